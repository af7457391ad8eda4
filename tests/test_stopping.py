"""``stopping.token_ends`` (shared by the plain and the speculative loop) against a plain Python
reading of the rules, on random ids: W tokens at once equal W one-token calls."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxdecode.stopping import (STOP_EOS, STOP_INVALID, STOP_LENGTH, STOP_RUNNING, STOP_SEQUENCE,
                                stop_reason, token_ends)


def _python_ends(history, token, eos, stops):
    """history: the row's earlier ids; the rules as the module docstring states them."""
    invalid = token < 0
    is_eos = not invalid and token in [e for e in eos if e >= 0]
    is_stop = False
    for seq in stops:
        ids = [t for t in seq if t >= 0]
        if not ids:
            continue
        window = (list(history) + [token])[-len(seq):]
        window = [-1] * (len(seq) - len(window)) + window
        is_stop |= all(s < 0 or w == s for s, w in zip(seq, window))
    return invalid, is_eos, is_stop


def test_token_ends_matches_the_rules_and_one_token_calls():
    rng = np.random.default_rng(7)
    rows, width, span = 6, 5, 4
    eos = np.array([3, 5, -1, -1], np.int32)
    stops = np.full((3, span), -1, np.int32)
    stops[0, -2:] = [1, 2]  # right-aligned
    stops[1, -3:] = [2, -1, 4]  # -1 inside: any token
    # stops[2]: all -1, matches nothing
    new = rng.integers(-1, 7, (rows, width)).astype(np.int32)
    recent = rng.integers(-1, 7, (rows, span - 1)).astype(np.int32)
    recent[0] = -1  # nothing emitted yet
    new[1, 1:3] = [1, 2]  # stops[0] inside the new tokens
    recent[2, -2:], new[2, 0] = [2, 6], 4  # stops[1] across recent and new
    got = [np.asarray(a) for a in token_ends(jnp.asarray(new), jnp.asarray(recent),
                                             jnp.asarray(eos), jnp.asarray(stops))]
    assert all(a.shape == (rows, width) and a.dtype == bool for a in got)
    for r in range(rows):
        history = [t for t in recent[r]]
        for w in range(width):
            want = _python_ends(history, int(new[r, w]), eos.tolist(), stops.tolist())
            assert tuple(bool(a[r, w]) for a in got) == want, (r, w, history, new[r, w])
            one = token_ends(jnp.asarray(new[r:r + 1, w:w + 1]),
                             jnp.asarray([history[-(span - 1):]], np.int32),
                             jnp.asarray(eos), jnp.asarray(stops))
            assert tuple(bool(a[0, 0]) for a in one) == want
            history.append(int(new[r, w]))
    assert got[0].any() and got[1].any() and got[2].any()  # the draw exercises every rule
    none = token_ends(jnp.asarray(new), None, jnp.asarray(eos), None)[2]
    assert not np.asarray(none).any()


def test_stop_reason_precedence():
    t, f = jnp.asarray([True]), jnp.asarray([False])
    assert int(stop_reason(t, t, t, t)[0]) == STOP_INVALID
    assert int(stop_reason(f, t, t, t)[0]) == STOP_EOS
    assert int(stop_reason(f, f, t, t)[0]) == STOP_SEQUENCE
    assert int(stop_reason(f, f, f, t)[0]) == STOP_LENGTH
    assert int(stop_reason(f, f, f, f)[0]) == STOP_RUNNING
    assert int(stop_reason(f, f, f, f, jnp.asarray([STOP_EOS]))[0]) == STOP_EOS
