"""How far jd.score's two maths are apart: "chunked" (the prefill's chunked gated delta rule)
against "recurrent" (the decode step's one-token recurrence, the math rollouts sample with).

    python benchmarks/score_modes.py [--model 0.8b] [--layers 0] [--rows 4] [--prompt 64]
        [--continuation 256] [--dtypes float32,bfloat16]

Random weights with the preset's shapes (``--layers`` cuts the model), random prompts and
continuations. Per dtype: the largest and mean |chunked - recurrent| over the continuation
tokens' log-probabilities (nats), the largest relative gap of the sequence sums, and each mode's
time for the batch (second call, compile excluded).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np

import jaxdecode as jd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    config = jd.Config.from_preset(args.model if args.model == "tiny" else f"qwen3.5-{args.model}")
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers,
                                     layer_types=config.layer_types[:args.layers])
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (args.rows, args.prompt)).tolist()
    conts = rng.integers(0, config.vocab_size, (args.rows, args.continuation)).tolist()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.model} "
          f"({config.num_hidden_layers} layers), {args.rows} rows x {args.prompt} prompt + "
          f"{args.continuation} continuation tokens", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        params = jd.init_params(config, jax.random.key(0), dtype)
        out, secs = {}, {}
        for mode in ("chunked", "recurrent"):
            jd.score(params, prompts, conts, mode=mode).logprobs.block_until_ready()
            t0 = time.perf_counter()
            out[mode] = np.asarray(jd.score(params, prompts, conts, mode=mode).logprobs)
            secs[mode] = time.perf_counter() - t0
        gap = np.abs(out["chunked"] - out["recurrent"])
        sums = {m: out[m].astype(np.float64).sum(1) for m in out}
        rel = np.abs(sums["chunked"] - sums["recurrent"]) / np.abs(sums["recurrent"])
        rows.append((dtype, gap.max(), gap.mean(), rel.max(), secs["chunked"], secs["recurrent"]))
        print(f"  {rows[-1]}", flush=True)
    print("\n| dtype | max gap (nats) | mean gap | sum gap (relative) | chunked s | recurrent s |\n"
          "|---|---:|---:|---:|---:|---:|")
    for dtype, mx, mean, rel, tc, tr in rows:
        print(f"| {dtype} | {mx:.2e} | {mean:.2e} | {rel:.2e} | {tc:.3f} | {tr:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
