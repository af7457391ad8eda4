"""One-token gated delta rule as a Pallas Mosaic GPU kernel: the state read once, written once.

The step of ``jaxdecode.gated_delta.gated_delta_rule_step`` (HF
``torch_recurrent_gated_delta_rule``), with GQA done in the kernel:

  q, k    [B, Hk, dk]      float32 (L2-normalised, q scaled by dk**-0.5), per KEY head
  v       [B, Hv, dv]      float32
  g, beta [B, Hv]          float32 (log-space decay, write strength)
  state   [B, Hv, dk, dv]  float32;  value head h reads key head h // (Hv // Hk)

  S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q

Program (b, h, j) holds columns ``[j*block_v, (j+1)*block_v)`` of S[b, h] as a [dk, block_v]
float32 tile in the wgmma register layout and writes it back in place (the state output aliases
the input); XLA's form makes several passes over S (benchmarks/RESULTS.md). Unlike the XLA form it
is not ``jax.vmap``-able (``pl.run_state`` has no batching rule), and non-finite inputs may give
inf where XLA gives NaN.

:func:`gated_delta_states_pallas` runs the same step over T tokens (a speculative verify step's
few) and writes the state after every token: the state read once, T states written, no copies
(``gated_delta.naive_gated_delta_rule(..., all_states=True)`` is its reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.gated_delta import gated_delta_rule_step
from jaxdecode.kernels import wait_for_inputs

TILE_ROWS = 64  # the wgmma register layout covers rows in multiples of 64
TARGET_PROGRAMS = 264  # two per SM of a 132-SM Hopper GPU
STATES_SMEM_BYTES = 160 * 1024  # the T staged state tiles of a states-kernel program


def choose_block_v(batch: int, heads: int, dv: int) -> int:
    """Columns of S per program: 32 when that still gives ``TARGET_PROGRAMS`` programs, else 16 to
    spread small batches over more programs (dv if 16 does not divide it); benchmarks/RESULTS.md."""
    for bv in (32, 16):
        if dv % bv == 0 and batch * heads * (dv // bv) >= TARGET_PROGRAMS:
            return bv
    return 16 if dv % 16 == 0 else dv


def _heads_error(key_heads: int, value_heads: int) -> str | None:
    if key_heads == 0 or value_heads % key_heads:
        return f"{value_heads} value heads are not a multiple of {key_heads} key heads"
    return None


def check_supported(q_shape, state_shape) -> str | None:
    """Why the kernel cannot take these shapes (None if it can)."""
    _, hk, dk = q_shape
    _, hv, _, dv = state_shape
    if dk <= 0 or dv <= 0:
        return f"head dims must be positive (linear_key_head_dim={dk}, linear_value_head_dim={dv})"
    if dk % TILE_ROWS:
        return f"linear_key_head_dim={dk} is not a multiple of {TILE_ROWS}"
    if dv % 8:
        return f"linear_value_head_dim={dv} is not a multiple of 8"
    return _heads_error(hk, hv)


def _validate(name: str, arrays: dict, want: dict, where: str, reason, block_v: int,
              dv: int) -> None:
    """Both kernels' host checks, in order: every array float32, each of ``want``'s shapes
    (expected ``where`` from), ``reason()`` (the kernel's own: called once the shapes hold),
    then ``block_v`` a positive multiple of 8 dividing dv. Raises ValueError naming ``name``."""
    bad = {n: x.dtype for n, x in arrays.items() if x.dtype != jnp.float32}
    if bad:
        raise ValueError(f"{name} takes float32 inputs; got {bad}")
    wrong = {n: (tuple(arrays[n].shape), s) for n, s in want.items() if arrays[n].shape != s}
    if wrong:
        raise ValueError(f"{name}: shapes (got, expected from {where}): {wrong}")
    why = reason()
    if why is None and (block_v <= 0 or dv % block_v or block_v % 8):
        why = f"dv={dv} is not a multiple of block_v={block_v}, or block_v not of 8"
    if why is not None:
        raise ValueError(f"{name}: {why}")


def _kernel(q_gmem, k_gmem, v_gmem, g_gmem, beta_gmem, o_gmem, state_gmem, s_smem, o_smem, *,
            block_v, r, interpret):
    wait_for_inputs(interpret)
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * block_v, block_v)
    layout = plgpu.Layout.WGMMA
    s = plgpu.load(state_gmem.at[b, h, :, cols], layout=layout, optimized=False)  # [dk, bv]
    k = plgpu.load(k_gmem.at[b, h // r], layout=layout.reduce(1), optimized=False)  # [dk]
    q = plgpu.load(q_gmem.at[b, h // r], layout=layout.reduce(1), optimized=False)
    v = plgpu.load(v_gmem.at[b, h, cols], layout=layout.reduce(0), optimized=False)  # [bv]
    decay, beta = jnp.exp(g_gmem[b, h]), beta_gmem[b, h]
    k_rows = lax.broadcast_in_dim(k, s.shape, [0])
    s = decay * s
    delta = beta * (v - jnp.sum(s * k_rows, axis=0))  # [bv]
    s = s + k_rows * lax.broadcast_in_dim(delta, s.shape, [1])
    s_smem[...] = s
    o_smem[...] = jnp.sum(s * lax.broadcast_in_dim(q, s.shape, [0]), axis=0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, state_gmem.at[b, h, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def gated_delta_decode_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                              interpret: bool = False):
    """The one-token gated delta rule in one pass over the state (see the module docstring).

    Shapes as in the module docstring (``state`` donated under jit is updated in place);
    ``block_v``: state columns per program (default :func:`choose_block_v`); ``interpret``: run
    in the Mosaic GPU interpreter (CPU). Returns (o [B, Hv, dv], new state), float32. Raises
    ValueError: inputs not float32, shapes that disagree, dk not a multiple of 64, Hv not a
    multiple of Hk, or dv not a multiple of ``block_v`` (itself a multiple of 8).
    """
    batch, heads, dk, dv = state.shape
    key_heads = q.shape[1] if q.ndim == 3 else -1
    block_v = block_v or choose_block_v(batch, heads, dv)
    _validate("gated_delta_decode_pallas", dict(q=q, k=k, v=v, g=g, beta=beta, state=state),
              dict(q=(batch, key_heads, dk), k=(batch, key_heads, dk), v=(batch, heads, dv),
                   g=(batch, heads), beta=(batch, heads)), f"state {state.shape}",
              lambda: check_supported(q.shape, state.shape), block_v, dv)
    if batch * heads == 0:
        return jnp.zeros((batch, heads, dv), jnp.float32), state
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_v=block_v, r=heads // key_heads, interpret=interpret),
        out_type=(),
        scratch_types=(plgpu.SMEM((dk, block_v), jnp.float32),
                       plgpu.SMEM((block_v,), jnp.float32)),
        grid=(batch, heads, dv // block_v), grid_names=("b", "h", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    # Mutable refs: the writes become outputs aliased to the inputs (o: lax.empty, fully written).
    def run(refs):
        o_ref, state_ref = refs
        kernel(q, k, v, g, beta, o_ref, state_ref)

    return pl.run_state(run)((lax.empty((batch, heads, dv), jnp.float32), state))


def _states_kernel(q_gmem, k_gmem, v_gmem, g_gmem, beta_gmem, state_gmem, o_gmem, states_gmem,
                   s_smem, o_smem, *, block_v, r, length, interpret):
    wait_for_inputs(interpret)
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * block_v, block_v)
    layout = plgpu.Layout.WGMMA
    s = plgpu.load(state_gmem.at[b, h, :, cols], layout=layout, optimized=False)  # [dk, bv]
    for t in range(length):  # static: T is a few tokens
        k = plgpu.load(k_gmem.at[b, t, h // r], layout=layout.reduce(1), optimized=False)
        q = plgpu.load(q_gmem.at[b, t, h // r], layout=layout.reduce(1), optimized=False)
        v = plgpu.load(v_gmem.at[b, t, h, cols], layout=layout.reduce(0), optimized=False)
        decay, beta = jnp.exp(g_gmem[b, t, h]), beta_gmem[b, t, h]
        k_rows = lax.broadcast_in_dim(k, s.shape, [0])
        s = decay * s
        delta = beta * (v - jnp.sum(s * k_rows, axis=0))  # [bv]
        s = s + k_rows * lax.broadcast_in_dim(delta, s.shape, [1])
        s_smem.at[t][...] = s
        o_smem.at[t][...] = jnp.sum(s * lax.broadcast_in_dim(q, s.shape, [0]), axis=0)
    plgpu.commit_smem()
    for t in range(length):
        plgpu.copy_smem_to_gmem(s_smem.at[t], states_gmem.at[b, t, h, :, cols])
        plgpu.copy_smem_to_gmem(o_smem.at[t], o_gmem.at[b, t, h, cols])
    plgpu.wait_smem_to_gmem(0)


def check_states_supported(q_shape, state_shape, block_v: int | None = None) -> str | None:
    """Why :func:`gated_delta_states_pallas` cannot take q [B, T, Hk, dk] and this state (None
    if it can): :func:`check_supported`'s reasons, or T staged state tiles over
    :data:`STATES_SMEM_BYTES`."""
    batch, length, hk, dk = q_shape
    why = check_supported((batch, hk, dk), state_shape)
    if why is not None:
        return why
    block_v = block_v or choose_block_v(batch, state_shape[1], state_shape[3])
    if length * (dk + 1) * block_v * 4 > STATES_SMEM_BYTES:
        return (f"{length} tokens of [{dk}, {block_v}] float32 state tiles exceed "
                f"{STATES_SMEM_BYTES} bytes of shared memory")
    return None


def gated_delta_states_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                              interpret: bool = False):
    """The gated delta rule over T tokens keeping the state after each (HF
    ``torch_recurrent_gated_delta_rule`` token by token; spec §10's per-token states).

    q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv], state [B, Hv, dk, dv], all
    float32 (the module docstring's per-token shapes with a T axis; value head h reads key head
    h // (Hv // Hk)). Returns (o [B, T, Hv, dv], states [B, T, Hv, dk, dv]: the state after
    token t), float32; ``state`` is only read. An inert token (g = beta = 0, k = 0) passes the
    state through. Raises ValueError: inputs not float32, shapes that disagree, or what
    :func:`check_states_supported` names.
    """
    batch, heads, dk, dv = state.shape
    length, key_heads = (q.shape[1], q.shape[2]) if q.ndim == 4 else (-1, -1)
    block_v = block_v or choose_block_v(batch, heads, dv)
    _validate("gated_delta_states_pallas", dict(q=q, k=k, v=v, g=g, beta=beta, state=state),
              dict(q=(batch, length, key_heads, dk), k=(batch, length, key_heads, dk),
                   v=(batch, length, heads, dv), g=(batch, length, heads),
                   beta=(batch, length, heads)), f"q {q.shape} and state {state.shape}",
              lambda: check_states_supported(q.shape, state.shape, block_v), block_v, dv)
    f32 = jnp.float32
    if batch * heads * length == 0:
        return (jnp.zeros((batch, length, heads, dv), f32),
                jnp.zeros((batch, length, heads, dk, dv), f32))
    kernel = plgpu.kernel(
        functools.partial(_states_kernel, block_v=block_v, r=heads // key_heads, length=length,
                          interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, length, heads, dv), f32),
                  jax.ShapeDtypeStruct((batch, length, heads, dk, dv), f32)),
        scratch_types=(plgpu.SMEM((length, dk, block_v), f32),
                       plgpu.SMEM((length, block_v), f32)),
        grid=(batch, heads, dv // block_v), grid_names=("b", "h", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(q, k, v, g, beta, state)


def gated_delta_decode_reference(q, k, v, g, beta, state):
    """The XLA form (q, k repeated to the value heads, then ``gated_delta_rule_step``); arguments
    and result as :func:`gated_delta_decode_pallas`."""
    why = _heads_error(q.shape[1], state.shape[1])
    if why is not None:
        raise ValueError(f"gated_delta_decode_reference: {why}")
    r = state.shape[1] // q.shape[1]
    return gated_delta_rule_step(jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1), v, g, beta,
                                 state)
