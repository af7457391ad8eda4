"""jaxdecode.state: the documented layout, init_state's checks, fork, and the conv ring's slot
arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from conftest import FULL, LIN, TINY, tiny


def test_state_layout_is_as_documented():
    c = tiny(num_hidden_layers=8, layer_types=(LIN, LIN, LIN, FULL) * 2)
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


def random_state(batch=2, max_len=16, seed=0):
    """A state of TINY whose every leaf holds random values (lengths in [0, max_len])."""
    state = jd.init_state(TINY, batch_size=batch, max_len=max_len)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    return jax.tree.map(
        lambda x: (jax.random.randint(next(keys), x.shape, 0, max_len + 1, x.dtype)
                   if x.dtype == jnp.int32 else jax.random.normal(next(keys), x.shape, x.dtype)),
        state)


def test_fork_repeats_rows():
    state = random_state(batch=2)
    forked = jd.fork(state, 3)
    assert forked.batch_size == 6
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(forked)):
        np.testing.assert_array_equal(np.repeat(np.asarray(a), 3, axis=0), np.asarray(b))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # not donated
    for bad in (0, True):
        with pytest.raises(ValueError, match=rf"n={bad} must be a positive int"):
            jd.fork(state, bad)


def test_init_state_errors():
    with pytest.raises(ValueError, match=r"max_len=0 must be a positive int"):
        jd.init_state(TINY, batch_size=1, max_len=0)
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings"):
        jd.init_state(TINY, batch_size=1, max_len=TINY.max_position_embeddings + 1)


def test_init_state_dtypes_and_integer_types():
    with pytest.raises(ValueError, match=r"dtype='int32' must be 'bfloat16' \(or 'bf16'\) or "
                                         r"'float32'"):
        jd.init_state(TINY, batch_size=2, max_len=16, dtype="int32")
    assert jd.init_state(TINY, 1, 8, dtype="bf16").conv_state[0].dtype == jnp.bfloat16
    bf16 = jd.init_state(TINY, batch_size=2, max_len=16, dtype="bfloat16")
    assert {x.dtype for x in bf16.conv_state} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in bf16.recurrent_state} == {jnp.dtype(jnp.float32)}
    # numpy integers are integers
    assert jd.init_state(TINY, np.int64(2), np.int32(8)).max_len == 8
    assert jd.fork(jd.init_state(TINY, 2, 16), np.int64(2)).batch_size == 4
    with pytest.raises(ValueError, match=r"batch_size=2.0 must be a positive int"):
        jd.init_state(TINY, 2.0, 8)


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


@pytest.mark.parametrize("kernel_size,length", [(4, 1), (4, 3), (4, 4), (4, 9), (2, 5)])
def test_conv_ring_update_matches_positions(kernel_size, length):
    """model.conv_ring_update against a ring rebuilt position by position in numpy: each real
    new input p goes to slot p % Kc, later ones overwrite earlier ones, other slots keep their
    values; rows with 0, some and all T tokens real, starts near 0 and far."""
    from jaxdecode.model import conv_ring_update
    rng = np.random.default_rng(kernel_size * 10 + length)
    batch, channels = 5, 3
    ring = rng.standard_normal((batch, kernel_size, channels)).astype(np.float32)
    mixed = rng.standard_normal((batch, length, channels)).astype(np.float32)
    start = np.array([0, 1, 7, 1000, kernel_size - 1], np.int32)
    num_new = np.array([0, length, max(length - 1, 0), 1, length], np.int32)
    got = np.asarray(jax.jit(conv_ring_update)(jnp.asarray(ring), jnp.asarray(mixed),
                                                jnp.asarray(start), jnp.asarray(num_new)))
    want = ring.copy()
    for b in range(batch):
        for t in range(num_new[b]):
            want[b, (start[b] + t) % kernel_size] = mixed[b, t]
    np.testing.assert_array_equal(got, want)


def test_conv_ring_update_in_place_in_a_loop():
    """A while loop carrying a conv ring that conv_ring_update rewrites every iteration updates
    the carry's buffer in place: no copy of the ring in the compiled body (the form before, a
    gather, cost the speculative loop one copy per DeltaNet layer and step)."""
    import re

    from jaxdecode.model import conv_ring_update
    shape = (2, 4, 96)

    def loop(ring, mixed):
        def body(carry):
            i, ring = carry
            rows = jnp.ones((2,), jnp.int32)
            return i + 1, conv_ring_update(ring, mixed + i.astype(mixed.dtype), 3 * i * rows,
                                           jnp.minimum(i, 3) * rows)
        return jax.lax.while_loop(lambda c: c[0] < 5, body, (jnp.zeros((), jnp.int32), ring))

    hlo = jax.jit(loop, donate_argnums=0).lower(
        jnp.ones(shape, jnp.bfloat16), jnp.ones((2, 4, 96), jnp.bfloat16)).compile().as_text()
    copies = re.findall(r"= bf16\[2,4,96\]\{[\d,]*\} copy\(", hlo)
    assert not copies, f"{len(copies)} copies of the ring in the compiled loop"


# ----- dtype names (issue 22)

@pytest.mark.parametrize("name,dtype", [("bf16", jnp.bfloat16), ("bfloat16", jnp.bfloat16),
                                        ("fp32", jnp.float32), ("float32", jnp.float32),
                                        (jnp.bfloat16, jnp.bfloat16)])
def test_dtype_names(name, dtype):
    assert jd.init_state(TINY, 1, 8, dtype=name).kv_cache[0].k.dtype == dtype
    assert jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(0), name).dtype == dtype


@pytest.mark.parametrize("name", ["fp16", "float16", "int8", "bf", 3])
def test_bad_dtype_names_say_which(name):
    with pytest.raises(ValueError, match="must be 'bfloat16' .* or 'float32'"):
        jd.init_state(TINY, 1, 8, dtype=name)
