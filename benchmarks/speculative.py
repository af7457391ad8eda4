"""Speculative decoding with the MTP layer: the cost of a verify step, and tokens/s against the
number of drafts accepted, in one run.

    python benchmarks/speculative.py [--model qwen3.5-9b] [--batches 1,8] [--ks 1,2,3,4]
        [--context 1024] [--tokens 256] [--oracle 0.8,0.9] [--accept 2] [--draft-vocab N]
        [--stream 1,4] [--penalty 1.1] [--profile] [--smoke]

Per (batch, k), ms per call (median of 3 repeats of 30 calls, compile apart): a plain decode step
(``step.jit_decode_step``, the library's step; again on a state keeping the MTP layer's pairs,
``init_state(..., mtp=True)``, whose step also appends its token's pair), a verify step of k + 1 tokens
(``model.verify_fn`` then ``model.commit_fn`` of all of them, on a state keeping MTP pairs as the
loop's does, so the commit appends their pairs; jitted, state donated), and one MTP
draft pass (``model.mtp_forward`` of one pair), both compiled with the library's
``COMPILER_OPTIONS``; the verify / plain ratio; and the tokens/s a speculative step would reach
with ``a`` drafts accepted on average, ``(a + 1) / (t_verify + k · t_draft)``, against
``1 / t_plain`` (a from 0 to k).

End to end at batch 1 and k = 3 (``--tokens`` new tokens, greedy, EOS off): ``jd.generate`` plain;
speculative with the MTP's own drafts (random weights accept almost none: the floor); and
speculative with an oracle draft (``speculative_generate_fn``'s ``draft`` hook) that is right with
probability ``--oracle`` per draft (the MTP-draft run's tokens, wrong ones shifted by one id; a
comma-separated list runs one each), or right on exactly the first ``--accept`` drafts of every
step (acceptance length ``--accept`` + 1 tokens a step, no draws): its measured drafts accepted
per step beside its tokens/s,
timed twice: each call with the last call's output alive (as every row), and with it freed first
(the new call's buffers may then take the same addresses).

``--draft-vocab N``: the drafts (MTP pass and end to end) from N fixed random ids
(``generate``'s ``draft_vocab``: the LM head's rows of those ids only); 0, the default, the whole
vocabulary.

``--stream 1,4``: the MTP-draft run and the plain run again through ``jd.generate_stream`` at each
chunk size (the host reads every chunk), beside the same runs in one ``generate`` call;
``--penalty r``: plain and MTP-draft speculative ``generate`` with a repetition penalty of r
(token counts kept), beside the runs without: the cost of streaming and of the penalties at the
same (near-zero) acceptance.

``--profile``: the first oracle run once more under CUPTI: its kernel time and kernel count per
verify step beside its wall time per step, and its largest kernels (where a step's time goes
beyond the verify step and the drafts). CUPTI misses kernels inside a command buffer's while
loop, so this run compiles the loop without ``generation.SPECULATIVE_COMPILER_OPTIONS``' loops
in command buffers (its wall time per step is the loop's with a host round trip per step).

Weights: bf16 fixed-seed random values with the preset's shapes plus one MTP layer; the KV caches
and states hold random values at ``--context`` tokens. ``--smoke``: the ``tiny`` preset on the CPU
(checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import generation, model, step  # noqa: E402
from decode import kernels_for, randomize_state  # noqa: E402
from step_profile import cupti_kernels  # noqa: E402


def _per_call(f, args_fn, calls=30, repeats=3):
    """Median seconds per call of ``f(*args_fn(out))`` chained ``calls`` times (the state
    threaded through), after 3 warm-up calls."""
    out = None
    for _ in range(3):
        out = f(*args_fn(out))
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args_fn(out))
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnames="kernels", donate_argnums=1,
                   compiler_options=step.COMPILER_OPTIONS)
def _verify(params, state, toks, *, kernels):
    """A verify step of all of ``toks`` [B, k+1], committed, lengths put back (stay at context)."""
    n = jnp.full((toks.shape[0],), toks.shape[1], jnp.int32)
    logits, hidden, pending, traces = model.verify_fn(params, state, toks, n, kernels)
    state = model.commit_fn(params, pending, traces, toks, hidden, n, kernels)
    return logits, state.replace(lengths=state.lengths - toks.shape[1])


@functools.partial(jax.jit, static_argnames="kernels", compiler_options=step.COMPILER_OPTIONS)
def _draft(params, cache, hidden, toks, start, head, *, kernels):
    """One MTP draft pass of one pair per row, scored against ``head`` (None: the LM head)."""
    one = jnp.ones((toks.shape[0],), jnp.int32)
    return model.mtp_forward(params, cache, hidden[:, None], toks[:, None], start, one, kernels,
                             lm_head=head)


# CUPTI does not report the kernels that run inside a command buffer's loop (CUDA graph
# conditional nodes): the profile compiles the loop with the library's step options instead.
_loop_without_graph_loops = jax.jit(
    generation.speculative.speculative_generate_fn,
    static_argnames=("num_speculative_tokens", "max_new_tokens", "features", "kernels",
                     "prefill_chunk_size", "query_block", "draft"),
    donate_argnames=("state",), compiler_options=step.COMPILER_OPTIONS)


def time_steps(params, batch, k, context, max_len, kernels, draft_vocab=None):
    """(plain, verify, draft, plain on a state keeping MTP pairs) seconds per call at this batch
    and k."""
    c = params.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, batch), jnp.int32)
    fresh = lambda mtp=False: randomize_state(  # noqa: E731
        jd.init_state(c, batch, max_len, params.dtype, mtp=mtp), context)

    def plain(mtp):  # the library's step on a state without / with MTP pairs
        state = fresh(mtp)

        def plain_args(out):
            nonlocal state
            if out is not None:
                state = out[1].replace(lengths=jnp.full((batch,), context, jnp.int32))
            return params, state, tokens, None

        return _per_call(step.jit_decode_step(c, kernels, mtp=mtp), plain_args)

    t_plain, t_plain_mtp = plain(False), plain(True)

    vtoks = jnp.tile(tokens[:, None], (1, k + 1))
    state = fresh(mtp=True)

    def verify_args(out):
        nonlocal state
        if out is not None:
            state = out[1]
        return params, state, vtoks

    t_verify = _per_call(lambda *a: _verify(*a, kernels=kernels), verify_args)

    kv = fresh().kv_cache[0]
    hidden = jnp.ones((batch, c.hidden_size), params.dtype)
    start = jnp.full((batch,), context, jnp.int32)

    head = None if draft_vocab is None else params.lm_head_weight[draft_vocab]

    def draft_args(out):
        cache = kv if out is None else out[2]
        return params, cache, hidden, tokens, start, head

    t_draft = _per_call(lambda *a: _draft(*a, kernels=kernels), draft_args)
    return t_plain, t_verify, t_draft, t_plain_mtp


def oracle_draft(reference, k, p=None, accept=None):
    """A ``draft`` hook right with probability ``p`` per draft: the reference run's next tokens,
    a wrong one where a fixed hash of (row, output position) falls at or above ``p``: the MTP's
    own draft, or the right id + 1 where that is right; with ``accept`` instead of ``p``, right
    on the first ``accept`` of the k drafts of every step, wrong on the rest. The result depends
    on every MTP draft, so XLA keeps all k draft passes (their LM heads included) as in a real
    run."""
    ref = jnp.asarray(np.maximum(reference, 0), jnp.int32)

    def draft(loop, drafts):
        pos = loop.num_generated[:, None] + jnp.arange(k)[None, :]
        right = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)
        row = jnp.arange(ref.shape[0])[:, None]
        u = ((pos * 7919 + row * 104729) % 1009) / 1009.0  # a fixed hash in [0, 1)
        ok = u < p if accept is None else jnp.arange(k)[None, :] < accept
        wrong = jnp.where(drafts != right, drafts, right + 1)
        return jnp.where(ok, right, wrong).astype(jnp.int32)

    return draft


def timed(fn, repeats=3, keep=True):
    """(the best of ``repeats`` calls' seconds after a first, compiling one; the last output);
    ``keep`` False: the last call's output freed before each call (its buffers reusable)."""
    out = fn()
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        if not keep:
            out = None
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
    return best, out


def overheads(params, tokens, k, streams, penalty, draft_vocab=None):
    """Seconds per token of the MTP-draft speculative and the plain run through
    ``jd.generate_stream`` (each chunk size of ``streams``, the host reading each chunk), and of
    plain and speculative ``jd.generate`` with a repetition penalty of ``penalty`` (greedy;
    None: not run):
    [(label, seconds per token, the matching unstreamed, unpenalised run's label)]."""
    prompt = [list(np.random.default_rng(2).integers(0, 1000, 16))]
    kw = dict(eos_token_ids=(), num_speculative_tokens=k, draft_vocab=draft_vocab)

    def best(fn):
        return timed(fn)[0] / tokens

    rows = []
    for chunk in streams:
        t = best(lambda: [c.tokens for c in jd.generate_stream(params, prompt, tokens,
                                                                chunk_size=chunk, **kw)])
        rows.append((f"speculative, MTP drafts, `generate_stream` chunk_size {chunk}", t,
                     "speculative"))
        t = best(lambda: [c.tokens for c in jd.generate_stream(params, prompt, tokens,
                                                                chunk_size=chunk,
                                                                eos_token_ids=())])
        rows.append((f"plain, `generate_stream` chunk_size {chunk}", t, "plain"))
    if penalty is not None:
        sampling = jd.SamplingParams.create(repetition_penalty=penalty)
        rows.append((f"plain, repetition penalty {penalty}",
                     best(lambda: jd.generate(params, prompt, tokens, sampling,
                                              eos_token_ids=())), "plain"))
        rows.append((f"speculative, MTP drafts, repetition penalty {penalty}",
                     best(lambda: jd.generate(params, prompt, tokens, sampling, **kw)),
                     "speculative"))
    return rows


def end_to_end(params, tokens, k, ps, kernels, draft_vocab=None, profile=False):
    """Seconds per token of plain generate and speculative (own drafts), and for each oracle
    of ``ps`` (a probability ``p``, or an int: exactly that many drafts right a step): (its
    label, seconds per token, mean drafts accepted per verify step, verify
    steps, whether its tokens equal the own-draft run's, and with ``profile`` the first
    oracle's loop without graph loops: (its seconds per token, its kernels under CUPTI
    [(name, ms)]), else None; seconds per token with the last call's output freed before each
    call, where the others keep it alive during the next: its buffers then sit elsewhere)."""
    c = params.config
    prompt = [list(np.random.default_rng(2).integers(0, 1000, 16))]

    t_plain, plain = timed(lambda: jd.generate(params, prompt, tokens, eos_token_ids=()))
    t_own, own = timed(lambda: jd.generate(params, prompt, tokens, eos_token_ids=(),
                                           num_speculative_tokens=k, draft_vocab=draft_vocab))
    # The oracle follows the speculative run's own tokens: in bf16 with random weights (near-tied
    # logits) the verify step's rounding can flip a greedy token against plain decoding's, and
    # an oracle of plain's tokens would then be wrong from there on.
    reference = np.asarray(own.tokens)
    n = reference.shape[1]
    padded = np.zeros((1, 16), np.int32)
    padded[0] = prompt[0]
    max_len = -(-(16 + n + k) // 64) * 64

    def oracle_run(draft, loop_fn=generation.speculative_generate_jit):
        return loop_fn(
            params, jd.init_state(c, 1, max_len, params.dtype, mtp=True), jnp.asarray(padded),
            jnp.asarray([16]), jnp.asarray([tokens]), jnp.full((8,), -1, jnp.int32), -1,
            num_speculative_tokens=k, max_new_tokens=n, kernels=kernels, draft=draft,
            draft_vocab=draft_vocab)

    oracles = []
    for p in ps:
        if isinstance(p, int):
            draft, label = oracle_draft(reference, k, accept=p), f"on the first {p} of {k} drafts"
        else:
            draft, label = oracle_draft(reference, k, p), f"with p = {p}"
        # (one function per oracle: the loop's jit key)
        t_oracle, loop = timed(lambda: oracle_run(draft))
        t_freed = timed(lambda: oracle_run(draft), keep=False)[0]
        kernels_run = None
        if profile and not oracles:
            host_loop = lambda: oracle_run(draft, _loop_without_graph_loops)  # noqa: E731
            hlo = oracle_run(draft, lambda *a, **kw: _loop_without_graph_loops.lower(
                *a, **kw).compile().as_text())
            kernels_run = (timed(host_loop)[0] / tokens, cupti_kernels(host_loop), phase_of(hlo))
        oracles.append((label, t_oracle / tokens,
                        float(loop.accepted) / max(int(loop.iterations), 1),
                        int(loop.iterations), np.array_equal(np.asarray(loop.tokens), reference),
                        kernels_run, t_freed / tokens))
    differ = np.flatnonzero(np.asarray(plain.tokens)[0] != reference[0])
    first_differing = int(differ[0]) if differ.size else None
    return t_plain / tokens, t_own / tokens, oracles, first_differing


def phase_of(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the phase of the speculative loop's body it belongs to (the named
    scopes ``draft``, ``verify``, ``accept``, ``commit`` in its metadata), else "unscoped"
    (the prefill, the first token, the loop's keys and condition)."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text):
        phase = re.search(r"/(draft|verify|accept|commit)(?:/|$)", m.group(2))
        out[m.group(1)] = out[m.group(1).replace(".", "_")] = (
            phase.group(1) if phase else "unscoped")
    return out


def print_profile(oracle, tokens):
    """The oracle's loop compiled without loops in command buffers: its kernel time per verify
    step against its wall time per step (the whole call: prefill and first token included) and
    the library loop's, and its largest kernels by name."""
    label, t_oracle, _, iterations, _, (t_host_loop, listing, phases), _ = oracle
    if not listing:
        print("\n(no CUPTI kernels: not on a GPU)")
        return
    total = sum(t for _, t in listing)
    by_name = collections.Counter()
    count = collections.Counter()
    for name, t in listing:
        key = re.sub(r"[._]\d+$", "", name)[:60]
        by_name[key] += t
        count[key] += 1
    print(f"\n## The oracle run (right {label}) without loops in command buffers, under CUPTI: "
          f"{iterations} verify steps\n")
    per_step = lambda t: t * tokens * 1e3 / iterations  # noqa: E731  s/token -> ms/step
    print(f"kernel sum {total:.2f} ms, {len(listing)} kernels; per step: kernels "
          f"{total / iterations:.3f} ms ({len(listing) / iterations:.0f} kernels), wall "
          f"{per_step(t_host_loop):.3f} ms (the library's loop: {per_step(t_oracle):.3f} ms)\n")
    # Phases run in launch order (draft, verify, accept, commit, then the next step's draft);
    # a kernel XLA names after an instruction of a later phase starts it. XLA reuses one
    # compiled kernel for identical fusions under the first one's name (the verify's 4-row
    # GEMMs run as the first MTP pass's), so a name of an earlier phase, an unscoped one or a
    # library kernel's (cuBLAS) counts in the phase under way.
    order = ("draft", "verify", "accept", "commit")
    by_phase, phase = collections.defaultdict(collections.Counter), "unscoped"
    for name, t in listing:
        named = phases.get(name)
        if named in order and (phase not in order or order.index(named) > order.index(phase)
                               or (phase, named) == ("commit", "draft")):
            phase = named
        by_phase[phase][re.sub(r"[._]\d+$", "", name)[:40]] += t
        by_phase[phase][""] += t
    print("| phase | ms per step | largest kernels, ms per step |")
    print("|---|---:|---|")
    for phase, names in sorted(by_phase.items(), key=lambda kv: -kv[1][""]):
        top = ", ".join(f"`{n}` {t / iterations:.3f}" for n, t in names.most_common(7) if n)
        print(f"| {phase} | {names[''] / iterations:.3f} | {top} |")
    print()
    print("| kernel | ms in all | calls |")
    print("|---|---:|---:|")
    for name, t in by_name.most_common(15):
        print(f"| `{name}` | {t:.3f} | {count[name]} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--oracle", default="0.8",
                    help="comma-separated probabilities that the oracle draft is right")
    ap.add_argument("--accept", default="",
                    help="comma-separated counts: oracles right on exactly the first N drafts "
                    "of every step (N + 1 tokens a step), after the --oracle ones")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="drafts from this many fixed random ids (0: the whole vocabulary)")
    ap.add_argument("--profile", action="store_true",
                    help="the first oracle run once more under CUPTI: kernel time per step")
    ap.add_argument("--stream", default="",
                    help="comma-separated chunk sizes: the MTP-draft run streamed "
                    "(jd.generate_stream) at each, against the same run unstreamed")
    ap.add_argument("--penalty", type=float, default=None,
                    help="also plain and MTP-draft speculative generate with this repetition "
                    "penalty (the penalties' cost)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
        ps = [float(p) for p in args.oracle.split(",") if p]
        accepts = [int(n) for n in args.accept.split(",") if n]
        streams = [int(n) for n in args.stream.split(",") if n]
    except ValueError:
        ap.error("--batches, --ks, --accept and --stream take comma-separated ints, --oracle "
                 "floats")
    if (min(batches) < 1 or min(ks) < 1 or not all(0 <= p <= 1 for p in ps)
            or not all(n >= 1 for n in streams)):
        ap.error("batches, ks and --stream's chunk sizes must be >= 1, --oracle in [0, 1]")
    name, context, tokens = args.model, args.context, args.tokens
    if args.smoke:
        name, batches, ks, context, tokens = "tiny", [1, 2], [1, 3], 32, 12
    elif jax.default_backend() != "gpu":
        ap.error("timings need a GPU; on a CPU run --smoke")
    k_e2e = 3 if 3 in ks else ks[-1]  # the end-to-end runs' k
    if not all(0 <= n <= k_e2e for n in accepts):
        ap.error(f"--accept must be in [0, k = {k_e2e}]")
    config = dataclasses.replace(jd.Config.from_preset(name), mtp_num_hidden_layers=1)
    params = jd.init_params(config, jax.random.key(0), "float32" if args.smoke else "bfloat16")
    if not 0 <= args.draft_vocab <= config.vocab_size:
        ap.error(f"--draft-vocab must be in [0, {config.vocab_size}]")
    draft_vocab = None
    if args.draft_vocab:
        draft_vocab = jnp.asarray(np.random.default_rng(0).permutation(config.vocab_size)[
            :args.draft_vocab], jnp.int32)
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; {name} + MTP layer, "
          f"context {context}; drafts from "
          f"{args.draft_vocab or config.vocab_size} of {config.vocab_size} ids", flush=True)
    max_len = -(-(context + 256) // 64) * 64
    rows = []
    for batch in batches:
        kernels = kernels_for(params, batch)
        for k in ks:
            t_plain, t_verify, t_draft, t_plain_mtp = time_steps(params, batch, k, context,
                                                                 max_len, kernels, draft_vocab)
            rows.append((batch, k, t_plain, t_verify, t_draft, t_plain_mtp))
            print(f"batch {batch} k {k}: plain {t_plain * 1e3:.3f} ms, verify {t_verify * 1e3:.3f}"
                  f" ms, draft {t_draft * 1e3:.3f} ms, plain keeping MTP pairs "
                  f"{t_plain_mtp * 1e3:.3f} ms", flush=True)
    e2e = end_to_end(params, tokens, k_e2e, ps + accepts, kernels_for(params, 1), draft_vocab,
                     args.profile)
    extra = overheads(params, tokens, k_e2e, streams, args.penalty, draft_vocab)

    print(f"\n## Verify step against the plain step ({name}, context {context})\n")
    print("| batch | k | plain ms | plain, MTP pairs kept | verify ms (k+1 tokens) | "
          "verify / plain | draft ms | "
          + " | ".join(f"speed-up at a={a}" for a in range(max(ks) + 1)) + " |")
    print("|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (max(ks) + 1))
    for batch, k, t_plain, t_verify, t_draft, t_plain_mtp in rows:
        cells = []
        for a in range(max(ks) + 1):
            cells.append(f"{(a + 1) / (t_verify + k * t_draft) * t_plain:.2f}x" if a <= k else "")
        print(f"| {batch} | {k} | {t_plain * 1e3:.3f} | {t_plain_mtp * 1e3:.3f} "
              f"({t_plain_mtp / t_plain:.3f}x) | {t_verify * 1e3:.3f} | "
              f"{t_verify / t_plain:.3f} | {t_draft * 1e3:.3f} | " + " | ".join(cells) + " |")
    t_plain, t_own, oracles, first_differing = e2e
    print(f"\n## End to end, batch 1, k = {k_e2e}, {tokens} tokens, greedy\n")
    print("| run | ms/token | tok/s | vs plain | drafts accepted per step |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain `jd.generate` | {t_plain * 1e3:.3f} | {1 / t_plain:.0f} | 1.00x | - |")
    print(f"| speculative, MTP drafts (random weights) | {t_own * 1e3:.3f} | {1 / t_own:.0f} | "
          f"{t_plain / t_own:.2f}x | - |")
    for label, t, base in extra:
        ref = t_plain if base == "plain" else t_own
        print(f"| {label} | {t * 1e3:.3f} | {1 / t:.0f} | {t_plain / t:.2f}x "
              f"({t / ref:.3f}x the {base} run's time) | - |")
    for label, t_oracle, accepted, iterations, _, _, t_freed in oracles:
        print(f"| speculative, oracle right {label} | {t_oracle * 1e3:.3f} | "
              f"{1 / t_oracle:.0f} | {t_plain / t_oracle:.2f}x | {accepted:.2f} "
              f"({iterations} steps) |")
        print(f"| ... the same, the last call's output freed before each call | "
              f"{t_freed * 1e3:.3f} | {1 / t_freed:.0f} | {t_plain / t_freed:.2f}x | |")
    same = all(o[4] for o in oracles)
    if args.profile:
        print_profile(oracles[0], tokens)
    print(f"\noracle runs' tokens == the MTP-draft run's: {same}; first token where speculative "
          f"and plain greedy differ (bf16 rounding on near-tied random logits): "
          f"{first_differing}")
    if not same:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
