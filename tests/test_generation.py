"""jaxdecode.generation (jd.generate, jd.generate_stream): HF parity (greedy), stopping, frozen
finished rows, fork, compile reuse, streaming == on-device, validation."""

import dataclasses
import json
import subprocess
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import generation as gen
from jaxdecode import sampling as sampling_lib
from jaxdecode.kernels import choice
from jaxdecode.sampling import SamplingParams
from jaxdecode.stopping import STOP_REASONS

from conftest import FULL, GPU_ONLY, HERE, LIN, hf_python, hf_text_config, host_stop, tiny

VOCAB = 384
# A small random model: vocab 384 keeps compiles and steps fast; GQA, r = 2, two attention layers.
SMALL = tiny(vocab_size=VOCAB, layer_types=(LIN, FULL, LIN, FULL), max_position_embeddings=512,
             eos_token_id=(VOCAB - 1,), rope_theta=10_000_000.0)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(SMALL, jax.random.key(1))


PROMPTS = [[5, 17, 33, 2, 9], [100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def _greedy(params, prompts=PROMPTS, budget=16, eos=(), **kw):
    return gen.generate(params, prompts, budget, eos_token_ids=eos, **kw)


# ----- Hugging Face parity ------------------------------------------------------------------------

def _hf_generate(ckpt: Path, cases: list[dict], workdir: Path) -> list[list[int]]:
    req, out = workdir / "gen_request.json", workdir / "gen_out.json"
    req.write_text(json.dumps({"dir": str(ckpt), "out": str(out), "cases": cases}))
    proc = subprocess.run([hf_python(), str(HERE / "hf_generate_reference.py"), str(req)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.hf
def test_greedy_generate_matches_hf_token_for_token(hf_checkpoints, tmp_path):
    """A ragged batch in one call == HF greedy generate on each prompt alone (float32)."""
    ckpt = hf_checkpoints.make("generate_tiny", hf_text_config(), seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (7, 1, 20)]
    budget = 24
    ref = _hf_generate(ckpt, [{"prompt": p, "max_new_tokens": budget, "eos_token_id": []}
                              for p in prompts], tmp_path)
    params = jd.load_checkpoint(str(ckpt), dtype="float32")
    out = gen.generate(params, prompts, budget, eos_token_ids=())
    assert out.token_lists() == ref
    assert out.stop_reasons() == ["length"] * 3

    # Per-row EOS with two ids: greedy with EOS is the EOS-free sequence cut after the first
    # EOS id (HF semantics), so the reference above decides where each row must stop.
    eos = (ref[0][5], ref[2][9])
    want = []
    for r in ref:
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        want.append(r[:cut])
    out = gen.generate(params, prompts, budget, eos_token_ids=eos)
    assert out.token_lists() == want
    assert out.stop_reasons() == ["eos" if w[-1] in eos else "length" for w in want]
    tokens = np.asarray(out.tokens)
    for row, w in zip(tokens, want):
        assert (row[len(w):] == -1).all()


@pytest.mark.slow
@pytest.mark.hf
def test_repetition_penalty_matches_hf_generate_in_both_scopes(hf_checkpoints, tmp_path):
    """Greedy with repetition_penalty=1.4: penalize_prompt (the default) == HF generate's own
    penalty (prompt and generated ids); False == HF's processor with prompt_ignore_length
    (generated ids only); one call may mix the two per row, and forked rows keep their prompt."""
    ckpt = hf_checkpoints.make("generate_tiny", hf_text_config(), seed=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 40, size=n).tolist() for n in (6, 11, 3, 17, 9)]
    budget, penalty = 20, 1.4
    cases = [{"prompt": p, "max_new_tokens": budget, "eos_token_id": [],
              "repetition_penalty": penalty, "penalize_prompt": flag}
             for flag in (True, False) for p in prompts]
    ref = _hf_generate(ckpt, cases, tmp_path)
    with_prompt, output_only = ref[:5], ref[5:]
    assert with_prompt != output_only  # the scopes lead to different tokens here
    params = jd.load_checkpoint(str(ckpt), dtype="float32")
    for flag, want in ((True, with_prompt), (False, output_only)):
        sp = SamplingParams.create(repetition_penalty=penalty, penalize_prompt=flag)
        assert gen.generate(params, prompts, budget, sp, eos_token_ids=()).token_lists() == want
    flags = [True, False, True, False, False]
    mixed = SamplingParams.create(5, repetition_penalty=penalty, penalize_prompt=flags)
    got = gen.generate(params, prompts, budget, mixed, eos_token_ids=(), num_samples=2)
    assert got.token_lists() == [(with_prompt if f else output_only)[i]
                                 for i, f in enumerate(flags) for _ in range(2)]


# ----- stopping and finished rows -------------------------------------------------------------------

def test_per_row_eos_stopping_with_two_eos_ids(params):
    free = _greedy(params).token_lists()
    eos = (free[0][3], free[1][6])
    out = _greedy(params, eos=eos, pad_id=-7)
    for got, full, reason, row in zip(out.token_lists(), free, out.stop_reasons(),
                                      np.asarray(out.tokens)):
        cut = next((i + 1 for i, t in enumerate(full) if t in eos), len(full))
        assert got == full[:cut]
        assert reason == ("eos" if cut < len(full) or full[-1] in eos else "length")
        assert (row[cut:] == -7).all()
    assert out.stop_reasons()[:2] == ["eos", "eos"]


def test_per_row_budgets(params):
    out = _greedy(params, budget=[3, 16, 1])
    np.testing.assert_array_equal(np.asarray(out.num_generated), [3, 16, 1])
    free = _greedy(params).token_lists()
    assert out.token_lists() == [free[0][:3], free[1], free[2][:1]]


def test_finished_row_state_stops_changing(params):
    """Once a row stops, decode steps leave its state (caches, lengths) bit-identical."""
    plan = gen._plan(params, PROMPTS, [2, 16, 16], None, None, (), max_len=None,
                     num_samples=1, chunk_size=4, pad_id=-1, kernels=None)
    args, static = gen._start_args(params, plan)
    loop, _ = gen._start_jit(*args, **static)

    def step(loop):  # the jitted one-token chunk generate_stream uses (loop is donated)
        args, static = gen._chunk_args(params, plan, loop)
        return gen._chunk_jit(*args, **{**static, "chunk_size": 1})

    loop, _ = step(loop)
    assert np.asarray(loop.done).tolist() == [True, False, False]
    frozen = jax.tree.map(lambda x: np.asarray(x[0]), loop.state)
    others = jax.tree.map(lambda x: np.asarray(x[1:]), loop.state)
    for _ in range(5):
        loop, emitted = step(loop)
        assert np.asarray(emitted)[0, 0] == -1
    after = jax.tree.map(lambda x: np.asarray(x[0]), loop.state)
    jax.tree.map(np.testing.assert_array_equal, after, frozen)
    assert int(after.lengths) == len(PROMPTS[0]) + 1  # prompt + first token fed; nothing since
    changed = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a[1:]), b), loop.state,
                           others)
    assert all(jax.tree.leaves(changed))  # the running rows did move


def test_generate_prefills_long_prompts_in_chunks_with_the_same_tokens(params):
    """prefill_chunk_size (or a budget that forces chunks): the prompts' prefill runs as a scan
    of continuations inside the one jitted call; the same tokens and final state as one call."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (150, 3, 90)]
    want = gen.generate(params, prompts, 8, eos_token_ids=(), return_state=True)
    whole = gen._plan(params, prompts, 8, None, None, (), max_len=None, num_samples=1,
                      chunk_size=8, pad_id=-1, kernels=None).prefill
    assert whole.prefill_chunk_size is None
    budget = whole.bytes // 2
    for kw in (dict(prefill_chunk_size=64), dict(activation_budget=budget)):
        got = gen.generate(params, prompts, 8, eos_token_ids=(), return_state=True, **kw)
        assert got.token_lists() == want.token_lists(), kw
        np.testing.assert_array_equal(np.asarray(got.state.lengths),
                                      np.asarray(want.state.lengths))
    plan = gen._plan(params, prompts, 8, None, None, (), max_len=None, num_samples=1,
                     chunk_size=8, pad_id=-1, kernels=None, activation_budget=budget)
    assert plan.prefill.prefill_chunk_size in (64, 128)  # the budget did force chunks


def test_batch_invariant_generate_gives_each_prompt_its_tokens_alone(params):
    """choose_kernels(..., batch_invariant=True) through jd.generate (greedy, one max_len): each
    prompt's tokens in a ragged batch == alone == the default mode's (float32)."""
    inv = jd.choose_kernels(SMALL, 1, dtype="float32", batch_invariant=True)
    batch = gen.generate(params, PROMPTS, 12, eos_token_ids=(), kernels=inv, max_len=128)
    for i, prompt in enumerate(PROMPTS):
        alone = gen.generate(params, [prompt], 12, eos_token_ids=(), kernels=inv, max_len=128)
        assert alone.token_lists()[0] == batch.token_lists()[i]
    assert batch.token_lists() == _greedy(params, budget=12).token_lists()


# ----- log-probabilities (issue 17) ----------------------------------------------------------

def _teacher_forced(params, prompt, generated):
    """[n, V] float32 logits predicting each generated token, from one prefill of the prompt
    and all generated tokens but the last (every position's logits)."""
    seq = np.array(prompt + generated[:-1], np.int32)[None]
    state = jd.init_state(params.config, 1, 64)
    logits, _ = jd.prefill(params, state, seq, np.array([seq.shape[1]]), return_all_logits=True)
    return np.asarray(logits)[0, len(prompt) - 1:]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_generate_logprobs_are_those_of_the_distributions_drawn_from(params):
    """Per generated token: raw == log_softmax of the teacher-forced logits at that token;
    processed == log_softmax of sampling.processed_logits of the same logits with the row's
    penalties (the prompt's and the earlier generated tokens), temperature, top-k and top-p;
    top ids/logprobs == the raw distribution's largest, descending; 0 and pad_id after a row's
    last token; the tokens the same as without log-probs (float32)."""
    sampling = SamplingParams.create(3, temperature=[0.0, 0.8, 1.3], top_k=[0, 20, 0],
                                     top_p=[1.0, 0.9, 0.7], repetition_penalty=[1.0, 1.3, 1.2],
                                     penalize_prompt=[True, True, False])
    budgets = [7, 9, 12]
    key = jax.random.key(4)
    out = gen.generate(params, PROMPTS, budgets, sampling, key=key, eos_token_ids=(),
                       return_logprobs=True, top_logprobs=4)
    plain = gen.generate(params, PROMPTS, budgets, sampling, key=key, eos_token_ids=())
    assert plain.logprobs is None
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    lp = jax.tree.map(np.asarray, out.logprobs)
    for r, (prompt, generated) in enumerate(zip(PROMPTS, out.token_lists())):
        n = len(generated)
        logits = _teacher_forced(params, prompt, generated)
        raw = _log_softmax(logits)
        np.testing.assert_allclose(lp.raw[r, :n], raw[np.arange(n), generated], atol=2e-5)
        order = np.argsort(-raw, axis=-1, kind="stable")[:, :4]
        np.testing.assert_array_equal(lp.top_ids[r, :n], order)
        np.testing.assert_allclose(lp.top_logprobs[r, :n],
                                   np.take_along_axis(raw, order, -1), atol=2e-5)
        row = jax.tree.map(lambda x: x[r:r + 1], sampling)
        prompt_mask = sampling_lib.prompt_mask_of(np.array([prompt]), np.array([len(prompt)]),
                                                  VOCAB)
        for i in range(n):
            counts = np.bincount(generated[:i], minlength=VOCAB)[None].astype(np.int32)
            x = sampling_lib.processed_logits(logits[i:i + 1], row, counts,
                                              prompt_mask=prompt_mask)
            want = _log_softmax(np.asarray(x))[0, generated[i]]
            np.testing.assert_allclose(lp.processed[r, i], want, atol=2e-5, err_msg=f"{r=} {i=}")
        assert (lp.raw[r, n:] == 0).all() and (lp.processed[r, n:] == 0).all()
        assert (lp.top_ids[r, n:] == -1).all() and (lp.top_logprobs[r, n:] == 0).all()
    assert lp.processed[0, :budgets[0]].max() <= 0 and (lp.processed[1:] != lp.raw[1:]).any()


def test_stream_logprobs_equal_generates(params):
    """generate_stream's chunks carry the same log-probabilities as generate (per chunk, with
    an EOS stopping a row early), top_logprobs=0 gives empty top arrays."""
    sampling = SamplingParams.create(temperature=0.9)
    ref = gen.generate(params, PROMPTS, 10, sampling, eos_token_ids=(VOCAB - 1, 7),
                       return_logprobs=True)
    chunks = list(gen.generate_stream(params, PROMPTS, 10, sampling, chunk_size=3,
                                      eos_token_ids=(VOCAB - 1, 7), return_logprobs=True))
    for field in ("processed", "raw", "top_ids", "top_logprobs"):
        got = np.concatenate([getattr(c.logprobs, field) for c in chunks], axis=1)
        want = np.asarray(getattr(ref.logprobs, field))[:, :got.shape[1]]
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=field)
    assert ref.logprobs.top_ids.shape == (3, 16, 0)


@pytest.mark.parametrize("kw, match", [
    (dict(top_logprobs=2), "needs return_logprobs=True"),
    (dict(return_logprobs=True, top_logprobs=-1), "top_logprobs=-1 must be an int"),
    (dict(return_logprobs=True, top_logprobs=VOCAB + 1), "must be an int in"),
    (dict(return_logprobs=1), "must be a bool")])
def test_logprobs_arguments_are_checked(params, kw, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(params, PROMPTS, 4, **kw)


# ----- fork / num_samples -----------------------------------------------------------------------------

@pytest.mark.slow
def test_fork_gives_identical_greedy_continuations(params):
    one = _greedy(params).token_lists()
    out = _greedy(params, num_samples=3)
    rows = out.token_lists()
    assert len(rows) == 9
    for p in range(3):
        assert rows[3 * p:3 * p + 3] == [one[p]] * 3


@pytest.mark.slow
def test_num_samples_with_sampling_gives_different_rows(params):
    sp = SamplingParams.create(temperature=1.0)
    rows = _greedy(params, num_samples=3, sampling=sp, key=jax.random.key(7)).token_lists()
    for p in range(3):
        assert len({tuple(r) for r in rows[3 * p:3 * p + 3]}) > 1
    # per-prompt leaves ([3]) or per-row ones ([9]); another length, or both kinds, is named
    for bad in (SamplingParams.create(temperature=[1.0, 0.5]),
                SamplingParams(**{**vars(SamplingParams.create(3, temperature=1.0)),
                                  "top_p": np.full(9, 0.9, np.float32)})):
        with pytest.raises(ValueError,
                           match=r"scalars or \[3\] \(one value per prompt\) or \[9\]"):
            _greedy(params, num_samples=3, sampling=bad)


# ----- compilation reuse ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.perf
def test_no_recompilation_within_a_bucket_and_across_sampling_values(params):
    """Prompts, budgets, EOS ids, keys and sampling values are traced: changing them within one
    bucket reuses the executable. Turning a sampling step on or off (greedy -> top-p) compiles
    one more executable per set of steps used (``SamplingFeatures``), reused after that."""
    def run(prompts, budget, sampling=None, key=None, eos=(7,)):
        jax.block_until_ready(gen.generate(params, prompts, budget, sampling, key, eos))
        return gen._generate_jit._cache_size()

    size = run(PROMPTS, 10)
    # greedy, prompts of 1..16 tokens, budgets of 2..16 tokens: one bucket
    assert run([[9] * 13, [1], [2] * 16], [10, 2, 16]) == size
    assert run([[1, 2], [3], [4, 5, 6]], 16, key=jax.random.key(3), eos=(7, 8)) == size
    top_p = run([[1, 2], [3], [4, 5, 6]], 16, SamplingParams.create(temperature=0.8, top_p=0.9))
    assert top_p == size + 1  # temperature and top-p now in the program
    assert run([[4] * 7, [5] * 8, [6] * 9], 9,
               SamplingParams.create(3, temperature=[1.5, 0.0, 1.0], top_p=[0.5, 1.0, 0.99]),
               key=jax.random.key(4), eos=()) == top_p  # other values, same steps
    mixed = SamplingParams.create(3, temperature=[1.5, 0.0, 1.0], top_k=[5, 0, 2], min_p=0.1)
    assert run([[4] * 7, [5] * 8, [6] * 9], 9, mixed) == top_p + 1
    assert run(PROMPTS, 10) == top_p + 1  # greedy again: its executable is reused


@pytest.mark.perf
@pytest.mark.parametrize("sampling", [None, SamplingParams.create(temperature=0.8, top_p=0.9),
                                      SamplingParams.create(temperature=1.0, top_k=4,
                                                            repetition_penalty=1.2)])
def test_loop_has_one_conditional_per_chunk_only(params, sampling):
    """The decode loop carries no lax.cond per token (on a GPU each one waits for the device):
    the only conditional in generate's program is the per-chunk skip of finished batches."""
    plan = gen._plan(params, PROMPTS, 16, sampling, None, (), max_len=None, num_samples=1,
                     chunk_size=4, pad_id=-1, kernels=None)
    args, static = gen._generate_args(params, plan, None)
    text = gen._generate_jit.lower(*args, **static).as_text()
    assert text.count("stablehlo.case") == 1


@pytest.mark.slow
@pytest.mark.perf
def test_all_features_gives_one_executable_and_the_same_tokens(params):
    """features=ALL_FEATURES compiles every step in (no per-token lax.cond either): one executable
    for greedy, sampled and penalised settings, with the tokens of the default (per-set) path."""
    settings = [None, SamplingParams.create(temperature=0.9, top_k=5, top_p=0.8),
                SamplingParams.create(3, temperature=[0.0, 1.2, 0.7], min_p=0.05,
                                      frequency_penalty=0.5)]
    before = gen._generate_jit._cache_size()
    got = [gen.generate(params, PROMPTS, 12, sp, jax.random.key(5), (),
                        features=sampling_lib.ALL_FEATURES).token_lists() for sp in settings]
    assert gen._generate_jit._cache_size() == before + 1
    for sp, tokens in zip(settings, got):
        want = gen.generate(params, PROMPTS, 12, sp, jax.random.key(5), ())
        assert tokens == want.token_lists()
        stream = [c.tokens for c in gen.generate_stream(
            params, PROMPTS, 12, sp, jax.random.key(5), (), chunk_size=4,
            features=sampling_lib.ALL_FEATURES)]
        streamed = np.concatenate(stream, axis=1)
        n = min(streamed.shape[1], want.tokens.shape[1])
        assert streamed[:, :n].tolist() == np.asarray(want.tokens)[:, :n].tolist()


@pytest.mark.parametrize("features,message", [
    (sampling_lib.SamplingFeatures(penalties=False, sampled=True, top_k=False, top_p=True,
                                   min_p=False), r"leaves out \['top_k'\]"),
    ("all", "must be a jaxdecode.sampling.SamplingFeatures"),
])
def test_features_that_leave_out_a_used_step_raise(params, features, message):
    sp = SamplingParams.create(temperature=0.9, top_k=5, top_p=0.8)
    with pytest.raises(ValueError, match=message):
        gen.generate(params, PROMPTS, 4, sp, features=features)


@pytest.mark.slow
def test_start_fn_tracks_counts_when_features_have_penalties(params):
    sp = SamplingParams.create(3, presence_penalty=0.5)
    state = jd.init_state(params.config, 3, 64)
    prompts = np.array([p + [0] * (11 - len(p)) for p in PROMPTS], np.int32)
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    args = (params, state, prompts, lengths, np.full(3, 4, np.int32), sp,
            jax.random.split(jax.random.key(0), 3), np.full(8, -1, np.int32))
    loop, _ = gen.start_fn(*args, features=sampling_lib.features_of(sp))
    assert loop.token_counts is not None and int(loop.token_counts.sum()) == 3
    assert gen.start_fn(*args)[0].token_counts is None  # no features: as before, opt-in


# ----- streaming == on-device ---------------------------------------------------------------------

@pytest.fixture(params=[False, True], ids=["read_then_dispatch", "dispatch_ahead"])
def dispatch_ahead(request, monkeypatch):
    """Both stream loops on the CPU, whose backend reads first (a GPU dispatches ahead)."""
    monkeypatch.setattr(gen, "_dispatch_ahead", lambda loop: request.param)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 3])
def test_stream_matches_on_device_loop(params, chunk_size, dispatch_ahead):
    kw = dict(sampling=SamplingParams.create(temperature=[1.0, 0.7, 1.2], top_k=[0, 40, 0],
                                             top_p=[1.0, 1.0, 0.9]),
              key=jax.random.key(11), eos_token_ids=(5, 6))
    out = gen.generate(params, PROMPTS, 16, **kw)
    chunks = list(gen.generate_stream(params, PROMPTS, 16, chunk_size=chunk_size, **kw))
    assert chunks[0].tokens.shape == (3, 1)  # the first token arrives alone (time to first token)
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)
    streamed = [row[row != -1].tolist() for row in streamed]
    assert streamed == out.token_lists()
    np.testing.assert_array_equal(chunks[-1].stop_reason, np.asarray(out.stop_reason))
    np.testing.assert_array_equal(chunks[-1].num_generated, np.asarray(out.num_generated))


@pytest.mark.slow
def test_presence_penalty_prevents_repeats(params):
    plain = _greedy(params, budget=16).token_lists()
    assert any(len(set(r)) < len(r) for r in plain)  # random greedy text repeats itself
    sp = SamplingParams.create(presence_penalty=1e4)
    for r in _greedy(params, budget=16, sampling=sp).token_lists():
        assert len(set(r)) == len(r)


@pytest.mark.slow
def test_progress_callback_sees_the_counts(params):
    seen = []
    out = gen.generate(params, PROMPTS, 16, eos_token_ids=(),
                       progress=lambda n: seen.append(int(np.sum(n))))
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert seen and seen[-1] == 3 * 16 and seen == sorted(seen)


# ----- validation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), r"prompt\(s\) \[1\] are empty"),
    (dict(prompts=[[1, VOCAB]]), "outside"),
    (dict(prompts=[[1, -1]]), "outside"),
    (dict(prompts=[1, 2, 3]), "flat list"),
    (dict(prompts="hello"), "token ids"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=[4, 5]), "one value per prompt"),
    (dict(max_new_tokens=510), "max_position_embeddings=512"),
    (dict(max_new_tokens=8, max_len=10), "exceeds max_len=10"),
    (dict(max_len=1024), "exceeds the model's max_position_embeddings"),
    (dict(max_new_tokens=2**32 + 2), "max_new_tokens=4294967298 exceeds"),  # not wrapped
    (dict(eos_token_ids=(VOCAB,)), "eos_token_ids"),
    (dict(eos_token_ids=[226.9]), "must be an int or a flat sequence of ints"),
    (dict(eos_token_ids="226"), "must be an int or a flat sequence of ints"),
    (dict(eos_token_ids=True), "must be an int or a flat sequence of ints"),
    (dict(eos_token_ids=[2**64]), "must be an int or a flat sequence of ints"),
    (dict(eos_token_ids=[[7, 8]]), r"flat sequence of ints \(a stop of several tokens: "
                                   "stop_sequences"),  # not two EOS ids 7 and 8
    (dict(eos_token_ids=[[7, 8], [9]]), "must be an int or a flat sequence of ints"),
    (dict(num_samples=0), "num_samples"),
    (dict(sampling={"temperature": 1.0}), "sampling must be"),
])
def test_invalid_inputs_raise_before_device_work(params, kwargs, message):
    call = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        gen.generate(params, call.pop("prompts"), call.pop("max_new_tokens"), **call)


def test_a_config_eos_token_id_outside_the_vocabulary_is_named_as_the_configs(params):
    """eos_token_ids=None takes config.eos_token_id, which the error says (a smaller vocabulary
    than the config's EOS ids, e.g. a replaced vocab_size)."""
    other = params.replace(config=dataclasses.replace(params.config, eos_token_id=(VOCAB + 5,)))
    with pytest.raises(ValueError, match=rf"eos_token_ids \[{VOCAB + 5}\] are outside .* "
                                         r"\(eos_token_ids=None: the config's eos_token_id"):
        gen.generate(other, [[1, 2]], 4)
    gen.generate(other, [[1, 2]], 1, eos_token_ids=())  # none: runs


@pytest.mark.slow
def test_kernels_are_checked_and_chosen(params):
    """kernels= must be a Kernels value (checked before any device work, in the stream on the
    first next()); None is choose_kernels' choice for the output rows."""
    for bad in ("pallas", {"attention": "pallas"}):
        with pytest.raises(ValueError, match=r"must be a jaxdecode.Kernels"):
            gen.generate(params, [[1, 2]], 4, kernels=bad)
        with pytest.raises(ValueError, match=r"must be a jaxdecode.Kernels"):
            next(gen.generate_stream(params, [[1, 2]], 4, kernels=bad))
    plan = gen._plan(params, PROMPTS, 4, None, None, (), max_len=None, num_samples=3,
                     chunk_size=4, pad_id=-1, kernels=None)
    assert plan.kernels == jd.choose_kernels(SMALL, 9, dtype=params.dtype)
    mine = choice.Kernels(interpret=True)
    assert gen._plan(params, PROMPTS, 4, None, None, (), max_len=None, num_samples=1,
                     chunk_size=4, pad_id=-1, kernels=mine).kernels is mine
    explicit = gen.generate(params, PROMPTS, 6, eos_token_ids=(), kernels=choice.XLA)
    assert explicit.token_lists() == _greedy(params, budget=6).token_lists()


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.01),
                                 dict(top_k=-2)])
def test_invalid_sampling_values_raise(params, bad):
    raw = SamplingParams(**{f: np.asarray(v) for f, v in dict(
        temperature=np.float32(0), top_k=np.int32(0), top_p=np.float32(1), min_p=np.float32(0),
        repetition_penalty=np.float32(1), presence_penalty=np.float32(0),
        frequency_penalty=np.float32(0)).items()})
    raw = raw.replace(**{k: np.asarray(v) for k, v in bad.items()})
    with pytest.raises(ValueError, match=next(iter(bad))):
        gen.generate(params, [[1, 2]], 4, raw)


@pytest.mark.slow
@pytest.mark.perf
def test_precompiled_executables_are_used_and_give_the_same_tokens(params):
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(max_new_tokens=6, key=jax.random.key(3), eos_token_ids=(),
              sampling=SamplingParams.create(temperature=0.8, top_k=20))
    executables = jd.precompile(params, prompts, **kw)
    before = gen._generate_jit._cache_size()
    out = gen.generate(params, prompts, executables=executables, **kw)
    assert gen._generate_jit._cache_size() == before  # ran the precompiled executable, no jit
    want = gen.generate(params, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
    stream_ex = gen.precompile(params, prompts, stream=True, **kw)
    streamed = np.concatenate([c.tokens for c in gen.generate_stream(
        params, prompts, executables=stream_ex, **kw)], axis=1)
    np.testing.assert_array_equal(streamed[:, :6], np.asarray(want.tokens)[:, :6])


@pytest.mark.slow
def test_single_prompt_matches_its_row_in_a_batch(params):
    """One prompt: its tokens equal the same row's in a batch, sampled per row, streamed or not,
    precompiled or not, and ``progress`` sees one row."""
    sampling = jd.SamplingParams.create(temperature=[0.8, 0.5, 1.0], top_k=[0, 5, 0])
    key = jax.random.key(7)
    batch = gen.generate(params, PROMPTS, 12, sampling, key, eos_token_ids=())
    one = jd.SamplingParams.create(temperature=[0.8], top_k=[0])
    seen = []
    single = gen.generate(params, PROMPTS[:1], 12, one, key, eos_token_ids=(), chunk_size=4,
                          progress=seen.append)
    assert single.token_lists() == batch.token_lists()[:1]
    assert np.asarray(single.tokens).shape[0] == 1 and single.stop_reasons() == ["length"]
    jax.effects_barrier()
    assert [np.asarray(n).tolist() for n in seen] == [[5], [9], [12], [12]]
    chunks = list(gen.generate_stream(params, PROMPTS[:1], 12, one, key, eos_token_ids=(),
                                      chunk_size=4))
    assert all(c.tokens.shape[0] == 1 for c in chunks)
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)[0]
    assert streamed[:12].tolist() == single.token_lists()[0]
    executables = gen.precompile(params, PROMPTS[:1], 12, one, key, eos_token_ids=(),
                                 stream=True, chunk_size=4)
    again = list(gen.generate_stream(params, PROMPTS[:1], 12, one, key, eos_token_ids=(),
                                     chunk_size=4, executables=executables))
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in again], axis=1)[0], streamed)
    penalised = jd.SamplingParams.create(temperature=0.7, repetition_penalty=1.3)
    with_counts = gen.generate(params, PROMPTS[:1], 12, penalised, key, eos_token_ids=())
    assert with_counts.token_lists() == gen.generate(
        params, PROMPTS[:2], 12, penalised, key, eos_token_ids=()).token_lists()[:1]


# ----- GPU only ---------------------------------------------------------------------------------

@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_compiles_generate(_, params, rows):
    """On a GPU, the whole loop compiles at one row (XLA GPU, jax 0.11.2, failed to compile the
    decode step at batch 1 with a traced active mask written as int(active) > 0: see
    test_step.py) and at three, and streaming gives the same tokens."""
    prompts = np.random.default_rng(10 + rows).integers(0, VOCAB, (rows, 4)).tolist()
    out = jd.generate(params, prompts, 12, eos_token_ids=(), chunk_size=4)
    assert np.asarray(out.tokens).shape[0] == rows
    assert (np.asarray(out.num_generated) == 12).all()
    streamed = np.concatenate([c.tokens for c in jd.generate_stream(
        params, prompts, 12, eos_token_ids=(), chunk_size=4)], axis=1)
    np.testing.assert_array_equal(streamed[:, :12], np.asarray(out.tokens)[:, :12])


# ----- key errors (issue 22)

@pytest.fixture(scope="module")
def gen_params():
    return jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(0), "float32")


@pytest.mark.parametrize("key", [0, np.zeros((2, 3), np.uint32), np.zeros((5,), np.float32)])
def test_generate_names_a_bad_key(gen_params, key):
    with pytest.raises(ValueError, match="key must be a PRNG key"):
        jd.generate(gen_params, [[1, 2]], 2, key=key)


# ----- continuing from a DecodeState (multi-turn) and stop sequences (issue 22) -----------

def _probe_logits(params, state):
    """Next-token logits after appending token 7 to every row (prefill of one token)."""
    rows = state.batch_size
    logits, _ = jd.prefill(params, state, np.full((rows, 1), 7, np.int32), np.ones(rows, np.int32))
    return np.asarray(logits)


def _close(a, b, rtol=5e-6):
    """Logits equal up to float32 rounding of the chunked vs recurrent forms."""
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * np.abs(b).max())


# ----- continuing from a state --------------------------------------------------------------------

@pytest.mark.slow
def test_two_turn_chat_from_the_returned_state_equals_one_long_prefill(params):
    """Turn 1 with return_state, turn 2 from that state with new tokens only == one generate
    over [turn 1 prompt + turn 1 output + turn 2 prompt]: same tokens, same lengths, same next
    logits, and the same logits as a plain prefill of the whole conversation (ragged, 2 rows,
    one row stopped by EOS: its EOS is in the state)."""
    turn1 = [[5, 17, 33, 2, 9], [100, 7]]
    free = gen.generate(params, turn1, [6, 9], eos_token_ids=()).token_lists()
    k = next(k for k in range(2, 6) if free[0][k] not in free[0][:k] + free[1])
    eos = (free[0][k],)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Some donated buffers were not usable")
        out1 = gen.generate(params, turn1, [6, 9], eos_token_ids=eos, return_state=True,
                            max_len=128)
        t1 = out1.token_lists()
        assert t1 == [free[0][:k + 1], free[1]] and out1.stop_reasons() == ["eos", "length"]
        state1 = out1.state
        np.testing.assert_array_equal(np.asarray(state1.lengths), [5 + k + 1, 2 + 9])
        turn2 = [[40, 41, 42], [50, 51, 52, 53, 54]]
        out2 = gen.generate(params, turn2, 10, eos_token_ids=(), state=state1)
    assert state1.lengths.is_deleted()  # donated: using it again is a clear error
    with pytest.raises(ValueError, match="was donated"):
        gen.generate(params, turn2, 4, state=state1)
    whole = [a + b + c for a, b, c in zip(turn1, t1, turn2)]
    ref = gen.generate(params, whole, 10, eos_token_ids=(), return_state=True, max_len=128)
    assert out2.token_lists() == ref.token_lists()
    assert out2.stop_reasons() == ["length"] * 2
    np.testing.assert_array_equal(np.asarray(out2.state.lengths), [len(w) + 10 for w in whole])
    np.testing.assert_array_equal(np.asarray(ref.state.lengths), [len(w) + 10 for w in whole])
    assert out2.state.max_len == 128

    # Plain prefill of every token (turn 2's output included) on a fresh state: the logits at
    # each of turn 2's positions pick its tokens, and the next logits agree.
    conv = [w + t for w, t in zip(whole, out2.token_lists())]
    tokens = np.zeros((2, max(map(len, conv))), np.int32)
    for r, c in enumerate(conv):
        tokens[r, :len(c)] = c
    fresh = jd.init_state(SMALL, 2, 128)
    all_logits, plain = jd.prefill(params, fresh, tokens, np.array([len(c) for c in conv]),
                                   return_all_logits=True)
    all_logits = np.asarray(all_logits)
    for r, (w, c) in enumerate(zip(whole, conv)):
        picked = all_logits[r, len(w) - 1:len(c) - 1].argmax(-1)
        assert picked.tolist() == c[len(w):]
    want = _probe_logits(params, plain)
    _close(_probe_logits(params, out2.state), want)
    _close(_probe_logits(params, ref.state), want)


@pytest.mark.slow
def test_continuing_a_prefilled_state_with_num_samples_forks_after_the_new_tokens(params):
    """A state from jd.prefill (all but each prompt's last token) continued with that token and
    num_samples=3 == a fresh generate of the whole prompts; the returned state has 6 rows."""
    prompts = [[5, 17, 33, 2, 9], [100, 7]]
    state = jd.init_state(SMALL, 2, 64)
    _, state = jd.prefill(params, state, np.array([[5, 17, 33, 2], [100, 0, 0, 0]], np.int32),
                          np.array([4, 1], np.int32))
    sp = SamplingParams.create(temperature=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Some donated")  # a forked state is not donated
        out = gen.generate(params, [[9], [7]], 8, sp, jax.random.key(3), (), state=state,
                           num_samples=3)
    want = gen.generate(params, prompts, 8, sp, jax.random.key(3), (), num_samples=3)
    assert out.token_lists() == want.token_lists()
    assert out.state.batch_size == 6
    np.testing.assert_array_equal(np.asarray(out.state.lengths), [5 + 8] * 3 + [2 + 8] * 3)


@pytest.mark.slow
def test_stream_returns_the_final_state_on_its_last_chunk(params, dispatch_ahead):
    prompts = [[5, 17, 33, 2, 9], [100, 7]]
    eos = (gen.generate(params, prompts, 12, eos_token_ids=()).token_lists()[1][4],)
    out = gen.generate(params, prompts, 12, eos_token_ids=eos, return_state=True)
    chunks = list(gen.generate_stream(params, prompts, 12, eos_token_ids=eos, return_state=True,
                                      chunk_size=4))
    assert all(c.state is None for c in chunks[:-1])
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)
    assert [r[r != -1].tolist() for r in streamed] == out.token_lists()
    np.testing.assert_array_equal(np.asarray(chunks[-1].state.lengths),
                                  np.asarray(out.state.lengths))
    _close(_probe_logits(params, chunks[-1].state), _probe_logits(params, out.state))
    assert all(c.state is None for c in gen.generate_stream(params, prompts, 4))  # not asked
    assert gen.generate(params, prompts, 4).state is None


def test_a_stream_ending_on_its_first_token_runs_no_chunk(params, monkeypatch):
    """The first chunk is read before any later one is dispatched (the time to first token
    waits for no chunk's compile); a stream that ends there runs none."""
    monkeypatch.setattr(gen, "_dispatch_ahead", lambda loop: True)
    calls = []
    real = gen._chunk_args
    monkeypatch.setattr(gen, "_chunk_args", lambda *a: calls.append(1) or real(*a))
    chunks = list(gen.generate_stream(params, PROMPTS, 1))
    assert len(chunks) == 1 and chunks[0].tokens.shape == (len(PROMPTS), 1) and not calls


def _state(params, rows=2, fill=(3, 5), config=SMALL, dtype="float32"):
    """A state of ``rows`` rows (max_len 64) holding ``fill[r]`` tokens per row."""
    state = jd.init_state(config, rows, 64, dtype)
    if config is not SMALL or dtype != "float32":
        return state
    return jd.prefill(params, state, np.ones((rows, max(fill)), np.int32),
                      np.array(fill, np.int32))[1]


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda p: _state(p, 3, (1, 1, 1)), {}, "state has 3 rows but there are 2 prompts"),
    (lambda p: _state(p, config=dataclasses.replace(SMALL, layer_types=(LIN, LIN, LIN, FULL))),
     {}, "does not match params.config"),
    (lambda p: _state(p, dtype="bfloat16"), {}, "dtype"),
    (lambda p: _state(p, fill=(3, 55)), {},
     r"prompt 1: 55 cached \+ 2 prompt tokens \+ max_new_tokens=8 exceeds max_len=64"),
    (_state, dict(max_len=64), "max_len or state, not both"),
    (_state, dict(prompts=[[1], []]), r"prompt\(s\) \[1\] are empty"),
    (lambda p: "not a state", {}, "must be a jaxdecode.DecodeState"),
])
def test_a_state_that_does_not_fit_raises_before_any_device_work(params, make, kwargs, message):
    state = make(params)
    call = dict(prompts=[[1, 2], [3, 4]], max_new_tokens=8, eos_token_ids=(), state=state)
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        gen.generate(params, **call)
    with pytest.raises(ValueError, match=message):
        next(gen.generate_stream(params, **call))
    if isinstance(state, jd.DecodeState):
        assert not state.lengths.is_deleted()  # not donated: still usable


# ----- stop sequences ---------------------------------------------------------------------------

PROMPTS4 = [[5, 17, 33, 2, 9], [100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [250]]


def _stops_from(free, prompts):
    """Stop sequences of lengths 1-3 cut from the stop-free output, one completed only by the
    prompt's tail (must not match there) and one that never occurs."""
    never = next([a, a, b] for a in range(VOCAB) for b in range(VOCAB)
                 if not any(r[i:i + 3] == [a, a, b] for r in free for i in range(len(r))))
    return [free[0][9:10], free[1][4:6], free[2][2:5], [prompts[3][-1], free[3][0]], never]


@pytest.mark.parametrize("num_samples", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stop_sequences_stop_where_a_host_scan_of_the_free_output_does(params, num_samples):
    sp = SamplingParams.create(temperature=1.0)
    kw = dict(sampling=sp, key=jax.random.key(5), eos_token_ids=(), num_samples=num_samples)
    prompts = PROMPTS4[:4 // num_samples]
    free = gen.generate(params, prompts, 16, **kw).token_lists()
    stops = _stops_from(free, [p for p in prompts for _ in range(num_samples)])
    want = [host_stop(r, 16, stops) for r in free]
    assert [reason for _, reason in want[:3]] == ["stop"] * 3
    size = gen._generate_jit._cache_size()
    out = gen.generate(params, prompts, 16, stop_sequences=stops, **kw)
    assert gen._generate_jit._cache_size() == size  # stop sequences are traced values
    assert out.token_lists() == [t for t, _ in want]
    assert out.stop_reasons() == [reason for _, reason in want]
    np.testing.assert_array_equal(np.asarray(out.num_generated), [len(t) for t, _ in want])
    for row, (t, _) in zip(np.asarray(out.tokens), want):
        assert (row[len(t):] == -1).all()
    chunks = list(gen.generate_stream(params, prompts, 16, stop_sequences=stops, chunk_size=3,
                                      **kw))
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)
    assert [r[r != -1].tolist() for r in streamed] == out.token_lists()
    assert [STOP_REASONS[int(s)] for s in chunks[-1].stop_reason] == out.stop_reasons()


@pytest.mark.slow
def test_stop_reason_precedence_and_the_prompt_tail(params):
    """EOS wins over a stop sequence ending on the same token; a stop sequence that the
    prompt's tail would complete with the first generated token does not match."""
    free = gen.generate(params, PROMPTS4, 8, eos_token_ids=()).token_lists()
    t = free[0][2]
    out = gen.generate(params, PROMPTS4[:1], 8, eos_token_ids=(t,), stop_sequences=[[t]])
    assert out.token_lists() == [free[0][:free[0].index(t) + 1]]
    assert out.stop_reasons() == ["eos"]
    tail = [[p[-1], f[0]] for p, f in zip(PROMPTS4, free)]
    out = gen.generate(params, PROMPTS4, 8, eos_token_ids=(), stop_sequences=tail)
    assert out.token_lists() == [host_stop(f, 8, tail)[0] for f in free]
    assert all(len(t) > 1 for t in out.token_lists())


def test_a_stop_sequence_ending_on_the_budget_gives_stop(params):
    free = gen.generate(params, PROMPTS4[:1], 16, eos_token_ids=()).token_lists()[0]
    budget = max(i + 1 for i in range(len(free)) if free[i] not in free[:i])
    out = gen.generate(params, PROMPTS4[:1], budget, eos_token_ids=(),
                       stop_sequences=[[free[budget - 1]]])
    assert out.token_lists() == [free[:budget]] and out.stop_reasons() == ["stop"]


@pytest.mark.slow
def test_long_and_many_stop_sequences_use_a_larger_bucket(params):
    """Over 8 sequences or 8 ids the arrays grow to the next power of two (a new executable);
    matching is unchanged."""
    free = gen.generate(params, PROMPTS4, 16, eos_token_ids=()).token_lists()
    stops = [[VOCAB - 2] * 9] + [[VOCAB - 3]] * 8 + [free[1][:10]]
    plan = gen._plan(params, PROMPTS4, 16, None, None, (), max_len=None, num_samples=1,
                     chunk_size=8, pad_id=-1, kernels=None, stop_sequences=stops)
    assert plan.stop_sequences.shape == (16, 16)
    assert plan.stop_sequences[-7].tolist() == [-1] * 6 + free[1][:10]
    out = gen.generate(params, PROMPTS4, 16, eos_token_ids=(), stop_sequences=stops)
    assert out.token_lists() == [host_stop(f, 16, stops)[0] for f in free]


@pytest.mark.parametrize("stops, message", [
    ([1, 2], "flat list"),
    ([[1], []], r"stop_sequence\(s\) \[1\] are empty"),
    ([[1, VOCAB]], "stop_sequence 0 has token ids outside"),
    ("\n", "token ids"),
    ([[1.5]], "integer token ids"),
])
def test_invalid_stop_sequences_raise(params, stops, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(params, [[1, 2]], 4, stop_sequences=stops)
