"""jaxdecode.kernels.chunk_gated_delta: the chunked delta rule with its recurrence in a Pallas
Mosaic GPU kernel, against the token-by-token recurrence in float64 numpy; its CUDA lowering
(checked on CPU); the model with the kernel against the model with XLA's form.

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``pytest -m gpu`` on an sm_90 machine), where its matmuls are
tf32 (relative tolerance 3e-3 instead of 1e-5). Inputs are fresh random draws, prepared as the
model prepares them (q, k L2-normalised, decays <= 0, beta in [0, 1]); rows end in inert
padding tokens (beta = g = 0, k = 0) as the model's ragged rows do.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import MODES, assert_rel_close, lower_for_cuda_text, tiny
from jaxdecode import model
from jaxdecode.gated_delta import l2_normalize
from jaxdecode.kernels import chunk_gated_delta as cg
from jaxdecode.kernels import choice

f32 = jnp.float32
TOL = {"interpret": 1e-5, "gpu": 3e-3}


def inputs(seed, batch, length, heads, dk, dv, num_new, decay=0.3):
    """Random (q, k, v, g, beta, state); tokens t >= num_new[b] of row b made inert."""
    ks = jax.random.split(jax.random.key(seed), 6)
    q = l2_normalize(jax.random.normal(ks[0], (batch, length, heads, dk))) * dk**-0.5
    k = l2_normalize(jax.random.normal(ks[1], (batch, length, heads, dk)))
    v = jax.random.normal(ks[2], (batch, length, heads, dv))
    g = -decay * jax.nn.softplus(jax.random.normal(ks[3], (batch, length, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, length, heads)))
    state = jax.random.normal(ks[5], (batch, heads, dk, dv))
    real = jnp.arange(length)[None, :] < jnp.asarray(num_new)[:, None]  # [B, T]
    k = jnp.where(real[..., None, None], k, 0.0)
    g, beta = (jnp.where(real[..., None], x, 0.0) for x in (g, beta))
    return q, k, v, g, beta, state


def recurrence_f64(q, k, v, g, beta, state):
    """HF ``torch_recurrent_gated_delta_rule`` in float64 numpy: (o [B, T, H, dv], state)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o, s


# (B, T, H, dk, dv, num_new, decay): several chunks with a ragged tail and an all-padding row;
# a single partial chunk; the published dk = dv = 128; strong decay (gates near 0).
CASES = {
    "ragged-3-chunks": (3, 150, 2, 64, 128, (150, 97, 0), 0.3),
    "one-partial-chunk": (1, 37, 3, 64, 64, (37,), 0.3),
    "dk128-dv128": (1, 128, 2, 128, 128, (128,), 0.1),
    "strong-decay": (2, 70, 1, 64, 64, (70, 64), 5.0),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_equals_the_float64_recurrence(mode, case):
    batch, length, heads, dk, dv, num_new, decay = CASES[case]
    args = inputs(zlib.crc32(case.encode()) % 1000, batch, length, heads, dk, dv, num_new, decay)
    o, state = jax.jit(cg.chunk_gated_delta_rule_pallas, static_argnames="interpret")(
        *args, interpret=mode == "interpret")
    want_o, want_state = recurrence_f64(*args)
    real = np.arange(length)[None, :] < np.asarray(num_new)[:, None]
    assert o.shape == want_o.shape and state.shape == want_state.shape
    assert_rel_close(np.asarray(o)[real], want_o[real], TOL[mode], "outputs")
    assert_rel_close(state, want_state, TOL[mode], "final state")
    for b, n in enumerate(num_new):
        if n == 0:  # no real token: the state passes through bit for bit (decay e^0, K = 0)
            np.testing.assert_array_equal(np.asarray(state)[b], np.asarray(args[5])[b])


@pytest.mark.parametrize("mode", MODES)
def test_kernel_on_correlated_keys_and_strong_writes(mode):
    """Keys sharing a common direction and beta near 1: T = I + A far from I, where T⁻¹ by
    powers of A would cancel terms near 1e18; the blocked inverse must match float64."""
    q, k, v, g, beta, state = inputs(21, 2, 192, 2, 128, 64, (192, 150), decay=0.02)
    base = jax.random.normal(jax.random.key(22), (1, 1, 2, 128))
    k = l2_normalize(2.0 * base + jax.random.normal(jax.random.key(23), k.shape))
    k = jnp.where(jnp.arange(192)[None, :, None, None] < jnp.array([192, 150])[:, None, None, None],
                  k, 0.0)
    beta = jnp.where(beta > 0, 0.9 + 0.1 * beta, 0.0)
    args = (q, k, v, g, beta, state)
    o, state_out = cg.chunk_gated_delta_rule_pallas(*args, interpret=mode == "interpret")
    want_o, want_state = recurrence_f64(*args)
    real = np.arange(192)[None, :] < np.array([192, 150])[:, None]
    assert_rel_close(np.asarray(o)[real], want_o[real], TOL[mode], "outputs")
    assert_rel_close(state_out, want_state, TOL[mode], "final state")


@pytest.mark.parametrize("mode", MODES)
def test_kernel_equals_xla_form(mode):
    """Same inputs through the kernel and ``chunk_gated_delta_rule_reference``."""
    args = inputs(11, 2, 200, 2, 64, 128, (200, 131))
    got = cg.chunk_gated_delta_rule_pallas(*args, interpret=mode == "interpret")
    with jax.default_matmul_precision("highest"):
        want = cg.chunk_gated_delta_rule_reference(*args)
    for g_, w_, what in zip(got, want, ("outputs", "final state")):
        assert_rel_close(g_, w_, TOL[mode], what)


def test_kernel_rejects_what_it_cannot_do():
    q, k, v, g, beta, state = inputs(1, 1, 64, 1, 64, 64, (64,))
    with pytest.raises(ValueError, match=r"takes float32 inputs; got \{'v': dtype\(bfloat16\)"):
        cg.chunk_gated_delta_rule_pallas(q, k, v.astype(jnp.bfloat16), g, beta, state)
    with pytest.raises(ValueError, match=r"'state': \(\(1, 1, 64, 32\), \(1, 1, 64, 64\)\)"):
        cg.chunk_gated_delta_rule_pallas(q, k, v, g, beta, state[..., :32])
    q, k, v, g, beta, state = inputs(1, 1, 64, 1, 32, 64, (64,))
    with pytest.raises(ValueError, match=r"linear_key_head_dim=32 \(the kernels take 64 or 128"):
        cg.chunk_gated_delta_rule_pallas(q, k, v, g, beta, state)
    q, k, v, g, beta, state = inputs(1, 1, 64, 1, 64, 96, (64,))
    with pytest.raises(ValueError, match=r"linear_value_head_dim=96 \(the kernels take 64 or 128"):
        cg.chunk_gated_delta_rule_pallas(q, k, v, g, beta, state)
    assert "linear_value_head_dim=256" in cg.check_supported((1, 1, 1, 128), (1, 1, 1, 256))
    assert "linear_key_head_dim=256" in cg.check_supported((1, 1, 1, 256), (1, 1, 1, 128))
    assert cg.check_supported((1, 1, 1, 128), (1, 1, 1, 128), jnp.bfloat16) is None
    assert "model dtype float32" in cg.check_supported((1, 1, 1, 128), (1, 1, 1, 128), f32)


@pytest.mark.parametrize("dk, dv", [(128, 128), (64, 64)])
def test_kernel_lowers_for_cuda(dk, dv):
    """The whole Pallas -> Mosaic GPU translation on this CPU (what the interpreter skips)."""
    shapes = [((2, 300, 4, dk), f32), ((2, 300, 4, dk), f32), ((2, 300, 4, dv), f32),
              ((2, 300, 4), f32), ((2, 300, 4), f32), ((2, 4, dk, dv), f32)]
    assert "mosaic_gpu" in lower_for_cuda_text(cg.chunk_gated_delta_rule_pallas, *shapes)


@pytest.mark.parametrize("mode", MODES)
def test_model_prefill_with_the_kernel_equals_xla(mode):
    """A ragged bf16 prefill through the model (two calls: a continuation, a row with no new
    token) with Kernels(prefill_delta_rule="pallas") == with XLA's form: the last logits and
    every DeltaNet state, to bf16 rounding."""
    config = tiny(vocab_size=300, linear_key_head_dim=64, linear_value_head_dim=64)
    params = jd.init_params(config, jax.random.key(5), "bfloat16")
    tokens = np.random.default_rng(6).integers(0, 300, (3, 100)).astype(np.int32)
    run = jax.jit(model.prefill_fn, static_argnames=("kernels",))
    results = []
    for impl in ("xla", "pallas"):
        kernels = choice.Kernels(prefill_delta_rule=impl, interpret=mode == "interpret")
        state = jd.init_state(config, 3, 256, "bfloat16")
        _, state = run(params, state, tokens[:, :30], np.array([30, 0, 7]), kernels=kernels)
        logits, state = run(params, state, tokens, np.array([100, 70, 0]), kernels=kernels)
        results.append((np.asarray(logits, np.float32), state))
    (want, want_state), (got, got_state) = results
    assert_rel_close(got, want, 3e-2, "last logits, kernel vs XLA")
    assert len(got_state.recurrent_state) == 3
    for i, (a, b) in enumerate(zip(got_state.recurrent_state, want_state.recurrent_state)):
        assert_rel_close(a, b, 2e-2, f"recurrent state of DeltaNet layer {i}")
