"""Parity with Hugging Face transformers 5.24.0 on random checkpoints written by save_pretrained.

Every checkpoint has all parameters randomised (tests/hf_reference.py). Both sides run float32
("highest" matmuls here, CPU torch there). Tolerance: max |Δlogit| <= 1e-4 · max|logit| and the
same argmax wherever the reference's top-2 margin is not a near-tie (spec §7 item 12).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxdecode as jd
from conftest import assert_logits_close, text_config

DECODE_STEPS = 16
PROMPT_LENGTHS = (1, 2, 3, 63, 64, 65, 150)  # shorter than the conv window, chunk edges, 3 chunks
OTHER_PROMPT = 70


def _prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


CHECKPOINTS = {
    # untied; r = Hv/Hk = 2; dk=16 != dv=24; 2 query heads per KV head
    "base": dict(text_config=text_config(), seed=1),
    # tied; r = 3; 4 query heads per KV head; 8 layers (2 attention layers)
    "tied_r3_g4": dict(seed=2, text_config=text_config(
        tie_word_embeddings=True, linear_num_value_heads=6, num_attention_heads=8,
        num_key_value_heads=2, num_hidden_layers=8, layer_types=(
            ["linear_attention"] * 3 + ["full_attention"]) * 2)),
    # r = 1, MHA (1 query head per KV head), dk > dv
    "r1_mha": dict(seed=3, text_config=text_config(
        linear_num_value_heads=2, num_attention_heads=2, num_key_value_heads=2,
        linear_key_head_dim=24, linear_value_head_dim=16)),
    # the published layout: Qwen3_5ForConditionalGeneration (model.language_model.*, visual)
    "multimodal": dict(seed=4, layout="conditional_generation",
                       text_config=text_config(tie_word_embeddings=True)),
    # several safetensors shards + index
    "sharded": dict(seed=5, max_shard_size="60KB", text_config=text_config()),
    # bf16 on disk with A_log / linear_attn.norm.weight float32 (loaded into float32 here)
    "bf16_f32_A_log": dict(seed=6, dtype="bfloat16", text_config=text_config()),
}

CASES = {key: [{"name": "p", "prompt": _prompt(100 + i, OTHER_PROMPT),
                "decode_steps": DECODE_STEPS}]
         for i, key in enumerate(CHECKPOINTS) if key != "base"}
CASES["base"] = [{"name": f"len{n}", "prompt": _prompt(n, n), "decode_steps": DECODE_STEPS}
                 for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf(hf_checkpoints):
    """{key: (checkpoint dir, reference arrays)} built in one transformers subprocess."""
    return hf_checkpoints.build(CHECKPOINTS, CASES)


@pytest.fixture(scope="module")
def loaded(hf):
    return {key: jd.load_checkpoint(path, dtype="float32") for key, (path, _) in hf.items()}


def _run_case(params, prompt, ref, name, *, pad_to=None, max_len=256):
    """Prefill (all logits) then decode following the reference's tokens; compare each."""
    t = pad_to or len(prompt)
    tokens = np.full((1, t), 7, np.int32)  # padding holds a real-looking id on purpose
    tokens[0, :len(prompt)] = prompt
    state = jd.init_state(params.config, batch_size=1, max_len=max_len)
    logits, state = jd.prefill(params, state, tokens, np.array([len(prompt)]),
                               return_all_logits=True)
    worst = assert_logits_close(np.asarray(logits)[0, :len(prompt)], ref[f"{name}/prefill_logits"],
                                what=f"{name} prefill")
    for i, tok in enumerate(ref[f"{name}/decode_tokens"]):
        logits, state = jd.decode_step(params, state, np.array([tok], np.int32))
        worst = max(worst, assert_logits_close(np.asarray(logits)[0],
                                               ref[f"{name}/decode_logits"][i],
                                               what=f"{name} decode step {i}"))
    assert int(state.lengths[0]) == len(prompt) + DECODE_STEPS
    return worst


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prompt_lengths_match_hf(hf, loaded, length):
    _, ref = hf["base"]
    # Short prompts also go through a padded prefill (right padding must be inert).
    pad_to = 8 if length < 8 else None
    worst = _run_case(loaded["base"], _prompt(length, length), ref, f"len{length}", pad_to=pad_to)
    print(f"base len{length}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("key", [k for k in CHECKPOINTS if k != "base"])
def test_configs_and_layouts_match_hf(hf, loaded, key):
    _, ref = hf[key]
    worst = _run_case(loaded[key], CASES[key][0]["prompt"], ref, "p")
    print(f"{key}: worst relative error {worst:.2e}")


def test_sharded_and_multimodal_checkpoints_are_what_they_claim(hf):
    from safetensors import safe_open
    from jaxdecode.checkpoint import checkpoint_files
    assert len(checkpoint_files(hf["sharded"][0])) > 1
    keys = []
    for f in checkpoint_files(hf["multimodal"][0]):
        with safe_open(f, "np") as fh:
            keys += list(fh.keys())
    assert any(k.startswith("model.language_model.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    with safe_open(checkpoint_files(hf["bf16_f32_A_log"][0])[0], "np") as fh:
        assert fh.get_slice("model.layers.0.linear_attn.A_log").get_dtype() == "F32"
        assert fh.get_slice("model.layers.0.linear_attn.in_proj_qkv.weight").get_dtype() == "BF16"


def test_config_variants_are_what_they_claim(loaded):
    c = {k: p.config for k, p in loaded.items()}
    assert c["base"].linear_num_value_heads_per_key_head == 2
    assert c["base"].linear_key_head_dim != c["base"].linear_value_head_dim
    assert c["tied_r3_g4"].linear_num_value_heads_per_key_head == 3
    assert c["tied_r3_g4"].num_key_value_groups == 4 and c["tied_r3_g4"].tie_word_embeddings
    assert loaded["tied_r3_g4"].lm_head is None and loaded["base"].lm_head is not None
    assert c["r1_mha"].num_key_value_groups == 1
    assert c["multimodal"].tie_word_embeddings


def test_ragged_batch_matches_each_prompt_alone(hf, loaded):
    """Rows of different lengths in one right-padded batch == each prompt run alone (HF)."""
    params, (_, ref) = loaded["base"], hf["base"]
    names = ["len150", "len3", "len64", "len1"]
    prompts = [_prompt(int(n[3:]), int(n[3:])) for n in names]
    t = max(map(len, prompts))
    tokens = np.zeros((len(prompts), t), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    state = jd.init_state(params.config, batch_size=len(prompts), max_len=256)
    logits, state = jd.prefill(params, state, tokens, np.array([len(p) for p in prompts]))
    for b, n in enumerate(names):
        assert_logits_close(np.asarray(logits)[b], ref[f"{n}/prefill_logits"][-1],
                            what=f"row {b} ({n}) prefill")
    for i in range(DECODE_STEPS):
        toks = np.array([ref[f"{n}/decode_tokens"][i] for n in names], np.int32)
        logits, state = jd.decode_step(params, state, toks)
        for b, n in enumerate(names):
            assert_logits_close(np.asarray(logits)[b], ref[f"{n}/decode_logits"][i],
                                what=f"row {b} ({n}) decode step {i}")
    np.testing.assert_array_equal(np.asarray(state.lengths),
                                  [len(p) + DECODE_STEPS for p in prompts])


@pytest.mark.parametrize("split", [1, 64, 97])
def test_prefill_in_two_calls_matches_one_call(hf, loaded, split):
    """A prompt prefilled in two calls (continuation from the state) == HF on the whole prompt,
    and == one jaxdecode call, including the state left behind."""
    params, (_, ref) = loaded["base"], hf["base"]
    prompt = np.array(_prompt(150, 150), np.int32)
    one = jd.init_state(params.config, batch_size=1, max_len=256)
    logits_one, one = jd.prefill(params, one, prompt[None], np.array([150]))
    two = jd.init_state(params.config, batch_size=1, max_len=256)
    _, two = jd.prefill(params, two, prompt[None, :split], np.array([split]))
    logits_two, two = jd.prefill(params, two, prompt[None, split:], np.array([150 - split]))
    assert_logits_close(np.asarray(logits_two)[0], ref["len150/prefill_logits"][-1],
                        what="two-call prefill vs HF")
    assert_logits_close(np.asarray(logits_two), np.asarray(logits_one), rel=2e-5,
                        what="two calls vs one call")
    for a, b in zip(jax_leaves(one), jax_leaves(two)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(a).max()))
    tok = ref["len150/decode_tokens"][0]
    logits, _ = jd.decode_step(params, two, np.array([tok], np.int32))
    assert_logits_close(np.asarray(logits)[0], ref["len150/decode_logits"][0],
                        what="decode after two-call prefill")


def jax_leaves(state):
    import jax
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(state)]
