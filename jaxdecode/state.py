"""The decode state: everything a Qwen3.5 decoder carries from one token to the next.

Every leaf has the batch as axis 0 (batching, forking and data parallelism treat all alike);
shapes are fixed by :func:`init_state`, so one compiled step serves every position. The cache
semantics are HF ``DynamicCache`` with ``LinearAttentionLayer`` (transformers 5.24.0
``cache_utils.py``), but the conv window is a ring of ``Kc`` slots (HF shifts its last ``Kc``
inputs left every token): slot ``p % Kc`` holds position p's pre-conv input, so a decode step
writes in place the one slot its own window does not read (:func:`conv_window`).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.core import Tracer  # imported once: jax.core's module getattr is slow per lookup

from jaxdecode import memory
from jaxdecode.config import Config, model_dtype

Array = jax.Array


@struct.dataclass
class KVCache:
    """Keys (after ``k_norm`` and RoPE) and values of one full-attention layer: each [B, Hkv, S, D]
    in the model dtype; position s of row b holds its token s (valid for s < lengths[b])."""
    k: Array
    v: Array


@struct.dataclass
class MTPCache:
    """The multi-token-prediction layer's state (spec §6), kept beside the target's so drafting
    can continue any state: pair p joins the target's final-norm hidden state at position p with
    the token at p + 1. With ``lengths = L`` pairs 0 .. L - 2 are in ``kv`` and ``hidden`` holds
    position L - 1's, waiting for the token at L (vLLM's MTP proposer likewise caches the pairs
    of every accepted token); positions from L - 1 on hold don't-care values (drafts)."""
    kv: KVCache  # the MTP layer's keys/values, [B, Hkv, S, D] each; position p: pair p
    hidden: Array  # [B, H] model dtype: the final-norm hidden state at L - 1 (zeros at L = 0)


@struct.dataclass
class DecodeState:
    """Per-row decoding state; one entry per Gated DeltaNet / full-attention layer, in layer order.
    ``conv_state`` channels are grouped per key head (``params.conv_channel_order``)."""
    conv_state: tuple[Array, ...]  # [B, Kc, C] ring of pre-conv inputs: slot p % Kc holds p's
    recurrent_state: tuple[Array, ...]  # [B, Hv, dk, dv] float32 delta-rule state (as HF)
    kv_cache: tuple[KVCache, ...]
    lengths: Array  # [B] int32 tokens written per row = next write index = next position
    # The MTP layer's pairs (``init_state(..., mtp=True)``): every step that appends tokens
    # appends their pairs; speculative decoding drafts from them. None: not kept.
    mtp: MTPCache | None = None

    @property
    def batch_size(self) -> int:
        """Rows B."""
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """Cache capacity in tokens (positions 0 .. max_len - 1)."""
        return self.kv_cache[0].k.shape[2]


def init_state(config: Config, batch_size: int, max_len: int, dtype="float32", *,
               mtp: bool = False, check_memory: bool = True) -> DecodeState:
    """An empty :class:`DecodeState` of ``batch_size`` rows (zeros, ``lengths = 0``).

    ``max_len``: cache capacity S per row (prompt + generated); on GPU a multiple of 64
    (``MAX_LEN_ALIGN``), or the decode kernel copies the caches every step. ``dtype`` (of the
    conv rings and KV caches): the params' dtype, "float32" or "bfloat16"; the recurrent state is
    float32. ``mtp``: also keep the MTP layer's pairs (:class:`MTPCache`; one more attention
    layer's cache), for speculative decoding from this state; needs
    ``config.mtp_num_hidden_layers == 1``. ValueError: non-positive sizes, ``max_len`` above
    ``max_position_embeddings``, another dtype, ``mtp`` without an MTP layer, or
    (``check_memory``) a state larger than the default device's free memory, checked before
    allocating (``memory.state_bytes``; inside a ``jit`` pass False).
    """
    batch_size = _positive_int("batch_size", batch_size)
    max_len = _positive_int("max_len", max_len)
    if max_len > config.max_position_embeddings:
        raise ValueError(f"{max_len=} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    dtype = model_dtype(dtype)
    if not isinstance(mtp, (bool, np.bool_)):
        raise ValueError(f"mtp={mtp!r} must be a bool")
    mtp = bool(mtp)
    if mtp and config.mtp_num_hidden_layers != 1:
        raise ValueError(f"mtp=True needs a model with an MTP layer (mtp_num_hidden_layers=1); "
                         f"this config has mtp_num_hidden_layers={config.mtp_num_hidden_layers} "
                         "(load_checkpoint(..., mtp=True) keeps it)")
    if check_memory:
        memory.check_fits(f"a state of {batch_size} rows x {max_len} positions",
                          memory.state_bytes(config, batch_size, max_len, dtype, mtp=mtp))
    return _zeros(config, batch_size, max_len, dtype, mtp)


# One compiled call for all buffers: eagerly, each jnp.zeros is a dispatch (65 for the 9B).
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _zeros(c: Config, batch_size: int, max_len: int, dtype, mtp: bool) -> DecodeState:
    conv = tuple(jnp.zeros((batch_size, c.linear_conv_kernel_dim, c.linear_conv_dim), dtype)
                 for _ in c.linear_attention_layers)
    rec = tuple(jnp.zeros((batch_size, c.linear_num_value_heads, c.linear_key_head_dim,
                           c.linear_value_head_dim), jnp.float32)
                for _ in c.linear_attention_layers)
    kv_shape = (batch_size, c.num_key_value_heads, max_len, c.head_dim)
    kv = tuple(KVCache(k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype))
               for _ in c.full_attention_layers)
    pairs = None if not mtp else MTPCache(
        kv=KVCache(k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype)),
        hidden=jnp.zeros((batch_size, c.hidden_size), dtype))
    return DecodeState(conv_state=conv, recurrent_state=rec, kv_cache=kv,
                       lengths=jnp.zeros((batch_size,), jnp.int32), mtp=pairs)


def conv_slot(position, offset, kernel_size: int):
    """The ring slot of position ``position + offset`` (``position`` >= 0 int32, ``offset`` >= -Kc,
    broadcasting); no sum overflows int32, and plain integer ops serve Pallas kernels too."""
    return (position % kernel_size + offset % kernel_size) % kernel_size


def conv_window_slots(lengths: Array, kernel_size: int) -> Array:
    """[B, Kc-1] int32: the ring slots of positions ``lengths - Kc + 1 .. lengths - 1`` (oldest
    first), the conv window of the token at position ``lengths`` (``lengths`` [B] int32 >= 0)."""
    offsets = jnp.arange(1 - kernel_size, 0, dtype=jnp.int32)
    return conv_slot(lengths[:, None].astype(jnp.int32), offsets[None, :], kernel_size)


def conv_window(conv_state: Array, lengths: Array) -> Array:
    """The conv window before each row's next token, oldest first: for a [B, Kc, C] ring and
    ``lengths`` [B] int32 >= 0, the [B, Kc-1, C] pre-conv inputs of positions ``lengths - Kc + 1
    .. lengths - 1`` (zeros before position 0)."""
    slots = conv_window_slots(lengths, conv_state.shape[1])
    return jnp.take_along_axis(conv_state, slots[:, :, None], axis=1)


def fork(state: DecodeState, n: int) -> DecodeState:
    """Repeats each row ``n`` times (parallel sampling, best-of-n, rollouts: prefill once, fork,
    decode). Returns a new state of batch ``B * n``, rows ``b*n .. b*n + n - 1`` copies of row
    ``b``; ``state`` stays valid. Raises ValueError if ``n`` is not a positive integer, or if
    the new state cannot fit in the free memory of the device (per device for a sharded state).
    """
    n = _positive_int("n", n)
    check_not_donated(state)
    leaves = jax.tree.leaves(state)
    if all(isinstance(x, jax.Array) and not isinstance(x, Tracer) for x in leaves):
        need = n * sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                       for x in leaves)
        memory.check_fits(f"fork's state of {state.batch_size * n} rows x {state.max_len} "
                          "positions", need, next(iter(leaves[0].sharding.device_set)),
                          advice="fork fewer copies, or from a state with a smaller max_len")
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), state)


def check_not_donated(state: DecodeState) -> None:
    """Raises ValueError if ``state`` is not a :class:`DecodeState` (e.g. the (logits, state)
    pair prefill returns), or was donated to an earlier call (its buffers deleted; ``lengths``
    stands for all: the library's jits donate every leaf together)."""
    if not isinstance(state, DecodeState):
        hint = (" (prefill and decode_step return (logits, state): unpack the pair)"
                if isinstance(state, tuple) else "")
        raise ValueError(f"state must be a jaxdecode.DecodeState; got {type(state).__name__}"
                         + hint)
    x = state.lengths
    if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted():
        raise ValueError("this DecodeState was donated to an earlier call (prefill, decode_step, "
                         "generate, generate_stream), which reused its buffers in "
                         "place; pass the state that call returned (logits, state = "
                         "jd.decode_step(params, state, tokens); generate_stream's last chunk "
                         "carries it, so a stream left early has used its state up)")


def _positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)):  # an index (1), not a count
        raise ValueError(f"{name}={value!r} must be a positive int")
    try:
        value = operator.index(value)  # accepts numpy integers, rejects floats
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a positive int") from None
    if value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value

