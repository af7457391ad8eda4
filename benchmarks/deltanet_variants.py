"""Other formulations of the one-token gated delta rule, for same-run A/B timing.

Each has the signature and result of ``jaxdecode.gated_delta.gated_delta_rule_step`` (equal up
to float32 round-off; ``tests/test_gated_delta.py`` checks them against a float64
recurrence). ``benchmarks/step_profile.py --deltanet-steps library,stacked,two_sums`` swaps
them into the decode step one after the other in one process, so their times are comparable
(times from different lent machines varied by 2-20% for the same code: RESULTS.md).

  library   the library's form: decay S, S^T k, write, then o = S'^T q from the new state
  stacked   one reduction of S over [k | q], then o = d S^T q + (k.q) delta (no read of S')
  two_sums  as stacked, with two separate reductions (sum of products) over the same S
  pallas    jaxdecode.kernels.gated_delta_decode: one Pallas Mosaic GPU kernel, S read once and
            written once in place (the Mosaic GPU interpreter where there is no GPU)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdecode.gated_delta import gated_delta_rule_step
from jaxdecode.kernels.gated_delta_decode import gated_delta_decode_pallas


def stacked(q, k, v, g, beta, state):
    decay = jnp.exp(g)[..., None]  # [B, H, 1]
    kq = jnp.stack([k, q], axis=-1)  # [B, H, dk, 2]
    s_kq = jnp.sum(state[..., None] * kq[..., :, None, :], axis=-3)  # [B, H, dv, 2]
    s_k, s_q = s_kq[..., 0], s_kq[..., 1]
    delta = beta[..., None] * (v - decay * s_k)
    o = decay * s_q + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    state = decay[..., None] * state + k[..., :, None] * delta[..., None, :]
    return o, state


def two_sums(q, k, v, g, beta, state):
    decay = jnp.exp(g)[..., None]
    s_k = jnp.sum(state * k[..., :, None], axis=-2)  # [B, H, dv]
    s_q = jnp.sum(state * q[..., :, None], axis=-2)
    delta = beta[..., None] * (v - decay * s_k)
    o = decay * s_q + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    state = decay[..., None] * state + k[..., :, None] * delta[..., None, :]
    return o, state


def pallas(q, k, v, g, beta, state):
    return gated_delta_decode_pallas(q, k, v, g, beta, state,
                                     interpret=jax.default_backend() != "gpu")


VARIANTS = {"library": gated_delta_rule_step, "stacked": stacked, "two_sums": two_sums,
            "pallas": pallas}
