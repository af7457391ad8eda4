"""Hand-written Pallas Mosaic GPU kernels, each beside a pure-JAX reference of the same signature.

* ``decode_attention``: split-K GQA decode attention.
* ``prefill_attention``: causal GQA flash attention of a prompt's new tokens over the cache.
* ``chunk_gated_delta``: the prefill's chunked gated delta rule, its chunk-to-chunk recurrence in
  one kernel.
* ``gated_delta_decode``: the one-token gated delta rule in one pass over the state.
* ``deltanet_decode``: the whole one-token Gated DeltaNet core (conv window, L2 norms, gating,
  delta rule) in one kernel.
* ``fp8_linear``: a block-FP8 weight-only linear for a decode step's few rows, dequantising in
  registers.

Which of them a step runs is decided in one place: ``choice.choose_kernels``.
"""

import functools

import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu


def wait_for_inputs(interpret: bool) -> None:
    """The first statement of every kernel body: programmatic dependent launch (PDL, Hopper; CUDA
    programming guide). The GPU may launch the kernel while the previous one runs; it waits here
    for that kernel's writes, then lets the next kernel launch early. Used as XLA's own kernels
    do (effect within noise: benchmarks/RESULTS.md); a no-op in the interpreter."""
    if not interpret:
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()


def stream_blocks(fetch, steps, num_stages: int, wait_consumed, *, prologue: int | None = None):
    """The memory warpgroup's loop of a warp-specialised kernel: ``fetch(i, slot)`` issues the
    copies of block i (0 <= i < ``steps``, traced) into ``slot = i % num_stages``; the first
    ``prologue`` (static, default ``num_stages``) at once, each later one after
    ``wait_consumed(slot)`` says the compute warpgroups released the slot; then the last
    ``num_stages`` releases are waited for too, so every barrier phase is observed."""
    for i in range(num_stages if prologue is None else prologue):
        pl.when(i < steps)(functools.partial(fetch, i, i))

    def refill(i, _):
        slot = lax.rem(i, num_stages)
        wait_consumed(slot)
        fetch(i + num_stages, slot)

    lax.fori_loop(0, jnp.maximum(steps - num_stages, 0), refill, None)

    def last(i, _):
        wait_consumed(lax.rem(i, num_stages))

    lax.fori_loop(jnp.maximum(steps - num_stages, 0), steps, last, None)
