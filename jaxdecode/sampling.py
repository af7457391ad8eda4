"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition/presence/frequency penalties.

:func:`sample` is pure. Every knob is a per-row leaf of :class:`SamplingParams` (rows may differ;
traced values never recompile) and each row draws from its own key (independent of the batch).

Order of operations, as HF ``GenerationMixin._get_logits_processor`` (transformers 5.24.0):

  1. penalties: repetition (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``: a
     seen token's logit divided by the penalty if positive, multiplied if negative) over the
     prompt's tokens (``prompt_mask``, rows with ``penalize_prompt``, as HF and vLLM) and the
     generated ones (``token_counts``); then presence and frequency over the generated tokens
     only (OpenAI, vLLM: ``logit -= presence * (count > 0) + frequency * count``);
  2. temperature (``logits / T``; ``T < MIN_TEMPERATURE``, 0 included: argmax of the penalised
     logits, as vLLM, where ``logits / T`` would overflow float32);
  3. top-k: keep the ``k`` largest logits;
  4. top-p (Holtzman et al. 2020): keep the most likely tokens whose probability (after 2-3)
     reaches ``p``: with ``top_p_keep_ties`` every token tied with the cut-off probability,
     else the smallest such prefix of the tokens sorted by probability (HF
     ``TopPLogitsWarper``, vLLM), ties broken toward higher ids;
  5. min-p (Nguyen et al. 2024): drop tokens below ``min_p`` times the top probability;
  6. one categorical draw per row (Gumbel-max, ``jax.random.categorical``).

Top-k and top-p find their cut-off by an exact radix search on the float32 bits, not a sort of
the vocabulary (far slower on CPU). A step no row uses is left out of the program
(:class:`SamplingFeatures`, read on the host by :func:`features_of`); with traced values and no
``features`` each runs under a ``lax.cond``, a device wait on a GPU (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.core import Tracer  # imported once: jax.core's module getattr is slow per lookup

Array = jax.Array

MIN_TEMPERATURE = 1e-5  # below it a row is greedy (vLLM's _SAMPLING_EPS)


def invalid(logits: Array) -> Array:
    """[..., V] -> [...] bool: logits holding a NaN or all -inf (a decode step's rejected row:
    full cache, id outside the vocabulary; or non-finite weights): :func:`sample` gives such a
    row the id -1 and generation stops it ("invalid")."""
    return jnp.isnan(logits).any(-1) | (logits == -jnp.inf).all(-1)


def is_sampled(temperature):
    """Which rows draw (numpy or jax): ``temperature >= MIN_TEMPERATURE``; the others take the
    argmax of their penalised logits."""
    return temperature >= MIN_TEMPERATURE

_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "penalize_prompt", "top_p_keep_ties")
_DTYPES = {"top_k": np.int32, "penalize_prompt": np.bool_, "top_p_keep_ties": np.bool_}


@struct.dataclass
class SamplingParams:
    """Per-row sampling settings; each leaf is ``[B]`` (or a scalar, broadcast to every row).
    Build with :meth:`create`, which validates; the raw constructor does not."""
    temperature: Array  # float32 >= 0; 0 (below MIN_TEMPERATURE) = greedy (argmax)
    top_k: Array  # int32 >= 0; 0 = off
    top_p: Array  # float32 in (0, 1]; 1 = off
    min_p: Array  # float32 in [0, 1]; 0 = off
    repetition_penalty: Array  # float32 > 0, on seen tokens (penalize_prompt says which); 1 = off
    presence_penalty: Array  # float32, subtracted once from a generated token's logit; 0 = off
    frequency_penalty: Array  # float32, subtracted per occurrence of a generated token; 0 = off
    # bool: the repetition penalty also counts the prompt's tokens (HF, vLLM); False: only the
    # generated ones. Presence and frequency always count generated tokens only (vLLM).
    penalize_prompt: Array = True
    # bool: top-p keeps every token tied with the cut-off probability; False: the smallest sorted
    # prefix, as HF and vLLM (ties broken toward higher ids; costs a second, shorter search).
    top_p_keep_ties: Array = True

    @classmethod
    def create(cls, batch_size: int | None = None, *, temperature=0.0, top_k=0, top_p=1.0,
               min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
               frequency_penalty=0.0, penalize_prompt=True,
               top_p_keep_ties=True) -> "SamplingParams":
        """Validated settings as numpy arrays. Each argument is a scalar or a ``[batch_size]``
        sequence; with ``batch_size``, every leaf is broadcast to ``[batch_size]``.

        Raises:
          ValueError: ``batch_size`` not a positive int or None, a value outside its range
            (class docstring), or a leaf of another length.
        """
        if batch_size is not None and (not isinstance(batch_size, (int, np.integer))
                                       or isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r} must be a positive int (or None: the "
                             "leaves' own lengths)")
        values = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, penalize_prompt=penalize_prompt,
                      top_p_keep_ties=top_p_keep_ties)
        leaves = {}
        for name, value in values.items():
            dtype = _DTYPES.get(name, np.float32)
            if dtype == np.bool_:
                arr = np.asarray(value)
                if arr.dtype != np.bool_ and not (arr.dtype.kind in "iu"
                                                  and np.isin(arr, (0, 1)).all()):
                    raise ValueError(f"{name}={value!r} must be a bool (or one per row)")
            if name == "top_k":
                arr = np.asarray(value)
                if arr.dtype.kind not in "iu" and not np.all(np.mod(arr, 1) == 0):
                    raise ValueError(f"top_k={value!r} must be an integer (0 = off)")
                if np.any(arr > np.iinfo(np.int32).max):
                    raise ValueError(f"top_k={value!r} must be below 2**31 (a value >= the "
                                     "vocabulary size keeps every token, as 0 does)")
            arr = np.asarray(value, dtype=dtype)
            if arr.ndim > 1:
                raise ValueError(f"{name} must be a scalar or a [batch] sequence, got shape "
                                 f"{arr.shape}")
            if batch_size is not None:
                if arr.ndim == 1 and arr.shape[0] != batch_size:
                    raise ValueError(f"{name} has {arr.shape[0]} values for {batch_size=}")
                arr = np.broadcast_to(arr, (batch_size,)).copy()
            leaves[name] = arr
        params = cls(**leaves)
        validate(params)
        return params

    def broadcast(self, batch_size: int) -> "SamplingParams":
        """Every leaf as a ``[batch_size]`` array (host or device arrays as given)."""
        def one(x):
            x = jnp.asarray(x) if isinstance(x, jax.Array) else np.asarray(x)
            if x.ndim == 1 and x.shape[0] != batch_size:
                raise ValueError(f"sampling leaf of shape {x.shape} does not fit {batch_size=}")
            xp = jnp if isinstance(x, jax.Array) else np
            return xp.broadcast_to(x, (batch_size,))
        return jax.tree.map(one, self)

    def repeat(self, n: int) -> "SamplingParams":
        """Each row repeated ``n`` times (row-major, like :func:`jaxdecode.fork`)."""
        return jax.tree.map(lambda x: np.repeat(np.asarray(x), n, axis=0)
                            if np.ndim(x) else x, self)


def greedy(batch_size: int | None = None) -> SamplingParams:
    """Greedy decoding settings (temperature 0, every filter and penalty off)."""
    return SamplingParams.create(batch_size)


def validate(params: SamplingParams) -> None:
    """Checks concrete (not traced) sampling values; one ValueError naming every field outside
    its range (:class:`SamplingParams`; temperature and penalties must also be finite)."""
    try:
        v = {name: np.asarray(getattr(params, name)) for name in _FIELDS}
    except jax.errors.TracerArrayConversionError:
        raise ValueError("validate() needs concrete values, not traced ones") from None
    problems = []

    def bad(name, mask, why):
        if np.any(mask):
            problems.append(f"{name}={_show(v[name][mask] if v[name].ndim else v[name])} {why}")

    t = v["temperature"]
    bad("temperature", ~np.isfinite(t) | (t < 0), "must be finite and >= 0 (0 = greedy)")
    k = v["top_k"]
    bad("top_k", k < 0, "must be >= 0 (0 = off)")
    p = v["top_p"]
    bad("top_p", ~((p > 0) & (p <= 1)), "must be in (0, 1] (1 = off)")
    m = v["min_p"]
    bad("min_p", ~((m >= 0) & (m <= 1)), "must be in [0, 1] (0 = off)")
    r = v["repetition_penalty"]
    bad("repetition_penalty", ~np.isfinite(r) | (r <= 0), "must be finite and > 0 (1 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        bad(name, ~np.isfinite(v[name]), "must be finite (0 = off)")
    if problems:
        raise ValueError("invalid sampling parameters: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class SamplingFeatures:
    """Which sampling steps at least one row uses (hashable: a ``jit`` static). Build with
    :func:`features_of`; :data:`ALL_FEATURES` (every step) is always correct."""
    penalties: bool = True  # some row has a repetition, presence or frequency penalty
    sampled: bool = True  # some row is_sampled (else every row takes the argmax)
    top_k: bool = True  # some sampled row uses that filter (also top_p, min_p)
    top_p: bool = True
    min_p: bool = True
    top_p_prefix: bool = True  # some sampled row uses top-p with top_p_keep_ties False


ALL_FEATURES = SamplingFeatures()


def features_of(params: SamplingParams) -> SamplingFeatures:
    """The steps some row of ``params`` uses, from concrete values; ValueError for traced values
    and for arrays this process cannot read whole (multi-process global arrays)."""
    values = {name: getattr(params, name) for name in _FIELDS}
    partial = [name for name, x in values.items() if isinstance(x, jax.Array)
               and not isinstance(x, Tracer) and not x.is_fully_addressable]
    if partial:
        raise ValueError(f"features_of() needs values this process can read; {partial} span "
                         "devices of other processes")
    try:
        v = {name: np.asarray(x) for name, x in values.items()}
    except jax.errors.TracerArrayConversionError:
        raise ValueError("features_of() needs concrete values, not traced ones") from None
    sampled = np.broadcast_to(is_sampled(v["temperature"]), np.broadcast_shapes(
        *(x.shape for x in v.values())))
    return SamplingFeatures(
        penalties=bool(np.any(v["repetition_penalty"] != 1) | np.any(v["presence_penalty"] != 0)
                       | np.any(v["frequency_penalty"] != 0)),
        sampled=bool(np.any(sampled)),
        top_k=bool(np.any(sampled & (v["top_k"] > 0))),
        top_p=bool(np.any(sampled & (v["top_p"] < 1))),
        min_p=bool(np.any(sampled & (v["min_p"] > 0))),
        top_p_prefix=bool(np.any(sampled & (v["top_p"] < 1) & ~v["top_p_keep_ties"])))


def _features_if_concrete(params: SamplingParams) -> SamplingFeatures | None:
    """:func:`features_of` ``(params)``, or None when a value is traced."""
    try:
        return features_of(params)
    except ValueError:
        return None


def _show(x) -> str:
    x = np.asarray(x).ravel()
    return repr(x[0].item()) if x.size == 1 else str(x.tolist())


def _sortable_key(x: Array) -> Array:
    """float32 -> uint32 of the same order (non-NaN values; -0.0 and +0.0 tie)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)  # -0.0 -> +0.0
    bits = lax.bitcast_convert_type(x, jnp.int32)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse their order
    return lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(0x80000000)


def _radix_bits() -> int:
    """Cut-off bits found per pass over the vocabulary (speed only; the cut-off is the same). GPU:
    4, as memory-bound passes favour fewer; elsewhere 1 (a bisection: the least arithmetic)."""
    return 4 if jax.default_backend() == "gpu" else 1


def _largest_key_where(u: Array, weights: Array, target: Array, num_bits: int = 32) -> Array:
    """Per row, the largest uint32 t with ``sum(weights[u >= t]) >= target`` (u: [B, V] uint32
    below ``2**num_bits``, weights: [B, V] >= 0, target: [B]; returns [B] uint32). A
    most-significant-digit-first radix search: each pass fixes the next bits of t, keeping the
    largest candidate digit whose mass reaches the target. Exact for non-negative weights; t = 0
    (keep all) when the total never reaches the target; t <= the row's largest key, so its
    largest entry is always kept.
    """
    bits = _radix_bits()
    digits = jnp.arange(1, 2 ** bits, dtype=jnp.uint32)  # [D], ascending
    prefix = jnp.zeros(u.shape[:1], jnp.uint32)
    zero = jnp.zeros((), weights.dtype)
    top = -(-num_bits // bits) * bits  # the digits cover [0, 2**top)
    for shift in range(top - bits, -1, -bits):  # unrolled: no device loop
        cand = prefix[:, None] | (digits[None, :] << shift)  # [B, D]
        mass = jnp.sum(jnp.where(u[:, None, :] >= cand[:, :, None], weights[:, None, :], zero),
                       axis=-1)  # [B, D]
        digit = jnp.max(jnp.where(mass >= target[:, None], digits[None, :], 0), axis=-1)
        prefix = prefix | (digit << shift)
    return jnp.minimum(prefix, jnp.max(u, axis=-1))


def top_k_mask(logits: Array, top_k: Array) -> Array:
    """Sets all but each row's ``top_k`` largest logits to -inf (ties with the k-th are kept).
    logits: [B, V] float32; top_k: [B] int, 0 (or >= V) keeps every logit."""
    top_k = jnp.asarray(top_k, jnp.int32)
    u = _sortable_key(logits)
    k = jnp.where(top_k > 0, top_k, logits.shape[-1])
    cut = _largest_key_where(u, jnp.ones(u.shape, jnp.int32), k)
    return jnp.where(u >= cut[:, None], logits, -jnp.inf)


def top_p_mask(logits: Array, top_p: Array, keep_ties: Array | None = None) -> Array:
    """Keeps each row's most likely tokens whose ``softmax`` mass reaches ``top_p``; the rest set
    to -inf. logits: [B, V] float32; top_p: [B] float in (0, 1], 1 keeps every logit;
    keep_ties: [B] bool (None: all True). True keeps every token tied with the cut-off
    probability. False keeps the smallest prefix of the tokens sorted by probability, HF
    ``TopPLogitsWarper``'s count: among the tied ones, the higher ids first (torch's stable
    ascending sort in HF and vLLM on a GPU; on a CPU torch orders ties arbitrarily).
    """
    top_p = jnp.asarray(top_p, jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    u = _sortable_key(logits)
    cut = _largest_key_where(u, probs, top_p)
    keep = u >= cut[:, None]
    if keep_ties is not None:
        # The mass still missing after the tokens above the cut-off comes from the tied ones
        # (equal probabilities), taken from the highest id down: a search over the ids.
        above = u > cut[:, None]
        tied = u == cut[:, None]
        missing = top_p - jnp.sum(jnp.where(above, probs, 0.0), axis=-1)
        vocab = logits.shape[-1]
        ids = lax.broadcasted_iota(jnp.uint32, u.shape, 1)
        first_id = _largest_key_where(ids, jnp.where(tied, probs, 0.0), missing,
                                      num_bits=max(1, (vocab - 1).bit_length()))
        prefix = above | (tied & (ids >= first_id[:, None]))
        keep = jnp.where(jnp.asarray(keep_ties, bool)[:, None], keep, prefix)
    keep = keep | (top_p[:, None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def min_p_mask(logits: Array, min_p: Array) -> Array:
    """Sets to -inf tokens whose probability is below ``min_p`` times the row's largest.
    logits: [B, V] float32; min_p: [B] float in [0, 1], 0 keeps every logit."""
    min_p = jnp.asarray(min_p, jnp.float32)
    ratio = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # p / p_max
    return jnp.where(ratio < min_p[:, None], -jnp.inf, logits)


def prompt_mask_of(tokens: Array, num_new: Array, vocab_size: int) -> Array:
    """[B, V] bool: which ids occur among each row's ``num_new[b]`` first ``tokens`` ([B, T]
    int32, right-padded); the ``prompt_mask`` of :func:`sample`, built on device (a scatter)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    batch, length = tokens.shape
    real = jnp.arange(length)[None, :] < jnp.asarray(num_new)[:, None]
    ids = jnp.where(real & (tokens >= 0), tokens, vocab_size)  # vocab_size: dropped
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape)
    return jnp.zeros((batch, vocab_size), bool).at[rows, ids].set(True, mode="drop")


def apply_penalties(logits: Array, token_counts: Array | None, params: SamplingParams,
                    prompt_mask: Array | None = None) -> Array:
    """Repetition, presence and frequency penalties (step 1 of the module docstring).

    logits: [B, V] float32; token_counts: [B, V] int32 generated-token counts (None: none yet);
    params: [B] or scalar leaves; prompt_mask: [B, V] bool, the prompt's ids (None: no prompt
    known). Tokens generated, or in the prompt of a row with ``penalize_prompt``, get
    ``x / r if x > 0 else x * r`` (HF ``RepetitionPenaltyLogitsProcessor``); then
    ``- presence * (count > 0) - frequency * count``.
    """
    b = logits.shape[0]
    p = params.broadcast(b)
    rep = jnp.asarray(p.repetition_penalty, jnp.float32)[:, None]
    pres = jnp.asarray(p.presence_penalty, jnp.float32)[:, None]
    freq = jnp.asarray(p.frequency_penalty, jnp.float32)[:, None]
    if token_counts is None:
        token_counts = jnp.zeros(logits.shape, jnp.int32)
    generated = token_counts > 0
    seen = generated
    if prompt_mask is not None:
        seen = seen | (prompt_mask & jnp.asarray(p.penalize_prompt, bool)[:, None])
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return x - pres * generated - freq * token_counts.astype(jnp.float32)


def _maybe(features: SamplingFeatures | None, step: str, predicate, fn, x):
    """``fn(x)`` if some row uses ``step``: per ``features``, or (None) a ``lax.cond`` on
    ``predicate()``."""
    if features is None:
        return lax.cond(predicate(), fn, lambda x: x, x)
    return fn(x) if getattr(features, step) else x


def processed_logits(logits: Array, params: SamplingParams, token_counts: Array | None = None,
                     *, prompt_mask: Array | None = None,
                     features: SamplingFeatures | None = None) -> Array:
    """The [B, V] float32 logits each row draws from: steps 1-5 of the module docstring (rows with
    temperature 0, or below :data:`MIN_TEMPERATURE`, get their penalised logits unscaled and
    unfiltered). Args as :func:`sample`."""
    logits = jnp.asarray(logits, jnp.float32)
    b = logits.shape[0]
    if features is None:  # before broadcast, which would trace closed-over device arrays
        features = _features_if_concrete(params)
    p = params.broadcast(b)
    if token_counts is not None or prompt_mask is not None:
        logits = _maybe(features, "penalties",
                        lambda: (jnp.any(jnp.asarray(p.repetition_penalty) != 1)
                                 | jnp.any(jnp.asarray(p.presence_penalty) != 0)
                                 | jnp.any(jnp.asarray(p.frequency_penalty) != 0)),
                        lambda x: apply_penalties(x, token_counts, p, prompt_mask), logits)
    temperature = jnp.asarray(p.temperature, jnp.float32)
    sampled = is_sampled(temperature)
    x = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    top_k = jnp.where(sampled, jnp.asarray(p.top_k, jnp.int32), 0)
    top_p = jnp.where(sampled, jnp.asarray(p.top_p, jnp.float32), 1.0)
    min_p = jnp.where(sampled, jnp.asarray(p.min_p, jnp.float32), 0.0)
    x = _maybe(features, "top_k", lambda: jnp.any(top_k > 0), lambda x: top_k_mask(x, top_k), x)
    prefix = features is None or features.top_p_prefix  # else no row asks for the prefix rule
    keep_ties = jnp.asarray(p.top_p_keep_ties, bool) if prefix else None
    x = _maybe(features, "top_p", lambda: jnp.any(top_p < 1),
               lambda x: top_p_mask(x, top_p, keep_ties), x)
    x = _maybe(features, "min_p", lambda: jnp.any(min_p > 0), lambda x: min_p_mask(x, min_p), x)
    return x


def row_keys(key: Array, batch_size: int) -> Array:
    """``[batch_size]`` keys from one key: row ``i`` gets ``fold_in(key, i)`` (its index only)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch_size, dtype=jnp.uint32))


def sample(logits: Array, key: Array, params: SamplingParams,
           token_counts: Array | None = None, *, prompt_mask: Array | None = None,
           features: SamplingFeatures | None = None, return_processed_logits: bool = False):
    """Draws one token per row.

    Args:
      logits: [B, V] float (cast to float32; other dtypes: ValueError).
      key: [B] per-row PRNG keys (typed, or raw ``[B, 2]`` uint32), or one key (:func:`row_keys`).
      params: :class:`SamplingParams`, leaves ``[B]`` or scalars; not validated here (they may
        be traced): use :func:`validate` or :meth:`SamplingParams.create` on the host.
      token_counts: optional [B, V] int32 generated-token counts (penalties).
      prompt_mask: optional [B, V] bool, the ids in each row's prompt (:func:`prompt_mask_of`),
        which the repetition penalty counts in rows with ``penalize_prompt``. With neither, no
        penalty applies.
      features: :func:`features_of` ``(params)`` (static; a step it turns off is skipped for
        every row). None: derived from concrete values, else each step runs under a ``lax.cond``
        (a device wait on a GPU): under ``jit`` pass ``features_of(host_params)``.

    Returns [B] int32 ids: the argmax of the penalised logits where temperature is 0 (or below
    :data:`MIN_TEMPERATURE`), else a draw from ``softmax(processed_logits(...))``; -1 for a row
    with NaN logits (a decode step's rejected row: full cache, id outside the vocabulary) or all
    -inf, which the next step rejects.
    With ``return_processed_logits``: (ids, the [B, V] float32 ``processed_logits``).
    """
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be float, got {logits.dtype}")
    logits = logits.astype(jnp.float32)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got {logits.shape=}")
    b = logits.shape[0]
    if features is None:  # before broadcast, which would trace closed-over device arrays
        features = _features_if_concrete(params)
    p = params.broadcast(b)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        key = row_keys(key, b)
    if key.shape[0] != b:
        raise ValueError(f"need one key per row: {key.shape=} for {logits.shape=}")
    x = processed_logits(logits, p, token_counts, prompt_mask=prompt_mask, features=features)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    sampled = is_sampled(jnp.asarray(p.temperature, jnp.float32))

    def draw(x):
        drawn = jax.vmap(jax.random.categorical)(key, x).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy_tokens)

    if features is None:
        tokens = lax.cond(jnp.any(sampled), draw, lambda x: greedy_tokens, x)
    else:
        tokens = draw(x) if features.sampled else greedy_tokens
    tokens = jnp.where(invalid(logits), -1, tokens)
    return (tokens, x) if return_processed_logits else tokens


@struct.dataclass
class Logprobs:
    """Log-probabilities (natural log, float32) of generated tokens, leaves [..., R] (per step)
    or [R, N] (a whole output; 0, and ids ``pad_id``, after a row's last token; NaN for a -1
    token). vLLM's "processed" and "raw" logprobs:"""
    processed: Array  # under the distribution the token was drawn from: softmax of the
    # processed_logits (penalties, temperature, top-k/p, min-p; temperature 0: the penalised
    # logits, whose argmax greedy takes)
    raw: Array  # under the model's distribution, softmax(logits)
    top_ids: Array  # [..., n] int32: the n most likely ids under the raw distribution
    top_logprobs: Array  # [..., n] float32: their raw log-probabilities, descending


def token_logprobs(logits: Array, processed_logits: Array, tokens: Array,
                   top_logprobs: int = 0) -> Logprobs:
    """:class:`Logprobs` of ``tokens`` [B] (from :func:`sample` with
    ``return_processed_logits``) under logits and processed_logits, both [B, V];
    ``top_logprobs`` (static, 0-V): how many top raw ids to report."""
    safe = jnp.maximum(tokens, 0)[:, None]

    def of(x):  # [B, V] -> (logsumexp [B, 1], log-prob of the token [B])
        x = jnp.asarray(x, jnp.float32)
        lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
        got = jnp.take_along_axis(x, safe, axis=1)[:, 0] - lse[:, 0]
        return lse, jnp.where(tokens >= 0, got, jnp.nan)

    lse, raw = of(logits)
    _, processed = of(processed_logits)
    top_values, top_ids = lax.top_k(jnp.asarray(logits, jnp.float32), top_logprobs)
    return Logprobs(processed=processed, raw=raw, top_ids=top_ids.astype(jnp.int32),
                    top_logprobs=top_values - lse)
