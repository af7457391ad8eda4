"""The whole one-token Gated DeltaNet mixer core as one Pallas Mosaic GPU kernel.

At decode time the core between the input projections and the gated RMSNorm of HF
``Qwen3_5GatedDeltaNet`` is, per row b, for its one new token at position n = positions[b]:

  conv window  hist = [window[b] | mixed_qkv[b]]  [Kc, C], window = the ring's slots of positions
               n-Kc+1 .. n-1 (``jaxdecode.state.conv_window``)
  conv         x = silu(sum_t f32(hist[t]) * f32(w[:, t]))  -> model dtype -> float32   [C]
  split        per key head i: [q_i (dk) | k_i (dk) | v of its r value heads (r * dv)]
  gating       beta = f32(sigmoid(b)) (rounded once to the model dtype)
               g = -exp(f32(A_log)) * softplus(f32(a) + f32(dt_bias))  (float32, <= 0)
  norms        q <- l2norm(q) * dk**-0.5;  k <- l2norm(k);   l2norm(x) = x * rsqrt(sum(x^2) + 1e-6)
  delta rule   value head h reads key head h // r (r = Hv // Hk):
               S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
  new ring     conv_state[b, n % Kc] = mixed_qkv[b] (the one slot the window does not read)

(HF ``causal_conv1d_update``, ``l2norm``, ``torch_recurrent_gated_delta_rule``; Yang, Kautz,
Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10.) A row with ``active[b]`` False is left
bit-exact and its o is 0 (the model's masking: q = k = v = 0, g = beta = 0, ring unchanged).

XLA runs this as about six small kernels per layer; :func:`deltanet_decode_pallas` is one.
Program (b, h, j) holds columns ``[j*block_v, (j+1)*block_v)`` of S[b, h] as a [dk, block_v]
float32 wgmma-layout tile and recomputes its q, k (cheap next to the tile). State and ring are
updated in place; the write slot n % Kc is the one no window reads, and each of its channels is
written by one program ((b, h, 0) with h % r == 0 writes key head h // r's q and k).
:func:`deltanet_decode_reference` is the model's decode math factored out.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.activations import sigmoid
from jaxdecode.gated_delta import L2NORM_EPS, l2_normalize
from jaxdecode.kernels import wait_for_inputs
from jaxdecode.kernels.gated_delta_decode import (TILE_ROWS, choose_block_v,
                                                  gated_delta_decode_reference)
from jaxdecode.state import conv_slot, conv_window

f32 = jnp.float32
MAX_COPY = 256  # one async (TMA) copy moves at most 256 elements along each dimension
MODEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check(name, mixed_qkv, a, b, active, positions, conv_state, recurrent_state, conv_weight,
           A_log, dt_bias, num_key_heads):
    """Shapes and dtypes, with a ValueError naming what disagrees. Returns (hk, hv, dk, dv, kc)."""
    if recurrent_state.ndim != 4:
        raise ValueError(f"{name}: recurrent_state must be [B, Hv, dk, dv]; got "
                         f"{recurrent_state.shape=}")
    batch, hv, dk, dv = recurrent_state.shape
    try:
        hk = operator.index(num_key_heads)  # ints, numpy ints
    except TypeError:
        raise ValueError(f"{name}: num_key_heads must be an integer; got "
                         f"{num_key_heads!r}") from None
    if hk <= 0 or hv % hk:
        raise ValueError(f"{name}: {hv} value heads are not a multiple of {hk} key heads "
                         f"(num_key_heads={hk!r})")
    if conv_weight.ndim != 2:
        raise ValueError(f"{name}: conv_weight must be [C, Kc] (the conv1d param [C, 1, Kc] as "
                         f"conv1d[:, 0, :]); got shape {tuple(conv_weight.shape)}")
    kc = conv_weight.shape[1]
    channels = hk * (2 * dk + (hv // hk) * dv)
    arrays = dict(mixed_qkv=mixed_qkv, a=a, b=b, active=active, positions=positions,
                  conv_state=conv_state, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias)
    want = dict(mixed_qkv=(batch, channels), a=(batch, hv), b=(batch, hv), active=(batch,),
                positions=(batch,), conv_state=(batch, kc, channels), conv_weight=(channels, kc),
                A_log=(hv,), dt_bias=(hv,))
    wrong = {n: (tuple(arrays[n].shape), s) for n, s in want.items() if arrays[n].shape != s}
    if kc < 1:
        wrong["conv_weight"] = (tuple(conv_weight.shape), ("C", "Kc >= 1"))
    if wrong:
        raise ValueError(f"{name}: shapes (got, expected from recurrent_state "
                         f"{recurrent_state.shape} and num_key_heads={hk}, so "
                         f"C = Hk*(2*dk + r*dv) = {channels}): {wrong}")
    dtype = mixed_qkv.dtype
    bad = {}
    if dtype not in MODEL_DTYPES:
        bad["mixed_qkv"] = dtype
    for n in ("a", "b", "conv_state"):
        if arrays[n].dtype != dtype:
            bad[n] = arrays[n].dtype
    for n in ("conv_weight", "A_log", "dt_bias"):
        if arrays[n].dtype not in MODEL_DTYPES:
            bad[n] = arrays[n].dtype
    if active.dtype != jnp.bool_:
        bad["active"] = active.dtype
    if positions.dtype != jnp.int32:
        bad["positions"] = positions.dtype
    if recurrent_state.dtype != f32:
        bad["recurrent_state"] = recurrent_state.dtype
    if bad:
        raise ValueError(f"{name}: dtypes: mixed_qkv, a, b and conv_state share the model dtype "
                         "(float32 or bfloat16), conv_weight/A_log/dt_bias are float32 or "
                         "bfloat16, active is bool, positions int32, recurrent_state float32; got "
                         f"{bad}")
    return hk, hv, dk, dv, kc


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _sigmoid_in(dtype, x):
    """sigmoid in float32, rounded once to ``dtype`` (as torch's bfloat16 ``sigmoid``)."""
    return _sigmoid(x).astype(dtype).astype(f32)


def _softplus(x):
    """log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), with log1p written out (Mosaic GPU has
    no log1p): log1p(u) = log(1 + u) * u / ((1 + u) - 1), or u where 1 + u rounds to 1."""
    u = jnp.exp(-jnp.abs(x))
    w = 1.0 + u
    log1p = jnp.where(w == 1.0, u, jnp.log(w) * (u / (w - 1.0)))
    return jnp.maximum(x, 0.0) + log1p


def _kernel(mixed_gmem,  # [B, C] model dtype
            a_gmem, b_gmem,  # [B, Hv] model dtype
            active_gmem,  # [B] int32
            positions_gmem,  # [B] int32: this token's position n
            w_gmem,  # [C, Kc]
            a_log_gmem, dt_bias_gmem,  # [Hv]
            o_gmem,  # [B, Hv, dv] float32 (out)
            conv_gmem,  # [B, Kc, C] model dtype: the ring (in and out)
            state_gmem,  # [B, Hv, dk, dv] float32 (in and out)
            s_smem, o_smem,  # scratch: [dk, bv], [bv] float32
            q_smem, k_smem, v_smem,  # scratch: [dk], [dk], [bv] model dtype
            *, block_v, r, dk, dv, kc, vrows, interpret):
    wait_for_inputs(interpret)
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    dtype = mixed_gmem.dtype
    tile = plgpu.Layout.WGMMA
    rows, cols = tile.reduce(1), tile.reduce(0)  # [n_rows] and [block_v] vectors of the tile
    channels = mixed_gmem.shape[1]
    act = active_gmem[b] != 0
    n = positions_gmem[b]
    group = (h // r) * (2 * dk + r * dv)  # first channel of key head h // r
    c0 = group + 2 * dk + (h % r) * dv + j * block_v  # first of this program's v channels

    def window(chans, layout):  # the Kc inputs of these channels, oldest first
        return ([plgpu.load(conv_gmem.at[b, conv_slot(n, t, kc), chans], layout=layout,
                            optimized=False)
                 for t in range(1 - kc, 0)]
                + [plgpu.load(mixed_gmem.at[b, chans], layout=layout, optimized=False)])

    def conv_silu(chans, layout):
        """(silu of the conv rounded to the model dtype, as float32; the window). Row layout only:
        the strided weight column w[chans, t] does not lower in the column layout."""
        xs, acc = window(chans, layout), None
        for t, x in enumerate(xs):
            wt = plgpu.load(w_gmem.at[chans, t], layout=layout, optimized=False)
            term = x.astype(f32) * wt.astype(f32)
            acc = term if acc is None else acc + term
        return (acc * _sigmoid(acc)).astype(dtype).astype(f32), xs

    def as_tile(vec, n_rows):  # [n_rows] row vector -> [n_rows, block_v], equal columns
        return lax.broadcast_in_dim(vec, (n_rows, block_v), [0])

    def along_rows(vec):  # [block_v] column vector -> [dk, block_v], equal rows
        return lax.broadcast_in_dim(vec, (dk, block_v), [1])

    # Every global load precedes the first cross-warp reduction, so its latency overlaps the conv.
    cols_v = pl.ds(j * block_v, block_v)
    s = plgpu.load(state_gmem.at[b, h, :, cols_v], layout=tile, optimized=False)  # [dk, bv]
    v_window = window(pl.ds(c0, block_v), cols)  # this program's v channels, column layout
    beta = _sigmoid_in(dtype, b_gmem[b, h].astype(f32))
    g = -jnp.exp(a_log_gmem[h].astype(f32)) * _softplus(a_gmem[b, h].astype(f32)
                                                         + dt_bias_gmem[h].astype(f32))

    # The v conv runs in the row layout over `vrows` channels from `start`, covering block_v.
    q, q_window = conv_silu(pl.ds(group, dk), rows)
    k, k_window = conv_silu(pl.ds(group + dk, dk), rows)
    start = jnp.minimum(c0, channels - vrows)
    v_rows, _ = conv_silu(pl.ds(start, vrows), rows)

    # L2 norms inside the tile: a row vector's full reduction does not lower, so the sum of
    # squares reduces the tile's rows into a [block_v] vector of equal entries.
    q, k = as_tile(q, dk), as_tile(k, dk)
    q = q * along_rows(lax.rsqrt(jnp.sum(q * q, axis=0) + L2NORM_EPS)) * (dk ** -0.5)
    k = k * along_rows(lax.rsqrt(jnp.sum(k * k, axis=0) + L2NORM_EPS))

    # v into the column layout: a masked sum over rows (one value plus zeros: exact).
    v_rows = as_tile(v_rows, vrows)
    pick = (lax.broadcasted_iota(jnp.int32, (vrows, block_v), 0)
            == lax.broadcasted_iota(jnp.int32, (vrows, block_v), 1) + (c0 - start))
    v = jnp.sum(jnp.where(pick, v_rows, jnp.zeros_like(v_rows)), axis=0)  # [block_v]

    s = jnp.exp(g) * s
    delta = beta * (v - jnp.sum(s * k, axis=0))  # [bv]
    s = s + k * along_rows(delta)
    o = jnp.sum(s * q, axis=0)
    s_smem[...] = s
    o_smem[...] = jnp.where(jnp.broadcast_to(act, o.shape), o, jnp.zeros_like(o))

    v_smem[...] = v_window[-1]
    q_smem[...] = q_window[-1]
    k_smem[...] = k_window[-1]

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, cols_v])
    slot = conv_slot(n, 0, kc)

    @pl.when(act)  # an inactive row's state and ring are not written: bit-exact
    def _():
        plgpu.copy_smem_to_gmem(s_smem, state_gmem.at[b, h, :, cols_v])
        plgpu.copy_smem_to_gmem(v_smem, conv_gmem.at[b, slot, pl.ds(c0, block_v)])

    @pl.when(act & (h % r == 0) & (j == 0))  # one program per key head writes its q, k channels
    def _():  # (two copies: one async copy moves at most 256 elements along a dimension)
        plgpu.copy_smem_to_gmem(q_smem, conv_gmem.at[b, slot, pl.ds(group, dk)])
        plgpu.copy_smem_to_gmem(k_smem, conv_gmem.at[b, slot, pl.ds(group + dk, dk)])

    plgpu.wait_smem_to_gmem(0)


def deltanet_decode_pallas(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                           conv_weight, A_log, dt_bias, *, num_key_heads: int,
                           block_v: int | None = None, interpret: bool = False):
    """The one-token Gated DeltaNet core in one kernel (math in the module docstring).

    Args:
      mixed_qkv: [B, C] model dtype (float32 or bfloat16): this token's ``in_proj_qkv`` output,
        channels grouped per key head (``params.conv_channel_order``), C = Hk * (2*dk + r*dv).
      a, b: [B, Hv] model dtype: the ``in_proj_a`` and ``in_proj_b`` outputs.
      active: [B] bool; False: the row's state and ring are kept bit-exact and its o is 0.
      positions: [B] int32 >= 0: this token's position (tokens already in the row).
      conv_state: [B, Kc, C] model dtype, the ring (position p at slot p % Kc); recurrent_state:
        [B, Hv, dk, dv] float32. Donated under jit, both are updated in place.
      conv_weight: [C, Kc] float32 or bfloat16 (``conv1d[:, 0, :]``); A_log, dt_bias: [Hv].
      num_key_heads: Hk (static).
      block_v: state columns per program (default ``gated_delta_decode.choose_block_v``).
      interpret: run in the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.

    Returns (o [B, Hv, dv] float32, new conv_state, new recurrent_state). Raises ValueError
    before any work: shapes that disagree; other dtypes; Hv not a multiple of Hk; dk not a
    multiple of 64 up to 256; Kc < 2; dv not a multiple of ``block_v``, or ``block_v`` not a
    multiple of 8 up to 256.
    """
    name = "deltanet_decode_pallas"
    hk, hv, dk, dv, kc = _check(name, mixed_qkv, a, b, active, positions, conv_state,
                                recurrent_state, conv_weight, A_log, dt_bias, num_key_heads)
    batch = recurrent_state.shape[0]
    if block_v is None:
        block_v = choose_block_v(batch, hv, dv)
    why = None
    if dk % TILE_ROWS or dk > MAX_COPY:
        why = f"linear_key_head_dim={dk} is not a multiple of {TILE_ROWS} up to {MAX_COPY}"
    elif kc < 2:
        why = f"linear_conv_kernel_dim={kc} must be at least 2"
    elif block_v <= 0 or block_v % 8 or block_v > MAX_COPY:
        why = f"{block_v=} must be a positive multiple of 8 up to {MAX_COPY}"
    elif dv % block_v:
        why = f"linear_value_head_dim={dv} is not a multiple of {block_v=}"
    if why is not None:
        raise ValueError(f"{name}: {why}")
    if batch * hv == 0:
        return (jnp.zeros((batch, hv, dv), f32), conv_state, recurrent_state)
    # Row-layout v window: a multiple of the tile's 64 rows >= block_v (C >= vrows holds).
    vrows = -(-block_v // TILE_ROWS) * TILE_ROWS
    dtype = mixed_qkv.dtype
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_v=block_v, r=hv // hk, dk=dk, dv=dv, kc=kc,
                          vrows=vrows, interpret=interpret),
        out_type=(),
        scratch_types=(plgpu.SMEM((dk, block_v), f32), plgpu.SMEM((block_v,), f32),
                       plgpu.SMEM((dk,), dtype), plgpu.SMEM((dk,), dtype),
                       plgpu.SMEM((block_v,), dtype)),
        grid=(batch, hv, dv // block_v), grid_names=("b", "h", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    # A bool in global memory is a byte; int32 keeps the kernel's scalar read plain.
    active = active.astype(jnp.int32)

    # Mutable refs: the writes become outputs aliased to the inputs (o: lax.empty, fully written).
    def run(refs):
        o_ref, conv_ref, state_ref = refs
        kernel(mixed_qkv, a, b, active, positions, conv_weight, A_log, dt_bias, o_ref, conv_ref,
               state_ref)

    return pl.run_state(run)((lax.empty((batch, hv, dv), f32), conv_state, recurrent_state))


def deltanet_decode_reference(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                              conv_weight, A_log, dt_bias, *, num_key_heads: int):
    """The XLA form (conv, masking, L2 norms, gating, then ``gated_delta_decode_reference``);
    arguments and result as :func:`deltanet_decode_pallas`, any Kc >= 1 and head dims."""
    return deltanet_decode_xla(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                               conv_weight, A_log, dt_bias, num_key_heads=num_key_heads)


def deltanet_decode_xla(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                        conv_weight, A_log, dt_bias, *, num_key_heads: int,
                        delta_rule=gated_delta_decode_reference):
    """:func:`deltanet_decode_reference` with its delta rule replaced by ``delta_rule`` (of
    ``gated_delta_decode_reference``'s signature: that one, or the one-pass kernel)."""
    hk, hv, dk, dv, kc = _check("deltanet_decode_reference", mixed_qkv, a, b, active, positions,
                                conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                                num_key_heads)
    batch = mixed_qkv.shape[0]
    # HF causal_conv1d_update over [cached Kc-1 inputs | this token]; w[:, Kc-1] hits this token.
    window = conv_window(conv_state, positions)  # [B, Kc-1, C]
    hist = jnp.concatenate([window.astype(mixed_qkv.dtype), mixed_qkv[:, None]], axis=1)
    w = conv_weight.astype(f32)  # [C, Kc]
    conv = sum(hist[:, t].astype(f32) * w[:, t] for t in range(kc))  # [B, C]
    conv = jax.nn.silu(conv).astype(mixed_qkv.dtype)
    # This token into slot positions % Kc (active rows): a select XLA does in place when donated.
    write = (jnp.arange(kc)[None, :] == conv_slot(positions, 0, kc)[:, None]) & active[:, None]
    new_conv_state = jnp.where(write[:, :, None], mixed_qkv[:, None].astype(conv_state.dtype),
                               conv_state)

    grouped = conv.reshape(batch, hk, 2 * dk + (hv // hk) * dv)
    q = grouped[..., :dk].astype(f32)
    k = grouped[..., dk:2 * dk].astype(f32)
    v = grouped[..., 2 * dk:].reshape(batch, hv, dv).astype(f32)
    beta = sigmoid(b).astype(f32)  # torch's bf16 sigmoid: float32 math, one rounding
    # Log-space decay g = -exp(A_log) * softplus(a + dt_bias) <= 0, in float32 as HF.
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    q = l2_normalize(q) * (dk ** -0.5)
    k = l2_normalize(k)
    # An inactive row is inert (q = k = v = 0, beta = g = 0): S passes through unchanged.
    q, k, v = (jnp.where(active[:, None, None], t, 0.0) for t in (q, k, v))
    g, beta = (jnp.where(active[:, None], t, 0.0) for t in (g, beta))
    o, new_state = delta_rule(q, k, v, g, beta, recurrent_state)
    return o, new_conv_state, new_state


def check_supported(recurrent_state_shape, kernel_size, dtype=jnp.bfloat16) -> str | None:
    """Why the kernel cannot take these (consistent) shapes or this model dtype; None if it can."""
    batch, heads, dk, dv = recurrent_state_shape
    if jnp.dtype(dtype) not in MODEL_DTYPES:
        return f"model dtype {jnp.dtype(dtype)} (the kernel takes float32 and bfloat16)"
    if dk % TILE_ROWS or dk > MAX_COPY:
        return f"linear_key_head_dim={dk} is not a multiple of {TILE_ROWS} up to {MAX_COPY}"
    if dv % 8 or choose_block_v(batch, heads, dv) > MAX_COPY:
        return (f"linear_value_head_dim={dv} is not a multiple of 8, or not of 16 and above "
                f"{MAX_COPY}")
    if kernel_size < 2:
        return f"linear_conv_kernel_dim={kernel_size} must be at least 2"
    return None
