"""Shared fixtures: float32 "highest" matmuls, the Hugging Face reference runner, tiny configs.

The transformers side runs in a separate Python (``JAXDECODE_HF_PYTHON``, set up by ``.ci/run``)
through ``tests/hf_reference.py``. Without it the HF parity tests skip, unless
``JAXDECODE_REQUIRE_HF=1`` (CI), where they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

HERE = Path(__file__).resolve().parent
LIN, FULL = "linear_attention", "full_attention"

# A tiny Qwen3.5 text config in HF's own terms (what save_pretrained writes). r = Hv/Hk = 2,
# dk != dv, 2 query heads per KV head, rotary dims 8 of 32, Kc = 4.
TINY_TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, layer_types=[LIN, LIN, LIN, FULL],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    eos_token_id=1, hidden_act="silu",
)


def text_config(**overrides) -> dict:
    cfg = json.loads(json.dumps(TINY_TEXT_CONFIG))
    cfg.update(overrides)
    return cfg


def hf_python() -> str | None:
    return os.environ.get("JAXDECODE_HF_PYTHON")


def _require_hf():
    if hf_python() is None:
        msg = ("JAXDECODE_HF_PYTHON is not set: it must name a Python with torch and "
               "transformers==5.24.0 (bash .ci/run sets one up)")
        if os.environ.get("JAXDECODE_REQUIRE_HF") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def run_hf(requests: list[dict], workdir: Path) -> None:
    """Runs a list of hf_reference.py actions in one subprocess."""
    _require_hf()
    workdir.mkdir(parents=True, exist_ok=True)
    req_file = workdir / f"requests_{os.getpid()}_{len(list(workdir.iterdir()))}.json"
    req_file.write_text(json.dumps(requests))
    proc = subprocess.run([hf_python(), str(HERE / "hf_reference.py"), str(req_file)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hf_reference.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


class HFCheckpoints:
    """Builds random HF checkpoints on demand (once per key) and runs reference cases on them."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[str, Path] = {}

    def make(self, key: str, text_config: dict, *, seed: int = 0, layout: str = "causal_lm",
             dtype: str = "float32", max_shard_size: str | None = None) -> Path:
        if key not in self.made:
            path = self.root / key
            run_hf([{"action": "make", "dir": str(path), "text_config": text_config,
                     "seed": seed, "layout": layout, "dtype": dtype,
                     "max_shard_size": max_shard_size}], self.root)
            self.made[key] = path
        return self.made[key]

    def build(self, specs: dict[str, dict], cases: dict[str, list[dict]]) -> dict:
        """Makes every checkpoint in ``specs`` and runs ``cases[key]`` on each, in ONE subprocess.

        Returns {key: (path, {array name: array})}.
        """
        requests, outs = [], {}
        for key, spec in specs.items():
            path = self.root / key
            requests.append({"action": "make", "dir": str(path), **spec})
            outs[key] = (path, self.root / f"{key}_ref.npz")
            requests.append({"action": "run", "dir": str(path), "out": str(outs[key][1]),
                             "cases": cases.get(key, [])})
        run_hf(requests, self.root)
        result = {}
        for key, (path, out) in outs.items():
            self.made[key] = path
            with np.load(out) as data:
                result[key] = (path, dict(data))
        return result

    def reference(self, path: Path, cases: list[dict]) -> dict[str, np.ndarray]:
        """Runs cases ({"name", "prompt", "decode_steps"}) on a checkpoint; returns the npz."""
        out = path.parent / f"{path.name}_ref_{len(list(path.parent.iterdir()))}.npz"
        run_hf([{"action": "run", "dir": str(path), "out": str(out), "cases": cases}], self.root)
        with np.load(out) as data:
            return dict(data)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> HFCheckpoints:
    _require_hf()
    return HFCheckpoints(tmp_path_factory.mktemp("hf"))


def assert_logits_close(actual, expected, *, rel: float = 1e-4, what: str = "logits",
                        near_tie: float | None = None):
    """Parity check for logits (spec §7 item 12): max |Δ| <= rel * max|expected| and the same
    argmax wherever the reference's top-2 margin is above ``near_tie`` (default 10·tolerance)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: {actual.shape=} != {expected.shape=}"
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    scale = np.abs(expected).max()
    tol = rel * scale
    err = np.abs(actual - expected).max()
    assert err <= tol, f"{what}: max |Δ| = {err:.3g} > {tol:.3g} (= {rel} · max|ref| {scale:.3g})"
    top2 = np.sort(expected, axis=-1)[..., -2:]
    decided = (top2[..., 1] - top2[..., 0]) > (near_tie if near_tie is not None else 10 * tol)
    same = np.argmax(actual, -1) == np.argmax(expected, -1)
    assert same[decided].all(), f"{what}: argmax differs at {np.argwhere(decided & ~same)[:5]}"
    return err / scale


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, size=length).tolist()


if sys.version_info < (3, 12):  # pragma: no cover
    raise RuntimeError("jaxdecode's tests need Python >= 3.12 (JAX 0.11)")
