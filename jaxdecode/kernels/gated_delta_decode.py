"""One-token gated delta rule as a Pallas Mosaic GPU kernel: the state read once, written once.

Same inputs and result as ``jaxdecode.gated_delta.gated_delta_rule_step``:

  q, k   [B, H, dk]      float32 (L2-normalised, q scaled by dk**-0.5, repeated to value heads)
  v      [B, H, dv]      float32
  g, beta [B, H]         float32 (log-space decay, write strength)
  state  [B, H, dk, dv]  float32

  d = exp(g);  u_k = S^T k, u_q = S^T q  (one pass over the old S)
  delta = beta (v - d u_k);  S' = d S + k delta^T;  o = S'^T q = d u_q + (k . q) delta

(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10; HF
``torch_recurrent_gated_delta_rule``.) Program (b, h, j) holds columns ``[j*block_v,
(j+1)*block_v)`` of S[b, h] in registers (a [dk, block_v] float32 tile in the wgmma register
layout), reduces over dk for both products (across warps through shared memory), updates the
tile and writes it back; the state output aliases the input, so the update is in place. XLA's
form of the same step makes three to four passes over S (benchmarks/RESULTS.md).

Status: tested against a float64 recurrence in the Mosaic GPU interpreter on CPU, and its lowering
for CUDA (with the state aliased in place) is checked on CPU (tests/test_gpu_lowering.py); **not
yet compiled or timed on a GPU**, so the model does not use it (``jaxdecode.model`` keeps the XLA
form; ``benchmarks/step_profile.py --deltanet-steps library,pallas`` swaps it in to time it).

Differences from the XLA form: not ``jax.vmap``-able (``pl.run_state`` has no batching rule; fold
extra batch dimensions into B); with non-finite inputs some outputs are inf where the XLA form
gives NaN (both non-finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE_ROWS = 64  # the wgmma register layout covers rows in multiples of 64


def choose_block_v(dv: int) -> int:
    """Columns of S per program: 64 when dv allows (a [dk, 64] float32 tile is 64 registers per
    thread at dk = 128, leaving room for the products; and it doubles the programs at small
    batch), else the whole dv."""
    return 64 if dv % 64 == 0 else dv


def _kernel(k_gmem, q_gmem, v_gmem, decay_gmem, beta_gmem, kq_gmem, o_gmem, state_gmem,
            s_smem, o_smem, *, block_v):
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * block_v, block_v)
    layout = plgpu.Layout.WGMMA
    s = plgpu.load(state_gmem.at[b, h, :, cols], layout=layout, optimized=False)  # [dk, bv]
    k = plgpu.load(k_gmem.at[b, h], layout=layout.reduce(1), optimized=False)  # [dk]
    q = plgpu.load(q_gmem.at[b, h], layout=layout.reduce(1), optimized=False)
    v = plgpu.load(v_gmem.at[b, h, cols], layout=layout.reduce(0), optimized=False)  # [bv]
    decay, beta, kq = decay_gmem[b, h], beta_gmem[b, h], kq_gmem[b, h]
    k_rows = lax.broadcast_in_dim(k, s.shape, [0])
    u_k = jnp.sum(s * k_rows, axis=0)  # [bv]
    u_q = jnp.sum(s * lax.broadcast_in_dim(q, s.shape, [0]), axis=0)
    delta = beta * (v - decay * u_k)
    s_smem[...] = decay * s + k_rows * lax.broadcast_in_dim(delta, s.shape, [1])
    o_smem[...] = decay * u_q + kq * delta
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, state_gmem.at[b, h, :, cols])
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, cols])
    plgpu.wait_smem_to_gmem(0)


def gated_delta_decode_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                              interpret: bool = False):
    """The one-token gated delta rule in one pass over the state (see the module docstring).

    Args:
      q, k: [B, H, dk] float32; v: [B, H, dv] float32; g, beta: [B, H] float32;
      state: [B, H, dk, dv] float32 (donate it under jit and the update is in place).
      block_v: state columns per program (default :func:`choose_block_v`).
      interpret: run in the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (o [B, H, dv] float32, new state [B, H, dk, dv] float32).

    Raises:
      ValueError: inputs not float32, shapes that disagree, dk not a multiple of 64, or dv not
        a multiple of ``block_v`` (itself a multiple of 8).
    """
    batch, heads, dk, dv = state.shape
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    bad = {n: x.dtype for n, x in arrays.items() if x.dtype != jnp.float32}
    if bad:
        raise ValueError(f"gated_delta_decode_pallas takes float32 inputs; got {bad}")
    want = dict(q=(batch, heads, dk), k=(batch, heads, dk), v=(batch, heads, dv),
                g=(batch, heads), beta=(batch, heads))
    wrong = {n: (tuple(arrays[n].shape), s) for n, s in want.items() if arrays[n].shape != s}
    if wrong:
        raise ValueError(f"shapes (got, expected from state {state.shape}): {wrong}")
    block_v = block_v or choose_block_v(dv)
    if dk % TILE_ROWS or dv % block_v or block_v % 8:
        raise ValueError(f"need dk % {TILE_ROWS} == 0 and dv % block_v == 0 with block_v % 8 == "
                         f"0; got {dk=}, {dv=}, {block_v=}")
    if batch * heads == 0:
        return jnp.zeros((batch, heads, dv), jnp.float32), state
    decay = jnp.exp(g)
    kq = jnp.sum(k * q, axis=-1)
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_v=block_v),
        out_type=(),
        scratch_types=(plgpu.SMEM((dk, block_v), jnp.float32),
                       plgpu.SMEM((block_v,), jnp.float32)),
        grid=(batch, heads, dv // block_v), grid_names=("b", "h", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    # o and the state are passed as mutable refs: the kernel writes them, and JAX turns the
    # writes into outputs aliased to those inputs (the state is updated in place).
    def run(refs):
        o_ref, state_ref = refs
        kernel(k, q, v, decay, beta, kq, o_ref, state_ref)

    o, new_state = pl.run_state(run)((jnp.zeros((batch, heads, dv), jnp.float32), state))
    return o, new_state
