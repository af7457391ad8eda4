"""Speculative decoding (``num_speculative_tokens``) through the rest of the generation API:
``generate_stream`` (the same tokens, draws, log-probabilities and state as ``generate``'s
speculative call, chunk by chunk), ``progress``, ``precompile``'s executables (used, no tracing),
and the repetition, presence and frequency penalties (greedy tokens and log-probabilities equal
plain decoding's with oracle drafts accepting runs; sampled ones in distribution). Apart from
tests/test_speculative.py so that no one process compiles too many programs (CI runs a process
per file)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import generation
from test_speculative import (CONFIG, _chi_square_same, assert_logprobs_equal,
                              assert_states_close, oracle_draft, padded_prompts)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(3))


@pytest.mark.parametrize("chunk_size, dispatch_ahead", [(1, False), (3, False), (1, True)],
                         ids=["1-read_then_dispatch", "3-read_then_dispatch", "1-dispatch_ahead"])
def test_speculative_stream_equals_speculative_generate(params, chunk_size, dispatch_ahead,
                                                        monkeypatch):
    """generate_stream(num_speculative_tokens=2): the first chunk one token a row, each later
    one [R, chunk_size * 3], a row's new tokens first and pad_id after them; joined, they are
    generate's speculative tokens and log-probabilities, sampled rows too (the same draws),
    with num_samples = 2, an EOS id, a stop sequence and ragged budgets; the last chunk's state
    is generate's return_state; greedy with a draft vocabulary gives plain greedy's tokens."""
    monkeypatch.setattr(generation, "_dispatch_ahead", lambda loop: dispatch_ahead)  # (a GPU's)
    c = CONFIG
    k = 2
    rng = np.random.default_rng(21)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (6, 2)]
    sampling = jd.SamplingParams.create(temperature=0.9, top_k=8)
    free = np.asarray(jd.generate(params, prompts, 14, sampling, jax.random.key(4),
                                  eos_token_ids=[], num_samples=2,
                                  num_speculative_tokens=k).tokens)
    kw = dict(max_new_tokens=[14, 11], sampling=sampling, key=jax.random.key(4),
              eos_token_ids=[int(free[0, 9])], stop_sequences=[free[2, 4:6].tolist()],
              num_samples=2, return_logprobs=True, top_logprobs=2, return_state=True,
              max_len=64, num_speculative_tokens=k)
    want = jd.generate(params, prompts, **kw)
    assert {"eos", "stop", "length"} <= set(want.stop_reasons())
    chunks = list(jd.generate_stream(params, prompts, chunk_size=chunk_size, pad_id=-7, **kw))
    assert chunks[0].tokens.shape == (4, 1)
    assert all(ch.tokens.shape == (4, chunk_size * (k + 1)) for ch in chunks[1:])
    before = np.zeros(4, np.int32)
    for ch in chunks:
        new = ch.num_generated - before
        width = ch.tokens.shape[1]
        # new tokens first, then pad_id; their log-probs there, zeros and pad ids after
        np.testing.assert_array_equal(ch.tokens == -7, np.arange(width)[None, :] >= new[:, None])
        assert (ch.logprobs.raw[ch.tokens == -7] == 0).all()
        assert (ch.logprobs.top_ids[ch.tokens == -7] == -7).all()
        before = ch.num_generated
    joined = np.concatenate([ch.tokens for ch in chunks], axis=1)
    assert [[t for t in row if t != -7] for row in joined.tolist()] == want.token_lists()
    for name in ("raw", "processed", "top_logprobs", "top_ids"):
        got = np.concatenate([getattr(ch.logprobs, name) for ch in chunks], axis=1)
        ref = np.asarray(getattr(want.logprobs, name))
        for row in range(4):
            n = int(want.num_generated[row])
            np.testing.assert_array_equal(got[row][joined[row] != -7], ref[row, :n])
    np.testing.assert_array_equal(chunks[-1].num_generated, np.asarray(want.num_generated))
    np.testing.assert_array_equal(chunks[-1].stop_reason, np.asarray(want.stop_reason))
    assert all(ch.state is None for ch in chunks[:-1])
    assert_states_close(chunks[-1].state, want.state)

    plain = jd.generate(params, prompts, 9, eos_token_ids=[])
    chunks = list(jd.generate_stream(params, prompts, 9, eos_token_ids=[], chunk_size=chunk_size,
                                     num_speculative_tokens=k,
                                     draft_vocab=np.arange(0, c.vocab_size, 3)))
    joined = np.concatenate([ch.tokens for ch in chunks], axis=1)
    assert [[t for t in row if t >= 0] for row in joined.tolist()] == plain.token_lists()


def test_speculative_precompiled_executables_are_used(params):
    """precompile(..., num_speculative_tokens=2) and generate/generate_stream given its
    executables: no jit call traces or compiles (the loop's, the stream's start, draft-vocabulary
    head, chunk and last-token step), and the tokens, sampled, are those of the same calls
    without them; a given state with num_samples = 2 too."""
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(max_new_tokens=[9, 6], sampling=jd.SamplingParams.create(temperature=0.8,
                                                                        top_k=20),
              key=jax.random.key(3), eos_token_ids=(), num_speculative_tokens=2,
              return_logprobs=True, pad_id=-5)
    jits = (generation.speculative_generate_jit, generation.speculative_start_jit,
            generation.speculative_chunk_jit, generation._draft_head_jit,
            generation._feed_last_jit)

    def sizes():
        return [f._cache_size() for f in jits]

    want = jd.generate(params, prompts, **kw)
    executables = generation.precompile(params, prompts, **kw)
    before = sizes()
    out = jd.generate(params, prompts, executables=executables, **kw)
    assert sizes() == before  # ran the precompiled executable, no jit
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))

    skw = dict(kw, draft_vocab=np.arange(0, CONFIG.vocab_size, 2), return_state=True)
    want = jd.generate(params, prompts, **skw)
    executables = generation.precompile(params, prompts, stream=True, chunk_size=2, **skw)
    assert len(executables.by_signature) == 4  # start, head, chunk, last token
    before = sizes()
    chunks = list(jd.generate_stream(params, prompts, chunk_size=2, executables=executables,
                                     **skw))
    assert sizes() == before
    joined = np.concatenate([ch.tokens for ch in chunks], axis=1)
    assert [[t for t in row if t != -5] for row in joined.tolist()] == want.token_lists()
    assert_states_close(chunks[-1].state, want.state)

    state = lambda: jd.prefill(params, jd.init_state(CONFIG, 2, 64, mtp=True),  # noqa: E731
                               [[3, 1, 4], [1, 5, 0]], [3, 2])[1]
    fkw = dict(kw, num_samples=2, max_new_tokens=5)
    want = jd.generate(params, prompts, state=state(), **fkw)
    given = state()
    executables = generation.precompile(params, prompts, state=given, **fkw)
    before = sizes()
    out = jd.generate(params, prompts, state=given, executables=executables, **fkw)
    assert sizes() == before
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))


def test_speculative_progress_sees_the_counts(params):
    """progress with num_speculative_tokens: called on the host every chunk_size verify steps
    and after the last with num_generated [R], non-decreasing, ending at the output's counts."""
    seen = []
    out = jd.generate(params, [[1, 2, 3], [4]], [12, 7], eos_token_ids=[], chunk_size=2,
                      num_speculative_tokens=2, progress=lambda n: seen.append(np.array(n)))
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert len(seen) >= 2 and all(s.shape == (2,) for s in seen)
    assert all((a <= b).all() and (b - a <= 2 * 3).all() for a, b in zip(seen, seen[1:]))
    np.testing.assert_array_equal(seen[-1], np.asarray(out.num_generated))
    seen.clear()  # every row stops on its first token: no verify step, one call
    jax.block_until_ready(jd.generate(params, [[1, 2, 3], [4]], 1, eos_token_ids=[],
                                      num_speculative_tokens=2, progress=seen.append))
    jax.effects_barrier()
    assert [np.asarray(n).tolist() for n in seen] == [[1, 1]]


def test_speculative_penalties_equal_plain(params):
    """Repetition (prompt counted in row 0 only), presence and frequency penalties, greedy,
    oracle drafts right 3 times in 4 (a verified position's penalties count the drafts before
    it): the tokens and each token's processed/raw log-probabilities and top 3 equal plain
    generate's (float32), an EOS and ragged budgets included; through generate (the MTP's
    drafts) and generate_stream too; the penalties change the tokens."""
    c = CONFIG
    rng = np.random.default_rng(31)
    prompts = [list(rng.integers(0, c.vocab_size, n)) for n in (7, 3, 12)]
    budgets = [16, 7, 14]
    sampling = jd.SamplingParams.create(3, repetition_penalty=[1.8, 1.5, 2.5],
                                        presence_penalty=[0.7, 0.0, 0.3],
                                        frequency_penalty=[0.4, 0.9, 0.0],
                                        penalize_prompt=[True, False, False])
    free = np.asarray(jd.generate(params, prompts, budgets, sampling, eos_token_ids=[]).tokens)
    unpenalised = np.asarray(jd.generate(params, prompts, budgets, eos_token_ids=[]).tokens)
    assert (free != unpenalised).any()
    eos = int(free[2, 9])
    plain = jd.generate(params, prompts, budgets, sampling, eos_token_ids=[eos],
                        return_logprobs=True, top_logprobs=3)
    ref = np.asarray(plain.tokens)
    k = 3
    loop = generation.speculative_generate_jit(
        params, jd.init_state(c, 3, 64, mtp=True), jnp.asarray(padded_prompts(prompts)),
        jnp.asarray([len(p) for p in prompts]), jnp.asarray(budgets),
        jnp.asarray([eos] + [-1] * 7, jnp.int32), -1, sampling,
        num_speculative_tokens=k, max_new_tokens=ref.shape[1],
        features=jd.sampling.features_of(sampling), kernels=jd.Kernels(),
        draft=oracle_draft(ref, k), logprobs=3)
    np.testing.assert_array_equal(np.asarray(loop.tokens), ref)
    assert int(loop.accepted) > 0.4 * int(np.sum(plain.num_generated))
    assert_logprobs_equal(loop.logprobs, plain.logprobs)
    spec = jd.generate(params, prompts, budgets, sampling, eos_token_ids=[eos],
                       num_speculative_tokens=2)
    np.testing.assert_array_equal(np.asarray(spec.tokens), ref)
    chunks = jd.generate_stream(params, prompts, budgets, sampling, eos_token_ids=[eos],
                                num_speculative_tokens=2, chunk_size=2)
    joined = np.concatenate([ch.tokens for ch in chunks], axis=1)
    assert [[t for t in row if t >= 0] for row in joined.tolist()] == plain.token_lists()


def test_speculative_sampling_with_penalties_matches_plain_in_distribution(params):
    """2,048 rows of one prompt, temperature 1, top-k 4 and a repetition penalty of 3 on
    generated and prompt tokens plus a frequency penalty: the joint distribution of the 2nd
    and 3rd tokens from speculative sampling (k = 2: both past a verify step, penalised by the
    tokens before them) against plain sampling's, a two-sample chi-square."""
    rows = 2048
    prompt = [[5, 17, 99, 3]] * rows
    sampling = jd.SamplingParams.create(temperature=1.0, top_k=4, repetition_penalty=3.0,
                                        frequency_penalty=0.5)
    plain = np.asarray(jd.generate(params, prompt, 3, sampling, jax.random.key(1),
                                   eos_token_ids=[]).tokens)
    spec = np.asarray(jd.generate(params, prompt, 3, sampling, jax.random.key(2),
                                  eos_token_ids=[], num_speculative_tokens=2).tokens)
    unpenalised = np.asarray(jd.generate(params, prompt[:256], 3, jd.SamplingParams.create(
        temperature=1.0, top_k=4), jax.random.key(1), eos_token_ids=[]).tokens)
    # the penalty bites: a repeat of the first token is rarer than without it
    repeats = lambda t: np.mean(t[:, 1] == t[:, 0])  # noqa: E731
    assert repeats(plain) < repeats(unpenalised)
    _chi_square_same(plain[:, 1:3], spec[:, 1:3])
