"""The chunked gated delta rule of the prefill: the library's form against candidates, timed on
the GPU with the same inputs.

    python benchmarks/chunk_delta_rule.py [--cells 0.8b:1:8192,0.8b:1:131072,9b:8:2048]
        [--candidates library,terms only,terms inverse,lean scan,lean scan + inverse,assoc,
                      pallas]

``terms only`` / ``terms inverse``: the per-chunk terms alone (``gated_delta.chunk_terms``),
with T⁻¹ from one triangular solve against I or formed by squarings
(:func:`unit_lower_inverse`) and applied by matmuls. ``lean scan``: the scan carries only the
state and the outputs follow it for all chunks at once (:func:`lean_chunk_gated_delta_rule`).

``library``: ``gated_delta.chunk_gated_delta_rule`` (64-token chunks in parallel, then a
``lax.scan`` over the chunks: one sequential step per 64 tokens, a few small kernels each).
``pallas``: the terms and the recurrence in two Mosaic GPU kernels
(``kernels.chunk_gated_delta.chunk_gated_delta_rule_pallas``, what the model runs on Hopper).
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
from jaxdecode.kernels.chunk_gated_delta import chunk_gated_delta_rule_pallas  # noqa: E402


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


def _chunk_out(o, batch, length, chunk_size):
    heads, dv = o.shape[2], o.shape[-1]
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, dv]
    return jnp.swapaxes(o, 2, 3).reshape(batch, -1, heads, dv)[:, :length]


def lean_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64, terms=None):
    """Candidate: the scan carries only the state (two matmuls a step: Delta = U - W S and
    S <- e^gamma S + K~^T Delta) and stacks the state before each chunk; the outputs
    O = Q~ S_n + (masked QK) Delta_n are computed after it, for every chunk at once."""
    batch, length = q.shape[:2]
    q_decayed, k_decayed, u, w, qk, gamma_last = terms or chunk_terms(q, k, v, g, beta,
                                                                      chunk_size)

    def step(s, xs):
        k_c, u_c, w_c, g_last = xs
        delta = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)
        return (jnp.exp(g_last)[..., None, None] * s
                + jnp.einsum("bhck,bhcv->bhkv", k_c, delta)), (s, delta)

    state, (before, delta) = jax.lax.scan(step, state, (k_decayed, u, w, gamma_last))
    o = (jnp.einsum("nbhck,nbhkv->nbhcv", q_decayed, before)
         + jnp.einsum("nbhij,nbhjv->nbhiv", qk, delta))
    return _chunk_out(o, batch, length, chunk_size), state


def unit_lower_inverse(t):
    """(I + A)^-1 for strictly lower A [..., C, C] (C a power of two) as the product
    (I - A)(I + A^2)(I + A^4)... = sum_k (-A)^k (A is nilpotent): log2 C squarings, no solve.
    Not stable in general: with correlated keys and beta near 1 (A near a lower matrix of ones)
    the powers reach C(63, 31) ~ 1e18 and cancel; forward substitution has no such growth."""
    c = t.shape[-1]
    eye = jnp.eye(c, dtype=t.dtype)
    n = eye - t  # -A
    inv = eye + n
    hi = jax.lax.Precision.HIGHEST
    for _ in range(int(c).bit_length() - 2):
        n = jnp.matmul(n, n, precision=hi)
        inv = inv + jnp.matmul(inv, n, precision=hi)
    return inv


def inverse_terms(q, k, v, g, beta, chunk_size=64):
    """chunk_terms with T^-1 formed once by :func:`unit_lower_inverse` and applied by matmuls
    instead of two triangular solves."""
    import jaxdecode.gated_delta as gd
    orig = gd.solve_triangular
    cache = {}

    def solve(t, b, lower, unit_diagonal):
        key = id(t)
        if key not in cache:
            cache[key] = unit_lower_inverse(t)
        return jnp.matmul(cache[key], b, precision=jax.lax.Precision.HIGHEST)

    gd.solve_triangular = solve
    try:
        return chunk_terms(q, k, v, g, beta, chunk_size)
    finally:
        gd.solve_triangular = orig


def lean_inverse(q, k, v, g, beta, state, chunk_size=64):
    return lean_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size,
                                       terms=inverse_terms(q, k, v, g, beta, chunk_size))


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


CANDIDATES = {
    "library": lambda *a: chunk_gated_delta_rule(*a, 64),
    "terms only": lambda *a: chunk_terms(*a[:5], 64),
    "terms inverse": lambda *a: inverse_terms(*a[:5], 64),
    "lean scan": lean_chunk_gated_delta_rule,
    "lean scan + inverse": lean_inverse,
    "assoc": assoc_chunk_gated_delta_rule,
    "pallas": chunk_gated_delta_rule_pallas,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:8192,0.8b:1:131072,9b:8:2048")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    args = ap.parse_args()
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    names = args.candidates.split(",")
    rows = []
    for cell in args.cells.split(","):
        name, b, t = cell.split(":")
        config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
        x = inputs(config, int(b), int(t))
        with jax.default_matmul_precision("highest"):
            o_ref, s_ref = jax.jit(lambda *a: chunk_gated_delta_rule(*a, 64))(*x)
        row = [cell]
        for cand in names:
            try:
                ms, out = time_ms(jax.jit(CANDIDATES[cand]), x)
                if "terms" in cand:
                    row.append(f"{ms:.2f}")
                    continue
                o, s = out
                err_o = float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max())
                err_s = float(jnp.abs(s - s_ref).max() / jnp.abs(s_ref).max())
                row.append(f"{ms:.2f} ({err_o:.0e}/{err_s:.0e})")
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it
                row.append(type(e).__name__)
            print(f"  {cell} {cand}: {row[-1]}", flush=True)
        rows.append(row)
    print("\n| cell | " + " | ".join(f"{n} ms/layer" for n in names) + " |\n|---|"
          + "---:|" * len(names))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("(in parentheses: the largest output / final-state difference from the library's "
          "form at 'highest' matmul precision, relative to their largest magnitudes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
