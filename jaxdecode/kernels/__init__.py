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

from jax.experimental.pallas import mosaic_gpu as plgpu


def wait_for_inputs(interpret: bool) -> None:
    """The first statement of every kernel body: programmatic dependent launch (PDL, Hopper; CUDA
    programming guide). The GPU may launch the kernel while the previous one runs; it waits here
    for that kernel's writes, then lets the next kernel launch early. Used as XLA's own kernels
    do (effect within noise: benchmarks/RESULTS.md); a no-op in the interpreter."""
    if not interpret:
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
