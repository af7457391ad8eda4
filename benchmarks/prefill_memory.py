"""A prefill's temporaries on a Hopper GPU against the plan's estimate, without a GPU.

    pip install -e ".[cuda12]"   # the CUDA plugin compiles for the GPU; no GPU or driver needed
    python benchmarks/prefill_memory.py [--cells 9b:64:8192,35b-a3b:8:8192] [--fp8]
        [--target h200|h100] [--memory-fraction 0.75]

Per cell (model:rows:tokens, the state's max_len 256 more): the prefill plan
(``memory.plan_prefill``, as ``jd.prefill`` makes it; its budget basis the memory JAX's allocator
may use, ``--memory-fraction`` of the card (JAX's default ``XLA_PYTHON_CLIENT_MEM_FRACTION``
0.75), less the weights and the state), compiled for the card (deviceless, as
``benchmarks/kernel_count.py``) at the planned chunk, and XLA's temporary bytes
(``memory_analysis().temp_size_in_bytes``) against the plan's estimate, which carries
``memory.SAFETY_FACTOR``: a ratio above 1 is a prefill the plan lets run out of memory. Without
a device XLA replaces CUB's sort by its own for large sorts (a warning; the MoE routing's), so
MoE rows may differ from the GPU's by that sort's scratch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_count import _DEVICE_INFO, abstract_inputs, deviceless_device  # noqa: E402  (sets jax_platforms)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import memory, step  # noqa: E402
from jaxdecode.kernels import choice  # noqa: E402

GiB = 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:8192,9b:64:8192",
                    help="model:rows:tokens,... (presets without the 'qwen3.5-' prefix)")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 Linears (jd.quantize_fp8)")
    ap.add_argument("--target", default="h200", choices=sorted(_DEVICE_INFO))
    ap.add_argument("--memory-fraction", type=float, default=0.75,
                    help="of the card's memory the allocator may use (JAX's default 0.75)")
    args = ap.parse_args()
    device = deviceless_device(args.target)
    placed = jax.sharding.SingleDeviceSharding(device)
    card = _DEVICE_INFO[args.target]["device_memory_size"]
    print(f"# deviceless compile for {device.device_kind}; jax {jax.__version__}; "
          f"{'FP8' if args.fp8 else 'bf16'} weights; free = {args.memory_fraction} x "
          f"{card / GiB:.1f} GiB - weights - state")
    print("| model | rows x tokens | weights GiB | state GiB | chunk | estimate GiB | "
          "XLA temporaries GiB | / estimate | compile s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for cell in args.cells.split(","):
        name, rows, tokens = cell.split(":")
        rows, tokens = int(rows), int(tokens)
        config = jd.Config.from_preset(name if name == "tiny" or name.startswith("qwen")
                                       else f"qwen3.5-{name}")
        shapes, state = abstract_inputs(config, rows, tokens + 256, device, args.fp8)
        weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        free = int(args.memory_fraction * card) - weights - held
        kernels = choice.choose_kernels(config, rows, dtype="bfloat16")
        plan = memory.plan_prefill(config, rows, tokens, tokens + 256, jnp.bfloat16,
                                   budget=int(memory.BUDGET_FRACTION * free),
                                   flash=kernels.prefill_attention == "pallas",
                                   weight_copy_bytes=step.dequantized_copy_bytes(shapes))
        chunk = plan.prefill_chunk_size or tokens
        run = step.jit_prefill(config, None, False, plan.query_block, kernels, False)
        t0 = time.perf_counter()
        compiled = run.lower(shapes, state,
                             jax.ShapeDtypeStruct((rows, chunk), jnp.int32, sharding=placed),
                             jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placed)).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"| {name} | {rows} x {tokens} | {weights / GiB:.1f} | {held / GiB:.2f} | "
              f"{plan.prefill_chunk_size or 'whole'} | {plan.bytes / GiB:.2f} | "
              f"{temp / GiB:.2f} | {temp / plan.bytes:.2f} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
