"""Decode attention (issue 3): the Pallas kernel against XLA, cuDNN and JAX's Triton ``gqa``.

    PYTHONPATH=. python benchmarks/decode_attention.py            # the full table
    PYTHONPATH=. python benchmarks/decode_attention.py --sweep    # plus the block/split sweep
    PYTHONPATH=. python benchmarks/decode_attention.py --quick    # 2 cells, for a smoke test
    PYTHONPATH=. python benchmarks/decode_attention.py --breakdown  # per-kernel times, small cells
    PYTHONPATH=. python benchmarks/decode_attention.py --cells 9B:8:8192 --impls kernel,cudnn

Grid: batch {1, 8, 64} x context {1k, 8k, 32k, 128k} x the Qwen3.5-9B (16 q heads, 4 KV heads,
head_dim 256) and 27B (24 q heads, 4 KV heads, head_dim 256) attention shapes, bf16 caches,
every row at the full context (lengths == max_len).

Method (printed with the results):
  * us = wall time per call of back-to-back calls enqueued without waiting (``span_ms``): what a
    caller pays, launch gaps and PDL overlap included. Each timed jit runs the call on R distinct
    input sets in turn (R * bytes >= 4x the 60 MB L2), so repeated calls do not read from L2.
  * kernel sum = the sum of the GPU kernels of one call, CUPTI
    (``jax.experimental.mosaic.gpu.profiler``), median over repeats; for the Pallas kernel with
    programmatic dependent launch off (``pdl_off``), because under PDL CUPTI counts a kernel's
    wait for the kernel before it (back-to-back calls then sum up to 2x their real time).
  * guard: the kernel cells are compared with ``decode_attention_baseline.json`` (the last
    recorded table; ``--record`` rewrites it) and every cell slower by more than the noise is
    printed (``NOISE_FRACTION``, or twice the cell's spread over repeats).
  * bytes = K and V bytes actually read (every row's ``lengths`` keys) + q + output.
  * copy bandwidth = the best of three 4 GiB device-to-device copies (``jnp.copy`` and ``x * s``
    in float32 and bfloat16), read + write bytes, in the same run; "% copy" = achieved GB/s / that.
    A read-only kernel can exceed 100%: HBM reads alone run faster than reads mixed with writes.
  * alternatives: ``decode_attention_reference`` (XLA); ``jax.nn.dot_product_attention``
    (implementation="cudnn", ``key_value_seq_lengths``) with the cache already in its
    [B, S, Hkv, D] layout; ``jax.experimental.pallas.ops.gpu.decode_attention.gqa`` (Triton)
    with the cache in its [B, S, Hkv, D] layout and ``kv_seq_len``. A cell that fails or does
    not fit in memory says so instead of a number.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxdecode.kernels import decode_attention as da

MODELS = {"9B": (16, 4, 256), "27B": (24, 4, 256)}  # (q heads, KV heads, head_dim)
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
L2_BYTES = 60e6
MEMORY_BUDGET_BYTES = 110e9  # of the H200's ~139 GiB: inputs of one cell must fit in this
IMPLS = ("kernel", "xla", "cudnn", "triton")
SWEEP_CELLS = (("9B", 1, 131072), ("9B", 8, 8192), ("27B", 64, 8192))
SPAN_CALLS = 200  # calls per wall-clock repeat (span_ms) ...
SPAN_MS = 300.0  # ... or as many as take this long, whichever is fewer
# Run-to-run noise of one cell on one card: the same code on two leases agreed within 1% (cuDNN)
# to 5% (kernel, small cells); a cell is reported as slower past this fraction.
NOISE_FRACTION = 0.08
BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_attention_baseline.json")
SHORT_ROWS = (8, 131072, ([300] * 8, [131072, 300, 300, 300, 0, 1, 300, 300]))


def _cupti_time_ms(fn, args, iters):
    """Median over ``iters`` runs of the sum of the GPU kernel times of one ``fn(*args)`` (CUPTI)."""
    from jax.experimental.mosaic.gpu import profiler
    _, times = profiler.measure(fn, iterations=max(2, iters))(*args)
    if times is None:
        raise RuntimeError("CUPTI saw no kernels")
    return statistics.median(times)


def _wall_time_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def span_ms(fn, args, calls: int, repeats: int = 5) -> tuple[float, float]:
    """(median, relative spread) of the wall time per call of ``calls`` back-to-back calls of
    ``fn(*args)``, enqueued without waiting, so the GPU never idles for the host: the time a
    caller pays, overlaps between consecutive kernels (PDL) included, launch gaps included."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - start) * 1e3 / calls)
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


@contextlib.contextmanager
def pdl_off():
    """The kernel without programmatic dependent launch (``wait_for_inputs`` a no-op), retraced.

    Under PDL a kernel may start while the one before it runs and waits on the GPU, so CUPTI
    counts that wait in its duration: kernel sums of back-to-back PDL kernels overcount (up to
    2x where a call's grid leaves SMs free). Kernel sums are therefore taken with PDL off."""
    saved = da.wait_for_inputs
    da.wait_for_inputs = lambda interpret: None
    jax.clear_caches()
    try:
        yield
    finally:
        da.wait_for_inputs = saved
        jax.clear_caches()


TIMER = {"name": "cupti"}


def time_ms(fn, args, iters):
    """Median device time of ``fn(*args)`` in ms (CUPTI kernel sum; wall clock if unavailable)."""
    if TIMER["name"] == "cupti":
        try:
            return _cupti_time_ms(fn, args, iters)
        except Exception as e:  # noqa: BLE001 - fall back once, say so
            print(f"# CUPTI timing unavailable ({type(e).__name__}: {e}); using wall clock")
            TIMER["name"] = "wall"
    return _wall_time_ms(fn, args, iters)


def copy_bandwidth_gb_per_s() -> tuple[float, str]:
    """Best of three 4 GiB device-to-device copies (read + write bytes): XLA's ``jnp.copy``
    (wall clock: it may be a DMA, which CUPTI's kernel timer does not see) and ``x * s``
    fusions in float32 and bfloat16 (kernel time). Returns (GB/s, what each gave)."""
    results = {}
    for name, dtype, fn in (("copy f32", jnp.float32, lambda x, s: jnp.copy(x)),
                            ("x*s f32", jnp.float32, lambda x, s: x * s),
                            ("x*s bf16", jnp.bfloat16, lambda x, s: x * s)):
        x = jax.random.normal(jax.random.key(0), (4 * 1024**3 // jnp.dtype(dtype).itemsize,), dtype)
        scale = jnp.asarray(1.0, dtype)
        fn = jax.jit(fn)
        jax.block_until_ready(fn(x, scale))
        try:
            ms = _cupti_time_ms(fn, (x, scale), 10) if name != "copy f32" else None
        except Exception:  # noqa: BLE001 - no CUPTI here: wall clock below
            ms = None
        ms = ms if ms is not None else _wall_time_ms(fn, (x, scale), 10)
        results[name] = 2 * x.nbytes / (ms * 1e-3) / 1e9
        del x
    best = max(results.values())
    return best, ", ".join(f"{k} {v:.0f}" for k, v in results.items())


def breakdown(copy_gbs):
    """Per-kernel CUPTI times of one call at small contexts, where fixed costs dominate."""
    from jax.experimental.mosaic.gpu import profiler
    for model, batch, context in (("9B", 1, 1024), ("27B", 1, 1024), ("9B", 1, 8192)):
        heads = MODELS[model]
        sets = make_sets(batch, heads, context, [context] * batch, 8)
        for impl in ("kernel", "cudnn"):
            fn, args = _kernel, sets
            if impl == "cudnn":
                fn = _cudnn
                args = [(q, k.swapaxes(1, 2), v.swapaxes(1, 2), l) for q, k, v, l in sets]
            many = jax.jit(lambda s, fn=fn: [fn(*a) for a in s])
            try:
                with pdl_off() if impl == "kernel" else contextlib.nullcontext():
                    jax.block_until_ready(many(args))
                    _, timings = profiler.measure(many, aggregate=False)(args)
                per_kernel = {}
                for name, ms in timings:
                    per_kernel[name] = per_kernel.get(name, 0.0) + ms * 1e3 / len(sets)
                parts = ", ".join(f"{k[:40]} {v:.1f}" for k, v in per_kernel.items())
                print(f"# breakdown {model} b{batch} {context} {impl}: "
                      f"{sum(per_kernel.values()):.1f} us = {parts}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"# breakdown {model} {impl}: {type(e).__name__}: {e}"[:200])
        del sets
        gc.collect()


# ----- the implementations, each taking the inputs in its own layout ----------------------------

def _kernel(q, k, v, lengths, config=None):
    return da.decode_attention_pallas(q, k, v, lengths, config=config)


def _cudnn(q, k_bshd, v_bshd, lengths):
    out = jax.nn.dot_product_attention(q[:, None], k_bshd, v_bshd, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out[:, 0]


def _triton(q, k_bshd, v_bshd, lengths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import decode_attention as triton_decode
    return triton_decode.gqa(q, k_bshd, v_bshd, kv_seq_len=lengths)


def make_sets(batch, heads, max_len, lengths, num_sets, seed=0):
    num_heads, num_kv_heads, head_dim = heads
    sets = []
    for i in range(num_sets):
        kq, kk, kv = jax.random.split(jax.random.key(seed + i), 3)
        q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(kk, (batch, num_kv_heads, max_len, head_dim), jnp.bfloat16)
        v = jax.random.normal(kv, (batch, num_kv_heads, max_len, head_dim), jnp.bfloat16)
        sets.append((q, k, v, jnp.asarray(lengths, jnp.int32)))
    return sets


def bytes_moved(batch, heads, lengths):
    num_heads, num_kv_heads, head_dim = heads
    kv = 2 * num_kv_heads * int(np.sum(lengths)) * head_dim * 2
    return kv + 2 * batch * num_heads * head_dim * 2


def measure(fn, sets, iters, *, kernel_sum=True):
    """Times ``fn`` over the input sets. Returns (timing, outputs of set 0), timing a dict:
    ``us`` wall time per call (:func:`span_ms`), ``spread`` its relative spread over repeats,
    ``sum_us`` the CUPTI kernel sum per call (None if ``kernel_sum`` is False), ``compile_s``."""
    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    start = time.perf_counter()
    outs = jax.block_until_ready(many(sets))
    compile_s = time.perf_counter() - start
    one_ms = _wall_time_ms(many, (sets,), 3)
    calls = max(3, min(math.ceil(SPAN_CALLS / len(sets)), math.ceil(SPAN_MS / one_ms)))
    ms, spread = span_ms(many, (sets,), calls)
    sum_us = time_ms(many, (sets,), iters) * 1e3 / len(sets) if kernel_sum else None
    return dict(us=ms * 1e3 / len(sets), spread=spread, sum_us=sum_us, compile_s=compile_s), outs[0]


def kernel_sum_us(sets, iters):
    """CUPTI kernel sum per call of the Pallas kernel with PDL off (see :func:`pdl_off`)."""
    with pdl_off():
        many = jax.jit(lambda sets: [_kernel(*s) for s in sets])
        jax.block_until_ready(many(sets))
        return time_ms(many, (sets,), iters) * 1e3 / len(sets)


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_cell(model, batch, context, copy_gbs, impls=IMPLS):
    heads = MODELS[model]
    lengths = [context] * batch
    kv_bytes = 2 * batch * heads[1] * context * heads[2] * 2
    num_sets = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes)))
    iters = 8 if kv_bytes < 1e9 else 3
    moved = bytes_moved(batch, heads, lengths)
    rows = []
    if kv_bytes * num_sets > MEMORY_BUDGET_BYTES:
        return [dict(model=model, batch=batch, context=context, impl=i, note="skip: memory")
                for i in impls]
    sets = make_sets(batch, heads, context, lengths, num_sets)
    outs = {}
    for impl in impls:
        row = dict(model=model, batch=batch, context=context, impl=impl)
        try:
            if impl in ("cudnn", "triton"):
                if 2 * kv_bytes * num_sets > MEMORY_BUDGET_BYTES:
                    raise MemoryError("needs a second, transposed cache")
                fn = _cudnn if impl == "cudnn" else _triton
                bshd = [(q, k.swapaxes(1, 2), v.swapaxes(1, 2), l) for q, k, v, l in sets]
                bshd = jax.block_until_ready(jax.jit(lambda s: s)(bshd))
                timing, outs[impl] = measure(fn, bshd, iters)
                del bshd
            elif impl == "kernel":
                timing, outs[impl] = measure(_kernel, sets, iters, kernel_sum=False)
                timing["sum_us"] = kernel_sum_us(sets, iters)
            else:
                timing, outs[impl] = measure(da.decode_attention_reference, sets, iters)
            gbs = moved / (timing["us"] * 1e-6) / 1e9
            row.update(timing, gbs=gbs, pct=100 * gbs / copy_gbs)
        except Exception as e:  # noqa: BLE001 - a failing alternative is a result, not a crash
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
        rows.append(row)
        gc.collect()
    check = "xla" if "xla" in outs else "kernel"
    for row in rows:
        if row["impl"] in outs and check in outs and row["impl"] != check:
            row["err"] = rel_err(outs[row["impl"]], outs[check])
            row["err_vs"] = check
    del sets, outs
    gc.collect()
    return rows


def format_table(rows, title):
    lines = [f"### {title}", "",
             "| model | batch | context | impl | us | GB/s | % copy | kernel sum us | rel err | note |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        us = f"{r['us']:.1f}" if "us" in r else ""
        gbs = f"{r['gbs']:.0f}" if "gbs" in r else ""
        pct = f"{r['pct']:.0f}%" if "pct" in r else ""
        ksum = f"{r['sum_us']:.1f}" if r.get("sum_us") is not None else ""
        err = f"{r['err']:.1e} (vs {r['err_vs']})" if r.get("err") is not None else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['impl']} | {us} | {gbs} "
                     f"| {pct} | {ksum} | {err} | {r.get('note', '')} |")
    return "\n".join(lines)


def cell_key(model, batch, context) -> str:
    return f"{model} b{batch} {context}"


def compare_with_baseline(rows, baseline: dict) -> list[str]:
    """Kernel cells slower than the recorded ``baseline`` by more than the noise.

    ``baseline`` maps :func:`cell_key` to {"us": wall per call, "sum_us": kernel sum}; a metric
    is compared where both runs have it. Noise: :data:`NOISE_FRACTION`, or twice the cell's own
    spread over repeats if larger."""
    slower = []
    for r in rows:
        base = baseline.get(cell_key(r["model"], r["batch"], r["context"]))
        if r["impl"] != "kernel" or base is None:
            continue
        noise = max(NOISE_FRACTION, 2 * r.get("spread", 0.0))
        for metric in ("us", "sum_us"):
            now, then = r.get(metric), base.get(metric)
            if now is not None and then is not None and now > then * (1 + noise):
                slower.append(f"{cell_key(r['model'], r['batch'], r['context'])} {metric}: "
                              f"{now:.1f} vs recorded {then:.1f} ({now / then:.2f}x; noise "
                              f"{100 * noise:.0f}%)")
    return slower


def sweep(copy_gbs):
    """Block size / stages / splits around choose_config, and short rows in a long cache."""
    rows = []
    for model, batch, context in SWEEP_CELLS:
        heads = MODELS[model]
        base = da.choose_config(batch, heads[1], context, heads[2], jnp.bfloat16)
        configs = {"auto": base}
        for block_kv, stages in ((64, 1), (64, 2), (128, 1)):
            cfg = da.DecodeAttentionConfig(block_kv, stages, base.num_splits)
            if da._smem_bytes(heads[2], block_kv, stages, jnp.bfloat16) <= da.SMEM_LIMIT_BYTES:
                configs[f"bk{block_kv}-st{stages}"] = cfg
        for factor in (0.5, 2):
            splits = max(1, int(base.num_splits * factor))
            configs[f"splits{splits}"] = da.DecodeAttentionConfig(base.block_kv, base.num_stages,
                                                                  splits)
        lengths = [context] * batch
        kv_bytes = 2 * batch * heads[1] * context * heads[2] * 2
        num_sets = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes)))
        sets = make_sets(batch, heads, context, lengths, num_sets)
        moved = bytes_moved(batch, heads, lengths)
        for name, cfg in configs.items():
            row = dict(model=model, batch=batch, context=context, impl=f"kernel {name}",
                       note=f"bk={cfg.block_kv} stages={cfg.num_stages} splits={cfg.num_splits}")
            rows.append(_timed(row, lambda *a, cfg=cfg: _kernel(*a, config=cfg), sets, moved,
                               copy_gbs))
        del sets
        gc.collect()
    # Blocks past a row's length are skipped: short rows in a 128k cache cost what short rows do.
    heads = MODELS["9B"]
    batch, context, all_lengths = SHORT_ROWS
    for lengths in all_lengths:
        sets = make_sets(batch, heads, context, lengths, 1)
        moved = bytes_moved(batch, heads, lengths)
        for impl, fn in (("kernel", _kernel), ("xla", da.decode_attention_reference)):
            row = dict(model="9B", batch=batch, context=context, impl=impl,
                       note=f"lengths={sorted(set(lengths))}")
            rows.append(_timed(row, fn, sets, moved, copy_gbs))
        del sets
        gc.collect()
    return rows



def _timed(row: dict, fn, sets, moved: int, copy_gbs: float) -> dict:
    """Times ``fn`` over ``sets`` (10 repeats) into ``row``: us, GB/s, % of copy bandwidth; a
    failure is recorded in the row's note, not raised (a failing config is a result)."""
    try:
        timing, _ = measure(fn, sets, 10, kernel_sum=False)
        gbs = moved / (timing["us"] * 1e-6) / 1e9
        row.update(timing, gbs=gbs, pct=100 * gbs / copy_gbs)
    except Exception as e:  # noqa: BLE001
        row["note"] += f" {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row

def parse_cells(text: str) -> list[tuple[str, int, int]]:
    """'9B:8:8192,27B:1:1024' -> [(model, batch, context), ...]."""
    cells = []
    for item in text.split(","):
        model, batch, context = item.split(":")
        if model not in MODELS:
            raise SystemExit(f"--cells: unknown model {model!r} (one of {sorted(MODELS)})")
        cells.append((model, int(batch), int(context)))
    return cells


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cells only")
    parser.add_argument("--cells", default="", help="model:batch:context,... instead of the grid")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma list of {IMPLS} (default all)")
    parser.add_argument("--sweep", action="store_true", help="also sweep block/stages/splits")
    parser.add_argument("--no-grid", action="store_true", help="skip the main grid")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel times, small cells")
    parser.add_argument("--record", action="store_true",
                        help=f"write the kernel cells measured to {os.path.basename(BASELINE)}")
    args = parser.parse_args()
    impls = tuple(args.impls.split(","))
    if set(impls) - set(IMPLS):
        parser.error(f"--impls takes {IMPLS}; got {args.impls!r}")
    device = jax.devices()[0]
    print(f"# device: {device.device_kind} ({getattr(device, 'core_count', '?')} SMs), "
          f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {sys.version.split()[0]}")
    copy_gbs, copies = copy_bandwidth_gb_per_s()
    print(f"# copy bandwidth (4 GiB, read+write bytes, best of: {copies}): {copy_gbs:.0f} GB/s")
    if args.breakdown:
        breakdown(copy_gbs)
    tables, rows = [], []
    if not args.no_grid:
        cells = [(m, b, c) for m in MODELS for b in BATCHES for c in CONTEXTS]
        if args.quick:
            cells = [("9B", 1, 8192), ("27B", 8, 1024)]
        if args.cells:
            cells = parse_cells(args.cells)
        for model, batch, context in cells:
            cell_rows = run_cell(model, batch, context, copy_gbs, impls)
            print(format_table(cell_rows, f"{model} batch {batch} context {context}")
                  .split("\n", 4)[-1], flush=True)
            rows += cell_rows
        tables.append(format_table(rows, "Decode attention, bf16 cache"))
    if args.sweep:
        tables.append(format_table(sweep(copy_gbs), "Kernel sweep (block size, stages, splits)"))
        print(tables[-1], flush=True)
    print(f"\n# us = wall time per call of back-to-back calls (span_ms); kernel sum = CUPTI "
          f"({TIMER['name']}), the Pallas kernel's with PDL off; copy bandwidth {copy_gbs:.0f} "
          f"GB/s; {device.device_kind}; jax {jax.__version__}")
    for table in tables:
        print("\n" + table)
    baseline = {}
    if os.path.exists(BASELINE):
        with open(BASELINE) as f:
            baseline = json.load(f)["cells"]
        slower = compare_with_baseline(rows, baseline)
        print(f"\n# against {os.path.basename(BASELINE)}: "
              + ("no kernel cell slower than recorded" if not slower
                 else f"{len(slower)} kernel cell(s) SLOWER than recorded:"))
        for line in slower:
            print(f"#   {line}")
    if args.record:
        for r in rows:
            if r["impl"] == "kernel" and "us" in r:
                baseline[cell_key(r["model"], r["batch"], r["context"])] = dict(
                    us=round(r["us"], 1), sum_us=round(r["sum_us"], 1) if r.get("sum_us") else None)
        with open(BASELINE, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__,
                       "copy_gb_per_s": round(copy_gbs), "cells": baseline}, f, indent=1)
        print(f"# recorded {len(rows)} rows' kernel cells to {BASELINE}")


if __name__ == "__main__":
    main()
