"""The compiled decode step (jaxdecode.step): donation aliases every state buffer, one executable
for all steps, the compiler options, inactive rows, use inside a user's jit/grad/scan (the pure
functions inlined), and the documented state layout."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import model, step
from jaxdecode.kernels import choice

CONFIG = jd.Config.from_preset("tiny").__class__(**{
    **jd.Config.from_preset("tiny").__dict__, "vocab_size": 1000})


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(1))


def _prefilled(params, batch=2, max_len=64, seed=0):
    rng = np.random.default_rng(seed)
    state = jd.init_state(CONFIG, batch_size=batch, max_len=max_len)
    tokens = rng.integers(0, CONFIG.vocab_size, (batch, 9)).astype(np.int32)
    num_new = np.array([9, 4, 7, 1][:batch], np.int32)
    return jd.prefill(params, state, tokens, num_new)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _kernels(batch=2):
    """What jd.decode_step runs for this batch on this machine (choose_kernels)."""
    return jd.choose_kernels(CONFIG, batch, dtype="float32")


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
    compiled = step.jit_decode_step(CONFIG, _kernels()).lower(params, state, tokens,
                                                              None).compile()
    aliased = _aliased_parameters(compiled.as_text())
    n_params = len(jax.tree.leaves(params))
    n_state = len(jax.tree.leaves(state))
    state_params = set(range(n_params, n_params + n_state))
    assert state_params <= aliased, f"state parameters not aliased: {state_params - aliased}"


def test_compiled_prefill_aliases_every_state_leaf(params):
    state = jd.init_state(CONFIG, batch_size=2, max_len=64)
    tokens, num_new = jnp.zeros((2, 5), jnp.int32), jnp.array([5, 2], jnp.int32)
    for return_all_logits in (False, True):
        compiled = step.jit_prefill(CONFIG, None, return_all_logits).lower(
            params, state, tokens, num_new).compile()
        aliased = _aliased_parameters(compiled.as_text())
        n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
        assert set(range(n_params, n_params + n_state)) <= aliased


def test_top_level_executables_carry_the_compiler_options(params):
    """step.jit_decode_step and step.jit_prefill are compiled with COMPILER_OPTIONS: JAX accepts
    compiler_options only on a top-level jit, so the jitted functions raise when nested, naming
    the options (which is why the entry points inline the pure functions when traced)."""
    assert jd.COMPILER_OPTIONS is step.COMPILER_OPTIONS
    assert dict(step.COMPILER_OPTIONS) == {"xla_gpu_dot_merger_threshold_mb": 1024}
    with pytest.raises(TypeError):
        step.COMPILER_OPTIONS["xla_gpu_dot_merger_threshold_mb"] = 1  # read-only
    _, state = _prefilled(params)
    tokens = jnp.asarray([3, 7], jnp.int32)
    decode = step.jit_decode_step(CONFIG, _kernels())
    with pytest.raises(ValueError, match=r"compiler_options.*xla_gpu_dot_merger_threshold_mb"):
        jax.jit(lambda p, s, t: decode(p, s, t, None))(params, _copy(state), tokens)
    for return_all_logits in (False, True):
        prefill = step.jit_prefill(CONFIG, None, return_all_logits)
        with pytest.raises(ValueError, match=r"compiler_options.*xla_gpu_dot_merger"):
            jax.jit(lambda p, s, t: prefill(p, s, t, jnp.ones(2, jnp.int32)))(
                params, _copy(state), tokens[:, None])
    # the builders are cached: one jitted function per (config, kernels) / (config, mesh, all)
    assert step.jit_decode_step(CONFIG, _kernels()) is decode
    assert step.jit_prefill(CONFIG, None, True) is step.jit_prefill(CONFIG, None, True)
    # top level, the entry point runs that jitted function (built once, then cached)
    calls = step.jit_decode_step.cache_info()
    jd.decode_step(params, _copy(state), tokens)
    after = step.jit_decode_step.cache_info()
    assert (after.hits, after.misses) == (calls.hits + 1, calls.misses)
    assert decode._cache_size() >= 1


def test_decode_step_traced_inlines_the_pure_function(params):
    """jd.decode_step called with traced arguments (a user's jit, grad, scan, vmap, eval_shape)
    runs model.decode_step_fn inline (a nested library jit would raise: compiler_options) and
    gives the top-level result; with everything closed over in a jit too."""
    _, state = _prefilled(params)
    tokens = jnp.asarray([3, 7], jnp.int32)
    want, want_state = model.decode_step_fn(params, _copy(state), tokens)
    top, top_state = jd.decode_step(params, _copy(state), tokens)  # the jitted, donated step
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(top), np.asarray(want), **close)

    in_jit, jit_state = jax.jit(lambda p, s, t: jd.decode_step(p, s, t))(params, _copy(state),
                                                                          tokens)
    twin = _copy(state)
    only_tokens, _ = jax.jit(lambda t: jd.decode_step(params, twin, t))(tokens)
    for got in (in_jit, only_tokens):
        np.testing.assert_allclose(np.asarray(got), np.asarray(top), **close)
    for a, b in zip(jax.tree.leaves(jit_state), jax.tree.leaves(top_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **close)

    grad = jax.grad(lambda p: jd.decode_step(p, twin, tokens)[0].sum())(params)
    want_grad = jax.grad(lambda p: model.decode_step_fn(p, twin, tokens)[0].sum())(params)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(grad))

    # three greedy steps in a scan == three top-level calls
    def body(carry, _):
        s, t = carry
        logits, s = jd.decode_step(params, s, t)
        return (s, jnp.argmax(logits, -1).astype(jnp.int32)), logits

    (scan_state, _), scan_logits = jax.lax.scan(body, (_copy(state), tokens), None, length=3)
    s, t = _copy(state), tokens
    for i in range(3):
        logits, s = jd.decode_step(params, s, t)
        np.testing.assert_allclose(np.asarray(scan_logits[i]), np.asarray(logits), **close)
        t = jnp.argmax(logits, -1).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(scan_state.lengths), np.asarray(s.lengths))

    shapes = jax.eval_shape(lambda s: jd.decode_step(params, s, tokens), twin)
    assert shapes[0].shape == (2, CONFIG.vocab_size) and shapes[0].dtype == jnp.float32
    assert not any(x.is_deleted() for x in jax.tree.leaves(twin))  # traced calls donate nothing


def test_prefill_traced_inlines_the_pure_function(params):
    """jd.prefill inside a user's jit, grad and scan: model.prefill_fn inline, the top-level
    result (last-token and all logits)."""
    _, state = _prefilled(params)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 3)), jnp.int32)
    num_new = jnp.asarray([3, 1], jnp.int32)
    close = dict(rtol=1e-5, atol=1e-5)
    for all_logits in (False, True):
        top, top_state = jd.prefill(params, _copy(state), tokens, num_new,
                                    return_all_logits=all_logits)
        in_jit, jit_state = jax.jit(lambda p, s, t, n: jd.prefill(
            p, s, t, n, return_all_logits=all_logits))(params, _copy(state), tokens, num_new)
        np.testing.assert_allclose(np.asarray(in_jit), np.asarray(top), **close)
        np.testing.assert_array_equal(np.asarray(jit_state.lengths), np.asarray(top_state.lengths))
        for a, b in zip(jax.tree.leaves(jit_state), jax.tree.leaves(top_state)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **close)
    np.testing.assert_array_equal(np.asarray(top_state.lengths), [12, 5])

    twin = _copy(state)
    grad = jax.grad(lambda p: jd.prefill(p, twin, tokens, num_new)[0].sum())(params)
    want = jax.grad(lambda p: model.prefill_fn(p, twin, tokens, num_new)[0].sum())(params)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # the prompts fed one token per scan step == one top-level prefill of all of them
    def body(s, t):
        logits, s = jd.prefill(params, s, t[:, None], jnp.ones(2, jnp.int32))
        return s, logits

    scan_state, scan_logits = jax.lax.scan(body, _copy(state), tokens.T)
    whole, whole_state = jd.prefill(params, _copy(state), tokens, jnp.full(2, 3, jnp.int32))
    np.testing.assert_allclose(np.asarray(scan_logits[-1]), np.asarray(whole), rtol=1e-4,
                               atol=1e-4 * np.abs(np.asarray(whole)).max())
    np.testing.assert_array_equal(np.asarray(scan_state.lengths), [12, 7])
    np.testing.assert_array_equal(np.asarray(whole_state.lengths), [12, 7])


@pytest.mark.xfail(strict=True, raises=(ValueError, jax.errors.TracerArrayConversionError),
                   reason="library: step.prefill/decode_step decide 'traced' from their arguments "
                          "only; inside a user's jit with every argument closed over they run the "
                          "top-level path: decode_step calls the top-level jit, which JAX refuses "
                          "(ValueError: compiler_options on a nested jit), prefill's host check "
                          "reads the lengths (TracerArrayConversionError)")
@pytest.mark.parametrize("entry", ["decode_step", "prefill"])
def test_entry_points_inside_a_jit_with_everything_closed_over(params, entry):
    _, state = _prefilled(params)
    tokens = jnp.asarray([3, 7], jnp.int32)
    if entry == "decode_step":
        want, _ = model.decode_step_fn(params, _copy(state), tokens)
        got, _ = jax.jit(lambda: jd.decode_step(params, state, tokens))()  # no tracer argument
    else:
        prompt, num_new = tokens[:, None], jnp.ones(2, jnp.int32)
        want, _ = model.prefill_fn(params, _copy(state), prompt, num_new)
        got, _ = jax.jit(lambda: jd.prefill(params, state, prompt, num_new))()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.xfail(strict=True, raises=AttributeError,
                   reason="library: jd.decode_step does not check kernels= (a str gets an "
                          "AttributeError from jit_decode_step, not a ValueError naming it)")
def test_decode_step_rejects_kernels_that_are_not_a_kernels_value(params):
    state = jd.init_state(CONFIG, 1, 64)
    with pytest.raises(ValueError, match="kernels"):
        jd.decode_step(params, state, [1], kernels="pallas")


def test_decode_steps_compile_once_and_donate(params):
    logits, state = _prefilled(params)
    jitted = step.jit_decode_step(CONFIG, _kernels())
    before = jitted._cache_size()
    builders = step.jit_decode_step.cache_info().currsize
    for _ in range(6):
        old_leaves = jax.tree.leaves(state)
        logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1).astype(jnp.int32))
        assert all(x.is_deleted() for x in old_leaves), "state buffers were not donated"
    assert jitted._cache_size() - before <= 1
    after_first = jitted._cache_size()
    for _ in range(4):
        logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1).astype(jnp.int32))
    assert jitted._cache_size() == after_first  # lengths advanced, no recompile
    assert step.jit_decode_step.cache_info().currsize == builders  # the same jitted function
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
