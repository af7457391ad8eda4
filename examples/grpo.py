"""GRPO on the `tiny` preset: sample G completions per prompt, reward them, normalise the rewards
within each prompt's group, and take a clipped policy-gradient step through the teacher-forced
log-probabilities (`jaxdecode.scoring.score_fn`) with optax; the mean reward rises.

    python examples/grpo.py [--steps 20] [--prompts 4] [--samples 4] [--new-tokens 8]

GRPO: Shao et al., "DeepSeekMath" (2024), §4.1, with one optimizer step per batch of rollouts
(so the importance ratio is the rollout's log-probs against the trainer's, 1 up to the
chunked/recurrent gap) and no KL term. The weights are random, so text means nothing; the reward
is the fraction of a completion's tokens in a class the model can learn to prefer: the half of
the vocabulary on the positive side of a fixed random hyperplane through the initial embeddings.
(A reward on a few named tokens would never be sampled: the initial distribution is nearly
uniform over 248,320 ids.) Every step reuses the first step's executables: params are arguments.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdecode as jd
from jaxdecode.scoring import score_fn


def grpo_loss(params, prompts, prompt_lengths, completions, num_tokens, rollout_logprobs,
              advantages, *, max_len, clip=0.2):
    """(loss, max |lp - rollout lp|): the loss is -(clipped surrogate), the per-token mean within
    each completion, then over completions.
    prompts [R, T], completions [R, N] int32 (right-padded); rollout_logprobs [R, N] float32
    (generate's raw log-probs); advantages [R] float32."""
    lp = score_fn(params, prompts, prompt_lengths, completions, num_tokens, mode="chunked",
                  max_len=max_len, kernels=jd.Kernels()).logprobs  # XLA kernels: has a VJP
    mask = jnp.arange(completions.shape[1])[None, :] < num_tokens[:, None]
    ratio = jnp.exp(lp - rollout_logprobs)
    adv = advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    per_row = jnp.where(mask, surrogate, 0.0).sum(1) / jnp.maximum(num_tokens, 1)
    gap = jnp.where(mask, jnp.abs(lp - rollout_logprobs), 0.0).max()
    return -per_row.mean(), gap


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="G, completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=3e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    P, G, N = args.prompts, args.samples, args.new_tokens

    params = jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, 1000, (P, 8)).astype(np.int32)
    direction = rng.standard_normal(params.config.hidden_size).astype(np.float32)
    in_class = jnp.asarray(np.asarray(params.embed_tokens) @ direction > 0)  # [V] bool

    # generate's rows are prompt-major (row p * G + g is prompt p's sample g)
    rows_prompts = jnp.asarray(np.repeat(np.pad(prompts, ((0, 0), (0, 8))), G, axis=0))
    rows_lengths = jnp.full((P * G,), prompts.shape[1], jnp.int32)
    max_len = 64 * -(-(rows_prompts.shape[1] + max(16, N)) // 64)
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, completions, num_tokens, rollout_logprobs):
        mask = jnp.arange(completions.shape[1])[None, :] < num_tokens[:, None]
        hits = jnp.where(mask, in_class[jnp.maximum(completions, 0)], False).sum(1)
        reward = (hits / jnp.maximum(num_tokens, 1)).reshape(P, G)
        adv = (reward - reward.mean(1, keepdims=True)) / (reward.std(1, keepdims=True) + 1e-4)
        (_, gap), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
            params, rows_prompts, rows_lengths, jnp.maximum(completions, 0), num_tokens,
            rollout_logprobs, adv.reshape(-1), max_len=max_len)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, reward.mean(), gap

    sampling = jd.SamplingParams.create(temperature=1.0)
    key = jax.random.key(args.seed + 1)
    history = []
    print(f"{'step':>4} {'reward':>7} {'distinct ids':>12} {'|lp - rollout lp|':>18} {'s':>6}")
    for step in range(args.steps):
        t0 = time.perf_counter()
        out = jd.generate(params, prompts, N, sampling, jax.random.fold_in(key, step),
                          eos_token_ids=[], num_samples=G, return_logprobs=True)
        params, opt_state, reward, gap = train_step(
            params, opt_state, out.tokens, out.num_generated, out.logprobs.raw)
        history.append(float(reward))
        distinct = np.mean([len(set(t)) for t in out.token_lists()])  # per completion
        print(f"{step:>4} {history[-1]:>7.3f} {distinct:>12.1f} {float(gap):>18.2e} "
              f"{time.perf_counter() - t0:>6.2f}", flush=True)
    k = max(1, len(history) // 5)
    print(f"mean reward: first {k} steps {np.mean(history[:k]):.3f}, "
          f"last {k} steps {np.mean(history[-k:]):.3f}")
    return history


if __name__ == "__main__":
    main()
