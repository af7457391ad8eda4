"""The chunked gated delta rule of the prefill, its chunk-to-chunk recurrence as a Pallas Mosaic
GPU kernel: one program per (row, value head, 64 state columns) walks the chunks with its slice
of the state in registers.

Arguments and result as ``jaxdecode.gated_delta.chunk_gated_delta_rule`` (HF
``torch_chunk_gated_delta_rule``): q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H],
state [B, H, dk, dv], all float32; returns (o [B, T, H, dv], final state), float32. XLA forms
the per-chunk terms (``gated_delta.chunk_terms``: decays, K Kᵀ and the two triangular solves,
parallel over chunks); the kernel runs the sequential part, per chunk n (C = 64 tokens)::

    Δ = U - W S;   O = (Q e^Γ) S + (masked decayed Q Kᵀ) Δ;   S <- e^{Γ_C} S + (K e^{Γ_C-Γ})ᵀ Δ

Why it looks the way it does:

* XLA runs that recurrence as a ``lax.scan`` of a few small batched matmuls per chunk, about
  20 µs a step of launch latency (benchmarks/RESULTS.md). Here a step is four
  ``wgmma`` on shared memory and nothing leaves the SM but the outputs.
* Columns of S evolve independently (Δ's columns depend only on S's), so programs split dv.
* Everything is transposed (Sᵀ [64, dk] in registers, the outputs as Oᵀ): ``wgmma`` takes float32
  only as tf32 and only K-major, and in that form every operand is K-major as XLA lays it out.
  tf32 is what XLA's default precision gives these float32 matmuls on the GPU too, so
  ``choose_kernels`` picks the kernel for 16-bit models only (errors: benchmarks/RESULTS.md).
* Loads overlap compute without a second buffer: the next chunk's W and Q are fetched once the
  first two matmuls have read them, its U, K and Q Kᵀ once the last two have.

Same math and FLOPs as flash-linear-attention's ``chunk_gated_delta_rule_fwd_h`` +
``chunk_fwd_o`` (Yang et al., "Gated Delta Networks", ICLR 2025), fused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.gated_delta import chunk_gated_delta_rule, chunk_terms
from jaxdecode.kernels import wait_for_inputs
from jaxdecode.kernels.decode_attention import _accumulate, _smem_tile

CHUNK = 64  # tokens per chunk of the prefill's delta rule (HF and flash-linear-attention: 64)
BLOCK_V = 64  # state columns per program: one wgmma M tile of Sᵀ


def check_supported(q_shape, v_shape, model_dtype=jnp.bfloat16) -> str | None:
    """Why :func:`chunk_gated_delta_rule_pallas` cannot take these shapes (None if it can), or
    should not serve a model of ``model_dtype``: its matmuls are tf32, so float32 models keep
    XLA's form, which honours ``jax_default_matmul_precision``."""
    dk, dv = q_shape[-1], v_shape[-1]
    if jnp.dtype(model_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"model dtype {jnp.dtype(model_dtype)} (tf32 matmuls: for 16-bit models)"
    if dk % 32 or not 32 <= dk <= 256:
        return f"linear_key_head_dim={dk} (the kernel takes multiples of 32 up to 256)"
    if dv % BLOCK_V:
        return f"linear_value_head_dim={dv} is not a multiple of {BLOCK_V}"
    return None


def _kernel(w_gmem, q_gmem, kt_gmem, ut_gmem, qk_gmem, gl_gmem, s0_gmem,  # inputs
            o_gmem, s_out_gmem,  # outputs
            w_smem, q_smem, kt_smem, ut_smem, qk_smem, s_smem, d_smem, o_smem, barriers, *,
            num_chunks, interpret):
    wait_for_inputs(interpret)
    j, h, b = lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * BLOCK_V, BLOCK_V)
    layout = plgpu.Layout.WGMMA
    w_bar, q_bar, kt_bar, ut_bar, qk_bar, s_bar = (barriers.at[i] for i in range(6))

    def fetch_first(n):  # what the first two matmuls read
        plgpu.copy_gmem_to_smem(w_gmem.at[b, h, n], w_smem, w_bar)
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h, n], q_smem, q_bar)

    def fetch_second(n):  # what the rest reads
        plgpu.copy_gmem_to_smem(ut_gmem.at[b, h, n, cols], ut_smem, ut_bar)
        plgpu.copy_gmem_to_smem(qk_gmem.at[b, h, n], qk_smem, qk_bar)
        plgpu.copy_gmem_to_smem(kt_gmem.at[b, h, n], kt_smem, kt_bar)

    plgpu.copy_gmem_to_smem(s0_gmem.at[b, h, cols], s_smem, s_bar)
    fetch_first(0)
    fetch_second(0)
    plgpu.barrier_wait(s_bar)
    s = plgpu.load(s_smem, layout=layout)  # Sᵀ [BLOCK_V, dk]

    def step(n, s):
        s_smem[...] = s
        plgpu.commit_smem()
        plgpu.barrier_wait(w_bar)
        plgpu.barrier_wait(q_bar)

        def first(acc_ws, acc_qs):
            plgpu.wgmma(acc_ws, s_smem, w_smem.T)  # Sᵀ Wᵀ = (W S)ᵀ  [BLOCK_V, C]
            plgpu.wgmma(acc_qs, s_smem, q_smem.T)  # (Q S)ᵀ
            return acc_ws[...], acc_qs[...]

        ws, qs = pl.run_scoped(first, plgpu.ACC((BLOCK_V, CHUNK), jnp.float32),
                               plgpu.ACC((BLOCK_V, CHUNK), jnp.float32))
        pl.when(n + 1 < num_chunks)(lambda: fetch_first(n + 1))
        plgpu.barrier_wait(ut_bar)
        d_smem[...] = plgpu.load(ut_smem, layout=layout) - ws  # Δᵀ = Uᵀ - (W S)ᵀ
        plgpu.commit_smem()
        plgpu.barrier_wait(qk_bar)
        plgpu.barrier_wait(kt_bar)
        o = _accumulate(qs, lambda acc: plgpu.wgmma(acc, d_smem, qk_smem.T),
                        interpret=interpret)  # Oᵀ += Δᵀ (Q Kᵀ)ᵀ
        decay = jnp.exp(gl_gmem[b, h, n])
        s = _accumulate(decay * s, lambda acc: plgpu.wgmma(acc, d_smem, kt_smem.T),
                        interpret=interpret)  # Sᵀ <- e^{Γ_C} Sᵀ + Δᵀ K~
        pl.when(n + 1 < num_chunks)(lambda: fetch_second(n + 1))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's Oᵀ has left o_smem
        o_smem[...] = o
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, n, cols])
        return s

    s = lax.fori_loop(0, num_chunks, step, s)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s_smem[...] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, s_out_gmem.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def chunk_recurrence_pallas(w, q_decayed, k_decayed_t, u_t, qk, gamma_last, state_t, *,
                            interpret: bool = False):
    """The kernel on the per-chunk terms, every array float32 and per (row, head, chunk):
    w, q_decayed [B, H, N, C, dk]; k_decayed_t [B, H, N, dk, C]; u_t [B, H, N, dv, C];
    qk [B, H, N, C, C]; gamma_last [B, H, N]; state_t (Sᵀ) [B, H, dv, dk]. Returns
    (Oᵀ [B, H, N, dv, C], final Sᵀ [B, H, dv, dk])."""
    batch, heads, n, c, dk = w.shape
    dv = u_t.shape[3]
    f32 = jnp.float32
    smem = (_smem_tile((c, dk), f32), _smem_tile((c, dk), f32), _smem_tile((dk, c), f32),
            _smem_tile((BLOCK_V, c), f32), _smem_tile((c, c), f32),
            _smem_tile((BLOCK_V, dk), f32), _smem_tile((BLOCK_V, c), f32),
            plgpu.SMEM((BLOCK_V, c), f32), plgpu.Barrier(num_barriers=6))
    return plgpu.kernel(
        functools.partial(_kernel, num_chunks=n, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, heads, n, dv, c), f32),
                  jax.ShapeDtypeStruct((batch, heads, dv, dk), f32)),
        scratch_types=smem,
        # column blocks fastest: the programs of one (row, head) share W, Q and K through L2
        grid=(dv // BLOCK_V, heads, batch), grid_names=("j", "h", "b"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(w, q_decayed, k_decayed_t, u_t, qk, gamma_last, state_t)


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, state, *, interpret: bool = False):
    """``gated_delta.chunk_gated_delta_rule`` (64-token chunks) with its recurrence in the kernel:
    arguments and result as there (the module docstring). ValueError: inputs not float32,
    shapes that disagree, or shapes :func:`check_supported` rejects."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    bad = {name: x.dtype for name, x in arrays.items() if x.dtype != jnp.float32}
    if bad:
        raise ValueError(f"chunk_gated_delta_rule_pallas takes float32 inputs; got {bad}")
    want = dict(k=q.shape, v=(batch, length, heads, dv), g=(batch, length, heads),
                beta=(batch, length, heads), state=(batch, heads, dk, dv))
    wrong = {name: (tuple(arrays[name].shape), shape) for name, shape in want.items()
             if arrays[name].shape != shape}
    if wrong:
        raise ValueError(f"shapes (got, expected from q {q.shape} and v): {wrong}")
    if (why := check_supported(q.shape, v.shape, jnp.bfloat16)) is not None:
        raise ValueError(f"chunk_gated_delta_rule_pallas does not take {why}")
    if batch * heads * length == 0:
        return jnp.zeros(v.shape, jnp.float32), state
    q_decayed, k_decayed, u, w, qk, gamma_last = chunk_terms(q, k, v, g, beta, CHUNK)
    per_row = lambda x: jnp.moveaxis(x, 0, 2)  # [N, B, H, ...] -> [B, H, N, ...]  # noqa: E731
    o_t, state_t = chunk_recurrence_pallas(
        per_row(w), per_row(q_decayed), jnp.swapaxes(per_row(k_decayed), -1, -2),
        jnp.swapaxes(per_row(u), -1, -2), per_row(qk), per_row(gamma_last),
        jnp.swapaxes(state, -1, -2), interpret=interpret)
    n = o_t.shape[2]
    o = jnp.transpose(o_t, (0, 2, 4, 1, 3)).reshape(batch, n * CHUNK, heads, dv)
    return o[:, :length], jnp.swapaxes(state_t, -1, -2)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, state):
    """The XLA form (``gated_delta.chunk_gated_delta_rule``, 64-token chunks); arguments and
    result as :func:`chunk_gated_delta_rule_pallas`."""
    return chunk_gated_delta_rule(q, k, v, g, beta, state, CHUNK)
