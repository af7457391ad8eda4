"""jaxdecode.kernels.fp8_linear: the block-FP8 weight-only linear kernel (Pallas Mosaic GPU) and its
XLA reference against float64 numpy; its CUDA lowering (checked on CPU); the dispatch in
``choice.fp8_linear``; a decode step of an FP8 model with the kernel against the step with XLA's
form.

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``pytest -m gpu`` on an sm_90 machine).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxdecode as jd
from conftest import FULL, LIN, MODES, assert_rel_close, lower_for_cuda_text, tiny
from jaxdecode import quantization
from jaxdecode.kernels import choice
from jaxdecode.kernels import fp8_linear as fl

bf16, f32 = jnp.bfloat16, jnp.float32
FP8 = ml_dtypes.float8_e4m3fn


def inputs(seed, m, n, k, dtype=bf16):
    """x [m, k] normal; weight [n, k] the e4m3 rounding of normals; block scales log-uniform over
    three decades (a scale applied to the wrong block shows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w8 = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(FP8)
    scale = (10.0 ** rng.uniform(-4, -1, quantization.scale_shape((n, k), (128, 128))))
    return jnp.asarray(x, dtype), jnp.asarray(w8), jnp.asarray(scale, f32)


def reference_f64(x, w8, scale, dtype):
    """float64 x @ W.T with W the dequantised weight rounded to the model dtype (the math the
    library defines: ``quantization.dequantize`` to x's dtype, then the product)."""
    w = quantization.dequantize(np.asarray(w8), np.asarray(scale), (128, 128), np.float32)
    w = np.asarray(jnp.asarray(w, dtype).astype(f32), np.float64)
    return np.asarray(jnp.asarray(x, f32), np.float64) @ w.T


# (m, n, k, config, dtype): one row; odd rows with 3 splits and 2 stages; a full 64-row tile;
# split-K with a short last split; one column block; 40 rows (padded to 48) in float16
CASES = {
    "m1": (1, 256, 384, None, bf16),
    "m5-splits3": (5, 384, 640, fl.Fp8LinearConfig(num_stages=2, splits=3), bf16),
    "m64": (64, 128, 256, None, bf16),
    "m17-uneven-splits": (17, 256, 896, fl.Fp8LinearConfig(num_stages=3, splits=3), bf16),
    "m9-one-block": (9, 128, 128, None, bf16),
    "m40-float16": (40, 256, 512, None, jnp.float16),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_float64(mode, case):
    m, n, k, config, dtype = CASES[case]
    x, w8, scale = inputs(list(CASES).index(case), m, n, k, dtype)
    got = jax.jit(lambda *a: fl.fp8_linear_pallas(*a, config=config,
                                                  interpret=mode == "interpret"))(x, w8, scale)
    assert got.shape == (m, n) and got.dtype == dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    want = reference_f64(x, w8, scale, dtype)
    # one rounding of the 16-bit output
    assert_rel_close(np.asarray(got, np.float32), want, 8e-3, f"{case} kernel")
    ref = fl.fp8_linear_reference(x, w8, scale)
    assert_rel_close(np.asarray(ref, np.float32), want, 8e-3, f"{case} reference")


# (experts, m, n, k, config): ids with repeats; 8 pairs of 35B-A3B's routing (k = 8) in small
GROUPED_CASES = {
    "e5-m3": (5, 3, 256, 384, None),
    "e6-m8-splits2": (6, 8, 128, 512, fl.Fp8LinearConfig(num_stages=2, splits=2)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_kernel_against_float64(mode, case):
    """Row m through stack entry ids[m] (the MoE pairs form): each row against float64 numpy
    of its own expert's dequantised weight; the reference's grouped form too."""
    e, m, n, k, config = GROUPED_CASES[case]
    seed = 20 + list(GROUPED_CASES).index(case)
    stack = [inputs(seed + i, m, n, k) for i in range(e)]
    x = stack[0][0]
    w8 = jnp.stack([w for _, w, _ in stack])
    scale = jnp.stack([s for _, _, s in stack])
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, e, m), jnp.int32)
    got = jax.jit(lambda *a: fl.fp8_linear_pallas(*a[:3], ids=a[3], config=config,
                                                  interpret=mode == "interpret"))(
        x, w8, scale, ids)
    assert got.shape == (m, n) and got.dtype == bf16
    want = np.stack([reference_f64(x[i:i + 1], w8[j], scale[j], bf16)[0]
                     for i, j in enumerate(np.asarray(ids))])
    assert_rel_close(np.asarray(got, np.float32), want, 8e-3, f"{case} grouped kernel")
    ref = fl.fp8_linear_reference(x, w8, scale, ids=ids)
    assert_rel_close(np.asarray(ref, np.float32), want, 8e-3, f"{case} grouped reference")


def test_grouped_kernel_lowers_for_cuda():
    specs = [jax.ShapeDtypeStruct((8, 2048), bf16), jax.ShapeDtypeStruct((256, 1024, 2048), FP8),
             jax.ShapeDtypeStruct((256, 8, 16), f32), jax.ShapeDtypeStruct((8,), jnp.int32)]
    text = lower_for_cuda_text(lambda x, w, s, ids: fl.fp8_linear_pallas(x, w, s, ids=ids),
                               *specs)
    assert "mosaic_gpu" in text


def test_reference_is_what_model_linear_computed_for_fp8():
    """The reference is ``dequantize`` to x's dtype then the dot (float32 here: exact)."""
    x, w8, scale = inputs(3, 4, 256, 384, f32)
    want = np.asarray(x, np.float64) @ quantization.dequantize(
        np.asarray(w8), np.asarray(scale), (128, 128), np.float64).T
    assert_rel_close(fl.fp8_linear_reference(x, w8, scale), want, 1e-5, "float32 reference")


@pytest.mark.parametrize("m, n, k, config", [(1, 256, 384, None), (64, 1024, 4096, None),
                                             (16, 12288, 4096, None),
                                             (3, 128, 512, fl.Fp8LinearConfig(4, 2))])
def test_kernel_lowers_for_cuda(m, n, k, config):
    specs = [jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((n, k), FP8),
             jax.ShapeDtypeStruct((n // 128, k // 128), f32)]
    text = lower_for_cuda_text(lambda *a: fl.fp8_linear_pallas(*a, config=config), *specs)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("x_shape, w_shape, x_dtype, why", [
    ((65, 256), (128, 256), bf16, "65 rows"),
    ((1, 200), (128, 200), bf16, "multiples of 128"),
    ((1, 256), (128, 384), bf16, "x's K must be the weight's"),
    ((1, 256), (100, 256), bf16, "multiples of 128"),
    ((1, 256), (128, 256), f32, "x dtype float32"),
])
def test_unsupported_inputs_raise(x_shape, w_shape, x_dtype, why):
    x = jnp.zeros(x_shape, x_dtype)
    w = jnp.zeros(w_shape, FP8)
    s = jnp.ones(quantization.scale_shape(w_shape, (128, 128)), f32)
    with pytest.raises(ValueError, match=why):
        fl.fp8_linear_pallas(x, w, s)
    with pytest.raises(ValueError, match="scale_inv.shape"):
        fl.fp8_linear_pallas(jnp.zeros((1, 256), bf16), jnp.zeros((128, 256), FP8),
                             jnp.ones((1, 1), f32))


def test_choose_config_fills_the_gpu_and_the_shared_memory():
    for n, k, m in [(12288, 4096, 1), (1024, 4096, 8), (4096, 12288, 64), (17408, 5120, 33)]:
        c = fl.choose_config(n, k, m)
        programs = n // 128 * c.splits
        assert 2 <= c.num_stages <= 8
        assert c.num_stages * (128 * 128 + fl.padded_rows(m) * 256) <= fl.SMEM_BUDGET_BYTES
        assert fl.smem_bytes(m, c.num_stages) <= fl.SMEM_LIMIT_BYTES
        if n // 128 > 132:  # two programs an SM, one wave
            assert c.splits == 2 and 2 * fl.smem_bytes(m, c.num_stages) <= fl.SMEM_PER_SM, (m, c)
        else:
            assert programs <= 132 or c.splits == 1, (n, k, c)
            assert c.splits == 1 or programs > 132 // 2, (n, k, c)
    for m in (1, 8, 33, 64):  # 27B's MLP (136 row blocks): stages shrink with the rows
        c = fl.choose_config(17408, 5120, m)
        assert c.splits == 2 and 2 * fl.smem_bytes(m, c.num_stages) <= fl.SMEM_PER_SM, (m, c)
    assert fl.choose_config(17408, 5120, 1).num_stages == 4


def test_config_overrides_are_checked_before_lowering():
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="must be None or an int >= 1"):
            fl.Fp8LinearConfig(num_stages=bad)
        with pytest.raises(ValueError, match="must be None or an int >= 1"):
            fl.Fp8LinearConfig(splits=bad)
    x, w8, scale = inputs(0, 64, 128, 256)
    with pytest.raises(ValueError, match="num_stages=8 needs .* bytes of shared memory"):
        fl.fp8_linear_pallas(x, w8, scale, config=fl.Fp8LinearConfig(num_stages=8))


def test_kernels_refuse_fp8_pallas_where_it_does_not_run():
    with pytest.raises(ValueError, match="fp8_linear"):
        choice.Kernels(fp8_linear="pallas", batch_invariant=True)
    with pytest.raises(ValueError, match="fp8_linear"):
        choice.Kernels(fp8_linear="mosaic")
    with pytest.raises(ValueError, match="fp8_experts"):
        choice.Kernels(fp8_experts="pallas", batch_invariant=True)


def test_choice_runs_the_kernel_up_to_64_rows_and_xla_above():
    """``choice.fp8_linear`` with fp8_linear="pallas": the kernel for up to 64 rows in all (a
    decode step's; lowered for CUDA: a Mosaic GPU call), XLA's dequantise + dot above it (a
    prefill's B·T rows, usually) and for calls it does not take."""
    k = choice.Kernels(fp8_linear="pallas", interpret=False)

    def lowered(shape, rows=256, dtype=bf16, kernels=k):
        w = jax.ShapeDtypeStruct((rows, 384), FP8)
        s = jax.ShapeDtypeStruct(quantization.scale_shape((rows, 384), (128, 128)), f32)
        return lower_for_cuda_text(
            lambda x, w, s: choice.fp8_linear(kernels, x, jd.Fp8Linear(w, s)),
            jax.ShapeDtypeStruct(shape, dtype), w, s)

    assert "mosaic_gpu" in lowered((8, 1, 384))  # [B, T, K] of a decode step
    assert "mosaic_gpu" in lowered((64, 384))
    assert "mosaic_gpu" not in lowered((65, 384))  # a prefill's rows
    assert "mosaic_gpu" not in lowered((2, 384), dtype=f32)
    assert "mosaic_gpu" not in lowered((2, 384), rows=200)
    assert "mosaic_gpu" not in lowered((2, 384), kernels=choice.XLA)


# Every FP8 Linear of this model has dimensions in 128-blocks except k_proj / v_proj (64 rows):
# those run XLA's form beside the kernel.
CONFIG = tiny(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
              num_hidden_layers=2, layer_types=(LIN, FULL))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_decode_step_with_the_kernel_matches_xla(mode):
    """A bf16 FP8 model: prefill (XLA's form: 3 x 7 rows), then decode steps with the kernel
    against the same steps with XLA's form (the same dequantised weights; bf16 rounding apart)."""
    params = jd.quantize_fp8(jd.init_params(CONFIG, jax.random.key(1), "bfloat16"))
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 7)), jnp.int32)
    kernel = choice.Kernels(fp8_linear="pallas", interpret=mode == "interpret")
    out = {}
    for name, kernels in (("xla", choice.XLA), ("kernel", kernel)):
        state = jd.init_state(CONFIG, 3, 32, dtype=params.dtype)
        logits, state = jd.model.prefill_fn(params, state, tokens, jnp.array([7, 3, 5]),
                                            kernels=choice.XLA)
        steps = []
        for _ in range(2):
            logits, state = jax.jit(functools.partial(jd.model.decode_step_fn, kernels=kernels))(
                params, state, jnp.argmax(logits, -1).astype(jnp.int32))
            steps.append(np.asarray(logits, np.float32))
        out[name] = np.stack(steps)
    assert_rel_close(out["kernel"], out["xla"], 2e-2, "decode logits, kernel vs XLA")


MOE = tiny(vocab_size=300, hidden_size=128, intermediate_size=0, num_attention_heads=2,
           num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=128, linear_value_head_dim=128, num_hidden_layers=2,
           layer_types=(LIN, FULL), num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=128, shared_expert_intermediate_size=128)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_moe_decode_step_with_the_grouped_kernel_matches_xla(mode, monkeypatch):
    """An FP8 MoE model's decode steps with the kernels (the experts' pairs form, 6 pairs over
    8 experts, through the grouped kernel) against the same steps with XLA's forms."""
    calls = []
    kernel_fn = choice._fp8_grouped_kernel
    monkeypatch.setattr(choice, "_fp8_grouped_kernel",
                        lambda *a: calls.append(a[0].shape) or kernel_fn(*a))
    params = jd.quantize_fp8(jd.init_params(MOE, jax.random.key(2), "bfloat16"))
    assert isinstance(params.layers[0].mlp.experts_gate_up_proj, jd.Fp8Linear)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, MOE.vocab_size, (3, 5)), jnp.int32)
    kernel = choice.Kernels(fp8_linear="pallas", fp8_experts="pallas",
                            interpret=mode == "interpret")
    out = {}
    for name, kernels in (("xla", choice.XLA), ("kernel", kernel)):
        state = jd.init_state(MOE, 3, 16, dtype=params.dtype)
        logits, state = jd.model.prefill_fn(params, state, tokens, jnp.array([5, 2, 4]),
                                            kernels=choice.XLA)
        steps = []
        for _ in range(2):
            logits, state = jax.jit(functools.partial(jd.model.decode_step_fn, kernels=kernels))(
                params, state, jnp.argmax(logits, -1).astype(jnp.int32))
            steps.append(np.asarray(logits, np.float32))
        out[name] = np.stack(steps)
    assert calls == [(6, 128)] * 8  # 2 steps (each traced) x 2 layers x (gate_up, down)
    assert_rel_close(out["kernel"], out["xla"], 2e-2, "MoE decode logits, kernel vs XLA")


@pytest.mark.slow
def test_gradient_through_the_grouped_kernel_equals_xla_form():
    """Reverse mode through the experts' grouped kernel (interpreter): x's gradient as XLA's
    form gives it."""
    from jaxdecode import experts
    params = jd.quantize_fp8(jd.init_params(MOE, jax.random.key(3), "bfloat16"))
    mlp = params.layers[0].mlp
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, 128)), bf16)
    chosen = jnp.asarray([[0, 4], [4, 7]], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (2, 2)), bf16)

    def loss(x, grouped):
        y = experts.routed_experts(x, weights, chosen, mlp.experts_gate_up_proj,
                                   mlp.experts_down_proj, grouped=grouped).astype(f32)
        return (y * jnp.arange(y.size, dtype=f32).reshape(y.shape) / y.size).sum()

    grouped = choice._fp8_grouped(choice.Kernels(fp8_experts="pallas", interpret=True))
    got, want = jax.grad(loss)(x, grouped), jax.grad(loss)(x, None)
    assert_rel_close(np.asarray(got, np.float32), np.asarray(want, np.float32), 2e-2,
                     "x's gradient")
    assert_rel_close(np.asarray(loss(x, grouped)), np.asarray(loss(x, None)), 1e-2, "loss")


@pytest.mark.slow
def test_gradient_through_the_kernel_equals_xla_form():
    """Reverse mode through ``choice.fp8_linear`` with the kernel (interpreter): x's gradient as
    XLA's form gives it, and none into the frozen FP8 weight or its scales."""
    x, w8, scale = inputs(7, 3, 256, 384)
    w = jd.Fp8Linear(w8, scale)

    def loss(x, w, kernels):
        y = choice.fp8_linear(kernels, x, w).astype(f32)
        return (y * jnp.arange(y.size, dtype=f32).reshape(y.shape) / y.size).sum()

    kernel = choice.Kernels(fp8_linear="pallas", interpret=True)
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w, kernel)
    want_x, want_w = jax.grad(loss, argnums=(0, 1))(x, w, choice.XLA)
    assert_rel_close(np.asarray(gx, np.float32), np.asarray(want_x, np.float32), 1e-2,
                     "x's gradient")
    assert not np.asarray(gw.scale_inv).any() and not np.asarray(want_w.scale_inv).any()
