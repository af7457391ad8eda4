"""jaxdecode.kernels.deltanet_decode: the one-kernel Gated DeltaNet decode core against a float64
numpy version of the whole core (conftest.numpy_core), whole decode steps with it against XLA's,
and its CUDA lowering at the published shapes with the state and ring updated in place (checked
on CPU).

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI; slow); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). The XLA reference is the model's own decode
math (test_model.py checks it against the model's one-token prefill).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import (CORE_ARG_NAMES, MODES, assert_inactive_rows_untouched, assert_rel_close,
                      lower_for_cuda_text, numpy_core, random_core_inputs, tiny)
from jaxdecode.kernels import choice
from jaxdecode.kernels import deltanet_decode as dnd
from jaxdecode.kernels.deltanet_decode import deltanet_decode_pallas, deltanet_decode_reference

f32, bf16 = jnp.float32, jnp.bfloat16


def run_pallas(mode, args, hk, block_v=None):
    fn = jax.jit(lambda *x: deltanet_decode_pallas(*x, num_key_heads=hk, block_v=block_v,
                                                   interpret=mode == "interpret"))
    return fn(*args)


CASES = {
    # name: (batch, Hk, Hv, dk, dv, Kc, block_v, active rows)
    "gqa-r2-16-cols": (2, 2, 4, 128, 128, 4, 16, [True, False]),
    "gqa-r2-64-cols": (3, 2, 4, 128, 128, 4, 64, [False, True, True]),
    "r1-whole-v": (2, 2, 2, 128, 128, 4, 128, [True, True]),
    "dk64-dv192-r3": (2, 1, 3, 64, 192, 4, 32, [True, False]),
    "dv-lt-dk-kc2": (1, 1, 2, 128, 64, 2, 8, [True]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_core(mode, case):
    batch, hk, hv, dk, dv, kc, block_v, active = CASES[case]
    args = random_core_inputs(sorted(CASES).index(case), batch, hk, hv, dk, dv, kc, active)
    o, new_conv, new_state = run_pallas(mode, args, hk, block_v)
    want_o, want_conv, want_state = numpy_core(*args, num_key_heads=hk)
    assert o.dtype == f32 and new_state.dtype == f32 and new_conv.dtype == args[5].dtype
    assert_rel_close(o, want_o, 2e-5, "o")
    assert_rel_close(new_state, want_state, 2e-5, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(new_conv), want_conv)  # a copy: exact
    assert_inactive_rows_untouched(args, o, new_conv, new_state)
    # and the XLA form (what choose_kernels falls back to) agrees with both
    ref = deltanet_decode_reference(*args, num_key_heads=hk)
    assert_rel_close(o, ref[0], 2e-5, "o vs reference")
    assert_rel_close(new_state, ref[2], 2e-5, "state vs reference")


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_model_matches_reference(mode):
    """bf16 activations, conv window, conv weight and dt_bias (A_log float32), as the published
    checkpoints. The kernel rounds where the reference does (silu output; the sigmoid in float32
    rounded once to bf16), so in the interpreter it agrees to float32 rounding; compiled, FMA
    contraction in the conv can flip a bf16 rounding of q, k or v, hence the looser GPU bound.
    The reference runs jitted, as the model does."""
    args = random_core_inputs(20, 3, 2, 4, 128, 128, 4, [True, False, True], dtype=bf16)
    # in 4 of the 8 active (row, head) pairs eager JAX's op-by-op bf16 sigmoid differs from
    # the once-rounded one: a kernel that rounds op by op fails here
    b = args[2][np.asarray(args[3])]
    assert (jax.nn.sigmoid(b) != jax.nn.sigmoid(b.astype(f32)).astype(bf16)).sum() == 4
    o, new_conv, new_state = run_pallas(mode, args, 2, block_v=32)
    want_o, want_conv, want_state = jax.jit(
        lambda *x: deltanet_decode_reference(*x, num_key_heads=2))(*args)
    assert new_conv.dtype == bf16
    rel = 1e-5 if mode == "interpret" else 1e-2
    assert_rel_close(o, want_o, rel, "o")
    assert_rel_close(new_state, want_state, rel, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))
    assert_inactive_rows_untouched(args, o, new_conv, new_state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_v", [8, 16, 64])
def test_every_conv_channel_written(mode, block_v):
    """Each channel of the ring's new slot comes from exactly one program (v channels by their
    column block, q and k channels by the first program of their key head): with random old
    rings, any channel a program missed would keep its old value, and one written twice or
    into another slot would break a slot some window reads."""
    args = random_core_inputs(block_v, 2, 2, 4, 64, 64, 4, [True, False], dtype=bf16)
    _, new_conv, _ = run_pallas(mode, args, 2, block_v)
    _, want_conv, _ = deltanet_decode_reference(*args, num_key_heads=2)
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))


# ----- whole decode steps with the kernel -----------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_model_decode_with_the_kernel_equals_the_reference(mode):
    """Whole decode steps (float32) with Kernels(deltanet="pallas") (the kernel; the interpreter
    on CPU; on a GPU choose_kernels' choice, which is the kernel at batch 2) against
    kernels=XLA: logits and every DeltaNet state, with an inactive row."""
    config = tiny(vocab_size=1000, linear_key_head_dim=128, linear_value_head_dim=128)
    params = jd.init_params(config, jax.random.key(3))
    prompt = np.random.default_rng(11).integers(0, config.vocab_size, (2, 7)).astype(np.int32)
    active = [np.array([True, True]), np.array([True, False]), np.array([True, True])]

    def run(kernels):
        state = jd.init_state(config, batch_size=2, max_len=64)
        logits, state = jd.prefill(params, state, prompt, np.array([7, 4], np.int32))
        out = []
        for act in active:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, state = jd.decode_step(params, state, token, jnp.asarray(act),
                                           kernels=kernels)
            out.append(np.asarray(logits))
        return np.stack(out), state

    want_logits, want_state = run(choice.XLA)
    if mode == "gpu":
        assert jd.choose_kernels(config, 2, dtype="float32").deltanet == "pallas"
    got_logits, got_state = run(choice.Kernels(deltanet="pallas") if mode == "interpret"
                                else None)
    assert_rel_close(got_logits, want_logits, 1e-4, "logits")
    for i, (g, w) in enumerate(zip(got_state.recurrent_state, want_state.recurrent_state)):
        assert_rel_close(g, w, 1e-4, f"recurrent_state[{i}]")
    for i, (g, w) in enumerate(zip(got_state.conv_state, want_state.conv_state)):
        assert_rel_close(g, w, 1e-5, f"conv_state[{i}]")


# ----- errors --------------------------------------------------------------------------------

def test_bad_inputs_raise_before_any_work():
    args = random_core_inputs(1, 2, 2, 4, 128, 128, 4, [True, False])

    def with_(name, value):
        return [value if n == name else x for n, x in zip(CORE_ARG_NAMES, args, strict=True)]

    with pytest.raises(ValueError, match=r"shapes.*mixed_qkv.*\(2, 1023\).*\(2, 1024\)"):
        deltanet_decode_pallas(*with_("mixed_qkv", args[0][:, 1:]), num_key_heads=2)
    with pytest.raises(ValueError, match=r"shapes.*conv_state"):
        deltanet_decode_pallas(*with_("conv_state", args[5][:, 1:]), num_key_heads=2)
    with pytest.raises(ValueError, match=r"shapes.*positions"):
        deltanet_decode_pallas(*with_("positions", args[4][:1]), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*positions"):
        deltanet_decode_reference(*with_("positions", args[4].astype(f32)), num_key_heads=2)
    with pytest.raises(ValueError, match="shapes.*active"):
        deltanet_decode_reference(*with_("active", args[3][:1]), num_key_heads=2)
    with pytest.raises(ValueError, match="4 value heads are not a multiple of 3 key heads"):
        deltanet_decode_pallas(*args, num_key_heads=3)
    with pytest.raises(ValueError, match="dtypes.*mixed_qkv"):
        deltanet_decode_pallas(*with_("mixed_qkv", args[0].astype(bf16)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*recurrent_state"):
        deltanet_decode_pallas(*with_("recurrent_state", args[6].astype(bf16)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*active"):
        deltanet_decode_pallas(*with_("active", args[3].astype(jnp.int32)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*A_log"):
        deltanet_decode_pallas(*with_("A_log", args[8].astype(jnp.float16)), num_key_heads=2)
    with pytest.raises(ValueError, match="block_v"):
        deltanet_decode_pallas(*args, num_key_heads=2, block_v=48)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        deltanet_decode_pallas(*random_core_inputs(1, 1, 1, 1, 32, 64, 4, [True]),
                               num_key_heads=1)
    with pytest.raises(ValueError, match="at least 2"):
        deltanet_decode_pallas(*random_core_inputs(1, 1, 1, 1, 64, 64, 1, [True]),
                               num_key_heads=1)


def test_reference_takes_any_head_dims_and_kc_1():
    args = random_core_inputs(2, 2, 2, 4, 16, 24, 1, [True, False])
    o, new_conv, new_state = deltanet_decode_reference(*args, num_key_heads=2)
    want = numpy_core(*args, num_key_heads=2)
    assert new_conv.shape == (2, 1, args[0].shape[1])
    np.testing.assert_array_equal(np.asarray(new_conv), want[1])
    assert_rel_close(o, want[0], 2e-5, "o")
    assert_rel_close(new_state, want[2], 2e-5, "recurrent_state")


def test_empty_batch():
    args = random_core_inputs(0, 0, 1, 2, 64, 64, 4, np.zeros(0, bool))
    o, new_conv, new_state = deltanet_decode_pallas(*args, num_key_heads=1, interpret=True)
    assert o.shape == (0, 2, 64) and new_conv.shape == args[5].shape
    assert new_state.shape == args[6].shape


def test_check_supported():
    """What choose_kernels asks before picking the kernel (shapes per device, the model dtype)."""
    assert dnd.check_supported((1, 32, 128, 128), 4, bf16) is None
    assert dnd.check_supported((1, 32, 128, 128), 4, f32) is None
    assert "model dtype float16" in dnd.check_supported((1, 32, 128, 128), 4, jnp.float16)
    assert "not a multiple of 64" in dnd.check_supported((1, 2, 32, 48), 4, bf16)
    assert "at least 2" in dnd.check_supported((1, 2, 64, 64), 1, bf16)


# ----- the CUDA lowering, on CPU ---------------------------------------------------------------

def deltanet_shapes(batch, key_heads, heads, dk, dv, kc, dtype):
    """The decode core's arguments at a published shape: activations, conv window, conv weight
    and dt_bias in the model dtype, A_log float32 (as the checkpoints)."""
    channels = key_heads * (2 * dk + heads // key_heads * dv)
    return (((batch, channels), dtype), ((batch, heads), dtype), ((batch, heads), dtype),
            ((batch,), jnp.bool_), ((batch,), jnp.int32), ((batch, kc, channels), dtype),
            ((batch, heads, dk, dv), f32), ((channels, kc), dtype), ((heads,), f32),
            ((heads,), dtype))


DELTANET_MODELS = {  # (Hk, Hv, dk, dv, Kc): C = 6144, 8192, 10240
    "qwen3.5-0.8b": (16, 16, 128, 128, 4),
    "qwen3.5-9b": (16, 32, 128, 128, 4),
    "qwen3.5-27b": (16, 48, 128, 128, 4),
}


@pytest.mark.perf
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("model", DELTANET_MODELS)
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_deltanet_decode_lowers_and_updates_the_state_in_place(model, batch, dtype):
    key_heads, heads, dk, dv, kc = DELTANET_MODELS[model]
    text = lower_for_cuda_text(
        lambda *args: deltanet_decode_pallas(*args, num_key_heads=key_heads),
        *deltanet_shapes(batch, key_heads, heads, dk, dv, kc, dtype), donate_argnums=(5, 6))
    call = re.search(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert call, text[-3000:]
    operands = [x.strip() for x in call.group(1).split(",")]
    aliases = dict(re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", text))
    # the kernel writes the state (the function's argument 6) and the conv ring (argument 5)
    # in place ...
    assert operands[int(aliases["2"])] == "%arg6", (operands, aliases)
    assert operands[int(aliases["1"])] == "%arg5", (operands, aliases)
    # ... and the donated arguments are aliased to the function's outputs
    assert re.search(r"%arg6: tensor<[^>]*> \{[^}]*tf\.aliasing_output = 2", text), text[:3000]
    assert re.search(r"%arg5: tensor<[^>]*> \{[^}]*tf\.aliasing_output = 1", text), text[:3000]


@pytest.mark.parametrize("batch,key_heads,heads,dk,dv,block_v", [
    (2, 1, 3, 64, 192, 64), (2, 2, 2, 128, 128, 128), (1, 1, 2, 128, 64, 8),
    (1, 1, 2, 256, 128, 16)])
def test_deltanet_decode_lowers_at_other_shapes(batch, key_heads, heads, dk, dv, block_v):
    lower_for_cuda_text(
        lambda *args: deltanet_decode_pallas(*args, num_key_heads=key_heads, block_v=block_v),
        *deltanet_shapes(batch, key_heads, heads, dk, dv, 4, f32), donate_argnums=(5, 6))


@pytest.mark.perf
def test_kernel_uses_programmatic_dependent_launch():
    """The kernel starts with jaxdecode.kernels.wait_for_inputs: its custom call carries
    mosaic_gpu.uses_pdl (see test_kernels_decode_attention.py)."""
    text = lower_for_cuda_text(lambda *args: deltanet_decode_pallas(*args, num_key_heads=16),
                               *deltanet_shapes(1, 16, 32, 128, 128, 4, bf16))
    assert re.search(r"custom_call @mosaic_gpu", text), text[-3000:]
    assert "mosaic_gpu.uses_pdl" in text
