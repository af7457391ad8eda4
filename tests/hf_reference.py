"""Hugging Face transformers side of the parity tests (runs in its own Python with torch).

jaxdecode runs on Python >= 3.12 while the CPU torch build on these machines is for 3.11, so the
tests call this script in a subprocess:

    python hf_reference.py REQUESTS.json

REQUESTS.json is a list of actions, run in order (one torch start-up for all of them):

  {"action": "make", "dir": D, "text_config": {...}, "seed": S,
   "layout": "causal_lm" | "conditional_generation", "dtype": "float32" | "bfloat16",
   "max_shard_size": null | "50KB"}
      Builds a Qwen3.5 model (Qwen3.5-MoE when text_config has num_experts; Qwen3NextForCausalLM
      when its model_type is "qwen3_next", causal_lm layout only) with EVERY
      parameter randomised (HF's init leaves norm weights,
      A_log and dt_bias at constants that would hide bugs) and writes it with save_pretrained.
      dtype "bfloat16" stores bf16 weights with A_log and linear_attn.norm.weight kept float32,
      as in the published checkpoints.

  {"action": "run", "dir": D, "out": F.npz, "cases": [{"name": N, "prompt": [ids],
   "decode_steps": K}]}
      Loads D with from_pretrained in float32 (eager attention and experts, torch reference
      kernels) and for
      each case runs the prompt (logits at every position), then K greedy cached decode steps.
      Writes N/prefill_logits [T, V], N/decode_tokens [K] (the token fed at each step) and
      N/decode_logits [K, V] (float32).

  {"action": "hidden_states", "dir": D, "out": F.npz, "prompt": [ids], "decode_token": id}
      Loads D as "run" does and runs the prompt, then one cached decode step of decode_token,
      with output_hidden_states=True. Writes prefill/hidden_states [L+1, T, H] and
      decode/hidden_states [L+1, 1, H] (float32; entry 0 the embeddings, entry i the output of
      decoder layer i-1, except the last entry, which HF ties to last_hidden_state: the last
      layer's output after the final norm), and prefill/logits [T, V], decode/logits [1, V].

  {"action": "processors", "in": X.npz, "out": F.npz, "penalty": r, "top_p": p}
      HF's logits processors on X.npz's "logits" [B, V] float32 and "input_ids" [B, L] (each
      row's prompt then its generated ids; "prompt_lengths" [B]): "repetition" =
      RepetitionPenaltyLogitsProcessor(r) (prompt and generated ids), "repetition_output" = the
      same with prompt_ignore_length=prompt_lengths (generated ids only), "top_p" =
      TopPLogitsWarper(p) on the logits (filtered entries -inf).

  {"action": "grad", "dir": D, "out": F.npz, "cases": [{"prompt": [ids],
   "continuation": [ids]}]}
      Loads D as "run" does; the loss is the sum over cases of the continuation tokens'
      log-probabilities (log_softmax of the logits at the position before each); writes "loss"
      and the gradient of every named parameter (float32, torch autograd, HF layout).

  {"action": "activations", "in": X.npy, "out": F.npz}
      torch's silu and sigmoid of X (float32 values exact in bfloat16) as bfloat16 tensors,
      and the MLP's silu(gate) * up with gate, up = the two halves of X, written as float32
      arrays "silu", "sigmoid" and "swiglu".
"""

import json
import math
import sys

import numpy as np
import torch

# The model actions are pinned to the transformers version CI installs (its Qwen3.5 code is the
# reference); "activations" needs only torch, so it also runs with the GPU machine's version.
TRANSFORMERS_VERSION = "5.24.0"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def randomize(model, seed):
    """Random values for every parameter, scaled so activations and logits stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("A_log"):  # decay rates exp(A_log) in [0.5, 16]: includes strong decay
                val = torch.log(torch.empty(shape).uniform_(0.5, 16.0, generator=gen))
            elif name.endswith("dt_bias"):
                val = torch.randn(shape, generator=gen) * 0.5
            elif name.endswith("linear_attn.norm.weight"):  # plain gain
                val = 1.0 + 0.3 * torch.randn(shape, generator=gen)
            elif name.endswith("norm.weight"):  # (1 + w) norms: w around 0
                val = 0.3 * torch.randn(shape, generator=gen)
            elif name.endswith("conv1d.weight"):
                val = torch.randn(shape, generator=gen) * 0.5
            elif p.ndim >= 2:
                fan_in = shape[-1] if "embed" not in name else 1
                val = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            else:
                val = torch.randn(shape, generator=gen) * 0.1
            p.copy_(val.to(p.dtype))


def check_transformers():
    """Imports transformers (only the model actions need it) and checks its version."""
    import transformers
    assert transformers.__version__ == TRANSFORMERS_VERSION, (
        f"the model actions are pinned to transformers {TRANSFORMERS_VERSION}; "
        f"this is {transformers.__version__}")
    return transformers


def make(req):
    tf = check_transformers()
    text = dict(req["text_config"])
    layout = req.get("layout", "causal_lm")
    moe = bool(text.get("num_experts"))  # Qwen3_5Moe* classes (the text config names experts)
    if text.pop("model_type", None) == "qwen3_next":
        assert layout == "causal_lm", "Qwen3-Next has no multimodal class"
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text))
    elif layout == "causal_lm":
        config = (tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig)(**text)
        model = (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM)(config)
    else:
        tie = text.pop("tie_word_embeddings", False)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text["hidden_size"], num_position_embeddings=16)
        config = (tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config)(
            text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = (tf.Qwen3_5MoeForConditionalGeneration if moe
                 else tf.Qwen3_5ForConditionalGeneration)(config)
    model = model.float()
    randomize(model, req["seed"])
    if req.get("dtype", "float32") == "bfloat16":
        keep = {n: p.detach().clone() for n, p in model.named_parameters()
                if n.endswith(("A_log", "linear_attn.norm.weight"))}
        model = model.to(torch.bfloat16)
        for name, p in model.named_parameters():
            if name in keep:
                p.data = keep[name]
    kwargs = {}
    if req.get("max_shard_size"):
        kwargs["max_shard_size"] = req["max_shard_size"]
    model.save_pretrained(req["dir"], **kwargs)


def load(directory):
    """The checkpoint in ``directory`` in float32 with eager attention, in eval mode."""
    tf = check_transformers()
    with open(f"{directory}/config.json") as f:
        arch = json.load(f)["architectures"][0]
    family = next(f for f in ("Qwen3_5Moe", "Qwen3Next", "Qwen3_5") if arch.startswith(f))
    cls = getattr(tf, family + ("ForConditionalGeneration" if "Conditional" in arch
                                else "ForCausalLM"))
    kwargs = {"experts_implementation": "eager"} if family != "Qwen3_5" else {}
    model = cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                **kwargs)
    model.eval()
    return model


def run(req):
    model = load(req["dir"])
    out = {}
    with torch.no_grad():
        for case in req["cases"]:
            ids = torch.tensor([case["prompt"]], dtype=torch.long)
            res = model(input_ids=ids, use_cache=True)
            cache = res.past_key_values
            out[case["name"] + "/prefill_logits"] = res.logits[0].float().numpy()
            logits, toks, step_logits = res.logits[0, -1], [], []
            for _ in range(case.get("decode_steps", 0)):
                tok = int(torch.argmax(logits))
                toks.append(tok)
                res = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                            use_cache=True)
                cache = res.past_key_values
                logits = res.logits[0, -1]
                step_logits.append(logits.float().numpy())
            out[case["name"] + "/decode_tokens"] = np.array(toks, np.int64)
            out[case["name"] + "/decode_logits"] = (np.stack(step_logits) if step_logits
                                                    else np.zeros((0, 1), np.float32))
    np.savez(req["out"], **out)


def hidden_states(req):
    model = load(req["dir"])
    num_layers = model.config.get_text_config().num_hidden_layers
    out = {}
    with torch.no_grad():
        res = model(input_ids=torch.tensor([req["prompt"]]), use_cache=True,
                    output_hidden_states=True)
        step = model(input_ids=torch.tensor([[req["decode_token"]]]),
                     past_key_values=res.past_key_values, use_cache=True,
                     output_hidden_states=True)
    for name, r in (("prefill", res), ("decode", step)):
        assert len(r.hidden_states) == num_layers + 1, len(r.hidden_states)
        out[name + "/hidden_states"] = np.stack([h[0].float().numpy() for h in r.hidden_states])
        out[name + "/logits"] = r.logits[0].float().numpy()
    np.savez(req["out"], **out)


def activations(req):
    x = torch.from_numpy(np.load(req["in"])).to(torch.bfloat16)
    gate, up = x.chunk(2)
    np.savez(req["out"], silu=torch.nn.functional.silu(x).float().numpy(),
             sigmoid=torch.sigmoid(x).float().numpy(),
             swiglu=(torch.nn.functional.silu(gate) * up).float().numpy())


def processors(req):
    from transformers.generation import logits_process as lp
    check_transformers()
    with np.load(req["in"]) as data:
        logits = torch.from_numpy(data["logits"])
        ids = torch.from_numpy(data["input_ids"]).long()
        lengths = torch.from_numpy(data["prompt_lengths"]).long()
    out = {"repetition": lp.RepetitionPenaltyLogitsProcessor(req["penalty"])(ids, logits.clone()),
           "repetition_output": lp.RepetitionPenaltyLogitsProcessor(
               req["penalty"], prompt_ignore_length=lengths)(ids, logits.clone()),
           "top_p": lp.TopPLogitsWarper(req["top_p"])(ids, logits.clone())}
    np.savez(req["out"], **{k: v.numpy() for k, v in out.items()})


def grad(req):
    model = load(req["dir"])
    total = 0.0
    for case in req["cases"]:
        ids = torch.tensor([case["prompt"] + case["continuation"]], dtype=torch.long)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(case["prompt"]) - 1
        targets = ids[0, start + 1:]
        total = total + logp[start:start + len(targets)].gather(1, targets[:, None]).sum()
    total.backward()
    out = {name: p.grad.float().numpy() for name, p in model.named_parameters()
           if p.grad is not None}
    np.savez(req["out"], loss=np.float32(total.item()), **out)


def main():
    torch.set_num_threads(2)
    with open(sys.argv[1]) as f:
        requests = json.load(f)
    for req in requests:
        {"make": make, "run": run, "hidden_states": hidden_states, "activations": activations,
         "grad": grad,
         "processors": processors}[req["action"]](req)


if __name__ == "__main__":
    main()
