"""jaxdecode: fast, pure-JAX decoding of Qwen3.5 hybrid (Gated DeltaNet + gated attention) models.

    import jaxdecode as jd
    params = jd.load_checkpoint("path/to/checkpoint_dir", dtype="bfloat16")
    state = jd.init_state(params.config, batch_size=B, max_len=L, dtype=params.dtype)
    logits, state = jd.prefill(params, state, tokens, num_new)
    logits, state = jd.decode_step(params, state, next_tokens)

Layers, each importing only those above it: ``config`` -> ``memory`` (bytes, the prefill's
chunk plan) -> ``params``, ``state`` -> ``kernels`` (each kernel beside its reference;
``kernels.choice`` decides which runs) -> ``model`` (pure functions) -> ``sharding`` (layouts)
-> ``step`` (the jitted, donated entry points), ``inputs`` (host checks of token lists),
``stopping`` (why a row stops) -> ``speculative`` (MTP drafts, verify, commit) -> ``generation``
(sampling loops), ``scoring`` (teacher-forced log-probs) -> ``checkpoint`` -> ``cli``.
"""

__version__ = "0.2.0"

from jaxdecode import memory, model, sharding  # noqa: E402 (after __version__, pyproject reads it)
from jaxdecode.checkpoint import load_checkpoint
from jaxdecode.config import PRESETS, Config
from jaxdecode.generation import (GenerateOutput, StreamChunk, generate, generate_stream,
                                  precompile)
from jaxdecode.kernels.choice import Kernels, choose_kernels
from jaxdecode.params import Params, init_params, num_params, param_specs, quantize_fp8
from jaxdecode.quantization import Fp8Linear
from jaxdecode.sampling import Logprobs, SamplingParams, sample
from jaxdecode.scoring import ScoreOutput, score
from jaxdecode.state import DecodeState, KVCache, MTPCache, fork, init_state
from jaxdecode.step import COMPILER_OPTIONS, decode_step, prefill
from jaxdecode.tokenizer import load_tokenizer

__all__ = [
    "__version__", "COMPILER_OPTIONS", "Config", "DecodeState", "GenerateOutput", "KVCache",
    "Fp8Linear", "Kernels", "Logprobs", "MTPCache",
    "PRESETS", "Params", "SamplingParams", "StreamChunk", "choose_kernels", "decode_step",
    "fork", "generate", "generate_stream", "init_params", "init_state", "load_checkpoint",
    "load_tokenizer", "memory", "model", "num_params", "param_specs", "precompile", "prefill",
    "quantize_fp8", "sample",
    "score", "ScoreOutput", "sharding",
]
