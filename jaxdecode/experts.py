"""The routed experts of the MoE block (HF ``Qwen3_5MoeExperts``): each (token, slot) pair's
SwiGLU through its expert, reading only the experts the routing chose.

``routed_experts(x, weights, experts, gate_up_proj, down_proj)``: x [N, H] (model dtype),
weights [N, k] (model dtype, renormalised), experts [N, k] int32, gate_up_proj [E, 2·I, H]
(rows [0, I) gate, [I, 2·I) up), down_proj [E, H, I]; returns [N, H], the sum over a token's k
slots of ``weight · down(silu(gate(x)) · up(x))``, each product in the model dtype as HF and
the k terms summed in float32 in slot order (deterministic: no atomics).

Two static-shape forms, picked by the number of pairs P = N·k (:func:`use_pairs`):

* **pairs** (decode, P <= E): each pair's expert weights gathered, then batched GEMVs: reads
  the chosen experts' weights, as a grouped GEMV would.
* **rounds** (P > E: prefill, large batches): pairs sorted by expert fill [E, C] slots, C per
  expert a round (:func:`capacity`); each round is one batched GEMM over all E experts (every
  weight read once, E·C ≈ 2P + 8E rows), and a ``while_loop`` runs rounds until the largest
  group is done, so no pair is dropped whatever the routing. Its VJP (:func:`_rounds_bwd`)
  walks the same rounds.

Expert parallel (``expert_parallel`` m > 1: the stack is one device's E/m experts): a device's
own pairs gathered into a few slots (:func:`expert_parallel_capacity`) run the pairs form, the
full form only where they overflow. Block-FP8 stacks (``Fp8Linear``) are dequantised as read.

Why not ``jax.lax.ragged_dot``: XLA's GPU compiler rewrites it to a dense dot over every
expert (``RaggedDotRewriter``: an [E, P, H] masked operand), reading all E experts at batch 1
and doing E times the FLOPs in prefill (benchmarks/RESULTS.md, the MoE tables).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode.activations import silu
from jaxdecode.quantization import Fp8Linear, tie_to_input

Array = jax.Array
f32 = jnp.float32

PAIRS_MAX_BYTES = 4 << 30  # gathered expert weights the pairs form may hold at once


def use_pairs(num_pairs: int, num_experts: int, expert_bytes: int) -> bool:
    """The pairs form up to E pairs while their gathered weights stay under
    :data:`PAIRS_MAX_BYTES` (the faster one there on the H200: benchmarks/RESULTS.md); else
    rounds (each reads all E experts once)."""
    return num_pairs <= num_experts and num_pairs * expert_bytes <= PAIRS_MAX_BYTES


def capacity(num_pairs: int, num_experts: int) -> int:
    """Slots per expert in a round: twice the mean group plus 8, a multiple of 8, so that
    near-uniform routing takes one round (a second round reads every expert again)."""
    mean = -(-num_pairs // num_experts)
    return -(-(2 * mean + 8) // 8) * 8


def _stack_bytes(stack: Array | Fp8Linear) -> int:
    """Bytes of one value of an expert stack: 1 for block FP8 (its scales ~1/16384 more)."""
    return 1 if isinstance(stack, Fp8Linear) else stack.dtype.itemsize


def _take(stack: Array | Fp8Linear, ids: Array, dtype) -> Array:
    """The experts ``ids`` of a stack [E, ...] -> [len(ids), ...]; a block-FP8 stack's gathered
    and dequantised to ``dtype`` (as ``model.linear``'s XLA form: weight-only, frozen), which XLA
    fuses into the GEMV that reads it."""
    if isinstance(stack, Fp8Linear):
        return stack.take(ids).dequantize(dtype)
    return stack[ids]


def _dense(stack: Array | Fp8Linear, dtype) -> Array:
    """Every expert of a stack, a block-FP8 one dequantised to ``dtype``."""
    return stack.dequantize(dtype) if isinstance(stack, Fp8Linear) else stack


def _swiglu(x, gate_up, down, *, subscripts):
    """down(silu(gate(x)) · up(x)) in x's dtype; ``subscripts`` (gate_up, down) einsums."""
    ie = down.shape[-1]
    gu = jnp.einsum(subscripts[0], x, gate_up)
    return jnp.einsum(subscripts[1], silu(gu[..., :ie]) * gu[..., ie:], down)


def _gathered(xs, ids, w, gate_up_proj, down_proj):
    """[S, H]: row s of ``xs`` through expert ``ids[s]`` (its weights gathered, batched GEMVs),
    times ``w`` flattened to [S] (model dtype)."""
    out = _swiglu(xs, _take(gate_up_proj, ids, xs.dtype), _take(down_proj, ids, xs.dtype),
                  subscripts=("ph,pih->pi", "pi,phi->ph"))
    return out * w.reshape(-1)[:, None]


def _pairs(x, weights, experts, gate_up_proj, down_proj):
    """[P, H]: each pair's weighted expert output (model dtype), pair p = token p // k."""
    ids = experts.reshape(-1)
    return _gathered(jnp.repeat(x, experts.shape[1], axis=0), ids, weights, gate_up_proj,
                     down_proj)


def _slots(r, order, starts, group_sizes, cap):
    """Round r's [E, C] slots: the sorted pair each holds (0 where empty) and which are real."""
    rank = r * cap + jnp.arange(cap, dtype=jnp.int32)[None, :]
    valid = rank < group_sizes[:, None]
    pair = order[jnp.where(valid, starts[:, None] + rank, 0)]
    return pair, valid


def _round(x, pair_weights, pair, valid, gate_up_proj, down_proj, k):
    """One round's weighted outputs [E, C, H] (zeros in empty slots); block-FP8 stacks
    dequantised here, inside the round, where XLA can fuse them into the batched GEMM."""
    xe = jnp.where(valid[..., None], x[pair // k], 0)
    out = _swiglu(xe, _dense(gate_up_proj, x.dtype), _dense(down_proj, x.dtype),
                  subscripts=("ech,eih->eci", "eci,ehi->ech"))
    return out * jnp.where(valid, pair_weights[pair], 0)[..., None]


def _routing(experts, num_experts):
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # pairs grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    starts = jnp.cumsum(group_sizes) - group_sizes
    return order, starts, group_sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(k, x, pair_weights, order, starts, group_sizes, gate_up_proj, down_proj):
    """[P, H]: as :func:`_pairs`, by rounds (module docstring); int arguments: no cotangent."""
    return _rounds_fwd(k, x, pair_weights, order, starts, group_sizes, gate_up_proj,
                       down_proj)[0]


def _num_rounds(group_sizes, cap):
    return lax.div(jnp.max(group_sizes) + cap - 1, cap)


def _rounds_fwd(k, x, pair_weights, order, starts, group_sizes, gate_up_proj, down_proj):
    e, p, h = gate_up_proj.shape[0], pair_weights.shape[0], x.shape[1]
    cap = capacity(p, e)
    _, (gate_up_proj, down_proj) = tie_to_input(x, (gate_up_proj, down_proj))  # one layer's copy

    def body(r, out):
        pair, valid = _slots(r, order, starts, group_sizes, cap)
        y = _round(x, pair_weights, pair, valid, gate_up_proj, down_proj, k)
        # each pair sits in exactly one (round, slot): a set, no adds; empty slots dropped
        return out.at[jnp.where(valid, pair, p)].set(y, mode="drop")

    # Zeros (the rows no round writes: pairs of another device's experts) made from this
    # layer's routing (min(count, 0) = 0): XLA merges constant starts of all layers into one
    # fusion at the program's start, every layer's [P, H] buffer then live at once (a prefill's
    # memory grew with the depth: benchmarks/RESULTS.md, "MoE fixed").
    start = jnp.broadcast_to(jnp.minimum(group_sizes[0], 0).astype(x.dtype), (p, h))
    out = lax.fori_loop(0, _num_rounds(group_sizes, cap), body, start)
    return out, (x, pair_weights, order, starts, group_sizes, gate_up_proj, down_proj)


def _rounds_bwd(k, res, g):
    x, pair_weights, order, starts, group_sizes, gate_up_proj, down_proj = res
    e, p = gate_up_proj.shape[0], pair_weights.shape[0]
    cap = capacity(p, e)
    _, (gate_up_proj, down_proj) = tie_to_input(g, (gate_up_proj, down_proj))
    # cotangents for x, the pair weights and the stacks that are not block FP8 (frozen: None)
    inputs = [a for a in (x, pair_weights, gate_up_proj, down_proj)
              if not isinstance(a, Fp8Linear)]

    def body(r, acc):
        pair, valid = _slots(r, order, starts, group_sizes, cap)

        def round_of(x, pair_weights, *dense):  # dense: the stacks that are not FP8
            it = iter(dense)
            stacks = [s if isinstance(s, Fp8Linear) else next(it)
                      for s in (gate_up_proj, down_proj)]
            return _round(x, pair_weights, pair, valid, *stacks, k)

        _, vjp = jax.vjp(round_of, *inputs)
        grads = vjp(jnp.where(valid[..., None], g[pair], 0))
        return tuple(a + d.astype(f32) for a, d in zip(acc, grads))

    zero = jnp.minimum(group_sizes[0], 0).astype(f32)  # from the routing, as in _rounds_fwd
    zeros = tuple(jnp.broadcast_to(zero, a.shape) for a in inputs)
    grads = iter(lax.fori_loop(0, _num_rounds(group_sizes, cap), body, zeros))
    out = [next(grads).astype(a.dtype) if not isinstance(a, Fp8Linear) else None
           for a in (x, pair_weights, gate_up_proj, down_proj)]
    return (out[0], out[1], None, None, None, out[2], out[3])


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


@functools.cache
def expert_parallel_capacity(num_pairs: int, devices: int) -> int:
    """Slots C for the pairs routed to one device's experts when the experts are split over
    ``devices`` (each holds 1/devices of them; routing assumed uniform, so a device's count is
    Binomial(P, 1/devices)): the C >= 1 minimising C·q + P·(1 - q), q = F(C)^devices, the
    expected pairs the slowest device computes when each runs C slots, or all P where its pairs
    overflow them (:func:`routed_experts`' fallback). E.g. P = 10 on 8 devices: C = 4."""
    if devices <= 1 or num_pairs <= 1:  # nothing to split
        return max(num_pairs, 1)
    p, s = num_pairs, 1 / devices
    best, best_cost, cdf = p, float(p), 0.0
    for c in range(p + 1):
        cdf += math.exp(math.lgamma(p + 1) - math.lgamma(c + 1) - math.lgamma(p - c + 1)
                        + c * math.log(s) + (p - c) * math.log1p(-s))
        q = min(cdf, 1.0) ** devices
        cost = max(c, 1) * q + p * (1 - q)
        if cost < best_cost:
            best, best_cost = max(c, 1), cost
        if q > 1 - 1e-12:  # larger C only costs more
            break
    return best


def plan(num_pairs: int, num_experts: int, expert_bytes: int, expert_parallel: int = 1
         ) -> tuple[str, int]:
    """(form, slots) :func:`routed_experts` runs for P pairs over a stack of E experts of
    ``expert_bytes`` each: the form for all P pairs (:func:`use_pairs`), and slots < P where one
    of ``expert_parallel`` devices runs its own pairs in that many slots first (the pairs form
    over :func:`expert_parallel_capacity` slots, where those fit it); else slots = P."""
    form = "pairs" if use_pairs(num_pairs, num_experts, expert_bytes) else "rounds"
    if expert_parallel > 1 and num_pairs <= num_experts * expert_parallel:
        cap = expert_parallel_capacity(num_pairs, expert_parallel)
        if cap < num_pairs and use_pairs(cap, num_experts, expert_bytes):
            return form, cap
    return form, num_pairs


def _local_pairs(x, weights, experts, here, gate_up_proj, down_proj, cap):
    """[P, H] as :func:`_pairs` (weights already 0 where not ``here``), computing ``cap`` slots:
    the pairs of this device's experts in order, then empty slots that read the first slot's
    expert again with weight 0 (the weights other devices' pairs would stream stay unread).
    Needs sum(here) <= cap."""
    k, e = experts.shape[1], gate_up_proj.shape[0]
    flat_here = here.reshape(-1)
    p = flat_here.shape[0]
    rank = jnp.cumsum(flat_here) - 1  # a local pair's slot
    slot_pair = jnp.zeros((cap,), jnp.int32).at[jnp.where(flat_here, rank, cap)].set(
        jnp.arange(p, dtype=jnp.int32), mode="drop")
    valid = jnp.arange(cap) < jnp.sum(flat_here)
    ids = jnp.clip(experts.reshape(-1)[slot_pair], 0, e - 1)
    ids = jnp.where(valid, ids, ids[0])
    w = jnp.where(valid, weights.reshape(-1)[slot_pair], 0)
    out = _gathered(x[slot_pair // k], ids, w, gate_up_proj, down_proj)
    return jnp.zeros((p, x.shape[1]), out.dtype).at[jnp.where(valid, slot_pair, p)].set(
        out, mode="drop")


def _by_form(form, x, weights, experts, here, gate_up_proj, down_proj):
    """[P, H] of one form; ``weights`` already 0 where not ``here``."""
    k, e = experts.shape[1], gate_up_proj.shape[0]
    if form == "pairs":  # another device's pair reads an expert of this one, times 0
        return _pairs(x, weights, jnp.clip(experts, 0, e - 1), gate_up_proj, down_proj)
    if form == "rounds":  # another device's pair sorts last, in no expert's group
        order, starts, group_sizes = _routing(jnp.where(here, experts, e), e)
        return _rounds(k, x, weights.reshape(-1), order, starts, group_sizes, gate_up_proj,
                       down_proj)
    raise ValueError(f"form={form!r}: expected 'pairs', 'rounds' or None")


def routed_experts(x: Array, weights: Array, experts: Array, gate_up_proj: Array | Fp8Linear,
                   down_proj: Array | Fp8Linear, *, form: str | None = None, out_dtype=None,
                   expert_parallel: int = 1) -> Array:
    """The routed experts' output [N, H] in ``out_dtype`` (default x's dtype; shapes and math:
    module docstring; HF ``Qwen3_5MoeExperts.forward``); ``form`` "pairs" | "rounds" | None
    (:func:`use_pairs` decides). A pair whose expert id is outside [0, E) adds nothing (expert
    parallelism: the experts another device holds). ``expert_parallel`` m > 1 (the stack is one
    of m devices' E/m experts; read only with ``form`` None, an explicit form runs as asked):
    the pairs form over :func:`expert_parallel_capacity` slots holding this device's pairs,
    where they fit (a ``lax.cond``; else the form for all N·k pairs), so a device streams about
    its own share of the chosen experts instead of k per token. Block-FP8 stacks
    (:class:`Fp8Linear`, weight [E, 2·I, H] / [E, H, I]) are dequantised to x's dtype as read
    (the rounds form: inside each round; frozen, no cotangent). Raises ValueError for any other
    ``form``."""
    n, k = experts.shape
    e, two_i, h = gate_up_proj.shape
    here = (experts >= 0) & (experts < e)
    weights = jnp.where(here, weights, 0)
    cap = n * k
    if form is None:
        form, cap = plan(n * k, e, 3 * (two_i // 2) * h * _stack_bytes(gate_up_proj),
                         expert_parallel)
    args = (x, weights, experts, here, gate_up_proj, down_proj)
    if cap < n * k:
        out = lax.cond(jnp.sum(here) <= cap, functools.partial(_local_pairs, cap=cap),
                       functools.partial(_by_form, form), *args)
    else:
        out = _by_form(form, *args)
    return jnp.sum(out.astype(f32).reshape(n, k, h), axis=1).astype(out_dtype or x.dtype)
