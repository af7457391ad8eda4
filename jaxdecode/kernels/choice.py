"""Which kernels a decode step runs: one frozen value, chosen once on the host.

    kernels = choose_kernels(config, batch_size, dtype="bfloat16")     # or mesh=mesh
    logits, state = jd.decode_step(params, state, tokens, kernels=kernels)

:class:`Kernels` is a jit static; :func:`choose_kernels` is the one place that decides (its
thresholds' numbers: ``benchmarks/RESULTS.md``). :func:`decode_attention` and
:func:`deltanet_decode` are the model's call sites: they run what the value says, per device
under ``jax.shard_map`` on a mesh (the SPMD partitioner cannot split a Pallas custom call).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdecode import experts, invariance, quantization
from jaxdecode.config import Config
from jaxdecode.gated_delta import naive_gated_delta_rule
from jaxdecode.kernels import chunk_gated_delta as chunk_rule_kernel
from jaxdecode.kernels import decode_attention as attention_kernel
from jaxdecode.kernels import deltanet_decode as deltanet_kernel
from jaxdecode.kernels import fp8_linear as fp8_kernel
from jaxdecode.kernels import gated_delta_decode as delta_rule_kernel
from jaxdecode.kernels import prefill_attention as prefill_kernel

DATA, MODEL = "data", "model"  # the mesh axes: rows, and heads/features (jaxdecode.sharding)
CHOICES = ("pallas", "xla")

# The one-kernel DeltaNet core below this many rows per device: it replaces about six small XLA
# kernels per layer, which dominate small batches; from 4 rows XLA's form is as fast (RESULTS.md).
DELTANET_CORE_MAX_BATCH = 4
# The one-pass delta-rule kernel from this many rows per device: below it XLA fuses the update
# into its neighbours and the whole step is faster (benchmarks/RESULTS.md).
DELTA_RULE_MIN_BATCH = 8


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation of each decode-step op, "pallas" or "xla" (frozen, hashable: a jit
    static). ValueError for another value, ``deltanet="pallas"`` with a mesh, and
    ``fp8_linear="pallas"`` with ``batch_invariant``."""
    attention: str = "xla"  # split-K decode attention kernel, or decode_attention_reference
    deltanet: str = "xla"  # the one-token DeltaNet core in one kernel, or XLA then delta_rule
    delta_rule: str = "xla"  # with deltanet="xla": the one-pass delta-rule kernel, or XLA
    prefill_attention: str = "xla"  # the flash prefill attention kernel, or its reference
    prefill_delta_rule: str = "xla"  # the chunked delta rule's recurrence in one kernel, or XLA
    fp8_linear: str = "xla"  # block-FP8 Linears of up to 64 rows: the kernel, or dequantise + dot
    # a speculative verify step's delta rule over a few tokens keeping every state: one kernel
    # (the state read once), or XLA's unrolled token-by-token form
    verify_delta_rule: str = "xla"
    # attention of a few queries per row (T·G <= 64: a verify step's k + 1 tokens, an MTP
    # draft's one): the decode-attention kernel with T queries (the cache read once, no
    # 128-query tile), or the prefill attention as ``prefill_attention`` says
    verify_attention: str = "xla"
    interpret: bool | None = None  # Mosaic GPU interpreter (CPU); None: when not on a GPU
    # (read when a step is traced, not at construction: importing jaxdecode must not start
    # the backend, or jax.distributed.initialize could no longer run)
    mesh: Mesh | None = None  # a ("data", "model") mesh: Pallas kernels run under shard_map
    # A row's logits and state bitwise independent of the rest of the batch (for one max_len,
    # on a GPU with the Pallas kernels): prefill row by row in fixed chunks; decode ops in fixed
    # 64-row groups (jaxdecode.invariance), the state ops per row or in kernels with one row's
    # tiling (measured: benchmarks/RESULTS.md)
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("attention", "deltanet", "delta_rule", "prefill_attention",
                     "prefill_delta_rule", "fp8_linear", "verify_delta_rule",
                     "verify_attention"):
            if getattr(self, name) not in CHOICES:
                raise ValueError(f"Kernels.{name}={getattr(self, name)!r} must be one of "
                                 f"{CHOICES}")
        if self.mesh is not None and self.deltanet == "pallas":
            raise ValueError("Kernels(deltanet='pallas') does not run on a mesh; use 'xla' "
                             "(with delta_rule='pallas' for the per-device delta-rule kernel)")
        if self.mesh is not None and self.batch_invariant:
            raise ValueError("Kernels(batch_invariant=True) does not run on a mesh yet")
        if self.verify_attention == "pallas" and self.batch_invariant:
            raise ValueError("Kernels(verify_attention='pallas') is not batch-invariant (its "
                             "split count follows the batch); leave it 'xla' with "
                             "batch_invariant")
        if self.fp8_linear == "pallas" and self.batch_invariant:
            raise ValueError("Kernels(fp8_linear='pallas') does not run with batch_invariant "
                             "(its row independence is untested)")


XLA = Kernels()  # every op in XLA: the reference path, any backend


def device_rows(batch_size: int, mesh: Mesh | None) -> int:
    """The rows of a batch one device holds: ``batch_size / "data"``, or every row where they do
    not divide "data" (then whole on each data group: :func:`_on_mesh`,
    ``sharding.constrain_state``)."""
    data = 1 if mesh is None else mesh.shape[DATA]
    return batch_size if batch_size % data else batch_size // data


def row_specs(specs, rows: int, mesh: Mesh | None):
    """A tree of ``PartitionSpec`` for arrays of ``rows`` rows on ``mesh``: as given where the
    rows divide "data", with "data" dropped where they do not (the rows then whole on each data
    group, :func:`device_rows`). Used for the kernels' ``shard_map`` specs (:func:`_on_mesh`)
    and the state's layout (``sharding.constrain_state``), so the two agree."""
    if mesh is None or rows % mesh.shape[DATA] == 0:
        return specs
    return jax.tree.map(lambda s: P(*(None if a == DATA else a for a in s)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def check_kernels(kernels) -> None:
    """ValueError unless ``kernels`` (a public call's argument) is a :class:`Kernels` or None."""
    if kernels is not None and not isinstance(kernels, Kernels):
        raise ValueError(f"kernels={kernels!r} must be a jaxdecode.Kernels (or None: "
                         "choose_kernels)")


def resolve_kernels(kernels: Kernels | None, config: Config, batch_size: int, dtype,
                    mesh: Mesh | None) -> Kernels:
    """The kernels a call of ``batch_size`` rows runs with params on ``mesh``:
    ``choose_kernels(config, batch_size, dtype=dtype, mesh=mesh)`` for ``kernels`` None, else
    :func:`for_mesh` (ValueError as there)."""
    if kernels is None:
        return choose_kernels(config, batch_size, dtype=dtype, mesh=mesh)
    return for_mesh(kernels, mesh)


def for_mesh(kernels: Kernels, mesh: Mesh | None) -> Kernels:
    """``kernels`` for a call whose params are on ``mesh`` (None: one device): its own mesh set
    where it has none (``jd.Kernels()`` passed for sharded params: XLA's forms on their mesh;
    the mesh is how a step lays out the state it creates). ValueError: ``kernels`` of another
    mesh, of a mesh for params on one device, or that cannot run on a mesh (:class:`Kernels`)."""
    if kernels.mesh == mesh:
        return kernels
    if kernels.mesh is None:
        try:
            return dataclasses.replace(kernels, mesh=mesh)
        except ValueError as e:  # Kernels' own message, which does not say why a mesh
            raise ValueError(f"the params are on a mesh ({mesh}), so the kernels run on it: "
                             f"{e}") from None
    raise ValueError(f"kernels.mesh is {kernels.mesh} but the params are on "
                     f"{'one device' if mesh is None else mesh}: pass kernels for the params' "
                     "mesh (choose_kernels(..., mesh=...)), or kernels without one")


# The Pallas kernels behind a jit of their own: the layers of a step call each with the same
# shapes, and JAX lowers a jitted function once per signature instead of once per layer.
_attention_pallas = jax.jit(attention_kernel.decode_attention_pallas,
                            static_argnames=("config", "batch_invariant", "interpret"))
_deltanet_pallas = jax.jit(deltanet_kernel.deltanet_decode_pallas,
                           static_argnames=("num_key_heads", "block_v", "interpret"))
_delta_rule_pallas = jax.jit(delta_rule_kernel.gated_delta_decode_pallas,
                             static_argnames=("block_v", "interpret"))
_delta_states_pallas = jax.jit(delta_rule_kernel.gated_delta_states_pallas,
                               static_argnames=("block_v", "interpret"))
_prefill_attention_pallas = jax.jit(prefill_kernel.prefill_attention_pallas,
                                    static_argnames=("config", "interpret"))
_prefill_delta_rule_pallas = jax.jit(chunk_rule_kernel.chunk_gated_delta_rule_pallas,
                                     static_argnames=("interpret",))
_fp8_linears_pallas = jax.jit(fp8_kernel.fp8_linears_pallas,
                              static_argnames=("block_size", "config", "interpret"))


def _compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU ((0, 0) if it does not say), None for other devices."""
    if device.platform != "gpu":
        return None
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return 0, 0


@functools.cache
def choose_kernels(config: Config, batch_size: int, *, dtype="bfloat16",
                   mesh: Mesh | None = None, batch_invariant: bool = False) -> Kernels:
    """The kernels a decode step of ``batch_size`` rows runs on this machine.

    Pallas kernels only on NVIDIA Hopper (compute capability 9.0+); elsewhere all XLA. On a
    GPU, a shape or dtype a kernel does not take falls back to XLA with one warning saying why.
    With a mesh, shapes and batch are per device (rows over "data", heads over "model").
    ``batch_invariant``: one choice for every batch size (the attention kernels and the
    one-kernel DeltaNet core), with ``Kernels.batch_invariant`` set (what it guarantees: its
    field comment); not on a mesh. The FP8 linear kernel (per device on a mesh): not
    batch-invariant, 16-bit models; it applies to ``Fp8Linear`` weights only, so a bf16 model
    is unaffected; a call it does not take (:func:`fp8_linear`) runs XLA's form without a
    warning. ValueError: ``batch_size`` not a positive int.
    """
    if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
            or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    cc = _compute_capability(device)
    if cc is None or cc < (9, 0):
        if cc is not None:
            warnings.warn(f"jaxdecode: the GPU ({device.device_kind}, compute capability "
                          f"{cc[0]}.{cc[1]}) is older than Hopper; decoding with XLA only",
                          stacklevel=2)
        return Kernels(mesh=mesh, interpret=False, batch_invariant=batch_invariant)
    c, dtype = config, jnp.dtype(dtype)
    heads = mesh.shape[MODEL] if mesh is not None else 1
    rows = 1 if batch_invariant else device_rows(batch_size, mesh)  # invariant: one row's tiling
    hq, hkv = c.num_attention_heads // heads, c.num_key_value_heads // heads
    hk, hv = c.linear_num_key_heads // heads, c.linear_num_value_heads // heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim

    def supported(op: str, why: str | None) -> bool:
        if why is not None:
            warnings.warn(f"jaxdecode: {op} runs in XLA instead of its Pallas kernel: {why}",
                          stacklevel=3)
        return why is None

    attention = supported("decode attention", attention_kernel.check_supported(
        (rows, hq, c.head_dim), (rows, hkv, 64, c.head_dim), dtype))
    core = (mesh is None and (batch_invariant or rows < DELTANET_CORE_MAX_BATCH)
            and supported("the Gated DeltaNet core", deltanet_kernel.check_supported(
                (rows, hv, dk, dv), c.linear_conv_kernel_dim, dtype)))
    rule_why = delta_rule_kernel.check_supported((rows, hk, dk), (rows, hv, dk, dv))
    rule = not core and (batch_invariant or rows >= DELTA_RULE_MIN_BATCH) and supported(
        "the gated delta rule", rule_why)
    verify_rule = rule_why is None and not batch_invariant
    verify_attention = attention and not batch_invariant
    prefill = supported("prefill attention", prefill_kernel.check_supported(
        (rows, 1, hq, c.head_dim), (rows, hkv, 64, c.head_dim), dtype))
    chunk_rule = supported("the prefill's delta rule", chunk_rule_kernel.check_supported(
        (rows, 1, hv, dk), (rows, 1, hv, dv), dtype))
    fp8 = not batch_invariant and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    pick = lambda use: "pallas" if use else "xla"  # noqa: E731
    return Kernels(attention=pick(attention), deltanet=pick(core), delta_rule=pick(rule),
                   prefill_attention=pick(prefill), prefill_delta_rule=pick(chunk_rule),
                   fp8_linear=pick(fp8), verify_delta_rule=pick(verify_rule),
                   verify_attention=pick(verify_attention), interpret=False, mesh=mesh,
                   batch_invariant=batch_invariant)


def _interpret(kernels: Kernels) -> bool:
    if kernels.interpret is None:
        return jax.default_backend() != "gpu"
    return kernels.interpret


def _on_mesh(kernels: Kernels, fn, in_specs, out_specs):
    """``fn`` as it is off a mesh; on ``kernels.mesh``, ``fn`` under ``jax.shard_map`` with these
    specs (each device runs it on its shards: the partitioner cannot split a Pallas call). Every
    caller's first argument has the rows first: rows that do not divide "data" run whole on each
    data group ("data" dropped from the specs; the state's layout then,
    ``sharding.constrain_state``)."""
    if kernels.mesh is None:
        return fn

    def call(*args):
        specs = row_specs((in_specs, out_specs), args[0].shape[0], kernels.mesh)
        return jax.shard_map(fn, mesh=kernels.mesh, in_specs=specs[0], out_specs=specs[1],
                             check_vma=False)(*args)
    return call


def decode_attention(kernels: Kernels, q, k_cache, v_cache, kv_len):
    """GQA decode attention as ``kernels.attention`` says: q [B, Hq, D], caches [B, Hkv, S, D],
    kv_len [B] int32 valid keys per row. Returns [B, Hq, D] in q's dtype. ``batch_invariant``:
    XLA's one row at a time, the kernel with one row's split count and a fixed-group merge."""
    if kernels.attention == "xla" and kernels.batch_invariant:
        return invariance.map_rows(
            lambda _, *row: attention_kernel.decode_attention_reference(*row), None,
            q, k_cache, v_cache, kv_len)
    if kernels.attention == "xla":
        return attention_kernel.decode_attention_reference(q, k_cache, v_cache, kv_len)
    config = None
    if kernels.batch_invariant:
        config = attention_kernel.choose_config(1, k_cache.shape[1], k_cache.shape[2],
                                                k_cache.shape[3], k_cache.dtype)
    attend = functools.partial(_attention_pallas, config=config,
                               batch_invariant=kernels.batch_invariant,
                               interpret=_interpret(kernels))
    heads, cache = P(DATA, MODEL, None), P(DATA, MODEL, None, None)
    return _on_mesh(kernels, attend, (heads, cache, cache, P(DATA)), heads)(
        q, k_cache, v_cache, kv_len)


def prefill_attention(kernels: Kernels, q, k_cache, v_cache, start, num_new, *,
                      query_block: int = 512):
    """Causal prefill attention as ``kernels.prefill_attention`` says: q [B, T, Hq, D], caches
    [B, Hkv, S, D] (the new keys written), start/num_new [B] int32 (``prefill_attention``'s
    module docstring); ``query_block``: the reference's. Returns [B, T, Hq, D]. A few queries
    (``kernels.verify_attention``, T·G <= 64): the decode-attention kernel with T queries
    (query t at ``start + t``, keys up to ``start + num_new``; a padding query's output is
    don't-care either way)."""
    interpret = _interpret(kernels)
    if (kernels.verify_attention == "pallas"
            and attention_kernel.check_supported(q.shape, k_cache.shape, k_cache.dtype) is None):
        def attend(q, k_cache, v_cache, start, num_new):
            return _attention_pallas(q, k_cache, v_cache, start + num_new, start,
                                     interpret=interpret)
    elif kernels.prefill_attention == "xla":
        return prefill_kernel.prefill_attention_reference(q, k_cache, v_cache, start, num_new,
                                                          query_block=query_block)
    else:
        attend = functools.partial(_prefill_attention_pallas, interpret=interpret)
    heads, cache = P(DATA, None, MODEL, None), P(DATA, MODEL, None, None)
    return _on_mesh(kernels, attend, (heads, cache, cache, P(DATA), P(DATA)), heads)(
        q, k_cache, v_cache, start, num_new)


def fp8_linear(kernels: Kernels, x, w, *, out_dtype=None, row_parallel: bool = False):
    """``x @ W.T`` for a block-FP8 ``w`` (``quantization.Fp8Linear``), x [..., K] -> [..., N].
    ``kernels.fp8_linear == "pallas"``: the kernel when it takes the call (up to 64 rows in all
    per device, a decode step's; ``fp8_linear.check_supported``) and the result is in x's dtype;
    otherwise the weight dequantised to x's dtype, then XLA's dot (more rows, a prefill's
    usually: one 16-bit copy of the weight per call). Both use the same dequantised weight;
    their results can differ by a rounding of x's dtype (another accumulation order).
    Reverse-mode differentiable either way, the FP8 weight frozen (``Fp8Linear.dequantize``).

    On a mesh the kernel runs per device under ``shard_map``: column-parallel (w's rows split
    over "model", x's rows over "data") or, ``row_parallel``, w's columns and x's K split over
    "model" and the partial products summed (one psum in x's dtype, the all-reduce the
    partitioner puts after a 16-bit row-parallel dot)."""
    if not row_parallel:
        return fp8_linears(kernels, x, (w,), out_dtype=out_dtype)[0]
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    model = 1 if kernels.mesh is None else kernels.mesh.shape[MODEL]
    if _takes_kernel(kernels, x, w, out_dtype, (device_rows(rows, kernels.mesh), k // model),
                     (w.shape[0], k // model)):
        block, interpret = w.block_size, _interpret(kernels)

        def kernel(x, weight, scale_inv):
            y = _fp8_linears_kernel(x, (weight,), (scale_inv,), block, interpret)[0]
            return jax.lax.psum(y, MODEL) if model > 1 else y
        y = _on_mesh(kernels, kernel, (P(DATA, MODEL), P(None, MODEL), P(None, MODEL)),
                     P(DATA, None))(x.reshape(rows, k), w.weight, w.scale_inv)
        return y.reshape(*lead, w.shape[0])
    return _fp8_dot(x, w, out_dtype)


def fp8_linears(kernels: Kernels, x, ws, *, out_dtype=None) -> tuple:
    """:func:`fp8_linear` of each column-parallel block-FP8 ``w`` in ``ws`` on the same x (e.g. a
    layer's ``gate_proj`` and ``up_proj``), the ones the kernel takes in one launch
    (``fp8_linear.fp8_linears_pallas``: one launch's fixed costs, one pad of x and one sum of
    partials instead of one each), the others in XLA's form. The same values as one
    :func:`fp8_linear` each. Returns a tuple of [..., N_i]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    model = 1 if kernels.mesh is None else kernels.mesh.shape[MODEL]
    x_local = (device_rows(rows, kernels.mesh), k)
    out = [None if _takes_kernel(kernels, x, w, out_dtype, x_local, (w.shape[0] // model, k))
           else _fp8_dot(x, w, out_dtype) for w in ws]
    taken = [i for i, y in enumerate(out) if y is None]
    if taken:
        block, interpret = ws[taken[0]].block_size, _interpret(kernels)

        def kernel(x, weights, scale_invs):
            return _fp8_linears_kernel(x, weights, scale_invs, block, interpret)
        column = tuple(P(MODEL, None) for _ in taken)
        ys = _on_mesh(kernels, kernel, (P(DATA, None), column, column),
                      tuple(P(DATA, MODEL) for _ in taken))(
            x.reshape(rows, k), tuple(ws[i].weight for i in taken),
            tuple(ws[i].scale_inv for i in taken))
        for i, y in zip(taken, ys):
            out[i] = y.reshape(*lead, ws[i].shape[0])
    return tuple(out)


def _takes_kernel(kernels: Kernels, x, w, out_dtype, x_local, w_local) -> bool:
    """Whether the FP8 kernel runs this Linear: chosen, in x's dtype, and w's per-device shape
    ``w_local`` one the kernel takes beside x's (``x_local``)."""
    return (kernels.fp8_linear == "pallas" and out_dtype in (None, x.dtype)
            and fp8_kernel.check_supported(x_local, w_local, x.dtype, w.weight.dtype,
                                           w.block_size) is None)


def _fp8_dot(x, w, out_dtype):
    """XLA's form: the weight dequantised to x's dtype, then the dot."""
    # the 16-bit copy made when this call runs; the dot reads the barrier's x too (with the
    # original x a little more stays alive)
    x, w = quantization.tie_to_input(x, w)
    return jnp.einsum("...i,oi->...o", x, w.dequantize(x.dtype), preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_linears_kernel(x, weights, scale_invs, block_size, interpret):
    """The kernel with a VJP: x's cotangent through the dequantised weights (XLA), none into the
    frozen FP8 weights and their scales."""
    return _fp8_linears_pallas(x, weights, scale_invs, block_size, interpret=interpret)


def _fp8_linears_kernel_fwd(x, weights, scale_invs, block_size, interpret):
    return (_fp8_linears_kernel(x, weights, scale_invs, block_size, interpret),
            (weights, scale_invs))


def _fp8_linears_kernel_bwd(block_size, interpret, residuals, gs):
    weights, scale_invs = residuals
    # each weight's part rounded to g's dtype, then added: what XLA's form, one dot each, gives
    dx = sum(jnp.einsum("mn,nk->mk", g, quantization.dequantize(w, s, block_size, g.dtype),
                        preferred_element_type=jnp.float32).astype(g.dtype)
             for g, w, s in zip(gs, weights, scale_invs))
    return dx, tuple(map(jnp.zeros_like, weights)), tuple(map(jnp.zeros_like, scale_invs))


_fp8_linears_kernel.defvjp(_fp8_linears_kernel_fwd, _fp8_linears_kernel_bwd)


def top_k(kernels: Kernels, x, k: int):
    """``jax.lax.top_k`` over x [N, E]'s last axis (the MoE router), per "data" shard on a
    mesh: the SPMD partitioner all-gathers a row-sharded operand of TopK (one collective per
    layer)."""
    if kernels.mesh is None or x.shape[0] % kernels.mesh.shape[DATA]:
        return jax.lax.top_k(x, k)
    rows = P(DATA, None)
    return _on_mesh(kernels, lambda x: tuple(jax.lax.top_k(x, k)), rows, (rows, rows))(x)


def routed_experts(kernels: Kernels, x, weights, chosen, gate_up_proj, down_proj):
    """The MoE block's routed experts (``experts.routed_experts``: x [N, H], weights/chosen
    [N, k], gate_up_proj [E, 2·I, H], down_proj [E, H, I]; returns [N, H] in x's dtype).

    On a mesh, expert parallel: each "model" device holds E/m consecutive experts
    (``sharding.PARAM_RULES``) and computes only the pairs routed to them from the replicated
    routing (no token moves, no weight moves); one float32 psum over "model" adds the devices'
    parts (GShard's expert parallelism, Lepikhin et al., 2020, with the all-to-alls replaced by
    the all-reduce tensor parallelism already ends each block with)."""
    if kernels.mesh is None:
        return experts.routed_experts(x, weights, chosen, gate_up_proj, down_proj)

    def local(x, weights, chosen, gate_up_proj, down_proj):
        first = jax.lax.axis_index(MODEL) * gate_up_proj.shape[0]
        out = experts.routed_experts(x, weights, chosen - first, gate_up_proj, down_proj,
                                     out_dtype=jnp.float32,
                                     expert_parallel=kernels.mesh.shape[MODEL])
        if kernels.mesh.shape[MODEL] > 1:  # (a psum over one device still launches)
            out = jax.lax.psum(out, MODEL)
        return out.astype(x.dtype)

    rows, stack = P(DATA, None), P(MODEL, None, None)
    return _on_mesh(kernels, local, (rows, rows, rows, stack, stack), rows)(
        x, weights, chosen, gate_up_proj, down_proj)


def chunk_gated_delta_rule(kernels: Kernels, q, k, v, g, beta, state):
    """The prefill's chunked gated delta rule (64-token chunks) as ``kernels.prefill_delta_rule``
    says: arguments and result as ``gated_delta.chunk_gated_delta_rule`` (q, k repeated to the
    value heads; float32), heads over "model" on a mesh."""
    if kernels.prefill_delta_rule == "xla":
        return chunk_rule_kernel.chunk_gated_delta_rule_reference(q, k, v, g, beta, state)
    rule = functools.partial(_prefill_delta_rule_pallas, interpret=_interpret(kernels))
    tokens, gates, heads = P(DATA, None, MODEL, None), P(DATA, None, MODEL), P(DATA, MODEL)
    return _on_mesh(kernels, rule, (tokens, tokens, tokens, gates, gates, heads),
                    (tokens, heads))(q, k, v, g, beta, state)


def gated_delta_states(kernels: Kernels, q, k, v, g, beta, state):
    """The gated delta rule over a few tokens keeping the state after each (a speculative verify
    step) as ``kernels.verify_delta_rule`` says: q, k [B, T, H, dk] (repeated to the value
    heads), v [B, T, H, dv], g, beta [B, T, H], state [B, H, dk, dv], float32. Returns (o [B, T,
    H, dv], states [B, T, H, dk, dv]). The kernel where it takes the shapes
    (``gated_delta_decode.check_states_supported``), else ``naive_gated_delta_rule`` unrolled;
    heads over "model" on a mesh."""
    if (kernels.verify_delta_rule == "xla"
            or delta_rule_kernel.check_states_supported(q.shape, state.shape) is not None):
        return naive_gated_delta_rule(q, k, v, g, beta, state, all_states=True, unroll=True)
    rule = functools.partial(_delta_states_pallas, interpret=_interpret(kernels))
    tokens, gates = P(DATA, None, MODEL, None), P(DATA, None, MODEL)
    return _on_mesh(kernels, rule, (tokens, tokens, tokens, gates, gates, P(DATA, MODEL)),
                    (tokens, P(DATA, None, MODEL)))(q, k, v, g, beta, state)


def deltanet_decode(kernels: Kernels, mixed_qkv, a, b, active, positions, conv_state,
                    recurrent_state, conv_weight, A_log, dt_bias, *, num_key_heads: int):
    """The one-token Gated DeltaNet core as ``kernels.deltanet`` / ``delta_rule`` say (arguments
    and result as ``deltanet_decode.deltanet_decode_pallas``). ``batch_invariant``: the one-kernel
    core with one row's ``block_v``, or the XLA core one row at a time."""
    args = (mixed_qkv, a, b, active, positions, conv_state, recurrent_state, conv_weight, A_log,
            dt_bias)
    hv, dv = recurrent_state.shape[1], recurrent_state.shape[3]
    if kernels.deltanet == "pallas":
        block_v = delta_rule_kernel.choose_block_v(1, hv, dv) if kernels.batch_invariant else None
        return _deltanet_pallas(*args, num_key_heads=num_key_heads, block_v=block_v,
                                interpret=_interpret(kernels))
    if kernels.delta_rule == "xla":
        rule = delta_rule_kernel.gated_delta_decode_reference
    else:
        block_v = None  # the kernel picks it from the batch; invariant: one row's
        if kernels.batch_invariant:
            block_v = delta_rule_kernel.choose_block_v(1, hv, dv)
        rule = functools.partial(_delta_rule_pallas, block_v=block_v,
                                 interpret=_interpret(kernels))
        heads, state = P(DATA, MODEL, None), P(DATA, MODEL, None, None)
        rule = _on_mesh(kernels, rule, (heads, heads, heads, P(DATA, MODEL), P(DATA, MODEL),
                                        state), (heads, state))
    core = functools.partial(deltanet_kernel.deltanet_decode_xla, num_key_heads=num_key_heads,
                             delta_rule=rule)
    if kernels.batch_invariant:
        return invariance.map_rows(lambda weights, *row: core(*row, *weights), args[7:],
                                   *args[:7])
    return core(*args)
