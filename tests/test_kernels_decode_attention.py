"""jaxdecode.kernels.decode_attention: the Pallas Mosaic GPU kernel and the XLA reference against
float64 numpy, the kernel's CUDA lowering (checked on CPU), and greedy decoding through the model
with the kernel.

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``@pytest.mark.gpu``: ``pytest -m gpu`` on an sm_90 machine;
skipped without one).

Grid pruning for the interpreter (the file must stay under ~3 minutes on 2 CPU cores):
  * every (heads, kv heads) x head_dim pair runs once, with the lengths {1, 63, 64, 65, 300}
    as the 5 rows of one batch (so one call covers every length);
  * the ragged batch (0, 1, 1000) runs for 3 of the 12 pairs (one of each group size class:
    G = 4, 1 and 16), float32 caches for 2 pairs, and explicit split/stage configs on the
    smallest shape;
  * the reference runs the full cross product (cheap, but 48 compiles: 8 in the quick run).
On the GPU everything runs compiled, plus contexts up to 128k and a repeat-run bit check.
Inputs are fresh standard normals (jax.random, a new key per test); NaN is planted in the
cache past every row's length.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import (ATTENTION_TOL, GPU_ONLY, MODES, assert_attention_close, attention_inputs,
                      attention_reference_f64, lower_for_cuda_text, tiny)
from jaxdecode.kernels import choice
from jaxdecode.kernels import decode_attention as da

bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32

HEADS = {"8x2": (8, 2), "16x4": (16, 4), "24x4": (24, 4), "32x2": (32, 2), "8x8": (8, 8),
         "16x1": (16, 1)}
HEAD_DIMS = (256, 128)
LENGTHS = (1, 63, 64, 65, 300)  # one batch row each; 64 = one block, 65 and 300 ragged
LENGTHS_MAX_LEN = 320
RAGGED = (0, 1, 1000)  # an empty row, a single key and a long row in one batch
RAGGED_MAX_LEN = 1024
RAGGED_PAIRS = {"16x4-d256": ((16, 4), 256), "8x8-d128": ((8, 8), 128),
                "16x1-d128": ((16, 1), 128)}
F32_PAIRS = {"16x4-d128": ((16, 4), 128), "16x1-d256": ((16, 1), 256)}


def check(out, q, k, v, lengths, dtype=bf16):
    """``out`` against the float64 reference, at ``dtype``'s tolerance."""
    return assert_attention_close(out, attention_reference_f64(q, k, v, lengths), lengths,
                                  ATTENTION_TOL[dtype])


def run_kernel(mode, q, k, v, lengths, config=None, batch_invariant=False):
    return jax.jit(lambda *a: da.decode_attention_pallas(
        *a, config=config, batch_invariant=batch_invariant,
        interpret=(mode == "interpret")))(q, k, v, lengths)


# ----- the kernel -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_kernel_lengths(mode, heads, head_dim):
    q, k, v, lengths = attention_inputs(0, heads, head_dim, LENGTHS_MAX_LEN, LENGTHS, bf16)
    out = run_kernel(mode, q, k, v, lengths)
    assert out.dtype == q.dtype
    check(out, q, k, v, lengths)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads, head_dim", RAGGED_PAIRS.values(), ids=RAGGED_PAIRS.keys())
def test_kernel_ragged_batch(mode, heads, head_dim):
    q, k, v, lengths = attention_inputs(1, heads, head_dim, RAGGED_MAX_LEN, RAGGED, jnp.bfloat16)
    out = run_kernel(mode, q, k, v, lengths)
    check(out, q, k, v, lengths)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads, head_dim", F32_PAIRS.values(), ids=F32_PAIRS.keys())
def test_kernel_float32_cache(mode, heads, head_dim):
    q, k, v, lengths = attention_inputs(2, heads, head_dim, LENGTHS_MAX_LEN, LENGTHS, jnp.float32)
    out = run_kernel(mode, q, k, v, lengths)
    assert out.dtype == jnp.float32
    check(out, q, k, v, lengths, f32)


CONFIGS = {
    "3splits-2stages": da.DecodeAttentionConfig(block_kv=64, num_stages=2, num_splits=3),
    "1split-wraps-stages": da.DecodeAttentionConfig(block_kv=64, num_stages=2, num_splits=1),
    "3stages": da.DecodeAttentionConfig(block_kv=64, num_stages=3, num_splits=2),
    "block128": da.DecodeAttentionConfig(block_kv=128, num_stages=2, num_splits=2),
    "more-splits-than-blocks": da.DecodeAttentionConfig(block_kv=128, num_stages=2, num_splits=7),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_kernel_configs(mode, config):
    lengths = (700, 0, 129, 1)
    q, k, v, lengths = attention_inputs(3, (8, 2), 128, 768, lengths, jnp.bfloat16)
    out = run_kernel(mode, q, k, v, lengths, config)
    check(out, q, k, v, lengths)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_batch_invariant_merge(mode):
    """batch_invariant=True (the split merge in fixed row groups, in split order) against
    float64, 66 rows: two row groups, ragged lengths."""
    rng = np.random.default_rng(8)
    lengths = tuple(int(n) for n in rng.integers(0, 129, 66))
    q, k, v, kv_len = attention_inputs(8, (8, 2), 64, 128, lengths, bf16)
    config = da.choose_config(1, 2, 128, 64, bf16)
    check(run_kernel(mode, q, k, v, kv_len, config=config, batch_invariant=True), q, k, v, kv_len)


def test_ordered_combine_merges_the_splits_as_the_reduction_does():
    """The batch-invariant combine (split by split, elementwise) == the einsum combine, with
    empty splits (-inf) and an empty row."""
    key = jax.random.key(11)
    o_part = jax.random.normal(key, (3, 2, 5, 4, 16), f32)
    lse = jax.random.normal(jax.random.fold_in(key, 1), (3, 2, 5, 4), f32) * 3
    lse = lse.at[0, :, 3:].set(-jnp.inf).at[2].set(-jnp.inf)
    ordered, plain = da._combine(o_part, lse, ordered=True), da._combine(o_part, lse)
    np.testing.assert_allclose(np.asarray(ordered), np.asarray(plain), rtol=1e-6, atol=1e-6)
    assert (np.asarray(ordered)[2] == 0).all()
    text = jax.jit(lambda o, l: da._combine(o, l, ordered=True)).lower(o_part, lse).as_text()
    assert "reduce" not in text and "dot_general" not in text


@pytest.mark.slow
def test_kernel_pads_odd_max_len():
    lengths = (70, 5)
    q, k, v, lengths = attention_inputs(4, (8, 2), 64, 100, lengths, jnp.bfloat16)
    out = run_kernel("interpret", q, k, v, lengths)
    check(out, q, k, v, lengths)


# A verify step's / MTP draft's few queries per row: (query_start, kv_len) per row. Query t sits
# at query_start + t and sees keys [0, min(query_start + t + 1, kv_len)). Rows: a new prompt, the
# last T positions ending on and across block boundaries, padding queries (kv_len < start + T),
# and an empty row.
QUERY_ROWS = ((0, 4), (60, 64), (62, 66), (296, 300), (10, 12), (0, 0))
QUERY_CASES = {"16x4-d256-T4": ((16, 4), 256, 4, bf16), "8x2-d128-T8": ((8, 2), 128, 8, bf16),
               "16x1-d128-T3": ((16, 1), 128, 3, bf16), "8x2-d64-T1": ((8, 2), 64, 1, bf16),
               "16x4-d128-T4-f32": ((16, 4), 128, 4, f32)}


def query_inputs(seed, heads, head_dim, queries, dtype, rows=QUERY_ROWS, max_len=320):
    """q [B, T, Hq, D], caches (NaN past each row's kv_len), kv_len, query_start: fresh normals."""
    starts, lengths = (jnp.asarray(x, i32) for x in zip(*rows))
    _, k, v, _ = attention_inputs(seed, heads, head_dim, max_len, lengths, dtype)
    q = jax.random.normal(jax.random.key(seed + 100), (len(rows), queries, heads[0], head_dim),
                          dtype)
    return q, k, v, lengths, starts


def check_queries(out, q, k, v, lengths, starts, dtype):
    """Every (row, query) against the float64 reference over the keys it sees."""
    batch, queries = q.shape[:2]
    seen = np.minimum(np.asarray(starts)[:, None] + np.arange(queries)[None, :] + 1,
                      np.asarray(lengths)[:, None]).reshape(-1)
    flat = lambda x: jnp.repeat(x, queries, axis=0)  # noqa: E731
    q1 = q.reshape(batch * queries, *q.shape[2:])
    expected = attention_reference_f64(q1, flat(k), flat(v), seen)
    return assert_attention_close(out.reshape(q1.shape), expected, seen, ATTENTION_TOL[dtype])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads, head_dim, queries, dtype", QUERY_CASES.values(),
                         ids=QUERY_CASES.keys())
def test_kernel_queries(mode, heads, head_dim, queries, dtype):
    q, k, v, lengths, starts = query_inputs(20, heads, head_dim, queries, dtype)
    out = jax.jit(lambda *a: da.decode_attention_pallas(*a, interpret=(mode == "interpret")))(
        q, k, v, lengths, starts)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_queries(out, q, k, v, lengths, starts, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_queries_with_splits(mode):
    """Splits that hold no key an earlier query sees (its partial must weigh 0, not NaN)."""
    rows = ((250, 256), (120, 128), (0, 3))
    q, k, v, lengths, starts = query_inputs(21, (8, 2), 64, 8, bf16, rows, max_len=256)
    config = da.DecodeAttentionConfig(block_kv=64, num_stages=2, num_splits=4)
    out = jax.jit(lambda *a: da.decode_attention_pallas(
        *a, config=config, interpret=(mode == "interpret")))(q, k, v, lengths, starts)
    check_queries(out, q, k, v, lengths, starts, bf16)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_queries_far_positions(mode):
    """query_start near 2**31 / G: the causal comparison must not wrap around in int32."""
    rows = ((2**28, 128), (2**27 + 5, 100))
    q, k, v, lengths, starts = query_inputs(24, (16, 1), 64, 2, bf16, rows, max_len=128)
    out = jax.jit(lambda *a: da.decode_attention_pallas(*a, interpret=(mode == "interpret")))(
        q, k, v, lengths, starts)
    check_queries(out, q, k, v, lengths, starts, bf16)


@pytest.mark.parametrize("heads, head_dim, queries, dtype", QUERY_CASES.values(),
                         ids=QUERY_CASES.keys())
def test_reference_queries(heads, head_dim, queries, dtype):
    q, k, v, lengths, starts = query_inputs(22, heads, head_dim, queries, dtype)
    out = jax.jit(da.decode_attention_reference)(q, k, v, lengths, starts)
    check_queries(out, q, k, v, lengths, starts, dtype)


def test_lengths_as_python_lists():
    """kv_len and query_start as Python lists (unjitted calls): the same as arrays, for the
    reference and the kernel's checks (its shape checks read ``.shape``)."""
    q, k, v, lengths, starts = query_inputs(23, (8, 2), 64, 3, bf16)
    want = da.decode_attention_reference(q, k, v, lengths, starts)
    got = da.decode_attention_reference(q, k, v, np.asarray(lengths).tolist(),
                                        np.asarray(starts).tolist())
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    one = da.decode_attention_reference(q[:, 0], k, v, np.asarray(lengths).tolist())
    check(one, q[:, 0], k, v, lengths)
    with pytest.raises(ValueError, match=r"kv_len.shape=\(1,\) must be"):
        da.decode_attention_pallas(q, k, v, [5], np.asarray(starts).tolist(), interpret=True)


def test_queries_rejected_beyond_the_tile():
    q, k, v, lengths, starts = query_inputs(23, (16, 1), 64, 5, bf16)  # 5 x 16 rows > 64
    with pytest.raises(ValueError, match="5 queries x 16 query heads"):
        da.decode_attention_pallas(q, k, v, lengths, starts, interpret=True)
    with pytest.raises(ValueError, match="query_start"):
        da.decode_attention_pallas(q, k, v, lengths, interpret=True)
    with pytest.raises(ValueError, match="query_start"):
        da.decode_attention_reference(q[:, 0], k, v, lengths, starts)
    with pytest.raises(ValueError, match="T >= 1"):  # no query at all
        da.decode_attention_pallas(q[:, :0], k, v, lengths, starts, interpret=True)


def test_kernel_rejects_what_it_cannot_do():
    q, k, v, lengths = attention_inputs(0, (4, 2), 32, 64, (3, 3), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim=32"):
        da.decode_attention_pallas(q, k, v, lengths, interpret=True)
    with pytest.raises(ValueError, match="block_kv=96"):
        da.DecodeAttentionConfig(block_kv=96)
    q, k, v, lengths = attention_inputs(0, (4, 2), 256, 128, (3, 3), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        da.decode_attention_pallas(q, k, v, lengths, interpret=True,
                                   config=da.DecodeAttentionConfig(block_kv=128, num_stages=2))


# ----- GPU only: long contexts, bf16 tolerance at scale, determinism ---------------------------

LONG = {"9b-128k": ((16, 4), 256, (131072, 100_003, 1)),
        "27b-32k": ((24, 4), 256, (32768, 30_001)),
        "16x1-d128-64k": ((16, 1), 128, (65536, 4097))}


@pytest.mark.parametrize("heads, head_dim, lengths", LONG.values(), ids=LONG.keys())
@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
def test_kernel_long_context(_, heads, head_dim, lengths):
    q, k, v, lengths_arr = attention_inputs(5, heads, head_dim, max(lengths), lengths, bf16)
    out = run_kernel("gpu", q, k, v, lengths_arr)
    check(out, q, k, v, lengths_arr)


@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
def test_kernel_is_deterministic(_):
    q, k, v, lengths = attention_inputs(6, (16, 4), 256, 8192, (8192, 5000, 300, 0), jnp.bfloat16)
    fn = jax.jit(da.decode_attention_pallas)
    first = np.asarray(fn(q, k, v, lengths))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(q, k, v, lengths)), first)


# ----- the reference ----------------------------------------------------------------------------

def _reference_grid():
    """The full cross product; the quick run (-m "not slow") keeps head_dim 128 with 4 query
    heads per KV head (8x2) and with 16 (16x1), every length set and dtype."""
    for heads_id, heads in HEADS.items():
        for head_dim in HEAD_DIMS:
            for lengths_id, lengths, max_len in (("lengths", LENGTHS, LENGTHS_MAX_LEN),
                                                 ("ragged", RAGGED, RAGGED_MAX_LEN)):
                for dtype_id, dtype in (("f32", f32), ("bf16", bf16)):
                    quick = head_dim == 128 and heads_id in ("8x2", "16x1")
                    yield pytest.param(heads, head_dim, lengths, max_len, dtype,
                                       id=f"{heads_id}-{head_dim}-{lengths_id}-{dtype_id}",
                                       marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize("heads, head_dim, lengths, max_len, dtype", list(_reference_grid()))
def test_reference(heads, head_dim, lengths, max_len, dtype):
    q, k, v, lengths = attention_inputs(7, heads, head_dim, max_len, lengths, dtype)
    out = jax.jit(da.decode_attention_reference)(q, k, v, lengths)
    assert out.dtype == q.dtype
    check(out, q, k, v, lengths, dtype)


# ----- configuration ---------------------------------------------------------------------------

def test_choose_config():
    for heads, kv_heads in HEADS.values():
        for head_dim in (64, 128, 256):
            for dtype in (jnp.bfloat16, jnp.float32):
                cfg = da.choose_config(1, kv_heads, 8192, head_dim, dtype, num_sms=132)
                smem = da._smem_bytes(head_dim, cfg.block_kv, cfg.num_stages, dtype)
                assert smem <= da.SMEM_LIMIT_BYTES, f"{cfg=} {head_dim=} {smem=}"
    # Qwen3.5-9B attention (4 KV heads): one wave of 132 programs at batch 1 and 8 ...
    assert da.choose_config(1, 4, 131072, 256, jnp.bfloat16, num_sms=132).num_splits == 33
    cfg = da.choose_config(8, 4, 8192, 256, jnp.bfloat16, num_sms=132)
    assert 32 * cfg.num_splits % 132 == 0 or 32 * cfg.num_splits <= 132, cfg
    # ... and no split once the batch alone fills the chip.
    assert da.choose_config(64, 4, 8192, 256, jnp.bfloat16, num_sms=132).num_splits == 1
    # A short cache never asks for more splits than it has blocks.
    assert da.choose_config(1, 4, 320, 256, jnp.bfloat16, num_sms=132).num_splits <= 5


# ----- end to end: greedy decoding through the model --------------------------------------------

E2E_MODES = [pytest.param("cpu", id="interpret-or-gpu", marks=pytest.mark.slow),
             pytest.param("gpu", id="gpu", marks=GPU_ONLY)]


@pytest.mark.parametrize("mode", E2E_MODES)
def test_greedy_decode_kernel_equals_reference(mode):
    config = tiny(vocab_size=1000, head_dim=64)  # a head_dim the kernel takes
    params = jd.init_params(config, jax.random.key(0))
    prompt = np.random.default_rng(10).integers(0, config.vocab_size, (2, 11)).astype(np.int32)
    prompt_lengths = np.array([11, 6], np.int32)
    steps = 6

    def greedy(kernels):
        state = jd.init_state(config, batch_size=2, max_len=128)
        logits, state = jd.prefill(params, state, prompt, prompt_lengths)
        tokens, all_logits = [], []
        for _ in range(steps):
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens.append(np.asarray(token))
            logits, state = jd.decode_step(params, state, token, kernels=kernels)
            all_logits.append(np.asarray(logits))
        return np.stack(tokens, 1), np.stack(all_logits, 1)

    ref_tokens, ref_logits = greedy(choice.XLA)
    kernel_tokens, kernel_logits = greedy(choice.Kernels(attention="pallas"))
    np.testing.assert_array_equal(kernel_tokens, ref_tokens)
    scale = np.abs(ref_logits).max()
    assert np.abs(kernel_logits - ref_logits).max() <= 1e-4 * scale


# ----- the CUDA lowering, on CPU ---------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [(16, 4, 256, bf16), (16, 2, 256, bf16),
                                                           (8, 8, 128, f32)])
def test_decode_attention_lowers(heads, kv_heads, head_dim, dtype):
    text = lower_for_cuda_text(da.decode_attention_pallas, ((2, heads, head_dim), dtype),
                               ((2, kv_heads, 1024, head_dim), dtype),
                               ((2, kv_heads, 1024, head_dim), dtype), ((2,), i32))
    assert "custom_call @mosaic_gpu" in text
    # and with a verify step's 4 queries per row (the causal mask's integer ops)
    text = lower_for_cuda_text(da.decode_attention_pallas, ((2, 4, heads, head_dim), dtype),
                               ((2, kv_heads, 1024, head_dim), dtype),
                               ((2, kv_heads, 1024, head_dim), dtype), ((2,), i32), ((2,), i32))
    assert "custom_call @mosaic_gpu" in text


@pytest.mark.perf
@pytest.mark.parametrize("dtype", [bf16, f32], ids=["bf16", "f32"])
def test_kernel_uses_programmatic_dependent_launch(dtype):
    """The kernel starts with jaxdecode.kernels.wait_for_inputs, which marks it for
    programmatic dependent launch: the custom call carries mosaic_gpu.uses_pdl. (The attribute
    says the kernel waits for its inputs (griddepcontrol.wait); whether it also lets the next
    kernel launch early is not visible at this level.)"""
    text = lower_for_cuda_text(da.decode_attention_pallas, ((1, 16, 256), dtype),
                               ((1, 4, 1280, 256), dtype), ((1, 4, 1280, 256), dtype),
                               ((1,), i32))
    assert re.search(r"custom_call @mosaic_gpu", text), text[-3000:]
    assert "mosaic_gpu.uses_pdl" in text
