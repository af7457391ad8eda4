"""GQA decode attention: one new query token per row (or a few) against a KV cache.

Shapes: q [B, Hq, D], k_cache/v_cache [B, Hkv, S, D], kv_len [B] int32 (keys 0 .. kv_len[b]-1 of
row b are valid, the current token already written). Query head h uses KV head h // (Hq // Hkv)
(HF ``repeat_kv``); scores scaled by D**-0.5, softmax and accumulation in float32, output in q's
dtype. A few queries per row (a speculative verify step's k + 1 tokens, an MTP draft's): q [B,
T, Hq, D] with ``query_start`` [B] int32: query t sits at position ``query_start[b] + t`` and
attends to keys [0, min(query_start[b] + t + 1, kv_len[b])) (causal).
:func:`decode_attention_pallas` is a Pallas Mosaic GPU kernel (Hopper) with split-K
"flash decoding": program (b, kv head, split) streams its share of row b's keys through a TMA
pipeline of ``block_kv`` blocks with an online softmax and writes a float32 partial output and
its log2-sum-exp, which :func:`_combine` merges. :func:`decode_attention_reference` is the same
function in ``jnp``; ``jaxdecode.kernels.choice`` picks one.

Why the kernel looks the way it does:

* GQA: each K/V block is loaded once for the G query heads of its group, padded to the 64-row
  ``wgmma`` tile (rows are independent; decode is memory bound, so the wasted work is free).
  T queries fill T·G of the tile's rows (t-major), so the cache is still read once per row.
* Blocks past a row's length are never loaded: the row's real blocks are split between the
  static ``num_splits`` programs (:func:`choose_config`) by its real length.
* Entries at positions >= kv_len[b] may hold NaN: their scores are replaced (not multiplied) by
  -inf and the partial block's value rows zeroed before ``p @ v``.
* 16-bit caches: TMA into ``num_stages`` buffers with a barrier per K and per V buffer (``q k^T``
  starts before V lands); ``p`` goes through shared memory, the interpreter's only operand.
* G not a multiple of 8 (9B, 27B) is zero-padded by XLA (a TMA copy moves whole 8-row tiles).
* float32 caches: ``wgmma`` takes float32 only as tf32 and cannot transpose 32-bit operands, so
  tiles are split into bfloat16 ``hi + lo`` and multiplied as three bf16 terms (about 1e-5).

Sources: FlashAttention's online softmax (Dao et al., 2022), "flash decoding" (Dao, Haziza, Massa,
Sizov, 2023); structure after ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxdecode import invariance
from jaxdecode.kernels import wait_for_inputs

LOG2E = math.log2(math.e)
MAX_LEN_ALIGN = 64  # a max_len not a multiple of this makes the kernel pad (copy) the caches
TILE_M = 64  # rows of one wgmma tile: query heads of one group, zero-padded
NUM_SMS_H100 = 132  # SMs of an SXM Hopper GPU; used when the device does not say
SMEM_LIMIT_BYTES = 227 * 1024  # the most shared memory one Hopper block may use
SMEM_BUDGET_BYTES = 200 * 1024  # what choose_config fills with pipeline stages


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Static tuning knobs of :func:`decode_attention_pallas`."""
    block_kv: int = 64  # keys per pipeline step; a multiple of 64 (the p @ v contraction tile)
    num_stages: int = 2  # K/V blocks in flight per program (16-bit caches; 1 for float32)
    num_splits: int = 1  # programs per (row, KV head) sharing the row's keys (split-K)

    def __post_init__(self):
        if self.block_kv <= 0 or self.block_kv % 64:
            raise ValueError(f"{self.block_kv=} must be a positive multiple of 64")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")
        if self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")


def _swizzle_bytes(minor_bytes: int) -> int:
    """Largest wgmma swizzle (128, 64 or 32 bytes) dividing a row of ``minor_bytes``."""
    for swizzle in (128, 64, 32):
        if minor_bytes % swizzle == 0:
            return swizzle
    raise ValueError(f"{minor_bytes=} must be a multiple of 32 bytes")


def _smem_bytes(head_dim: int, block_kv: int, num_stages: int, cache_dtype) -> int:
    """Shared memory one program allocates (scratch + 4 KiB for barriers, alignment, reductions)."""
    fixed = 4096 + TILE_M * 4  # + lse staging
    out = TILE_M * head_dim * 4  # f32 output staging (aliases the K/V buffers)
    if jnp.dtype(cache_dtype).itemsize == 2:
        kv = 2 * num_stages * block_kv * head_dim * 2
        return fixed + TILE_M * head_dim * 2 + TILE_M * block_kv * 2 + max(kv, out)
    hi_lo = 4 * block_kv * head_dim * 2
    return fixed + 2 * TILE_M * head_dim * 2 + 2 * TILE_M * block_kv * 2 + max(hi_lo, out)


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", NUM_SMS_H100)) or NUM_SMS_H100
    except Exception:  # noqa: BLE001 - no device info is fine, it is only a heuristic
        return NUM_SMS_H100


def choose_config(batch: int, num_kv_heads: int, max_len: int, head_dim: int, cache_dtype,
                  num_sms: int | None = None) -> DecodeAttentionConfig:
    """Picks block size, pipeline depth and split count for one static shape.

    ``block_kv``: 128 where it divides ``max_len`` and head_dim <= 128 (16-bit caches), else 64.
    ``num_stages``: as many K/V buffers (2 to 4) as fit :data:`SMEM_BUDGET_BYTES` (float32: 1).
    ``num_splits`` minimises ``waves(s) * (blocks per split + 2)``, ``waves(s) = ceil(batch *
    num_kv_heads * s / num_sms)`` (one program per SM: each uses > 113 KiB of shared memory; 2
    blocks of fixed cost per program); ties go to fewer splits.
    """
    num_sms = num_sms or _num_sms()
    itemsize = jnp.dtype(cache_dtype).itemsize
    block_kv = 128 if (itemsize == 2 and head_dim <= 128 and max_len % 128 == 0) else 64
    if itemsize == 2:
        num_stages = 2
        while num_stages < 4 and _smem_bytes(head_dim, block_kv, num_stages + 1,
                                             cache_dtype) <= SMEM_BUDGET_BYTES:
            num_stages += 1
    else:
        num_stages = 1
    num_blocks = max(1, -(-max_len // block_kv))
    pairs = batch * num_kv_heads
    best, best_cost = 1, None
    for s in range(1, min(num_blocks, 4 * num_sms) + 1):
        cost = -(-pairs * s // num_sms) * (-(-num_blocks // s) + 2)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return DecodeAttentionConfig(block_kv=block_kv, num_stages=num_stages, num_splits=best)


def _lengths(len_gmem, b, causal):
    """Row ``b``'s (kv_len, query_start or None): ``len_gmem`` is kv_len [B] for one query per
    row, [2, B] (kv_len; query_start) for ``causal`` queries (q [B, T, Hq, D])."""
    if not causal:
        return len_gmem[b], None
    return len_gmem[0, b], len_gmem[1, b]


def _split_range(kv_len, s, *, max_len, block_kv, num_splits):
    """(length, first block, number of blocks) of split ``s`` of a row with ``kv_len`` keys
    (all int32 scalars)."""
    length = jnp.clip(kv_len, 0, max_len)
    num_blocks = lax.div(length + (block_kv - 1), block_kv)
    per_split = lax.div(num_blocks + (num_splits - 1), num_splits)
    first = s * per_split
    return length, first, jnp.clip(num_blocks - first, 0, per_split)


def _online_softmax_step(scores, start, length, m, l, *, scale, block_kv, query_start=None,
                         group=1):
    """Masks one [64, block_kv] score tile and updates the running max/sum (log2 domain).

    With a ``query_start`` (q [B, T, Hq, D]), tile row r is query r // ``group`` (position
    ``query_start + r // group``) and sees keys up to its position too. Returns (p [64,
    block_kv] f32, alpha [64] rescale of the old accumulator, m, l).
    """
    key = start + plgpu.broadcasted_iota(jnp.int32, (TILE_M, block_kv), 1,
                                         layout=plgpu.Layout.WGMMA)
    visible = key < length
    if query_start is not None:  # key <= query_start + r // group <=> (key - start) * group <= r
        row = plgpu.broadcasted_iota(jnp.int32, (TILE_M, block_kv), 0, layout=plgpu.Layout.WGMMA)
        ahead = jnp.minimum(jnp.maximum(key - query_start, -1), TILE_M)  # no int32 overflow
        visible &= ahead * group <= row
    scores = jnp.where(visible, scores * scale, -jnp.inf)  # where, not *: NaN past length
    m_new = jnp.maximum(m, scores.max(axis=1))  # one query: every loaded block has a valid key
    m_safe = m_new
    if query_start is not None:  # an earlier query may see none of a block or split: m = -inf
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
    return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _accumulate(acc, mma, *, interpret):
    """``acc`` plus what ``mma(acc_ref)`` (wgmma calls) adds, in place in registers on the GPU (a
    second [64, D] float32 tile would spill at D = 256); the interpreter, which has no
    ``run_state``, adds a fresh accumulator instead."""
    if interpret:
        def fresh(acc_ref):
            mma(acc_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def _register_operand(x, smem, *, interpret):
    """``x`` (registers) as a wgmma A operand: itself on the GPU; in the interpreter, which
    takes wgmma operands from shared memory only, written to ``smem`` (same shape) first."""
    if not interpret:
        return x
    smem[...] = x
    plgpu.commit_smem()
    return smem


def _write_partial(acc, m, l, o_smem, lse_smem, o_gmem, lse_gmem, *, rows):
    """Writes rows [0, rows) of the normalised partial output and its log2-sum-exp to GMEM (an
    empty split writes zeros and -inf, which the combine weights by 0)."""
    inv_l = jnp.where(l > 0, 1.0 / l, 0.0)
    o_smem[...] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_gmem)
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows)], lse_gmem)
    plgpu.wait_smem_to_gmem(0)


def _kernel_16bit(len_gmem,     # [B] int32 kv_len, or [2, B] (kv_len; query_start) (_lengths)
                  q_gmem,        # [B, Hkv, Gp, D] cache dtype (Gp: T·G rounded up to 8)
                  k_gmem,        # [B, Hkv, S, D]
                  v_gmem,        # [B, Hkv, S, D]
                  o_gmem,        # [B, Hkv, splits, Gp, D] f32
                  lse_gmem,      # [B, Hkv, splits, Gp] f32
                  q_smem,        # [64, D]
                  p_smem,        # [64, block_kv]
                  kvo_smem,      # union: ([stages, block_kv, D] x2) | [64, D] f32
                  lse_smem,      # [64] f32
                  q_barrier, k_barriers, v_barriers,
                  *, max_len, block_kv, num_stages, num_splits, rows, scale, causal, group,
                  interpret):
    wait_for_inputs(interpret)
    (k_smem, v_smem), o_smem = kvo_smem
    head_dim = q_smem.shape[-1]
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    # q first: its copy overlaps the latency of the kv_len[b] load that the K/V copies wait on.
    plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem.at[pl.ds(0, rows)], q_barrier)
    kv_len, query_start = _lengths(len_gmem, b, causal)
    length, first, n = _split_range(kv_len, s, max_len=max_len, block_kv=block_kv,
                                    num_splits=num_splits)

    def fetch(i, slot):
        keys = pl.ds((first + i) * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(k_gmem.at[b, h, keys], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[b, h, keys], v_smem.at[slot], v_barriers.at[slot])

    for i in range(num_stages):
        pl.when(i < n)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_barrier)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, num_stages)
        start = (first + i) * block_kv
        plgpu.barrier_wait(k_barriers.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((TILE_M, block_kv), jnp.float32))
        p, alpha, m, l = _online_softmax_step(scores, start, length, m, l, scale=scale,
                                              block_kv=block_kv, query_start=query_start,
                                              group=group)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when(start + block_kv > length)
        def _zero_values_past_length():
            row = start + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                                 layout=plgpu.Layout.WGMMA)
            v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
            v_smem.at[slot][...] = jnp.where(row < length, v, jnp.zeros_like(v))

        plgpu.commit_smem()  # p (and the zeroed values) visible to the tensor cores

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])

        acc = _accumulate(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), pv,
                          interpret=interpret)

        @pl.when(i + num_stages < n)
        def _refill():
            fetch(i + num_stages, slot)

        return acc, m, l

    acc = plgpu.layout_cast(jnp.zeros((TILE_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((TILE_M,), -jnp.inf, jnp.float32),
                          plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((TILE_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, m, l = lax.fori_loop(0, n, step, (acc, m, l))
    _write_partial(acc, m, l, o_smem, lse_smem, o_gmem.at[b, h, s], lse_gmem.at[b, h, s],
                   rows=rows)


def _split_hi_lo(x):
    """float32 -> (hi, lo) bfloat16 with hi + lo == x to about 2**-17 relative."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _kernel_f32(len_gmem,     # [B] or [2, B] int32 (_kernel_16bit)
                q_gmem,        # [B, Hkv, Gp, D] f32
                k_gmem,        # [B, Hkv, S, D] f32
                v_gmem,        # [B, Hkv, S, D] f32
                o_gmem,        # [B, Hkv, splits, Gp, D] f32
                lse_gmem,      # [B, Hkv, splits, Gp] f32
                q_hi, q_lo,    # [64, D] bf16 each
                p_hi, p_lo,    # [64, block_kv] bf16 each
                union_smem,    # [64, D] f32 q staging | 4 x [block_kv, D] bf16 | [64, D] f32 out
                lse_smem,      # [64] f32
                q_barrier,
                *, max_len, block_kv, num_splits, rows, scale, causal, group, interpret):
    wait_for_inputs(interpret)
    (q32_smem,), (k_hi, k_lo, v_hi, v_lo), (o_smem,) = union_smem
    head_dim = q_hi.shape[-1]
    chunk = min(64, head_dim)  # columns converted at a time (bounds register use)
    wgmma_layout = plgpu.Layout.WGMMA
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    kv_len, query_start = _lengths(len_gmem, b, causal)
    length, first, n = _split_range(kv_len, s, max_len=max_len, block_kv=block_kv,
                                    num_splits=num_splits)

    plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q32_smem.at[pl.ds(0, rows)], q_barrier)
    plgpu.barrier_wait(q_barrier)
    hi, lo = _split_hi_lo(plgpu.load(q32_smem, layout=wgmma_layout))
    q_hi[...] = hi
    q_lo[...] = lo

    def step(i, carry):
        acc, m, l = carry
        start = (first + i) * block_kv
        keys = pl.ds(start, block_kv)
        row = start + plgpu.broadcasted_iota(jnp.int32, (block_kv, chunk), 0, layout=wgmma_layout)
        for c in range(0, head_dim, chunk):  # plain loads GMEM -> registers (Mosaic: unoptimized)
            cols = pl.ds(c, chunk)
            k = plgpu.load(k_gmem.at[b, h, keys, cols], layout=wgmma_layout, optimized=False)
            hi, lo = _split_hi_lo(k)
            k_hi.at[:, cols][...] = hi
            k_lo.at[:, cols][...] = lo
            v = plgpu.load(v_gmem.at[b, h, keys, cols], layout=wgmma_layout, optimized=False)
            hi, lo = _split_hi_lo(jnp.where(row < length, v, jnp.zeros_like(v)))
            v_hi.at[:, cols][...] = hi
            v_lo.at[:, cols][...] = lo
        plgpu.commit_smem()

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_hi, k_hi.T)
            plgpu.wgmma(acc_ref, q_lo, k_hi.T)
            plgpu.wgmma(acc_ref, q_hi, k_lo.T)
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((TILE_M, block_kv), jnp.float32))
        p, alpha, m, l = _online_softmax_step(scores, start, length, m, l, scale=scale,
                                              block_kv=block_kv, query_start=query_start,
                                              group=group)
        hi, lo = _split_hi_lo(p)
        p_hi[...] = hi
        p_lo[...] = lo
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_hi, v_hi)
            plgpu.wgmma(acc_ref, p_lo, v_hi)
            plgpu.wgmma(acc_ref, p_hi, v_lo)

        acc = _accumulate(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), pv,
                          interpret=interpret)
        return acc, m, l

    acc = plgpu.layout_cast(jnp.zeros((TILE_M, head_dim), jnp.float32), wgmma_layout)
    m = plgpu.layout_cast(jnp.full((TILE_M,), -jnp.inf, jnp.float32), wgmma_layout.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((TILE_M,), jnp.float32), wgmma_layout.reduce(1))
    acc, m, l = lax.fori_loop(0, n, step, (acc, m, l))
    _write_partial(acc, m, l, o_smem, lse_smem, o_gmem.at[b, h, s], lse_gmem.at[b, h, s],
                   rows=rows)


def _smem_tile(shape, dtype):
    """A shared-memory ref tiled and swizzled for wgmma along its minor dimension."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = _swizzle_bytes(shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def check_supported(q_shape, k_shape, cache_dtype) -> str | None:
    """Why :func:`decode_attention_pallas` cannot take these shapes/dtype (q [B, Hq, D] or [B,
    T, Hq, D]), or None if it can."""
    queries = q_shape[1] if len(q_shape) == 4 else 1
    num_heads, head_dim = q_shape[-2:]
    _, num_kv_heads, _, _ = k_shape
    if jnp.dtype(cache_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                      jnp.dtype(jnp.float32)):
        return f"cache dtype {jnp.dtype(cache_dtype)} (the kernel takes bfloat16, float16, float32)"
    if head_dim % 64 or not 64 <= head_dim <= 256:
        return f"{head_dim=} (the kernel takes multiples of 64 up to 256)"
    group = num_heads // num_kv_heads
    if -(-group * queries // 8) * 8 > TILE_M:
        return (f"{queries} queries x {group} query heads per KV head (the kernel takes up to "
                f"{TILE_M} in all)")
    return None


def decode_attention_pallas(q, k_cache, v_cache, kv_len, query_start=None, *,
                            config: DecodeAttentionConfig | None = None,
                            batch_invariant: bool = False, interpret: bool = False):
    """Decode attention as a Pallas Mosaic GPU kernel (Hopper) plus an XLA split combine.

    Arguments and result as :func:`decode_attention_reference`, plus: caches bfloat16, float16
    or float32 (q is cast to their dtype), D a multiple of 64 up to 256, T·G <= 64, else
    ValueError (:func:`check_supported`); an S not a multiple of ``block_kv`` is zero-padded (a
    copy: allocate multiples of ``MAX_LEN_ALIGN``). ``config``: None picks :func:`choose_config`;
    ``batch_invariant``: merge the splits by elementwise ops in split order, in fixed groups of
    rows (``jaxdecode.invariance.map_row_groups``), so a row's result does not depend on the
    batch (with a fixed ``config``); ``interpret``: run in the Mosaic GPU interpreter (CPU).
    """
    kv_len, query_start = _as_arrays(kv_len, query_start)
    queries = _check_queries(q, query_start)
    batch, num_heads, head_dim = q.shape[0], *q.shape[-2:]
    _, num_kv_heads, max_len, _ = k_cache.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"{q.shape=}, {k_cache.shape=}, {v_cache.shape=} do not match "
                         "[B, (T,) Hq, D], [B, Hkv, S, D], [B, Hkv, S, D]")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{k_cache.dtype=} != {v_cache.dtype=}")
    if kv_len.shape != (batch,):
        raise ValueError(f"{kv_len.shape=} must be ({batch},)")
    if (why := check_supported(q.shape, k_cache.shape, k_cache.dtype)) is not None:
        raise ValueError(f"decode_attention_pallas does not take {why}")
    cache_dtype = k_cache.dtype
    is_f32 = jnp.dtype(cache_dtype).itemsize == 4
    if config is None:
        config = choose_config(batch, num_kv_heads, max_len, head_dim, cache_dtype)
    block_kv, num_splits = config.block_kv, config.num_splits
    smem = _smem_bytes(head_dim, block_kv, config.num_stages, cache_dtype)
    if smem > SMEM_LIMIT_BYTES:
        raise ValueError(f"{config=} needs about {smem} bytes of shared memory for {head_dim=}, "
                         f"over the {SMEM_LIMIT_BYTES} a Hopper block may use")
    if max_len % block_kv:
        pad = ((0, 0), (0, 0), (0, -max_len % block_kv), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)

    group = num_heads // num_kv_heads
    used = queries * group  # tile rows t * G + g
    rows = -(-used // 8) * 8  # TMA into the tiled q buffer moves whole 8-row tiles
    qg = q.reshape(batch, queries, num_kv_heads, group, head_dim).astype(cache_dtype)
    qg = jnp.moveaxis(qg, 2, 1).reshape(batch, num_kv_heads, used, head_dim)
    if rows != used:  # a tiny copy; inside the model XLA fuses it into RoPE
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - used), (0, 0)))
    lengths = kv_len.astype(jnp.int32)
    causal = query_start is not None
    if causal:
        lengths = jnp.stack([lengths, query_start.astype(jnp.int32)])

    statics = dict(max_len=max_len, block_kv=block_kv, num_splits=num_splits, rows=rows,
                   scale=head_dim**-0.5 * LOG2E, causal=causal, group=group,
                   interpret=interpret)
    out_f32 = lambda x: _smem_tile(x, jnp.float32)  # noqa: E731
    if is_f32:
        body = functools.partial(_kernel_f32, **statics)
        scratch = (
            *(_smem_tile((TILE_M, head_dim), jnp.bfloat16) for _ in range(2)),  # q hi, lo
            *(_smem_tile((TILE_M, block_kv), jnp.bfloat16) for _ in range(2)),  # p hi, lo
            plgpu.RefUnion((out_f32((TILE_M, head_dim)),),
                           tuple(_smem_tile((block_kv, head_dim), jnp.bfloat16) for _ in range(4)),
                           (out_f32((TILE_M, head_dim)),)),
            plgpu.SMEM((TILE_M,), jnp.float32),
            plgpu.Barrier(),
        )
    else:
        stages = config.num_stages
        body = functools.partial(_kernel_16bit, num_stages=stages, **statics)
        kv_buffers = _smem_tile((stages, block_kv, head_dim), cache_dtype)
        scratch = (
            _smem_tile((TILE_M, head_dim), cache_dtype),
            _smem_tile((TILE_M, block_kv), cache_dtype),
            plgpu.RefUnion((kv_buffers, kv_buffers), out_f32((TILE_M, head_dim))),
            plgpu.SMEM((TILE_M,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        )
    out_type = (
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows), jnp.float32),
    )
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch,
        grid=(batch, num_kv_heads, num_splits), grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    o_part, lse = kernel(lengths, qg, k_cache, v_cache)
    o_part, lse = o_part[:, :, :, :used], lse[:, :, :, :used]
    if batch_invariant:
        out = invariance.map_row_groups(lambda _, o, m: _combine(o, m, ordered=True), None,
                                        o_part, lse)
    else:
        out = _combine(o_part, lse)  # [B, Hkv, T·G, D]
    out = jnp.moveaxis(out.reshape(batch, num_kv_heads, queries, group, head_dim), 2, 1)
    return out.reshape(q.shape).astype(q.dtype)


def _as_arrays(kv_len, query_start):
    """kv_len and query_start (None stays None) as arrays: lists and numpy arrays are taken."""
    return jnp.asarray(kv_len), None if query_start is None else jnp.asarray(query_start)


def _check_queries(q, query_start) -> int:
    """T, the queries per row: 1 for q [B, Hq, D] (``query_start`` None), T for q [B, T, Hq, D]
    (``query_start`` [B] required). ValueError otherwise."""
    if q.ndim == 3 and query_start is None:
        return 1
    if (q.ndim == 4 and q.shape[1] >= 1 and query_start is not None
            and query_start.shape == (q.shape[0],)):
        return q.shape[1]
    raise ValueError(f"{q.shape=} with query_start "
                     f"{None if query_start is None else query_start.shape}: expected q [B, Hq, "
                     "D] without query_start, or q [B, T >= 1, Hq, D] with query_start [B]")


def _combine(o_part, lse, *, ordered: bool = False):
    """Merges split partials: [B, Hkv, splits, G, D] f32 and [B, Hkv, splits, G] -> [B, Hkv, G, D],
    weights 2**(lse_s - max lse) / sum (each split is normalised); rows with no key give zeros.
    ``ordered``: sums split by split (elementwise ops only)."""
    if ordered:
        splits = range(lse.shape[2])
        lse_max = functools.reduce(jnp.maximum, (lse[:, :, s] for s in splits))[:, :, None]
    else:
        lse_max = jnp.max(lse, axis=2, keepdims=True)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weight = jnp.exp2(lse - lse_max)  # [B, Hkv, splits, G]; 0 for empty splits
    if ordered:
        total = functools.reduce(jnp.add, (weight[:, :, s] for s in splits))
        out = functools.reduce(jnp.add, (weight[:, :, s, :, None] * o_part[:, :, s]
                                          for s in splits))
    else:
        total = jnp.sum(weight, axis=2)
        out = jnp.einsum("bksg,bksgd->bkgd", weight, o_part, precision=lax.Precision.HIGHEST)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def decode_attention_reference(q, k_cache, v_cache, kv_len, query_start=None):
    """Pure-JAX (XLA) decode attention, HF ``eager_attention_forward`` for one query per row
    (or T: the module docstring).

    q: [B, Hq, D] (after q_norm and RoPE), or [B, T, Hq, D] with ``query_start`` [B] int32;
    k_cache, v_cache: [B, Hkv, S, D]; kv_len: [B] int32 valid positions per row. Returns q's
    shape in q.dtype, zeros for a query that sees no key; entries at positions >= kv_len[b]
    (even NaN) never affect row b.
    """
    kv_len, query_start = _as_arrays(kv_len, query_start)
    queries = _check_queries(q, query_start)
    batch, num_heads, head_dim = q.shape[0], *q.shape[-2:]
    _, num_kv_heads, max_len, _ = k_cache.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, queries, num_kv_heads, group, head_dim).astype(jnp.float32)
    key = jnp.arange(max_len)
    valid = key[None, :] < kv_len[:, None]  # [B, S]
    k = jnp.where(valid[:, None, :, None], k_cache, 0).astype(jnp.float32)
    v = jnp.where(valid[:, None, :, None], v_cache, 0).astype(jnp.float32)
    seen = valid[:, None, :]  # [B, T, S]
    if query_start is not None:
        position = query_start[:, None] + jnp.arange(queries)[None, :]  # [B, T]
        seen = seen & (key[None, None, :] <= position[..., None])
    one = query_start is None  # its einsums without the T axis: XLA's dot for those rounds
    # differently on the CPU, and the one-query path keeps its results bit for bit
    if one:
        scores = jnp.einsum("bkgd,bksd->bkgs", qg[:, 0], k)[:, None]
    else:
        scores = jnp.einsum("btkgd,bksd->btkgs", qg, k)
    scores = jnp.where(seen[:, :, None, None, :], scores * (head_dim**-0.5), -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if one:
        out = jnp.einsum("bkgs,bksd->bkgd", p[:, 0], v)[:, None]
    else:
        out = jnp.einsum("btkgs,bksd->btkgd", p, v)
    out = out / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(q.shape).astype(q.dtype)
