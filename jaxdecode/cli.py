"""The ``jaxdecode generate`` command (also ``examples/generate.py``). With no options it generates
from the embedded default model (preset "tiny", random weights from ``key(0)``, the Qwen3.5
vocabulary) and prints the ids, the text and the speed, compilation timed apart (``precompile``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

EXAMPLE_PROMPT = "Once upon a time"
RANDOM_WEIGHTS_NOTE = "random weights: the text is noise, not a trained model's output"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: ...``) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A bad argument or input, reported as one line."""


def _int_in(low: int, high: int = 2**31 - 1):
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


def _version() -> str:
    from importlib.metadata import version
    return version("jaxdecode")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    arg = p.add_argument
    arg("--version", action="version", version=f"%(prog)s {_version()}")
    arg("--checkpoint", metavar="DIR", help="Hugging Face checkpoint directory (config.json + "
        "safetensors); default: the embedded random-weight model")
    arg("--prompt", help=f"prompt text (default: {EXAMPLE_PROMPT!r})")
    arg("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids")
    arg("--chat", action="store_true", help="wrap the prompt as a user turn (chat template)")
    arg("--max-new-tokens", type=_int_in(1), default=32, metavar="N",
        help="new tokens per sample (default: %(default)s)")
    arg("--stop", action="append", default=[], metavar="STRING", help="stop a sample right after "
        "it generates this text's token ids (kept in the output; repeatable; needs a tokenizer)")
    arg("--stop-ids", action="append", default=[], metavar="IDS",
        help="a stop sequence as comma-separated token ids (repeatable)")
    arg("--temperature", type=float, default=0.0,
        help="0 = greedy (default; so is anything below 1e-5), > 0 samples")
    arg("--top-k", type=_int_in(0), default=0, help="keep the k most likely (0 = off, default)")
    arg("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off, default)")
    arg("--top-p-keep-ties", action=argparse.BooleanOptionalAction, default=True,
        help="top-p keeps every token tied with the cut-off (default); --no-top-p-keep-ties: "
        "the smallest sorted prefix, as Hugging Face and vLLM")
    arg("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    arg("--repetition-penalty", type=float, default=1.0, help="CTRL penalty (1 = off)")
    arg("--penalize-prompt", action=argparse.BooleanOptionalAction, default=True,
        help="the repetition penalty also counts the prompt's tokens, as Hugging Face and vLLM "
        "(default); --no-penalize-prompt: generated tokens only")
    arg("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty (0 = off)")
    arg("--frequency-penalty", type=float, default=0.0,
        help="OpenAI frequency penalty (0 = off)")
    arg("--seed", type=_int_in(0, 2**63 - 1), default=0, help="sampling PRNG seed (default: 0)")
    arg("--num-samples", type=_int_in(1), default=1, metavar="N",
        help="continuations of the prompt (the state is forked after the prefill)")
    arg("--stream", action="store_true", help="print text as it is produced; report prefill, "
        "time to first token and decode speed")
    arg("--dtype", choices=("float32", "bfloat16", "fp32", "bf16"), default="float32",
        help="model dtype (default: %(default)s)")
    arg("--quantize", choices=("fp8",), default=None,
        help="hold the Linears in block FP8 (load_checkpoint(..., quantize='fp8'); an FP8 "
        "checkpoint loads as FP8 without it)")
    arg("--num-speculative-tokens", type=_int_in(0), default=0, metavar="K",
        help="speculative decoding: K drafts per step from the checkpoint's MTP layer "
        "(load_checkpoint(..., mtp=True); the embedded model gets a random one); 0 = off")
    arg("--draft-vocab", metavar="FILE", default=None,
        help="with --num-speculative-tokens: the token ids the drafts may be, whitespace- or "
        "comma-separated in a text file (e.g. the most frequent ids in your data): a cheaper "
        "draft, the same output")
    arg("--chunk-size", type=_int_in(1), default=None, metavar="N",
        help="decode steps (speculative: verify steps) per device call (default: 1 with "
        "--stream, else 8)")
    arg("--compile-cache", metavar="DIR", default=_default_cache_dir(),
        help="persistent XLA compilation cache (default: %(default)s)")
    arg("--no-compile-cache", dest="compile_cache", action="store_const", const=None,
        help="do not read or write a compilation cache")


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxdecode`` parser (one subcommand, ``generate``)."""
    parser = _Parser(prog="jaxdecode", description="Decode Qwen3.5 hybrid models with JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate_args(sub.add_parser("generate", help="generate text from a prompt"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxdecode`` console script. Returns the exit status."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        return parser.print_help(sys.stderr) or 2
    return _run_generate(parser.parse_args(argv), prog="jaxdecode generate")


def generate_main(argv: list[str] | None = None, prog: str = "generate.py") -> int:
    """``jaxdecode generate`` without the subcommand word (for ``examples/generate.py``)."""
    parser = _Parser(prog=prog, description="Generate from a prompt with jaxdecode.")
    _add_generate_args(parser)
    return _run_generate(parser.parse_args(argv), prog=prog)


def _run_generate(args, prog: str) -> int:
    try:
        return _generate(args)
    except (UsageError, ValueError, OSError) as e:  # OSError: a missing or unreadable file
        print(f"{prog}: error: {e}", file=sys.stderr)  # a checkpoint report keeps its lines
        return 2


def _say(text: str = "") -> None:
    print(text, flush=True)


def _ids(name: str, text: str) -> list[int]:
    try:
        pieces = [t.strip() for t in text.split(",")] if "," in text else text.split()
        if "" in pieces:
            raise ValueError
        ids = [int(t) for t in pieces]
    except ValueError:
        raise UsageError(f"{name} {text!r} must be comma-separated integers") from None
    if not ids:
        raise UsageError(f"{name} is empty")
    return ids


def _generate(args) -> int:
    # Everything checkable without the model is checked before importing JAX or loading weights.
    if args.prompt is not None and args.prompt_ids is not None:
        raise UsageError("pass --prompt or --prompt-ids, not both")
    if args.stream and args.num_samples > 1:
        raise UsageError("--stream prints one sample; use --num-samples 1 with --stream")
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat needs --prompt text, not --prompt-ids")
    if args.checkpoint is not None and args.checkpoint.endswith(".safetensors"):
        args.checkpoint = os.path.dirname(args.checkpoint) or "."  # a file: its directory
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint!r} is not a directory")
    prompt_ids = None if args.prompt_ids is None else _ids("--prompt-ids", args.prompt_ids)
    stops = [_ids("--stop-ids", text) for text in args.stop_ids]
    for name, text in [("--prompt", args.prompt)] + [("--stop", t) for t in args.stop]:
        if text is not None and not text:
            raise UsageError(f"{name} is empty")

    import jax
    import numpy as np

    import jaxdecode as jd
    from jaxdecode import checkpoint
    from jaxdecode import tokenizer as tok_lib
    from jaxdecode.generation import generate, precompile

    sampling = jd.SamplingParams.create(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, penalize_prompt=args.penalize_prompt,
        top_p_keep_ties=args.top_p_keep_ties)
    if args.compile_cache:  # every executable: on CPU init_params' small ones add up to seconds
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    config = (jd.Config.from_preset("tiny") if args.checkpoint is None else
              jd.Config.from_json_file(os.path.join(args.checkpoint, "config.json")))
    tokenizer = tok_lib.load_tokenizer(args.checkpoint, config.vocab_size)
    if tokenizer is None and (prompt_ids is None or args.stop):  # before loading any weights
        raise UsageError(f"{'--stop needs' if args.stop else 'a text prompt needs'} a "
                         f"tokenizer; this checkpoint has none (no tokenizer.json, vocab_size="
                         f"{config.vocab_size}): pass --prompt-ids / --stop-ids")
    for name, ids in [("--prompt-ids", prompt_ids or [])] + [("--stop-ids", s) for s in stops]:
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:  # before loading any weights, too
            raise UsageError(f"{name}: ids must be in [0, vocab_size={config.vocab_size}); got "
                             f"{bad}")
    t0 = time.perf_counter()
    speculative = args.num_speculative_tokens > 0
    draft_vocab = None
    if args.draft_vocab is not None:
        if not speculative:
            raise UsageError("--draft-vocab needs --num-speculative-tokens K (K > 0)")
        with open(args.draft_vocab) as f:
            words = f.read().replace(",", " ").split()
        try:
            draft_vocab = [int(w) for w in words]
        except ValueError as e:  # the file may be large: name the bad word, not the text
            raise UsageError(f"--draft-vocab {args.draft_vocab}: token ids must be integers "
                             f"({e})") from None
    if args.checkpoint is None:
        if speculative:
            config = dataclasses.replace(config, mtp_num_hidden_layers=1)
        params = jd.init_params(config, jax.random.key(0), dtype=args.dtype)
        if args.quantize == "fp8":
            params = jd.quantize_fp8(params)
        what = (f'embedded default (preset "tiny", init_params(key(0)), '
                f"{jd.num_params(params) / 1e6:.1f}M params, {args.dtype}{_fp8_note(params)}) -- "
                f"{RANDOM_WEIGHTS_NOTE}")
        eos = tuple(config.eos_token_id)
    else:
        if speculative and not checkpoint.holds_mtp_layer(args.checkpoint):
            raise UsageError(f"--num-speculative-tokens: {args.checkpoint} has no MTP layer "
                             f"(no {checkpoint.MTP_PREFIX}* tensors) to draft with; run without it")
        params = jd.load_checkpoint(args.checkpoint, dtype=args.dtype, quantize=args.quantize,
                                    mtp=speculative)
        config = params.config
        what = (f"{args.checkpoint} ({jd.num_params(params) / 1e6:.1f}M params, {args.dtype}"
                f"{_fp8_note(params)})")
        eos = tuple(config.eos_token_id)  # generation_config.json's where it names them
    jax.block_until_ready(params)
    _say(f"model: {what}\nloaded in {time.perf_counter() - t0:.2f} s")
    _say(f"tokenizer: {tokenizer.name if tokenizer else 'none (token ids only)'}")
    _say(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, "
         f"{os.cpu_count()} host cores)")
    if prompt_ids is None:
        text = EXAMPLE_PROMPT if args.prompt is None else args.prompt
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            eos = tuple(dict.fromkeys(eos + tokenizer.chat_eos_token_ids))
        prompt_ids = tokenizer.encode(text)
        if not prompt_ids:
            raise UsageError("the prompt encodes to no tokens")
        _say(f"prompt: {text!r} -> {len(prompt_ids)} tokens {prompt_ids}")
    else:
        _say(f"prompt ids: {prompt_ids}")
    stops += [tokenizer.encode(text) for text in args.stop]
    _say(f"eos ids: {list(eos)}; stop sequences: {stops}; sampling: {_describe(args)}")

    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_token_ids=eos,
                  key=jax.random.key(args.seed), num_samples=args.num_samples,
                  stop_sequences=stops, chunk_size=args.chunk_size or (1 if args.stream else 8))
    if speculative:
        kwargs.update(num_speculative_tokens=args.num_speculative_tokens, draft_vocab=draft_vocab)
    if args.stream:
        return _stream(params, [prompt_ids], kwargs, tokenizer, args.compile_cache)
    progress = _Progress(args.max_new_tokens * args.num_samples) if sys.stderr.isatty() else None
    t = time.perf_counter()
    executables = precompile(params, [prompt_ids], progress=progress, **kwargs)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    if progress is not None:
        progress.start = t
    out = jax.block_until_ready(generate(params, [prompt_ids], progress=progress,
                                         executables=executables, **kwargs))
    run_s = time.perf_counter() - t
    if progress is not None:
        sys.stderr.write("\n")
    _say_samples(out, tokenizer)
    total = int(np.sum(out.num_generated))
    _say("--- timing (wall clock, first run after compiling) ---\n"
         + _compile_line(compile_s, args.compile_cache))
    how = (f"speculative, {args.num_speculative_tokens} drafts per step from the MTP layer"
           if speculative else "prefill + decode in one on-device loop")
    _say(f"generate: {total} tokens in {run_s * 1e3:.1f} ms = {total / run_s:.1f} tokens/s "
         f"({how}, {args.num_samples} row(s); --stream splits prefill and decode)")
    return 0


def _say_samples(out, tokenizer) -> None:
    """Each row of a ``GenerateOutput``: its ids, why it stopped, and its text."""
    for r, (ids, reason) in enumerate(zip(out.token_lists(), out.stop_reasons())):
        _say(f"--- sample {r}: {len(ids)} tokens, stopped by {reason} ---\nids: {ids}")
        if tokenizer is not None:
            _say(f"text: {tokenizer.decode(ids)}")


def _compile_line(seconds: float, cache: str | None) -> str:
    return (f"compile: {seconds:.2f} s (apart, not in the numbers below; "
            f"{f'persistent cache {cache}' if cache else 'no persistent cache'})")


def _describe(args) -> str:
    off = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, penalize_prompt=True,
               top_p_keep_ties=True)
    parts = [f"{k}={getattr(args, k)}" for k, v in off.items() if getattr(args, k) != v]
    return ", ".join(parts + [f"seed={args.seed}"] if args.temperature else ["greedy"] + parts)


def _fp8_note(params) -> str:
    """', N Linears in block FP8' for a model with FP8 weights, else ''."""
    import jax
    import numpy as np

    import jaxdecode as jd
    n = sum(int(np.prod(x.shape[:-2])) for x in jax.tree.leaves(  # a stack: E Linears
        params, is_leaf=lambda x: isinstance(x, jd.Fp8Linear)) if isinstance(x, jd.Fp8Linear))
    return f", {n} Linears in block FP8" if n else ""


def _stream(params, prompts, kwargs, tokenizer, cache) -> int:
    from jaxdecode.generation import generate_stream, precompile
    from jaxdecode.stopping import STOP_REASONS
    from jaxdecode.tokenizer import StreamDecoder

    t = time.perf_counter()
    executables = precompile(params, prompts, stream=True, **kwargs)
    compile_s = time.perf_counter() - t
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    ids: list[int] = []
    _say("--- output ---")
    t_start = time.perf_counter()
    t_prefill = t_first = None
    for piece in generate_stream(params, prompts, executables=executables, **kwargs):
        if t_prefill is None:  # the first chunk: prefill + first sample, on the host
            t_prefill = time.perf_counter() - t_start
        new = [int(i) for i in piece.tokens[0] if i >= 0]
        ids.extend(new)
        sys.stdout.write(decoder.push(new) if decoder else "".join(f" {i}" for i in new))
        sys.stdout.flush()
        if t_first is None:
            t_first = time.perf_counter() - t_start
    decode_s = time.perf_counter() - t_start - t_prefill
    _say(decoder.flush() if decoder else "")
    _say(f"--- {len(ids)} tokens, stopped by {STOP_REASONS[int(piece.stop_reason[0])]} ---\n"
         f"ids: {ids}\n--- timing (wall clock, first run after compiling) ---\n"
         + _compile_line(compile_s, cache))
    _say(f"prefill: {t_prefill * 1e3:.1f} ms ({len(prompts[0])} prompt tokens, incl. sampling "
         f"the first token)\ntime to first token: {t_first * 1e3:.1f} ms")
    if len(ids) > 1:
        n = len(ids) - 1
        _say(f"decode: {n} tokens in {decode_s * 1e3:.1f} ms = {n / decode_s:.1f} tokens/s, "
             f"{decode_s / n * 1e3:.2f} ms/token")
    return 0


class _Progress:
    """A one-line progress display on stderr, fed from the device loop after each chunk."""

    def __init__(self, total: int):
        self.total, self.start = total, time.perf_counter()

    def __call__(self, num_generated) -> None:
        done = int(sum(num_generated))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        filled = int(30 * done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} tokens "
                         f"({rate:.0f} tokens/s) ")
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
