"""jaxdecode.generation: continuing from a DecodeState (multi-turn) and stop sequences (issue 22),
plus the CLI's --stop / --stop-ids."""

import dataclasses
import re
import warnings

import jax
import numpy as np
import pytest

import jaxdecode as jd
from conftest import FULL, LIN, tiny
from jaxdecode import cli
from jaxdecode import generation as gen
from jaxdecode.sampling import SamplingParams

VOCAB = 384
CONFIG = tiny(vocab_size=VOCAB, layer_types=(LIN, FULL, LIN, FULL), max_position_embeddings=512,
              eos_token_id=(VOCAB - 1,), rope_theta=10_000_000.0)


@pytest.fixture(scope="module")
def params():
    return jd.init_params(CONFIG, jax.random.key(1))  # float32


def _probe_logits(params, state):
    """Next-token logits after appending token 7 to every row (prefill of one token)."""
    rows = state.batch_size
    logits, _ = jd.prefill(params, state, np.full((rows, 1), 7, np.int32), np.ones(rows, np.int32))
    return np.asarray(logits)


def _close(a, b, rtol=5e-6):
    """Logits equal up to float32 rounding of the chunked vs recurrent forms."""
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * np.abs(b).max())


# ----- continuing from a state --------------------------------------------------------------------

@pytest.mark.slow
def test_two_turn_chat_from_the_returned_state_equals_one_long_prefill(params):
    """Turn 1 with return_state, turn 2 from that state with new tokens only == one generate
    over [turn 1 prompt + turn 1 output + turn 2 prompt]: same tokens, same lengths, same next
    logits, and the same logits as a plain prefill of the whole conversation (ragged, 2 rows,
    one row stopped by EOS: its EOS is in the state)."""
    turn1 = [[5, 17, 33, 2, 9], [100, 7]]
    free = gen.generate(params, turn1, [6, 9], eos_token_ids=()).token_lists()
    k = next(k for k in range(2, 6) if free[0][k] not in free[0][:k] + free[1])
    eos = (free[0][k],)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Some donated buffers were not usable")
        out1 = gen.generate(params, turn1, [6, 9], eos_token_ids=eos, return_state=True,
                            max_len=128)
        t1 = out1.token_lists()
        assert t1 == [free[0][:k + 1], free[1]] and out1.stop_reasons() == ["eos", "length"]
        state1 = out1.state
        np.testing.assert_array_equal(np.asarray(state1.lengths), [5 + k + 1, 2 + 9])
        turn2 = [[40, 41, 42], [50, 51, 52, 53, 54]]
        out2 = gen.generate(params, turn2, 10, eos_token_ids=(), state=state1)
    assert state1.lengths.is_deleted()  # donated: using it again is a clear error
    with pytest.raises(ValueError, match="was donated"):
        gen.generate(params, turn2, 4, state=state1)
    whole = [a + b + c for a, b, c in zip(turn1, t1, turn2)]
    ref = gen.generate(params, whole, 10, eos_token_ids=(), return_state=True, max_len=128)
    assert out2.token_lists() == ref.token_lists()
    assert out2.stop_reasons() == ["length"] * 2
    np.testing.assert_array_equal(np.asarray(out2.state.lengths), [len(w) + 10 for w in whole])
    np.testing.assert_array_equal(np.asarray(ref.state.lengths), [len(w) + 10 for w in whole])
    assert out2.state.max_len == 128

    # Plain prefill of every token (turn 2's output included) on a fresh state: the logits at
    # each of turn 2's positions pick its tokens, and the next logits agree.
    conv = [w + t for w, t in zip(whole, out2.token_lists())]
    tokens = np.zeros((2, max(map(len, conv))), np.int32)
    for r, c in enumerate(conv):
        tokens[r, :len(c)] = c
    fresh = jd.init_state(CONFIG, 2, 128)
    all_logits, plain = jd.prefill(params, fresh, tokens, np.array([len(c) for c in conv]),
                                   return_all_logits=True)
    all_logits = np.asarray(all_logits)
    for r, (w, c) in enumerate(zip(whole, conv)):
        picked = all_logits[r, len(w) - 1:len(c) - 1].argmax(-1)
        assert picked.tolist() == c[len(w):]
    want = _probe_logits(params, plain)
    _close(_probe_logits(params, out2.state), want)
    _close(_probe_logits(params, ref.state), want)


@pytest.mark.slow
def test_continuing_a_prefilled_state_with_num_samples_forks_after_the_new_tokens(params):
    """A state from jd.prefill (all but each prompt's last token) continued with that token and
    num_samples=3 == a fresh generate of the whole prompts; the returned state has 6 rows."""
    prompts = [[5, 17, 33, 2, 9], [100, 7]]
    state = jd.init_state(CONFIG, 2, 64)
    _, state = jd.prefill(params, state, np.array([[5, 17, 33, 2], [100, 0, 0, 0]], np.int32),
                          np.array([4, 1], np.int32))
    sp = SamplingParams.create(temperature=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Some donated")  # a forked state is not donated
        out = gen.generate(params, [[9], [7]], 8, sp, jax.random.key(3), (), state=state,
                           num_samples=3)
    want = gen.generate(params, prompts, 8, sp, jax.random.key(3), (), num_samples=3)
    assert out.token_lists() == want.token_lists()
    assert out.state.batch_size == 6
    np.testing.assert_array_equal(np.asarray(out.state.lengths), [5 + 8] * 3 + [2 + 8] * 3)


@pytest.mark.slow
def test_stream_returns_the_final_state_on_its_last_chunk(params):
    prompts = [[5, 17, 33, 2, 9], [100, 7]]
    eos = (gen.generate(params, prompts, 12, eos_token_ids=()).token_lists()[1][4],)
    out = gen.generate(params, prompts, 12, eos_token_ids=eos, return_state=True)
    chunks = list(gen.generate_stream(params, prompts, 12, eos_token_ids=eos, return_state=True,
                                      chunk_size=4))
    assert all(c.state is None for c in chunks[:-1])
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)
    assert [r[r != -1].tolist() for r in streamed] == out.token_lists()
    np.testing.assert_array_equal(np.asarray(chunks[-1].state.lengths),
                                  np.asarray(out.state.lengths))
    _close(_probe_logits(params, chunks[-1].state), _probe_logits(params, out.state))
    assert all(c.state is None for c in gen.generate_stream(params, prompts, 4))  # not asked
    assert gen.generate(params, prompts, 4).state is None


def _state(params, rows=2, fill=(3, 5), config=CONFIG, dtype="float32"):
    """A state of ``rows`` rows (max_len 64) holding ``fill[r]`` tokens per row."""
    state = jd.init_state(config, rows, 64, dtype)
    if config is not CONFIG or dtype != "float32":
        return state
    return jd.prefill(params, state, np.ones((rows, max(fill)), np.int32),
                      np.array(fill, np.int32))[1]


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda p: _state(p, 3, (1, 1, 1)), {}, "state has 3 rows but there are 2 prompts"),
    (lambda p: _state(p, config=dataclasses.replace(CONFIG, layer_types=(LIN, LIN, LIN, FULL))),
     {}, "does not match params.config"),
    (lambda p: _state(p, dtype="bfloat16"), {}, "dtype"),
    (lambda p: _state(p, fill=(3, 55)), {},
     r"prompt 1: 55 cached \+ 2 prompt tokens \+ max_new_tokens=8 exceeds max_len=64"),
    (_state, dict(max_len=64), "max_len or state, not both"),
    (_state, dict(prompts=[[1], []]), r"prompt\(s\) \[1\] are empty"),
    (lambda p: "not a state", {}, "must be a jaxdecode.DecodeState"),
])
def test_a_state_that_does_not_fit_raises_before_any_device_work(params, make, kwargs, message):
    state = make(params)
    call = dict(prompts=[[1, 2], [3, 4]], max_new_tokens=8, eos_token_ids=(), state=state)
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        gen.generate(params, **call)
    with pytest.raises(ValueError, match=message):
        next(gen.generate_stream(params, **call))
    if isinstance(state, jd.DecodeState):
        assert not state.lengths.is_deleted()  # not donated: still usable


# ----- stop sequences ---------------------------------------------------------------------------

def _host_stop(tokens, budget, stops):
    """Where each row stops, scanning its stop-free tokens on the host: (tokens, reason)."""
    for end in range(1, budget + 1):
        if any(end >= len(s) and tokens[end - len(s):end] == list(s) for s in stops):
            return tokens[:end], "stop"
    return tokens[:budget], "length"


PROMPTS4 = [[5, 17, 33, 2, 9], [100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [250]]


def _stops_from(free, prompts):
    """Stop sequences of lengths 1-3 cut from the stop-free output, one completed only by the
    prompt's tail (must not match there) and one that never occurs."""
    never = next([a, a, b] for a in range(VOCAB) for b in range(VOCAB)
                 if not any(r[i:i + 3] == [a, a, b] for r in free for i in range(len(r))))
    return [free[0][9:10], free[1][4:6], free[2][2:5], [prompts[3][-1], free[3][0]], never]


@pytest.mark.parametrize("num_samples", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stop_sequences_stop_where_a_host_scan_of_the_free_output_does(params, num_samples):
    sp = SamplingParams.create(temperature=1.0)
    kw = dict(sampling=sp, key=jax.random.key(5), eos_token_ids=(), num_samples=num_samples)
    prompts = PROMPTS4[:4 // num_samples]
    free = gen.generate(params, prompts, 16, **kw).token_lists()
    stops = _stops_from(free, [p for p in prompts for _ in range(num_samples)])
    want = [_host_stop(r, 16, stops) for r in free]
    assert [reason for _, reason in want[:3]] == ["stop"] * 3
    size = gen._generate_jit._cache_size()
    out = gen.generate(params, prompts, 16, stop_sequences=stops, **kw)
    assert gen._generate_jit._cache_size() == size  # stop sequences are traced values
    assert out.token_lists() == [t for t, _ in want]
    assert out.stop_reasons() == [reason for _, reason in want]
    np.testing.assert_array_equal(np.asarray(out.num_generated), [len(t) for t, _ in want])
    for row, (t, _) in zip(np.asarray(out.tokens), want):
        assert (row[len(t):] == -1).all()
    chunks = list(gen.generate_stream(params, prompts, 16, stop_sequences=stops, chunk_size=3,
                                      **kw))
    streamed = np.concatenate([c.tokens for c in chunks], axis=1)
    assert [r[r != -1].tolist() for r in streamed] == out.token_lists()
    assert [gen.STOP_REASONS[int(s)] for s in chunks[-1].stop_reason] == out.stop_reasons()


@pytest.mark.slow
def test_stop_reason_precedence_and_the_prompt_tail(params):
    """EOS wins over a stop sequence ending on the same token; a stop sequence that the
    prompt's tail would complete with the first generated token does not match."""
    free = gen.generate(params, PROMPTS4, 8, eos_token_ids=()).token_lists()
    t = free[0][2]
    out = gen.generate(params, PROMPTS4[:1], 8, eos_token_ids=(t,), stop_sequences=[[t]])
    assert out.token_lists() == [free[0][:free[0].index(t) + 1]]
    assert out.stop_reasons() == ["eos"]
    tail = [[p[-1], f[0]] for p, f in zip(PROMPTS4, free)]
    out = gen.generate(params, PROMPTS4, 8, eos_token_ids=(), stop_sequences=tail)
    assert out.token_lists() == [_host_stop(f, 8, tail)[0] for f in free]
    assert all(len(t) > 1 for t in out.token_lists())


def test_a_stop_sequence_ending_on_the_budget_gives_stop(params):
    free = gen.generate(params, PROMPTS4[:1], 16, eos_token_ids=()).token_lists()[0]
    budget = max(i + 1 for i in range(len(free)) if free[i] not in free[:i])
    out = gen.generate(params, PROMPTS4[:1], budget, eos_token_ids=(),
                       stop_sequences=[[free[budget - 1]]])
    assert out.token_lists() == [free[:budget]] and out.stop_reasons() == ["stop"]


@pytest.mark.slow
def test_long_and_many_stop_sequences_use_a_larger_bucket(params):
    """Over 8 sequences or 8 ids the arrays grow to the next power of two (a new executable);
    matching is unchanged."""
    free = gen.generate(params, PROMPTS4, 16, eos_token_ids=()).token_lists()
    stops = [[VOCAB - 2] * 9] + [[VOCAB - 3]] * 8 + [free[1][:10]]
    plan = gen._plan(params, PROMPTS4, 16, None, None, (), max_len=None, num_samples=1,
                     chunk_size=8, pad_id=-1, kernels=None, stop_sequences=stops)
    assert plan.stop_sequences.shape == (16, 16)
    assert plan.stop_sequences[-7].tolist() == [-1] * 6 + free[1][:10]
    out = gen.generate(params, PROMPTS4, 16, eos_token_ids=(), stop_sequences=stops)
    assert out.token_lists() == [_host_stop(f, 16, stops)[0] for f in free]


@pytest.mark.parametrize("stops, message", [
    ([1, 2], "flat list"),
    ([[1], []], r"stop_sequence\(s\) \[1\] are empty"),
    ([[1, VOCAB]], "stop_sequence 0 has token ids outside"),
    ("\n", "token ids"),
    ([[1.5]], "integer token ids"),
])
def test_invalid_stop_sequences_raise(params, stops, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(params, [[1, 2]], 4, stop_sequences=stops)


# ----- the command line ---------------------------------------------------------------------------

def _cli(capsys, *argv):
    status = cli.main(["generate", "--prompt-ids", "1,2,3", "--no-compile-cache", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.slow
def test_cli_stop_ids_and_stop_text(capsys):
    status, out, _ = _cli(capsys, "--max-new-tokens", "12")
    assert status == 0
    free = [int(i) for i in re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")]
    stop = free[4:6]
    status, out, _ = _cli(capsys, "--max-new-tokens", "12", "--stop-ids",
                          ",".join(map(str, stop)), "--stop-ids", "0")
    assert status == 0
    got = [int(i) for i in re.search(r"^ids: \[(.*)\]$", out, re.M).group(1).split(", ")]
    assert got == _host_stop(free, 12, [stop, [0]])[0]
    assert "stopped by stop" in out and f"stop sequences: [{stop}, [0]]" in out
    status, out, _ = _cli(capsys, "--max-new-tokens", "2", "--stop", "Hello world")
    tok = jd.load_tokenizer(None, jd.Config.from_preset("tiny").vocab_size)
    assert status == 0 and f"stop sequences: [{tok.encode('Hello world')}]" in out


@pytest.mark.parametrize("argv, message", [
    (["--stop-ids", "1,x"], "--stop-ids '1,x' must be comma-separated integers"),
    (["--stop-ids", ""], "--stop-ids is empty"),
    (["--stop", ""], "--stop is empty"),
    (["--stop-ids", "999999999"], "stop_sequence 0 has token ids outside"),
])
def test_cli_bad_stop_arguments_exit_with_one_line(capsys, argv, message):
    status, _, err = _cli(capsys, "--max-new-tokens", "2", *argv)
    assert status == 2 and err.count("\n") == 1 and message in err, err


def test_cli_stop_text_without_a_tokenizer_is_a_clear_error(capsys, monkeypatch):
    from jaxdecode import tokenizer
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda *a: None)
    status, _, err = _cli(capsys, "--max-new-tokens", "2", "--stop", "x")
    assert status == 2 and "--stop needs a tokenizer" in err and "--stop-ids" in err, err
