"""The MoE models' expert computation on one GPU: the sparse MoE block over a stack of layers,
each way the library could compute it, against the bytes the routing actually touches, and the
whole decode step.

    python benchmarks/moe.py [--model 35b-a3b] [--tokens 1,8,64,1024] [--variants ...]
        [--decode 1,8,64] [--context 1024]

Part 1, the block alone: ``model.moe`` for every layer of the preset in one program (random
bf16 weights with the preset's shapes, E experts per layer; each layer's input is the previous
layer's output, RMS-normalised, so routing changes from layer to layer), N tokens at a time.
Reported per variant: ms for all layers, the bytes the routing touched (router + shared expert
+ the distinct experts chosen in each layer, counted from the run's routing), GB/s over those
bytes and % of the copy bandwidth measured in the same run, and the largest difference from the
first variant relative to max |out|. Variants:

  library           ``model.moe`` as the library runs it (``experts.routed_experts`` picks)
  pairs             the routed experts in the pairs form (each pair's expert weights
                    gathered, batched GEMVs; N <= 64 here)
  rounds            the rounds form (batched GEMMs over all E experts, E x C slots a round)
  ragged_dot        two ``jax.lax.ragged_dot`` over pairs sorted by expert (the library's form
                    until this benchmark; N <= 1024: XLA rewrites it to a dense dot)
  ragged_dot+cudnn  the same compiled with ``xla_gpu_experimental_use_ragged_dot_fusion``
  pairs_reduce      the pairs form with each GEMV a multiply + float32 sum (the gather fused
                    into the reduction; N <= 64)
  slices            one GEMV pair per (token, slot) on a ``dynamic_slice`` of the stack (N = 1)
  slices+fusion     the same with ``xla_gpu_enable_dynamic_slice_fusion``
  ep_slots          with ``--simulate-ep M``: one of M expert-parallel devices (its stack holds
                    E/M experts; the touched bytes count those): the library's slots
  ep_clipped        the same device with every pair clipped onto its experts (weight 0 for the
                    other devices' pairs: the form before the slots)

Part 2, ``--decode``: the library's decode step (``step.jit_decode_step``) for the whole model
at the given batch sizes and context, ms per token (the library's MoE); ``--fp8``: the same
cells again with ``jd.quantize_fp8`` weights (experts as block-FP8 stacks). Random weights route
near-uniformly, the worst case for distinct experts at batch > 1.

Part 3, ``--mesh DATA,MODEL`` (e.g. 397B-A17B on 8 GPUs):

    python benchmarks/moe.py --model 397b-a17b --mesh 1,8 --decode 1,8,64 \
        --contexts 1024,8192 --check-layers 2 --load-layers 4

the decode step expert parallel (experts split over "model") with tensor-parallel attention and
DeltaNet, params created in their shardings (``sharding.init_params_sharded``), no MTP layer:
ms per token, tok/s, bytes one device needs per step (its weight shards, the share of its
experts uniform routing touches, its share of the state) and % of the copy bandwidth of one
GPU measured in the same run (each GPU reads its own bytes, so this is also the share of the
summed bandwidth), the bytes the expert form streams (every slot counted as a full read), the
collectives of the compiled step (count and bytes per device) and its memory per device.
``--check-layers N``: the first N layers on the mesh, on one device and in float32 on one
device (prefill + one decode step). ``--load-layers N``: N layers written as published to
``--load-dir`` (page cache dropped; with ``--fp8`` in the FP8 releases' layout, experts per
expert), ``load_checkpoint(mesh=)`` timed, the rate applied to the whole model's bytes. ``--compile-only``: abstract params and state, nothing allocated: the
collectives and memory of the full 397B step on 8 virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``). ``--fp8``: the
cells with block-FP8 Linears and experts (``init_params_sharded(quantize="fp8")``; the
397B-A17B FP8 on 4 GPUs: ``--mesh 1,4 --fp8``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import experts, model, sharding  # noqa: E402
from jaxdecode.activations import sigmoid, silu  # noqa: E402
from jaxdecode.params import MLPParams, MoEParams  # noqa: E402
from jaxdecode.step import jit_decode_step  # noqa: E402
from sharded_decode import collectives, describe  # noqa: E402

FUSION = {"xla_gpu_experimental_use_ragged_dot_fusion": True}


def moe_form(form):
    """model.moe with the routed experts in one form ("pairs" | "rounds")."""
    def fn(p, x, config):
        return _moe(p, x, config, functools.partial(experts.routed_experts, form=form))
    return fn


def _ragged_dot_experts(x, weights, chosen, gate_up_proj, down_proj):
    """The experts as two ``jax.lax.ragged_dot`` grouped GEMMs over pairs sorted by expert (the
    library's form before: XLA's GPU compiler rewrites ragged_dot to a dense dot)."""
    n, k = chosen.shape
    e, h, ie = gate_up_proj.shape[0], x.shape[1], down_proj.shape[2]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gu = jax.lax.ragged_dot(x[order // k], jnp.swapaxes(gate_up_proj, 1, 2), group_sizes)
    out = jax.lax.ragged_dot(silu(gu[:, :ie]) * gu[:, ie:], jnp.swapaxes(down_proj, 1, 2),
                             group_sizes) * weights.reshape(-1)[order][:, None]
    routed = jnp.zeros((n * k, h), jnp.float32).at[order].set(out.astype(jnp.float32))
    return jnp.sum(routed.reshape(n, k, h), axis=1).astype(x.dtype)


def _pairs_reduce_experts(x, weights, chosen, gate_up_proj, down_proj):
    """The pairs form with each GEMV written as a multiply and a float32 sum, so XLA can fuse the
    expert gather into the reduction (reading each chosen expert's weights once, in place)."""
    n, k = chosen.shape
    ie = down_proj.shape[2]
    flat = chosen.reshape(-1)
    xs = jnp.repeat(x, k, axis=0).astype(jnp.float32)
    gu = jnp.sum(xs[:, None, :] * gate_up_proj[flat].astype(jnp.float32), axis=-1).astype(x.dtype)
    a = (silu(gu[:, :ie]) * gu[:, ie:]).astype(jnp.float32)
    out = jnp.sum(a[:, None, :] * down_proj[flat].astype(jnp.float32), axis=-1).astype(x.dtype)
    out = out * weights.reshape(-1)[:, None]
    return jnp.sum(out.astype(jnp.float32).reshape(n, k, -1), axis=1).astype(x.dtype)


def _slices_experts(x, weights, chosen, gate_up_proj, down_proj):
    """One GEMV pair per (token, slot), each expert's weights a ``dynamic_slice`` of the stack
    (with ``xla_gpu_enable_dynamic_slice_fusion`` the GEMM reads the slice in place)."""
    n, k = chosen.shape
    ie = down_proj.shape[2]
    outs = []
    for t in range(n):
        acc = 0
        for j in range(k):
            e = chosen[t, j]
            gu = x[t:t + 1] @ jax.lax.dynamic_index_in_dim(gate_up_proj, e, keepdims=False).T
            a = silu(gu[:, :ie]) * gu[:, ie:]
            y = a @ jax.lax.dynamic_index_in_dim(down_proj, e, keepdims=False).T
            acc = acc + (y * weights[t, j]).astype(jnp.float32)
        outs.append(acc)
    return jnp.concatenate(outs).astype(x.dtype)


def _moe(p: MoEParams, x, config, routed_fn):
    """model.moe's router and shared expert around ``routed_fn``."""
    weights, chosen = model.route(p, x, config)
    routed = routed_fn(x, weights, chosen, p.experts_gate_up_proj, p.experts_down_proj)
    shared = model.mlp(p.shared_expert, x) * sigmoid(model.linear(x, p.shared_expert_gate))
    return routed + shared


# name: (function, compiler options, largest N it runs at)
VARIANTS = {
    "library": (model.moe, None, None),
    "pairs": (moe_form("pairs"), None, 64),
    "rounds": (moe_form("rounds"), None, None),
    "ragged_dot": (lambda p, x, c: _moe(p, x, c, _ragged_dot_experts), None, 1024),
    "ragged_dot+cudnn": (lambda p, x, c: _moe(p, x, c, _ragged_dot_experts), FUSION, 1024),
    "pairs_reduce": (lambda p, x, c: _moe(p, x, c, _pairs_reduce_experts), None, 64),
    "slices": (lambda p, x, c: _moe(p, x, c, _slices_experts), None, 1),
    "slices+fusion": (lambda p, x, c: _moe(p, x, c, _slices_experts),
                      {"xla_gpu_enable_dynamic_slice_fusion": True}, 1),
}


def layer_params(config, layers, key, local=None):
    """One MoEParams per layer (separate arrays: a scan over stacked weights would hand each
    layer a slice, which XLA may copy); ``local``: only the first ``local`` experts' weights
    (one expert-parallel device's), the router over all E."""
    c = config
    h, ie, isz = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    e = local or c.num_experts

    def normal(key, shape, fan_in):
        return jax.random.normal(key, shape, jnp.bfloat16) * jnp.bfloat16(fan_in**-0.5)

    @jax.jit
    def make(key):
        ks = jax.random.split(key, 7)
        return MoEParams(
            gate=normal(ks[0], (c.num_experts, h), h),
            experts_gate_up_proj=normal(ks[1], (e, 2 * ie, h), h),
            experts_down_proj=normal(ks[2], (e, h, ie), ie),
            shared_expert=MLPParams(gate_proj=normal(ks[3], (isz, h), h),
                                    up_proj=normal(ks[4], (isz, h), h),
                                    down_proj=normal(ks[5], (h, isz), isz)),
            shared_expert_gate=normal(ks[6], (1, h), h))
    return [make(k) for k in jax.random.split(key, layers)]


def routing(p: MoEParams, x, config):
    return model.route(p, x, config)[1]


def stack_fn(fn, config):
    """x [N, H] through every layer's block (unrolled); returns (out, experts [L, N, k])."""
    def run(params, x):
        chosen = []
        for p in params:
            out = fn(p, x, config)
            chosen.append(routing(p, x, config))
            x = model.rms_norm(x + out, jnp.ones((x.shape[-1],), jnp.float32), 1e-6).astype(
                x.dtype)
        return out, jnp.stack(chosen)
    return run


def median_s(f, args, repeats=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touched_bytes(config, chosen, local=None):
    """Bytes the routing touched in every layer: router, shared expert and gate, and each
    distinct chosen expert's gate_up and down weights (bf16; with ``local``, only experts below
    it: one expert-parallel device's)."""
    c = config
    h, ie, isz = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    per_expert = 3 * ie * h * 2
    fixed = (c.num_experts * h + 3 * isz * h + h) * 2
    local = local or c.num_experts
    distinct = [len(np.unique(layer[layer < local])) for layer in np.asarray(chosen)]
    return sum(fixed + d * per_expert for d in distinct), statistics.mean(distinct)


def ep_variants(devices):
    """Variants for one of ``devices`` expert-parallel devices (part 1 with ``--simulate-ep``;
    its stack holds experts [0, E/devices), pairs of the others add nothing): the library's
    slots, and every pair clipped onto this device's experts (the form before the slots)."""
    slots = functools.partial(experts.routed_experts, expert_parallel=devices)
    return {"ep_slots": (lambda p, x, c: _moe(p, x, c, slots), None, None),
            "ep_clipped": (lambda p, x, c: _moe(p, x, c, experts.routed_experts), None, None)}


def part_blocks(config, tokens, variants, bw, simulate_ep=None):
    layers = config.num_hidden_layers
    local = config.num_experts // simulate_ep if simulate_ep else None
    params = layer_params(config, layers, jax.random.key(0), local)
    forms = {**VARIANTS, **(ep_variants(simulate_ep) if simulate_ep else {})}
    rows = []
    for n in tokens:
        x = jax.random.normal(jax.random.key(n), (n, config.hidden_size), jnp.bfloat16)
        ref = None
        for name in variants:
            fn, options, largest = forms[name]
            if largest is not None and n > largest:
                continue  # pairs: N·k weight copies; ragged_dot: an [E, N·k, H] operand
            try:
                f = jax.jit(stack_fn(fn, config)).lower(params, x).compile(
                    compiler_options=options)
                s = median_s(f, (params, x))
                hlo = f.as_text()
                lowered = ("cuDNN fusion" if "__cudnn$fusion" in hlo or "kCuDnn" in hlo
                           else "ragged-dot" if "ragged-dot" in hlo else "dense dot/gather")
                out, chosen = f(params, x)
                nbytes, distinct = touched_bytes(config, chosen, local)
                # the difference on one layer (chained layers amplify bf16 routing flips)
                out = np.asarray(jax.jit(fn, static_argnums=2)(params[0], x, config).astype(
                    jnp.float32))
                if ref is None:
                    ref = out
                diff = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
                rows.append((n, name, s * 1e3, nbytes / 2**20, distinct, nbytes / s / 1e9,
                             100 * nbytes / s / 1e9 / bw, diff, lowered))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((n, name, f"{type(e).__name__}: {str(e)[:100]}"))
            print(rows[-1], flush=True)
    del params
    return rows


def decode_bytes(config, params, batch, context):
    """Bytes a decode step reads: the dense model's (``decode.step_bytes``) with the experts
    counted as the distinct experts B tokens touch under uniform routing, E(1 - (1 - k/E)^B)
    per layer."""
    from decode import step_bytes  # noqa: PLC0415
    c = config
    parts = step_bytes(c, params, batch, context)
    moe = [layer.mlp for layer in params.layers]
    all_experts = sum(x.nbytes for m in moe
                      for x in jax.tree.leaves((m.experts_gate_up_proj, m.experts_down_proj)))
    distinct = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
    return sum(parts.values()) - all_experts + all_experts * distinct / c.num_experts


def part_decode(config, batches, context, bw, prefill, fp8=False):
    """The decode cells in bf16, then (``fp8``) with ``jd.quantize_fp8`` weights (the experts as
    block-FP8 stacks) in the same run; the prefill cells in bf16."""
    params = jd.init_params(config, jax.random.key(0), "bfloat16")
    from decode import randomize_state, time_decode  # noqa: PLC0415
    rows = []
    for weights in ("bf16", "fp8") if fp8 else ("bf16",):
        p = jd.quantize_fp8(params) if weights == "fp8" else params
        for batch in batches:
            state = randomize_state(jd.init_state(config, batch, context + 256, "bfloat16"),
                                    context)
            try:
                s, compile_s, _ = time_decode(p, state, batch)
                nbytes = decode_bytes(config, p, batch, context)
                rows.append((f"{batch} ({weights})", s * 1e3, batch / s, nbytes / 2**30,
                             100 * nbytes / s / 1e9 / bw, compile_s))
            except Exception as e:  # noqa: BLE001
                rows.append((f"{batch} ({weights})", f"{type(e).__name__}: {str(e)[:100]}"))
            print(rows[-1], flush=True)
            del state
        del p
    pre = []
    for cell in filter(None, prefill.split(",")):
        b, t = map(int, cell.split(":"))
        ids = np.random.default_rng(0).integers(0, config.vocab_size, (b, t)).astype(np.int32)
        times = []
        for _ in range(3):
            state = jd.init_state(config, b, t, "bfloat16")
            t0 = time.perf_counter()
            logits, state = jd.prefill(params, state, ids, np.full(b, t, np.int32))
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
            del state, logits
        pre.append((cell, times[0], statistics.median(times[1:]), b * t / statistics.median(times[1:])))
        print(pre[-1], flush=True)
    return rows, pre


def truncated(config, layers):
    """``config`` with its last ``layers`` layers (the published schedule ends in a full-attention
    layer) and no MTP layer (decode does not read it)."""
    return dataclasses.replace(config, num_hidden_layers=layers,
                               layer_types=config.layer_types[-layers:], mtp_num_hidden_layers=0)


def device_step_bytes(params, batch, context, mesh):
    """(needed, streamed): bytes one device reads in a decode step on ``mesh``. Needed: its
    shard of every weight (the embedding: B rows; the routed experts: the share of its E/m
    experts that B/d tokens touch under uniform routing, 1 - (1 - k/E)^(B/d)) and its share of
    the state (every state leaf is split over data x model). Streamed: the same with the
    experts as the library's form reads them (``experts.routed_experts``: the slots' experts
    when the pairs fit them, else every pair's or, rounds, every local expert).
    ``params`` real or abstract (``jax.ShapeDtypeStruct`` with shardings), block-FP8 or not."""
    from decode import step_bytes  # noqa: PLC0415
    c = params.config
    rows, m = batch // mesh.shape[sharding.DATA], mesh.shape[sharding.MODEL]
    local, pairs = c.num_experts // m, rows * c.num_experts_per_tok
    stack = next(layer.mlp.experts_gate_up_proj for layer in params.layers
                 if isinstance(layer.mlp, MoEParams))
    value_bytes = 1 if isinstance(stack, jd.Fp8Linear) else stack.dtype.itemsize
    expert_bytes = 3 * c.moe_intermediate_size * c.hidden_size * value_bytes
    form, slots = experts.plan(pairs, local, expert_bytes, m)
    if slots == pairs and form == "rounds":
        slots = local  # every local expert once
    touched = 1 - (1 - c.num_experts_per_tok / c.num_experts) ** rows

    def shard(x):  # an Fp8Linear: its values and scales
        return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
                   for a in jax.tree.leaves(x))

    total = sum(shard(x) for x in jax.tree.leaves(params))
    total -= shard(params.embed_tokens) - rows * c.hidden_size * params.embed_tokens.dtype.itemsize
    stacks = sum(shard(layer.mlp.experts_gate_up_proj) + shard(layer.mlp.experts_down_proj)
                 for layer in params.layers if isinstance(layer.mlp, MoEParams))
    state = step_bytes(c, params, batch, context)
    state = (state["kv"] + state["state"]) / mesh.size
    return (int(total - stacks * (1 - touched) + state),
            int(total - stacks + stacks * slots / local + state))


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        shardings)


def part_mesh(config, mesh, batches, contexts, bw, compile_only=False, fp8=False):
    """Part 3: the decode step on ``mesh`` (expert parallel MoE, tensor parallel attention and
    DeltaNet), params created in their shardings (``fp8``: block-FP8 Linears and experts); with
    ``compile_only`` abstract params and state (nothing allocated: the full 397B compiles on 8
    virtual CPU devices)."""
    from decode import randomize_state, time_decode  # noqa: PLC0415
    key = jax.random.key(0)
    init = functools.partial(sharding.init_params_sharded, config, mesh, key, "bfloat16",
                             quantize="fp8" if fp8 else None)
    if compile_only:  # eval_shape drops the shardings: param_shardings gives them back (an
        # Fp8Linear's weight and scales both take its leaf's)
        shaped = jax.eval_shape(init)
        params = jax.tree.map(lambda s, leaf: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), leaf),
            sharding.param_shardings(shaped.config, mesh), shaped)
    else:
        params = init()
    config = params.config
    rows = []
    for context in contexts:
        for batch in batches:
            cell = dict(batch=batch, context=context)
            try:
                kernels = jd.choose_kernels(config, batch, dtype=params.dtype, mesh=mesh)
                tokens = sharding.shard_batch(
                    np.random.default_rng(0).integers(0, 1000, batch).astype(np.int32), mesh)
                if compile_only:
                    state = abstract(jax.eval_shape(
                        lambda b=batch, n=context: jd.init_state(config, b, n + 128, "bfloat16",
                                                                 check_memory=False)),
                        sharding.state_shardings(config, mesh, batch))
                    t0 = time.perf_counter()
                    compiled = jit_decode_step(config, kernels).lower(
                        params, state, tokens, None).compile()
                    s, compile_s = float("nan"), time.perf_counter() - t0
                else:
                    state = randomize_state(sharding.init_state_sharded(
                        config, mesh, batch, context + 128, "bfloat16"), context)
                    s, compile_s, compiled = time_decode(params, state, batch, steps=30,
                                                         kernels=kernels, tokens=tokens)
                    del state
                nbytes, streamed = device_step_bytes(params, batch, context, mesh)
                memory_stats = compiled.memory_analysis()
                cell.update(ms=s * 1e3, tok_s=batch / s, gib=nbytes / 2**30,
                            streamed_gib=streamed / 2**30,
                            pct=100 * nbytes / s / 1e9 / bw, compile_s=compile_s,
                            comm=describe(collectives(compiled.as_text())),
                            device_gib=(memory_stats.argument_size_in_bytes
                                        + memory_stats.temp_size_in_bytes) / 2**30)
            except Exception as e:  # noqa: BLE001 - report and go on
                cell["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(cell)
            print(cell, flush=True)
    return rows


def check_on_one_device(config, mesh, layers, prompt=64):
    """The first ``layers`` layers' model, bf16, on ``mesh`` and gathered onto one device,
    against the same weights in float32 on one device: prefill of a random prompt per "data"
    group and one greedy decode step (the mesh's tokens fed to all three), max |difference|
    relative to max |logits|. The mesh is right when its error is the one device's (bf16
    rounding) in size."""
    config = truncated(config, layers)
    params = sharding.init_params_sharded(config, mesh, jax.random.key(1), "bfloat16")
    one = jax.device_put(params, jax.devices()[0])
    rows = mesh.shape[sharding.DATA]  # one row per "data" group
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (rows, prompt)).astype(
        np.int32)
    c, n = params.config, prompt + 8
    runs = (("mesh", params, sharding.init_state_sharded(c, mesh, rows, n, "bfloat16")),
            ("one", one, jd.init_state(c, rows, n, "bfloat16")),
            ("f32", jax.tree.map(lambda x: x.astype(jnp.float32), one),
             jd.init_state(c, rows, n)))
    logits, token = {}, None
    for name, p, state in runs:
        first, state = jd.prefill(p, state, ids, np.full(rows, prompt, np.int32))
        if token is None:
            token = np.asarray(jnp.argmax(first, -1)).astype(np.int32)
        logits[name] = [np.asarray(x, np.float32)
                        for x in (first, jd.decode_step(p, state, token)[0])]
        del p, state

    def rel(a, b):
        return [float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b)]
    return dict(layers=layers, mesh_vs_f32=rel(logits["mesh"], logits["f32"]),
                one_vs_f32=rel(logits["one"], logits["f32"]),
                mesh_vs_one=rel(logits["mesh"], logits["one"]))


def save_safetensors(tensors: dict, path: str) -> None:
    """numpy arrays (float8_e4m3fn included, which safetensors' numpy writer lacks) as one
    safetensors file, written from the format's spec (8-byte header size, JSON header, data)."""
    import json  # noqa: PLC0415

    import ml_dtypes  # noqa: PLC0415
    codes = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, offset = {}, 0
    for name, x in tensors.items():
        header[name] = {"dtype": codes[x.dtype], "shape": list(x.shape),
                        "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())


def release_tensors(hf: dict, names: list, config, fp8: bool) -> dict:
    """``names`` of the HF tensors ``hf`` (popped) as a release stores them: bf16; with ``fp8``
    the FP8 releases' layout (spec §9): the Linears they quantise as F8_E4M3 + bf16
    ``weight_scale_inv`` in 128 x 128 blocks, the routed experts per expert."""
    import ml_dtypes  # noqa: PLC0415

    from jaxdecode import quantization  # noqa: PLC0415
    out = {}
    for name in names:
        x = np.asarray(hf.pop(name))
        if not (fp8 and quantization.is_quantized_leaf(name)):
            out[name] = x
            continue
        w8, scale = quantization.quantize(x)
        scale = scale.astype(ml_dtypes.bfloat16)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: rows [0, I) gate
            i = config.moe_intermediate_size
            parts = {"gate_proj": (w8[:, :i], scale[:, :i // 128]),
                     "up_proj": (w8[:, i:], scale[:, i // 128:])}
        elif name.endswith("mlp.experts.down_proj"):
            parts = {"down_proj": (w8, scale)}
        else:
            out[name], out[name + "_scale_inv"] = w8, scale
            continue
        prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
        for kind, (w, sc) in parts.items():
            for e in range(w.shape[0]):
                out[f"{prefix}.{e}.{kind}.weight"] = w[e]
                out[f"{prefix}.{e}.{kind}.weight_scale_inv"] = sc[e]
    return out


def time_load(config, mesh, layers, directory, fp8=False):
    """Writes the first ``layers`` layers' random weights as published (a
    ``model.safetensors.index.json`` and one file per layer; bf16 with the experts as fused 3-D
    tensors, or ``fp8`` the FP8 releases' layout: :func:`release_tensors`), drops them from the
    page cache (fsync + ``POSIX_FADV_DONTNEED``), then times ``jd.load_checkpoint(directory,
    "bfloat16", mesh=mesh)``; GB/s and that rate applied to the whole model's bytes (bf16, or
    FP8 where the release quantises)."""
    import json  # noqa: PLC0415

    from jaxdecode.params import param_specs, params_to_hf  # noqa: PLC0415
    from jaxdecode.quantization import is_quantized_leaf  # noqa: PLC0415
    part = truncated(config, layers)
    os.makedirs(directory, exist_ok=True)
    hf_config = part.to_hf_config()
    if fp8:
        hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                            "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    hf = params_to_hf(jd.init_params(part, jax.random.key(2), "bfloat16"))  # on the device
    files: dict[str, list] = {}
    for name in hf:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(f"model-{layer}.safetensors", []).append(name)
    weight_map, nbytes, count = {}, 0, 0
    for file, names in files.items():  # one file in host memory at a time
        tensors = release_tensors(hf, names, part, fp8)
        weight_map.update(dict.fromkeys(tensors, file))
        path = os.path.join(directory, file)
        save_safetensors(tensors, path)
        nbytes += sum(t.nbytes for t in tensors.values())
        count += len(tensors)
        del tensors
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the load reads from disk
        os.close(fd)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f)
    t0 = time.perf_counter()
    params = jax.block_until_ready(jd.load_checkpoint(directory, "bfloat16", mesh=mesh))
    s = time.perf_counter() - t0
    full = sum(int(np.prod(spec.shape)) * (1 if fp8 and is_quantized_leaf(name) else 2)
               for name, spec in param_specs(
                   dataclasses.replace(config, mtp_num_hidden_layers=0)).items())
    del params
    return dict(layers=layers, fp8=fp8, tensors=count, gib=nbytes / 2**30, s=s,
                gb_s=nbytes / s / 1e9, full_model_s=full / (nbytes / s))


def run_mesh(config, args, bw):
    """Part 3's cells: the check on one device, the load timing, then the decode step."""
    data, model_size = (int(n) for n in args.mesh.split(","))
    mesh = sharding.make_mesh(data, model_size, devices=jax.devices()[:data * model_size])
    config = dataclasses.replace(config, mtp_num_hidden_layers=0)
    check = load = None
    if args.check_layers:
        check = check_on_one_device(config, mesh, args.check_layers)
        print(check, flush=True)
    if args.load_layers:
        load = time_load(config, mesh, args.load_layers, args.load_dir, args.fp8)
        print(load, flush=True)
    rows = part_mesh(config, mesh, [int(b) for b in (args.decode or "1,8,64").split(",")],
                     [int(c) for c in args.contexts.split(",")], bw, args.compile_only,
                     args.fp8)
    return rows, check, load


def print_mesh(rows, check, load, args):
    what = ("compiled only" if args.compile_only else "timed") + (", FP8" if args.fp8 else "")
    print(f"\n| mesh (data, model) | batch | context | ms/token | tok/s | GiB needed per step "
          f"per device | % copy bw | GiB the expert form streams | collectives per step (bytes "
          f"per device) | device GiB (args + temp) | compile s |   ({what})")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| ({args.mesh}) | {r['batch']} | {r['context']} | {r['error']} |")
        else:
            print(f"| ({args.mesh}) | {r['batch']} | {r['context']} | {r['ms']:.3f} | "
                  f"{r['tok_s']:.0f} | {r['gib']:.2f} | {r['pct']:.1f} | "
                  f"{r['streamed_gib']:.2f} | {r['comm']} | "
                  f"{r['device_gib']:.1f} | {r['compile_s']:.1f} |")
    if check:
        print(f"\nFirst {check['layers']} layers, bf16, max |difference| / max |logits| "
              "(prefill, decode step):")
        for name, what in (("mesh_vs_f32", f"on ({args.mesh}) vs float32 on one device"),
                           ("one_vs_f32", "on one device vs float32 on one device"),
                           ("mesh_vs_one", f"on ({args.mesh}) vs on one device")):
            print(f"- {what}: {check[name][0]:.1e}, {check[name][1]:.1e}")
    if load:
        print(f"\nload_checkpoint(mesh=) of {load['layers']} layers ({load['gib']:.1f} GiB in "
              f"{load['tensors']} tensors"
              f"{', the FP8 release layout' if load['fp8'] else ''}, page cache dropped): "
              f"{load['s']:.1f} s, {load['gb_s']:.2f} GB/s; the whole "
              f"model at that rate {load['full_model_s']:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="35b-a3b")
    ap.add_argument("--tokens", default=None, help="part 1's token counts (default 1,8,64,1024; "
                    "none with --mesh)")
    ap.add_argument("--variants", default="library,pairs,rounds,ragged_dot")
    ap.add_argument("--decode", default="", help="batch sizes for part 2, e.g. 1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", default="", help="rows:tokens cells of jd.prefill, e.g. 1:8192")
    ap.add_argument("--fp8", action="store_true",
                    help="part 2 also with block-FP8 weights (jd.quantize_fp8), same run; "
                         "part 3 with them only (sharding.init_params_sharded(quantize='fp8'))")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (CPU smoke runs)")
    ap.add_argument("--experts", type=int, default=None, help="fewer experts (CPU smoke runs)")
    ap.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (CPU smoke runs)")
    ap.add_argument("--simulate-ep", type=int, default=None,
                    help="part 1 as one of M expert-parallel devices (its E/M experts), for the "
                         "variants ep_slots and ep_clipped, e.g. 8 for 397B-A17B on 8 GPUs")
    ap.add_argument("--mesh", default=None, help="part 3: DATA,MODEL mesh of the decode step, "
                    "e.g. 1,8 (batches: --decode, default 1,8,64)")
    ap.add_argument("--contexts", default="1024,8192", help="part 3's contexts")
    ap.add_argument("--compile-only", action="store_true",
                    help="part 3 on abstract params and state: collectives and memory per "
                         "device, nothing allocated (runs on 8 virtual CPU devices)")
    ap.add_argument("--check-layers", type=int, default=0,
                    help="part 3: the first N layers on the mesh against one device")
    ap.add_argument("--load-layers", type=int, default=0,
                    help="part 3: write N layers as published to --load-dir, time "
                         "load_checkpoint(mesh=) from disk")
    ap.add_argument("--load-dir", default="/tmp/jaxdecode_moe_checkpoint")
    args = ap.parse_args()
    if args.tokens is None:
        args.tokens = "" if args.mesh else "1,8,64,1024"
    name = args.model
    config = jd.Config.from_preset(name if name.startswith("tiny") else f"qwen3.5-{name}")
    if args.layers:
        config = truncated(config, args.layers)
    if args.experts:
        config = dataclasses.replace(config, num_experts=args.experts)
    if args.vocab:
        config = dataclasses.replace(config, vocab_size=args.vocab)
    from decode import copy_bandwidth_gb_per_s  # noqa: PLC0415
    bw = copy_bandwidth_gb_per_s()
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}, copy bandwidth "
          f"{bw:.0f} GB/s, {config.num_hidden_layers} layers x {config.num_experts} experts, "
          f"top {config.num_experts_per_tok}")
    blocks = part_blocks(config, [int(t) for t in args.tokens.split(",") if t],
                         args.variants.split(","), bw, args.simulate_ep) if args.tokens else []
    if args.mesh:
        mesh_rows, check, load = run_mesh(config, args, bw)
    decode, pre = part_decode(config, [int(b) for b in args.decode.split(",") if b],
                              args.context, bw, args.prefill, args.fp8) \
        if (args.decode or args.prefill) and not args.mesh else ([], [])
    if blocks:
        print("\n| tokens | variant | ms (all layers) | MiB touched | distinct experts/layer "
              "| GB/s | % copy bw | max diff | compiled as |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in blocks:
        if len(r) == 3:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
        else:
            print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.0f} | {r[4]:.1f} | {r[5]:.0f} "
                  f"| {r[6]:.1f} | {r[7]:.1e} | {r[8]} |")
    if decode:
        print(f"\n| batch | ms/token (context {args.context}) | tok/s | GiB read per step "
              "(uniform routing) | % copy bw | compile s |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in decode:
            if len(r) == 2:
                print(f"| {r[0]} | {r[1]} |")
            else:
                print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.0f} | {r[3]:.2f} | {r[4]:.1f} "
                      f"| {r[5]:.1f} |")
    if pre:
        print("\n| prefill rows:tokens | first call s | s | tok/s |")
        print("|---|---:|---:|---:|")
        for r in pre:
            print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.3f} | {r[3]:.0f} |")
    if args.mesh:
        print_mesh(mesh_rows, check, load, args)


if __name__ == "__main__":
    main()
