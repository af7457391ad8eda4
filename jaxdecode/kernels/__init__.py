"""Hand-written kernels, each with a pure-JAX reference of the same signature.

* ``decode_attention``: GQA decode attention (Pallas Mosaic GPU) and
  ``decode_attention_reference`` beside it; the model dispatches to it.
* ``gated_delta_decode``: the one-token gated delta rule in one pass over the state (Pallas
  Mosaic GPU) and ``gated_delta_decode_reference`` (XLA) beside it; the model's decode step
  dispatches to it (the kernel on Hopper GPUs from batch 8; benchmarks/RESULTS.md).
* ``deltanet_decode``: the whole one-token Gated DeltaNet core (conv window, L2 norms, gating,
  delta rule) as one Pallas Mosaic GPU kernel, ``deltanet_decode_reference`` (XLA) beside it; the
  model's decode step dispatches to it (the kernel on Hopper GPUs below batch 8, where it cuts
  the small kernels of each layer; from batch 8 XLA's form with ``gated_delta_decode``).

The dispatchers take ``implementation`` in :data:`IMPLEMENTATIONS`.
"""

IMPLEMENTATIONS = ("auto", "pallas", "reference")
