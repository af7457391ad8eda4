"""Causal GQA prefill attention: T new queries per row over its KV cache (earlier tokens + the new
ones, already written).

Shapes: q [B, T, Hq, D] (after q_norm and RoPE), k_cache/v_cache [B, Hkv, S, D], start [B] int32
(tokens already in the row before this call), num_new [B] int32 (real queries: t < num_new[b]).
Query t of row b sits at position ``start[b] + t`` and sees keys ``s <= start[b] + t`` (all of
them below ``end = start + num_new``); query head h reads KV head h // (Hq // Hkv) (HF
``repeat_kv``); scores scaled by D**-0.5, softmax in float32; padding queries (t >= num_new) are
don't-care. :func:`prefill_attention_reference` is HF ``eager_attention_forward`` in ``jnp``;
:func:`prefill_attention_pallas` the same as a Pallas Mosaic GPU kernel (Hopper).

Why the kernel looks the way it does (after ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``,
FlashAttention-3: Shah et al., 2024; online softmax: Dao et al., 2022):

* Program (q head, 128-query tile, row) has two compute warpgroups (64 queries each, ping-ponged
  on a schedule barrier so one's softmax overlaps the other's matmuls) and one TMA warpgroup
  streaming K/V blocks through ``num_stages`` buffers.
* Work is the causal area a row can see: a tile loads keys up to its last query's position (and
  the row's end), no further; tiles past ``num_new`` load nothing and write zeros. Blocks wholly
  below a warpgroup's first query run unmasked; only the diagonal blocks are masked.
* Cache slots past a row's end may hold anything (NaN): their scores are replaced by -inf, and
  the value rows of the block holding the end are zeroed before ``p @ v``.
* 16-bit caches only (``wgmma`` takes float32 only as tf32); float32 runs the reference.
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

from jaxdecode.kernels import stream_blocks, wait_for_inputs
from jaxdecode.kernels.decode_attention import _accumulate, _register_operand, _smem_tile

LOG2E = math.log2(math.e)
BLOCK_Q = 64  # queries per compute warpgroup (one wgmma M tile); a program holds two
COMPUTE_WGS = 2
SMEM_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class PrefillAttentionConfig:
    """Static tuning knobs of :func:`prefill_attention_pallas`."""
    block_kv: int = 64  # keys per pipeline step, a multiple of 64
    num_stages: int = 2  # K/V blocks in flight

    def __post_init__(self):
        if self.block_kv <= 0 or self.block_kv % 64:
            raise ValueError(f"{self.block_kv=} must be a positive multiple of 64")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2")


def _smem_bytes(head_dim: int, config: PrefillAttentionConfig, itemsize: int,
                interpret: bool) -> int:
    q = COMPUTE_WGS * BLOCK_Q * head_dim * itemsize
    kv = 2 * config.num_stages * config.block_kv * head_dim * itemsize
    p = COMPUTE_WGS * BLOCK_Q * config.block_kv * itemsize if interpret else 0
    return q + kv + p + 4096


def choose_config(head_dim: int, dtype) -> PrefillAttentionConfig:
    """128-key blocks up to D = 128 (2 stages; 3 at D = 64), 64-key blocks at D = 256 (the
    shared memory of 2 stages); the largest that fits :data:`SMEM_LIMIT_BYTES`."""
    itemsize = jnp.dtype(dtype).itemsize
    block_kv = 128 if head_dim <= 128 else 64
    stages = 3 if head_dim <= 64 else 2
    config = PrefillAttentionConfig(block_kv=block_kv, num_stages=stages)
    while _smem_bytes(head_dim, config, itemsize, False) > SMEM_LIMIT_BYTES and block_kv > 64:
        block_kv //= 2
        config = PrefillAttentionConfig(block_kv=block_kv, num_stages=stages)
    return config


def check_supported(q_shape, k_shape, dtype) -> str | None:
    """Why :func:`prefill_attention_pallas` cannot take these shapes/dtype, or None if it can."""
    _, _, num_heads, head_dim = q_shape
    num_kv_heads = k_shape[1]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (the kernel takes bfloat16 and float16)"
    if head_dim % 64 or not 64 <= head_dim <= 256:
        return f"{head_dim=} (the kernel takes 64, 128, 192 or 256)"
    if num_heads % num_kv_heads:
        return f"{num_heads=} not a multiple of {num_kv_heads=}"
    return None


def _kernel(start_gmem, num_new_gmem, q_gmem, k_gmem, v_gmem, o_gmem, scoped, *, block_kv,
            num_stages, group, max_len, scale, interpret):
    wait_for_inputs(interpret)
    (qo_smem2, k_smem, v_smem, p_smem2), (k_barriers, v_barriers, q_barriers), \
        (k_consumed, v_consumed), schedule_barrier = scoped
    b, h = lax.axis_index("b"), lax.axis_index("h")
    tile = lax.axis_size("q") - 1 - lax.axis_index("q")  # the largest causal areas first
    wg = lax.axis_index("wg")
    head_dim = qo_smem2.shape[-1]
    start = start_gmem[b]
    num_new = num_new_gmem[b]
    end = jnp.minimum(start + num_new, max_len)
    t0 = tile * (COMPUTE_WGS * BLOCK_Q)
    # Keys the whole program loads: up to its last real query's position (exclusive end).
    last = jnp.where(t0 < num_new, jnp.minimum(start + t0 + COMPUTE_WGS * BLOCK_Q, end), 0)
    total_steps = lax.div(last + (block_kv - 1), block_kv)

    def schedule():
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        q_base = t0 + wg * BLOCK_Q
        first_pos = start + q_base  # position of this warpgroup's first query
        real = q_base < num_new
        mine = jnp.where(real, jnp.minimum(first_pos + BLOCK_Q, end), 0)
        steps = lax.div(mine + (block_kv - 1), block_kv)
        # Blocks wholly at or below the first query's position: no mask (and all below end).
        full = jnp.minimum(lax.div(first_pos + 1, block_kv), steps)

        plgpu.copy_gmem_to_smem(q_gmem.at[b, pl.ds(q_base, BLOCK_Q), h], qo_smem,
                                q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[wg])
        layout = plgpu.Layout.WGMMA
        m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), layout.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), layout.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), layout)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_barriers.at[0])

        pl.when(wg == 1)(schedule)

        def step(i, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(i, num_stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].T)
                schedule()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            s = s * scale  # log2 domain: exp2 below
            key0 = i * block_kv
            if masked:
                row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=layout)
                col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=layout)
                key = key0 + col
                s = jnp.where((key <= first_pos + row) & (key < end), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(qo_smem.dtype)
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule_barrier)

            if masked:
                @pl.when(key0 + block_kv > end)
                def _zero_values_past_end():  # both warpgroups may write the same zeros
                    r = key0 + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                                      layout=layout)
                    v = plgpu.load(v_smem.at[slot], layout=layout)
                    v_smem.at[slot][...] = jnp.where(r < end, v, jnp.zeros_like(v))
                    plgpu.commit_smem()

            p16 = _register_operand(p16, p_smem2.at[wg] if interpret else None,
                                    interpret=interpret)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = i + 1

                @pl.when(nxt < steps)
                def _wait_next():
                    plgpu.barrier_wait(k_barriers.at[lax.rem(nxt, num_stages)])

            acc = _accumulate(acc, pv, interpret=interpret)
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l

        def drain(i, _):  # blocks only the other warpgroup needs: follow along in step
            slot = lax.rem(i, num_stages)
            plgpu.barrier_wait(k_barriers.at[slot])  # every barrier phase observed, as used
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            schedule()
            schedule()

        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
        lax.fori_loop(steps, total_steps, drain, None)
        pl.when(wg == 0)(schedule)

        inv_l = jnp.where(l > 0, 1.0 / l, 0.0)
        qo_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(qo_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, o_gmem.at[b, pl.ds(q_base, BLOCK_Q), h])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(h, group)

        def fetch(i, slot):
            keys = pl.ds(i * block_kv, block_kv)
            plgpu.copy_gmem_to_smem(k_gmem.at[b, kv_head, keys], k_smem.at[slot],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[b, kv_head, keys], v_smem.at[slot],
                                    v_barriers.at[slot])

        def wait_consumed(slot):
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])

        stream_blocks(fetch, total_steps, num_stages, wait_consumed,
                      prologue=min(num_stages, max_len // block_kv))  # static: in the cache


def prefill_attention_pallas(q, k_cache, v_cache, start, num_new, *,
                             config: PrefillAttentionConfig | None = None,
                             interpret: bool = False):
    """Prefill attention as a Pallas Mosaic GPU kernel (Hopper); arguments and result as
    :func:`prefill_attention_reference`. bfloat16/float16, D a multiple of 64 up to 256, else
    ValueError (:func:`check_supported`); T is padded to a multiple of 128 and S to one of
    ``block_kv`` (copies: allocate multiples). ``config``: None picks :func:`choose_config`;
    ``interpret``: run in the Mosaic GPU interpreter (CPU)."""
    batch, length, num_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k_cache.shape
    if (k_cache.shape != v_cache.shape or k_cache.shape[0] != batch
            or k_cache.shape[3] != head_dim):
        raise ValueError(f"{q.shape=}, {k_cache.shape=}, {v_cache.shape=} do not match "
                         "[B, T, Hq, D], [B, Hkv, S, D], [B, Hkv, S, D]")
    if start.shape != (batch,) or num_new.shape != (batch,):
        raise ValueError(f"{start.shape=}, {num_new.shape=} must be ({batch},)")
    if (why := check_supported(q.shape, k_cache.shape, k_cache.dtype)) is not None:
        raise ValueError(f"prefill_attention_pallas does not take {why}")
    config = config or choose_config(head_dim, k_cache.dtype)
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    smem = _smem_bytes(head_dim, config, itemsize, interpret)
    if smem > SMEM_LIMIT_BYTES:
        raise ValueError(f"{config=} needs about {smem} bytes of shared memory for {head_dim=}")
    block_kv, stages = config.block_kv, config.num_stages
    if max_len % block_kv:
        pad = ((0, 0), (0, 0), (0, -max_len % block_kv), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
        max_len = k_cache.shape[2]
    tile = COMPUTE_WGS * BLOCK_Q
    padded = -(-length // tile) * tile
    qp = q.astype(k_cache.dtype)
    if padded != length:
        qp = jnp.pad(qp, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
    dtype = k_cache.dtype

    body = functools.partial(_kernel, block_kv=block_kv, num_stages=stages,
                             group=num_heads // num_kv_heads, max_len=max_len,
                             scale=head_dim**-0.5 * LOG2E, interpret=interpret)

    def entry(start_gmem, num_new_gmem, q_gmem, k_gmem, v_gmem, o_gmem):
        smem = (_smem_tile((COMPUTE_WGS, BLOCK_Q, head_dim), dtype),
                _smem_tile((stages, block_kv, head_dim), dtype),
                _smem_tile((stages, block_kv, head_dim), dtype),
                _smem_tile((COMPUTE_WGS, BLOCK_Q, block_kv), dtype) if interpret else None)
        pl.run_scoped(
            lambda *scoped: body(start_gmem, num_new_gmem, q_gmem, k_gmem, v_gmem, o_gmem,
                                 scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=COMPUTE_WGS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg")

    out = plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((batch, padded, num_heads, head_dim), dtype),
        # heads fastest: the programs of one KV head's query heads run together (K/V from L2)
        grid=(num_heads, padded // tile, batch), grid_names=("h", "q", "b"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(start.astype(jnp.int32), num_new.astype(jnp.int32), qp, k_cache, v_cache)
    return out[:, :length].astype(q.dtype)


def prefill_attention_reference(q, k_cache, v_cache, start, num_new, *,
                                query_block: int = 512):
    """HF ``eager_attention_forward`` of T new queries over the whole cache, in ``jnp``.

    Shapes as the module docstring. Float32 scores scaled by D**-0.5, probabilities cast to the
    model dtype before ``@ V``; ``query_block`` queries at a time bound the float32 scores to
    [B, Hq, query_block, S]. Returns [B, T, Hq, D] in q's dtype.
    """
    batch, length, hq, d = q.shape
    positions = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    end = start + num_new
    if length <= query_block:
        return _attend(q, k_cache, v_cache, positions, end)
    pad = (-length) % query_block
    n = (length + pad) // query_block
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)))  # padded queries are cropped below
    q_blocks = jnp.moveaxis(q.reshape(batch, n, query_block, hq, d), 1, 0)
    pos_blocks = jnp.moveaxis(positions.reshape(batch, n, query_block), 1, 0)
    out = jax.lax.map(lambda qp: _attend(qp[0], k_cache, v_cache, qp[1], end),
                      (q_blocks, pos_blocks))  # [N, B, block, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(batch, n * query_block, hq, d)[:, :length]


def _attend(q, k_cache, v_cache, positions, end):
    f32 = jnp.float32
    batch, length, hq, d = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(batch, length, hkv, group, d)
    s_idx = jnp.arange(max_len)
    visible = (s_idx[None, None, :] <= positions[:, :, None]) & (
        s_idx[None, None, :] < end[:, None, None])  # [B, T, S]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=f32)
    scores = jnp.where(visible[:, None, None], scores * (d ** -0.5), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0).astype(q.dtype)  # rows with no key: 0
    key_valid = s_idx[None, :] < end[:, None]  # unwritten slots may hold anything (NaN)
    v = jnp.where(key_valid[:, None, :, None], v_cache, 0).astype(q.dtype)
    o = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return o.reshape(batch, length, hq, d)
