"""The whole one-token Gated DeltaNet mixer core as one Pallas Mosaic GPU kernel.

At decode time the core between the input projections and the gated RMSNorm of a Gated DeltaNet
layer (HF ``Qwen3_5GatedDeltaNet``, spec §1.4) is, per row b, for this row's one new token:

  conv window  hist = [window[b] | mixed_qkv[b]]                       [Kc, C]  (model dtype)
               window[b] = the ring conv_state[b] [Kc, C] at the slots of positions
               n-Kc+1 .. n-1, n = positions[b] (``jaxdecode.state.conv_window``)
  conv         x = silu(sum_t f32(hist[t]) * f32(w[:, t]))  -> model dtype -> float32   [C]
  split        per key head i: [q_i (dk) | k_i (dk) | v of its r value heads (r * dv)]
  gating       beta = f32(sigmoid(b))  (in float32, rounded once to the model dtype)
               g = -exp(f32(A_log)) * softplus(f32(a) + f32(dt_bias))  (float32, <= 0)
  norms        q <- l2norm(q) * dk**-0.5;  k <- l2norm(k);   l2norm(x) = x * rsqrt(sum(x^2) + 1e-6)
  delta rule   value head h reads key head h // r (r = Hv // Hk):
               S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
  new ring     conv_state[b, n % Kc] = mixed_qkv[b] (the one slot the window does not read)

(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10; HF ``Qwen3_5GatedDeltaNet``
and ``torch_recurrent_gated_delta_rule``.) A row with ``active[b]`` False takes no token: its
recurrent state and conv ring are left bit-exact and its o is 0 (the model's masking: q = k =
v = 0, g = beta = 0, ring unchanged).

XLA runs this as about six small kernels per layer (conv window, norms, gating, delta rule,
readout); :func:`deltanet_decode_pallas` is one. Grid (B, Hv, dv // block_v): program (b, h, j)
holds columns ``[j*block_v, (j+1)*block_v)`` of S[b, h] as a [dk, block_v] float32 tile in the
wgmma register layout (as ``gated_delta_decode``), and recomputes what it needs from the raw
inputs: the conv and L2 norm of key head h // r's q and k (2*dk channels; every program of that
key head repeats this, cheap next to the tile), the conv of its own block_v v channels, g and
beta. The recurrent state and the conv ring are updated in place (outputs aliased to the inputs;
an inactive row's are not written at all). Programs of one key head read its q and k window
channels while one of them writes them, which is safe because the ring's write slot n % Kc is
the one slot no window reads; each channel of that slot is written by exactly one program:
program (b, h, j) its block_v v channels, program (b, h, 0) with h % r == 0 the 2*dk q and k
channels of key head h // r.

Tested against a float64 numpy version of the whole core in the Mosaic GPU interpreter on CPU;
its CUDA lowering (state and ring aliased in place) is checked on CPU in
tests/test_gpu_lowering.py.
:func:`deltanet_decode_reference` is the model's decode math factored out;
``jaxdecode.kernels.choice`` decides when the model uses the kernel.
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


# ----- the kernel ------------------------------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _sigmoid_in(dtype, x):
    """sigmoid of a ``dtype`` value computed in float32 and rounded once to ``dtype`` (as torch's
    ``sigmoid`` of a bfloat16 tensor, and as jitted XLA computes ``jax.nn.sigmoid``; eager JAX
    rounds after each op instead)."""
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

    def window(chans, layout):
        """The Kc inputs of these channels, oldest first: the ring's slots of positions
        n-Kc+1 .. n-1, then this token."""
        return ([plgpu.load(conv_gmem.at[b, conv_slot(n, t, kc), chans], layout=layout,
                            optimized=False)
                 for t in range(1 - kc, 0)]
                + [plgpu.load(mixed_gmem.at[b, chans], layout=layout, optimized=False)])

    def conv_silu(chans, layout):
        """silu of the causal conv, rounded to the model dtype, as float32 (the model's casts),
        and the window. The weight column w[chans, t] is a strided load (stride Kc): it lowers
        in the row layout (one element per thread register), not in the column layout (whose
        registers hold pairs of adjacent columns, which must be contiguous)."""
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

    # Every global load comes before the first cross-warp reduction (a barrier) in program
    # order, so the state tile's load latency can overlap the conv work.
    cols_v = pl.ds(j * block_v, block_v)
    s = plgpu.load(state_gmem.at[b, h, :, cols_v], layout=tile, optimized=False)  # [dk, bv]
    v_window = window(pl.ds(c0, block_v), cols)  # this program's v channels, column layout
    beta = _sigmoid_in(dtype, b_gmem[b, h].astype(f32))
    g = -jnp.exp(a_log_gmem[h].astype(f32)) * _softplus(a_gmem[b, h].astype(f32)
                                                         + dt_bias_gmem[h].astype(f32))

    # The convs of key head h // r's q and k, and of v. The v conv runs in the row layout over
    # `vrows` channels from `start` (covering this program's block_v; see conv_silu).
    q, q_window = conv_silu(pl.ds(group, dk), rows)
    k, k_window = conv_silu(pl.ds(group + dk, dk), rows)
    start = jnp.minimum(c0, channels - vrows)
    v_rows, _ = conv_silu(pl.ds(start, vrows), rows)

    # q and k L2-normalised inside the tile. The sum of squares is a reduction over the tile's
    # rows (a full reduction of a row vector to a scalar does not lower), so it arrives as a
    # [block_v] vector of equal entries.
    q, k = as_tile(q, dk), as_tile(k, dk)
    q = q * along_rows(lax.rsqrt(jnp.sum(q * q, axis=0) + L2NORM_EPS)) * (dk ** -0.5)
    k = k * along_rows(lax.rsqrt(jnp.sum(k * k, axis=0) + L2NORM_EPS))

    # v into the column layout: a masked sum over the rows picks this program's block_v
    # channels (each column sums one value and zeros: exact).
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

    # This token's inputs go to the ring's slot n % Kc, which no program's window reads.
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
      mixed_qkv: [B, C] model dtype (float32 or bfloat16): this token's ``in_proj_qkv`` output
        before the conv, channels grouped per key head ``[q_i | k_i | v of its r value heads]``
        (``jaxdecode.params.conv_channel_order``), C = Hk * (2*dk + r*dv), r = Hv // Hk.
      a, b: [B, Hv] model dtype: the ``in_proj_a`` and ``in_proj_b`` outputs.
      active: [B] bool: the row takes this token (it has a new token). False: its state and ring
        are kept bit-exact and its o is 0.
      positions: [B] int32 >= 0: this token's position (tokens already in the row).
      conv_state: [B, Kc, C] model dtype: the ring of pre-conv inputs, position p at slot
        p % Kc (``jaxdecode.state.DecodeState``); donate it under jit and the update (one slot)
        is in place.
      recurrent_state: [B, Hv, dk, dv] float32; donate it under jit and the update is in place.
      conv_weight: [C, Kc] float32 or bfloat16: the ``conv1d`` param [C, 1, Kc] as
        ``conv1d[:, 0, :]``; ``w[:, Kc-1]`` multiplies the current token.
      A_log, dt_bias: [Hv] float32 or bfloat16.
      num_key_heads: Hk (static).
      block_v: state columns per program (default ``gated_delta_decode.choose_block_v``: 16 at
        small batches, 32 from 264 programs up).
      interpret: run in the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (o [B, Hv, dv] float32, new conv_state [B, Kc, C] (conv_state's dtype),
      new recurrent_state [B, Hv, dk, dv] float32).

    Raises:
      ValueError (before any work): shapes that disagree; dtypes other than the above; Hv not
        a multiple of Hk; dk not a multiple of 64 up to 256; Kc < 2; dv not a multiple of
        ``block_v``, or ``block_v`` not a multiple of 8 up to 256.
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
    # v channels are convolved over a row-layout window of vrows >= block_v channels (a
    # multiple of the tile's 64 rows; C >= 2*dk + dv >= vrows always holds).
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
    # A bool in global memory is a byte; int32 keeps the kernel's scalar read plain (XLA fuses
    # the convert into the op that computes `active`).
    active = active.astype(jnp.int32)

    # o, the ring and the state are mutable refs: the kernel's writes become outputs aliased to
    # them. The ring and the state are updated in place; o starts uninitialised (lax.empty),
    # since every element is written.
    def run(refs):
        o_ref, conv_ref, state_ref = refs
        kernel(mixed_qkv, a, b, active, positions, conv_weight, A_log, dt_bias, o_ref, conv_ref,
               state_ref)

    return pl.run_state(run)((lax.empty((batch, hv, dv), f32), conv_state, recurrent_state))


def deltanet_decode_reference(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                              conv_weight, A_log, dt_bias, *, num_key_heads: int):
    """The XLA form: the decode branch of ``jaxdecode.model.gated_delta_net`` (conv, masking, L2
    norms, gating) then ``gated_delta_decode_reference``. Arguments and result as
    :func:`deltanet_decode_pallas`; any Kc >= 1 and head dims."""
    return deltanet_decode_xla(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                               conv_weight, A_log, dt_bias, num_key_heads=num_key_heads)


def deltanet_decode_xla(mixed_qkv, a, b, active, positions, conv_state, recurrent_state,
                        conv_weight, A_log, dt_bias, *, num_key_heads: int,
                        delta_rule=gated_delta_decode_reference):
    """Conv, masking, L2 norms and gating in XLA, then ``delta_rule`` (a function with
    ``gated_delta_decode_reference``'s signature: that one, or the one-pass kernel). Arguments
    (but ``delta_rule``), result and errors as :func:`deltanet_decode_reference`."""
    hk, hv, dk, dv, kc = _check("deltanet_decode_reference", mixed_qkv, a, b, active, positions,
                                conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                                num_key_heads)
    batch = mixed_qkv.shape[0]
    # Causal depthwise conv over [cached Kc-1 inputs | this token]; cross-correlation, so
    # w[:, Kc-1] multiplies the current token (spec §1.4).
    window = conv_window(conv_state, positions)  # [B, Kc-1, C]
    hist = jnp.concatenate([window.astype(mixed_qkv.dtype), mixed_qkv[:, None]], axis=1)
    w = conv_weight.astype(f32)  # [C, Kc]
    conv = sum(hist[:, t].astype(f32) * w[:, t] for t in range(kc))  # [B, C]
    conv = jax.nn.silu(conv).astype(mixed_qkv.dtype)
    # This token into the ring's slot positions % Kc (active rows only): a select at equal
    # indices, which XLA does in place in a donated buffer.
    write = (jnp.arange(kc)[None, :] == conv_slot(positions, 0, kc)[:, None]) & active[:, None]
    new_conv_state = jnp.where(write[:, :, None], mixed_qkv[:, None].astype(conv_state.dtype),
                               conv_state)

    grouped = conv.reshape(batch, hk, 2 * dk + (hv // hk) * dv)
    q = grouped[..., :dk].astype(f32)
    k = grouped[..., dk:2 * dk].astype(f32)
    v = grouped[..., 2 * dk:].reshape(batch, hv, dv).astype(f32)
    beta = sigmoid(b).astype(f32)  # torch's bf16 sigmoid: float32 math, one rounding
    # Log-space decay g = -exp(A_log) * softplus(a + dt_bias) <= 0, in float32 (spec §7 item 6).
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    q = l2_normalize(q) * (dk ** -0.5)
    k = l2_normalize(k)
    # An inactive row is inert (q = k = v = 0, beta = g = 0): S passes through unchanged.
    q, k, v = (jnp.where(active[:, None, None], t, 0.0) for t in (q, k, v))
    g, beta = (jnp.where(active[:, None], t, 0.0) for t in (g, beta))
    o, new_state = delta_rule(q, k, v, g, beta, recurrent_state)
    return o, new_conv_state, new_state


def check_supported(recurrent_state_shape, kernel_size, dtype=jnp.bfloat16) -> str | None:
    """Why the kernel cannot take these shapes or this model dtype (None if it can; shapes
    assumed consistent)."""
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
