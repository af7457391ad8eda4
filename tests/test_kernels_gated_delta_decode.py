"""jaxdecode.kernels.gated_delta_decode: the one-pass Pallas Mosaic GPU delta-rule step against a
float64 recurrence, and its CUDA lowering with the state updated in place (aliased), checked on
CPU.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI; slow); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MODES, lower_for_cuda_text, numpy_recurrence, random_inputs
from jaxdecode.gated_delta import gated_delta_rule_step, naive_gated_delta_rule
from jaxdecode.kernels import gated_delta_decode as gdd
from jaxdecode.kernels.gated_delta_decode import (choose_block_v, gated_delta_decode_pallas,
                                                  gated_delta_decode_reference,
                                                  gated_delta_states_pallas)

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
    # and the XLA form (the reference choose_kernels falls back to)
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


def test_check_supported():
    """What choose_kernels asks before picking the kernel."""
    assert gdd.check_supported((8, 16, 128), (8, 32, 128, 128)) is None
    assert "not a multiple of 64" in gdd.check_supported((8, 1, 32), (8, 2, 32, 48))
    assert "not a multiple of 8" in gdd.check_supported((8, 1, 64), (8, 2, 64, 44))
    assert "3 value heads are not a multiple of 2 key heads" in gdd.check_supported(
        (8, 2, 64), (8, 3, 64, 64))


def test_reference_rejects_value_heads_not_a_multiple_of_key_heads():
    args, _, _ = gqa_inputs(1, 1, 1, 3, 32, 48, 1.0)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        gated_delta_decode_reference(jnp.tile(args[0], (1, 2, 1)), jnp.tile(args[1], (1, 2, 1)),
                                     *args[2:])


# ----- T tokens, every state kept (the speculative verify step's form) ---------------------------

def float64_states(q, k, v, g, beta, state):
    """The float64 recurrence's (o [B, T, Hv, dv], the state after each token [B, T, ...])."""
    outs, states = [], []
    for t in range(q.shape[1]):
        o, state = numpy_recurrence(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                    g[:, t:t + 1], beta[:, t:t + 1], state)
        outs.append(o[:, 0])
        states.append(state)
    return np.stack(outs, 1), np.stack(states, 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [(2, 4, 2, 4, 128, 128, 16), (1, 2, 1, 3, 64, 192, 32),
                                  (3, 5, 2, 2, 128, 64, 32)],
                         ids=["b2-t4-gqa", "b1-t2-r3-dv192", "b3-t5-mha"])
def test_states_kernel_matches_float64_recurrence(mode, case):
    batch, length, hk, hv, dk, dv, block_v = case
    q, k, v, g, beta, state = random_inputs(length * 7 + batch, batch, length, hv, dk, dv,
                                            decay_scale=2.0)
    q, k = q[:, :, ::hv // hk], k[:, :, ::hv // hk]  # one per key head
    r = hv // hk
    beta[0, 1] = 0.0  # an inert token of row 0: its state equals the one before
    g[0, 1] = 0.0
    k[0, 1] = 0.0
    want_o, want_s = float64_states(np.repeat(q, r, axis=2), np.repeat(k, r, axis=2), v, g, beta,
                                    state)
    fn = jax.jit(lambda *a: gated_delta_states_pallas(*a, block_v=block_v,
                                                      interpret=mode == "interpret"))
    o, s = fn(*map(jnp.asarray, (q, k, v, g, beta, state)))
    assert o.shape == (batch, length, hv, dv) and s.shape == (batch, length, hv, dk, dv)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=1e-5 * np.abs(want_o).max())
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=1e-5 * np.abs(want_s).max())
    np.testing.assert_array_equal(np.asarray(s)[0, 1], np.asarray(s)[0, 0])
    # and the XLA form the model falls back to
    o_xla, s_xla = naive_gated_delta_rule(*(jnp.repeat(jnp.asarray(x), r, axis=2) for x in (q, k)),
                                          *map(jnp.asarray, (v, g, beta, state)), all_states=True)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_xla), rtol=0,
                               atol=1e-5 * np.abs(want_s).max())


def test_states_kernel_bad_inputs_raise():
    q, k, v, g, beta, state = map(jnp.asarray, random_inputs(0, 1, 2, 2, 64, 32, decay_scale=1.0))
    with pytest.raises(ValueError, match="float32"):
        gated_delta_states_pallas(q.astype(jnp.bfloat16), k, v, g, beta, state)
    with pytest.raises(ValueError, match=r"'v'"):
        gated_delta_states_pallas(q, k, v[:, :1], g, beta, state)
    long = random_inputs(0, 1, 64, 2, 128, 128, decay_scale=1.0)
    with pytest.raises(ValueError, match="shared memory"):
        gated_delta_states_pallas(*map(jnp.asarray, long), block_v=32)
    with pytest.raises(ValueError, match="block_v=-8"):
        gated_delta_states_pallas(q, k, v, g, beta, state, block_v=-8)
    empty = random_inputs(0, 1, 2, 2, 64, 32, decay_scale=1.0)
    empty[0], empty[1], empty[5] = empty[0][..., :0], empty[1][..., :0], empty[5][:, :, :0]
    with pytest.raises(ValueError, match="head dims must be positive"):
        gated_delta_states_pallas(*map(jnp.asarray, empty))
    assert gdd.check_states_supported((1, 4, 16, 128), (1, 32, 128, 128)) is None
    assert "shared memory" in gdd.check_states_supported((1, 64, 16, 128), (1, 32, 128, 128), 32)


# ----- the CUDA lowering, on CPU ---------------------------------------------------------------

def delta_rule_shapes(batch, key_heads, heads, dk, dv):
    """(shape, dtype) of q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], state [B, Hv, dk, dv]
    (all float32)."""
    f32 = jnp.float32
    return (((batch, key_heads, dk), f32), ((batch, key_heads, dk), f32),
            ((batch, heads, dv), f32), ((batch, heads), f32), ((batch, heads), f32),
            ((batch, heads, dk, dv), f32))


@pytest.mark.perf
@pytest.mark.parametrize("batch,key_heads,heads,dv,block_v", [
    (1, 16, 16, 128, 16), (1, 16, 32, 128, 32), (64, 16, 32, 128, 64), (64, 32, 32, 128, 128),
    (2, 1, 3, 192, 64)])
def test_gated_delta_decode_lowers_and_updates_the_state_in_place(batch, key_heads, heads, dv,
                                                                 block_v):
    text = lower_for_cuda_text(
        lambda q, k, v, g, b, s: gated_delta_decode_pallas(q, k, v, g, b, s, block_v=block_v),
        *delta_rule_shapes(batch, key_heads, heads, 128, dv), donate_argnums=5)
    # the kernel call writes its state operand in place (output aliased to that operand) ...
    assert re.search(r"output_operand_alias<output_tuple_indices = \[1\]", text), text[-3000:]
    # ... and the donated state argument is aliased to the function's state output
    assert re.search(r"%arg5: tensor<[^>]*> \{[^}]*tf\.aliasing_output = 1", text), text[:3000]


@pytest.mark.perf
def test_kernel_uses_programmatic_dependent_launch():
    """The kernel starts with jaxdecode.kernels.wait_for_inputs: its custom call carries
    mosaic_gpu.uses_pdl (see test_kernels_decode_attention.py)."""
    text = lower_for_cuda_text(gated_delta_decode_pallas, *delta_rule_shapes(8, 16, 32, 128, 128))
    assert re.search(r"custom_call @mosaic_gpu", text), text[-3000:]
    assert "mosaic_gpu.uses_pdl" in text
