"""Speculative decoding with the checkpoint's own MTP layer (spec §6, §10): greedy, on device.

Each iteration drafts ``k`` tokens with the MTP layer (:func:`model.mtp_forward`, reused k times
on its own output), verifies the last token and the k drafts in one target pass
(:func:`model.verify_fn`), accepts per row the drafts that equal the target's argmax, emits the
accepted ones plus the target's next token, and continues from the state after the last accepted
token without recomputing (:func:`model.commit_fn`). Rows accept different counts; the whole
loop is one ``lax.while_loop``. Greedy only: the output equals plain greedy decoding token for
token (up to float ties in the argmax), only faster when drafts are accepted.

The MTP layer's cache holds one pair per position p (the main model's final-norm hidden state at p,
the token at p + 1): the prompt's pairs are computed with its prefill, and each step first writes
the pairs of the tokens the last step accepted (the target's hidden states, not the draft's own),
as vLLM's MTP proposer does; the last of them drafts the first token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxdecode.kernels import choice
from jaxdecode.kernels.choice import Kernels
from jaxdecode.model import commit_fn, mtp_forward, prefill_hidden_fn, verify_fn
from jaxdecode.params import Params
from jaxdecode.state import DecodeState, KVCache

Array = jax.Array

STOP_EOS, STOP_LENGTH = 1, 2  # generation.STOP_EOS / STOP_LENGTH (same values)


@struct.dataclass
class SpeculativeLoop:
    """The loop's carry (R rows, N output slots, k drafts)."""
    state: DecodeState  # the target; ``lengths`` tokens processed (all but ``last``)
    mtp_cache: KVCache  # the MTP layer's keys/values, [R, Hkv, S, D] each; position p: pair p
    last: Array  # [R] int32 the last emitted token (not yet processed)
    pair_hidden: Array  # [R, k + 1, H] the MTP pairs the last step made: target hidden states
    pair_tokens: Array  # [R, k + 1] int32 ... and the token after each (the emitted ones)
    pair_count: Array  # [R] int32 pairs in use (the last: the one the next draft starts from)
    pair_start: Array  # [R] int32 position of the first pair
    tokens: Array  # [R, N] int32 emitted tokens, pad_id after each row's last
    num_generated: Array  # [R] int32
    stop_reason: Array  # [R] int32, 0 while running
    accepted: Array  # [] int32 drafts accepted over the run (all rows)
    iterations: Array  # [] int32 verify steps run


def _emit(loop: SpeculativeLoop, new: Array, count: Array, eos_ids: Array, budgets: Array,
          pad_id) -> tuple[SpeculativeLoop, Array]:
    """Appends each running row's first ``count`` of ``new`` [R, W] to its output, cut after an
    EOS id or at its budget. Returns (loop with tokens/num_generated/stop_reason updated, the
    number of tokens each row took)."""
    width = new.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    running = loop.stop_reason == 0
    is_eos = jnp.any(new[:, :, None] == eos_ids[None, None, :], axis=-1) & (j < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, width), axis=1)
    room = budgets - loop.num_generated
    took = jnp.minimum(jnp.minimum(count, first_eos + 1), room)
    took = jnp.where(running, took, 0)
    slots = jnp.where(j < took[:, None], loop.num_generated[:, None] + j, loop.tokens.shape[1])
    tokens = jax.vmap(lambda row, s, v: row.at[s].set(v, mode="drop"))(loop.tokens, slots, new)
    num_generated = loop.num_generated + took
    stop = jnp.where(running & (first_eos < took), STOP_EOS,
                     jnp.where(running & (num_generated >= budgets), STOP_LENGTH, 0))
    del pad_id  # the buffer starts as pad_id: unwritten slots keep it
    return loop.replace(tokens=tokens, num_generated=num_generated,
                        stop_reason=jnp.where(running, stop, loop.stop_reason)), took


def speculative_generate_fn(params: Params, state: DecodeState, prompts: Array,
                            prompt_lengths: Array, budgets: Array, eos_ids: Array, pad_id, *,
                            num_speculative_tokens: int, max_new_tokens: int,
                            kernels: Kernels = choice.XLA, prefill_chunk_size: int | None = None,
                            query_block: int = 512, draft=None) -> SpeculativeLoop:
    """Greedy speculative generation; pure, un-jitted, unvalidated (``generate`` checks).

    state: an empty state of R rows with room for prompt + budget + k tokens; prompts [R, T]
    int32 right-padded, prompt_lengths [R] >= 1, budgets [R] >= 1, eos_ids [E] (-1 pads);
    statics: ``num_speculative_tokens`` k >= 1, ``max_new_tokens`` N (the output width).
    ``draft``: test hook, ``(loop, mtp_drafts [R, k]) -> drafts [R, k]`` replacing the MTP's
    drafts (e.g. an oracle that is right with a set probability). Returns the final loop.
    """
    k = num_speculative_tokens
    rows, length = prompts.shape
    one = jnp.ones((rows,), jnp.int32)
    cache = state.kv_cache[0]
    cache = KVCache(k=jnp.zeros_like(cache.k), v=jnp.zeros_like(cache.v))
    state, cache = _prefill(params, state, cache, prompts, prompt_lengths,
                            prefill_chunk_size or length, query_block, kernels)
    # The last prompt token through verify_fn: its logits give the first token, its hidden
    # state the first MTP pair.
    last_prompt = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
    logits, hidden, pending, traces = verify_fn(params, state, last_prompt, one, kernels)
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, k)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    loop = SpeculativeLoop(
        state=commit_fn(pending, traces, one), mtp_cache=cache, last=first,
        pair_hidden=pad(hidden), pair_tokens=pad(first[:, None]), pair_count=one,
        pair_start=prompt_lengths - 1,
        tokens=jnp.full((rows, max_new_tokens), pad_id, jnp.int32),
        num_generated=jnp.zeros((rows,), jnp.int32), stop_reason=jnp.zeros((rows,), jnp.int32),
        accepted=jnp.zeros((), jnp.int32), iterations=jnp.zeros((), jnp.int32))
    loop, _ = _emit(loop, first[:, None], one, eos_ids, budgets, pad_id)

    def body(loop: SpeculativeLoop) -> SpeculativeLoop:
        running = loop.stop_reason == 0
        live = running.astype(jnp.int32)
        # The last step's pairs (target hidden states, emitted tokens) into the MTP cache, the
        # last of them drafting the first token; then k - 1 drafts on the MTP's own output.
        lg, d, cache = mtp_forward(params, loop.mtp_cache, loop.pair_hidden, loop.pair_tokens,
                                   loop.pair_start, live * loop.pair_count, kernels)
        at = jnp.maximum(loop.pair_count - 1, 0)
        tok = jnp.argmax(jnp.take_along_axis(lg, at[:, None, None], axis=1)[:, 0],
                         axis=-1).astype(jnp.int32)
        h = jnp.take_along_axis(d, at[:, None, None], axis=1)[:, 0]
        drafts = [tok]
        position = loop.pair_start + loop.pair_count  # of the next draft pair
        for j in range(1, k):
            lg, d, cache = mtp_forward(params, cache, h[:, None], tok[:, None],
                                       position + j - 1, live, kernels)
            tok = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
            h = d[:, 0]
            drafts.append(tok)
        drafts = jnp.stack(drafts, axis=1)  # [R, k]
        if draft is not None:
            drafts = draft(loop, drafts)
        verify = jnp.concatenate([loop.last[:, None], drafts], axis=1)  # [R, k + 1]
        logits, hidden, pending, traces = verify_fn(params, loop.state, verify, live * (k + 1),
                                                    kernels)
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, k + 1]
        match = jnp.cumprod((drafts == target[:, :k]).astype(jnp.int32), axis=1)
        num_accepted = jnp.sum(match, axis=1)  # drafts accepted, [0, k]
        loop = loop.replace(mtp_cache=cache)
        loop, took = _emit(loop, target, num_accepted + 1, eos_ids, budgets, pad_id)
        # took tokens emitted = the target's outputs after ``last`` and took - 1 drafts: those
        # ``took`` inputs enter the state; the last emitted token is the next ``last``, and
        # (hidden at each verified position, the token emitted after it) the next pairs.
        at = jnp.maximum(took - 1, 0)
        moved = took > 0
        return loop.replace(
            state=commit_fn(pending, traces, took),
            last=jnp.where(moved, jnp.take_along_axis(target, at[:, None], axis=1)[:, 0],
                           loop.last),
            pair_hidden=hidden, pair_tokens=target, pair_count=jnp.where(moved, took, 0),
            pair_start=loop.state.lengths,
            accepted=loop.accepted + jnp.sum(jnp.where(moved, took - 1, 0)),
            iterations=loop.iterations + 1)

    return lax.while_loop(lambda loop: jnp.any(loop.stop_reason == 0), body, loop)


def _prefill(params: Params, state: DecodeState, cache: KVCache, prompts: Array,
             prompt_lengths: Array, chunk: int, query_block: int, kernels: Kernels):
    """The target over each prompt but its last token, ``chunk`` tokens at a time (a
    ``lax.scan`` of continuations), and the MTP layer over the prompt's pairs (the hidden state
    at p, the prompt token at p + 1) for p < length - 1. Returns (state, MTP cache)."""
    rows, length = prompts.shape
    n = -(-length // chunk)
    nxt = jnp.concatenate([prompts[:, 1:], jnp.zeros((rows, 1), prompts.dtype)], axis=1)
    split = lambda x: jnp.moveaxis(  # noqa: E731  [R, T] -> [n, R, chunk]
        jnp.pad(x, ((0, 0), (0, n * chunk - length))).reshape(rows, n, chunk), 1, 0)

    def body(carry, xs):
        state, cache = carry
        tok, following, i = xs
        nn = jnp.clip(prompt_lengths - 1 - i * chunk, 0, chunk)
        _, new_state, hidden = prefill_hidden_fn(params, state, tok, nn,
                                                 query_block=query_block, kernels=kernels)
        _, _, cache = mtp_forward(params, cache, hidden, following, state.lengths, nn, kernels,
                                  return_logits=False)
        return (new_state, cache), None

    (state, cache), _ = lax.scan(body, (state, cache),
                                 (split(prompts), split(nxt), jnp.arange(n)))
    return state, cache


speculative_generate_jit = jax.jit(
    speculative_generate_fn,
    static_argnames=("num_speculative_tokens", "max_new_tokens", "kernels",
                     "prefill_chunk_size", "query_block", "draft"),
    donate_argnames=("state",))

