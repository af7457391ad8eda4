"""The few-row GEMV kernel (with its RMSNorm prologue) against float64 numpy.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). Its CUDA lowering at the published shapes
is checked on CPU in tests/test_gpu_lowering.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdecode import model
from jaxdecode.kernels.gemv import check_supported, gemv_pallas, gemv_reference, gemv_wgmma
from test_decode_attention import MODES  # interpret / gpu (skipped without an sm_90 GPU)

bf16 = jnp.bfloat16
EPS = 1e-6


def device_for(mode):
    """The interpreter runs on the CPU even where a GPU is the default device: XLA's GPU fusions
    of the interpreter's jnp ops keep excess precision across the kernel's bfloat16 roundings
    (the SwiGLU cases then missed float64 by 2.4e-3 and 3.0e-3 of the scale on the H200)."""
    if mode == "interpret":
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


def numpy_gemv(x, w, norm_weight, num_splits, eps=EPS):
    """float64 partials; with a norm, x is normalised as the model's rms_norm (float64 math,
    one rounding to bfloat16)."""
    x64 = np.asarray(x, np.float64)
    if norm_weight is not None:
        scale = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
        x64 = (x64 * scale * (1.0 + np.asarray(norm_weight, np.float64)))
        x64 = x64.astype(ml_dtypes.bfloat16).astype(np.float64)
    batch, k = x64.shape
    xs = x64.reshape(batch, num_splits, k // num_splits)
    ws = np.asarray(w, np.float64).reshape(w.shape[0], num_splits, k // num_splits)
    return np.einsum("bsk,nsk->sbn", xs, ws)


def random_inputs(seed, batch, n, k, norm, x_scale=(0.5, 20), norm_dtype=bf16):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, k)) * rng.uniform(*x_scale, (batch, 1)))
    w = rng.standard_normal((n, k)) * k ** -0.5
    nw = jnp.asarray(rng.standard_normal(k) * 0.3, norm_dtype) if norm else None
    return jnp.asarray(x, bf16), jnp.asarray(w, bf16), nw


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,n,k,num_splits,norm,block_k,num_stages", [
    (1, 128, 1024, 1, True, 256, 4), (1, 192, 1024, 2, False, 256, 4),
    (3, 64, 512, 1, True, 128, 4), (8, 128, 768, 3, False, 256, 4),
    (2, 64, 1024, 4, True, 64, 4), (1, 64, 256, 1, True, 128, 4),
    # more tiles than stages: every slot is refilled (12 tiles through 2 slots, and through 1)
    (2, 128, 1536, 1, True, 128, 2), (1, 64, 1536, 2, False, 64, 1)])
def test_matches_float64(mode, batch, n, k, num_splits, norm, block_k, num_stages):
    x, w, nw = random_inputs(batch * n + k, batch, n, k, norm)
    with device_for(mode):
        got = jax.jit(lambda x, w, nw: gemv_pallas(
            x, w, norm_weight=nw, eps=EPS, num_splits=num_splits, block_k=block_k,
            num_stages=num_stages, interpret=mode == "interpret"))(x, w, nw)
    want = numpy_gemv(x, w, nw, num_splits)
    assert got.shape == (num_splits, batch, n) and got.dtype == jnp.float32
    # float32 sums of bfloat16 products against float64 (about 1e-7 of the output's scale).
    # With a norm, x_n is rounded once to bfloat16, and float32 rsqrt and sums can flip that
    # rounding for an element (about 5e-5 of the scale each; none seen at these seeds).
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=(3e-4 if norm else 1e-5) * scale)
    assert scale > 0.1


def numpy_swiglu(x):
    """[gate | up] -> bfloat16(bfloat16(silu(gate)) * up) in float64 math."""
    gate, up = np.split(np.asarray(x, np.float64), 2, axis=-1)
    act = (gate / (1.0 + np.exp(-gate))).astype(ml_dtypes.bfloat16).astype(np.float64)
    return (act * up).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,n,k,num_splits,block_k,num_stages", [
    (1, 128, 512, 1, 256, 4), (3, 64, 1536, 2, 128, 2)])
def test_swiglu_matches_float64(mode, batch, n, k, num_splits, block_k, num_stages):
    """The down projection of silu(gate) * up, with x = [gate | up] (2K columns)."""
    rng = np.random.default_rng(batch + k)
    x = jnp.asarray(rng.standard_normal((batch, 2 * k)) * 3, bf16)
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, bf16)
    with device_for(mode):
        got = gemv_pallas(x, w, swiglu=True, num_splits=num_splits, block_k=block_k,
                          num_stages=num_stages, interpret=mode == "interpret")
    want = numpy_gemv(numpy_swiglu(x), w, None, num_splits)
    scale = np.abs(want).max()
    # silu in float32 against float64 can flip the one bfloat16 rounding (as for the norm)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=3e-4 * scale)
    assert scale > 0.1
    ref = gemv_reference(x, w, swiglu=True, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=0, atol=3e-4 * scale)


@pytest.mark.parametrize("mode", MODES)
def test_norm_epsilon_and_float32_norm_weight(mode):
    """Rows of mean square about 1e-4 with eps = 1e-2: eps sets the scale (to within 1%), so a
    kernel that dropped or misplaced it would be far off; the norm weight in float32."""
    eps = 1e-2
    x, w, nw = random_inputs(7, 2, 128, 512, True, x_scale=(0.005, 0.02), norm_dtype=jnp.float32)
    with device_for(mode):
        got = gemv_pallas(x, w, norm_weight=nw, eps=eps, block_k=128, num_stages=2,
                          interpret=mode == "interpret")
    want = numpy_gemv(x, w, nw, 1, eps=eps)
    without_eps = numpy_gemv(x, w, nw, 1, eps=0.0)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=3e-4 * scale)
    assert np.abs(without_eps - want).max() > scale  # eps matters far beyond the tolerance


def test_reference_is_the_models_norm_then_projection():
    """gemv_reference (the kernel's contract) equals model.rms_norm followed by model.linear."""
    x, w, nw = random_inputs(1, 2, 64, 512, True)
    got = gemv_reference(x, w, norm_weight=nw, eps=EPS, num_splits=2).sum(0)
    want = model.linear(model.rms_norm(x, nw, EPS).astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_before_any_work():
    x, w, nw = random_inputs(2, 1, 128, 512, True)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemv_pallas(x, w[:100], interpret=True)
    with pytest.raises(ValueError, match="positive multiple of 64"):
        gemv_pallas(x, w[:0], interpret=True)
    for bad in (dict(block_k=0), dict(block_k=-64), dict(num_splits=0), dict(num_stages=0),
                dict(num_splits=2.0), dict(num_stages=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            gemv_pallas(x, w, interpret=True, **bad)
    with pytest.raises(ValueError, match="must be 64, 128, 192 or 256"):
        gemv_pallas(x, w, block_k=96, interpret=True)
    with pytest.raises(ValueError, match="positive multiple of num_splits"):
        gemv_pallas(x[:, :0], w[:, :0], interpret=True)
    with pytest.raises(ValueError, match="rows of x"):
        gemv_pallas(jnp.zeros((9, 512), bf16), w, interpret=True)
    with pytest.raises(ValueError, match="num_splits"):
        gemv_pallas(x, w, num_splits=3, interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        gemv_pallas(x.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_pallas(x, w, norm_weight=nw[:256], interpret=True)
    with pytest.raises(ValueError, match="x must be"):
        gemv_pallas(x[0], w, interpret=True)
    with pytest.raises(ValueError, match=r"\[gate \| up\]"):
        gemv_pallas(x, w, swiglu=True, interpret=True)  # x must be 2K wide
    with pytest.raises(ValueError, match="do not go together"):
        gemv_pallas(jnp.concatenate([x, x], 1), w, swiglu=True, norm_weight=nw, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):  # 8 rows of 12288 inputs: 192 KiB
        gemv_pallas(jnp.zeros((8, 12288), bf16), jnp.zeros((64, 12288), bf16), interpret=True)
    # the same check answers check_supported (what a caller asks before choosing the kernel)
    assert "shared memory" in check_supported((8, 12288), (64, 12288), bf16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,n,k,num_splits,block_k,num_stages", [
    (1, 128, 512, 1, 128, 4), (3, 64, 1024, 2, 64, 2), (8, 192, 768, 3, 128, 1),
    # 12 tiles through 2 slots: every slot refilled
    (5, 64, 1536, 1, 128, 2)])
def test_wgmma_matches_float64(mode, batch, n, k, num_splits, block_k, num_stages):
    """The tensor-core GEMV (x zero-padded to 8 rows inside) against float64 partials."""
    x, w, _ = random_inputs(batch * n + k + 1, batch, n, k, False)
    with device_for(mode):
        got = gemv_wgmma(x, w, num_splits=num_splits, block_k=block_k, num_stages=num_stages,
                         interpret=mode == "interpret")
    want = numpy_gemv(x, w, None, num_splits)
    assert got.shape == (num_splits, batch, n) and got.dtype == jnp.float32
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * scale)
    assert scale > 0.1


def test_wgmma_bad_inputs_raise_before_any_work():
    x, w, _ = random_inputs(3, 2, 128, 512, False)
    with pytest.raises(ValueError, match="x must be"):
        gemv_wgmma(x[:, :256], w, interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        gemv_wgmma(x.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="rows of x"):
        gemv_wgmma(jnp.zeros((9, 512), bf16), w, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemv_wgmma(x, w[:96], interpret=True)
    # x is padded to 8 rows in shared memory whatever B is: 8 rows of 12288 inputs do not fit
    with pytest.raises(ValueError, match=r"padded to 8 rows.*shared memory"):
        gemv_wgmma(jnp.zeros((1, 12288), bf16), jnp.zeros((64, 12288), bf16), interpret=True)
    assert check_supported((1, 12288), (64, 12288), bf16, 128) is None  # the CUDA-core kernel
