"""Why a generated row stops: the stop-reason codes and the per-token end tests that the plain
loop (``generation``) and the speculative loop (``speculative``) share.

A row ends on the first of, in this order of precedence when several fall on one token: an
invalid token (``sampling.sample``'s -1 for logits that are NaN or all -inf; emitted as -1), one
of the EOS ids (emitted), the last token of a stop sequence of ids (emitted), or its token
budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

STOP_RUNNING = 0  # not stopped yet (only seen in streamed chunks)
STOP_EOS = 1  # emitted one of the EOS ids (included in the output)
STOP_LENGTH = 2  # reached its token budget
STOP_SEQUENCE = 3  # emitted the last token of a stop sequence (included in the output)
STOP_INVALID = 4  # the logits were NaN or all -inf (sampling.invalid): emitted -1 and stopped
STOP_REASONS = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_LENGTH: "length",
                STOP_SEQUENCE: "stop", STOP_INVALID: "invalid"}


def token_ends(new: Array, recent: Array | None, eos_ids: Array,
               stop_sequences: Array | None) -> tuple[Array, Array, Array]:
    """Which of the tokens ``new`` [R, W] int32 (W emitted in order, after ``recent``) end their
    row, each as [R, W] bool: (invalid: a negative id; EOS: one of ``eos_ids`` [E] (-1 padding
    never matches, an invalid token is not EOS); stop: the token completes a sequence of
    ``stop_sequences`` [S, L] int32, right-aligned and -1 padded (-1 matches anything; an all -1
    row matches nothing), matched against ``recent`` [R, L - 1] (the row's last emitted ids, -1
    before the first) followed by ``new``). ``stop_sequences`` None: no stop sequences."""
    is_invalid = new < 0
    is_eos = jnp.any(new[..., None] == eos_ids, axis=-1) & ~is_invalid
    if stop_sequences is None:
        return is_invalid, is_eos, jnp.zeros_like(is_invalid)
    span, width = stop_sequences.shape[1], new.shape[1]
    emitted = jnp.concatenate([recent, new], axis=1)  # [R, L - 1 + W]
    windows = jnp.stack([emitted[:, i:i + span] for i in range(width)], axis=1)  # [R, W, L]
    hit = jnp.all((stop_sequences < 0) | (windows[:, :, None] == stop_sequences), axis=-1)
    is_stop = jnp.any(hit & jnp.any(stop_sequences >= 0, axis=-1), axis=-1)
    return is_invalid, is_eos, is_stop


def stop_reason(is_invalid: Array, is_eos: Array, is_stop: Array, spent: Array,
                running: Array | int = STOP_RUNNING) -> Array:
    """The STOP_* code of the first test that holds, in the module's order of precedence
    (arrays of one shape, bool); ``running`` where none does. int32."""
    return jnp.select([is_invalid, is_eos, is_stop, spent],
                      [STOP_INVALID, STOP_EOS, STOP_SEQUENCE, STOP_LENGTH],
                      running).astype(jnp.int32)
