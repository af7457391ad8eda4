"""Anatomy of one decode step on the GPU: every kernel it launches, with its CUPTI time.

    python benchmarks/step_profile.py [--cells 0.8b:1:1024,9b:1:1024] [--attention auto,reference]
        [--deltanet auto,reference] [--options ';name=value,...'] [--pdl on,off] [--fp8]
        [--fp8-linear auto,pallas,xla] [--layers N]

Per cell (model:batch:context) and variant (attention and DeltaNet implementations, XLA
options): wall ms per step (the same timing as ``benchmarks/decode.py``), the sum of kernel
times of one step (CUPTI through ``jax.experimental.mosaic.gpu``; CUDA-graph kernels included),
the difference (time the GPU sits between kernels: launch gaps and host work), the number of
kernels, the copy ops left in the compiled step (a copy of a state buffer means an update was
not done in place), and the kernels grouped by family and by the layer kind they come from (read
off the named scopes in the optimised HLO's metadata). The largest kernels are listed last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode.kernels import wait_for_inputs  # noqa: E402
from decode import kernels_for, randomize_state, time_decode  # noqa: E402

CHOICES = ("auto", "pallas", "xla")
DELTANET = {"auto": {}, "pallas": dict(deltanet="pallas"),
            "xla": dict(deltanet="xla", delta_rule="xla")}
FP8_LINEAR = {"auto": {}, "pallas": dict(fp8_linear="pallas"), "xla": dict(fp8_linear="xla")}


def parse_options(text: str) -> dict:
    """'name=value,name=value' -> XLA compiler options (true/false -> bool, digits -> int). A
    value may itself hold commas (a list, e.g. ``xla_gpu_enable_command_buffer=FUSION,WHILE``):
    items split only at a comma followed by ``name=``."""
    options = {}
    for item in filter(None, re.split(r",(?=\w+=)", text)):
        if "=" not in item:
            raise SystemExit(f"--options: {item!r} is not name=value (in {text!r})")
        key, value = item.split("=", 1)
        low = value.lower()
        options[key] = (low == "true" if low in ("true", "false")
                        else int(value) if value.lstrip("-").isdigit() else value)
    return options


def cupti_kernels(fn):
    """Runs ``fn()`` once under CUPTI; returns [(kernel name, ms)] in launch order."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    except ImportError:  # CPU: no CUPTI; the wall time and HLO parts still run
        jax.block_until_ready(fn())
        return []
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        jax.block_until_ready(fn())
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def scope_of(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the named scope (``layer3_deltanet`` ...) in its metadata."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text):
        scope = re.search(r"(layer\d+_\w+?|lm_head)(?:/|$)", m.group(2))
        if scope:
            kind = re.sub(r"layer\d+_", "", scope.group(1))
            out[m.group(1)] = out[m.group(1).replace(".", "_")] = kind
    return out


def family(name: str) -> str:
    n = name.lower()
    if n.startswith("gemm_fusion") or n.startswith("triton_gemm"):
        return "XLA GEMM fusion (Triton)"  # XLA's own GEMM emitter, not a library call
    if "gemv" in n:
        return "cuBLAS gemv"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "sm90" in n:
        return "cuBLAS gemm"
    if "triton" in n:
        return "triton (XLA)"
    if "mosaic" in n or "decode_attention" in n or "pallas" in n:
        return "Pallas Mosaic GPU"
    if "reduce" in n:
        return "XLA reduction fusion"
    if "fusion" in n:
        return "XLA loop fusion"
    return "other: " + name[:30]


def print_sequence(listing: list[str], spec: str) -> None:
    """Prints kernels start..stop-1 of ``listing`` (one line per kernel, launch order) for
    ``spec`` "start:stop"; nothing for ""."""
    if not spec:
        return
    start, stop = (int(v) for v in spec.split(":"))
    print(f"kernels {start}..{stop - 1} in launch order:")
    for n, line in enumerate(listing[start:stop], start):
        print(f"  {n:4d} {line}")


def set_pdl(on: bool) -> None:
    """Benchmark-only switch for an A/B in one process: off makes ``wait_for_inputs`` a no-op
    (no programmatic dependent launch) in every kernel module that imported it; clears JAX's
    caches so the next step is traced again."""
    for name, module in list(sys.modules.items()):
        if name.startswith("jaxdecode.kernels.") and hasattr(module, "wait_for_inputs"):
            module.wait_for_inputs = wait_for_inputs if on else (lambda interpret: None)
    jax.clear_caches()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:1024,9b:1:1024")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--sequence", default="",
                    help="'start:stop': also list kernels start..stop-1 of the step in launch "
                         "order (name, scope, us), e.g. 0:120 for the first layers")
    ap.add_argument("--options", default="",
                    help="';'-separated XLA compiler-option variants to compare, each "
                         "'name=value,name=value' ('' = defaults), e.g. "
                         "';xla_gpu_enable_triton_gemm=false'")
    ap.add_argument("--deltanet", default="auto",
                    help="comma-separated DeltaNet core choices, each timed in the same process "
                         "(auto: jd.choose_kernels; pallas: the one-kernel core; xla: all XLA)")
    ap.add_argument("--pdl", default="on",
                    help="comma-separated on/off: the Pallas kernels with and without "
                         "programmatic dependent launch (jaxdecode.kernels.wait_for_inputs), "
                         "each timed in the same process")
    ap.add_argument("--dump-hlo", default=None, help="write each cell's optimised HLO here")
    ap.add_argument("--fp8", action="store_true",
                    help="the same weights as block-FP8 Linears (jd.quantize_fp8)")
    ap.add_argument("--fp8-linear", default="auto",
                    help="with --fp8: comma-separated FP8 Linear forms, each timed in the same "
                         "process (auto: jd.choose_kernels; pallas: the kernel; xla: dequantise "
                         "+ dot)")
    ap.add_argument("--layers", type=int, default=None,
                    help="each preset's first N layers only, at full width (a model that does "
                         "not fit the card beside its FP8 copy); per-layer kernels unchanged")
    args = ap.parse_args()
    for flag, values in (("--attention", args.attention), ("--deltanet", args.deltanet),
                         ("--fp8-linear", args.fp8_linear)):
        unknown = [v for v in values.split(",") if v not in CHOICES]
        if unknown:
            ap.error(f"{flag}: unknown {unknown}; choose from {CHOICES}")
    if args.fp8_linear != "auto" and not args.fp8:
        ap.error("--fp8-linear compares FP8 Linear forms: it needs --fp8")
    if "pallas" in args.deltanet.split(","):
        for cell in args.cells.split(","):
            name = cell.split(":")[0]
            c = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
            if c.linear_key_head_dim % 64:
                ap.error(f"--deltanet pallas needs linear_key_head_dim % 64 == 0; {name} has "
                         f"{c.linear_key_head_dim}")
    for opts in args.options.split(";"):
        parse_options(opts)  # fail on a malformed option before any device work
    if set(args.pdl.split(",")) - {"on", "off"}:
        ap.error(f"--pdl takes on and/or off; got {args.pdl!r}")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1; got {args.layers}")
    if args.sequence and not re.fullmatch(r"\d+:\d+", args.sequence):
        ap.error(f"--sequence must be start:stop, e.g. 0:120; got {args.sequence!r}")
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    summary = []
    params_cache = {}
    for cell in args.cells.split(","):
        name, batch, context = cell.split(":")
        batch, context = int(batch), int(context)
        preset = name if name == "tiny" else f"qwen3.5-{name}"
        if preset not in params_cache:
            params_cache.clear()
            config = jd.Config.from_preset(preset)
            if args.layers:
                config = dataclasses.replace(config, num_hidden_layers=args.layers,
                                             layer_types=config.layer_types[:args.layers])
            params_cache[preset] = jd.init_params(config, jax.random.key(0), "bfloat16")
            if args.fp8:
                params_cache[preset] = jd.quantize_fp8(params_cache[preset])
        params = params_cache[preset]
        config = params.config
        variants = [(impl, opts, form, pdl, fp8_form) for impl in args.attention.split(",")
                    for opts in args.options.split(";")
                    for form in args.deltanet.split(",")
                    for pdl in args.pdl.split(",")
                    for fp8_form in args.fp8_linear.split(",")]
        for impl, opts, form, pdl, fp8_form in variants:
            if args.pdl != "on":  # only an on/off comparison patches the kernel modules
                set_pdl(pdl == "on")
            options = parse_options(opts)
            state = randomize_state(jd.init_state(config, batch, context + 256,
                                                   dtype="bfloat16"), context)
            kernels = kernels_for(params, batch, impl, **DELTANET[form], **FP8_LINEAR[fp8_form])
            dt, compile_s, compiled = time_decode(params, state, batch, kernels=kernels,
                                                  compiler_options=options or None)
            hlo = compiled.as_text()
            if args.dump_hlo:
                os.makedirs(args.dump_hlo, exist_ok=True)
                variant = re.sub(r"[^\w.=-]+", "_", (f"{opts}_{form}" if opts else form)
                                 + ("_nopdl" if pdl == "off" else ""))
                path = os.path.join(args.dump_hlo, f"{name}_b{batch}_{impl}_{variant}.hlo.txt")
                with open(path, "w") as f:
                    f.write(hlo)
            scopes = scope_of(hlo)
            tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, batch), jnp.int32)
            state = randomize_state(jd.init_state(config, batch, context + 256,
                                                   dtype="bfloat16"), context)
            box = {"state": state}

            def one_step(compiled=compiled, box=box):  # bound now: both are deleted below
                logits, box["state"] = compiled(params, box["state"], tokens, None)
                return logits

            one_step()
            kernels = cupti_kernels(one_step)
            total = sum(ms for _, ms in kernels)
            by_family = collections.defaultdict(lambda: [0, 0.0])
            by_scope = collections.defaultdict(lambda: [0, 0.0])
            by_name = collections.defaultdict(lambda: [0, 0.0])
            scope = "?"
            listing = []
            for kname, ms in kernels:
                # Kernels XLA names after their HLO instruction carry its scope; library
                # kernels (cuBLAS) inherit the scope of the kernel launched before them.
                scope = scopes.get(kname, scope)
                f = by_family[family(kname)]
                f[0] += 1
                f[1] += ms
                s = by_scope[scope]
                s[0] += 1
                s[1] += ms
                key = re.sub(r"[._]\d+$", "", kname)[:60] + f" [{scope}]"
                by_name[key][0] += 1
                by_name[key][1] += ms
                listing.append(f"{ms * 1e3:7.1f} us  {scope:16s} {kname[:90]}")
            entry = hlo[hlo.index("ENTRY"):]
            copies = re.findall(r"= (\S+) copy\(", entry[:entry.index("\n}\n")])
            n_cmd = len(copies)
            fp8 = (" fp8" + (f" fp8_linear={fp8_form}" if fp8_form != "auto" else "")
                   if args.fp8 else "")
            tag = (f"{name}{fp8} b{batch} ctx{context} attention={impl}"
                   + (f" {opts}" if opts else "")
                   + (f" deltanet={form}" if form != "auto" else "")
                   + (" pdl=off" if pdl == "off" else ""))
            print(f"\n## {tag}\nwall {dt * 1e3:.3f} ms/step; kernels {len(kernels)}, kernel sum "
                  f"{total:.3f} ms; between kernels {dt * 1e3 - total:.3f} ms; compile "
                  f"{compile_s:.1f} s; copies in the step: {collections.Counter(copies)}")
            print("family: " + "; ".join(f"{k} {v[0]}x {v[1] * 1e3:.0f}us" for k, v in
                                          sorted(by_family.items(), key=lambda kv: -kv[1][1])))
            print("scope: " + "; ".join(f"{k} {v[0]}x {v[1] * 1e3:.0f}us" for k, v in
                                         sorted(by_scope.items(), key=lambda kv: -kv[1][1])))
            for key, (count, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"  {ms * 1e3:8.1f} us  {count:4d}x  {key}")
            print_sequence(listing, args.sequence)
            summary.append((tag, dt * 1e3, total, len(kernels), n_cmd))
            del state, box, compiled
    print("\n| cell | wall ms/step | kernel sum ms | gap ms | kernels | copy ops |")
    print("|---|---:|---:|---:|---:|---:|")
    for tag, wall, total, n, n_cmd in summary:
        print(f"| {tag} | {wall:.3f} | {total:.3f} | {wall - total:.3f} | {n} | {n_cmd} |")


if __name__ == "__main__":
    sys.exit(main())
