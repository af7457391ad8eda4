"""Decode step on several GPUs: tensor parallel (TP) and data parallel (DP) against one GPU.

    python benchmarks/sharded_decode.py [--models 9b,27b] [--context 1024] [--json FILE]
        [--setups TP1:1,TP2:1] [--options '{"xla_gpu_...": value}']

For each model (published shapes, bf16 fixed-seed random weights, bf16 KV cache, float32
recurrent state, every row at ``--context`` tokens already in the cache) and each setup:

  TP1   mesh (data=1, model=1): one GPU                     batch 1 and 64
  TP2   mesh (1, 2): heads, MLP and vocabulary split        batch 1 and 64
  DP2   mesh (2, 1): rows split, weights replicated         batch 64

it compiles ``jaxdecode.step.jit_decode_step`` with ``jd.choose_kernels(..., mesh=mesh)`` (state
donated, the Pallas kernels per device under ``shard_map``), reports median ms per step (3
repeats of 30 steps after warm-up), tokens/s and the speed-up over TP1 at the same batch,
counts the collectives in the compiled step (and their bytes per device), and checks the logits
of one step against TP1 from the same state (relative max difference; bf16). On CPU
(``--models demo`` with XLA_FLAGS=--xla_force_host_platform_device_count=2) it checks the script
itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import sharding  # noqa: E402
from jaxdecode.step import jit_decode_step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import randomize_state  # noqa: E402

SETUPS = (("TP1", 1, 1, 1), ("TP1", 1, 1, 64), ("TP2", 1, 2, 1), ("TP2", 1, 2, 64),
          ("DP2", 2, 1, 64))


def config_for(name: str) -> jd.Config:
    if name == "demo":  # CPU check: tiny widths, head counts that split 2 ways
        return dataclasses.replace(jd.Config.from_preset("tiny"), num_attention_heads=16,
                                   num_key_value_heads=8, linear_num_key_heads=8,
                                   linear_num_value_heads=16)
    return jd.Config.from_preset(f"qwen3.5-{name}")


def random_state(config, mesh, batch, context, max_len):
    state = sharding.init_state_sharded(config, mesh, batch, max_len, dtype="bfloat16")
    return randomize_state(state, context)  # leaf by leaf, shardings kept


def _shape_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array type such as ``bf16[1,4096]`` (``pred``: 1 byte; ``s4``: half)."""
    bits = 8 if dtype == "pred" else int(re.search(r"(\d+)", dtype).group(1))
    return int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} of the collectives in a compiled module's text: each op once (an
    async pair by its ``-start``), bytes of its result per device (an async all-gather's or
    permute's (operands, results[, u32[] contexts]) tuple: the results, the scalar contexts
    left out)."""
    names = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    found = {}
    for result, kind, start in re.findall(
            r"= (\([^=]*?\)|\S+) (" + "|".join(names) + r")(-start)?\(", hlo):
        shapes = [(dt, dims) for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)
                  if not (start and dims == "")]
        if start and kind != "all-reduce" and len(shapes) > 1:
            shapes = shapes[len(shapes) // 2:]
        nbytes = sum(_shape_bytes(dt, dims) for dt, dims in shapes)
        count, total = found.get(kind, (0, 0))
        found[kind] = (count + 1, total + nbytes)
    return found


def describe(comm: dict[str, tuple[int, int]]) -> str:
    """"9 all-reduce (72 KiB)" per kind, or "none"."""
    return ", ".join(f"{n} {k} ({b / 1024:.0f} KiB)" for k, (n, b) in comm.items()) or "none"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="9b,27b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--setups", default=None,
                    help="subset as SETUP:BATCH,..., e.g. TP1:1,TP2:1 (default: all five)")
    ap.add_argument("--options", default="{}",
                    help="XLA compiler options (JSON object) for every compile of the step, "
                         "to A/B them against a run without")
    args = ap.parse_args()
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as e:
        ap.error(f"--options is not JSON ({e}): {args.options!r}")
    if not isinstance(options, dict):
        ap.error(f"--options must be a JSON object of XLA option names to values, got "
                 f"{args.options!r}")
    options = options or None
    setups = SETUPS
    if args.setups is not None:
        known = {f"{s[0]}:{s[3]}": s for s in SETUPS}
        asked = [x for x in args.setups.split(",") if x]
        unknown = [x for x in asked if x not in known]
        if unknown:
            ap.error(f"--setups: unknown {unknown}; choose from {sorted(known)}")
        setups = [s for s in SETUPS if f"{s[0]}:{s[3]}" in asked]
        missing = sorted({f"TP1:{s[3]}" for s in setups} - set(asked))
        if missing:
            ap.error(f"--setups needs the one-GPU reference of each batch: add {missing}")
    devices = jax.devices()
    print(f"# {len(devices)} x {devices[0].device_kind}; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; compiler options {options}", flush=True)
    if len(devices) < 2:
        raise SystemExit("needs 2 devices")
    rows = []
    for name in args.models.split(","):
        config = config_for(name)
        reference_logits = {}
        params = None
        for setup, data, model_size, batch in setups:
            mesh = sharding.make_mesh(data, model_size, devices=devices[:data * model_size])
            t0 = time.perf_counter()
            if params is None:
                # Eager init on the first device, then placement. (A jitted init with
                # out_shardings took 188 s to compile for the 9B shapes on the H200.)
                params = jd.init_params(config, jax.random.key(0), "bfloat16")
            params = sharding.shard_params(params, mesh)  # reshard on device; old one freed
            config = params.config  # KV heads repeated where the mesh needs it
            jax.block_until_ready(params)
            place_s = time.perf_counter() - t0
            print(f"  {name} {setup} batch {batch}: params placed in {place_s:.1f} s", flush=True)
            max_len = args.context + 128
            step = jit_decode_step(config, jd.choose_kernels(config, batch, dtype=params.dtype,
                                                             mesh=mesh))
            tokens = sharding.shard_batch(
                np.random.default_rng(0).integers(0, 1000, batch).astype(np.int32), mesh)
            t0 = time.perf_counter()
            state = jax.block_until_ready(random_state(config, mesh, batch, args.context,
                                                       max_len))
            print(f"  state filled in {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            compiled = step.lower(params, state, tokens, None).compile(compiler_options=options)
            compile_s = time.perf_counter() - t0
            print(f"  step compiled in {compile_s:.1f} s", flush=True)
            comm = collectives(compiled.as_text())
            logits, state = compiled(params, state, tokens, None)
            first = np.asarray(jax.device_get(logits), np.float32)
            key = batch
            if setup == "TP1":
                reference_logits[key] = first
                diff = 0.0
            else:
                ref = reference_logits[key]
                diff = float(np.abs(first - ref).max() / np.abs(ref).max())
            for _ in range(3):
                logits, state = compiled(params, state, tokens, None)
            logits.block_until_ready()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    logits, state = compiled(params, state, tokens, None)
                logits.block_until_ready()
                times.append((time.perf_counter() - t0) / args.steps)
            dt = statistics.median(times)
            row = dict(model=name, setup=setup, mesh=f"({data},{model_size})", batch=batch,
                       context=args.context, ms_per_step=dt * 1e3, tok_per_s=batch / dt,
                       compile_s=compile_s, place_s=place_s, collectives=comm,
                       logits_rel_diff_vs_tp1=diff)
            rows.append(row)
            print("  " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                     for k, v in row.items()}), flush=True)
            del state, compiled, logits
        del params
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(devices=f"{len(devices)} x {devices[0].device_kind}",
                           jax=jax.__version__, rows=rows), f, indent=1)
    base = {(r["model"], r["batch"]): r["ms_per_step"] for r in rows if r["setup"] == "TP1"}
    print(f"\n## Sharded decode step ({len(devices)} x {devices[0].device_kind}, jax "
          f"{jax.__version__}, context {args.context})\n")
    print("| model | setup | mesh (data, model) | batch | ms/step | tok/s | vs TP1 | collectives "
          "per step (bytes per device) | logits vs TP1 | compile s |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        comm = describe(r["collectives"])
        print(f"| {r['model']} | {r['setup']} | {r['mesh']} | {r['batch']} | "
              f"{r['ms_per_step']:.3f} | {r['tok_per_s']:.0f} | "
              f"{base[(r['model'], r['batch'])] / r['ms_per_step']:.2f}x | {comm} | "
              f"{r['logits_rel_diff_vs_tp1']:.1e} | {r['compile_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
