"""Anatomy of one prefill call on the GPU: every kernel it launches, with its CUPTI time, grouped
by family, by layer kind and by the op that emitted it.

    python benchmarks/prefill_profile.py [--cells 0.8b:1:8192,9b:1:8192] [--top 30]

Per cell (model:rows:tokens, one call of the jitted prefill over all ``tokens``, no chunking;
bf16 random weights): wall ms of the call (median of 3), the kernel sum, and the kernels summed
by family (``step_profile.family``), by layer kind (the model's named scopes) and by the
innermost op names of the HLO instruction that launched them (library kernels, cuBLAS, inherit
the op of the kernel launched before them).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import step  # noqa: E402
from step_profile import cupti_kernels, family, print_sequence  # noqa: E402


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its metadata op_name with the jit wrapper dropped."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text):
        name = re.sub(r"^jit\([^)]*\)/", "", m.group(2))
        out[m.group(1)] = out[m.group(1).replace(".", "_")] = name
    return out


def describe(op: str) -> tuple[str, str]:
    """op_name -> (layer kind, the op's last two path components without layer numbers)."""
    scope = re.search(r"layer\d+_(\w+?)(?:/|$)", op)
    kind = scope.group(1) if scope else ("lm_head" if "lm_head" in op else "other")
    tail = "/".join(re.sub(r"layer\d+_", "", op).split("/")[-2:])
    return kind, tail[:70]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:8192")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sequence", default="",
                    help="'start:stop': also list kernels start..stop-1 in launch order")
    ap.add_argument("--dump-hlo", default=None, help="write each cell's optimised HLO here")
    args = ap.parse_args()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    summary = []
    for cell in args.cells.split(","):
        name, rows, tokens = cell.split(":")
        rows, tokens = int(rows), int(tokens)
        config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
        params = jd.init_params(config, jax.random.key(0), "bfloat16")
        kernels = jd.choose_kernels(config, rows, dtype="bfloat16")
        plan = step.plan_prefill(params, rows, tokens, tokens, kernels=kernels)
        run = step.jit_prefill(config, None, False, plan.query_block, kernels)
        ids = jax.numpy.asarray(np.random.default_rng(0).integers(
            0, config.vocab_size, (rows, tokens)), jax.numpy.int32)
        num_new = jax.numpy.full((rows,), tokens, jax.numpy.int32)
        fresh = lambda: jax.block_until_ready(  # noqa: E731
            jd.init_state(config, rows, tokens, "bfloat16"))
        compiled = run.lower(params, fresh(), ids, num_new).compile()
        hlo = compiled.as_text()
        ops = op_names(hlo)
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"{cell.replace(':', '_')}.hlo.txt"), "w") as f:
                f.write(hlo)
        times = []
        for _ in range(4):
            state = fresh()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, state, ids, num_new))
            times.append(time.perf_counter() - t0)
        wall = statistics.median(times[1:]) * 1e3
        state = fresh()
        kernels_run = cupti_kernels(functools.partial(compiled, params, state, ids, num_new))
        total = sum(ms for _, ms in kernels_run)
        groups = {k: collections.defaultdict(lambda: [0, 0.0]) for k in ("family", "kind", "op")}
        op = "?"
        listing = []
        for kname, ms in kernels_run:
            op = ops.get(kname, op)
            kind, tail = describe(op)
            listing.append(f"{ms * 1e3:8.1f} us  {kind:10s} {kname[:50]:50s} {tail}")
            base = re.sub(r"[._]\d+$", "", kname)[:40]
            for key, value in (("family", family(kname)), ("kind", kind),
                               ("op", f"{kind}: {tail}  <{base}>")):
                groups[key][value][0] += 1
                groups[key][value][1] += ms
        print(f"\n## {cell} (chunk plan {plan.prefill_chunk_size}, query block "
              f"{plan.query_block}; kernels {kernels.prefill_attention}/"
              f"{kernels.prefill_delta_rule})\nwall {wall:.2f} ms; {len(kernels_run)} kernels, "
              f"sum {total:.2f} ms")
        for key in ("family", "kind"):
            print(f"{key}: " + "; ".join(f"{k} {v[0]}x {v[1]:.2f}ms" for k, v in sorted(
                groups[key].items(), key=lambda kv: -kv[1][1])))
        for k, (count, ms) in sorted(groups["op"].items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {ms:8.3f} ms {count:4d}x  {k}")
        print_sequence(listing, args.sequence)
        summary.append((cell, wall, total, len(kernels_run)))
        del params, state, compiled
    print("\n| cell | wall ms | kernel sum ms | kernels |\n|---|---:|---:|---:|")
    for cell, wall, total, n in summary:
        print(f"| {cell} | {wall:.2f} | {total:.2f} | {n} |")


if __name__ == "__main__":
    sys.exit(main())
