"""Block-FP8 weight-only linear for a few rows: ``x @ W.T`` with ``W`` held as float8_e4m3fn plus
one float32 scale per 128 x 128 block (``jaxdecode.quantization``), read once.

Shapes: x [M, K] bfloat16/float16, weight [N, K] float8_e4m3fn, scale_inv [ceil(N / 128),
ceil(K / 128)] float32; result [M, N] in x's dtype, accumulated in float32. The math is
``quantization.dequantize`` then the product: ``W[n, k] = dtype(f32(w8[n, k]) · s[n // 128,
k // 128])`` (HF ``FineGrainedFP8Config``'s weight-only path, spec §9).
:func:`fp8_linear_reference` is that in ``jnp``; :func:`fp8_linear_pallas` the same as a Pallas
Mosaic GPU kernel (Hopper) for M <= 64, the decode step's rows.

Why the kernel looks the way it does (after ``jax/experimental/pallas/ops/gpu/
hopper_mixed_type_matmul_mgpu.py``; Marlin, Frantar et al., 2024, for the weight-only idea):

* XLA's form writes a 16-bit copy of every weight before the dot (3 more bytes per weight than
  the 1 the FP8 model must read), so the kernel converts in registers instead: a program takes
  a range of [128, 128] blocks (128 weight rows share a scale row); a TMA warpgroup streams the
  FP8 blocks and the matching [M, 128] slices of x through ``num_stages`` buffers; two
  compute warpgroups each take 64 rows, upcast them (e4m3 -> f16 -> f32, times the block's scale,
  -> x's dtype: ``dequantize``'s rounding) and feed them to ``wgmma`` as the A operand from
  registers, with x's slice as B from shared memory: out^T [64, M] += W [64, 128] @ x^T [128, M].
* The work is the row blocks' pipeline steps in order (row block by row block), cut into ranges
  of ``steps_per_program``. A few rows cannot fill the GPU with one program per 128 rows (k_proj:
  8 programs), so a row block's columns are split over several programs (split-K); with more row
  blocks than SMs (27B's MLP: 136), ranges cut evenly over the SMs, so that no second, nearly
  empty wave follows. A range may end one row block and start the next: the program writes each
  row block's float32 partial [128, M] to its slot of [S, N, M'] (S: the most programs sharing a
  row block; M' the rows padded) and XLA adds the written slots, transposes and casts.
* Several weights of one x (``gate_proj`` and ``up_proj``; q, k, v) run as one launch
  (:func:`fp8_linears_pallas`): their row blocks are one sequence of work, the TMA warpgroup
  picking each block's weight. At the 35B-A3B's widths a launch's fixed costs (the first bytes'
  latency, the partials' write) and the pad and sum XLA adds around it are as long as a small
  weight's bytes.
* A pipeline step copies ``cols_per_step`` column blocks at once ([128, 128·c] FP8, 128·c-byte
  rows per TMA copy): fewer, larger steps issue fewer instructions per byte. A 4-block step's
  wgmmas share one accumulator scope (:data:`SCOPE_MIN_COLS`): block j + 1 is converted while
  block j's wgmma runs, and the step waits for them once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxdecode.kernels import stream_blocks, wait_for_inputs
from jaxdecode.kernels.decode_attention import _accumulate, _register_operand, _smem_tile
from jaxdecode.quantization import DEFAULT_BLOCK, FP8, dequantize

BLOCK = 128  # a block's weight rows (one scale row) and columns (one scale column)
ROWS_PER_WG = 64  # one wgmma M tile
COMPUTE_WGS = BLOCK // ROWS_PER_WG
MAX_ROWS = 64  # x rows the kernel takes (the accumulator [64, M] float32 stays in registers)
SMEM_BUDGET_BYTES = 200 * 1024  # the pipeline's buffers (choose_config's stages)
SMEM_LIMIT_BYTES = 227 * 1024  # what a Hopper CTA may use: the check on a config override
DEFAULT_NUM_SMS = 132  # H100/H200 SXM; choose_config's ranges only
# relative time per [128, 128] block by blocks a pipeline step (12288 x 4096, one row, H100:
# 24.5, 25.4, 27.4 us): choose_config trades wider steps against even ranges with it
BLOCK_COST = {4: 1.0, 2: 1.04, 1: 1.12}
# a step of at least this many blocks shares one accumulator scope (measured faster at 4 blocks,
# not at 2); narrower steps take one scope a block
SCOPE_MIN_COLS = 4


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """Static tuning knobs of :func:`fp8_linear_pallas`; None: :func:`choose_config`'s.
    ValueError for a value that is not None or a positive int."""
    num_stages: int | None = None  # pipeline steps in flight per program
    cols_per_step: int | None = None  # [128, 128] weight blocks one pipeline step copies
    steps_per_program: int | None = None  # pipeline steps one program runs (the last: fewer)

    def __post_init__(self):
        for name in ("num_stages", "cols_per_step", "steps_per_program"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Fp8LinearConfig.{name}={value!r} must be None or an int >= 1")


def padded_rows(m: int) -> int:
    """x rows padded to a multiple of 8: wgmma's N (x^T is its B operand) must be one; the
    padding rows' outputs are dropped."""
    return -(-m // 8) * 8


def smem_bytes(m: int, num_stages: int, cols_per_step: int = 1) -> int:
    """Shared memory of one program: the weight blocks and x slices in flight, the two [64, M']
    float32 output tiles (M' = :func:`padded_rows`), and 1 KiB for the barriers."""
    mp = padded_rows(m)
    step = cols_per_step * (BLOCK * BLOCK + mp * BLOCK * 2)
    return num_stages * step + COMPUTE_WGS * ROWS_PER_WG * mp * 4 + 1024


def choose_config(n: int, k: int, m: int, num_sms: int = DEFAULT_NUM_SMS,
                  cols_per_step: int | None = None) -> Fp8LinearConfig:
    """Blocks in flight: as many [128, 128] blocks (+ x slices) as fit :data:`SMEM_BUDGET_BYTES`,
    up to 8 (bytes in flight hide HBM latency). Ranges: with no more row blocks than SMs, split-K
    (each row block's column blocks cut into as many parts of >= 2 blocks as one wave allows, a
    range as long as a part: ranges cross row blocks where a part does not divide them), 4, 2 or
    1 blocks a step (the widest dividing a part, two steps in flight); with more row blocks than
    SMs (a second, nearly empty wave otherwise), all steps cut evenly into ``num_sms`` ranges, the
    width the one whose busiest program takes the least time by :data:`BLOCK_COST`. (Evening out
    the ranges over all SMs did not help where one wave fits.) ``cols_per_step``: that width,
    the rest chosen around it (it must divide the column blocks: the kernel checks)."""
    block_bytes = BLOCK * BLOCK + padded_rows(m) * BLOCK * 2
    blocks = max(2, min(8, SMEM_BUDGET_BYTES // block_bytes))
    row_blocks, col_blocks = n // BLOCK, k // BLOCK
    widths = [c for c in (4, 2, 1) if col_blocks % c == 0 and (2 * c <= blocks or c == 1)]
    if cols_per_step is not None:
        widths = [cols_per_step]
    if row_blocks <= num_sms:
        splits = max(1, min(num_sms // max(row_blocks, 1), col_blocks // 2))
        part = -(-col_blocks // splits)
        cols = next((c for c in widths if part % c == 0), widths[-1])
        return Fp8LinearConfig(num_stages=max(2, blocks // cols), cols_per_step=cols,
                               steps_per_program=-(-part // cols))

    def busiest(cols):  # steps of the busiest program, and its time by BLOCK_COST
        steps = -(-row_blocks * col_blocks // cols // num_sms)
        return steps, steps * cols * BLOCK_COST.get(cols, 1.0)

    cols = min(widths, key=lambda c: busiest(c)[1])  # on a tie the first: the widest
    steps, _ = busiest(cols)
    return Fp8LinearConfig(num_stages=max(2, blocks // cols), cols_per_step=cols,
                           steps_per_program=steps)


def partial_slots(row_blocks: int, steps_per_row: int, steps_per_program: int) -> np.ndarray:
    """[S, row_blocks] bool: which slots of the partial output program ranges write, slot j of
    row block r being the j-th program whose range holds some of r's steps."""
    first = np.arange(row_blocks) * steps_per_row // steps_per_program
    last = ((np.arange(row_blocks) + 1) * steps_per_row - 1) // steps_per_program
    count = last - first + 1
    return np.arange(count.max())[:, None] < count[None, :]


def check_supported(x_shape, w_shape, x_dtype, w_dtype, block_size) -> str | None:
    """Why :func:`fp8_linear_pallas` cannot take these shapes/dtypes, or None if it can."""
    m, k = x_shape
    n, k2 = w_shape
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"x dtype {jnp.dtype(x_dtype)} (the kernel takes bfloat16 and float16)"
    if jnp.dtype(w_dtype) != FP8:
        return f"weight dtype {jnp.dtype(w_dtype)} (the kernel takes float8_e4m3fn)"
    if tuple(block_size) != (BLOCK, BLOCK):
        return f"{block_size=} (the kernel takes ({BLOCK}, {BLOCK}))"
    if k != k2:
        return f"x {x_shape} and weight {w_shape} (x's K must be the weight's)"
    if n % BLOCK or k % BLOCK or not n or not k:
        return f"x {x_shape} and weight {w_shape} (N and K must be positive multiples of {BLOCK})"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (the kernel takes 1 to {MAX_ROWS})"
    return None


def _kernel(x_gmem, w_gmems, s_gmems, o_gmem, scoped, *, first_rows, steps_per_program,
            steps_per_row, total_steps, cols, num_stages, dtype, interpret):
    wait_for_inputs(interpret)
    (w_smem, x_smem, o_smem2, w_tmp2), (w_barriers, x_barriers), consumed = scoped
    program, wg = lax.axis_index("p"), lax.axis_index("wg")
    scope = cols if cols >= SCOPE_MIN_COLS else 1  # blocks per accumulator scope
    start = program * steps_per_program  # this program's first step over all row blocks
    steps = jnp.minimum(total_steps - start, steps_per_program)

    def where(i):  # (row block, first column block) of this program's step i
        g = start + i
        return g // steps_per_row, (g % steps_per_row) * cols

    def parts(row):  # (weight, scale, is row block ``row`` in it, its row block there) per weight
        if len(w_gmems) == 1:
            yield w_gmems[0], s_gmems[0], True, row
            return
        for w, s, first, last in zip(w_gmems, s_gmems, first_rows, first_rows[1:]):
            yield w, s, (row >= first) & (row < last), jnp.clip(row - first, 0, last - first - 1)

    def scales(i):  # step i's block scales (past the last step: the last step's)
        row, col = where(jnp.minimum(i, steps - 1))
        chosen = [0.0] * cols
        for _, s, inside, local in parts(row):
            chosen = [s[local, col + j] if inside is True else
                      jnp.where(inside, s[local, col + j], chosen[j]) for j in range(cols)]
        return tuple(chosen)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
        layout = plgpu.Layout.WGMMA
        zero = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, x_smem.shape[1]), jnp.float32), layout)
        o_smem = o_smem2.at[wg]

        def step(i, carry):
            acc, scale = carry
            # the next step's scales, loaded a step ahead (off the conversion's critical path)
            next_scale = scales(i + 1)
            slot = lax.rem(i, num_stages)
            plgpu.barrier_wait(w_barriers.at[slot])

            def convert(j):  # block j of the step: e4m3 -> x's dtype times its scale
                w8 = plgpu.load(w_smem.at[slot, rows, pl.ds(j * BLOCK, BLOCK)],
                                layout=plgpu.Layout.WGMMA_UPCAST_2X, optimized=not interpret)
                w = (w8.astype(jnp.float16).astype(jnp.float32) * scale[j]).astype(dtype)
                return plgpu.layout_cast(w, layout)

            # a scope's wgmmas are waited for once, block j + 1 converting while j's runs
            for first in range(0, cols, scope):
                w = convert(first)
                if first == 0:
                    plgpu.barrier_wait(x_barriers.at[slot])

                def mma(acc_ref, first=first, w=w):
                    for j in range(first, first + scope):
                        following = convert(j + 1) if j + 1 < first + scope else None
                        w = _register_operand(w, w_tmp2.at[wg] if interpret else None,
                                              interpret=interpret)
                        plgpu.wgmma(acc_ref, w, x_smem.at[slot, :, pl.ds(j * BLOCK, BLOCK)].T)
                        w = following

                acc = _accumulate(acc, mma, interpret=interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            row, col = where(i)
            flush = (col + cols == steps_per_row * cols) | (i == steps - 1)  # row's or range's end

            @pl.when(flush)
            def _write():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last write read o_smem
                o_smem[...] = acc
                plgpu.commit_smem()
                out = o_gmem.at[program - row * steps_per_row // steps_per_program,
                                pl.ds(row * BLOCK + wg * ROWS_PER_WG, ROWS_PER_WG)]
                plgpu.copy_smem_to_gmem(o_smem, out)

            # a branch, not a multiply by 0: inf * 0 would carry NaN into the next row block
            return lax.cond(flush, lambda: zero, lambda: acc), next_scale

        lax.fori_loop(0, steps, step, (zero, scales(0)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        def fetch(i, slot):
            row, col = where(i)
            span = pl.ds(col * BLOCK, cols * BLOCK)
            for w, _, inside, local in parts(row):  # the one weight row block ``row`` is in
                copy = functools.partial(plgpu.copy_gmem_to_smem,
                                         w.at[pl.ds(local * BLOCK, BLOCK), span],
                                         w_smem.at[slot], w_barriers.at[slot])
                copy() if inside is True else pl.when(inside)(copy)
            plgpu.copy_gmem_to_smem(x_gmem.at[:, span], x_smem.at[slot], x_barriers.at[slot])

        stream_blocks(fetch, steps, num_stages,
                      lambda slot: plgpu.barrier_wait(consumed.at[slot]))


def fp8_linear_pallas(x, weight, scale_inv, block_size=DEFAULT_BLOCK, *,
                      config: Fp8LinearConfig | None = None, interpret: bool = False):
    """``x @ dequantize(weight, scale_inv).T`` as a Pallas Mosaic GPU kernel (Hopper); shapes as
    the module docstring, [M, N] in x's dtype. :func:`fp8_linears_pallas` of one weight."""
    return fp8_linears_pallas(x, (weight,), (scale_inv,), block_size, config=config,
                              interpret=interpret)[0]


def fp8_linears_pallas(x, weights, scale_invs, block_size=DEFAULT_BLOCK, *,
                       config: Fp8LinearConfig | None = None, interpret: bool = False):
    """``x @ dequantize(w_i, s_i).T`` for each of several weights of x's K (e.g. ``gate_proj``
    and ``up_proj``) in one launch: their row blocks are one range of work, as if the weights
    were stacked (one launch's fixed costs, one pad of x, one sum of the partials). Returns a
    tuple of [M, N_i] in x's dtype. ValueError for what :func:`check_supported` refuses, for a
    scale of the wrong shape, and for a ``config`` whose buffers exceed
    :data:`SMEM_LIMIT_BYTES`. ``config``: None picks :func:`choose_config`; ``interpret``: the
    Mosaic GPU interpreter (CPU). Not differentiable (``choice.fp8_linears`` adds the VJP)."""
    weights, scale_invs = tuple(weights), tuple(scale_invs)
    if not weights or len(weights) != len(scale_invs):
        raise ValueError(f"{len(weights)} weights and {len(scale_invs)} scales (one per weight)")
    for weight, scale_inv in zip(weights, scale_invs):
        if (why := check_supported(x.shape, weight.shape, x.dtype, weight.dtype, block_size)):
            raise ValueError(f"fp8_linears_pallas does not take {why}")
        if scale_inv.shape != (weight.shape[0] // BLOCK, weight.shape[1] // BLOCK):
            raise ValueError(f"{scale_inv.shape=} does not match {weight.shape=} in "
                             f"{BLOCK}-blocks")
    m, k = x.shape
    sizes = [w.shape[0] for w in weights]
    n = sum(sizes)
    first_rows = tuple(int(r) for r in np.cumsum([0] + sizes) // BLOCK)
    chosen = choose_config(n, k, m, cols_per_step=config and config.cols_per_step)
    stages = (config and config.num_stages) or chosen.num_stages
    cols = chosen.cols_per_step
    per_program = (config and config.steps_per_program) or chosen.steps_per_program
    row_blocks, col_blocks = n // BLOCK, k // BLOCK
    if col_blocks % cols:
        raise ValueError(f"cols_per_step={cols} must divide the {col_blocks} column blocks")
    if smem_bytes(m, stages, cols) > SMEM_LIMIT_BYTES:
        raise ValueError(f"num_stages={stages} x cols_per_step={cols} needs "
                         f"{smem_bytes(m, stages, cols)} bytes of shared memory for {m} rows "
                         f"(at most {SMEM_LIMIT_BYTES})")
    steps_per_row = col_blocks // cols
    total_steps = row_blocks * steps_per_row
    programs = -(-total_steps // per_program)
    valid = partial_slots(row_blocks, steps_per_row, per_program)
    mp = padded_rows(m)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    dtype = x.dtype
    count = len(weights)

    body = functools.partial(_kernel, first_rows=first_rows, steps_per_program=per_program,
                             steps_per_row=steps_per_row, total_steps=total_steps, cols=cols,
                             num_stages=stages, dtype=dtype, interpret=interpret)

    def entry(x_gmem, *refs):
        w_gmems, s_gmems, o_gmem = refs[:count], refs[count:2 * count], refs[-1]
        smem = (_smem_tile((stages, BLOCK, cols * BLOCK), FP8),
                _smem_tile((stages, mp, cols * BLOCK), dtype),
                plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, mp), jnp.float32),
                _smem_tile((COMPUTE_WGS, ROWS_PER_WG, BLOCK), dtype) if interpret else None)
        pl.run_scoped(
            lambda *scoped: body(x_gmem, w_gmems, s_gmems, o_gmem, scoped),
            smem,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            collective_axes="wg")

    partial = plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((len(valid), n, mp), jnp.float32),
        grid=(programs,), grid_names=("p",),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, *weights, *(s.astype(jnp.float32) for s in scale_invs))
    if not valid.all():  # slots no program wrote hold whatever the buffer held
        partial = jnp.where(np.repeat(valid, BLOCK, axis=1)[:, :, None], partial, 0.0)
    out = partial.sum(0).T[:m].astype(dtype)
    return tuple(out[:, a * BLOCK:b * BLOCK] for a, b in zip(first_rows, first_rows[1:]))


def fp8_linear_reference(x, weight, scale_inv, block_size=DEFAULT_BLOCK):
    """``x @ dequantize(weight, scale_inv, block_size, x.dtype).T``, float32 accumulation, in
    x's dtype (what ``model.linear`` computes for an ``Fp8Linear``). x [..., K]."""
    w = dequantize(weight, scale_inv, block_size, x.dtype)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
