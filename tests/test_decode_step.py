"""The compiled decode step: donation aliases every state buffer, one executable for all steps,
inactive rows, use inside a user's jit, and the documented state layout."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import model

CONFIG = jd.Config.from_preset("tiny").__class__(**{
    **jd.Config.from_preset("tiny").__dict__, "vocab_size": 1000})


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(1))


def _prefilled(params, batch=2, max_len=64, seed=0):
    rng = np.random.default_rng(seed)
    state = jd.init_state(CONFIG, batch_size=batch, max_len=max_len)
    tokens = rng.integers(0, CONFIG.vocab_size, (batch, 9)).astype(np.int32)
    lengths = np.array([9, 4, 7, 1][:batch], np.int32)
    return jd.prefill(params, state, tokens, lengths)


def test_state_layout_is_as_documented():
    c = CONFIG
    state = jd.init_state(c, batch_size=3, max_len=40)
    assert len(state.conv_state) == len(state.recurrent_state) == 6
    assert len(state.kv_cache) == 2
    assert state.conv_state[0].shape == (3, c.linear_conv_kernel_dim, c.linear_conv_dim)
    assert state.recurrent_state[0].shape == (3, c.linear_num_value_heads, c.linear_key_head_dim,
                                              c.linear_value_head_dim)
    assert state.recurrent_state[0].dtype == jnp.float32
    assert state.kv_cache[0].k.shape == (3, c.num_key_value_heads, 40, c.head_dim)
    assert state.lengths.shape == (3,) and state.lengths.dtype == jnp.int32
    assert state.max_len == 40 and state.batch_size == 3


def _aliased_parameters(hlo_text: str) -> set[int]:
    start = hlo_text.find("input_output_alias={")
    assert start >= 0, "the compiled module has no input_output_alias: nothing was donated"
    segment = hlo_text[start:hlo_text.find("entry_computation_layout", start)]
    return {int(m) for m in re.findall(r"\{\d*\}:\s*\((\d+),", segment)}


def test_compiled_decode_step_aliases_every_state_leaf(params):
    _, state = _prefilled(params)
    tokens = jnp.zeros((2,), jnp.int32)
    compiled = model.decode_step_jit.lower(params, state, tokens, None).compile()
    aliased = _aliased_parameters(compiled.as_text())
    n_params = len(jax.tree.leaves(params))
    n_state = len(jax.tree.leaves(state))
    state_params = set(range(n_params, n_params + n_state))
    assert state_params <= aliased, f"state parameters not aliased: {state_params - aliased}"


def test_library_jits_carry_the_compiler_options_and_compose(params):
    """decode_step_jit and prefill_jit are compiled with jd.COMPILER_OPTIONS (JAX accepts those
    only on a top-level jit: the raw jitted function raises when nested); inside a user's jit,
    grad or eager scan, and for jd.decode_step with everything closed over, they run the pure
    function instead, with the same results."""
    assert jd.COMPILER_OPTIONS == {"xla_gpu_dot_merger_threshold_mb": 1024}
    _, state = _prefilled(params)
    tokens = jnp.asarray([3, 7], jnp.int32)
    with pytest.raises(ValueError, match="compiler_options"):
        jax.jit(lambda p, s, t: model.decode_step_jit._jitted(p, s, t, None))(params, state,
                                                                               tokens)
    twin = jax.tree.map(jnp.copy, state)
    want, _ = model.decode_step_fn(params, twin, tokens)
    nested, _ = jax.jit(lambda p, s, t: model.decode_step_jit(p, s, t, None))(
        params, jax.tree.map(jnp.copy, state), tokens)
    closed, _ = jax.jit(lambda: jd.decode_step(params, twin, tokens))()  # no tracer argument
    for got in (nested, closed):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda p: model.decode_step_jit(p, twin, tokens)[0].sum())(params)
    assert np.isfinite(np.asarray(grad.norm)).all()
    prefill_logits, _ = jax.jit(lambda s: model.prefill_jit(
        params, s, tokens[:, None], jnp.ones(2, jnp.int32)))(jax.tree.map(jnp.copy, state))
    assert np.isfinite(np.asarray(prefill_logits)).all()
    top, _ = model.decode_step_jit(params, state, tokens)  # top level: the jitted function
    np.testing.assert_allclose(np.asarray(top), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_at_top_level_sees_every_transformation():
    """model.at_top_level (which picks TopLevelJit's path) reads JAX's current trace by its
    class name: this fails if a JAX upgrade renames it."""
    seen = {}

    def probe(name, x):
        seen[name] = model.at_top_level()
        return x

    probe("top", 1.0)
    jax.jit(lambda x: probe("jit", x))(1.0)
    jax.grad(lambda x: probe("grad", x))(1.0)
    jax.vmap(lambda x: probe("vmap", x))(jnp.ones(2))
    jax.lax.scan(lambda c, x: (probe("scan", c), x), 0.0, jnp.ones(2))
    jax.eval_shape(lambda x: probe("eval_shape", x), 1.0)
    assert seen == {"top": True, "jit": False, "grad": False, "vmap": False, "scan": False,
                    "eval_shape": False}


def test_decode_steps_compile_once_and_donate(params):
    logits, state = _prefilled(params)
    before = model.decode_step_jit._cache_size()
    for _ in range(6):
        old_leaves = jax.tree.leaves(state)
        logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1).astype(jnp.int32))
        assert all(x.is_deleted() for x in old_leaves), "state buffers were not donated"
    assert model.decode_step_jit._cache_size() - before <= 1
    after_first = model.decode_step_jit._cache_size()
    for _ in range(4):
        logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1).astype(jnp.int32))
    assert model.decode_step_jit._cache_size() == after_first  # lengths advanced, no recompile
    np.testing.assert_array_equal(np.asarray(state.lengths), [19, 14])


def test_inactive_rows_leave_their_state_untouched(params):
    logits, state = _prefilled(params)
    copy = jax.tree.map(lambda x: np.asarray(x).copy(), state)
    toks = jnp.argmax(logits, -1).astype(jnp.int32)
    _, new = jd.decode_step(params, state, toks, active=np.array([False, True]))
    for old, cur in zip(jax.tree.leaves(copy), jax.tree.leaves(new)):
        np.testing.assert_array_equal(np.asarray(cur)[0], old[0])
        assert not np.array_equal(np.asarray(cur)[1], old[1])  # the active row moved on
    np.testing.assert_array_equal(np.asarray(new.lengths), [9, 5])


def test_decode_step_inside_a_user_jit(params):
    logits, state = _prefilled(params)
    toks = jnp.argmax(logits, -1).astype(jnp.int32)
    twin = jax.tree.map(jnp.copy, state)

    @jax.jit
    def two_steps(p, s, t):
        l1, s = jd.decode_step(p, s, t)
        l2, s = jd.decode_step(p, s, jnp.argmax(l1, -1).astype(jnp.int32))
        return l2, s

    got, s_jit = two_steps(params, state, toks)
    l1, s_ref = jd.decode_step(params, twin, toks)
    want, s_ref = jd.decode_step(params, s_ref, jnp.argmax(l1, -1).astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(s_jit.lengths), np.asarray(s_ref.lengths))


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


def test_fork_repeats_rows(params):
    logits, state = _prefilled(params)
    forked = jd.fork(state, 3)
    assert forked.batch_size == 6
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(forked)):
        np.testing.assert_array_equal(np.repeat(np.asarray(a), 3, axis=0), np.asarray(b))


def test_init_params_shapes_follow_param_specs():
    specs = jd.param_specs(CONFIG)
    shapes = jax.eval_shape(lambda: jd.init_params(CONFIG, jax.random.key(0), "bfloat16"))
    assert shapes.layers[0].linear_attn.in_proj_qkv.shape == (CONFIG.linear_conv_dim,
                                                              CONFIG.hidden_size)
    assert shapes.layers[0].linear_attn.A_log.dtype == jnp.float32
    assert shapes.layers[3].self_attn.q_proj.dtype == jnp.bfloat16
    n = sum(int(np.prod(s.shape)) for s in specs.values())
    assert n == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def test_query_blocked_prefill_attention_equals_one_block():
    """Long prompts attend in query blocks (bounded score memory); same result as one block."""
    rng = np.random.default_rng(3)
    b, t, hq, hkv, s, d = 2, 37, 4, 2, 48, 8
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
    k[:, :, 45:] = np.nan  # unwritten slots
    v = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
    v[:, :, 45:] = np.nan
    start = np.array([3, 8])
    positions = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
    end = jnp.asarray(start + np.array([37, 30]), jnp.int32)
    one = model.causal_attention(q, jnp.asarray(k), jnp.asarray(v), positions, end,
                                 query_block=64)
    blocked = model.causal_attention(q, jnp.asarray(k), jnp.asarray(v), positions, end,
                                     query_block=8)
    assert np.isfinite(np.asarray(one)[1, :30]).all()
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("r", [1, 2, 3])
def test_conv_channel_order_groups_each_key_head(r):
    """in_proj_qkv/conv1d channels are held grouped per key head; the maps are inverse."""
    from jaxdecode.params import conv_channel_order, hf_to_internal, internal_to_hf
    c = jd.Config.from_preset("tiny").__class__(**{
        **jd.Config.from_preset("tiny").__dict__, "linear_num_value_heads": 2 * r})
    order = conv_channel_order(c)
    hk, dk, dv, ck = 2, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim
    assert sorted(order.tolist()) == list(range(c.linear_conv_dim))
    group = 2 * dk + r * dv
    # key head 1's group: its q rows, its k rows, then the v rows of value heads r .. 2r-1
    np.testing.assert_array_equal(order[group:group + dk], np.arange(dk, 2 * dk))
    np.testing.assert_array_equal(order[group + dk:group + 2 * dk], ck + np.arange(dk, 2 * dk))
    np.testing.assert_array_equal(order[group + 2 * dk:2 * group],
                                  2 * ck + np.arange(r * dv, 2 * r * dv))
    x = np.random.default_rng(0).standard_normal((c.linear_conv_dim, 3))
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    np.testing.assert_array_equal(internal_to_hf(c, name, hf_to_internal(c, name, x)), x)
    assert hf_to_internal(c, "model.layers.0.mlp.up_proj.weight", x) is x


def test_rollout_example_scans_decode_steps():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "rollout.py"
    spec = importlib.util.spec_from_file_location("rollout_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tokens, state = mod.main(["--batch", "3", "--steps", "5"])
    assert tokens.shape == (3, 5)
    assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 248_320)).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [13, 13, 13])


@pytest.mark.parametrize("kernel_size", [2, 4, 7])
def test_conv_window_slots_at_every_position(kernel_size):
    """The window of the token at position n is positions n-Kc+1 .. n-1, at slots p mod Kc (also
    for positions before 0, and without int32 overflow near 2**31)."""
    from jaxdecode.state import conv_window_slots
    lengths = [0, 1, kernel_size - 1, kernel_size, 37, 2**31 - 2, 2**31 - 1]
    got = np.asarray(conv_window_slots(jnp.asarray(lengths, jnp.int32), kernel_size))
    want = [[(n - kernel_size + 1 + t) % kernel_size for t in range(kernel_size - 1)]
            for n in lengths]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel_size", [2, 4, 7])
def test_conv_slot_position_inverts_conv_slot(kernel_size):
    """conv_slot_position(end, s) is the last position before end in ring slot s (searched
    downward in Python), also below 0 and near 2**31; and conv_slot maps it back to s."""
    from jaxdecode.state import conv_slot, conv_slot_position
    ends = [0, 1, kernel_size - 1, kernel_size, 38, 2**31 - 1]
    slots = np.arange(kernel_size, dtype=np.int32)
    got = np.asarray(conv_slot_position(jnp.asarray(ends, jnp.int32)[:, None],
                                        jnp.asarray(slots)[None, :], kernel_size))
    want = [[next(p for p in range(end - 1, end - 1 - kernel_size, -1) if p % kernel_size == s)
             for s in slots] for end in ends]
    np.testing.assert_array_equal(got, want)
    nonneg = got >= 0
    back = np.asarray(conv_slot(jnp.asarray(np.maximum(got, 0)), 0, kernel_size))
    np.testing.assert_array_equal(back[nonneg], np.broadcast_to(slots, got.shape)[nonneg])
