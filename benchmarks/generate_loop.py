"""The whole generation loop (``jd.generate``'s program) on the GPU: time per token, kernel time
per token, and XLA option variants, all in one process.

    python benchmarks/generate_loop.py [--cells 0.8b:1,9b:1] [--tokens 512]
        [--sampling greedy,top_p] [--options ';name=value,...'] [--layers N] [--top N]
        [--logprobs N]

Per cell (model:batch), sampling setting and XLA compiler-option variant (``--options``,
';'-separated, '' = the library's ``jd.COMPILER_OPTIONS`` alone, as in
``benchmarks/step_profile.py``): the program ``jd.generate`` runs (``generation.generate_fn``:
prefill of a 16-token prompt, then ``lax.scan`` chunks of 32 decode steps with sampling), compiled with ``jd.COMPILER_OPTIONS`` plus the
variant's options, and run ``--tokens`` tokens per row with EOS off. Reported:

  ms/token     median wall time of 3 runs / tokens (prefill included; it is 1 of the tokens)
  kernel ms    the sum of CUPTI kernel times of one run / tokens (CUDA-graph kernels included)
  gap ms       ms/token - kernel ms: time the GPU waits for the host (launches, syncs)
  kernels      kernels launched per token

and whether every variant of a cell and sampling setting emits the same tokens. ``--per-call``
also times, in the same process, a Python loop of public ``jd.decode_step`` calls (greedy:
``argmax`` of the logits on the device, as in the README) for ``--tokens`` steps after a
prefill of the same prompt, the variant "per-call jd.decode_step" (its ms/token over the
loop's greedy one: the cost of one step per Python call), the same loop passing the previous
logits as ``out`` (the step writes one buffer every call), and both loops calling the jitted
step without the host-side checks (``step.jit_decode_step``), so the checks' cost shows. ``--logprobs N``
runs each setting again with ``return_logprobs`` and N top log-probabilities (the loop's
outputs include them), as the variant "logprobs N".
The model is the preset's shapes (``--layers`` cuts it, for quick checks), bf16 random weights.
"""

from __future__ import annotations

import argparse
import collections
import functools
import dataclasses
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
from jaxdecode import sampling as S  # noqa: E402
from step_profile import cupti_kernels, parse_options  # noqa: E402

from jaxdecode import generation as G  # noqa: E402
from jaxdecode import step  # noqa: E402

SAMPLING = {"greedy": None, "top_p": S.SamplingParams.create(temperature=0.7, top_p=0.9),
            # HF's prefix rule: the second cut-off search over the tied ids
            "top_p_prefix": S.SamplingParams.create(temperature=0.7, top_p=0.9,
                                                    top_p_keep_ties=False)}


def compile_loop(params, plan, features, compiler_options=None, logprobs=None):
    """(compiled ``args -> tokens`` (and the Logprobs with ``logprobs``), its arguments,
    compile seconds) for the whole loop."""
    config = params.config
    rows = plan.prompts.shape[0]

    def run(params, prompts, lengths, budgets, sampling, keys, eos):
        state = jd.init_state(config, rows, plan.max_len, dtype=params.dtype)
        out, _ = G.generate_fn(params, state, prompts, lengths, budgets, sampling, keys, eos,
                               max_new_tokens=plan.max_new_tokens, chunk_size=plan.chunk_size,
                               features=features, kernels=plan.kernels, logprobs=logprobs)
        return out.tokens if logprobs is None else (out.tokens, out.logprobs)

    args = (params, plan.prompts, plan.prompt_lengths, plan.budgets, plan.sampling, plan.keys,
            plan.eos_token_ids)
    t0 = time.perf_counter()
    # jd.generate's jit carries jd.COMPILER_OPTIONS; the variant's options are added to them
    compiled = jax.jit(run, compiler_options=jd.COMPILER_OPTIONS).lower(*args).compile(
        compiler_options=compiler_options or None)
    return compiled, args, time.perf_counter() - t0


def time_loop(compiled, args, tokens_per_row, runs=3):
    """(median ms per generated token, tokens [R, N] of the last run)."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    tokens = out[0] if isinstance(out, tuple) else out
    return statistics.median(times) / tokens_per_row * 1e3, np.asarray(tokens)


def time_per_call(params, prompts, tokens_per_row, runs=3, validated=True, out=False):
    """Median ms per token of a Python loop of ``jd.decode_step`` calls (greedy), after a
    prefill of ``prompts``; every run appends ``tokens_per_row`` tokens to the same state.
    ``validated=False``: the jitted step it calls (``step.jit_decode_step``), without the
    host-side checks. ``out``: each call passes the previous logits as ``out`` (unvalidated:
    to ``step.jit_decode_step(..., logits_out=True)``)."""
    batch, length = len(prompts), len(prompts[0])
    state = jd.init_state(params.config, batch, length + (runs + 1) * tokens_per_row + 64,
                          dtype=params.dtype)
    logits, state = jd.prefill(params, state, np.asarray(prompts, np.int32),
                               np.full(batch, length, np.int32))
    argmax = jax.jit(lambda x: x.argmax(-1).astype(np.int32))
    kernels = jd.choose_kernels(params.config, batch, dtype=params.dtype)
    raw = step.jit_decode_step(params.config, kernels, logits_out=out)

    def run(logits, state):
        for _ in range(tokens_per_row):
            if out and validated:
                logits, state = jd.decode_step(params, state, argmax(logits), out=logits)
            elif out:
                logits, state = raw(params, state, argmax(logits), None, logits)
            elif validated:
                logits, state = jd.decode_step(params, state, argmax(logits))
            else:
                logits, state = raw(params, state, argmax(logits), None)
        return logits, state

    logits, state = jax.block_until_ready(run(logits, state))  # compile + warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        logits, state = jax.block_until_ready(run(logits, state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / tokens_per_row * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1,9b:1", help="model:batch,...")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--sampling", default="greedy", help=f"comma-separated, of {list(SAMPLING)}")
    ap.add_argument("--options", default="",
                    help="';'-separated XLA compiler-option variants, each 'name=value,...' "
                         "('' = defaults), e.g. ';xla_gpu_graph_min_graph_size=1'")
    ap.add_argument("--layers", type=int, default=0, help="cut each model to N layers (0: all)")
    ap.add_argument("--no-cupti", action="store_true", help="skip the kernel-time run")
    ap.add_argument("--logprobs", type=int, default=-1,
                    help="also run with return_logprobs and this many top ones (-1: not)")
    ap.add_argument("--per-call", action="store_true",
                    help="also time a Python loop of jd.decode_step calls (greedy)")
    ap.add_argument("--top", type=int, default=0,
                    help="also list the N kernels (by name) with the most time per token")
    args = ap.parse_args()
    if args.tokens < 16 or args.tokens & (args.tokens - 1):
        ap.error(f"--tokens must be a power of two >= 16 (the generate budget bucket), got "
                 f"{args.tokens}")
    unknown = [s for s in args.sampling.split(",") if s not in SAMPLING]
    if unknown:
        ap.error(f"--sampling: unknown {unknown}; choose from {list(SAMPLING)}")
    variants = args.options.split(";")
    for opts in variants:  # a malformed or unknown option fails here, before any real work
        try:
            jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=parse_options(opts)
                                                       or None)
        except Exception as e:  # noqa: BLE001 (XLA raises its own error types)
            ap.error(f"--options {opts!r}: {e}")
    cells = []
    for cell in args.cells.split(","):
        name, _, batch = cell.partition(":")
        preset = name if name == "tiny" else f"qwen3.5-{name}"
        if preset not in jd.PRESETS or not batch.isdigit() or int(batch) < 1:
            ap.error(f"--cells: {cell!r} is not model:batch with a model of "
                     f"{sorted(p.removeprefix('qwen3.5-') for p in jd.PRESETS)} and batch >= 1")
        config = jd.Config.from_preset(preset)
        if not 0 <= args.layers <= config.num_hidden_layers:
            ap.error(f"--layers must be in [0, {config.num_hidden_layers}] for {name}")
        if args.layers:
            if "full_attention" not in config.layer_types[:args.layers]:
                ap.error("--layers must include a full-attention layer (4 or more for Qwen3.5)")
            config = dataclasses.replace(config, num_hidden_layers=args.layers,
                                         layer_types=config.layer_types[:args.layers])
        cells.append((name, int(batch), config))
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {args.tokens} tokens per row",
          flush=True)
    rows = []
    for name, batch, config in cells:
        params = jd.init_params(config, jax.random.key(0), "bfloat16")
        prompts = np.random.default_rng(0).integers(0, 1000, (batch, 16)).tolist()
        for sampling_name in args.sampling.split(","):
            plan = G._plan(params, prompts, args.tokens, SAMPLING[sampling_name], None, (),
                           max_len=None, num_samples=1, chunk_size=32, pad_id=-1,
                           kernels=None)
            reference = None
            runs = [(opts, None) for opts in variants]
            if args.logprobs >= 0:
                runs.append(("", args.logprobs))
            for opts, logprobs in runs:
                compiled, call_args, compile_s = compile_loop(params, plan, plan.features,
                                                              parse_options(opts), logprobs)
                ms, tokens = time_loop(compiled, call_args, args.tokens)
                kernels = ([] if args.no_cupti
                           else cupti_kernels(functools.partial(compiled, *call_args)))
                kernel_ms = sum(t for _, t in kernels) / args.tokens
                same = reference is None or np.array_equal(tokens, reference)
                reference = tokens if reference is None else reference
                timed = bool(kernels)  # no CUPTI (CPU, or --no-cupti): no kernel columns
                label = opts or ("library defaults" if logprobs is None
                                 else f"logprobs {logprobs}")
                row = (f"{name} b{batch} {sampling_name}", label, ms,
                       kernel_ms if timed else None, len(kernels) / args.tokens if timed else None,
                       compile_s, same)
                rows.append(row)
                print(f"  {row[0]} [{row[1]}]: {ms:.4f} ms/token, kernels "
                      + (f"{kernel_ms:.4f} ms/token ({row[4]:.0f} per token)" if timed else "n/a")
                      + f", compile {compile_s:.1f} s, same tokens {same}", flush=True)
                if args.top and kernels:
                    by_name = collections.defaultdict(lambda: [0, 0.0])
                    for kname, t in kernels:
                        entry = by_name[re.sub(r"[._]\d+$", "", kname)[:70]]
                        entry[0] += 1
                        entry[1] += t
                    for kname, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[
                            :args.top]:
                        print(f"    {t / args.tokens * 1e3:7.2f} us/token {count / args.tokens:6.2f}"
                              f"/token  {kname}")
                del compiled
            if args.per_call and sampling_name == "greedy":
                loop_ms = next(r[2] for r in rows if r[0] == f"{name} b{batch} greedy")
                for label, validated, out in (
                        ("per-call jd.decode_step", True, False),
                        ("per-call jd.decode_step, out=logits", True, True),
                        ("per-call step.jit_decode_step, unvalidated", False, False),
                        ("per-call step.jit_decode_step, unvalidated, out=logits", False, True)):
                    ms = time_per_call(params, prompts, args.tokens, validated=validated,
                                       out=out)
                    rows.append((f"{name} b{batch} greedy", label, ms, None, None, 0.0, None))
                    print(f"  {name} b{batch} {label}: {ms:.4f} ms/token, "
                          f"{ms / loop_ms:.3f}x the loop", flush=True)
        del params
    print("\n| cell | XLA options | ms/token | tok/s | x first row of cell | kernel ms/token "
          "| gap ms | kernels/token | compile s | same tokens |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for tag, opts, ms, kernel_ms, n, compile_s, same in rows:
        first = next(r[2] for r in rows if r[0] == tag)
        batch = int(tag.split()[1][1:])
        kernel_cols = ("n/a | n/a | n/a" if kernel_ms is None else
                       f"{kernel_ms:.4f} | {ms - kernel_ms:.4f} | {n:.0f}")
        print(f"| {tag} | {opts} | {ms:.4f} | {batch * 1e3 / ms:,.0f} | {ms / first:.3f} | "
              f"{kernel_cols} | {compile_s:.1f} | {'n/a' if same is None else same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
