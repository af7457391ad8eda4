"""jaxdecode.generation (jd.generate, jd.generate_stream): HF parity (greedy), stopping, frozen
finished rows, fork, compile reuse, streaming == on-device, validation."""

import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import generation as gen
from jaxdecode import sampling as sampling_lib
from jaxdecode.kernels import choice
from jaxdecode.sampling import SamplingParams

from conftest import FULL, GPU_ONLY, HERE, LIN, hf_python, hf_text_config, tiny

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

@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 3])
def test_stream_matches_on_device_loop(params, chunk_size):
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
    (dict(eos_token_ids=(VOCAB,)), "eos_token_ids"),
    (dict(num_samples=0), "num_samples"),
])
def test_invalid_inputs_raise_before_device_work(params, kwargs, message):
    call = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        gen.generate(params, call.pop("prompts"), call.pop("max_new_tokens"), **call)


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
    executables = gen.precompile(params, prompts, **kw)
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
