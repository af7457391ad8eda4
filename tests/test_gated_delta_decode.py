"""The one-pass Pallas Mosaic GPU delta-rule step against a float64 recurrence.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). Its lowering for CUDA, and that the state is
updated in place (aliased), are checked on CPU in tests/test_gpu_lowering.py.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.gated_delta import gated_delta_rule_step
from jaxdecode.kernels import gated_delta_decode as gdd
from jaxdecode.kernels.gated_delta_decode import (choose_block_v, gated_delta_decode,
                                                  gated_delta_decode_pallas,
                                                  gated_delta_decode_reference)
from test_decode_attention import MODES  # interpret / gpu (skipped without an sm_90 GPU)
from test_gated_delta import numpy_recurrence, random_inputs

CASES = {
    # name: (batch, key heads, value heads, dk, dv, block_v, decay_scale)
    "published-gqa-16-cols": (2, 2, 4, 128, 128, 16, 2.0),
    "published-gqa-64-cols": (2, 2, 4, 128, 128, 64, 2.0),
    "whole-v": (2, 3, 3, 128, 128, 128, 2.0),
    "dk64-dv192-r3": (1, 1, 3, 64, 192, 32, 0.5),
    "strong-decay": (3, 2, 2, 128, 128, 64, 30.0),
}


def gqa_inputs(seed, batch, hk, hv, dk, dv, decay):
    """Fresh random one-token inputs with q, k per key head, plus their float64 result (the
    recurrence on q, k repeated to the value heads: head h reads key head h // r)."""
    q, k, v, g, beta, state = random_inputs(seed, batch, 1, hv, dk, dv, decay_scale=decay)
    q, k = q[:, :, ::hv // hk], k[:, :, ::hv // hk]  # one per key head
    r = hv // hk
    want_o, want_s = numpy_recurrence(np.repeat(q, r, axis=2), np.repeat(k, r, axis=2), v, g,
                                      beta, state)
    args = [jnp.asarray(x[:, 0]) for x in (q, k, v, g, beta)] + [jnp.asarray(state)]
    return args, want_o[:, 0], want_s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_recurrence(mode, case):
    batch, hk, hv, dk, dv, block_v, decay = CASES[case]
    args, want_o, want_s = gqa_inputs(sorted(CASES).index(case), batch, hk, hv, dk, dv, decay)
    fn = jax.jit(lambda *a: gated_delta_decode_pallas(*a, block_v=block_v,
                                                      interpret=mode == "interpret"))
    o, s = fn(*args)
    assert o.shape == (batch, hv, dv) and s.shape == (batch, hv, dk, dv)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=1e-5 * np.abs(want_o).max())
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=1e-5 * np.abs(want_s).max())
    # and the XLA form (the reference the dispatcher falls back to)
    o_xla, s_xla = gated_delta_decode_reference(*args)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), rtol=0,
                               atol=1e-5 * np.abs(want_o).max())


def test_reference_is_the_library_step_on_repeated_heads():
    args, want_o, want_s = gqa_inputs(5, 2, 2, 4, 32, 48, 1.0)
    o, s = gated_delta_decode_reference(*args)
    q, k = (jnp.repeat(x, 2, axis=1) for x in args[:2])
    o2, s2 = gated_delta_rule_step(q, k, *args[2:])
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=1e-5 * np.abs(want_s).max())


@pytest.mark.parametrize("mode", MODES)
def test_inert_token_leaves_the_state_bit_exact(mode):
    """beta = g = 0 and k = 0 (how padding and finished rows are neutralised)."""
    (q, k, v, g, beta, state), _, _ = gqa_inputs(11, 2, 3, 3, 128, 128, 1.0)
    zero = jnp.zeros_like(g)
    _, s = gated_delta_decode_pallas(q, 0 * k, v, zero, zero, state,
                                     interpret=mode == "interpret")
    np.testing.assert_array_equal(np.asarray(s), np.asarray(state))


def test_bad_inputs_raise_before_any_work():
    (q, k, v, g, beta, state), _, _ = gqa_inputs(1, 1, 2, 2, 128, 128, 1.0)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_decode_pallas(q, k, v, g, beta, state.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="shapes"):
        gated_delta_decode_pallas(q, k[:, :1], v, g, beta, state)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        (q3, k3, *rest), _, _ = gqa_inputs(1, 1, 1, 3, 128, 128, 1.0)
        gated_delta_decode_pallas(jnp.tile(q3, (1, 2, 1)), jnp.tile(k3, (1, 2, 1)), *rest)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        args, _, _ = gqa_inputs(1, 1, 2, 2, 32, 48, 1.0)
        gated_delta_decode_pallas(*args)
    with pytest.raises(ValueError, match="block_v"):
        gated_delta_decode_pallas(q, k, v, g, beta, state, block_v=48)
    with pytest.raises(ValueError, match="implementation"):
        gated_delta_decode(q, k, v, g, beta, state, implementation="triton")


def test_empty_batch():
    state = jnp.zeros((0, 2, 128, 128), jnp.float32)
    o, s = gated_delta_decode_pallas(jnp.zeros((0, 1, 128)), jnp.zeros((0, 1, 128)),
                                     jnp.zeros((0, 2, 128)), jnp.zeros((0, 2)),
                                     jnp.zeros((0, 2)), state, interpret=True)
    assert o.shape == (0, 2, 128) and s.shape == state.shape


def test_block_v_choice():
    # the published 0.8B (16 value heads, dv = 128): batch 1 spreads over 128 programs
    assert choose_block_v(1, 16, 128) == 16
    assert choose_block_v(8, 32, 128) == 32
    assert choose_block_v(64, 16, 128) == 32
    assert choose_block_v(1, 2, 48) == 16
    assert choose_block_v(64, 2, 40) == 40  # no multiple of 16 divides it: the whole dv


def test_dispatcher_on_this_machine():
    """'auto' is the reference without a Hopper GPU (silently), and the kernel with one from
    MIN_BATCH_AUTO rows up."""
    args, want_o, _ = gqa_inputs(3, gdd.MIN_BATCH_AUTO, 2, 4, 128, 128, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = jax.jit(lambda *a: gated_delta_decode(*a, implementation="auto"))(*args)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=1e-5 * np.abs(want_o).max())
    text = jax.jit(lambda *a: gated_delta_decode(*a)).lower(*args).as_text()
    on_hopper = (gdd._gpu_compute_capability() or (0, 0)) >= (9, 0)
    assert ("mosaic_gpu" in text) == on_hopper
    small = [x[:gdd.MIN_BATCH_AUTO - 1] for x in args]
    assert "mosaic_gpu" not in jax.jit(lambda *a: gated_delta_decode(*a)).lower(*small).as_text()


def test_dispatcher_warns_on_a_shape_the_kernel_cannot_take(monkeypatch):
    monkeypatch.setattr(gdd, "_gpu_compute_capability", lambda: (9, 0))
    args, _, _ = gqa_inputs(1, gdd.MIN_BATCH_AUTO, 1, 2, 32, 48, 1.0)
    with pytest.warns(UserWarning, match="not a multiple of 64"):
        gated_delta_decode(*args)


def test_unknown_implementations_are_named_before_any_work():
    import jaxdecode as jd
    params = jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(0))
    state = jd.init_state(params.config, 1, 64)
    with pytest.raises(ValueError, match="deltanet_impl='bogus'"):
        jd.decode_step(params, state, [1], deltanet_impl="bogus")
    with pytest.raises(ValueError, match="attention_impl='triton'"):
        jd.decode_step(params, state, [1], attention_impl="triton")
    with pytest.raises(ValueError, match="deltanet_impl='bogus'"):
        next(jd.generate_stream(params, [[1, 2]], 4, deltanet_impl="bogus"))
    with pytest.raises(ValueError, match="deltanet_impl='bogus'"):
        jd.generate(params, [[1, 2]], 4, deltanet_impl="bogus")
    args, _, _ = gqa_inputs(1, 1, 1, 3, 32, 48, 1.0)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        gated_delta_decode_reference(jnp.tile(args[0], (1, 2, 1)), jnp.tile(args[1], (1, 2, 1)),
                                     *args[2:])
