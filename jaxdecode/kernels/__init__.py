"""Hand-written kernels, each with a pure-JAX reference of the same signature.

* ``decode_attention``: GQA decode attention (Pallas Mosaic GPU) and
  ``decode_attention_reference`` beside it; the model dispatches to it.
* ``gated_delta_decode``: the one-token gated delta rule in one pass over the state (Pallas
  Mosaic GPU) and ``gated_delta_decode_reference`` (XLA) beside it; the model's decode step
  dispatches to it (the kernel on Hopper GPUs from batch 8; benchmarks/RESULTS.md).
* ``deltanet_decode``: the whole one-token Gated DeltaNet core (conv window, L2 norms, gating,
  delta rule) as one Pallas Mosaic GPU kernel, ``deltanet_decode_reference`` (XLA) beside it; the
  model's decode step dispatches to it (the kernel on Hopper GPUs below batch 4, where it cuts
  the small kernels of each layer; from batch 4 XLA's form, with ``gated_delta_decode`` from 8).

Which of them a step runs is decided in one place: ``choice.choose_kernels``.
"""

from jax.experimental.pallas import mosaic_gpu as plgpu


def wait_for_inputs(interpret: bool) -> None:
    """The first statement of every kernel body here: programmatic dependent launch (PDL,
    Hopper). It marks the kernel as a PDL kernel, so the GPU may launch it while the kernel
    before it is still running (XLA's own kernels signal their dependents early), and waits here
    until that kernel has finished and its writes are visible; then it lets the kernel after
    this one launch early in turn (that one waits the same way for this one to finish). XLA
    launches its own kernels this way and ours follow it; on a whole decode step the effect is
    within run-to-run noise (benchmarks/RESULTS.md). A no-op in the Mosaic GPU interpreter,
    which has no such instructions. (CUDA programming guide, "Programmatic Dependent Launch".)"""
    if not interpret:
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
