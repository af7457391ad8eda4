"""Kernels one decode step launches on a Hopper GPU, counted on a machine without one.

    pip install -e ".[cuda12]"   # the CUDA plugin compiles for the GPU; no GPU or driver needed
    python benchmarks/kernel_count.py [--cells 35b-a3b:1,9b:1] [--fp8] [--target h100|h200]
        [--kernels name=value,...] [--sequence] [--dump-hlo DIR]

XLA compiles the step (``step.jit_decode_step``) for the target card's device description
(deviceless: ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``)
with the kernels ``jd.choose_kernels`` picks on Hopper, and the launches in the optimised HLO are
counted: each fusion, library call (cuBLAS, Mosaic GPU) and copy one, a sort two (XLA copies
its operands into place, then sorts: CUPTI counts both). Two depths are compiled, one and two
periods of the layer pattern (up to the first attention layer: 3 Gated DeltaNet + 1 attention,
each with its MLP or MoE block, at full width), so the table gives the launches of a period and
of the whole model by extrapolation, without compiling every layer.

Static counts: a loop's body counts once (the MoE rounds form's trip count depends on the
routing), every branch of a conditional counts. Without a device XLA does not autotune: a GEMM
may get another backend (Triton instead of cuBLAS) and the times are unknown. Calibration against
CUPTI on an H100 (benchmarks/RESULTS.md, session 48; CUPTI's counts from sessions 40-41, the
same step): 35B-A3B and 9B at 20 layers, batch 1, bf16, within one launch.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys

import jax

jax.config.update("jax_platforms", "cpu")  # no GPU backend: the topology below compiles for one

import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import step  # noqa: E402
from jaxdecode.kernels import choice  # noqa: E402

# XLA's GpuTargetConfig text for each card (cores, shared memory, bandwidth, as the devices report)
_DEVICE_INFO = {
    "h100": dict(memory_bandwidth=3352320000000, device_memory_size=84929347584,
                 clock_rate_ghz=1.98, name="NVIDIA H100 80GB HBM3"),
    "h200": dict(memory_bandwidth=4800000000000, device_memory_size=150754820096,
                 clock_rate_ghz=1.98, name="NVIDIA H200"),
}
NOT_LAUNCHES = {"AllocateBuffer"}  # custom calls that reserve a buffer, no kernel


def target_config(card: str) -> str:
    d = _DEVICE_INFO[card]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {d['memory_bandwidth']} l2_cache_size: 52428800
  clock_rate_ghz: {d['clock_rate_ghz']} device_memory_size: {d['device_memory_size']}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{d['name']}"
"""


def deviceless_device(card: str):
    """The one device of a ``card`` topology (compiles for it, runs nothing), with
    ``choose_kernels`` answering as on Hopper (as tests/test_choice.py makes it: this process
    has no GPU backend). Exits naming the plugin to install where there is no CUDA compiler."""
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(card), topology="1x1x1")
    except Exception as e:  # noqa: BLE001 (the plugin's own message says what is missing)
        sys.exit(f"no deviceless CUDA compiler ({e}); install the CUDA plugin: "
                 "pip install -e '.[cuda12]'")
    choice._compute_capability = lambda d: (9, 0)
    return topology.devices[0]


def launches(hlo_text: str) -> list[tuple[str, str, str]]:
    """(instruction, kind, op_name) of each kernel launch of the entry computation in order,
    control flow walked into (a while's body and condition once, every branch of a conditional,
    called computations), fusion bodies not."""
    computations, current, entry = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(2)
            computations[current] = []
            entry = current if head.group(1) else entry
        elif current and line.startswith("  "):
            computations[current].append(line)
    out = []

    def walk(name):
        for line in computations[name]:
            m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(", line)
            if not m:
                continue
            inst, op = m.groups()
            if op in ("while", "conditional", "call"):
                for callee in re.findall(r"%([\w.\-]+)", line.split(")", 1)[-1]):
                    if callee in computations:
                        walk(callee)
                continue
            if op == "fusion":
                backend = re.search(r'"kind":"(\w+)"', line)
                kind = backend.group(1) if backend else re.search(r"kind=(\w+)", line).group(1)
                if re.search(r"\bsort\(", "\n".join(computations.get(
                        re.search(r"calls=%([\w.\-]+)", line).group(1), []))):
                    kind = "sort"
            elif op == "custom-call":
                kind = re.search(r'custom_call_target="([^"]+)"', line).group(1)
                if kind in NOT_LAUNCHES:
                    continue
            elif op in ("sort", "copy", "all-reduce", "all-gather", "reduce-scatter",
                        "all-to-all", "collective-permute"):
                kind = op
            else:
                continue
            op_name = re.search(r'op_name="([^"]*)"', line)
            out.append((inst, kind, op_name.group(1) if op_name else ""))
            if kind == "sort":
                out.append((inst + ".operands", "copy (sort's operands)", ""))

    walk(entry)
    return out


def abstract_inputs(config, batch, max_len, device, fp8):
    """(params, state): ``ShapeDtypeStruct`` trees of bf16 random-weight params (``fp8``: block
    FP8, ``jd.quantize_fp8``) and a [batch, max_len] state, placed on ``device``; nothing is
    allocated."""
    placed = jax.sharding.SingleDeviceSharding(device)

    def make_params():
        params = jd.init_params(config, jax.random.key(0), "bfloat16")
        return jd.quantize_fp8(params) if fp8 else params

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed),
                            tree)

    return (abstract(jax.eval_shape(make_params)),
            abstract(jax.eval_shape(lambda: jd.init_state(config, batch, max_len,
                                                          dtype="bfloat16"))))


def compile_step(config, batch, context, device, fp8, overrides):
    """Optimised HLO text of the decode step for ``device`` (a topology device)."""
    params, state = abstract_inputs(config, batch, context, device, fp8)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                  sharding=jax.sharding.SingleDeviceSharding(device))
    kernels = dataclasses.replace(choice.choose_kernels(config, batch, dtype="bfloat16"),
                                  **overrides)
    lowered = step.jit_decode_step(config, kernels).lower(params, state, tokens, None)
    return lowered.compile().as_text(), kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="35b-a3b:1,9b:1",
                    help="model:batch,... (presets without the 'qwen3.5-' prefix)")
    ap.add_argument("--context", type=int, default=1280, help="the state's max_len")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 Linears (jd.quantize_fp8)")
    ap.add_argument("--target", default="h100", choices=sorted(_DEVICE_INFO))
    ap.add_argument("--kernels", default="",
                    help="jd.Kernels fields overriding the choice, e.g. fp8_linear=xla")
    ap.add_argument("--sequence", action="store_true",
                    help="also list the second period's launches in order (from the first "
                         "launch after the first period's layers)")
    ap.add_argument("--dump-hlo", default=None, help="write each optimised HLO here")
    args = ap.parse_args()
    overrides = dict(item.split("=", 1) for item in args.kernels.split(",") if item)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(jd.Kernels)}
    if unknown:
        ap.error(f"--kernels: {sorted(unknown)} are not jd.Kernels fields")
    overrides = {name: {"true": True, "false": False}.get(value.lower(), value)
                 for name, value in overrides.items()}  # batch_invariant=false: a bool
    device = deviceless_device(args.target)
    print(f"# deviceless compile for {device.device_kind}; jax {jax.__version__}; "
          f"{'FP8' if args.fp8 else 'bf16'} weights; context {args.context}")
    rows = []
    for cell in args.cells.split(","):
        name, batch = cell.split(":")
        full = jd.Config.from_preset(name if name == "tiny" or name.startswith("qwen")
                                     else f"qwen3.5-{name}")
        period = full.full_attention_layers[0] + 1  # the layer pattern repeats after it
        if full.num_hidden_layers % period or full.layer_types != full.layer_types[:period] * (
                full.num_hidden_layers // period):
            sys.exit(f"{name}: its layers do not repeat a {period}-layer pattern; the count "
                     "extrapolates from one")
        counts = []
        for layers in (period, 2 * period):
            config = dataclasses.replace(full, num_hidden_layers=layers,
                                         layer_types=full.layer_types[:layers])
            hlo, kernels = compile_step(config, int(batch), args.context, device, args.fp8,
                                        overrides)
            if args.dump_hlo:
                os.makedirs(args.dump_hlo, exist_ok=True)
                with open(os.path.join(args.dump_hlo, f"{name}_b{batch}_l{layers}.hlo.txt"),
                          "w") as f:
                    f.write(hlo)
            counts.append(launches(hlo))
        one, two = counts
        per_period = len(two) - len(one)
        fixed = len(one) - per_period
        whole = fixed + per_period * full.num_hidden_layers // period
        start = next((i for i, (_, _, op) in enumerate(two) if f"layer{period}_" in op), None)
        if start is None:
            sys.exit(f"{name}: no launch is named for layer {period} (op_name scopes): the "
                     "second period cannot be found")
        while start and "layer" not in two[start - 1][2]:  # its norm (no layer scope)
            start -= 1
        second = two[start:start + per_period]
        kinds = collections.Counter(kind for _, kind, _ in second)
        rows.append((name, batch, whole, per_period, fixed, kinds))
        if args.sequence:
            print(f"\n{name} batch {batch}: one period's launches ({kernels}):")
            for n, (inst, kind, op_name) in enumerate(second):
                scope = re.sub(r"^jit\(\w+\)/", "", op_name)[-70:]
                print(f"  {n:3d} {kind:28s} {inst:34s} {scope}")
    print(f"\n| model | batch | kernels a step ({args.target}) | a period of "
          f"{period} layers | outside the layers | a period by kind |")
    print("|---|---:|---:|---:|---:|---|")
    for name, batch, whole, per_period, fixed, kinds in rows:
        by_kind = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        print(f"| {name} | {batch} | {whole} | {per_period} | {fixed} | {by_kind} |")


if __name__ == "__main__":
    main()
