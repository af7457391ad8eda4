"""Hugging Face transformers' prefill of the same prompts, for ``benchmarks/prefill.py``'s table:
``Qwen3_5ForCausalLM`` (random bf16 weights with the preset's shapes, SDPA attention) on CUDA,
its DeltaNet layers through flash-linear-attention's Triton ``chunk_gated_delta_rule`` when the
``fla`` package imports (as transformers' ``use_kernel_func_from_hub_with_fallback`` decides),
otherwise through ``torch_chunk_gated_delta_rule``.

    python benchmarks/hf_prefill.py [--cells 0.8b:1:8192,0.8b:8:2048]

Per cell (model:rows:tokens): the median of 3 timed forwards after one warm-up, each over the
whole prompt with ``logits_to_keep=1`` (the last position's logits, as ``jd.prefill``), wall time
until ``torch.cuda.synchronize`` returns, and the peak memory torch allocated.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
import transformers

import jaxdecode as jd


def fla_available() -> bool:
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
        return True
    except Exception:  # noqa: BLE001 - transformers falls back to torch on any import failure
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="0.8b:1:8192,0.8b:8:2048")
    args = ap.parse_args()
    fla = fla_available()
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; transformers "
          f"{transformers.__version__}; flash-linear-attention: {'yes' if fla else 'no'}")
    rows = []
    for cell in args.cells.split(","):
        name, b, t = cell.split(":")
        config = transformers.Qwen3_5TextConfig(
            **jd.Config.from_preset(f"qwen3.5-{name}").to_hf_config())
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
        tokens = torch.randint(0, config.vocab_size, (int(b), int(t)), device="cuda")
        times = []
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for i in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=tokens, logits_to_keep=1, use_cache=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        s = statistics.median(times[1:])
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((cell, s, int(b) * int(t) / s, times[0], peak))
        print(f"  {cell}: {s:.3f} s", flush=True)
        del model
        torch.cuda.empty_cache()
    print("\n| cell | HF s (TTFT) | tok/s | first call s | peak GiB | delta rule |")
    print("|---|---:|---:|---:|---:|---|")
    for cell, s, tok_s, first, peak in rows:
        print(f"| {cell} | {s:.3f} | {tok_s:,.0f} | {first:.1f} | {peak:.1f} | "
              f"{'flash-linear-attention' if fla else 'torch (no fla)'} |")


if __name__ == "__main__":
    main()
