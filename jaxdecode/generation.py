"""Generation loops: prefill, then sample and decode until every row stops.

:func:`generate` runs the whole loop on device in one jitted call (a ``lax.scan`` over chunks of
``chunk_size`` tokens; a chunk in which every row has stopped is skipped by a ``lax.cond``).
:func:`generate_stream` runs one jitted chunk at a time and yields its tokens to the host. Both
share one step function, so they give the same tokens for the same key.

A row stops after an ``eos_token_ids`` token or its budget; it is then inactive in
:func:`jaxdecode.model.decode_step_fn` (its state no longer written) and padded with ``pad_id``.
Row ``r`` draws its ``i``-th token with ``fold_in(row_keys(key, rows)[r], i)``, so its tokens do
not depend on the chunking, the mode or the other rows.

Compilation: prompts are padded to a power-of-two length (>= 16), the token buffer to a
power-of-two budget, ``max_len`` to a multiple of 64, so few executables serve many requests.
Sampling values, budgets, keys and up to 8 EOS ids are traced; turning a sampling step on or off
for the whole batch recompiles (:class:`~jaxdecode.sampling.SamplingFeatures`: unused steps are
left out, as a ``lax.cond`` waits for the device on a GPU; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxdecode import sampling as sampling_lib
from jaxdecode import sharding
from jaxdecode.kernels.choice import Kernels, choose_kernels
from jaxdecode.kernels.decode_attention import MAX_LEN_ALIGN
from jaxdecode.model import decode_step_fn, prefill_fn
from jaxdecode.step import COMPILER_OPTIONS
from jaxdecode.params import Params
from jaxdecode.sampling import SamplingFeatures, SamplingParams
from jaxdecode.state import DecodeState, fork, init_state

Array = jax.Array

STOP_RUNNING = 0  # not stopped yet (only seen in streamed chunks)
STOP_EOS = 1  # emitted one of the EOS ids (included in the output)
STOP_LENGTH = 2  # reached its token budget
STOP_REASONS = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_LENGTH: "length"}

MIN_PROMPT_BUCKET = 16
MIN_TOKEN_BUCKET = 16
MAX_EOS_IDS = 8  # EOS id arrays are padded to this many entries (-1 never matches)


@struct.dataclass
class GenerateOutput:
    """Result of :func:`generate` (R = prompts × num_samples rows, N >= the largest budget)."""
    tokens: Array  # [R, N] int32 generated ids, pad_id after each row's last token
    num_generated: Array  # [R] int32 tokens generated per row (an EOS token counts)
    stop_reason: Array  # [R] int32, STOP_EOS or STOP_LENGTH

    def token_lists(self) -> list[list[int]]:
        """Each row's generated ids, without padding (a host sync)."""
        tokens, counts = np.asarray(self.tokens), np.asarray(self.num_generated)
        return [tokens[r, :counts[r]].tolist() for r in range(tokens.shape[0])]

    def stop_reasons(self) -> list[str]:
        """Each row's stop reason as text ("eos" or "length")."""
        return [STOP_REASONS[int(s)] for s in np.asarray(self.stop_reason)]


@struct.dataclass
class LoopState:
    """The carry of the decode loop (every leaf has the rows as axis 0)."""
    state: DecodeState  # prompt + every emitted token but the last
    last_token: Array  # [R] int32, the token to feed next
    num_generated: Array  # [R] int32
    done: Array  # [R] bool
    stop_reason: Array  # [R] int32 (STOP_*)
    budgets: Array  # [R] int32 token budget per row
    keys: Array  # [R] per-row PRNG keys
    token_counts: Array | None  # [R, V] int32 generated-token counts (penalties), or None


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """One chunk yielded by :func:`generate_stream` (host numpy arrays)."""
    tokens: np.ndarray  # [R, n] int32 new ids, pad_id where a row produced nothing
    num_generated: np.ndarray  # [R] int32 tokens generated per row so far
    stop_reason: np.ndarray  # [R] int32, STOP_RUNNING for rows still going


def _record(loop: LoopState, state: DecodeState, token: Array, active: Array,
            eos_token_ids: Array, pad_id: int) -> tuple[LoopState, Array]:
    """Books one sampled token per active row; returns the new carry and the emitted ids."""
    emitted = jnp.where(active, token, pad_id).astype(jnp.int32)
    num_generated = loop.num_generated + active.astype(jnp.int32)
    is_eos = active & jnp.any(token[:, None] == eos_token_ids[None, :], axis=-1)
    spent = active & (num_generated >= loop.budgets)
    stop_reason = jnp.where(is_eos, STOP_EOS, jnp.where(spent, STOP_LENGTH, loop.stop_reason))
    counts = loop.token_counts
    if counts is not None:
        rows = jnp.arange(token.shape[0])
        counts = counts.at[rows, jnp.where(active, token, 0)].add(active.astype(jnp.int32))
    new = LoopState(state=state, last_token=jnp.where(active, token, loop.last_token),
                    num_generated=num_generated, done=loop.done | is_eos | spent,
                    stop_reason=stop_reason.astype(jnp.int32), budgets=loop.budgets,
                    keys=loop.keys, token_counts=counts)
    return new, emitted


def _step_keys(keys: Array, num_generated: Array) -> Array:
    return jax.vmap(jax.random.fold_in)(keys, num_generated)


def start_fn(params: Params, state: DecodeState, prompts: Array, prompt_lengths: Array,
             budgets: Array, sampling: SamplingParams, keys: Array, eos_token_ids: Array, *,
             num_samples: int = 1, track_counts: bool | None = None,
             features: SamplingFeatures | None = None,
             pad_id: int = -1) -> tuple[LoopState, Array]:
    """Prefill, fork, and sample each row's first token.

    Args:
      state: an empty (or continued) state with P = ``prompts.shape[0]`` rows.
      prompts: [P, T] int32, right-padded; prompt_lengths: [P] int32, >= 1.
      budgets: [R] int32 (R = P × num_samples), token budget per output row, >= 1.
      sampling: :class:`SamplingParams` with [R] leaves; keys: [R] per-row PRNG keys.
      eos_token_ids: [E] int32 (entries -1 are ignored); pad_id: for rows that emit nothing.
      num_samples: rows per prompt (``fork``); row ``p * num_samples + j`` continues prompt p.
      track_counts: keep [R, V] generated-token counts for the penalties (else none applies);
        None: ``features.penalties`` when ``features`` is given, else False.
      features: ``features_of(sampling)`` (static): unused steps are left out; None: each step
        is decided on the device by a ``lax.cond``.

    Returns (LoopState, first tokens [R] int32).
    """
    logits, state = prefill_fn(params, state, prompts, prompt_lengths)
    if num_samples > 1:
        state = fork(state, num_samples)
        logits = jnp.repeat(logits, num_samples, axis=0)
    rows, vocab = logits.shape
    if track_counts is None:
        track_counts = features is not None and features.penalties
    counts = jnp.zeros((rows, vocab), jnp.int32) if track_counts else None
    loop = LoopState(state=state, last_token=jnp.zeros((rows,), jnp.int32),
                     num_generated=jnp.zeros((rows,), jnp.int32),
                     done=jnp.zeros((rows,), bool), stop_reason=jnp.zeros((rows,), jnp.int32),
                     budgets=budgets.astype(jnp.int32), keys=keys, token_counts=counts)
    token = sampling_lib.sample(logits, _step_keys(keys, loop.num_generated), sampling, counts,
                                features=features)
    return _record(loop, state, token, jnp.ones((rows,), bool), eos_token_ids, pad_id)


def step_fn(params: Params, loop: LoopState, sampling: SamplingParams, eos_token_ids: Array, *,
            pad_id: int = -1, kernels: Kernels | None = None,
            features: SamplingFeatures | None = None) -> tuple[LoopState, Array]:
    """One decode step for every row still running: feed the last token, sample the next.

    ``features`` as in :func:`start_fn`. Returns (new LoopState, emitted ids [R] int32,
    ``pad_id`` for stopped rows).
    """
    active = ~loop.done
    logits, state = decode_step_fn(params, loop.state, loop.last_token, active, kernels)
    token = sampling_lib.sample(logits, _step_keys(loop.keys, loop.num_generated), sampling,
                                loop.token_counts, features=features)
    return _record(loop, state, token, active, eos_token_ids, pad_id)


def chunk_fn(params: Params, loop: LoopState, sampling: SamplingParams, eos_token_ids: Array, *,
             chunk_size: int, pad_id: int = -1, kernels: Kernels | None = None,
             features: SamplingFeatures | None = None,
             progress: Callable[[np.ndarray], None] | None = None) -> tuple[LoopState, Array]:
    """``chunk_size`` decode steps (a ``lax.scan``), skipped entirely once every row is done.

    ``features`` as in :func:`start_fn`. Returns (new LoopState, emitted ids [R, chunk_size]
    int32). With ``progress``, calls ``progress(num_generated [R])`` on the host after the chunk
    (``jax.debug.callback``).
    """
    def run(loop):
        loop, emitted = lax.scan(
            lambda c, _: step_fn(params, c, sampling, eos_token_ids, pad_id=pad_id,
                                 kernels=kernels, features=features),
            loop, None, length=chunk_size)
        return loop, emitted.T

    def skip(loop):
        return loop, jnp.full((loop.done.shape[0], chunk_size), pad_id, jnp.int32)

    loop, emitted = lax.cond(jnp.all(loop.done), skip, run, loop)
    if progress is not None:
        jax.debug.callback(progress, loop.num_generated)
    return loop, emitted


def generate_fn(params: Params, state: DecodeState, prompts: Array, prompt_lengths: Array,
                budgets: Array, sampling: SamplingParams, keys: Array, eos_token_ids: Array, *,
                max_new_tokens: int, chunk_size: int = 8, num_samples: int = 1,
                track_counts: bool | None = None, features: SamplingFeatures | None = None,
                pad_id: int = -1, kernels: Kernels | None = None,
                progress: Callable[[np.ndarray], None] | None = None
                ) -> tuple[GenerateOutput, LoopState]:
    """The whole generation loop as one pure function (un-jitted, un-validated).

    Args as :func:`start_fn`, plus ``max_new_tokens`` (static): the token buffer length N, at
    least ``max(budgets)``; ``chunk_size`` (static): decode steps per scan iteration.
    Returns (GenerateOutput with [R, N] tokens, final LoopState).
    """
    loop, first = start_fn(params, state, prompts, prompt_lengths, budgets, sampling, keys,
                           eos_token_ids, num_samples=num_samples, track_counts=track_counts,
                           features=features, pad_id=pad_id)
    rows = first.shape[0]
    num_chunks = math.ceil((max_new_tokens - 1) / chunk_size)
    if num_chunks:
        loop, chunks = lax.scan(
            lambda c, _: chunk_fn(params, c, sampling, eos_token_ids, chunk_size=chunk_size,
                                  pad_id=pad_id, kernels=kernels, features=features,
                                  progress=progress),
            loop, None, length=num_chunks)
        rest = jnp.transpose(chunks, (1, 0, 2)).reshape(rows, num_chunks * chunk_size)
        tokens = jnp.concatenate([first[:, None], rest], axis=1)[:, :max_new_tokens]
    else:
        tokens = first[:, None]
    return GenerateOutput(tokens=tokens, num_generated=loop.num_generated,
                          stop_reason=loop.stop_reason), loop


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Validated, bucketed host inputs plus the static arguments of the jitted calls."""
    prompts: np.ndarray  # [P, T_bucket] int32
    prompt_lengths: np.ndarray  # [P] int32
    budgets: np.ndarray  # [R] int32
    sampling: SamplingParams  # [R] leaves
    keys: Array  # [R]
    eos_token_ids: np.ndarray  # [E] int32
    max_len: int
    max_new_tokens: int  # token buffer N (bucketed)
    chunk_size: int
    num_samples: int
    features: SamplingFeatures  # the sampling steps some row uses (static)
    pad_id: int
    kernels: Kernels


def _as_prompt_list(prompts) -> list[list[int]]:
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim == 1:
            raise ValueError(f"prompts must be a batch: a list of token-id lists or a [B, T] "
                             f"array; got a 1-D array of shape {arr.shape} (wrap it in a list)")
        if arr.ndim != 2:
            raise ValueError(f"prompts must be [B, T]; got shape {arr.shape}")
        return [row.tolist() for row in arr]
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be token ids (tokenize text first, see "
                         "jaxdecode.tokenizer)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (int, np.integer)):
            raise ValueError("prompts must be a batch: a list of token-id lists; got a flat list "
                             "of ints (wrap it in a list)")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a 1-D sequence of token ids; got shape "
                             f"{arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids; got dtype {arr.dtype}")
        out.append(arr.astype(np.int64).tolist())
    return out


def _per_row(name: str, value, rows: int, dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 0:
        return np.full((rows,), arr, dtype)
    if arr.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or one value per prompt ({rows}); got shape "
                         f"{arr.shape}")
    return arr.astype(dtype)


def _plan(params: Params, prompts, max_new_tokens, sampling, key, eos_token_ids, *, max_len,
          num_samples, chunk_size, pad_id, kernels, features: SamplingFeatures | None = None
          ) -> _Plan:
    if kernels is not None and not isinstance(kernels, Kernels):
        raise ValueError(f"kernels={kernels!r} must be a jaxdecode.Kernels (or None)")
    config = params.config
    vocab = config.vocab_size
    prompt_list = _as_prompt_list(prompts)
    if not prompt_list:
        raise ValueError("prompts is empty: pass at least one prompt")
    empty = [i for i, p in enumerate(prompt_list) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt(s) {empty} are empty: every prompt needs at least one token")
    for i, p in enumerate(prompt_list):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab}): "
                             f"{bad[:8]}")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{num_samples=} must be a positive int")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be a positive int")
    if not isinstance(pad_id, (int, np.integer)) or not -2**31 <= pad_id < 2**31:
        raise ValueError(f"{pad_id=} must be an int32")
    num_prompts = len(prompt_list)
    rows = num_prompts * num_samples
    budgets = np.asarray(max_new_tokens)
    if budgets.size == 0 or not np.issubdtype(budgets.dtype, np.integer):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int or one int per prompt")
    budgets = _per_row("max_new_tokens", budgets, num_prompts, np.int32)
    if (budgets < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1; got {budgets.tolist()}")
    prompt_lengths = np.array([len(p) for p in prompt_list], np.int32)
    need = prompt_lengths + budgets
    limit = config.max_position_embeddings
    if (need > limit).any():
        i = int(np.argmax(need > limit))
        raise ValueError(f"prompt {i}: {prompt_lengths[i]} prompt tokens + max_new_tokens="
                         f"{budgets[i]} exceeds the model's max_position_embeddings={limit}")
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"{max_len=} must be a positive int")
        max_len = int(max_len)
        if max_len > limit:
            raise ValueError(f"{max_len=} exceeds the model's max_position_embeddings={limit}")
        if (need > max_len).any():
            i = int(np.argmax(need > max_len))
            raise ValueError(f"prompt {i}: {prompt_lengths[i]} prompt tokens + max_new_tokens="
                             f"{budgets[i]} exceeds {max_len=}")
    t_bucket = bucket(int(prompt_lengths.max()), MIN_PROMPT_BUCKET)
    n_bucket = bucket(int(budgets.max()), MIN_TOKEN_BUCKET)
    if max_len is None:  # a multiple of the decode kernel's block, so it never pads the cache
        max_len = min(-(-(t_bucket + n_bucket) // MAX_LEN_ALIGN) * MAX_LEN_ALIGN, limit)
    padded = np.zeros((num_prompts, t_bucket), np.int32)
    for i, p in enumerate(prompt_list):
        padded[i, :len(p)] = p

    if sampling is None:
        sampling = sampling_lib.greedy()
    if _leaf_rows(sampling) == rows != num_prompts:  # already one value per output row
        sampling = sampling.broadcast(rows)
    else:
        sampling = sampling.broadcast(num_prompts).repeat(num_samples)
    sampling = jax.tree.map(np.asarray, sampling)
    sampling_lib.validate(sampling)
    used = sampling_lib.features_of(sampling)
    if features is None:
        features = used
    elif not isinstance(features, SamplingFeatures):
        raise ValueError(f"features={features!r} must be a jaxdecode.sampling.SamplingFeatures")
    else:
        left_out = [f.name for f in dataclasses.fields(used)
                    if getattr(used, f.name) and not getattr(features, f.name)]
        if left_out:
            raise ValueError(f"features={features} leaves out {left_out}, which the sampling "
                             "values use (pass jaxdecode.sampling.ALL_FEATURES or None)")

    if eos_token_ids is None:
        eos_token_ids = config.eos_token_id
    eos = np.atleast_1d(np.asarray(eos_token_ids, np.int64)).ravel()  # an int or a sequence
    bad = eos[(eos < 0) | (eos >= vocab)]
    if bad.size:
        raise ValueError(f"eos_token_ids {bad.tolist()} are outside [0, vocab_size={vocab})")
    eos_padded = np.full((max(MAX_EOS_IDS, bucket(eos.size, 1)),), -1, np.int32)
    eos_padded[:eos.size] = eos

    if key is None:
        key = jax.random.key(0)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        keys = sampling_lib.row_keys(key, rows)
    elif key.shape[0] == rows:
        keys = key
    else:
        raise ValueError(f"key must be one PRNG key or one per output row ({rows}); got "
                         f"{key.shape=}")
    return _Plan(prompts=padded, prompt_lengths=prompt_lengths,
                 budgets=np.repeat(budgets, num_samples), sampling=sampling, keys=keys,
                 eos_token_ids=eos_padded, max_len=int(max_len), max_new_tokens=n_bucket,
                 chunk_size=min(chunk_size, max(n_bucket - 1, 1)), num_samples=num_samples,
                 features=features, pad_id=pad_id,
                 kernels=kernels or choose_kernels(config, rows, dtype=params.dtype,
                                                   mesh=sharding.mesh_of(params)))


def _leaf_rows(sampling: SamplingParams) -> int | None:
    shapes = {np.shape(x) for x in jax.tree.leaves(sampling)}
    if shapes == {()}:
        return None
    sizes = {s[0] for s in shapes if s}
    return sizes.pop() if len(sizes) == 1 else -1


# Dynamic arguments are positional, static ones keywords. pad_id is traced (a fill value), so
# changing it does not recompile.
@functools.partial(jax.jit, static_argnames=("max_len", "max_new_tokens", "chunk_size",
                                             "num_samples", "features", "kernels", "progress"),
                   compiler_options=COMPILER_OPTIONS)
def _generate_jit(params, prompts, prompt_lengths, budgets, sampling, keys, eos_token_ids, pad_id,
                  *, max_len, max_new_tokens, chunk_size, num_samples, features,
                  kernels, progress):
    state = init_state(params.config, prompts.shape[0], max_len, dtype=params.dtype)
    out, _ = generate_fn(params, state, prompts, prompt_lengths, budgets, sampling, keys,
                         eos_token_ids, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                         num_samples=num_samples, features=features, pad_id=pad_id,
                         kernels=kernels, progress=progress)
    return out


@functools.partial(jax.jit, static_argnames=("max_len", "num_samples", "features"),
                   compiler_options=COMPILER_OPTIONS)
def _start_jit(params, prompts, prompt_lengths, budgets, sampling, keys, eos_token_ids, pad_id,
               *, max_len, num_samples, features):
    state = init_state(params.config, prompts.shape[0], max_len, dtype=params.dtype)
    return start_fn(params, state, prompts, prompt_lengths, budgets, sampling, keys,
                    eos_token_ids, num_samples=num_samples, features=features, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("chunk_size", "kernels", "features"),
                   donate_argnames=("loop",), compiler_options=COMPILER_OPTIONS)
def _chunk_jit(params, loop, sampling, eos_token_ids, pad_id, *, chunk_size, kernels,
               features):
    return chunk_fn(params, loop, sampling, eos_token_ids, chunk_size=chunk_size, pad_id=pad_id,
                    kernels=kernels, features=features)


def _start_args(params: Params, plan: _Plan):
    args = (params, plan.prompts, plan.prompt_lengths, plan.budgets, plan.sampling, plan.keys,
            plan.eos_token_ids, np.int32(plan.pad_id))
    return args, dict(max_len=plan.max_len, num_samples=plan.num_samples, features=plan.features)


def _generate_args(params: Params, plan: _Plan, progress):
    args, static = _start_args(params, plan)
    return args, dict(static, max_new_tokens=plan.max_new_tokens, chunk_size=plan.chunk_size,
                      kernels=plan.kernels, progress=progress)


def _chunk_args(params: Params, plan: _Plan, loop):
    args = (params, loop, plan.sampling, plan.eos_token_ids, np.int32(plan.pad_id))
    return args, dict(chunk_size=plan.chunk_size, kernels=plan.kernels, features=plan.features)


@dataclasses.dataclass(frozen=True)
class Executables:
    """Executables compiled ahead of time by :func:`precompile`, keyed by everything ``jit``
    keys on. Passed as ``executables=`` to :func:`generate` / :func:`generate_stream`, a call
    whose signature matches runs them directly, so no tracing or lowering lands in its prefill
    or time to first token; any other call goes through ``jit`` as usual."""
    by_signature: tuple[tuple[tuple, Callable], ...] = ()

    def get(self, signature: tuple):
        """The executable compiled for ``signature``, or None."""
        return dict(self.by_signature).get(signature)


def _signature(fn, args, static) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    avals = tuple((np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False)),
                   getattr(x, "sharding", None)) for x in leaves)
    return fn, treedef, avals, tuple(sorted(static.items(), key=lambda kv: kv[0]))


def _compile(fn, args, static) -> tuple[tuple, Callable]:
    return _signature(fn, args, static), fn.lower(*args, **static).compile()


def _params_sharding(params: Params):
    """Where jit puts outputs computed from single-device params: the params' device."""
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None  # sharded params: the chunk signature will not match; jit compiles on first call


def _call(fn, args, static, executables: Executables | None):
    executable = executables.get(_signature(fn, args, static)) if executables else None
    return executable(*args) if executable is not None else fn(*args, **static)


_DOC_ARGS = """
    Args:
      prompts: a list of token-id lists (ragged) or a [P, T] int array; every prompt non-empty.
      max_new_tokens: token budget (>= 1), an int or one per prompt.
      sampling: :class:`~jaxdecode.sampling.SamplingParams`, scalar, [P] or [P × num_samples]
        leaves; None = greedy.
      key: one PRNG key (row r uses ``fold_in(key, r)``) or one per output row; None = key(0).
      eos_token_ids: ids that stop a row; None = ``params.config.eos_token_id``; () = none.
      max_len: state capacity per row; None = prompt bucket + budget bucket, rounded up to a
        multiple of 64 and capped at ``max_position_embeddings``.
      num_samples: continuations per prompt; row ``p * num_samples + j`` continues prompt ``p``.
      chunk_size: decode steps per jitted chunk / scan iteration; pad_id: written after a stop.
      kernels: the decode steps' kernels; None: ``choose_kernels`` on the params' device or mesh.
      features: the sampling steps compiled in (:class:`~jaxdecode.sampling.SamplingFeatures`);
        None: those the sampling values use; ``ALL_FEATURES``: one executable for every setting.
      executables: from :func:`precompile` for the same arguments (optional).

    Raises:
      ValueError: before any device work, for empty prompts, ids outside ``[0, vocab_size)``,
        a budget < 1, prompt + budget over ``max_len`` or ``max_position_embeddings``, invalid
        sampling values (see :func:`jaxdecode.sampling.validate`), ``features`` leaving out a
        step the sampling values use, a mis-shaped key, or ``kernels`` not a ``Kernels``.
"""


def generate(params: Params, prompts, max_new_tokens=64, sampling: SamplingParams | None = None,
             key=None, eos_token_ids: Sequence[int] | None = None, *, max_len: int | None = None,
             num_samples: int = 1, chunk_size: int = 8, pad_id: int = -1,
             kernels: Kernels | None = None, features: SamplingFeatures | None = None,
             progress: Callable[[np.ndarray], None] | None = None,
             executables: Executables | None = None) -> GenerateOutput:
    """Generates continuations with the whole loop on device (one jitted call, no per-token sync).

    Returns a :class:`GenerateOutput` of device arrays. ``progress``, if given, is called on the
    host after every chunk with ``num_generated [R]`` (a new function object compiles anew).
    """
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, max_len=max_len,
                 num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id,
                 kernels=kernels, features=features)
    args, static = _generate_args(params, plan, progress)
    return _call(_generate_jit, args, static, executables)


def generate_stream(params: Params, prompts, max_new_tokens=64,
                    sampling: SamplingParams | None = None, key=None,
                    eos_token_ids: Sequence[int] | None = None, *, max_len: int | None = None,
                    num_samples: int = 1, chunk_size: int = 1, pad_id: int = -1,
                    kernels: Kernels | None = None, features: SamplingFeatures | None = None,
                    executables: Executables | None = None) -> Iterator[StreamChunk]:
    """Generates continuations, yielding a :class:`StreamChunk` to the host per jitted chunk.

    The first chunk holds each row's first token (prefill + one sample: the time to first token),
    each later one ``chunk_size`` decode steps, until every row has stopped; the same tokens as
    :func:`generate`. Validation happens on the first ``next()``.
    """
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, max_len=max_len,
                 num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id,
                 kernels=kernels, features=features)
    args, static = _start_args(params, plan)
    loop, first = _call(_start_jit, args, static, executables)
    yield _stream_chunk(first[:, None], loop)
    while not bool(np.all(np.asarray(loop.done))):
        loop, emitted = _call(_chunk_jit, *_chunk_args(params, plan, loop), executables)
        yield _stream_chunk(emitted, loop)


def _stream_chunk(emitted, loop: LoopState) -> StreamChunk:
    emitted, counts, stop = jax.device_get((emitted, loop.num_generated, loop.stop_reason))
    return StreamChunk(tokens=np.asarray(emitted), num_generated=np.asarray(counts),
                       stop_reason=np.asarray(stop))


generate.__doc__ += _DOC_ARGS
generate_stream.__doc__ += _DOC_ARGS


def precompile(params: Params, prompts, max_new_tokens=64, sampling: SamplingParams | None = None,
               key=None, eos_token_ids: Sequence[int] | None = None, *, stream: bool = False,
               max_len: int | None = None, num_samples: int = 1, chunk_size: int | None = None,
               pad_id: int = -1, kernels: Kernels | None = None,
               features: SamplingFeatures | None = None,
               progress: Callable[[np.ndarray], None] | None = None) -> Executables:
    """Compiles (without running) what :func:`generate` (or, with ``stream``,
    :func:`generate_stream`) will run for these arguments, so compile time can be timed apart.
    Arguments as those functions; returns :class:`Executables` for their ``executables=``."""
    if chunk_size is None:
        chunk_size = 1 if stream else 8
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, max_len=max_len,
                 num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id,
                 kernels=kernels, features=features)
    if not stream:
        return Executables((_compile(_generate_jit, *_generate_args(params, plan, progress)),))
    args, static = _start_args(params, plan)
    start = _compile(_start_jit, args, static)
    loop_shape = _start_jit.eval_shape(*args, **static)[0]  # top-level: it has compiler_options
    # The chunk's signature is that of the loop _start_jit returns (device arrays).
    loop_like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                       sharding=_params_sharding(params)), loop_shape)
    chunk_args, chunk_static = _chunk_args(params, plan, loop_like)
    return Executables((start, _compile(_chunk_jit, chunk_args, chunk_static)))
