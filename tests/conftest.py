"""Shared fixtures, configs, references and helpers of the test suite (no test file imports
another test file; everything shared lives here).

* float32 "highest" matmuls everywhere (parity tests compare float32 results to 1e-4);
* configs: one tiny ``Config`` (:data:`TINY`), every other small config ``tiny(**changes)``
  (a ``dataclasses.replace`` of it), and :func:`hf_text_config`, the same config in HF's terms;
* the Hugging Face reference: transformers runs in a separate Python (``JAXDECODE_HF_PYTHON``,
  set up by ``.ci/run``) through ``tests/hf_reference.py``. Without it the HF parity tests skip,
  unless ``JAXDECODE_REQUIRE_HF=1`` (CI), where they fail instead;
* kernel modes: "interpret" (the Mosaic GPU interpreter on CPU) and "gpu" (compiled; skipped
  without an sm_90 GPU), and the float64 references the kernels and the model are checked
  against;
* markers (registered in pyproject.toml): ``gpu``, ``hf``, ``slow`` (deselect with
  ``-m "not slow"`` for a quick run: subprocesses, whole-loop compiles, interpreter cases) and
  ``perf`` (performance contracts: donation/aliasing, HLO op counts, executable counts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.kernels import choice

jax.config.update("jax_default_matmul_precision", "highest")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIN, FULL = "linear_attention", "full_attention"


# ----- configs ------------------------------------------------------------------------------

# The one tiny config every small test config derives from: GQA (2 query heads per KV head),
# r = Hv/Hk = 2, dk != dv, rotary dims 8 of 32, Kc = 4, one attention layer after three DeltaNet
# layers, untied LM head, vocabulary 512.
TINY = dataclasses.replace(
    jd.Config.from_preset("tiny"), vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, layer_types=(LIN, LIN, LIN, FULL), num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25, rope_theta=10_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=4096, eos_token_id=(1,))


def tiny(**changes) -> jd.Config:
    """:data:`TINY` with ``changes`` (``dataclasses.replace``)."""
    return dataclasses.replace(TINY, **changes)


def hf_text_config(config: jd.Config = TINY, **changes) -> dict:
    """``config`` (with ``changes``) as the HF text config kwargs a random checkpoint is built from
    (tests/hf_reference.py): its config.json text config, ``model_type`` kept (it picks the HF
    classes), with the text-only mRoPE sections Qwen3.5 expects (equal position rows make mRoPE
    plain RoPE; Qwen3-Next's RoPE is 1-D and takes none)."""
    config = dataclasses.replace(config, **changes)
    d = config.to_hf_config()
    for key in ("architectures", "partial_rotary_factor"):
        d.pop(key)
    if config.model_type == "qwen3_5":
        half = int(config.head_dim * config.partial_rotary_factor) // 2
        d["rope_parameters"] = {**d["rope_parameters"],
                                "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
                                "mrope_interleaved": True}
    return d


# ----- kernel modes ---------------------------------------------------------------------------

@functools.cache
def cpu_devices_env(count: int) -> dict[str, str]:
    """Environment variables for a subprocess that runs on ``count`` virtual CPU devices.

    XLA's CPU client runs each device's part of a program on a pool of max(cores, devices)
    threads (``GetPjRtCpuClient``), so on a 2-core machine a collective over all ``count``
    devices has no thread to spare, and its rendezvous aborts the process after 40 s
    (``xla_cpu_collective_call_terminate_timeout_seconds``). CI saw that once (4 of 8 devices at
    an all-gather in time). ``PJRT_NPROC`` sizes the pool with room to spare and the timeout is
    raised; a real hang still fails at the caller's subprocess timeout.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}"
                         " --xla_cpu_collective_call_terminate_timeout_seconds=600",
            "PJRT_NPROC": str(max(4 * count, os.cpu_count() or 1)),
            "JAX_PLATFORMS": "cpu"}


def has_sm90_gpu() -> bool:
    try:
        return (choice._compute_capability(jax.devices()[0]) or (0, 0)) >= (9, 0)
    except RuntimeError:
        return False


def pytest_runtest_setup(item):
    """Tests marked ``gpu`` skip without an sm_90 GPU (decided when they run: importing this
    file must not start the backend, as tests/sharding_worker.py initializes jax.distributed
    after importing it)."""
    if item.get_closest_marker("gpu") is not None and not has_sm90_gpu():
        pytest.skip("needs an NVIDIA GPU with sm_90+")


GPU_ONLY = [pytest.mark.gpu]
# "interpret": the Mosaic GPU interpreter on CPU (slow); "gpu": compiled on an sm_90 GPU.
MODES = [pytest.param("interpret", id="interpret", marks=pytest.mark.slow),
         pytest.param("gpu", id="gpu", marks=GPU_ONLY)]


def lower_for_cuda_text(fn, *specs, donate_argnums=()) -> str:
    """StableHLO text of ``fn`` lowered for CUDA on this (CPU) machine: for a Mosaic GPU kernel
    this runs the whole Pallas -> Mosaic GPU translation."""
    specs = [s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(*s)
             for s in specs]
    return jax.jit(fn, donate_argnums=donate_argnums).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()


def aliased_parameters(hlo_text: str) -> set[int]:
    """Entry parameters aliased to an output (``input_output_alias``) in compiled HLO text."""
    start = hlo_text.find("input_output_alias={")
    if start < 0:
        return set()
    segment = hlo_text[start:hlo_text.find("entry_computation_layout", start)]
    return {int(m) for m in re.findall(r"\{\d*\}:\s*\((\d+),", segment)}


def assert_rel_close(got, want, rel, what):
    """max |got - want| <= rel * max |want| (float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape=} != {want.shape=}"
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max|want| {scale:.3g}"


# ----- references: the gated delta rule -------------------------------------------------------

def numpy_recurrence(q, k, v, g, beta, state):
    """Float64 token-by-token gated delta rule (Yang et al. 2025, eq. 10; HF recurrent kernel)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    s = s.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s += k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def random_inputs(seed, batch, length, heads, dk, dv, *, decay_scale):
    """Random float32 inputs of the gated delta rule: unit-norm q (times dk**-0.5) and k
    [B, T, H, dk], v [B, T, H, dv], log decay g in [-decay_scale, 0] and beta in [0, 1] [B, T, H],
    state [B, H, dk, dv]."""
    rng = np.random.default_rng(seed)


    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit((batch, length, heads, dk)) * dk ** -0.5
    k = unit((batch, length, heads, dk))
    v = rng.standard_normal((batch, length, heads, dv))
    g = -decay_scale * rng.uniform(0.0, 1.0, (batch, length, heads))
    beta = rng.uniform(0.0, 1.0, (batch, length, heads))
    state = rng.standard_normal((batch, heads, dk, dv))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta, state)]


# ----- references: decode attention ----------------------------------------------------------

ATTENTION_TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-4}  # per (row, head) relative L2 error


def attention_inputs(seed, heads, head_dim, max_len, lengths, dtype):
    """Random q [B, Hq, D], caches [B, Hkv, S, D] (NaN past each row's length), lengths [B]."""
    num_heads, num_kv_heads = heads
    batch = len(lengths)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, num_kv_heads, max_len, head_dim), dtype)
    v = jax.random.normal(kv, (batch, num_kv_heads, max_len, head_dim), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    past = (jnp.arange(max_len)[None, :] >= lengths[:, None])[:, None, :, None]
    return q, jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), lengths


def attention_reference_f64(q, k, v, lengths):
    """softmax(q k^T / sqrt(D)) v in float64 over each row's valid keys only."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (q, k, v))
    batch, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for b, length in enumerate(np.asarray(lengths)):
        if length == 0:
            continue
        for kv_head in range(k.shape[1]):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            keys = k[b, kv_head, :length].astype(np.float64)
            values = v[b, kv_head, :length].astype(np.float64)
            scores = q[b, heads].astype(np.float64) @ keys.T / math.sqrt(head_dim)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[b, heads] = (p @ values) / p.sum(axis=-1, keepdims=True)
    return out


def assert_attention_close(out, expected, lengths, tol):
    """Relative L2 error <= tol per (row, head); rows with length 0 exactly zero; no NaN."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert out.shape == expected.shape, f"{out.shape=} != {expected.shape=}"
    assert np.isfinite(out).all(), f"non-finite output at {np.argwhere(~np.isfinite(out))[:5]}"
    lengths = np.asarray(lengths)
    np.testing.assert_array_equal(out[lengths == 0], 0.0)
    nonempty = lengths > 0
    err = (np.linalg.norm(out[nonempty] - expected[nonempty], axis=-1)
           / np.linalg.norm(expected[nonempty], axis=-1))
    assert err.max() <= tol, f"max relative error {err.max():.3g} > {tol} (mean {err.mean():.3g})"
    return err.max()


# ----- references: the one-token Gated DeltaNet core ------------------------------------------

CORE_ARG_NAMES = ("mixed_qkv", "a", "b", "active", "positions", "conv_state", "recurrent_state",
                  "conv_weight", "A_log", "dt_bias")


def random_core_inputs(seed, batch, hk, hv, dk, dv, kc, active, dtype=jnp.float32,
                       param_dtype=None):
    """Fresh random inputs of the decode core (no zeros). The conv weight, A_log and dt_bias
    are spread so that the decay exp(g) ranges from ~1 down to ~e^-30."""
    rng = np.random.default_rng(seed)
    param_dtype = param_dtype or dtype
    channels = hk * (2 * dk + (hv // hk) * dv)
    arrays = dict(
        mixed_qkv=(rng.standard_normal((batch, channels)), dtype),
        a=(2.0 * rng.standard_normal((batch, hv)), dtype),
        b=(2.0 * rng.standard_normal((batch, hv)), dtype),
        active=(np.asarray(active, bool), jnp.bool_),
        # positions from 0 (the window wraps to slots of positions before 0) to past several
        # turns of the ring
        positions=(rng.integers(0, 4 * kc + 3, batch), jnp.int32),
        conv_state=(rng.standard_normal((batch, kc, channels)), dtype),
        recurrent_state=(rng.standard_normal((batch, hv, dk, dv)), jnp.float32),
        conv_weight=(0.6 * rng.standard_normal((channels, kc)), param_dtype),
        A_log=(rng.uniform(-1.5, 1.5, hv), jnp.float32),  # float32 in the published checkpoints
        dt_bias=(rng.standard_normal(hv), param_dtype),
    )
    assert arrays["active"][0].shape == (batch,)
    return [jnp.asarray(x, d) for x, d in arrays.values()]


def numpy_core(mixed_qkv, a, b, active, positions, conv_state, recurrent_state, conv_weight, A_log,
               dt_bias, *, num_key_heads):
    """Float64 version of the whole one-token core (HF ``Qwen3_5GatedDeltaNet``): conv + silu,
    split, gating, L2 norms, masking of inactive rows, the GQA delta rule (value head h reads key
    head h // r) and the new conv ring. Inputs already rounded to their dtypes; no intermediate
    rounding."""
    mixed, a, b, conv_state, state, w, A_log, dt_bias = (
        np.asarray(x, np.float64) for x in (mixed_qkv, a, b, conv_state, recurrent_state,
                                            conv_weight, A_log, dt_bias))
    active, positions = np.asarray(active), np.asarray(positions)
    batch, hv, dk, dv = state.shape
    hk, r, kc = num_key_heads, hv // num_key_heads, conv_state.shape[1]
    # the window: positions n-Kc+1 .. n-1, position p in ring slot p mod Kc
    rows = np.arange(batch)[:, None]
    slots = (positions[:, None] - kc + 1 + np.arange(kc - 1)[None, :]) % kc  # [B, Kc-1]
    hist = np.concatenate([conv_state[rows, slots], mixed[:, None]], axis=1)  # [B, Kc, C]
    conv = np.einsum("btc,ct->bc", hist, w)
    x = conv / (1.0 + np.exp(-conv))  # silu
    grouped = x.reshape(batch, hk, 2 * dk + r * dv)
    q, k = grouped[..., :dk], grouped[..., dk:2 * dk]
    v = grouped[..., 2 * dk:].reshape(batch, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(A_log) * np.logaddexp(0.0, a + dt_bias)
    m = active[:, None, None]
    q, k, v = (np.where(m, t, 0.0) for t in (q, k, v))
    g, beta = (np.where(active[:, None], t, 0.0) for t in (g, beta))
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    o, new_state = numpy_recurrence(q[:, None], k[:, None], v[:, None], g[:, None],
                                    beta[:, None], state)
    new_ring = conv_state.copy()
    new_ring[active, positions[active] % kc] = mixed[active]  # this token at slot n mod Kc
    return o[:, 0], new_ring, new_state


def assert_inactive_rows_untouched(args, o, new_conv, new_state):
    """Rows that take no token: state and ring bit-exact, o == 0."""
    active = np.asarray(args[3])
    np.testing.assert_array_equal(np.asarray(new_state)[~active], np.asarray(args[6])[~active])
    np.testing.assert_array_equal(np.asarray(new_conv)[~active], np.asarray(args[5])[~active])
    assert (np.asarray(o)[~active] == 0).all()


# ----- the Hugging Face reference -------------------------------------------------------------

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

    def hidden_states(self, path: Path, prompt: list[int], decode_token: int
                      ) -> dict[str, np.ndarray]:
        """HF's hidden states of every layer for a prompt and one decode step after it
        (hf_reference.py "hidden_states")."""
        out = path.parent / f"{path.name}_hidden_{len(list(path.parent.iterdir()))}.npz"
        run_hf([{"action": "hidden_states", "dir": str(path), "out": str(out), "prompt": prompt,
                 "decode_token": int(decode_token)}], self.root)
        with np.load(out) as data:
            return dict(data)

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
    """Parity check for logits: max |Δ| <= rel * max|expected| and the same argmax wherever the
    reference's top-2 margin is above ``near_tie`` (default 10·tolerance)."""
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


# ----- a small HF tokenizer directory -----------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_hf_tokenizer(directory, template_in="config"):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>",
                                                                  "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50,
                            trainer)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if template_in == "config":
        cfg["chat_template"] = TEMPLATE
    else:
        (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


if sys.version_info < (3, 12):  # pragma: no cover
    raise RuntimeError("jaxdecode's tests need Python >= 3.12 (JAX 0.11)")


def host_stop(tokens, budget, stops):
    """Where each row stops, scanning its stop-free tokens on the host: (tokens, reason)."""
    for end in range(1, budget + 1):
        if any(end >= len(s) and tokens[end - len(s):end] == list(s) for s in stops):
            return tokens[:end], "stop"
    return tokens[:budget], "length"
