"""Teacher-forced scoring: the log-probabilities of given continuations after given prompts.

:func:`score` runs each (prompt, continuation) row in one jitted call, in one of two maths:

  "chunked"    the prompt as a prefill, then the continuation as a second one
               (``model.prefill_logprobs_fn``: the chunked gated delta rule), in token chunks
               under the activation budget, logits computed at the continuation's positions
               only (and the prompt's last);
  "recurrent"  the prompt as a prefill, then the continuation one token per decode step
               (``model.decode_logprobs_fn``): the math ``jd.generate`` samples with, so a
               rollout's raw log-probabilities and their re-scoring agree (tested bitwise in
               float32 on the CPU; the chunked/recurrent gap: benchmarks/RESULTS.md).

Lengths are bucketed to powers of two (>= 16) as in ``jaxdecode.generation``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdecode import memory, sharding
from jaxdecode.inputs import MIN_PROMPT_BUCKET, MIN_TOKEN_BUCKET, bucket, token_lists
from jaxdecode.kernels.choice import Kernels, check_kernels, resolve_kernels
from jaxdecode.kernels.decode_attention import MAX_LEN_ALIGN
from jaxdecode.model import (decode_logprobs_fn, prefill_fn, prefill_logprobs_fn,
                             target_logprobs)
from jaxdecode.params import Params, check_params, traced
from jaxdecode.state import DecodeState, init_state
from jaxdecode.step import COMPILER_OPTIONS, plan_prefill

Array = jax.Array
MODES = ("chunked", "recurrent")


@struct.dataclass
class ScoreOutput:
    """Result of :func:`score` (B rows, N >= the longest continuation)."""
    logprobs: Array  # [B, N] float32: log p(continuation[b][i] | prompt, continuation[:i]),
    # natural log, under the model's softmax(logits); 0 after the row's continuation
    num_tokens: Array  # [B] int32 continuation lengths
    state: DecodeState | None = None  # return_state: prompt + continuation in every row

    def sums(self) -> np.ndarray:
        """[B] float64 sequence log-likelihoods (a host sync)."""
        return np.asarray(self.logprobs, np.float64).sum(axis=1)


def score_fn(params: Params, prompts: Array, prompt_lengths: Array, continuations: Array,
             num_tokens: Array, *, mode: str = "chunked", max_len: int,
             kernels: Kernels | None = None, prefill_chunk_size: int | None = None,
             query_block: int = 512, return_state: bool = False,
             remat: bool = False) -> ScoreOutput:
    """:func:`score` as a pure, unvalidated function of padded arrays, to compose inside your own
    ``jit`` or ``grad`` (a policy-gradient loss: ``examples/grpo.py``).

    prompts [B, T] and continuations [B, N] int32, right-padded (ids in the vocabulary);
    prompt_lengths, num_tokens [B] int32 (each >= 1, sum <= max_len; unchecked: a row that does
    not fit gets NaN log-probabilities from its first token past ``max_len`` on, not a
    truncation). Differentiable in "chunked" mode with
    ``kernels=Kernels()`` (XLA; the Pallas kernels have no VJP); ``remat`` recomputes each
    prefill chunk in the backward pass (``model.prefill_logprobs_fn``).
    """
    batch, n = continuations.shape
    state = sharding.constrain_state(init_state(params.config, batch, max_len, params.dtype,
                                                check_memory=False),
                                     None if kernels is None else kernels.mesh)
    # the prompt as a prefill (only its last logits: they score continuation[0]), then the
    # continuation: feeding continuation[i] (i < num_tokens) gives the logits of continuation[i+1]
    logits, state = prefill_fn(params, state, prompts, prompt_lengths,
                               prefill_chunk_size=prefill_chunk_size, query_block=query_block,
                               kernels=kernels, remat=remat)
    first = target_logprobs(logits, continuations[:, 0])
    targets = jnp.concatenate([continuations[:, 1:], jnp.full((batch, 1), -1)], axis=1)
    targets = jnp.where(jnp.arange(n)[None, :] + 1 < num_tokens[:, None], targets, -1)
    if mode == "chunked":
        rest, state = prefill_logprobs_fn(params, state, continuations, num_tokens, targets,
                                          prefill_chunk_size=prefill_chunk_size,
                                          query_block=query_block, kernels=kernels, remat=remat)
    else:
        rest, state = decode_logprobs_fn(params, state, continuations, num_tokens, targets,
                                         kernels)
    lp = jnp.concatenate([first[:, None], rest[:, :-1]], axis=1)
    lp = jnp.where(jnp.arange(n)[None, :] < num_tokens[:, None], lp, 0.0)
    return ScoreOutput(logprobs=lp, num_tokens=num_tokens,
                       state=state if return_state else None)


_STATIC = ("mode", "max_len", "kernels", "prefill_chunk_size", "query_block", "return_state",
           "remat")
_score_jit = jax.jit(score_fn, static_argnames=_STATIC, compiler_options=COMPILER_OPTIONS)
# inside the caller's jit or grad: JAX takes compiler options at the top-level jit only
_score_traced = jax.jit(score_fn, static_argnames=_STATIC)


def score(params: Params, prompts, continuations, *, mode: str = "chunked",
          max_len: int | None = None, return_state: bool = False,
          kernels: Kernels | None = None, prefill_chunk_size: int | None = None,
          activation_budget: int | None = None) -> ScoreOutput:
    """Log-probabilities of each continuation's tokens after its prompt, teacher-forced.

    Args:
      prompts, continuations: lists of token-id lists (ragged), one continuation per prompt,
        each non-empty (repeat a prompt to score several continuations of it); a 2-D array's
        rows are taken whole, padding included (as ``jd.generate``'s: pass lists for ragged
        rows).
      mode: "chunked" or "recurrent" (the module docstring).
      max_len: the state's capacity per row (None: the buckets, rounded up to a multiple of 64).
      return_state: also return the state holding prompt + continuation (``.state``).
      kernels: as ``jd.generate``'s (``batch_invariant`` is not supported here).
      prefill_chunk_size, activation_budget: as ``jd.prefill``'s (the prompt's prefill, and in
        "chunked" mode the continuation's); the [B, chunk, V] float32 logits of a chunk count.

    With params on a mesh it runs there, rows over "data" (whole on each data group where they
    do not divide it), as ``jd.generate``. With traced params (a leaf traced by the caller's
    ``jax.jit``, ``grad`` or ``vmap``; the prompts and continuations stay host lists) it runs
    :func:`score_fn` as a nested jit; gradients need ``kernels=jd.Kernels()`` (XLA's forms: the
    Pallas kernels have no VJP), and on a mesh ``kernels`` for it (``choose_kernels(...,
    mesh=mesh)``: traced params carry no placement). Concrete params closed over inside the
    caller's jit are a JAX error (a jit with compiler options inside another): pass them as an
    argument.

    Returns a :class:`ScoreOutput`. Raises ValueError before any device work: params that are
    not :class:`Params`, ``kernels`` of another mesh (``kernels.choice.for_mesh``), empty
    prompts or continuations, a different number of them, ids outside ``[0, vocab_size)``, an
    unknown mode, prompt + continuation over ``max_len`` or ``max_position_embeddings``, a state
    or activations that cannot fit in the device's (a mesh's device's) free memory.
    """
    check_params(params)
    config = params.config
    vocab, limit = config.vocab_size, config.max_position_embeddings
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    check_kernels(kernels)
    if kernels is not None and kernels.batch_invariant:
        raise ValueError("score does not run Kernels(batch_invariant=True)")
    prompt_list = token_lists(prompts, "prompts", vocab)
    cont_list = token_lists(continuations, "continuations", vocab)
    if not prompt_list or len(prompt_list) != len(cont_list):
        raise ValueError(f"need one continuation per prompt, at least one: got "
                         f"{len(prompt_list)} prompts and {len(cont_list)} continuations")
    batch = len(prompt_list)
    p_len = np.array([len(p) for p in prompt_list], np.int32)
    c_len = np.array([len(c) for c in cont_list], np.int32)
    need = p_len + c_len
    t_bucket = bucket(int(p_len.max()), MIN_PROMPT_BUCKET)
    n_bucket = bucket(int(c_len.max()), MIN_TOKEN_BUCKET)
    if max_len is None:
        max_len = min(-(-(t_bucket + n_bucket) // MAX_LEN_ALIGN) * MAX_LEN_ALIGN, limit)
    elif isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"{max_len=} must be a positive int")
    for cap, what in ((limit, "the model's max_position_embeddings"), (max_len, "max_len")):
        if (need > cap).any():
            i = int(np.argmax(need > cap))
            raise ValueError(f"row {i}: {p_len[i]} prompt + {c_len[i]} continuation tokens "
                             f"exceed {what}={cap}")
    prompts_np = np.zeros((batch, t_bucket), np.int32)
    conts_np = np.zeros((batch, n_bucket), np.int32)
    for i, (p, c) in enumerate(zip(prompt_list, cont_list)):
        prompts_np[i, :len(p)], conts_np[i, :len(c)] = p, c
    inside = traced(params)  # in the caller's jit or grad: no placement to read
    if inside:
        mesh = None if kernels is None else kernels.mesh
    else:
        mesh = sharding.mesh_of(params)
    kernels = resolve_kernels(kernels, config, batch, params.dtype, mesh)
    memory.check_fits(f"score's state ({batch} rows x {max_len} positions)",
                      memory.state_bytes(config, batch, int(max_len), params.dtype)
                      // sharding.state_spread(batch, mesh),
                      None if mesh is None else mesh.devices.flat[0])
    length = max(t_bucket, n_bucket) if mode == "chunked" else t_bucket  # the longer prefill
    plan = plan_prefill(params, batch, length, int(max_len), mesh=mesh,
                        prefill_chunk_size=prefill_chunk_size,
                        activation_budget=activation_budget, kernels=kernels,
                        logits_per_token=mode == "chunked")
    run = _score_traced if inside else _score_jit
    return run(params, prompts_np, p_len, conts_np, c_len, mode=mode, max_len=int(max_len),
               kernels=kernels, prefill_chunk_size=plan.prefill_chunk_size,
               query_block=plan.query_block, return_state=bool(return_state))

