"""The one-kernel residual add and RMSNorm against float64 numpy, and in whole decode steps.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). Its CUDA lowering at the published widths
is checked on CPU in tests/test_gpu_lowering.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import model
from jaxdecode.kernels import rms_norm as rn
from jaxdecode.kernels.rms_norm import add_rms_norm, add_rms_norm_pallas, add_rms_norm_reference
from test_decode_attention import MODES  # interpret / gpu (skipped without an sm_90 GPU)

f32, bf16 = jnp.float32, jnp.bfloat16
EPS = 1e-6


def numpy_add_rms_norm(x, delta, w, eps):
    """float64 math with the model's roundings: x + delta rounded once to x's dtype; the norm
    in float64, rounded once to x's dtype."""
    dtype = x.dtype
    x64 = np.asarray(x, np.float64)
    if delta is not None:
        x64 = (x64 + np.asarray(delta, np.float64)).astype(dtype).astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    y = y * (1.0 + np.asarray(w, np.float64))
    return x64.astype(dtype), y.astype(dtype)


def random_inputs(seed, batch, hidden, dtype, add=True):
    rng = np.random.default_rng(seed)
    np_dtype = ml_dtypes.bfloat16 if dtype == bf16 else np.float32
    # rows of different scales (the residual stream grows with depth)
    x = (rng.standard_normal((batch, hidden)) * rng.uniform(0.1, 30, (batch, 1))).astype(np_dtype)
    delta = rng.standard_normal((batch, hidden)).astype(np_dtype) if add else None
    w = (rng.standard_normal(hidden) * 0.3).astype(np_dtype)
    return x, delta, w


def run(mode, x, delta, w):
    fn = jax.jit(lambda x, d, w: add_rms_norm_pallas(x, d, w, eps=EPS,
                                                      interpret=mode == "interpret"))
    return fn(jnp.asarray(x), None if delta is None else jnp.asarray(delta), jnp.asarray(w))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,hidden,dtype,add", [
    (1, 1024, bf16, True), (1, 4096, bf16, True), (3, 2560, bf16, True), (2, 5120, bf16, False),
    (1, 512, f32, True), (5, 2048, f32, False)])
def test_matches_float64(mode, batch, hidden, dtype, add):
    x, delta, w = random_inputs(batch + hidden, batch, hidden, dtype, add)
    got_x, got_y = run(mode, x, delta, w)
    want_x, want_y = numpy_add_rms_norm(x, delta, w, EPS)
    assert got_x.dtype == got_y.dtype == dtype and got_y.shape == (batch, hidden)
    np.testing.assert_array_equal(np.asarray(got_x), want_x)  # the add: one rounding, exact
    # the norm: float32 sums, rsqrt and products against float64: one bfloat16 ulp (the final
    # rounding), or a few float32 ulps
    ulp = 2.0 ** -7 if dtype == bf16 else 2.0 ** -20
    err = np.abs(np.asarray(got_y, np.float64) - want_y.astype(np.float64))
    bound = ulp * np.abs(want_y.astype(np.float64)) + 1e-30
    assert (err <= bound).all(), f"max error {err.max()} ({(err > bound).sum()} elements)"
    assert np.abs(np.asarray(got_y, np.float64)).max() > 0.5  # not a zero output


@pytest.mark.parametrize("mode", MODES)
def test_model_decode_with_the_kernel_equals_the_reference(mode):
    """Whole decode steps (float32, hidden 512) with norm_impl="pallas" (the kernel; the
    interpreter on CPU) against "reference": logits and the states, with an inactive row."""
    base = jd.Config.from_preset("tiny")  # hidden 128 is below the kernel's 512: widen
    config = base.__class__(**{**base.__dict__, "vocab_size": 1000, "hidden_size": 512})
    params = jd.init_params(config, jax.random.key(5))
    prompt = np.random.default_rng(13).integers(0, config.vocab_size, (2, 6)).astype(np.int32)
    active = [np.array([True, True]), np.array([False, True]), np.array([True, True])]

    def decode(impl):
        state = jd.init_state(config, batch_size=2, max_len=32)
        logits, state = jd.prefill(params, state, prompt, np.array([6, 3], np.int32))
        out = []
        for act in active:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, state = model.decode_step_jit(params, state, token, jnp.asarray(act),
                                                  norm_impl=impl)
            out.append(np.asarray(logits))
        return np.stack(out), state

    want_logits, want_state = decode("reference")
    got_logits, got_state = decode("pallas" if mode == "interpret" else "auto")
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert np.abs(want_logits).max() > 0.1
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise_before_any_work():
    x, delta, w = (jnp.asarray(a) for a in random_inputs(0, 2, 1024, f32))
    with pytest.raises(ValueError, match="multiple of 512"):
        add_rms_norm_pallas(x[:, :1000], delta[:, :1000], w[:1000], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="delta must have x's shape"):
        add_rms_norm_pallas(x, delta[:1], w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"w must be \[H\]"):
        add_rms_norm_pallas(x, delta, w[:512], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm_pallas(x, delta.astype(bf16), w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="x must be"):
        add_rms_norm_reference(x[None], None, w, eps=EPS)
    with pytest.raises(ValueError, match="implementation"):
        add_rms_norm(x, delta, w, eps=EPS, implementation="triton")
    with pytest.raises(ValueError, match="norm_impl"):
        model.check_implementations("auto", "auto", "fast")


def test_reference_takes_any_width_and_no_add():
    x, _, w = random_inputs(1, 3, 100, f32, add=False)
    got_x, got_y = add_rms_norm_reference(jnp.asarray(x), None, jnp.asarray(w), eps=EPS)
    want_x, want_y = numpy_add_rms_norm(x, None, w, EPS)
    np.testing.assert_array_equal(np.asarray(got_x), want_x)
    np.testing.assert_allclose(np.asarray(got_y), want_y, rtol=2e-6)


@pytest.mark.parametrize("batch,hidden,kernel", [(1, 1024, True), (rn.MAX_BATCH_AUTO - 1, 4096, True),
                                                 (rn.MAX_BATCH_AUTO, 4096, False),
                                                 (1, 1000, False)])
def test_auto_on_hopper_takes_the_kernel_below_max_batch_auto(monkeypatch, batch, hidden,
                                                              kernel):
    """On a Hopper GPU (faked; lowered for CUDA on CPU) "auto" is the kernel below
    MAX_BATCH_AUTO rows at a width it takes, XLA's form otherwise; off Hopper, XLA's form."""
    specs = [jax.ShapeDtypeStruct((batch, hidden), bf16)] * 2 + [
        jax.ShapeDtypeStruct((hidden,), bf16)]

    def lowered():
        return jax.jit(lambda x, d, w: add_rms_norm(x, d, w, eps=EPS)).trace(*specs).lower(
            lowering_platforms=("cuda",)).as_text()

    on_hopper = (rn._gpu_compute_capability() or (0, 0)) >= (9, 0)
    assert ("mosaic_gpu" in lowered()) == (on_hopper and kernel)
    monkeypatch.setattr(rn, "_gpu_compute_capability", lambda: (9, 0))
    assert ("mosaic_gpu" in lowered()) == kernel
