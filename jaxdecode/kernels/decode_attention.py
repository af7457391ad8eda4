"""GQA decode attention: one new query token per row against a KV cache.

Layout (shared with ``jaxdecode.state``):
    q        [B, num_attention_heads, head_dim]
    k_cache  [B, num_key_value_heads, max_len, head_dim]
    v_cache  [B, num_key_value_heads, max_len, head_dim]
    lengths  [B] int32: keys 0 .. lengths[b]-1 of row b are valid (the current token is already written).

Query head h uses KV head h // (num_attention_heads // num_key_value_heads) (HF ``repeat_kv``).
Scores are scaled by head_dim**-0.5; softmax and accumulation in float32; output in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention_reference(q, k_cache, v_cache, lengths):
    """Pure-JAX (XLA) decode attention.

    Args:
        q: [B, Hq, D] query of the current token (after q_norm and RoPE).
        k_cache: [B, Hkv, S, D] keys (after k_norm and RoPE); Hq % Hkv == 0.
        v_cache: [B, Hkv, S, D] values.
        lengths: [B] int32, number of valid cache positions per row (0 <= lengths <= S).

    Returns:
        [B, Hq, D] in q.dtype. Rows with lengths == 0 give zeros. Cache entries at positions
        >= lengths[b] (garbage, NaN) never affect row b.

    Source: softmax(q k^T / sqrt(D)) v with GQA head sharing, as HF ``eager_attention_forward``
    (transformers ``models/qwen3_5/modeling_qwen3_5.py``).
    """
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k_cache.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # [B, S]
    k = jnp.where(valid[:, None, :, None], k_cache, 0).astype(jnp.float32)
    v = jnp.where(valid[:, None, :, None], v_cache, 0).astype(jnp.float32)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, k) * (head_dim**-0.5)
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksd->bkgd", p, v) / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, lengths, *, implementation: str = "auto"):
    """Decode attention dispatcher (see module docstring for shapes).

    ``implementation``: "auto" | "pallas" | "reference". Until the Pallas kernel lands every
    choice runs :func:`decode_attention_reference`.
    """
    if implementation not in ("auto", "pallas", "reference"):
        raise ValueError(f"{implementation=} must be 'auto', 'pallas' or 'reference'")
    return decode_attention_reference(q, k_cache, v_cache, lengths)
