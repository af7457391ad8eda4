"""jaxdecode.sharding: sharded decoding equals the single-device run, keeps its layout, donates,
and fails clearly.

The rest of the suite runs with one CPU device, and XLA's device count is fixed when jax is
imported, so the sharded runs happen in subprocesses (``tests/sharding_worker.py``: 8 virtual
CPU devices; two ``jax.distributed`` processes with 2 devices each on 127.0.0.1) and these tests
assert on what they report. The spec tables themselves are checked here, in-process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxdecode as jd
from conftest import TINY
from jaxdecode import sharding

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharding_worker.py"
MESHES = ("1,8", "2,4", "4,2", "8,1")
REL_TOL = 1e-5  # max |sharded - single device| / max |logit|, float32 "highest" matmuls


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def _result(stdout: str, stderr: str, what: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"{what} printed no RESULT line; stderr tail:\n{stderr[-3000:]}")


@pytest.fixture(scope="module")
def meshes():
    proc = subprocess.run([sys.executable, str(WORKER), "meshes"], capture_output=True,
                          text=True, timeout=900, env=_env())
    assert proc.returncode == 0, f"sharding_worker.py meshes failed:\n{proc.stderr[-3000:]}"
    return _result(proc.stdout, proc.stderr, "sharding_worker.py meshes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "process", str(i), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for i in range(2)]
    results = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"process {i} failed:\n{err[-3000:]}"
            results.append(_result(out, err, f"process {i}"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


# ----- in-process: the spec tables -------------------------------------------------------------

def test_specs_mirror_the_pytrees_and_match_leaf_ranks():
    config = TINY
    for tied in (True, False):
        c = dataclasses.replace(config, tie_word_embeddings=tied)
        shapes = jax.eval_shape(lambda c=c: jd.init_params(c, jax.random.key(0)))
        specs = sharding.param_partition_specs(c)
        assert jax.tree.structure(shapes) == jax.tree.structure(
            specs, is_leaf=lambda x: isinstance(x, P))
        for leaf, spec in zip(jax.tree.leaves(shapes),
                              jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            assert len(spec) <= leaf.ndim
    state = jax.eval_shape(lambda: jd.init_state(config, 2, 16))
    specs = sharding.state_partition_specs(config)
    assert jax.tree.structure(state) == jax.tree.structure(
        specs, is_leaf=lambda x: isinstance(x, P))
    assert specs.recurrent_state[0] == P("data", "model", None, None)
    assert specs.kv_cache[0].k == P("data", "model", None, None)
    assert specs.lengths == P("data")
    m = dataclasses.replace(config, mtp_num_hidden_layers=1)  # a state keeping MTP pairs
    state = jax.eval_shape(lambda: jd.init_state(m, 2, 16, mtp=True))
    specs = sharding.state_partition_specs(m, mtp=True)
    assert jax.tree.structure(state) == jax.tree.structure(
        specs, is_leaf=lambda x: isinstance(x, P))
    assert specs.mtp.kv.v == P("data", "model", None, None)
    assert specs.mtp.hidden == P("data", None)


def test_every_weight_but_the_norm_gains_is_split_over_model():
    for name in jd.param_specs(jd.Config.from_preset("qwen3.5-9b")):
        spec = sharding.param_partition_spec(name)
        replicated = "norm" in name or "layernorm" in name
        assert ("model" in spec) != replicated, (name, spec)


def test_one_device_mesh_runs_in_process():
    """jd.prefill / jd.decode_step on a state placed on a (1, 1) mesh run on that mesh (the
    mesh's kernels, outputs in the mesh layout) and refuse params that are not on it."""
    from jaxdecode import step
    config = TINY
    mesh = sharding.make_mesh(1, 1)
    plain = jd.init_params(config, jax.random.key(0))
    params = sharding.shard_params(plain, mesh)
    state = sharding.init_state_sharded(config, mesh, batch_size=1, max_len=16)
    assert sharding.mesh_of(state) == mesh and sharding.mesh_of(params) == mesh
    with pytest.raises(ValueError, match=r"params are on one device but the state is on mesh"):
        jd.prefill(plain, state, [[1, 2, 3]], [3])
    logits, state = jd.prefill(params, state, [[1, 2, 3]], [3])
    kernels = jd.choose_kernels(config, 1, dtype="float32", mesh=mesh)
    assert kernels.mesh == mesh
    calls = step.jit_decode_step.cache_info()
    logits, state = jd.decode_step(params, state, [4])
    assert step.jit_decode_step(config, kernels)._cache_size() >= 1
    assert step.jit_decode_step.cache_info().hits + step.jit_decode_step.cache_info().misses == (
        calls.hits + calls.misses + 2)
    assert logits.shape == (1, config.vocab_size)
    assert int(state.lengths[0]) == 4
    assert sharding.mesh_of(state) == mesh
    assert logits.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, sharding.logits_partition_spec()), 2)
    with pytest.raises(ValueError, match=r"params are on one device but the state is on mesh"):
        jd.decode_step(plain, state, [4])


def test_sharded_state_takes_init_states_dtype_names():
    """``init_state_sharded`` accepts the dtype spellings ``init_state`` does ("bf16", "fp32", a
    dtype) and refuses the same others."""
    mesh = sharding.make_mesh(1, 1)
    for name, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32),
                        (jnp.bfloat16, jnp.bfloat16), ("float32", jnp.float32)):
        state = sharding.init_state_sharded(TINY, mesh, 1, 16, name)
        assert state.kv_cache[0].k.dtype == dtype and state.conv_state[0].dtype == dtype
        assert state.recurrent_state[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="dtype="):
        sharding.init_state_sharded(TINY, mesh, 1, 16, "float16")


def test_mesh_of():
    config = TINY
    mesh = sharding.make_mesh(1, 1)
    assert sharding.mesh_of(jd.init_state(config, 1, 8)) is None  # one device
    assert sharding.mesh_of(sharding.init_state_sharded(config, mesh, 1, 8)) == mesh
    assert sharding.mesh_of(sharding.shard_batch([1], mesh)) == mesh
    other = jax.make_mesh((1,), ("x",))
    placed = jax.device_put(jax.numpy.zeros(2), jax.sharding.NamedSharding(other, P("x")))
    assert sharding.mesh_of(placed) is None  # another layout
    seen = []
    jax.jit(lambda s: seen.append(sharding.mesh_of(s)) or s.lengths)(
        sharding.init_state_sharded(config, mesh, 1, 8))
    assert seen == [None]  # traced: no mesh to read


# ----- 8 virtual devices: every mesh against one device ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_logits_equal_single_device(meshes, mesh):
    errors = meshes["meshes"][mesh]["rel_errors"]
    assert len(errors) == 9  # prefill + 8 decode steps
    assert max(errors) <= REL_TOL, f"mesh {mesh}: max relative error per call {errors}"


@pytest.mark.slow
def test_chunked_prefill_on_a_mesh_equals_one_call_on_one_device(meshes):
    """jd.prefill(prefill_chunk_size=64) on a sharded state: [B, 64] continuations on the mesh,
    the same logits as one unchunked call on one device, the state kept in its layout."""
    res = meshes["chunked_prefill"]
    assert res["rel_error"] <= REL_TOL, res
    assert res["state_mismatches"] == []
    assert res["lengths"] == [200, 64, 1, 130, 199, 65, 0, 100]


@pytest.mark.slow
def test_generate_on_a_mesh_splits_rows_over_data(meshes):
    """jd.generate with sharded params lays out the state it creates (rows over "data": a
    device's loop holds its shard of the cache, never the whole) and equals one device; the
    returned state continues in place with decode_step; a PRNG key committed to one device
    samples as the same key uncommitted (params on the mesh, or committed to another device). Rows that do not divide "data" run whole
    on each data group, continue with generate(state=), and decode_step refuses them."""
    split, whole = meshes["generate"]["8"], meshes["generate"]["3"]
    assert split["tokens_equal"] and split["mismatches"] == [], split
    assert split["xla_kernels_mismatches"] == [], split
    shapes = split["cache_shapes_in_hlo"]
    assert shapes["global"] == 0 and shapes["shard"] > 0, shapes
    assert split["decode_step_donated"], split
    assert split["committed_key_equal"], split  # a key device_put to one device
    assert split["committed_key_one_device_equal"], split  # params on another one
    assert whole["tokens_equal"] and whole["continued_equal"], whole
    assert whole["spec"] == [None, "model"], whole
    assert "batch_size=3 must be divisible by the 'data' mesh axis size 4" in (
        whole["decode_step_error"] or ""), whole
    assert "generate(..., state=)" in whole["decode_step_error"]


@pytest.mark.slow
def test_pallas_kernels_take_rows_that_do_not_divide_data(meshes):
    """Hopper's kernel choices on a (4, 2) mesh with 3 rows, or 1 prompt's prefill before 4
    samples: each Pallas call under shard_map with the rows whole per data group (shard_map
    refuses a split it cannot make); greedy tokens of one device with the calls replaced by
    their references, and the real kernels lowered for CUDA."""
    res = meshes["pallas_uneven_rows"]
    assert res["3 prompts"] and res["1 prompt x 4"], res
    assert all(res[f"{call}_mosaic_kernels"] > 0 for call in ("decode_step", "prefill",
                                                               "verify")), res


@pytest.mark.slow
def test_speculative_generate_on_a_mesh_equals_one_device(meshes):
    """num_speculative_tokens=2 with params on a (4, 2) mesh, 8 rows and 3: one device's
    speculative tokens, plain greedy decoding's; the returned state, continued speculatively,
    gives plain greedy's continuation (and stays in the state layout); a state keeping MTP
    pairs, through jd.prefill and jd.decode_step on the mesh, holds one device's pairs in the
    state layout."""
    res = dict(meshes["speculative"])
    pairs = res.pop("pairs")
    assert res == {"8": {"one_device": True, "plain": True, "continued": True,
                         "state_mismatches": []},
                   "3": {"one_device": True, "plain": True, "continued": True}}, res
    assert pairs["scale"] > 0.1 and pairs["error"] <= REL_TOL * pairs["scale"], pairs
    assert pairs["mismatches"] == [], pairs


@pytest.mark.slow
def test_score_on_a_mesh_equals_one_device(meshes):
    """jd.score with sharded params, both modes, rows dividing "data" and not: the one-device
    log-probabilities; the state it returns in the state layout."""
    for case, res in meshes["score"].items():
        assert res["rel_error"] <= REL_TOL and res["num_tokens_equal"], (case, res)
        if case.endswith(",3"):  # 3 rows on 4 data groups: whole on each
            assert res["cache_spec"] == [None, "model"], (case, res)
        else:
            assert res["mismatches"] == [] and res["cache_spec"] == ["data", "model"], res
    assert sorted(meshes["score"]) == ["chunked,3", "chunked,8", "recurrent,3", "recurrent,8"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_shardings_are_the_specified_ones_before_and_after_each_step(meshes, mesh):
    res = meshes["meshes"][mesh]
    assert res["param_mismatches"] == []
    bad = {step: m for step, m in res["state_mismatches"].items() if m}
    assert not bad, f"mesh {mesh}: state leaves not in their specified sharding: {bad}"
    assert set(res["state_mismatches"]) == {"init", "prefill", *(f"decode{i}" for i in range(8))}
    assert res["logits_sharding_ok"]


@pytest.mark.slow
@pytest.mark.perf
@pytest.mark.parametrize("mesh", MESHES)
def test_donation_aliases_every_state_buffer(meshes, mesh):
    res = meshes["meshes"][mesh]
    assert res["unaliased_state_params"] == [], "state inputs missing from input_output_alias"
    assert all(res["donated"]), f"old state buffers still alive after steps: {res['donated']}"


@pytest.mark.slow
@pytest.mark.perf
def test_tensor_parallel_step_moves_activations_only(meshes):
    """Per decode step: one all-reduce per mixer and per MLP (+ the embedding lookup); no
    weight is ever gathered (every collective is on [B, ·] activations, see sharding.py)."""
    for mesh in ("1,8", "2,4", "4,2"):
        ops = meshes["meshes"][mesh]["collectives"]
        # The conv channels are grouped per key head and decode attention runs per device
        # (kernels.choice under shard_map), so nothing but these all-reduces moves.
        assert ops == {"all-reduce": 2 * 4 + 1}, (mesh, ops)
    assert meshes["meshes"]["8,1"]["collectives"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_moe_expert_parallel_equals_single_device(meshes, mesh):
    """An MoE model on each mesh: the routed experts split by expert over "model" (each device
    holds 1/m of them), the same greedy prefill + decode logits as one device, and per decode
    step only the all-reduces of the dense model (no weight, token or routing moves)."""
    res = meshes["moe"]["meshes"][mesh]
    assert max(res["rel_errors"]) <= REL_TOL, res["rel_errors"]
    assert res["param_mismatches"] == []
    model_size = int(mesh.split(",")[1])
    assert res["expert_fraction_per_device"] == 1 / model_size
    assert res["collectives"] == ({"all-reduce": 2 * 4 + 1} if model_size > 1 else {}), res
    # (4, 2): 2 rows x 3 pairs a device, 4 slots for the pairs of its 8 experts (a cond per
    # layer: experts.expert_parallel_capacity); the other meshes' slots would exceed the pairs
    # form's limit (E/m experts) and run the rounds form
    assert res["conditionals"] == (4 if mesh == "4,2" else 0), res


@pytest.mark.slow
def test_moe_checkpoint_loads_into_the_expert_shardings(meshes):
    assert meshes["moe"]["checkpoint"] == {"mismatches": [], "values_equal": True}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1,8", "2,4"])
def test_fewer_kv_heads_than_devices_repeats_them(meshes, mesh):
    """Qwen3.5-397B-A17B's shape shrunk (2 KV heads, top-10 MoE, MTP layer) on a "model" axis
    of 8 and 4: each device holds one repeated KV head, the logits equal one device's, and the
    step moves nothing but the dense model's all-reduces."""
    res = meshes["repeated_kv_heads"][mesh]
    model_size = int(mesh.split(",")[1])
    assert max(res["rel_errors"]) <= REL_TOL, res["rel_errors"]
    assert res["num_key_value_heads"] == model_size and res["kv_heads_per_device"] == 1
    assert res["param_mismatches"] == []
    assert res["collectives"] == {"all-reduce": 2 * 4 + 1}, res


def test_published_fp8_releases_split_into_whole_blocks():
    """The FP8 releases' 128 x 128 blocks split whole over 2, 4 and 8 "model" devices (the
    397B-A17B FP8 on 4 GPUs among them), but for a shared expert (or MLP) of 512 (3584) rows
    over 8: those weights named, with one warning, before any device work (the callers hold
    them in the model dtype)."""
    from jax.sharding import AbstractMesh

    from jaxdecode import quantization
    unsplit = {("qwen3.5-35b-a3b", 8): ("mlp.shared_expert.", 3 * 40, "(2048, 512)"),
               ("qwen3-next-80b-a3b", 8): ("mlp.shared_expert.", 3 * 48, "(2048, 512)"),
               ("qwen3.5-0.8b", 8): ("mlp.", 3 * 24, "mlp.down_proj.weight (1024, 3584)")}
    for preset in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
                   "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"):
        config = jd.Config.from_preset(preset)
        weights = {n: (spec.shape, (128, 128)) for n, spec in jd.param_specs(config).items()
                   if quantization.is_quantized_leaf(n)}
        for m in (2, 4, 8):
            mesh = AbstractMesh((1, m), ("data", "model"))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                names = sharding.unsplit_fp8(config, mesh, weights)
            if (preset, m) not in unsplit:
                assert not names and not caught, (preset, m, sorted(names)[:3])
                continue
            part, count, shown = unsplit[preset, m]
            assert len(names) == count and all(f".{part}" in n for n in names), (preset, m)
            assert len(caught) == 1 and shown in str(caught[0].message), (preset, m)
            assert (f"{count} of {len(weights)} FP8 weights cannot be split into whole scale "
                    f"blocks on each of 8 'model' devices and are held in the model dtype"
                    ) in str(caught[0].message)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1,8", "2,4"])
def test_fp8_weights_on_a_mesh_equal_one_device(meshes, mesh):
    """Block-FP8 params (the MoE model, 8 x 8 blocks) on a mesh: each weight split as its bf16
    spec with its block scales beside it (a device's scales are its own blocks'), the greedy
    logits of one device, and only the dense model's all-reduces (no weight gathered)."""
    res = meshes["fp8"][mesh]
    assert max(res["rel_errors"]) <= REL_TOL, res["rel_errors"]
    assert res["layout_problems"] == []
    assert res["collectives"] == {"all-reduce": 2 * 4 + 1}, res
    # param_shardings serves as a jit's in/out shardings for FP8 params (a pytree prefix)
    assert res["jit_param_shardings"] == [True, []], res
    # a prefill's 16-bit copy of FP8 weights per device: every FP8 weight split over "model"
    one_device, per_device = res["copy_bytes"]
    model = int(mesh.split(",")[1])
    assert per_device * model == one_device > 0, res


@pytest.mark.slow
def test_fp8_kv_heads_repeat_with_their_scales(meshes):
    """One-device FP8 params with 2 KV heads sharded onto 4 "model" devices: each head's rows and
    scale rows repeated (32 rows and 1 scale row a device), the one-device logits; a K/V weight
    in blocks taller than a head is held in the model dtype, with a warning naming it and
    head_dim."""
    res = meshes["fp8"]["repeated_kv"]
    assert max(res["rel_errors"]) <= REL_TOL, res["rel_errors"]
    assert res["num_key_value_heads"] == 4 and res["layout_problems"] == [], res
    assert res["k_rows_and_scale_rows_per_device"] == [32, 1], res
    assert res["init_sharded_head_rows_equal"], "K/V in 64-row blocks created in place"
    unsplit, warned = res["head_rows_unsplit"]
    assert unsplit == ["model.layers.3.self_attn.k_proj.weight"] and len(warned) == 1, res
    assert ("model.layers.3.self_attn.k_proj.weight (64, 64): its KV heads, repeated 2 times, "
            "have head_dim=32 rows, not whole 64-row blocks") in warned[0], res


@pytest.mark.slow
def test_fp8_kernel_runs_per_device_on_a_mesh(meshes):
    """choice.fp8_linear's kernel path on a (2, 4) mesh calls the kernel once per device on its
    shards (4 rows of x; 128 of the 512 weight rows, or 128 of the 512 columns with x's K) and
    gives XLA's one-device result: exactly (column-parallel), or within the bf16 rounding of the
    partial sums one all-reduce adds (row-parallel, as the partitioner's 16-bit dot). The real
    kernel's path lowers for CUDA on that mesh. Rows that do not divide "data" too; and
    ``choice.fp8_linears`` of two weights, one kernel for both."""
    res = meshes["fp8"]["kernel"]
    assert res["column"] == {"rel_error": 0.0, "collectives": {},
                             "local_shapes": [[[4, 512], [128, 512]]],
                             "cuda_lowering": {"mosaic_kernels": 1, "all_reduces": 0}}, res
    # two column-parallel weights of one x: one kernel per device for both
    assert res["column, two weights"] == {
        "rel_error": 0.0, "collectives": {}, "local_shapes": [[[4, 512], [128, 512], [256, 512]]],
        "cuda_lowering": {"mosaic_kernels": 1, "all_reduces": 0}}, res
    assert res["row"]["local_shapes"] == [[[4, 128], [128, 128]]], res
    assert res["row"]["cuda_lowering"] == {"mosaic_kernels": 1, "all_reduces": 1}, res
    assert res["row"]["collectives"] == {"all-reduce": 1}, res
    assert res["row"]["rel_error"] <= 1e-2, res
    # 3 rows (not dividing "data" = 2): all 3 on every device, the kernel still taking them
    assert res["column, 3 rows"]["local_shapes"] == [[[3, 512], [128, 512]]], res
    assert res["row, 3 rows"]["local_shapes"] == [[[3, 128], [128, 128]]], res
    assert res["column, 3 rows"]["rel_error"] == 0.0 and res["row, 3 rows"]["rel_error"] <= 1e-2
    assert all(res[c]["cuda_lowering"]["mosaic_kernels"] == 1 for c in ("column, 3 rows",
                                                                        "row, 3 rows")), res


@pytest.mark.slow
def test_fp8_checkpoint_and_sharded_init_land_in_their_shardings(meshes):
    """An FP8 release checkpoint loaded onto (1, 8) equals shard_params of the one-device load,
    bit for bit; init_params_sharded(quantize="fp8") equals quantising its unquantised values."""
    res = meshes["fp8"]
    for where in ("checkpoint", "init_sharded"):  # (shard_bytes: the test below)
        assert {**res[where], "shard_bytes": None} == {
            "values_equal": True, "layout_problems": [], "shard_bytes": None}, res[where]


@pytest.mark.slow
def test_shard_bytes_checked_before_loading_are_what_a_device_holds(meshes):
    """sharding.params_shard_bytes (the memory check of load_checkpoint(mesh=) and of
    init_params_sharded, before any weight is read or created) is the bytes the first device
    then holds: a checkpoint with its 2 KV heads repeated to 8, the MoE split by expert on each
    mesh, block FP8 split whole (a release checkpoint, init_params_sharded) and with weights
    held in float32 where their blocks do not split whole."""
    fp8 = meshes["fp8"]
    got = {"repeated_kv_checkpoint": meshes["repeated_kv_heads"]["checkpoint"]["shard_bytes"],
           **{f"moe {m}": res["shard_bytes"] for m, res in meshes["moe"]["meshes"].items()},
           "fp8_checkpoint": fp8["checkpoint"]["shard_bytes"],
           "fp8_init_sharded": fp8["init_sharded"]["shard_bytes"],
           "fp8_checkpoint_quantize_128": fp8["checkpoint_quantize_128"]["shard_bytes"],
           "fp8_unsplit_init_sharded": fp8["unsplit"]["init_sharded"]["shard_bytes"]}
    assert len(got) == 5 + len(MESHES), got
    assert all(predicted == held > 0 for predicted, held in got.values()), got


@pytest.mark.slow
def test_fp8_weights_that_do_not_split_into_whole_blocks_are_held_in_the_model_dtype(meshes):
    """A split that would cut a scale block (I_s = 40 over 8 devices in 8-blocks; the tiny
    shapes over 8 in 128-blocks) keeps those weights in the model dtype, with one warning naming
    them, dequantised (the FP8 model's values): shard_params (the greedy logits of the FP8
    model on one device), init_params_sharded and load_checkpoint(quantize="fp8", mesh=) (both
    equal to shard_params of the quantised model); every other weight stays FP8, split whole."""
    res = meshes["fp8"]["unsplit"]
    shared = sorted(f"model.layers.{i}.mlp.shared_expert.{p}_proj.weight"
                    for i in range(4) for p in ("down", "gate", "up"))
    for where in ("shard_params", "init_sharded"):
        got = res[where]
        assert got["held"] == shared and got["held_dtypes"] == ["float32"], got
        assert got["fp8"] > 0 and len(got["warnings"]) == 1, got
        assert got["warnings"][0].startswith(
            "jaxdecode: 12 of ") and "on each of 8 'model' devices" in got["warnings"][0], got
        assert ("model.layers.0.mlp.shared_expert.down_proj.weight (64, 40): axis 1 (40) is "
                "not a multiple of 8 x 8") in got["warnings"][0], got
    assert max(res["shard_params"]["rel_errors"]) <= REL_TOL, res["shard_params"]
    assert res["shard_params"]["layout_problems"] == []
    assert res["init_sharded"]["values_equal"] and res["init_sharded"]["layout_problems"] == []
    load = meshes["fp8"]["checkpoint_quantize_128"]
    # only q_proj (1024 rows: 8 x 128) and the 8 expert stacks (split by expert) stay FP8
    assert load["fp8"] == 9 and len(load["held"]) == 24 and load["values_equal"], load
    assert load["held_dtypes"] == ["float32"] and len(load["warnings"]) == 1, load
    assert load["warnings"][0].startswith("jaxdecode: 24 of 33 FP8 weights"), load
    assert ("in_proj_qkv.weight (384, 64): axis 0 (384) is not a multiple of 8 x 128"
            in load["warnings"][0]), load


@pytest.mark.slow
def test_params_initialised_in_their_shardings_equal_shard_params(meshes):
    """sharding.init_params_sharded (each device computes only its shard: how a benchmark gets
    397B-A17B onto 8 GPUs) gives shard_params(init_params)'s values, config and layout."""
    res = meshes["repeated_kv_heads"]["init_sharded"]
    assert res["worst_rel_error"] <= 1e-6, res
    assert res["config_equal"] and res["mismatches"] == [], res


@pytest.mark.slow
def test_checkpoint_with_fewer_kv_heads_than_devices_loads_repeated(meshes):
    """The published-layout checkpoint (2 KV heads) loaded onto 8 "model" devices: K/V rows
    repeated as it is read, the same arrays, config and layout as shard_params."""
    res = meshes["repeated_kv_heads"]["checkpoint"]
    assert res["stored_k_rows"] * 4 == res["loaded_k_rows"]
    assert res == {**res, "config_equal": True, "values_equal": True, "mismatches": []}


@pytest.mark.slow
def test_unpinned_jit_of_the_model_step_keeps_the_layout_too(meshes):
    """A user's own jax.jit of model.decode_step_fn (no out_shardings) also keeps the layout."""
    assert meshes["unpinned_decode_mismatches"] == []


@pytest.mark.slow
def test_public_decode_step_on_a_sharded_state_runs_on_its_mesh(meshes):
    """jd.decode_step on a sharded state runs step.jit_decode_step with choose_kernels(...,
    mesh=mesh) (its one builder call, the entry for those kernels), keeps the layout and gives
    that jitted step's logits."""
    result = dict(meshes["public_decode_step"])
    errors = result.pop("wrong_params_errors")
    out_error = result.pop("out_on_one_device_error")
    assert out_error and "out has sharding" in out_error, out_error  # out= on another layout
    assert result == {"jit_decode_step_calls": 1, "mesh_kernels": True,
                      "built_for_the_mesh_kernels": True, "mismatches": [],
                      "logits_equal": True, "out_equal_and_donated": True}
    # params on one device, or on another mesh, are refused by name (not moved every step)
    assert len(errors) == 2 and all(e and "params are on " in e and "but the state is on mesh" in e
                                    for e in errors), errors


@pytest.mark.slow
def test_new_weights_on_a_mesh_reuse_the_step_and_match_one_device(meshes):
    """Params updated in a jit (as an optimizer step) keep their shardings; prefill and
    decode_step with them compile nothing new and equal one device with the same weights."""
    res = meshes["new_weights"]
    assert res["param_mismatches"] == [] and res["new_executables"] == 0, res
    assert max(res["rel_errors"]) <= REL_TOL, res


@pytest.mark.slow
def test_load_checkpoint_places_each_tensor_in_its_sharding(meshes):
    assert meshes["checkpoint"] == {"mismatches": [], "values_equal": True}


@pytest.mark.slow
def test_errors_name_the_sizes(meshes):
    errors = meshes["errors"]
    assert "num_key_value_heads=2 must be divisible by the 'model' mesh axis size 8" in (
        errors["heads"])
    assert "linear_num_key_heads=4" in errors["heads"]
    assert "num_attention_heads" not in errors["heads"]  # 16 divides 8: only real problems
    assert "batch_size=6 must be divisible by the 'data' mesh axis size 4" in errors["batch"]
    assert "repeat the KV heads to 8: build the state from their params.config" in (
        errors["heads"])  # a config the params' KV heads were repeated from
    # shard_params repeats the 2 KV heads to 8 itself: only the linear heads are left to name
    assert "linear_num_key_heads=4 must be divisible by the 'model' mesh axis size 8" in (
        errors["shard_params"]) and "num_key_value_heads" not in errors["shard_params"]
    assert "data=3 x model=4 = 12 devices, but 8 are available" in errors["devices"]
    assert ("data=1 x model=2 = 2 devices, but 8 are available (cpu); pass "
            "devices=jax.devices()[:2]") in errors["fewer_devices"]
    assert "AxisType.Auto" in errors["explicit_mesh"]
    assert "num_experts=12 must be divisible by the 'model' mesh axis size 8" in (
        errors["experts"])


# ----- two processes (jax.distributed on 127.0.0.1) -------------------------------------------

@pytest.mark.slow
def test_two_processes_give_the_single_process_greedy_tokens(meshes, two_processes):
    want = meshes["greedy_tokens"]
    assert sorted(r["process_index"] for r in two_processes) == [0, 1]
    for r in two_processes:
        assert r["num_devices"] == 4
        for mesh, tokens in r["tokens"].items():
            assert tokens == want, f"process {r['process_index']}, mesh {mesh}"


@pytest.mark.slow
def test_eager_sample_on_arrays_spanning_both_processes(two_processes):
    """jd.sample on global arrays no process can read whole (its host-side features check must
    not fetch them) draws the tokens of the same values as local arrays."""
    for r in two_processes:
        assert r["sample"]["global"] == r["sample"]["local"], f"process {r['process_index']}"


def test_importing_jaxdecode_leaves_the_backend_uninitialized():
    code = ("import jaxdecode\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized(), 'initialized by the import'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_example_runs_and_matches_one_device():
    proc = subprocess.run(
        [sys.executable, str(HERE.parent / "examples" / "sharded.py"), "--mesh", "2,4",
         "--max-new-tokens", "3", "--prompt-len", "5", "--check"],
        capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: sharded tokens == single-device tokens" in proc.stdout


@pytest.mark.slow
def test_example_checks_a_checkpoint_with_fewer_kv_heads_than_the_model_axis(tmp_path):
    """--check compares with the checkpoint on one device (its own 2 KV heads), not the mesh's
    config (KV heads repeated to 4)."""
    from test_checkpoint import write_checkpoint
    config = dataclasses.replace(TINY, linear_num_key_heads=4, linear_num_value_heads=8)
    assert config.num_key_value_heads == 2
    path = write_checkpoint(tmp_path / "ck", jd.init_params(config, jax.random.key(3)))
    proc = subprocess.run(
        [sys.executable, str(HERE.parent / "examples" / "sharded.py"), "--mesh", "1,4",
         "--checkpoint", str(path), "--max-new-tokens", "3", "--prompt-len", "5", "--check"],
        capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: sharded tokens == single-device tokens" in proc.stdout


def test_example_reports_bad_mesh_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(HERE.parent / "examples" / "sharded.py"), "--mesh", "3,3"],
        capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "num_key_value_heads=8 must be divisible by the 'model' mesh axis size 3" in proc.stderr


def _fake_mesh(data: int, model: int) -> Mesh:
    """A mesh of the one CPU device repeated: enough for config_on, which reads its shape."""
    devices = np.array([jax.devices()[0]] * (data * model), dtype=object).reshape(data, model)
    return Mesh(devices, sharding.AXIS_NAMES, axis_types=(AxisType.Auto, AxisType.Auto))


def test_repeated_kv_heads_are_the_same_model():
    """config_on repeats the KV heads only where the "model" size is a multiple of them that
    divides the query heads; the repeated weights give the original model's logits (one device,
    float32: the same products, so equal to rounding)."""
    from jaxdecode.params import params_from_flat, params_to_flat
    c = dataclasses.replace(TINY, num_attention_heads=8, num_key_value_heads=2)
    on = sharding.config_on(c, _fake_mesh(1, 8))
    assert on == dataclasses.replace(c, num_key_value_heads=8)
    assert sharding.config_on(c, _fake_mesh(4, 2)) is c  # 2 heads split 2 ways: no repeat
    assert sharding.config_on(c, _fake_mesh(1, 3)) is c  # not a multiple: check_mesh refuses
    four = dataclasses.replace(c, num_attention_heads=4)  # 4 query heads cannot split 8 ways
    assert sharding.config_on(four, _fake_mesh(1, 8)) is four
    params = jd.init_params(c, jax.random.key(5))
    flat = params_to_flat(params)
    repeated = {n: sharding.repeat_kv_heads(n, x, c, on) for n, x in flat.items()}
    k = "model.layers.3.self_attn.k_proj.weight"
    assert repeated[k].shape == (8 * c.head_dim, c.hidden_size)
    np.testing.assert_array_equal(np.asarray(repeated[k][c.head_dim:2 * c.head_dim]),
                                  np.asarray(flat[k][:c.head_dim]))  # head 1 = head 0's copy
    tokens = np.random.default_rng(5).integers(0, c.vocab_size, (2, 7)).astype(np.int32)
    lengths = np.array([7, 4], np.int32)
    want, _ = jd.prefill(params, jd.init_state(c, 2, 16), tokens, lengths)
    got, _ = jd.prefill(params_from_flat(on, repeated), jd.init_state(on, 2, 16), tokens,
                        lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * float(np.abs(np.asarray(want)).max()))
    with pytest.raises(ValueError, match="repeat the KV heads to 8"):
        sharding.check_mesh(c, _fake_mesh(1, 8))


def test_shard_state_names_the_leaf_that_does_not_split():
    """A state built from the original config (2 KV heads) for a "model" axis of 4, where
    shard_params repeated the KV heads: a ValueError naming the cache leaf and the hint, before
    any placement (a raw IndivisibleError from JAX before)."""
    c = dataclasses.replace(TINY, num_attention_heads=8, num_key_value_heads=2)
    state = jd.init_state(c, 4, 16)
    with pytest.raises(ValueError, match=r"state\.kv_cache\[0\]\.k has shape \(4, 2, 16, 32\): "
                                         r"its axis 1 \(2\) must be divisible by the 'model' "
                                         r"mesh axis size 4 \(and 1 more leaves\); params "
                                         r"sharded on this mesh repeat the KV heads"):
        sharding.shard_state(state, _fake_mesh(1, 4))
