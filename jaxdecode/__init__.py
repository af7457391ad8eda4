"""jaxdecode: fast, pure-JAX decoding of Qwen3.5 hybrid (Gated DeltaNet + gated attention) models.

    import jaxdecode as jd
    params = jd.load_checkpoint("path/to/checkpoint_dir", dtype="bfloat16")
    state = jd.init_state(params.config, batch_size=B, max_len=L)
    logits, state = jd.prefill(params, state, tokens, lengths)
    logits, state = jd.decode_step(params, state, next_tokens)
"""

from jaxdecode import model, sharding
from jaxdecode.checkpoint import load_checkpoint
from jaxdecode.config import PRESETS, Config
from jaxdecode.kernels.decode_attention import decode_attention, decode_attention_reference
from jaxdecode.model import COMPILER_OPTIONS, decode_step, prefill
from jaxdecode.params import Params, init_params, num_params, param_specs
from jaxdecode.state import DecodeState, KVCache, fork, init_state
from jaxdecode.sampling import SamplingParams, sample
from jaxdecode.tokenizer import load_tokenizer
from jaxdecode.generate import GenerateOutput, StreamChunk, generate, generate_stream

__all__ = [
    "COMPILER_OPTIONS", "Config", "DecodeState", "GenerateOutput", "KVCache", "PRESETS",
    "Params", "SamplingParams", "StreamChunk", "decode_attention", "decode_attention_reference",
    "decode_step", "fork",
    "generate", "generate_stream", "init_params", "init_state", "load_checkpoint",
    "load_tokenizer", "model", "num_params", "param_specs", "prefill", "sample", "sharding",
]
