"""Ops whose result for one row cannot depend on the other rows of the batch.

XLA compiles each batch size into another program: it may fuse elementwise ops otherwise (a
multiply and an add contracted to one FMA in one fusion, rounded twice across two), reduce in
another order or pick another GEMM algorithm, so a row's bits follow the batch. Here a row's
ops run in a subgraph of one fixed shape, fenced by optimisation barriers (XLA neither fuses
across one nor hoists work out of it): the same HLO, compiled alike, whatever the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows per group of :func:`map_row_groups`: the decode step's GEMM and elementwise shape.
GROUP_ROWS = 64


def _fenced(fn):
    def body(consts, rows):
        consts, rows = jax.lax.optimization_barrier((consts, rows))
        return jax.lax.optimization_barrier(fn(consts, *rows))
    return body


def map_row_groups(fn, consts, *rows):
    """``fn(consts, *group)`` over groups of :data:`GROUP_ROWS` rows, fenced.

    rows: arrays [B, ...] (one B), zero-padded to whole groups; consts: a pytree every group
    reads (weights), passed through the fence so no part of ``fn`` is hoisted out of the loop.
    ``fn`` gets [GROUP_ROWS, ...] arrays and returns a pytree of [GROUP_ROWS, ...] arrays.
    Returns that pytree with the real B rows. One group runs as is, more as a ``lax.map``.
    """
    n = rows[0].shape[0]
    groups = max(1, -(-n // GROUP_ROWS))
    padded = tuple(
        jnp.pad(r, [(0, groups * GROUP_ROWS - n)] + [(0, 0)] * (r.ndim - 1))
        .reshape(groups, GROUP_ROWS, *r.shape[1:]) for r in rows)
    body = _fenced(fn)
    if groups == 1:
        out = jax.tree.map(lambda y: y[None], body(consts, tuple(r[0] for r in padded)))
    else:
        out = jax.lax.map(lambda group: body(consts, group), padded)
    return jax.tree.map(lambda y: y.reshape(groups * GROUP_ROWS, *y.shape[2:])[:n], out)


def map_rows(fn, consts, *rows):
    """``fn(consts, *row)`` for each row alone, fenced: rows [B, ...] reach ``fn`` as [1, ...]
    and its pytree of [1, ...] arrays comes back as [B, ...] (a ``lax.map`` from two rows)."""
    body = _fenced(fn)
    if rows[0].shape[0] == 1:
        return body(consts, rows)
    one = lambda row: jax.tree.map(lambda y: y[0], body(consts, tuple(x[None] for x in row)))  # noqa: E731
    return jax.lax.map(one, rows)
