"""Tensor and data parallelism over a ``("data", "model")`` mesh, as data.

The model code never mentions devices: this module gives ``PartitionSpec`` pytrees shaped like
``Params`` and ``DecodeState``, and ``jax.jit``'s SPMD partitioner inserts every collective.

    mesh = sharding.make_mesh(data=2, model=4)
    params = jd.load_checkpoint(path, "bfloat16", mesh=mesh)     # or sharding.shard_params(p, mesh)
    state = sharding.init_state_sharded(params.config, mesh, batch_size=8, max_len=4096)
    logits, state = jd.prefill(params, state, tokens, num_new)     # runs on the state's mesh
    logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1))

Layout (:data:`PARAM_RULES`, :data:`STATE_RULES`): every weight split over ``"model"`` but the
replicated RMSNorm gains (and an MoE router), state rows over ``"data"``, logits [B, V]
``(data, model)``. Megatron pattern (column-parallel in-, row-parallel out-projections): no
weight moves, and each mixer and MLP ends with one all-reduce of its [B, T, H] update
(tests/test_sharding.py counts them). MoE layers: the routed experts split over ``"model"`` by
expert (expert parallelism), the shared expert as a dense MLP. Block-FP8 weights
(``Fp8Linear``) split as their 16-bit form with their block scales beside them, where every
device gets whole scale blocks (elsewhere held in the model dtype: :func:`unsplit_fp8`); a
decode step's FP8 Linears run their kernel per device (``kernels.choice.fp8_linear``).
``q_proj``'s per-head ``[Hq, 2D]`` rows and the per-key-head conv channels
(``params.conv_channel_order``) make contiguous blocks whole heads. The Pallas kernels run under
``shard_map`` (the partitioner cannot split a custom call); the per-row cache write moves no K/V
row across ``"data"``. :func:`check_mesh`: head counts, ``intermediate_size`` and ``vocab_size``
divisible by the ``"model"`` size (published models: up to 8-way), the batch by the ``"data"``
size. Fewer KV heads than ``"model"`` devices (Qwen3.5's 2 or 4 on 8):
:func:`shard_params` and ``load_checkpoint(..., mesh=mesh)`` repeat each KV head so every device
holds the one its query heads read (:func:`config_on`; vLLM's replicated KV heads).

Several hosts: every process runs the same script, calls ``jax.distributed.initialize`` first,
builds the mesh from the global device list (:func:`make_mesh` keeps ``"model"`` in a host) and
passes the same global host inputs; :func:`shard_batch` keeps each process's shards.

Source: Megatron-LM tensor parallelism (Shoeybi et al., 2019) as in gpt-fast's ``tp.py``; JAX's
"Distributed arrays and automatic parallelization" and "Multi-process" guides.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # imported once: jax.core's module getattr is slow per lookup
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode import memory, quantization
from jaxdecode.config import Config, model_dtype
from jaxdecode.kernels.choice import DATA, MODEL, device_rows, row_specs
from jaxdecode.params import (Params, check_key, init_leaf, param_specs, params_bytes,
                              params_from_flat, params_to_flat)
from jaxdecode.state import DecodeState, KVCache, MTPCache, init_state
from jaxdecode.quantization import DEFAULT_BLOCK, SCALE_SUFFIX, Fp8Linear

AXIS_NAMES = (DATA, MODEL)

# Parameter leaf name (HF name without the "model." / "model.layers.{i}." prefix) -> spec;
# leaves not listed (the RMSNorm gains) are replicated.
PARAM_RULES: dict[str, P] = {
    "embed_tokens.weight": P(MODEL, None),  # [V, H] vocabulary
    "lm_head.weight": P(MODEL, None),  # [V, H] vocabulary
    "mlp.gate_proj.weight": P(MODEL, None),  # [I, H] intermediate
    "mlp.up_proj.weight": P(MODEL, None),  # [I, H]
    "mlp.down_proj.weight": P(None, MODEL),  # [H, I]
    "self_attn.q_proj.weight": P(MODEL, None),  # [2·Hq·D, H] query heads (with their gates)
    "self_attn.k_proj.weight": P(MODEL, None),  # [Hkv·D, H] KV heads
    "self_attn.v_proj.weight": P(MODEL, None),  # [Hkv·D, H]
    "self_attn.o_proj.weight": P(None, MODEL),  # [H, Hq·D]
    "linear_attn.in_proj_qkv.weight": P(MODEL, None),  # [C, H] key-head groups
    # [C, 1, Kc]; written as a jit's output carries it (trailing Nones dropped), so params
    # updated in a jit keep an equal sharding and reuse the compiled step
    "linear_attn.conv1d.weight": P(MODEL),
    "linear_attn.in_proj_z.weight": P(MODEL, None),  # [Hv·dv, H] value heads
    "linear_attn.in_proj_b.weight": P(MODEL, None),  # [Hv, H]
    "linear_attn.in_proj_a.weight": P(MODEL, None),  # [Hv, H]
    "linear_attn.dt_bias": P(MODEL),  # [Hv]
    "linear_attn.A_log": P(MODEL),  # [Hv]
    "linear_attn.out_proj.weight": P(None, MODEL),  # [H, Hv·dv]
    # MoE (expert parallel: E/m consecutive experts a device, kernels.choice.routed_experts);
    # the router and the shared expert's gate stay replicated (each [E or 1, H]: routing is
    # computed whole on every device, so no token moves)
    "mlp.gate.weight": P(),  # [E, H]
    "mlp.experts.gate_up_proj": P(MODEL, None, None),  # [E, 2·I_e, H]
    "mlp.experts.down_proj": P(MODEL, None, None),  # [E, H, I_e]
    "mlp.shared_expert.gate_proj.weight": P(MODEL, None),  # [I_s, H], as the dense MLP
    "mlp.shared_expert.up_proj.weight": P(MODEL, None),
    "mlp.shared_expert.down_proj.weight": P(None, MODEL),
    "mlp.shared_expert_gate.weight": P(),  # [1, H]
}

# DecodeState field -> spec of each of its arrays.
STATE_RULES: dict[str, P] = {
    "conv_state": P(DATA, None, MODEL),  # [B, Kc, C]: key-head groups, as in_proj_qkv
    "recurrent_state": P(DATA, MODEL, None, None),  # [B, Hv, dk, dv]
    "kv_cache": P(DATA, MODEL, None, None),  # [B, Hkv, S, D] (k and v)
    "lengths": P(DATA),  # [B]
    "mtp_hidden": P(DATA, None),  # [B, H] (the MTP cache's keys/values as "kv_cache")
}

_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.|^model\.|^mtp\.layers\.\d+\.|^mtp\.")


def make_mesh(data: int, model: int, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``data × model`` devices, ``AxisType.Auto`` axes (the model
    code has no sharding annotations). ``devices`` (default ``jax.devices()``, every process's)
    are ordered by (process, id), so a ``"model"`` group stays in one host when ``model``
    divides the local device count. ValueError: non-positive sizes or the wrong device count.
    """
    if not all(isinstance(n, int) and n > 0 for n in (data, model)):
        raise ValueError(f"{data=} and {model=} must be positive ints")
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        hint = (f"pass devices=jax.devices()[:{data * model}]" if data * model < len(devices)
                else "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                     "importing jax")
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but "
                         f"{len(devices)} are available ({devices[0].platform}); {hint}")
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXIS_NAMES,
                axis_types=(AxisType.Auto, AxisType.Auto))


KV_LEAVES = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")  # [Hkv·D, H] each


def config_on(config: Config, mesh: Mesh) -> Config:
    """``config`` as it runs on ``mesh``: itself, or with ``num_key_value_heads`` = the "model"
    size m when m is a multiple of it that divides ``num_attention_heads`` (each KV head repeated
    m / Hkv times, so device j holds the head its query heads j·Hq/m .. read: query head h reads
    repeated head h // (Hq / m), original head h // (Hq / Hkv), as before). The same model: only
    the K/V weights and the cache hold repeated heads (m / Hkv times their bytes, 1 head each
    per device)."""
    m, hkv, hq = mesh.shape[MODEL], config.num_key_value_heads, config.num_attention_heads
    if hkv % m == 0 or m % hkv or hq % m:
        return config
    return dataclasses.replace(config, num_key_value_heads=m)


def repeat_kv_heads(name: str, x, config: Config, to: Config):
    """Leaf ``name`` of ``config``'s params in ``to``'s layout: a K/V projection [Hkv·D, H] with
    each head's rows repeated ``to.num_key_value_heads / config.num_key_value_heads`` times (an
    :class:`Fp8Linear`: its weight's rows and its scales' rows, D / b0 a head, alike; numpy or
    jax in, the same kind out); any other leaf as it is. ValueError: an FP8 K/V projection whose
    scale blocks straddle two heads (D not a multiple of the block rows)."""
    r = to.num_key_value_heads // config.num_key_value_heads
    if r == 1 or not _base_name(name).endswith(KV_LEAVES):
        return x
    if isinstance(x, Fp8Linear):
        if config.head_dim % x.block_size[0]:
            raise ValueError(f"cannot repeat the KV heads of FP8 {name}: head_dim="
                             f"{config.head_dim} is not a multiple of its {x.block_size[0]}-row "
                             "scale blocks")
        return Fp8Linear(repeat_kv_heads(name, x.weight, config, to),
                         repeat_kv_heads(name, x.scale_inv, config, to), x.block_size)
    xp = np if isinstance(x, np.ndarray) else jnp
    heads = x.reshape(config.num_key_value_heads, -1, x.shape[-1])  # a head's rows (or scales)
    return xp.repeat(heads, r, axis=0).reshape(-1, x.shape[-1])


def _base_name(name: str) -> str:
    """A weight's name for an FP8 scale's (``..._scale_inv``), any other name as it is."""
    return name.removesuffix(SCALE_SUFFIX)


def check_mesh(config: Config, mesh: Mesh, batch_size: int | None = None) -> None:
    """Checks that ``config`` (and a batch of ``batch_size`` rows) can be split over ``mesh``.

    Raises:
      ValueError: axis names other than ``("data", "model")``, an ``Explicit`` axis, or (in one
        message) every head count, ``intermediate_size``, ``vocab_size`` not divisible by the
        ``"model"`` size (MoE: ``num_experts``, ``shared_expert_intermediate_size`` too) and a
        batch not divisible by the ``"data"`` size.
    """
    if tuple(mesh.axis_names) != AXIS_NAMES:
        raise ValueError(f"mesh.axis_names={tuple(mesh.axis_names)} must be {AXIS_NAMES} "
                         "(see jaxdecode.sharding.make_mesh)")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError(f"mesh.axis_types={mesh.axis_types} must all be AxisType.Auto: the model "
                         "code relies on sharding propagation (jax.make_mesh defaults to Explicit; "
                         "use jaxdecode.sharding.make_mesh)")
    m, d = mesh.shape[MODEL], mesh.shape[DATA]
    problems = [f"{name}={getattr(config, name)} must be divisible by the 'model' mesh axis "
                f"size {m}"
                for name in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                             "linear_num_value_heads", "intermediate_size", "vocab_size",
                             "num_experts", "shared_expert_intermediate_size")
                if getattr(config, name) % m]
    if config_on(config, mesh) is not config:  # one problem: the KV heads, with the way out
        kv = [i for i, p in enumerate(problems) if p.startswith("num_key_value_heads=")][0]
        problems[kv] += (" as given (shard_params and load_checkpoint(..., mesh=mesh) repeat the "
                         f"KV heads to {m}: build the state from their params.config)")
    if batch_size is not None and batch_size % d:
        problems.append(f"{batch_size=} must be divisible by the 'data' mesh axis size {d}")
    if problems:
        raise ValueError(f"cannot shard over the mesh (data={d}, model={m}): "
                         + "; ".join(problems))


def param_partition_spec(name: str) -> P:
    """The spec of one parameter, by its HF checkpoint name (``Qwen3_5ForCausalLM`` layout); an
    FP8 weight's block scales (``name + "_scale_inv"``, [..., R, C]) split as the weight."""
    return PARAM_RULES.get(_LAYER_PREFIX.sub("", _base_name(name)), P())


def fp8_split_problem(name: str, shape: Sequence[int], block_size: Sequence[int],
                      mesh: Mesh) -> str | None:
    """Why the block-FP8 weight ``name`` ([..., out, in]) cannot be split over ``mesh`` as its
    spec says, or None: a split dimension of the last two must give each "model" device whole
    scale blocks (its size a multiple of "model" size x block), so that a device's scales are
    those of its own weights."""
    spec = tuple(param_partition_spec(name)) + (None,) * len(shape)
    m, lead = mesh.shape[MODEL], len(shape) - 2
    for dim in range(lead, len(shape)):
        b = block_size[dim - lead]
        if spec[dim] == MODEL and m > 1 and shape[dim] % (m * b):
            return (f"{name} {tuple(shape)}: axis {dim} ({shape[dim]}) is not a multiple of "
                    f"{m} x {b}")
    return None


def unsplit_fp8(config: Config, mesh: Mesh, weights: dict) -> set[str]:
    """The block-FP8 weights ``name: (shape, block_size)`` of ``config``'s params (shapes in
    ``config``'s layout) that cannot be split over ``mesh`` in whole scale blocks:
    :func:`fp8_split_problem` on the shape :func:`config_on` lays out (K/V rows repeated), or
    K/V heads to repeat whose rows are not whole blocks. Warns naming them: :func:`shard_params`,
    :func:`init_params_sharded` and ``load_checkpoint`` hold those dequantised in the model dtype
    on this mesh, the FP8 model's values (e.g. the 35B-A3B's 512-row shared expert on 8 devices;
    vLLM refuses such a split)."""
    r = config_on(config, mesh).num_key_value_heads // config.num_key_value_heads
    problems = {}
    for name, (shape, block) in sorted(weights.items()):
        if r > 1 and name.endswith(KV_LEAVES):
            if config.head_dim % block[0]:
                problems[name] = (f"{name} {tuple(shape)}: its KV heads, repeated {r} times, "
                                  f"have head_dim={config.head_dim} rows, not whole "
                                  f"{block[0]}-row blocks")
                continue
            shape = (shape[0] * r, *shape[1:])
        if why := fp8_split_problem(name, shape, block, mesh):
            problems[name] = why
    if problems:
        shown = list(problems.values())
        warnings.warn(f"jaxdecode: {len(shown)} of {len(weights)} FP8 weights cannot be split "
                      f"into whole scale blocks on each of {mesh.shape[MODEL]} 'model' devices "
                      f"and are held in the model dtype on this mesh (fewer 'model' devices "
                      f"keep them FP8): " + "; ".join(shown[:3])
                      + (f"; and {len(shown) - 3} more" if len(shown) > 3 else ""),
                      stacklevel=3)
    return set(problems)


def param_partition_specs(config: Config) -> Params:
    """A :class:`Params` whose leaves are the ``PartitionSpec`` of each weight (table above)."""
    return params_from_flat(config, {name: param_partition_spec(name)
                                     for name in param_specs(config)})


def state_partition_specs(config: Config, *, mtp: bool = False) -> DecodeState:
    """A :class:`DecodeState` whose leaves are the ``PartitionSpec`` of each state array
    (``mtp``: of a state keeping MTP pairs, ``init_state(..., mtp=True)``)."""
    return _state_specs(len(config.linear_attention_layers), len(config.full_attention_layers),
                        mtp)


def _state_specs(num_linear: int, num_full: int, mtp: bool) -> DecodeState:
    kv = STATE_RULES["kv_cache"]
    return DecodeState(conv_state=(STATE_RULES["conv_state"],) * num_linear,
                       recurrent_state=(STATE_RULES["recurrent_state"],) * num_linear,
                       kv_cache=(KVCache(k=kv, v=kv),) * num_full,
                       lengths=STATE_RULES["lengths"],
                       mtp=MTPCache(kv=KVCache(k=kv, v=kv), hidden=STATE_RULES["mtp_hidden"])
                       if mtp else None)


def logits_partition_spec(return_all_logits: bool = False) -> P:
    """Spec of the logits: ``[B, V]`` (or ``[B, T, V]``), batch over data, vocab over model."""
    return P(DATA, None, MODEL) if return_all_logits else P(DATA, MODEL)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(config: Config, mesh: Mesh) -> Params:
    """:func:`param_partition_specs` as ``NamedSharding`` on ``mesh`` (checked first): the
    ``in_shardings`` / ``out_shardings`` of params on ``mesh`` for your own ``jax.jit``, pass
    the params' own config (``config_on``'s, KV heads repeated). A pytree prefix of block-FP8
    params too: an :class:`Fp8Linear`'s weight and block scales both take its leaf's
    sharding."""
    check_mesh(config, mesh)
    return _named(mesh, param_partition_specs(config))


def state_shardings(config: Config, mesh: Mesh, batch_size: int | None = None, *,
                    mtp: bool = False) -> DecodeState:
    """:func:`state_partition_specs` as ``NamedSharding`` on ``mesh`` (checked first)."""
    check_mesh(config, mesh, batch_size)
    return _named(mesh, state_partition_specs(config, mtp=mtp))


def _put(x, sharding: NamedSharding) -> jax.Array:
    """Places one array: a reshard for global arrays, else each device gets only its slice."""
    if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # the same global value on every process
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: Params, mesh: Mesh) -> Params:
    """``params`` placed with :func:`param_shardings` (host or device arrays in, global out), with
    ``config_on(params.config, mesh)``'s config (KV heads repeated where the mesh needs it; they
    stay repeated when resharded to a smaller mesh or saved by ``params_to_hf``: the same model
    with more KV heads). A block-FP8 weight (:class:`Fp8Linear`) keeps its spec, its block
    scales split with it; one whose blocks would not split whole is dequantised to the model
    dtype (:func:`unsplit_fp8`, which warns). Raises ValueError: see :func:`check_mesh`."""
    config = config_on(params.config, mesh)
    check_mesh(config, mesh)
    flat = params_to_flat(params)
    unsplit = unsplit_fp8(params.config, mesh, {name: (x.shape, x.block_size)
                                                for name, x in flat.items()
                                                if isinstance(x, Fp8Linear)})
    flat = {name: repeat_kv_heads(name, x.dequantize(params.dtype) if name in unsplit else x,
                                  params.config, config)
            for name, x in flat.items()}
    return params_from_flat(config, {name: _place(name, x, mesh) for name, x in flat.items()})


def _place(name: str, x, mesh: Mesh):
    """One leaf (an :class:`Fp8Linear`: both its arrays) with ``name``'s spec on ``mesh``."""
    placed = NamedSharding(mesh, param_partition_spec(name))
    if isinstance(x, Fp8Linear):
        return Fp8Linear(_put(x.weight, placed), _put(x.scale_inv, placed), x.block_size)
    return _put(x, placed)


def params_shard_bytes(config: Config, mesh: Mesh, dtype, fp8_leaves=frozenset(),
                       block_size=DEFAULT_BLOCK) -> int:
    """Bytes of ``config``'s params one device of ``mesh`` holds (``params.params_bytes`` of
    each leaf's shard under :func:`param_partition_spec`, in :func:`config_on`'s layout: K/V
    heads repeated), ``fp8_leaves`` as block FP8 (split in whole scale blocks: not the
    :func:`unsplit_fp8` ones). ValueError: :func:`check_mesh`."""
    on = config_on(config, mesh)
    check_mesh(on, mesh)
    return params_bytes(on, dtype, fp8_leaves, block_size, shard_shape=lambda name, shape: (
        NamedSharding(mesh, param_partition_spec(name)).shard_shape(shape)))


def init_params_sharded(config: Config, mesh: Mesh, key: jax.Array, dtype="float32", *,
                        quantize: str | None = None, block_size=DEFAULT_BLOCK) -> Params:
    """``shard_params(jd.init_params(config, key, dtype), mesh)`` with each leaf created in its
    sharding: every device computes and holds only its shard (a model no one device can hold,
    e.g. Qwen3.5-397B-A17B on 8 GPUs). Values as ``init_params`` under jit (random bits do not
    depend on the sharding); one small program per distinct leaf kind and shape.
    ``quantize="fp8"``: as ``shard_params(jd.quantize_fp8(init_params(...), block_size))``, each
    leaf quantised where it is created (the FP8 model without its 16-bit copy anywhere), those
    :func:`unsplit_fp8` names dequantised back to ``dtype``.
    Raises ValueError: see :func:`check_mesh`, a key or dtype ``init_params`` refuses, another
    ``quantize``, or a shard of the weights larger than a device's free memory."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize={quantize!r} must be None or 'fp8'")
    check_key(key)
    block_size = quantization.check_block_size(block_size)
    on = config_on(config, mesh)
    check_mesh(on, mesh)
    dtype = model_dtype(dtype)
    specs = param_specs(config)
    fp8 = {name for name in specs if quantize and quantization.is_quantized_leaf(name)}
    unsplit = unsplit_fp8(config, mesh, {name: (specs[name].shape, block_size) for name in fp8})
    fns = {name: _init_leaf_jit(dataclasses.replace(spec, name=_LAYER_PREFIX.sub("", name)),
                                dtype, config, on, NamedSharding(mesh, param_partition_spec(name)),
                                tuple(block_size) if name in fp8 else None, name in unsplit)
           for name, spec in specs.items()}  # one jit per leaf kind and shape
    keys = [jax.random.fold_in(key, n) for n in range(len(fns))]
    memory.check_fits(f"a shard of the weights ({'FP8' if fp8 else dtype.name}) over "
                      f"{mesh.size} devices",
                      params_shard_bytes(config, mesh, dtype, fp8 - unsplit, block_size),
                      mesh.devices.flat[0],
                      advice="use more 'model' devices" + ("" if fp8 else " (or FP8 weights)"))
    return params_from_flat(on, {name: fn(k) for (name, fn), k in zip(fns.items(), keys)})


@functools.cache
def _init_leaf_jit(spec, dtype, config: Config, on: Config, placed: NamedSharding, block_size,
                   dequantized: bool):
    def init(key):
        x = init_leaf(spec, key, dtype, config)
        if dequantized:  # (unsplit_fp8) the FP8 model's values, in its own blocks, then repeated
            x = Fp8Linear(*quantization.quantize(x, block_size), block_size).dequantize(dtype)
        x = repeat_kv_heads(spec.name, x, config, on)
        if block_size is None or dequantized:
            return x
        return Fp8Linear(*quantization.quantize(x, block_size), block_size=block_size)

    return jax.jit(init, out_shardings=placed)


def shard_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """``state`` placed with the state shardings (e.g. a state from ``jd.init_state``).
    Raises ValueError if the batch does not divide the ``"data"`` axis, or a leaf's heads or
    channels the ``"model"`` axis (naming the leaf; a state built from a config whose KV heads
    :func:`shard_params` repeated gets that hint)."""
    check_state_rows(state, mesh)
    specs = _state_specs(len(state.conv_state), len(state.kv_cache), state.mtp is not None)
    problems = []
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(state),
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                                  strict=True):
        for dim, axis in enumerate(spec):
            if axis == MODEL and leaf.shape[dim] % mesh.shape[MODEL]:
                problems.append(f"state{jax.tree_util.keystr(path)} has shape {leaf.shape}: its "
                                f"axis {dim} ({leaf.shape[dim]}) must be divisible by the "
                                f"'model' mesh axis size {mesh.shape[MODEL]}")
    if problems:
        hint = ("; params sharded on this mesh repeat the KV heads to the 'model' size: build the "
                "state from their params.config" if any("kv_cache" in p for p in problems) else "")
        raise ValueError(f"cannot shard the state over the mesh: {problems[0]}"
                         + (f" (and {len(problems) - 1} more leaves)" if len(problems) > 1 else "")
                         + hint)
    return jax.tree.map(_put, state, _named(mesh, specs))


def check_state_rows(state: DecodeState, mesh: Mesh, advice: str = "") -> None:
    """Raises ValueError if the state's rows do not divide the ``"data"`` axis (the layout
    splits them over it); ``advice``: the caller's way out, appended."""
    d = mesh.shape[DATA]
    if state.batch_size % d:
        raise ValueError(f"batch_size={state.batch_size} must be divisible by the 'data' mesh "
                         f"axis size {d}{advice}")


def init_state_sharded(config: Config, mesh: Mesh, batch_size: int, max_len: int,
                       dtype="float32", *, mtp: bool = False) -> DecodeState:
    """:func:`jaxdecode.init_state` created directly in its sharding (each device allocates only
    its shard); arguments as ``init_state`` plus ``mesh``, ValueError also :func:`check_mesh`
    and a shard larger than a device's free memory."""
    check_mesh(config, mesh, batch_size)
    shard = memory.state_bytes(config, batch_size, max_len, dtype, mtp=mtp) // mesh.size
    memory.check_fits(f"a state shard of {batch_size} rows x {max_len} positions over "
                      f"{mesh.size} devices", shard, mesh.devices.flat[0])
    return laid_out_state(config, mesh, batch_size, max_len, dtype, mtp=mtp)


def laid_out_state(config: Config, mesh: Mesh | None, batch_size: int, max_len: int,
                   dtype="float32", *, mtp: bool = False) -> DecodeState:
    """``init_state`` created on ``mesh`` in :func:`constrain_state`'s layout (any row count;
    None: the default device), without :func:`init_state_sharded`'s checks: for callers that
    made them (``generate``)."""
    return _init_state_jit(config, mesh, batch_size, max_len, model_dtype(dtype).name,
                           bool(mtp))()


@functools.cache
def _init_state_jit(config: Config, mesh: Mesh | None, batch_size: int, max_len: int, dtype: str,
                    mtp: bool):
    return jax.jit(lambda: constrain_state(
        init_state(config, batch_size, max_len, dtype, mtp=mtp, check_memory=False), mesh))


def constrain_state(state: DecodeState, mesh: Mesh | None) -> DecodeState:
    """``with_sharding_constraint`` of a state to the state layout, for use inside your own
    ``jax.jit`` (e.g. on a state created or forked inside it); ``mesh`` None: ``state`` as it is.
    A batch that does not divide the ``"data"`` axis keeps its rows whole on every data group
    (heads still split over ``"model"``), as the kernels' ``shard_map`` forms take such rows;
    ``jd.prefill``/``jd.decode_step`` refuse that state."""
    if mesh is None:
        return state
    specs = row_specs(_state_specs(len(state.conv_state), len(state.kv_cache),
                                   state.mtp is not None), state.batch_size, mesh)
    return jax.lax.with_sharding_constraint(state, _named(mesh, specs))


def state_spread(rows: int, mesh: Mesh | None) -> int:
    """Over how many devices a state of ``rows`` rows is spread (:func:`constrain_state`): the
    whole mesh, or only ``"model"`` for rows that do not divide ``"data"``; 1 off a mesh."""
    if mesh is None:
        return 1
    return rows // device_rows(rows, mesh) * mesh.shape[MODEL]


def shard_batch(x, mesh: Mesh, dtype=None) -> jax.Array:
    """A per-row input (tokens [B] or [B, T], num_new [B], active [B]) split over ``"data"``.

    Host arrays must hold the same *global* value on every process; each process keeps only its
    devices' rows. Global ``jax.Array`` are resharded; tracers get a sharding constraint.
    Raises ValueError if the batch does not divide the ``"data"`` axis.
    """
    if isinstance(x, Tracer):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA)))
    if not isinstance(x, jax.Array):
        x = np.asarray(x, dtype)
    elif dtype is not None and x.dtype != dtype:
        x = x.astype(dtype)
    d = mesh.shape[DATA]
    if x.ndim == 0 or x.shape[0] % d:
        raise ValueError(f"batch of {x.shape=} must be divisible by the 'data' mesh axis size {d}")
    return _put(x, NamedSharding(mesh, P(DATA)))


def checkpoint_placer(config: Config, mesh: Mesh) -> Callable[[str, np.ndarray], jax.Array]:
    """The ``place(name, host_array)`` callback of ``load_checkpoint(..., mesh=mesh)``: each
    device receives only its slice of each tensor as it is read, the K/V projections in
    ``config_on(config, mesh)``'s layout; an FP8 weight's scales (``name + "_scale_inv"``) split
    as the weight (:func:`param_partition_spec`). ValueError: :func:`check_mesh`."""
    on = config_on(config, mesh)
    check_mesh(on, mesh)

    def place(name: str, host: np.ndarray) -> jax.Array:
        host = repeat_kv_heads(name, host, config, on)
        return jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, param_partition_spec(name)), lambda index: host[index])

    return place


def onto_devices_of(x: jax.Array, params: Params) -> jax.Array:
    """``x`` (e.g. a PRNG key) replicated on the devices ``params`` are committed to, where ``x``
    is committed to others (jit refuses the mix: "incompatible devices"); otherwise ``x``."""
    where = getattr(params.embed_tokens, "sharding", None)
    if (not x.committed or not getattr(params.embed_tokens, "committed", False)
            or x.sharding.device_set == where.device_set):
        return x
    if isinstance(where, NamedSharding):
        return jax.device_put(x, NamedSharding(where.mesh, P()))
    if len(where.device_set) == 1:
        return jax.device_put(x, next(iter(where.device_set)))
    return x


def mesh_of(x) -> Mesh | None:
    """The ``("data", "model")`` mesh of a placed state, params or array (its first leaf's
    ``NamedSharding``), or None: single-device, traced, or another layout."""
    if isinstance(x, (DecodeState, Params)):  # one leaf, without flattening the whole tree
        leaf = x.lengths if isinstance(x, DecodeState) else x.embed_tokens
    else:
        leaf = jax.tree.leaves(x)[0]
    where = None if isinstance(leaf, Tracer) else getattr(leaf, "sharding", None)
    if isinstance(where, NamedSharding) and tuple(where.mesh.axis_names) == AXIS_NAMES:
        return where.mesh
    return None


def check_params_on(params: Params, mesh: Mesh | None) -> None:
    """Raises ValueError if ``params`` are not placed on ``mesh`` (every call would move them)."""
    if mesh_of(params) != mesh:
        where = lambda m: "one device" if m is None else f"mesh {m}"  # noqa: E731
        raise ValueError(f"the params are on {where(mesh_of(params))} but the state is on "
                         f"{where(mesh)}; place both with sharding.shard_params / shard_state "
                         "(or load_checkpoint(..., mesh=mesh), init_state_sharded)")
