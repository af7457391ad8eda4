"""jaxdecode.kernels.prefill_attention: the flash prefill-attention kernel (Pallas Mosaic GPU) and
its XLA reference against float64 numpy; the kernel's CUDA lowering (checked on CPU) and the
model with the kernel against the model with the reference.

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``pytest -m gpu`` on an sm_90 machine). Each case is one ragged
batch: rows with start > 0 (a continuation), odd lengths, a row with no new token, a row that
starts at 0; NaN is planted in the caches past every row's end and in the padding queries' keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import GPU_ONLY, MODES, assert_rel_close, lower_for_cuda_text, tiny
from jaxdecode import model
from jaxdecode.kernels import choice
from jaxdecode.kernels import prefill_attention as pa

bf16, f32 = jnp.bfloat16, jnp.float32
# RMS error per output element in bf16 (values are standard normals, outputs averages of them;
# a relative error would blow up for the short outputs of queries that see many keys).
BF16_TOL = 1e-2


def inputs(seed, heads, head_dim, length, starts, num_new, max_len, dtype):
    """q [B, T, Hq, D]; caches [B, Hkv, S, D] random below each row's end, NaN from it on."""
    num_heads, num_kv_heads = heads
    batch = len(starts)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, length, num_heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, num_kv_heads, max_len, head_dim), dtype)
    v = jax.random.normal(kv, (batch, num_kv_heads, max_len, head_dim), dtype)
    start, num_new = jnp.asarray(starts, jnp.int32), jnp.asarray(num_new, jnp.int32)
    past = (jnp.arange(max_len)[None, :] >= (start + num_new)[:, None])[:, None, :, None]
    return q, jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), start, num_new


def reference_f64(q, k, v, start, num_new):
    """[B, T, Hq, D] float64 for the real queries (t < num_new), zeros at padding."""
    q, k, v = (np.asarray(jnp.asarray(x, f32), np.float64) for x in (q, k, v))
    batch, length, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape)
    for b in range(batch):
        s0, n = int(start[b]), int(num_new[b])
        for h in range(num_heads):
            keys, values = k[b, h // group, :s0 + n], v[b, h // group, :s0 + n]
            scores = q[b, :n, h] @ keys.T / math.sqrt(head_dim)  # [n, s0 + n]
            scores[np.arange(n)[:, None] + s0 < np.arange(s0 + n)[None, :]] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :n, h] = (p @ values) / p.sum(-1, keepdims=True)
    return out


def check(out, want, num_new, tol):
    """RMS error per (row, real query, head) <= tol; finite everywhere."""
    out = np.asarray(jnp.asarray(out, f32), np.float64)
    assert np.isfinite(out).all(), "non-finite output (NaN past a row's end leaked?)"
    real = np.arange(out.shape[1])[None, :] < np.asarray(num_new)[:, None]
    err = np.sqrt(np.mean((out - want) ** 2, axis=-1))
    assert err[real].max() <= tol, f"max RMS error {err[real].max():.3g} > {tol}"


# (heads, head_dim, T, starts, num_new, S): G = 4, 1, 16 and 2; D 256, 128, 64
CASES = {
    "g4-d256": ((8, 2), 256, 130, (0, 70, 5, 0), (130, 61, 0, 1), 256),
    "g1-d128": ((2, 2), 128, 200, (3, 0), (197, 200), 448),
    "g16-d64": ((16, 1), 64, 64, (130,), (63,), 256),
    "g2-d128-long": ((4, 2), 128, 384, (0, 200), (384, 383), 640),
    "g4-d128-odd-max-len": ((4, 1), 128, 130, (60,), (130,), 200),  # S padded to 256
}


@pytest.mark.parametrize("dtype", [bf16, f32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference(case, dtype):
    heads, d, t, starts, num_new, s = case
    q, k, v, start, nn = inputs(1, heads, d, t, starts, num_new, s, dtype)
    out = jax.jit(pa.prefill_attention_reference, static_argnames="query_block")(
        q, k, v, start, nn, query_block=64)
    check(out, reference_f64(q, k, v, start, nn), nn, BF16_TOL if dtype == bf16 else 1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel(mode, case):
    heads, d, t, starts, num_new, s = case
    q, k, v, start, nn = inputs(2, heads, d, t, starts, num_new, s, bf16)
    out = jax.jit(lambda *a: pa.prefill_attention_pallas(*a, interpret=mode == "interpret"))(
        q, k, v, start, nn)
    assert out.shape == q.shape and out.dtype == q.dtype
    check(out, reference_f64(q, k, v, start, nn), nn, BF16_TOL)


CONFIGS = {"3stages-64": pa.PrefillAttentionConfig(block_kv=64, num_stages=3),
           "2stages-128": pa.PrefillAttentionConfig(block_kv=128, num_stages=2)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_kernel_configs(mode, config):
    q, k, v, start, nn = inputs(3, (4, 2), 64, 200, (0, 37, 300), (200, 150, 3), 512, bf16)
    out = jax.jit(lambda *a: pa.prefill_attention_pallas(
        *a, config=config, interpret=mode == "interpret"))(q, k, v, start, nn)
    check(out, reference_f64(q, k, v, start, nn), nn, BF16_TOL)


@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
def test_kernel_long_rows_and_every_head_dim(_):
    for heads, d in (((16, 4), 256), ((8, 1), 128), ((32, 8), 64)):
        q, k, v, start, nn = inputs(4, heads, d, 2048, (0, 1000, 4000), (2048, 1500, 7), 8192,
                                    bf16)
        out = jax.jit(pa.prefill_attention_pallas)(q, k, v, start, nn)
        check(out, reference_f64(q, k, v, start, nn), nn, BF16_TOL)


def test_query_blocked_reference_equals_one_block():
    """The reference in query blocks (bounded score memory) == one block."""
    q, k, v, start, nn = inputs(5, (4, 2), 8, 37, (3, 8), (37, 30), 48, f32)
    one = pa.prefill_attention_reference(q, k, v, start, nn, query_block=64)
    blocked = pa.prefill_attention_reference(q, k, v, start, nn, query_block=8)
    assert np.isfinite(np.asarray(one)[1, :30]).all()
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_kernel_rejects_what_it_cannot_do():
    q, k, v, start, nn = inputs(6, (4, 2), 64, 64, (0,), (64,), 64, f32)
    with pytest.raises(ValueError, match="does not take dtype float32"):
        pa.prefill_attention_pallas(q, k, v, start, nn)
    q, k, v, start, nn = inputs(6, (4, 2), 96, 64, (0,), (64,), 64, bf16)
    with pytest.raises(ValueError, match="head_dim=96"):
        pa.prefill_attention_pallas(q, k, v, start, nn)
    assert pa.check_supported((1, 1, 16, 256), (1, 4, 64, 256), bf16) is None
    assert pa.choose_config(256, bf16).block_kv == 64 and pa.choose_config(128, bf16).block_kv == 128


@pytest.mark.parametrize("heads, head_dim", [((16, 4), 256), ((8, 2), 256), ((4, 4), 128),
                                             ((16, 1), 64)])
def test_kernel_lowers_for_cuda(heads, head_dim):
    """The whole Pallas -> Mosaic GPU translation on this CPU (what the interpreter skips)."""
    hq, hkv = heads
    text = lower_for_cuda_text(
        pa.prefill_attention_pallas, ((2, 256, hq, head_dim), bf16),
        ((2, hkv, 1024, head_dim), bf16), ((2, hkv, 1024, head_dim), bf16), ((2,), jnp.int32),
        ((2,), jnp.int32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("mode", MODES)
def test_model_prefill_with_the_kernel_equals_the_reference(mode):
    """A ragged bf16 prefill through the model (two calls: a continuation) with
    Kernels(prefill_attention="pallas") == with the XLA reference, logits to bf16 rounding."""
    config = tiny(vocab_size=300, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    params = jd.init_params(config, jax.random.key(7), "bfloat16")
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 300, (3, 140)).astype(np.int32)
    results = []
    for impl in ("xla", "pallas"):
        kernels = choice.Kernels(prefill_attention=impl, interpret=mode == "interpret")
        state = jd.init_state(config, 3, 320, "bfloat16")
        run = jax.jit(model.prefill_fn, static_argnames=("return_all_logits", "kernels"))
        _, state = run(params, state, tokens[:, :40], np.array([40, 0, 17]), kernels=kernels)
        logits, state = run(params, state, tokens, np.array([140, 90, 3]),
                            return_all_logits=True, kernels=kernels)
        results.append(np.asarray(logits, np.float32))
    real = np.arange(140)[None, :] < np.array([140, 90, 3])[:, None]
    assert_rel_close(results[1][real], results[0][real], 3e-2, "logits, kernel vs reference")
