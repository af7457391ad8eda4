"""The one-kernel Gated DeltaNet decode core against a float64 numpy version of the whole core.

"interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI); "gpu" compiles it
(``@pytest.mark.gpu``, skipped without an sm_90 GPU). Its CUDA lowering at the published shapes,
with the state updated in place, is checked on CPU in tests/test_gpu_lowering.py. The reference
is checked against the model's own decode math (``model.gated_delta_net``, decode=True).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import model
from jaxdecode.kernels import choice
from jaxdecode.kernels import deltanet_decode as dnd
from jaxdecode.kernels.deltanet_decode import (deltanet_decode_pallas, deltanet_decode_reference,
                                               deltanet_decode_xla)
from jaxdecode.kernels.gated_delta_decode import gated_delta_decode_reference
from test_decode_attention import MODES  # interpret / gpu (skipped without an sm_90 GPU)
from test_gated_delta import numpy_recurrence

f32, bf16 = jnp.float32, jnp.bfloat16
ARG_NAMES = ("mixed_qkv", "a", "b", "active", "positions", "conv_state", "recurrent_state",
             "conv_weight", "A_log", "dt_bias")


def random_core_inputs(seed, batch, hk, hv, dk, dv, kc, active, dtype=f32, param_dtype=None):
    """Fresh random inputs of the decode core (no zeros). The conv weight, A_log and dt_bias
    are spread so that the decay exp(g) ranges from ~1 down to ~e^-30."""
    rng = np.random.default_rng(seed)
    param_dtype = param_dtype or dtype
    channels = hk * (2 * dk + (hv // hk) * dv)
    arrays = dict(
        mixed_qkv=(rng.standard_normal((batch, channels)), dtype),
        a=(2.0 * rng.standard_normal((batch, hv)), dtype),
        b=(2.0 * rng.standard_normal((batch, hv)), dtype),
        active=(np.asarray(active, bool), jnp.bool_),
        # positions from 0 (the window wraps to slots of positions before 0) to past several
        # turns of the ring
        positions=(rng.integers(0, 4 * kc + 3, batch), jnp.int32),
        conv_state=(rng.standard_normal((batch, kc, channels)), dtype),
        recurrent_state=(rng.standard_normal((batch, hv, dk, dv)), f32),
        conv_weight=(0.6 * rng.standard_normal((channels, kc)), param_dtype),
        A_log=(rng.uniform(-1.5, 1.5, hv), f32),  # float32 in the published checkpoints
        dt_bias=(rng.standard_normal(hv), param_dtype),
    )
    assert arrays["active"][0].shape == (batch,)
    return [jnp.asarray(x, d) for x, d in arrays.values()]


def numpy_core(mixed_qkv, a, b, active, positions, conv_state, recurrent_state, conv_weight, A_log,
               dt_bias, *, num_key_heads):
    """Float64 version of the whole core (spec §1.4): conv + silu, split, gating, L2 norms,
    masking of inactive rows, the GQA delta rule (value head h reads key head h // r) and the
    new conv ring. Inputs already rounded to their dtypes; no intermediate rounding."""
    mixed, a, b, conv_state, state, w, A_log, dt_bias = (
        np.asarray(x, np.float64) for x in (mixed_qkv, a, b, conv_state, recurrent_state,
                                            conv_weight, A_log, dt_bias))
    active, positions = np.asarray(active), np.asarray(positions)
    batch, hv, dk, dv = state.shape
    hk, r, kc = num_key_heads, hv // num_key_heads, conv_state.shape[1]
    # the window: positions n-Kc+1 .. n-1, position p in ring slot p mod Kc
    rows = np.arange(batch)[:, None]
    slots = (positions[:, None] - kc + 1 + np.arange(kc - 1)[None, :]) % kc  # [B, Kc-1]
    hist = np.concatenate([conv_state[rows, slots], mixed[:, None]], axis=1)  # [B, Kc, C]
    conv = np.einsum("btc,ct->bc", hist, w)
    x = conv / (1.0 + np.exp(-conv))  # silu
    grouped = x.reshape(batch, hk, 2 * dk + r * dv)
    q, k = grouped[..., :dk], grouped[..., dk:2 * dk]
    v = grouped[..., 2 * dk:].reshape(batch, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(A_log) * np.logaddexp(0.0, a + dt_bias)
    m = active[:, None, None]
    q, k, v = (np.where(m, t, 0.0) for t in (q, k, v))
    g, beta = (np.where(active[:, None], t, 0.0) for t in (g, beta))
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    o, new_state = numpy_recurrence(q[:, None], k[:, None], v[:, None], g[:, None],
                                    beta[:, None], state)
    new_ring = conv_state.copy()
    new_ring[active, positions[active] % kc] = mixed[active]  # this token at slot n mod Kc
    return o[:, 0], new_ring, new_state


def run_pallas(mode, args, hk, block_v=None):
    fn = jax.jit(lambda *x: deltanet_decode_pallas(*x, num_key_heads=hk, block_v=block_v,
                                                   interpret=mode == "interpret"))
    return fn(*args)


def assert_close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape=} != {want.shape=}"
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max|want| {scale:.3g}"


def assert_inactive_rows_untouched(args, o, new_conv, new_state):
    """Rows that take no token: state and ring bit-exact, o == 0."""
    active = np.asarray(args[3])
    np.testing.assert_array_equal(np.asarray(new_state)[~active], np.asarray(args[6])[~active])
    np.testing.assert_array_equal(np.asarray(new_conv)[~active], np.asarray(args[5])[~active])
    assert (np.asarray(o)[~active] == 0).all()


CASES = {
    # name: (batch, Hk, Hv, dk, dv, Kc, block_v, active rows)
    "gqa-r2-16-cols": (2, 2, 4, 128, 128, 4, 16, [True, False]),
    "gqa-r2-64-cols": (3, 2, 4, 128, 128, 4, 64, [False, True, True]),
    "r1-whole-v": (2, 2, 2, 128, 128, 4, 128, [True, True]),
    "dk64-dv192-r3": (2, 1, 3, 64, 192, 4, 32, [True, False]),
    "dv-lt-dk-kc2": (1, 1, 2, 128, 64, 2, 8, [True]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_core(mode, case):
    batch, hk, hv, dk, dv, kc, block_v, active = CASES[case]
    args = random_core_inputs(sorted(CASES).index(case), batch, hk, hv, dk, dv, kc, active)
    o, new_conv, new_state = run_pallas(mode, args, hk, block_v)
    want_o, want_conv, want_state = numpy_core(*args, num_key_heads=hk)
    assert o.dtype == f32 and new_state.dtype == f32 and new_conv.dtype == args[5].dtype
    assert_close(o, want_o, 2e-5, "o")
    assert_close(new_state, want_state, 2e-5, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(new_conv), want_conv)  # a copy: exact
    assert_inactive_rows_untouched(args, o, new_conv, new_state)
    # and the XLA form (what choose_kernels falls back to) agrees with both
    ref = deltanet_decode_reference(*args, num_key_heads=hk)
    assert_close(o, ref[0], 2e-5, "o vs reference")
    assert_close(new_state, ref[2], 2e-5, "state vs reference")


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_model_matches_reference(mode):
    """bf16 activations, conv window, conv weight and dt_bias (A_log float32), as the published
    checkpoints. The kernel rounds where the reference does (silu output; the sigmoid in float32
    rounded once to bf16), so in the interpreter it agrees to float32 rounding; compiled, FMA
    contraction in the conv can flip a bf16 rounding of q, k or v, hence the looser GPU bound.
    The reference runs jitted, as the model does."""
    args = random_core_inputs(20, 3, 2, 4, 128, 128, 4, [True, False, True], dtype=bf16)
    # in 4 of the 8 active (row, head) pairs eager JAX's op-by-op bf16 sigmoid differs from
    # the once-rounded one: a kernel that rounds op by op fails here
    b = args[2][np.asarray(args[3])]
    assert (jax.nn.sigmoid(b) != jax.nn.sigmoid(b.astype(f32)).astype(bf16)).sum() == 4
    o, new_conv, new_state = run_pallas(mode, args, 2, block_v=32)
    want_o, want_conv, want_state = jax.jit(
        lambda *x: deltanet_decode_reference(*x, num_key_heads=2))(*args)
    assert new_conv.dtype == bf16
    rel = 1e-5 if mode == "interpret" else 1e-2
    assert_close(o, want_o, rel, "o")
    assert_close(new_state, want_state, rel, "recurrent_state")
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))
    assert_inactive_rows_untouched(args, o, new_conv, new_state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_v", [8, 16, 64])
def test_every_conv_channel_written(mode, block_v):
    """Each channel of the ring's new slot comes from exactly one program (v channels by their
    column block, q and k channels by the first program of their key head): with random old
    rings, any channel a program missed would keep its old value, and one written twice or
    into another slot would break a slot some window reads."""
    args = random_core_inputs(block_v, 2, 2, 4, 64, 64, 4, [True, False], dtype=bf16)
    _, new_conv, _ = run_pallas(mode, args, 2, block_v)
    _, want_conv, _ = deltanet_decode_reference(*args, num_key_heads=2)
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))


# ----- the reference is the model's decode math --------------------------------------------

def test_models_decode_equals_its_one_token_prefill():
    """The model's decode branch (kernels=XLA: deltanet_decode_xla with the callable delta rule
    gated_delta_decode_reference, the default and an explicit one) against the model's prefill
    path for the same one token: its own conv, ring update (take_along_axis), masking and
    chunked delta rule (float32), at positions on both sides of the ring's wrap."""
    config = jd.Config.from_preset("tiny")
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
            assert_close(g, w, 1e-5, f"{what} ({impl})")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the ring
        # the inactive row: ring and state untouched, output 0
        np.testing.assert_array_equal(np.asarray(got[2])[1], np.asarray(state)[1])
        np.testing.assert_array_equal(np.asarray(got[1])[1], np.asarray(conv_state)[1])
        assert (np.asarray(got[0])[1] == 0).all()
    assert not np.array_equal(np.asarray(want[2]), np.asarray(state))  # the step did something


@pytest.mark.parametrize("mode", MODES)
def test_model_decode_with_the_kernel_equals_the_reference(mode):
    """Whole decode steps (float32) with Kernels(deltanet="pallas") (the kernel; the interpreter
    on CPU; on a GPU choose_kernels' choice, which is the kernel at batch 2) against
    kernels=XLA: logits and every DeltaNet state, with an inactive row."""
    base = jd.Config.from_preset("tiny")  # its dk = 32 is below the kernel's 64: widen
    config = base.__class__(**{**base.__dict__, "vocab_size": 1000, "linear_key_head_dim": 128,
                               "linear_value_head_dim": 128})
    params = jd.init_params(config, jax.random.key(3))
    prompt = np.random.default_rng(11).integers(0, config.vocab_size, (2, 7)).astype(np.int32)
    active = [np.array([True, True]), np.array([True, False]), np.array([True, True])]

    def run(kernels):
        state = jd.init_state(config, batch_size=2, max_len=64)
        logits, state = jd.prefill(params, state, prompt, np.array([7, 4], np.int32))
        out = []
        for act in active:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, state = jd.decode_step(params, state, token, jnp.asarray(act),
                                           kernels=kernels)
            out.append(np.asarray(logits))
        return np.stack(out), state

    want_logits, want_state = run(choice.XLA)
    if mode == "gpu":
        assert jd.choose_kernels(config, 2, dtype="float32").deltanet == "pallas"
    got_logits, got_state = run(choice.Kernels(deltanet="pallas") if mode == "interpret"
                                else None)
    assert_close(got_logits, want_logits, 1e-4, "logits")
    for i, (g, w) in enumerate(zip(got_state.recurrent_state, want_state.recurrent_state)):
        assert_close(g, w, 1e-4, f"recurrent_state[{i}]")
    for i, (g, w) in enumerate(zip(got_state.conv_state, want_state.conv_state)):
        assert_close(g, w, 1e-5, f"conv_state[{i}]")


# ----- errors --------------------------------------------------------------------------------

def test_bad_inputs_raise_before_any_work():
    args = random_core_inputs(1, 2, 2, 4, 128, 128, 4, [True, False])

    def with_(name, value):
        return [value if n == name else x for n, x in zip(ARG_NAMES, args, strict=True)]

    with pytest.raises(ValueError, match=r"shapes.*mixed_qkv.*\(2, 1023\).*\(2, 1024\)"):
        deltanet_decode_pallas(*with_("mixed_qkv", args[0][:, 1:]), num_key_heads=2)
    with pytest.raises(ValueError, match=r"shapes.*conv_state"):
        deltanet_decode_pallas(*with_("conv_state", args[5][:, 1:]), num_key_heads=2)
    with pytest.raises(ValueError, match=r"shapes.*positions"):
        deltanet_decode_pallas(*with_("positions", args[4][:1]), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*positions"):
        deltanet_decode_reference(*with_("positions", args[4].astype(f32)), num_key_heads=2)
    with pytest.raises(ValueError, match="shapes.*active"):
        deltanet_decode_reference(*with_("active", args[3][:1]), num_key_heads=2)
    with pytest.raises(ValueError, match="4 value heads are not a multiple of 3 key heads"):
        deltanet_decode_pallas(*args, num_key_heads=3)
    with pytest.raises(ValueError, match="dtypes.*mixed_qkv"):
        deltanet_decode_pallas(*with_("mixed_qkv", args[0].astype(bf16)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*recurrent_state"):
        deltanet_decode_pallas(*with_("recurrent_state", args[6].astype(bf16)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*active"):
        deltanet_decode_pallas(*with_("active", args[3].astype(jnp.int32)), num_key_heads=2)
    with pytest.raises(ValueError, match="dtypes.*A_log"):
        deltanet_decode_pallas(*with_("A_log", args[8].astype(jnp.float16)), num_key_heads=2)
    with pytest.raises(ValueError, match="block_v"):
        deltanet_decode_pallas(*args, num_key_heads=2, block_v=48)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        deltanet_decode_pallas(*random_core_inputs(1, 1, 1, 1, 32, 64, 4, [True]),
                               num_key_heads=1)
    with pytest.raises(ValueError, match="at least 2"):
        deltanet_decode_pallas(*random_core_inputs(1, 1, 1, 1, 64, 64, 1, [True]),
                               num_key_heads=1)


def test_reference_takes_any_head_dims_and_kc_1():
    args = random_core_inputs(2, 2, 2, 4, 16, 24, 1, [True, False])
    o, new_conv, new_state = deltanet_decode_reference(*args, num_key_heads=2)
    want = numpy_core(*args, num_key_heads=2)
    assert new_conv.shape == (2, 1, args[0].shape[1])
    np.testing.assert_array_equal(np.asarray(new_conv), want[1])
    assert_close(o, want[0], 2e-5, "o")
    assert_close(new_state, want[2], 2e-5, "recurrent_state")


def test_empty_batch():
    args = random_core_inputs(0, 0, 1, 2, 64, 64, 4, np.zeros(0, bool))
    o, new_conv, new_state = deltanet_decode_pallas(*args, num_key_heads=1, interpret=True)
    assert o.shape == (0, 2, 64) and new_conv.shape == args[5].shape
    assert new_state.shape == args[6].shape


def test_check_supported():
    """What choose_kernels asks before picking the kernel (shapes per device, the model dtype)."""
    assert dnd.check_supported((1, 32, 128, 128), 4, bf16) is None
    assert dnd.check_supported((1, 32, 128, 128), 4, f32) is None
    assert "model dtype float16" in dnd.check_supported((1, 32, 128, 128), 4, jnp.float16)
    assert "not a multiple of 64" in dnd.check_supported((1, 2, 32, 48), 4, bf16)
    assert "at least 2" in dnd.check_supported((1, 2, 64, 64), 1, bf16)
