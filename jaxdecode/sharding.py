"""Tensor and data parallelism over a ``("data", "model")`` mesh, as data.

The model code (``jaxdecode.model``) never mentions devices. This module says where every leaf of
:class:`~jaxdecode.params.Params` and :class:`~jaxdecode.state.DecodeState` lives, as
``PartitionSpec`` pytrees shaped like them; ``jax.jit`` and XLA's SPMD partitioner (Shardy) then
insert every collective. No hand-written communication anywhere.

    mesh = sharding.make_mesh(data=2, model=4)
    params = jd.load_checkpoint(path, "bfloat16", mesh=mesh)     # or sharding.shard_params(p, mesh)
    state = sharding.init_state_sharded(params.config, mesh, batch_size=8, max_len=4096)
    logits, state = jd.prefill(params, state, tokens, num_new)     # runs on the state's mesh
    logits, state = jd.decode_step(params, state, jnp.argmax(logits, -1))

Layout (weights are PyTorch ``[out, in]``; in the spec column ``model``/``data`` are the mesh
axes and ``-`` means not split):

    leaf                               shape               spec                   split by
    embed_tokens, lm_head              [V, H]             (model, -)             vocabulary
    input/post_attention_layernorm,
      norm, q_norm, k_norm,
      linear_attn.norm                 [H] / [D] / [dv]   ()                     replicated
    mlp.gate_proj, mlp.up_proj         [I, H]             (model, -)             intermediate
    mlp.down_proj                      [H, I]             (-, model)             intermediate
    self_attn.q_proj                   [2·Hq·D, H]        (model, -)             query heads
    self_attn.k_proj, v_proj           [Hkv·D, H]         (model, -)             KV heads
    self_attn.o_proj                   [H, Hq·D]          (-, model)             query heads
    linear_attn.in_proj_qkv            [C, H]             (model, -)             key-head groups
    linear_attn.conv1d                 [C, 1, Kc]          (model, -, -)          key-head groups
    linear_attn.in_proj_z              [Hv·dv, H]         (model, -)             value heads
    linear_attn.in_proj_a, in_proj_b   [Hv, H]            (model, -)             value heads
    linear_attn.dt_bias, A_log         [Hv]                (model,)               value heads
    linear_attn.out_proj               [H, Hv·dv]         (-, model)             value heads
    state.conv_state[i]                [B, Kc, C]          (data, -, model)       rows; key-head groups
    state.recurrent_state[i]           [B, Hv, dk, dv]     (data, model, -, -)    rows; value heads
    state.kv_cache[i].k, .v            [B, Hkv, S, D]      (data, model, -, -)    rows; KV heads
    state.lengths                      [B]                 (data,)                rows
    logits                             [B, V] / [B, T, V]  (data, model) / (data, -, model)

``q_proj`` rows are ``[Hq, 2D]`` per head (query, then gate), so contiguous blocks are whole
heads and each device's gate rows sit with its query rows.

Why: every weight is split over ``"model"`` (none is replicated, none is ever all-gathered), in
the Megatron pattern: column-parallel in-projections, row-parallel out-projections, so each
mixer and each MLP ends with one all-reduce of the [B, T, H] residual update. Caches and the
recurrent state live with the heads that read and write them. The vocabulary split leaves the
logits split too (an argmax or sampler reduces across ``"model"``, on [B, V] floats).

The Gated DeltaNet conv channels: in the checkpoint they are ``[q (Hk·dk) | k (Hk·dk) |
v (Hv·dv)]``, whose contiguous blocks do not hold whole heads (splitting them cost 3-8
collective-permutes of the post-conv activation per DeltaNet layer and step). jaxdecode holds
them grouped per key head instead (``jaxdecode.params.conv_channel_order``: ``[q_i | k_i | the
r value heads of key head i]``, applied to ``in_proj_qkv`` rows and ``conv1d`` channels at load
time), so ``m`` contiguous blocks (``m`` dividing Hk) are whole key-head groups: projection,
conv, window update and delta rule are all local to a device.

The Pallas kernels run per device under ``shard_map`` (``jaxdecode.kernels.choice``, from
``choose_kernels(config, B, mesh=mesh)``, which ``jd.decode_step`` calls for a state on a
mesh): a kernel is a custom call the SPMD partitioner cannot split, and would otherwise get an
all-gathered KV cache every step.

Per decode step of the 9B model (compiled HLO for 8 CPU devices, batch 8, meshes (1,2), (1,4)
and (2,4)): 65 all-reduces of [B, H] (one per mixer and per MLP, plus the vocab-split
embedding lookup) and no other collective. No weight moves.
The cache write in ``model.py`` is a per-row scatter, so with ``data`` > 1 no K/V rows move
across ``"data"`` (the compiled step has no all-gather at data=2/model=4 or data=8).

Requirements (checked, with one ``ValueError`` naming every size that fails):
``num_attention_heads``, ``num_key_value_heads``, ``linear_num_key_heads``,
``linear_num_value_heads``, ``intermediate_size`` and ``vocab_size`` divisible by the
``"model"`` axis size, and the batch by the ``"data"`` axis size. For the published 9B and 27B
(4 KV heads) that means at most 4-way tensor parallelism; 0.8B and 2B (2 KV heads): 2-way.

Donation: ``jaxdecode.step`` builds the jitted prefill and decode step with ``out_shardings``
pinned to these tables, so every state buffer is aliased in place and no step reshards.

Several hosts (processes): the same code. Every process runs the same script; first call
``jax.distributed.initialize`` (no arguments on SLURM, Cloud TPU and other detected
clusters), then build the mesh from the *global* device list: :func:`make_mesh` puts ``"model"``
innermost, so a model group stays inside one host (tensor parallelism over NVLink) and
``"data"`` spans hosts. Every process passes the same global host arrays (tokens, lengths);
:func:`shard_batch` keeps only each process's shards. On CPU (tests) collectives go over gloo.

    # 2 hosts x 8 GPUs, 4-way TP inside each host, 4-way DP; on host i (0 or 1):
    python examples/sharded.py --mesh 4,4 --checkpoint DIR --dtype bfloat16 \\
        --coordinator host0.example:12355 --num-processes 2 --process-id i

Source: the Megatron-LM tensor-parallel layout (Shoeybi et al., 2019) as used by gpt-fast's
``tp.py``; mesh and spec conventions of ``jax-llm-examples``; JAX's "Distributed arrays and
automatic parallelization" and "Multi-process" guides.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdecode.config import Config
from jaxdecode.kernels.choice import DATA, MODEL
from jaxdecode.params import Params, param_specs, params_from_flat
from jaxdecode.state import DecodeState, KVCache, init_state

AXIS_NAMES = (DATA, MODEL)

# Parameter leaf name (HF name without the "model." / "model.layers.{i}." prefix) -> spec.
# Leaves not listed (the RMSNorm gains) are replicated.
PARAM_RULES: dict[str, P] = {
    "embed_tokens.weight": P(MODEL, None),  # [V, H] vocabulary
    "lm_head.weight": P(MODEL, None),  # [V, H] vocabulary
    "mlp.gate_proj.weight": P(MODEL, None),  # [I, H]
    "mlp.up_proj.weight": P(MODEL, None),  # [I, H]
    "mlp.down_proj.weight": P(None, MODEL),  # [H, I]
    # q_proj rows are [Hq, 2D] per head (query then gate): contiguous blocks are whole heads.
    "self_attn.q_proj.weight": P(MODEL, None),  # [2·Hq·D, H]
    "self_attn.k_proj.weight": P(MODEL, None),  # [Hkv·D, H]
    "self_attn.v_proj.weight": P(MODEL, None),  # [Hkv·D, H]
    "self_attn.o_proj.weight": P(None, MODEL),  # [H, Hq·D]
    # Channels grouped per key head (params.conv_channel_order): contiguous blocks are whole
    # key-head groups, the same blocks as conv1d and conv_state.
    "linear_attn.in_proj_qkv.weight": P(MODEL, None),  # [C, H]
    "linear_attn.conv1d.weight": P(MODEL, None, None),  # [C, 1, Kc]
    "linear_attn.in_proj_z.weight": P(MODEL, None),  # [Hv·dv, H]
    "linear_attn.in_proj_b.weight": P(MODEL, None),  # [Hv, H]
    "linear_attn.in_proj_a.weight": P(MODEL, None),  # [Hv, H]
    "linear_attn.dt_bias": P(MODEL),  # [Hv]
    "linear_attn.A_log": P(MODEL),  # [Hv]
    "linear_attn.out_proj.weight": P(None, MODEL),  # [H, Hv·dv]
}

# DecodeState field -> spec of each of its arrays.
STATE_RULES: dict[str, P] = {
    "conv_state": P(DATA, None, MODEL),  # [B, Kc, C]: key-head groups, as in_proj_qkv
    "recurrent_state": P(DATA, MODEL, None, None),  # [B, Hv, dk, dv]
    "kv_cache": P(DATA, MODEL, None, None),  # [B, Hkv, S, D] (k and v)
    "lengths": P(DATA),  # [B]
}

_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.|^model\.")


# ----- the mesh and its checks ----------------------------------------------------------------

def make_mesh(data: int, model: int, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``data × model`` devices.

    Args:
      data: size of the data-parallel axis (splits the batch).
      model: size of the tensor-parallel axis (splits heads, intermediate and vocabulary).
      devices: default ``jax.devices()`` (all processes' devices after
        ``jax.distributed.initialize``), ordered by (process, id) so that ``"model"`` groups
        stay inside a process (host) whenever ``model`` divides the local device count.

    Returns:
      A ``jax.sharding.Mesh`` with ``AxisType.Auto`` axes (the partitioner propagates shardings
      through the model code, which carries no sharding annotations of its own).

    Raises:
      ValueError: for non-positive sizes or ``data * model`` different from the device count.
    """
    if not all(isinstance(n, int) and n > 0 for n in (data, model)):
        raise ValueError(f"{data=} and {model=} must be positive ints")
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but "
                         f"{len(devices)} are available ({devices[0].platform}); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax")
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXIS_NAMES,
                axis_types=(AxisType.Auto, AxisType.Auto))


def check_mesh(config: Config, mesh: Mesh, batch_size: int | None = None) -> None:
    """Checks that ``config`` (and a batch of ``batch_size`` rows) can be split over ``mesh``.

    Raises:
      ValueError: one message listing every problem: axis names other than
        ``("data", "model")``, an ``Explicit`` axis, a head count, ``intermediate_size`` or
        ``vocab_size`` not divisible by the ``"model"`` size, a batch not divisible by the
        ``"data"`` size.
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
                             "linear_num_value_heads", "intermediate_size", "vocab_size")
                if getattr(config, name) % m]
    if batch_size is not None and batch_size % d:
        problems.append(f"{batch_size=} must be divisible by the 'data' mesh axis size {d}")
    if problems:
        raise ValueError(f"cannot shard over the mesh (data={d}, model={m}): "
                         + "; ".join(problems))


# ----- PartitionSpecs shaped like the pytrees -------------------------------------------------

def param_partition_spec(name: str) -> P:
    """The spec of one parameter, by its HF checkpoint name (``Qwen3_5ForCausalLM`` layout)."""
    return PARAM_RULES.get(_LAYER_PREFIX.sub("", name), P())


def param_partition_specs(config: Config) -> Params:
    """A :class:`Params` whose leaves are the ``PartitionSpec`` of each weight (table above)."""
    return params_from_flat(config, {name: param_partition_spec(name)
                                     for name in param_specs(config)})


def state_partition_specs(config: Config) -> DecodeState:
    """A :class:`DecodeState` whose leaves are the ``PartitionSpec`` of each state array."""
    return _state_specs(len(config.linear_attention_layers), len(config.full_attention_layers))


def _state_specs(num_linear: int, num_full: int) -> DecodeState:
    kv = STATE_RULES["kv_cache"]
    return DecodeState(conv_state=(STATE_RULES["conv_state"],) * num_linear,
                       recurrent_state=(STATE_RULES["recurrent_state"],) * num_linear,
                       kv_cache=(KVCache(k=kv, v=kv),) * num_full,
                       lengths=STATE_RULES["lengths"])


def logits_partition_spec(return_all_logits: bool = False) -> P:
    """Spec of the logits: ``[B, V]`` (or ``[B, T, V]``), batch over data, vocab over model."""
    return P(DATA, None, MODEL) if return_all_logits else P(DATA, MODEL)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(config: Config, mesh: Mesh) -> Params:
    """:func:`param_partition_specs` as ``NamedSharding`` on ``mesh`` (checked first)."""
    check_mesh(config, mesh)
    return _named(mesh, param_partition_specs(config))


def state_shardings(config: Config, mesh: Mesh, batch_size: int | None = None) -> DecodeState:
    """:func:`state_partition_specs` as ``NamedSharding`` on ``mesh`` (checked first)."""
    check_mesh(config, mesh, batch_size)
    return _named(mesh, state_partition_specs(config))


# ----- placing arrays -------------------------------------------------------------------------

def _put(x, sharding: NamedSharding) -> jax.Array:
    """Places one array: a reshard for global arrays, else each device gets only its slice."""
    if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # the same global value on every process
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: Params, mesh: Mesh) -> Params:
    """``params`` placed with :func:`param_shardings` (host or device arrays in, global out).

    Raises:
      ValueError: see :func:`check_mesh`.
    """
    return jax.tree.map(_put, params, param_shardings(params.config, mesh))


def shard_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """``state`` placed with the state shardings (e.g. a state from ``jd.init_state``).

    Raises:
      ValueError: see :func:`check_mesh` (the batch must divide the ``"data"`` axis).
    """
    _check_state_mesh(state, mesh)
    specs = _state_specs(len(state.conv_state), len(state.kv_cache))
    return jax.tree.map(_put, state, _named(mesh, specs))


def _check_state_mesh(state: DecodeState, mesh: Mesh) -> None:
    d = mesh.shape[DATA]
    if state.batch_size % d:
        raise ValueError(f"batch_size={state.batch_size} must be divisible by the 'data' mesh "
                         f"axis size {d}")


def init_state_sharded(config: Config, mesh: Mesh, batch_size: int, max_len: int,
                       dtype="float32") -> DecodeState:
    """:func:`jaxdecode.init_state` created directly in its sharding (each device allocates only
    its shard; no full copy anywhere). Arguments as ``init_state`` plus ``mesh``.

    Raises:
      ValueError: see :func:`check_mesh` and ``init_state``.
    """
    check_mesh(config, mesh, batch_size)
    return _init_state_jit(config, mesh)(config, batch_size, max_len, jnp.dtype(dtype).name)


@functools.cache
def _init_state_jit(config: Config, mesh: Mesh):
    return jax.jit(init_state, static_argnums=(0, 1, 2, 3),
                   out_shardings=state_shardings(config, mesh))


def constrain_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """``with_sharding_constraint`` of a state to the state layout, for use inside your own
    ``jax.jit`` (e.g. on a state created or forked inside it)."""
    return jax.lax.with_sharding_constraint(
        state, _named(mesh, _state_specs(len(state.conv_state), len(state.kv_cache))))


def shard_batch(x, mesh: Mesh, dtype=None) -> jax.Array:
    """A per-row input (tokens [B] or [B, T], lengths [B], active [B]) split over ``"data"``.

    Host arrays must hold the same *global* value on every process; each process keeps only its
    devices' rows. Global ``jax.Array`` are resharded; tracers get a sharding constraint.

    Raises:
      ValueError: if the batch does not divide the ``"data"`` axis.
    """
    if isinstance(x, jax.core.Tracer):
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
    device receives only its slice of each tensor as it is read.

    Raises:
      ValueError: see :func:`check_mesh` (raised before any tensor is read).
    """
    check_mesh(config, mesh)
    shardings = {name: NamedSharding(mesh, param_partition_spec(name))
                 for name in param_specs(config)}

    def place(name: str, host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, shardings[name],
                                            lambda index: host[index])

    return place


def mesh_of(x) -> Mesh | None:
    """The ``("data", "model")`` mesh of a placed state, params or array (its first leaf's
    ``NamedSharding``), or None: single-device, traced, or another layout."""
    leaf = jax.tree.leaves(x)[0]
    where = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    if isinstance(where, NamedSharding) and tuple(where.mesh.axis_names) == AXIS_NAMES:
        return where.mesh
    return None


def check_params_on(params: Params, mesh: Mesh | None) -> None:
    """Raises ValueError if ``params`` are not placed on ``mesh`` (every call would move them)."""
    if mesh_of(params) != mesh:
        raise ValueError(f"params are on mesh {mesh_of(params)} but the state on {mesh}; place "
                         "both with sharding.shard_params / shard_state (or load_checkpoint(..., "
                         "mesh=mesh), init_state_sharded)")
