"""jaxdecode.kernels.grouped_linear: the MoE block's grouped linear kernel (Pallas Mosaic GPU) and
its XLA reference against float64 numpy; the MoE block through it (``choice.moe_experts``)
against the block's XLA form; its CUDA lowering and the choice (checked on CPU).

Modes (conftest.MODES): "interpret" runs the kernel in the Mosaic GPU interpreter (CPU, CI;
marked slow); "gpu" compiles it (``pytest -m gpu`` on an sm_90 machine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import MODES, assert_rel_close, lower_for_cuda_text, tiny
from jaxdecode import model
from jaxdecode.kernels import choice
from jaxdecode.kernels import grouped_linear as gl

bf16, f32 = jnp.bfloat16, jnp.float32

# (rows m, experts E, N, K, routed groups, shared piece rows, x per group, config, dtype):
# one token for all groups with a two-piece shared weight (the gate/up form); x per group with
# split-K over 3 programs and 2 stages (the down form); 17 rows, routed only, float16; a full
# 64-row tile with an uneven last split
CASES = {
    "gate-up": (1, 5, 256, 192, 3, (128, 128), False, None, bf16),
    "down-splits3": (3, 4, 128, 384, 2, (128,), True,
                     gl.GroupedLinearConfig(num_stages=2, splits=3), bf16),
    "m17-routed-float16": (17, 3, 256, 128, 3, (), True, None, jnp.float16),
    "m64-uneven": (64, 6, 128, 320, 4, (128,), True,
                   gl.GroupedLinearConfig(num_stages=3, splits=2), bf16),
}


def case_inputs(seed, m, e, n, k, routed, shared_rows, per_group, dtype):
    """x, ids (repeats included), weight, shared pieces: fresh normals in ``dtype``."""
    rng = np.random.default_rng(seed)
    g = routed + (1 if shared_rows else 0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    ids = jnp.asarray(np.append(rng.integers(0, e, routed - 1), 0), jnp.int32)
    ids = jnp.concatenate([ids, jnp.asarray(rng.integers(0, e, g - routed), jnp.int32)])
    return (normal(g if per_group else 1, m, k), ids, normal(e, n, k),
            tuple(normal(r, k) for r in shared_rows))


def reference_f64(x, ids, weight, shared, routed):
    x, w = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    piece = np.concatenate([np.asarray(s, np.float64) for s in shared]) if shared else None
    return np.stack([x[g if x.shape[0] > 1 else 0] @ (w[int(ids[g])] if g < routed else piece).T
                     for g in range(ids.shape[0])])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_linear_against_float64(mode, name):
    m, e, n, k, routed, shared_rows, per_group, config, dtype = CASES[name]
    x, ids, w, shared = case_inputs(len(name), m, e, n, k, routed, shared_rows, per_group, dtype)
    want = reference_f64(x, ids, w, shared, routed)
    got = gl.grouped_linear_pallas(x, ids, w, shared, num_routed=routed, config=config,
                                   interpret=mode == "interpret")
    assert got.dtype == f32 and got.shape == want.shape
    assert_rel_close(got, want, 1e-5, f"kernel {name}")
    ref = gl.grouped_linear_reference(x, ids, w, shared, num_routed=routed)
    assert_rel_close(ref, want, 1e-5, f"reference {name}")


def test_grouped_linear_errors():
    x, ids, w, shared = case_inputs(0, 1, 4, 128, 64, 2, (128,), False, bf16)
    with pytest.raises(ValueError, match="K must be multiples of 64|rows must be multiples"):
        gl.grouped_linear_pallas(x[..., :32], ids, w[..., :32], (shared[0][:, :32],),
                                 num_routed=2)
    with pytest.raises(ValueError, match="do not add up"):
        gl.grouped_linear_pallas(x, ids, w, (shared[0], shared[0]), num_routed=2)
    with pytest.raises(ValueError, match="needs 0 <= num_routed"):
        gl.grouped_linear_pallas(x, ids, w, (), num_routed=2)
    with pytest.raises(ValueError, match="takes 1 to 64"):
        gl.grouped_linear_pallas(jnp.zeros((1, 65, 64), bf16), ids, w, shared, num_routed=2)
    with pytest.raises(ValueError, match="takes bfloat16 and float16"):
        gl.grouped_linear_pallas(x.astype(f32), ids, w.astype(f32), (shared[0].astype(f32),),
                                 num_routed=2)
    with pytest.raises(ValueError, match="must be None or an int"):
        gl.GroupedLinearConfig(splits=0)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        gl.grouped_linear_pallas(x, ids, w, shared, num_routed=2,
                                 config=gl.GroupedLinearConfig(num_stages=64))


MOE = tiny(hidden_size=128, num_experts=16, num_experts_per_tok=4,
           moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=0)


def moe_block(seed):
    """One layer's MoEParams of MOE in bfloat16, weights scaled so the block's output is O(1)."""
    params = jd.init_params(MOE, jax.random.key(seed), "bfloat16")
    block = next(layer.mlp for layer in params.layers if hasattr(layer.mlp, "experts_down_proj"))
    return jax.tree.map(lambda a: (a.astype(f32) * 8).astype(bf16), block)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_block_through_the_kernels_equals_xla_form(mode, tokens):
    """model.moe with ``moe_experts="pallas"`` against its XLA form (routed experts' pairs form
    and the shared MLP): the same roundings, so equal up to a few bfloat16 roundings of the
    projections' different float32 accumulation order."""
    p = moe_block(tokens)
    x = jax.random.normal(jax.random.key(7 + tokens), (tokens, MOE.hidden_size), bf16)
    kernels = choice.Kernels(moe_experts="pallas", interpret=mode == "interpret")
    weights, chosen = model.route(p, x, MOE)
    s = p.shared_expert
    assert choice.moe_experts(kernels, x, weights, chosen, p.experts_gate_up_proj,
                              p.experts_down_proj, s.gate_proj, s.up_proj,
                              s.down_proj) is not None, "the kernels must take this call"
    got = jax.jit(lambda p, x: model.moe(p, x, MOE, kernels))(p, x)
    want = jax.jit(lambda p, x: model.moe(p, x, MOE, choice.XLA))(p, x)
    assert float(jnp.max(jnp.abs(want.astype(f32)))) > 0.1
    assert_rel_close(got.astype(f32), want.astype(f32), 2e-2, "moe block")


def test_moe_experts_declines_what_the_kernels_do_not_take():
    """None (the caller's XLA form) for "xla", more pairs than experts, float32, FP8 weights."""
    p = moe_block(0)
    s = p.shared_expert
    x = jnp.ones((1, MOE.hidden_size), bf16)
    weights, chosen = model.route(p, x, MOE)
    args = (p.experts_gate_up_proj, p.experts_down_proj, s.gate_proj, s.up_proj, s.down_proj)
    on = choice.Kernels(moe_experts="pallas", interpret=True)
    assert choice.moe_experts(choice.XLA, x, weights, chosen, *args) is None
    many = jnp.ones((5, MOE.hidden_size), bf16)  # 5 tokens x 4 slots > 16 experts
    assert choice.moe_experts(on, many, *model.route(p, many, MOE), *args) is None
    f = jax.tree.map(lambda a: a.astype(f32), (x, weights, args))
    assert choice.moe_experts(on, f[0], f[1], chosen, *f[2]) is None
    q = jd.quantize_fp8(jd.init_params(MOE, jax.random.key(0), "bfloat16"))
    qs = next(layer.mlp for layer in q.layers if hasattr(layer.mlp, "experts_down_proj"))
    assert choice.moe_experts(on, x, weights, chosen, qs.experts_gate_up_proj,
                              qs.experts_down_proj, qs.shared_expert.gate_proj,
                              qs.shared_expert.up_proj, qs.shared_expert.down_proj) is None


def test_moe_kernels_lower_for_cuda():
    """The block at one token lowered for CUDA on CPU: two Mosaic GPU kernels per block."""
    p = moe_block(0)
    kernels = choice.Kernels(moe_experts="pallas", interpret=False)
    leaves, tree = jax.tree.flatten(p)
    text = lower_for_cuda_text(
        lambda x, *leaves: model.moe(jax.tree.unflatten(tree, leaves), x, MOE, kernels),
        ((1, MOE.hidden_size), bf16), *[(a.shape, a.dtype) for a in leaves])
    assert text.count("mosaic_gpu") >= 2


def test_choose_kernels_picks_the_moe_kernels_on_hopper(monkeypatch):
    """Hopper, one device, 16-bit: the kernels up to E / k rows, XLA above (more pairs than
    experts), on a mesh and batch-invariant; a dense config never asks."""
    monkeypatch.setattr(choice, "_compute_capability", lambda device: (9, 0))
    choice.choose_kernels.cache_clear()
    try:
        c = jd.Config.from_preset("qwen3.5-35b-a3b")
        for batch, want in ((1, "pallas"), (8, "pallas"), (32, "pallas"), (33, "xla")):
            assert choice.choose_kernels(c, batch, dtype="bfloat16").moe_experts == want, batch
        assert choice.choose_kernels(c, 1, dtype="bfloat16",
                                     batch_invariant=True).moe_experts == "xla"
        odd = dataclasses.replace(MOE, hidden_size=96)
        with pytest.warns(UserWarning, match="the MoE experts runs in XLA"):
            assert choice.choose_kernels(odd, 1, dtype="bfloat16").moe_experts == "xla"
    finally:
        choice.choose_kernels.cache_clear()
    with pytest.raises(ValueError, match="moe_experts='pallas'\\) runs on one device"):
        choice.Kernels(moe_experts="pallas", batch_invariant=True)
