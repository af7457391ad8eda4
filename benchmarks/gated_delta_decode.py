"""The one-token delta-rule update alone: the Pallas kernel (per ``block_v``) against XLA's form.

    python benchmarks/gated_delta_decode.py

Per shape (batch B, key heads Hk, value heads Hv, dk = dv = 128, the published head dims):
kernel time of one update from CUPTI (the sum over the kernels one call launches, median of 20
calls), and the bandwidth that implies for one read and one write of the float32 state
[B, Hv, dk, dv]. Every kernel variant is checked against the XLA form on the same random
inputs first. Needs an sm_90 GPU (elsewhere it checks the script in the Mosaic GPU interpreter,
without times).
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdecode.kernels.gated_delta_decode import (choose_block_v,  # noqa: E402
                                                  gated_delta_decode_pallas,
                                                  gated_delta_decode_reference)
from step_profile import cupti_kernels  # noqa: E402

# (B, Hk, Hv): 0.8B and 9B at batch 1, 8, 64
SHAPES = [(1, 16, 16), (1, 16, 32), (8, 16, 32), (64, 16, 16), (64, 16, 32)]


def inputs(batch, hk, hv, d=128, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    unit = lambda k, s: (lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True))(
        jax.random.normal(k, s, jnp.float32))
    return (unit(ks[0], (batch, hk, d)) * d ** -0.5, unit(ks[1], (batch, hk, d)),
            jax.random.normal(ks[2], (batch, hv, d)),
            -jax.random.uniform(ks[3], (batch, hv)), jax.random.uniform(ks[4], (batch, hv)),
            jax.random.normal(ks[5], (batch, hv, d, d)))


def main():
    on_gpu = jax.default_backend() == "gpu"
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    shapes = SHAPES if on_gpu else [(1, 2, 4)]
    for batch, hk, hv in shapes:
        args = inputs(batch, hk, hv)
        state_bytes = args[5].size * 4
        variants = {"xla": jax.jit(gated_delta_decode_reference, donate_argnums=5)}
        for bv in (16, 32, 64, 128):
            variants[f"pallas bv={bv}"] = jax.jit(
                lambda *a, bv=bv: gated_delta_decode_pallas(*a, block_v=bv,
                                                            interpret=not on_gpu),
                donate_argnums=5)
        want_o, want_s = jax.jit(gated_delta_decode_reference)(*args)
        for name, fn in variants.items():
            o, s = fn(*args[:5], jnp.copy(args[5]))
            np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-4, rtol=1e-4,
                                       err_msg=name)
            np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), atol=1e-4, rtol=1e-4,
                                       err_msg=name)
            if not on_gpu:
                continue
            box = {"s": s}

            def call():
                o, box["s"] = fn(*args[:5], box["s"])
                return o

            for _ in range(3):
                call()
            times, counts = [], []
            for _ in range(20):
                ks = cupti_kernels(call)
                times.append(sum(ms for _, ms in ks))
                counts.append(len(ks))
            us = statistics.median(times) * 1e3
            rows.append((f"B{batch} Hk{hk} Hv{hv}", name, us, max(counts),
                         2 * state_bytes / (us * 1e-6) / 1e9,
                         choose_block_v(batch, hv, 128)))
        print(f"checked B={batch} Hk={hk} Hv={hv}", flush=True)
    print("\n| shape | variant | kernel us | kernels | GB/s (state read + write) | "
          "default block_v |\n|---|---|---:|---:|---:|---:|")
    for shape, name, us, n, gbs, default in rows:
        print(f"| {shape} | {name} | {us:.1f} | {n} | {gbs:.0f} | {default} |")


if __name__ == "__main__":
    main()
