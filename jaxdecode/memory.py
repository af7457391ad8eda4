"""Device memory: what a state and a prefill need, what a device has free, and the prefill's
chunking under an activation budget.

Estimates count bytes of the arrays the math needs (state leaves exactly; prefill activations of
the widest layer per token, plus the attention scores), not XLA's exact buffer assignment; the
prefill estimate carries a safety factor for XLA's temporaries (benchmarks/RESULTS.md measures
the peak against it). Errors name the bytes needed and available before any device work.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxdecode.config import Config, model_dtype

GiB = 2**30
# Part of a device's free memory the default prefill budget takes (the rest: XLA temporaries).
BUDGET_FRACTION = 0.5
# Prefill budget where the device reports no memory statistics (the CPU).
HOST_BUDGET_BYTES = 4 * GiB
# Measured peak over the estimate stays below this for XLA's fusion and scheduling temporaries.
SAFETY_FACTOR = 1.5
MIN_CHUNK = 64  # the delta rule's chunk: prefill chunks are multiples of it
MAX_QUERY_BLOCK = 512
MIN_QUERY_BLOCK = 16


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def free_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes the device's allocator can still hand out (``bytes_limit - bytes_in_use`` of
    ``memory_stats()``), or None where the device keeps no statistics (the CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def host_available_bytes() -> int | None:
    """The host's available memory (Linux ``/proc/meminfo`` MemAvailable), or None elsewhere:
    what a CPU device's arrays can still take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def state_bytes(config: Config, batch_size: int, max_len: int, dtype, *,
                mtp: bool = False) -> int:
    """Bytes of ``init_state(config, batch_size, max_len, dtype, mtp=mtp)``'s buffers (exact)."""
    c, e = config, np.dtype(model_dtype(dtype)).itemsize
    conv = batch_size * c.linear_conv_kernel_dim * c.linear_conv_dim * e
    rec = (batch_size * c.linear_num_value_heads * c.linear_key_head_dim
           * c.linear_value_head_dim * 4)
    pairs = (kv_cache_bytes(c, batch_size, max_len, dtype) + batch_size * c.hidden_size * e
             if mtp else 0)
    return (len(c.linear_attention_layers) * (conv + rec)
            + len(c.full_attention_layers) * kv_cache_bytes(c, batch_size, max_len, dtype)
            + pairs + 4 * batch_size)


def kv_cache_bytes(config: Config, batch_size: int, max_len: int, dtype) -> int:
    """Bytes of one attention layer's ``KVCache`` (k and v, [B, Hkv, S, D] each): a full-attention
    layer's, or the MTP layer's."""
    e = np.dtype(model_dtype(dtype)).itemsize
    return 2 * batch_size * config.num_key_value_heads * max_len * config.head_dim * e


def check_fits(what: str, needed: int, device: jax.Device | None = None,
               advice: str = "use fewer rows, a smaller max_len or a mesh") -> None:
    """ValueError (ending with ``advice``) if ``needed`` bytes exceed the device's free memory
    (a CPU device: the host's available memory; nothing where neither is known)."""
    device = device or jax.devices()[0]
    free, where = free_bytes(device), f"the device ({device.device_kind})"
    if free is None and device.platform == "cpu":
        free, where = host_available_bytes(), "the host (cpu devices)"
    if free is not None and needed > free:
        raise ValueError(f"{what} needs {_size(needed)} but {where} has {_size(free)} free; "
                         + advice)


def prefill_token_bytes(config: Config, dtype) -> int:
    """Activation bytes per (row, token) of a prefill: the residual stream plus the widest layer's
    intermediates (the MLP's gate/up or the MoE block's routed copies, the DeltaNet projections,
    conv and chunked delta rule in float32), times :data:`SAFETY_FACTOR`."""
    c, e = config, np.dtype(model_dtype(dtype)).itemsize
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    residual = 4 * c.hidden_size * e
    dense = len(c.moe_layers) < c.num_hidden_layers  # some layer has the dense MLP
    mlp = (3 * c.intermediate_size * e + c.intermediate_size * 4) if dense else 0
    if c.is_moe:  # router probabilities; per pair, the rounds' two slots (experts.capacity) of
        # input rows, gate/up, hidden and outputs, its output and float32 sum; shared expert
        k = c.num_experts_per_tok
        mlp = max(mlp, c.num_experts * 4 * 2
                  + k * (2 * (2 * c.hidden_size * e + 3 * c.moe_intermediate_size * e)
                         + c.hidden_size * (e + 4))
                  + 3 * c.shared_expert_intermediate_size * e)
    deltanet = (c.linear_conv_dim * (e + 3 * 4) + hv * dv * e  # mixed, conv, z
                + hv * (2 * dk + dv) * 4 * 2  # q, k, v repeated to Hv heads
                + hv * 64 * 4 * 6  # the [64, 64] chunk matrices per token
                + hv * (dk + 2 * dv) * 4 * 2)  # u, w, o
    attention = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * (e + 4)
    return int(SAFETY_FACTOR * (residual + max(mlp, deltanet, attention)))


def attention_scores_bytes(config: Config, batch_size: int, query_block: int,
                           max_len: int) -> int:
    """The XLA prefill attention's float32 scores, probabilities and mask for one query block:
    [B, Hq, query_block, max_len] three times."""
    return 3 * 4 * batch_size * config.num_attention_heads * query_block * max_len


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How a prefill of [B, T] tokens runs: ``prefill_chunk_size`` tokens per continuation (None:
    the whole T at once), ``query_block`` queries per attention block; ``bytes`` its estimate."""
    prefill_chunk_size: int | None
    query_block: int
    bytes: int


def plan_prefill(config: Config, batch_size: int, length: int, max_len: int, dtype, *,
                 budget: int | None = None, return_all_logits: bool = False,
                 device: jax.Device | None = None, flash: bool = False,
                 logits_per_token: bool = False, weight_copy_bytes: int = 0) -> PrefillPlan:
    """The largest chunk (a power of two >= 64, or the whole T) and query block (a power of two
    in [16, 512]) whose activations fit ``budget`` bytes (None: :data:`BUDGET_FRACTION` of the
    device's free memory, :data:`HOST_BUDGET_BYTES` without statistics). ``flash``: the
    attention is the flash kernel, which holds no scores. ``logits_per_token``: every token's
    float32 logits are live per chunk (teacher-forced scoring), twice (the logits and their
    exponent). ``weight_copy_bytes``: held besides the activations (the 16-bit copies XLA
    dequantises from block-FP8 weights, ``step.dequantized_copy_bytes``).

    Raises ValueError naming the bytes when even 64-token chunks and 16-query blocks do not fit,
    or ``return_all_logits``' [B, T, V] float32 output does not.
    """
    for name, value in (("batch_size", batch_size), ("length", length)):
        if value < 1:
            raise ValueError(f"plan_prefill: {name}={value} must be >= 1")
    if budget is not None and budget <= 0:
        raise ValueError(f"plan_prefill: budget={budget} must be a positive number of bytes")
    free = free_bytes(device)
    if budget is None:
        budget = HOST_BUDGET_BYTES if free is None else int(BUDGET_FRACTION * free)
    if return_all_logits:
        out = 4 * batch_size * length * config.vocab_size
        check_fits(f"return_all_logits' [{batch_size}, {length}, {config.vocab_size}] float32 "
                   "logits", out, device)
    per_token = prefill_token_bytes(config, dtype) + (8 * config.vocab_size
                                                      if logits_per_token else 0)

    def scores(block):
        return 0 if flash else attention_scores_bytes(config, batch_size, block, max_len)

    def need(chunk, block):
        return batch_size * chunk * per_token + scores(min(block, chunk)) + weight_copy_bytes

    # query blocks from the largest whose scores take at most half the budget down to the
    # smallest; the plan: the largest chunk (the whole prompt first) over every such block, then
    # the largest block (so a larger budget never gives a smaller chunk)
    top = MAX_QUERY_BLOCK
    while top > MIN_QUERY_BLOCK and scores(top) > budget // 2:
        top //= 2
    blocks = [top >> i for i in range(top.bit_length()) if top >> i >= MIN_QUERY_BLOCK]
    for block in blocks:
        if need(length, block) <= budget:
            return PrefillPlan(prefill_chunk_size=None, query_block=block,
                               bytes=need(length, block))
    best = None
    for block in blocks:
        chunk = 1 << max(length - 1, 1).bit_length()
        while chunk > MIN_CHUNK and need(chunk, block) > budget:
            chunk //= 2
        if need(chunk, block) <= budget and (best is None or chunk > best.prefill_chunk_size):
            best = PrefillPlan(prefill_chunk_size=chunk, query_block=block,
                               bytes=need(chunk, block))
    if best is not None:
        return best
    least = min(MIN_CHUNK, length)
    raise ValueError(
        f"a prefill of {batch_size} rows needs {_size(need(least, MIN_QUERY_BLOCK))} of "
        "activations even in "
        + (f"{MIN_CHUNK}-token chunks" if length > MIN_CHUNK else f"one call of its {length} "
           "tokens")
        + f" (max_len {max_len})"
        + (f", {_size(weight_copy_bytes)} of them 16-bit copies of FP8 weights"
           if weight_copy_bytes else "")
        + f", over the budget of {_size(budget)}"
        + ("" if free is None else f" ({_size(free)} free)")
        + "; use fewer rows or a larger budget")
