"""jaxdecode.checkpoint: HF-layout safetensors directories load (prefixes, extra tensors,
dtypes) and are validated whole, every problem listed in one ValueError. The checkpoints here are
written with numpy/safetensors only (no jaxdecode code); HF-written ones are in test_model.py."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import tiny
from jaxdecode.checkpoint import load_checkpoint
from jaxdecode.params import params_to_hf
import jaxdecode as jd

CONFIG = tiny(vocab_size=300, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(0))


def write_checkpoint(path, params, *, prefix="", drop=(), extra=None, reshape=None):
    """Writes params as an HF-style directory with numpy/safetensors only (no jaxdecode code)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(params.config.to_hf_config()))
    leaves = params_to_hf(params)
    tensors = {}
    for name in leaves:
        if name in drop:
            continue
        value = np.asarray(leaves[name], np.float32)
        if reshape and name in reshape:
            value = np.zeros(reshape[name], np.float32)
        stored = name.replace("model.", prefix, 1) if prefix else name
        tensors[stored] = value
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_checkpoint_round_trip_skips_mtp_and_vision(tmp_path, params):
    extra = {"mtp.fc.weight": np.ones((4, 4), np.float32),
             "model.visual.patch_embed.weight": np.ones((2, 2), np.float32)}
    path = write_checkpoint(tmp_path / "ck", params, prefix="model.language_model.", extra=extra)
    loaded = load_checkpoint(path, dtype="float32")
    assert loaded.config == params.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf16 = load_checkpoint(path, dtype="bfloat16")
    assert bf16.dtype == np.dtype("bfloat16")
    assert bf16.layers[0].linear_attn.A_log.dtype == np.float32  # kept float32


def test_checkpoint_problems_are_listed_together(tmp_path, params):
    a = "model.layers.0.linear_attn.A_log"
    q = "model.layers.3.self_attn.q_proj.weight"
    path = write_checkpoint(tmp_path / "bad", params, drop=(a,), reshape={q: (7, 5)},
                            extra={"model.layers.0.mlp.bias": np.ones(3, np.float32)})
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    msg = str(err.value)
    assert "3 problems" in msg
    assert f"missing tensor {a} (expected shape (4,))" in msg
    assert f"tensor {q} has shape (7, 5), expected (256, 64)" in msg
    assert "unexpected tensor model.layers.0.mlp.bias with shape (3,)" in msg


def test_checkpoint_duplicates_and_non_float_tensors(tmp_path, params):
    emb = "model.embed_tokens.weight"
    extra = {"model.language_model.embed_tokens.weight": np.zeros((300, 64), np.float32)}
    path = write_checkpoint(tmp_path / "dup", params, extra=extra)
    with pytest.raises(ValueError, match=rf"tensor {emb} is stored twice"):
        load_checkpoint(path)
    a = "model.layers.0.linear_attn.A_log"
    path = write_checkpoint(tmp_path / "int", params, extra={a: np.ones(4, np.int32)})
    with pytest.raises(ValueError, match=rf"tensor {a} has dtype I32, expected a float type"):
        load_checkpoint(path)


def test_checkpoint_tied_lm_head_of_the_wrong_shape(tmp_path, params):
    assert params.config.tie_word_embeddings
    path = write_checkpoint(tmp_path / "tied", params,
                            extra={"lm_head.weight": np.ones((3, 3), np.float32)})
    with pytest.raises(ValueError, match=r"tensor lm_head.weight has shape \(3, 3\), expected "
                                         r"\(300, 64\)"):
        load_checkpoint(path)


def test_checkpoint_malformed_files(tmp_path, params):
    path = write_checkpoint(tmp_path / "cfg", params)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": "128"}))
    with pytest.raises(ValueError, match=r"wrong type"):
        load_checkpoint(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json' is not valid JSON"):
        load_checkpoint(path)
    path = write_checkpoint(tmp_path / "idx", params)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"is not a safetensors index with a 'weight_map'"):
        load_checkpoint(path)


def test_eos_ids_from_generation_config(tmp_path, params):
    """HF generate stops at GenerationConfig's eos_token_id, which from_pretrained reads from
    generation_config.json over config.json (Qwen's chat releases add <|im_end|> there):
    load_checkpoint takes them (an int, a list, [] for none), keeps config.json's where the file
    names none (a deliberate difference: HF would then stop at none), and jd.generate's default
    stops there."""
    path = write_checkpoint(tmp_path / "ck", params)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 5}))
    gen_config = path / "generation_config.json"
    loaded = load_checkpoint(path, dtype="float32")
    assert loaded.config.eos_token_id == (5,)
    first = jd.generate(loaded, [[1, 2, 3]], max_new_tokens=3, eos_token_ids=()).token_lists()[0]
    for text, want in (({"temperature": 0.7}, (5,)), ({"eos_token_id": None}, (5,)),
                       ({"eos_token_id": 7}, (7,)), ({"eos_token_id": []}, ()),
                       ({"eos_token_id": [299, first[0], 299]}, (299, first[0]))):
        gen_config.write_text(json.dumps(text))
        assert load_checkpoint(path, dtype="float32").config.eos_token_id == want, text
    out = jd.generate(load_checkpoint(path, dtype="float32"), [[1, 2, 3]], max_new_tokens=3)
    assert out.token_lists()[0] == first[:1] and out.stop_reasons()[0] == "eos"
    for text, match in (([1.5], r"generation_config.json'.*eos_token_id=\[1.5\]"),
                        ([7], "not a JSON object")):
        gen_config.write_text(json.dumps({"eos_token_id": text} if text == [1.5] else text))
        with pytest.raises(ValueError, match=match):
            load_checkpoint(path)


def test_checkpoint_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf_config()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


# ----- damaged files (issue 22): a ValueError naming the file or tensor

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny float32 checkpoint as numpy tensors (HF names) and a writer for variants of it."""
    config = jd.Config.from_preset("tiny")
    params = jd.init_params(config, jax.random.key(3), "float32")
    flat = {k: np.asarray(v) for k, v in params_to_hf(params).items()}
    root = tmp_path_factory.mktemp("ckpt")

    def write(name, tensors=None, raw: bytes | None = None):
        path = root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config.to_hf_config()))
        if raw is None:
            save_file(tensors if tensors is not None else flat, str(path / "model.safetensors"))
        else:
            (path / "model.safetensors").write_bytes(raw)
        return path

    return params, flat, write


def test_single_file_path_loads(written):
    params, _, write = written
    path = write("single")
    got = jd.load_checkpoint(path / "model.safetensors", "fp32")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                     got, params))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_tensor_is_named(written, value):
    _, flat, write = written
    name = "model.layers.1.mlp.down_proj.weight"
    bad = dict(flat)
    bad[name] = flat[name].copy()
    bad[name].flat[[5, 17]] = value
    path = write(f"nonfinite_{value}", bad)
    with pytest.raises(ValueError, match=rf"tensor {name} in .*model\.safetensors.* has 2 NaN or inf"):
        jd.load_checkpoint(path, "float32")
    # check_finite=False is the explicit way to load it anyway
    loaded = jd.load_checkpoint(path, "float32", check_finite=False)
    assert not np.isfinite(np.asarray(loaded.layers[1].mlp.down_proj)).all()


@pytest.mark.parametrize("kind", ["truncated", "empty", "garbage"])
def test_unreadable_file_is_named(written, kind, tmp_path):
    _, _, write = written
    good = write(f"good_for_{kind}") / "model.safetensors"
    data = good.read_bytes()
    raw = {"truncated": data[: len(data) // 2], "empty": b"",
           "garbage": np.random.default_rng(0).bytes(4096)}[kind]
    path = write(kind, raw=raw)
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        jd.load_checkpoint(path)


def test_values_that_overflow_the_model_dtype_are_caught(written):
    """A float32 value above bfloat16's range becomes inf when cast: the check runs after it."""
    _, flat, write = written
    name = "model.layers.2.mlp.up_proj.weight"
    big = dict(flat)
    big[name] = flat[name].copy()
    big[name].flat[0] = 3.4e38
    path = write("overflow", big)
    jd.load_checkpoint(path, "float32")  # finite in float32
    with pytest.raises(ValueError, match=rf"tensor {name} .* has 1 NaN or inf values as bfloat16"):
        jd.load_checkpoint(path, "bfloat16")


# ----- MoE experts: fused 3-D or per-expert 2-D tensors ------------------------------------------

MOE_CONFIG = tiny(vocab_size=300, intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24)


def per_expert(tensors, config, *, drop=(), bad_shape=()):
    """The fused expert tensors of ``tensors`` split into HF's per-expert 2-D names (what
    transformers' save_pretrained writes), with (layer, expert, kind) entries dropped or
    misshapen."""
    out, ie = {}, config.moe_intermediate_size
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            parts = {"gate": value[:, :ie], "up": value[:, ie:]}
        elif name.endswith("mlp.experts.down_proj"):
            parts = {"down": value}
        else:
            out[name] = value
            continue
        layer = int(name.split(".")[2])
        for kind, stacked in parts.items():
            for e in range(config.num_experts):
                if (layer, e, kind) in drop:
                    continue
                x = stacked[e][:-1] if (layer, e, kind) in bad_shape else stacked[e]
                out[name.replace("experts.gate_up_proj", "experts.").replace(
                    "experts.down_proj", "experts.") + f"{e}.{kind}_proj.weight"] = x
    return out


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_moe_checkpoint_round_trip(tmp_path, layout):
    params = jd.init_params(MOE_CONFIG, jax.random.key(3))
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 64)
    if layout == "per_expert":
        tensors = per_expert(tensors, MOE_CONFIG)
        assert "model.layers.2.mlp.experts.3.up_proj.weight" in tensors
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.config == MOE_CONFIG
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_moe_checkpoint_problems_name_each_expert_tensor(tmp_path):
    params = jd.init_params(MOE_CONFIG, jax.random.key(3))
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    tensors = per_expert(tensors, MOE_CONFIG, drop={(1, 2, "up")}, bad_shape={(0, 3, "down")})
    tensors["model.layers.2.mlp.experts.4.gate_proj.weight"] = np.zeros((16, 64), np.float32)
    # a second expert 1 under another spelling of its index: not silently one of the two
    tensors["model.layers.2.mlp.experts.01.down_proj.weight"] = np.zeros((64, 16), np.float32)
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert "4 problems" in msg
    assert "unexpected tensor model.layers.2.mlp.experts.01.down_proj.weight" in msg
    assert ("missing tensor model.layers.1.mlp.experts.2.up_proj.weight (expected shape "
            "(16, 64))") in msg
    assert ("tensor model.layers.0.mlp.experts.3.down_proj.weight has shape (63, 16), expected "
            "(64, 16)") in msg
    assert "unexpected tensor model.layers.2.mlp.experts.4.gate_proj.weight (num_experts=4)" in msg


def test_a_nan_in_a_per_expert_tensor_names_that_expert(tmp_path):
    params = jd.init_params(MOE_CONFIG, jax.random.key(3))
    tensors = per_expert({k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()},
                         MOE_CONFIG)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"  # rows [I, 2I) of expert 2's gate_up
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] = np.nan
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)} in .*model\.safetensors' "
                                         r"has 1 NaN or inf values as float32"):
        load_checkpoint(tmp_path, dtype="float32")


# ----- Qwen3-Next: fused DeltaNet projections, dense layers, mtp.* skipped ---------------------

NEXT_CONFIG = tiny(vocab_size=300, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   mlp_only_layers=(2,), norm_topk_prob=False)


def write_next(path, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(NEXT_CONFIG.to_hf_config()))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_qwen3_next_checkpoint_round_trip(tmp_path, layout):
    """A Qwen3NextForCausalLM directory (model.* names, in_proj_qkvz / in_proj_ba, experts fused
    or per expert as save_pretrained writes them, a dense MLP in layer 2, mtp.* tensors) loads
    to the params it was written from."""
    params = jd.init_params(NEXT_CONFIG, jax.random.key(5))
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in tensors
    if layout == "per_expert":
        tensors = per_expert(tensors, NEXT_CONFIG)
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in tensors
    tensors["mtp.layers.0.mlp.experts.0.up_proj.weight"] = np.ones((16, 64), np.float32)
    tensors["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    loaded = load_checkpoint(write_next(tmp_path, tensors), dtype="float32")
    assert loaded.config == NEXT_CONFIG
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qwen3_next_checkpoint_problems_name_each_tensor(tmp_path):
    params = jd.init_params(NEXT_CONFIG, jax.random.key(5))
    tensors = per_expert({k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()},
                         NEXT_CONFIG)
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    tensors[qkvz] = tensors[qkvz][:-1]
    del tensors["model.layers.1.linear_attn.in_proj_ba.weight"]
    # the Qwen3.5 split names are not a Qwen3-Next checkpoint's
    tensors["model.layers.2.linear_attn.in_proj_z.weight"] = np.zeros((96, 64), np.float32)
    # experts in layer 2, a dense-MLP layer (mlp_only_layers)
    tensors["model.layers.2.mlp.experts.0.gate_proj.weight"] = np.zeros((16, 64), np.float32)
    with pytest.raises(ValueError) as err:
        load_checkpoint(write_next(tmp_path, tensors))
    msg = str(err.value)
    assert "4 problems" in msg
    assert f"tensor {qkvz} has shape (255, 64), expected (256, 64)" in msg
    assert ("missing tensor model.layers.1.linear_attn.in_proj_ba.weight (expected shape "
            "(8, 64))") in msg
    assert ("unexpected tensor model.layers.2.linear_attn.in_proj_z.weight with shape "
            "(96, 64)") in msg
    assert ("unexpected tensor model.layers.2.mlp.experts.0.gate_proj.weight with shape "
            "(16, 64)") in msg


def test_a_per_expert_tensor_beside_fused_experts_is_named_once(tmp_path):
    """A stray per-expert tensor in a layer stored fused is the one problem reported (not every
    other expert's tensors as missing)."""
    params = jd.init_params(MOE_CONFIG, jax.random.key(3))
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    stray = "model.layers.1.mlp.experts.0.gate_proj.weight"
    tensors[stray] = np.zeros((16, 64), np.float32)
    del tensors["model.layers.2.mlp.experts.down_proj"]
    other = "model.layers.2.mlp.experts.3.down_proj.weight"
    tensors[other] = np.zeros((64, 16), np.float32)
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG.to_hf_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert "3 problems" in msg, msg
    assert (f"tensor {stray} is stored twice: per expert and in the fused "
            "model.layers.1.mlp.experts.gate_up_proj") in msg
    assert (f"unexpected tensor {other}: the layer's experts are stored fused "
            "(model.layers.2.mlp.experts.gate_up_proj)") in msg
    assert "missing tensor model.layers.2.mlp.experts.down_proj" in msg
