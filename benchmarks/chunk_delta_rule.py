"""The chunked gated delta rule of the prefill: the library's form against a candidate, timed on
the GPU with the same inputs.

    python benchmarks/chunk_delta_rule.py [--cells 0.8b:1:8192,0.8b:1:131072,9b:8:2048]

``library``: ``gated_delta.chunk_gated_delta_rule`` (64-token chunks in parallel, then a
``lax.scan`` over the chunks: one sequential step per 64 tokens, a few small kernels each).
``assoc``: the same chunk algebra, but the chunk-to-chunk recurrence ``S_{n+1} = A_n S_n + B_n``
(``A_n = e^{gamma_n} I - K~_n^T W_n``, ``B_n = K~_n^T U_n``) composed by
``lax.associative_scan`` (log2 N sequential levels instead of N steps), the initial state
applied in full float32. Reported per cell (rows:tokens, the model's DeltaNet heads, float32
inputs as the model prepares them): ms per layer, and the candidate's largest difference from
the library's output and final state, relative to their largest magnitudes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxdecode as jd  # noqa: E402
from jaxdecode.gated_delta import chunk_gated_delta_rule, chunk_terms, l2_normalize  # noqa: E402


def assoc_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64):
    """The candidate (module docstring); shapes as ``chunk_gated_delta_rule``."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    q_decayed, k_decayed, u, w, qk, gamma_last = chunk_terms(q, k, v, g, beta, chunk_size)
    n = u.shape[0]
    eye = jnp.eye(dk, dtype=q.dtype)
    trans = (jnp.exp(gamma_last)[..., None, None] * eye
             - jnp.einsum("nbhck,nbhcj->nbhkj", k_decayed, w))  # [N, B, H, dk, dk]
    offset = jnp.einsum("nbhck,nbhcv->nbhkv", k_decayed, u)  # [N, B, H, dk, dv]

    def compose(first, second):
        a1, b1 = first
        a2, b2 = second
        return a2 @ a1, a2 @ b1 + b2

    acum, bcum = jax.lax.associative_scan(compose, (trans, offset), axis=0)
    after = jnp.einsum("nbhkj,bhjv->nbhkv", acum, state,
                       precision=jax.lax.Precision.HIGHEST) + bcum
    before = jnp.concatenate([state[None], after[:-1]], axis=0)
    delta = u - jnp.einsum("nbhck,nbhkv->nbhcv", w, before)
    o = (jnp.einsum("nbhck,nbhkv->nbhcv", q_decayed, before)
         + jnp.einsum("nbhij,nbhjv->nbhiv", qk, delta))
    o = jnp.moveaxis(o, 0, 1)
    o = jnp.swapaxes(o, 2, 3).reshape(batch, n * chunk_size, heads, dv)
    return o[:, :length], after[-1]


def inputs(config, rows, tokens):
    c = config
    h, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    keys = jax.random.split(jax.random.key(3), 6)
    q = l2_normalize(jax.random.normal(keys[0], (rows, tokens, h, dk))) * dk**-0.5
    k = l2_normalize(jax.random.normal(keys[1], (rows, tokens, h, dk)))
    v = jax.random.normal(keys[2], (rows, tokens, h, dv))
    g = -jax.random.uniform(keys[3], (rows, tokens, h)) * 0.05  # weak decay: long memory
    beta = jax.random.uniform(keys[4], (rows, tokens, h))
    s0 = jax.random.normal(keys[5], (rows, h, dk, dv)) * 0.1
    return q, k, v, g, beta, s0


def time_ms(f, args, repeats=5):
    out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:8192,0.8b:1:131072,9b:8:2048")
    args = ap.parse_args()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    for cell in args.cells.split(","):
        name, b, t = cell.split(":")
        config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
        x = inputs(config, int(b), int(t))
        lib_ms, (o_ref, s_ref) = time_ms(jax.jit(lambda *a: chunk_gated_delta_rule(*a, 64)), x)
        try:
            new_ms, (o, s) = time_ms(jax.jit(assoc_chunk_gated_delta_rule), x)
            err_o = float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max())
            err_s = float(jnp.abs(s - s_ref).max() / jnp.abs(s_ref).max())
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it
            new_ms, err_o, err_s = f"{type(e).__name__}", float("nan"), float("nan")
        rows.append((cell, lib_ms, new_ms, err_o, err_s))
        print(f"  {rows[-1]}", flush=True)
    print("\n| cell | library ms/layer | assoc ms/layer | assoc vs library: output | state |\n"
          "|---|---:|---:|---:|---:|")
    for cell, lib_ms, new_ms, err_o, err_s in rows:
        new = f"{new_ms:.2f}" if isinstance(new_ms, float) else new_ms
        print(f"| {cell} | {lib_ms:.2f} | {new} | {err_o:.1e} | {err_s:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
