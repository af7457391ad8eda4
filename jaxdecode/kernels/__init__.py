"""Hand-written kernels, each with a pure-JAX reference of the same signature.

* ``decode_attention``: GQA decode attention (Pallas Mosaic GPU) and
  ``decode_attention_reference`` beside it; the model dispatches to it.
* ``gated_delta_decode``: the one-token gated delta rule in one pass over the state (Pallas
  Mosaic GPU); its reference is ``jaxdecode.gated_delta.gated_delta_rule_step``. Not used by the
  model until it has been timed on a GPU (benchmarks/RESULTS.md).
"""
