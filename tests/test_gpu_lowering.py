"""The Pallas Mosaic GPU kernels lower for CUDA, checked on CPU (no GPU needed).

JAX lowers a function for another platform without that platform's devices
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``), and for a Mosaic GPU kernel that
runs the whole Pallas -> Mosaic GPU translation (register layouts, reductions, copies, shared
memory sizes). A kernel that uses an op or layout Mosaic GPU cannot lower fails here, in CI,
before it reaches a GPU. Not covered: PTX compilation, register spills, speed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxdecode.kernels.decode_attention import decode_attention_pallas
from jaxdecode.kernels.deltanet_decode import deltanet_decode_pallas
from jaxdecode.kernels.gated_delta_decode import gated_delta_decode_pallas

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def lower_for_cuda(fn, *shapes, donate_argnums=()):
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn, donate_argnums=donate_argnums).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()


def delta_rule_shapes(batch, key_heads, heads, dk, dv):
    return (((batch, key_heads, dk), f32), ((batch, key_heads, dk), f32),
            ((batch, heads, dv), f32), ((batch, heads), f32), ((batch, heads), f32),
            ((batch, heads, dk, dv), f32))


@pytest.mark.parametrize("batch,key_heads,heads,dv,block_v", [
    (1, 16, 16, 128, 16), (1, 16, 32, 128, 32), (64, 16, 32, 128, 64), (64, 32, 32, 128, 128),
    (2, 1, 3, 192, 64)])
def test_gated_delta_decode_lowers_and_updates_the_state_in_place(batch, key_heads, heads, dv,
                                                                 block_v):
    text = lower_for_cuda(
        lambda q, k, v, g, b, s: gated_delta_decode_pallas(q, k, v, g, b, s, block_v=block_v),
        *delta_rule_shapes(batch, key_heads, heads, 128, dv), donate_argnums=5)
    # the kernel call writes its state operand in place (output aliased to that operand) ...
    assert re.search(r"output_operand_alias<output_tuple_indices = \[1\]", text), text[-3000:]
    # ... and the donated state argument is aliased to the function's state output
    assert re.search(r"%arg5: tensor<[^>]*> \{[^}]*tf\.aliasing_output = 1", text), text[:3000]


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


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("model", DELTANET_MODELS)
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_deltanet_decode_lowers_and_updates_the_state_in_place(model, batch, dtype):
    key_heads, heads, dk, dv, kc = DELTANET_MODELS[model]
    text = lower_for_cuda(
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
    lower_for_cuda(
        lambda *args: deltanet_decode_pallas(*args, num_key_heads=key_heads, block_v=block_v),
        *deltanet_shapes(batch, key_heads, heads, dk, dv, 4, f32), donate_argnums=(5, 6))


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [(16, 4, 256, bf16), (16, 2, 256, bf16),
                                                           (8, 8, 128, f32)])
def test_decode_attention_lowers(heads, kv_heads, head_dim, dtype):
    lower_for_cuda(decode_attention_pallas, ((2, heads, head_dim), dtype),
                   ((2, kv_heads, 1024, head_dim), dtype), ((2, kv_heads, 1024, head_dim), dtype),
                   ((2,), i32))


def test_a_kernel_mosaic_gpu_cannot_lower_fails_here():
    """The check is not vacuous: a transposed register tile (no Mosaic GPU lowering) raises."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_gmem, o_gmem, o_smem):
        x = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        o_smem[...] = x.T
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), f32),
                          scratch_types=(plgpu.SMEM((128, 128), f32),), grid=(1,),
                          grid_names=("g",))
    with pytest.raises(Exception):
        lower_for_cuda(kernel, ((128, 128), f32))


@pytest.mark.parametrize("kernel", ["decode_attention", "decode_attention_f32",
                                    "gated_delta_decode", "deltanet_decode"])
def test_kernels_use_programmatic_dependent_launch(kernel):
    """Every kernel starts with jaxdecode.kernels.wait_for_inputs, which marks it for
    programmatic dependent launch: the custom call carries mosaic_gpu.uses_pdl. (The attribute
    says the kernel waits for its inputs (griddepcontrol.wait); whether it also lets the next
    kernel launch early is not visible at this level.)"""
    if kernel.startswith("decode_attention"):
        dtype = f32 if kernel.endswith("f32") else bf16
        text = lower_for_cuda(decode_attention_pallas, ((1, 16, 256), dtype),
                              ((1, 4, 1280, 256), dtype), ((1, 4, 1280, 256), dtype),
                              ((1,), jnp.int32))
    elif kernel == "gated_delta_decode":
        text = lower_for_cuda(gated_delta_decode_pallas, *delta_rule_shapes(8, 16, 32, 128, 128))
    else:
        text = lower_for_cuda(lambda *args: deltanet_decode_pallas(*args, num_key_heads=16),
                              *deltanet_shapes(1, 16, 32, 128, 128, 4, bf16))
    assert re.search(r"custom_call @mosaic_gpu", text), text[-3000:]
    assert "mosaic_gpu.uses_pdl" in text
