"""The decode projections at the published shapes: XLA (RMSNorm or SwiGLU, then the dot)
against the GEMV kernels of ``jaxdecode.kernels.gemv``, one process.

    python benchmarks/gemv.py [--models 0.8b,9b] [--batch 1] [--block-k 128,256]
                              [--splits auto,2,4] [--stages 4] [--kernels cuda,wgmma]

Kernels: ``cuda`` is ``gemv_pallas`` (the norm or SwiGLU folded into its prologue, the product
on the CUDA cores); ``wgmma`` is XLA's norm or SwiGLU followed by ``gemv_wgmma`` (the product
on the tensor cores, no prologue). Per projection (model, layer part, N x K, and what precedes
it) and variant: the sum of CUPTI kernel times of one call (median of 9 calls, each on another
copy of the weight, with enough copies that together they are at least twice L2 (50 MB on an
H200), so L2 does not serve the weight), the number of kernels, the largest kernel's time and
the weight bytes / that time (TB/s). ``--block-k`` and ``--splits`` take comma lists: every
supported combination is timed (``auto``: the fewest K splits that give a program per
multiprocessor). All variants are compiled with ``jd.COMPILER_OPTIONS``. A kernel's variant
includes the XLA fusion that sums its split-K partials (inside the model that sum would fuse
into the consumer). Every variant returns the float32 product (the cast to bfloat16 would
fuse into the same last kernel), and the table gives the largest difference from XLA's,
relative to the product's largest entry. On CPU (the interpreter, no kernel times)
projections of more than 4M weights are checked on their first 256 output columns.
The questions it answers: does a kernel stream the weight at least as fast as XLA's GEMM
fusions (2.9-4.5 TB/s at 9B shapes, benchmarks/RESULTS.md session 9), and does folding the
norm or SwiGLU in pay?
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import activations, model  # noqa: E402
from jaxdecode.kernels.gemv import (TILE_N, check_supported, gemv_pallas,  # noqa: E402
                                    gemv_wgmma)
from step_profile import cupti_kernels  # noqa: E402

L2_BYTES = 50 << 20  # H200


def projections(config: jd.Config):
    """(name, N, K, what the kernel folds in: "norm", "swiglu" or None) of one layer's decode
    GEMVs, and the LM head."""
    c = config
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
        c.linear_num_value_heads * c.linear_value_head_dim)
    z = c.linear_num_value_heads * c.linear_value_head_dim
    return [("in_proj_qkv+z", conv + z, c.hidden_size, "norm"),
            ("out_proj", c.hidden_size, z, None),
            ("gate+up", 2 * c.intermediate_size, c.hidden_size, "norm"),
            ("down", c.hidden_size, c.intermediate_size, "swiglu"),
            ("lm_head", c.vocab_size, c.hidden_size, "norm")]


def choose_splits(batch: int, n: int, k: int, block_k: int, num_stages: int,
                  num_sms: int, tensor_cores: bool = False) -> int:
    """The fewest K splits (a divisor of K / block_k) the kernel takes that give at least one
    program per multiprocessor, else the most it takes (1 if none)."""
    steps = max(k // block_k, 1)
    fits = [d for d in range(1, steps + 1) if steps % d == 0 and check_supported(
        (batch, k), (n, k), jnp.bfloat16, block_k, d, num_stages, tensor_cores) is None]
    return next((d for d in fits if (n // TILE_N) * d >= num_sms), fits[-1] if fits else 1)


def timed(fn, args_list):
    """Median CUPTI kernel sum (ms), kernel count and largest kernel (ms) over calls that cycle
    through ``args_list`` (distinct weight copies)."""
    jax.block_until_ready(fn(*args_list[0]))
    sums, counts, largest = [], [], []
    for i in range(9):
        args = args_list[(i + 1) % len(args_list)]
        kernels = cupti_kernels(lambda: fn(*args))
        sums.append(sum(ms for _, ms in kernels))
        counts.append(len(kernels))
        largest.append(max((ms for _, ms in kernels), default=0.0))
    return statistics.median(sums), int(statistics.median(counts)), statistics.median(largest)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.8b,9b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-k", default="256", help="comma list of tile widths")
    ap.add_argument("--splits", default="auto", help="comma list: auto or K-split counts")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--kernels", default="cuda,wgmma",
                    help="comma list: cuda (gemv_pallas, the norm or SwiGLU in its prologue), "
                         "wgmma (XLA's norm or SwiGLU, then gemv_wgmma on the tensor cores)")
    args = ap.parse_args()
    block_ks = [int(v) for v in args.block_k.split(",")]
    split_opts = [v if v == "auto" else int(v) for v in args.splits.split(",")]
    dev = jax.devices()[0]
    num_sms = int(getattr(dev, "core_count", 132) or 132)
    interpret = dev.platform != "gpu"
    print(f"# {dev.device_kind}; jax {jax.__version__}; batch {args.batch}; block_k "
          f"{args.block_k}; stages {args.stages}; {num_sms} SMs"
          + ("; CPU: the Mosaic GPU interpreter, no kernel times" if interpret else ""),
          flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
        for part, n, k, fold in projections(config):
            if interpret and n * k > 1 << 22:  # the interpreter is slow: a slice of N
                print(f"  {name} {part}: on CPU only the first 256 of N = {n}", flush=True)
                n = 256
            width = 2 * k if fold == "swiglu" else k  # [gate | up] for the down projection
            x = jnp.asarray(rng.standard_normal((args.batch, width)) * 4, jnp.bfloat16)
            nw = (jnp.asarray(rng.standard_normal(k) * 0.2, jnp.bfloat16) if fold == "norm"
                  else None)
            copies = max(3, -(-2 * L2_BYTES // (n * k * 2)) + 1)
            weights = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * k ** -0.5
                       for i in range(copies)]
            eps = config.rms_norm_eps

            def prologue(x, nw):  # the norm or SwiGLU as the model computes it
                h = model.rms_norm(x, nw, eps) if nw is not None else x
                if fold == "swiglu":  # as model.mlp
                    gate, up = jnp.split(h, 2, axis=-1)
                    h = activations.silu(gate) * up
                return h

            def xla(x, w, nw):
                return jnp.einsum("bk,nk->bn", prologue(x, nw), w,
                                  preferred_element_type=jnp.float32)

            options = dict(jd.COMPILER_OPTIONS)
            variants = [("XLA", jax.jit(xla, compiler_options=options))]
            for kind, block_k, opt in ((kind, b, o) for kind in args.kernels.split(",")
                                       for b in block_ks for o in split_opts):
                wg = kind == "wgmma"
                splits = (choose_splits(args.batch, n, k, block_k, args.stages, num_sms, wg)
                          if opt == "auto" else opt)
                why = check_supported((args.batch, k), (n, k), jnp.bfloat16, block_k, splits,
                                      args.stages, wg)
                label = f"{kind} bk {block_k} splits {splits}"
                if why is not None:
                    print(f"  {name} {part} {label}: skipped ({why})", flush=True)
                    continue
                if any(v[0] == label for v in variants):
                    continue

                def kernel(x, w, nw, block_k=block_k, splits=splits, wg=wg):
                    if wg:
                        return gemv_wgmma(prologue(x, nw), w, num_splits=splits,
                                          block_k=block_k, num_stages=args.stages,
                                          interpret=interpret).sum(0)
                    return gemv_pallas(x, w, norm_weight=nw, eps=eps, swiglu=fold == "swiglu",
                                       num_splits=splits, block_k=block_k,
                                       num_stages=args.stages, interpret=interpret).sum(0)

                variants.append((label, jax.jit(kernel, compiler_options=options)))
            args_list = [(x, w, nw) for w in weights]
            ref = None
            for variant, fn in variants:
                got = np.asarray(fn(*args_list[0]))
                ref = got if ref is None else ref
                diff = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                total, count, big = timed(fn, args_list)
                tbps = n * k * 2 / (big * 1e-3) / 1e12 if big else float("nan")
                rows.append((name, part + (f" (+{fold})" if fold else ""), n, k, variant,
                             total * 1e3, count, big * 1e3, tbps, diff))
                print(f"  {rows[-1]}", flush=True)
            del weights
    print("\n| model | projection | N x K | variant | kernel sum us | kernels | largest us "
          "| TB/s (largest) | max rel diff |\n|---|---|---|---|---:|---:|---:|---:|---:|")
    for name, part, n, k, variant, total, count, big, tbps, diff in rows:
        print(f"| {name} | {part} | {n} x {k} | {variant} | {total:.1f} | {count} | {big:.1f} "
              f"| {tbps:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
