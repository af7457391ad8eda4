"""The Qwen3.5 text decoder as pure functions over (Params, DecodeState).

Every equation, cast and weight name follows ``shared/docs/qwen35_spec.md``, which describes
HF ``transformers/models/qwen3_5/modeling_qwen3_5.py`` (transformers 5.24.0); section numbers
below refer to it.

Shape legend (docstrings and comments): B batch, T new tokens in this call, S cache positions
(max_len), Hd hidden_size, Hq/Hkv attention heads/KV heads, D head_dim, Hk/Hv DeltaNet key/value
heads, dk/dv their head dims, C conv channels (2·Hk·dk + Hv·dv), Kc conv width, V vocab.

Two entry points share one forward:
  * :func:`prefill_fn` appends ``n_new[b]`` tokens per row (chunked gated delta rule, causal
    attention over cache + new tokens);
  * :func:`decode_step_fn` appends one token per row (recurrent delta rule, decode attention).
:func:`prefill` and :func:`decode_step` add host-side input validation and ``jax.jit`` with the
state donated, so the caches are updated in place.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_extend_core

from jaxdecode.activations import sigmoid, silu
from jaxdecode.config import FULL_ATTENTION, Config
from jaxdecode.gated_delta import chunk_gated_delta_rule, l2_normalize
from jaxdecode.kernels import IMPLEMENTATIONS
from jaxdecode.kernels.decode_attention import decode_attention
from jaxdecode.kernels.deltanet_decode import deltanet_decode, deltanet_decode_xla
from jaxdecode.params import AttentionParams, GatedDeltaNetParams, MLPParams, Params
from jaxdecode.state import DecodeState, KVCache, conv_slot_position, conv_window

Array = jax.Array
f32 = jnp.float32

# XLA options every jitted program of the library is compiled with (pass them to your own
# ``jax.jit(..., compiler_options=COMPILER_OPTIONS)`` around ``decode_step_fn``). GPU options;
# other backends ignore them.
#   xla_gpu_dot_merger_threshold_mb: XLA merges dots that share an operand into one only below
#   this many MB of weights (default 32). At 1024 the MLP's gate and up projections (101 MB each
#   in the 9B) become one GEMM reading the input once: on an H200, one process, the 9B batch-1
#   step went from 5.032 to 4.818 ms and the 0.8B's kernel time from 1.131 to 1.076 ms
#   (benchmarks/RESULTS.md, session 6).
COMPILER_OPTIONS = types.MappingProxyType({"xla_gpu_dot_merger_threshold_mb": 1024})  # read-only
# Chunk size of the chunked gated delta rule (HF and FLA use 64).
CHUNK_SIZE = 64


# ----- small pieces ---------------------------------------------------------------------------

def linear(x: Array, w: Array) -> Array:
    """``x @ w.T`` with ``w`` in PyTorch layout ``[out, in]`` (no bias anywhere in Qwen3.5)."""
    return jnp.einsum("...i,oi->...o", x, w)


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """Zero-centred RMSNorm (``Qwen3_5RMSNorm``, spec §1.2): gain is ``1 + w``, applied in float32
    before the cast back to x's dtype. Used for input/post/final norms and q_norm/k_norm."""
    xf = x.astype(f32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(f32))).astype(x.dtype)


def gated_rms_norm(x: Array, z: Array, w: Array, eps: float) -> Array:
    """``Qwen3_5RMSNormGated`` (spec §1.2): plain gain ``w`` (not ``1 + w``), normalised value cast
    to x's dtype before the gain, then times ``silu(z)`` computed in float32 ("norm before gate")."""
    xf = x.astype(f32)
    n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (w.astype(f32) * n.astype(f32) * jax.nn.silu(z.astype(f32))).astype(x.dtype)


def rope_cos_sin(positions: Array, config: Config) -> tuple[Array, Array]:
    """Partial rotate-half RoPE tables (spec §1.6).

    Args:
      positions: [B, T] int32 absolute positions.

    Returns:
      (cos, sin), each [B, T, rotary_dim] float32, ``cat(freqs, freqs)`` with
      ``inv_freq_i = theta^(-2i / rotary_dim)``: the denominator is the rotary dim (64 of 256 in
      the published models), not head_dim. Text-only mRoPE with equal T/H/W rows reduces to this.
    """
    rd = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, rd, 2, dtype=f32) / rd))
    freqs = positions.astype(f32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates the first ``rotary_dim`` dims of x [B, T, N, D] (dim j pairs with j + rotary_dim/2,
    "rotate half"/NeoX pairing); the rest pass through. cos/sin are cast to x's dtype as in HF."""
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def mlp(p: MLPParams, x: Array) -> Array:
    """Dense SwiGLU (spec §1.7): ``down_proj(silu(gate_proj x) * up_proj x)``, elementwise in
    the model dtype (each op rounded once, as torch)."""
    return linear(silu(linear(x, p.gate_proj)) * linear(x, p.up_proj), p.down_proj)


def token_mask(length: int, n_new: Array) -> Array:
    """[B, T] bool: token t of row b is real (t < n_new[b]). At T == 1 this is ``n_new > 0``,
    written without the iota compare. (Decode builds its masks from ``active`` instead: see
    ``_forward``.)"""
    if length == 1:
        return (n_new > 0)[:, None]
    return jnp.arange(length)[None, :] < n_new[:, None]


# ----- Gated DeltaNet -------------------------------------------------------------------------

def gated_delta_net(p: GatedDeltaNetParams, x: Array, conv_state: Array, recurrent_state: Array,
                    start: Array, n_new: Array, valid: Array, config: Config, *, decode: bool,
                    deltanet_impl="auto"):
    """Gated DeltaNet mixer (HF ``Qwen3_5GatedDeltaNet``, spec §1.4) over T new tokens per row.

    Args:
      x: [B, T, Hd] input_layernorm output; row b's first ``n_new[b]`` tokens are real, the rest is
        right padding that must not touch any state.
      conv_state: [B, Kc, C] ring of pre-conv inputs (``jaxdecode.state.DecodeState``);
        recurrent_state: [B, Hv, dk, dv] float32.
      start: [B] int32 tokens already in the row (the position of the first new token).
      n_new: [B] int32.
      valid: [B, T] bool, ``token_mask(T, n_new)`` (``_forward`` builds it once for all layers).
      decode: T == 1 and the one-token recurrence is used instead of the chunked form.
      deltanet_impl: the one-token core (decode only). A string is an ``implementation`` of
        ``jaxdecode.kernels.deltanet_decode.deltanet_decode`` (conv window, norms, gating and
        delta rule; "auto": one Pallas kernel on Hopper below batch 4, XLA's form from batch 4,
        with the one-pass delta-rule kernel from batch 8). A callable replaces only the delta
        rule and has the signature of ``jaxdecode.kernels.gated_delta_decode.gated_delta_decode``
        (such as ``jaxdecode.sharding.sharded_gated_delta_decode(mesh)``).

    Returns:
      (out [B, T, Hd], new conv_state, new recurrent_state).
    """
    c = config
    batch, length, _ = x.shape
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    kc = c.linear_conv_kernel_dim

    mixed = linear(x, p.in_proj_qkv)  # [B, T, C]  pre-conv q, k, v (grouped per key head)
    z = linear(x, p.in_proj_z).reshape(batch, length, hv, dv)
    b = linear(x, p.in_proj_b)  # [B, T, Hv]
    a = linear(x, p.in_proj_a)  # [B, T, Hv]
    if decode:
        # The whole one-token core (conv window, gating, L2 norms, masking, delta rule): a
        # string picks deltanet_decode's implementation (one Pallas kernel on Hopper below
        # batch 4); a callable replaces the delta rule of its XLA form.
        args = (mixed[:, 0], a[:, 0], b[:, 0], valid[:, 0], start, conv_state, recurrent_state,
                p.conv1d[:, 0, :], p.A_log, p.dt_bias)
        if callable(deltanet_impl):
            o, new_conv_state, new_state = deltanet_decode_xla(
                *args, num_key_heads=hk, delta_rule=deltanet_impl)
        else:
            o, new_conv_state, new_state = deltanet_decode(
                *args, num_key_heads=hk, implementation=deltanet_impl)
        o = gated_rms_norm(o[:, None].astype(x.dtype), z, p.norm, c.rms_norm_eps)
        out = linear(o.reshape(batch, length, hv * dv), p.out_proj)
        return out, new_conv_state, new_state

    # Causal depthwise conv over [cached Kc-1 inputs | new inputs]; cross-correlation, so
    # w[:, Kc-1] multiplies the current token (spec §1.4, §7 item 4). Pads sit after the real
    # tokens, so they never enter a real token's window.
    window = conv_window(conv_state, start)  # [B, Kc-1, C], positions start-Kc+1 .. start-1
    hist = jnp.concatenate([window.astype(mixed.dtype), mixed], axis=1)  # [B, Kc-1+T, C]
    w = p.conv1d[:, 0, :].astype(f32)  # [C, Kc]
    conv = sum(hist[:, j:j + length, :].astype(f32) * w[:, j] for j in range(kc))
    conv = jax.nn.silu(conv).astype(x.dtype)
    # The new ring: slot s holds the last real position p in it (conv_slot_position), which is
    # hist[p - start + Kc - 1]; with no new token (n_new = 0) the slot of p = start - Kc keeps
    # its old value (index -1), and every other slot gets its old value back from the window.
    end = start + n_new
    slot = jnp.arange(kc, dtype=jnp.int32)[None, :]
    idx = conv_slot_position(end[:, None], slot, kc) - start[:, None] + kc - 1
    new_conv_state = jnp.take_along_axis(hist, jnp.maximum(idx, 0)[:, :, None], axis=1)
    new_conv_state = jnp.where((idx >= 0)[:, :, None], new_conv_state.astype(conv_state.dtype),
                               conv_state)

    # Channels are grouped per key head, [q_i | k_i | v of its r value heads] (params.py,
    # conv_channel_order), so each head's q, k and v sit together.
    grouped = conv.reshape(batch, length, hk, 2 * dk + (hv // hk) * dv)
    q = grouped[..., :dk].astype(f32)
    k = grouped[..., dk:2 * dk].astype(f32)
    v = grouped[..., 2 * dk:].reshape(batch, length, hv, dv).astype(f32)
    beta = sigmoid(b).astype(f32)  # torch's bf16 sigmoid: float32 math, one rounding
    # Log-space decay g = -exp(A_log) * softplus(a + dt_bias) <= 0, in float32 (spec §7 item 6).
    g = -jnp.exp(p.A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + p.dt_bias.astype(f32))

    q = l2_normalize(q) * (dk ** -0.5)
    k = l2_normalize(k)
    # Padding tokens become inert (beta = g = 0, k = 0): S passes through them unchanged.
    m = valid[:, :, None, None]
    q, k, v = (jnp.where(m, t, 0.0) for t in (q, k, v))
    g = jnp.where(valid[:, :, None], g, 0.0)
    beta = jnp.where(valid[:, :, None], beta, 0.0)

    # Value head h reads key head h // r: repeat_interleave, not tiling (spec §7 item 3).
    r = c.linear_num_value_heads_per_key_head
    q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
    o, new_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, CHUNK_SIZE)

    o = gated_rms_norm(o.astype(x.dtype), z, p.norm, c.rms_norm_eps)
    out = linear(o.reshape(batch, length, hv * dv), p.out_proj)
    return out, new_conv_state, new_state


# ----- gated full attention -------------------------------------------------------------------

def gated_attention(p: AttentionParams, x: Array, cache: KVCache, start: Array, n_new: Array,
                    valid: Array, config: Config, *, decode: bool, attention_impl: str):
    """Gated GQA attention (HF ``Qwen3_5Attention``, spec §1.6) writing the new keys/values.

    Args:
      x: [B, T, Hd] input_layernorm output (right-padded, ``n_new`` real tokens per row).
      cache: the layer's KV cache ([B, Hkv, S, D] each).
      start: [B] int32 tokens already in the cache (= position of the first new token).
      n_new: [B] int32.
      valid: [B, T] bool, ``token_mask(T, n_new)`` (``_forward`` builds it once for all layers).
      decode: T == 1; attention goes through ``decode_attention`` (the kernel seam).

    Returns:
      (out [B, T, Hd], new cache).
    """
    c = config
    batch, length, _ = x.shape
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    max_len = cache.k.shape[2]
    positions = start[:, None] + jnp.arange(length)[None, :]  # [B, T]

    # q_proj holds query and output gate interleaved per head: [Hq, 2D] (spec §7 item 2).
    qg = linear(x, p.q_proj).reshape(batch, length, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = linear(x, p.k_proj).reshape(batch, length, hkv, d)
    v = linear(x, p.v_proj).reshape(batch, length, hkv, d)
    q = rms_norm(q, p.q_norm, c.rms_norm_eps)  # per head over D, before RoPE
    k = rms_norm(k, p.k_norm, c.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, c)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    # Write real tokens at their positions; padding goes to index S, which mode="drop" discards.
    # A per-row scatter (vmap over B) keeps the write local to each row's shard under data
    # parallelism (a scatter indexed by global row would gather the new rows across "data").
    write_pos = jnp.where(valid, positions, max_len)

    def write(cache_rows, new_rows, pos):  # [Hkv, S, D], [T, Hkv, D], [T]
        return cache_rows.at[:, pos, :].set(new_rows.swapaxes(0, 1).astype(cache_rows.dtype),
                                            mode="drop")

    cache = KVCache(k=jax.vmap(write)(cache.k, k, write_pos),
                    v=jax.vmap(write)(cache.v, v, write_pos))
    end = start + n_new  # [B] valid cache length after this call

    if decode:
        if callable(attention_impl):  # e.g. sharding.sharded_decode_attention(mesh)
            o = attention_impl(q[:, 0], cache.k, cache.v, end)
        else:
            o = decode_attention(q[:, 0], cache.k, cache.v, end, implementation=attention_impl)
        o = o[:, None]  # [B, 1, Hq, D]
    else:
        o = causal_attention(q, cache.k, cache.v, positions, end)
    o = o.reshape(batch, length, hq * d) * sigmoid(gate.reshape(batch, length, hq * d))
    return linear(o, p.o_proj), cache


def causal_attention(q: Array, k_cache: Array, v_cache: Array, positions: Array, end: Array,
                     *, query_block: int = 512) -> Array:
    """Prefill attention of T new queries over the whole cache (HF ``eager_attention_forward``).

    Args:
      q: [B, T, Hq, D]; k_cache, v_cache: [B, Hkv, S, D]; positions: [B, T] query positions;
      end: [B] number of valid cache positions.
      query_block: queries per step when T is larger, so the float32 scores stay
        [B, Hq, query_block, S] (a 32k-token prompt would otherwise need B·Hq·T·S·4 bytes).

    Query at position p sees keys ``s <= p`` and ``s < end``; scores in float32 scaled by
    D**-0.5, probabilities cast to the model dtype before ``@ V`` (as HF).

    Returns:
      [B, T, Hq, D] in q's dtype.
    """
    batch, length, hq, d = q.shape
    if length <= query_block:
        return _attend(q, k_cache, v_cache, positions, end)
    pad = (-length) % query_block
    n = (length + pad) // query_block
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)))  # padded queries are cropped below
    q_blocks = jnp.moveaxis(q.reshape(batch, n, query_block, hq, d), 1, 0)
    pos_blocks = jnp.moveaxis(positions.reshape(batch, n, query_block), 1, 0)
    out = jax.lax.map(lambda qp: _attend(qp[0], k_cache, v_cache, qp[1], end),
                      (q_blocks, pos_blocks))  # [N, B, block, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(batch, n * query_block, hq, d)[:, :length]


def _attend(q, k_cache, v_cache, positions, end):
    batch, length, hq, d = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(batch, length, hkv, group, d)
    s_idx = jnp.arange(max_len)
    visible = (s_idx[None, None, :] <= positions[:, :, None]) & (
        s_idx[None, None, :] < end[:, None, None])  # [B, T, S]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=f32)
    scores = jnp.where(visible[:, None, None], scores * (d ** -0.5), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0).astype(q.dtype)  # rows with no key: 0
    key_valid = s_idx[None, :] < end[:, None]  # unwritten slots may hold anything (NaN)
    v = jnp.where(key_valid[:, None, :, None], v_cache, 0).astype(q.dtype)
    o = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return o.reshape(batch, length, hq, d)


# ----- the whole model ------------------------------------------------------------------------

def _forward(params: Params, state: DecodeState, tokens: Array, n_new: Array | None, *,
             return_all_logits: bool, attention_impl: str = "auto", deltanet_impl="auto",
             active: Array | None = None):
    """The shared body of prefill and decode: ``n_new`` [B] int32 new tokens per row (prefill),
    or, for decode (T == 1), ``active`` [B] bool with ``n_new`` None."""
    decode = active is not None
    c = params.config
    batch, length = tokens.shape
    start = state.lengths
    # In-graph guard for callers that skip host validation (inside their own jit): a row with a
    # bad request (n_new outside [0, T], a write past the cache, a real token id outside the
    # vocabulary; negative ids too, which jnp.take would wrap) is left untouched (no state change,
    # lengths not advanced) and gets NaN logits, never a silently dropped, clamped or wrapped op.
    in_vocab = (tokens >= 0) & (tokens < c.vocab_size)
    if decode:
        # Decode: the masks stay boolean, from ``active``. Written as n_new = int(active) with
        # masks n_new > 0, XLA GPU (jax 0.11.2) fails to compile a loop of one-row steps
        # ("Expected instruction to have shape equal to pred[], actual shape is pred[1]" at
        # compare(convert(active), ...); tests/test_gpu_compile.py), and the same for an any()
        # over the size-1 token axis.
        rejected = (active & (start >= state.max_len)) | (active & ~in_vocab[:, 0])
        valid = (active & ~rejected)[:, None]  # [B, 1]
        n_new = valid[:, 0].astype(jnp.int32)
    else:
        bad_token = token_mask(length, n_new) & ~in_vocab  # [B, T]
        # no any() over a size-1 axis (see above)
        bad_row = bad_token[:, 0] if length == 1 else jnp.any(bad_token, axis=1)
        rejected = ((n_new < 0) | (n_new > length) | (start + n_new > state.max_len) | bad_row)
        n_new = jnp.where(rejected, 0, n_new)
        valid = token_mask(length, n_new)  # [B, T]

    x = jnp.take(params.embed_tokens, jnp.where(in_vocab, tokens, 0), axis=0)
    x = jnp.where(valid[..., None], x, 0).astype(params.dtype)  # no embedding scale (spec §1.1)

    conv_state, recurrent_state = list(state.conv_state), list(state.recurrent_state)
    kv_cache = list(state.kv_cache)
    lin = full = 0
    for i, (layer, kind) in enumerate(zip(params.layers, c.layer_types)):
        h = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
        if kind == FULL_ATTENTION:
            with jax.named_scope(f"layer{i}_attention"):
                h, kv_cache[full] = gated_attention(layer.self_attn, h, kv_cache[full], start,
                                                    n_new, valid, c, decode=decode,
                                                    attention_impl=attention_impl)
            full += 1
        else:
            with jax.named_scope(f"layer{i}_deltanet"):
                h, conv_state[lin], recurrent_state[lin] = gated_delta_net(
                    layer.linear_attn, h, conv_state[lin], recurrent_state[lin], start, n_new,
                    valid, c, decode=decode, deltanet_impl=deltanet_impl)
            lin += 1
        x = x + h
        with jax.named_scope(f"layer{i}_mlp"):
            x = x + mlp(layer.mlp, rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps))

    if not return_all_logits and length > 1:  # only each row's last real token: the LM head
        last = jnp.maximum(n_new - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, Hd]
        valid = (n_new > 0)[:, None]
    x = rms_norm(x, params.norm, c.rms_norm_eps)
    with jax.named_scope("lm_head"):
        logits = jnp.einsum("bti,vi->btv", x, params.lm_head_weight, preferred_element_type=f32)
    logits = jnp.where(valid[..., None], logits, 0.0)
    logits = jnp.where(rejected[:, None, None], jnp.nan, logits)
    if not return_all_logits:
        logits = logits[:, 0]
    new_state = DecodeState(conv_state=tuple(conv_state), recurrent_state=tuple(recurrent_state),
                            kv_cache=tuple(kv_cache), lengths=start + n_new)
    return logits, new_state


def prefill_fn(params: Params, state: DecodeState, tokens: Array, lengths: Array,
               return_all_logits: bool = False):
    """Pure, un-jitted, un-validated prefill (see :func:`prefill`); for use inside your own jit."""
    return _forward(params, state, tokens, lengths.astype(jnp.int32),
                    return_all_logits=return_all_logits)


def decode_step_fn(params: Params, state: DecodeState, tokens: Array, active: Array | None = None,
                   attention_impl: str = "auto", deltanet_impl: str = "auto"):
    """Pure, un-jitted, un-validated decode step (see :func:`decode_step`)."""
    active = jnp.ones(tokens.shape, bool) if active is None else active.astype(bool)
    logits, state = _forward(params, state, tokens[:, None], None,
                             return_all_logits=False, attention_impl=attention_impl,
                             deltanet_impl=deltanet_impl, active=active)
    return logits, state


def at_top_level() -> bool:
    """Whether no JAX transformation (``jit``, ``grad``, ``vmap``, ``scan``, ...) is tracing at
    this point of the Python call stack (``jax.extend.core.find_top_trace`` is the eval trace)."""
    return type(jax_extend_core.find_top_trace(())).__name__ == "EvalTrace"


class TopLevelJit:
    """A ``jax.jit`` function compiled with :data:`COMPILER_OPTIONS` that also composes.

    JAX accepts compiler options only on a top-level jit: nested in another jit, or under
    ``grad`` or an eager ``scan``, it raises. Called at top level this runs the jitted function
    (donation, options, one executable per signature); called inside a transformation it runs
    ``pure`` (the same un-jitted function), inlined into the caller's program, where donation
    and the options are the caller's jit's business. Every other attribute (``lower``,
    ``trace``, ``eval_shape``, ...) is the jitted function's.
    """

    def __init__(self, jitted, pure, doc: str):
        self._jitted, self._pure, self.__doc__ = jitted, pure, doc

    def __call__(self, *args, **kwargs):
        fn = self._jitted if at_top_level() else self._pure
        return fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


prefill_jit = TopLevelJit(
    jax.jit(prefill_fn, static_argnames=("return_all_logits",), donate_argnames=("state",),
            compiler_options=COMPILER_OPTIONS), prefill_fn,
    """``prefill_fn`` jitted with the state donated and :data:`COMPILER_OPTIONS`; no host
    validation. Inside a transformation (your own ``jit``, ``grad``, ``scan``) it is
    ``prefill_fn`` (:class:`TopLevelJit`).""")
decode_step_jit = TopLevelJit(
    jax.jit(decode_step_fn, static_argnames=("attention_impl", "deltanet_impl"),
            donate_argnames=("state",), compiler_options=COMPILER_OPTIONS), decode_step_fn,
    """``decode_step_fn`` jitted with the state donated and :data:`COMPILER_OPTIONS`; no host
    validation. Inside a transformation (your own ``jit``, ``grad``, ``scan``) it is
    ``decode_step_fn`` (:class:`TopLevelJit`).""")


# ----- host-side validation -------------------------------------------------------------------

def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def _check_state(config: Config, state: DecodeState, dtype) -> None:
    c = config
    problems = []
    dtypes = {x.dtype for x in state.conv_state} | {x.dtype for kv in state.kv_cache
                                                    for x in (kv.k, kv.v)}
    if dtype is not None and dtypes != {jnp.dtype(dtype)}:
        problems.append(f"conv_state/kv_cache dtype {sorted(map(str, dtypes))} != the params' "
                        f"dtype {jnp.dtype(dtype)} (use init_state(..., dtype=params.dtype))")
    if any(x.dtype != jnp.float32 for x in state.recurrent_state):
        problems.append("recurrent_state must be float32")
    if not jnp.issubdtype(state.lengths.dtype, jnp.integer):
        problems.append(f"lengths must be integers, got {state.lengths.dtype}")
    if len(state.conv_state) != len(c.linear_attention_layers) or len(
            state.recurrent_state) != len(c.linear_attention_layers):
        problems.append(f"state has {len(state.conv_state)} conv / {len(state.recurrent_state)} "
                        f"recurrent states but the config has {len(c.linear_attention_layers)} "
                        f"linear_attention layers")
    if len(state.kv_cache) != len(c.full_attention_layers):
        problems.append(f"state has {len(state.kv_cache)} KV caches but the config has "
                        f"{len(c.full_attention_layers)} full_attention layers")
    batch = state.lengths.shape[0]
    expect = {
        "conv_state": (batch, c.linear_conv_kernel_dim, c.linear_conv_dim),
        "recurrent_state": (batch, c.linear_num_value_heads, c.linear_key_head_dim,
                            c.linear_value_head_dim),
        "kv_cache": (batch, c.num_key_value_heads, state.max_len, c.head_dim)}
    got = {"conv_state": [x.shape for x in state.conv_state],
           "recurrent_state": [x.shape for x in state.recurrent_state],
           "kv_cache": [x.shape for kv in state.kv_cache for x in (kv.k, kv.v)]}
    for name, shapes in got.items():
        bad = [s for s in shapes if tuple(s) != expect[name]]
        if bad:
            problems.append(f"{name} shape {tuple(bad[0])} != expected {expect[name]}")
    if problems:
        raise ValueError("state does not match params.config: " + "; ".join(problems))


def _check_tokens(config: Config, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    real = tokens if mask is None else tokens[mask]
    bad = (real < 0) | (real >= config.vocab_size)
    if bad.any():
        raise ValueError(f"token ids must be in [0, vocab_size={config.vocab_size}); got "
                         f"{real[bad][:8].tolist()} ({int(bad.sum())} out of range)")


def _read_lengths(state: DecodeState) -> np.ndarray:
    cached = np.asarray(state.lengths)
    if ((cached < 0) | (cached > state.max_len)).any():
        raise ValueError(f"state.lengths must be in [0, max_len={state.max_len}]; got "
                         f"{cached.tolist()}")
    return cached


def check_prefill_inputs(config: Config, state: DecodeState, tokens, lengths,
                         dtype=None) -> None:
    """Validates prefill inputs on the host (reads ``state.lengths``: a device sync).

    Raises:
      ValueError: mismatched batch sizes, state shapes or dtypes (``dtype`` is the params'),
        empty token arrays, ``lengths`` outside ``[0, T]``, token ids outside ``[0, vocab_size)``
        among the real tokens, or a row whose ``state.lengths + lengths`` exceeds ``max_len``.
    """
    _check_state(config, state, dtype)
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1; got {tokens.shape=}")
    if lengths.shape != (tokens.shape[0],):
        raise ValueError(f"lengths must be [B] with B = tokens.shape[0]; got {lengths.shape=} "
                         f"for {tokens.shape=}")
    if tokens.shape[0] != state.batch_size:
        raise ValueError(f"batch size mismatch: {tokens.shape=} but the state has "
                         f"batch_size={state.batch_size}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    if (lengths < 0).any() or (lengths > tokens.shape[1]).any():
        raise ValueError(f"lengths must be in [0, T={tokens.shape[1]}]; got {lengths.tolist()}")
    _check_tokens(config, tokens, np.arange(tokens.shape[1])[None, :] < lengths[:, None])
    cached = _read_lengths(state)
    over = cached + lengths > state.max_len
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"row {b}: {int(cached[b])} cached + {int(lengths[b])} new tokens "
                         f"exceeds the cache's max_len={state.max_len}")


def check_decode_inputs(config: Config, state: DecodeState, tokens, active=None,
                        dtype=None) -> None:
    """Validates decode-step inputs on the host (reads ``state.lengths``: a device sync).

    Raises:
      ValueError: state shapes or dtypes that do not match, ``tokens`` not ``[B]`` for the
        state's B, ids outside ``[0, vocab_size)``, or a row already at ``max_len``.
    """
    _check_state(config, state, dtype)
    tokens = np.asarray(tokens)
    if tokens.shape != (state.batch_size,):
        raise ValueError(f"tokens must be [B] with B = {state.batch_size} (the state's batch "
                         f"size); got {tokens.shape=}")
    act = np.ones(tokens.shape, bool) if active is None else np.asarray(active, bool)
    if act.shape != tokens.shape:
        raise ValueError(f"active must be [B] like tokens; got {act.shape=}")
    _check_tokens(config, tokens, act)
    cached = _read_lengths(state)
    full = (cached >= state.max_len) & act
    if full.any():
        b = int(np.argmax(full))
        raise ValueError(f"row {b}: the cache is full ({int(cached[b])} of max_len="
                         f"{state.max_len} positions used); cannot decode another token")


# ----- public API -----------------------------------------------------------------------------

def check_implementations(attention_impl, deltanet_impl) -> None:
    """Raises ValueError, naming the argument, for an implementation that is neither one of
    ``jaxdecode.kernels.IMPLEMENTATIONS`` nor a callable (on the host, before any device work)."""
    for name, value in (("attention_impl", attention_impl), ("deltanet_impl", deltanet_impl)):
        if not callable(value) and not (isinstance(value, str) and value in IMPLEMENTATIONS):
            raise ValueError(f"{name}={value!r} must be one of {IMPLEMENTATIONS} or a callable "
                             "with the kernel dispatcher's signature")


def prefill(params: Params, state: DecodeState, tokens, lengths, *,
            return_all_logits: bool = False):
    """Appends each row's prompt tokens to the state (a fresh state or a continuation).

    Args:
      params: model weights (``params.config`` is the shape).
      state: a :class:`DecodeState` for this config; donated (do not reuse it after the call).
      tokens: [B, T] int32 token ids, right-padded; padding may hold any value.
      lengths: [B] int32 real tokens per row, ``0 <= lengths <= T``; a row with 0 is untouched.
      return_all_logits: return logits for every position instead of each row's last token.

    Returns:
      (logits, new_state). logits: [B, V] float32 of each row's last new token (zeros for rows
      with ``lengths == 0``), or [B, T, V] with ``return_all_logits`` (zeros at padding).
      ``new_state.lengths = state.lengths + lengths``.

    Raises:
      ValueError: see :func:`check_prefill_inputs` (checked on the host before any device work;
        skipped when called with traced values inside your own ``jax.jit``).

    Math: Gated DeltaNet layers use the chunked gated delta rule (chunk 64; HF
    ``torch_chunk_gated_delta_rule``, spec §1.4) starting from the state's recurrent state;
    attention layers attend causally over cache + new tokens (HF ``eager_attention_forward``).
    Source: HF ``modeling_qwen3_5.py`` (transformers 5.24.0).

    Compilation: one executable per distinct (B, T), with :data:`COMPILER_OPTIONS`; pad prompts
    to a few bucket lengths (as ``jaxdecode.generate`` does) to reuse them. Inside your own
    ``jax.jit`` it is :func:`prefill_fn` inlined (validation skipped for traced arguments).
    """
    if not _is_traced(params, state, tokens, lengths):  # on the host, before any device work
        check_prefill_inputs(params.config, state, tokens, lengths, params.dtype)
    return prefill_jit(params, state, jnp.asarray(tokens, jnp.int32),
                       jnp.asarray(lengths, jnp.int32), return_all_logits=return_all_logits)


def decode_step(params: Params, state: DecodeState, tokens, active=None, *,
                attention_impl: str = "auto", deltanet_impl: str = "auto",
                check_inputs: bool = True):
    """Appends one token per row, each at its own position, and returns the next-token logits.

    Jitted with the state donated and :data:`COMPILER_OPTIONS`: the compiled executable aliases
    every state buffer to its output (caches are updated in place) and one executable serves
    every step. Inside your own ``jax.jit`` (or ``grad``, ``scan``) it is :func:`decode_step_fn`
    inlined into your program (validation skipped for traced arguments).

    Args:
      params: model weights.
      state: the current :class:`DecodeState`; donated.
      tokens: [B] int32 token ids.
      active: optional [B] bool; rows with False leave their state untouched (no cache writes,
        lengths not advanced) and get zero logits.
      attention_impl: "auto" | "pallas" | "reference" (see ``jaxdecode.kernels.decode_attention``),
        or a hashable callable with ``decode_attention``'s signature (a jit static), such as
        ``jaxdecode.sharding.sharded_decode_attention(mesh)``.
      deltanet_impl: the Gated DeltaNet one-token core, "auto" | "pallas" | "reference" (see
        ``jaxdecode.kernels.deltanet_decode``: "auto" on Hopper GPUs is one Pallas kernel for
        the conv window, norms, gating and delta rule below batch 4, and XLA's form from batch
        4, with the one-pass delta-rule kernel (``jaxdecode.kernels.gated_delta_decode``) from 8;
        XLA elsewhere), or a hashable callable replacing the delta rule only, with
        ``gated_delta_decode``'s signature, such as
        ``jaxdecode.sharding.sharded_gated_delta_decode(mesh)``.
      check_inputs: validate on the host first. Validation reads ``state.lengths`` back from the
        device (one sync per step); pass False in a hot loop whose bounds you checked up front.
        Unchecked, a row that would overflow the cache, or is fed a token id outside the
        vocabulary, is left untouched (state and lengths unchanged) and gets NaN logits.

    Returns:
      (logits [B, V] float32, new_state) with ``new_state.lengths = state.lengths + active``.

    A concrete (not traced) state sharded over a ``("data", "model")`` mesh of more than one
    device (``jaxdecode.sharding.is_on_mesh``), with both implementations strings, goes through
    ``jaxdecode.sharding.decode_step``: same results, both kernels run per device, output state
    pinned to the input layout. Inside your own ``jax.jit`` that dispatch cannot see the mesh:
    there, pass ``sharding.sharded_decode_attention(mesh)`` and
    ``sharding.sharded_gated_delta_decode(mesh)`` to ``model.decode_step_fn``, or on GPU the
    Pallas kernels get all-gathered KV caches and recurrent states.

    Raises:
      ValueError: see :func:`check_decode_inputs` and :func:`check_implementations`.

    Math: one token of every layer (spec §1.3-§1.8): Gated DeltaNet layers run the one-token
    gated delta rule from the cached conv window and recurrent state (Yang et al., "Gated Delta
    Networks", ICLR 2025; HF ``torch_recurrent_gated_delta_rule``); attention layers write the new
    key/value at ``lengths[b]`` and attend over positions ``0..lengths[b]`` through
    ``decode_attention``. Source: HF ``modeling_qwen3_5.py`` (transformers 5.24.0).
    """
    check_implementations(attention_impl, deltanet_impl)
    if isinstance(attention_impl, str) and isinstance(deltanet_impl, str):
        from jaxdecode import sharding  # imports this module
        if sharding.is_on_mesh(state):  # kernels per device; same validation and results
            return sharding.decode_step(params, state, tokens, active,
                                        attention_impl=attention_impl,
                                        deltanet_impl=deltanet_impl, check_inputs=check_inputs)
    if check_inputs and not _is_traced(params, state, tokens, active):
        check_decode_inputs(params.config, state, tokens, active, params.dtype)
    tokens = jnp.asarray(tokens, jnp.int32)
    if active is not None:
        active = jnp.asarray(active, bool)
    return decode_step_jit(params, state, tokens, active, attention_impl=attention_impl,
                           deltanet_impl=deltanet_impl)
