"""Few-row matrix products that stream the weight once, with the RMSNorm folded in (Pallas
Mosaic GPU). Not used by the model: it measured slower than XLA (see "Status" below), and a
tensor-core form without the norm (:func:`gemv_wgmma`) is not timed yet.

At decode time (one token per row, B rows) every projection is ``y = x @ w.T`` with w
``[N, K]`` in PyTorch layout: a pass over N*K weights for a handful of rows, bound by memory
bandwidth. XLA runs each as one GEMM fusion, and the RMSNorm before it as two more kernels
(sum of squares, then scale and cast), each about 1.2-1.5 us on an H200
(benchmarks/RESULTS.md, session 8). A kernel of its own costs a launch, so merging only the
small kernels did not pay. This kernel takes the norm into the GEMV that reads its output:
:func:`gemv_pallas` with ``norm_weight`` computes

    x_n = model_dtype(f32(x) * rsqrt(mean(f32(x)**2) + eps) * (1 + f32(norm_weight)))
    out[s] = sum over the split's K range of f32(x_n) * f32(w)            (float32)

(``Qwen3_5RMSNorm``, spec §1.2, then the projection), so the norm costs no kernel of its own.
With ``swiglu`` (the MLP's down projection, spec §1.7) x is the gate and up projections side by
side, ``[gate | up]`` of 2K columns, and

    x_n = model_dtype(model_dtype(silu(f32(gate))) * f32(up))

(torch's bfloat16 ``silu`` rounds once, then the product; HF ``Qwen3_5MLP``), which saves the
SwiGLU kernel.

Layout: program (n, s) owns output columns ``[64 n, 64 n + 64)`` and K range ``s`` of
``num_splits``; it streams its [64, K/num_splits] slab of w through shared memory in
[64, block_k] tiles (TMA copies, ``num_stages`` in flight) and multiplies each tile with the
rows of x on the CUDA cores (a memory-bound product needs no tensor cores): the tile times x
broadcast down its rows, summed along the row, gives 64 partial outputs per row of x. While
the first tiles are in flight, the program puts its K range of x into shared memory; with a
norm it first sums the squares of each whole row of x (K values, read from L2), so the scale
needs no second kernel, and stores the normalised, rounded values. The caller sums the
``num_splits`` float32 partials; XLA can fuse that sum into the op that consumes the output
(such as the residual add), as it does for its own split-K GEMMs.

Status: correct (tested against float64 numpy in the Mosaic GPU interpreter and compiled on an
H200, tests/test_gemv.py) but too slow to use, so ``jaxdecode.model`` does not. On an H200
(``benchmarks/gemv.py``, benchmarks/RESULTS.md, session 9) it streams the 9B projections'
weights at 0.9-3.0 TB/s at best (per projection, over tile widths and split counts) where
XLA's GEMMs stream them at 2.9-4.5 TB/s; with everything each call launches summed, the 9B
gate+up projection takes 99 us at best where XLA's three kernels (norm and GEMM) take 53 us,
and the down projection with SwiGLU 114 us against 30 us. Summing the products elementwise over
the loop (one K reduction at the end instead of one per tile) moved the best times by at most
10% (gate+up 89 us) and was reverted. The likely cause is the CUDA-core multiply with a
layout-changing broadcast per tile.

:func:`gemv_wgmma` is that next form, for timing only: the swapped product
``w_tile [64, block_k] @ x.T [block_k, 8]`` on the tensor cores (wgmma with N = 8, x
zero-padded to 8 rows), without a prologue, because Mosaic GPU (JAX 0.11.2) does not lower a
store of a normalised x from registers into the swizzled tiles wgmma reads. Correct in the
interpreter and lowered for CUDA on CPU; not yet timed (``benchmarks/gemv.py --kernels wgmma``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.activations import silu
from jaxdecode.kernels import wait_for_inputs

f32 = jnp.float32
TILE_N = 64  # output columns per program: the rows of the wgmma register layout
MAX_ROWS = 8  # rows of x per call (each adds a multiply-reduce per tile)
MODEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SMEM_BUDGET_BYTES = 200 * 1024  # of the H100/H200's 227 KiB per block, leaving Mosaic's share


def gemv_reference(x, w, *, norm_weight=None, eps: float = 1e-6, swiglu: bool = False,
                   num_splits: int = 1):
    """The same function in ``jnp``: float32 partials [num_splits, B, N] of ``x_n @ w.T`` (x_n
    as in the module docstring; x itself without ``norm_weight`` or ``swiglu``)."""
    if swiglu:
        gate, up = jnp.split(x, 2, axis=-1)
        x = (silu(gate).astype(f32) * up.astype(f32)).astype(x.dtype)
    if norm_weight is not None:
        xf = x.astype(f32)
        scale = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        x = (xf * scale * (1.0 + norm_weight.astype(f32))).astype(x.dtype)
    batch, k = x.shape
    xs = x.reshape(batch, num_splits, k // num_splits).astype(f32)
    ws = w.reshape(w.shape[0], num_splits, k // num_splits).astype(f32)
    return jnp.einsum("bsk,nsk->sbn", xs, ws, precision=lax.Precision.HIGHEST)


def smem_bytes(batch: int, k: int, block_k: int, num_splits: int, num_stages: int,
               tensor_cores: bool = False) -> int:
    """Shared memory one program uses: its weight tiles in flight, its K range of x (padded to
    ``MAX_ROWS`` rows with ``tensor_cores``), its output rows."""
    stages = min(num_stages, k // (num_splits * block_k))
    rows = MAX_ROWS if tensor_cores else batch
    return stages * TILE_N * block_k * 2 + rows * (k // num_splits) * 2 + rows * TILE_N * 4


def check_supported(x_shape, w_shape, dtype, block_k: int = 256, num_splits: int = 1,
                    num_stages: int = 4, tensor_cores: bool = False) -> str | None:
    """Why :func:`gemv_pallas` (or, with ``tensor_cores``, :func:`gemv_wgmma`) cannot take
    these shapes and settings (None if it can). K is w's; x's width (K, or 2K with
    ``swiglu``) is checked by :func:`gemv_pallas`."""
    batch = x_shape[0]
    n, k = w_shape
    for arg, value in (("block_k", block_k), ("num_splits", num_splits),
                       ("num_stages", num_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{arg}={value!r} must be a positive int"
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"the weight dtype {jnp.dtype(dtype)} is not bfloat16"
    if not 1 <= batch <= MAX_ROWS:
        return f"{batch} rows of x; the kernel takes 1 to {MAX_ROWS}"
    if n < TILE_N or n % TILE_N:
        return f"N={n} is not a positive multiple of {TILE_N}"
    if block_k % 64 or block_k > 256:
        return f"{block_k=} must be 64, 128, 192 or 256"
    if k < num_splits * block_k or k % (num_splits * block_k):
        return f"K={k} is not a positive multiple of {num_splits=} x {block_k=}"
    smem = smem_bytes(batch, k, block_k, num_splits, num_stages, tensor_cores)
    if smem > SMEM_BUDGET_BYTES:
        return (f"the weight tiles in flight ([{TILE_N}, {block_k}] each) and {batch} rows of "
                f"{k // num_splits} inputs{' (padded to 8 rows)' if tensor_cores else ''} "
                f"need {smem} bytes of shared memory, more than "
                f"{SMEM_BUDGET_BYTES}: use more num_splits or fewer num_stages")
    return None


def _fetch_weight_tile(w_gmem, w_smem, barriers, n, k_first, block_k, i, slot):
    """Weight tile i of program (n, split starting at k_first), [64, block_k], into pipeline
    slot ``slot`` (an async TMA copy that arrives on ``barriers[slot]``)."""
    plgpu.copy_gmem_to_smem(
        w_gmem.at[pl.ds(n * TILE_N, TILE_N), pl.ds(k_first + i * block_k, block_k)],
        w_smem.at[slot], barriers.at[slot])


def _kernel(*refs, rows, block_k, steps, num_stages, eps, norm, swiglu, interpret):
    if norm:
        x_gmem, w_gmem, nw_gmem, out_gmem, w_smem, x_smem, o_smem, barriers = refs
    else:
        (x_gmem, w_gmem, out_gmem, w_smem, x_smem, o_smem, barriers), nw_gmem = refs, None
    wait_for_inputs(interpret)
    n, s = lax.axis_index("n"), lax.axis_index("s")
    tile = plgpu.Layout.WGMMA
    cols, tile_rows = tile.reduce(0), tile.reduce(1)  # [block_k] and [64] vectors of a tile
    dtype = x_gmem.dtype
    k_len = w_gmem.shape[1]
    k_first = s * (steps * block_k)

    fetch = functools.partial(_fetch_weight_tile, w_gmem, w_smem, barriers, n, k_first, block_k)

    for i in range(min(num_stages, steps)):  # in flight while x is prepared below
        fetch(i, i)

    def x_block(b, start):  # [block_k] of row b from global memory, column layout
        return plgpu.load(x_gmem.at[b, pl.ds(start, block_k)], layout=cols, optimized=False)

    # This split's K range of each row of x (normalised or gated, rounded to the model dtype)
    # into shared memory once, so the loop below reads it from there.
    for b in range(rows):
        if norm:
            # rsqrt(mean(x^2) + eps) of the whole row, as a [block_k] vector of equal entries:
            # the squares summed per column over the row's blocks, then over the columns (down
            # the rows of a broadcast tile, then back across: a full reduction of a vector to a
            # scalar does not lower), divided by the 64 equal rows it was summed over.
            sq = None
            for i in range(k_len // block_k):
                xb = x_block(b, i * block_k).astype(f32)
                sq = xb * xb if sq is None else sq + xb * xb
            per_row = jnp.sum(lax.broadcast_in_dim(sq, (TILE_N, block_k), [1]), axis=1)
            total = jnp.sum(lax.broadcast_in_dim(per_row, (TILE_N, block_k), [0]), axis=0)
            scale = lax.rsqrt(total * (1.0 / (TILE_N * k_len)) + eps)
        for i in range(steps):
            xb = x_block(b, k_first + i * block_k)
            if swiglu:  # x = [gate | up]: silu(gate) rounded to the model dtype, times up
                g = xb.astype(f32)
                up = x_block(b, k_len + k_first + i * block_k).astype(f32)
                act = (g / (1.0 + jnp.exp(-g))).astype(dtype).astype(f32)
                xb = (act * up).astype(dtype)
            if norm:  # the model's norm output, rounded to the model dtype
                gain = 1.0 + plgpu.load(nw_gmem.at[pl.ds(k_first + i * block_k, block_k)],
                                        layout=cols, optimized=False).astype(f32)
                xb = (xb.astype(f32) * scale * gain).astype(dtype)
            x_smem.at[b, pl.ds(i * block_k, block_k)][...] = xb
    plgpu.commit_smem()  # x visible to every thread

    def step(i, accs):
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(barriers.at[slot])
        w = plgpu.load(w_smem.at[slot], layout=tile).astype(f32)  # [64, block_k]
        out = []
        for b in range(rows):
            xb = plgpu.load(x_smem.at[b, pl.ds(i * block_k, block_k)], layout=cols)
            xb = lax.broadcast_in_dim(xb.astype(f32), (TILE_N, block_k), [1])
            out.append(accs[b] + jnp.sum(w * xb, axis=1))
        plgpu.commit_smem()  # every thread has read the slot before it is refilled

        @pl.when(i + num_stages < steps)
        def _refill():
            fetch(i + num_stages, slot)

        return tuple(out)

    zeros = tuple(plgpu.layout_cast(jnp.zeros((TILE_N,), f32), tile_rows) for _ in range(rows))
    accs = lax.fori_loop(0, steps, step, zeros)
    for b in range(rows):
        o_smem.at[b][...] = accs[b]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[s, :, pl.ds(n * TILE_N, TILE_N)])
    plgpu.wait_smem_to_gmem(0)


def gemv_pallas(x, w, *, norm_weight=None, eps: float = 1e-6, swiglu: bool = False,
                num_splits: int = 1, block_k: int = 256, num_stages: int = 4,
                interpret: bool = False):
    """Float32 partials of ``x_n @ w.T`` in one kernel (math in the module docstring).

    Args:
      x: [B, K] bfloat16, 1 <= B <= 8: the rows (the residual stream when ``norm_weight`` is
        given, else the projection's input).
      w: [N, K] bfloat16, PyTorch layout (``nn.Linear.weight``); N a multiple of 64.
      norm_weight: optional [K]: the RMSNorm weight (gain ``1 + norm_weight``) applied to x in
        the kernel first; ``eps`` its epsilon (``rms_norm_eps``).
      swiglu: x is [B, 2K], ``[gate | up]``, and the kernel multiplies with
        ``silu(gate) * up`` (module docstring); not together with ``norm_weight``.
      num_splits: K ranges, each a program per 64 output columns (more programs for small N);
        K must be a multiple of ``num_splits * block_k``.
      block_k: K columns per streamed tile (multiple of 64, at most 256); num_stages: tiles in
        flight per program.
      interpret: run in the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.

    Returns:
      [num_splits, B, N] float32: sum over axis 0 (and cast) for the product.

    Raises:
      ValueError (before any work): shapes or dtypes that disagree, or outside the above
        (:func:`check_supported`), including the weight tiles and x's K range needing more
        than ``SMEM_BUDGET_BYTES`` of shared memory.
    """
    name = "gemv_pallas"
    width = 2 if swiglu else 1
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != width * w.shape[1]:
        want = "[B, 2K] ([gate | up])" if swiglu else "[B, K]"
        raise ValueError(f"{name}: x must be {want} and w [N, K]; got {x.shape} and {w.shape}")
    if swiglu and norm_weight is not None:
        raise ValueError(f"{name}: swiglu and norm_weight do not go together")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x ({x.dtype}) and w ({w.dtype}) must share a dtype")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],)
                                    or norm_weight.dtype not in MODEL_DTYPES):
        raise ValueError(f"{name}: norm_weight must be [K] = [{x.shape[1]}] float32 or "
                         f"bfloat16; got {norm_weight.shape} {norm_weight.dtype}")
    why = check_supported(x.shape, w.shape, w.dtype, block_k, num_splits, num_stages)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    batch = x.shape[0]
    n, k = w.shape
    norm = norm_weight is not None
    k_split = k // num_splits
    steps = k_split // block_k
    num_stages = min(num_stages, steps)
    # a [64, block_k] bfloat16 tile row is block_k * 2 bytes, a multiple of 128: 128-byte swizzle
    kernel = plgpu.kernel(
        functools.partial(_kernel, rows=batch, block_k=block_k, steps=steps,
                          num_stages=num_stages, eps=float(eps), norm=norm,
                          swiglu=bool(swiglu), interpret=interpret),
        out_type=jax.ShapeDtypeStruct((num_splits, batch, n), f32),
        scratch_types=(
            plgpu.SMEM((num_stages, TILE_N, block_k), w.dtype,
                       transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
            plgpu.SMEM((batch, k_split), x.dtype),
            plgpu.SMEM((batch, TILE_N), f32),
            plgpu.Barrier(num_barriers=num_stages)),
        grid=(n // TILE_N, num_splits), grid_names=("n", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(x, w, *((norm_weight,) if norm else ()))


def _wgmma_kernel(x_gmem, w_gmem, out_gmem, w_smem, x_smem, o_smem, w_barriers, x_barriers, *,
                  block_k, steps, num_stages, interpret):
    wait_for_inputs(interpret)
    n, s = lax.axis_index("n"), lax.axis_index("s")
    k_first = s * (steps * block_k)

    fetch = functools.partial(_fetch_weight_tile, w_gmem, w_smem, w_barriers, n, k_first,
                              block_k)

    for i in range(min(num_stages, steps)):
        fetch(i, i)
    for i in range(steps):  # this split's K range of x, [8, block_k] tiles (L2, small)
        plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(k_first + i * block_k, block_k)],
                                x_smem.at[i], x_barriers.at[i])
    for i in range(steps):
        plgpu.barrier_wait(x_barriers.at[i])

    def step(i, acc):
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(w_barriers.at[slot])

        def product(acc_ref):  # [64, block_k] @ [block_k, 8] on the tensor cores
            plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[i].transpose((1, 0)))
            return acc_ref[...]  # waits for the wgmma: the slot is free below

        acc = acc + pl.run_scoped(product, plgpu.ACC((TILE_N, MAX_ROWS), f32))

        @pl.when(i + num_stages < steps)
        def _refill():
            fetch(i + num_stages, slot)

        return acc

    acc = lax.fori_loop(0, steps, step, plgpu.layout_cast(
        jnp.zeros((TILE_N, MAX_ROWS), f32), plgpu.Layout.WGMMA))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[s, pl.ds(n * TILE_N, TILE_N), :])
    plgpu.wait_smem_to_gmem(0)


def gemv_wgmma(x, w, *, num_splits: int = 1, block_k: int = 128, num_stages: int = 4,
               interpret: bool = False):
    """Float32 partials of ``x @ w.T`` on the tensor cores, for a timing comparison (no norm
    or SwiGLU prologue; not used by the model).

    The swapped product: each program multiplies its [64, block_k] weight tiles (TMA-streamed,
    ``num_stages`` in flight) with x's [block_k, 8] (x zero-padded to 8 rows, the narrowest
    wgmma) into a [64, 8] float32 accumulator, so the CUDA cores only move data. A normalised
    x cannot be written from registers into the swizzled [8, block_k] tiles wgmma reads (Mosaic
    GPU's layout inference rejects the store in JAX 0.11.2), which is why x arrives through
    TMA as given and the RMSNorm stays outside (benchmarks/RESULTS.md, session 9).

    Args:
      x: [B, K] bfloat16, 1 <= B <= 8.  w: [N, K] bfloat16 (PyTorch layout), N a multiple of 64.
      num_splits, block_k, num_stages, interpret: as :func:`gemv_pallas`.

    Returns:
      [num_splits, B, N] float32: sum over axis 0 (and cast) for the product.

    Raises:
      ValueError (before any work): shapes, dtypes or settings :func:`check_supported` rejects
        (with ``tensor_cores=True``).
    """
    name = "gemv_wgmma"
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x must be [B, K] and w [N, K]; got {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x ({x.dtype}) and w ({w.dtype}) must share a dtype")
    why = check_supported(x.shape, w.shape, w.dtype, block_k, num_splits, num_stages,
                          tensor_cores=True)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    batch = x.shape[0]
    n, k = w.shape
    steps = k // num_splits // block_k
    num_stages = min(num_stages, steps)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(_wgmma_kernel, block_k=block_k, steps=steps, num_stages=num_stages,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((num_splits, n, MAX_ROWS), f32),
        scratch_types=(
            plgpu.SMEM((num_stages, TILE_N, block_k), w.dtype, transforms=tiles),
            plgpu.SMEM((steps, MAX_ROWS, block_k), x.dtype, transforms=tiles),
            plgpu.SMEM((TILE_N, MAX_ROWS), f32),
            plgpu.Barrier(num_barriers=num_stages),
            plgpu.Barrier(num_barriers=steps)),
        grid=(n // TILE_N, num_splits), grid_names=("n", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    padded = jnp.pad(x, ((0, MAX_ROWS - batch), (0, 0)))
    return kernel(padded, w)[:, :, :batch].transpose(0, 2, 1)
