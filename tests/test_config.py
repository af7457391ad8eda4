"""jaxdecode.config: presets, HF config.json round trips, and the errors for configs jaxdecode
does not support."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxdecode as jd
from conftest import HERE, TINY, hf_text_config


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen9'"):
        jd.Config.from_preset("qwen9")
    base = jd.Config.from_preset("qwen3.5-0.8b").to_hf_config()
    with pytest.raises(ValueError, match=r"model_type='qwen3_5_text' with num_experts=8 "
                                         r"\(mixture-of-experts models are"):
        jd.Config.from_hf_config({**base, "num_experts": 8})
    moe = jd.Config.from_preset("qwen3.5-35b-a3b").to_hf_config()
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2 \(every layer MoE\)"):
        jd.Config.from_hf_config({**moe, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match=r"missing the required field 'moe_intermediate_size'"):
        jd.Config.from_hf_config({k: v for k, v in moe.items() if k != "moe_intermediate_size"})
    for experts in (0, -2):
        with pytest.raises(ValueError, match=rf"num_experts={experts} \(model_type "
                                             r"'qwen3_5_moe_text' is a mixture-of-experts model"):
            jd.Config.from_hf_config({**moe, "num_experts": experts})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 > num_experts=8"):
        jd.Config.from_hf_config({**moe, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"\{'moe_intermediate_size': 64\} given without "
                                         r"num_experts"):
        dataclasses.replace(TINY, moe_intermediate_size=64)
    moe_tiny = dataclasses.replace(TINY, intermediate_size=0, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16,
                                   shared_expert_intermediate_size=16)
    with pytest.raises(ValueError, match=r"intermediate_size=384 must be 0 for a 'qwen3_5' MoE "
                                         r"model \(every layer's FFN is the MoE block"):
        dataclasses.replace(moe_tiny, intermediate_size=384)  # (it would be ignored)
    for name in ("num_experts_per_tok", "num_experts", "hidden_size", "intermediate_size"):
        for bad in (True, False):  # bools are ints to Python: True would pass as 1
            with pytest.raises(ValueError, match=rf"{name}={bad} must be a positive int"):
                dataclasses.replace(moe_tiny, **{name: bad})
    with pytest.raises(ValueError, match=r"mtp_num_hidden_layers=True \(jaxdecode holds 0 or 1"):
        dataclasses.replace(TINY, mtp_num_hidden_layers=True)
    with pytest.raises(ValueError, match=r"model_type='llama'"):
        jd.Config.from_hf_config({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):
        jd.Config.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"rope_type='yarn'"):
        jd.Config.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn"}})
    for field in ("hidden_size", "num_hidden_layers"):
        with pytest.raises(ValueError, match=rf"missing the required field '{field}'"):
            jd.Config.from_hf_config({k: v for k, v in base.items() if k != field})
    with pytest.raises(ValueError, match=r"num_hidden_layers='4' must be an int"):
        jd.Config.from_hf_config({**base, "num_hidden_layers": "4"})
    for bad in ([1, 2], {**base, "text_config": [1]}):
        with pytest.raises(ValueError, match=r"config.json must hold a JSON object"):
            jd.Config.from_hf_config(bad)
    with pytest.raises(ValueError, match=r"num_attention_heads=8 must be divisible by "
                                         r"num_key_value_heads=3"):
        jd.Config.from_hf_config({**base, "num_key_value_heads": 3})


def test_eos_token_id_becomes_a_tuple_of_ints():
    """Config is a static jit argument, so it must hash: every spelling of the EOS ids becomes a
    tuple of Python ints (numpy arrays and integers included), and anything else is refused."""
    for given, want in ((np.array([5, 7]), (5, 7)), ([np.int64(3)], (3,)), (np.int32(9), (9,)),
                        (4, (4,)), ([1, 2], (1, 2)), (None, ()), ([], ())):
        config = dataclasses.replace(TINY, eos_token_id=given)
        assert config.eos_token_id == want
        assert all(type(i) is int for i in config.eos_token_id)
        hash(config)
    for bad in ([[1, 2]], np.array([[1]]), [True], 1.5, [-1], "2"):
        with pytest.raises(ValueError, match=r"eos_token_id=.* must be a non-negative int or a "
                                             r"flat sequence of them"):
            dataclasses.replace(TINY, eos_token_id=bad)
    assert jd.Config.from_hf_config({**TINY.to_hf_config(), "eos_token_id": None}).eos_token_id == ()


def test_config_round_trip_and_multimodal_layout():
    for name in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "tiny", "qwen3.5-35b-a3b",
                 "qwen3-next-80b-a3b"):
        c = jd.Config.from_preset(name)
        assert jd.Config.from_hf_config(c.to_hf_config()) == c
        hash(c)  # valid jit static
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False,
               "text_config": {**jd.Config.from_preset("qwen3.5-9b").to_hf_config(),
                               "model_type": "qwen3_5_text"}}
    assert jd.Config.from_hf_config(wrapped) == jd.Config.from_preset("qwen3.5-9b")


def test_presets_match_published_configs():
    """The presets equal the reconstructed published configs (copied from shared/docs/configs)."""
    docs = HERE / "data" / "configs"
    for name in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b",
                 "qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b",
                 "qwen3-next-80b-a3b"):
        published = jd.Config.from_json_file(docs / f"{name}.json")
        assert published == jd.Config.from_preset(name), name


def test_the_test_config_is_a_valid_hf_config():
    """conftest's TINY as HF kwargs (what the parity checkpoints are built from) reads back."""
    assert jd.Config.from_hf_config({**hf_text_config(), "model_type": "qwen3_5_text"}) == TINY


NEXT = dataclasses.replace(TINY, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, shared_expert_intermediate_size=24)


def test_qwen3_next_config():
    """Qwen3-Next: the published config.json (legacy top-level rope_theta and
    partial_rotary_factor, rope_scaling null) is 1-D RoPE over 64 of 256 dims with theta 5e6;
    decoder_sparse_step / mlp_only_layers pick the MoE layers (HF Qwen3NextDecoderLayer);
    to_hf_config round-trips every switch."""
    path = HERE / "data" / "configs" / "qwen3-next-80b-a3b.json"
    c = jd.Config.from_json_file(path)
    assert c.model_type == "qwen3_next" and c.rotary_dim == 64 and c.rope_theta == 5e6
    assert c.norm_topk_prob and c.moe_layers == tuple(range(48)) and c.vocab_size == 151_936
    hf = c.to_hf_config()
    assert hf["architectures"] == ["Qwen3NextForCausalLM"] and hf["intermediate_size"] == 5120
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    # as HF's convert_rope_params_to_dict: rope_scaling (or rope_parameters) first, then the
    # top-level fields, then Qwen3NextConfig's defaults (theta 10000, factor 0.25)
    assert jd.Config.from_hf_config({**legacy, "rope_theta": 7.0, "partial_rotary_factor": 0.5,
                                     "rope_scaling": None}).rotary_dim == 128
    assert jd.Config.from_hf_config({**legacy, "rope_scaling": {
        "rope_type": "default", "rope_theta": 3.0}, "rope_theta": 7.0}).rope_theta == 3.0
    defaults = jd.Config.from_hf_config({k: v for k, v in legacy.items()
                                         if k not in ("rope_theta", "partial_rotary_factor")})
    assert (defaults.rope_theta, defaults.partial_rotary_factor) == (10_000.0, 0.25)

    mixed = dataclasses.replace(NEXT, num_hidden_layers=8, layer_types=TINY.layer_types * 2,
                                decoder_sparse_step=2, mlp_only_layers=[5], norm_topk_prob=False)
    assert mixed.moe_layers == (1, 3, 7) and mixed.mlp_only_layers == (5,)
    dense = dataclasses.replace(NEXT, num_experts=0, num_experts_per_tok=0,
                                moe_intermediate_size=0, shared_expert_intermediate_size=0)
    assert dense.moe_layers == () and not dense.is_moe
    for config in (NEXT, mixed, dense):
        assert jd.Config.from_hf_config(config.to_hf_config()) == config
        hash(config)
    # absent switches take HF's defaults; num_experts is required (HF's default is 512)
    bare = {k: v for k, v in NEXT.to_hf_config().items()
            if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    assert jd.Config.from_hf_config(bare) == NEXT
    with pytest.raises(ValueError, match=r"missing the required field 'num_experts'"):
        jd.Config.from_hf_config({k: v for k, v in bare.items() if k != "num_experts"})


def test_qwen3_next_config_errors():
    base = NEXT.to_hf_config()
    with pytest.raises(ValueError) as err:  # every unsupported field named in one message
        jd.Config.from_hf_config({**base, "hidden_act": "gelu", "attention_bias": True,
                                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    for part in ("hidden_act='gelu'", "attention_bias=True", "rope_type='yarn'"):
        assert part in str(err.value)
    with pytest.raises(ValueError, match=r"rope_type='yarn'"):  # HF: rope_scaling wins
        jd.Config.from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[4, -1\] are not layer indices in "
                                         r"\[0, num_hidden_layers=4\)"):
        jd.Config.from_hf_config({**base, "mlp_only_layers": [4, 1, -1]})
    for step in (0, True):
        with pytest.raises(ValueError, match=rf"decoder_sparse_step={step} must be a positive int"):
            jd.Config.from_hf_config({**base, "decoder_sparse_step": step})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[True\] are not layer indices"):
        jd.Config.from_hf_config({**base, "mlp_only_layers": [True]})
    with pytest.raises(ValueError, match=r"rms_norm_eps=-1.0 must be a positive number"):
        jd.Config.from_hf_config({**base, "rms_norm_eps": -1})
    with pytest.raises(ValueError, match=r"intermediate_size=0 must be a positive int \(layers "
                                         r"\[1\] have a dense MLP\)"):
        dataclasses.replace(NEXT, intermediate_size=0, mlp_only_layers=(1,))
    with pytest.raises(ValueError, match=r"model_type='llama' must be 'qwen3_5' or 'qwen3_next'"):
        dataclasses.replace(TINY, model_type="llama")
    with pytest.raises(ValueError) as err:  # HF Qwen3.5 classes have none of the switches
        dataclasses.replace(TINY, norm_topk_prob=False, decoder_sparse_step=2,
                            mlp_only_layers=(1,))
    for part in ("norm_topk_prob=False", "decoder_sparse_step=2", "mlp_only_layers=(1,)"):
        assert f"{part} needs model_type='qwen3_next'" in str(err.value)
