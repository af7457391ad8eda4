"""The library's jitted, donated entry points: :func:`prefill` and :func:`decode_step`.

:func:`jit_prefill` / :func:`jit_decode_step` jit ``jaxdecode.model``'s pure functions with the
state donated (caches updated in place), on a mesh with ``out_shardings`` from
``jaxdecode.sharding``. :func:`check_prefill` / :func:`check_decode_step` validate inputs on the
host. Inside your own ``jit``, ``grad`` or ``scan`` call ``model.prefill_fn`` /
``model.decode_step_fn`` and compile with :data:`COMPILER_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer  # imported once: jax.core's module getattr is slow per lookup
from jax.sharding import Mesh, NamedSharding

from jaxdecode import memory, model, sharding
from jaxdecode.config import Config
from jaxdecode.kernels.choice import Kernels, check_kernels, device_rows, resolve_kernels
from jaxdecode.params import MoEParams, Params, check_params
from jaxdecode.quantization import Fp8Linear
from jaxdecode.state import DecodeState, KVCache, MTPCache, check_not_donated

# XLA options of every program the library compiles (other backends ignore them). The dot merger
# threshold (default 32 MB) is raised so the MLP's gate and up projections become one GEMM.
COMPILER_OPTIONS = types.MappingProxyType({"xla_gpu_dot_merger_threshold_mb": 1024})


def _cache(builder):
    """``functools.cache`` keyed on the bound arguments with defaults applied, so calls spelled
    differently (positional, keyword, a default given or left out) get one jitted function and
    its compiled executables. ``cache_info`` / ``cache_clear`` as functools'."""
    signature = inspect.signature(builder)
    cached = functools.cache(builder)
    every = len(signature.parameters)

    @functools.wraps(builder)
    def build(*args, **kwargs):
        if kwargs or len(args) != every:  # the library's calls give all, positionally: no bind
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        return cached(*args)

    build.cache_info, build.cache_clear = cached.cache_info, cached.cache_clear
    return build


def check_state(config: Config, state: DecodeState, dtype) -> None:
    """Raises ValueError if the state's structure, shapes or dtypes do not fit ``config`` and the
    params' ``dtype`` (shapes and dtypes only: no device read). A state whose layout passed once
    is recognised by its leaves' avals (``_check_state_layout`` caches by them)."""
    check_not_donated(state)
    leaves, treedef = jax.tree.flatten(state)
    try:
        avals = tuple([x.aval for x in leaves])
    except AttributeError:  # a leaf that is not a jax.Array (numpy, a ShapeDtypeStruct)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype")
                                           else np.result_type(x)) for x in leaves)
    _check_state_layout(config, jnp.dtype(dtype), treedef, avals)


@functools.lru_cache(maxsize=64)
def _check_state_layout(config: Config, dtype, treedef, avals) -> None:
    # cached on success only (an exception is not cached): a decode loop's state passes in the
    # time of one dict lookup instead of one Python test per leaf
    state = jax.tree.unflatten(treedef, avals)
    c = config
    problems = []
    dtypes = {x.dtype for x in state.conv_state} | {x.dtype for kv in state.kv_cache
                                                    for x in (kv.k, kv.v)}
    if dtypes != {jnp.dtype(dtype)}:
        problems.append(f"conv_state/kv_cache dtype {sorted(map(str, dtypes))} != the params' "
                        f"dtype {jnp.dtype(dtype)} (use init_state(..., dtype=params.dtype))")
    if any(x.dtype != jnp.float32 for x in state.recurrent_state):
        problems.append("recurrent_state must be float32")
    if state.lengths.dtype != jnp.int32:
        problems.append(f"lengths must be int32, got {state.lengths.dtype}")
    num_linear, num_full = len(c.linear_attention_layers), len(c.full_attention_layers)
    if len(state.conv_state) != num_linear or len(state.recurrent_state) != num_linear:
        problems.append(f"state has {len(state.conv_state)} conv / {len(state.recurrent_state)} "
                        f"recurrent states but the config has {num_linear} linear_attention "
                        "layers")
    if len(state.kv_cache) != num_full:
        problems.append(f"state has {len(state.kv_cache)} KV caches but the config has "
                        f"{num_full} full_attention layers")
    batch = state.batch_size
    expect = {
        "conv_state": (batch, c.linear_conv_kernel_dim, c.linear_conv_dim),
        "recurrent_state": (batch, c.linear_num_value_heads, c.linear_key_head_dim,
                            c.linear_value_head_dim),
        "kv_cache": (batch, c.num_key_value_heads, state.max_len, c.head_dim)}
    got = {"conv_state": [x.shape for x in state.conv_state],
           "recurrent_state": [x.shape for x in state.recurrent_state],
           "kv_cache": [x.shape for kv in state.kv_cache for x in (kv.k, kv.v)]}
    for name, shapes in got.items():
        bad = [s for s in shapes if tuple(s) != expect[name]]
        if bad:
            problems.append(f"{name} shape {tuple(bad[0])} != expected {expect[name]}")
    if state.mtp is not None and not (isinstance(state.mtp, MTPCache)
                                      and isinstance(state.mtp.kv, KVCache)):
        problems.append(f"mtp must be a jaxdecode.MTPCache (init_state(..., mtp=True)); got "
                        f"{type(state.mtp).__name__}")
    elif state.mtp is not None:
        if c.mtp_num_hidden_layers != 1:
            problems.append("state keeps MTP pairs (init_state(..., mtp=True)) but the params "
                            "hold no MTP layer (load_checkpoint(..., mtp=True))")
        for name, x, want in (("mtp.kv.k", state.mtp.kv.k, expect["kv_cache"]),
                              ("mtp.kv.v", state.mtp.kv.v, expect["kv_cache"]),
                              ("mtp.hidden", state.mtp.hidden, (batch, c.hidden_size))):
            if not hasattr(x, "shape"):
                problems.append(f"{name} is {type(x).__name__}, not an array")
                continue
            if tuple(x.shape) != want:
                problems.append(f"{name} shape {tuple(x.shape)} != expected {want}")
            if x.dtype != jnp.dtype(dtype):
                problems.append(f"{name} dtype {x.dtype} != the params' dtype "
                                f"{jnp.dtype(dtype)}")
    if problems:
        raise ValueError("state does not match params.config: " + "; ".join(problems))


def _check_token_ids(config: Config, tokens: np.ndarray, real: np.ndarray) -> None:
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    ids = tokens[real]
    bad = (ids < 0) | (ids >= config.vocab_size)
    if bad.any():
        raise ValueError(f"token ids must be in [0, vocab_size={config.vocab_size}); got "
                         f"{ids[bad][:8].tolist()} ({int(bad.sum())} out of range)")


def _host_array(x, name: str, layout: str) -> np.ndarray:
    """``np.asarray(x)``, or a ValueError naming ``name`` and its ``layout`` where ``x`` nests
    sequences of unequal lengths (numpy's own message names neither)."""
    try:
        return np.asarray(x)
    except ValueError:
        raise ValueError(f"{name} must be a {layout}; got nested sequences of unequal "
                         "lengths") from None


def check_prefill(params: Params, state: DecodeState, tokens, num_new) -> None:
    """Validates a prefill on the host, reading ``state.lengths`` back (one device sync; skipped
    for a state spread over several processes). ValueError: a state that does not fit the params
    (:func:`check_state`); tokens not [B, T], T >= 1; ``num_new`` not [B] integers in ``[0, T]``;
    real ids outside ``[0, vocab_size)``; a row whose ``state.lengths + num_new`` > ``max_len``.
    """
    check_state(params.config, state, params.dtype)
    tokens = _host_array(tokens, "tokens", "[B, T] integer array (each row right-padded to T; "
                         "num_new[b] of row b's are real)")
    num_new = _host_array(num_new, "num_new", "[B] integer array")
    if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.shape[0] != state.batch_size:
        raise ValueError(f"tokens must be [B, T] with B = {state.batch_size} (the state's batch "
                         f"size) and T >= 1; got {tokens.shape=}")
    if num_new.shape != (tokens.shape[0],) or not np.issubdtype(num_new.dtype, np.integer):
        raise ValueError(f"num_new must be [B] integers; got {num_new.shape=}, {num_new.dtype}")
    if (num_new < 0).any() or (num_new > tokens.shape[1]).any():
        raise ValueError(f"num_new must be in [0, T={tokens.shape[1]}]; got {num_new.tolist()}")
    _check_token_ids(params.config, tokens, np.arange(tokens.shape[1]) < num_new[:, None])
    if not getattr(state.lengths, "is_fully_addressable", True):  # (host arrays: readable)
        return
    # Read a copy: a zero-copy CPU view would make the buffer copied instead of donated.
    cached = np.asarray(jnp.copy(state.lengths))
    if ((cached < 0) | (cached > state.max_len)).any():
        raise ValueError(f"state.lengths must be in [0, max_len={state.max_len}]; got "
                         f"{cached.tolist()}")
    over = cached + num_new > state.max_len
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(f"row {b}: {int(cached[b])} cached + {int(num_new[b])} new tokens "
                         f"exceeds the cache's max_len={state.max_len}")


def check_decode_step(params: Params, state: DecodeState, tokens, active=None) -> None:
    """Validates a decode step on the host without reading the device (device token ids are
    checked in the step, where a bad id, like a full cache, gives NaN logits). ValueError: a state
    that does not fit (:func:`check_state`); tokens or ``active`` not [B]; host ids outside
    ``[0, vocab_size)``."""
    check_state(params.config, state, params.dtype)
    if not isinstance(tokens, jax.Array):
        tokens = _host_array(tokens, "tokens", "[B] integer array")
    if tokens.shape != (state.batch_size,):
        raise ValueError(f"tokens must be [B] with B = {state.batch_size} (the state's batch "
                         f"size); got shape {tokens.shape}")
    real = np.ones(state.batch_size, bool)  # the rows whose host ids are checked
    if active is not None:
        if not isinstance(active, jax.Array):  # host values: reading them costs no device sync
            active = real = _host_array(active, "active", "[B] bool array")
        if active.shape != (state.batch_size,):
            raise ValueError(f"active must be [B] like tokens; got shape {active.shape}")
        if active.dtype != np.bool_:
            raise ValueError("active must be a [B] bool array (True: the row takes its token)")
    if not np.issubdtype(tokens.dtype, np.integer):  # a device array's dtype: no device read
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    if not isinstance(tokens, jax.Array):
        _check_token_ids(params.config, tokens, real)


@_cache
def jit_prefill(config: Config, mesh: Mesh | None = None, return_all_logits: bool = False,
                query_block: int = 512, kernels: Kernels | None = None, mtp: bool = False):
    """``model.prefill_fn`` jitted with the state donated and :data:`COMPILER_OPTIONS` (on a mesh,
    outputs in ``jaxdecode.sharding``'s layout; ``mtp``: for states keeping MTP pairs);
    ``f(params, state, tokens, num_new)``, inputs placed, no validation, no chunking
    (:func:`prefill` loops over chunks)."""
    fn = functools.partial(model.prefill_fn, return_all_logits=return_all_logits,
                           query_block=query_block, kernels=kernels)
    out = None if mesh is None else (
        NamedSharding(mesh, sharding.logits_partition_spec(return_all_logits)),
        sharding.state_shardings(config, mesh, mtp=mtp))
    return jax.jit(fn, donate_argnums=1, out_shardings=out, compiler_options=COMPILER_OPTIONS)


@jax.jit
def _keep_last(last, logits, has_tokens):
    return jnp.where(has_tokens[:, None], logits, last)


def plan_prefill(params: Params, batch_size: int, length: int, max_len: int, *,
                 mesh: Mesh | None = None, return_all_logits: bool = False,
                 prefill_chunk_size: int | None = None, activation_budget: int | None = None,
                 kernels: Kernels | None = None,
                 logits_per_token: bool = False) -> memory.PrefillPlan:
    """How a prefill of [B, T = ``length``] tokens into a ``max_len`` state runs
    (``memory.plan_prefill`` for one device's rows; ``prefill_chunk_size`` given: that,
    validated). ValueError: a ``prefill_chunk_size`` that is not a positive multiple of 64, or
    a request whose activations cannot fit."""
    chunk = prefill_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer))
                              or chunk <= 0 or chunk % memory.MIN_CHUNK):
        raise ValueError(f"prefill_chunk_size={chunk!r} must be a positive multiple of "
                         f"{memory.MIN_CHUNK}")
    rows = device_rows(batch_size, mesh)
    device = None if mesh is None else mesh.devices.flat[0]
    if kernels is not None and kernels.batch_invariant:  # one row, fixed chunks
        rows, length = 1, model.INVARIANT_CHUNK
    flash = kernels is not None and kernels.prefill_attention == "pallas"
    plan = memory.plan_prefill(params.config, rows, length, max_len, params.dtype,
                               budget=activation_budget, return_all_logits=return_all_logits,
                               device=device, flash=flash,
                               logits_per_token=logits_per_token,
                               weight_copy_bytes=dequantized_copy_bytes(params))
    if chunk is not None:
        plan = dataclasses.replace(plan, prefill_chunk_size=chunk if chunk < length else None)
    return plan


def dequantized_copy_bytes(params: Params) -> int:
    """Per device, the most bytes of 16-bit weight copies a prefill holds at once when XLA
    dequantises block-FP8 weights (``choice.fp8_linear`` past the kernel's rows; the MoE rounds
    form, ``experts._rounds``, which dequantises one layer's two expert stacks together): one
    layer's expert stacks or the largest FP8 Linear, in ``params.dtype``; 0 without FP8."""
    def copy(w):
        if not isinstance(w, Fp8Linear):
            return 0
        sharded = getattr(w.weight, "sharding", None)
        shape = w.shape if sharded is None else sharded.shard_shape(w.shape)
        return math.prod(shape) * params.dtype.itemsize
    most = 0
    for layer in (*params.layers, *((params.mtp.layer,) if params.mtp is not None else ())):
        weights = jax.tree.leaves(layer, is_leaf=lambda a: isinstance(a, Fp8Linear))
        most = max([most, *(copy(w) for w in weights)])
        if isinstance(layer.mlp, MoEParams):
            most = max(most, copy(layer.mlp.experts_gate_up_proj)
                       + copy(layer.mlp.experts_down_proj))
    return most


@_cache
def jit_decode_step(config: Config, kernels: Kernels, logits_out: bool = False,
                    mtp: bool = False):
    """``model.decode_step_fn`` with ``kernels``, jitted as :func:`jit_prefill` on
    ``kernels.mesh``; ``f(params, state, tokens, active)`` (``active`` may be None).
    ``logits_out``: ``f(params, state, tokens, active, out)``, ``out`` a [B, V] float32 array
    donated for the logits (XLA writes them into its buffer)."""
    fn = functools.partial(model.decode_step_fn, kernels=kernels)
    shardings = None if kernels.mesh is None else (
        NamedSharding(kernels.mesh, sharding.logits_partition_spec()),
        sharding.state_shardings(config, kernels.mesh, mtp=mtp))
    if not logits_out:
        return jax.jit(fn, donate_argnums=1, out_shardings=shardings,
                       compiler_options=COMPILER_OPTIONS)

    def with_out(params, state, tokens, active, out):
        del out  # only its buffer is used: donated, it holds the logits output
        return fn(params, state, tokens, active)

    return jax.jit(with_out, donate_argnums=(1, 4), keep_unused=True, out_shardings=shardings,
                   compiler_options=COMPILER_OPTIONS)


def check_logits_out(out, state: DecodeState, vocab_size: int, mesh: Mesh | None) -> None:
    """ValueError unless ``out`` can hold a decode step's logits: a live (not donated) float32
    jax.Array [B, V] on the state's device, or on a mesh with the logits' sharding."""
    want = (state.batch_size, vocab_size)
    if not isinstance(out, jax.Array) or out.shape != want or out.dtype != jnp.float32:
        raise ValueError(f"out must be a float32 jax.Array of shape {want} (the logits of an "
                         f"earlier step); got {type(out).__name__} "
                         f"{getattr(out, 'shape', None)} {getattr(out, 'dtype', None)}")
    if out.is_deleted():
        raise ValueError("out was donated to an earlier decode_step; pass the logits that call "
                         "returned")
    if mesh is not None:
        expect = NamedSharding(mesh, sharding.logits_partition_spec())
        if not out.sharding.is_equivalent_to(expect, out.ndim):
            raise ValueError(f"out has sharding {out.sharding}; the logits on this mesh have "
                             f"{expect}")
    elif isinstance(state.lengths, jax.Array) and out.devices() != state.lengths.devices():
        raise ValueError(f"out is on {out.devices()}, the state on {state.lengths.devices()}")


# prefill and decode_step split a state's rows over "data"; generate and score also take rows
# that do not divide it (whole on each data group) and return such states
ROWS_ADVICE = (" (prefill and decode_step split the state's rows over it; a state of other "
               "row counts, from generate or score with return_state, continues with "
               "generate(..., state=))")


def _traced(params: Params, *xs) -> bool:
    # the leaves' types at C speed, then a few subclass checks; of the params only the embedding
    # (a traced leaf elsewhere in them still works: the jitted step is then traced inline);
    # params of another type: _check_concrete names them
    leaves = jax.tree.leaves((getattr(params, "embed_tokens", None), xs))
    return any(issubclass(t, Tracer) for t in set(map(type, leaves)))


def _check_concrete(params: Params, state: DecodeState) -> None:
    """ValueError for params or a state of another type (:func:`check_not_donated`), or
    abstract ones (``jax.ShapeDtypeStruct`` leaves, e.g. from ``jax.eval_shape``), which the
    eager API cannot run on (one leaf each stands for all)."""
    check_params(params)
    check_not_donated(state)
    for what, leaf in (("params", params.embed_tokens), ("state", state.lengths)):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(f"the {what} are abstract (jax.ShapeDtypeStruct leaves): create "
                             "real arrays, or call model.prefill_fn / decode_step_fn inside "
                             "jax.jit or jax.eval_shape")


def _check_call(params: Params, state: DecodeState, kernels) -> Mesh | None:
    """What :func:`prefill` and :func:`decode_step` check first: ``kernels`` a Kernels or None,
    :func:`_check_concrete`, params on the state's mesh and its rows split evenly over it.
    Returns the state's mesh (None: one device). Raises ValueError."""
    check_kernels(kernels)
    _check_concrete(params, state)
    mesh = sharding.mesh_of(state)
    sharding.check_params_on(params, mesh)
    if mesh is not None:
        sharding.check_state_rows(state, mesh, ROWS_ADVICE)
    return mesh


def _batch_input(x, mesh: Mesh | None, dtype):
    if mesh is not None:
        return sharding.shard_batch(x, mesh, dtype)
    return x if isinstance(x, jax.Array) and x.dtype == dtype else jnp.asarray(x, dtype)


def prefill(params: Params, state: DecodeState, tokens, num_new, *,
            return_all_logits: bool = False, prefill_chunk_size: int | None = None,
            activation_budget: int | None = None, kernels: Kernels | None = None):
    """Appends each row's prompt tokens to the state (a fresh prompt or a continuation).

    Args:
      params: model weights; on a mesh, placed on the state's mesh.
      state: a :class:`DecodeState` for this config (one device, or placed with
        ``jaxdecode.sharding``); donated: do not use it after the call.
      tokens: [B, T] int32 token ids, right-padded (padding may hold any value).
      num_new: [B] int32 real tokens per row, ``0 <= num_new <= T``; a row with 0 is untouched.
      return_all_logits: logits for every position instead of each row's last token.
      prefill_chunk_size: tokens per call (a multiple of 64): a longer T runs as continuations
        of that many tokens, one executable for every T; None: the largest whose activations
        fit ``activation_budget`` (``memory.plan_prefill``).
      activation_budget: bytes of activations a call may hold; None: half the device's free
        memory (4 GiB where the device reports none).
      kernels: its ``prefill_attention`` (the flash kernel or XLA's) and ``batch_invariant``
        (rows one at a time in fixed chunks); None: ``choose_kernels`` for the state.

    Returns (logits, new_state) as ``model.prefill_fn``: logits [B, V] float32 (or [B, T, V]),
    ``new_state.lengths = state.lengths + num_new``, in the state's layout. Raises ValueError:
    :func:`check_prefill`, :func:`plan_prefill`, or params on another mesh than the state.
    Compiles once per (B, chunk) (pad prompts to a few sizes, as ``jd.generate`` does); with
    traced arguments it is ``model.prefill_fn``, inlined.
    """
    if _traced(params, state, tokens, num_new):
        return model.prefill_fn(params, state, jnp.asarray(tokens, jnp.int32),
                                jnp.asarray(num_new, jnp.int32), return_all_logits,
                                prefill_chunk_size=prefill_chunk_size, kernels=kernels)
    mesh = _check_call(params, state, kernels)
    check_prefill(params, state, tokens, num_new)
    kernels = resolve_kernels(kernels, params.config, state.batch_size, params.dtype, mesh)
    tokens, num_new = np.asarray(tokens), np.asarray(num_new)
    length = tokens.shape[1]
    plan = plan_prefill(params, state.batch_size, length, state.max_len, mesh=mesh,
                        return_all_logits=return_all_logits,
                        prefill_chunk_size=prefill_chunk_size,
                        activation_budget=activation_budget, kernels=kernels)
    run = jit_prefill(params.config, mesh, return_all_logits, plan.query_block, kernels,
                      state.mtp is not None)
    chunk = plan.prefill_chunk_size
    if chunk is None or (kernels is not None and kernels.batch_invariant):
        return run(params, state, _batch_input(tokens, mesh, jnp.int32),
                   _batch_input(num_new, mesh, jnp.int32))
    # Continuations of `chunk` tokens: every call the same [B, chunk] executable.
    tokens = np.pad(tokens, ((0, 0), (0, -length % chunk)))
    pieces, last = [], None
    for start in range(0, length, chunk):
        n = np.clip(num_new - start, 0, chunk).astype(np.int32)
        if start and not n.any():  # every row's tokens are done: the rest is padding
            break
        piece = _batch_input(tokens[:, start:start + chunk], mesh, jnp.int32)
        logits, state = run(params, state, piece, _batch_input(n, mesh, jnp.int32))
        if return_all_logits:
            pieces.append(logits)
        else:
            last = logits if last is None else _keep_last(last, logits,
                                                          _batch_input(n > 0, mesh, jnp.bool_))
    if not return_all_logits:
        return last, state
    logits = jnp.concatenate(pieces, axis=1)[:, :length]
    if logits.shape[1] < length:  # chunks with no row's tokens: zeros, as for padding
        logits = jnp.pad(logits, ((0, 0), (0, length - logits.shape[1]), (0, 0)))
    return logits, state


def decode_step(params: Params, state: DecodeState, tokens, active=None, *,
                kernels: Kernels | None = None, out=None):
    """Appends one token per row, each at its own position; returns the next-token logits.

    One jitted executable for every step, the state donated; no device read.

    Args:
      params: model weights; on a mesh, placed on the state's mesh.
      state: the current :class:`DecodeState`; donated.
      tokens: [B] int32 token ids (host or device).
      active: optional [B] bool; rows with False are untouched and get zero logits.
      kernels: which kernels run; None: ``choose_kernels(config, B, dtype, mesh)`` for the
        state's device or mesh.
      out: optional [B, V] float32 array, donated, whose buffer receives the logits, typically
        the previous step's logits after their last use (``jd.decode_step(params, state,
        next_tokens(logits), out=logits)``): the step then writes the same device buffer
        every call and XLA replays its recorded command buffer instead of updating it for a
        new output address (host time per call; benchmarks/RESULTS.md). Do not use ``out``
        after the call.

    Returns (logits [B, V] float32, new_state), ``new_state.lengths = state.lengths + active``;
    a row whose cache is full, or given an id outside the vocabulary, is left untouched and gets
    NaN logits. Raises ValueError: :func:`check_decode_step`, :func:`check_logits_out`, or
    params on another mesh than the state. With traced arguments it is
    ``model.decode_step_fn``, inlined (``out`` unused).
    """
    if _traced(params, state, tokens, active):
        return model.decode_step_fn(params, state, jnp.asarray(tokens, jnp.int32),
                                    None if active is None else jnp.asarray(active, bool),
                                    kernels)
    mesh = _check_call(params, state, kernels)
    check_decode_step(params, state, tokens, active)
    if out is not None:
        check_logits_out(out, state, params.config.vocab_size, mesh)
    kernels = resolve_kernels(kernels, params.config, state.batch_size, params.dtype, mesh)
    args = (params, state, _batch_input(tokens, mesh, jnp.int32),
            None if active is None else _batch_input(active, mesh, jnp.bool_))
    mtp = state.mtp is not None
    if out is None:
        return jit_decode_step(params.config, kernels, False, mtp)(*args)
    return jit_decode_step(params.config, kernels, True, mtp)(*args, out)
