"""Residual add and zero-centred RMSNorm of one token per row as one Pallas Mosaic GPU kernel.

Between the blocks of a decoder layer the model does, per row b (HF ``Qwen3_5DecoderLayer`` and
``Qwen3_5RMSNorm``, spec §1.2)::

    x[b]  <- x[b] + delta[b]                                (model dtype: one rounding)
    y[b]   = f32(x[b]) * rsqrt(mean(f32(x[b])**2) + eps) * (1 + f32(w))  -> model dtype

XLA compiles this as two kernels (the sum of squares, then the scale and cast: a reduction's
result cannot feed an elementwise op over the same row in one XLA fusion), each about 1.2 us at
decode sizes, twice per layer. :func:`add_rms_norm_pallas` is one kernel: program b holds row b
of width H as a [64, H/64] tile in the wgmma register layout; the sum of squares is a reduction
over the tile's columns then over its rows (a full reduction of a vector to a scalar does not
lower, so it arrives as a vector of equal entries), and both results go out through shared
memory.

:func:`add_rms_norm_reference` is the same math in ``jnp`` (the model's ``rms_norm``), and
:func:`add_rms_norm` the dispatcher the model calls at decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxdecode.kernels import IMPLEMENTATIONS, wait_for_inputs
from jaxdecode.kernels.decode_attention import _gpu_compute_capability

f32 = jnp.float32
TILE_ROWS = 64  # the wgmma register layout's row count
MAX_COPY = 256  # one async (TMA) copy moves at most 256 elements along each dimension
MODEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# "auto" takes the kernel on Hopper below this batch (one program per row; at larger batches
# the two XLA kernels are no longer launch-bound).
MAX_BATCH_AUTO = 8


def rms_norm(x, w, eps: float):
    """Zero-centred RMSNorm (``Qwen3_5RMSNorm``, spec §1.2) over the last axis: gain ``1 + w``,
    applied in float32 before the cast back to x's dtype."""
    xf = x.astype(f32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(f32))).astype(x.dtype)


def _check(name, x, delta, w):
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [B, H]; got shape {tuple(x.shape)}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"{name}: delta must have x's shape {tuple(x.shape)}; got "
                         f"{tuple(delta.shape)}")
    if w.shape != x.shape[1:]:
        raise ValueError(f"{name}: w must be [H] = {tuple(x.shape[1:])}; got {tuple(w.shape)}")
    bad = {}
    if x.dtype not in MODEL_DTYPES:
        bad["x"] = x.dtype
    if delta is not None and delta.dtype != x.dtype:
        bad["delta"] = delta.dtype
    if w.dtype not in MODEL_DTYPES:
        bad["w"] = w.dtype
    if bad:
        raise ValueError(f"{name}: x (and delta) must be float32 or bfloat16 of one dtype, w "
                         f"float32 or bfloat16; got {bad}")


def add_rms_norm_reference(x, delta, w, *, eps: float):
    """``x + delta`` (in x's dtype) and its RMSNorm, in ``jnp``. Arguments and result as
    :func:`add_rms_norm_pallas`, for any H."""
    _check("add_rms_norm_reference", x, delta, w)
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, w, eps)


def check_supported(hidden_size: int) -> str | None:
    """Why the kernel cannot take rows of this width (None if it can)."""
    cols = hidden_size // TILE_ROWS
    if hidden_size % (TILE_ROWS * 8) or cols > MAX_COPY:
        return (f"hidden_size={hidden_size} is not a multiple of {TILE_ROWS * 8} up to "
                f"{TILE_ROWS * MAX_COPY}")
    return None


def _kernel(*refs, eps, hidden, add, interpret):
    if add:
        x_gmem, delta_gmem, w_gmem, x_out_gmem, y_gmem, x_smem, y_smem = refs
    else:
        (x_gmem, w_gmem, x_out_gmem, y_gmem, x_smem, y_smem), delta_gmem = refs, None
    wait_for_inputs(interpret)
    b = lax.axis_index("b")
    dtype = x_gmem.dtype
    tile = plgpu.Layout.WGMMA
    rows, cols = x_gmem.shape[1:]
    x = plgpu.load(x_gmem.at[b], layout=tile, optimized=False)
    w = plgpu.load(w_gmem, layout=tile, optimized=False)
    if delta_gmem is not None:
        d = plgpu.load(delta_gmem.at[b], layout=tile, optimized=False)
        x = (x.astype(f32) + d.astype(f32)).astype(dtype)  # one rounding, as x + delta
    xf = x.astype(f32)
    # sum over the row: over the tile's columns ([rows] vector), then, broadcast back, over its
    # rows ([cols] vector of equal entries)
    row_sums = jnp.sum(xf * xf, axis=1)
    total = jnp.sum(lax.broadcast_in_dim(row_sums, (rows, cols), [0]), axis=0)
    scale = lax.rsqrt(total * (1.0 / hidden) + eps)
    y = xf * lax.broadcast_in_dim(scale, (rows, cols), [1]) * (1.0 + w.astype(f32))
    x_smem[...] = x
    y_smem[...] = y.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_smem, x_out_gmem.at[b])
    plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[b])
    plgpu.wait_smem_to_gmem(0)


def add_rms_norm_pallas(x, delta, w, *, eps: float, interpret: bool = False):
    """Residual add and RMSNorm of each row in one kernel (math in the module docstring).

    Args:
      x: [B, H] float32 or bfloat16: the residual stream.
      delta: [B, H] x's dtype, or None (no add): the block output added to x.
      w: [H] float32 or bfloat16: the norm weight (gain ``1 + w``).
      eps: the norm's epsilon (``rms_norm_eps``).
      interpret: run in the Mosaic GPU interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (x + delta [B, H] x's dtype (x itself when delta is None), its RMSNorm [B, H] x's dtype).

    Raises:
      ValueError (before any work): shapes or dtypes that disagree; H not a multiple of 512 up
        to 16384 (the tile is [64, H/64] with H/64 a multiple of 8).
    """
    name = "add_rms_norm_pallas"
    _check(name, x, delta, w)
    batch, hidden = x.shape
    why = check_supported(hidden)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    if batch == 0:
        return (x if delta is None else x + delta), x
    shape = (batch, TILE_ROWS, hidden // TILE_ROWS)  # a free reshape of the rows
    kernel = plgpu.kernel(
        functools.partial(_kernel, eps=float(eps), hidden=hidden, add=delta is not None,
                          interpret=interpret),
        out_type=(jax.ShapeDtypeStruct(shape, x.dtype), jax.ShapeDtypeStruct(shape, x.dtype)),
        scratch_types=(plgpu.SMEM(shape[1:], x.dtype), plgpu.SMEM(shape[1:], x.dtype)),
        grid=(batch,), grid_names=("b",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    ins = (x.reshape(shape),) + (() if delta is None else (delta.reshape(shape),))
    x_new, y = kernel(*ins, w.reshape(shape[1:]))
    return x_new.reshape(batch, hidden), y.reshape(batch, hidden)


def add_rms_norm(x, delta, w, *, eps: float, implementation: str = "auto"):
    """Residual add and RMSNorm dispatcher (arguments and result as :func:`add_rms_norm_pallas`).

    ``implementation`` (a static Python string):
      * "auto": on NVIDIA GPUs of compute capability 9.0+ with fewer than ``MAX_BATCH_AUTO``
        rows and a width the kernel takes, the kernel; the reference otherwise.
      * "pallas": the kernel; without a GPU it runs in the Mosaic GPU interpreter (slow; for
        tests). Unsupported widths raise ValueError.
      * "reference": :func:`add_rms_norm_reference`.

    Raises:
      ValueError: an unknown ``implementation``; shapes or dtypes that disagree; with
        "pallas", the widths :func:`add_rms_norm_pallas` rejects.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"add_rms_norm: {implementation=} must be one of {IMPLEMENTATIONS}")
    if implementation == "reference":
        return add_rms_norm_reference(x, delta, w, eps=eps)
    cc = _gpu_compute_capability()
    if implementation == "pallas":
        return add_rms_norm_pallas(x, delta, w, eps=eps, interpret=cc is None)
    if (cc is None or cc < (9, 0) or x.ndim != 2 or x.shape[0] >= MAX_BATCH_AUTO
            or check_supported(x.shape[-1]) is not None):
        return add_rms_norm_reference(x, delta, w, eps=eps)
    return add_rms_norm_pallas(x, delta, w, eps=eps)
