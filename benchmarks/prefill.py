"""Prefill at production sizes through the public API (``jd.prefill``, its chunk plan chosen by
``jaxdecode.memory``): time, tokens/s, FLOP utilisation against the bf16 matmul peak measured in
the same run, and peak device memory.

    python benchmarks/prefill.py [--cells 0.8b:1:8192,0.8b:8:2048,9b:64:8192,...]
        [--budget-gib G] [--attention-only] [--prefill-attention auto|pallas|xla]
        [--prefill-delta-rule auto|pallas|xla]

Each cell (model:rows:tokens, every row ``tokens`` long, ``max_len`` = tokens) runs in its own
process, so its peak memory (``peak_bytes_in_use``) is its own: bf16 random weights with the
preset's shapes, a first call (compile + run), then the median of 3 timed calls (1 after a
first call over 30 s), each on a fresh state (allocated outside the timing). Reported:

  s / tok/s      wall time of the call until the logits are ready (= time to first token)
  % peak         FLOPs / time over the 8192^3 bf16 matmul rate of the same process; FLOPs count
                 the weight matmuls (2 x matmul weights x tokens; the LM head for the last
                 tokens only) and the causal attention (QK and PV over the visible keys, 4 x D
                 x visible pairs x query heads per attention layer), not the delta rule
  plan           the chunk (tokens per continuation) and attention query block the library chose
  peak GiB       peak device memory of the process up to the end of the prefill calls (the
                 op timings below run after it, on inputs of their own), and weights + state
  attention ms   the model's attention layers alone on the same shapes: the XLA reference
                 (``prefill_attention_reference``), the flash kernel
                 (``prefill_attention_pallas``) and cuDNN's flash attention
                 (``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")``)
  delta rule ms  the chunked gated delta rule alone (float32) over every DeltaNet layer: XLA's
                 form (``gated_delta.chunk_gated_delta_rule``) / the kernels'
                 (``chunk_gated_delta_rule_pallas``: per-chunk terms, then the recurrence)
  (kernels)      after the cell: the prefill attention and delta rule the model ran
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DEFAULT_CELLS = ("0.8b:1:8192,0.8b:8:2048,9b:1:8192,9b:8:2048,27b:1:8192,27b:8:2048,"
                 "9b:64:8192,0.8b:1:131072,9b:1:131072")


def matmul_peak_tflops() -> float:
    import jax
    import jax.numpy as jnp
    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def prefill_flops(params, rows: int, tokens: int) -> float:
    """Weight-matmul and causal-attention FLOPs of a prefill of ``rows`` x ``tokens`` tokens."""
    import jax
    c = params.config
    matrices = sum(x.size for x in jax.tree.leaves(params.layers) if x.ndim == 2)
    flops = 2 * matrices * rows * tokens + 2 * c.vocab_size * c.hidden_size * rows
    pairs = tokens * (tokens + 1) / 2
    flops += (len(c.full_attention_layers) * 4 * c.head_dim * pairs * c.num_attention_heads
              * rows)
    return flops


def _median_ms(f, args, repeats=3):
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_attention(config, rows, tokens, impl):
    """ms of the model's attention layers (all of them) for one prefill of these shapes:
    ``xla`` (the reference, query blocks as the library plans them), ``pallas`` (the flash
    kernel), ``cudnn`` (``jax.nn.dot_product_attention``, causal)."""
    import jax
    import jax.numpy as jnp
    from jaxdecode import memory
    from jaxdecode.kernels import prefill_attention as pa
    c = config
    key = jax.random.key(2)
    q = jax.random.normal(key, (rows, tokens, c.num_attention_heads, c.head_dim), jnp.bfloat16)
    k = jax.random.normal(key, (rows, tokens, c.num_key_value_heads, c.head_dim), jnp.bfloat16)
    start = jnp.zeros((rows,), jnp.int32)
    num_new = jnp.full((rows,), tokens, jnp.int32)
    if impl == "cudnn":
        f = jax.jit(lambda q, k: jax.nn.dot_product_attention(q, k, k, is_causal=True,
                                                              implementation="cudnn"))
        args = (q, k)
    elif impl == "pallas":
        f = jax.jit(lambda q, cache: pa.prefill_attention_pallas(q, cache, cache, start,
                                                                 num_new))
        args = (q, jnp.swapaxes(k, 1, 2))  # [B, Hkv, S, D]
    else:
        block = memory.plan_prefill(c, rows, tokens, tokens, "bfloat16").query_block
        f = jax.jit(lambda q, cache: pa.prefill_attention_reference(
            q, cache, cache, start, num_new, query_block=block))
        args = (q, jnp.swapaxes(k, 1, 2))
    return _median_ms(f, args) * len(c.full_attention_layers)


def time_delta_rule(config, rows, tokens, impl):
    """ms of the chunked gated delta rule alone (float32 as the model runs it; ``impl`` "xla":
    gated_delta.chunk_gated_delta_rule, "pallas": the kernel's form) over every DeltaNet layer
    (inputs: ``chunk_delta_rule.inputs``)."""
    import jax
    from chunk_delta_rule import inputs
    from jaxdecode.gated_delta import chunk_gated_delta_rule
    from jaxdecode.kernels.chunk_gated_delta import chunk_gated_delta_rule_pallas
    if impl == "pallas":
        f = jax.jit(lambda *a: chunk_gated_delta_rule_pallas(*a)[0])
    else:
        f = jax.jit(lambda *a: chunk_gated_delta_rule(*a, 64)[0])
    return _median_ms(f, inputs(config, rows, tokens)) * len(config.linear_attention_layers)


def worker(cell: str, budget_gib: float | None, attention_only: bool,
           prefill_attention: str = "auto", prefill_delta_rule: str = "auto") -> dict:
    import jax
    import numpy as np
    import jaxdecode as jd
    from jaxdecode import memory, step
    name, rows, tokens = cell.split(":")
    rows, tokens = int(rows), int(tokens)
    config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
    out = dict(cell=cell, peak_tflops=matmul_peak_tflops())
    if attention_only:
        return _time_ops(out, config, rows, tokens)
    params = jd.init_params(config, jax.random.key(0), "bfloat16")
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (rows, tokens)).astype(np.int32)
    num_new = np.full(rows, tokens, np.int32)
    kernels = jd.choose_kernels(config, rows, dtype="bfloat16")
    if prefill_attention != "auto":
        kernels = dataclasses.replace(kernels, prefill_attention=prefill_attention)
    if prefill_delta_rule != "auto":
        kernels = dataclasses.replace(kernels, prefill_delta_rule=prefill_delta_rule)
    out["kernels"] = f"{kernels.prefill_attention}/{kernels.prefill_delta_rule}"
    plan = step.plan_prefill(params, rows, tokens, tokens, activation_budget=budget,
                             kernels=kernels)
    out.update(chunk=plan.prefill_chunk_size, query_block=plan.query_block,
               estimate_gib=plan.bytes / 2**30,
               weights_gib=sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30,
               state_gib=memory.state_bytes(config, rows, tokens, "bfloat16") / 2**30)
    times = []
    for i in range(4):
        if i == 2 and times[0] > 30:  # a long first call: one timed call is enough
            break
        state = jd.init_state(config, rows, tokens, "bfloat16")
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        logits, state = jd.prefill(params, state, ids, num_new, activation_budget=budget,
                                   kernels=kernels)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        if i == 0:
            out["first_call_s"] = times[0]
        assert np.isfinite(np.asarray(logits)).all()
        del state, logits
    s = statistics.median(times[1:])
    out.update(s=s, tok_s=rows * tokens / s,
               pct_peak=100 * prefill_flops(params, rows, tokens) / s / 1e12
               / out["peak_tflops"],
               peak_gib=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30)
    del params
    return _time_ops(out, config, rows, tokens)  # after the peak: their inputs are their own


def _time_ops(out, config, rows, tokens):
    for impl in ("xla", "pallas", "cudnn"):
        try:
            out[f"attention_{impl}_ms"] = time_attention(config, rows, tokens, impl)
        except Exception as e:  # noqa: BLE001 - report, keep going
            out[f"attention_{impl}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
    for impl in ("xla", "pallas"):
        try:
            out[f"delta_rule_{impl}_ms"] = time_delta_rule(config, rows, tokens, impl)
        except Exception as e:  # noqa: BLE001
            out[f"delta_rule_{impl}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=DEFAULT_CELLS)
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="activation budget (default: the library's, half the free memory)")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--prefill-attention", choices=("auto", "pallas", "xla"), default="auto",
                    help="the model's prefill attention (auto: choose_kernels)")
    ap.add_argument("--prefill-delta-rule", choices=("auto", "pallas", "xla"), default="auto",
                    help="the model's chunked delta rule (auto: choose_kernels)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.budget_gib, args.attention_only,
                                            args.prefill_attention, args.prefill_delta_rule)))
        return 0
    import jax
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    results = []
    for cell in args.cells.split(","):
        cmd = [sys.executable, __file__, "--worker", cell]
        if args.budget_gib is not None:
            cmd += ["--budget-gib", str(args.budget_gib)]
        if args.attention_only:
            cmd.append("--attention-only")
        cmd += ["--prefill-attention", args.prefill_attention,
                "--prefill-delta-rule", args.prefill_delta_rule]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
            results.append(dict(cell=cell, error=err))
            print(f"  {cell}: FAILED: {err}", flush=True)
            continue
        r = json.loads(line[0][7:])
        results.append(r)
        print(f"  {cell} ({time.perf_counter() - t0:.0f} s): {r}", flush=True)

    def num(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else str(x)

    print("\n| cell | s (TTFT) | tok/s | % bf16 peak | chunk / query block | peak GiB (est. act. "
          "/ weights + state) | attention ms: XLA / kernel / cuDNN | delta rule ms: XLA / kernel | "
          "first call "
          "s | peak TFLOP/s |\n|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['cell']} | failed: {r['error']} |||||||")
            continue
        print(f"| {r['cell']} ({r.get('kernels')}) | {num(r.get('s'), '.3f')} | "
              f"{num(r.get('tok_s'), ',.0f')} | "
              f"{num(r.get('pct_peak'), '.1f')} | {r.get('chunk')} / {r.get('query_block')} | "
              f"{num(r.get('peak_gib'), '.1f')} ({num(r.get('estimate_gib'), '.1f')} / "
              f"{num(r.get('weights_gib', 0) + r.get('state_gib', 0), '.1f')}) | "
              f"{num(r['attention_xla_ms'], '.1f')} / {num(r['attention_pallas_ms'], '.1f')} / "
              f"{num(r['attention_cudnn_ms'], '.1f')} | {num(r['delta_rule_xla_ms'], '.1f')} / "
              f"{num(r['delta_rule_pallas_ms'], '.1f')} | "
              f"{num(r.get('first_call_s'), '.1f')} | {r['peak_tflops']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
