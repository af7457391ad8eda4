"""Sharded runs for tests/test_sharding.py, in a fresh process with its own XLA device count.

    python tests/sharding_worker.py meshes           # 8 CPU devices: every mesh vs one device
    python tests/sharding_worker.py process I PORT   # process I of 2 (2 CPU devices each)

Prints one line ``RESULT {json}`` on stdout; the test asserts on it. The device count must be set
before jax is imported, which is why this is a separate script and not a fixture.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
import warnings

MODE = sys.argv[1]
DEVICES = 8 if MODE == "meshes" else 2
from conftest import cpu_devices_env  # noqa: E402 (before jax creates its CPU client)

os.environ.update(cpu_devices_env(DEVICES))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from conftest import aliased_parameters, tiny  # noqa: E402 (float32 "highest" matmuls too)
from jaxdecode import generation, model, sharding, step  # noqa: E402

# Every head count (Hq 16, Hkv 8, Hk 8, Hv 16), the intermediate size and the vocabulary divide
# 8, so all four meshes are valid; GQA group 2, r = Hv/Hk = 2, dk != dv, untied LM head.
CONFIG = tiny(vocab_size=1024, num_attention_heads=16, num_key_value_heads=8,
              linear_num_key_heads=8, linear_num_value_heads=16, linear_value_head_dim=8)
MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))
PROCESS_MESHES = ((2, 2), (1, 4))
BATCH, MAX_LEN, DECODE_STEPS = 8, 32, 8
PROMPT_LENGTHS = np.array([12, 5, 9, 1, 12, 7, 3, 10], np.int32)
# The same with every FFN an MoE block: 16 experts (2 a device on "model" = 8), 3 per token,
# I_e != I_s (both divide 8)
MOE_CONFIG = dataclasses.replace(CONFIG, intermediate_size=0, num_experts=16,
                                 num_experts_per_tok=3, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=40)

# Qwen3.5-397B-A17B's shape shrunk (issue 21's CPU check): 2 KV heads for 8 query heads (the
# published 2 for 32), 4 value heads per key head, every FFN an MoE block with top-10 of 32
# experts and I_e == I_s, one attention layer in four, untied LM head; on a "model" axis of 8
# the KV heads are repeated (sharding.config_on).
SHRUNK_397B = tiny(vocab_size=1024, num_attention_heads=8, num_key_value_heads=2,
                   linear_num_key_heads=8, linear_num_value_heads=32, linear_key_head_dim=16,
                   linear_value_head_dim=16, intermediate_size=0, num_experts=32,
                   num_experts_per_tok=10, moe_intermediate_size=16,
                   shared_expert_intermediate_size=16, tie_word_embeddings=False,
                   mtp_num_hidden_layers=1)
KV_MESHES = ((1, 8), (2, 4))

# Block-FP8 weights on a mesh: MOE_CONFIG with I_s = 64 and 8 x 8 blocks, so that every split
# weight gives each of 8 "model" devices whole blocks (the published shapes' 128 x 128 blocks
# split whole up to 8-way but for the 35B-A3B's shared expert, I_s = 512); I_s = 40 does not.
FP8_CONFIG = dataclasses.replace(MOE_CONFIG, shared_expert_intermediate_size=64)
FP8_BLOCK = (8, 8)
FP8_MESHES = ((1, 8), (2, 4))


def inputs():
    params = jd.init_params(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (BATCH, 12)).astype(np.int32)
    return params, tokens


def greedy(params, state, tokens, prefill, decode_step):
    """Prefill + DECODE_STEPS greedy steps; returns (logits list, tokens list, state)."""
    logits, state = prefill(params, state, tokens, PROMPT_LENGTHS)
    all_logits, all_tokens = [logits], []
    for _ in range(DECODE_STEPS):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        all_tokens.append(tok)
        logits, state = decode_step(params, state, tok)
        all_logits.append(logits)
    all_tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
    return all_logits, all_tokens, state


def one_device_run(params, seed):
    """Random prompts (``seed``) and their greedy run on one device: (prompts, each step's
    logits, each step's tokens, max |logits| over the run: the scale of the sharded errors)."""
    c = params.config
    tokens = np.random.default_rng(seed).integers(0, c.vocab_size, (BATCH, 12))
    ref_logits, ref_tokens, _ = greedy(params, jd.init_state(c, BATCH, MAX_LEN), tokens,
                                       jd.prefill, jd.decode_step)
    return tokens, ref_logits, ref_tokens, max(float(np.abs(np.asarray(x)).max())
                                               for x in ref_logits)


def sharded_greedy(params, mesh, tokens, ref_logits, ref_tokens, scale):
    """``params`` sharded on ``mesh``, then prefill + DECODE_STEPS steps fed the one-device run's
    tokens: (sharded params, final state, each step's max |logits - ref| / ``scale``, the
    compiled decode step's HLO text)."""
    sp = sharding.shard_params(params, mesh)
    state = sharding.init_state_sharded(sp.config, mesh, BATCH, MAX_LEN)
    logits, state = jd.prefill(sp, state, tokens, PROMPT_LENGTHS)
    errors = [float(np.abs(np.asarray(logits) - np.asarray(ref_logits[0])).max()) / scale]
    for i in range(DECODE_STEPS):
        logits, state = jd.decode_step(sp, state, np.asarray(ref_tokens[i]))
        errors.append(float(np.abs(np.asarray(logits) - np.asarray(ref_logits[i + 1])).max())
                      / scale)
    kernels = jd.choose_kernels(sp.config, BATCH, dtype="float32", mesh=mesh)
    tok = sharding.shard_batch(np.zeros(BATCH, np.int32), mesh)
    hlo = step.jit_decode_step(sp.config, kernels).lower(sp, state, tok, None).compile().as_text()
    return sp, state, errors, hlo


def spec_mismatches(tree, specs, mesh) -> list[str]:
    """Leaves whose sharding is not equivalent to the specified one, by key path."""
    bad = []
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(tree), flat_specs,
                                  strict=True):
        want = jax.sharding.NamedSharding(mesh, spec)
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            bad.append(f"{jax.tree_util.keystr(path)}: {leaf.sharding} != {spec}")
    return bad


def collectives(hlo_text: str) -> dict[str, int]:
    ops = re.findall(r"\s(all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)"
                     r"(?:-start)?\(", hlo_text)
    return {op: ops.count(op) for op in sorted(set(ops))}


def mesh_kernels(mesh):
    """The kernels jd.decode_step picks for a state on ``mesh``."""
    return jd.choose_kernels(CONFIG, BATCH, dtype="float32", mesh=mesh)


def check_new_weights(params, tokens) -> dict:
    """After an optimizer-like update of params on a (2, 4) mesh (a jitted tree.map: the layout
    propagates), jd.prefill / jd.decode_step with the new params keep every param's sharding,
    reuse the compiled step (no new executable) and give the single-device logits of the same
    new weights."""
    mesh = sharding.make_mesh(2, 4)
    sp = sharding.shard_params(params, mesh)
    update = jax.jit(lambda p, key: jax.tree.map(
        lambda x: x + 0.01 * jax.random.normal(key, x.shape, x.dtype), p))
    new = update(sp, jax.random.key(7))
    out = {"param_mismatches": spec_mismatches(new, sharding.param_partition_specs(CONFIG),
                                               mesh)}
    fn = step.jit_decode_step(CONFIG, mesh_kernels(mesh))
    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
    _, state = jd.prefill(sp, state, tokens, PROMPT_LENGTHS)
    _, state = jd.decode_step(sp, state, tokens[:, 0])  # compiled with the old weights
    size = fn._cache_size()
    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
    got = [jd.prefill(new, state, tokens, PROMPT_LENGTHS)]
    got.append(jd.decode_step(new, got[0][1], tokens[:, 0]))
    out["new_executables"] = fn._cache_size() - size
    host = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), new)  # one device, same values
    ref = [jd.prefill(host, jd.init_state(CONFIG, BATCH, MAX_LEN), tokens, PROMPT_LENGTHS)]
    ref.append(jd.decode_step(host, ref[0][1], tokens[:, 0]))
    scale = max(float(np.abs(np.asarray(r[0])).max()) for r in ref)
    out["rel_errors"] = [float(np.abs(np.asarray(g[0]) - np.asarray(r[0])).max()) / scale
                         for g, r in zip(got, ref)]
    return out


def run_meshes() -> dict:
    params, tokens = inputs()
    ref_logits, ref_tokens, _ = greedy(params, jd.init_state(CONFIG, BATCH, MAX_LEN), tokens,
                                       jd.prefill, jd.decode_step)  # one device
    ref_logits = [np.asarray(x) for x in ref_logits]
    scale = max(float(np.abs(x).max()) for x in ref_logits)
    out = {"greedy_tokens": np.stack([np.asarray(t) for t in ref_tokens]).tolist(), "meshes": {}}
    state_specs = sharding.state_partition_specs(CONFIG)
    for shape in MESHES:
        mesh = sharding.make_mesh(*shape)
        res = {}
        sp = sharding.shard_params(params, mesh)
        res["param_mismatches"] = spec_mismatches(sp, sharding.param_partition_specs(CONFIG), mesh)
        state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
        res["state_mismatches"] = {"init": spec_mismatches(state, state_specs, mesh)}
        logits, state = jd.prefill(sp, state, tokens, PROMPT_LENGTHS)  # on the state's mesh
        res["state_mismatches"]["prefill"] = spec_mismatches(state, state_specs, mesh)
        res["logits_sharding_ok"] = logits.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(mesh, sharding.logits_partition_spec()), 2)
        errors = [float(np.abs(np.asarray(logits) - ref_logits[0]).max()) / scale]
        donated = []
        for i in range(DECODE_STEPS):
            old = jax.tree.leaves(state)
            logits, state = jd.decode_step(sp, state, np.asarray(ref_tokens[i]))
            donated.append(all(x.is_deleted() for x in old))
            errors.append(float(np.abs(np.asarray(logits) - ref_logits[i + 1]).max()) / scale)
            res["state_mismatches"][f"decode{i}"] = spec_mismatches(state, state_specs, mesh)
        res["rel_errors"] = errors
        res["donated"] = donated
        step_fn = step.jit_decode_step(CONFIG, mesh_kernels(mesh))
        tok = sharding.shard_batch(np.zeros(BATCH, np.int32), mesh)
        hlo = step_fn.lower(sp, state, tok, None).compile().as_text()
        n_params, n_state = len(jax.tree.leaves(sp)), len(jax.tree.leaves(state))
        res["unaliased_state_params"] = sorted(
            set(range(n_params, n_params + n_state)) - aliased_parameters(hlo))
        res["collectives"] = collectives(hlo)
        out["meshes"][f"{shape[0]},{shape[1]}"] = res
    out["errors"] = check_errors(params)
    out["checkpoint"] = check_checkpoint(params)
    out["unpinned_decode_mismatches"] = check_unpinned(params, tokens)
    out["public_decode_step"] = check_public_decode_step_routes(params, tokens)
    out["chunked_prefill"] = check_chunked_prefill(params)
    out["generate"] = check_generate(params)
    out["score"] = check_score(params)
    out["pallas_uneven_rows"] = check_pallas_rows_not_dividing_data(params)
    out["speculative"] = check_speculative()
    out["new_weights"] = check_new_weights(params, tokens)
    out["moe"] = check_moe()
    out["repeated_kv_heads"] = check_repeated_kv_heads()
    out["fp8"] = check_fp8()
    return out


def check_repeated_kv_heads() -> dict:
    """SHRUNK_397B on meshes whose "model" axis exceeds its 2 KV heads, against one device:
    greedy prefill + decode logits, the KV heads each device holds, the step's collectives;
    load_checkpoint(mesh=) of the published-layout checkpoint equal to shard_params."""
    c = SHRUNK_397B
    key = jax.random.key(3)
    params = jd.init_params(c, key)
    tokens, ref_logits, ref_tokens, scale = one_device_run(params, 4)
    out = {}
    for shape in KV_MESHES:
        mesh = sharding.make_mesh(*shape)
        sp, state, errors, hlo = sharded_greedy(params, mesh, tokens, ref_logits, ref_tokens,
                                                scale)
        cache = state.kv_cache[0].k
        out[f"{shape[0]},{shape[1]}"] = {
            "rel_errors": errors,
            "num_key_value_heads": sp.config.num_key_value_heads,
            "kv_heads_per_device": cache.addressable_shards[0].data.shape[1],
            "param_mismatches": spec_mismatches(sp, sharding.param_partition_specs(sp.config),
                                                mesh),
            "collectives": collectives(hlo)}
    out["checkpoint"] = check_repeated_kv_checkpoint(params)
    out["init_sharded"] = check_init_params_sharded(params, key)
    return out


def check_fp8() -> dict:
    """Block-FP8 params (FP8_CONFIG, FP8_BLOCK) on FP8_MESHES against one device: greedy logits,
    each FP8 weight's and its scales' layout, the step's collectives; an FP8 release checkpoint
    loaded onto the mesh; FP8 params created in their shardings; weights whose blocks do not
    split whole held in float32."""
    from test_quantization import _write_fp8_checkpoint
    params = jd.init_params(FP8_CONFIG, jax.random.key(5))
    fp8 = jd.quantize_fp8(params, FP8_BLOCK)
    tokens, ref_logits, ref_tokens, scale = one_device_run(fp8, 6)
    out = {}
    for shape in FP8_MESHES:
        mesh = sharding.make_mesh(*shape)
        sp, _, errors, hlo = sharded_greedy(fp8, mesh, tokens, ref_logits, ref_tokens, scale)
        shardings = sharding.param_shardings(sp.config, mesh)  # a prefix of the FP8 tree
        through = jax.jit(lambda p: p, in_shardings=(shardings,), out_shardings=shardings)(sp)
        out[f"{shape[0]},{shape[1]}"] = {
            "rel_errors": errors, "collectives": collectives(hlo),
            "layout_problems": fp8_layout_problems(sp, mesh),
            "jit_param_shardings": [trees_equal(through, sp),
                                    fp8_layout_problems(through, mesh)],
            "copy_bytes": [step.dequantized_copy_bytes(fp8), step.dequantized_copy_bytes(sp)]}
    mesh = sharding.make_mesh(1, 8)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_fp8_checkpoint(pathlib.Path(tmp), params, block=FP8_BLOCK)
        loaded = jd.load_checkpoint(path, "float32", mesh=mesh)
        want = sharding.shard_params(jd.load_checkpoint(path, "float32"), mesh)
        out["checkpoint"] = {"values_equal": trees_equal(loaded, want),
                             "layout_problems": fp8_layout_problems(loaded, mesh),
                             "shard_bytes": shard_bytes(loaded, mesh)}
        # the tiny shapes in 128-blocks: most weights do not split whole over 8 devices
        got, held = held_in_model_dtype(lambda: jd.load_checkpoint(
            path / "dequantised", "float32", mesh=mesh, quantize="fp8"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = sharding.shard_params(jd.quantize_fp8(jd.load_checkpoint(
                path / "dequantised", "float32")), mesh)
        out["checkpoint_quantize_128"] = {**held, "values_equal": trees_equal(got, want),
                                          "shard_bytes": shard_bytes(got, mesh)}
    key = jax.random.key(7)
    got = sharding.init_params_sharded(FP8_CONFIG, mesh, key, quantize="fp8",
                                       block_size=FP8_BLOCK)
    unquantised = jax.tree.map(np.asarray, sharding.init_params_sharded(FP8_CONFIG, mesh, key))
    out["init_sharded"] = {
        "values_equal": trees_equal(got, sharding.shard_params(
            jd.quantize_fp8(unquantised, FP8_BLOCK), mesh)),
        "layout_problems": fp8_layout_problems(got, mesh), "shard_bytes": shard_bytes(got, mesh)}
    out["kernel"] = check_fp8_kernel_on_mesh()
    out["repeated_kv"] = check_fp8_repeated_kv_heads()
    # I_s = 40 rows over 8 devices in 8-row blocks: the shared experts held in float32
    uneven = jd.quantize_fp8(jd.init_params(MOE_CONFIG, jax.random.key(0)), FP8_BLOCK)
    tokens, ref_logits, ref_tokens, scale = one_device_run(uneven, 11)
    (sp, _, errors, _), held = held_in_model_dtype(lambda: sharded_greedy(
        uneven, mesh, tokens, ref_logits, ref_tokens, scale))
    got, init = held_in_model_dtype(lambda: sharding.init_params_sharded(
        MOE_CONFIG, mesh, key, quantize="fp8", block_size=FP8_BLOCK))
    unquantised = jax.tree.map(np.asarray, sharding.init_params_sharded(MOE_CONFIG, mesh, key))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = sharding.shard_params(jd.quantize_fp8(unquantised, FP8_BLOCK), mesh)
    out["unsplit"] = {"shard_params": {**held, "rel_errors": errors,
                                       "layout_problems": fp8_layout_problems(sp, mesh)},
                      "init_sharded": {**init, "layout_problems": fp8_layout_problems(got, mesh),
                                       "values_equal": trees_equal(got, want),
                                       "shard_bytes": shard_bytes(got, mesh)}}
    return out


def held_in_model_dtype(call) -> tuple:
    """(``call()``, its warnings about FP8 weights held in the model dtype and which weights of
    the params it returns (or of the first item of a tuple) are arrays where ``quantize_fp8``
    would give block FP8)."""
    from jaxdecode import quantization
    from jaxdecode.params import params_to_flat
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    flat = params_to_flat(result[0] if isinstance(result, tuple) else result)
    held = {name: x for name, x in flat.items()
            if quantization.is_quantized_leaf(name) and not isinstance(x, jd.Fp8Linear)}
    return result, {
        "warnings": [str(w.message) for w in caught if "FP8 weights" in str(w.message)],
        "held": sorted(held), "held_dtypes": sorted({str(x.dtype) for x in held.values()}),
        "fp8": sum(isinstance(x, jd.Fp8Linear) for x in flat.values())}


def check_fp8_repeated_kv_heads() -> dict:
    """SHRUNK_397B (2 KV heads of 32 rows) in FP8 with 32 x 8 blocks, sharded from one device
    onto (2, 4): each KV head repeated with its scale rows (one head a device), the greedy
    logits of one device; a K/V weight in 64-row blocks (a head's rows not whole blocks)
    held in the model dtype (sharding.unsplit_fp8, what shard_params asks)."""
    config = dataclasses.replace(SHRUNK_397B, shared_expert_intermediate_size=128)
    params = jd.init_params(config, jax.random.key(9))
    fp8 = jd.quantize_fp8(params, (32, 8))
    tokens, ref_logits, ref_tokens, scale = one_device_run(fp8, 10)
    mesh = sharding.make_mesh(2, 4)
    sp, _, errors, _ = sharded_greedy(fp8, mesh, tokens, ref_logits, ref_tokens, scale)
    k = sp.layers[3].self_attn.k_proj
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unsplit = sharding.unsplit_fp8(config, mesh, {
            "model.layers.3.self_attn.k_proj.weight": ((64, 64), (64, 8))})
    # created in its shardings with those 64-row blocks: the FP8 model's values, K/V quantised
    # in their own blocks before they are repeated (as shard_params of the quantised model)
    key = jax.random.key(13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = sharding.init_params_sharded(config, mesh, key, quantize="fp8",
                                            block_size=(64, 8))
        want = sharding.shard_params(jd.quantize_fp8(jax.jit(
            jd.init_params, static_argnums=(0, 2))(config, key, "float32"), (64, 8)), mesh)
    return {"rel_errors": errors, "num_key_value_heads": sp.config.num_key_value_heads,
            "k_rows_and_scale_rows_per_device": [k.weight.addressable_shards[0].data.shape[0],
                                                 k.scale_inv.addressable_shards[0].data.shape[0]],
            "layout_problems": fp8_layout_problems(sp, mesh),
            "head_rows_unsplit": [sorted(unsplit), [str(w.message) for w in caught]],
            "init_sharded_head_rows_equal": trees_equal(made, want)}


def check_fp8_kernel_on_mesh() -> dict:
    """choice.fp8_linear's kernel path per device on a (2, 4) mesh, column- and row-parallel
    (x [8, 512] bf16, or 3 rows: whole on each data group; w [512, 512] / [128, 512] in 128-blocks), with the kernel's call replaced
    by its XLA reference (the Mosaic GPU interpreter does not run under a multi-device
    shard_map; the kernel itself is tested in test_kernels_fp8_linear.py): max |difference|
    from XLA's form on one device relative to max |out|, and the compiled call's collectives;
    the real kernel's path lowered for CUDA on the same mesh (its Mosaic GPU custom call and
    all-reduces)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdecode import quantization
    from jaxdecode.kernels import choice
    from jaxdecode.kernels import fp8_linear as fl
    mesh = sharding.make_mesh(2, 4)
    rng = np.random.default_rng(8)
    out = {}
    kernel, shapes = choice._fp8_linears_kernel, []

    def reference(x, ws, ss, block, interpret):  # traced per device: the local shapes
        shapes.append([list(x.shape)] + [list(w.shape) for w in ws])
        return tuple(fl.fp8_linear_reference(x, w, s, block) for w, s in zip(ws, ss))
    choice._fp8_linears_kernel = reference
    for name, ns, row_parallel, rows in (("column", (512,), False, 8), ("row", (128,), True, 8),
                                         ("column, 3 rows", (512,), False, 3),
                                         ("row, 3 rows", (128,), True, 3),
                                         ("column, two weights", (512, 1024), False, 8)):
        x = jnp.asarray(rng.standard_normal((rows, 512)), jnp.bfloat16)
        ws = tuple(jd.Fp8Linear(*quantization.quantize(
            rng.standard_normal((n, 512)).astype(np.float32))) for n in ns)
        one = [choice.fp8_linear(choice.XLA, x, w) for w in ws]
        spec = P(None, "model") if row_parallel else P("model", None)
        placed = tuple(jd.Fp8Linear(*(jax.device_put(a, NamedSharding(mesh, spec))
                                      for a in (w.weight, w.scale_inv))) for w in ws)
        xs = jax.device_put(x, NamedSharding(mesh, P("data" if rows % 2 == 0 else None,
                                                     "model" if row_parallel else None)))

        def call(kernels, x, ws, rp=row_parallel):
            if len(ws) > 1:
                return choice.fp8_linears(kernels, x, ws)
            return (choice.fp8_linear(kernels, x, ws[0], row_parallel=rp),)
        kernels = choice.Kernels(fp8_linear="pallas", interpret=True, mesh=mesh)
        fn = jax.jit(functools.partial(call, kernels))
        real = choice.Kernels(fp8_linear="pallas", interpret=False, mesh=mesh)
        choice._fp8_linears_kernel = kernel  # the real kernel, per device, lowered for CUDA
        text = jax.jit(functools.partial(call, real)).trace(xs, placed).lower(
            lowering_platforms=("cuda",)).as_text()
        choice._fp8_linears_kernel = reference
        shapes.clear()
        got = fn(xs, placed)
        got, one = ([np.asarray(a, np.float32) for a in arrays] for arrays in (got, one))
        out[name] = {"rel_error": max(float(np.abs(g - o).max() / np.abs(o).max())
                                      for g, o in zip(got, one)),
                     "collectives": collectives(fn.lower(xs, placed).compile().as_text()),
                     "local_shapes": shapes[:1],
                     "cuda_lowering": {"mosaic_kernels": len(re.findall(
                                           r"custom_call @mosaic_gpu", text)),
                                       "all_reduces": text.count("stablehlo.all_reduce")}}
    choice._fp8_linears_kernel = kernel
    return out


def fp8_layout_problems(params, mesh) -> list[str]:
    """Each FP8 weight whose values or scales are not split as its spec says, or whose device
    shard's scales are not the blocks of its shard of the values."""
    from jaxdecode.params import params_to_flat
    bad = []
    for name, x in params_to_flat(params).items():
        if not isinstance(x, jd.Fp8Linear):
            continue
        want = jax.sharding.NamedSharding(mesh, sharding.param_partition_spec(name))
        w_shard = x.weight.addressable_shards[0].data.shape
        s_shard = x.scale_inv.addressable_shards[0].data.shape
        blocks = (*w_shard[:-2], *(-(-n // b) for n, b in zip(w_shard[-2:], x.block_size)))
        if (not x.weight.sharding.is_equivalent_to(want, x.weight.ndim)
                or not x.scale_inv.sharding.is_equivalent_to(want, x.scale_inv.ndim)
                or s_shard != blocks):
            bad.append(f"{name}: {x.weight.sharding.spec} {w_shard}, scales "
                       f"{x.scale_inv.sharding.spec} {s_shard}")
    return bad


def shard_bytes(params, mesh) -> list[int]:
    """[sharding.params_shard_bytes (load_checkpoint's and init_params_sharded's memory check),
    the bytes the first device of ``mesh`` holds of ``params``]: the FP8 leaves and block as
    ``params`` holds them."""
    from jaxdecode import quantization
    from jaxdecode.params import params_to_flat
    flat = params_to_flat(params)
    fp8 = {name for name, x in flat.items() if isinstance(x, jd.Fp8Linear)}
    block = next((flat[name].block_size for name in fp8), quantization.DEFAULT_BLOCK)
    first = mesh.devices.flat[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
               if s.device == first)
    return [sharding.params_shard_bytes(params.config, mesh, params.embed_tokens.dtype, fp8,
                                        block), int(held)]


def trees_equal(a, b) -> bool:
    """Same leaves (FP8 ones compared bitwise), same structure."""
    def bits(x):
        x = np.asarray(x)
        return x.view(np.uint8) if x.dtype.itemsize == 1 else x
    return all(np.array_equal(bits(x), bits(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def error_of(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def check_init_params_sharded(params, key) -> dict:
    """sharding.init_params_sharded on (1, 8): the values of shard_params(init_params) (relative
    to each leaf's scale; init_params' values are eager, these jitted), its config and layout."""
    mesh = sharding.make_mesh(1, 8)
    got = sharding.init_params_sharded(params.config, mesh, key)
    want = sharding.shard_params(params, mesh)
    errors = [float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    return {"worst_rel_error": max(errors), "config_equal": got.config == want.config,
            "mismatches": spec_mismatches(got, sharding.param_partition_specs(got.config), mesh)}


def check_repeated_kv_checkpoint(params) -> dict:
    """load_checkpoint(mesh=(1, 8)) of ``params`` saved as published (2 KV heads): the same
    arrays and config as shard_params."""
    import tempfile

    from safetensors.numpy import save_file

    from jaxdecode.params import params_to_hf
    mesh = sharding.make_mesh(1, 8)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(params.config.to_hf_config(), f)
        hf = {k: np.asarray(v) for k, v in params_to_hf(params).items()}
        save_file(hf, os.path.join(tmp, "model.safetensors"))
        loaded = jd.load_checkpoint(tmp, "float32", mesh=mesh, mtp=True)
    want = sharding.shard_params(params, mesh)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True))
    return {"config_equal": loaded.config == want.config,
            "stored_k_rows": int(hf["model.layers.3.self_attn.k_proj.weight"].shape[0]),
            "loaded_k_rows": int(loaded.layers[3].self_attn.k_proj.shape[0]),
            "values_equal": same, "shard_bytes": shard_bytes(loaded, mesh),
            "mismatches": spec_mismatches(loaded, sharding.param_partition_specs(loaded.config),
                                          mesh)}


def check_chunked_prefill(params) -> dict:
    """jd.prefill in 64-token continuations on a (2, 4) mesh == one call on one device (last
    logits, relative to their scale), the state in its layout after every chunk."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CONFIG.vocab_size, (BATCH, 200)).astype(np.int32)
    lengths = np.array([200, 64, 1, 130, 199, 65, 0, 100], np.int32)
    want, _ = jd.prefill(params, jd.init_state(CONFIG, BATCH, 256), tokens, lengths)
    mesh = sharding.make_mesh(2, 4)
    sp = sharding.shard_params(params, mesh)
    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, 256)
    got, state = jd.prefill(sp, state, tokens, lengths, prefill_chunk_size=64)
    want = np.asarray(want)
    return {"rel_error": float(np.abs(np.asarray(got) - want).max() / np.abs(want).max()),
            "state_mismatches": spec_mismatches(state, sharding.state_partition_specs(CONFIG),
                                                mesh),
            "lengths": np.asarray(state.lengths).tolist()}


def check_generate(params) -> dict:
    """jd.generate on a (4, 2) mesh: the state it creates inside its jit is laid out (rows over
    "data", in the compiled loop too), its tokens equal one device's, and decode_step continues
    its returned state in place; 3 rows (not dividing "data" = 4) stay whole on each data group,
    continue through generate(state=), and decode_step refuses them by name."""
    mesh = sharding.make_mesh(4, 2)
    sp = sharding.shard_params(params, mesh)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    out, res = {}, {}
    for rows in (BATCH, 3):
        want = jd.generate(params, prompts[:rows], max_new_tokens=6, return_state=True)
        got = jd.generate(sp, prompts[:rows], max_new_tokens=6, return_state=True)
        res = {"tokens_equal": bool(np.array_equal(got.tokens, want.tokens))}
        if rows == BATCH:
            res["mismatches"] = spec_mismatches(got.state, sharding.state_partition_specs(CONFIG),
                                                mesh)
            # kernels without a mesh (XLA's forms) run on the params' mesh, the state laid out
            res["xla_kernels_mismatches"] = spec_mismatches(jd.generate(
                sp, prompts[:rows], max_new_tokens=2, kernels=jd.Kernels(),
                return_state=True).state, sharding.state_partition_specs(CONFIG), mesh)
            hlo = generation.precompile(sp, prompts, max_new_tokens=6).by_signature[0][1].as_text()
            k = got.state.kv_cache[0].k  # a whole cache's and one device's shard's shape
            res["cache_shapes_in_hlo"] = {
                what: len(re.findall(re.escape("f32[" + ",".join(map(str, shape)) + "]"), hlo))
                for what, shape in (("global", k.shape),
                                    ("shard", k.addressable_shards[0].data.shape))}
            # a key committed to one device (a user's device_put) samples as the same key
            sampling, key = jd.SamplingParams.create(rows, temperature=0.9), jax.random.key(7)
            res["committed_key_equal"] = bool(np.array_equal(*(
                jd.generate(sp, prompts, max_new_tokens=4, sampling=sampling, key=k).tokens
                for k in (jax.device_put(key, jax.devices()[5]), key))))
            # ... and with params committed to one device, another than the key's
            res["committed_key_one_device_equal"] = bool(np.array_equal(*(
                jd.generate(p, prompts, max_new_tokens=4, sampling=sampling, key=k).tokens
                for p, k in ((jax.device_put(params, jax.devices()[3]),
                              jax.device_put(key, jax.devices()[5])), (params, key)))))
            old = jax.tree.leaves(got.state)
            jd.decode_step(sp, got.state, np.zeros(rows, np.int32))
            res["decode_step_donated"] = all(x.is_deleted() for x in old)
        else:
            res["spec"] = list(got.state.kv_cache[0].k.sharding.spec)
            more = [[int(t)] for t in rng.integers(0, CONFIG.vocab_size, rows)]
            res["continued_equal"] = bool(np.array_equal(
                jd.generate(sp, more, max_new_tokens=4, state=got.state).tokens,
                jd.generate(params, more, max_new_tokens=4, state=want.state).tokens))
            try:
                jd.decode_step(sp, jd.generate(sp, prompts[:rows], max_new_tokens=2,
                                               return_state=True).state, np.zeros(rows, np.int32))
                res["decode_step_error"] = None
            except ValueError as e:
                res["decode_step_error"] = str(e)
        out[rows] = res
    return out


def check_score(params) -> dict:
    """jd.score (both modes) with params on a (4, 2) mesh against one device, 8 rows (split over
    "data") and 3 (whole on each data group): relative error of the log-probabilities, and the
    returned state's layout for 8 rows."""
    mesh = sharding.make_mesh(4, 2)
    sp = sharding.shard_params(params, mesh)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS + 1]
    conts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (PROMPT_LENGTHS % 5) + 1]
    out = {}
    for mode in ("chunked", "recurrent"):
        for rows in (BATCH, 3):
            want = jd.score(params, prompts[:rows], conts[:rows], mode=mode)
            got = jd.score(sp, prompts[:rows], conts[:rows], mode=mode, return_state=True)
            want_lp = np.asarray(want.logprobs)
            out[f"{mode},{rows}"] = {
                "rel_error": float(np.abs(np.asarray(got.logprobs) - want_lp).max()
                                   / np.abs(want_lp).max()),
                "num_tokens_equal": bool(np.array_equal(got.num_tokens, want.num_tokens)),
                "mismatches": spec_mismatches(got.state, sharding.state_partition_specs(CONFIG),
                                              mesh) if rows == BATCH else None,
                "cache_spec": list(got.state.kv_cache[0].k.sharding.spec)}
    return out


def check_pallas_rows_not_dividing_data(params) -> dict:
    """Hopper's Pallas choices on a (4, 2) mesh for rows that do not divide "data" (3 prompts;
    1 prompt x 4 samples, whose prefill has 1 row): each kernel under shard_map with the rows
    whole on every data group. Greedy generate with the Pallas calls replaced by their XLA
    references (the Mosaic GPU interpreter does not run under a multi-device shard_map) gives
    one device's tokens; the real kernels' decode step, prefill and speculative verify step of
    3 rows lower for CUDA (bf16, shapes the kernels take)."""
    from jaxdecode.kernels import choice
    from jaxdecode.kernels import chunk_gated_delta as ck
    from jaxdecode.kernels import decode_attention as ak
    from jaxdecode.kernels import gated_delta_decode as dk
    from jaxdecode.kernels import prefill_attention as pk
    mesh = sharding.make_mesh(4, 2)
    fields = dict(attention="pallas", prefill_attention="pallas", delta_rule="pallas",
                  prefill_delta_rule="pallas")
    references = {
        "_attention_pallas": lambda q, k, v, n, **_: ak.decode_attention_reference(q, k, v, n),
        "_prefill_attention_pallas": lambda *a, **_: pk.prefill_attention_reference(*a),
        "_delta_rule_pallas": lambda *a, **_: dk.gated_delta_decode_reference(*a),
        "_prefill_delta_rule_pallas": lambda *a, **_: ck.chunk_gated_delta_rule_reference(*a)}
    saved = {name: getattr(choice, name) for name in references}
    sp = sharding.shard_params(params, mesh)
    rng = np.random.default_rng(4)
    out = {}
    try:
        for name, fn in references.items():
            setattr(choice, name, fn)
        kernels = choice.Kernels(**fields, mesh=mesh, interpret=True)
        for case, rows, samples in (("3 prompts", 3, 1), ("1 prompt x 4", 1, 4)):
            prompts = [rng.integers(0, CONFIG.vocab_size, 5 + r).tolist() for r in range(rows)]
            want = jd.generate(params, prompts, 6, num_samples=samples)
            got = jd.generate(sp, prompts, 6, num_samples=samples, kernels=kernels)
            out[case] = bool(np.array_equal(got.tokens, want.tokens))
    finally:
        for name, fn in saved.items():
            setattr(choice, name, fn)
    supported = tiny(head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128)
    sp = sharding.shard_params(jd.init_params(supported, jax.random.key(2), "bfloat16"), mesh)
    state = jax.jit(lambda s: sharding.constrain_state(s, mesh))(
        jd.init_state(supported, 3, 256, "bfloat16"))
    real = choice.Kernels(**fields, verify_attention="pallas", verify_delta_rule="pallas",
                          mesh=mesh, interpret=False)
    calls = {"decode_step": (functools.partial(model.decode_step_fn, kernels=real),
                             (sp, state, jnp.zeros(3, jnp.int32), None)),
             "prefill": (functools.partial(model.prefill_fn, kernels=real),
                         (sp, state, jnp.zeros((3, 128), jnp.int32), jnp.full(3, 128))),
             "verify": (functools.partial(model.verify_fn, kernels=real),  # speculative's
                        (sp, state, jnp.zeros((3, 4), jnp.int32), jnp.full(3, 4)))}
    for name, (fn, args) in calls.items():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        out[f"{name}_mosaic_kernels"] = text.count("mosaic_gpu")
    return out


def check_speculative() -> dict:
    """Greedy speculative generate (k = 2, the MTP layer drafting) with params on a (4, 2) mesh,
    8 rows (split over "data") and 3 (whole on each data group): one device's speculative
    tokens, which are plain greedy decoding's; its returned state (in the state layout for 8
    rows) continued by another speculative call gives plain greedy's continuation."""
    config = dataclasses.replace(CONFIG, mtp_num_hidden_layers=1)
    params = jd.init_params(config, jax.random.key(12))
    mesh = sharding.make_mesh(4, 2)
    sp = sharding.shard_params(params, mesh)
    rng = np.random.default_rng(5)
    out = {}
    for rows in (BATCH, 3):
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENGTHS[:rows]]
        plain = jd.generate(params, prompts, 8).tokens
        one = jd.generate(params, prompts, 8, num_speculative_tokens=2).tokens
        got = jd.generate(sp, prompts, 8, num_speculative_tokens=2).tokens
        out[rows] = {"one_device": bool(np.array_equal(got, one)),
                     "plain": bool(np.array_equal(got, plain))}
        first = jd.generate(sp, prompts, 8, num_speculative_tokens=2, return_state=True,
                            max_len=MAX_LEN)
        want = jd.generate(params, prompts, 8, return_state=True, max_len=MAX_LEN)
        more = [[int(t)] for t in rng.integers(0, config.vocab_size, rows)]
        got = jd.generate(sp, more, 5, state=first.state, num_speculative_tokens=2)
        out[rows]["continued"] = bool(np.array_equal(
            got.tokens, jd.generate(params, more, 5, state=want.state).tokens))
        if rows == BATCH:
            out[rows]["state_mismatches"] = spec_mismatches(
                got.state, sharding.state_partition_specs(config, mtp=True), mesh)
    # A state keeping MTP pairs through jd.prefill and jd.decode_step on the mesh: one device's
    # pairs, in the state layout.
    tokens = np.asarray(rng.integers(0, config.vocab_size, (BATCH, 12)), np.int32)
    lengths = np.asarray([12, 5, 9, 1, 12, 7, 3, 10], np.int32)
    states = []
    for p, state in ((params, jd.init_state(config, BATCH, MAX_LEN, mtp=True)),
                     (sp, sharding.init_state_sharded(sp.config, mesh, BATCH, MAX_LEN, mtp=True))):
        _, state = jd.prefill(p, state, tokens, lengths)
        _, state = jd.decode_step(p, state, tokens[:, 0])
        states.append(state)
    want, got = states
    out["pairs"] = {
        "error": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                     for a, b in ((got.mtp.kv.k, want.mtp.kv.k), (got.mtp.kv.v, want.mtp.kv.v),
                                  (got.mtp.hidden, want.mtp.hidden))),
        "scale": float(np.abs(np.asarray(want.mtp.kv.k)).max()),
        "mismatches": spec_mismatches(got, sharding.state_partition_specs(sp.config, mtp=True),
                                      mesh)}
    return out


def check_errors(params) -> dict:
    """Messages of the errors users get for meshes that do not fit."""
    msgs = {}
    small = dataclasses.replace(CONFIG, num_key_value_heads=2, linear_num_key_heads=4)
    for name, call in {
        "heads": lambda: sharding.init_state_sharded(small, sharding.make_mesh(1, 8), 8, 16),
        "batch": lambda: sharding.init_state_sharded(CONFIG, sharding.make_mesh(4, 2), 6, 16),
        "shard_params": lambda: sharding.shard_params(jd.init_params(small, jax.random.key(0)),
                                                      sharding.make_mesh(1, 8)),
        "devices": lambda: sharding.make_mesh(3, 4),
        "fewer_devices": lambda: sharding.make_mesh(1, 2),
        "experts": lambda: sharding.check_mesh(
            dataclasses.replace(MOE_CONFIG, num_experts=12), sharding.make_mesh(1, 8)),
        "explicit_mesh": lambda: sharding.check_mesh(CONFIG, jax.make_mesh((2, 4),
                                                                           ("data", "model"))),
    }.items():
        try:
            call()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def check_checkpoint(params, config=CONFIG) -> dict:
    """load_checkpoint(mesh=...) puts every tensor in its sharding with the stored values."""
    import tempfile

    from safetensors.numpy import save_file

    from jaxdecode.params import params_to_hf
    mesh = sharding.make_mesh(2, 4)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config.to_hf_config(), f)
        save_file({k: np.asarray(v) for k, v in params_to_hf(params).items()},
                  os.path.join(tmp, "model.safetensors"))
        loaded = jd.load_checkpoint(tmp, "float32", mesh=mesh)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))
    return {"mismatches": spec_mismatches(loaded, sharding.param_partition_specs(config), mesh),
            "values_equal": same}


def check_moe() -> dict:
    """The MoE model expert-parallel on each mesh against one device: greedy prefill + decode
    logits (relative to their scale), param layouts, the decode step's collectives and the
    bytes of expert weights one device holds; load_checkpoint into the shardings."""
    params = jd.init_params(MOE_CONFIG, jax.random.key(1))
    tokens = np.random.default_rng(2).integers(0, MOE_CONFIG.vocab_size, (BATCH, 12))
    ref_logits, ref_tokens, _ = greedy(params, jd.init_state(MOE_CONFIG, BATCH, MAX_LEN),
                                       tokens, jd.prefill, jd.decode_step)
    scale = max(float(np.abs(np.asarray(x)).max()) for x in ref_logits)
    out = {"meshes": {}, "checkpoint": check_checkpoint(params, MOE_CONFIG)}
    for shape in MESHES:
        mesh = sharding.make_mesh(*shape)
        sp, state, errors, hlo = sharded_greedy(params, mesh, tokens, ref_logits, ref_tokens,
                                                scale)
        experts = sp.layers[0].mlp.experts_gate_up_proj
        out["meshes"][f"{shape[0]},{shape[1]}"] = {
            "rel_errors": errors,
            "param_mismatches": spec_mismatches(sp, sharding.param_partition_specs(MOE_CONFIG),
                                                mesh),
            "collectives": collectives(hlo),
            "conditionals": len(re.findall(r"\sconditional\(", hlo)),
            "expert_fraction_per_device":
                experts.addressable_shards[0].data.size / experts.size,
            "shard_bytes": shard_bytes(sp, mesh)}
    return out


def check_unpinned(params, tokens) -> list[str]:
    """Whether a user's jax.jit of model.decode_step_fn (no out_shardings) also keeps the state
    layout."""
    mesh = sharding.make_mesh(2, 4)
    sp = sharding.shard_params(params, mesh)
    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
    _, state = jd.prefill(sp, state, tokens, PROMPT_LENGTHS)
    unpinned = jax.jit(functools.partial(model.decode_step_fn, kernels=mesh_kernels(mesh)),
                       donate_argnums=1)
    _, state = unpinned(sp, state, sharding.shard_batch(tokens[:, 0], mesh), None)
    return spec_mismatches(state, sharding.state_partition_specs(CONFIG), mesh)


def check_public_decode_step_routes(params, tokens) -> dict:
    """jaxdecode.decode_step on a sharded state runs step.jit_decode_step with the mesh's kernels
    (per-device attention, pinned layout) and gives that jitted step's logits."""
    mesh = sharding.make_mesh(2, 4)
    sp = sharding.shard_params(params, mesh)
    kernels = mesh_kernels(mesh)
    out = {}

    def calls():
        info = step.jit_decode_step.cache_info()
        return info.hits + info.misses, info.misses

    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
    _, state = jd.prefill(sp, state, tokens, PROMPT_LENGTHS)
    twin = jax.tree.map(jnp.copy, state)
    twin_out = jax.tree.map(jnp.copy, state)
    step.jit_decode_step.cache_clear()  # so the entry jd.decode_step uses is built below
    before, _ = calls()
    logits, state = jd.decode_step(sp, state, tokens[:, 0])
    after, misses = calls()
    out["jit_decode_step_calls"] = after - before
    out["mesh_kernels"] = kernels.mesh == mesh
    step.jit_decode_step(CONFIG, kernels)  # a hit iff jd.decode_step built this entry
    out["built_for_the_mesh_kernels"] = calls()[1] == misses
    out["mismatches"] = spec_mismatches(state, sharding.state_partition_specs(CONFIG), mesh)
    direct, _ = step.jit_decode_step(CONFIG, kernels)(
        sp, twin, sharding.shard_batch(tokens[:, 0], mesh, jnp.int32), None)
    out["logits_equal"] = bool(np.array_equal(np.asarray(logits), np.asarray(direct)))
    buf = jnp.copy(logits)  # the logits' sharding
    via_out, _ = jd.decode_step(sp, twin_out, tokens[:, 0], out=buf)
    out["out_equal_and_donated"] = bool(np.array_equal(np.asarray(via_out), np.asarray(logits))
                                        and buf.is_deleted())
    try:
        jd.decode_step(sp, state, tokens[:, 0],
                       out=jax.device_put(np.zeros(logits.shape, np.float32), jax.devices()[0]))
        out["out_on_one_device_error"] = None
    except ValueError as e:
        out["out_on_one_device_error"] = str(e)
    errors = []
    state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
    other = sharding.shard_params(params, sharding.make_mesh(1, 8))
    for wrong in (params, other):  # one device; another mesh
        try:
            jd.decode_step(wrong, state, tokens[:, 0])
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out["wrong_params_errors"] = errors
    return out


def run_process(process_id: int, port: int) -> dict:
    """Process ``process_id`` of 2. jax.distributed is initialized here, after importing
    jaxdecode (and conftest) as a user's script would: the import must not start the backend."""
    from jax.experimental import multihost_utils
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30,
                               shutdown_timeout_seconds=30)
    params, tokens = inputs()
    out = {"process_index": jax.process_index(), "num_devices": jax.device_count(), "tokens": {}}
    for shape in PROCESS_MESHES:
        mesh = sharding.make_mesh(*shape)
        sp = sharding.shard_params(params, mesh)
        state = sharding.init_state_sharded(CONFIG, mesh, BATCH, MAX_LEN)
        _, toks, state = greedy(sp, state, tokens, jd.prefill, jd.decode_step)
        gathered = [multihost_utils.process_allgather(t, tiled=True) for t in toks]
        out["tokens"][f"{shape[0]},{shape[1]}"] = np.stack(gathered).tolist()
    out["sample"] = sample_global_arrays()
    jax.distributed.shutdown()
    return out


def sample_global_arrays() -> dict:
    """Eager ``jd.sample`` on logits and per-row sampling values sharded over both processes
    (no process can read them whole) and on the same values as local host arrays."""
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = sharding.make_mesh(4, 1)
    rows = NamedSharding(mesh, P(sharding.DATA))

    def global_array(x):
        return jax.make_array_from_callback(x.shape, rows, lambda index: x[index])

    logits = np.random.default_rng(1).normal(size=(BATCH, 64)).astype(np.float32)
    values = jd.SamplingParams.create(BATCH, temperature=0.8, top_p=0.9)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), BATCH))
    tokens = jd.sample(global_array(logits), global_array(np.asarray(keys)),
                       jax.tree.map(global_array, values))
    return {"global": multihost_utils.process_allgather(tokens, tiled=True).tolist(),
            "local": np.asarray(jd.sample(logits, keys, values)).tolist()}


if __name__ == "__main__":
    if MODE == "meshes":
        result = run_meshes()
    elif MODE == "process":
        result = run_process(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
    print("RESULT " + json.dumps(result), flush=True)
