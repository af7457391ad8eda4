"""Sharded greedy generation: prefill + a decode loop on a ("data", "model") mesh.

    python examples/sharded.py --mesh 2,4                  # 8 devices; on CPU made on the fly
    python examples/sharded.py --mesh 1,2 --check          # also compare with one device
    python examples/sharded.py --mesh 1,4 --checkpoint DIR --dtype bfloat16

    # several hosts (processes): the same command on every host, process id 0 .. N-1
    python examples/sharded.py --mesh 2,8 --coordinator host0:12355 \\
        --num-processes 2 --process-id $ID

"data" splits the batch, "model" splits heads, MLP and vocabulary (jaxdecode/sharding.py has
the layout). Without --checkpoint the model is the "tiny" preset with every head count set to 8
or 16 (random weights, the real vocabulary), so any "model" size up to 8 is valid. On CPU the
script asks XLA for as many host devices as the mesh needs (unless XLA_FLAGS already sets
--xla_force_host_platform_device_count). Prompts are random token ids; generated ids are printed
by process 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2,4", metavar="DATA,MODEL",
                   help="mesh shape: data-parallel size, tensor-parallel size (default: 2,4)")
    p.add_argument("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="rows (default: 2 per data-parallel shard)")
    p.add_argument("--prompt-len", type=positive_int, default=16,
                   help="tokens per prompt (default: 16)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="default: 16")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and random weights")
    p.add_argument("--check", action="store_true",
                   help="also run on one device and compare the tokens (exit 1 if they differ)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="jax.distributed coordinator (process 0's address) for several processes")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    args = p.parse_args(argv)
    try:
        data, model = (int(x) for x in args.mesh.split(","))
    except ValueError:
        p.error(f"--mesh {args.mesh!r} must be DATA,MODEL, e.g. 2,4")
    if data < 1 or model < 1:
        p.error(f"--mesh {args.mesh!r}: both sizes must be >= 1")
    args.data, args.model = data, model
    args.batch = args.batch or 2 * data
    return args


def demo_config():
    import jaxdecode as jd
    # Head counts divisible by 8, so every "model" size up to 8 fits (the plain "tiny" preset has
    # 2 KV heads and 2 DeltaNet key heads, i.e. at most 2-way tensor parallelism).
    return dataclasses.replace(jd.Config.from_preset("tiny"), num_attention_heads=16,
                               num_key_value_heads=8, linear_num_key_heads=8,
                               linear_num_value_heads=16)


def greedy(params, state, prompts, num_new, steps):
    """Greedy tokens [steps, B] (device arrays) after prefill + steps - 1 decode steps; on the
    state's mesh when it has one (jd.prefill / jd.decode_step see it)."""
    import jax.numpy as jnp
    import jaxdecode as jd
    logits, state = jd.prefill(params, state, prompts, num_new)
    tokens = [jnp.argmax(logits, -1).astype(jnp.int32)]
    for _ in range(steps - 1):
        logits, state = jd.decode_step(params, state, tokens[-1], out=logits)
        tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
    return tokens


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    processes = args.num_processes or 1
    local = max(1, args.data * args.model // processes)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Only affects the CPU platform: GPU/TPU machines keep their own devices.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={local}")

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxdecode as jd
    from jaxdecode import sharding

    if args.coordinator or args.num_processes:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    main_process = jax.process_index() == 0
    say = print if main_process else (lambda *a, **k: None)

    mesh = sharding.make_mesh(args.data, args.model)
    if args.checkpoint:
        params = jd.load_checkpoint(args.checkpoint, args.dtype, mesh=mesh)
    else:
        demo = demo_config()
        sharding.check_mesh(sharding.config_on(demo, mesh), mesh)  # before any device work
        params = sharding.shard_params(
            jd.init_params(demo, jax.random.key(args.seed), args.dtype), mesh)
    config = params.config  # KV heads repeated where the mesh needs it
    say(f"mesh data={args.data} x model={args.model} over {jax.device_count()} "
        f"{jax.devices()[0].platform} devices in {jax.process_count()} process(es); "
        f"batch {args.batch}, {args.dtype}")

    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    num_new = np.full((args.batch,), args.prompt_len, np.int32)
    max_len = args.prompt_len + args.max_new_tokens

    def run():
        state = sharding.init_state_sharded(config, mesh, args.batch, max_len, args.dtype)
        return greedy(params, state, prompts, num_new, args.max_new_tokens)

    start = time.perf_counter()
    jax.block_until_ready(run())  # compiles prefill and the decode step
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = jax.block_until_ready(run())
    run_s = time.perf_counter() - start
    tokens = np.stack([np.asarray(multihost_utils.process_allgather(t, tiled=True))
                       for t in tokens], axis=1)  # [B, max_new_tokens]
    say(f"first run (with compilation) {compile_s:.1f} s; second run {run_s:.2f} s "
        f"= {args.batch * args.max_new_tokens / run_s:.1f} tok/s (prefill + "
        f"{args.max_new_tokens - 1} decode steps)")
    for row in range(min(args.batch, 4)):
        say(f"row {row}: {tokens[row].tolist()}")

    if args.check:  # the same model on one device, with its own KV heads
        if args.checkpoint:
            ref_params = jd.load_checkpoint(args.checkpoint, args.dtype)
        else:
            ref_params = jd.init_params(demo_config(), jax.random.key(args.seed), args.dtype)
        state = jd.init_state(ref_params.config, args.batch, max_len, args.dtype)
        ref = np.stack([np.asarray(t) for t in greedy(ref_params, state, prompts, num_new,
                                                      args.max_new_tokens)], axis=1)
        differ = int((ref != tokens).sum())
        say(f"check: sharded tokens {'==' if not differ else '!='} single-device tokens"
            + (f" ({differ} of {ref.size} differ)" if differ else ""))
        if differ:
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # sizes that do not fit the mesh, bad checkpoints: one line, exit 2
        print(f"sharded.py: error: {e}", file=sys.stderr)
        sys.exit(2)
