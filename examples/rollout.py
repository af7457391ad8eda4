"""A sampled rollout inside one jitted lax.scan: prefill, then `steps` decode steps with
per-row sampling, no host synchronisation per token (the pattern for RL rollouts).

    python examples/rollout.py [--steps 32] [--batch 4]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode as jd
from jaxdecode import model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    B, steps = args.batch, args.steps

    params = jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(0))
    state = jd.init_state(params.config, batch_size=B, max_len=8 + steps)
    prompts = np.random.default_rng(0).integers(0, 1000, (B, 8)).astype(np.int32)
    logits, state = jd.prefill(params, state, prompts, np.full(B, 8, np.int32))
    sampling = jd.SamplingParams.create(B, temperature=0.8, top_p=0.95)

    @functools.partial(jax.jit, compiler_options=jd.COMPILER_OPTIONS)  # as the library's jits
    def rollout(params, state, logits, key):
        def step(carry, i):
            state, logits = carry
            keys = jax.random.split(jax.random.fold_in(key, i), B)
            token = jd.sample(logits, keys, sampling)  # [B]
            logits, state = model.decode_step_fn(params, state, token)  # pure, no host sync
            return (state, logits), (token, logits.max(-1))
        (state, _), (tokens, top_logit) = jax.lax.scan(step, (state, logits), jnp.arange(steps))
        return tokens.T, top_logit.T, state  # [B, steps]

    tokens, top_logit, state = rollout(params, state, logits, jax.random.key(1))
    print(f"tokens {tokens.shape}: {np.asarray(tokens)[0, :12].tolist()} ...")
    print(f"state.lengths after the rollout: {np.asarray(state.lengths).tolist()}")
    return tokens, state


if __name__ == "__main__":
    main()
