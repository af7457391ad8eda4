"""The model's elementwise activations on bfloat16 match torch's bit for bit (HF runs them on
bfloat16 tensors: float32 math, one rounding per op), alone and as fused in the MLP under jit.
Run on CPU in CI; on an H200 it passed too (benchmarks/RESULTS.md, session 9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import run_hf
from jaxdecode import activations


@pytest.mark.hf
@pytest.mark.slow
def test_silu_and_sigmoid_match_torch_on_bfloat16(tmp_path):
    rng = np.random.default_rng()  # fresh inputs each run
    x = (rng.standard_normal(50_000) * rng.choice([0.1, 1.0, 4.0, 30.0], 50_000))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # exact in bfloat16
    np.save(tmp_path / "x.npy", x)
    run_hf([{"action": "activations", "in": str(tmp_path / "x.npy"),
             "out": str(tmp_path / "torch.npz")}], tmp_path)
    want = np.load(tmp_path / "torch.npz")
    xb = jnp.asarray(x, jnp.bfloat16)
    for name, fn in (("silu", activations.silu), ("sigmoid", activations.sigmoid)):
        got = np.asarray(jax.jit(fn)(xb), np.float32)
        assert jax.jit(fn)(xb).dtype == jnp.bfloat16
        # Bit for bit, except where torch's result is below 1e-30 (x < -85): XLA's float32
        # exp underflows to 0 there (and denormals are flushed), torch keeps ~1e-37.
        tiny = np.abs(want[name]) < 1e-30
        mismatched = int((got != want[name])[~tiny].sum())
        assert mismatched == 0, f"{name}: {mismatched} of {x.size} differ from torch"
        assert np.abs(got - want[name])[tiny].max(initial=0.0) < 1e-30
    # the MLP's elementwise part, fused under jit as in model.mlp: silu rounded, then the product
    gate, up = jnp.split(xb, 2)
    got = np.asarray(jax.jit(lambda g, u: activations.silu(g) * u)(gate, up), np.float32)
    tiny = np.abs(want["swiglu"]) < 1e-30
    assert int((got != want["swiglu"])[~tiny].sum()) == 0
    # the check has teeth: jax.nn.silu on bfloat16 (its sigmoid rounded first) does not match
    plain = np.asarray(jax.jit(jax.nn.silu)(xb), np.float32)
    assert (plain != want["silu"]).mean() > 0.05
