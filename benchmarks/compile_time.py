"""Compile time as a measured cost: what a user waits for before the first token.

    PYTHONPATH=. python benchmarks/compile_time.py [--models 0.8b,9b] [--prompt 1024] [--batch 1]

Per model (bf16 random weights with the preset's shapes), in one fresh process per model
(``--models`` runs each in a subprocess, so JAX's in-memory caches never carry over; the
persistent compilation cache is off):

  decode_step   trace + lower and XLA compile of ``step.jit_decode_step`` (one step, B rows,
                cache of prompt + 256 positions)
  prefill       the same for ``step.jit_prefill`` ([B, prompt] tokens)
  generate      wall time of the first ``jd.generate`` call for a ``--prompt``-token prompt and
                16 new tokens, minus the same call run again (what compiling its one program
                costs), and the second call's time

Prints one table; record it in benchmarks/RESULTS.md with the card and JAX version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def measure(preset: str, prompt: int, batch: int) -> dict:
    import jax
    import numpy as np

    import jaxdecode as jd
    from jaxdecode import step

    jax.config.update("jax_enable_compilation_cache", False)
    config = jd.Config.from_preset(preset)
    params = jax.block_until_ready(jd.init_params(config, jax.random.key(0), "bfloat16"))
    out = dict(model=preset, batch=batch, prompt=prompt, layers=config.num_hidden_layers)

    def phases(jitted, *args):
        t0 = time.perf_counter()
        lowered = jitted.lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        return t1 - t0, time.perf_counter() - t1

    state = jd.init_state(config, batch, prompt + 256, dtype=params.dtype)
    tokens = np.zeros((batch,), np.int32)
    kernels = jd.choose_kernels(config, batch, dtype=params.dtype)
    out["decode_trace_s"], out["decode_compile_s"] = phases(
        step.jit_decode_step(config, kernels), params, state, tokens, None)
    prompts = np.ones((batch, prompt), np.int32)
    out["prefill_trace_s"], out["prefill_compile_s"] = phases(
        step.jit_prefill(config), params, state, prompts, np.full((batch,), prompt, np.int32))
    del state
    rows = [list(range(1, prompt + 1))] * batch
    t0 = time.perf_counter()
    jax.block_until_ready(jd.generate(params, rows, 16).tokens)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(jd.generate(params, rows, 16).tokens)
    second = time.perf_counter() - t0
    out.update(generate_first_s=first, generate_compile_s=first - second,
               generate_second_s=second)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.8b,9b", help="comma-separated presets (e.g. 0.8b,9b)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the per-model subprocess
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.prompt, args.batch)))
        return
    import jax
    device = jax.devices()[0]
    print(f"# {device.device_kind}; jax {jax.__version__}; batch {args.batch}, prompt "
          f"{args.prompt}; one process per model, persistent cache off", flush=True)
    rows = []
    for name in args.models.split(","):
        preset = name if name == "tiny" else f"qwen3.5-{name}"
        proc = subprocess.run([sys.executable, __file__, "--one", preset, "--prompt",
                               str(args.prompt), "--batch", str(args.batch)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"# {preset}: failed:\n{proc.stderr[-2000:]}")
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print("  " + json.dumps(rows[-1]), flush=True)
    print("\n| model | layers | decode_step trace / compile s | prefill trace / compile s | "
          "first jd.generate s | of which compile s | second call s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} | {r['decode_trace_s']:.1f} / "
              f"{r['decode_compile_s']:.1f} | {r['prefill_trace_s']:.1f} / "
              f"{r['prefill_compile_s']:.1f} | {r['generate_first_s']:.1f} | "
              f"{r['generate_compile_s']:.1f} | {r['generate_second_s']:.2f} |")


if __name__ == "__main__":
    main()
