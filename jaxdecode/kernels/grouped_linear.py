"""A grouped linear for the MoE block at decode: each group's few rows times one expert's weight,
reading only the weights the groups name (the routed experts' and the shared expert's).

Shapes: x [Gx, M, K] (Gx = G: group g multiplies x[g]; Gx = 1: every group multiplies x[0]),
groups [G] int32 expert ids into weight [E, N, K]; the last ``G - num_routed`` groups take the
shared weight instead, given as row pieces ``shared`` ([N_i, K] each, sum N_i = N: the shared
expert's gate_proj and up_proj for the gate/up projection, its down_proj for the down). Result
[G, M, N] float32: ``out[g] = x[g or 0] @ W_g.T`` accumulated in float32.
:func:`grouped_linear_reference` is that in ``jnp``; :func:`grouped_linear_pallas` the same as a
Pallas Mosaic GPU kernel (Hopper) for M <= 64, a decode step's tokens.

Why a kernel (benchmarks/RESULTS.md, the MoE tables): XLA streams the chosen experts' weights in
place but as separate, partly idle kernels per layer (the routed gate/up, silu·up, the routed
down, then the shared expert's gate/up and down on a few SMs each); one launch per projection
over all groups keeps every SM streaming. A program owns 128 weight rows of one group and a range
of 64-column blocks; a TMA warpgroup streams the [128, 64] weight blocks (the expert picked by
the group's id) and x's [M, 64] slices through ``num_stages`` buffers; two compute warpgroups
each take 64 rows as wgmma's A operand straight from shared memory: out^T [64, M] += W [64, 64]
@ x^T [64, M]. Few groups cannot fill the GPU, so the column blocks may be split over programs
(split-K); each writes its float32 partial and XLA adds the splits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxdecode.kernels import stream_blocks, wait_for_inputs
from jaxdecode.kernels.decode_attention import _accumulate, _smem_tile

BLOCK_N = 128  # weight rows per program
BLOCK_K = 64  # columns per step: one 128-byte swizzle of a 16-bit dtype
ROWS_PER_WG = 64  # one wgmma M tile
COMPUTE_WGS = BLOCK_N // ROWS_PER_WG
MAX_ROWS = 64  # x rows per group (the accumulator [64, M] float32 stays in registers)
SMEM_LIMIT_BYTES = 227 * 1024  # what a Hopper CTA may use
SMEM_PER_SM = 226 * 1024  # what two co-resident programs may use together
DEFAULT_NUM_SMS = 132  # H100/H200 SXM; the split heuristic only


@dataclasses.dataclass(frozen=True)
class GroupedLinearConfig:
    """Static tuning knobs of :func:`grouped_linear_pallas`; None: :func:`choose_config`'s.
    ValueError for a value that is not None or a positive int."""
    num_stages: int | None = None  # [128, 64] weight blocks in flight per program
    splits: int | None = None  # programs sharing one row block's column blocks (split-K)

    def __post_init__(self):
        for name in ("num_stages", "splits"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"GroupedLinearConfig.{name}={value!r} must be None or an "
                                 "int >= 1")


def padded_rows(m: int) -> int:
    """x rows padded to a multiple of 16, at least 16 (wgmma's N for the B operand x^T)."""
    return max(16, -(-m // 16) * 16)


def smem_bytes(m: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of one program: the weight blocks and x slices in flight, the two [64, M]
    float32 output tiles, and 1 KiB for the barriers."""
    mp = padded_rows(m)
    return (num_stages * (BLOCK_N + mp) * BLOCK_K * itemsize
            + COMPUTE_WGS * ROWS_PER_WG * mp * 4 + 1024)


def choose_config(groups: int, n: int, k: int, m: int,
                  num_sms: int = DEFAULT_NUM_SMS) -> GroupedLinearConfig:
    """As many programs as fit one wave with two per SM (each keeping >= 2 column blocks), the
    stages that two co-resident programs' shared memory allows (up to 8): bytes in flight hide
    HBM latency, and a second, nearly empty wave would cost a whole program's time."""
    programs, col_blocks = groups * (n // BLOCK_N), k // BLOCK_K
    splits = max(1, min(2 * num_sms // max(programs, 1), col_blocks // 2))
    step_bytes = (BLOCK_N + padded_rows(m)) * BLOCK_K * 2
    stages = max(2, min(8, (SMEM_PER_SM // 2 - smem_bytes(m, 0)) // step_bytes))
    return GroupedLinearConfig(num_stages=stages, splits=splits)


def check_supported(x_shape, groups: int, w_shape, shared_shapes, dtype) -> str | None:
    """Why :func:`grouped_linear_pallas` cannot take these shapes/dtype, or None if it can."""
    gx, m, k = x_shape
    e, n, k2 = w_shape
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (the kernel takes bfloat16 and float16)"
    if gx not in (1, groups):
        return f"x {x_shape} for {groups} groups (x's groups must be 1 or {groups})"
    if k != k2 or any(s[1] != k for s in shared_shapes):
        return f"x {x_shape}, weight {w_shape}, shared {shared_shapes} (K differs)"
    if shared_shapes and sum(s[0] for s in shared_shapes) != n:
        return f"shared pieces {shared_shapes} do not add up to the experts' {n} rows"
    if any(s[0] % BLOCK_N for s in shared_shapes) or n % BLOCK_N or k % BLOCK_K:
        return (f"weight {w_shape}, shared {shared_shapes} (rows must be multiples of "
                f"{BLOCK_N}, K of {BLOCK_K})")
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows per group (the kernel takes 1 to {MAX_ROWS})"
    return None


def _kernel(ids_gmem, x_gmem, w_gmem, *refs, num_routed, shared_rows, x_per_group,
            steps_per_split, col_blocks, num_stages, interpret):
    wait_for_inputs(interpret)
    shared_gmem = refs[:len(shared_rows)]
    o_gmem = refs[len(shared_rows)]
    (w_smem, x_smem, o_smem2), (w_barriers, x_barriers), consumed = refs[len(shared_rows) + 1]
    group, row_block = lax.axis_index("g"), lax.axis_index("n")
    split, wg = lax.axis_index("s"), lax.axis_index("wg")
    first = split * steps_per_split  # this program's first column block
    steps = jnp.minimum(col_blocks - first, steps_per_split)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
        acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, x_smem.shape[1]), jnp.float32),
                                plgpu.Layout.WGMMA)

        def step(i, acc):
            slot = lax.rem(i, num_stages)
            plgpu.barrier_wait(w_barriers.at[slot])
            plgpu.barrier_wait(x_barriers.at[slot])

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, w_smem.at[slot, rows], x_smem.at[slot].T)

            acc = _accumulate(acc, mma, interpret=interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, steps, step, acc)
        o_smem = o_smem2.at[wg]
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[
            split, group, pl.ds(row_block * BLOCK_N + wg * ROWS_PER_WG, ROWS_PER_WG)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        row0 = row_block * BLOCK_N
        expert = ids_gmem[group]

        def fetch(i, slot):
            cols = pl.ds((first + i) * BLOCK_K, BLOCK_K)
            if num_routed:
                pl.when(group < num_routed)(lambda: plgpu.copy_gmem_to_smem(
                    w_gmem.at[expert, pl.ds(row0, BLOCK_N), cols], w_smem.at[slot],
                    w_barriers.at[slot]))
            offset = 0
            for ref, size in zip(shared_gmem, shared_rows):
                piece = (group >= num_routed) & (row0 >= offset) & (row0 < offset + size)
                pl.when(piece)(functools.partial(
                    lambda ref, offset: plgpu.copy_gmem_to_smem(
                        ref.at[pl.ds(row0 - offset, BLOCK_N), cols], w_smem.at[slot],
                        w_barriers.at[slot]), ref, offset))
                offset += size
            plgpu.copy_gmem_to_smem(x_gmem.at[group if x_per_group else 0, :, cols],
                                    x_smem.at[slot], x_barriers.at[slot])

        stream_blocks(fetch, steps, num_stages,
                      lambda slot: plgpu.barrier_wait(consumed.at[slot]))


def grouped_linear_pallas(x, groups, weight, shared=(), *, num_routed: int | None = None,
                          config: GroupedLinearConfig | None = None, interpret: bool = False):
    """The grouped linear as a Pallas Mosaic GPU kernel (Hopper); shapes as the module docstring.
    ``num_routed``: groups [0, num_routed) take ``weight[groups[g]]``, the rest the ``shared``
    pieces (default: all routed when ``shared`` is empty). Ids must lie in [0, E) (not checked on
    the device: the caller clips). ValueError for what :func:`check_supported` refuses, shared
    groups without ``shared`` pieces, and a ``config`` whose buffers exceed
    :data:`SMEM_LIMIT_BYTES`. ``interpret``: the Mosaic GPU interpreter (CPU)."""
    g = groups.shape[0]
    shared = tuple(shared)
    num_routed = g if num_routed is None else num_routed
    if (why := check_supported(x.shape, g, weight.shape, [s.shape for s in shared], x.dtype)):
        raise ValueError(f"grouped_linear_pallas does not take {why}")
    if num_routed < g and not shared or not 0 <= num_routed <= g:
        raise ValueError(f"{num_routed=} of {g} groups needs 0 <= num_routed <= {g} and shared "
                         "pieces for the rest")
    if any(a.dtype != x.dtype for a in (weight, *shared)):
        raise ValueError(f"weights {[a.dtype for a in (weight, *shared)]} must be x's {x.dtype}")
    gx, m, k = x.shape
    n = weight.shape[1]
    chosen = choose_config(g, n, k, m)
    stages = (config and config.num_stages) or chosen.num_stages
    splits = (config and config.splits) or chosen.splits
    col_blocks = k // BLOCK_K
    steps_per_split = -(-col_blocks // splits)
    splits = -(-col_blocks // steps_per_split)  # no empty split
    if smem_bytes(m, stages) > SMEM_LIMIT_BYTES:
        raise ValueError(f"num_stages={stages} needs {smem_bytes(m, stages)} bytes of shared "
                         f"memory for {m} rows (at most {SMEM_LIMIT_BYTES})")
    mp = padded_rows(m)
    xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, 0))) if mp != m else x
    body = functools.partial(
        _kernel, num_routed=num_routed, shared_rows=tuple(s.shape[0] for s in shared),
        x_per_group=gx > 1, steps_per_split=steps_per_split, col_blocks=col_blocks,
        num_stages=stages, interpret=interpret)

    def entry(*refs):
        smem = (_smem_tile((stages, BLOCK_N, BLOCK_K), x.dtype),
                _smem_tile((stages, mp, BLOCK_K), x.dtype),
                plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, mp), jnp.float32))
        pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            collective_axes="wg")

    partial = plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((splits, g, n, mp), jnp.float32),
        grid=(g, n // BLOCK_N, splits), grid_names=("g", "n", "s"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(groups.astype(jnp.int32), xp, weight, *shared)
    return jnp.swapaxes(partial.sum(0), 1, 2)[:, :m]


def grouped_linear_reference(x, groups, weight, shared=(), *, num_routed: int | None = None):
    """The grouped linear in ``jnp`` (float32 accumulation): [G, M, N] float32."""
    g = groups.shape[0]
    num_routed = g if num_routed is None else num_routed
    w = weight[groups[:num_routed]]
    if num_routed < g:
        piece = jnp.concatenate(shared, axis=0)
        w = jnp.concatenate([w, jnp.broadcast_to(piece, (g - num_routed, *piece.shape))])
    x = jnp.broadcast_to(x, (g, *x.shape[1:]))
    return jnp.einsum("gmk,gnk->gmn", x, w, preferred_element_type=jnp.float32)
