"""The Qwen3.5 text decoder as pure functions over (Params, DecodeState).

Every equation, cast and weight name follows HF ``transformers/models/qwen3_5/modeling_qwen3_5.py``
(transformers 5.24.0); each piece's docstring names the HF class or function it mirrors.
Qwen3-Next (``modeling_qwen3_next.py``) is the same decoder: its fused DeltaNet projections are
split at load (``params.split_fused``); it differs here only in the router's ``norm_topk_prob``
and in the dense MLP of the layers outside ``config.moe_layers``.

Shape legend (one for the library): B batch, T new tokens in this call, S cache positions
(max_len), H hidden_size, I intermediate_size, Hq/Hkv attention heads/KV heads, G = Hq/Hkv, D
head_dim, Hk/Hv DeltaNet key/value heads, r = Hv/Hk, dk/dv their head dims, C conv channels
(2·Hk·dk + Hv·dv), Kc conv width, V vocab.

:func:`prefill_fn` appends ``num_new[b]`` tokens per row, :func:`decode_step_fn` one token per
row (one shared forward); ``jaxdecode.step`` jits them and validates their inputs on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from flax import struct

from jaxdecode import invariance
from jaxdecode.activations import sigmoid, silu
from jaxdecode.config import FULL_ATTENTION, Config
from jaxdecode.gated_delta import l2_normalize
from jaxdecode.kernels import choice
from jaxdecode.kernels.choice import Kernels
from jaxdecode.params import AttentionParams, GatedDeltaNetParams, MLPParams, MoEParams, Params
from jaxdecode.quantization import Fp8Linear
from jaxdecode.state import DecodeState, KVCache, MTPCache, conv_slot, conv_window

Array = jax.Array
f32 = jnp.float32

# Batch-invariant prefill: each row in chunks of this many tokens (one GEMM shape for any prompt).
INVARIANT_CHUNK = 256


def linear(x: Array, w: Array | Fp8Linear, *, out_dtype=None,
           kernels: Kernels = choice.XLA, row_parallel: bool = False) -> Array:
    """``x @ w.T`` with ``w`` in PyTorch layout ``[out, in]`` (no bias anywhere in Qwen3.5);
    ``out_dtype``: the accumulation/output dtype (None: x's). A block-FP8 ``w`` is weight-only
    (x stays in the model dtype): ``choice.fp8_linear`` as ``kernels.fp8_linear`` says (the
    kernel or XLA's form, on the same weights dequantised to x's dtype); ``row_parallel``: w's
    input dimension is the one split over a mesh (``o_proj``, ``out_proj``, ``down_proj``), which
    the kernel's per-device call needs to know."""
    if isinstance(w, Fp8Linear):
        return choice.fp8_linear(kernels, x, w, out_dtype=out_dtype, row_parallel=row_parallel)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)


def linears(x: Array, ws, *, kernels: Kernels = choice.XLA) -> tuple[Array, ...]:
    """:func:`linear` of each column-parallel ``w`` in ``ws`` on the same x; block-FP8 ones
    together (``choice.fp8_linears``: one kernel launch where it takes them all)."""
    if all(isinstance(w, Fp8Linear) for w in ws):
        return choice.fp8_linears(kernels, x, tuple(ws))
    return tuple(linear(x, w, kernels=kernels) for w in ws)


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """HF ``Qwen3_5RMSNorm``: zero-centred gain ``1 + w``, applied in float32 before the cast back
    to x's dtype. Used for input/post/final norms and q_norm/k_norm."""
    xf = x.astype(f32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(f32))).astype(x.dtype)


def gated_rms_norm(x: Array, z: Array, w: Array, eps: float) -> Array:
    """HF ``Qwen3_5RMSNormGated``: plain gain ``w`` (not ``1 + w``), normalised value cast to x's
    dtype before the gain, then times ``silu(z)`` computed in float32 ("norm before gate")."""
    xf = x.astype(f32)
    n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (w.astype(f32) * n.astype(f32) * jax.nn.silu(z.astype(f32))).astype(x.dtype)


def rope_cos_sin(positions: Array, config: Config) -> tuple[Array, Array]:
    """Partial rotate-half RoPE tables (HF ``Qwen3_5TextRotaryEmbedding``,
    ``Qwen3NextRotaryEmbedding``).

    positions: [B, T] int32. Returns (cos, sin), each [B, T, rotary_dim] float32,
    ``cat(freqs, freqs)`` with ``inv_freq_i = theta^(-2i / rotary_dim)`` (the rotary dim, not
    head_dim). Text-only mRoPE, whose three position rows are equal, reduces to this; Qwen3-Next's
    RoPE is this 1-D form (``compute_default_rope_parameters``: rotary dim
    ``int(head_dim * rope_parameters["partial_rotary_factor"])``).
    """
    rd = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, rd, 2, dtype=f32) / rd))
    freqs = positions.astype(f32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """HF ``apply_rotary_pos_emb``: rotates the first ``rotary_dim`` dims of x [B, T, N, D] (dim j
    pairs with j + rotary_dim/2, "rotate half"), the rest pass; cos/sin cast to x's dtype."""
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def mlp(p: MLPParams, x: Array, kernels: Kernels = choice.XLA) -> Array:
    """HF ``Qwen3_5MLP``: ``down_proj(silu(gate_proj x) * up_proj x)``, elementwise in the model
    dtype (each op rounded once, as torch)."""
    gate, up = linears(x, (p.gate_proj, p.up_proj), kernels=kernels)
    return linear(silu(gate) * up, p.down_proj, kernels=kernels, row_parallel=True)


def route(p: MoEParams, x: Array, config: Config,
          kernels: Kernels = choice.XLA) -> tuple[Array, Array]:
    """The router of HF ``Qwen3_5MoeTopKRouter`` (``Qwen3NextTopKRouter``) over x [N, H] (model
    dtype): logits in the model dtype, softmax in float32 over all E experts, top-k (per "data"
    shard on ``kernels.mesh``), renormalised to sum 1 (Qwen3-Next: only when
    ``config.norm_topk_prob``). Returns (weights [N, k] model dtype, experts [N, k] int32).

    Computed without the [N, E] softmax: softmax is increasing, so the top k logits pick the same
    experts, and the renormalised weights are the softmax of those k logits (the max and the
    normaliser cancel); without renormalising, ``exp(logit - logsumexp(all E logits))``. Equal
    to HF's form up to float32 rounding."""
    logits = linear(x, p.gate).astype(f32)  # [N, E]
    top, chosen = choice.top_k(kernels, logits, config.num_experts_per_tok)  # [N, k]
    if config.norm_topk_prob:
        weights = jax.nn.softmax(top, axis=-1)
    else:  # the k softmax probabilities as they are (sum < 1)
        weights = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return weights.astype(x.dtype), chosen


def moe(p: MoEParams, x: Array, config: Config, kernels: Kernels = choice.XLA) -> Array:
    """HF ``Qwen3_5MoeSparseMoeBlock`` (``Qwen3NextSparseMoeBlock``) over x [..., H] (model
    dtype).

    Router: :func:`route`. Experts (``Qwen3_5MoeExperts``):
    :func:`jaxdecode.experts.routed_experts` (only the chosen experts' weights read at decode, no
    dense compute over all E per pair, no token dropping), each output times its weight in the
    model dtype, a token's k outputs summed in float32 (HF's ``index_add_`` adds them in expert
    order in the model dtype: equal in float32). Plus the shared expert times
    ``sigmoid(x · shared_expert_gate)``.
    """
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    weights, chosen = route(p, x, config, kernels)
    routed = choice.routed_experts(kernels, x, weights, chosen, p.experts_gate_up_proj,
                                   p.experts_down_proj)
    shared = mlp(p.shared_expert, x, kernels) * sigmoid(linear(x, p.shared_expert_gate))
    return (routed + shared).reshape(*lead, h)


def ffn(p: MLPParams | MoEParams, x: Array, config: Config,
        kernels: Kernels = choice.XLA) -> Array:
    """A decoder layer's feed-forward block: :func:`mlp` (dense) or :func:`moe` (the layers in
    ``config.moe_layers``; its experts expert-parallel on ``kernels.mesh``)."""
    return moe(p, x, config, kernels) if isinstance(p, MoEParams) else mlp(p, x, kernels)


def token_mask(length: int, num_new: Array) -> Array:
    """[B, T] bool: token t of row b is real (t < num_new[b]); at T == 1 ``num_new > 0``, without
    the iota compare."""
    if length == 1:
        return (num_new > 0)[:, None]
    return jnp.arange(length)[None, :] < num_new[:, None]


def deltanet_projections(p: GatedDeltaNetParams, x: Array, kernels: Kernels = choice.XLA):
    """The input projections of HF ``Qwen3_5GatedDeltaNet``: x [B, T, H] -> (mixed_qkv [B, T, C]
    pre-conv q, k, v grouped per key head, z [B, T, Hv*dv], b [B, T, Hv], a [B, T, Hv])."""
    return (*linears(x, (p.in_proj_qkv, p.in_proj_z), kernels=kernels),
            linear(x, p.in_proj_b, kernels=kernels), linear(x, p.in_proj_a, kernels=kernels))


def deltanet_output(p: GatedDeltaNetParams, o: Array, z: Array, config: Config,
                    kernels: Kernels = choice.XLA) -> Array:
    """The gated RMSNorm and ``out_proj`` of HF ``Qwen3_5GatedDeltaNet``: o [B, T, Hv, dv] (any
    float dtype, cast to z's), z [B, T, Hv*dv] -> [B, T, H]."""
    batch, length, _ = z.shape
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    o = gated_rms_norm(o.astype(z.dtype), z.reshape(batch, length, hv, dv), p.norm,
                       config.rms_norm_eps)
    return linear(o.reshape(batch, length, hv * dv), p.out_proj, kernels=kernels,
                  row_parallel=True)


def _hist_slice(window: Array, new: Array, j: int, length: int) -> Array:
    """hist[:, j:j+length] of hist = [window | new] ([B, Kc-1, C], [B, T, C]), without hist."""
    shift = window.shape[1] - j  # taps before the first new input
    if shift <= 0:
        return new[:, -shift:length - shift]
    if length <= shift:
        return window[:, j:j + length]
    return jnp.concatenate([window[:, j:], new[:, :length - shift]], axis=1)


def gated_delta_net(p: GatedDeltaNetParams, x: Array, conv_state: Array, recurrent_state: Array,
                    start: Array, num_new: Array, valid: Array, config: Config, *, decode: bool,
                    kernels: Kernels = choice.XLA):
    """HF ``Qwen3_5GatedDeltaNet`` over T new tokens per row.

    x: [B, T, H] input_layernorm output, right-padded after row b's ``num_new[b]`` real tokens
    (padding touches no state); conv_state: [B, Kc, C] ring; recurrent_state: [B, Hv, dk, dv]
    float32; start: [B] int32 tokens already in the row; valid: [B, T] bool ``token_mask``;
    decode: T == 1, the one-token form through ``kernels``. Returns (out [B, T, H], new
    conv_state, new recurrent_state).
    """
    c = config
    mixed, z, b, a = deltanet_projections(p, x, kernels)
    if decode:
        o, new_conv_state, new_state = choice.deltanet_decode(
            kernels, mixed[:, 0], a[:, 0], b[:, 0], valid[:, 0], start, conv_state,
            recurrent_state, p.conv1d[:, 0, :], p.A_log, p.dt_bias,
            num_key_heads=c.linear_num_key_heads)
        return deltanet_output(p, o[:, None], z, c, kernels), new_conv_state, new_state

    window = conv_window(conv_state, start).astype(mixed.dtype)  # [B, Kc-1, C], start-Kc+1 ..
    new_conv_state = conv_ring_update(conv_state, mixed, start, num_new)
    q, k, v, g, beta = _delta_rule_inputs(p, mixed, window, b, a, valid, c)
    o, new_state = choice.chunk_gated_delta_rule(kernels, q, k, v, g, beta, recurrent_state)
    return deltanet_output(p, o, z, c, kernels), new_conv_state, new_state


def conv_ring_update(conv_state: Array, mixed: Array, start: Array, num_new: Array) -> Array:
    """The [B, Kc, C] conv ring after each row's first ``num_new[b]`` of the T new pre-conv
    inputs ``mixed`` [B, T, C] at positions ``start[b]`` on ([B] int32): position p goes to slot
    ``conv_slot(p)``; only the last min(Kc, T) of a row can stay, so at most that many entries a
    row are written, by a scatter that XLA applies to the ring's own buffer (a loop's carry is
    updated in place, not copied)."""
    kc, length = conv_state.shape[1], mixed.shape[1]
    width = min(kc, length)
    first = jnp.clip(num_new - width, 0, length - width)  # [B]: the first token written
    tail = jax.vmap(lambda m, f: lax.dynamic_slice_in_dim(m, f, width))(mixed, first)
    t = first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width] token index
    slot = jnp.where(t < num_new[:, None], conv_slot(start[:, None], t, kc), kc)  # kc: dropped
    return jax.vmap(lambda ring, s, v: ring.at[s].set(v.astype(ring.dtype), mode="drop"))(
        conv_state, slot, tail)


def _delta_rule_inputs(p: GatedDeltaNetParams, mixed: Array, window: Array, b: Array, a: Array,
                       valid: Array, config: Config):
    """HF ``Qwen3_5GatedDeltaNet``'s causal conv and gating for T new tokens: (q, k [B, T, Hv,
    dk], v [B, T, Hv, dv], g, beta [B, T, Hv]) float32, as ``gated_delta``'s rules take them."""
    c = config
    batch, length, _ = mixed.shape
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    # HF causal_conv1d_fn (depthwise, causal) over hist = [cached Kc-1 inputs | new]; w[:, Kc-1]
    # multiplies the current token. Pads follow the real tokens, so no real window holds one.
    # hist is never built: each tap reads the window and the new inputs in place (a
    # concatenated [B, Kc-1+T, C] copy is the prefill's largest glue kernel).
    w = p.conv1d[:, 0, :].astype(f32)  # [C, Kc]
    conv = sum(_hist_slice(window, mixed, j, length).astype(f32) * w[:, j]
               for j in range(c.linear_conv_kernel_dim))
    conv = jax.nn.silu(conv).astype(mixed.dtype)

    # Channels grouped per key head: [q_i | k_i | v of its r value heads] (conv_channel_order).
    grouped = conv.reshape(batch, length, hk, 2 * dk + (hv // hk) * dv)
    q = grouped[..., :dk].astype(f32)
    k = grouped[..., dk:2 * dk].astype(f32)
    v = grouped[..., 2 * dk:].reshape(batch, length, hv, dv).astype(f32)
    beta = sigmoid(b).astype(f32)  # torch's bf16 sigmoid: float32 math, one rounding
    # Log-space decay g = -exp(A_log) * softplus(a + dt_bias) <= 0, in float32 as HF.
    g = -jnp.exp(p.A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + p.dt_bias.astype(f32))

    q = l2_normalize(q) * (dk ** -0.5)
    k = l2_normalize(k)
    # Padding tokens become inert (beta = g = 0, k = 0): S passes through them unchanged.
    m = valid[:, :, None, None]
    q, k, v = (jnp.where(m, t, 0.0) for t in (q, k, v))
    g = jnp.where(valid[:, :, None], g, 0.0)
    beta = jnp.where(valid[:, :, None], beta, 0.0)

    # Value head h reads key head h // r: HF's repeat_interleave, not tiling.
    r = c.linear_num_value_heads_per_key_head
    return jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2), v, g, beta


@struct.dataclass
class DeltaNetTrace:
    """What :func:`verify_fn` keeps of one DeltaNet layer, so :func:`commit_fn` can stop after
    any of the T verified tokens without recomputing (spec §10, vLLM's per-token state slots)."""
    mixed: Array  # [B, T, C] the new tokens' pre-conv inputs (the conv ring's entries)
    states: Array  # [B, T, Hv, dk, dv] float32 recurrent state after each new token


def gated_delta_net_trace(p: GatedDeltaNetParams, x: Array, conv_state: Array,
                          recurrent_state: Array, start: Array, valid: Array, config: Config,
                          kernels: Kernels = choice.XLA):
    """:func:`gated_delta_net` over T new tokens (few: a speculative verify step) keeping the
    recurrent state after every token (HF ``torch_recurrent_gated_delta_rule``, token by token).
    Returns (out [B, T, H], :class:`DeltaNetTrace`); the state itself is not advanced."""
    mixed, z, b, a = deltanet_projections(p, x, kernels)
    window = conv_window(conv_state, start).astype(mixed.dtype)
    q, k, v, g, beta = _delta_rule_inputs(p, mixed, window, b, a, valid, config)
    o, states = choice.gated_delta_states(kernels, q, k, v, g, beta, recurrent_state)
    return deltanet_output(p, o, z, config, kernels), DeltaNetTrace(mixed=mixed, states=states)


def attention_projections(p: AttentionParams, x: Array, positions: Array, config: Config,
                          kernels: Kernels = choice.XLA):
    """The projections of HF ``Qwen3_5Attention``: x [B, T, H], positions [B, T] int32 ->
    (q [B, T, Hq, D] after q_norm and RoPE, gate [B, T, Hq, D], k [B, T, Hkv, D] after k_norm
    and RoPE, v [B, T, Hkv, D])."""
    c = config
    batch, length, _ = x.shape
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    # q_proj holds query and output gate interleaved per head: [Hq, 2D], not two halves.
    qg, k, v = linears(x, (p.q_proj, p.k_proj, p.v_proj), kernels=kernels)
    qg = qg.reshape(batch, length, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = k.reshape(batch, length, hkv, d)
    v = v.reshape(batch, length, hkv, d)
    q = rms_norm(q, p.q_norm, c.rms_norm_eps)  # per head over D, before RoPE
    k = rms_norm(k, p.k_norm, c.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, c)
    return apply_rope(q, cos, sin), gate, apply_rope(k, cos, sin), v


def write_kv(cache: KVCache, k: Array, v: Array, positions: Array, valid: Array) -> KVCache:
    """The layer's cache with k, v [B, T, Hkv, D] at positions [B, T] where valid [B, T]."""
    # Padding goes to index S, which mode="drop" discards. A per-row scatter (vmap) keeps the
    # write local to each row's "data" shard (a global-row scatter would gather across "data").
    write_pos = jnp.where(valid, positions, cache.k.shape[2])

    def write(cache_rows, new_rows, pos):  # [Hkv, S, D], [T, Hkv, D], [T]
        return cache_rows.at[:, pos, :].set(new_rows.swapaxes(0, 1).astype(cache_rows.dtype),
                                            mode="drop")

    return KVCache(k=jax.vmap(write)(cache.k, k, write_pos),
                   v=jax.vmap(write)(cache.v, v, write_pos))


def attention_output(p: AttentionParams, o: Array, gate: Array,
                     kernels: Kernels = choice.XLA) -> Array:
    """HF ``Qwen3_5Attention``'s output gate and ``o_proj``: o, gate [B, T, Hq, D] -> [B, T, H]."""
    batch, length = o.shape[:2]
    o = o.reshape(batch, length, -1) * sigmoid(gate.reshape(batch, length, -1))
    return linear(o, p.o_proj, kernels=kernels, row_parallel=True)


def gated_attention(p: AttentionParams, x: Array, cache: KVCache, start: Array, num_new: Array,
                    valid: Array, config: Config, *, decode: bool,
                    kernels: Kernels = choice.XLA, query_block: int = 512):
    """HF ``Qwen3_5Attention`` (gated GQA), writing the new keys/values to the cache.

    Args as :func:`gated_delta_net`, with ``cache`` the layer's KV cache ([B, Hkv, S, D] each);
    ``decode``: attention goes through ``kernels`` (decode or prefill attention);
    ``query_block``: the XLA prefill attention's (``prefill_attention_reference``).
    Returns (out [B, T, H], new cache).
    """
    positions = start[:, None] + jnp.arange(x.shape[1])[None, :]  # [B, T]
    q, gate, k, v = attention_projections(p, x, positions, config, kernels)
    cache = write_kv(cache, k, v, positions, valid)
    if decode:
        o = choice.decode_attention(kernels, q[:, 0], cache.k, cache.v, start + num_new)[:, None]
    else:
        o = choice.prefill_attention(kernels, q, cache.k, cache.v, start, num_new,
                                     query_block=query_block)
    return attention_output(p, o, gate, kernels), cache


def _forward(params: Params, state: DecodeState, tokens: Array, num_new: Array | None, *,
             return_all_logits: bool, kernels: Kernels = choice.XLA,
             active: Array | None = None, query_block: int = 512, trace: bool = False,
             return_hidden: bool = False):
    """The shared body of prefill and decode: ``num_new`` [B] int32 new tokens per row (prefill),
    or, for decode (T == 1), ``active`` [B] bool with ``num_new`` None. ``trace``
    (:func:`verify_fn`): DeltaNet layers through :func:`gated_delta_net_trace`, their state not
    advanced; returns (logits, state, final-norm hidden [B, T, H], traces). ``return_hidden``:
    returns (logits, state, final-norm hidden [B, T, H]) (the MTP layer's input). A state
    keeping MTP pairs (``state.mtp``) gets the new tokens' (:func:`mtp_append`), but in
    ``trace`` (:func:`commit_fn` appends the accepted ones)."""
    decode = active is not None
    c = params.config
    batch, length = tokens.shape
    start = state.lengths
    # In-graph guard for callers that skip host validation: a row with a bad request (num_new
    # outside [0, T], a write past the cache, an id outside the vocabulary, which jnp.take would
    # wrap) is left untouched and gets NaN logits, never a silently dropped or clamped op.
    in_vocab = (tokens >= 0) & (tokens < c.vocab_size)
    if decode:
        rejected, valid, num_new = _decode_rows(state, in_vocab, active)
    else:
        rejected = _rejected(c, state, tokens, num_new)
        num_new = jnp.where(rejected, 0, num_new)
        valid = token_mask(length, num_new)  # [B, T]

    x = jnp.take(params.embed_tokens, jnp.where(in_vocab, tokens, 0), axis=0)
    x = jnp.where(valid[..., None], x, 0).astype(params.dtype)  # no embedding scale

    conv_state, recurrent_state = list(state.conv_state), list(state.recurrent_state)
    kv_cache = list(state.kv_cache)
    traces = [None] * len(conv_state)
    lin = full = 0
    for i, (layer, kind) in enumerate(zip(params.layers, c.layer_types)):
        h = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
        if kind == FULL_ATTENTION:
            with jax.named_scope(f"layer{i}_attention"):
                h, kv_cache[full] = gated_attention(layer.self_attn, h, kv_cache[full], start,
                                                    num_new, valid, c, decode=decode,
                                                    kernels=kernels, query_block=query_block)
            full += 1
        elif trace:
            h, traces[lin] = gated_delta_net_trace(layer.linear_attn, h, conv_state[lin],
                                                   recurrent_state[lin], start, valid, c, kernels)
            lin += 1
        else:
            with jax.named_scope(f"layer{i}_deltanet"):
                h, conv_state[lin], recurrent_state[lin] = gated_delta_net(
                    layer.linear_attn, h, conv_state[lin], recurrent_state[lin], start, num_new,
                    valid, c, decode=decode, kernels=kernels)
            lin += 1
        x = x + h
        with jax.named_scope(f"layer{i}_mlp"):
            x = _mlp_block(layer, x, c, kernels)

    hidden = None  # the final-norm hidden states of every token: trace, return_hidden, MTP pairs
    if not return_all_logits and length > 1:  # only each row's last real token: the LM head
        if trace or return_hidden or state.mtp is not None:
            hidden = rms_norm(x, params.norm, c.rms_norm_eps)
        last = jnp.maximum(num_new - 1, 0)
        x = jnp.take_along_axis(x if hidden is None else hidden, last[:, None, None],
                                axis=1)  # [B, 1, H]
        valid = (num_new > 0)[:, None]
    if hidden is None:
        x = hidden = rms_norm(x, params.norm, c.rms_norm_eps)
    with jax.named_scope("lm_head"):
        logits = linear(x, params.lm_head_weight, out_dtype=f32)
    logits = jnp.where(valid[..., None], logits, 0.0)
    logits = jnp.where(rejected[:, None, None], jnp.nan, logits)
    if not return_all_logits:
        logits = logits[:, 0]
    if trace:  # the keys/values written; DeltaNet states, lengths and MTP pairs as before
        return logits, state.replace(kv_cache=tuple(kv_cache)), hidden, tuple(traces)
    new_state = _advanced(params, state, conv_state, recurrent_state, kv_cache, hidden, tokens,
                          num_new, kernels)
    if return_hidden:
        return logits, new_state, hidden
    return logits, new_state


def _decode_rows(state: DecodeState, in_vocab: Array, active: Array):
    """A decode step's (rejected [B] bool, valid [B, 1] bool, num_new [B] int32) from in_vocab
    [B, 1] and active [B]: a rejected row is active with a full cache or an id outside the
    vocabulary."""
    # Masks stay boolean, from active: num_new > 0 masks (or an any() over the size-1 token
    # axis) fail to compile on XLA GPU in one-row loops (tests/test_step.py, GPU cases).
    rejected = (active & (state.lengths >= state.max_len)) | (active & ~in_vocab[:, 0])
    valid = (active & ~rejected)[:, None]
    return rejected, valid, valid[:, 0].astype(jnp.int32)


def _mlp_block(layer, x: Array, config: Config, kernels: Kernels = choice.XLA) -> Array:
    """The layer's second residual block: ``x + mlp(post_attention_layernorm(x))``."""
    return x + ffn(layer.mlp, rms_norm(x, layer.post_attention_layernorm, config.rms_norm_eps),
                   config, kernels)


def _decode_invariant(params: Params, state: DecodeState, tokens: Array, active: Array,
                      kernels: Kernels):
    """:func:`_forward`'s decode step (tokens [B, 1]) with a row's bits independent of the batch
    (``kernels.batch_invariant``): every op on the activations runs in fenced groups of
    ``invariance.GROUP_ROWS`` rows (``map_row_groups``: one shape, one compilation for any B),
    the ops on the state (KV write, attention and DeltaNet cores) per row or in kernels with one
    row's tiling (``choice``). Same math as :func:`_forward`."""
    c = params.config
    groups = invariance.map_row_groups
    start = state.lengths
    in_vocab = (tokens >= 0) & (tokens < c.vocab_size)
    rejected, valid, num_new = _decode_rows(state, in_vocab, active)
    x = jnp.take(params.embed_tokens, jnp.where(in_vocab, tokens, 0), axis=0)
    x = jnp.where(valid[..., None], x, 0).astype(params.dtype)  # [B, 1, H]
    positions = start[:, None]

    conv_state, recurrent_state = list(state.conv_state), list(state.recurrent_state)
    kv_cache = list(state.kv_cache)
    lin = full = 0
    for i, (layer, kind) in enumerate(zip(params.layers, c.layer_types)):
        norm = lambda p, x: rms_norm(x, p.input_layernorm, c.rms_norm_eps)  # noqa: E731
        if kind == FULL_ATTENTION:
            with jax.named_scope(f"layer{i}_attention"):
                q, gate, k, v = groups(
                    lambda p, x, pos: attention_projections(p.self_attn, norm(p, x), pos, c),
                    layer, x, positions)
                kv_cache[full] = write_kv(kv_cache[full], k, v, positions, valid)
                o = choice.decode_attention(kernels, q[:, 0], kv_cache[full].k,
                                            kv_cache[full].v, start + num_new)[:, None]
                x = groups(lambda p, x, o, gate: _mlp_block(
                    p, x + attention_output(p.self_attn, o, gate), c, kernels), layer, x, o, gate)
            full += 1
        else:
            with jax.named_scope(f"layer{i}_deltanet"):
                la = layer.linear_attn
                mixed, z, b, a = groups(
                    lambda p, x: deltanet_projections(p.linear_attn, norm(p, x)), layer, x)
                o, conv_state[lin], recurrent_state[lin] = choice.deltanet_decode(
                    kernels, mixed[:, 0], a[:, 0], b[:, 0], valid[:, 0], start, conv_state[lin],
                    recurrent_state[lin], la.conv1d[:, 0, :], la.A_log, la.dt_bias,
                    num_key_heads=c.linear_num_key_heads)
                x = groups(lambda p, x, o, z: _mlp_block(
                    p, x + deltanet_output(p.linear_attn, o[:, None], z, c), c, kernels),
                    layer, x, o, z)
            lin += 1
    final_norm = lambda w, x: rms_norm(x, w, c.rms_norm_eps)  # noqa: E731
    head = lambda w, h: linear(h, w, out_dtype=f32)  # noqa: E731
    hidden = None  # the final-norm hidden state: normed once, in its own group, for MTP pairs
    with jax.named_scope("lm_head"):
        if state.mtp is None:
            logits = groups(lambda p, x: head(p[1], final_norm(p[0], x)),
                            (params.norm, params.lm_head_weight), x)
        else:
            hidden = groups(final_norm, params.norm, x)
            logits = groups(head, params.lm_head_weight, hidden)
    logits = jnp.where(valid, logits[:, 0], 0.0)
    logits = jnp.where(rejected[:, None], jnp.nan, logits)
    return logits, _advanced(params, state, conv_state, recurrent_state, kv_cache, hidden, tokens,
                             num_new, kernels, groups)


def _advanced(params: Params, state: DecodeState, conv_state, recurrent_state, kv_cache,
              hidden: Array | None, tokens: Array, num_new: Array, kernels: Kernels,
              groups=None) -> DecodeState:
    """The state after a forward pass over ``tokens`` [B, T] (``num_new`` [B] int32 of them
    real): the layers' new conv rings, recurrent states and KV caches, ``lengths + num_new``,
    and, in a state keeping MTP pairs, the new tokens' (:func:`mtp_append` of their final-norm
    ``hidden`` [B, T, H]; ``groups`` as there)."""
    start = state.lengths
    mtp = state.mtp
    if mtp is not None:
        mtp = mtp_append(params, mtp, hidden, tokens, start, num_new, kernels, groups)
    return DecodeState(conv_state=tuple(conv_state), recurrent_state=tuple(recurrent_state),
                       kv_cache=tuple(kv_cache), lengths=start + num_new, mtp=mtp)


def prefill_hidden_fn(params: Params, state: DecodeState, tokens: Array, num_new: Array, *,
                      query_block: int = 512, kernels: Kernels = choice.XLA):
    """:func:`prefill_fn` in one call (no chunking; chunk the tokens yourself) that also returns
    the final-norm hidden state of every new token, what the MTP layer reads. Returns (logits
    [B, V] of each row's last new token, new_state, hidden [B, T, H]). Pure, unvalidated."""
    return _forward(params, state, tokens, num_new.astype(jnp.int32), return_all_logits=False,
                    query_block=query_block, kernels=kernels, return_hidden=True)


def verify_fn(params: Params, state: DecodeState, tokens: Array, num_new: Array,
              kernels: Kernels = choice.XLA):
    """A speculative verify step: the target model over T new tokens per row (the last sampled
    token and T-1 drafts), keeping what :func:`commit_fn` needs to stop after any of them.

    tokens [B, T] int32, num_new [B] int32 real tokens per row (prefill's semantics, padding
    after). Returns (logits [B, T, V] float32, hidden [B, T, H] (after the final norm: what
    the MTP layer reads), pending state, traces): the pending state has the new keys/values
    written but its DeltaNet states and ``lengths`` as before; ``traces`` one
    :class:`DeltaNetTrace` per DeltaNet layer. A rejected row (as :func:`prefill_fn`) gets NaN
    logits. Pure, un-jitted, unvalidated.
    """
    logits, pending, hidden, traces = _forward(params, state, tokens, num_new.astype(jnp.int32),
                                               return_all_logits=True, kernels=kernels,
                                               trace=True)
    return logits, hidden, pending, traces


def commit_fn(params: Params, pending: DecodeState, traces: tuple[DeltaNetTrace, ...],
              tokens: Array, hidden: Array, num_accepted: Array,
              kernels: Kernels = choice.XLA) -> DecodeState:
    """The state after each row's first ``num_accepted[b]`` (in [0, T]) of :func:`verify_fn`'s
    tokens [B, T] (its hidden [B, T, H]), without recomputing: the conv ring from the kept
    pre-conv inputs (:func:`conv_ring_update`), the recurrent state kept after token
    ``num_accepted - 1`` (the old one at 0), the MTP pairs of the accepted tokens
    (:func:`mtp_append`, where ``pending.mtp`` is kept), ``lengths + num_accepted``;
    keys/values past the new length are never read (the next write overwrites them). HF has no
    such step; vLLM keeps per-token state slots."""
    start = pending.lengths
    n = num_accepted.astype(jnp.int32)
    if pending.mtp is not None:
        pending = pending.replace(mtp=mtp_append(params, pending.mtp, hidden, tokens, start, n,
                                                 kernels))
    conv, rec = [], []
    for ring, old, t in zip(pending.conv_state, pending.recurrent_state, traces):
        conv.append(conv_ring_update(ring, t.mixed, start, n))
        kept = jnp.take_along_axis(t.states, jnp.maximum(n - 1, 0)[:, None, None, None, None],
                                   axis=1)[:, 0]
        rec.append(jnp.where((n > 0)[:, None, None, None], kept, old))
    return pending.replace(conv_state=tuple(conv), recurrent_state=tuple(rec), lengths=start + n)


def mtp_forward(params: Params, cache: KVCache, hidden: Array, tokens: Array, start: Array,
                num_new: Array, kernels: Kernels = choice.XLA, return_logits: bool = True,
                lm_head: Array | None = None):
    """The MTP layer (spec §6; vLLM ``Qwen3_5MultiTokenPredictor.forward``) over T pairs per row:
    pair t joins ``hidden[:, t]`` (the main model's final-norm hidden state at position
    ``start + t``, or the MTP's own output when drafting further) with the embedding of
    ``tokens[:, t]`` (the token at ``start + t + 1``) and predicts the token after it.

    cache: the MTP layer's own KV cache ([B, Hkv, S, D]; position p holds pair p); start [B]
    int32 pairs already in it; num_new [B] real pairs (padding after). Returns (logits [B, T, V]
    float32, or None without ``return_logits`` (a prompt's pairs: only the cache is wanted),
    d [B, T, H] the MTP's final-norm output (the next draft's ``hidden``), new cache).
    ``lm_head`` [V', H]: the rows of the LM head to score (a draft vocabulary; logits [B, T,
    V']), default the whole head. ValueError if ``params`` holds no MTP layer.
    """
    u = _mtp_input(params, hidden, tokens, kernels)  # ValueError first: no MTP layer
    c, m = params.config, params.mtp
    num_new = num_new.astype(jnp.int32)
    valid = token_mask(tokens.shape[1], num_new)
    a = rms_norm(u, m.layer.input_layernorm, c.rms_norm_eps)
    a, cache = gated_attention(m.layer.self_attn, a, cache, start, num_new, valid, c,
                               decode=False, kernels=kernels)
    u = _mlp_block(m.layer, u + a, c, kernels)
    d = rms_norm(u, m.norm, c.rms_norm_eps)
    if not return_logits:
        return None, d, cache
    head = params.lm_head_weight if lm_head is None else lm_head
    logits = linear(d, head, out_dtype=f32, kernels=kernels)
    return jnp.where(valid[..., None], logits, 0.0), d, cache


def _mtp_input(params: Params, hidden: Array, tokens: Array, kernels: Kernels) -> Array:
    """The MTP layer's input [B, T, H]: ``fc`` over the normed embedding of ``tokens`` [B, T]
    and the normed ``hidden`` [B, T, H], embedding first (spec §6). ValueError if ``params``
    hold no MTP layer."""
    if params.mtp is None:
        raise ValueError("these params hold no MTP layer: load the checkpoint with "
                         "load_checkpoint(..., mtp=True) (or a config with "
                         "mtp_num_hidden_layers=1 for init_params)")
    c, m = params.config, params.mtp
    in_vocab = (tokens >= 0) & (tokens < c.vocab_size)
    e = jnp.take(params.embed_tokens, jnp.where(in_vocab, tokens, 0), axis=0)
    e = rms_norm(e.astype(params.dtype), m.pre_fc_norm_embedding, c.rms_norm_eps)
    h = rms_norm(hidden.astype(params.dtype), m.pre_fc_norm_hidden, c.rms_norm_eps)
    return linear(jnp.concatenate([e, h], axis=-1), m.fc, kernels=kernels)


def mtp_append(params: Params, mtp: MTPCache, hidden: Array, tokens: Array, start: Array,
               num_new: Array, kernels: Kernels = choice.XLA, groups=None) -> MTPCache:
    """``mtp`` after ``num_new[b]`` tokens (tokens [B, T] int32, their final-norm hidden states
    [B, T, H]) were appended at ``start[b]``: pair ``start + t - 1`` joins the hidden state at
    that position (``mtp.hidden`` for t = 0; none before position 0) with ``tokens[:, t]``, and
    ``hidden`` becomes the last new token's. Only the MTP attention's keys and values are
    computed (what later pairs attend to; :func:`mtp_forward`'s projections). ``groups``:
    ``invariance.map_row_groups`` to compute them batch-invariantly (the rest moves bits
    without arithmetic)."""
    c, m = params.config, params.mtp
    length = tokens.shape[1]
    num_new = num_new.astype(jnp.int32)
    before = jnp.concatenate([mtp.hidden[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
    skip = (start == 0).astype(jnp.int32)  # a row's first token has no pair
    t = jnp.minimum(jnp.arange(length)[None, :] + skip[:, None], length - 1)  # [B, T]
    positions = jnp.maximum(start - 1, 0)[:, None] + jnp.arange(length)[None, :]

    def keys_values(params, h, tok, positions):
        a = rms_norm(_mtp_input(params, h, tok, kernels), m.layer.input_layernorm,
                     c.rms_norm_eps)
        return attention_projections(m.layer.self_attn, a, positions, c, kernels)[2:]
    pairs = (jnp.take_along_axis(before, t[..., None], axis=1),
             jnp.take_along_axis(tokens, t, axis=1), positions)
    k, v = keys_values(params, *pairs) if groups is None else groups(keys_values, params, *pairs)
    kv = write_kv(mtp.kv, k, v, positions, token_mask(length, jnp.maximum(num_new - skip, 0)))
    last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return MTPCache(kv=kv, hidden=jnp.where((num_new > 0)[:, None],
                                            last.astype(mtp.hidden.dtype), mtp.hidden))


def _rejected(config: Config, state: DecodeState, tokens: Array, num_new: Array) -> Array:
    """[B] bool: rows whose prefill request is bad (``num_new`` outside [0, T], a write past the
    cache, a real id outside the vocabulary)."""
    length = tokens.shape[1]
    in_vocab = (tokens >= 0) & (tokens < config.vocab_size)
    bad_token = token_mask(length, num_new) & ~in_vocab  # [B, T]
    bad_row = bad_token[:, 0] if length == 1 else jnp.any(bad_token, axis=1)
    return ((num_new < 0) | (num_new > length) | (state.lengths + num_new > state.max_len)
            | bad_row)


def target_logprobs(logits: Array, targets: Array) -> Array:
    """``log_softmax(logits)[..., targets]``: logits [..., V] float32, targets [...] int32;
    0 where ``targets < 0``."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    got = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(targets >= 0, got - lse, 0.0)


def _prefill_chunks(params: Params, state: DecodeState, tokens: Array, num_new: Array,
                    chunk: int, return_all_logits: bool, query_block: int, kernels: Kernels,
                    targets: Array | None = None, remat: bool = False):
    """The prefill as a ``lax.scan`` over [B, chunk] token chunks, each the continuation of the
    one before (T padded to a multiple of ``chunk``): activations bounded by one chunk. Same
    result as one call (chunk boundaries at multiples of 64 keep the delta rule's). With
    ``targets`` [B, T]: each chunk's logits reduced to :func:`target_logprobs` ([B, T] out);
    ``remat``: each chunk under ``jax.checkpoint`` (its activations recomputed for the VJP)."""
    batch, length = tokens.shape
    rejected = _rejected(params.config, state, tokens, num_new)
    num_new = jnp.where(rejected, 0, num_new)
    n = -(-length // chunk)
    split = lambda x: jnp.moveaxis(  # noqa: E731  [B, T] -> [N, B, chunk]
        jnp.pad(x, ((0, 0), (0, n * chunk - length)), constant_values=-1).reshape(batch, n, chunk),
        1, 0)
    chunks = split(tokens)
    per_chunk = split(targets) if targets is not None else jnp.zeros((n,), jnp.int32)
    return_all_logits = return_all_logits or targets is not None

    def body(carry, xs):
        state, last = carry
        tok, i, tgt = xs
        tok = jnp.maximum(tok, 0)  # the padding's -1: past num_new, never read
        nn = jnp.clip(num_new - i * chunk, 0, chunk)
        logits, state = _forward(params, state, tok, nn, return_all_logits=return_all_logits,
                                 query_block=query_block, kernels=kernels)
        if targets is not None:
            return (state, last), target_logprobs(logits, tgt)
        if return_all_logits:
            return (state, last), logits
        return (state, jnp.where((nn > 0)[:, None], logits, last)), None

    last = jnp.zeros((batch, params.config.vocab_size), f32)
    body = jax.checkpoint(body) if remat else body
    (state, logits), every = jax.lax.scan(body, (state, last),
                                          (chunks, jnp.arange(n), per_chunk))
    if targets is not None:
        lp = jnp.moveaxis(every, 0, 1).reshape(batch, n * chunk)[:, :length]
        return jnp.where(rejected[:, None], jnp.nan, lp), state
    if return_all_logits:
        logits = jnp.moveaxis(every, 0, 1).reshape(batch, n * chunk, -1)[:, :length]
        return jnp.where(rejected[:, None, None], jnp.nan, logits), state
    return jnp.where(rejected[:, None], jnp.nan, logits), state


def _prefill_rows(params: Params, state: DecodeState, tokens: Array, num_new: Array,
                  return_all_logits: bool, query_block: int, kernels: Kernels):
    """Batch-invariant prefill: one row at a time (a ``fori_loop``, the state updated in place),
    each through :func:`_prefill_chunks` with :data:`INVARIANT_CHUNK`-token chunks, so every op
    has the same shape whatever the batch and the other rows' lengths."""
    batch, length = tokens.shape
    padded = -(-length // INVARIANT_CHUNK) * INVARIANT_CHUNK
    tokens = jnp.pad(tokens, ((0, 0), (0, padded - length)))
    vocab = params.config.vocab_size
    shape = (batch, length, vocab) if return_all_logits else (batch, vocab)
    kernels = dataclasses.replace(kernels, batch_invariant=False)  # the shapes are fixed here

    def row(i, carry):
        state, logits = carry
        one = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), state)
        out, one = _prefill_chunks(params, one, jax.lax.dynamic_slice_in_dim(tokens, i, 1),
                                   jax.lax.dynamic_slice_in_dim(num_new, i, 1), INVARIANT_CHUNK,
                                   return_all_logits, query_block, kernels)
        if return_all_logits:
            out = out[:, :length]
        state = jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, i, 0),
                             state, one)
        return state, jax.lax.dynamic_update_slice_in_dim(logits, out, i, 0)

    state, logits = jax.lax.fori_loop(0, batch, row, (state, jnp.zeros(shape, f32)))
    return logits, state


def _chunk(prefill_chunk_size: int | None, length: int) -> int:
    """The chunk of :func:`_prefill_chunks` for T = ``length`` tokens: ``prefill_chunk_size``
    when T is longer, else T itself (one chunk, unpadded: no logits computed for padding)."""
    if prefill_chunk_size is None or prefill_chunk_size >= length:
        return length
    return prefill_chunk_size


def prefill_fn(params: Params, state: DecodeState, tokens: Array, num_new: Array,
               return_all_logits: bool = False, *, prefill_chunk_size: int | None = None,
               query_block: int = 512, kernels: Kernels | None = None, remat: bool = False):
    """Appends each row's ``num_new[b]`` tokens to the state; pure, un-jitted, unvalidated.

    Arguments as :func:`jaxdecode.prefill`; statics: ``prefill_chunk_size`` (a multiple of 64):
    a longer T runs as a ``lax.scan`` of continuations over chunks of that many tokens (bounded
    memory, the same logits); ``query_block``: queries per attention block (bounds the
    [B, Hq, block, S] float32 scores of XLA's attention); ``kernels``: the prefill attention
    (None: ``choose_kernels`` on the default device, as :func:`decode_step_fn`; on a mesh pass
    ``mesh=``), with ``batch_invariant`` rows one at a time in fixed chunks.
    Returns (logits, new_state): logits [B, V] float32 of each row's last new token (zeros
    where ``num_new == 0``), or [B, T, V] (zeros at padding). A row overflowing its cache or
    holding an id outside the vocabulary is left untouched and gets NaN logits. HF
    ``Qwen3_5ForCausalLM.forward``: DeltaNet layers run ``torch_chunk_gated_delta_rule`` (chunk
    64), attention ``eager_attention_forward``. Under ``jax.grad`` pass ``kernels=Kernels()``
    (XLA): the Pallas kernels have no VJP; ``remat`` recomputes each chunk in the backward pass.
    """
    num_new = num_new.astype(jnp.int32)
    if kernels is None:
        kernels = choice.choose_kernels(params.config, tokens.shape[0], dtype=params.dtype)
    if kernels.batch_invariant:
        return _prefill_rows(params, state, tokens, num_new, return_all_logits, query_block,
                             kernels)
    if remat or (prefill_chunk_size is not None and tokens.shape[1] > prefill_chunk_size):
        chunk = _chunk(prefill_chunk_size, tokens.shape[1])
        return _prefill_chunks(params, state, tokens, num_new, chunk, return_all_logits,
                               query_block, kernels, remat=remat)
    return _forward(params, state, tokens, num_new, return_all_logits=return_all_logits,
                    query_block=query_block, kernels=kernels)


def prefill_logprobs_fn(params: Params, state: DecodeState, tokens: Array, num_new: Array,
                        targets: Array, *, prefill_chunk_size: int | None = None,
                        query_block: int = 512, kernels: Kernels | None = None,
                        remat: bool = False):
    """Teacher-forced log-probabilities in prefill's (chunked delta rule) math: appends tokens as
    :func:`prefill_fn` and returns (logprobs [B, T] float32, new_state): at position t,
    ``log_softmax(logits_t)[targets[b, t]]`` (targets [B, T] int32; 0 where < 0; NaN rows for a
    rejected request), never holding more than one chunk's [B, chunk, V] logits.
    Differentiable with ``kernels=Kernels()`` (XLA; the Pallas kernels have no VJP); ``remat``
    recomputes each chunk in the backward pass, so a gradient holds one chunk's activations
    (plus the state at each chunk boundary). ``kernels.batch_invariant`` is ignored: the rows
    run batched (``jd.score`` refuses it)."""
    num_new = num_new.astype(jnp.int32)
    if kernels is None:
        kernels = choice.choose_kernels(params.config, tokens.shape[0], dtype=params.dtype)
    kernels = dataclasses.replace(kernels, batch_invariant=False)
    chunk = _chunk(prefill_chunk_size, tokens.shape[1])
    return _prefill_chunks(params, state, tokens, num_new, chunk, False, query_block, kernels,
                           targets=targets.astype(jnp.int32), remat=remat)


def decode_logprobs_fn(params: Params, state: DecodeState, tokens: Array, num_new: Array,
                       targets: Array, kernels: Kernels | None = None):
    """Teacher-forced log-probabilities in the decode step's math (the one-token recurrence):
    a ``lax.scan`` of :func:`decode_step_fn` over tokens [B, T] (row b's first ``num_new[b]``;
    the rest inactive). Returns (logprobs [B, T] as :func:`prefill_logprobs_fn`'s, new_state)."""
    num_new = num_new.astype(jnp.int32)

    def body(state, xs):
        tok, tgt, t = xs
        logits, state = decode_step_fn(params, state, jnp.maximum(tok, 0), t < num_new, kernels)
        return state, target_logprobs(logits, tgt)

    xs = (tokens.T, targets.astype(jnp.int32).T, jnp.arange(tokens.shape[1]))
    state, lp = jax.lax.scan(body, state, xs)
    return lp.T, state


def decode_step_fn(params: Params, state: DecodeState, tokens: Array, active: Array | None = None,
                   kernels: Kernels | None = None):
    """Appends one token per row at its own position; pure, un-jitted, unvalidated.

    Arguments and result as :func:`jaxdecode.decode_step`, but ``kernels`` (a jit static) None
    is ``choose_kernels`` on the default device (on a mesh pass ``mesh=``). HF
    ``torch_recurrent_gated_delta_rule`` (Yang et al., "Gated Delta Networks", ICLR 2025) in
    DeltaNet layers, ``eager_attention_forward`` over positions ``0..state.lengths[b]``. Under
    ``jax.grad`` pass ``kernels=Kernels()`` (XLA): the Pallas kernels have no VJP.
    """
    if kernels is None:
        kernels = choice.choose_kernels(params.config, tokens.shape[0], dtype=params.dtype)
    active = jnp.ones(tokens.shape, bool) if active is None else active.astype(bool)
    if kernels.batch_invariant:
        return _decode_invariant(params, state, tokens[:, None], active, kernels)
    return _forward(params, state, tokens[:, None], None, return_all_logits=False,
                    kernels=kernels, active=active)
