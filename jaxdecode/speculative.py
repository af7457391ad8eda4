"""Speculative decoding with the checkpoint's own MTP layer (spec §6, §10), on device.

Each iteration drafts ``k`` tokens with the MTP layer (:func:`model.mtp_forward`, reused k times
on its own output), verifies the last token and the k drafts in one target pass
(:func:`model.verify_fn`), accepts per row a prefix of the drafts, emits it plus one token from the
target, and continues from the state after the last emitted input without recomputing
(:func:`model.commit_fn`). Rows accept different counts; the whole loop is one
``lax.while_loop`` (``generation.speculative_generate_jit`` compiles it with the loop inside
XLA's command buffers, so the GPU evaluates its condition without a host round trip). Greedy
rows accept while the draft is the target's argmax: the output equals plain greedy decoding
token for token (up to float ties). Sampled rows (temperature, top-k, top-p, min-p as
``jaxdecode.sampling``) draw their drafts from the MTP's processed distribution q and use the
speculative-sampling rule (:func:`accept_drafts`), so each token is distributed exactly as plain
sampling's (not the same draws: the keys are used differently). Repetition, presence and
frequency penalties apply to the target at each verified position with the counts of the tokens
emitted before it and of the drafts before it (:func:`position_counts`), as plain decoding
would have counted them; the drafts are proposed without penalties (the rule is exact for any
q; only acceptance can fall). Each emitted token's log-probabilities come from the verify
step's logits at its position (:func:`emitted_logprobs`), the distribution plain decoding would
draw it from.

A draft vocabulary (``draft_vocab``: the ids the MTP may propose, e.g. a corpus's most frequent
tokens; Zhao et al., "FR-Spec", 2025) scores each draft against those rows of the LM head only,
the draft's largest read (248k x H at every draft); q is then zero outside it, which the rule
allows, so the output is unchanged: greedy tokens equal plain greedy's, sampled ones follow the
target's distribution. Only the acceptance rate can fall (a target token outside the set is
never drafted).

The MTP layer's pairs live in the state (``DecodeState.mtp``, ``init_state(..., mtp=True)``):
pair p joins the main model's final-norm hidden state at p with the token at p + 1. The prompt's
prefill and every commit append the pairs of the tokens they add (the target's hidden states,
not the draft's own), as vLLM's MTP proposer does; each step's first draft comes from the pair
of the last accepted position and the token emitted after it. So a state continued here
(``generate(..., state=)``), whether prefilled, decoded or generated before, drafts with the
MTP attending to every token in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxdecode import sampling as sampling_lib
from jaxdecode.kernels import choice
from jaxdecode.kernels.choice import Kernels
from jaxdecode.model import commit_fn, decode_step_fn, mtp_forward, prefill_fn, verify_fn
from jaxdecode.params import Params
from jaxdecode.sampling import (Logprobs, SamplingFeatures, SamplingParams, is_sampled,
                                processed_logits)
from jaxdecode.state import DecodeState
from jaxdecode.stopping import STOP_RUNNING, stop_reason, token_ends

Array = jax.Array
# The most drafts per step: the loop unrolls one MTP pass per draft (compile time and memory
# grow with it), and a draft's acceptance falls with its distance from the verified token.
MAX_SPECULATIVE_TOKENS = 16



@struct.dataclass
class SpeculativeLoop:
    """The loop's carry (R rows, N output slots)."""
    state: DecodeState  # the target and its MTP pairs; ``lengths`` tokens (all but ``last``)
    last: Array  # [R] int32 the last emitted token (not yet processed)
    tokens: Array  # [R, N] int32 emitted tokens, pad_id after each row's last
    num_generated: Array  # [R] int32
    stop_reason: Array  # [R] int32, 0 while running
    recent: Array  # [R, L - 1] int32 the last emitted tokens (-1 before the first): stop sequences
    accepted: Array  # [] int32 drafts accepted over the run (all rows)
    iterations: Array  # [] int32 verify steps run
    logprobs: Logprobs | None = None  # of ``tokens``, [R, N] leaves (top ones [R, N, n])
    token_counts: Array | None = None  # [R, V] int32 emitted-token counts: the penalties
    prompt_mask: Array | None = None  # [R, V] bool, the prompts' ids: the repetition penalty


def _all_greedy(sampling: SamplingParams | None, features: SamplingFeatures | None) -> bool:
    """Whether no row samples (``features.sampled`` off, or none given): tokens are argmaxes."""
    return sampling is None or features is None or not features.sampled


def distribution(logits: Array, sampling: SamplingParams, features: SamplingFeatures,
                 token_counts: Array | None = None, prompt_mask: Array | None = None) -> Array:
    """[..., V] float32 probabilities a row draws from: ``softmax(processed_logits)`` for
    sampled rows, one-hot at the argmax for greedy ones (``sampling.is_sampled`` false);
    ``sampling`` leaves [R], logits [R, ..., V]; the penalties' ``token_counts`` (as logits) and
    ``prompt_mask`` [R, V] as :func:`sampling.processed_logits`' (None: none)."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])
    counts = None if token_counts is None else token_counts.reshape(flat.shape)

    def one(x, c):  # [R, V] at one position
        x = processed_logits(x, sampling, c, prompt_mask=prompt_mask, features=features)
        greedy = jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
        return jnp.where(is_sampled(jnp.asarray(sampling.temperature, jnp.float32))[:, None],
                         jax.nn.softmax(x, axis=-1), greedy)

    return jax.vmap(one, in_axes=1, out_axes=1)(flat, counts).reshape(shape)


def penalised(logits: Array, sampling: SamplingParams | None,
              features: SamplingFeatures | None, token_counts: Array | None,
              prompt_mask: Array | None) -> Array:
    """logits [R, ..., V] after the repetition, presence and frequency penalties
    (``sampling.apply_penalties``; ``token_counts`` shaped as logits) where ``features`` has
    them, else unchanged: what a greedy row takes the argmax of."""
    if token_counts is None or features is None or not features.penalties:
        return logits
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1]).astype(jnp.float32)
    out = jax.vmap(lambda x, c: sampling_lib.apply_penalties(x, c, sampling, prompt_mask),
                   in_axes=1, out_axes=1)(flat, token_counts.reshape(flat.shape))
    return out.reshape(shape)


def position_counts(token_counts: Array | None, drafts: Array) -> Array | None:
    """The emitted-token counts each verified position is scored with: [R, V] counts before the
    step, drafts [R, k] -> [R, k + 1, V], position j adding drafts 0..j-1 (None stays None)."""
    if token_counts is None:
        return None
    added = jnp.cumsum(jax.nn.one_hot(drafts, token_counts.shape[-1], dtype=jnp.int32), axis=1)
    added = jnp.concatenate([jnp.zeros_like(added[:, :1]), added], axis=1)
    return token_counts[:, None] + added


def check_draft_vocab(draft_vocab, vocab_size: int) -> Array:
    """``draft_vocab`` as a [V'] int32 device array after host checks: a non-empty 1-D array of
    distinct integer ids in [0, vocab_size) (a repeated id would misstate q); else ValueError."""
    if isinstance(draft_vocab, (set, frozenset)):
        raise ValueError("draft_vocab must be a sequence or array of token ids, not a set "
                         "(pass sorted(ids))")
    try:
        ids = np.asarray(draft_vocab)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"draft_vocab must be a 1-D array of token ids: {e}") from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"draft_vocab must be a non-empty 1-D array of token ids; got shape "
                         f"{ids.shape}, dtype {ids.dtype}")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise ValueError(f"draft_vocab holds ids outside [0, {vocab_size}): "
                         f"{outside[:8].tolist()}")
    if np.unique(ids).size != ids.size:
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"draft_vocab repeats ids: {values[counts > 1][:8].tolist()}")
    return jnp.asarray(ids, jnp.int32)


def draft_tokens(tokens: Array, q: Array | None, draft_vocab: Array | None, vocab_size: int):
    """Drafts chosen over a draft vocabulary, in the model's ids: tokens [R] (indices into
    ``draft_vocab``) -> ids, q [R, V'] -> [R, V] (zero outside the set; None stays None).
    Without ``draft_vocab`` both pass through."""
    if draft_vocab is None:
        return tokens, q
    if q is not None:
        q = jnp.zeros((q.shape[0], vocab_size), q.dtype).at[:, draft_vocab].set(q)
    return draft_vocab[tokens], q


def accept_drafts(target: Array, draft: Array, drafts: Array, key: Array):
    """The speculative-sampling rule (Leviathan et al., 2023; Chen et al., 2023): draft j is
    accepted, while all before it were, with probability ``min(1, p_j(y_j) / q_j(y_j))``; the
    first rejected one is replaced by a draw from ``normalise(max(0, p_j - q_j))``, and after k
    accepted drafts a bonus token is drawn from ``p_k``. Each emitted token is then distributed
    as the target's ``p`` given the tokens before it. One-hot p and q (greedy rows) make it
    "accept while the draft is the argmax, then the argmax".

    target [R, k+1, V] and draft [R, k, V] probabilities, drafts [R, k] int32 (drawn from q),
    key [R] keys. Returns (emitted [R, k+1] int32: the accepted drafts, then the replacement or
    bonus token, then don't-care; count [R] int32 emitted, accepted drafts + 1).
    """
    rows, k = drafts.shape
    keys = jax.vmap(lambda key: jax.random.split(key, 2))(key)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys[:, 0])
    p_y = jnp.take_along_axis(target[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_y = jnp.take_along_axis(draft, drafts[..., None], axis=-1)[..., 0]
    ok = u * q_y < p_y  # u < p/q without the division (q_y > 0: y was drawn from q)
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    at = num_accepted[:, None, None]
    p_at = jnp.take_along_axis(target, at, axis=1)[:, 0]  # [R, V]
    q_at = jnp.take_along_axis(jnp.pad(draft, ((0, 0), (0, 1), (0, 0))), at, axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)  # q is 0 past the drafts: the bonus is p_k
    # Where p <= q everywhere (rounding only), fall back to p itself.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_at)
    last = jax.vmap(jax.random.categorical)(keys[:, 1], jnp.log(residual)).astype(jnp.int32)
    j = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(j < num_accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        last[:, None])
    return emitted.astype(jnp.int32), num_accepted + 1


def emitted_logprobs(logits: Array, tokens: Array, sampling: SamplingParams | None,
                     features: SamplingFeatures | None, top_logprobs: int,
                     token_counts: Array | None = None,
                     prompt_mask: Array | None = None) -> Logprobs:
    """:class:`Logprobs` [R, W] (top ones [R, W, n]) of ``tokens`` [R, W] under the verify
    step's logits [R, W, V] at their positions: the distributions plain decoding draws them from
    (``sampling.token_logprobs``), penalised with ``token_counts`` [R, W, V] and
    ``prompt_mask`` [R, V] (None: no penalties)."""
    rows, width, vocab = logits.shape
    if _all_greedy(sampling, features):
        processed = penalised(logits, sampling, features, token_counts, prompt_mask)
    else:
        processed = jax.vmap(  # (a None token_counts maps as an empty tree)
            lambda x, c: processed_logits(x, sampling, c, prompt_mask=prompt_mask,
                                          features=features),
            in_axes=1, out_axes=1)(logits, token_counts)
    lp = sampling_lib.token_logprobs(logits.reshape(rows * width, vocab),
                                     processed.reshape(rows * width, vocab),
                                     tokens.reshape(-1), top_logprobs)
    return jax.tree.map(lambda x: x.reshape(rows, width, *x.shape[1:]), lp)


def _emit(loop: SpeculativeLoop, new: Array, count: Array, eos_ids: Array, budgets: Array,
          stop_sequences: Array, new_logprobs: Logprobs | None = None
          ) -> tuple[SpeculativeLoop, Array]:
    """Appends each running row's first ``count`` of ``new`` [R, W] to its output, cut after an
    EOS id, after the last token of a stop sequence ([S, L], ``stopping.token_ends``; matched
    against the emitted tokens only) or at its budget; the reason in ``stopping``'s order when
    several fall on one token; ``new_logprobs`` ([R, W] leaves) into
    ``loop.logprobs`` at the same places, the taken ids into ``loop.token_counts`` (if kept).
    Returns (loop with tokens/num_generated/stop_reason/recent/logprobs/token_counts updated,
    the number of tokens each row took)."""
    width = new.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    running = loop.stop_reason == STOP_RUNNING
    offered = j < count[:, None]
    first_invalid, first_eos, first_stop = (
        jnp.min(jnp.where(ends & offered, j, width), axis=1)
        for ends in token_ends(new, loop.recent, eos_ids, stop_sequences))
    span = stop_sequences.shape[1]
    emitted = jnp.concatenate([loop.recent, new], axis=1)  # [R, L - 1 + W]
    room = budgets - loop.num_generated
    first_end = jnp.minimum(first_invalid, jnp.minimum(first_eos, first_stop))
    took = jnp.minimum(jnp.minimum(count, first_end + 1), room)
    took = jnp.where(running, took, 0)
    slots = jnp.where(j < took[:, None], loop.num_generated[:, None] + j, loop.tokens.shape[1])
    put = jax.vmap(lambda row, s, v: row.at[s].set(v, mode="drop"))
    tokens = put(loop.tokens, slots, new)
    if new_logprobs is not None:
        loop = loop.replace(logprobs=jax.tree.map(lambda old, v: put(old, slots, v),
                                                  loop.logprobs, new_logprobs))
    if loop.token_counts is not None:  # the penalties count each taken id (an invalid -1: none)
        counted = (j < took[:, None]) & (new >= 0)
        rows = jnp.broadcast_to(jnp.arange(new.shape[0])[:, None], new.shape)
        loop = loop.replace(token_counts=loop.token_counts.at[rows, jnp.where(counted, new, 0)]
                            .add(counted.astype(jnp.int32)))
    num_generated = loop.num_generated + took
    stop = stop_reason(first_invalid < took, first_eos < took, first_stop < took,
                       num_generated >= budgets)
    # the last L - 1 emitted tokens: emitted[took : took + L - 1] per row
    recent = jax.vmap(lambda row, t: lax.dynamic_slice(row, (t,), (span - 1,)))(emitted, took)
    return loop.replace(tokens=tokens, num_generated=num_generated, recent=recent,
                        stop_reason=jnp.where(running, stop, loop.stop_reason)), took


def draft_head(params: Params, draft_vocab: Array | None) -> Array | None:
    """The LM head's rows of ``draft_vocab`` [V'] ([V', H], the drafts' scores), gathered once
    per loop; None without a draft vocabulary (the whole LM head)."""
    if draft_vocab is None:
        return None
    return jnp.take(params.lm_head_weight, draft_vocab, axis=0)


def speculative_start_fn(params: Params, state: DecodeState, prompts: Array,
                         prompt_lengths: Array, budgets: Array, eos_ids: Array, pad_id,
                         sampling: SamplingParams | None, keys: Array, *, max_new_tokens: int,
                         features: SamplingFeatures | None = None,
                         kernels: Kernels = choice.XLA, prefill_chunk_size: int | None = None,
                         query_block: int = 512, stop_sequences: Array,
                         logprobs: int | None = None) -> SpeculativeLoop:
    """The loop's start (pure, unvalidated): the prompts into ``state`` (the target over each
    prompt but its last token, its MTP pairs appended with it, then the last one through
    ``verify_fn``, whose logits give each row's first token, emitted). Arguments as
    :func:`speculative_generate_fn` (``keys`` [R] and ``stop_sequences`` [S, L] given)."""
    rows = prompts.shape[0]
    one = jnp.ones((rows,), jnp.int32)
    if state.mtp is None:
        raise ValueError("speculative decoding needs a state keeping the MTP layer's pairs: "
                         "init_state(..., mtp=True)")
    choose, _ = _choosers(sampling, features, None, params.config.vocab_size)
    state = prefill_fn(params, state, prompts, prompt_lengths - 1,
                       prefill_chunk_size=prefill_chunk_size, query_block=query_block,
                       kernels=kernels)[1]
    last_prompt = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
    logits, hidden, pending, traces = verify_fn(params, state, last_prompt, one, kernels)
    counts = prompt_mask = None
    if features is not None and features.penalties:
        vocab = params.config.vocab_size
        counts = jnp.zeros((rows, vocab), jnp.int32)
        prompt_mask = sampling_lib.prompt_mask_of(prompts, prompt_lengths, vocab)
    first, _ = choose(logits[:, 0], jax.vmap(jax.random.fold_in)(keys, 0 * one), counts,
                      prompt_mask)
    first = jnp.where(sampling_lib.invalid(logits[:, 0]), -1, first)  # as sample's -1
    loop = SpeculativeLoop(
        state=commit_fn(params, pending, traces, last_prompt, hidden, one, kernels), last=first,
        tokens=jnp.full((rows, max_new_tokens), pad_id, jnp.int32),
        num_generated=jnp.zeros((rows,), jnp.int32), stop_reason=jnp.zeros((rows,), jnp.int32),
        recent=jnp.full((rows, stop_sequences.shape[1] - 1), -1, jnp.int32),
        accepted=jnp.zeros((), jnp.int32), iterations=jnp.zeros((), jnp.int32),
        token_counts=counts, prompt_mask=prompt_mask)
    if logprobs is not None:
        zeros = jnp.zeros((rows, max_new_tokens), jnp.float32)
        loop = loop.replace(logprobs=Logprobs(
            processed=zeros, raw=zeros,
            top_ids=jnp.full((rows, max_new_tokens, logprobs), pad_id, jnp.int32),
            top_logprobs=jnp.zeros((rows, max_new_tokens, logprobs), jnp.float32)))
    return _emit(loop, first[:, None], one, eos_ids, budgets, stop_sequences,
                 _logprobs_of(logits[:, :1], first[:, None], sampling, features, logprobs,
                              None if counts is None else counts[:, None], prompt_mask))[0]


def _choosers(sampling, features, draft_vocab, vocab):
    """(choose, choose_draft): logits [R, V] and keys [R] (and the penalties' counts [R, V] and
    prompt mask) -> (tokens [R], probabilities [R, V] or None for greedy rows); choose_draft
    over the draft vocabulary's logits [R, V'], without penalties (any q keeps the output
    exact), its ids and q mapped back to the model's (:func:`draft_tokens`)."""
    greedy = _all_greedy(sampling, features)

    def choose(logits, key, token_counts=None, prompt_mask=None):
        if greedy:
            x = penalised(logits, sampling, features, token_counts, prompt_mask)
            return jnp.argmax(x, axis=-1).astype(jnp.int32), None
        probs = distribution(logits, sampling, features, token_counts, prompt_mask)
        return jax.vmap(jax.random.categorical)(key, jnp.log(probs)).astype(jnp.int32), probs

    def choose_draft(logits, key):
        return draft_tokens(*choose(logits, key), draft_vocab, vocab)

    return choose, choose_draft


def _logprobs_of(logits, tokens, sampling, features, logprobs, token_counts=None,
                 prompt_mask=None):
    """[R, W, V] logits, [R, W] tokens -> :class:`Logprobs` [R, W], None if not computed."""
    if logprobs is None:
        return None
    return emitted_logprobs(logits, tokens, sampling, features, logprobs, token_counts,
                            prompt_mask)


def speculative_steps_fn(params: Params, loop: SpeculativeLoop, budgets: Array, eos_ids: Array,
                         sampling: SamplingParams | None, keys: Array, head: Array | None = None,
                         *, num_speculative_tokens: int,
                         features: SamplingFeatures | None = None,
                         kernels: Kernels = choice.XLA, draft=None,
                         draft_vocab: Array | None = None, stop_sequences: Array,
                         logprobs: int | None = None, max_steps: int | None = None,
                         progress=None, progress_every: int = 1) -> SpeculativeLoop:
    """Verify steps (draft, verify, accept, commit) in one ``lax.while_loop`` while a row runs,
    at most ``max_steps`` (static; None: until every row stops). ``head``: :func:`draft_head`
    of ``draft_vocab``. ``progress``: called on the host with ``num_generated`` [R] after every
    ``progress_every``-th verify step and after the one where the last row stops (or once,
    where no step runs). Other arguments as :func:`speculative_generate_fn`."""
    k = num_speculative_tokens
    vocab = params.config.vocab_size
    greedy = _all_greedy(sampling, features)
    _, choose_draft = _choosers(sampling, features, draft_vocab, vocab)

    def body(loop: SpeculativeLoop) -> SpeculativeLoop:
        running = loop.stop_reason == STOP_RUNNING
        live = running.astype(jnp.int32)
        # The first draft from the pair (hidden state at lengths - 1, ``last``), then k - 1 on
        # the MTP's own output. Their pairs go into the state's MTP cache at lengths - 1 on;
        # commit_fn rewrites the accepted ones from the target's hidden states, and later
        # drafts overwrite the rest before any pair reads them.
        step_keys = jax.vmap(lambda key, n: jax.random.split(jax.random.fold_in(key, n),
                                                             k + 1))(keys, loop.num_generated)
        state = loop.state
        with jax.named_scope("draft"):  # scopes name the phases in profiles
            lg, d, cache = mtp_forward(params, state.mtp.kv, state.mtp.hidden[:, None],
                                       loop.last[:, None], state.lengths - 1, live, kernels,
                                       lm_head=head)
            tok, q = choose_draft(lg[:, 0], step_keys[:, 0])
            h = d[:, 0]
            drafts, qs = [tok], [q]
            for j in range(1, k):
                lg, d, cache = mtp_forward(params, cache, h[:, None], tok[:, None],
                                           state.lengths + j - 1, live, kernels, lm_head=head)
                tok, q = choose_draft(lg[:, 0], step_keys[:, j])
                h = d[:, 0]
                drafts.append(tok)
                qs.append(q)
            drafts = jnp.stack(drafts, axis=1)  # [R, k]
            if draft is not None:
                drafts = draft(loop, drafts)
                qs = [jax.nn.one_hot(drafts[:, j], vocab) for j in range(k)]
            state = state.replace(mtp=state.mtp.replace(kv=cache))
        verify = jnp.concatenate([loop.last[:, None], drafts], axis=1)  # [R, k + 1]
        with jax.named_scope("verify"):
            logits, hidden, pending, traces = verify_fn(params, state, verify, live * (k + 1),
                                                        kernels)
        with jax.named_scope("accept"):
            # the penalties at position j count the emitted tokens and drafts 0..j-1
            counts = position_counts(loop.token_counts, drafts)
            if greedy:
                target = jnp.argmax(penalised(logits, sampling, features, counts,
                                              loop.prompt_mask), axis=-1).astype(jnp.int32)
                # an invalid row's -1: a draft never matches
                target = jnp.where(sampling_lib.invalid(logits), -1, target)
                match = jnp.cumprod((drafts == target[:, :k]).astype(jnp.int32), axis=1)
                emitted, count = target, jnp.sum(match, axis=1) + 1
            else:
                emitted, count = accept_drafts(
                    distribution(logits, sampling, features, counts, loop.prompt_mask),
                    jnp.stack(qs, axis=1), drafts, step_keys[:, k])
                emitted = jnp.where(sampling_lib.invalid(logits), -1, emitted)
            loop, took = _emit(loop, emitted, count, eos_ids, budgets, stop_sequences,
                               _logprobs_of(logits, emitted, sampling, features, logprobs,
                                            counts, loop.prompt_mask))
        with jax.named_scope("commit"):
            # took tokens emitted = took - 1 accepted drafts and the token after them: ``last``
            # and those drafts enter the state (with their MTP pairs); the last emitted token is
            # the next ``last``.
            at = jnp.maximum(took - 1, 0)
            moved = took > 0
            loop = loop.replace(
                state=commit_fn(params, pending, traces, verify, hidden, took, kernels),
                last=jnp.where(moved, jnp.take_along_axis(emitted, at[:, None], axis=1)[:, 0],
                               loop.last),
                accepted=loop.accepted + jnp.sum(jnp.where(moved, took - 1, 0)),
                iterations=loop.iterations + 1)
        if progress is not None:  # every progress_every steps, and after the last
            lax.cond((loop.iterations % progress_every == 0)
                     | ~jnp.any(loop.stop_reason == STOP_RUNNING),
                     lambda n: jax.debug.callback(progress, n), lambda n: None,
                     loop.num_generated)
        return loop

    def running(loop):
        return jnp.any(loop.stop_reason == STOP_RUNNING)
    start = loop.iterations
    if max_steps is None:
        loop = lax.while_loop(running, body, loop)
    else:
        loop = lax.while_loop(lambda loop: running(loop) & (loop.iterations < start + max_steps),
                              body, loop)
    if progress is not None:  # every row stopped on its first token: no step ran
        lax.cond(loop.iterations == start, lambda n: jax.debug.callback(progress, n),
                 lambda n: None, loop.num_generated)
    return loop


def emitted_since(loop: SpeculativeLoop, since: Array, width: int, pad_id
                  ) -> tuple[Array, Logprobs | None]:
    """Each row's tokens emitted after its first ``since[r]``, left-aligned in [R, width]
    (``pad_id`` after them; their :class:`Logprobs` as ``loop.logprobs``, zeros and ``pad_id``
    top ids after them, None without): what a stream chunk shows."""
    index = since[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    new = index < loop.num_generated[:, None]
    index = jnp.minimum(index, loop.tokens.shape[1] - 1)

    def take(x, fill):
        at = index.reshape(*index.shape, *(1,) * (x.ndim - 2))
        got = jnp.take_along_axis(x, at, axis=1)
        return jnp.where(new.reshape(at.shape), got, jnp.asarray(fill, x.dtype))

    tokens = take(loop.tokens, pad_id)
    if loop.logprobs is None:
        return tokens, None
    lp = loop.logprobs
    return tokens, Logprobs(processed=take(lp.processed, 0), raw=take(lp.raw, 0),
                            top_ids=take(lp.top_ids, pad_id),
                            top_logprobs=take(lp.top_logprobs, 0))


def speculative_chunk_fn(params: Params, loop: SpeculativeLoop, budgets: Array, eos_ids: Array,
                         pad_id, sampling: SamplingParams | None, keys: Array,
                         head: Array | None = None, *, num_speculative_tokens: int,
                         chunk_size: int, features: SamplingFeatures | None = None,
                         kernels: Kernels = choice.XLA, draft_vocab: Array | None = None,
                         stop_sequences: Array, logprobs: int | None = None
                         ) -> tuple[SpeculativeLoop, tuple[Array, Logprobs | None]]:
    """Up to ``chunk_size`` verify steps (:func:`speculative_steps_fn`), then what they emitted
    (:func:`emitted_since`: [R, chunk_size · (k + 1)] tokens and log-probabilities)."""
    since = loop.num_generated
    loop = speculative_steps_fn(params, loop, budgets, eos_ids, sampling, keys, head,
                                num_speculative_tokens=num_speculative_tokens, features=features,
                                kernels=kernels, draft_vocab=draft_vocab,
                                stop_sequences=stop_sequences, logprobs=logprobs,
                                max_steps=chunk_size)
    return loop, emitted_since(loop, since, chunk_size * (num_speculative_tokens + 1), pad_id)


def speculative_generate_fn(params: Params, state: DecodeState, prompts: Array,
                            prompt_lengths: Array, budgets: Array, eos_ids: Array, pad_id,
                            sampling: SamplingParams | None = None, keys: Array | None = None, *,
                            num_speculative_tokens: int, max_new_tokens: int,
                            features: SamplingFeatures | None = None,
                            kernels: Kernels = choice.XLA, prefill_chunk_size: int | None = None,
                            query_block: int = 512, draft=None,
                            draft_vocab: Array | None = None,
                            stop_sequences: Array | None = None,
                            logprobs: int | None = None,
                            return_state: bool = False, progress=None,
                            progress_every: int = 1) -> SpeculativeLoop:
    """Speculative generation; pure, un-jitted, unvalidated (``generate`` checks):
    :func:`speculative_start_fn`, then :func:`speculative_steps_fn` until every row stops.

    state: R rows keeping MTP pairs (``init_state(..., mtp=True)``; ValueError otherwise), empty
    or holding earlier tokens the prompts continue, with room for prompt + budget + k more
    tokens; prompts [R, T]
    int32 right-padded, prompt_lengths [R] >= 1, budgets [R] >= 1, eos_ids [E] (-1 pads);
    ``sampling`` (leaves [R]; None: greedy), ``keys`` [R] per-row keys (a
    row's draws at a step use ``fold_in(key, num_generated)``); statics:
    ``num_speculative_tokens`` k >= 1, ``max_new_tokens`` N (the output width), ``features``
    (``sampling.features_of``; None: greedy; with ``penalties``, [R, V] token counts and the
    prompts' ids are kept). ``draft``: test hook, ``(loop, mtp_drafts [R, k])
    -> drafts [R, k]`` replacing the MTP's drafts (e.g. an oracle that is right with a set
    probability; then drafts count as drawn from a one-hot q). ``draft_vocab``: [V'] int32
    distinct ids the drafts come from (:func:`check_draft_vocab`; None: the whole vocabulary).
    ``stop_sequences``: [S, L] int32 right-aligned, -1 padded (``generate``'s; None: none).
    ``logprobs`` (static): fill ``loop.logprobs`` with that many top ones (None: not computed;
    0 and ids ``pad_id`` past a row's last token, as ``generate``'s). ``return_state``
    (static): the final loop's ``state`` holds every emitted token (the last fed through one
    decode step, as ``generation.feed_last_fn``), else all but the last. ``progress``
    (static): ``progress(num_generated [R])`` on the host every ``progress_every`` verify
    steps and at the end. Returns the final loop.
    """
    if stop_sequences is None:
        stop_sequences = jnp.full((1, 1), -1, jnp.int32)
    if keys is None:
        keys = sampling_lib.row_keys(jax.random.key(0), prompts.shape[0])
    loop = speculative_start_fn(params, state, prompts, prompt_lengths, budgets, eos_ids, pad_id,
                                sampling, keys, max_new_tokens=max_new_tokens, features=features,
                                kernels=kernels, prefill_chunk_size=prefill_chunk_size,
                                query_block=query_block, stop_sequences=stop_sequences,
                                logprobs=logprobs)
    loop = speculative_steps_fn(params, loop, budgets, eos_ids, sampling, keys,
                                draft_head(params, draft_vocab),
                                num_speculative_tokens=num_speculative_tokens, features=features,
                                kernels=kernels, draft=draft, draft_vocab=draft_vocab,
                                stop_sequences=stop_sequences, logprobs=logprobs,
                                progress=progress, progress_every=progress_every)
    if return_state:
        loop = loop.replace(state=decode_step_fn(params, loop.state, loop.last, None, kernels)[1])
    return loop
