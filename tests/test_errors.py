"""Bad input gets a clear ValueError before any device work (prefill; decode_step for what it
can check without reading the device); what decode_step cannot check on the host (a full cache,
device token ids out of range) gets NaN logits and an untouched row; checkpoints are validated
whole."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxdecode as jd
from jaxdecode.checkpoint import load_checkpoint
from jaxdecode.params import params_to_hf

CONFIG = dataclasses.replace(jd.Config.from_preset("tiny"), vocab_size=300)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(0))


def fresh(batch=2, max_len=16):
    return jd.init_state(CONFIG, batch_size=batch, max_len=max_len)


# ----- prefill / decode ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 300, 10**6])
def test_prefill_rejects_out_of_range_token_ids(params, bad):
    tokens = np.array([[1, 2, bad], [3, 4, 5]])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=300\)"):
        jd.prefill(params, fresh(), tokens, np.array([3, 3]))


def test_prefill_ignores_padding_ids(params):
    tokens = np.array([[1, 2, -1], [3, 4, 5]])  # -1 is padding (row 0 has 2 real tokens)
    logits, state = jd.prefill(params, fresh(), tokens, np.array([2, 3]))
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [2, 3])


def test_prompt_longer_than_cache(params):
    tokens = np.ones((2, 17), np.int32)
    with pytest.raises(ValueError, match=r"row 0: 0 cached \+ 17 new tokens exceeds the cache's "
                                         r"max_len=16"):
        jd.prefill(params, fresh(), tokens, np.array([17, 3]))


def test_continuation_past_cache(params):
    _, state = jd.prefill(params, fresh(), np.ones((2, 10), np.int32), np.array([10, 2]))
    with pytest.raises(ValueError, match=r"row 0: 10 cached \+ 7 new tokens exceeds"):
        jd.prefill(params, state, np.ones((2, 7), np.int32), np.array([7, 7]))


@pytest.mark.parametrize("num_new, match", [
    (np.array([4, 1]), r"num_new must be in \[0, T=3\]; got \[4, 1\]"),
    (np.array([-1, 1]), r"num_new must be in \[0, T=3\]"),
    (np.array([1, 1, 1]), r"num_new must be \[B\] integers; got num_new.shape=\(3,\)"),
    (np.array([1.0, 1.0]), r"num_new must be \[B\] integers; .*float64"),
])
def test_prefill_rejects_bad_num_new(params, num_new, match):
    with pytest.raises(ValueError, match=match):
        jd.prefill(params, fresh(), np.ones((2, 3), np.int32), num_new)


def test_prefill_rejects_batch_mismatch_and_bad_shapes(params):
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\] with B = 3 \(the state's "
                                         r"batch size\)"):
        jd.prefill(params, fresh(batch=3), np.ones((2, 3), np.int32), np.array([3, 3]))
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        jd.prefill(params, fresh(), np.ones((2, 0), np.int32), np.array([0, 0]))
    with pytest.raises(ValueError, match=r"token ids must be integers"):
        jd.prefill(params, fresh(), np.ones((2, 3)), np.array([3, 3]))


def test_decode_rejects_host_token_ids_and_shapes(params):
    _, state = jd.prefill(params, fresh(max_len=4), np.ones((2, 4), np.int32), np.array([4, 1]))
    for bad in (np.array([0, 300]), [0, -1], (0, 10**6)):  # host ids (numpy, list, tuple)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=300\)"):
            jd.decode_step(params, state, bad)
    with pytest.raises(ValueError, match=r"token ids must be integers"):
        jd.decode_step(params, state, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"tokens must be \[B\] with B = 2"):
        jd.decode_step(params, state, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"tokens must be \[B\] with B = 2"):
        jd.decode_step(params, state, np.array([[0, 1]]))
    with pytest.raises(ValueError, match=r"active must be \[B\] like tokens"):
        jd.decode_step(params, state, np.array([0, 1]), active=np.array([True]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # raised before donating
    # an inactive row's id is padding: not checked
    _, state = jd.decode_step(params, state, np.array([300, 1]), active=np.array([False, True]))
    np.testing.assert_array_equal(np.asarray(state.lengths), [4, 2])


def _snapshot(state):
    return jax.tree.map(lambda x: np.asarray(x).copy(), state)


def _assert_rows(before, after, untouched, moved):
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        new = np.asarray(new)
        for r in untouched:
            np.testing.assert_array_equal(new[r], old[r])
        assert np.isfinite(new).all()  # no NaN written into any state
    np.testing.assert_array_equal(np.asarray(after.lengths),
                                  np.asarray(before.lengths) + np.isin(
                                      np.arange(len(before.lengths)), moved))


@pytest.mark.parametrize("how", ["top-level", "jit"])
def test_decode_on_a_full_cache_gives_nan_and_leaves_the_row_untouched(params, how):
    """No device read per step (issue 16): a row whose cache is full is rejected in the graph
    (NaN logits, state and lengths untouched), not by a host ValueError; the other rows run."""
    _, state = jd.prefill(params, fresh(max_len=4), np.ones((2, 4), np.int32), np.array([4, 1]))
    before = _snapshot(state)
    step = jd.decode_step if how == "top-level" else jax.jit(jd.decode_step)
    logits, state = step(params, state, np.array([0, 1], np.int32))
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()
    _assert_rows(before, state, untouched=[0], moved=[1])
    np.testing.assert_array_equal(np.asarray(state.lengths), [4, 2])
    # The full row may sit out while the other row continues (finite logits, zeros for it).
    logits, state = jd.decode_step(params, state, np.array([0, 1]), active=np.array([False, True]))
    assert not np.asarray(logits)[0].any() and np.isfinite(np.asarray(logits)[1]).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [4, 3])


@pytest.mark.parametrize("how", ["top-level", "jit"])
@pytest.mark.parametrize("bad", [-1, -300, 300, 2**31 - 1])
def test_device_token_ids_out_of_range_give_nan_and_leave_the_row_untouched(params, bad, how):
    """Token ids on the device are not read back on the host: an id outside the vocabulary
    (negative ones too, which a gather would wrap) gives that row NaN logits and leaves it
    untouched (no NaN written, no advance)."""
    _, state = jd.prefill(params, fresh(), np.ones((2, 3), np.int32), np.array([3, 3]))
    before = _snapshot(state)
    tokens = jnp.asarray([bad, 5], jnp.int32)  # a device array
    step = jd.decode_step if how == "top-level" else jax.jit(jd.decode_step)
    logits, state = step(params, state, tokens)
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()
    _assert_rows(before, state, untouched=[0], moved=[1])
    np.testing.assert_array_equal(np.asarray(state.lengths), [3, 4])


def test_rejected_row_next_to_a_good_row_does_not_change_the_good_rows_result(params):
    """The NaN of a rejected row stays in its row: the other row's logits and state equal the
    same step with the bad row inactive."""
    _, state = jd.prefill(params, fresh(), np.ones((2, 3), np.int32), np.array([3, 3]))
    twin = jax.tree.map(jnp.copy, state)
    bad_logits, bad_state = jd.decode_step(params, state, jnp.asarray([300, 5], jnp.int32))
    ok_logits, ok_state = jd.decode_step(params, twin, jnp.asarray([0, 5], jnp.int32),
                                         active=np.array([False, True]))
    np.testing.assert_array_equal(np.asarray(bad_logits)[1], np.asarray(ok_logits)[1])
    for a, b in zip(jax.tree.leaves(bad_state), jax.tree.leaves(ok_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unchecked_prefill_lengths_outside_the_tokens_are_rejected_in_graph(params):
    from jaxdecode import model
    state = fresh(batch=3)
    logits, state = jax.jit(model.prefill_fn)(params, state, np.ones((3, 4), np.int32),
                                              np.array([6, -2, 4], np.int32))
    logits = np.asarray(logits)
    assert np.isnan(logits[:2]).all() and np.isfinite(logits[2]).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [0, 0, 4])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_state_dtype_and_lengths_are_checked(params):
    bf16 = jd.init_state(CONFIG, batch_size=2, max_len=16, dtype="bfloat16")
    for call in (lambda s: jd.decode_step(params, s, np.array([0, 1])),
                 lambda s: jd.prefill(params, s, np.ones((2, 1), np.int32), np.array([1, 1]))):
        with pytest.raises(ValueError, match=r"dtype \['bfloat16'\] != the params' dtype "
                                             r"float32"):
            call(bf16)
    with pytest.raises(ValueError, match=r"state dtype=int32 must be float32 or bfloat16"):
        jd.init_state(CONFIG, batch_size=2, max_len=16, dtype="int32")
    # prefill reads the lengths once (decode_step does not read the device)
    for lengths in ([-1, 2], [0, 17]):
        bad = fresh().replace(lengths=jnp.asarray(lengths, jnp.int32))
        with pytest.raises(ValueError, match=r"state.lengths must be in \[0, max_len=16\]"):
            jd.prefill(params, bad, np.ones((2, 1), np.int32), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"lengths must be int32, got int64"):
        jd.decode_step(params, fresh().replace(lengths=np.zeros(2, np.int64)), np.array([0, 1]))
    # numpy integers are integers
    assert jd.init_state(CONFIG, np.int64(2), np.int32(8)).max_len == 8
    assert jd.fork(fresh(), np.int64(2)).batch_size == 4


def test_state_for_another_config(params):
    other = dataclasses.replace(CONFIG, num_key_value_heads=1)
    state = jd.init_state(other, batch_size=2, max_len=16)
    with pytest.raises(ValueError, match=r"state does not match params.config: kv_cache shape"):
        jd.decode_step(params, state, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"state does not match params.config: kv_cache shape"):
        jd.prefill(params, state, np.ones((2, 1), np.int32), np.array([1, 1]))
    fewer = dataclasses.replace(CONFIG, num_hidden_layers=4, layer_types=CONFIG.layer_types[:4])
    with pytest.raises(ValueError, match=r"state has 3 conv / 3 recurrent states but the config "
                                         r"has 6 linear_attention layers"):
        jd.decode_step(params, jd.init_state(fewer, 2, 16), np.array([0, 1]))


# ----- config ----------------------------------------------------------------------------------

def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen9'"):
        jd.Config.from_preset("qwen9")
    base = jd.Config.from_preset("qwen3.5-0.8b").to_hf_config()
    with pytest.raises(ValueError, match=r"mixture-of-experts"):
        jd.Config.from_hf_config({**base, "model_type": "qwen3_5_moe_text", "num_experts": 8})
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
    for name in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "tiny"):
        c = jd.Config.from_preset(name)
        assert jd.Config.from_hf_config(c.to_hf_config()) == c
        hash(c)  # valid jit static
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False,
               "text_config": {**jd.Config.from_preset("qwen3.5-9b").to_hf_config(),
                               "model_type": "qwen3_5_text"}}
    assert jd.Config.from_hf_config(wrapped) == jd.Config.from_preset("qwen3.5-9b")


def test_presets_match_published_configs():
    """The presets equal the reconstructed published configs (copied from shared/docs/configs)."""
    import pathlib
    docs = pathlib.Path(__file__).resolve().parent / "data" / "configs"
    for name in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b"):
        published = jd.Config.from_json_file(docs / f"{name}.json")
        assert published == jd.Config.from_preset(name), name


def test_init_state_errors():
    with pytest.raises(ValueError, match=r"max_len=0 must be a positive int"):
        jd.init_state(CONFIG, batch_size=1, max_len=0)
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings"):
        jd.init_state(CONFIG, batch_size=1, max_len=CONFIG.max_position_embeddings + 1)


# ----- checkpoints -----------------------------------------------------------------------------

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


def test_hf_layout_round_trip(params):
    from jaxdecode.params import params_from_flat, params_from_hf, params_to_flat
    for back in (params_from_hf(params.config, params_to_hf(params)),
                 params_from_flat(params.config, params_to_flat(params))):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not np.array_equal(np.asarray(params_to_hf(params)[qkv]),
                              np.asarray(params_to_flat(params)[qkv]))  # the layouts differ


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
    assert f"tensor {q} has shape (7, 5), expected (512, 128)" in msg
    assert "unexpected tensor model.layers.0.mlp.bias with shape (3,)" in msg


def test_checkpoint_duplicates_and_non_float_tensors(tmp_path, params):
    emb = "model.embed_tokens.weight"
    extra = {"model.language_model.embed_tokens.weight": np.zeros((300, 128), np.float32)}
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
                                         r"\(300, 128\)"):
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


def test_checkpoint_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf_config()))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_checkpoint(tmp_path)

