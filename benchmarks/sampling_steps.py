"""Sampling steps decided on the host vs under ``lax.cond``, inside ``jd.generate``'s loop.

    python benchmarks/sampling_steps.py [--layers 4] [--model 0.8b] [--tokens 256]

One process, same inputs: the whole generation loop (``generation.generate_fn``: prefill, then
``lax.scan`` chunks of up to 32 decode steps with sampling) compiled twice per sampling setting:

  lax.cond  ``features=None`` with the sampling values traced: every sampling step (penalties,
            top-k, top-p, min-p, the draw) runs under a ``lax.cond`` on its values; on a GPU each
            one copies its predicate to the host and waits for the device.
  host      ``features=sampling.features_of(values)`` (what ``jd.generate`` passes): the steps
            no row uses are left out of the program; no conditional per token.

The model is the preset's shapes cut to ``--layers`` layers (default 4: three Gated DeltaNet and
one attention layer, so each compile takes seconds); bf16 random weights; batch 2 (a one-row loop
is padded to two on GPUs anyway); 16-token prompts; ``--tokens`` a power of two (the loop runs
the bucketed budget). Reports ms per generated token (median of 5 runs) and checks that both
programs emit the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np

import jaxdecode as jd
from jaxdecode import sampling as S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_loop import compile_loop  # noqa: E402
from generate_loop import time_loop as time_loop_of  # noqa: E402

from jaxdecode import generation as G  # noqa: E402

SETTINGS = (("greedy", None), ("top_p", S.SamplingParams.create(temperature=0.7, top_p=0.9)))


def time_loop(params, plan, features, runs=5):
    """(median ms per generated token, compile s, tokens) of one compiled generation loop
    (``generate_loop.compile_loop``: ``jd.generate``'s program, ``jd.COMPILER_OPTIONS``)."""
    compiled, args, compile_s = compile_loop(params, plan, features)
    ms, tokens = time_loop_of(compiled, args, plan.max_new_tokens, runs=runs)
    return ms, compile_s, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    config = jd.Config.from_preset(f"qwen3.5-{args.model}")
    if args.tokens < 16 or args.tokens & (args.tokens - 1):
        ap.error(f"--tokens must be a power of two >= 16 (the generate budget bucket), got "
                 f"{args.tokens}")
    if not 1 <= args.layers <= config.num_hidden_layers:
        ap.error(f"--layers must be in [1, {config.num_hidden_layers}]")
    if "full_attention" not in config.layer_types[:args.layers]:
        ap.error("--layers must include a full-attention layer (4 or more for Qwen3.5)")
    config = dataclasses.replace(config, num_hidden_layers=args.layers,
                                 layer_types=config.layer_types[:args.layers])
    params = jd.init_params(config, jax.random.key(0), "bfloat16")
    prompts = np.random.default_rng(0).integers(0, 1000, (2, 16)).tolist()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; qwen3.5-{args.model} shapes, "
          f"{args.layers} layers; batch 2; {args.tokens} tokens", flush=True)
    rows = []
    for name, sampling in SETTINGS:
        plan = G._plan(params, prompts, args.tokens, sampling, None, (), max_len=None,
                       num_samples=1, chunk_size=32, pad_id=-1, kernels=None)
        results = {}
        for label, features in (("lax.cond", None), ("host", plan.features)):
            results[label] = time_loop(params, plan, features)
            print(f"  {name} {label}: {results[label][0]:.4f} ms/token (compile "
                  f"{results[label][1]:.1f} s)", flush=True)
        rows.append((name, results))
    print("\n| sampling | lax.cond ms/token | host ms/token | saved us/token | speed-up | "
          "same tokens |\n|---|---:|---:|---:|---:|---|")
    for name, r in rows:
        a, b = r["lax.cond"], r["host"]
        print(f"| {name} | {a[0]:.4f} | {b[0]:.4f} | {(a[0] - b[0]) * 1e3:.1f} | "
              f"{a[0] / b[0]:.2f}x | {np.array_equal(a[2], b[2])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
