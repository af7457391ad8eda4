"""jaxdecode.params: parameter specs and init, the HF <-> internal layouts (conv channels grouped
per key head)."""

from __future__ import annotations

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


def test_hf_layout_round_trip(params):
    from jaxdecode.params import params_from_flat, params_from_hf, params_to_flat
    for back in (params_from_hf(params.config, params_to_hf(params)),
                 params_from_flat(params.config, params_to_flat(params))):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not np.array_equal(np.asarray(params_to_hf(params)[qkv]),
                              np.asarray(params_to_flat(params)[qkv]))  # the layouts differ
