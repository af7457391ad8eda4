"""Hugging Face greedy ``generate`` on a checkpoint directory (the reference for
test_generation.py).

Runs in the Python that has torch + transformers 5.24.0 (``JAXDECODE_HF_PYTHON``):

    python hf_generate_reference.py REQUEST.json

REQUEST.json: {"dir": D, "out": F.json, "cases": [{"prompt": [ids], "max_new_tokens": K,
"eos_token_id": [ids], "repetition_penalty": r, "penalize_prompt": bool}]}. Each case runs alone
(batch 1, no padding) with ``do_sample=False``, float32 weights, eager attention. An empty
``eos_token_id`` list disables EOS stopping (the checkpoint's generation config is overridden).
``repetition_penalty`` (optional) is HF's own (``generate(repetition_penalty=r)``, which counts
the prompt); with ``"penalize_prompt": false`` it is a ``RepetitionPenaltyLogitsProcessor(r,
prompt_ignore_length=len(prompt))`` instead (generated tokens only). Writes F.json: a list with
the new token ids of each case (without the prompt).
"""

import json
import sys

import torch
import transformers
from transformers import (LogitsProcessorList, Qwen3_5ForCausalLM,
                          Qwen3_5ForConditionalGeneration, RepetitionPenaltyLogitsProcessor)

assert transformers.__version__ == "5.24.0", transformers.__version__


def main():
    torch.set_num_threads(2)
    with open(sys.argv[1]) as f:
        req = json.load(f)
    with open(f"{req['dir']}/config.json") as f:
        arch = json.load(f)["architectures"][0]
    cls = Qwen3_5ForConditionalGeneration if "Conditional" in arch else Qwen3_5ForCausalLM
    model = cls.from_pretrained(req["dir"], dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for case in req["cases"]:
            ids = torch.tensor([case["prompt"]], dtype=torch.long)
            eos = case.get("eos_token_id") or None
            kw = {}
            penalty = case.get("repetition_penalty")
            if penalty is not None and case.get("penalize_prompt", True):
                kw["repetition_penalty"] = penalty
            elif penalty is not None:
                kw["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(
                    penalty, prompt_ignore_length=ids.shape[1])])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=case["max_new_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=0, use_cache=True, **kw)
            results.append(out[0, ids.shape[1]:].tolist())
    with open(req["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
