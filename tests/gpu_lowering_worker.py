"""Lowers jaxdecode's Pallas Mosaic GPU kernels for CUDA on a machine without a GPU.

Run by tests/test_gpu_lowering.py in a subprocess whose PYTHONPATH holds the Mosaic GPU bindings
(``jax-cuda12-plugin``, installed with --no-deps into a side folder by .ci/run). JAX's lowering
for another platform runs the whole Pallas -> Mosaic GPU translation (register layouts,
reductions, copies) without a device, so a kernel that uses an op or layout Mosaic GPU cannot
lower fails here, on CPU, before it reaches a GPU. Prints one line per kernel configuration:
"OK name" or "FAIL name: error".
"""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp

from jaxdecode.kernels.decode_attention import decode_attention_pallas
from jaxdecode.kernels.gated_delta_decode import gated_delta_decode_pallas


def lower(name, fn, *shapes):
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    try:
        jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
        print(f"OK {name}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print(f"FAIL {name}: {last[:300]}", flush=True)


def main():
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    for batch, heads, dv, block_v in ((1, 16, 128, 64), (64, 32, 128, 128), (2, 3, 192, 64)):
        dk = 128
        lower(f"gated_delta_decode B{batch} H{heads} dv{dv} block_v{block_v}",
              lambda q, k, v, g, b, s, bv=block_v: gated_delta_decode_pallas(q, k, v, g, b, s,
                                                                             block_v=bv),
              ((batch, heads, dk), f32), ((batch, heads, dk), f32), ((batch, heads, dv), f32),
              ((batch, heads), f32), ((batch, heads), f32), ((batch, heads, dk, dv), f32))
    for (hq, hkv, d), dtype in (((16, 4, 256), bf16), ((16, 2, 256), bf16), ((8, 8, 128), f32)):
        lower(f"decode_attention Hq{hq} Hkv{hkv} D{d} {jnp.dtype(dtype).name}",
              decode_attention_pallas, ((2, hq, d), dtype), ((2, hkv, 1024, d), dtype),
              ((2, hkv, 1024, d), dtype), ((2,), i32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
