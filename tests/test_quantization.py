"""Block-FP8 weights: the (de)quantisation against float64 numpy, the model with FP8 Linears
against the model with their dequantised weights, and FP8 checkpoints (spec §9)."""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import FULL, LIN, assert_logits_close, hf_text_config, random_prompt, tiny
from jaxdecode import memory, quantization
from jaxdecode.params import params_to_hf
import jaxdecode as jd

FP8 = ml_dtypes.float8_e4m3fn
# DeltaNet head dims of 128 (as every published config): the FP8 blocks of in_proj_qkv stay
# whole when its rows are regrouped per key head.
CONFIG = tiny(vocab_size=300, hidden_size=96, intermediate_size=200, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
              layer_types=(LIN, FULL, LIN, FULL))


def _random_fp8(rng, shape):
    """Random finite float8_e4m3fn values of every magnitude, subnormals and zeros included."""
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # 0x7F / 0xFF are NaN in e4m3fn
    return bits.view(FP8)


@pytest.mark.parametrize("shape,block", [((130, 200), (128, 128)), ((7, 300), (128, 128)),
                                          ((257, 129), (64, 32))])
def test_dequantize_is_exact_against_float64(shape, block):
    rng = np.random.default_rng(0)
    w8 = _random_fp8(rng, shape)
    scale = rng.uniform(1e-4, 2.0, quantization.scale_shape(shape, block)).astype(
        ml_dtypes.bfloat16)
    want = np.empty(shape, np.float64)
    for i in range(shape[0]):
        for j in range(shape[1]):
            want[i, j] = float(w8[i, j]) * float(scale[i // block[0], j // block[1]])
    np.testing.assert_array_equal(quantization.dequantize(w8, scale, block), want)
    got = quantization.dequantize(jnp.asarray(w8), jnp.asarray(scale), block, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("shape", [(130, 200), (5, 3), (256, 384)])
def test_quantize_round_trip_error_is_one_fp8_rounding(shape):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, (shape[0], 1))
    w[:2, :3] = 0.0  # zeros stay zeros
    w8, scale = quantization.quantize(w)
    assert w8.dtype == FP8 and scale.dtype == np.float32
    assert scale.shape == quantization.scale_shape(shape, (128, 128))
    back = quantization.dequantize(w8, scale).astype(np.float64)
    s = np.repeat(np.repeat(scale, 128, 0)[:shape[0]], 128, 1)[:, :shape[1]].astype(np.float64)
    # e4m3: 3 mantissa bits, so half an ulp is 2^-4 of the value; subnormals: 2^-10 of the scale
    bound = np.maximum(np.abs(w) * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)
    assert (np.abs(back - w) <= bound).all()
    assert (back[:2, :3] == 0).all()
    # each block's largest magnitude is 448 after scaling: the full e4m3 range is used
    amax = np.abs(w8.astype(np.float32)).max()
    assert amax == 448.0
    jw8, jscale = quantization.quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jscale), scale)
    np.testing.assert_array_equal(np.asarray(jw8).view(np.uint8), w8.view(np.uint8))
    z8, zscale = quantization.quantize(np.zeros((3, 4), np.float32))
    assert (zscale == 1).all() and (z8.astype(np.float32) == 0).all()


def _dequantized(params):
    """params with every Fp8Linear replaced by its float32 dequantised weight."""
    return jax.tree.map(lambda x: x.dequantize(jnp.float32) if isinstance(x, jd.Fp8Linear)
                        else x, params, is_leaf=lambda x: isinstance(x, jd.Fp8Linear))


def _run(params, tokens, num_new, steps=3):
    state = jd.init_state(params.config, tokens.shape[0], 64, dtype=params.dtype)
    logits, state = jd.prefill(params, state, tokens, num_new)
    out = [np.asarray(logits)]
    for _ in range(steps):
        logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1).astype(jnp.int32))
        out.append(np.asarray(logits))
    return np.stack(out)


def test_fp8_model_equals_the_model_with_dequantised_weights():
    """float32: dequantising is exact, so the FP8 model is the dense model of the dequantised
    weights (which tests/test_model.py checks against HF); the quantised leaves are FP8."""
    params = jd.quantize_fp8(jd.init_params(CONFIG, jax.random.key(0)))
    lin, full = params.layers[0], params.layers[1]
    for w in (lin.linear_attn.in_proj_qkv, lin.linear_attn.out_proj, full.self_attn.q_proj,
              full.mlp.down_proj):
        assert isinstance(w, jd.Fp8Linear) and w.weight.dtype == FP8
    assert not isinstance(lin.linear_attn.in_proj_a, jd.Fp8Linear)
    assert jd.num_params(params) == jd.num_params(jd.init_params(CONFIG, jax.random.key(0)))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CONFIG.vocab_size, (3, 11)).astype(np.int32)
    num_new = np.array([11, 4, 1], np.int32)
    got, want = _run(params, tokens, num_new), _run(_dequantized(params), tokens, num_new)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # and near the unquantised model: one e4m3 rounding per weight (a scale ignored or applied
    # to the wrong block would be off by orders of magnitude)
    dense = _run(jd.init_params(CONFIG, jax.random.key(0)), tokens, num_new, steps=0)[0]
    err = np.abs(got[0] - dense).max() / np.abs(dense).max()  # prefill: the same tokens
    assert 1e-4 < err < 0.1, err
    with pytest.raises(ValueError, match="dequantise them first"):
        params_to_hf(params)
    # FP8 weights are frozen: no gradient into them, the rest of the model's still flows
    grads = jax.grad(lambda p: jd.model.linear(jnp.ones((2, 128)), p.layers[1].self_attn.o_proj
                                               ).sum() + p.norm.sum())(params)
    assert not np.asarray(grads.layers[1].self_attn.o_proj.scale_inv).any()
    assert np.asarray(grads.norm).all()
    # the README's optimizer for FP8 params: the Fp8Linear leaves set to zero, the rest trained
    import optax
    labels = jax.tree.map(lambda x: "frozen" if isinstance(x, jd.Fp8Linear) else "train",
                          params, is_leaf=lambda x: isinstance(x, jd.Fp8Linear))
    opt = optax.multi_transform({"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()},
                                labels)
    updates, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
    new = optax.apply_updates(params, updates)
    o_proj = new.layers[1].self_attn.o_proj
    assert o_proj.weight.dtype == FP8 and np.array_equal(
        np.asarray(o_proj.weight, np.float32),
        np.asarray(params.layers[1].self_attn.o_proj.weight, np.float32))
    assert np.abs(np.asarray(new.norm) - np.asarray(params.norm)).min() > 0


def _save(path, tensors: dict):
    """A safetensors file of float32 / bfloat16 / float8_e4m3fn (/ uint8) numpy arrays, written from the
    format's spec (8-byte header size, JSON header, data), since safetensors' numpy writer has
    no float8."""
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(FP8): "F8_E4M3", np.dtype(np.uint8): "U8"}
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        data = np.ascontiguousarray(x).tobytes()
        header[name] = {"dtype": codes[x.dtype], "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _split_experts(hf: dict, config) -> dict:
    """The fused 3-D expert tensors of ``hf`` as the FP8 MoE releases store them: per expert,
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (spec §9)."""
    out, ie = {}, config.moe_intermediate_size
    for name, w in hf.items():
        prefix = name.rpartition("experts.")[0] + "experts."
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(config.num_experts):
                out[f"{prefix}{e}.gate_proj.weight"] = w[e, :ie]
                out[f"{prefix}{e}.up_proj.weight"] = w[e, ie:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(config.num_experts):
                out[f"{prefix}{e}.down_proj.weight"] = w[e]
        else:
            out[name] = w
    return out


# Stored as FP8 by the releases besides quantization.QUANTIZED_LEAVES: the routed experts (per
# expert) and Qwen3-Next's fused in_proj_qkvz.
_RELEASE_FP8 = re.compile(r"(mlp\.experts\.\d+\.(gate|up|down)_proj|in_proj_qkvz)\.weight$")


def _write_fp8_checkpoint(path, params, *, scale_dtype=ml_dtypes.bfloat16, change=None,
                          block=quantization.DEFAULT_BLOCK, drop=()):
    """An FP8 release's layout from float32 params: the quantised Linears (the routed experts
    per expert, Qwen3-Next's in_proj_qkvz) as F8_E4M3 + a weight_scale_inv (``scale_dtype``) in
    ``block`` blocks, the rest float32; also the dequantised checkpoint beside it (path /
    "dequantised"). ``change``: {name: array} replacing stored tensors; ``drop``: names left out."""
    hf = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    hf = _split_experts(hf, params.config)
    fp8, dense = {}, {}
    for name, w in hf.items():
        if quantization.is_quantized_leaf(name) or _RELEASE_FP8.search(name):
            w8, scale = quantization.quantize(w, block)
            scale = scale.astype(scale_dtype)
            fp8[name], fp8[name + "_scale_inv"] = w8, scale
            dense[name] = quantization.dequantize(w8, scale, block)
        else:
            fp8[name] = dense[name] = w
    fp8.update(change or {})
    fp8 = {name: w for name, w in fp8.items() if name not in drop}
    config = params.config.to_hf_config()
    for where, tensors, extra in ((path, fp8, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}}), (path / "dequantised", dense, {})):
        where.mkdir(parents=True, exist_ok=True)
        (where / "config.json").write_text(json.dumps({**config, **extra}))
        _save(where / "model.safetensors", tensors)
    return path


def test_fp8_checkpoint_loads_as_published_and_matches_its_dequantised_weights(tmp_path):
    params = jd.init_params(CONFIG, jax.random.key(3))
    path = _write_fp8_checkpoint(tmp_path / "fp8", params)
    loaded = jd.load_checkpoint(path, dtype="float32")
    dense = jd.load_checkpoint(path / "dequantised", dtype="float32")
    w = loaded.layers[0].linear_attn.in_proj_qkv
    assert isinstance(w, jd.Fp8Linear) and w.scale_inv.dtype == np.float32
    # the regrouped rows (params.conv_channel_order) and their scales moved together
    np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.float32)),
                                  np.asarray(dense.layers[0].linear_attn.in_proj_qkv))
    assert not isinstance(loaded.layers[0].linear_attn.in_proj_b, jd.Fp8Linear)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 9)).astype(np.int32)
    num_new = np.array([9, 5], np.int32)
    got, want = _run(loaded, tokens, num_new), _run(dense, tokens, num_new)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    bf16 = jd.load_checkpoint(path, dtype="bfloat16")
    assert bf16.dtype == np.dtype("bfloat16")
    assert bf16.layers[1].self_attn.o_proj.weight.dtype == FP8


def test_fp8_checkpoint_problems_name_the_tensor_and_both_shapes(tmp_path):
    params = jd.init_params(CONFIG, jax.random.key(3))
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = _write_fp8_checkpoint(tmp_path / "bad", params, change={
        name + "_scale_inv": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match=rf"{name}_scale_inv has shape \(2, 2\), but its "
                                         rf"weight {name} as stored, \(96, 128\) in blocks "
                                         r"\[128, 128\], needs \(1, 1\)"):
        jd.load_checkpoint(bad, dtype="float32")
    hf = params_to_hf(params)
    w8, _ = quantization.quantize(np.asarray(hf[name], np.float32))
    missing = tmp_path / "missing"
    _write_fp8_checkpoint(missing, params)
    tensors = {}
    from safetensors import safe_open
    with safe_open(str(missing / "model.safetensors"), "np") as f:
        for key in f.keys():
            if key != name + "_scale_inv" and not quantization.is_quantized_leaf(key):
                tensors[key] = f.get_tensor(key)
    tensors[name] = w8
    _save(missing / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=rf"missing tensor {name}_scale_inv"):
        jd.load_checkpoint(missing, dtype="float32")
    w8, scale = quantization.quantize(np.asarray(hf[name], np.float32))
    f8_scale = _write_fp8_checkpoint(tmp_path / "f8_scale", params, change={
        name + "_scale_inv": scale.astype(FP8)})
    with pytest.raises(ValueError, match=rf"{name}_scale_inv has dtype F8_E4M3; block scales"):
        jd.load_checkpoint(f8_scale, dtype="float32")
    u8_scale = _write_fp8_checkpoint(tmp_path / "u8_scale", params, change={
        name + "_scale_inv": np.ones((1, 1), np.uint8)})
    with pytest.raises(ValueError, match=rf"{name}_scale_inv has dtype U8, expected a float "
                                         r"type \('F32', 'BF16', 'F16', 'F64'\)"):
        jd.load_checkpoint(u8_scale, dtype="float32")
    # a scale whose weight is absent, and one beside a float32 weight: each said as it is
    for case, change in (("absent", None), ("float", hf[name])):
        where = _write_fp8_checkpoint(
            tmp_path / case, params, drop=(name,) if change is None else (),
            change=None if change is None else {name: np.asarray(change, np.float32)})
        with pytest.raises(ValueError) as e:
            jd.load_checkpoint(where, dtype="float32")
        if change is None:
            assert f"unexpected tensor {name}_scale_inv with shape (1, 1) (no weight " in str(e.value)
            assert f"missing tensor {name}" in str(e.value)
        else:
            assert (f"unexpected tensor {name}_scale_inv with shape (1, 1) (its weight {name} is "
                    "stored as F32, not F8_E4M3)") in str(e.value)


def test_fp8_tensor_of_an_unquantised_leaf_is_dequantised_at_load(tmp_path):
    params = jd.init_params(CONFIG, jax.random.key(6))
    name = "model.layers.0.linear_attn.in_proj_a.weight"
    w8, scale = quantization.quantize(np.asarray(params_to_hf(params)[name], np.float32))
    path = _write_fp8_checkpoint(tmp_path / "a", params, change={name: w8,
                                                                  name + "_scale_inv": scale})
    loaded = jd.load_checkpoint(path, dtype="float32")
    got = loaded.layers[0].linear_attn.in_proj_a
    assert not isinstance(got, jd.Fp8Linear) and got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got), quantization.dequantize(w8, scale))


def test_fp8_in_proj_qkv_whose_blocks_regrouping_splits_is_dequantised(tmp_path):
    """DeltaNet head dims 16 / 24: regrouping in_proj_qkv's rows per key head splits its 128-row
    blocks, so it loads dequantised (as Qwen3-Next's fused in_proj_qkvz does), its values the
    dequantised checkpoint's; the other Linears stay FP8; the logits are the dequantised
    checkpoint's."""
    small = tiny(vocab_size=300)
    path = _write_fp8_checkpoint(tmp_path / "split", jd.init_params(small, jax.random.key(0)))
    loaded = jd.load_checkpoint(path, dtype="float32")
    dense = jd.load_checkpoint(path / "dequantised", dtype="float32")
    got, want = loaded.layers[0].linear_attn, dense.layers[0].linear_attn
    assert not isinstance(got.in_proj_qkv, jd.Fp8Linear)
    np.testing.assert_array_equal(np.asarray(got.in_proj_qkv), np.asarray(want.in_proj_qkv))
    assert isinstance(got.out_proj, jd.Fp8Linear)
    np.testing.assert_array_equal(np.asarray(got.out_proj.dequantize(jnp.float32)),
                                  np.asarray(want.out_proj))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, small.vocab_size, (2, 6)),
                         jnp.int32)
    logits = [jd.prefill(p, jd.init_state(small, 2, 16, dtype=p.dtype), tokens,
                         jnp.array([6, 4]))[0]
              for p in (loaded, dense)]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), rtol=0,
                               atol=1e-6 * np.abs(np.asarray(logits[1])).max())


def test_fp8_checkpoint_with_other_quantisation_is_refused(tmp_path):
    small = tiny(vocab_size=300)
    path = _write_fp8_checkpoint(tmp_path / "split", jd.init_params(small, jax.random.key(0)))
    config = json.loads((path / "config.json").read_text())
    for q in ({"quant_method": "gptq", "bits": 4},
              {"quant_method": "fp8", "weight_block_size": [128, 0]},
              {"quant_method": "fp8", "weight_block_size": [128]}):
        config["quantization_config"] = q
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="unsupported quantization_config"):
            jd.load_checkpoint(path, dtype="float32")
    with pytest.raises(ValueError, match="quantize='int4' must be None or 'fp8'"):
        jd.load_checkpoint(path / "dequantised", quantize="int4")


MOE_CONFIG = dataclasses.replace(CONFIG, intermediate_size=0,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=96)
NEXT_CONFIG = dataclasses.replace(MOE_CONFIG, model_type="qwen3_next", intermediate_size=160,
                                  mlp_only_layers=(2,), norm_topk_prob=False)


@pytest.mark.parametrize("config", [MOE_CONFIG, NEXT_CONFIG,
                                    dataclasses.replace(NEXT_CONFIG, linear_key_head_dim=32),
                                    dataclasses.replace(MOE_CONFIG, moe_intermediate_size=128)],
                         ids=["qwen3_5_moe", "qwen3_next", "qwen3_next_split_blocks",
                              "qwen3_5_moe_whole_blocks"])
def test_fp8_moe_release_loads_its_experts(tmp_path, config):
    """The FP8 MoE releases' layout (experts per expert in F8_E4M3 with block scales; Qwen3-Next's
    fused in_proj_qkvz in F8_E4M3) loads: the experts as block-FP8 stacks (gate_up_proj where an
    expert's gate rows end on a block boundary, moe_intermediate_size 128 as every release; else
    dequantised), their values the dequantised checkpoint's; the fused projection split into
    FP8 in_proj_qkv and in_proj_z with their scale rows where its per-key-head row groups are
    whole blocks (2·dk and r·dv multiples of 128, as Qwen3-Next-80B-A3B's), else dequantised; the
    other Linears FP8; the logits the dequantised checkpoint's."""
    params = jd.init_params(config, jax.random.key(9))
    path = _write_fp8_checkpoint(tmp_path / "fp8", params)
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "np") as f:
        kinds = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert kinds["model.layers.0.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    needed = []  # the bytes load_checkpoint's memory check counts: what it then holds
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "check_fits", lambda what, n, *args, **kw: needed.append(n))
        loaded = jd.load_checkpoint(path, dtype="float32")
    assert needed == [sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(loaded))]
    dense = jd.load_checkpoint(path / "dequantised", dtype="float32")
    moe, want = loaded.layers[0].mlp, dense.layers[0].mlp
    for got, ref, whole in ((moe.experts_gate_up_proj, want.experts_gate_up_proj,
                             config.moe_intermediate_size % 128 == 0),
                            (moe.experts_down_proj, want.experts_down_proj, True)):
        if whole:  # down_proj: each expert's [H, I] keeps its own blocks
            assert isinstance(got, jd.Fp8Linear) and got.weight.dtype == FP8
            assert got.scale_inv.shape == quantization.scale_shape(ref.shape, (128, 128))
            got = got.dequantize(jnp.float32)
        else:
            assert not isinstance(got, jd.Fp8Linear)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert isinstance(loaded.layers[1].self_attn.o_proj, jd.Fp8Linear)
    assert isinstance(moe.shared_expert.down_proj, jd.Fp8Linear)
    lin, lin_dense = loaded.layers[0].linear_attn, dense.layers[0].linear_attn
    split_blocks = (2 * config.linear_key_head_dim) % 128 != 0
    for got, ref in ((lin.in_proj_qkv, lin_dense.in_proj_qkv), (lin.in_proj_z, lin_dense.in_proj_z)):
        if config.model_type == "qwen3_next" and split_blocks:  # split, dequantised
            assert not isinstance(got, jd.Fp8Linear)
        else:  # (Qwen3-Next: split out of the fused FP8 tensor, rows regrouped, kept FP8)
            assert isinstance(got, jd.Fp8Linear) and got.weight.dtype == FP8
            assert got.scale_inv.shape == quantization.scale_shape(ref.shape, (128, 128))
            got = got.dequantize(jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    rng = np.random.default_rng(10)
    tokens = rng.integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    num_new = np.array([9, 4], np.int32)
    got, want = _run(loaded, tokens, num_new), _run(dense, tokens, num_new)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # a damaged per-expert scale is named like any other
    name = "model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"
    bad = _write_fp8_checkpoint(tmp_path / "bad", params, change={
        name: np.ones((3, 3), np.float32)})
    with pytest.raises(ValueError, match=rf"{name} has shape \(3, 3\), but its weight "
                                         rf"{name[:-len('_scale_inv')]} as stored, "
                                         rf"\({config.moe_intermediate_size}, "
                                         rf"{config.hidden_size}\) in blocks \[128, 128\], "
                                         r"needs \(1, 1\)"):
        jd.load_checkpoint(bad, dtype="float32")
    # an expert stored in another dtype: its layer's stack loads dequantised, with a warning
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    mixed = _write_fp8_checkpoint(tmp_path / "mixed", params, drop=(name + "_scale_inv",),
                                  change={name: np.asarray(dense.layers[0].mlp.experts_down_proj[1])})
    with pytest.warns(UserWarning, match=r"1 expert stacks are stored partly in FP8 and load "
                      r"dequantised in float32: model.layers.0.mlp.experts.down_proj \(3 of 4 "
                      r"tensors F8_E4M3\)$"):
        got = jd.load_checkpoint(mixed, dtype="float32")
    assert not isinstance(got.layers[0].mlp.experts_down_proj, jd.Fp8Linear)
    np.testing.assert_array_equal(np.asarray(got.layers[0].mlp.experts_down_proj),
                                  np.asarray(dense.layers[0].mlp.experts_down_proj))
    # and a NaN in an expert of a stack (down_proj: always one) by that expert's tensor and file
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
    nan = _write_fp8_checkpoint(tmp_path / "nan", params, change={
        name: np.full((1, 1), np.nan, np.float32)})
    with pytest.raises(ValueError, match=rf"tensor {name} in .*model.safetensors' has 1 NaN"):
        jd.load_checkpoint(nan, dtype="float32")
    # a negative block scale (a sign flipped in a damaged file), of a stack (gate/up: also where
    # the stack is dequantised at load) and of a Linear
    for name in ("model.layers.0.mlp.experts.2.down_proj.weight_scale_inv",
                 "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv",
                 "model.layers.1.self_attn.o_proj.weight_scale_inv"):
        negative = _write_fp8_checkpoint(tmp_path / name, params, change={
            name: -np.ones((1, 1), np.float32)})
        with pytest.raises(ValueError, match=rf"tensor {name} in .*model.safetensors' has 1 "
                                             r"NaN, inf or negative block scale values"):
            jd.load_checkpoint(negative, dtype="float32")
    # a finite scale whose block overflows the model dtype once multiplied out (kept FP8: the
    # step would dequantise it to inf), of a stack (named by its expert's tensor, the block by
    # its index in that tensor: an up_proj's rows follow the gate's in the stack) and a Linear
    whole = config.moe_intermediate_size % 128 == 0  # gate_up kept FP8
    for name in ("model.layers.0.mlp.experts.2.down_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight",
                 *(["model.layers.0.mlp.experts.3.up_proj.weight"] if whole else [])):
        huge = _write_fp8_checkpoint(tmp_path / ("huge" + name), params, change={
            name + "_scale_inv": np.full((1, 1), 1e37, np.float32)})
        for dtype in ("float32", "bfloat16"):
            with pytest.raises(ValueError, match=rf"tensor {name} in .*model.safetensors': its "
                               rf"FP8 block \(0, 0\) times its weight_scale_inv 1e\+37 exceeds "
                               rf"{dtype}'s largest value"):
                jd.load_checkpoint(huge, dtype=dtype)
        jd.load_checkpoint(huge, dtype="float32", check_finite=False)


def test_an_fp8_release_parses_each_file_header_once(tmp_path, monkeypatch):
    """The FP8 tensors' bytes are located from their file's JSON header, parsed once per file
    (a release holds thousands of per-expert tensors a file; a parse per tensor took 3 ms
    each at 2,400 entries)."""
    from jaxdecode import checkpoint
    path = _write_fp8_checkpoint(tmp_path, jd.init_params(MOE_CONFIG, jax.random.key(9)))
    parsed = []
    real = checkpoint._safetensors_header
    monkeypatch.setattr(checkpoint, "_safetensors_header",
                        lambda p: parsed.append(p) or real(p))
    jd.load_checkpoint(path, dtype="float32")
    assert parsed == [str(path / "model.safetensors")], parsed


def test_quantize_fp8_holds_the_moe_experts_as_fp8_stacks():
    """quantize_fp8 of an MoE model: the routed experts as block-FP8 stacks (each expert in its
    own blocks), the router in the model dtype; logits (prefill, and decode at 1 and 3 rows:
    the pairs and the rounds forms) those of the dequantised weights."""
    dense = jd.init_params(MOE_CONFIG, jax.random.key(12))
    params = jd.quantize_fp8(dense)
    moe = params.layers[0].mlp
    assert isinstance(moe.experts_gate_up_proj, jd.Fp8Linear)
    assert moe.experts_gate_up_proj.scale_inv.shape == (4, 1, 1)
    assert moe.experts_down_proj.weight.shape == (4, 96, 64) and not isinstance(moe.gate,
                                                                                 jd.Fp8Linear)
    assert jd.num_params(params) == jd.num_params(dense)
    rng = np.random.default_rng(13)
    for rows in (1, 3):
        tokens = rng.integers(0, MOE_CONFIG.vocab_size, (rows, 7)).astype(np.int32)
        num_new = np.full(rows, 7, np.int32)
        got, want = _run(params, tokens, num_new), _run(_dequantized(params), tokens, num_new)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_a_bad_block_size_is_refused_by_name():
    params = jd.init_params(MOE_CONFIG, jax.random.key(12))
    for bad in ((0, 128), (128,), (128.0, 128), (-1, 128), (True, 128), 128, None):
        with pytest.raises(ValueError, match=r"block_size=.* must be two positive ints"):
            jd.quantize_fp8(params, bad)
    with pytest.raises(ValueError, match=r"block_size=\(8, 0\) must be two positive ints"):
        quantization.quantize(np.ones((8, 8), np.float32), (8, 0))
    with pytest.raises(ValueError, match=r"params must be jaxdecode.Params"):
        jd.quantize_fp8({"model.embed_tokens.weight": np.ones((4, 4), np.float32)})
    held = jd.quantize_fp8(params, [32, np.int64(32)])  # any two positive ints, held as a tuple
    assert held.layers[0].mlp.experts_down_proj.block_size == (32, 32)


def test_quantize_at_load_equals_quantize_fp8_of_the_loaded_params(tmp_path):
    """Any checkpoint (here the small config, whose regrouped rows would split FP8 blocks on
    disk: quantised after the regrouping) loads as FP8 with ``quantize="fp8"``."""
    small = tiny(vocab_size=300)
    path = _write_fp8_checkpoint(tmp_path / "q", jd.init_params(small, jax.random.key(5)))
    dense = path / "dequantised"
    at_load = jd.load_checkpoint(dense, dtype="float32", quantize="fp8")
    after = jd.quantize_fp8(jd.load_checkpoint(dense, dtype="float32"))
    leaves = lambda p: jax.tree.leaves(p)  # noqa: E731
    assert len(leaves(at_load)) == len(leaves(after))
    for a, b in zip(leaves(at_load), leaves(after)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype == FP8 else a,
                                      np.asarray(b).view(np.uint8) if b.dtype == FP8 else b)
    assert isinstance(at_load.layers[0].mlp.gate_proj, jd.Fp8Linear)


def test_fp8_checkpoint_logits_match_hf_on_the_dequantised_weights(tmp_path, hf_checkpoints):
    """An FP8 checkpoint of an HF-built random model against HF transformers running the
    dequantised weights (float32 both sides: the same math, so the dense parity bound, 1e-4)."""
    hf_dir = hf_checkpoints.make("fp8_base", hf_text_config(CONFIG), seed=7)
    params = jd.load_checkpoint(hf_dir, dtype="float32")
    path = _write_fp8_checkpoint(tmp_path / "fp8", params)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    for where in (path, path / "dequantised"):  # HF's own config.json (its class, its fields)
        ours = json.loads((where / "config.json").read_text())
        extra = {"quantization_config": ours["quantization_config"]} if where == path else {}
        (where / "config.json").write_text(json.dumps({**hf_config, **extra}))
    prompt = random_prompt(np.random.default_rng(8), 13, CONFIG.vocab_size)
    ref = hf_checkpoints.reference(path / "dequantised",
                                   [{"name": "p", "prompt": prompt, "decode_steps": 4}])
    fp8 = jd.load_checkpoint(path, dtype="float32")
    assert isinstance(fp8.layers[0].linear_attn.in_proj_qkv, jd.Fp8Linear)
    state = jd.init_state(CONFIG, 1, 64, dtype="float32")
    logits, state = jd.prefill(fp8, state, np.asarray([prompt], np.int32),
                               np.array([len(prompt)], np.int32), return_all_logits=True)
    assert_logits_close(np.asarray(logits[0]), ref["p/prefill_logits"], what="prefill")
    for k, token in enumerate(ref["p/decode_tokens"]):
        logits, state = jd.decode_step(fp8, state, np.array([token], np.int32))
        assert_logits_close(np.asarray(logits[0]), ref["p/decode_logits"][k], what=f"step {k}")
