"""Host-side checks and padding buckets for token-id inputs (lists of ids), shared by
``jaxdecode.generation`` and ``jaxdecode.scoring``; every error is raised before device work."""

from __future__ import annotations

import jax
import numpy as np

MIN_PROMPT_BUCKET = 16  # prompts are padded to a power of two >= this many tokens
MIN_TOKEN_BUCKET = 16  # generated/continuation buffers likewise


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def token_lists(x, name: str, vocab: int) -> list[list[int]]:
    """A list of token-id lists or a [B, T] array as lists, each non-empty and in the vocab."""
    one, out = name.rstrip("s"), []
    for i, p in enumerate(np.asarray(x) if isinstance(x, jax.Array) else x):
        if isinstance(p, (int, np.integer)):
            raise ValueError(f"{name} must be a batch: a list of token-id lists; got a flat list "
                             "of ints (wrap it in a list)")
        arr = np.asarray(p)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{one} {i} must be a 1-D sequence of integer token ids (tokenize "
                             f"text first); got shape {arr.shape}, dtype {arr.dtype}")
        out.append(arr.astype(np.int64).tolist())
        bad = [t for t in out[-1] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{one} {i} has token ids outside [0, vocab_size={vocab}): {bad[:8]}")
    empty = [i for i, p in enumerate(out) if not p]
    if empty:
        raise ValueError(f"{one}(s) {empty} are empty: each needs at least one token")
    return out
