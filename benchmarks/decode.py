"""Whole decode-step benchmark on one GPU, against the memory roofline and Hugging Face.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/decode.py [--grid quick|targets|full]
        [--cells model:batch:context,...] [--hf] [--fp8 [--fp8-xla]]

Each (model, batch, max_len) compiles its own step (13-36 s on the H200), so the full grid does
not fit one 10-minute device call: ``targets`` (8 cells) does. Per-kernel anatomy of a step:
``benchmarks/step_profile.py``; several GPUs: ``benchmarks/sharded_decode.py``.

Per cell (model, batch, context already in the cache): median ms per decode step (50 steps per
repeat, 3 repeats, after warm-up; compile time apart), tokens/s (per row and total), bytes moved
per step and achieved GB/s against the device-to-device copy bandwidth measured in the same run.
Bytes per step = weights streamed (the embedding table counts as B rows unless tied, where the LM
head reads all of it) + K and V read up to each row's length + recurrent state read and written
+ conv windows read and written. Weights are bf16 fixed-seed random values (speed does not depend
on them), KV cache bf16, recurrent state float32; KV caches and states hold random values.

``--hf``: Hugging Face transformers (the version on the machine, with flash-linear-attention if
importable) decoding the same config with the SAME weights (shared from JAX through DLPack) at
batch 1 and 8, with its own cache, as its users run it; the ratio is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import step  # noqa: E402
from jaxdecode.params import params_to_hf  # noqa: E402

GRIDS = {
    # model: [(batch, context), ...]
    "smoke": {"tiny": [(1, 64), (2, 64)]},  # CPU check of the script itself
    "none": {},  # only the --generate cells
    "quick": {"qwen3.5-0.8b": [(1, 1024)], "qwen3.5-9b": [(1, 1024)]},
    # the target cells plus one cell of each other model (fits one 10-minute call)
    "targets": {"qwen3.5-0.8b": [(1, 1024), (64, 1024)],
                "qwen3.5-9b": [(1, 1024), (8, 1024), (64, 8192)],
                "qwen3.5-2b": [(1, 1024)], "qwen3.5-4b": [(1, 1024)],
                "qwen3.5-27b": [(1, 1024)]},
    "full": {
        "qwen3.5-0.8b": [(1, 1024), (8, 1024), (64, 1024), (256, 1024), (1, 8192), (64, 8192)],
        "qwen3.5-9b": [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (64, 1024),
                       (64, 8192), (64, 32768)],
        "qwen3.5-27b": [(1, 1024), (8, 1024), (64, 8192)],
        "qwen3.5-2b": [(1, 1024), (64, 1024)],
        "qwen3.5-4b": [(1, 1024), (64, 1024)],
    },
}
PREFILL = {"qwen3.5-0.8b": [2048, 8192], "qwen3.5-9b": [2048, 8192], "tiny": [32]}
HF_MODELS = ("qwen3.5-0.8b", "qwen3.5-9b")


def copy_bandwidth_gb_per_s() -> float:
    """Device memory bandwidth: the faster of a device-to-device copy and a streaming float32
    scale over 4 GiB (bytes read + bytes written)."""
    nbytes = (4 << 30) if jax.devices()[0].platform == "gpu" else (256 << 20)
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    best = 0.0
    # The f32 scale reached 4289 GB/s on an H200 where jnp.copy reached 3324 (RESULTS.md).
    for f in (jax.jit(lambda a: a.copy()), jax.jit(lambda a: a * jnp.float32(1.0001))):
        f(x).block_until_ready()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * nbytes / statistics.median(times) / 1e9)
    return best


def step_bytes(config: jd.Config, params, batch: int, context: int) -> dict[str, int]:
    c = config
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    emb = params.embed_tokens
    if not c.tie_word_embeddings:  # the embedding lookup reads B rows, not the table
        weights -= emb.size * emb.dtype.itemsize - batch * c.hidden_size * emb.dtype.itemsize
    kv = (2 * len(c.full_attention_layers) * batch * c.num_key_value_heads * context * c.head_dim
          * 2)
    rec = (2 * len(c.linear_attention_layers) * batch * c.linear_num_value_heads
           * c.linear_key_head_dim * c.linear_value_head_dim * 4)
    # the conv ring: the window's Kc-1 slots read, this token's slot written
    conv = len(c.linear_attention_layers) * batch * c.linear_conv_kernel_dim * c.linear_conv_dim * 2
    return {"weights": weights, "kv": kv, "state": rec + conv}


@functools.lru_cache(maxsize=None)
def _filler(shape, dtype, sharding):
    """A jitted ``key -> 0.1 * normal(shape)`` placed with ``sharding`` (one per leaf kind)."""
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32) * 0.1).astype(dtype),
                   out_shardings=sharding)


def randomize_state(state, context):
    """Random caches/states and lengths = context (so timings never run on zeros), each leaf
    keeping its sharding. Leaf by leaf, one small program per distinct leaf shape: one jitted
    fill of the whole state took over 3 minutes to compile for the 27B at batch 64 on the H200."""
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    out = [_filler(x.shape, x.dtype, x.sharding)(k) if jnp.issubdtype(x.dtype, jnp.floating)
           else x for k, x in zip(keys, leaves)]
    state = jax.tree.unflatten(tree, out)
    lengths = np.full(state.lengths.shape, context, state.lengths.dtype)
    return state.replace(lengths=jax.device_put(lengths, state.lengths.sharding))


def kernels_for(params, batch, attention="auto", **overrides) -> jd.Kernels:
    """``jd.choose_kernels`` for this cell, with ``attention`` ("auto" | "pallas" | "xla") and
    any other field overridden (one process can then time the step with and without a kernel)."""
    kernels = jd.choose_kernels(params.config, batch, dtype=params.dtype)
    if attention != "auto":
        overrides["attention"] = attention
    return dataclasses.replace(kernels, **overrides)


def time_decode(params, state, batch, steps=50, repeats=3, kernels=None, compiler_options=None,
                tokens=None):
    """(median s per step, compile s, compiled step); ``tokens`` [B] (default random ids on the
    default device; on a mesh pass them placed with ``sharding.shard_batch``)."""
    if tokens is None:
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, batch), jnp.int32)
    kernels = kernels or kernels_for(params, batch)
    t0 = time.perf_counter()
    compiled = step.jit_decode_step(params.config, kernels).lower(
        params, state, tokens, None).compile(compiler_options=compiler_options)
    compile_s = time.perf_counter() - t0
    for _ in range(5):
        logits, state = compiled(params, state, tokens, None)
    logits.block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, state = compiled(params, state, tokens, None)
        logits.block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    assert np.isfinite(np.asarray(logits)).all()
    return statistics.median(times), compile_s, compiled


def time_generate(params, batch, new_tokens=512, prompt_len=16, chunk_size=32):
    """``jd.generate`` (the whole loop on device: prefill, then a scan of decode steps with
    greedy sampling) for ``new_tokens`` tokens per row, EOS off. Returns (median seconds per
    generated token, including the short prefill; first call's seconds: compile + run)."""
    prompts = np.random.default_rng(2).integers(0, 1000, (batch, prompt_len)).tolist()

    def run():
        out = jd.generate(params, prompts, new_tokens, eos_token_ids=(), chunk_size=chunk_size)
        jax.block_until_ready(out.tokens)
        return out

    t0 = time.perf_counter()
    run()
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    assert (np.asarray(out.num_generated) == new_tokens).all()
    return statistics.median(times) / new_tokens, first_s


def hlo_kernel_count(compiled) -> dict[str, int]:
    """Kernels launched per step, read off the optimised HLO's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    kinds = {"fusion": 0, "custom-call": 0, "other": 0}
    skip = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "constant(")
    for line in entry.splitlines()[1:]:
        if " = " not in line or any(s in line for s in skip):
            continue
        head = line.split(" = ", 1)[1].split("(", 1)[0].split()
        op = head[-1] if head else "other"
        kinds[op if op in kinds else "other"] += 1
    return kinds


def layer_cost(config: jd.Config, full_dt: float) -> dict[str, float]:
    """Splits the batch-1 step time into a fixed part and a per-layer part by timing a 4-layer
    twin of the model (3 DeltaNet + 1 attention layer, same widths)."""
    small = dataclasses.replace(config, num_hidden_layers=4,
                                layer_types=config.layer_types[:4])
    params = jd.init_params(small, jax.random.key(0), "bfloat16")
    state = randomize_state(jd.init_state(small, 1, 1024 + 256, dtype="bfloat16"), 1024)
    dt4, _, _ = time_decode(params, state, 1)
    per_block = (full_dt - dt4) / (config.num_hidden_layers / 4 - 1)  # one 3+1 block of layers
    return dict(ms_4_layers=dt4 * 1e3, ms_per_4_layer_block=per_block * 1e3,
                ms_fixed=(dt4 - per_block) * 1e3)


def time_prefill(params, config, length):
    state = jd.init_state(config, batch_size=1, max_len=length, dtype="bfloat16")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 1000, (1, length)), jnp.int32)
    lengths = jnp.array([length], jnp.int32)
    t0 = time.perf_counter()
    compiled = step.jit_prefill(config).lower(params, state, tokens, lengths).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(4):
        state = state.replace(lengths=jnp.zeros_like(state.lengths))
        t0 = time.perf_counter()
        logits, state = compiled(params, state, tokens, lengths)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), compile_s


def hf_decode(params, config: jd.Config, batch: int, context: int, steps: int = 32):
    """transformers on the same weights (DLPack), its own cache, greedy decode after a prompt."""
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {k: v for k, v in config.to_hf_config().items()
              if k not in ("model_type", "architectures")}
    hf_cfg = Qwen3_5TextConfig(**fields)
    with torch.device("cuda"):
        m = Qwen3_5ForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    flat = {k: torch.from_dlpack(v) for k, v in params_to_hf(params).items()}
    if config.tie_word_embeddings:
        flat["lm_head.weight"] = flat["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(flat, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    m.eval()
    import importlib.util
    backend = ("flash-linear-attention installed" if importlib.util.find_spec("fla")
               else "torch reference kernels (fla not installed)")
    prompt = torch.randint(0, 1000, (batch, context), device="cuda")
    with torch.no_grad():
        out = m(input_ids=prompt, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(4):
            out = m(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
    del m, cache, out
    torch.cuda.empty_cache()
    return dt, f"transformers {transformers.__version__}, GDN kernels from {backend}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="targets",
                    help="cells to time (default: targets; full needs several device calls)")
    ap.add_argument("--cells", default="",
                    help="comma-separated model:batch:context cells (e.g. 9b:1:1024,9b:64:8192) "
                         "timed instead of the --grid cells")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="each model's cells again with its Linears in block FP8 "
                    "(jd.quantize_fp8 of the same weights)")
    ap.add_argument("--fp8-xla", action="store_true",
                    help="with --fp8: the FP8 cells once more with XLA's form of the FP8 "
                         "Linears (dequantise, then dot) instead of the kernel")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-anatomy", action="store_true",
                    help="skip the 4-layer twin that splits the batch-1 step into parts")
    ap.add_argument("--attention", choices=("auto", "pallas", "xla"), default="auto",
                    help="decode attention: jd.choose_kernels' choice, or forced")
    ap.add_argument("--compare-attention", action="store_true",
                    help="also time every cell with XLA attention in the "
                         "same run: ms/step of the whole step with and without the kernel")
    ap.add_argument("--generate", default="",
                    help="comma-separated model:batch cells (e.g. 0.8b:1,9b:1) also timed "
                         "through jd.generate: 512 new tokens from a 16-token prompt, the whole "
                         "loop on device (no host dispatch per step); with --fp8 the FP8 "
                         "weights too")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    args = ap.parse_args()
    if args.fp8_xla and not args.fp8:
        ap.error("--fp8-xla goes with --fp8")
    cells_grid = None  # --cells, checked before any device work
    if args.cells:
        cells_grid = {}
        for cell in args.cells.split(","):
            parts = cell.split(":")
            if (len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit())
                    or int(parts[1]) < 1 or int(parts[2]) < 1):
                ap.error(f"--cells: {cell!r} is not model:batch:context with batch and context "
                         "at least 1 (e.g. 9b:1:1024)")
            preset = f"qwen3.5-{parts[0]}" if parts[0] != "tiny" else "tiny"
            try:
                jd.Config.from_preset(preset)
            except ValueError as e:
                ap.error(f"--cells: {cell!r}: {e}")
            cells_grid.setdefault(preset, []).append((int(parts[1]), int(parts[2])))

    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind}; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; attention={args.attention}")
    bw = copy_bandwidth_gb_per_s()
    print(f"# measured copy bandwidth: {bw:.0f} GB/s")
    rows, prefill_rows, hf_rows, anatomy, generate_rows = [], [], [], {}, []
    generate_cells = {}
    for cell in filter(None, args.generate.split(",")):
        if cell.count(":") != 1 or not cell.split(":")[1].isdigit():
            ap.error(f"--generate: {cell!r} is not model:batch (e.g. 0.8b:1)")
        name, batch = cell.split(":")
        generate_cells.setdefault(f"qwen3.5-{name}" if name != "tiny" else name,
                                  []).append(int(batch))
    grid = dict(GRIDS[args.grid]) if cells_grid is None else cells_grid
    for name in generate_cells:
        grid.setdefault(name, [])
    for name, cells in grid.items():
        config = jd.Config.from_preset(name)
        t0 = time.perf_counter()
        params = jd.init_params(config, jax.random.key(0), "bfloat16")
        jax.block_until_ready(params)
        print(f"# {name}: {jd.num_params(params) / 1e9:.2f}B params, init "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
        variants = [(name, params, {})]
        if args.fp8:  # the same weights, quantised: the cells again, side by side
            fp8 = jd.quantize_fp8(params)
            variants.append((f"{name} fp8", fp8, {}))
            if args.fp8_xla:
                variants.append((f"{name} fp8 xla-form", fp8, dict(fp8_linear="xla")))
        for (label, weights, overrides), (batch, context) in [(v, c) for v in variants
                                                              for c in cells]:
            state = jd.init_state(config, batch, context + 256, dtype="bfloat16")
            state = randomize_state(state, context)
            dt, compile_s, compiled = time_decode(
                weights, state, batch,
                kernels=kernels_for(weights, batch, args.attention, **overrides))
            nbytes = step_bytes(config, weights, batch, context)
            total = sum(nbytes.values())
            row = dict(model=label, batch=batch, context=context, ms_per_step=dt * 1e3,
                       tok_per_s_per_row=1 / dt, tok_per_s=batch / dt, compile_s=compile_s,
                       weights_gb=nbytes["weights"] / 1e9, kv_gb=nbytes["kv"] / 1e9,
                       state_gb=nbytes["state"] / 1e9, gb_per_s=total / dt / 1e9,
                       pct_copy_bw=100 * total / dt / 1e9 / bw)
            if args.compare_attention:
                state = randomize_state(jd.init_state(config, batch, context + 256,
                                                       dtype="bfloat16"), context)
                dt_ref, _, _ = time_decode(params, state, batch,
                                           kernels=kernels_for(params, batch, "xla"))
                row["ms_per_step_xla_attention"] = dt_ref * 1e3
            rows.append(row)
            print("  " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in row.items()}), flush=True)
            if (batch == 1 and context == 1024 and label in ("qwen3.5-0.8b", "qwen3.5-9b")
                    and not args.no_anatomy):
                anatomy[name] = dict(kernels=hlo_kernel_count(compiled), ms=dt * 1e3,
                                     **layer_cost(config, dt))
            del state, compiled
        for (label, weights, overrides), batch in [(v, b) for v in variants
                                                   for b in generate_cells.get(name, [])]:
            if overrides:  # (jd.generate picks its own kernels)
                continue
            dt, first_s = time_generate(weights, batch)
            generate_rows.append(dict(model=label, batch=batch, ms_per_token=dt * 1e3,
                                      tok_per_s=batch / dt, first_call_s=first_s))
            print("  generate " + json.dumps(generate_rows[-1]), flush=True)
        del variants
        if not args.no_prefill:
            for length in PREFILL.get(name, []):
                dt, compile_s = time_prefill(params, config, length)
                prefill_rows.append(dict(model=name, prompt=length, ms=dt * 1e3,
                                         tok_per_s=length / dt, compile_s=compile_s))
                print("  prefill " + json.dumps(prefill_rows[-1]), flush=True)
        if args.hf and name in HF_MODELS:
            for batch in (1, 8):
                try:
                    hf_dt, backend = hf_decode(params, config, batch, 1024)
                except Exception as e:  # report, don't hide: the JAX numbers stand alone
                    print(f"  HF {name} batch {batch} failed: {type(e).__name__}: {e}")
                    continue
                ours = next((r for r in rows if r["model"] == name and r["batch"] == batch
                             and r["context"] == 1024), None)
                hf_rows.append(dict(model=name, batch=batch, hf_ms=hf_dt * 1e3,
                                    ours_ms=ours["ms_per_step"] if ours else float("nan"),
                                    backend=backend))
                print("  hf " + json.dumps(hf_rows[-1]), flush=True)
        del params

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__, copy_gb_per_s=bw,
                           decode=rows, prefill=prefill_rows, hf=hf_rows, anatomy=anatomy,
                           generate=generate_rows), f,
                      indent=1)
    print(f"\n## Decode step ({dev.device_kind}, jax {jax.__version__}, copy bandwidth "
          f"{bw:.0f} GB/s)\n")
    compare = args.compare_attention
    print("| model | batch | context | ms/step | tok/s/row | tok/s | GB moved | GB/s | % copy bw "
          "| compile s |" + (" ms/step, XLA attention |" if compare else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if compare else ""))
    for r in rows:
        moved = r["weights_gb"] + r["kv_gb"] + r["state_gb"]
        print(f"| {r['model']} | {r['batch']} | {r['context']} | {r['ms_per_step']:.3f} | "
              f"{r['tok_per_s_per_row']:.0f} | {r['tok_per_s']:.0f} | {moved:.2f} | "
              f"{r['gb_per_s']:.0f} | {r['pct_copy_bw']:.0f}% | {r['compile_s']:.1f} |"
              + (f" {r['ms_per_step_xla_attention']:.3f} |" if compare else ""))
    if generate_rows:
        print("\n| model | batch | jd.generate ms/token | tok/s | first call s |\n"
              "|---|---|---|---|---|")
        for r in generate_rows:
            print(f"| {r['model']} | {r['batch']} | {r['ms_per_token']:.3f} | "
                  f"{r['tok_per_s']:.0f} | {r['first_call_s']:.1f} |")
    if prefill_rows:
        print("\n| model | prompt | prefill ms | prefill tok/s | compile s |\n|---|---|---|---|---|")
        for r in prefill_rows:
            print(f"| {r['model']} | {r['prompt']} | {r['ms']:.1f} | {r['tok_per_s']:.0f} | "
                  f"{r['compile_s']:.1f} |")
    if hf_rows:
        print("\n| model | batch | HF ms/token | jaxdecode ms/token | speed-up |\n|---|---|---|---|---|")
        for r in hf_rows:
            print(f"| {r['model']} | {r['batch']} | {r['hf_ms']:.2f} | {r['ours_ms']:.3f} | "
                  f"{r['hf_ms'] / r['ours_ms']:.1f}x |")
        print(f"\nHF backend: {hf_rows[0]['backend']}")
    for name, kinds in anatomy.items():
        print(f"\n{name} batch 1 step: kernels in the optimised HLO entry: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
