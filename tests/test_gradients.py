"""Gradients through the forward (issue 17): jax.grad of a sequence log-probability loss through
``model.prefill_logprobs_fn`` against torch autograd on the same Hugging Face checkpoint (every
parameter), against central finite differences, and with rematerialised chunks == without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import model
from jaxdecode.kernels import choice
from jaxdecode.params import params_to_hf

from conftest import FULL, LIN, hf_text_config, run_hf, tiny

CONFIG = tiny(vocab_size=256, layer_types=(LIN, FULL, LIN, FULL))
CASES = [([5, 17, 33, 2, 9, 40, 41], [7, 8, 100, 3, 3, 90]), ([100, 7], [4] * 70 + [9, 250])]


def _batch(cases):
    """seq [B, T], total [B], targets [B, T] (position t scores token t + 1 of the
    continuation), as jd.score's chunked mode builds them."""
    length = max(len(p) + len(c) for p, c in cases)
    seq = np.zeros((len(cases), length), np.int32)
    targets = np.full((len(cases), length), -1, np.int32)
    for i, (p, c) in enumerate(cases):
        s = p + c
        seq[i, :len(s)] = s
        targets[i, len(p) - 1:len(s) - 1] = c
    return seq, np.array([len(p) + len(c) for p, c in cases], np.int32), targets


@jax.jit
def _loss(params, seq, total, targets):
    state = jd.init_state(params.config, seq.shape[0], 128, params.dtype)
    lp, _ = model.prefill_logprobs_fn(params, state, seq, total, targets, kernels=choice.XLA)
    return lp.sum()


def _grad(params, cases, **kw):
    seq, total, targets = _batch(cases)

    def loss(p):
        state = jd.init_state(p.config, seq.shape[0], 128, p.dtype)
        lp, _ = model.prefill_logprobs_fn(p, state, seq, total, targets, kernels=choice.XLA, **kw)
        return lp.sum()
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
@pytest.mark.hf
def test_grad_of_sequence_logprob_matches_torch_autograd(hf_checkpoints, tmp_path):
    """Every parameter's gradient (HF layout, params_to_hf) within 1e-4 of the largest entry
    of torch's for that tensor, and the loss, float32."""
    ckpt = hf_checkpoints.make("grad_tiny", hf_text_config(CONFIG), seed=5)
    out = tmp_path / "grad.npz"
    run_hf([{"action": "grad", "dir": str(ckpt), "out": str(out),
             "cases": [{"prompt": p, "continuation": c} for p, c in CASES]}], tmp_path)
    params = jd.load_checkpoint(str(ckpt), dtype="float32")
    loss, grads = _grad(params, CASES, prefill_chunk_size=64, remat=True)
    with np.load(out) as ref:
        np.testing.assert_allclose(float(loss), float(ref["loss"]), rtol=1e-5)
        got = params_to_hf(grads)
        assert set(got) == set(ref.files) - {"loss"}, set(got) ^ (set(ref.files) - {"loss"})
        for name, g in got.items():
            want = ref[name]
            scale = np.abs(want).max()
            err = np.abs(np.asarray(g) - want).max()
            assert err <= 1e-4 * scale + 1e-7, f"{name}: max |Δ| {err:.3g}, max |grad| {scale:.3g}"


def test_grad_with_remat_and_chunks_equals_the_plain_grad():
    """prefill_chunk_size=64 with remat (a 79-token row: two chunks) == one chunk without."""
    params = jd.init_params(CONFIG, jax.random.key(3))
    loss, plain = _grad(params, CASES)
    loss2, remat = _grad(params, CASES, prefill_chunk_size=64, remat=True)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    scale = max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves(plain))
    for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * scale)


def test_grad_matches_central_finite_differences():
    """The gradient's directional derivative along three random unit directions d (over all
    parameters) == (L(p + eps d) - L(p - eps d)) / 2 eps (float32; eps 0.03, where the
    difference has converged: 0.1 and 0.01 agree with it to 1e-3)."""
    params = jd.init_params(CONFIG, jax.random.key(4))
    seq, total, targets = _batch(CASES)
    _, grads = _grad(params, CASES)
    leaves, treedef = jax.tree.flatten(params)
    gleaves = jax.tree.leaves(grads)
    for seed in range(3):
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        d = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
        norm = jnp.sqrt(sum(jnp.vdot(v, v) for v in d))
        d = [v / norm for v in d]
        eps = 0.03
        plus = treedef.unflatten([x + eps * v for x, v in zip(leaves, d)])
        minus = treedef.unflatten([x - eps * v for x, v in zip(leaves, d)])
        fd = (float(_loss(plus, seq, total, targets))
              - float(_loss(minus, seq, total, targets))) / (2 * eps)
        analytic = float(sum(jnp.vdot(g, v) for g, v in zip(gleaves, d)))
        assert abs(fd - analytic) <= 2e-3 * abs(analytic) + 1e-3, (seed, fd, analytic)


def test_new_weights_reuse_the_compiled_executables():
    """After an update of every weight (same shapes and dtypes), generate, score and the
    gradient run the executables compiled for the old weights: params are arguments, not
    constants; the new weights change the results."""
    from jaxdecode import generation as gen
    from jaxdecode import scoring
    params = jd.init_params(CONFIG, jax.random.key(6))
    prompts = [[3, 4, 5], [9]]
    old = gen.generate(params, prompts, 6, eos_token_ids=(), return_logprobs=True)
    old_score = jd.score(params, prompts, [[1, 2], [3]])
    _, grads = _grad(params, CASES)
    sizes = (gen._generate_jit._cache_size(), scoring._score_jit._cache_size())
    new = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)  # one SGD step
    out = gen.generate(new, prompts, 6, eos_token_ids=(), return_logprobs=True)
    new_score = jd.score(new, prompts, [[1, 2], [3]])
    assert (gen._generate_jit._cache_size(), scoring._score_jit._cache_size()) == sizes
    assert not np.array_equal(np.asarray(out.logprobs.raw), np.asarray(old.logprobs.raw))
    assert not np.array_equal(np.asarray(new_score.logprobs), np.asarray(old_score.logprobs))
