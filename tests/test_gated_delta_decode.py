"""The one-pass Pallas Mosaic GPU delta-rule step against a float64 recurrence.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). Its lowering for CUDA, and that the state is
updated in place (aliased), are checked on CPU in tests/test_gpu_lowering.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.gated_delta import gated_delta_rule_step
from jaxdecode.kernels.gated_delta_decode import choose_block_v, gated_delta_decode_pallas
from test_decode_attention import MODES  # interpret / gpu (skipped without an sm_90 GPU)
from test_gated_delta import numpy_recurrence, random_inputs

CASES = {
    # name: (batch, heads, dk, dv, block_v, decay_scale)
    "published-heads-split-v": (2, 3, 128, 128, 64, 2.0),
    "published-heads-whole-v": (2, 3, 128, 128, 128, 2.0),
    "dk64-dv192": (1, 2, 64, 192, 64, 0.5),
    "strong-decay": (3, 2, 128, 128, 64, 30.0),
}


def _run(mode, inputs, block_v):
    q, k, v, g, beta, state = inputs
    fn = jax.jit(lambda *a: gated_delta_decode_pallas(*a, block_v=block_v,
                                                      interpret=mode == "interpret"))
    return fn(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_recurrence(mode, case):
    batch, heads, dk, dv, block_v, decay = CASES[case]
    inputs = random_inputs(sorted(CASES).index(case), batch, 1, heads, dk, dv,
                           decay_scale=decay)
    want_o, want_s = numpy_recurrence(*inputs)
    o, s = _run(mode, inputs, block_v)
    assert o.shape == (batch, heads, dv) and s.shape == (batch, heads, dk, dv)
    np.testing.assert_allclose(np.asarray(o), want_o[:, 0], rtol=0,
                               atol=1e-5 * np.abs(want_o).max())
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=1e-5 * np.abs(want_s).max())
    # and the library's XLA form, which the decode step uses by default
    o_xla, s_xla = gated_delta_rule_step(*(x[:, 0] for x in inputs[:5]), inputs[5])
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), rtol=0,
                               atol=1e-5 * np.abs(want_o).max())


@pytest.mark.parametrize("mode", MODES)
def test_inert_token_leaves_the_state_bit_exact(mode):
    """beta = g = 0 and k = 0 (how padding and finished rows are neutralised)."""
    q, k, v, g, beta, state = random_inputs(11, 2, 1, 3, 128, 128, decay_scale=1.0)
    zero = np.zeros_like(g)
    _, s = _run(mode, (q, 0 * k, v, zero, zero, state), 64)
    np.testing.assert_array_equal(np.asarray(s), state)


def test_bad_inputs_raise_before_any_work():
    q, k, v, g, beta, state = (jnp.asarray(x) for x in
                               random_inputs(1, 1, 1, 2, 128, 128, decay_scale=1.0))
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    with pytest.raises(ValueError, match="float32"):
        gated_delta_decode_pallas(q, k, v, g, beta, state.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="shapes"):
        gated_delta_decode_pallas(q, k[:, :1], v, g, beta, state)
    small = random_inputs(1, 1, 1, 2, 32, 48, decay_scale=1.0)
    with pytest.raises(ValueError, match="dk % 64"):
        gated_delta_decode_pallas(*(jnp.asarray(x[:, 0]) for x in small[:5]),
                                  jnp.asarray(small[5]))


def test_empty_batch():
    state = jnp.zeros((0, 2, 128, 128), jnp.float32)
    o, s = gated_delta_decode_pallas(jnp.zeros((0, 2, 128)), jnp.zeros((0, 2, 128)),
                                     jnp.zeros((0, 2, 128)), jnp.zeros((0, 2)),
                                     jnp.zeros((0, 2)), state, interpret=True)
    assert o.shape == (0, 2, 128) and s.shape == state.shape


def test_block_v_choice():
    assert choose_block_v(128) == 64
    assert choose_block_v(192) == 64
    assert choose_block_v(48) == 48
