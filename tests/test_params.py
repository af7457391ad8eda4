"""jaxdecode.params: parameter specs and init, the HF <-> internal layouts (conv channels grouped
per key head; Qwen3-Next's fused DeltaNet projections)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import TINY, tiny
from jaxdecode.params import params_to_hf


@pytest.fixture(scope="module")
def params():
    return jd.init_params(TINY, jax.random.key(0))


def test_init_params_shapes_follow_param_specs():
    specs = jd.param_specs(TINY)
    shapes = jax.eval_shape(lambda: jd.init_params(TINY, jax.random.key(0), "bfloat16"))
    assert shapes.layers[0].linear_attn.in_proj_qkv.shape == (TINY.linear_conv_dim,
                                                              TINY.hidden_size)
    assert shapes.layers[0].linear_attn.A_log.dtype == jnp.float32
    assert shapes.layers[3].self_attn.q_proj.dtype == jnp.bfloat16
    n = sum(int(np.prod(s.shape)) for s in specs.values())
    assert n == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("r", [1, 2, 3])
def test_conv_channel_order_groups_each_key_head(r):
    """in_proj_qkv/conv1d channels are held grouped per key head; the maps are inverse."""
    from jaxdecode.params import conv_channel_order, hf_to_internal, internal_to_hf
    c = tiny(linear_num_value_heads=2 * r)
    order = conv_channel_order(c)
    dk, dv, ck = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim
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


def test_hf_layout_round_trip(params):
    from jaxdecode.params import params_from_flat, params_from_hf, params_to_flat
    for back in (params_from_hf(params.config, params_to_hf(params)),
                 params_from_flat(params.config, params_to_flat(params))):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not np.array_equal(np.asarray(params_to_hf(params)[qkv]),
                              np.asarray(params_to_flat(params)[qkv]))  # the layouts differ


NEXT = tiny(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=(2,))


@pytest.mark.parametrize("r", [1, 2, 3])
def test_fused_projections_split_as_hf_fix_query_key_value_ordering(r):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba split by split_fused give the q, k, v, z, b, a HF
    ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`` reads from the fused outputs (here
    re-done in numpy: a view per key head, then a split); fuse_split inverts it."""
    from jaxdecode.params import fuse_split, split_fused
    c = dataclasses.replace(NEXT, linear_num_value_heads=2 * r)
    hk, dk, dv, hv = 2, c.linear_key_head_dim, c.linear_value_head_dim, 2 * r
    rng = np.random.default_rng(r)
    x = rng.standard_normal((5, c.hidden_size))
    w_qkvz = rng.standard_normal((2 * c.linear_key_dim + 2 * c.linear_value_dim, c.hidden_size))
    w_ba = rng.standard_normal((2 * hv, c.hidden_size))
    qkvz = (x @ w_qkvz.T).reshape(5, hk, 2 * dk + 2 * r * dv)
    q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    ba = (x @ w_ba.T).reshape(5, hk, 2 * r)
    p = "model.layers.0.linear_attn."
    parts = {**split_fused(c, p + "in_proj_qkvz.weight", w_qkvz),
             **split_fused(c, p + "in_proj_ba.weight", w_ba)}
    assert sorted(parts) == sorted(p + n + ".weight" for n in ("in_proj_qkv", "in_proj_z",
                                                                "in_proj_b", "in_proj_a"))
    want = {"in_proj_qkv": np.concatenate([t.reshape(5, -1) for t in (q, k, v)], axis=-1),
            "in_proj_z": z.reshape(5, -1), "in_proj_b": ba[..., :r].reshape(5, hv),
            "in_proj_a": ba[..., r:].reshape(5, hv)}
    for name, value in want.items():
        np.testing.assert_allclose(x @ parts[p + name + ".weight"].T, value, rtol=1e-12,
                                   err_msg=name)
    params = jd.init_params(c, jax.random.key(r))
    hf = params_to_hf(params)
    assert p + "in_proj_qkvz.weight" in hf and p + "in_proj_qkv.weight" not in hf
    flat = {}
    for name, value in hf.items():
        flat.update(split_fused(c, name, value))
    back = fuse_split(c, flat)
    assert list(back) == list(hf)
    for name in hf:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(hf[name]))


def test_qwen3_next_specs_and_hf_layout_round_trip():
    """checkpoint_specs: Qwen3-Next's fused projections in place of the split ones, a dense MLP
    in mlp_only_layers; params_to_hf writes exactly those names and shapes and params_from_hf
    reads them back; Qwen3.5's checkpoint specs are its param specs."""
    from jaxdecode.params import checkpoint_specs, params_from_hf
    assert checkpoint_specs(TINY) == jd.param_specs(TINY)
    specs = checkpoint_specs(NEXT)
    p = "model.layers.0.linear_attn."
    assert specs[p + "in_proj_qkvz.weight"].shape == (2 * 32 + 2 * 96, 64)
    assert specs[p + "in_proj_ba.weight"].shape == (8, 64)
    assert not any(n.endswith(("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
                               "in_proj_b.weight")) for n in specs)
    assert "model.layers.2.mlp.up_proj.weight" in specs
    assert "model.layers.1.mlp.experts.gate_up_proj" in specs
    params = jd.init_params(NEXT, jax.random.key(4))
    assert isinstance(params.layers[2].mlp, jd.params.MLPParams)
    hf = params_to_hf(params)
    assert {n: tuple(x.shape) for n, x in hf.items()} == {n: s.shape for n, s in specs.items()}
    for a, b in zip(jax.tree.leaves(params),
                    jax.tree.leaves(params_from_hf(NEXT, hf)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_params_names_a_key_that_is_not_one():
    config = jd.Config.from_preset("tiny")
    for bad, got in ((0, "got int$"), (np.uint32(3), r"got uint32 uint32\[\]$"),
                     (jax.random.split(jax.random.key(0), 2), r"got \w+ key<fry>\[2\]$")):
        with pytest.raises(ValueError, match=r"key must be one PRNG key \(jax.random.key.*"
                                             + got):
            jd.init_params(config, bad)
    legacy = jd.init_params(config, jax.random.PRNGKey(0))  # uint32 [2]: still a key
    assert legacy.embed_tokens.shape == (config.vocab_size, config.hidden_size)
