"""Generation loops: prefill, then sample and decode until every row stops.

:func:`generate` runs the whole loop in one jitted call (a ``lax.scan`` over chunks of
``chunk_size`` steps, each skipped by a ``lax.cond`` once every row has stopped),
:func:`generate_stream` one jitted chunk at a time; same step, same tokens: row ``r`` draws its
``i``-th token with ``fold_in(row_keys(key, R)[r], i)``. A stopped row (EOS id, stop sequence,
budget) is inactive in ``decode_step_fn`` and padded with ``pad_id``. Prompts are padded to a
power-of-two length (>= 16), the token buffer to a power of two, ``max_len`` to a multiple of 64;
sampling values, budgets, keys, EOS ids and stop sequences are traced (8 ids, 8 sequences of 8
ids per bucket); a sampling step on or off for the whole batch recompiles (``SamplingFeatures``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxdecode import memory
from jaxdecode import sampling as sampling_lib
from jaxdecode import sharding, speculative
from jaxdecode.inputs import MIN_PROMPT_BUCKET, MIN_TOKEN_BUCKET, bucket, token_lists
from jaxdecode.kernels.choice import Kernels, check_kernels, resolve_kernels
from jaxdecode.kernels.decode_attention import MAX_LEN_ALIGN
from jaxdecode.model import decode_step_fn, prefill_fn
from jaxdecode.params import Params, check_not_traced, check_params
from jaxdecode.sampling import Logprobs, SamplingFeatures, SamplingParams
from jaxdecode.state import DecodeState, fork, init_state
from jaxdecode.stopping import STOP_REASONS, STOP_RUNNING, stop_reason, token_ends
from jaxdecode.step import COMPILER_OPTIONS, check_state, plan_prefill

Array = jax.Array


MAX_EOS_IDS = 8  # EOS id arrays are padded to this many entries (-1 never matches)
MAX_STOP = 8  # stop sequences: padded to >= 8 rows of >= 8 ids, right-aligned, -1 before


@struct.dataclass
class GenerateOutput:
    """Result of :func:`generate` (R = prompts × num_samples rows, N >= the largest budget)."""
    tokens: Array  # [R, N] int32 generated ids, pad_id after each row's last token
    num_generated: Array  # [R] int32 tokens generated per row (EOS and stop tokens count)
    stop_reason: Array  # [R] int32, STOP_EOS, STOP_SEQUENCE, STOP_LENGTH or STOP_INVALID
    state: DecodeState | None = None  # R rows: prompt + all generated (state= or return_state)
    logprobs: Logprobs | None = None  # [R, N] leaves (top ones [R, N, n]): return_logprobs

    def token_lists(self) -> list[list[int]]:
        """Each row's generated ids, without padding (a host sync)."""
        tokens, counts = np.asarray(self.tokens), np.asarray(self.num_generated)
        return [tokens[r, :counts[r]].tolist() for r in range(tokens.shape[0])]

    def stop_reasons(self) -> list[str]:
        """Each row's stop reason as text ("eos", "stop", "length" or "invalid": the model's
        logits were NaN or all -inf, the row's last token is -1)."""
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
    recent: Array | None = None  # [R, L-1] int32 last generated ids (-1: none yet), or None
    prompt_mask: Array | None = None  # [R, V] bool: ids in this call's prompt (penalties)


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """One chunk yielded by :func:`generate_stream` (host numpy arrays)."""
    tokens: np.ndarray  # [R, n] int32 new ids, pad_id where a row produced nothing
    num_generated: np.ndarray  # [R] int32 tokens generated per row so far
    stop_reason: np.ndarray  # [R] int32, STOP_RUNNING for rows still going
    state: DecodeState | None = None  # the last chunk's: the final state, as GenerateOutput's
    logprobs: Logprobs | None = None  # of ``tokens``, [R, n] numpy leaves: return_logprobs


def _record(loop: LoopState, state: DecodeState, token: Array, active: Array,
            eos_token_ids: Array, stop_sequences: Array | None,
            pad_id: int) -> tuple[LoopState, Array]:
    """Books one sampled token per active row; returns the new carry and the emitted ids."""
    num_generated = loop.num_generated + active.astype(jnp.int32)
    ends = token_ends(token[:, None], loop.recent, eos_token_ids, stop_sequences)
    is_invalid, is_eos, is_stop = (active & e[:, 0] for e in ends)
    recent = loop.recent
    if stop_sequences is not None:
        recent = jnp.where(active[:, None], jnp.concatenate([recent, token[:, None]], 1)[:, 1:],
                           recent)
    spent = active & (num_generated >= loop.budgets)
    reason = stop_reason(is_invalid, is_eos, is_stop, spent, loop.stop_reason)
    counts = loop.token_counts
    if counts is not None:
        counted = active & (token >= 0)  # sample gives -1 for a NaN row
        counts = counts.at[jnp.arange(token.shape[0]), jnp.where(counted, token, 0)].add(counted)
    new = loop.replace(state=state, last_token=jnp.where(active, token, loop.last_token),
                       num_generated=num_generated,
                       done=loop.done | is_invalid | is_eos | is_stop | spent,
                       stop_reason=reason, token_counts=counts, recent=recent)
    return new, jnp.where(active, token, pad_id).astype(jnp.int32)


def _emit(ids: Array, logits: Array, processed: Array, token: Array, active: Array,
          pad_id: int, logprobs: int | None):
    """What a step emits: ``ids`` [R], or with ``logprobs`` (the number of top ones) also their
    :class:`Logprobs` (0 and ``pad_id`` for inactive rows)."""
    if logprobs is None:
        return ids
    lp = sampling_lib.token_logprobs(logits, processed, token, logprobs)
    zero = lambda x: jnp.where(active.reshape(-1, *[1] * (x.ndim - 1)), x, 0.0)  # noqa: E731
    return ids, Logprobs(processed=zero(lp.processed), raw=zero(lp.raw),
                         top_ids=jnp.where(active[:, None], lp.top_ids, pad_id),
                         top_logprobs=zero(lp.top_logprobs))


def _step_keys(keys: Array, num_generated: Array) -> Array:
    return jax.vmap(jax.random.fold_in)(keys, num_generated)


def start_fn(params: Params, state: DecodeState, prompts: Array, prompt_lengths: Array,
             budgets: Array, sampling: SamplingParams, keys: Array, eos_token_ids: Array, *,
             stop_sequences: Array | None = None, num_samples: int = 1,
             track_counts: bool | None = None, features: SamplingFeatures | None = None,
             pad_id: int = -1, kernels: Kernels | None = None,
             prefill_chunk_size: int | None = None, query_block: int = 512,
             logprobs: int | None = None) -> tuple[LoopState, Array]:
    """Prefill, fork, and sample each row's first token. Returns (LoopState, tokens [R] int32;
    with ``logprobs``, n >= 0 top ones, (tokens, :class:`Logprobs`)).

    ``state``: P = ``prompts.shape[0]`` rows (empty or not); ``prompts`` [P, T] int32, right-
    padded; ``prompt_lengths`` [P] >= 1; ``budgets`` [R] >= 1 (R = P × num_samples); ``sampling``
    [R] leaves; ``keys`` [R]; ``eos_token_ids`` [E] and ``stop_sequences`` [S, L] (right-aligned)
    int32, -1 = no id; ``num_samples``: rows per prompt (``fork``), row ``p * num_samples + j``
    continues prompt p; ``track_counts``: keep [R, V] token counts and the prompt's ids for the
    penalties (None: ``features.penalties``, False without ``features``); ``features``
    (static): sampling steps compiled in (None: a ``lax.cond`` per step); ``pad_id``: emitted by
    stopped rows; ``kernels`` (its ``batch_invariant``), ``prefill_chunk_size``, ``query_block``:
    ``model.prefill_fn``'s.
    """
    logits, state = prefill_fn(params, state, prompts, prompt_lengths,
                               prefill_chunk_size=prefill_chunk_size, query_block=query_block,
                               kernels=kernels)
    if num_samples > 1:
        state = fork(state, num_samples)
        logits = jnp.repeat(logits, num_samples, axis=0)
    state = _laid_out(state, kernels)
    rows, vocab = logits.shape
    if track_counts is None:
        track_counts = features is not None and features.penalties
    zeros = jnp.zeros((rows,), jnp.int32)
    prompt_mask = None
    if track_counts:
        prompt_mask = sampling_lib.prompt_mask_of(prompts, prompt_lengths, vocab)
        prompt_mask = jnp.repeat(prompt_mask, num_samples, axis=0)
    loop = LoopState(state=state, last_token=zeros, num_generated=zeros,
                     done=jnp.zeros((rows,), bool), stop_reason=zeros,
                     budgets=budgets.astype(jnp.int32), keys=keys,
                     token_counts=jnp.zeros((rows, vocab), jnp.int32) if track_counts else None,
                     recent=None if stop_sequences is None else
                     jnp.full((rows, stop_sequences.shape[1] - 1), -1, jnp.int32),
                     prompt_mask=prompt_mask)
    token, processed = sampling_lib.sample(logits, _step_keys(keys, zeros), sampling,
                                           loop.token_counts, prompt_mask=prompt_mask,
                                           features=features, return_processed_logits=True)
    active = jnp.ones((rows,), bool)
    loop, ids = _record(loop, state, token, active, eos_token_ids, stop_sequences, pad_id)
    return loop, _emit(ids, logits, processed, token, active, pad_id, logprobs)


def _laid_out(state: DecodeState, kernels: Kernels | None) -> DecodeState:
    """On ``kernels.mesh``, ``state`` constrained to the state layout (``sharding.constrain_state``:
    rows over "data"), so that a state created or forked inside the loop's jit is not left to
    propagation, which replicates its rows over "data"; else ``state``."""
    return sharding.constrain_state(state, None if kernels is None else kernels.mesh)


def step_fn(params: Params, loop: LoopState, sampling: SamplingParams, eos_token_ids: Array, *,
            stop_sequences: Array | None = None, pad_id: int = -1,
            kernels: Kernels | None = None, features: SamplingFeatures | None = None,
            logprobs: int | None = None) -> tuple[LoopState, Array]:
    """One decode step of every running row: feed its last token, sample the next. Returns
    (LoopState, emitted ids [R] int32, ``pad_id`` for stopped rows; with ``logprobs`` as
    :func:`start_fn`)."""
    active = ~loop.done
    logits, state = decode_step_fn(params, loop.state, loop.last_token, active, kernels)
    token, processed = sampling_lib.sample(
        logits, _step_keys(loop.keys, loop.num_generated), sampling, loop.token_counts,
        prompt_mask=loop.prompt_mask, features=features, return_processed_logits=True)
    loop, ids = _record(loop, state, token, active, eos_token_ids, stop_sequences, pad_id)
    return loop, _emit(ids, logits, processed, token, active, pad_id, logprobs)


def chunk_fn(params: Params, loop: LoopState, sampling: SamplingParams, eos_token_ids: Array, *,
             chunk_size: int, stop_sequences: Array | None = None, pad_id: int = -1,
             kernels: Kernels | None = None, features: SamplingFeatures | None = None,
             progress: Callable[[np.ndarray], None] | None = None,
             logprobs: int | None = None) -> tuple[LoopState, Array]:
    """``chunk_size`` steps (a ``lax.scan``), skipped once every row is done. Returns
    (LoopState, emitted ids [R, chunk_size], with ``logprobs`` and their :class:`Logprobs`);
    then ``progress(num_generated)`` on the host."""
    def run(loop):
        loop, emitted = lax.scan(
            lambda c, _: step_fn(params, c, sampling, eos_token_ids, pad_id=pad_id,
                                 stop_sequences=stop_sequences, kernels=kernels,
                                 features=features, logprobs=logprobs),
            loop, None, length=chunk_size)
        return loop, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), emitted)

    def skip(loop):
        rows = loop.done.shape[0]
        ids = jnp.full((rows, chunk_size), pad_id, jnp.int32)
        if logprobs is None:
            return loop, ids
        zeros = jnp.zeros((rows, chunk_size), jnp.float32)
        return loop, (ids, Logprobs(
            processed=zeros, raw=zeros,
            top_ids=jnp.full((rows, chunk_size, logprobs), pad_id, jnp.int32),
            top_logprobs=jnp.zeros((rows, chunk_size, logprobs), jnp.float32)))

    loop, emitted = lax.cond(jnp.all(loop.done), skip, run, loop)
    if progress is not None:
        jax.debug.callback(progress, loop.num_generated)
    return loop, emitted


def feed_last_fn(params: Params, state: DecodeState, last_token: Array,
                 kernels: Kernels | None = None) -> DecodeState:
    """Appends ``LoopState.last_token`` (after the loop, each row's one emitted token not in the
    state yet), so the state holds every token; the logits are dropped."""
    return decode_step_fn(params, state, last_token, None, kernels)[1]


def generate_fn(params: Params, state: DecodeState, prompts: Array, prompt_lengths: Array,
                budgets: Array, sampling: SamplingParams, keys: Array, eos_token_ids: Array, *,
                max_new_tokens: int, chunk_size: int = 8, num_samples: int = 1,
                track_counts: bool | None = None, features: SamplingFeatures | None = None,
                pad_id: int = -1, kernels: Kernels | None = None,
                progress: Callable[[np.ndarray], None] | None = None,
                stop_sequences: Array | None = None, return_state: bool = False,
                prefill_chunk_size: int | None = None, query_block: int = 512,
                logprobs: int | None = None) -> tuple[GenerateOutput, LoopState]:
    """The whole loop as one pure function (un-jitted, unvalidated); args as :func:`start_fn`,
    and (static) ``max_new_tokens``: the token buffer N >= ``max(budgets)``; ``chunk_size``:
    steps per scan iteration; ``return_state``: set ``.state`` (:func:`feed_last_fn`);
    ``logprobs``: set ``.logprobs`` with that many top ones (None: not computed).
    Returns (GenerateOutput with [R, N] tokens, final LoopState)."""
    loop, first = start_fn(params, state, prompts, prompt_lengths, budgets, sampling, keys,
                           eos_token_ids, stop_sequences=stop_sequences, num_samples=num_samples,
                           track_counts=track_counts, features=features, pad_id=pad_id,
                           kernels=kernels, prefill_chunk_size=prefill_chunk_size,
                           query_block=query_block, logprobs=logprobs)
    out = jax.tree.map(lambda x: x[:, None], first)  # [R, 1, ...] per leaf
    num_chunks = math.ceil((max_new_tokens - 1) / chunk_size)
    if num_chunks:
        loop, chunks = lax.scan(
            lambda c, _: chunk_fn(params, c, sampling, eos_token_ids, chunk_size=chunk_size,
                                  stop_sequences=stop_sequences, pad_id=pad_id, kernels=kernels,
                                  features=features, progress=progress, logprobs=logprobs),
            loop, None, length=num_chunks)

        def join(head, rest):  # rest [num_chunks, R, chunk, ...] after head [R, 1, ...]
            rest = jnp.swapaxes(rest, 0, 1).reshape(head.shape[0], rest.shape[0] * rest.shape[2],
                                                    *rest.shape[3:])
            return jnp.concatenate([head, rest], axis=1)[:, :max_new_tokens]

        out = jax.tree.map(join, out, chunks)
    tokens, lp = out if logprobs is not None else (out, None)
    final = feed_last_fn(params, loop.state, loop.last_token, kernels) if return_state else None
    return GenerateOutput(tokens=tokens, num_generated=loop.num_generated,
                          stop_reason=loop.stop_reason, state=final, logprobs=lp), loop


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Validated, bucketed host inputs plus the static arguments of the jitted calls."""
    prompts: np.ndarray  # [P, T_bucket] int32
    prompt_lengths: np.ndarray  # [P] int32
    budgets: np.ndarray  # [R] int32
    sampling: SamplingParams  # [R] leaves
    keys: Array  # [R]
    eos_token_ids: np.ndarray  # [E] int32
    stop_sequences: np.ndarray  # [S, L] int32
    max_len: int
    max_new_tokens: int  # token buffer N (bucketed)
    chunk_size: int
    num_samples: int
    features: SamplingFeatures  # the sampling steps some row uses (static)
    pad_id: int
    kernels: Kernels
    return_state: bool
    fork_state: bool  # a given state is forked: the output cannot reuse (donated) its buffers
    prefill: memory.PrefillPlan  # how the prompts' prefill runs (chunks, query block)
    logprobs: int | None = None  # return_logprobs: this many top ones (static), else None


def _plan(params: Params, prompts, max_new_tokens, sampling, key, eos_token_ids, *, max_len,
          num_samples, chunk_size, pad_id, kernels, features: SamplingFeatures | None = None,
          stop_sequences=None, state: DecodeState | None = None, return_state: bool = False,
          prefill_chunk_size: int | None = None, activation_budget: int | None = None,
          return_logprobs: bool = False, top_logprobs: int = 0,
          num_speculative_tokens: int = 0) -> _Plan:
    check_params(params)
    check_not_traced("jd.generate (and generate_stream, precompile)",
                     "generation.generate_fn (padded arrays) or model.decode_step_fn in a "
                     "lax.scan (README: 'Inside your own jit')", params, key, state, sampling)
    check_kernels(kernels)
    config = params.config
    vocab, limit = config.vocab_size, config.max_position_embeddings
    if not isinstance(return_logprobs, (bool, np.bool_)):
        raise ValueError(f"{return_logprobs=} must be a bool")
    if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer))
            or not 0 <= top_logprobs <= vocab):
        raise ValueError(f"{top_logprobs=} must be an int in [0, vocab_size={vocab}]")
    if top_logprobs and not return_logprobs:
        raise ValueError(f"{top_logprobs=} needs return_logprobs=True")
    prompt_list = token_lists(prompts, "prompts", vocab)
    if not prompt_list:
        raise ValueError("prompts is empty: pass at least one prompt")
    for name, value in (("num_samples", num_samples), ("chunk_size", chunk_size)):
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int")
    num_samples, chunk_size = int(num_samples), int(chunk_size)
    if not isinstance(pad_id, (int, np.integer)) or not -2**31 <= pad_id < 2**31:
        raise ValueError(f"{pad_id=} must be an int32")
    num_prompts = len(prompt_list)
    rows = num_prompts * num_samples
    budgets = np.asarray(max_new_tokens)
    if not np.issubdtype(budgets.dtype, np.integer) or budgets.shape not in ((), (num_prompts,)):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int or one value per "
                         f"prompt ({num_prompts})")
    budgets = np.broadcast_to(budgets, (num_prompts,)).astype(np.int64)  # int32 once in range
    if (budgets < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1; got {budgets.tolist()}")
    prompt_lengths = np.array([len(p) for p in prompt_list], np.int32)
    cached = np.zeros(num_prompts, np.int64)
    if state is not None:
        check_state(config, state, params.dtype)
        sharding.check_params_on(params, sharding.mesh_of(state))
        if state.batch_size != num_prompts:
            raise ValueError(f"state has {state.batch_size} rows but there are {num_prompts} "
                             "prompts (the new tokens of each row)")
        if max_len is not None:
            raise ValueError("pass max_len or state, not both (state.max_len is the capacity)")
        if getattr(state.lengths, "is_fully_addressable", True):  # else over several processes
            cached = np.asarray(jnp.copy(state.lengths)).astype(np.int64)  # a copy: it is donated
        max_len = state.max_len
    elif max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"{max_len=} must be a positive int")
        if max_len > limit:
            raise ValueError(f"{max_len=} exceeds the model's max_position_embeddings={limit}")
    # a speculative verify step's k tokens of cache room past the budget
    extra = num_speculative_tokens
    why = f"num_speculative_tokens={extra} (the verify step's room)"
    need = cached + prompt_lengths + budgets + extra
    for cap, what in ((limit, "the model's max_position_embeddings"), (max_len, "max_len")):
        if cap is not None and (need > cap).any():
            i = int(np.argmax(need > cap))
            pre = f"{cached[i]} cached + " if state is not None else ""
            raise ValueError(f"prompt {i}: {pre}{prompt_lengths[i]} prompt tokens + "
                             f"max_new_tokens={budgets[i]}{f' + {why}' if extra else ''} "
                             f"exceeds {what}={cap}")
    budgets = budgets.astype(np.int32)  # <= max_position_embeddings (checked above)
    t_bucket = bucket(int(prompt_lengths.max()), MIN_PROMPT_BUCKET)
    n_bucket = bucket(int(budgets.max()), MIN_TOKEN_BUCKET)
    if max_len is None:  # a multiple of the decode kernel's block, so it never pads the cache
        max_len = min(-(-(t_bucket + n_bucket + extra) // MAX_LEN_ALIGN) * MAX_LEN_ALIGN, limit)
    padded = np.zeros((num_prompts, t_bucket), np.int32)
    for i, p in enumerate(prompt_list):
        padded[i, :len(p)] = p

    sampling = sampling_lib.greedy() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a jaxdecode.SamplingParams (or None: greedy); got "
                         f"{type(sampling).__name__}")
    firsts = {np.shape(x)[:1] for x in jax.tree.leaves(sampling)} - {()}
    if not (firsts <= {(rows,)} or firsts <= {(num_prompts,)}):
        per_row = (f" or [{rows}] (one per output row: prompts x num_samples)"
                   if rows != num_prompts else "")
        raise ValueError(f"sampling leaves must be scalars or [{num_prompts}] (one value per "
                         f"prompt){per_row}; got lengths {sorted(f[0] for f in firsts)}")
    if firsts == {(rows,)} and rows != num_prompts:  # already one value per output row
        sampling = sampling.broadcast(rows)
    else:
        sampling = sampling.broadcast(num_prompts).repeat(num_samples)
    sampling = jax.tree.map(np.asarray, sampling)
    sampling_lib.validate(sampling)
    used = sampling_lib.features_of(sampling)
    if features is not None and not isinstance(features, SamplingFeatures):
        raise ValueError(f"features={features!r} must be a jaxdecode.sampling.SamplingFeatures")
    features = features or used
    left_out = [f.name for f in dataclasses.fields(used)
                if getattr(used, f.name) and not getattr(features, f.name)]
    if left_out:
        raise ValueError(f"features={features} leaves out {left_out}, which the sampling values "
                         "use (pass jaxdecode.sampling.ALL_FEATURES or None)")

    raw = config.eos_token_id if eos_token_ids is None else eos_token_ids  # int or sequence
    try:
        eos = np.atleast_1d(np.asarray(raw))
    except ValueError:  # ragged nesting
        eos = np.asarray([raw], object)
    if eos.ndim != 1 or (eos.size and not np.issubdtype(eos.dtype, np.integer)):
        raise ValueError(f"eos_token_ids={eos_token_ids!r} must be an int or a flat sequence of "
                         "ints (a stop of several tokens: stop_sequences)")
    bad = eos[(eos < 0) | (eos >= vocab)] if eos.size else eos
    if bad.size:
        given = ("" if eos_token_ids is not None else
                 " (eos_token_ids=None: the config's eos_token_id; pass eos_token_ids=() for none)")
        raise ValueError(f"eos_token_ids {bad.tolist()} are outside [0, vocab_size={vocab})"
                         + given)
    eos = eos.astype(np.int64)
    eos_padded = np.full((max(MAX_EOS_IDS, bucket(eos.size, 1)),), -1, np.int32)
    eos_padded[:eos.size] = eos
    stops = token_lists(() if stop_sequences is None else stop_sequences, "stop_sequences",
                         vocab)
    width = max([MAX_STOP] + [bucket(len(s), 1) for s in stops])
    stop_padded = np.full((max(MAX_STOP, bucket(len(stops), 1)), width), -1, np.int32)
    for i, s in enumerate(stops):
        stop_padded[i, width - len(s):] = s

    mesh = sharding.mesh_of(params)
    key = jax.random.key(0) if key is None else key
    key = key if isinstance(key, jax.Array) else jnp.asarray(key)
    key = sharding.onto_devices_of(key, params)  # e.g. a key committed to another device
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and (key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2):
        raise ValueError(f"key must be a PRNG key (jax.random.key(seed)) or one per output row "
                         f"({rows}); got {key.dtype} {key.shape}")
    if key.ndim == (0 if typed else 1):
        key = sampling_lib.row_keys(key, rows)
    elif key.ndim != (1 if typed else 2) or key.shape[0] != rows:
        raise ValueError(f"key must be one PRNG key or one per output row ({rows}); got "
                         f"{key.shape=}")
    kernels = resolve_kernels(kernels, config, rows, params.dtype, mesh)
    # Memory, before any device work: the new state, the forked one (with the MTP layer's
    # pairs for speculative decoding or where the given state keeps them), the prefill's
    # activations.
    made = [(n, what) for n, what, new in ((num_prompts, "prompt", state is None),
                                           (rows, "sample (forked)", num_samples > 1)) if new]
    new_rows = [n for n, _ in made]
    mtp = bool(num_speculative_tokens) or (state is not None and state.mtp is not None)
    memory.check_fits(f"generate's state ({' + '.join(f'{n} {what}' for n, what in made)} rows "
                      f"x {max_len} positions)"
                      + (" with the MTP layer's pairs" if mtp else ""),
                      sum(memory.state_bytes(config, n, int(max_len), params.dtype, mtp=mtp)
                          // sharding.state_spread(n, mesh) for n in new_rows),
                      None if mesh is None else mesh.devices.flat[0])
    prefill = plan_prefill(params, num_prompts, t_bucket, int(max_len), mesh=mesh,
                           prefill_chunk_size=prefill_chunk_size,
                           activation_budget=activation_budget, kernels=kernels)
    return _Plan(prompts=padded, prompt_lengths=prompt_lengths,
                 budgets=np.repeat(budgets, num_samples), sampling=sampling, keys=key,
                 eos_token_ids=eos_padded, stop_sequences=stop_padded, max_len=int(max_len),
                 max_new_tokens=n_bucket, chunk_size=min(chunk_size, max(n_bucket - 1, 1)),
                 num_samples=num_samples, features=features, pad_id=pad_id, kernels=kernels,
                 return_state=bool(return_state) or state is not None,
                 fork_state=state is not None and num_samples > 1, prefill=prefill,
                 logprobs=int(top_logprobs) if return_logprobs else None)


def _run(params, state, prompts, prompt_lengths, budgets, sampling, keys, eos_token_ids,
         stop_sequences, pad_id, *, max_len, num_samples, features, kernels, prefill_chunk_size,
         query_block, logprobs, **loop):
    """:func:`start_fn`, or with ``loop``'s statics :func:`generate_fn`, on ``state`` or a new one
    (None). Dynamic arguments positional, static ones keywords; pad_id is traced (a fill value)."""
    if state is None:  # its memory was checked by _plan
        state = _laid_out(init_state(params.config, prompts.shape[0], max_len, params.dtype,
                                     check_memory=False), kernels)
    args = (params, state, prompts, prompt_lengths, budgets, sampling, keys, eos_token_ids)
    kw = dict(stop_sequences=stop_sequences, num_samples=num_samples, features=features,
              pad_id=pad_id, kernels=kernels, prefill_chunk_size=prefill_chunk_size,
              query_block=query_block, logprobs=logprobs)
    return generate_fn(*args, **kw, **loop)[0] if loop else start_fn(*args, **kw)


# Two of each: one donating the state, one not, for a forked state (jit would warn).
_STATIC = ("max_len", "num_samples", "features", "max_new_tokens", "chunk_size", "kernels",
           "progress", "return_state", "prefill_chunk_size", "query_block", "logprobs")
_generate_jit, _fork_jit = (jax.jit(_run, static_argnames=_STATIC, donate_argnames=donate,
                                    compiler_options=COMPILER_OPTIONS)
                            for donate in (("state",), ()))
_start_jit = _generate_jit  # called without the loop's statics: start_fn


@functools.partial(jax.jit, static_argnames=("chunk_size", "kernels", "features", "logprobs"),
                   donate_argnames=("loop",), compiler_options=COMPILER_OPTIONS)
def _chunk_jit(params, loop, sampling, eos_token_ids, stop_sequences, pad_id, *, chunk_size,
               kernels, features, logprobs):
    return chunk_fn(params, loop, sampling, eos_token_ids, chunk_size=chunk_size, pad_id=pad_id,
                    stop_sequences=stop_sequences, kernels=kernels, features=features,
                    logprobs=logprobs)


_feed_last_jit = jax.jit(feed_last_fn, static_argnames=("kernels",), donate_argnames=("state",),
                         compiler_options=COMPILER_OPTIONS)

# The library's options, plus while loops and conditionals inside command buffers (CUDA graph
# conditional nodes; the rest is XLA 0.11.2's default list): the speculative loop's condition
# depends on each step's accepted counts, which the host would otherwise read back before
# launching every iteration (measured in benchmarks/RESULTS.md).
SPECULATIVE_COMPILER_OPTIONS = types.MappingProxyType({
    **COMPILER_OPTIONS,
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"})

def _speculative_state(params: Params, state: DecodeState | None, rows: int, max_len: int | None,
                       kernels: Kernels | None) -> DecodeState:
    """``state``, or (None) a new one of ``rows`` x ``max_len`` keeping MTP pairs, in the state
    layout (its memory was checked by ``_plan``)."""
    if state is not None:
        return state
    return _laid_out(init_state(params.config, rows, max_len, params.dtype, mtp=True,
                                check_memory=False), kernels)


def _speculative_generate(params, state, prompts, prompt_lengths, budgets, eos_ids, pad_id,
                          sampling=None, keys=None, draft_vocab=None, stop_sequences=None, *,
                          max_len=None, **static):
    """:func:`speculative.speculative_generate_fn` on ``state``, or (None) on a new state of
    ``max_len`` made inside the call (arrays positional: ``precompile``'s signatures)."""
    state = _speculative_state(params, state, prompts.shape[0], max_len, static.get("kernels"))
    return speculative.speculative_generate_fn(
        params, state, prompts, prompt_lengths, budgets, eos_ids, pad_id, sampling, keys,
        draft_vocab=draft_vocab, stop_sequences=stop_sequences, **static)


speculative_generate_jit = jax.jit(
    _speculative_generate,
    static_argnames=("num_speculative_tokens", "max_new_tokens", "features", "kernels",
                     "prefill_chunk_size", "query_block", "draft", "logprobs", "return_state",
                     "progress", "progress_every", "max_len"),
    donate_argnames=("state",), compiler_options=SPECULATIVE_COMPILER_OPTIONS)


def _speculative_start(params, state, prompts, prompt_lengths, budgets, eos_ids, pad_id,
                       sampling, keys, stop_sequences, *, max_len, max_new_tokens, features,
                       kernels, prefill_chunk_size, query_block, logprobs):
    """:func:`speculative.speculative_start_fn` (on a new state where ``state`` is None), and
    the first token each row emitted ([R, 1] with its log-probabilities: a stream's first
    chunk)."""
    state = _speculative_state(params, state, prompts.shape[0], max_len, kernels)
    loop = speculative.speculative_start_fn(
        params, state, prompts, prompt_lengths, budgets, eos_ids, pad_id, sampling, keys,
        stop_sequences=stop_sequences, max_new_tokens=max_new_tokens, features=features,
        kernels=kernels, prefill_chunk_size=prefill_chunk_size, query_block=query_block,
        logprobs=logprobs)
    return loop, speculative.emitted_since(loop, jnp.zeros_like(loop.num_generated), 1, pad_id)


def _speculative_chunk(params, loop, budgets, eos_ids, pad_id, sampling, keys, head, draft_vocab,
                       stop_sequences, **static):
    """:func:`speculative.speculative_chunk_fn`, its arrays positional."""
    return speculative.speculative_chunk_fn(params, loop, budgets, eos_ids, pad_id, sampling,
                                            keys, head, draft_vocab=draft_vocab,
                                            stop_sequences=stop_sequences, **static)


# generate_stream's speculative calls: the start (donating the state), then chunks of verify
# steps (donating the loop), their loops in command buffers as speculative_generate_jit's
speculative_start_jit = jax.jit(
    _speculative_start, static_argnames=("max_len", "max_new_tokens", "features", "kernels",
                                         "prefill_chunk_size", "query_block", "logprobs"),
    donate_argnames=("state",), compiler_options=COMPILER_OPTIONS)
speculative_chunk_jit = jax.jit(
    _speculative_chunk,
    static_argnames=("num_speculative_tokens", "chunk_size", "features", "kernels", "logprobs"),
    donate_argnames=("loop",), compiler_options=SPECULATIVE_COMPILER_OPTIONS)
_draft_head_jit = jax.jit(speculative.draft_head)


def _start_args(params: Params, plan: _Plan, state: DecodeState | None = None):
    args = (params, state, plan.prompts, plan.prompt_lengths, plan.budgets, plan.sampling,
            plan.keys, plan.eos_token_ids, plan.stop_sequences, np.int32(plan.pad_id))
    return args, dict(max_len=plan.max_len, num_samples=plan.num_samples, features=plan.features,
                      kernels=plan.kernels, prefill_chunk_size=plan.prefill.prefill_chunk_size,
                      query_block=plan.prefill.query_block, logprobs=plan.logprobs)


def _generate_args(params: Params, plan: _Plan, progress, state: DecodeState | None = None):
    args, static = _start_args(params, plan, state)
    return args, dict(static, max_new_tokens=plan.max_new_tokens, chunk_size=plan.chunk_size,
                      progress=progress, return_state=plan.return_state)


def _chunk_args(params: Params, plan: _Plan, loop):
    args = (params, loop, plan.sampling, plan.eos_token_ids, plan.stop_sequences,
            np.int32(plan.pad_id))
    return args, dict(chunk_size=plan.chunk_size, kernels=plan.kernels, features=plan.features,
                      logprobs=plan.logprobs)


@dataclasses.dataclass(frozen=True)
class Executables:
    """Executables compiled by :func:`precompile`, keyed by what ``jit`` keys on. A call given
    them (``executables=``) runs the one matching its signature directly, with no tracing or
    lowering in its time to first token; any other goes through ``jit``."""
    by_signature: tuple[tuple[tuple, Callable], ...] = ()


def _signature(fn, args, static) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    avals = tuple((np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False)),
                   getattr(x, "sharding", None)) for x in leaves)
    return fn, treedef, avals, tuple(sorted(static.items(), key=lambda kv: kv[0]))


def _compile(fn, args, static) -> tuple[tuple, Callable]:
    return _signature(fn, args, static), fn.lower(*args, **static).compile()


def _call(fn, args, static, executables: Executables | None):
    found = executables and dict(executables.by_signature).get(_signature(fn, args, static))
    return found(*args) if found else fn(*args, **static)


_DOC_ARGS = """
    Args:
      prompts: a list of token-id lists (ragged) or a [P, T] int array whose rows are taken
        whole (no padding: pass a list for ragged prompts); every prompt non-empty.
      max_new_tokens: token budget (>= 1), an int or one per prompt.
      sampling: :class:`~jaxdecode.sampling.SamplingParams`, scalar, [P] or [P × num_samples]
        leaves; None = greedy. The repetition penalty's prompt (``penalize_prompt``) is the
        prompt of this call: with ``state=``, the new tokens (the state holds no ids).
      key: one PRNG key (row r uses ``fold_in(key, r)``) or one per output row; None = key(0).
      eos_token_ids: ids that stop a row; None = ``params.config.eos_token_id`` (from a
        checkpoint: ``generation_config.json``'s, as HF ``generate``); () = none.
      stop_sequences: id sequences (``[[13, 198], [151645]]``): a row stops right after it
        generates one (only tokens it generated in this call match), kept in its output, reason
        "stop" (an EOS id ending it: "eos").
      state: a :class:`~jaxdecode.DecodeState` with P rows to continue (from ``jd.prefill`` or
        an earlier ``.state``), donated: the prompts are appended to its rows (>= 1 token each;
        it holds no logits), its ``max_len`` is the capacity; with ``num_samples`` > 1 forked
        after them (speculative: before) and not donated. None: a new state.
      return_state: return the final state (``.state``) also without ``state=``. It holds each
        output row's prompt and every token it generated, the last included (one extra decode
        step): ``lengths = lengths before + prompt lengths + num_generated``; to continue pass
        the next tokens only, and a new key (each call draws from token 0 of its key).
      max_len: state capacity per row; None = prompt bucket + budget bucket, rounded up to a
        multiple of 64 and capped at ``max_position_embeddings``.
      num_samples: continuations per prompt; row ``p * num_samples + j`` continues prompt ``p``.
      chunk_size: decode steps per jitted chunk / scan iteration; pad_id: written after a stop.
      kernels: the decode steps' kernels; None: ``choose_kernels`` on the params' device or mesh
        (``choose_kernels(..., batch_invariant=True)``: each row computed the same whatever
        else is in the batch, for one ``max_len``: ``Kernels.batch_invariant``); kernels
        without a mesh run on the params' (``kernels.choice.for_mesh``). With params on a mesh
        the rows split over "data" where they divide it, else run whole on each data group.
      prefill_chunk_size, activation_budget: the prompts' prefill in chunks (as
        :func:`jaxdecode.prefill`, inside the one jitted call).
      return_logprobs: also return each generated token's log-probabilities (``.logprobs``, a
        :class:`~jaxdecode.sampling.Logprobs`: under the distribution it was drawn from and
        under the model's), computed in the loop (no host sync; off, nothing is computed).
      top_logprobs: with ``return_logprobs``, also the n most likely ids and their raw
        log-probabilities at each step (0-vocab_size; a static: each n compiles once).
      features: the sampling steps compiled in (:class:`~jaxdecode.sampling.SamplingFeatures`);
        None: those the sampling values use; ``ALL_FEATURES``: one executable for every setting.
      executables: from :func:`precompile` for the same arguments (optional).

    Raises:
      ValueError: before any device work, for empty prompts or stop sequences, ids outside
        ``[0, vocab_size)``, a budget < 1, (cached +) prompt + budget over ``max_len`` or
        ``max_position_embeddings``, invalid sampling values (:func:`~jaxdecode.sampling.
        validate`), ``features`` leaving out a step they use, a mis-shaped key, params not
        ``Params``, ``kernels`` not a ``Kernels`` or of another mesh, ``top_logprobs`` outside
        [0, vocab_size] or without ``return_logprobs``, a state that is not a ``DecodeState``
        or is of another config, dtype, mesh or row count (``state.lengths`` is read once),
        both ``state`` and ``max_len``, or a state or prefill that cannot fit in the device's
        free memory (the bytes named).
"""


def _speculative(num_speculative_tokens, draft_vocab) -> bool:
    """Whether a call decodes speculatively: anything but an int 0 (numpy's too) for
    ``num_speculative_tokens`` (checked later); ValueError for a ``draft_vocab`` without it."""
    off = (isinstance(num_speculative_tokens, (int, np.integer))
           and not isinstance(num_speculative_tokens, (bool, np.bool_))
           and num_speculative_tokens == 0)
    if draft_vocab is not None and off:
        raise ValueError("draft_vocab applies to speculative decoding: pass "
                         "num_speculative_tokens > 0 with it")
    return not off


def generate(params: Params, prompts, max_new_tokens=64, sampling: SamplingParams | None = None,
             key=None, eos_token_ids: Sequence[int] | None = None, *,
             stop_sequences: Sequence[Sequence[int]] | None = None,
             state: DecodeState | None = None, return_state: bool = False,
             max_len: int | None = None, num_samples: int = 1, chunk_size: int = 8,
             pad_id: int = -1, kernels: Kernels | None = None,
             features: SamplingFeatures | None = None,
             progress: Callable[[np.ndarray], None] | None = None,
             executables: Executables | None = None, prefill_chunk_size: int | None = None,
             activation_budget: int | None = None, return_logprobs: bool = False,
             top_logprobs: int = 0, num_speculative_tokens: int = 0,
             draft_vocab=None) -> GenerateOutput:
    """Generates continuations with the whole loop on device (one jitted call, no per-token sync).

    Returns a :class:`GenerateOutput` of device arrays. ``progress``, if given, is called on the
    host after every chunk with ``num_generated [R]`` (a new function object compiles anew).
    ``num_speculative_tokens`` k in [1, 16]: speculative decoding with the params' MTP layer
    (``load_checkpoint(..., mtp=True)``; ``jaxdecode.speculative``): greedy rows give the same
    tokens as plain greedy decoding, sampled rows the same distribution (other draws);
    ``max_len`` then needs room for k more tokens; log-probabilities as plain decoding's (from
    the verify step's logits); ``num_samples`` rows prefilled apart; a ``state`` must keep the
    MTP layer's pairs (``init_state(..., mtp=True)``; ValueError otherwise), and the MTP then
    drafts from every token in it; ``progress`` is called every ``chunk_size`` verify steps;
    penalties apply as in plain decoding (each verified position counts the drafts before it;
    the drafts themselves are proposed without them); :func:`precompile` takes it. Not yet
    together with ``batch_invariant`` kernels (ValueError).
    ``draft_vocab``: token ids [V'] the drafts are chosen from (``jaxdecode.speculative``: a
    cheaper draft, the same output; distinct ids in [0, vocab_size), else ValueError; only with
    ``num_speculative_tokens``).
    """
    if _speculative(num_speculative_tokens, draft_vocab):
        return _generate_speculative(
            params, prompts, max_new_tokens, sampling, key, eos_token_ids, num_speculative_tokens,
            stop_sequences=stop_sequences, state=state, return_state=return_state,
            max_len=max_len, num_samples=num_samples, pad_id=pad_id, kernels=kernels,
            progress=progress, executables=executables, prefill_chunk_size=prefill_chunk_size,
            activation_budget=activation_budget, return_logprobs=return_logprobs,
            top_logprobs=top_logprobs, chunk_size=chunk_size, features=features,
            draft_vocab=draft_vocab)
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, max_len=max_len,
                 num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id, kernels=kernels,
                 features=features, stop_sequences=stop_sequences, state=state,
                 return_state=return_state, prefill_chunk_size=prefill_chunk_size,
                 activation_budget=activation_budget, return_logprobs=return_logprobs,
                 top_logprobs=top_logprobs)
    fn = _fork_jit if plan.fork_state else _generate_jit
    return _call(fn, *_generate_args(params, plan, progress, state), executables)


def _speculative_plan(params: Params, prompts, max_new_tokens, sampling, key, eos_token_ids, k,
                      *, chunk_size, state=None, stop_sequences=None, return_state=False,
                      max_len=None, num_samples=1, pad_id=-1, kernels=None,
                      prefill_chunk_size=None, activation_budget=None, return_logprobs=False,
                      top_logprobs=0, features=None, draft_vocab=None, abstract: bool = False
                      ) -> tuple[_Plan, DecodeState | None, Array | None]:
    """The checks and plan of :func:`generate` / :func:`generate_stream` /
    :func:`precompile` with ``num_speculative_tokens=k`` (keyword defaults: ``generate``'s):
    (plan, the state to donate to the loop, None for a new one made inside it; draft_vocab as a
    device array or None). A given state with ``num_samples`` > 1 is forked here (``abstract``:
    its shape only)."""
    check_params(params)
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"num_speculative_tokens={k!r} must be a positive int (0: off)")
    if k > speculative.MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={k} is more than "
                         f"{speculative.MAX_SPECULATIVE_TOKENS} (each draft is one more MTP pass "
                         "compiled into the loop)")
    if params.mtp is None:
        raise ValueError("num_speculative_tokens needs the MTP layer: load the checkpoint with "
                         "jd.load_checkpoint(path, mtp=True)")
    # the verify step runs rows batched: a row's logits could depend on the batch
    if kernels is not None and kernels.batch_invariant:
        raise ValueError("num_speculative_tokens does not yet work with "
                         "['kernels.batch_invariant']")
    if isinstance(state, DecodeState) and state.mtp is None:
        raise ValueError("num_speculative_tokens continues a state only if it keeps the MTP "
                         "layer's pairs: make it with jd.init_state(..., mtp=True) (prefill, "
                         "decode_step and generate then keep them)")
    if draft_vocab is not None:
        draft_vocab = speculative.check_draft_vocab(draft_vocab, params.config.vocab_size)
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids,
                 max_len=max_len, num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id,
                 kernels=kernels, features=features, prefill_chunk_size=prefill_chunk_size,
                 activation_budget=activation_budget, stop_sequences=stop_sequences,
                 return_logprobs=return_logprobs, top_logprobs=top_logprobs, state=state,
                 return_state=return_state,
                 num_speculative_tokens=int(k))
    # num_samples: each prompt's rows prefilled apart (row p * n + j is prompt p's j-th
    # sample), so the prefill's chunks are planned for all rows
    n, mesh = plan.num_samples, sharding.mesh_of(params)
    if n > 1:
        plan = dataclasses.replace(plan, prefill=plan_prefill(
            params, len(plan.budgets), plan.prompts.shape[1], plan.max_len, mesh=mesh,
            prefill_chunk_size=prefill_chunk_size, activation_budget=activation_budget,
            kernels=plan.kernels))
    if state is not None and n > 1:  # each prompt's rows continue its row (``state`` kept)
        forked = lambda state: sharding.constrain_state(fork(state, n), mesh)  # noqa: E731
        state = (_abstract_on(jax.eval_shape(forked, state), _device_of(params)) if abstract
                 else forked(state))
    return plan, state, draft_vocab


def _speculative_args(params: Params, plan: _Plan, state: DecodeState | None) -> tuple:
    """The loop's dynamic start arguments, each prompt repeated for its samples: (params, state,
    prompts, prompt_lengths, budgets, eos_ids, pad_id, sampling, keys)."""
    n = plan.num_samples
    return (params, state, jnp.asarray(np.repeat(plan.prompts, n, axis=0)),
            jnp.asarray(np.repeat(plan.prompt_lengths, n, axis=0)), jnp.asarray(plan.budgets),
            jnp.asarray(plan.eos_token_ids), np.int32(plan.pad_id), plan.sampling, plan.keys)


def _speculative_generate_args(params, plan, state, draft_vocab, k, progress):
    args = (*_speculative_args(params, plan, state), draft_vocab,
            jnp.asarray(plan.stop_sequences))
    return args, dict(max_len=plan.max_len, features=plan.features, num_speculative_tokens=int(k),
                      max_new_tokens=plan.max_new_tokens, kernels=plan.kernels,
                      prefill_chunk_size=plan.prefill.prefill_chunk_size,
                      query_block=plan.prefill.query_block, logprobs=plan.logprobs,
                      return_state=plan.return_state, progress=progress,
                      progress_every=plan.chunk_size)


def _speculative_start_args(params, plan, state):
    args = (*_speculative_args(params, plan, state), jnp.asarray(plan.stop_sequences))
    return args, dict(max_len=plan.max_len, max_new_tokens=plan.max_new_tokens,
                      features=plan.features, kernels=plan.kernels,
                      prefill_chunk_size=plan.prefill.prefill_chunk_size,
                      query_block=plan.prefill.query_block, logprobs=plan.logprobs)


def _speculative_chunk_args(params, plan, loop, start_args, head, draft_vocab, k):
    _, _, _, _, budgets, eos_ids, pad_id, sampling, keys, stop_sequences = start_args
    return ((params, loop, budgets, eos_ids, pad_id, sampling, keys, head, draft_vocab,
             stop_sequences),
            dict(num_speculative_tokens=int(k), chunk_size=plan.chunk_size,
                 features=plan.features, kernels=plan.kernels, logprobs=plan.logprobs))


def _generate_speculative(params: Params, prompts, max_new_tokens, sampling, key, eos_token_ids,
                          k, *, progress, executables, **kwargs) -> GenerateOutput:
    """:func:`generate` with ``num_speculative_tokens=k`` (checks, then
    ``speculative.speculative_generate_fn`` in one jitted call)."""
    plan, state, draft_vocab = _speculative_plan(params, prompts, max_new_tokens, sampling, key,
                                                 eos_token_ids, k, **kwargs)
    loop = _call(speculative_generate_jit,
                 *_speculative_generate_args(params, plan, state, draft_vocab, k, progress),
                 executables)
    return GenerateOutput(tokens=loop.tokens, num_generated=loop.num_generated,
                          stop_reason=loop.stop_reason, logprobs=loop.logprobs,
                          state=loop.state if plan.return_state else None)


def _stream_speculative(params: Params, prompts, max_new_tokens, sampling, key, eos_token_ids,
                        k, *, executables, **kwargs) -> Iterator[StreamChunk]:
    """:func:`generate_stream` with ``num_speculative_tokens=k``: the loop's start, then chunks
    of ``chunk_size`` verify steps, each yielding the tokens its rows emitted."""
    plan, state, draft_vocab = _speculative_plan(params, prompts, max_new_tokens, sampling, key,
                                                 eos_token_ids, k, **kwargs)
    args, static = _speculative_start_args(params, plan, state)
    loop, emitted = _call(speculative_start_jit, args, static, executables)
    head = (None if draft_vocab is None
            else _call(_draft_head_jit, (params, draft_vocab), {}, executables))
    yield from _chunks(params, plan, loop, emitted, lambda loop: loop.last,
                       lambda loop: _call(speculative_chunk_jit, *_speculative_chunk_args(
                           params, plan, loop, args, head, draft_vocab, k), executables),
                       executables)


def generate_stream(params: Params, prompts, max_new_tokens=64,
                    sampling: SamplingParams | None = None, key=None,
                    eos_token_ids: Sequence[int] | None = None, *,
                    stop_sequences: Sequence[Sequence[int]] | None = None,
                    state: DecodeState | None = None, return_state: bool = False,
                    max_len: int | None = None, num_samples: int = 1, chunk_size: int = 1,
                    pad_id: int = -1, kernels: Kernels | None = None,
                    features: SamplingFeatures | None = None,
                    executables: Executables | None = None,
                    prefill_chunk_size: int | None = None,
                    activation_budget: int | None = None, return_logprobs: bool = False,
                    top_logprobs: int = 0, num_speculative_tokens: int = 0,
                    draft_vocab=None) -> Iterator[StreamChunk]:
    """Generates continuations, yielding a :class:`StreamChunk` to the host per jitted chunk.

    The first chunk holds each row's first token (prefill + one sample: the time to first token),
    each later one ``chunk_size`` decode steps, until every row has stopped; the same tokens as
    :func:`generate`. The last chunk carries ``.state`` (with ``state`` or ``return_state``; lost
    if the iteration stops early). Validation happens on the first ``next()``. On a GPU each
    later chunk is dispatched before the previous one is read back, so the device runs it while
    the caller handles that one (an iteration stopped early has run one chunk more).
    ``num_speculative_tokens`` k, ``draft_vocab``: speculative decoding as :func:`generate`'s
    (the same tokens and draws as its speculative call); a later chunk then holds c verify
    steps, [R, c · (k + 1)] tokens, each row's new ones first and ``pad_id`` after them (c:
    ``chunk_size``, at most the token budget's bucket less one, as for plain chunks).
    """
    if _speculative(num_speculative_tokens, draft_vocab):
        yield from _stream_speculative(
            params, prompts, max_new_tokens, sampling, key, eos_token_ids, num_speculative_tokens,
            stop_sequences=stop_sequences, state=state, return_state=return_state,
            max_len=max_len, num_samples=num_samples, pad_id=pad_id, kernels=kernels,
            executables=executables, prefill_chunk_size=prefill_chunk_size,
            activation_budget=activation_budget, return_logprobs=return_logprobs,
            top_logprobs=top_logprobs, chunk_size=chunk_size, features=features,
            draft_vocab=draft_vocab)
        return
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, max_len=max_len,
                 num_samples=num_samples, chunk_size=chunk_size, pad_id=pad_id, kernels=kernels,
                 features=features, stop_sequences=stop_sequences, state=state,
                 return_state=return_state, prefill_chunk_size=prefill_chunk_size,
                 activation_budget=activation_budget, return_logprobs=return_logprobs,
                 top_logprobs=top_logprobs)
    fn = _fork_jit if plan.fork_state else _start_jit
    loop, emitted = _call(fn, *_start_args(params, plan, state), executables)

    def advance(loop):  # the next chunk: (loop, (ids, Logprobs or None))
        loop, emitted = _call(_chunk_jit, *_chunk_args(params, plan, loop), executables)
        return loop, (emitted if plan.logprobs is not None else (emitted, None))

    first = jax.tree.map(lambda x: x[:, None], emitted)
    yield from _chunks(params, plan, loop, first if plan.logprobs is not None else (first, None),
                       lambda loop: loop.last_token, advance, executables)


def _chunks(params: Params, plan: _Plan, loop, emitted, last, advance,
            executables) -> Iterator[StreamChunk]:
    """A stream's chunks from its started loop (plain or speculative): each one's ``emitted``
    (ids, Logprobs or None) read to the host, until every row has stopped, the last carrying
    the final state (``last(loop)``, the token not yet in it, fed through one step) where
    ``plan.return_state``; ``advance(loop)`` runs the next chunk (donating ``loop``).

    From the second chunk on, the next chunk is dispatched before this one is read back, so the
    device runs it while the host reads, yields and the caller works (a host round trip per
    chunk otherwise leaves the device idle); after the last chunk that one runs no step (every
    row stopped) and leaves the loop as it was. The first chunk is read first (the time to first
    token does not wait for the chunk's compile), and on the CPU backend nothing is dispatched
    ahead (a read there waits for every call dispatched before it)."""
    ahead = False  # the first chunk: read before the next is dispatched
    while True:
        if ahead:  # copies: advance donates the loop, whose counts this chunk reports
            status = (jnp.copy(loop.num_generated), jnp.copy(loop.stop_reason))
            following = advance(loop)
        else:
            status = (loop.num_generated, loop.stop_reason)
        (ids, lp), num_generated, stop_reason = jax.tree.map(np.asarray, jax.device_get(
            (emitted, *status)))
        chunk = StreamChunk(ids, num_generated, stop_reason, logprobs=lp)
        done = bool((chunk.stop_reason != STOP_RUNNING).all())
        if ahead:
            loop, emitted = following
        if done and plan.return_state:
            chunk = dataclasses.replace(chunk, state=_call(
                _feed_last_jit, (params, loop.state, last(loop)), dict(kernels=plan.kernels),
                executables))
        yield chunk
        if done:
            return
        if not ahead:
            loop, emitted = advance(loop)
            ahead = _dispatch_ahead(loop)


def _dispatch_ahead(loop) -> bool:
    """Whether a stream dispatches its next chunk before reading this one: not on the CPU
    backend, where a read waits for every call dispatched before it (each chunk would then
    reach the host one chunk later)."""
    return not all(d.platform == "cpu" for d in loop.num_generated.sharding.device_set)


generate.__doc__ += _DOC_ARGS
generate_stream.__doc__ += _DOC_ARGS


def _device_of(params: Params):
    """The params' sharding where they sit on one device, else None (for abstract arguments)."""
    where = jax.tree.leaves(params)[0].sharding
    return where if isinstance(where, jax.sharding.SingleDeviceSharding) else None


def _abstract_on(tree, where):
    """``ShapeDtypeStruct`` leaves placed on ``where``: arguments whose signatures match the
    arrays a run will pass (on the params' device; with sharded params they will not match, and
    jit compiles that call on its first run)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                                       sharding=where), tree)


def precompile(params: Params, prompts, max_new_tokens=64, sampling: SamplingParams | None = None,
               key=None, eos_token_ids: Sequence[int] | None = None, *, stream: bool = False,
               chunk_size: int | None = None, progress: Callable[[np.ndarray], None] | None = None,
               state: DecodeState | None = None, **kwargs) -> Executables:
    """Compiles (without running) what :func:`generate` (or, with ``stream``,
    :func:`generate_stream`) runs for these arguments (the same keywords, speculative decoding
    included; ``state`` is read, not donated), so compile time can be timed apart; pass the
    result as their ``executables=``. ValueError: as theirs."""
    chunk_size = chunk_size or (1 if stream else 8)
    if _speculative(kwargs.get("num_speculative_tokens", 0), kwargs.get("draft_vocab")):
        return _precompile_speculative(params, prompts, max_new_tokens, sampling, key,
                                       eos_token_ids, stream=stream, chunk_size=chunk_size,
                                       progress=progress, state=state, **kwargs)
    kwargs.pop("num_speculative_tokens", None)
    kwargs.pop("draft_vocab", None)
    plan = _plan(params, prompts, max_new_tokens, sampling, key, eos_token_ids, state=state,
                 chunk_size=chunk_size, **{"max_len": None, "num_samples": 1, "pad_id": -1,
                                           "kernels": None, **kwargs})
    fn = _fork_jit if plan.fork_state else _generate_jit
    if not stream:
        return Executables((_compile(fn, *_generate_args(params, plan, progress, state)),))
    args, static = _start_args(params, plan, state)
    # the chunk's signature is that of the loop the start returns (top-level eval_shape: it has
    # compiler_options)
    loop = _abstract_on(fn.eval_shape(*args, **static)[0], _device_of(params))
    compiled = [_compile(fn, args, static), _compile(_chunk_jit, *_chunk_args(params, plan, loop))]
    if plan.return_state:
        compiled.append(_compile(_feed_last_jit, (params, loop.state, loop.last_token),
                                 dict(kernels=plan.kernels)))
    return Executables(tuple(compiled))


def _precompile_speculative(params: Params, prompts, max_new_tokens, sampling, key,
                            eos_token_ids, *, stream, chunk_size, progress, state,
                            num_speculative_tokens, **kwargs) -> Executables:
    """:func:`precompile` of speculative decoding: its one jitted loop, or (``stream``) its
    start, the draft vocabulary's head, its chunks and the last token's step."""
    k = num_speculative_tokens
    plan, state, draft_vocab = _speculative_plan(
        params, prompts, max_new_tokens, sampling, key, eos_token_ids, k, state=state,
        chunk_size=chunk_size, abstract=True, **kwargs)
    if not stream:
        return Executables((_compile(speculative_generate_jit, *_speculative_generate_args(
            params, plan, state, draft_vocab, k, progress)),))
    where = _device_of(params)
    args, static = _speculative_start_args(params, plan, state)
    compiled = [_compile(speculative_start_jit, args, static)]
    loop = _abstract_on(speculative_start_jit.eval_shape(*args, **static)[0], where)
    head = None
    if draft_vocab is not None:
        compiled.append(_compile(_draft_head_jit, (params, draft_vocab), {}))
        head = _abstract_on(_draft_head_jit.eval_shape(params, draft_vocab), where)
    compiled.append(_compile(speculative_chunk_jit, *_speculative_chunk_args(
        params, plan, loop, args, head, draft_vocab, k)))
    if plan.return_state:
        compiled.append(_compile(_feed_last_jit, (params, loop.state, loop.last),
                                 dict(kernels=plan.kernels)))
    return Executables(tuple(compiled))
