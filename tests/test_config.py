"""jaxdecode.config: presets, HF config.json round trips, and the errors for configs jaxdecode
does not support."""

from __future__ import annotations

import dataclasses

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
    with pytest.raises(ValueError, match=r"model_type='qwen3_next'; jaxdecode supports"):
        jd.Config.from_json_file(HERE / "data" / "configs" / "qwen3-next-80b-a3b.json")
    moe = jd.Config.from_preset("qwen3.5-35b-a3b").to_hf_config()
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2 \(every layer MoE\)"):
        jd.Config.from_hf_config({**moe, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match=r"missing the required field 'moe_intermediate_size'"):
        jd.Config.from_hf_config({k: v for k, v in moe.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 > num_experts=8"):
        jd.Config.from_hf_config({**moe, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"\{'moe_intermediate_size': 64\} given without "
                                         r"num_experts"):
        dataclasses.replace(TINY, moe_intermediate_size=64)
    with pytest.raises(ValueError, match=r"model_type='llama'"):
        jd.Config.from_hf_config({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):
        jd.Config.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"rope_type='yarn'"):
        jd.Config.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match=r"missing the required field 'hidden_size'"):
        jd.Config.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match=r"num_attention_heads=8 must be divisible by "
                                         r"num_key_value_heads=3"):
        jd.Config.from_hf_config({**base, "num_key_value_heads": 3})


def test_config_round_trip_and_multimodal_layout():
    for name in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "tiny", "qwen3.5-35b-a3b"):
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
                 "qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"):
        published = jd.Config.from_json_file(docs / f"{name}.json")
        assert published == jd.Config.from_preset(name), name


def test_the_test_config_is_a_valid_hf_config():
    """conftest's TINY as HF kwargs (what the parity checkpoints are built from) reads back."""
    assert jd.Config.from_hf_config({**hf_text_config(), "model_type": "qwen3_5_text"}) == TINY
