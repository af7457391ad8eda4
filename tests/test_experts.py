"""jaxdecode.experts: both forms of the routed experts against a float64 numpy loop over
(token, slot) pairs (HF ``Qwen3_5MoeExperts``' eager algorithm), routing skewed so the rounds
form needs several rounds, the rounds form's custom VJP against autodiff of the pairs form, and
which form runs at which size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import experts

E, H, I, K = 8, 16, 12, 3


def _weights(seed):
    k0, k1 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k0, (E, 2 * I, H)) * H**-0.5,
            jax.random.normal(k1, (E, H, I)) * I**-0.5)


def _routing(seed, n, skew):
    """x [n, H], weights [n, K] summing to 1, experts [n, K] distinct per token; ``skew``: all
    tokens but two choose experts 0, 1, 2 (groups above the rounds' capacity)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H)).astype(np.float32)
    chosen = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    if skew:
        chosen[: n - 2] = [0, 1, 2]
    w = rng.uniform(0.1, 1, (n, K)).astype(np.float32)
    return x, w / w.sum(-1, keepdims=True), chosen


def _reference(x, w, chosen, gate_up, down):
    x, w = np.float64(x), np.float64(w)
    gate_up, down = np.float64(gate_up), np.float64(down)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(K):
            e = chosen[n, slot]
            gu = gate_up[e] @ x[n]
            g, u = gu[:I], gu[I:]
            out[n] += w[n, slot] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("form", ["pairs", "rounds"])
@pytest.mark.parametrize("n,skew", [(1, False), (5, False), (40, False), (100, True)])
def test_forms_equal_a_float64_loop_over_pairs(form, n, skew):
    gate_up, down = _weights(n)
    x, w, chosen = _routing(n, n, skew)
    if skew:  # the rounds form really takes more than one round here
        assert np.bincount(chosen.ravel()).max() > experts.capacity(n * K, E)
    got = experts.routed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(chosen), gate_up,
                                 down, form=form)
    want = _reference(x, w, chosen, gate_up, down)
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert err < 1e-6, err


@pytest.mark.parametrize("skew", [False, True])
def test_rounds_vjp_equals_autodiff_of_pairs(skew):
    # skewed: expert 0's group (98 pairs) exceeds the capacity (88), so two rounds
    """Gradients of a random linear functional of the output w.r.t. x, the routing weights and
    both expert tensors: the rounds form's hand-written VJP (under jit) against JAX's autodiff
    of the pairs form."""
    gate_up, down = _weights(7)
    x, w, chosen = _routing(8, 100, skew)
    r = jax.random.normal(jax.random.key(9), (100, H))

    def loss(form):
        return lambda *a: jnp.sum(r * experts.routed_experts(*a[:2], chosen, *a[2:], form=form))

    args = (jnp.asarray(x), jnp.asarray(w), gate_up, down)
    want = jax.grad(loss("pairs"), argnums=(0, 1, 2, 3))(*args)
    got = jax.jit(jax.grad(loss("rounds"), argnums=(0, 1, 2, 3)))(*args)
    for name, g, h in zip(("x", "weights", "gate_up_proj", "down_proj"), got, want):
        err = float(jnp.max(jnp.abs(g - h)) / jnp.max(jnp.abs(h)))
        assert err < 1e-5, (name, err)


def test_form_by_size():
    """Pairs up to E pairs (decode), rounds above (prefill) or when the gathered weights
    would pass PAIRS_MAX_BYTES; the jitted pairs form has no loop, rounds one."""
    assert experts.use_pairs(E, E, 1)
    assert not experts.use_pairs(E + 1, E, 1)
    assert not experts.use_pairs(2, E, experts.PAIRS_MAX_BYTES)
    gate_up, down = _weights(1)

    def jaxpr(n):
        x, w, chosen = _routing(1, n, False)
        return str(jax.make_jaxpr(experts.routed_experts)(x, w, chosen, gate_up, down))

    assert "while" not in jaxpr(2) and "while" in jaxpr(40)
    with pytest.raises(ValueError, match="form='dense'"):
        experts.routed_experts(*_routing(1, 2, False), gate_up, down, form="dense")


@pytest.mark.parametrize("form", ["pairs", "rounds"])
def test_pairs_of_experts_outside_the_stack_add_nothing(form):
    """Expert parallelism hands each device its own experts, E/m of them, with ids shifted:
    pairs routed to another device's experts (ids outside [0, E_local)) add nothing, the rest
    equal the float64 loop over this device's pairs."""
    gate_up, down = _weights(3)
    x, w, chosen = _routing(4, 40, False)
    first = 2  # this device holds experts 2..5 of 0..7
    local = chosen - first
    here = (local >= 0) & (local < 4)
    got = experts.routed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(local),
                                 gate_up[first:first + 4], down[first:first + 4], form=form)
    want = _reference(x, np.where(here, w, 0), np.where(here, chosen, 0), gate_up, down)
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert err < 1e-6, err


def test_expert_parallel_capacity_minimises_the_slowest_devices_pairs():
    """The slots a device runs: 4 for Qwen3.5-397B-A17B's 10 pairs on 8 devices (against a
    brute-force expectation over simulated uniform routing), at least 1, at most P."""
    assert experts.expert_parallel_capacity(10, 8) == 4
    assert experts.expert_parallel_capacity(1, 8) == 1
    assert experts.expert_parallel_capacity(24, 2) <= 24
    rng = np.random.default_rng(0)
    counts = rng.binomial(10, 1 / 8, size=(20000, 8))  # per step, per device

    def slowest(c):
        return np.mean(np.where((counts <= c).all(1), c, 10))

    assert min(range(1, 11), key=slowest) == 4


@pytest.mark.parametrize("n,first,devices", [(1, 2, 2), (3, 0, 4), (6, 4, 4), (2, 6, 4)])
def test_expert_parallel_slots_equal_the_pairs_of_this_device(n, first, devices):
    """One device of ``devices`` holding E/devices experts: its pairs through the slots (or, when
    more of them than the slots, the full form) equal the float64 loop over this device's pairs;
    the step has the slots' cond. n = 6 on 4 devices of 2 experts, all routed to experts 4, 5
    (with 6): more local pairs than slots, the fallback."""
    gate_up, down = _weights(5)
    x, w, chosen = _routing(6, n, False)
    if n == 6:
        chosen[:] = [4, 5, 6]
    e = E // devices
    local = chosen - first
    here = (local >= 0) & (local < e)
    cap = experts.expert_parallel_capacity(n * K, devices)
    assert (here.sum() > cap) == (n == 6) and cap < n * K

    def run(*a):
        return experts.routed_experts(*a, out_dtype=jnp.float32, expert_parallel=devices)

    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(local), gate_up[first:first + e],
            down[first:first + e])
    assert "cond" in str(jax.make_jaxpr(run)(*args))
    got = jax.jit(run)(*args)
    want = _reference(x, np.where(here, w, 0), np.where(here, chosen, 0), gate_up, down)
    scale = np.max(np.abs(want)) or 1.0  # no pair on this device: exactly zero
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / scale
    assert err < 1e-6, (err, here.sum())
    g = jax.grad(lambda *a: jnp.sum(run(*a) ** 2), argnums=(0, 1, 3, 4))(*args)
    g_ref = jax.grad(lambda *a: jnp.sum(experts.routed_experts(
        *a[:2], jnp.asarray(local), *a[2:], form="pairs", out_dtype=jnp.float32) ** 2),
        argnums=(0, 1, 2, 3))(args[0], args[1], args[3], args[4])
    for a, b in zip(g, g_ref):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(float(jnp.max(jnp.abs(b))), 1.0)


@pytest.mark.parametrize("form,devices,n", [("pairs", 1, 5), ("rounds", 1, 5), (None, 2, 2)])
def test_block_fp8_experts_equal_their_dequantised_weights(form, devices, n):
    """Stacks of block-FP8 experts (jd.Fp8Linear [E, 2I, H] / [E, H, I], 8 x 8 blocks so the
    blocks straddle the gate/up rows and the scales differ within an expert) give the output of
    their dequantised float32 weights, in every form (None on 2 devices: the slots)."""
    from jaxdecode.quantization import Fp8Linear, quantize

    gate_up, down = _weights(11)
    fp8 = [Fp8Linear(*quantize(w, (8, 8)), block_size=(8, 8)) for w in (gate_up, down)]
    assert fp8[0].scale_inv.shape == (E, 3, 2)
    x, w, chosen = _routing(12, n, False)
    e = E // devices
    local = chosen - e  # the second device's experts when split
    stacks = [f.take(jnp.arange(e, 2 * e)) if devices > 1 else f for f in fp8]
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(local if devices > 1 else chosen))
    if devices > 1:
        assert "cond" in str(jax.make_jaxpr(functools.partial(
            experts.routed_experts, expert_parallel=devices))(*args, *stacks))
    got = experts.routed_experts(*args, *stacks, form=form, expert_parallel=devices)
    want = experts.routed_experts(*args, *(s.dequantize(jnp.float32) for s in stacks),
                                  form=form, expert_parallel=devices)
    assert float(jnp.max(jnp.abs(want))) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_rounds_vjp_with_block_fp8_stacks_flows_to_x_and_the_weights_only():
    """The rounds form with block-FP8 stacks (dequantised inside each round): gradients w.r.t. x
    and the routing weights equal autodiff of the pairs form on the dequantised stacks; the FP8
    stacks are frozen (their cotangent is zero)."""
    from jaxdecode.quantization import Fp8Linear, quantize

    stacks = [Fp8Linear(*quantize(w, (8, 8)), block_size=(8, 8)) for w in _weights(13)]
    x, w, chosen = _routing(14, 40, True)
    r = jax.random.normal(jax.random.key(15), (40, H))

    def loss(form, gate_up, down):
        return lambda x, w: jnp.sum(r * experts.routed_experts(x, w, chosen, gate_up, down,
                                                                form=form))

    args = (jnp.asarray(x), jnp.asarray(w))
    got = jax.jit(jax.grad(loss("rounds", *stacks), argnums=(0, 1)))(*args)
    want = jax.grad(loss("pairs", *(s.dequantize(jnp.float32) for s in stacks)),
                    argnums=(0, 1))(*args)
    for g, h in zip(got, want):
        assert float(jnp.max(jnp.abs(g - h)) / jnp.max(jnp.abs(h))) < 1e-5
    frozen = jax.grad(lambda s: jnp.sum(r * experts.routed_experts(
        *args, chosen, s, stacks[1], form="rounds")))(stacks[0])
    assert not np.asarray(frozen.scale_inv).any()
