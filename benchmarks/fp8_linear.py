"""The block-FP8 linear alone at the decode step's shapes: the Pallas kernel
(``jaxdecode.kernels.fp8_linear``) against XLA's form (dequantise to bf16, then dot: what an FP8
model ran before the kernel) and the bf16 weight's dot, in one process.

    python benchmarks/fp8_linear.py [--shapes 12288x4096,4096x12288,...] [--batches 1,8,64]
        [--configs 2:4:8,4:2:21] [--groups 8192+4096x2048,512+512x2048] [--smoke]

Per (out x in, rows): microseconds per matrix (``--layers`` different matrices of the shape
summed in one jitted call, so the weights do not sit in the 60 MB L2; median of 5 repeats of 50
calls) and the % of the copy bandwidth measured in the same run
(``decode.copy_bandwidth_gb_per_s``), over the bytes the weight must move (FP8: 1 byte per
weight + the block scales; bf16: 2). Default shapes: the 9B model's quantised Linears (MLP
gate/up, down; DeltaNet in_proj_qkv, out_proj; attention k_proj) and the 27B's MLP.
``--smoke``: tiny shapes in the Mosaic GPU interpreter (checks the script on a CPU; no timings;
it ignores --shapes, --batches and --layers). ``--configs``: the kernel once more per
``num_stages:cols_per_step:steps_per_program`` (``Fp8LinearConfig``; a field left empty is
``choose_config``'s), beside ``choose_config``'s own; one the kernel refuses for a shape is
reported and skipped. ``--groups``: weights of one x (``N1+N2+...xK``, e.g. the 35B-A3B's
in_proj_qkv + in_proj_z, 8192+4096x2048) as one launch (``fp8_linears_pallas``) against one
kernel launch each, per rows count (us per group, % of the copy bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdecode import quantization  # noqa: E402
from jaxdecode.kernels import fp8_linear as fl  # noqa: E402
from decode import copy_bandwidth_gb_per_s  # noqa: E402

DEFAULT_SHAPES = "12288x4096,4096x12288,8192x4096,4096x4096,1024x4096,17408x5120,5120x17408"


def bench(f, args, n=50):
    out = f(*args)
    out.block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated OUTxIN")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default="",
                    help="extra kernel configs, comma-separated num_stages:cols_per_step:"
                         "steps_per_program (an empty field: choose_config's)")
    ap.add_argument("--groups", default="",
                    help="comma-separated N1+N2+...xK: those weights as one launch and as one "
                         "each (the default shapes are skipped unless --shapes is given)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
        configs = [fl.Fp8LinearConfig(*(int(v) if v else None for v in c.split(":")))
                   for c in args.configs.split(",") if c]
    except (ValueError, TypeError) as e:
        ap.error(f"--shapes takes OUTxIN,..., --batches N,..., --configs S:C:T,...; got "
                 f"{args.shapes!r}, {args.batches!r}, {args.configs!r} ({e})")
    try:
        groups = [(tuple(int(n) for n in g.split("x")[0].split("+")), int(g.split("x")[1]))
                  for g in args.groups.split(",") if g]
    except (ValueError, IndexError) as e:
        ap.error(f"--groups takes N1+N2+...xK,...; got {args.groups!r} ({e})")
    if groups and args.shapes == DEFAULT_SHAPES:
        shapes = []
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or min(batches) < 1 or args.layers < 1:
        ap.error("shapes, batches and --layers must be positive")
    layers = args.layers
    if args.smoke:  # fixed tiny shapes: a check of the script, not a measurement
        shapes, batches, layers, groups = [(256, 384)], [1, 3], 2, [((256, 128), 384)]
        configs = configs or [fl.Fp8LinearConfig(2, 1, 2), fl.Fp8LinearConfig(3, 1, 4)]
    elif jax.default_backend() != "gpu":
        ap.error("timings need a GPU (the kernel compiles for Hopper); on a CPU run --smoke")
    interpret = args.smoke
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    bw = None if args.smoke else copy_bandwidth_gb_per_s()
    if bw:
        print(f"# copy bandwidth {bw:.0f} GB/s", flush=True)

    forms = {
        "bf16 dot": lambda x, w, w8, s: jnp.einsum("bi,oi->bo", x, w,
                                                   preferred_element_type=jnp.float32
                                                   ).astype(x.dtype),
        "fp8 XLA form": lambda x, w, w8, s: fl.fp8_linear_reference(x, w8, s),
        "fp8 kernel": lambda x, w, w8, s: fl.fp8_linear_pallas(x, w8, s, interpret=interpret),
    }
    for c in configs:
        name = "kernel " + ":".join(str(v or "") for v in dataclasses.astuple(c))
        forms[name] = lambda x, w, w8, s, c=c: fl.fp8_linear_pallas(x, w8, s, config=c,
                                                                      interpret=interpret)
    rows = []
    for (n, k) in shapes:
        w = jax.random.normal(jax.random.key(1), (layers, n, k), jnp.bfloat16)
        w8, s = jax.vmap(quantization.quantize)(w)
        w = jax.vmap(lambda a, b: quantization.dequantize(a, b, (128, 128), jnp.bfloat16))(w8, s)
        for m in batches:
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            res, outs = {}, {}
            for name, form in forms.items():
                f = jax.jit(lambda x, w, w8, s, form=form: sum(
                    form(x, w[i], w8[i], s[i]).astype(jnp.float32) for i in range(layers)))
                try:
                    outs[name] = f(x, w, w8, s)
                except ValueError as e:  # a --configs entry this shape cannot take
                    print(f"{n}x{k} rows {m}: {name} refused: {e}", flush=True)
                    res[name] = None
                    continue
                res[name] = None if args.smoke else bench(f, (x, w, w8, s)) / layers
            ref = outs["bf16 dot"]
            err = {name: float(jnp.max(jnp.abs(o - ref)) / jnp.max(jnp.abs(ref)))
                   for name, o in outs.items()}
            rows.append((n, k, m, res, err))
            print(f"{n}x{k} rows {m} (choose_config: {fl.choose_config(n, k, m)}): " + ", ".join(
                f"{name} {res[name] * 1e6:.1f} us" if res[name] else name for name in outs)
                + f"; max |diff| to the bf16 dot / max: {max(err.values()):.1e}", flush=True)
    group_rows = [time_group(sizes, k, m, layers, interpret, args.smoke)
                  for sizes, k in groups for m in batches]
    if args.smoke:
        assert all("fp8 kernel" in e and max(e.values()) < 2e-2 for *_, e in rows), rows
        assert all(err < 2e-2 for *_, err in group_rows), group_rows
        print("smoke: every form agrees with the bf16 dot of the dequantised weights; a group's "
              "one launch with its weights' own launches")
        return
    if group_rows:
        print(f"\n## weights of one x: one launch each vs one launch for all (us per group; % "
              f"of the copy bandwidth {bw:.0f} GB/s)\n")
        print("| weights (N x K) | rows | one launch each | one launch | speed-up |")
        print("|---|---:|---:|---:|---:|")
        for sizes, k, m, (each, one), _ in group_rows:
            nbytes = sum(n * k + (n // 128) * (k // 128) * 4 for n in sizes)
            pct = lambda t: nbytes / t / 1e9 / bw * 100  # noqa: E731
            print(f"| {'+'.join(map(str, sizes))} x {k} | {m} | {each * 1e6:.1f} "
                  f"({pct(each):.0f}%) | {one * 1e6:.1f} ({pct(one):.0f}%) | {each / one:.2f}x |")
    if not rows:
        return
    print(f"\n## block-FP8 linear (us per matrix; % of the copy bandwidth {bw:.0f} GB/s over "
          "the weight's bytes)\n")
    print("| out x in | rows | " + " | ".join(forms) + " | kernel vs XLA form |")
    print("|---|---:|" + "---:|" * (len(forms) + 1))
    for n, k, m, res, _ in rows:
        cells = []
        for name in forms:
            nbytes = n * k * (2 if name == "bf16 dot" else 1) + (n // 128) * (k // 128) * 4
            cells.append("-" if res[name] is None else
                         f"{res[name] * 1e6:.1f} ({nbytes / res[name] / 1e9 / bw * 100:.0f}%)")
        print(f"| {n} x {k} | {m} | " + " | ".join(cells)
              + f" | {res['fp8 XLA form'] / res['fp8 kernel']:.2f}x |")


def time_group(sizes, k, m, layers, interpret, smoke):
    """(sizes, k, m, (s each, s one launch) per group, max |difference| of the two forms over
    max |out|): ``layers`` different groups in one jitted call."""
    key = jax.random.key(3)
    w8s, ss = [], []
    for i, n in enumerate(sizes):
        w8, s = jax.vmap(quantization.quantize)(
            jax.random.normal(jax.random.fold_in(key, i), (layers, n, k), jnp.bfloat16))
        w8s.append(w8)
        ss.append(s)
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)

    def each(x, w8s, ss):
        return [sum(fl.fp8_linear_pallas(x, w8[i], s[i], interpret=interpret).astype(jnp.float32)
                    for i in range(layers)) for w8, s in zip(w8s, ss)]

    def one(x, w8s, ss):
        outs = [fl.fp8_linears_pallas(x, [w8[i] for w8 in w8s], [s[i] for s in ss],
                                      interpret=interpret) for i in range(layers)]
        return [sum(o[j].astype(jnp.float32) for o in outs) for j in range(len(sizes))]
    fe, fo = jax.jit(each), jax.jit(one)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
              for a, b in zip(fe(x, w8s, ss), fo(x, w8s, ss)))
    if smoke:
        return sizes, k, m, (None, None), err
    first = lambda f: lambda *a: f(*a)[0]  # noqa: E731 (bench waits on one array)
    times = (bench(first(fe), (x, w8s, ss)) / layers, bench(first(fo), (x, w8s, ss)) / layers)
    print(f"{'+'.join(map(str, sizes))}x{k} rows {m}: one launch each {times[0] * 1e6:.1f} us, "
          f"one launch {times[1] * 1e6:.1f} us", flush=True)
    return sizes, k, m, times, err


if __name__ == "__main__":
    sys.exit(main())
