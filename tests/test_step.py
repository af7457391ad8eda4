"""jaxdecode.step, the entry points: jd.prefill and jd.decode_step.

* the jitted forms (step.jit_prefill / jit_decode_step): the state donated and aliased in
  place, COMPILER_OPTIONS, one executable for every step;
* called with traced arguments (a user's jit, grad, scan, eval_shape) they run the pure
  functions of jaxdecode.model inline, with the top-level results;
* host validation before any device work: prefill reads the lengths once and raises for
  everything; decode_step reads nothing back (issue 16): what it cannot check on the host (a
  full cache, device token ids out of the vocabulary) gives that row NaN logits and leaves it
  untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import FULL, GPU_ONLY, LIN, ROOT, aliased_parameters, tiny
from jaxdecode import model, step

CONFIG = tiny(vocab_size=300)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(1))


def fresh(batch=2, max_len=16):
    return jd.init_state(CONFIG, batch_size=batch, max_len=max_len)


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


# ----- the jitted entry points ----------------------------------------------------------------

@pytest.mark.perf
def test_compiled_decode_step_aliases_every_state_leaf(params):
    _, state = _prefilled(params)
    tokens = jnp.zeros((2,), jnp.int32)
    compiled = step.jit_decode_step(CONFIG, _kernels()).lower(params, state, tokens,
                                                              None).compile()
    aliased = aliased_parameters(compiled.as_text())
    n_params = len(jax.tree.leaves(params))
    n_state = len(jax.tree.leaves(state))
    state_params = set(range(n_params, n_params + n_state))
    assert state_params <= aliased, f"state parameters not aliased: {state_params - aliased}"


@pytest.mark.perf
def test_compiled_prefill_aliases_every_state_leaf(params):
    state = jd.init_state(CONFIG, batch_size=2, max_len=64)
    tokens, num_new = jnp.zeros((2, 5), jnp.int32), jnp.array([5, 2], jnp.int32)
    for return_all_logits in (False, True):
        compiled = step.jit_prefill(CONFIG, None, return_all_logits).lower(
            params, state, tokens, num_new).compile()
        aliased = aliased_parameters(compiled.as_text())
        n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
        assert set(range(n_params, n_params + n_state)) <= aliased


@pytest.mark.perf
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
    # ... whatever the spelling: defaults given or left out, positional or keyword
    assert step.jit_decode_step(CONFIG, kernels=_kernels(), logits_out=False, mtp=False) is decode
    assert step.jit_prefill(CONFIG) is step.jit_prefill(config=CONFIG, mesh=None, query_block=512)
    assert step.jit_prefill(CONFIG, mtp=True) is not step.jit_prefill(CONFIG)
    # top level, the entry point runs that jitted function (built once, then cached)
    calls = step.jit_decode_step.cache_info()
    jd.decode_step(params, _copy(state), tokens)
    after = step.jit_decode_step.cache_info()
    assert (after.hits, after.misses) == (calls.hits + 1, calls.misses)
    assert decode._cache_size() >= 1


@pytest.mark.slow
def test_decode_step_traced_inlines_the_pure_function(params):
    """jd.decode_step called with traced arguments (a user's jit, grad, scan, eval_shape)
    runs model.decode_step_fn inline (a nested library jit would raise: compiler_options) and
    gives the top-level result, also with params and state closed over (only the tokens
    traced). Everything closed over: the xfail below."""
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_decode_step_rejects_kernels_that_are_not_a_kernels_value(params):
    state = jd.init_state(CONFIG, 1, 64)
    for bad in ("pallas", {"attention": "pallas"}):
        with pytest.raises(ValueError, match=r"kernels=.* must be a jaxdecode.Kernels"):
            jd.decode_step(params, state, [1], kernels=bad)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # before any device work


@pytest.mark.perf
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


def test_decode_step_writes_the_logits_into_out(params):
    """out=: the logits land in the donated buffer (aliased in the compiled step, `out` deleted
    after the call), equal to a step without it, one executable for every call."""
    logits, state = _prefilled(params)
    want_logits, want_state = jd.decode_step(params, _copy(state), jnp.argmax(logits, -1))
    buf = jnp.copy(logits)
    got, state = jd.decode_step(params, state, jnp.argmax(logits, -1), out=buf)
    assert buf.is_deleted(), "out was not donated"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_logits))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jitted = step.jit_decode_step(CONFIG, _kernels(), logits_out=True)
    compiled = jitted.lower(params, state, jnp.zeros((2,), jnp.int32), None, got).compile()
    out_index = len(jax.tree.leaves((params, state))) + 1  # after params, state and tokens
    assert out_index in aliased_parameters(compiled.as_text())
    size = jitted._cache_size()
    for _ in range(3):
        got, state = jd.decode_step(params, state, jnp.argmax(got, -1).astype(jnp.int32),
                                    out=got)
    assert jitted._cache_size() == size


def test_decode_step_rejects_a_bad_out(params):
    logits, state = _prefilled(params)
    tokens = jnp.zeros((2,), jnp.int32)
    for bad in (np.zeros((2, 300), np.float32), jnp.zeros((2, 299)), jnp.zeros((3, 300)),
                jnp.zeros((2, 300), jnp.bfloat16)):
        with pytest.raises(ValueError, match="out must be a float32 jax.Array of shape"):
            jd.decode_step(params, state, tokens, out=bad)
    used = jnp.copy(logits)
    logits, state = jd.decode_step(params, state, tokens, out=used)
    with pytest.raises(ValueError, match="out was donated"):
        jd.decode_step(params, state, tokens, out=used)


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


@pytest.mark.slow
def test_rollout_example_scans_decode_steps():
    """examples/rollout.py: decode steps (model.decode_step_fn) and sampling in a user's
    lax.scan, compiled with COMPILER_OPTIONS."""
    import importlib.util
    path = ROOT / "examples" / "rollout.py"
    spec = importlib.util.spec_from_file_location("rollout_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tokens, state = mod.main(["--batch", "3", "--steps", "5"])
    assert tokens.shape == (3, 5)
    assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 248_320)).all()
    np.testing.assert_array_equal(np.asarray(state.lengths), [13, 13, 13])


# ----- validation (host) and the in-graph guard ------------------------------------------------

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
    # ragged rows: the layout named, not numpy's "inhomogeneous shape"
    with pytest.raises(ValueError, match=r"tokens must be a \[B, T\] integer array \(each row "
                                         r"right-padded to T; num_new\[b\] of row b's are real\); "
                                         r"got nested sequences of unequal lengths"):
        jd.prefill(params, fresh(), [[1, 2, 3], [4, 5]], [3, 2])
    with pytest.raises(ValueError, match=r"num_new must be a \[B\] integer array; got nested"):
        jd.prefill(params, fresh(), np.ones((2, 3), np.int32), [[3], [1, 2]])


def test_decode_rejects_host_token_ids_and_shapes(params):
    _, state = jd.prefill(params, fresh(max_len=4), np.ones((2, 4), np.int32), np.array([4, 1]))
    for bad in (np.array([0, 300]), [0, -1], (0, 10**6)):  # host ids (numpy, list, tuple)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=300\)"):
            jd.decode_step(params, state, bad)
    for floats in (np.array([0.0, 1.0]), jnp.asarray([0.0, 1.0])):  # host or device: metadata
        with pytest.raises(ValueError, match=r"token ids must be integers, got dtype float"):
            jd.decode_step(params, state, floats)
    with pytest.raises(ValueError, match=r"tokens must be \[B\] with B = 2"):
        jd.decode_step(params, state, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"tokens must be \[B\] with B = 2"):
        jd.decode_step(params, state, np.array([[0, 1]]))
    with pytest.raises(ValueError, match=r"active must be \[B\] like tokens"):
        jd.decode_step(params, state, np.array([0, 1]), active=np.array([True]))
    with pytest.raises(ValueError, match=r"active must be a \[B\] bool array"):
        jd.decode_step(params, state, np.array([0, 1]), active=np.array([0.5, 0]))
    with pytest.raises(ValueError, match=r"tokens must be a \[B\] integer array; got nested"):
        jd.decode_step(params, state, [[0], [1, 2]])
    with pytest.raises(ValueError, match=r"active must be a \[B\] bool array; got nested"):
        jd.decode_step(params, state, np.array([0, 1]), active=[[True], [True, False]])
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # raised before donating
    # an inactive row's id is padding: not checked
    _, state = jd.decode_step(params, state, np.array([300, 1]), active=np.array([False, True]))
    np.testing.assert_array_equal(np.asarray(state.lengths), [4, 2])


def test_decode_step_takes_host_token_ids_as_lists_and_tuples(params):
    """Token ids as a list, a tuple, numpy or a device array: the same step."""
    _, state = _prefilled(params)
    results = []
    for tokens in ([3, 7], (3, 7), np.array([3, 7]), jnp.asarray([3, 7], jnp.int32)):
        logits, new = jd.decode_step(params, _copy(state), tokens)
        results.append(np.asarray(logits))
        np.testing.assert_array_equal(np.asarray(new.lengths), [10, 5])
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


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


def test_state_dtype_and_lengths_are_checked(params):
    bf16 = jd.init_state(CONFIG, batch_size=2, max_len=16, dtype="bfloat16")
    for call in (lambda s: jd.decode_step(params, s, np.array([0, 1])),
                 lambda s: jd.prefill(params, s, np.ones((2, 1), np.int32), np.array([1, 1]))):
        with pytest.raises(ValueError, match=r"dtype \['bfloat16'\] != the params' dtype "
                                             r"float32"):
            call(bf16)
    # prefill reads the lengths once (decode_step does not read the device)
    for lengths in ([-1, 2], [0, 17]):
        bad = fresh().replace(lengths=jnp.asarray(lengths, jnp.int32))
        with pytest.raises(ValueError, match=r"state.lengths must be in \[0, max_len=16\]"):
            jd.prefill(params, bad, np.ones((2, 1), np.int32), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"lengths must be int32, got int64"):
        jd.decode_step(params, fresh().replace(lengths=np.zeros(2, np.int64)), np.array([0, 1]))


def test_state_for_another_config(params):
    other = tiny(vocab_size=300, num_key_value_heads=1)
    state = jd.init_state(other, batch_size=2, max_len=16)
    with pytest.raises(ValueError, match=r"state does not match params.config: kv_cache shape"):
        jd.decode_step(params, state, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"state does not match params.config: kv_cache shape"):
        jd.prefill(params, state, np.ones((2, 1), np.int32), np.array([1, 1]))
    more = tiny(vocab_size=300, num_hidden_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2)
    with pytest.raises(ValueError, match=r"state has 6 conv / 6 recurrent states but the config "
                                         r"has 3 linear_attention layers"):
        jd.decode_step(params, jd.init_state(more, 2, 16), np.array([0, 1]))


# ----- chunked prefill (issue 25) ----------------------------------------------------------------

@pytest.mark.perf
def test_chunked_prefill_reuses_one_executable_for_every_length():
    """jd.prefill(prefill_chunk_size=64): prompts of 150 and 300 tokens run as [B, 64]
    continuations of one executable, each equal to one call (last-token and all logits, state);
    rows finish in different chunks, one row has no tokens."""
    config = tiny(vocab_size=301)  # its own jit caches: only this test's calls are counted
    params = jd.init_params(config, jax.random.key(4))
    rng = np.random.default_rng(7)
    for length, num_new in ((150, [150, 0, 77]), (300, [300, 130, 1])):
        tokens = rng.integers(0, config.vocab_size, (3, length)).astype(np.int32)
        num_new = np.array(num_new, np.int32)
        for all_logits in (False, True):
            want, want_state = jd.prefill(params, jd.init_state(config, 3, 320), tokens,
                                          num_new, return_all_logits=all_logits)
            got, got_state = jd.prefill(params, jd.init_state(config, 3, 320), tokens, num_new,
                                        return_all_logits=all_logits, prefill_chunk_size=64)
            assert got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5,
                                       atol=2e-5 * np.abs(np.asarray(want)).max())
            for a, b in zip(jax.tree.leaves(want_state), jax.tree.leaves(got_state)):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    kernels = jd.choose_kernels(config, 3, dtype="float32")
    for all_logits in (False, True):  # [3, 64] for both lengths, [3, 150] and [3, 300] whole
        assert step.jit_prefill(config, None, all_logits, 512, kernels)._cache_size() == 3


def test_prefill_chunk_size_is_validated_and_the_budget_chooses_it(params):
    state = jd.init_state(CONFIG, 2, 256)
    tokens, num_new = np.ones((2, 200), np.int32), np.array([200, 3])
    for bad in (0, 100, -64, 64.0, True):
        with pytest.raises(ValueError, match="prefill_chunk_size=.* must be a positive multiple "
                                             "of 64"):
            jd.prefill(params, state, tokens, num_new, prefill_chunk_size=bad)
    plan = step.plan_prefill(params, 2, 200, 256, activation_budget=2**40)
    assert plan.prefill_chunk_size is None and plan.query_block == 512  # all at once
    small = step.plan_prefill(params, 2, 200, 256, activation_budget=plan.bytes // 2)
    assert small.prefill_chunk_size in (64, 128) and small.bytes <= plan.bytes // 2
    with pytest.raises(ValueError, match=r"needs .* MiB of activations even in 64-token chunks"):
        jd.prefill(params, state, tokens, num_new, activation_budget=1000)
    # a budget that forces chunks gives the same logits as one call
    want, _ = jd.prefill(params, jd.init_state(CONFIG, 2, 256), tokens, num_new)
    got, _ = jd.prefill(params, jd.init_state(CONFIG, 2, 256), tokens, num_new,
                        activation_budget=small.bytes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5,
                               atol=2e-5 * np.abs(np.asarray(want)).max())


# ----- GPU only: what CPU CI cannot compile -----------------------------------------------------

@pytest.mark.parametrize("_", [pytest.param(None, id="gpu", marks=GPU_ONLY)])
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_compiles_a_decode_step_with_an_active_mask(_, rows):
    """On a GPU, a traced ``active`` mask at batch 1 (how generate steps) compiles (XLA GPU, jax
    0.11.2, failed to when the masks were ``int(active) > 0``: model._forward builds them from
    the boolean ``active``); the active row gets the logits of the same step without a mask, an
    inactive row is left untouched."""
    params = jd.init_params(CONFIG, jax.random.key(3), "float32")
    prompt = np.random.default_rng(rows).integers(0, CONFIG.vocab_size, (rows, 5))
    tokens = jnp.array([7, 9][:rows])
    results = []
    for active in (jnp.array([True, False][:rows]), None):
        state = jd.init_state(CONFIG, rows, 64)
        _, state = jd.prefill(params, state, prompt, np.full(rows, 5))
        logits, state = jd.decode_step(params, state, tokens, active)
        results.append((np.asarray(logits), np.asarray(state.lengths)))
    (masked, masked_len), (plain, plain_len) = results
    np.testing.assert_allclose(masked[0], plain[0], rtol=1e-5, atol=1e-5 * np.abs(plain).max())
    assert masked_len[0] == 6 and plain_len[0] == 6
    if rows == 2:
        assert masked_len[1] == 5 and not masked[1].any()


# ----- what a new user meets (issue 22)

@pytest.fixture(scope="module")
def user_params():
    return jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(0), "float32")


DONATED = r"was donated to an earlier call \(prefill, decode_step, generate"


def test_a_donated_state_is_named(user_params):
    state = jd.init_state(user_params.config, 1, 64, dtype=user_params.dtype)
    logits, new_state = jd.prefill(user_params, state, np.array([[5, 6]]), np.array([2]))
    for call in (lambda: jd.decode_step(user_params, state, np.array([1])),
                 lambda: jd.prefill(user_params, state, np.array([[1]]), np.array([1])),
                 lambda: jd.fork(state, 2)):
        with pytest.raises(ValueError, match=DONATED):
            call()
    logits, new_state = jd.decode_step(user_params, new_state, np.array([1]))  # the returned one works
    assert int(new_state.lengths[0]) == 3


def test_full_cache_row_gives_nan_then_minus_one_and_stays_put(user_params):
    """A step past the cache: NaN logits for that row only, its state untouched; the sampler
    turns the row into -1, which the next step rejects again (no silent token 0)."""
    state = jd.init_state(user_params.config, 2, 4, dtype=user_params.dtype)
    logits, state = jd.prefill(user_params, state, np.array([[1, 2, 3, 4], [1, 2, 0, 0]]),
                               np.array([4, 2]))
    logits, state = jd.decode_step(user_params, state, jnp.array([7, 7]))
    assert np.isnan(np.asarray(logits[0])).all() and np.isfinite(np.asarray(logits[1])).all()
    assert np.asarray(state.lengths).tolist() == [4, 3]
    token = jd.sample(logits, jax.random.key(0), jd.SamplingParams.create())
    assert int(token[0]) == -1
    logits, state = jd.decode_step(user_params, state, token)
    assert np.isnan(np.asarray(logits[0])).all() and np.asarray(state.lengths).tolist() == [4, 4]


def test_float_token_ids_on_the_device_are_rejected(user_params):
    state = jd.init_state(user_params.config, 2, 16, dtype=user_params.dtype)
    with pytest.raises(ValueError, match="token ids must be integers, got dtype float32"):
        jd.decode_step(user_params, state, jnp.array([1.5, 2.0]))
    logits, state = jd.decode_step(user_params, state, jnp.array([1, 2]))  # not donated by the error
    assert logits.shape == (2, user_params.config.vocab_size)


def test_abstract_params_or_state_are_refused_on_the_host(params):
    state = jd.init_state(CONFIG, 2, 64)
    abstract_params = jax.eval_shape(lambda: params)
    abstract_state = jax.eval_shape(lambda: state)
    tokens, num_new = np.ones((2, 3), np.int32), np.array([3, 2])
    for p, s, what in ((abstract_params, state, "params"), (params, abstract_state, "state")):
        with pytest.raises(ValueError, match=rf"the {what} are abstract"):
            jd.prefill(p, s, tokens, num_new)
        with pytest.raises(ValueError, match=rf"the {what} are abstract"):
            jd.decode_step(p, s, np.ones(2, np.int32))
    # inside eval_shape (tracers) both are the pure functions
    logits, _ = jax.eval_shape(lambda p, s: jd.prefill(p, s, tokens, num_new), params, state)
    assert logits.shape == (2, CONFIG.vocab_size)


def test_a_state_or_params_of_another_type_are_named(user_params):
    """The (logits, state) pair prefill returns, passed on whole, or params swapped with the
    state: one ValueError naming the type, from every entry point (not an AttributeError)."""
    state = jd.init_state(user_params.config, 1, 16, dtype=user_params.dtype)
    pair = jd.prefill(user_params, state, np.array([[5, 6]]), np.array([2]))
    for call in (lambda: jd.decode_step(user_params, pair, np.array([1])),
                 lambda: jd.prefill(user_params, pair, np.array([[1]]), np.array([1])),
                 lambda: jd.fork(pair, 2),
                 lambda: jd.generate(user_params, [[1]], 2, state=pair)):
        with pytest.raises(ValueError, match=r"state must be a jaxdecode.DecodeState; got tuple "
                                             r"\(prefill and decode_step return \(logits, state\)"):
            call()
    for call in (lambda: jd.decode_step(pair[1], user_params, np.array([1])),
                 lambda: jd.generate(pair[1], [[1]], 2),
                 lambda: jd.generate(pair[1], [[1]], 2, num_speculative_tokens=1),
                 lambda: jd.score(pair[1], [[1]], [[2]])):
        with pytest.raises(ValueError, match="params must be jaxdecode.Params .* got DecodeState"):
            call()


def test_a_state_copied_to_the_host_continues_as_on_the_device(user_params):
    """jax.device_get of a state (numpy leaves, e.g. a saved rollout) is a state every entry
    point takes, with the device state's results."""
    tokens, num_new = np.array([[5, 6, 7], [8, 9, 0]]), np.array([3, 2])
    state = jd.init_state(user_params.config, 2, 32, dtype=user_params.dtype)
    _, state = jd.prefill(user_params, state, tokens, num_new)
    host = jax.device_get(state)
    assert isinstance(host.lengths, np.ndarray)
    copy = jax.tree.map(jnp.copy, state)
    want, _ = jd.prefill(user_params, copy, tokens, num_new)
    got, _ = jd.prefill(user_params, jax.device_get(state), tokens, num_new)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    logits, _ = jd.decode_step(user_params, jax.tree.map(jnp.copy, state), np.array([3, 4]))
    got, _ = jd.decode_step(user_params, jax.device_get(state), np.array([3, 4]),
                            out=jnp.zeros_like(logits))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits))
    want = jd.generate(user_params, [[3], [4]], 4, state=jax.tree.map(jnp.copy, state))
    got = jd.generate(user_params, [[3], [4]], 4, state=host)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert np.asarray(got.state.lengths).tolist() == [3 + 1 + 4, 2 + 1 + 4]
