"""jaxdecode.gated_delta: the chunked gated delta rule and the one-token step against a float64
numpy recurrence (conftest.numpy_recurrence)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import numpy_recurrence, random_inputs
from jaxdecode.gated_delta import (chunk_gated_delta_rule, gated_delta_rule_step,
                                   naive_gated_delta_rule)


CASES = {
    # name: (length, decay_scale)
    "one_token": (1, 1.0),
    "short": (5, 1.0),
    "chunk_minus_1": (63, 0.1),
    "exact_chunk": (64, 1.0),
    "chunk_plus_1": (65, 0.5),
    "three_chunks_weak_decay": (150, 0.01),
    "strong_decay": (130, 30.0),  # exp(g) down to e^-30: exercises the -inf masking
    "no_decay": (100, 0.0),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_matches_float64_recurrence(name, impl):
    length, decay = CASES[name]
    inputs = random_inputs(hash(name) % 1000, 2, length, 3, 16, 24, decay_scale=decay)
    want_o, want_s = numpy_recurrence(*inputs)
    fn = chunk_gated_delta_rule if impl == "chunked" else naive_gated_delta_rule
    o, s = jax.jit(fn)(*map(jnp.asarray, inputs))
    # float32 against float64: the delta rule amplifies rounding (spec §7 item 12).
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=2e-4 * np.abs(want_o).max())
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=2e-4 * np.abs(want_s).max())


def test_chunked_equals_recurrence_in_float64():
    """With float64 the chunked algebra must agree with the recurrence to round-off."""
    inputs = random_inputs(7, 1, 130, 2, 8, 8, decay_scale=3.0)
    want_o, want_s = numpy_recurrence(*inputs)
    with jax.enable_x64(True):
        o, s = chunk_gated_delta_rule(*(jnp.asarray(x, jnp.float64) for x in inputs))
        assert o.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-9, atol=1e-9)


def test_step_matches_recurrence_and_padding_is_inert():
    q, k, v, g, beta, state = random_inputs(3, 2, 1, 4, 16, 16, decay_scale=2.0)
    want_o, want_s = numpy_recurrence(q, k, v, g, beta, state)
    o, s = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    np.testing.assert_allclose(np.asarray(o), want_o[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-5, atol=1e-5)
    # beta = g = 0 and k = 0: the state passes through bit-exactly (how padding is neutralised).
    zero = np.zeros_like(g[:, 0])
    _, s2 = gated_delta_rule_step(q[:, 0], 0 * k[:, 0], v[:, 0], zero, zero, state)
    np.testing.assert_array_equal(np.asarray(s2), state)
