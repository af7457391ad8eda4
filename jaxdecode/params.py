"""Parameter pytrees, described once.

:func:`param_specs` lists every leaf by its HF ``Qwen3_5ForCausalLM`` checkpoint name with its
shape; :func:`init_params`, ``jaxdecode.checkpoint`` and ``jax.eval_shape`` all derive from it.
:func:`params_from_flat` / :func:`params_to_flat` map ``{hf_name: array}`` to the typed tree and
back in jaxdecode's layout, :func:`params_from_hf` / :func:`params_to_hf` in the checkpoint's
(:func:`checkpoint_specs`: a Qwen3-Next checkpoint fuses each DeltaNet layer's four input
projections into two tensors, :func:`split_fused` / :func:`fuse_split`).

Weights keep the PyTorch ``[out, in]`` layout. One change from the checkpoint: the C channels of
``in_proj_qkv`` and ``conv1d`` are grouped per key head (:func:`conv_channel_order`), so a
contiguous split of them (tensor parallelism) holds whole heads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.core import Tracer  # imported once: jax.core's module getattr is slow per lookup

from jaxdecode import memory, quantization
from jaxdecode.config import FULL_ATTENTION, QWEN3_NEXT, Config, model_dtype
from jaxdecode.quantization import Fp8Linear

Array = jax.Array

# Held float32 whatever the model dtype: the published checkpoints store them F32 and HF computes
# the decay (Qwen3_5GatedDeltaNet) and Qwen3_5RMSNormGated in float32.
FLOAT32_LEAVES = ("linear_attn.A_log", "linear_attn.norm.weight")


@struct.dataclass
class MLPParams:
    """HF ``Qwen3_5MLP``: down_proj(silu(gate_proj x) * up_proj x)."""
    gate_proj: Array  # [I, H]
    up_proj: Array  # [I, H]
    down_proj: Array  # [H, I]


@struct.dataclass
class MoEParams:
    """HF ``Qwen3_5MoeSparseMoeBlock``: a softmax top-k router over E experts, the experts as
    fused 3-D tensors (``Qwen3_5MoeExperts``), and a shared expert scaled by a sigmoid gate."""
    gate: Array  # [E, H] router (``mlp.gate.weight``)
    experts_gate_up_proj: Array  # [E, 2·I_e, H]: rows [0, I_e) gate, [I_e, 2·I_e) up
    experts_down_proj: Array  # [E, H, I_e]
    shared_expert: MLPParams  # I = I_s
    shared_expert_gate: Array  # [1, H]


@struct.dataclass
class GatedDeltaNetParams:
    """Gated DeltaNet mixer (HF ``Qwen3_5GatedDeltaNet``)."""
    in_proj_qkv: Array  # [C, H]  channels grouped per key head (conv_channel_order)
    in_proj_z: Array  # [Hv·dv, H]  output gate
    in_proj_b: Array  # [Hv, H]  beta = sigmoid(b)
    in_proj_a: Array  # [Hv, H]  decay input
    conv1d: Array  # [C, 1, Kc]  depthwise causal conv (grouped channels), w[..., Kc-1]: this token
    dt_bias: Array  # [Hv]
    A_log: Array  # [Hv] float32
    norm: Array  # [dv] float32, plain gain w (not 1 + w)
    out_proj: Array  # [H, Hv·dv]


@struct.dataclass
class AttentionParams:
    """Gated full attention (HF ``Qwen3_5Attention``)."""
    q_proj: Array  # [2·Hq·D, H]  per head: D query rows then D gate rows
    k_proj: Array  # [Hkv·D, H]
    v_proj: Array  # [Hkv·D, H]
    o_proj: Array  # [H, Hq·D]
    q_norm: Array  # [D]  (1 + w) RMSNorm
    k_norm: Array  # [D]  (1 + w) RMSNorm


@struct.dataclass
class DecoderLayerParams:
    """One pre-norm residual block; exactly one of linear_attn / self_attn is set."""
    input_layernorm: Array  # [H]  (1 + w)
    post_attention_layernorm: Array  # [H]  (1 + w)
    mlp: MLPParams | MoEParams  # MoEParams in config.moe_layers
    linear_attn: GatedDeltaNetParams | None = None
    self_attn: AttentionParams | None = None


@struct.dataclass
class MTPParams:
    """The multi-token-prediction layer (spec §6; vLLM ``Qwen3_5MultiTokenPredictor``): predicts
    the token after next from the main model's final hidden state and the next token's
    embedding. Embedding and LM head are the main model's."""
    fc: Array  # [H, 2H]: [embedding ; hidden] -> H (embedding first)
    pre_fc_norm_embedding: Array  # [H]  (1 + w)
    pre_fc_norm_hidden: Array  # [H]  (1 + w)
    layer: DecoderLayerParams  # one full-attention decoder layer (the MoE block in MoE models)
    norm: Array  # [H]  (1 + w)


@struct.dataclass
class Params:
    """All weights of a Qwen3.5 text decoder (HF module names; PyTorch ``[out, in]`` layout), in the
    model dtype (float32 or bfloat16) but ``A_log`` and the gated-norm weight (float32); the
    Linears of ``quantization.QUANTIZED_LEAVES`` may be block-FP8 :class:`Fp8Linear` instead.
    ``config`` is static pytree metadata (a jit specialises on it)."""
    embed_tokens: Array  # [V, H]
    layers: tuple[DecoderLayerParams, ...]
    norm: Array  # [H]  (1 + w)
    lm_head: Array | None  # [V, H], None when tie_word_embeddings (embed_tokens is used)
    config: Config = struct.field(pytree_node=False)
    mtp: MTPParams | None = None  # config.mtp_num_hidden_layers == 1

    @property
    def dtype(self):
        """The model dtype (of the embedding and every projection)."""
        return self.embed_tokens.dtype

    @property
    def lm_head_weight(self) -> Array:
        """[V, H] output projection (the embedding when tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter leaf: HF name, shape, and whether it is always float32."""
    name: str
    shape: tuple[int, ...]
    float32: bool = False


def param_specs(config: Config) -> dict[str, ParamSpec]:
    """``{name: ParamSpec}`` of every parameter, keyed by its ``Qwen3_5ForCausalLM`` checkpoint
    name, in a fixed order (embedding, final norm, LM head unless tied, then layer by layer; the
    MoE block in ``config.moe_layers``, the dense MLP elsewhere; then the MTP layer's ``mtp.*``
    when ``config.mtp_num_hidden_layers``, its block an MoE one in MoE models)."""
    c = config
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for layer, kind in enumerate(c.layer_types):
        _layer_shapes(c, shapes, f"model.layers.{layer}.", kind, layer in c.moe_layers)
    if c.mtp_num_hidden_layers:
        shapes["mtp.fc.weight"] = (h, 2 * h)
        shapes["mtp.pre_fc_norm_embedding.weight"] = (h,)
        shapes["mtp.pre_fc_norm_hidden.weight"] = (h,)
        _layer_shapes(c, shapes, "mtp.layers.0.", FULL_ATTENTION, c.num_experts > 0)
        shapes["mtp.norm.weight"] = (h,)
    return {name: ParamSpec(name, shape, name.endswith(FLOAT32_LEAVES))
            for name, shape in shapes.items()}


def _layer_shapes(c: Config, shapes: dict, p: str, kind: str, moe: bool) -> None:
    """Adds the checkpoint names and shapes of one decoder layer under prefix ``p``."""
    h, i, hq, hkv, d = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                        c.num_key_value_heads, c.head_dim)
    hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if moe:
        e, ie, i_s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        shapes[p + "mlp.gate.weight"] = (e, h)
        shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * ie, h)
        shapes[p + "mlp.experts.down_proj"] = (e, h, ie)
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (i_s, h)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (i_s, h)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (h, i_s)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    else:
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    if kind == FULL_ATTENTION:
        shapes[p + "self_attn.q_proj.weight"] = (2 * hq * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (hkv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (hkv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, hq * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    else:
        shapes[p + "linear_attn.in_proj_qkv.weight"] = (c.linear_conv_dim, h)
        shapes[p + "linear_attn.in_proj_z.weight"] = (hv * dv, h)
        shapes[p + "linear_attn.in_proj_b.weight"] = (hv, h)
        shapes[p + "linear_attn.in_proj_a.weight"] = (hv, h)
        shapes[p + "linear_attn.conv1d.weight"] = (c.linear_conv_dim, 1,
                                                   c.linear_conv_kernel_dim)
        shapes[p + "linear_attn.dt_bias"] = (hv,)
        shapes[p + "linear_attn.A_log"] = (hv,)
        shapes[p + "linear_attn.norm.weight"] = (dv,)
        shapes[p + "linear_attn.out_proj.weight"] = (h, hv * dv)


def leaf_dtype(spec: ParamSpec, dtype) -> jnp.dtype:
    """The dtype a leaf is held in when the model dtype is ``dtype``."""
    return jnp.dtype(jnp.float32) if spec.float32 else jnp.dtype(dtype)


def params_from_flat(config: Config, flat: dict[str, Any]) -> Params:
    """:class:`Params` from ``{hf_name: array}`` holding exactly :func:`param_specs` names
    (KeyError if one is missing; ``jaxdecode.checkpoint`` validates first)."""
    def w(name):
        return flat[name]

    layers = tuple(_layer(w, f"model.layers.{layer}.", kind, layer in config.moe_layers)
                   for layer, kind in enumerate(config.layer_types))
    mtp = None
    if config.mtp_num_hidden_layers:
        mtp = MTPParams(fc=w("mtp.fc.weight"),
                        pre_fc_norm_embedding=w("mtp.pre_fc_norm_embedding.weight"),
                        pre_fc_norm_hidden=w("mtp.pre_fc_norm_hidden.weight"),
                        layer=_layer(w, "mtp.layers.0.", FULL_ATTENTION, config.num_experts > 0),
                        norm=w("mtp.norm.weight"))
    return Params(embed_tokens=w("model.embed_tokens.weight"), layers=layers,
                  norm=w("model.norm.weight"),
                  lm_head=None if config.tie_word_embeddings else w("lm_head.weight"),
                  config=config, mtp=mtp)


def _layer(w: Callable[[str], Any], p: str, kind: str, moe: bool) -> DecoderLayerParams:
    """One decoder layer's params from ``w(checkpoint name)``, names under prefix ``p``."""
    if moe:
        m = p + "mlp."
        mlp = MoEParams(
            gate=w(m + "gate.weight"), experts_gate_up_proj=w(m + "experts.gate_up_proj"),
            experts_down_proj=w(m + "experts.down_proj"),
            shared_expert=MLPParams(gate_proj=w(m + "shared_expert.gate_proj.weight"),
                                    up_proj=w(m + "shared_expert.up_proj.weight"),
                                    down_proj=w(m + "shared_expert.down_proj.weight")),
            shared_expert_gate=w(m + "shared_expert_gate.weight"))
    else:
        mlp = MLPParams(gate_proj=w(p + "mlp.gate_proj.weight"),
                        up_proj=w(p + "mlp.up_proj.weight"),
                        down_proj=w(p + "mlp.down_proj.weight"))
    common = dict(input_layernorm=w(p + "input_layernorm.weight"),
                  post_attention_layernorm=w(p + "post_attention_layernorm.weight"), mlp=mlp)
    if kind == FULL_ATTENTION:
        a = p + "self_attn."
        return DecoderLayerParams(**common, self_attn=AttentionParams(
            q_proj=w(a + "q_proj.weight"), k_proj=w(a + "k_proj.weight"),
            v_proj=w(a + "v_proj.weight"), o_proj=w(a + "o_proj.weight"),
            q_norm=w(a + "q_norm.weight"), k_norm=w(a + "k_norm.weight")))
    a = p + "linear_attn."
    return DecoderLayerParams(**common, linear_attn=GatedDeltaNetParams(
        in_proj_qkv=w(a + "in_proj_qkv.weight"), in_proj_z=w(a + "in_proj_z.weight"),
        in_proj_b=w(a + "in_proj_b.weight"), in_proj_a=w(a + "in_proj_a.weight"),
        conv1d=w(a + "conv1d.weight"), dt_bias=w(a + "dt_bias"), A_log=w(a + "A_log"),
        norm=w(a + "norm.weight"), out_proj=w(a + "out_proj.weight")))


def params_to_flat(params: Params) -> dict[str, Array]:
    """Inverse of :func:`params_from_flat`: ``{hf_name: array}`` in :func:`param_specs` order, in
    jaxdecode's layout (conv channels grouped per key head)."""
    tree = params_from_flat(params.config, {name: name for name in param_specs(params.config)})
    return dict(zip(jax.tree.leaves(tree), _weights(params)))


def _weights(params: Params) -> list:
    """The leaves of ``params``, an :class:`Fp8Linear` counted as one."""
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Linear))


def params_to_hf(params: Params) -> dict[str, Array]:
    """``{hf_name: array}`` in the checkpoint (HF) layout, :func:`checkpoint_specs` names and
    shapes: the HF model's ``state_dict`` (MoE experts as fused 3-D tensors; Qwen3-Next's fused
    ``in_proj_qkvz`` / ``in_proj_ba``), so ``load_checkpoint`` of these tensors (or
    :func:`params_from_hf`) gives ``params`` back. ValueError for FP8 params (dequantise
    them first)."""
    if any(isinstance(x, Fp8Linear) for x in _weights(params)):
        raise ValueError("params_to_hf takes params in their model dtype; these hold FP8 "
                         "Linears (jd.Fp8Linear): dequantise them first")
    return fuse_split(params.config, {name: internal_to_hf(params.config, name, x)
                                      for name, x in params_to_flat(params).items()})


def params_from_hf(config: Config, flat: dict[str, Any]) -> Params:
    """:class:`Params` from ``{hf_name: array}`` in the checkpoint (HF) layout (e.g. a
    transformers ``state_dict`` converted to arrays); inverse of :func:`params_to_hf`. No shape
    checks: ``jaxdecode.load_checkpoint`` validates files."""
    return params_from_flat(config, {leaf: hf_to_internal(config, leaf, part)
                                     for name, x in flat.items()
                                     for leaf, part in split_fused(config, name, x).items()})


# Qwen3-Next checkpoint leaf -> the two split (Qwen3.5) leaves whose rows it holds.
FUSED_PROJECTIONS = {
    "linear_attn.in_proj_qkvz.weight": ("linear_attn.in_proj_qkv.weight",
                                        "linear_attn.in_proj_z.weight"),
    "linear_attn.in_proj_ba.weight": ("linear_attn.in_proj_b.weight",
                                      "linear_attn.in_proj_a.weight"),
}


def checkpoint_specs(config: Config) -> dict[str, ParamSpec]:
    """``{name: ParamSpec}`` of the tensors an HF checkpoint of ``config`` holds: those of
    :func:`param_specs`, but for Qwen3-Next (HF ``Qwen3NextGatedDeltaNet``) each DeltaNet layer's
    ``in_proj_qkvz`` [2·Ck + 2·Cv, H] and ``in_proj_ba`` [2·Hv, H] in place of the four split
    projections (same position in the order)."""
    specs = param_specs(config)
    if config.model_type != QWEN3_NEXT:
        return specs
    first = {parts[0]: (fused, parts) for fused, parts in FUSED_PROJECTIONS.items()}
    second = tuple(parts[1] for parts in FUSED_PROJECTIONS.values())
    out = {}
    for name, spec in specs.items():
        suffix = next((s for s in first if name.endswith(s)), None)
        if suffix is not None:
            prefix, (fused, parts) = name[:-len(suffix)], first[suffix]
            rows = sum(specs[prefix + part].shape[0] for part in parts)
            out[prefix + fused] = ParamSpec(prefix + fused, (rows, config.hidden_size))
        elif not name.endswith(second):
            out[name] = spec
    return out


def fused_rows(config: Config, fused: str) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a Qwen3-Next fused projection (name ending in a :data:`FUSED_PROJECTIONS`
    key) that hold its two split tensors, each in the split (Qwen3.5 checkpoint) row order.

    HF ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`` reads the fused rows per key head
    i as ``[q_i (dk) | k_i (dk) | v (r·dv) | z (r·dv)]`` and ``[b (r) | a (r)]``, the v, z, b, a
    of value heads i·r .. i·r+r-1; the split layout is ``in_proj_qkv`` = ``[q (Hk·dk) | k (Hk·dk)
    | v (Hv·dv)]``, ``in_proj_z`` (Hv·dv), ``in_proj_b`` and ``in_proj_a`` (Hv), head-major. So
    the conversion is a pure row permutation (spec §1.5)."""
    c = config
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads_per_key_head
    if fused.endswith("in_proj_qkvz.weight"):
        start = (2 * dk + 2 * r * dv) * np.arange(hk)[:, None]  # [Hk, 1] first row of head i
        q, k = start + np.arange(dk), start + dk + np.arange(dk)
        v = start + 2 * dk + np.arange(r * dv)
        z = start + 2 * dk + r * dv + np.arange(r * dv)
        return np.concatenate([q.ravel(), k.ravel(), v.ravel()]), z.ravel()
    start = 2 * r * np.arange(hk)[:, None]
    return (start + np.arange(r)).ravel(), (start + r + np.arange(r)).ravel()


def split_fused(config: Config, name: str, x) -> dict[str, Any]:
    """One checkpoint tensor as ``{param_specs name: array}`` in the split HF layout: a Qwen3-Next
    fused projection [rows, H] becomes its two parts (:func:`fused_rows`), any other tensor is
    ``{name: x}``. numpy or jax arrays."""
    suffix = next((s for s in FUSED_PROJECTIONS if name.endswith(s)), None)
    if config.model_type != QWEN3_NEXT or suffix is None:
        return {name: x}
    prefix = name[:-len(suffix)]
    return {prefix + part: x[rows]
            for part, rows in zip(FUSED_PROJECTIONS[suffix], fused_rows(config, name))}


def fuse_split(config: Config, flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`split_fused` over a whole ``{param_specs name: array}`` dict (HF layout):
    for Qwen3-Next each layer's split DeltaNet projections joined into the fused ones (jax
    arrays), in :func:`checkpoint_specs` order; other configs' dicts unchanged."""
    if config.model_type != QWEN3_NEXT:
        return flat
    out = {}
    for name in checkpoint_specs(config):
        suffix = next((s for s in FUSED_PROJECTIONS if name.endswith(s)), None)
        if suffix is None:
            out[name] = flat[name]
            continue
        prefix = name[:-len(suffix)]
        parts = [flat[prefix + part] for part in FUSED_PROJECTIONS[suffix]]
        out[name] = jnp.concatenate(parts)[np.argsort(np.concatenate(fused_rows(config, name)))]
    return out


# The leaves whose axis 0 runs over the C conv channels.
CONV_CHANNEL_LEAVES = ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")


def conv_channel_order(config: Config) -> np.ndarray:
    """Internal order of the C conv channels, as indices into HF's ``[q (Hk·dk) | k (Hk·dk) |
    v (Hv·dv)]``: grouped per key head, ``[q_i (dk) | k_i (dk) | v_{i·r} .. v_{i·r+r-1}]``
    for i = 0 .. Hk-1 (the value heads of key head i, as HF's ``repeat_interleave``; Qwen3-Next's
    ``in_proj_qkvz`` grouping). The depthwise conv is unchanged, but a contiguous split of C over
    m devices (m dividing Hk) holds whole heads, so tensor parallelism moves no conv activations.
    """
    hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r, ck = config.linear_num_value_heads_per_key_head, config.linear_key_dim
    order = []
    for i in range(hk):
        order += range(i * dk, (i + 1) * dk)
        order += range(ck + i * dk, ck + (i + 1) * dk)
        order += range(2 * ck + i * r * dv, 2 * ck + (i + 1) * r * dv)
    return np.asarray(order)


def hf_to_internal(config: Config, name: str, x):
    """One checkpoint tensor (HF layout) -> jaxdecode's layout (numpy or jax array)."""
    return x[conv_channel_order(config)] if name.endswith(CONV_CHANNEL_LEAVES) else x


def internal_to_hf(config: Config, name: str, x):
    """Inverse of :func:`hf_to_internal`."""
    if name.endswith(CONV_CHANNEL_LEAVES):
        return x[np.argsort(conv_channel_order(config))]
    return x


def init_leaf(spec: ParamSpec, key: Array, dtype, config: Config) -> Array:
    """HF-like initial values (``Qwen3_5PreTrainedModel._init_weights``), with small random
    perturbations of the norm weights so no quirk of the model hides behind a constant."""
    name, shape = spec.name, spec.shape
    dt = leaf_dtype(spec, dtype)
    if name.endswith("A_log"):  # A ~ U(0, 16), A_log = log A  (HF init)
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dt)
    if name.endswith("dt_bias"):
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if name.endswith("linear_attn.norm.weight"):  # plain gain around 1
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):  # (1 + w): w around 0
        return (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if name.endswith("conv1d.weight"):  # PyTorch Conv1d default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(config.linear_conv_kernel_dim)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dt)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dt)  # initializer_range


def params_bytes(config: Config, dtype, fp8_leaves=frozenset(),
                 block_size=quantization.DEFAULT_BLOCK,
                 shard_shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None
                 ) -> int:
    """Bytes of the :class:`Params` of ``config`` in model ``dtype`` on one device: every
    :func:`param_specs` leaf in its :func:`leaf_dtype`, those named in ``fp8_leaves`` as block
    FP8 (one byte a value plus a float32 scale a ``block_size`` block). ``shard_shape(name,
    shape)``: the part of each leaf one device holds (``sharding.params_shard_bytes``; whole
    scale blocks), default the whole leaf."""
    dtype, total = model_dtype(dtype), 0
    for name, spec in param_specs(config).items():
        shape = shard_shape(name, spec.shape) if shard_shape else spec.shape
        if name in fp8_leaves:
            total += math.prod(shape) + 4 * math.prod(quantization.scale_shape(shape, block_size))
        else:
            total += math.prod(shape) * leaf_dtype(spec, dtype).itemsize
    return total


def init_params(config: Config, key: Array, dtype="float32") -> Params:
    """Random :class:`Params` of the real shapes (tests, demos, benchmarks). Leaf ``n`` (in
    :func:`param_specs` order) uses ``fold_in(key, n)`` (under jit ~1 ulp from the eager value).
    ``dtype``: "float32" or "bfloat16" (else ValueError); ``A_log`` and the gated-norm weight stay
    float32. ``jax.eval_shape`` of it gives shapes without allocating. ValueError: ``key`` not
    one PRNG key (:func:`check_key`); weights larger than the default device's free memory
    (``memory.check_fits``; a CPU device: the host's), before any is created."""
    check_key(key)
    dtype = model_dtype(dtype)
    if not isinstance(key, Tracer):  # (jax.eval_shape allocates nothing)
        memory.check_fits(f"init_params' weights ({dtype.name})", params_bytes(config, dtype),
                          advice="use a mesh, or FP8 weights: sharding.init_params_sharded("
                          "config, mesh, key, quantize='fp8') (a (1, 1) mesh for one device)")
    specs = param_specs(config)
    flat = {name: init_leaf(spec, jax.random.fold_in(key, n), dtype, config)
            for n, (name, spec) in enumerate(specs.items())}
    return params_from_flat(config, flat)


def check_params(params) -> None:
    """Raises ValueError unless ``params`` is a :class:`Params` (``jd.load_checkpoint`` or
    ``jd.init_params``)."""
    if not isinstance(params, Params):
        raise ValueError(f"params must be jaxdecode.Params (jd.load_checkpoint or "
                         f"jd.init_params); got {type(params).__name__}")


def traced(*trees) -> bool:
    """Whether any leaf of ``trees`` (params, a state, keys, sampling parameters) is a JAX tracer:
    the call is being traced by ``jax.jit``, ``grad`` or ``vmap``."""
    return any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(trees))


def check_not_traced(entry: str, inside: str, *trees) -> None:
    """Raises ValueError where a leaf of ``trees`` is traced (:func:`traced`): ``entry`` plans on
    the host (lists, buckets, memory) and runs its own jitted calls; ``inside`` names what to use
    inside a ``jit`` instead."""
    if traced(*trees):
        raise ValueError(f"{entry} runs from the host and cannot be traced (jax.jit, grad, vmap); "
                         f"inside your own jit use {inside}")


def check_key(key) -> None:
    """Raises ValueError unless ``key`` is one PRNG key: ``jax.random.key(seed)``, or a legacy
    ``jax.random.PRNGKey(seed)`` (uint32 of the default implementation's key shape: [2] for
    threefry); a bare int seed is not one."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32 and shape == jax.eval_shape(
        lambda: jax.random.key_data(jax.random.key(0))).shape  # (abstract: no device work)
    if not ((typed and shape == ()) or raw):
        got = type(key).__name__ if dtype is None else f"{type(key).__name__} {dtype}{list(shape)}"
        raise ValueError(f"key must be one PRNG key (jax.random.key(seed)); got {got}")


def num_params(params: Params) -> int:
    """Total number of parameter values (a tied LM head counted once; FP8 scales not counted)."""
    return sum(int(np.prod(x.shape)) for x in _weights(params))


def quantize_fp8(params: Params, block_size=quantization.DEFAULT_BLOCK) -> Params:
    """``params`` with the Linears the FP8 releases quantise (``quantization.QUANTIZED_LEAVES``)
    as block-FP8 :class:`Fp8Linear` (``quantization.quantize``; the MoE routed experts as
    stacks, each expert's [2·I, H] and [H, I] in its own blocks), the rest unchanged. Already
    quantised leaves are kept. ValueError: ``params`` not :class:`Params`; ``block_size`` not two
    positive ints."""
    check_params(params)
    block_size = quantization.check_block_size(block_size)
    flat = params_to_flat(params)
    for name, x in flat.items():
        if quantization.is_quantized_leaf(name) and not isinstance(x, Fp8Linear):
            flat[name] = Fp8Linear(*quantization.quantize(x, block_size), block_size=block_size)
    return params_from_flat(params.config, flat)
