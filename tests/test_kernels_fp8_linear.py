"""jaxdecode.kernels.fp8_linear: the block-FP8 weight-only linear kernel (Pallas Mosaic GPU) and its
XLA reference against float64 numpy; its CUDA lowering (checked on CPU); the dispatch in
``choice.fp8_linear``; a decode step of an FP8 model with the kernel against the step with XLA's
form.

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``pytest -m gpu`` on an sm_90 machine).
"""

from __future__ import annotations

import functools
import re

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


# (m, n, k, config, dtype): one row; 5 rows, one column block a step, programs of 3 steps over 3
# row blocks of 5 (ranges crossing row blocks, a row block over 3 programs, slots left unwritten);
# a full 64-row tile; 17 rows, the last program short; one column block; 40 rows (no padding)
# in float16; 4 column blocks a step, a program per step; 2 blocks a step, a program with more
# steps than stages; 2 blocks a step, a program ending one row block and starting the next; one
# program over 3 one-step row blocks and its short last one; one program longer than all steps
CASES = {
    "m1": (1, 256, 384, None, bf16),
    "m5-ranges-cross-rows": (5, 384, 640, fl.Fp8LinearConfig(2, 1, 3), bf16),
    "m64": (64, 128, 256, None, bf16),
    "m17-short-last": (17, 256, 896, fl.Fp8LinearConfig(3, 1, 3), bf16),
    "m9-one-block": (9, 128, 128, None, bf16),
    "m40-float16": (40, 256, 512, None, jnp.float16),
    "m3-cols4": (3, 256, 1024, fl.Fp8LinearConfig(2, 4, 1), bf16),
    "m24-cols2-3steps": (24, 128, 768, fl.Fp8LinearConfig(2, 2, 3), bf16),
    "m8-cols2-cross-rows": (8, 384, 1024, fl.Fp8LinearConfig(2, 2, 3), bf16),
    "m1-range-over-3-rows": (1, 512, 128, fl.Fp8LinearConfig(2, 1, 3), bf16),
    "m17-range-past-the-end": (17, 256, 384, fl.Fp8LinearConfig(2, 1, 50), jnp.float16),
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


# (m, sizes N_i, k, config): weights of 256, 128 and 384 rows in one launch, one column block a
# step, ranges of 3 steps (ranges crossing from one weight into the next, a weight's one row
# block over several programs); two weights, 2 blocks a step, the library's config
SEVERAL = {
    "m3-three-weights-ranges-cross-weights": (3, (256, 128, 384), 384, fl.Fp8LinearConfig(2, 1, 2)),
    "m9-two-weights": (9, (512, 128), 512, None),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SEVERAL))
def test_several_weights_in_one_launch_against_float64(mode, case):
    """``fp8_linears_pallas``: each weight's product as if computed alone (its scales, its rows),
    each with different random weights and scales."""
    m, sizes, k, config = SEVERAL[case]
    parts = [inputs(20 + i, m, n, k) for i, n in enumerate(sizes)]
    x = parts[0][0]
    weights, scales = [p[1] for p in parts], [p[2] for p in parts]
    got = jax.jit(lambda x, w, s: fl.fp8_linears_pallas(
        x, w, s, config=config, interpret=mode == "interpret"))(x, weights, scales)
    assert [g.shape for g in got] == [(m, n) for n in sizes]
    for i, (g, w8, scale) in enumerate(zip(got, weights, scales)):
        want = reference_f64(x, w8, scale, bf16)
        assert_rel_close(np.asarray(g, np.float32), want, 8e-3, f"{case} weight {i}")


def test_several_weights_errors():
    x = jnp.zeros((2, 256), bf16)
    w, s = jnp.zeros((128, 256), FP8), jnp.ones((1, 2), f32)
    with pytest.raises(ValueError, match="2 weights and 1 scales"):
        fl.fp8_linears_pallas(x, (w, w), (s,))
    with pytest.raises(ValueError, match=r"x \(2, 256\) and weight \(128, 384\)"):
        fl.fp8_linears_pallas(x, (w, jnp.zeros((128, 384), FP8)), (s, jnp.ones((1, 3), f32)))
    with pytest.raises(ValueError, match="does not match"):
        fl.fp8_linears_pallas(x, (w, w), (s, jnp.ones((2, 2), f32)))


@pytest.mark.parametrize("mode", MODES)
def test_an_overflowing_row_block_leaves_the_next_one_in_its_range_finite(mode):
    """A row block whose float32 sums overflow gives inf, as the reference does, and the next row
    block of the same program's range starts again from 0 (a reset by multiplying by 0 would make
    it NaN). One program of 4 steps over 2 row blocks of 2 column blocks."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(np.abs(rng.standard_normal((3, 256))) * 1e10 + 1e9, bf16)
    w8 = jnp.asarray(np.clip(np.abs(rng.standard_normal((256, 256))) * 100 + 1, 1, 448), FP8)
    scale = jnp.asarray([[1e30, 1e30], [1e-28, 3e-28]], f32)
    got = jax.jit(lambda *a: fl.fp8_linear_pallas(
        *a, config=fl.Fp8LinearConfig(2, 1, 4), interpret=mode == "interpret"))(x, w8, scale)
    got = np.asarray(got, np.float32)
    assert np.isposinf(got[:, :128]).all()
    assert np.isposinf(np.asarray(fl.fp8_linear_reference(x, w8, scale), f32)[:, :128]).all()
    assert np.isfinite(got[:, 128:]).all(), "NaN or inf after the overflowing row block"
    want = reference_f64(x, w8, scale, bf16)
    assert_rel_close(got[:, 128:], want[:, 128:], 8e-3, "the row block after the overflow")


def test_reference_is_what_model_linear_computed_for_fp8():
    """The reference is ``dequantize`` to x's dtype then the dot (float32 here: exact)."""
    x, w8, scale = inputs(3, 4, 256, 384, f32)
    want = np.asarray(x, np.float64) @ quantization.dequantize(
        np.asarray(w8), np.asarray(scale), (128, 128), np.float64).T
    assert_rel_close(fl.fp8_linear_reference(x, w8, scale), want, 1e-5, "float32 reference")


@pytest.mark.parametrize("m, n, k, config", [(1, 256, 384, None), (64, 1024, 4096, None),
                                             (16, 12288, 4096, None),
                                             (3, 128, 512, fl.Fp8LinearConfig(4, 2, 1)),
                                             (8, 4096, 12288, None),
                                             (64, 384, 1024, fl.Fp8LinearConfig(2, 2, 3))])
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
    ((1, 0), (128, 0), bf16, "positive multiples of 128"),
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
    for n, k, m in [(12288, 4096, 1), (1024, 4096, 8), (4096, 12288, 64), (17408, 5120, 33),
                    (4096, 1536, 1), (2048, 1536, 5), (17408, 5120, 1), (128, 128, 1)]:
        c = fl.choose_config(n, k, m)
        assert c.cols_per_step in (1, 2, 4) and k // 128 % c.cols_per_step == 0, (n, k, c)
        assert c.num_stages >= 2 and c.num_stages * c.cols_per_step <= 8
        step = c.cols_per_step * (128 * 128 + fl.padded_rows(m) * 256)
        assert c.num_stages * step <= fl.SMEM_BUDGET_BYTES or c.num_stages == 2
        assert fl.smem_bytes(m, c.num_stages, c.cols_per_step) <= fl.SMEM_LIMIT_BYTES
        total = n // 128 * k // 128 // c.cols_per_step
        programs = -(-total // c.steps_per_program)
        assert programs <= 132, (n, k, c)  # one wave
        if n // 128 <= 132:  # split-K: each row block's columns in equal parts of >= 2 blocks
            assert k // 128 // c.cols_per_step % c.steps_per_program == 0 or programs > 66
            assert c.steps_per_program * c.cols_per_step >= 2 or k // 128 < 2, (n, k, c)
        else:  # ranges as even as the steps allow
            assert c.steps_per_program == -(-total // 132), (n, k, c)
    # the 9B's MLP at one row: a program per row block (96), 8 steps of 4 blocks
    assert fl.choose_config(12288, 4096, 1) == fl.Fp8LinearConfig(2, 4, 8)
    assert fl.choose_config(4096, 12288, 1) == fl.Fp8LinearConfig(2, 4, 6)  # 4 parts of 24 blocks
    assert fl.choose_config(4096, 12288, 64).cols_per_step == 2  # two 2-block steps fit
    # 27B's MLP, 136 x 40 blocks: 130 programs of 21 2-block steps (cost 43.7), not 11 4-block
    # ones (44) or 42 1-block ones (47)
    assert fl.choose_config(17408, 5120, 1) == fl.Fp8LinearConfig(4, 2, 21)
    # a width fixed by the caller: the stages and ranges chosen around it (one wave, the stages
    # within the budget)
    for n, k, cols in [(12288, 4096, 1), (4224, 1536, 4), (17408, 5120, 4), (1024, 4096, 4)]:
        c = fl.choose_config(n, k, 1, cols_per_step=cols)
        assert c.cols_per_step == cols and c.num_stages * cols <= 8, (n, k, c)
        assert -(-(n // 128 * k // 128 // cols) // c.steps_per_program) <= 132, (n, k, c)
    # on 100 SMs: 14 4-block steps (56) beat 28 2-block ones (58.2)
    assert fl.choose_config(17408, 5120, 1, num_sms=100) == fl.Fp8LinearConfig(2, 4, 14)


def test_partial_slots():
    """Row blocks of 5 steps, programs of 3: program p holds steps [3p, 3p + 3)."""
    want = np.array([[1, 1, 1], [1, 1, 1], [0, 1, 0]], bool)  # rows 0-2 span 2, 3, 2 programs
    np.testing.assert_array_equal(fl.partial_slots(3, 5, 3), want)
    np.testing.assert_array_equal(fl.partial_slots(4, 2, 2), np.ones((1, 4), bool))
    np.testing.assert_array_equal(fl.partial_slots(1, 4, 1), np.ones((4, 1), bool))


def test_config_overrides_are_checked_before_lowering():
    for bad in (0, -1, 2.0):
        for name in ("num_stages", "cols_per_step", "steps_per_program"):
            with pytest.raises(ValueError, match="must be None or an int >= 1"):
                fl.Fp8LinearConfig(**{name: bad})
    x, w8, scale = inputs(0, 64, 128, 256)
    with pytest.raises(ValueError, match="num_stages=8 x cols_per_step=1 needs .* bytes of shared"):
        fl.fp8_linear_pallas(x, w8, scale, config=fl.Fp8LinearConfig(8, 1))
    # the width alone: the stages chosen for it (2, not the 8 of 1-block steps)
    specs = [jax.ShapeDtypeStruct((1, 1536), bf16), jax.ShapeDtypeStruct((4224, 1536), FP8),
             jax.ShapeDtypeStruct((33, 12), f32)]
    assert "mosaic_gpu" in lower_for_cuda_text(
        lambda *a: fl.fp8_linear_pallas(*a, config=fl.Fp8LinearConfig(cols_per_step=4)), *specs)
    x, w8, scale = inputs(0, 1, 128, 768)  # 6 column blocks: 4 a step would leave 2 over
    with pytest.raises(ValueError, match="cols_per_step=4 must divide the 6 column blocks"):
        fl.fp8_linear_pallas(x, w8, scale, config=fl.Fp8LinearConfig(2, 4))


def test_kernels_refuse_fp8_pallas_where_it_does_not_run():
    with pytest.raises(ValueError, match="fp8_linear"):
        choice.Kernels(fp8_linear="pallas", batch_invariant=True)
    with pytest.raises(ValueError, match="fp8_linear"):
        choice.Kernels(fp8_linear="mosaic")


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


def test_choice_runs_the_linears_it_takes_in_one_launch():
    """``choice.fp8_linears``: the weights the kernel takes in one Mosaic GPU call (lowered for
    CUDA), a weight it does not take (200 rows) in XLA's form beside it; the values of one
    ``fp8_linear`` each in XLA's form (the kernel in the interpreter)."""
    k = choice.Kernels(fp8_linear="pallas", interpret=False)
    shapes = [(256, 384), (128, 384), (200, 384)]
    specs = [s for n in shapes for s in (jax.ShapeDtypeStruct(n, FP8), jax.ShapeDtypeStruct(
        quantization.scale_shape(n, (128, 128)), f32))]

    def call(x, *a):
        return choice.fp8_linears(k, x, [jd.Fp8Linear(a[i], a[i + 1])
                                         for i in range(0, len(a), 2)])
    text = lower_for_cuda_text(call, jax.ShapeDtypeStruct((2, 384), bf16), *specs)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1, text[-2000:]
    assert text.count("stablehlo.dot_general") == 1
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 384)), bf16)
    ws = [jd.Fp8Linear(*quantization.quantize(rng.standard_normal(n).astype(np.float32)))
          for n in shapes]
    interpret = choice.Kernels(fp8_linear="pallas", interpret=True)
    got = jax.jit(lambda x, ws: choice.fp8_linears(interpret, x, ws))(x, ws)
    for i, (g, w) in enumerate(zip(got, ws)):  # (the kernel's sum order: one bf16 rounding)
        assert_rel_close(np.asarray(g, f32), np.asarray(choice.fp8_linear(choice.XLA, x, w), f32),
                         8e-3, f"weight {i}")


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


def test_gradient_through_several_linears_in_one_launch_equals_xla_form():
    """Reverse mode through ``choice.fp8_linears`` of two weights in one kernel launch
    (interpreter): x's gradient, the sum over both products, as XLA's form gives it."""
    x, w8, scale = inputs(8, 3, 256, 384)
    _, w8b, scaleb = inputs(9, 3, 128, 384)
    ws = (jd.Fp8Linear(w8, scale), jd.Fp8Linear(w8b, scaleb))

    def loss(x, kernels):
        ys = choice.fp8_linears(kernels, x, ws)
        return sum((y.astype(f32) * jnp.arange(y.size, dtype=f32).reshape(y.shape) / (i + 1)).sum()
                   for i, y in enumerate(ys)) / 1e3

    gx = jax.grad(loss)(x, choice.Kernels(fp8_linear="pallas", interpret=True))
    want = jax.grad(loss)(x, choice.XLA)
    assert_rel_close(np.asarray(gx, np.float32), np.asarray(want, np.float32), 1e-2,
                     "x's gradient")
