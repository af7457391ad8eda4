"""The MTP layer and greedy speculative decoding (jaxdecode.speculative, model.verify_fn /
commit_fn / mtp_forward): the MTP forward against a float64 numpy reference of spec §6's
equations; the MTP pairs a state keeps (``init_state(..., mtp=True)``), however its tokens came,
against one MTP forward over the whole sequence; a verify step committed after n tokens against a
prefill of those n tokens; speculative
greedy generation against plain greedy generation token for token, with drafts from an oracle
that is right at set positions (long accepted runs, an EOS inside one, ragged budgets); drafts
from a draft vocabulary (greedy tokens unchanged, sampled ones in distribution); loading
``mtp.*``; the errors."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import tiny
from jaxdecode import generation, model, speculative
from jaxdecode.params import params_to_hf
from jaxdecode.sampling import processed_logits
from test_checkpoint import write_checkpoint

CONFIG = tiny(mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(3))


def _rms_1p(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, positions, c):
    """Rotate-half RoPE on the first rotary dims (HF apply_rotary_pos_emb), x [T, N, D]."""
    rd = c.rotary_dim
    inv = 1.0 / (c.rope_theta ** (np.arange(0, rd, 2) / rd))
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    xr, xp = x[..., :rd], x[..., rd:]
    rot = np.concatenate([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return np.concatenate([xr * cos[:, None] + rot * sin[:, None], xp], -1)


def mtp_reference(flat, c, hidden, tokens):
    """float64 numpy MTP forward (spec §6) of one row's T pairs at positions 0..T-1, causal:
    returns (logits [T, V], d [T, H])."""
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    eps, hq, hkv, d_head = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    e = _rms_1p(f["model.embed_tokens.weight"][tokens], f["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _rms_1p(hidden, f["mtp.pre_fc_norm_hidden.weight"], eps)
    u = np.concatenate([e, h], -1) @ f["mtp.fc.weight"].T
    p = "mtp.layers.0."
    x = _rms_1p(u, f[p + "input_layernorm.weight"], eps)
    t = len(tokens)
    qg = (x @ f[p + "self_attn.q_proj.weight"].T).reshape(t, hq, 2 * d_head)
    q, gate = qg[..., :d_head], qg[..., d_head:]
    k = (x @ f[p + "self_attn.k_proj.weight"].T).reshape(t, hkv, d_head)
    v = (x @ f[p + "self_attn.v_proj.weight"].T).reshape(t, hkv, d_head)
    q = _rope(_rms_1p(q, f[p + "self_attn.q_norm.weight"], eps), np.arange(t, dtype=np.float64), c)
    k = _rope(_rms_1p(k, f[p + "self_attn.k_norm.weight"], eps), np.arange(t, dtype=np.float64), c)
    out = np.zeros((t, hq, d_head))
    for head in range(hq):
        kv = head // (hq // hkv)
        s = q[:, head] @ k[:, kv].T / math.sqrt(d_head)
        s[np.triu(np.ones((t, t), bool), 1)] = -np.inf
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    o = (out * (1.0 / (1.0 + np.exp(-gate)))).reshape(t, -1) @ f[p + "self_attn.o_proj.weight"].T
    u = u + o
    y = _rms_1p(u, f[p + "post_attention_layernorm.weight"], eps)
    g = y @ f[p + "mlp.gate_proj.weight"].T
    u = u + ((g / (1.0 + np.exp(-g))) * (y @ f[p + "mlp.up_proj.weight"].T)) @ \
        f[p + "mlp.down_proj.weight"].T
    d = _rms_1p(u, f["mtp.norm.weight"], eps)
    head_w = f["model.embed_tokens.weight"] if c.tie_word_embeddings else f["lm_head.weight"]
    return d @ head_w.T, d


def test_mtp_forward_against_float64_reference(params):
    """Two calls (3 pairs, then 4 more over the cache) against one float64 pass over 7 pairs."""
    c = CONFIG
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 7, c.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, c.vocab_size, (1, 7)).astype(np.int32)
    kv = (1, c.num_key_value_heads, 64, c.head_dim)
    cache = jd.KVCache(k=jnp.zeros(kv), v=jnp.zeros(kv))
    one = jnp.ones((1,), jnp.int32)
    lg1, d1, cache = model.mtp_forward(params, cache, hidden[:, :3], tokens[:, :3], 0 * one,
                                       3 * one)
    lg2, d2, _ = model.mtp_forward(params, cache, hidden[:, 3:], tokens[:, 3:], 3 * one, 4 * one)
    want_logits, want_d = mtp_reference(params_to_hf(params), c, hidden[0].astype(np.float64),
                                        tokens[0])
    got_logits = np.concatenate([np.asarray(lg1[0]), np.asarray(lg2[0])])
    got_d = np.concatenate([np.asarray(d1[0]), np.asarray(d2[0])])
    scale = np.abs(want_logits).max()
    assert np.abs(got_logits - want_logits).max() <= 1e-4 * scale
    assert np.abs(got_d - want_d).max() <= 1e-4 * np.abs(want_d).max()


def mtp_pairs_of(params, tokens, lengths, max_len=64):
    """The MTP pairs of each row's first ``lengths[b]`` tokens, made apart from the state's own
    bookkeeping: the target's final-norm hidden states of one prefill, and ``mtp_forward`` over
    (hidden at p, token at p + 1), p < length - 1, into an empty cache. Returns (KVCache,
    hidden [B, H] at length - 1, written [B, 1, S, 1] mask of the pair positions)."""
    c = params.config
    rows = tokens.shape[0]
    _, _, hidden = model.prefill_hidden_fn(params, jd.init_state(c, rows, max_len), tokens,
                                           lengths, kernels=jd.Kernels())
    kv = (rows, c.num_key_value_heads, max_len, c.head_dim)
    empty = jd.KVCache(k=jnp.zeros(kv), v=jnp.zeros(kv))
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # last: padding
    _, _, cache = model.mtp_forward(params, empty, hidden, following,
                                    jnp.zeros((rows,), jnp.int32), lengths - 1, jd.Kernels(),
                                    return_logits=False)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    written = (np.arange(max_len)[None, :] < np.asarray(lengths - 1)[:, None])[:, None, :, None]
    return cache, last, written


def assert_pairs_close(state, want, atol=2e-5):
    """``state.mtp`` against :func:`mtp_pairs_of`'s (cache, hidden, written)."""
    cache, hidden, written = want
    assert np.abs(np.where(written, cache.k, 0)).max() > 0.1
    for got, ref in ((state.mtp.kv.k, cache.k), (state.mtp.kv.v, cache.v)):
        np.testing.assert_allclose(np.where(written, got, 0), np.where(written, ref, 0),
                                   rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(state.mtp.hidden), np.asarray(hidden), rtol=0,
                               atol=atol)


@pytest.mark.parametrize("how", ["one prefill", "chunks", "two prefills", "decode steps",
                                 "jd.prefill and decode_step", "batch invariant"])
def test_a_state_keeps_the_mtp_pairs_of_every_token(params, how):
    """``init_state(..., mtp=True)``: however its tokens came in (one prefill, chunked, two
    calls, one decode step at a time, the public jits, the batch-invariant paths), the state's
    MTP cache holds pair p = (hidden at p, token p + 1) for p < length - 1 and the hidden state
    at length - 1, as one MTP forward over the whole sequence gives; ragged rows, one of a
    single token (no pair)."""
    c = CONFIG
    rng = np.random.default_rng(4)
    lengths = jnp.array([11, 6, 1])
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, (3, 12)), jnp.int32)
    state = jd.init_state(c, 3, 64, mtp=True)
    xla, invariant = jd.Kernels(), jd.Kernels(batch_invariant=True)
    if how == "one prefill":
        _, state = model.prefill_fn(params, state, tokens, lengths, kernels=xla)
    elif how == "chunks":
        _, state = model.prefill_fn(params, state, tokens, lengths, prefill_chunk_size=4,
                                    kernels=xla)
    elif how == "two prefills":
        _, state = model.prefill_fn(params, state, tokens[:, :5], jnp.minimum(lengths, 5),
                                    kernels=xla)
        _, state = model.prefill_fn(params, state, tokens[:, 5:], jnp.maximum(lengths - 5, 0),
                                    kernels=xla)
    elif how == "decode steps":
        for t in range(tokens.shape[1]):
            _, state = model.decode_step_fn(params, state, tokens[:, t], t < lengths, xla)
    elif how == "jd.prefill and decode_step":
        _, state = jd.prefill(params, state, tokens[:, :3], jnp.minimum(lengths, 3))
        for t in range(3, tokens.shape[1]):
            _, state = jd.decode_step(params, state, tokens[:, t], active=t < lengths)
    else:
        _, state = model.decode_step_fn(params, state, tokens[:, 0], None, invariant)
        _, state = model.prefill_fn(params, state, tokens[:, 1:], lengths - 1, kernels=invariant)
    np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(lengths))
    assert_pairs_close(state, mtp_pairs_of(params, tokens, lengths))


def test_verify_then_commit_equals_prefill_of_the_accepted_tokens(params):
    c = CONFIG
    rng = np.random.default_rng(1)
    rows, t = 4, 5
    prompt = jnp.asarray(rng.integers(0, c.vocab_size, (rows, 9)), jnp.int32)
    new = jnp.asarray(rng.integers(0, c.vocab_size, (rows, t)), jnp.int32)
    xla = jd.Kernels()
    _, state = model.prefill_fn(params, jd.init_state(c, rows, 64, mtp=True), prompt,
                                jnp.array([9, 6, 1, 3]), kernels=xla)
    logits, hidden, pending, traces = model.verify_fn(params, state, new, jnp.full((rows,), t))
    accepted = jnp.array([0, 2, 5, 1])
    got = model.commit_fn(params, pending, traces, new, hidden, accepted)
    want_logits, want = model.prefill_fn(params, state, new, accepted, return_all_logits=True,
                                         kernels=xla)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for a, b in zip(got.conv_state + got.recurrent_state, want.conv_state + want.recurrent_state):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    # the MTP pairs of the accepted tokens, as the prefill of them appends
    written = (np.arange(64)[None, :] < np.asarray(want.lengths - 1)[:, None])[:, None, :, None]
    for a, b in ((got.mtp.kv.k, want.mtp.kv.k), (got.mtp.kv.v, want.mtp.kv.v)):
        np.testing.assert_allclose(np.where(written, a, 0), np.where(written, b, 0), rtol=0,
                                   atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.mtp.hidden), np.asarray(want.mtp.hidden), rtol=0,
                               atol=1e-5)
    real = (np.arange(t)[None, :] < np.asarray(accepted)[:, None])[..., None]
    scale = float(jnp.abs(want_logits).max())
    assert np.abs(np.where(real, np.asarray(logits - want_logits), 0)).max() <= 1e-5 * scale
    # the hidden state is the final norm's output: the LM head of it gives the logits
    head = params.lm_head_weight
    np.testing.assert_allclose(np.asarray(hidden @ head.T), np.asarray(logits), rtol=0,
                               atol=1e-5 * scale)


@pytest.mark.parametrize("mode", [pytest.param("interpret", marks=pytest.mark.slow),
                                  pytest.param("gpu", marks=pytest.mark.gpu)])
def test_verify_step_and_draft_through_the_few_query_attention_kernel(mode):
    """verify_fn and mtp_forward with Kernels(verify_attention="pallas") (the decode-attention
    kernel with T queries) against the XLA path, float32, ragged lengths."""
    if mode == "gpu" and jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    c = tiny(mtp_num_hidden_layers=1, head_dim=64)  # a head_dim the kernel takes
    params = jd.init_params(c, jax.random.key(5))
    rng = np.random.default_rng(5)
    rows, t = 3, 4
    prompt = jnp.asarray(rng.integers(0, c.vocab_size, (rows, 70)), jnp.int32)
    new = jnp.asarray(rng.integers(0, c.vocab_size, (rows, t)), jnp.int32)
    _, state = model.prefill_fn(params, jd.init_state(c, rows, 128), prompt,
                                jnp.array([70, 61, 2]))
    mine = jd.Kernels(verify_attention="pallas", interpret=(mode == "interpret"))
    num_new = jnp.array([t, t, 2])
    want = model.verify_fn(params, state, new, num_new)[:2]
    got = model.verify_fn(params, state, new, num_new, mine)[:2]
    real = (np.arange(t)[None, :] < np.asarray(num_new)[:, None])[..., None]
    for a, b in zip(got, want):
        scale = float(jnp.abs(b).max())
        assert np.abs(np.where(real, np.asarray(a - b), 0)).max() <= 1e-5 * scale
    hidden = jax.random.normal(jax.random.key(6), (rows, 1, c.hidden_size))
    one = jnp.ones((rows,), jnp.int32)
    want = model.mtp_forward(params, state.kv_cache[0], hidden, new[:, :1], state.lengths, one)
    got = model.mtp_forward(params, state.kv_cache[0], hidden, new[:, :1], state.lengths, one,
                            mine)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=1e-5 * float(jnp.abs(b).max()))


def oracle_draft(ref, k):
    """A draft hook right except at every 4th output position: draft j of a row is ``ref``'s
    token at the row's output index ``num_generated + j`` (any id past the row's end, where
    ``ref`` holds the pad -1), plus 1 where that index is 3 mod 4."""
    ref = jnp.asarray(ref)

    def oracle(loop, drafts):
        pos = loop.num_generated[:, None] + jnp.arange(k)[None, :]  # output index of draft j
        right = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)
        right = jnp.maximum(right, 0)
        return jnp.where(pos % 4 == 3, (right + 1) % CONFIG.vocab_size, right).astype(jnp.int32)

    return oracle


def padded_prompts(prompts, width=16):
    """[len(prompts), width] int32: each prompt left-aligned, zeros after."""
    padded = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    return padded


def test_speculative_greedy_equals_plain_greedy(params):
    """Oracle drafts, right except at every 4th output position: accepted runs of up to k,
    rejections mid-run, an EOS inside an accepted run (row 0), ragged budgets and prompts."""
    c = CONFIG
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (6, 11, 1)]
    budgets = [20, 9, 17]
    plain0 = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[])
    ref = np.asarray(plain0.tokens)
    eos = int(ref[0, 10])  # row 0 stops at its 11th token, inside a run of accepted drafts
    plain = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[eos])
    k = 3

    oracle = oracle_draft(ref, k)
    n = plain.tokens.shape[1]
    state = jd.init_state(c, 3, 64, mtp=True)
    padded = padded_prompts(prompts)
    eos_ids = jnp.asarray([eos] + [-1] * 7, jnp.int32)
    loop = generation.speculative_generate_jit(
        params, state, jnp.asarray(padded), jnp.asarray([len(p) for p in prompts]),
        jnp.asarray(budgets), eos_ids, -1, num_speculative_tokens=k, max_new_tokens=n,
        kernels=jd.Kernels(), draft=oracle)
    np.testing.assert_array_equal(np.asarray(loop.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(loop.num_generated),
                                  np.asarray(plain.num_generated))
    np.testing.assert_array_equal(np.asarray(loop.stop_reason), np.asarray(plain.stop_reason))
    assert int(plain.num_generated[0]) == 11 and plain.stop_reasons()[0] == "eos"
    # drafts were accepted (3 of every 4 right): far fewer verify steps than tokens
    assert int(loop.accepted) > 0.4 * int(np.sum(plain.num_generated))
    assert int(loop.iterations) < 0.6 * int(np.max(plain.num_generated))

    # through generate (the MTP's own drafts): the same tokens
    spec = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[eos],
                       num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert spec.stop_reasons() == plain.stop_reasons()


def test_speculative_stop_sequences_equal_plain(params):
    """Stop sequences (and EOS) end rows where plain decoding ends them, inside accepted runs
    too: a 2-token sequence that completes in the middle of a step's drafts, a 1-token one, a
    3-token one that never completes, with oracle drafts right 3 times in 4."""
    c = CONFIG
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (5, 9, 2)]
    budgets = [18, 14, 16]
    free = np.asarray(jd.generate(params, prompts, max_new_tokens=budgets,
                                  eos_token_ids=[]).tokens)
    stops = [[int(free[0, 7]), int(free[0, 8])], [int(free[1, 5])],
             [int(free[2, 0]), int(free[2, 0]), int(free[2, 0])]]
    plain = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[],
                        stop_sequences=stops)
    assert "stop" in plain.stop_reasons()
    ref = np.asarray(plain.tokens)
    k = 3

    oracle = oracle_draft(ref, k)
    padded = padded_prompts(prompts)
    stop_padded = np.full((8, 4), -1, np.int32)
    for i, stop in enumerate(stops):
        stop_padded[i, 4 - len(stop):] = stop
    loop = generation.speculative_generate_jit(
        params, jd.init_state(c, 3, 64, mtp=True), jnp.asarray(padded),
        jnp.asarray([len(p) for p in prompts]), jnp.asarray(budgets),
        jnp.full((8,), -1, jnp.int32), -1, num_speculative_tokens=k,
        max_new_tokens=ref.shape[1], kernels=jd.Kernels(), draft=oracle,
        stop_sequences=jnp.asarray(stop_padded))
    np.testing.assert_array_equal(np.asarray(loop.tokens), ref)
    np.testing.assert_array_equal(np.asarray(loop.num_generated),
                                  np.asarray(plain.num_generated))
    np.testing.assert_array_equal(np.asarray(loop.stop_reason), np.asarray(plain.stop_reason))
    assert int(loop.accepted) > 0  # the stops fell inside runs of accepted drafts
    # through generate (the MTP's own drafts)
    spec = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[],
                       stop_sequences=stops, num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), ref)
    assert spec.stop_reasons() == plain.stop_reasons()


def assert_states_close(got, want):
    """Equal lengths; every layer's state and the KV caches' filled positions equal to float32
    rounding (a cache past a row's length holds don't-care values: rejected drafts)."""
    lengths = np.asarray(want.lengths)
    np.testing.assert_array_equal(np.asarray(got.lengths), lengths)
    for a, b in zip(got.conv_state + got.recurrent_state, want.conv_state + want.recurrent_state):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    filled = (np.arange(want.max_len)[None, :] < lengths[:, None])[:, None, :, None]
    for a, b in zip(got.kv_cache, want.kv_cache):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            np.testing.assert_allclose(np.where(filled, np.asarray(x), 0),
                                       np.where(filled, np.asarray(y), 0), rtol=0, atol=1e-5)


def test_speculative_returns_and_continues_a_state_as_plain_decoding(params):
    """return_state: the state after every emitted token, plain greedy's; state=: new ragged
    prompts after it give plain greedy's tokens and state, with num_samples = 2 too (each
    prompt's rows continue its row; the given state stays valid, as plain generate's); a state
    without MTP pairs is refused."""
    c = CONFIG
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (7, 3)]
    run = lambda prompts, n, **kw: jd.generate(  # noqa: E731
        params, prompts, n, eos_token_ids=[], return_state=True, **kw)
    plain, spec = (run(prompts, 9, max_len=64, **kw) for kw in ({}, {"num_speculative_tokens": 3}))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert_states_close(spec.state, plain.state)
    more = [list(rng.integers(0, c.vocab_size, n)) for n in (2, 5)]
    plain = run(more, 8, state=plain.state)
    spec = run(more, 8, state=spec.state, num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert_states_close(spec.state, plain.state)
    kept_plain, kept = plain.state, spec.state
    with pytest.raises(ValueError, match=r"init_state\(\.\.\., mtp=True\)"):
        run([[1], [2]], 6, state=kept_plain, num_speculative_tokens=2)
    plain = run([[1], [2, 3]], 6, state=kept_plain, num_samples=2)
    spec = run([[1], [2, 3]], 6, state=kept, num_samples=2, num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert_states_close(spec.state, plain.state)
    assert not any(x.is_deleted() for x in jax.tree.leaves((kept, kept_plain)))


def test_speculative_continues_a_prefilled_state_with_its_mtp_pairs(params):
    """A state prefilled with 40 tokens (jd.prefill, keeping MTP pairs), continued by speculative
    generate: the returned state's MTP pairs are those of all its tokens (the 40, the prompts,
    every emitted token), as one MTP forward over the whole sequence gives; its tokens are plain
    greedy's from the same state."""
    c = CONFIG
    rng = np.random.default_rng(12)
    early = jnp.asarray(rng.integers(0, c.vocab_size, (2, 40)), jnp.int32)
    start = lambda: jd.prefill(params, jd.init_state(c, 2, 64, mtp=True), early,  # noqa: E731
                               [40, 40])[1]
    prompts = [[5, 9, 2, 7], [3, 1]]
    spec = jd.generate(params, prompts, 10, eos_token_ids=[], state=start(),
                       num_speculative_tokens=2)
    plain = jd.generate(params, prompts, 10, eos_token_ids=[], state=start())
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    assert_states_close(spec.state, plain.state)
    everything = np.zeros((2, 64), np.int32)
    for row, prompt in enumerate(prompts):
        seq = list(np.asarray(early[row])) + prompt + list(np.asarray(spec.tokens[row]))
        everything[row, :len(seq)] = seq
    lengths = spec.state.lengths
    np.testing.assert_array_equal(np.asarray(lengths), [54, 52])
    assert_pairs_close(spec.state, mtp_pairs_of(params, jnp.asarray(everything), lengths),
                       atol=1e-4)


def test_speculative_errors(params):
    no_mtp = jd.init_params(tiny(), jax.random.key(0))
    with pytest.raises(ValueError, match="mtp=True"):
        jd.generate(no_mtp, [[1, 2]], 4, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="draft_vocab applies to speculative decoding"):
        next(jd.generate_stream(params, [[1, 2]], 4, draft_vocab=[1, 2]))
    with pytest.raises(ValueError, match="draft_vocab applies to speculative decoding"):
        generation.precompile(params, [[1, 2]], 4, draft_vocab=[1, 2])
    with pytest.raises(ValueError, match="positive int"):
        generation.precompile(params, [[1, 2]], 4, num_speculative_tokens=-5)
    with pytest.raises(ValueError, match="mtp=True"):
        generation.precompile(no_mtp, [[1, 2]], 4, num_speculative_tokens=2, stream=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_p'"):
        generation.precompile(params, [[1, 2]], 4, num_speculative_tokens=2, top_p=0.9)
    generation.precompile(params, [[1, 2]], 4, num_speculative_tokens=0, draft_vocab=None)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 .* exceeds max_len=16"):
        jd.generate(params, [[1, 2]], 4, state=jd.prefill(
            params, jd.init_state(CONFIG, 1, 16, mtp=True), [[5] * 9], [9])[1],
            num_speculative_tokens=3)
    invariant = jd.choose_kernels(params.config, 1, dtype=params.dtype, batch_invariant=True)
    with pytest.raises(ValueError, match=r"does not yet work with \['kernels.batch_invariant'\]"):
        jd.generate(params, [[1, 2]], 4, kernels=invariant, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="stop_sequence 0 has token ids outside"):
        jd.generate(params, [[1, 2]], 4, stop_sequences=[[10**9]], num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 .* exceeds max_len=8"):
        jd.generate(params, [[1, 2]], 4, max_len=8, num_speculative_tokens=3)
    for bad in (-1, 0.0, False, 2.5, None):
        with pytest.raises(ValueError, match="positive int"):
            jd.generate(params, [[1, 2]], 4, num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens=17 is more than 16"):
        jd.generate(params, [[1, 2]], 4, num_speculative_tokens=17)
    keys = jax.random.split(jax.random.key(0), 2)[:, None]  # [R, 1]: not one key per row
    with pytest.raises(ValueError, match="one per output row"):
        jd.generate(params, [[1, 2], [3]], 4, key=keys, num_speculative_tokens=2)
    # a features value that enables penalties no row uses, numpy ints: accepted
    out = jd.generate(params, [[1, 2]], 3, num_speculative_tokens=2, num_samples=np.int64(2),
                      features=jd.sampling.ALL_FEATURES)
    assert out.tokens.shape[0] == 2
    with pytest.raises(ValueError, match="top_logprobs=3 needs return_logprobs"):
        jd.generate(params, [[1, 2]], 4, top_logprobs=3, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="chunk_size"):
        jd.generate(params, [[1, 2]], 4, chunk_size=0, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="MTP layer"):
        model.mtp_forward(no_mtp, None, None, jnp.zeros((1, 1), jnp.int32), None, None)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=2"):
        tiny(mtp_num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"mtp=True needs a model with an MTP layer"):
        jd.init_state(tiny(), 1, 64, mtp=True)
    with pytest.raises(ValueError, match=r"mtp='no' must be a bool"):
        jd.init_state(CONFIG, 1, 64, mtp="no")
    good = jd.init_state(CONFIG, 1, 64, mtp=True)
    for bad, message in ((good.replace(mtp=(good.mtp.kv, good.mtp.hidden)),
                          r"mtp must be a jaxdecode.MTPCache .* got tuple"),
                         (good.replace(mtp=good.mtp.replace(hidden=good.mtp.hidden[:, :3])),
                          r"mtp.hidden shape \(1, 3\) != expected \(1, 64\)"),
                         (good.replace(mtp=good.mtp.replace(hidden=None)),
                          r"mtp.hidden is NoneType, not an array")):
        with pytest.raises(ValueError, match=message):
            jd.decode_step(params, bad, [1])
    pairs = jd.init_state(CONFIG, 1, 64, mtp=True)
    for call in (lambda: jd.prefill(no_mtp, pairs, [[1, 2]], [2]),
                 lambda: jd.decode_step(no_mtp, pairs, [1]),
                 lambda: jd.generate(no_mtp, [[1, 2]], 4, state=pairs)):
        with pytest.raises(ValueError, match=r"state keeps MTP pairs .* but the params hold "
                                             r"no MTP layer"):
            call()


def assert_logprobs_equal(got, want):
    """Two runs' :class:`Logprobs`: values within float32 rounding, the top ids equal."""
    for name in ("processed", "raw", "top_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                   rtol=0, atol=2e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))


def test_speculative_logprobs_equal_plain(params):
    """Greedy, oracle drafts right 3 times in 4 (runs accepted, rejections mid-run), ragged
    prompts and budgets, an EOS: each emitted token's processed/raw log-probability and the
    top 3 equal plain generate's (float32), zero / pad_id past a row's end."""
    c = CONFIG
    rng = np.random.default_rng(12)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (7, 3, 12)]
    budgets = [15, 6, 13]
    free = np.asarray(jd.generate(params, prompts, max_new_tokens=budgets,
                                  eos_token_ids=[]).tokens)
    eos = int(free[2, 8])
    plain = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[eos],
                        return_logprobs=True, top_logprobs=3)
    ref = np.asarray(plain.tokens)
    k = 3

    oracle = oracle_draft(ref, k)
    padded = padded_prompts(prompts)
    loop = generation.speculative_generate_jit(
        params, jd.init_state(c, 3, 64, mtp=True), jnp.asarray(padded),
        jnp.asarray([len(p) for p in prompts]), jnp.asarray(budgets),
        jnp.asarray([eos] + [-1] * 7, jnp.int32), -1, num_speculative_tokens=k,
        max_new_tokens=ref.shape[1], kernels=jd.Kernels(), draft=oracle, logprobs=3)
    np.testing.assert_array_equal(np.asarray(loop.tokens), ref)
    assert int(loop.accepted) > 0
    assert_logprobs_equal(loop.logprobs, plain.logprobs)
    assert np.asarray(plain.logprobs.top_ids)[1, 6:].tolist() == [[-1] * 3] * (ref.shape[1] - 6)
    # through generate (the MTP's own drafts)
    spec = jd.generate(params, prompts, max_new_tokens=budgets, eos_token_ids=[eos],
                       return_logprobs=True, top_logprobs=3, num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), ref)
    np.testing.assert_allclose(np.asarray(spec.logprobs.raw), np.asarray(plain.logprobs.raw),
                               rtol=0, atol=2e-5)


def test_speculative_sampled_logprobs_and_num_samples(params):
    """Sampled rows (temperature 0.7, top-k 5) with num_samples = 3: row p * 3 + j is prompt p's
    (the same tokens as prompting p alone with that row's key); each token's raw and processed
    log-probability against a float32 prefill of prompt + output (the logits at its position,
    their softmax and that of ``processed_logits``)."""
    c = CONFIG
    prompts = [[5, 17, 99, 3], [42, 8]]
    sampling = jd.SamplingParams.create(temperature=0.7, top_k=5)
    keys = jax.random.split(jax.random.key(9), 6)
    out = jd.generate(params, prompts, 10, sampling, keys, eos_token_ids=[], num_samples=3,
                      return_logprobs=True, num_speculative_tokens=3)
    tokens = np.asarray(out.tokens)
    assert tokens.shape[0] == 6 and (np.asarray(out.num_generated) == 10).all()
    for row in range(6):
        alone = jd.generate(params, [prompts[row // 3]], 10, sampling, keys[row:row + 1],
                            eos_token_ids=[], num_speculative_tokens=3)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], tokens[row])
        seq = prompts[row // 3] + tokens[row, :10].tolist()
        logits, _ = model.prefill_fn(params, jd.init_state(c, 1, 64),
                                     jnp.asarray([seq], jnp.int32), jnp.asarray([len(seq)]),
                                     return_all_logits=True)
        at = logits[0, len(prompts[row // 3]) - 1:len(seq) - 1]  # [10, V]: each token's
        processed = processed_logits(at, sampling.broadcast(10))
        for got, x in ((out.logprobs.raw, at), (out.logprobs.processed, processed)):
            want = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1),
                                       jnp.asarray(tokens[row, :10])[:, None], axis=1)[:, 0]
            np.testing.assert_allclose(np.asarray(got)[row, :10], np.asarray(want), rtol=0,
                                       atol=2e-5)
    assert len({tuple(r) for r in tokens[:3]}) > 1  # the samples of one prompt differ


def test_load_checkpoint_with_mtp(tmp_path, params):
    path = write_checkpoint(tmp_path / "ck", params, prefix="model.language_model.")
    loaded = jd.load_checkpoint(path, dtype="float32", mtp=True)
    assert loaded.config.mtp_num_hidden_layers == 1
    for a, b in zip(jax.tree.leaves(loaded.mtp), jax.tree.leaves(params.mtp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain = jd.load_checkpoint(path, dtype="float32")  # HF's behaviour: mtp.* skipped
    assert plain.mtp is None and plain.config.mtp_num_hidden_layers == 0
    damaged = write_checkpoint(tmp_path / "no_fc", params, drop=("mtp.fc.weight",))
    with pytest.raises(ValueError, match=r"missing tensor mtp\.fc\.weight"):
        jd.load_checkpoint(damaged, dtype="float32", mtp=True)
    # a checkpoint without an MTP layer: one line saying so, not a line per mtp.* tensor
    none = write_checkpoint(tmp_path / "no_mtp", params.replace(
        mtp=None, config=dataclasses.replace(params.config, mtp_num_hidden_layers=0)))
    with pytest.raises(ValueError, match=r"\(1 problems\):\n  mtp=True, but the checkpoint "
                                         r"holds no mtp\.\* tensors"):
        jd.load_checkpoint(none, dtype="float32", mtp=True)
    hf = json.loads((path / "config.json").read_text())
    text = hf.get("text_config", hf)
    for layers in (2, 3):
        text["mtp_num_hidden_layers"] = layers
        (path / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ValueError, match=rf"mtp=True, but config.json has "
                                             rf"mtp_num_hidden_layers={layers}: jaxdecode runs one"):
            jd.load_checkpoint(path, dtype="float32", mtp=True)
        assert jd.load_checkpoint(path, dtype="float32").mtp is None  # plain loading is unaffected
    for name, bad in (("mtp", "yes"), ("mtp", 1), ("check_finite", None)):  # as init_state's
        with pytest.raises(ValueError, match=rf"{name}={bad!r} must be a bool"):
            jd.load_checkpoint(path, dtype="float32", **{name: bad})


def test_accept_drafts_keeps_the_target_distribution():
    """The rule alone, 200k rows, V = 6, k = 2, fixed target p_0..p_2 and draft q_0, q_1 that
    differ: the first emitted token ~ p_0, the second (where emitted) ~ p_1, the third ~ p_2,
    each within 5 standard errors per id; greedy (one-hot) rows accept exactly the argmax."""
    rng = np.random.default_rng(5)
    v, k, n = 6, 2, 200_000
    p = rng.dirichlet(np.ones(v), k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v), k).astype(np.float32)
    drafts = np.stack([rng.choice(v, n, p=q[j] / q[j].sum()) for j in range(k)], 1)
    keys = jax.random.split(jax.random.key(6), n)
    emitted, count = jax.jit(speculative.accept_drafts)(
        jnp.broadcast_to(p, (n, k + 1, v)), jnp.broadcast_to(q, (n, k, v)),
        jnp.asarray(drafts, jnp.int32), keys)
    emitted, count = np.asarray(emitted), np.asarray(count)
    assert count.min() >= 1 and count.max() <= k + 1
    for j in range(k + 1):
        rows = count > j
        freq = np.bincount(emitted[rows, j], minlength=v) / rows.sum()
        se = np.sqrt(p[j] * (1 - p[j]) / rows.sum())
        assert np.all(np.abs(freq - p[j]) <= 5 * se + 1e-4), (j, freq, p[j])
    # greedy rows: one-hot p and q
    target = jax.nn.one_hot(jnp.array([[2, 4, 1]]), v)
    e, c = speculative.accept_drafts(target, jax.nn.one_hot(jnp.array([[2, 3]]), v),
                                     jnp.array([[2, 3]]), jax.random.split(jax.random.key(0), 1))
    assert int(c[0]) == 2 and e[0, :2].tolist() == [2, 4]


def test_speculative_sampling_matches_plain_sampling_in_distribution(params):
    """2,048 rows of one prompt, temperature 1 and top-k 4, 3 tokens: the joint distribution of
    the 2nd and 3rd tokens (both past a verify step) from speculative sampling (the MTP's own
    drafts, k = 2; again with drafts from a third of the vocabulary) against plain sampling's, a
    two-sample chi-square over the 16 cells; a greedy row in the same batch keeps plain greedy's
    tokens."""
    rows = 2048
    prompt = [[5, 17, 99, 3]] * rows
    sampling = jd.SamplingParams.create(temperature=1.0, top_k=4)
    plain = np.asarray(jd.generate(params, prompt, 3, sampling, jax.random.key(1),
                                   eos_token_ids=[]).tokens)[:, 1:3]
    spec = np.asarray(jd.generate(params, prompt, 3, sampling, jax.random.key(2),
                                  eos_token_ids=[], num_speculative_tokens=2).tokens)[:, 1:3]
    _chi_square_same(plain, spec)
    # drafts from a third of the vocabulary (q zero elsewhere): the same distribution
    ids = np.random.default_rng(7).permutation(CONFIG.vocab_size)[:CONFIG.vocab_size // 3]
    subset = np.asarray(jd.generate(params, prompt, 3, sampling, jax.random.key(4),
                                    eos_token_ids=[], num_speculative_tokens=2,
                                    draft_vocab=ids).tokens)[:, 1:3]
    _chi_square_same(plain, subset)
    mixed = jd.SamplingParams.create(2, temperature=[0.0, 1.0], top_k=[0, 4])
    got = jd.generate(params, [[5, 17, 99, 3]] * 2, 8, mixed, jax.random.key(3),
                      eos_token_ids=[], num_speculative_tokens=3)
    want = jd.generate(params, [[5, 17, 99, 3]], 8, eos_token_ids=[])
    np.testing.assert_array_equal(np.asarray(got.tokens)[0], np.asarray(want.tokens)[0])


def _chi_square_same(plain, spec):
    """A two-sample chi-square over the joint cells of two [N, 2] token samples (rare cells
    pooled): fails only far out in the tail."""
    cells = sorted(set(map(tuple, plain)) | set(map(tuple, spec)))
    a = np.array([np.sum(np.all(plain == c, axis=1)) for c in cells], float)
    b = np.array([np.sum(np.all(spec == c, axis=1)) for c in cells], float)
    keep = (a + b) >= 10  # pool the rare cells
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    expected_a = (a + b) / 2
    chi2 = np.sum((a - expected_a) ** 2 / np.maximum(expected_a, 1e-9)) * 2
    dof = int(np.sum((a + b) > 0)) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # far out in the tail only


def test_draft_tokens_maps_draft_vocab_indices_to_ids():
    ids = jnp.asarray([7, 2, 11], jnp.int32)
    q = jnp.asarray([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    tokens, full = speculative.draft_tokens(jnp.asarray([2, 1]), q, ids, 12)
    assert tokens.tolist() == [11, 2]
    want = np.zeros((2, 12))
    want[0, [7, 2, 11]] = [0.5, 0.25, 0.25]
    want[1, 2] = 1.0
    np.testing.assert_array_equal(np.asarray(full), want)
    same, none = speculative.draft_tokens(jnp.asarray([2, 1]), None, None, 12)
    assert same.tolist() == [2, 1] and none is None


def test_accept_drafts_with_q_zero_outside_a_draft_vocab():
    """q drawn over a subset of the ids (a draft vocabulary): the emitted tokens still follow
    p, including ids q never proposes (they come from the residual)."""
    rng = np.random.default_rng(8)
    v, k, n = 6, 2, 200_000
    subset = np.array([0, 2, 3])
    p = rng.dirichlet(np.ones(v), k + 1).astype(np.float32)
    q = np.zeros((k, v), np.float32)
    q[:, subset] = rng.dirichlet(np.ones(len(subset)), k)
    drafts = np.stack([rng.choice(v, n, p=q[j] / q[j].sum()) for j in range(k)], 1)
    emitted, count = jax.jit(speculative.accept_drafts)(
        jnp.broadcast_to(p, (n, k + 1, v)), jnp.broadcast_to(q, (n, k, v)),
        jnp.asarray(drafts, jnp.int32), jax.random.split(jax.random.key(9), n))
    emitted, count = np.asarray(emitted), np.asarray(count)
    for j in range(k + 1):
        rows = count > j
        freq = np.bincount(emitted[rows, j], minlength=v) / rows.sum()
        se = np.sqrt(p[j] * (1 - p[j]) / rows.sum())
        assert np.all(np.abs(freq - p[j]) <= 5 * se + 1e-4), (j, freq, p[j])


def test_draft_vocab_keeps_greedy_tokens_and_drafts_from_the_set(params):
    """Greedy with a draft vocabulary (half the ids; all of them shuffled) gives plain greedy's
    tokens; the MTP's drafts are ids of the set: an oracle draft hook that turns wrong whenever
    an MTP draft falls outside it would accept nothing."""
    c = CONFIG
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (5, 9)]
    plain = jd.generate(params, prompts, 12, eos_token_ids=[])
    half = rng.permutation(c.vocab_size)[:c.vocab_size // 2]
    for ids in (half, rng.permutation(c.vocab_size)):
        spec = jd.generate(params, prompts, 12, eos_token_ids=[], num_speculative_tokens=2,
                           draft_vocab=ids)
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))

    ref = jnp.asarray(np.asarray(plain.tokens))
    in_set = jnp.zeros(c.vocab_size, bool).at[jnp.asarray(half)].set(True)
    k = 2

    def oracle_if_in_set(loop, mtp_drafts):
        pos = loop.num_generated[:, None] + jnp.arange(k)[None, :]
        right = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)
        right = jnp.maximum(right, 0)  # past a row's end (pad -1): any id in the vocabulary
        ok = jnp.all(in_set[mtp_drafts])
        return jnp.where(ok, right, (right + 1) % c.vocab_size).astype(jnp.int32)

    padded = np.zeros((2, 9), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    loop = generation.speculative_generate_jit(
        params, jd.init_state(c, 2, 32, mtp=True), jnp.asarray(padded), jnp.asarray([5, 9]),
        jnp.asarray([12, 12]), jnp.full((8,), -1, jnp.int32), -1, num_speculative_tokens=k,
        max_new_tokens=12, kernels=jd.Kernels(), draft=oracle_if_in_set,
        draft_vocab=jnp.asarray(half, jnp.int32))
    np.testing.assert_array_equal(np.asarray(loop.tokens), np.asarray(plain.tokens)[:, :12])
    assert int(loop.accepted) >= 0.5 * 2 * 12  # nearly every draft right: all MTP drafts in set


def test_draft_vocab_errors(params):
    v = CONFIG.vocab_size
    for bad, match in (([[1, 2]], "1-D"), ([], "non-empty"), ([1.0, 2.0], "dtype float"),
                       ([0, v], rf"outside \[0, {v}\): \[{v}\]"), ([-1, 3], "outside"),
                       ([4, 5, 4], r"repeats ids: \[4\]"), ({1, 2}, r"not a set"),
                       ([[1], [2, 3]], "draft_vocab must be a 1-D array")):
        with pytest.raises(ValueError, match=match):
            jd.generate(params, [[1, 2]], 4, num_speculative_tokens=2, draft_vocab=bad)
    for off in (0, np.int32(0)):  # an int zero, numpy's too, is "off"
        with pytest.raises(ValueError, match="num_speculative_tokens > 0"):
            jd.generate(params, [[1, 2]], 4, draft_vocab=[1, 2], num_speculative_tokens=off)


def test_moe_mtp_layer_loads_per_expert_and_drafts(tmp_path):
    """An MoE model's MTP layer holds an MoE block: it loads from per-expert tensors
    (``mtp.layers.0.mlp.experts.{e}.*``, as save_pretrained writes them) and drafts."""
    import json

    from safetensors.numpy import save_file
    from test_checkpoint import MOE_CONFIG, per_expert
    config = dataclasses.replace(MOE_CONFIG, mtp_num_hidden_layers=1)
    params = jd.init_params(config, jax.random.key(7))
    assert params.mtp.layer.mlp.experts_gate_up_proj.shape[0] == config.num_experts
    tensors = per_expert({k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()},
                         config)
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in tensors
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = jd.load_checkpoint(tmp_path, dtype="float32", mtp=True)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = jd.generate(loaded, [[3, 1, 4, 1, 5]], 6, eos_token_ids=[], num_speculative_tokens=2)
    want = jd.generate(loaded, [[3, 1, 4, 1, 5]], 6, eos_token_ids=[])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_a_row_whose_logits_turn_nan_stops_invalid_in_both_loops(params):
    """A token whose embedding is NaN: the row that emits it gets NaN logits on the next step,
    emits -1 and stops with "invalid" (not "eos", though the EOS ids' padding is -1 too, and not
    a valid-looking id), in plain and speculative decoding alike; the other rows run on."""
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (4, 7, 3)]
    clean = np.asarray(jd.generate(params, prompts, 10, eos_token_ids=[]).token_lists())
    t = int(clean[0, 3])
    bad = params.replace(embed_tokens=params.embed_tokens.at[t].set(jnp.nan))
    hit = [int(np.argmax(row == t)) if (row == t).any() else None for row in clean]
    unused = [i for i in range(CONFIG.vocab_size) if i not in clean][:8]
    for eos in ([], unused):  # no EOS ids; every padded slot filled
        plain = jd.generate(bad, prompts, 10, eos_token_ids=eos)
        spec = jd.generate(bad, prompts, 10, eos_token_ids=eos, num_speculative_tokens=2)
        for out in (plain, spec):
            for r, row in enumerate(out.token_lists()):
                if hit[r] is None:
                    assert out.stop_reasons()[r] == "length" and row == clean[r].tolist()
                else:
                    assert row == clean[r, :hit[r] + 1].tolist() + [-1]
                    assert out.stop_reasons()[r] == "invalid"
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
