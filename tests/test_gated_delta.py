"""The chunked gated delta rule and the one-token step against a float64 numpy recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.gated_delta import chunk_gated_delta_rule, gated_delta_rule_step, naive_gated_delta_rule


def numpy_recurrence(q, k, v, g, beta, state):
    """Float64 token-by-token gated delta rule (Yang et al. 2025, eq. 10; HF recurrent kernel)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    s = s.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s += k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def random_inputs(seed, batch, length, heads, dk, dv, *, decay_scale):
    rng = np.random.default_rng(seed)
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit((batch, length, heads, dk)) * dk ** -0.5
    k = unit((batch, length, heads, dk))
    v = rng.standard_normal((batch, length, heads, dv))
    g = -decay_scale * rng.uniform(0.0, 1.0, (batch, length, heads))
    beta = rng.uniform(0.0, 1.0, (batch, length, heads))
    state = rng.standard_normal((batch, heads, dk, dv))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta, state)]


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
