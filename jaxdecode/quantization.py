"""Block-FP8 Linear weights: the format of Qwen's ``*-FP8`` checkpoints (spec §9).

A quantised ``[out, in]`` weight is ``float8_e4m3fn`` values plus one scale per
``block_size = (128, 128)`` block, ``W[i, j] = f32(w8[i, j]) · scale_inv[i // 128, j // 128]``
(HF ``FineGrainedFP8Config``; the name says "inv" but it multiplies). Only the weights of the
Linears the releases quantise are held this way (:data:`QUANTIZED_LEAVES`); the rest of a model
stays in its dtype. Works on numpy and jax arrays alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

Array = jax.Array

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # a weight's block scales are stored as ``name + SCALE_SUFFIX``

# The checkpoint leaves (``params.param_specs`` names) held as FP8: those the FP8 releases store
# quantised (their MoE experts per expert, held here as stacks of [E, out, in]).
QUANTIZED_LEAVES = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                    "linear_attn.out_proj.weight", "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                    "mlp.down_proj.weight", "mlp.shared_expert.gate_proj.weight",
                    "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
                    "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@struct.dataclass
class Fp8Linear:
    """A block-FP8 ``[out, in]`` Linear weight: ``weight`` float8_e4m3fn [out, in], ``scale_inv``
    float32 [ceil(out / b0), ceil(in / b1)] for ``block_size = (b0, b1)`` (static); or a stack of
    them with leading axes (the MoE experts: weight [E, out, in], scale_inv [E, R, C]), indexed
    by :meth:`take`."""
    weight: Array
    scale_inv: Array
    block_size: tuple[int, int] = struct.field(pytree_node=False, default=DEFAULT_BLOCK)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype) -> Array:
        """The [..., out, in] weight in ``dtype`` (:func:`dequantize`). FP8 weights are frozen: no
        gradient flows into them (a float8 cotangent would underflow to zero)."""
        weight, scale = jax.lax.stop_gradient((self.weight, self.scale_inv))
        return dequantize(weight, scale, self.block_size, dtype)

    def take(self, index) -> "Fp8Linear":
        """The stacked Linears ``index`` picks along the first axis (an int array gathers)."""
        return Fp8Linear(self.weight[index], self.scale_inv[index], self.block_size)


def check_block_size(block_size) -> tuple[int, int]:
    """``block_size`` as (rows, columns) of positive ints; ValueError for anything else."""
    ok = (isinstance(block_size, (tuple, list)) and len(block_size) == 2
          and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0
                  for b in block_size))
    if not ok:
        raise ValueError(f"block_size={block_size!r} must be two positive ints (rows, columns)")
    return int(block_size[0]), int(block_size[1])


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
    """[..., ceil(out / b0), ceil(in / b1)]: the ``weight_scale_inv`` shape of an [..., out, in]
    weight (leading axes: a stack)."""
    return (*shape[:-2], *(math.ceil(n / b) for n, b in zip(shape[-2:], block_size)))


def _expand(scale, shape, block_size):
    """[..., R, C] block scales -> [..., out, in], each block's scale over its (possibly
    partial) block."""
    xp = jnp if isinstance(scale, jax.Array) else np
    rows = xp.repeat(scale, block_size[0], axis=-2)[..., :shape[-2], :]
    return xp.repeat(rows, block_size[1], axis=-1)[..., :shape[-1]]


def dequantize(weight, scale_inv, block_size=DEFAULT_BLOCK, dtype=np.float32):
    """``f32(weight) · scale_inv`` per block, cast to ``dtype`` (exact in float32 for bf16 scales,
    the releases': a 4-bit by an 8-bit mantissa; float32 scales round once). weight [..., out,
    in] float8_e4m3fn, scale_inv [..., R, C] any float type."""
    xp = jnp if isinstance(weight, jax.Array) else np
    w = weight.astype(xp.float32) * _expand(scale_inv.astype(xp.float32), weight.shape, block_size)
    return w.astype(dtype)


def quantize(w, block_size=DEFAULT_BLOCK):
    """An [..., out, in] float weight -> (float8_e4m3fn [..., out, in], float32 scales [..., R,
    C]): each block's scale its largest magnitude / 448 (1 for an all-zero block), the values
    ``w / scale`` rounded to nearest (the DeepSeek-V3 / Qwen block quantisation; numpy or jax;
    leading axes: a stack, each quantised on its own). ValueError: a bad ``block_size``."""
    block_size = check_block_size(block_size)
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    lead, (out, inp) = w.shape[:-2], w.shape[-2:]
    r, c = scale_shape(w.shape, block_size)[-2:]
    padded = xp.pad(xp.abs(w), ((0, 0),) * len(lead) + ((0, r * block_size[0] - out),
                                                         (0, c * block_size[1] - inp)))
    amax = padded.reshape(*lead, r, block_size[0], c, block_size[1]).max(axis=(-3, -1))
    # times the float32 reciprocal, not / 448: XLA rewrites a division by a constant that way,
    # so numpy and jax give the same scales
    scale = xp.where(amax > 0, amax * xp.float32(1 / FP8_MAX), 1.0).astype(xp.float32)
    q = xp.clip(w / _expand(scale, w.shape, block_size), -FP8_MAX, FP8_MAX)
    return q.astype(FP8), scale


def tie_to_input(x, weights):
    """``(x, weights)`` through one ``lax.optimization_barrier`` when ``weights`` (a pytree) holds
    an :class:`Fp8Linear`, else unchanged: a 16-bit copy dequantised from the returned weights
    cannot then be computed before ``x`` exists, so only the running layer's copy is alive
    (else XLA may hoist every layer's dequantisation out of its loop and hold them all at once:
    1.5 GiB a layer for the 35B-A3B's experts, a copy of the whole model for the Linears, on
    the CPU backend). A barrier moves no data."""
    leaves = jax.tree.leaves(weights, is_leaf=lambda a: isinstance(a, Fp8Linear))
    if not any(isinstance(a, Fp8Linear) for a in leaves):
        return x, weights
    return jax.lax.optimization_barrier((x, weights))


def is_quantized_leaf(name: str) -> bool:
    """Whether the FP8 releases (and ``quantize="fp8"``) hold leaf ``name`` as FP8."""
    return name.endswith(QUANTIZED_LEAVES)
