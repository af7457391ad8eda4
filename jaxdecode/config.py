"""Model configuration: the HF ``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` fields jaxdecode reads,
named as in ``config.json`` (transformers 5.24.0 ``configuration_qwen3_5.py``,
``configuration_qwen3_next.py``); derived sizes are properties.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import ml_dtypes
import numpy as np

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

DENSE_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
NEXT_MODEL_TYPES = ("qwen3_next",)
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES + NEXT_MODEL_TYPES
# Config.model_type: the HF family, which fixes the checkpoint layout and the HF class names.
QWEN3_5, QWEN3_NEXT = "qwen3_5", "qwen3_next"


@dataclasses.dataclass(frozen=True)
class Config:
    """A Qwen3.5 or Qwen3-Next text decoder's shape; frozen and hashable (a ``jax.jit`` static).
    Shape letters: ``jaxdecode.model``'s legend (Hq = ``num_attention_heads``, C =
    ``linear_conv_dim``).

    ``model_type`` is the HF family: "qwen3_5" (``Qwen3_5TextConfig``, or with ``num_experts > 0``
    ``Qwen3_5MoeTextConfig``: every layer's FFN a routed MoE block with a shared expert, no
    ``intermediate_size``, which is then 0) or "qwen3_next" (``Qwen3NextConfig``: the same
    decoder with fused DeltaNet projections on disk, a ``norm_topk_prob`` switch, and a dense
    ``intermediate_size`` MLP in the layers ``decoder_sparse_step`` / ``mlp_only_layers`` name:
    :attr:`moe_layers`).

    Raises ``ValueError`` on construction for non-positive sizes, ``layer_types`` that do not
    match ``num_hidden_layers`` or name unknown kinds, no full-attention layer, head counts that
    do not divide, odd rotary dims, ``linear_conv_kernel_dim`` < 2, MoE sizes that disagree, an
    unknown ``model_type``, or Qwen3-Next switches on a "qwen3_5" config.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    eos_token_id: tuple[int, ...] = ()
    num_experts: int = 0  # E routed experts per layer; 0: a dense model
    num_experts_per_tok: int = 0  # k experts each token is routed to
    moe_intermediate_size: int = 0  # I_e of each routed expert
    shared_expert_intermediate_size: int = 0  # I_s of the shared expert
    model_type: str = QWEN3_5  # QWEN3_5 or QWEN3_NEXT
    # Qwen3-Next only (HF Qwen3_5Moe* always renormalises and routes every layer):
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # The multi-token-prediction layer (spec §6): 0 (not loaded) or 1 (``mtp.*`` weights held;
    # ``load_checkpoint(..., mtp=True)``). HF's config names it; HF itself never loads it.
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        for name in ("layer_types", "mlp_only_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = []
        eos = _token_ids(self.eos_token_id)
        if eos is None:
            problems.append(f"eos_token_id={self.eos_token_id!r} must be a non-negative int or a "
                            "flat sequence of them")
        else:  # a tuple of Python ints: Config is hashable (a static jit argument)
            object.__setattr__(self, "eos_token_id", eos)
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim") + moe:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name}={value!r} must be a positive int")
                continue
            if name in moe + ("intermediate_size",) and value == 0:
                continue  # checked below: a dense model's MoE sizes, an MoE's dense size
            if value <= 0:
                problems.append(f"{name}={value!r} must be a positive int")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"{name}={value!r} must be a positive number")
        if not problems and self.num_experts:
            zero = [n for n in moe[1:] if not getattr(self, n)]
            if zero:
                problems.append(f"num_experts={self.num_experts} needs positive {zero}")
            elif self.num_experts_per_tok > self.num_experts:
                problems.append(f"num_experts_per_tok={self.num_experts_per_tok} > "
                                f"num_experts={self.num_experts}")
            if self.model_type == QWEN3_5 and self.intermediate_size:
                problems.append(f"intermediate_size={self.intermediate_size} must be 0 for a "
                                f"{QWEN3_5!r} MoE model (every layer's FFN is the MoE block; "
                                f"only {QWEN3_NEXT!r} has dense layers)")
        elif not problems:
            if not self.intermediate_size:
                problems.append("intermediate_size=0 must be a positive int (a dense model)")
            given = {n: getattr(self, n) for n in moe[1:] if getattr(self, n)}
            if given:
                problems.append(f"{given} given without num_experts")
        if not problems:
            problems += self._family_problems()
        if problems:
            raise ValueError("invalid Config: " + "; ".join(problems))
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"len(layer_types)={len(self.layer_types)} != "
                            f"num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            problems.append(f"unsupported layer_types {unknown} (supported: "
                            f"{LINEAR_ATTENTION!r}, {FULL_ATTENTION!r})")
        if FULL_ATTENTION not in self.layer_types:
            problems.append("layer_types has no 'full_attention' layer; jaxdecode needs at least "
                            "one (it holds the KV cache that bounds max_len)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be divisible by "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(f"linear_num_value_heads={self.linear_num_value_heads} must be "
                            f"divisible by linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append(f"rotary dims int(head_dim * partial_rotary_factor)={self.rotary_dim} "
                            f"must be even and in (0, head_dim={self.head_dim}]")
        if self.linear_conv_kernel_dim < 2:
            problems.append(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 2")
        mtp = self.mtp_num_hidden_layers
        if isinstance(mtp, bool) or mtp not in (0, 1):
            problems.append(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers!r} (jaxdecode "
                            "holds 0 or 1 MTP layer, as every published checkpoint has)")
        if problems:
            raise ValueError("invalid Config: " + "; ".join(problems))

    def _family_problems(self) -> list[str]:
        """The ``model_type`` and Qwen3-Next switch problems of :meth:`__post_init__`."""
        if self.model_type not in (QWEN3_5, QWEN3_NEXT):
            return [f"model_type={self.model_type!r} must be {QWEN3_5!r} or {QWEN3_NEXT!r}"]
        problems = []
        switches = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}
        if self.model_type == QWEN3_5:
            problems += [f"{name}={getattr(self, name)!r} needs model_type={QWEN3_NEXT!r} (HF "
                         f"Qwen3.5 has no such switch)"
                         for name, default in switches.items() if getattr(self, name) != default]
            return problems
        step = self.decoder_sparse_step
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            problems.append(f"decoder_sparse_step={self.decoder_sparse_step!r} must be a positive "
                            "int")
        bad = [i for i in self.mlp_only_layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.num_hidden_layers]
        if bad:
            problems.append(f"mlp_only_layers {bad} are not layer indices in "
                            f"[0, num_hidden_layers={self.num_hidden_layers})")
        if not problems and self.num_experts and not self.intermediate_size and (
                len(self.moe_layers) < self.num_hidden_layers):
            dense = sorted(set(range(self.num_hidden_layers)) - set(self.moe_layers))
            problems.append(f"intermediate_size=0 must be a positive int (layers {dense} have a "
                            "dense MLP)")
        return problems

    @property
    def is_moe(self) -> bool:
        """The model has routed experts: the FFN of each layer in :attr:`moe_layers` is a routed
        mixture of experts (HF ``Qwen3_5MoeSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``)."""
        return self.num_experts > 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is the MoE block, the others a dense MLP of
        ``intermediate_size`` (HF ``Qwen3NextDecoderLayer``: not in ``mlp_only_layers``, and
        ``(i + 1) % decoder_sparse_step == 0``); every layer of a Qwen3.5-MoE model."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per KV head (Hq / Hkv)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def linear_num_value_heads_per_key_head(self) -> int:
        """r = Hv / Hk: value head h uses key head h // r (HF's ``repeat_interleave``)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def rotary_dim(self) -> int:
        """Rotated dims of each attention head: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """Ck = Hk·dk."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Cv = Hv·dv."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """C = 2·Ck + Cv: channels of ``in_proj_qkv`` and of the causal conv."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the gated full-attention (KV cache) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "Config":
        """A Config from an HF ``config.json`` dict: text-only (``qwen3_5_text``,
        ``qwen3_5_moe_text``), multimodal (``qwen3_5``, ``qwen3_5_moe`` with a ``text_config``
        block) or ``qwen3_next``. Qwen3-Next's legacy top-level ``rope_theta`` /
        ``partial_rotary_factor`` (its published config.json) are read as HF 5.24's
        ``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` does: ``rope_scaling`` (or
        ``rope_parameters``) first, then the top-level fields, then ``Qwen3NextConfig``'s defaults
        (theta 10000, factor 0.25). ValueError naming every unsupported field (another model
        type, biases, non-SiLU activations, rope scaling, a Qwen3.5 sparse-step schedule) at
        once, or for a missing or mistyped field."""
        if not isinstance(hf_config, Mapping) or not isinstance(
                hf_config.get("text_config") or {}, Mapping):
            raise ValueError(f"config.json must hold a JSON object (with a text_config object "
                             f"where given), got {type(hf_config).__name__}")
        top = dict(hf_config)
        text = dict(top.get("text_config") or top)
        model_type = text.get("model_type", top.get("model_type"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported config: model_type={model_type!r}; jaxdecode supports "
                             f"{SUPPORTED_MODEL_TYPES}")
        nxt = model_type in NEXT_MODEL_TYPES
        # Qwen3-Next is MoE unless num_experts is 0 (HF's default is 512; the field is required).
        moe = model_type in MOE_MODEL_TYPES or (nxt and text.get("num_experts", 512) != 0)
        if not moe and not nxt and text.get("num_experts"):
            raise ValueError(f"unsupported config: model_type={model_type!r} with num_experts="
                             f"{text['num_experts']} (mixture-of-experts models are "
                             f"{MOE_MODEL_TYPES + NEXT_MODEL_TYPES})")
        problems = []
        experts = text.get("num_experts")
        if (model_type in MOE_MODEL_TYPES and isinstance(experts, int)
                and not isinstance(experts, bool) and experts <= 0):
            problems.append(f"num_experts={experts} (model_type {model_type!r} is a "
                            "mixture-of-experts model: num_experts > 0; a dense Qwen3.5 is "
                            "'qwen3_5' / 'qwen3_5_text')")
        if text.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={text['hidden_act']!r} (only 'silu')")
        if text.get("attention_bias", False):
            problems.append("attention_bias=True (Qwen3.5 has no biases)")
        if text.get("attn_output_gate", True) is False:
            problems.append("attn_output_gate=False (the gated attention output is required)")
        if not nxt and text.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={text['mlp_only_layers']} (Qwen3.5: every layer "
                            "the same FFN)")
        if not nxt and moe and text.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={text['decoder_sparse_step']} (every layer MoE)")
        # HF: rope_scaling, when set, replaces rope_parameters (convert_rope_params_to_dict).
        rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            problems.append(f"rope_type={rope_type!r} (only 'default')")
        if problems:
            raise ValueError("unsupported config: " + "; ".join(problems))
        # Theta when config.json names none: HF's default_theta for Qwen3-Next; for Qwen3.5 the
        # published value.
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000.0 if nxt
                                                      else 10_000_000.0))
        partial = rope.get("partial_rotary_factor",
                           text.get("partial_rotary_factor", top.get("partial_rotary_factor", 0.25)))
        num_layers = text.get("num_hidden_layers")  # read here: the default layer_types
        if num_layers is None:
            raise ValueError("config.json is missing the required field 'num_hidden_layers'")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool):
            raise ValueError(f"config.json's num_hidden_layers={num_layers!r} must be an int")
        layer_types = text.get("layer_types")
        if layer_types is None:
            layer_types = _schedule(num_layers, text.get("full_attention_interval", 4))
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos = () if eos is None else eos
        tie = top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        moe_names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size")
        try:
            family = {}
            if nxt:
                family = dict(model_type=QWEN3_NEXT,
                              norm_topk_prob=text.get("norm_topk_prob", True),
                              decoder_sparse_step=text.get("decoder_sparse_step", 1),
                              mlp_only_layers=tuple(text.get("mlp_only_layers") or ()))
            return cls(
                vocab_size=text["vocab_size"],
                hidden_size=text["hidden_size"],
                intermediate_size=0 if moe and not nxt else text["intermediate_size"],
                num_hidden_layers=num_layers,
                num_attention_heads=text["num_attention_heads"],
                num_key_value_heads=text["num_key_value_heads"],
                head_dim=text.get("head_dim",
                                  text["hidden_size"] // text["num_attention_heads"]),
                linear_num_key_heads=text["linear_num_key_heads"],
                linear_num_value_heads=text["linear_num_value_heads"],
                linear_key_head_dim=text["linear_key_head_dim"],
                linear_value_head_dim=text["linear_value_head_dim"],
                linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
                layer_types=tuple(layer_types),
                partial_rotary_factor=float(partial),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(tie),
                max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
                eos_token_id=eos,
                **({name: text[name] for name in moe_names} if moe else {}),
                **family,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
        except TypeError as e:  # e.g. "hidden_size": "128"
            raise ValueError(f"config.json has a field of the wrong type: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "Config":
        """Reads an HF ``config.json`` file (:meth:`from_hf_config`); ValueError for malformed JSON
        (naming the file) or an unsupported config."""
        return cls.from_hf_config(read_json(path))

    @classmethod
    def from_preset(cls, name: str) -> "Config":
        """The published Qwen3.5 and Qwen3-Next text shapes, plus ``tiny`` for tests and the demo (ValueError for
        an unknown name, listing the presets)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return PRESETS[name]

    def to_hf_config(self) -> dict[str, Any]:
        """The ``qwen3_5_text`` (``qwen3_5_moe_text``, ``qwen3_next``) config.json dict for this
        Config (inverse of from_hf_config, but for ``mtp_num_hidden_layers``: written as held,
        read as 0 by from_hf_config, since holding the MTP layer is ``load_checkpoint``'s
        ``mtp`` choice)."""
        d = dataclasses.asdict(self)
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
        nxt = self.model_type == QWEN3_NEXT
        if nxt:
            d["num_experts"] = self.num_experts  # 0 must be written: HF's default is 512
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        else:
            for name in ("model_type", "norm_topk_prob", "decoder_sparse_step",
                         "mlp_only_layers"):
                d.pop(name)
            for name in ("intermediate_size",) if self.is_moe else moe:
                d.pop(name)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = (list(self.eos_token_id) if len(self.eos_token_id) != 1
                             else self.eos_token_id[0])
        d.pop("rope_theta")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor}
        if nxt:
            d["model_type"], d["architectures"] = QWEN3_NEXT, ["Qwen3NextForCausalLM"]
        else:
            d["model_type"] = "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text"
            d["architectures"] = ["Qwen3_5MoeForCausalLM" if self.is_moe
                                  else "Qwen3_5ForCausalLM"]
        d["hidden_act"] = "silu"
        return d


MODEL_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
                "float32": np.float32, "fp32": np.float32, "f32": np.float32}


def model_dtype(dtype) -> np.dtype:
    """The model dtype named by ``dtype`` ("bfloat16"/"bf16", "float32"/"fp32", or a dtype);
    ValueError for anything else."""
    try:
        return np.dtype(MODEL_DTYPES[dtype if isinstance(dtype, str) else np.dtype(dtype).name])
    except (KeyError, TypeError):
        raise ValueError(f"dtype={dtype!r} must be 'bfloat16' (or 'bf16') or 'float32' (or "
                         "'fp32')") from None


def _token_ids(value) -> tuple[int, ...] | None:
    """``value`` (an int, or a flat list/tuple/1-D array of ints, numpy integers included; None:
    none, as HF's ``eos_token_id: null``) as a tuple of non-negative Python ints; None if it is
    anything else (bools, floats, nesting)."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if isinstance(value, np.ndarray) and value.ndim != 1:
        return None
    ids = []
    for x in items:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            return None
        ids.append(int(x))
    return tuple(ids)


def _schedule(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(num_layers))


def _published(hidden, intermediate, layers, hq, hkv, hv, tie, **moe) -> Config:
    # Common to every published Qwen3.5 dense size (their config.json files).
    return Config(
        vocab_size=248_320, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=hv, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=_schedule(layers),
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, max_position_embeddings=262_144, eos_token_id=(248_044,), **moe)


def _published_moe(hidden, layers, hq, hv, experts, k, intermediate) -> Config:
    # Common to the published Qwen3.5-MoE sizes (their config.json files).
    return _published(hidden, 0, layers, hq, 2, hv, False, num_experts=experts,
                      num_experts_per_tok=k, moe_intermediate_size=intermediate,
                      shared_expert_intermediate_size=intermediate)


# Name -> Config: the published Qwen3.5 and Qwen3-Next text shapes (their config.json) and "tiny".
PRESETS: dict[str, Config] = {
    "qwen3.5-0.8b": _published(1024, 3584, 24, 8, 2, 16, True),
    "qwen3.5-2b": _published(2048, 6144, 24, 8, 2, 16, True),
    "qwen3.5-4b": _published(2560, 9216, 32, 16, 4, 32, True),
    "qwen3.5-9b": _published(4096, 12288, 32, 16, 4, 32, False),
    "qwen3.5-27b": _published(5120, 17408, 64, 24, 4, 48, False),
    "qwen3.5-35b-a3b": _published_moe(2048, 40, 16, 32, 256, 8, 512),
    "qwen3.5-122b-a10b": _published_moe(3072, 48, 32, 64, 256, 8, 1024),
    "qwen3.5-397b-a17b": _published_moe(4096, 60, 32, 64, 512, 10, 1024),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: vocabulary 151936, theta 5e6, every layer
    # MoE (its intermediate_size 5120 unused), norm_topk_prob true.
    "qwen3-next-80b-a3b": dataclasses.replace(
        _published_moe(2048, 48, 16, 32, 512, 10, 512), vocab_size=151_936,
        intermediate_size=5120, rope_theta=5_000_000.0, eos_token_id=(151_645,),
        model_type=QWEN3_NEXT),
    # Small enough for CPU tests and the demo, with the real vocabulary (so a real tokenizer fits),
    # GQA (2 query heads per KV head), r = Hv/Hk = 2, dk != dv and two attention layers.
    "tiny": Config(
        vocab_size=248_320, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
        linear_conv_kernel_dim=4, layer_types=_schedule(8), partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262_144, eos_token_id=(248_044,)),
}


def read_json(path: str | os.PathLike):
    """The parsed JSON of a file (an HF ``config.json``); ValueError naming the file if it is not
    valid JSON."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from None
