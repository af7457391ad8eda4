"""Elementwise activations on model-dtype tensors, rounded as torch rounds them.

HF runs ``silu`` and ``sigmoid`` on bfloat16 tensors with float32 math and one rounding to
bfloat16 per op (spec §1.7). ``jax.nn.silu`` on bfloat16 under jit rounds its inner sigmoid
first, and about 40% of random bfloat16 inputs then differ from torch by an ulp; these compute
in float32 and round once (checked bit for bit against torch on CPU and on an H200:
tests/test_activations.py). The model and the XLA form of the one-token DeltaNet core use
them; the Pallas kernels write the same math in Mosaic GPU's ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def silu(x: Array) -> Array:
    """``x * sigmoid(x)`` of a model-dtype tensor (any shape): float32 math, rounded once to
    x's dtype (torch's ``F.silu``)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def sigmoid(x: Array) -> Array:
    """``1 / (1 + exp(-x))`` of a model-dtype tensor (any shape): float32 math, rounded once to
    x's dtype (torch's ``sigmoid``)."""
    return jax.nn.sigmoid(x.astype(jnp.float32)).astype(x.dtype)
