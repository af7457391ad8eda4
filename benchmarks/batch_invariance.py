"""How far a prompt's bf16 results move with what else is in its batch, and what the
batch-invariant mode costs.

    python benchmarks/batch_invariance.py [--cells 0.8b:1,2,4,8,16,32,64;9b:1,8,64]
        [--invariant 1,8,64] [--prompts 64] [--steps 32] [--max-len 1024]

Per model: ``--prompts`` random prompts (16-512 tokens, fixed seed) are run in batches of each
size b (consecutive prompts grouped, padded to 512 tokens, one ``max_len``): a prefill, then
``--steps`` greedy decode steps in one jitted ``lax.scan`` (``model.decode_step_fn`` with the
kernels ``jd.choose_kernels`` picks for b, as ``jd.generate`` runs). Against each prompt run
alone (b = 1), per b:

  same tokens    prompts whose greedy tokens all equal their tokens alone
  first diff     mean index of the first differing token over the prompts that differ
  prefill gap    max over prompts of max|logits - logits alone| / max|logits alone| (last
                 prompt token)
  step-1 gap     the same for the first decode step, over prompts whose first token agrees
  bitwise        prompts whose prefill and first-step logits are bitwise those alone

``--invariant`` batch sizes run again with ``choose_kernels(..., batch_invariant=True)``
(reference: its own b = 1). Costs, in the same process: ms per decode step (the scan's time /
steps) and ms per prefill of the batch, default vs invariant mode. bf16 random weights with
the preset's shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecode as jd  # noqa: E402
from jaxdecode import model  # noqa: E402

PROMPT_PAD = 512


def run_batches(params, prompts, lengths, batch, steps, max_len, kernels_of):
    """Every prompt in batches of ``batch``: (prefill logits [N, V], first-step logits [N, V],
    greedy tokens [N, steps], prefill s per batch, decode ms per step)."""
    config = params.config
    kernels = kernels_of(batch)
    inv = kernels.batch_invariant

    @jax.jit
    def prefill(params, state, tokens, num_new):
        return model.prefill_fn(params, state, tokens, num_new, kernels=kernels if inv else None)

    @jax.jit
    def decode(params, state, logits):
        def body(carry, _):
            state, logits = carry
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            logits, state = model.decode_step_fn(params, state, token, None, kernels)
            return (state, logits), (token, logits)
        (_, _), (tokens, every) = jax.lax.scan(body, (state, logits), None, length=steps)
        return tokens.T, every[0]

    n = len(prompts)
    pre, first, toks, t_prefill, t_decode = [], [], [], [], []
    for g in range(0, n, batch):
        rows = list(range(g, min(g + batch, n)))
        while len(rows) < batch:  # the last group padded with repeats of its first prompt
            rows.append(rows[0])
        state = jd.init_state(config, batch, max_len, params.dtype)
        tok = prompts[rows]
        nn = lengths[rows]
        if g == 0:  # compile both outside the timings
            l0, s0 = prefill(params, jd.init_state(config, batch, max_len, params.dtype), tok, nn)
            jax.block_until_ready(decode(params, s0, l0))
        t0 = time.perf_counter()
        logits, state = prefill(params, state, tok, nn)
        logits.block_until_ready()
        t1 = time.perf_counter()
        tokens, step1 = decode(params, state, logits)
        tokens.block_until_ready()
        t2 = time.perf_counter()
        t_prefill.append(t1 - t0)
        t_decode.append((t2 - t1) / steps * 1e3)
        keep = len(set(rows)) if g + batch > n else batch
        pre.append(np.asarray(logits)[:keep])
        first.append(np.asarray(step1)[:keep])
        toks.append(np.asarray(tokens)[:keep])
    return (np.concatenate(pre)[:n], np.concatenate(first)[:n], np.concatenate(toks)[:n],
            float(np.median(t_prefill)), float(np.median(t_decode)))


def compare(ref, got):
    pre_r, first_r, tok_r = ref[:3]
    pre_g, first_g, tok_g = got[:3]
    same = (tok_r == tok_g).all(axis=1)
    first_diff = [int(np.argmax(a != b)) for a, b in zip(tok_r, tok_g) if (a != b).any()]
    scale = np.abs(pre_r).max(axis=1)
    pre_gap = (np.abs(pre_g - pre_r).max(axis=1) / scale).max()
    agree = tok_r[:, 0] == tok_g[:, 0]
    step_gap = ((np.abs(first_g - first_r).max(axis=1) / np.abs(first_r).max(axis=1))[agree].max()
                if agree.any() else float("nan"))
    bitwise = ((pre_r == pre_g).all(axis=1) & (first_r == first_g).all(axis=1) & agree)
    return dict(same=int(same.sum()), first_diff=float(np.mean(first_diff)) if first_diff
                else float("nan"), pre_gap=float(pre_gap), step_gap=float(step_gap),
                bitwise=int(bitwise.sum()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1,2,4,8,16,32,64;9b:1,8,64")
    ap.add_argument("--invariant", default="1,8,64", help="batch sizes for the invariant mode")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}; jax {jax.__version__}; {args.prompts} prompts of 16-512 "
          f"tokens, {args.steps} greedy steps, max_len {args.max_len}, bf16", flush=True)
    rows = []
    for cell in args.cells.split(";"):
        name, _, sizes = cell.partition(":")
        sizes = [int(b) for b in sizes.split(",")]
        config = jd.Config.from_preset(name if name == "tiny" else f"qwen3.5-{name}")
        params = jd.init_params(config, jax.random.key(0), "bfloat16")
        rng = np.random.default_rng(0)
        lengths = rng.integers(16, PROMPT_PAD + 1, args.prompts).astype(np.int32)
        prompts = rng.integers(0, config.vocab_size, (args.prompts, PROMPT_PAD)).astype(np.int32)
        for mode, batch_sizes in (("default", sizes),
                                  ("invariant", [int(b) for b in args.invariant.split(",")])):
            def kernels_of(b, mode=mode):
                return jd.choose_kernels(config, b, dtype="bfloat16",
                                         batch_invariant=mode == "invariant")
            ref = None
            for b in batch_sizes:
                t0 = time.perf_counter()
                got = run_batches(params, prompts, lengths, b, args.steps, args.max_len,
                                  kernels_of)
                ref = got if ref is None else ref
                c = compare(ref, got)
                rows.append((name, mode, b, c, got[3], got[4]))
                print(f"  {name} {mode} b{b}: {c}, prefill {got[3] * 1e3:.1f} ms/batch, "
                      f"decode {got[4]:.3f} ms/step ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        del params
    print(f"\n| model | mode | batch | same tokens (of {args.prompts}) | first diff | prefill "
          "gap | step-1 gap | bitwise rows | prefill ms/batch | decode ms/step |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, mode, b, c, tp, td in rows:
        print(f"| {name} | {mode} | {b} | {c['same']} | {c['first_diff']:.1f} | "
              f"{c['pre_gap']:.2e} | {c['step_gap']:.2e} | {c['bitwise']} | {tp * 1e3:.1f} | "
              f"{td:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
