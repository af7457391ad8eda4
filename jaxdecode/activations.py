"""Elementwise activations on model-dtype tensors, rounded as torch rounds them.

torch runs ``silu`` and ``sigmoid`` on bfloat16 tensors in float32 with one rounding per op;
``jax.nn.silu`` under jit rounds its inner sigmoid too, an ulp off for many inputs. These compute
in float32 and round once (bit for bit against torch: tests/test_activations.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def silu(x: Array) -> Array:
    """``x * sigmoid(x)`` in float32, rounded once to x's dtype (torch's ``F.silu``)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def sigmoid(x: Array) -> Array:
    """``1 / (1 + exp(-x))`` in float32, rounded once to x's dtype (torch's ``sigmoid``)."""
    return jax.nn.sigmoid(x.astype(jnp.float32)).astype(x.dtype)
