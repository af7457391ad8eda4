"""jaxdecode.sampling against plain numpy re-implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import sampling
from jaxdecode.sampling import SamplingParams


def _random_logits(b, v, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(size=(b, v)).astype(np.float32) * scale


def _softmax(x):
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


# ----- numpy references ---------------------------------------------------------------------------

def np_top_k(x, k):
    out = x.copy()
    for i, ki in enumerate(k):
        if 0 < ki < x.shape[1]:
            kth = np.sort(x[i])[::-1][ki - 1]
            out[i][x[i] < kth] = -np.inf
    return out


def np_top_p(x, p):
    """Sort descending; keep token j while the probability mass before it is < p."""
    out = x.copy()
    for i, pi in enumerate(p):
        if pi >= 1:
            continue
        order = np.argsort(-x[i], kind="stable")
        probs = _softmax(x[i][order].astype(np.float64))
        mass_before = np.cumsum(probs) - probs
        drop = order[mass_before >= pi]
        out[i][drop] = -np.inf
    return out


def np_top_p_prefix(x, p):
    """HF's prefix rule: sort descending, ties by higher id first; keep token j while the mass
    before it is < p."""
    out = x.copy()
    for i, pi in enumerate(p):
        if pi >= 1:
            continue
        order = np.lexsort((-np.arange(x.shape[1]), -x[i]))
        probs = _softmax(x[i][order].astype(np.float64))
        mass_before = np.cumsum(probs) - probs
        out[i][order[mass_before >= pi]] = -np.inf
    return out


def np_min_p(x, m):
    probs = _softmax(x.astype(np.float64))
    return np.where(probs < m[:, None] * probs.max(-1, keepdims=True), -np.inf, x)


def np_penalties(x, counts, rep, pres, freq, prompt=None):
    """prompt: [B, V] bool, the prompt ids of rows whose repetition penalty counts them."""
    seen = counts > 0
    rep_seen = seen if prompt is None else seen | prompt
    y = np.where(rep_seen, np.where(x > 0, x / rep[:, None], x * rep[:, None]), x)
    return y - pres[:, None] * seen - freq[:, None] * counts


def np_processed(x, counts, sp, prompt=None):
    """Steps 1-5 of the sampling module docstring, in numpy (prompt: [B, V] bool ids)."""
    p = {f: np.broadcast_to(np.asarray(getattr(sp, f)), x.shape[:1]) for f in sampling._FIELDS}
    if counts is not None:
        if prompt is not None:
            prompt = prompt & p["penalize_prompt"][:, None]
        x = np_penalties(x, counts, p["repetition_penalty"], p["presence_penalty"],
                         p["frequency_penalty"], prompt)
    x = np_top_k(x / p["temperature"][:, None], p["top_k"])
    x = np.where(p["top_p_keep_ties"][:, None], np_top_p(x, p["top_p"]),
                 np_top_p_prefix(x, p["top_p"]))
    return np_min_p(x, p["min_p"])


# ----- masks ----------------------------------------------------------------------------------------

@pytest.fixture(params=[1, pytest.param(2, marks=pytest.mark.slow), 4],
                ids=lambda b: f"{b}-bit")
def radix_bits(request, monkeypatch):
    """Every width of the cut-off search (1: what CPUs run; 4: what GPUs run; 2 only in the full
    run). The width is read at trace time, so each test traces afresh."""
    monkeypatch.setattr(sampling, "_radix_bits", lambda: request.param)
    jax.clear_caches()
    return request.param


@pytest.mark.parametrize("v", [7, 1000])
def test_top_k_mask_matches_numpy(v, radix_bits):
    x = _random_logits(6, v, seed=v)
    k = np.array([0, 1, 2, 5, v, v + 3], np.int32)
    got = np.asarray(jax.jit(sampling.top_k_mask)(x, k))
    np.testing.assert_array_equal(got, np_top_k(x, k))
    kept = np.isfinite(got).sum(-1)
    np.testing.assert_array_equal(kept, [v, 1, 2, 5, v, v])


@pytest.mark.parametrize("v", [7, 1000])
def test_top_p_mask_matches_numpy(v, radix_bits):
    x = _random_logits(6, v, seed=v + 1)
    p = np.array([1.0, 0.05, 0.3, 0.5, 0.9, 0.999], np.float32)
    got = np.asarray(jax.jit(sampling.top_p_mask)(x, p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_top_p(x, p)))
    assert np.isfinite(got).sum(-1).min() >= 1  # the most likely token always survives


def test_cut_off_search_with_ties_and_minus_inf(radix_bits):
    """Integer logits (many ties at the cut-off: all kept) with -inf entries, every k."""
    rng = np.random.default_rng(radix_bits)
    x = rng.integers(-3, 4, (4, 50)).astype(np.float32)
    x[:, rng.integers(0, 50, 15)] = -np.inf
    for k in range(1, 52, 5):
        ks = np.full(4, k, np.int32)
        np.testing.assert_array_equal(np.asarray(sampling.top_k_mask(x, ks)), np_top_k(x, ks))
    # top-p keeps every token tied with the cut-off logit: the logit at which the mass of the
    # sorted tokens first reaches p
    p = np.array([0.1, 0.5, 0.9, 0.99], np.float32)
    want = []
    for row, pi in zip(x, p):
        desc = np.sort(row)[::-1]
        mass = np.cumsum(_softmax(desc.astype(np.float64)))
        want.append(row >= desc[np.argmax(mass >= pi)])
    np.testing.assert_array_equal(np.isfinite(np.asarray(sampling.top_p_mask(x, p))), want)


def test_cut_off_keeps_the_top_token_and_treats_signed_zeros_as_ties(radix_bits):
    """A top_p that float32 flushes to zero (a subnormal) or an unvalidated 0 still keeps the most
    likely token; -0.0 and +0.0 are tied logits (both kept or both dropped)."""
    x = np.array([[-5.0, -4.0, -3.0, 9.0], [9.0, 1.0, -3.0, -4.0]], np.float32)
    for p in (1e-40, 0.0, 1e-45):
        got = np.asarray(sampling.top_p_mask(x, np.full(2, p, np.float32)))
        np.testing.assert_array_equal(np.isfinite(got), [[0, 0, 0, 1], [1, 0, 0, 0]])
    z = np.array([[0.0, -0.0, -1.0, -0.0]], np.float32)
    got = np.asarray(sampling.top_k_mask(z, np.array([1], np.int32)))
    np.testing.assert_array_equal(np.isfinite(got), [[1, 1, 0, 1]])


def test_top_p_mask_with_minus_inf_entries():
    x = np.array([[2.0, -np.inf, 1.0, 0.0, -np.inf]], np.float32)
    got = np.asarray(sampling.top_p_mask(x, np.array([0.8], np.float32)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_top_p(x, [0.8])))


def test_top_p_tie_rules_on_the_issue_example(radix_bits):
    """Probabilities 0.4 and four tokens at 0.15, top_p 0.6: keeping ties keeps all 5; the
    prefix rule keeps 0.4 and the two highest-id 0.15s (HF's count: 3)."""
    x = np.log(np.array([[0.15, 0.15, 0.4, 0.15, 0.15]] * 2, np.float32))
    got = np.asarray(sampling.top_p_mask(x, np.full(2, 0.6, np.float32),
                                         np.array([True, False])))
    np.testing.assert_array_equal(np.isfinite(got), [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])


def test_top_p_prefix_rule_matches_numpy_on_ties(radix_bits):
    """Logits with few distinct values (ties at almost every cut-off) and -inf entries: the
    prefix rule equals a sort by (probability, id) descending, for every p."""
    rng = np.random.default_rng(10 + radix_bits)
    x = rng.integers(-2, 3, (6, 37)).astype(np.float32) * 0.7
    x[:, rng.integers(0, 37, 9)] = -np.inf
    for p in (0.05, 0.2, 0.5, 0.77, 0.95, 0.999):
        ps = np.full(6, p, np.float32)
        got = np.asarray(sampling.top_p_mask(x, ps, np.zeros(6, bool)))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_top_p_prefix(x, ps)))
    # per row: the rule of each row (keep ties in rows 0, 2, 4)
    ps = np.full(6, 0.5, np.float32)
    keep = np.arange(6) % 2 == 0
    got = np.isfinite(np.asarray(sampling.top_p_mask(x, ps, keep)))
    np.testing.assert_array_equal(got[~keep], np.isfinite(np_top_p_prefix(x, ps))[~keep])
    np.testing.assert_array_equal(got[keep], np.isfinite(np.asarray(sampling.top_p_mask(x, ps)))[keep])


def test_min_p_mask_matches_numpy():
    x = _random_logits(5, 500, seed=3)
    m = np.array([0.0, 0.01, 0.1, 0.5, 1.0], np.float32)
    got = np.asarray(jax.jit(sampling.min_p_mask)(x, m))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np_min_p(x, m)))
    assert np.isfinite(got[0]).all() and np.isfinite(got[4]).sum() == 1


def test_penalties_as_specified():
    b, v = 3, 50
    rng = np.random.default_rng(4)
    x = _random_logits(b, v, seed=4)
    counts = rng.integers(0, 3, size=(b, v)).astype(np.int32)
    sp = SamplingParams.create(b, repetition_penalty=[1.0, 1.3, 0.8],
                               presence_penalty=[0.5, 0.0, -0.2], frequency_penalty=[0.0, 0.25, 1.0])
    got = np.asarray(sampling.apply_penalties(x, counts, sp))
    want = np_penalties(x, counts, sp.repetition_penalty, sp.presence_penalty,
                        sp.frequency_penalty)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Repetition penalty > 1 makes seen tokens less likely whatever their sign.
    seen = counts[1] > 0
    assert np.all(got[1][seen] <= x[1][seen])


def test_prompt_mask_of_marks_each_rows_real_prompt_ids():
    tokens = np.array([[3, 1, 3, 0, 7], [4, 4, 2, 2, 6], [5, 0, 0, 0, 0]], np.int32)
    got = np.asarray(sampling.prompt_mask_of(tokens, np.array([3, 5, 0]), 8))
    want = np.zeros((3, 8), bool)
    want[0, [1, 3]] = want[1, [2, 4, 6]] = True  # padding (row 0's 0 and 7, row 2) not counted
    np.testing.assert_array_equal(got, want)


def test_repetition_penalty_counts_the_prompt_in_rows_that_ask():
    """penalize_prompt: prompt ids get the repetition penalty (not presence/frequency, which count
    generated tokens only, as vLLM); False: generated tokens only, as before."""
    b, v = 4, 40
    rng = np.random.default_rng(11)
    x = _random_logits(b, v, seed=11)
    counts = (rng.integers(0, 3, (b, v)) * (rng.random((b, v)) < 0.2)).astype(np.int32)
    prompt = rng.random((b, v)) < 0.3
    flags = np.array([True, False, True, False])
    sp = SamplingParams.create(b, repetition_penalty=[1.4, 1.4, 0.7, 1.0],
                               presence_penalty=0.5, frequency_penalty=0.1,
                               penalize_prompt=flags)
    got = np.asarray(sampling.apply_penalties(x, counts, sp, prompt))
    want = np_penalties(x, counts, sp.repetition_penalty, sp.presence_penalty,
                        sp.frequency_penalty, prompt & flags[:, None])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    only_prompt = prompt[0] & (counts[0] == 0)
    assert only_prompt.any() and (got[0][only_prompt] < x[0][only_prompt]).all()
    np.testing.assert_allclose(got[1], np_penalties(x, counts, sp.repetition_penalty,
                                                    sp.presence_penalty,
                                                    sp.frequency_penalty)[1], rtol=1e-6)
    # no generated tokens yet (token_counts None): the prompt alone
    first = np.asarray(sampling.apply_penalties(x, None, sp, prompt))
    np.testing.assert_allclose(first, np_penalties(x, np.zeros_like(counts), sp.repetition_penalty,
                                                   sp.presence_penalty, sp.frequency_penalty,
                                                   prompt & flags[:, None]), rtol=1e-6)


@pytest.mark.hf
def test_penalties_and_top_p_match_hf_processors(tmp_path):
    """On the same histories (prompt + generated ids), both penalty scopes equal HF's
    RepetitionPenaltyLogitsProcessor (with and without prompt_ignore_length), and the top-p
    prefix rule keeps exactly HF TopPLogitsWarper's tokens where the cut-off has no tie and as
    many tokens where it has (HF's CPU sort orders ties arbitrarily)."""
    from conftest import run_hf
    rng = np.random.default_rng(12)
    b, v, n_prompt, n_gen = 6, 64, 9, 5
    x = _random_logits(b, v, seed=12)
    ids = rng.integers(0, 24, (b, n_prompt + n_gen))  # a small id range: repeats, overlaps
    lengths = rng.integers(1, n_prompt + 1, b)
    ties = np.log(np.array([0.15, 0.15, 0.4, 0.15, 0.15] + [1e-9] * (v - 5), np.float32))
    logits = np.concatenate([x, ties[None], np.roll(ties, 7)[None]]).astype(np.float32)
    ids = np.concatenate([ids, ids[:2]])
    lengths = np.concatenate([lengths, lengths[:2]])
    rows = len(logits)
    # jaxdecode's inputs from the same history: prompt = ids[:len], generated = ids[len:]
    prompt_ids = np.where(np.arange(ids.shape[1])[None] < lengths[:, None], ids, 0)
    prompt = np.asarray(sampling.prompt_mask_of(prompt_ids.astype(np.int32), lengths, v))
    counts = np.zeros((rows, v), np.int32)
    for r in range(rows):
        np.add.at(counts[r], ids[r, lengths[r]:], 1)
    np.savez(tmp_path / "in.npz", logits=logits, input_ids=ids, prompt_lengths=lengths)
    run_hf([{"action": "processors", "in": str(tmp_path / "in.npz"),
             "out": str(tmp_path / "out.npz"), "penalty": 1.4, "top_p": 0.6}], tmp_path)
    hf = dict(np.load(tmp_path / "out.npz"))
    assert (hf["repetition"] != hf["repetition_output"]).any(axis=-1).all()  # scopes differ
    for flag, name in ((True, "repetition"), (False, "repetition_output")):
        sp = SamplingParams.create(rows, repetition_penalty=1.4, penalize_prompt=flag)
        got = np.asarray(sampling.apply_penalties(logits, counts, sp, prompt))
        np.testing.assert_allclose(got, hf[name], rtol=1e-6, err_msg=name)
    kept = np.isfinite(np.asarray(sampling.top_p_mask(logits, np.full(rows, 0.6, np.float32),
                                                      np.zeros(rows, bool))))
    hf_kept = np.isfinite(hf["top_p"])
    np.testing.assert_array_equal(kept[:b], hf_kept[:b])
    np.testing.assert_array_equal(kept.sum(-1), hf_kept.sum(-1))
    assert kept[b:].sum(-1).tolist() == [3, 3]


def test_processed_logits_match_numpy_pipeline():
    b, v = 4, 300
    x = _random_logits(b, v, seed=5)
    counts = np.random.default_rng(5).integers(0, 2, size=(b, v)).astype(np.int32)
    sp = SamplingParams.create(b, temperature=[0.5, 1.0, 1.5, 0.9], top_k=[0, 20, 100, 7],
                               top_p=[0.9, 1.0, 0.5, 0.95], min_p=[0.0, 0.05, 0.0, 0.1],
                               repetition_penalty=1.2, presence_penalty=0.3)
    got = np.asarray(jax.jit(sampling.processed_logits)(x, sp, counts))
    want = np_processed(x, counts, sp)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5)


# ----- sampling ---------------------------------------------------------------------------------------

def test_greedy_equals_argmax():
    x = _random_logits(8, 2000, seed=6)
    toks = jax.jit(sampling.sample)(x, jax.random.key(0), SamplingParams.create(8))
    np.testing.assert_array_equal(np.asarray(toks), x.argmax(-1))
    # Filters do not change a greedy row.
    sp = SamplingParams.create(8, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    np.testing.assert_array_equal(np.asarray(sampling.sample(x, jax.random.key(1), sp)),
                                  x.argmax(-1))


def test_a_temperature_below_min_temperature_is_greedy():
    """logits / T overflows float32 for a tiny T (2e-38: +-inf, wrong tokens, NaN log-probs):
    below sampling.MIN_TEMPERATURE a row takes the argmax, its processed logits unscaled; at
    MIN_TEMPERATURE it samples."""
    x = jnp.asarray([[40.0, 50.0, 0.0], [-50.0, -30.0, -40.0]])
    for t in (2e-38, 1e-37, 1e-6):
        sp = SamplingParams.create(2, temperature=t)
        assert sampling.features_of(sp) == sampling.features_of(SamplingParams.create(2))
        for features in (None, sampling.ALL_FEATURES):
            toks, processed = sampling.sample(x, jax.random.key(0), sp, features=features,
                                              return_processed_logits=True)
            np.testing.assert_array_equal(np.asarray(toks), [1, 1])
            np.testing.assert_array_equal(np.asarray(processed), np.asarray(x))
            lp = sampling.token_logprobs(x, processed, toks).processed
            assert np.isfinite(np.asarray(lp)).all()
    sp = SamplingParams.create(2, temperature=sampling.MIN_TEMPERATURE)
    assert sampling.features_of(sp).sampled
    _, processed = sampling.sample(x, jax.random.key(0), sp, return_processed_logits=True)
    np.testing.assert_allclose(np.asarray(processed), np.asarray(x) / np.float32(1e-5), rtol=1e-6)


def test_greedy_with_penalties_is_argmax_of_penalised_logits():
    x = _random_logits(2, 20, seed=7)
    counts = np.zeros((2, 20), np.int32)
    counts[:, x[0].argmax()] = 1
    counts[:, x[1].argmax()] = 1
    sp = SamplingParams.create(2, presence_penalty=100.0)
    toks = np.asarray(sampling.sample(x, jax.random.key(0), sp, counts))
    assert toks[0] != x[0].argmax() and toks[1] != x[1].argmax()
    np.testing.assert_array_equal(toks, np_penalties(x, counts, np.ones(2), np.full(2, 100.0),
                                                     np.zeros(2)).argmax(-1))


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1, top_k=6),
])
def test_sampled_frequencies_chi_square(settings):
    """Pearson chi-square of 20,000 draws against the numpy-processed distribution."""
    v, n = 8, 20_000
    x = np.array([[2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0]], np.float32)
    sp = SamplingParams.create(n, **settings)
    keys = jax.random.split(jax.random.key(42), n)
    toks = np.asarray(jax.jit(sampling.sample)(np.repeat(x, n, 0), keys, sp))
    want = _softmax(np_processed(x, None, SamplingParams.create(1, **settings)))[0]
    observed = np.bincount(toks, minlength=v)
    assert observed[want == 0].sum() == 0, "sampled a filtered token"
    support = want > 0
    expected = want[support] * n
    chi2 = np.sum((observed[support] - expected) ** 2 / expected)
    dof = support.sum() - 1
    # 0.1% critical values of chi-square for dof = 1..7.
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[dof]
    assert chi2 < critical, (chi2, observed, expected)


def test_rows_are_independent_of_the_batch():
    """A row's draw depends on its own key and logits only."""
    x = _random_logits(3, 100, seed=8)
    keys = jax.random.split(jax.random.key(3), 3)
    sp = SamplingParams.create(3, temperature=[1.0, 0.8, 1.2], top_p=[1.0, 0.9, 0.7])
    batch = np.asarray(sampling.sample(x, keys, sp))
    for i in range(3):
        one = SamplingParams.create(1, temperature=sp.temperature[i], top_p=sp.top_p[i])
        alone = np.asarray(sampling.sample(x[i:i + 1], keys[i:i + 1], one))
        assert alone[0] == batch[i]


@pytest.mark.perf
def test_changing_values_does_not_recompile():
    f = jax.jit(lambda *args: sampling.sample(*args))  # a fresh cache, unshared with other tests
    x = _random_logits(2, 64, seed=9)
    for settings in [dict(), dict(temperature=0.5, top_k=3), dict(temperature=2.0, top_p=0.3,
                                                                  min_p=0.2, top_k=[1, 9])]:
        f(x, jax.random.key(0), SamplingParams.create(2, **settings)).block_until_ready()
    assert f._cache_size() == 1


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
])
def test_invalid_values_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.create(2, **bad)


def test_wrong_length_raises():
    with pytest.raises(ValueError, match="temperature has 3 values"):
        SamplingParams.create(2, temperature=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "2"])
def test_a_batch_size_that_is_not_a_positive_int_raises(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size={batch_size!r} must be a positive int"):
        SamplingParams.create(batch_size)


def test_integer_logits_are_refused_by_sample():
    """Token ids or counts passed as logits would give argmax ids silently."""
    for dtype in (jnp.int32, jnp.bool_):
        with pytest.raises(ValueError, match=r"logits must be float, got (int32|bool)"):
            sampling.sample(jnp.zeros((2, 16), dtype), jax.random.key(0), SamplingParams.create())


# ----- host-decided steps (SamplingFeatures) ------------------------------------------------------

def _random_settings(rng, b):
    """Per-row settings with every step on in some rows and off in others; row 0 greedy, row 1
    sampled."""
    temperature = np.where(rng.random(b) < 0.3, 0.0, rng.uniform(0.3, 2.0, b))
    temperature[:2] = 0.0, rng.uniform(0.3, 2.0)
    return SamplingParams.create(
        b, temperature=temperature,
        top_k=np.where(rng.random(b) < 0.5, 0, rng.integers(1, 40, b)),
        top_p=np.where(rng.random(b) < 0.5, 1.0, rng.uniform(0.2, 0.95, b)),
        min_p=np.where(rng.random(b) < 0.5, 0.0, rng.uniform(0.01, 0.3, b)),
        repetition_penalty=np.where(rng.random(b) < 0.5, 1.0, rng.uniform(0.5, 2.0, b)),
        presence_penalty=rng.normal(size=b), frequency_penalty=rng.normal(size=b) * 0.1,
        penalize_prompt=rng.random(b) < 0.5, top_p_keep_ties=rng.random(b) < 0.5)


def test_features_of():
    f = sampling.features_of
    assert f(sampling.greedy()) == sampling.SamplingFeatures(False, False, False, False, False,
                                                              False)
    # Filters on greedy rows do nothing, so they are not counted.
    assert f(SamplingParams.create(2, temperature=[0.0, 0.7], top_k=[5, 0], top_p=[0.5, 1.0],
                                   min_p=[0.1, 0.0], top_p_keep_ties=False)
             ) == sampling.SamplingFeatures(penalties=False, sampled=True, top_k=False,
                                            top_p=False, min_p=False, top_p_prefix=False)
    assert f(SamplingParams.create(2, temperature=[0.0, 0.7], top_k=[0, 5], top_p=[1.0, 0.5],
                                   min_p=[0.0, 0.1])) == sampling.SamplingFeatures(
        penalties=False, sampled=True, top_k=True, top_p=True, min_p=True, top_p_prefix=False)
    assert f(SamplingParams.create(2, temperature=0.7, top_p=[1.0, 0.5],
                                   top_p_keep_ties=[True, False])).top_p_prefix
    for name, value in (("repetition_penalty", 1.1), ("presence_penalty", -0.5),
                        ("frequency_penalty", 0.2)):
        assert f(SamplingParams.create(**{name: value})).penalties
    # scalar temperature with per-row filters broadcasts
    assert f(SamplingParams.create(temperature=1.0, top_p=np.array([1.0, 0.9]))).top_p
    with pytest.raises(ValueError, match="concrete"):
        jax.jit(lambda t: sampling.features_of(SamplingParams.create(temperature=1.0)
                                               .replace(temperature=t)).sampled)(1.0)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_host_decided_steps_sample_the_same_tokens(seed):
    """features_of(params), ALL_FEATURES and the lax.cond path (features=None) give identical
    processed logits and tokens on random logits, counts, prompt ids and per-row settings."""
    rng = np.random.default_rng(100 + seed)
    b, v = 6, 300
    x = _random_logits(b, v, seed=200 + seed)
    counts = rng.integers(0, 3, (b, v)).astype(np.int32) * (rng.random((b, v)) < 0.1)
    prompt = rng.random((b, v)) < 0.1
    keys = jax.random.split(jax.random.key(seed), b)
    sp = _random_settings(rng, b)
    variants = [None, sampling.features_of(sp), sampling.ALL_FEATURES]
    logits = [np.asarray(jax.jit(sampling.processed_logits, static_argnames="features")(
        x, sp, counts, prompt_mask=prompt, features=f)) for f in variants]
    tokens = [np.asarray(jax.jit(sampling.sample, static_argnames="features")(
        x, keys, sp, counts, prompt_mask=prompt, features=f)) for f in variants]
    for got_logits, got_tokens in zip(logits[1:], tokens[1:]):
        np.testing.assert_array_equal(got_logits, logits[0])
        np.testing.assert_array_equal(got_tokens, tokens[0])
    # and they are the numpy reference's: sampled rows filtered, greedy rows only penalised
    sampled = np.asarray(sp.temperature) > 0
    assert sampled.any() and not sampled.all()
    p = {f: np.asarray(getattr(sp, f)) for f in sampling._FIELDS}
    want = np_penalties(x, counts, p["repetition_penalty"], p["presence_penalty"],
                        p["frequency_penalty"], prompt & p["penalize_prompt"][:, None])
    rows = np.flatnonzero(sampled)
    want[rows] = np_processed(x[rows], counts[rows], jax.tree.map(lambda a: a[rows], sp),
                              prompt[rows])
    np.testing.assert_array_equal(np.isfinite(logits[1]), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(logits[1][finite], want[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.perf
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.8, top_p=0.9)])
def test_host_decided_steps_leave_no_conditional_in_the_program(settings):
    """With features the program has no lax.cond (each one a device-to-host wait on a GPU);
    without, every step is one."""
    x = _random_logits(2, 64, seed=10)
    sp = SamplingParams.create(2, **settings)
    counts = np.zeros((2, 64), np.int32)

    def n_cases(features):
        text = jax.jit(sampling.sample, static_argnames="features").lower(
            x, jax.random.key(0), sp, counts, features=features).as_text()
        return text.count("stablehlo.case")

    assert n_cases(sampling.features_of(sp)) == 0
    assert n_cases(None) == 5  # traced values: penalties, top-k, top-p, min-p, draw
    for values in (sp, jax.tree.map(jnp.asarray, SamplingParams.create(**settings))):
        # concrete values closed over: numpy [B] leaves, device scalars
        closed_over = jax.jit(lambda x, key: sampling.sample(x, key, values, counts))
        assert closed_over.lower(x, jax.random.key(0)).as_text().count("stablehlo.case") == 0


# ----- bounds and NaN rows (issue 22)

def test_top_k_beyond_int32_is_a_value_error():
    with pytest.raises(ValueError, match="top_k=.* must be below 2\\*\\*31"):
        SamplingParams.create(top_k=10**12)


def test_sample_marks_nan_rows_with_minus_one():
    logits = jnp.array([[0.0, 3.0, 1.0], [jnp.nan, 0.0, 9.0], [1.0, 0.0, 0.0]])
    for settings in (SamplingParams.create(), SamplingParams.create(temperature=1.0)):
        tokens = sampling.sample(logits, jax.random.key(0), settings)
        assert int(tokens[1]) == -1
        assert int(tokens[0]) in (0, 1, 2) and int(tokens[2]) in (0, 1, 2)
    assert sampling.sample(logits, jax.random.key(0), SamplingParams.create()).tolist() == [1, -1, 0]


def test_a_row_with_no_possible_token_samples_minus_one():
    """Every logit -inf (every token masked): no token to draw, so -1, as for NaN rows."""
    logits = jnp.array([[-jnp.inf] * 3, [0.0, -jnp.inf, 1.0]])
    for settings in (SamplingParams.create(), SamplingParams.create(temperature=0.7, top_p=0.5)):
        tokens = sampling.sample(logits, jax.random.key(0), settings)
        assert int(tokens[0]) == -1 and int(tokens[1]) in (0, 2)
