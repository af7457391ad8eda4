"""The gated delta rule: one-token step, chunked parallel form, naive recurrence.

All three take float32 inputs prepared as in HF's torch kernels (q, k L2-normalised, q scaled
by dk**-0.5, repeated to the H value heads): q, k [B, T, H, dk]; v [B, T, H, dv]; log-space
decay g <= 0 and write strength beta in [0, 1], [B, T, H]; state S [B, H, dk, dv].

Per token (HF ``torch_recurrent_gated_delta_rule``; Yang et al., "Gated Delta Networks", ICLR
2025, eq. 10): S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.

The chunked form (HF ``torch_chunk_gated_delta_rule``) computes the same 64 tokens at a time
with a unit-lower-triangular solve per chunk. A token with ``beta = g = 0, k = 0`` leaves S
unchanged: that is how padding is made inert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

Array = jax.Array

# HF's l2norm adds this to the *sum* of squares (hard-coded, not rms_norm_eps).
L2NORM_EPS = 1e-6


def l2_normalize(x: Array) -> Array:
    """``x * rsqrt(sum(x²) + 1e-6)`` over the last axis (HF ``l2norm``; eps on the sum)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule (HF ``torch_recurrent_gated_delta_rule``'s loop body).

    q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H]; state: [B, H, dk, dv] (all float32).
    Returns (o [B, H, dv], new state); o reads the state *after* this token's write, as HF.
    """
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = beta[..., None] * (v - kv_mem)
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", state, q)
    return o, state


def naive_gated_delta_rule(q, k, v, g, beta, state, *, all_states: bool = False,
                           unroll: bool = False):
    """Token-by-token reference (``lax.scan`` of :func:`gated_delta_rule_step`); shapes as in the
    module docstring. Returns (o [B, T, H, dv], final state), or with ``all_states`` (o, the
    state after every token [B, T, H, dk, dv]: a speculative verify step's, spec §10).
    ``unroll``: the scan unrolled (a few tokens: a GPU while loop costs a host round trip per
    token)."""
    def step(s, xs):
        o, s = gated_delta_rule_step(*xs, s)
        return s, (o, s) if all_states else o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs, unroll=unroll)
    if all_states:
        o, states = out
        return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1), state


def pad_to_chunks(q, k, v, g, beta, chunk_size: int):
    """The five inputs (module docstring) with T padded to a multiple of ``chunk_size`` by inert
    tokens (beta = g = 0, k = 0, and q = v = 0)."""
    pad = (-q.shape[1]) % chunk_size
    if not pad:
        return q, k, v, g, beta
    widths = ((0, 0), (0, pad), (0, 0))
    q, k, v = (jnp.pad(x, widths + ((0, 0),)) for x in (q, k, v))
    g, beta = (jnp.pad(x, widths) for x in (g, beta))
    return q, k, v, g, beta


def chunk_terms(q, k, v, g, beta, chunk_size: int = 64):
    """The per-chunk terms of :func:`chunk_gated_delta_rule` (its docstring's notation), every
    chunk at once: returns (Q e^Γ, K e^{Γ_C-Γ}, U, W, the masked decayed Q Kᵀ, Γ_C), each
    [N, B, H, C, ...] (N chunks of C = ``chunk_size`` tokens; the tail padded with inert tokens).
    """
    batch, _, heads, _ = q.shape
    c = chunk_size
    q, k, v, g, beta = pad_to_chunks(q, k, v, g, beta, c)
    n = q.shape[1] // c

    def chunks(x):  # [B, N*C, H, ...] -> [N, B, H, C, ...]
        x = x.reshape(batch, n, c, heads, *x.shape[3:])
        return jnp.moveaxis(jnp.swapaxes(x, 2, 3), 1, 0)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    causal = jnp.tril(jnp.ones((c, c), bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)  # j < i
    decay = jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    kk = jnp.einsum("...id,...jd->...ij", k, k)
    a = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    eye = jnp.eye(c, dtype=a.dtype)
    # T⁻¹ by one forward substitution against I (C right-hand sides, not dk + dv), applied by
    # float32 matmuls, as flash-linear-attention's solve_tril + recompute_w_u.
    t_inv = solve_triangular(a + eye, jnp.broadcast_to(eye, a.shape), lower=True,
                             unit_diagonal=True)
    hi = jax.lax.Precision.HIGHEST
    u = jnp.matmul(t_inv, beta[..., None] * v, precision=hi)
    w = jnp.matmul(t_inv, (beta * jnp.exp(gamma))[..., None] * k, precision=hi)
    qk = jnp.where(causal, jnp.einsum("...id,...jd->...ij", q, k) * decay, 0.0)
    q_decayed = q * jnp.exp(gamma)[..., None]
    gamma_last = gamma[..., -1]  # [N, B, H]
    k_decayed = k * jnp.exp(gamma_last[..., None] - gamma)[..., None]
    return q_decayed, k_decayed, u, w, qk, gamma_last


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked (parallel) gated delta rule, equal to :func:`naive_gated_delta_rule`.

    Shapes as in the module docstring; T need not be a multiple of ``chunk_size`` (the tail is
    padded with inert tokens). Within chunk n with cumulative decay Γ_i = Σ_{s<=i} g_s:

      A_ij = β_i (k_i·k_j) e^{Γ_i-Γ_j} (j < i),  T = I + A
      U = T⁻¹ diag(β) V,  W = T⁻¹ diag(β e^Γ) K
      Δ = U - W S;  O = diag(e^Γ) Q S + (e^{Γ_i-Γ_j} [j<=i] ⊙ Q Kᵀ) Δ
      S <- e^{Γ_C} S + (diag(e^{Γ_C-Γ}) K)ᵀ Δ

    Exponents are masked to -inf before ``exp``, so strongly decaying heads cannot overflow.
    Returns (o [B, T, H, dv] float32, final state [B, H, dk, dv] float32).
    """
    batch, length, heads, _ = q.shape
    dv = v.shape[-1]
    terms = chunk_terms(q, k, v, g, beta, chunk_size)
    n = terms[0].shape[0]

    def step(s, xs):
        q_c, k_c, u_c, w_c, qk_c, g_last = xs
        delta = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", qk_c, delta)
        s = jnp.exp(g_last)[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", k_c, delta)
        return s, o

    state, o = jax.lax.scan(step, state, terms)
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, dv]
    o = jnp.swapaxes(o, 2, 3).reshape(batch, n * chunk_size, heads, dv)
    return o[:, :length], state
