"""The chunked gated delta rule of the prefill as two Pallas Mosaic GPU kernels: the per-chunk
terms, one program per (row, head, chunk); then the chunk-to-chunk recurrence, one program per
(row, value head, 64 state columns) walking the chunks with its slice of the state in registers.

Arguments and result as ``jaxdecode.gated_delta.chunk_gated_delta_rule`` (HF
``torch_chunk_gated_delta_rule``): q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H],
state [B, H, dk, dv], all float32; returns (o [B, T, H, dv], final state), float32. Per chunk n
of C = 64 tokens (that function's docstring has the notation)::

    terms:       A = β K Kᵀ e^{Γi-Γj} [j<i],  T⁻¹ = (I + A)⁻¹,  W = T⁻¹ diag(β e^Γ) K,
                 U = T⁻¹ diag(β) V,  masked decayed Q Kᵀ,  Q e^Γ,  K e^{Γ_C-Γ}
    recurrence:  Δ = U - W S;   O = (Q e^Γ) S + (masked decayed Q Kᵀ) Δ;
                 S <- e^{Γ_C} S + (K e^{Γ_C-Γ})ᵀ Δ

Why it looks the way it does:

* XLA runs the recurrence as a ``lax.scan`` of a few small batched matmuls per chunk, about
  20 µs a step of launch latency, and the terms' triangular solve as a batched solver
  (benchmarks/RESULTS.md). Here a chunk's terms are 24 ``wgmma`` in one program and a
  recurrence step is four, on shared memory.
* T⁻¹ is formed by blocks (the inverse of blocks of 2s from those of s: X - X L X), as
  flash-linear-attention's ``solve_tril`` merges them: as stable as forward substitution, where
  the product (I - A)(I + A²)(I + A⁴)... cancels powers of A that reach 1e18.
* Columns of S evolve independently (Δ's columns depend only on S's), so recurrence programs
  split dv.
* ``wgmma`` takes float32 only as tf32 and only K-major: the recurrence works on transposes
  (Sᵀ [64, dk] in registers, the outputs as Oᵀ) and the terms carry Xᵀ beside X, so every operand
  is K-major. tf32 is what XLA's default precision gives these float32 matmuls on the GPU too, so
  ``choose_kernels`` picks the kernels for 16-bit models only (errors: benchmarks/RESULTS.md).
* Recurrence loads overlap compute without a second buffer: the next chunk's W and Q are fetched
  once the first two matmuls have read them, its U, K and Q Kᵀ once the last two have.

Same math and FLOPs as flash-linear-attention's ``chunk_scaled_dot_kkt`` + ``solve_tril`` +
``recompute_w_u`` (the terms) and ``chunk_gated_delta_rule_fwd_h`` + ``chunk_fwd_o`` (the
recurrence) (Yang et al., "Gated Delta Networks", ICLR 2025).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.gated_delta import chunk_gated_delta_rule, pad_to_chunks
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
    if dk not in (64, 128):
        return f"linear_key_head_dim={dk} (the kernels take 64 or 128)"
    if dv not in (64, 128):
        return f"linear_value_head_dim={dv} (the kernels take 64 or 128)"
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


def _terms_kernel(q_gmem, k_gmem, kt_gmem, vt_gmem, gamma_gmem, beta_gmem,  # inputs
                  w_gmem, ut_gmem, qk_gmem, qd_gmem, kdt_gmem,  # outputs
                  q_smem, k_smem, kt_smem, vt_smem, x_smem, xt_smem, l_smem, lt_smem, qk_smem,
                  vec_smem, barriers, *, interpret):
    wait_for_inputs(interpret)
    n, h, b = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("b")
    layout = plgpu.Layout.WGMMA
    q_bar, k_bar, kt_bar, vt_bar = (barriers.at[i] for i in range(4))
    # Γ and β each twice: a shared-memory ref is read in one register layout only
    for i, src in enumerate((gamma_gmem, gamma_gmem, beta_gmem, beta_gmem)):
        plgpu.copy_gmem_to_smem(src.at[b, h, n], vec_smem.at[i], barriers.at[4 + i])
    plgpu.copy_gmem_to_smem(q_gmem.at[b, h, n], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(k_gmem.at[b, h, n], k_smem, k_bar)
    plgpu.copy_gmem_to_smem(kt_gmem.at[b, h, n], kt_smem, kt_bar)
    plgpu.copy_gmem_to_smem(vt_gmem.at[b, h, n], vt_smem, vt_bar)

    shape = (CHUNK, CHUNK)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)  # i
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)  # j

    def per_row(ref):  # [C] -> [C, C], x_i in row i
        x = lax.broadcast_in_dim(plgpu.load(ref, layout=layout.reduce(1)), shape, [0])
        return plgpu.layout_cast(x, layout)

    def per_col(ref):  # [C] -> [C, C], x_j in column j
        x = lax.broadcast_in_dim(plgpu.load(ref, layout=layout.reduce(0)), shape, [1])
        return plgpu.layout_cast(x, layout)

    for i in range(4):
        plgpu.barrier_wait(barriers.at[4 + i])
    gamma_i, gamma_j = per_row(vec_smem.at[0]), per_col(vec_smem.at[1])
    beta_i, beta_j = per_row(vec_smem.at[2]), per_col(vec_smem.at[3])
    decay = jnp.exp(jnp.where(col <= row, gamma_i - gamma_j, -jnp.inf))  # e^{Γi-Γj}, j <= i
    decay_t = jnp.exp(jnp.where(row <= col, gamma_j - gamma_i, -jnp.inf))  # its transpose

    plgpu.barrier_wait(q_bar)
    plgpu.barrier_wait(k_bar)

    def products(acc_kk, acc_qk):
        plgpu.wgmma(acc_kk, k_smem, k_smem.T)  # K Kᵀ
        plgpu.wgmma(acc_qk, q_smem, k_smem.T)  # Q Kᵀ
        return acc_kk[...], acc_qk[...]

    kk, qk = pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                           plgpu.ACC(shape, jnp.float32))
    qk_smem[...] = jnp.where(col <= row, qk * decay, 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qk_smem, qk_gmem.at[b, h, n])
    dk, dv = kt_smem.shape[0], vt_smem.shape[0]
    exp_gamma = jnp.exp(plgpu.load(vec_smem.at[0], layout=layout.reduce(1)))
    q_smem[...] = plgpu.load(q_smem, layout=layout) * lax.broadcast_in_dim(
        exp_gamma, (CHUNK, dk), [0])  # Q e^Γ
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, qd_gmem.at[b, h, n])
    a = jnp.where(col < row, beta_i * kk * decay, 0.0)  # A (strictly lower)
    a_t = jnp.where(row < col, beta_j * kk * decay_t, 0.0)  # Aᵀ (K Kᵀ is symmetric)

    # T⁻¹ = (I + A)⁻¹ by blocks, as flash-linear-attention's solve_tril merges them: with X the
    # inverse of T's diagonal blocks of size s and L T's blocks just below them (within blocks of
    # 2s), the inverse of the blocks of 2s is X - X L X. Xᵀ is carried beside X because tf32
    # wgmma takes K-major operands only.
    def level_mask(i, j, s):
        return ((i // s) % 2 == 1) & (j // s == i // s - 1)

    eye = jnp.where(row == col, 1.0, 0.0)
    x = eye - jnp.where(level_mask(row, col, 1), a, 0.0)
    x_t = eye - jnp.where(level_mask(col, row, 1), a_t, 0.0)
    s = 2
    while s < CHUNK:
        x_smem[...] = x
        xt_smem[...] = x_t
        l_smem[...] = jnp.where(level_mask(row, col, s), a, 0.0)
        lt_smem[...] = jnp.where(level_mask(col, row, s), a_t, 0.0)
        plgpu.commit_smem()

        def left(acc_xl, acc_xtlt):
            plgpu.wgmma(acc_xl, x_smem, lt_smem.T)  # X L
            plgpu.wgmma(acc_xtlt, xt_smem, l_smem.T)  # Xᵀ Lᵀ
            return acc_xl[...], acc_xtlt[...]

        xl, xtlt = pl.run_scoped(left, plgpu.ACC(shape, jnp.float32),
                                 plgpu.ACC(shape, jnp.float32))
        l_smem[...] = xl
        lt_smem[...] = xtlt
        plgpu.commit_smem()

        def right(acc_x, acc_xt):
            plgpu.wgmma(acc_x, l_smem, xt_smem.T)  # (X L) X
            plgpu.wgmma(acc_xt, lt_smem, x_smem.T)  # (Xᵀ Lᵀ) Xᵀ
            return acc_x[...], acc_xt[...]

        xlx, xlx_t = pl.run_scoped(right, plgpu.ACC(shape, jnp.float32),
                                   plgpu.ACC(shape, jnp.float32))
        x, x_t = x - xlx, x_t - xlx_t
        s *= 2

    x_smem[...] = x * beta_j  # T⁻¹ diag(β)
    xt_smem[...] = x * (beta_j * jnp.exp(gamma_j))  # T⁻¹ diag(β e^Γ)
    plgpu.commit_smem()
    plgpu.barrier_wait(kt_bar)
    plgpu.barrier_wait(vt_bar)

    def apply(acc_w, acc_ut):
        plgpu.wgmma(acc_w, xt_smem, kt_smem.T)  # W = T⁻¹ diag(β e^Γ) K  [C, dk]
        plgpu.wgmma(acc_ut, vt_smem, x_smem.T)  # Uᵀ = (T⁻¹ diag(β) V)ᵀ  [dv, C]
        return acc_w[...], acc_ut[...]

    w, u_t = pl.run_scoped(apply, plgpu.ACC((CHUNK, dk), jnp.float32),
                           plgpu.ACC((dv, CHUNK), jnp.float32))
    to_end = jnp.exp(gamma_gmem[b, h, n, CHUNK - 1]
                     - plgpu.load(vec_smem.at[1], layout=layout.reduce(0)))  # e^{Γ_C-Γ}
    kt_smem[...] = plgpu.load(kt_smem, layout=layout) * lax.broadcast_in_dim(
        to_end, (dk, CHUNK), [1])  # (K e^{Γ_C-Γ})ᵀ
    vt_smem[...] = u_t
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # Q e^Γ has left q_smem
    q_smem[...] = w
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, w_gmem.at[b, h, n])
    plgpu.copy_smem_to_gmem(vt_smem, ut_gmem.at[b, h, n])
    plgpu.copy_smem_to_gmem(kt_smem, kdt_gmem.at[b, h, n])
    plgpu.wait_smem_to_gmem(0)


def chunk_terms_pallas(q, k, k_t, v_t, gamma, beta, *, interpret: bool = False):
    """The per-chunk terms, every array float32 and per (row, head, chunk) of C = 64 tokens:
    q, k [B, H, N, C, dk]; k_t [B, H, N, dk, C]; v_t [B, H, N, dv, C]; gamma (Γ, the decays'
    cumulative sum within the chunk) and beta [B, H, N, C]. Returns (W [B, H, N, C, dk],
    Uᵀ [B, H, N, dv, C], masked decayed Q Kᵀ [B, H, N, C, C], Q e^Γ [B, H, N, C, dk],
    (K e^{Γ_C-Γ})ᵀ [B, H, N, dk, C]): ``gated_delta.chunk_terms``'s, laid out for
    :func:`chunk_recurrence_pallas`, T⁻¹ formed by blocks in tf32."""
    batch, heads, n, c, dk = q.shape
    dv = v_t.shape[3]
    f32 = jnp.float32
    cc = _smem_tile((c, c), f32)
    smem = (_smem_tile((c, dk), f32), _smem_tile((c, dk), f32), _smem_tile((dk, c), f32),
            _smem_tile((dv, c), f32), cc, cc, cc, cc, cc, plgpu.SMEM((4, c), f32),
            plgpu.Barrier(num_barriers=8))
    return plgpu.kernel(
        functools.partial(_terms_kernel, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, heads, n, c, dk), f32),
                  jax.ShapeDtypeStruct((batch, heads, n, dv, c), f32),
                  jax.ShapeDtypeStruct((batch, heads, n, c, c), f32),
                  jax.ShapeDtypeStruct((batch, heads, n, c, dk), f32),
                  jax.ShapeDtypeStruct((batch, heads, n, dk, c), f32)),
        scratch_types=smem,
        grid=(n, heads, batch), grid_names=("n", "h", "b"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, k_t, v_t, gamma, beta)


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
    q, k, v, g, beta = pad_to_chunks(q, k, v, g, beta, CHUNK)
    n = q.shape[1] // CHUNK

    def chunked(x):  # [B, N*C, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(batch, n, CHUNK, heads, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-1)  # Γ [B, H, N, C]
    w, u_t, qk, q_decayed, k_decayed_t = chunk_terms_pallas(
        q, k, jnp.swapaxes(k, -1, -2), jnp.swapaxes(v, -1, -2), gamma, beta, interpret=interpret)
    o_t, state_t = chunk_recurrence_pallas(
        w, q_decayed, k_decayed_t, u_t, qk, gamma[..., -1], jnp.swapaxes(state, -1, -2),
        interpret=interpret)
    o = jnp.transpose(o_t, (0, 2, 4, 1, 3)).reshape(batch, n * CHUNK, heads, dv)
    return o[:, :length], jnp.swapaxes(state_t, -1, -2)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, state):
    """The XLA form (``gated_delta.chunk_gated_delta_rule``, 64-token chunks); arguments and
    result as :func:`chunk_gated_delta_rule_pallas`."""
    return chunk_gated_delta_rule(q, k, v, g, beta, state, CHUNK)
