"""jaxdecode.scoring (jd.score): teacher-forced log-probabilities against the log-softmax of the
prefill's every-position logits, the recurrent mode bitwise equal to a rollout's raw log-probs
(float32), chunking, the returned state, validation."""

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import generation as gen
from jaxdecode.scoring import score_fn

from conftest import FULL, LIN, ROOT, tiny

VOCAB = 384
SMALL = tiny(vocab_size=VOCAB, layer_types=(LIN, FULL, LIN, FULL), max_position_embeddings=512,
             eos_token_id=(VOCAB - 1,))
PROMPTS = [[5, 17, 33, 2, 9], [100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def params():
    return jd.init_params(SMALL, jax.random.key(1))


def _reference(params, prompt, continuation):
    """log_softmax (float64) of one prefill's every-position logits at the continuation."""
    seq = np.array(prompt + continuation, np.int32)[None]
    state = jd.init_state(params.config, 1, 256)
    logits, _ = jd.prefill(params, state, seq, np.array([seq.shape[1]]), return_all_logits=True)
    x = np.asarray(logits, np.float64)[0, len(prompt) - 1:-1]
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return lp[np.arange(len(continuation)), continuation]


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_score_is_the_teacher_forced_log_softmax(params, mode):
    """Both modes == the log-softmax of the prefill's logits at each continuation token (ragged
    rows, a one-token continuation, 0 after each row's end), and sums() their totals."""
    rng = np.random.default_rng(0)
    conts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 9, 20)]
    out = jd.score(params, PROMPTS, conts, mode=mode)
    lp = np.asarray(out.logprobs)
    for r, (p, c) in enumerate(zip(PROMPTS, conts)):
        np.testing.assert_allclose(lp[r, :len(c)], _reference(params, p, c), atol=2e-5)
        assert (lp[r, len(c):] == 0).all()
    np.testing.assert_array_equal(np.asarray(out.num_tokens), [1, 9, 20])
    np.testing.assert_allclose(out.sums(), lp.sum(1), rtol=1e-6)
    assert out.state is None


def test_recurrent_score_reproduces_a_rollouts_raw_logprobs_bitwise(params):
    """Re-scoring sampled rollouts in "recurrent" mode gives generate's raw log-probs bit for
    bit (float32); "chunked" (the prefill's delta rule) differs by rounding only."""
    out = gen.generate(params, PROMPTS, [7, 9, 12], jd.SamplingParams.create(temperature=1.0),
                       key=jax.random.key(3), eos_token_ids=(), return_logprobs=True)
    conts = out.token_lists()
    raw = np.asarray(out.logprobs.raw)
    rec = np.asarray(jd.score(params, PROMPTS, conts, mode="recurrent").logprobs)
    chunked = np.asarray(jd.score(params, PROMPTS, conts, mode="chunked").logprobs)
    n = min(raw.shape[1], rec.shape[1])
    np.testing.assert_array_equal(rec[:, :n], raw[:, :n])
    np.testing.assert_allclose(chunked[:, :n], raw[:, :n], atol=1e-5)


def test_chunked_score_in_64_token_chunks_and_the_state(params):
    """prefill_chunk_size=64 over a 150-token sequence == one chunk; return_state holds prompt
    + continuation, and decoding on from it == decoding on from a prefill of both."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, 70).tolist(), [4]]
    conts = [rng.integers(0, VOCAB, 80).tolist(), rng.integers(0, VOCAB, 3).tolist()]
    whole = jd.score(params, prompts, conts, return_state=True)
    chunked = jd.score(params, prompts, conts, prefill_chunk_size=64, return_state=True)
    np.testing.assert_allclose(np.asarray(chunked.logprobs), np.asarray(whole.logprobs),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(whole.state.lengths), [150, 4])
    for mode in ("chunked", "recurrent"):
        state = jd.score(params, prompts, conts, mode=mode, return_state=True).state
        got, _ = jd.decode_step(params, state, np.array([7, 8], np.int32))
        ref = jd.init_state(params.config, 2, state.max_len)
        seqs = [p + c for p, c in zip(prompts, conts)]
        tok = np.zeros((2, 150), np.int32)
        for i, s in enumerate(seqs):
            tok[i, :len(s)] = s
        _, ref = jd.prefill(params, ref, tok, np.array([150, 4]))
        want, _ = jd.decode_step(params, ref, np.array([7, 8], np.int32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_long_prompt_short_continuation_in_chunks(params):
    """A 150-token prompt in 64-token chunks, then a 5-token continuation (shorter than a chunk:
    one unpadded chunk) == both in one chunk each, in both modes."""
    rng = np.random.default_rng(2)
    prompts, conts = [rng.integers(0, VOCAB, 150).tolist()], [rng.integers(0, VOCAB, 5).tolist()]
    for mode in ("chunked", "recurrent"):
        whole = np.asarray(jd.score(params, prompts, conts, mode=mode).logprobs)
        chunked = np.asarray(jd.score(params, prompts, conts, mode=mode,
                                      prefill_chunk_size=64).logprobs)
        np.testing.assert_allclose(chunked, whole, atol=1e-5)
    np.testing.assert_allclose(whole[0, :5], _reference(params, prompts[0], conts[0]), atol=2e-5)


@pytest.mark.parametrize("prompts, conts, kw, match", [
    ([[1, 2]], [[3], [4]], {}, "one continuation per prompt"),
    ([[1, 2]], [[]], {}, "empty"),
    ([[1, 2]], [[VOCAB]], {}, "outside"),
    ([[1, 2]], [[3]], dict(mode="exact"), "mode='exact' must be one of"),
    ([[1] * 40], [[3] * 30], dict(max_len=64), "exceed max_len=64"),
    ([[1, 2]], [[3]], dict(kernels=jd.Kernels(batch_invariant=True)), "batch_invariant"),
    ([[1, 2]], [[3]], dict(kernels="xla"), "kernels='xla' must be a jaxdecode.Kernels"),
])
def test_score_rejects_bad_requests_before_device_work(params, prompts, conts, kw, match):
    with pytest.raises(ValueError, match=match):
        jd.score(params, prompts, conts, **kw)


def test_score_fn_gradient_remat_and_finite_differences(params):
    """jax.grad through scoring.score_fn (the pure score, chunked, XLA kernels): with remat ==
    without, over a 100-token prompt in 64-token chunks, and the directional derivative along a
    random direction == a central finite difference (float32, eps 3e-4)."""
    rng = np.random.default_rng(3)
    prompts = np.zeros((2, 128), np.int32)
    prompts[0, :100], prompts[1, :7] = rng.integers(0, VOCAB, 100), rng.integers(0, VOCAB, 7)
    conts = rng.integers(0, VOCAB, (2, 16)).astype(np.int32)
    p_len, n_tok = np.array([100, 7], np.int32), np.array([16, 5], np.int32)
    weights = rng.standard_normal((2, 16)).astype(np.float32)

    def loss(p, remat):
        out = score_fn(p, prompts, p_len, conts, n_tok, max_len=192, kernels=jd.Kernels(),
                       prefill_chunk_size=64, remat=remat)
        return (out.logprobs * weights).sum()

    g_plain = jax.jit(jax.grad(lambda p: loss(p, False)))(params)
    g_remat = jax.jit(jax.grad(lambda p: loss(p, True)))(params)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(params))))
    direction = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), params)
    along = sum(float((a * d).sum()) for a, d in zip(jax.tree.leaves(g_plain),
                                                     jax.tree.leaves(direction)))
    f = jax.jit(lambda p: loss(p, False))
    eps = 3e-4  # the curvature term is 3% at 1e-3; float32 rounding 0.1% here
    shift = lambda s: jax.tree.map(lambda x, d: x + s * d, params, direction)  # noqa: E731
    numeric = (float(f(shift(eps))) - float(f(shift(-eps)))) / (2 * eps)
    np.testing.assert_allclose(along, numeric, rtol=2e-2)


def test_score_inside_jit_and_grad_runs_score_fn(params):
    """jd.score with traced params (the caller's jax.jit / jax.grad; lists stay on the host)
    runs score_fn as a nested jit: the eager values, and the gradient score_fn gives on the same
    padded arrays, also with only some leaves traced (the final norm's gradient, the rest
    closed over); jd.generate there is a ValueError naming what to use instead, for a traced
    key as for traced params."""
    conts = [[7, 8, 9], [1], [300, 301, 2, 3]]
    eager = np.asarray(jd.score(params, PROMPTS, conts).logprobs)
    traced = jax.jit(lambda p: jd.score(p, PROMPTS, conts, kernels=jd.Kernels()).logprobs)
    np.testing.assert_allclose(np.asarray(traced(params)), eager, atol=1e-5)

    def loss(norm, fn):
        return fn(params.replace(norm=norm)).logprobs.sum()

    got = jax.grad(loss)(params.norm, lambda p: jd.score(p, PROMPTS, conts,
                                                          kernels=jd.Kernels()))
    prompts, cont = np.zeros((3, 16), np.int32), np.zeros((3, 16), np.int32)
    for r, (p, c) in enumerate(zip(PROMPTS, conts)):
        prompts[r, :len(p)], cont[r, :len(c)] = p, c
    want = jax.grad(loss)(params.norm, lambda p: score_fn(
        p, prompts, np.array([5, 2, 11], np.int32), cont, np.array([3, 1, 4], np.int32),
        max_len=64, kernels=jd.Kernels()))
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"jd.generate.*runs from the host.*generate_fn"):
        jax.jit(lambda p: gen.generate(p, PROMPTS, 4).tokens)(params)
    with pytest.raises(ValueError, match=r"jd.generate.*runs from the host"):
        jax.jit(lambda k: gen.generate(params, PROMPTS, 4, key=k).tokens)(jax.random.key(0))


@pytest.mark.slow
def test_grpo_example_raises_the_reward():
    """examples/grpo.py: generate (G samples per prompt, raw log-probs), group-normalised
    advantages, a clipped policy-gradient step through score_fn with optax; the mean reward
    of the last 3 of the example's 20 steps is well above the first 3's, and the trainer's
    log-probs match the rollout's (the ratio is 1 up to float32 rounding). All 20 steps: over
    fewer, the rise depends on the CPU's float rounding of the sampled trajectory."""
    import importlib.util
    path = ROOT / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    history = mod.main(["--steps", "20"])
    assert len(history) == 20 and all(0 <= r <= 1 for r in history)
    assert np.mean(history[-3:]) > np.mean(history[:3]) + 0.15, history
