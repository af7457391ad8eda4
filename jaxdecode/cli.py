"""The ``jaxdecode`` command line: ``jaxdecode generate [options]`` (also ``examples/generate.py``).

With no options it generates from the embedded default model (preset "tiny", random weights
from ``key(0)``, the real Qwen3.5 vocabulary) and prints the ids, the text and the speed, with
compilation timed apart (``jaxdecode.generation.precompile``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXAMPLE_PROMPT = "Once upon a time"
RANDOM_WEIGHTS_NOTE = ("random weights: the text is noise, not a trained model's output")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: ...``) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A bad argument or input, reported as one line."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _int_in(low: int, high: int):
    """argparse type: an integer in [low, high] (so huge values fail here, not in numpy)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be in [{low}, {high}]")
        return value
    return parse


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxdecode", "xla")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face checkpoint directory (config.json + safetensors); "
                        "default: the embedded random-weight model")
    p.add_argument("--prompt", help=f"prompt text (default: {EXAMPLE_PROMPT!r})")
    p.add_argument("--prompt-ids", metavar="IDS",
                   help="prompt as comma-separated token ids (instead of --prompt)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="N",
                   help="token budget per sample (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default), > 0 samples")
    p.add_argument("--top-k", type=_int_in(0, 2**31 - 1), default=0,
                   help="keep the k most likely (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top probability (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL penalty on generated tokens (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from generated tokens' logits (0 = off)")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0,
                   help="PRNG seed for sampling (default: 0)")
    p.add_argument("--num-samples", type=_positive_int, default=1, metavar="N",
                   help="continuations of the prompt (the state is forked after the prefill)")
    p.add_argument("--stream", action="store_true",
                   help="print text as it is produced; report prefill, time to first token "
                        "and decode speed")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model dtype (default: float32)")
    p.add_argument("--chunk-size", type=_positive_int, default=None, metavar="N",
                   help="decode steps per device call (default: 1 with --stream, else 8)")
    p.add_argument("--compile-cache", metavar="DIR", default=_default_cache_dir(),
                   help="persistent XLA compilation cache, so later runs skip most compiling "
                        "(default: %(default)s)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_const", const=None,
                   help="do not read or write a compilation cache")


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxdecode`` parser (one subcommand, ``generate``)."""
    parser = _Parser(prog="jaxdecode", description="Decode Qwen3.5 hybrid models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate from a prompt (see jaxdecode.generation).")
    _add_generate_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxdecode`` console script. Returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _run_generate(args, prog="jaxdecode generate")
    return 2  # pragma: no cover (argparse requires a command)


def generate_main(argv: list[str] | None = None, prog: str = "generate.py") -> int:
    """``jaxdecode generate`` without the subcommand word (for ``examples/generate.py``)."""
    parser = _Parser(prog=prog, description="Generate from a prompt with jaxdecode.")
    _add_generate_args(parser)
    return _run_generate(parser.parse_args(argv), prog=prog)


def _run_generate(args, prog: str) -> int:
    try:
        return _generate(args)
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError) as e:
        message = " ".join(str(e).split())  # one line
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


def _say(text: str = "") -> None:
    print(text, flush=True)


def _generate(args) -> int:
    # Everything checkable without the model is checked before importing JAX or loading weights.
    if args.prompt is not None and args.prompt_ids is not None:
        raise UsageError("pass --prompt or --prompt-ids, not both")
    if args.stream and args.num_samples > 1:
        raise UsageError("--stream prints one sample; use --num-samples 1 with --stream")
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat needs --prompt text, not --prompt-ids")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint!r} is not a directory")
    prompt_ids = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r} must be comma-separated "
                             f"integers") from None
        if not prompt_ids:
            raise UsageError("--prompt-ids is empty")
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty")

    import jax
    import numpy as np

    import jaxdecode as jd
    from jaxdecode import tokenizer as tok_lib
    from jaxdecode.generation import generate, precompile
    from jaxdecode.sampling import SamplingParams

    sampling = SamplingParams.create(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty)

    if args.compile_cache:
        # Every executable, even the small ones init_params dispatches one by one: on CPU they
        # add up to seconds per run.
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    t0 = time.perf_counter()
    if args.checkpoint is None:
        config = jd.Config.from_preset("tiny")
        params = jd.init_params(config, jax.random.key(0), dtype=args.dtype)
        what = (f'embedded default (preset "tiny", init_params(key(0)), '
                f"{jd.num_params(params) / 1e6:.1f}M params, {args.dtype}) -- "
                f"{RANDOM_WEIGHTS_NOTE}")
        eos = tuple(config.eos_token_id)
    else:
        params = jd.load_checkpoint(args.checkpoint, dtype=args.dtype)
        config = params.config
        what = (f"{args.checkpoint} ({jd.num_params(params) / 1e6:.1f}M params, {args.dtype})")
        eos = tok_lib.eos_token_ids(args.checkpoint) or tuple(config.eos_token_id)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    tokenizer = tok_lib.load_tokenizer(args.checkpoint, config.vocab_size)
    _say(f"model: {what}")
    _say(f"loaded in {load_s:.2f} s")
    _say(f"tokenizer: {tokenizer.name if tokenizer else 'none (token ids only)'}")
    _say(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, "
         f"{os.cpu_count()} host cores)")

    if prompt_ids is None:
        text = EXAMPLE_PROMPT if args.prompt is None else args.prompt
        if tokenizer is None:
            raise UsageError(f"no tokenizer for this checkpoint (no tokenizer.json, vocab_size="
                             f"{config.vocab_size}): pass --prompt-ids")
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            eos = tuple(dict.fromkeys(eos + tokenizer.chat_eos_token_ids))
        prompt_ids = tokenizer.encode(text)
        if not prompt_ids:
            raise UsageError("the prompt encodes to no tokens")
        _say(f"prompt: {text!r} -> {len(prompt_ids)} tokens {prompt_ids}")
    else:
        _say(f"prompt ids: {prompt_ids}")
    _say(f"eos ids: {list(eos)}; sampling: " + _describe(args))

    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling,
                  key=jax.random.key(args.seed), eos_token_ids=eos, num_samples=args.num_samples)
    if args.stream:
        chunk = args.chunk_size or 1
        return _stream(params, [prompt_ids], kwargs, chunk, tokenizer, args.compile_cache)
    chunk = args.chunk_size or 8
    progress = _Progress(args.max_new_tokens * args.num_samples) if sys.stderr.isatty() else None
    t = time.perf_counter()
    executables = precompile(params, [prompt_ids], chunk_size=chunk, progress=progress, **kwargs)
    compile_s = time.perf_counter() - t
    if progress is not None:
        progress.start = time.perf_counter()
    t = time.perf_counter()
    out = generate(params, [prompt_ids], chunk_size=chunk, progress=progress,
                   executables=executables, **kwargs)
    jax.block_until_ready(out)
    run_s = time.perf_counter() - t
    if progress is not None:
        progress.close()
    cache = args.compile_cache
    counts = np.asarray(out.num_generated)
    for r, (ids, reason) in enumerate(zip(out.token_lists(), out.stop_reasons())):
        _say(f"--- sample {r}: {len(ids)} tokens, stopped by {reason} ---")
        _say(f"ids: {ids}")
        if tokenizer is not None:
            _say(f"text: {tokenizer.decode(ids)}")
    total = int(counts.sum())
    _say("--- timing (wall clock, first run after compiling) ---")
    _say(_compile_line(compile_s, cache))
    _say(f"generate: {total} tokens in {run_s * 1e3:.1f} ms = {total / run_s:.1f} tokens/s "
         f"(prefill + decode in one on-device loop, {counts.size} row(s); --stream splits "
         f"prefill and decode)")
    return 0


def _compile_line(seconds: float, cache: str | None) -> str:
    where = f"persistent cache {cache}" if cache else "no persistent cache"
    return f"compile: {seconds:.2f} s (apart, not in the numbers below; {where})"


def _describe(args) -> str:
    if args.temperature == 0:
        text = "greedy"
    else:
        parts = [f"temperature={args.temperature}"]
        for name in ("top_k", "top_p", "min_p"):
            value, off = getattr(args, name), {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[name]
            if value != off:
                parts.append(f"{name}={value}")
        text = ", ".join(parts) + f", seed={args.seed}"
    if args.repetition_penalty != 1.0:
        text += f", repetition_penalty={args.repetition_penalty}"
    if args.presence_penalty != 0.0:
        text += f", presence_penalty={args.presence_penalty}"
    return text


def _stream(params, prompts, kwargs, chunk, tokenizer, cache) -> int:
    from jaxdecode.generation import STOP_REASONS, generate_stream, precompile
    from jaxdecode.tokenizer import StreamDecoder

    t = time.perf_counter()
    executables = precompile(params, prompts, stream=True, chunk_size=chunk, **kwargs)
    compile_s = time.perf_counter() - t
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    ids: list[int] = []
    _say("--- output ---")
    t_start = time.perf_counter()
    t_first = t_prefill = None
    last = None
    for piece in generate_stream(params, prompts, chunk_size=chunk, executables=executables,
                                 **kwargs):
        now = time.perf_counter()
        if t_prefill is None:
            t_prefill = now - t_start  # the first chunk: prefill + first sample, on the host
        new = [int(i) for i in piece.tokens[0] if i >= 0]
        ids.extend(new)
        if decoder is not None:
            sys.stdout.write(decoder.push(new))
        else:
            sys.stdout.write("".join(f" {i}" for i in new))
        sys.stdout.flush()
        if t_first is None:
            t_first = time.perf_counter() - t_start
        last = piece
    t_end = time.perf_counter()
    if decoder is not None:
        sys.stdout.write(decoder.flush())
    _say()
    reason = STOP_REASONS[int(last.stop_reason[0])]
    _say(f"--- {len(ids)} tokens, stopped by {reason} ---")
    _say(f"ids: {ids}")
    decode_n = len(ids) - 1
    decode_s = t_end - t_start - t_prefill
    _say("--- timing (wall clock, first run after compiling) ---")
    _say(_compile_line(compile_s, cache))
    _say(f"prefill: {t_prefill * 1e3:.1f} ms ({len(prompts[0])} prompt tokens, "
         f"incl. sampling the first token)")
    _say(f"time to first token: {t_first * 1e3:.1f} ms")
    if decode_n > 0:
        _say(f"decode: {decode_n} tokens in {decode_s * 1e3:.1f} ms = "
             f"{decode_n / decode_s:.1f} tokens/s, {decode_s / decode_n * 1e3:.2f} ms/token")
    return 0


class _Progress:
    """A one-line progress display on stderr, fed from the device loop after each chunk."""

    def __init__(self, total: int):
        self.total = total
        self.start = time.perf_counter()

    def __call__(self, num_generated) -> None:
        done = int(sum(num_generated))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = int(width * done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                         f"tokens ({rate:.0f} tokens/s) ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
