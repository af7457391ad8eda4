"""Hugging Face checkpoint directory -> :class:`~jaxdecode.params.Params`.

Reads ``config.json`` and ``model.safetensors`` (or the shards of
``model.safetensors.index.json``) tensor by tensor, so peak host memory is about one tensor above
the parameters. Text-only ``Qwen3_5ForCausalLM`` names (``model.layers.*``) and the published
multimodal ``Qwen3_5ForConditionalGeneration`` ones (``model.language_model.*`` -> ``model.*``, as
HF's conversion mapping; ``model.visual.*`` skipped, ``mtp.*`` unless asked for) both load, and
``Qwen3NextForCausalLM`` ones (``model.*``; ``mtp.*`` as above), whose fused DeltaNet projections
``in_proj_qkvz`` / ``in_proj_ba`` are split by row permutation (``params.split_fused``). MoE
experts load from the fused 3-D tensors (``mlp.experts.gate_up_proj`` / ``down_proj``) or from
per-expert 2-D ones (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers 5.24's
``save_pretrained`` writes for both families), stacked as HF's ``qwen2_moe`` conversion rules do.
Every header is checked before any data is read, all problems raised together in one
``ValueError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxdecode import memory, quantization, sharding
from jaxdecode.config import Config, model_dtype, read_json
from jaxdecode.params import (Params, checkpoint_specs, hf_to_internal, leaf_dtype, param_specs,
                              params_bytes, params_from_flat, split_fused)
from jaxdecode.quantization import SCALE_SUFFIX, Fp8Linear

TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."  # the MTP layer: loaded only when asked for (load_checkpoint's mtp)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(directory: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory (shards in index order); FileNotFoundError
    without ``model.safetensors`` or an index, or for a missing shard (ValueError: bad index)."""
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index!r} is not a safetensors index with a 'weight_map' "
                                 f"({type(e).__name__}: {e})") from None
        files = [os.path.join(directory, name) for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that do not exist: {missing}")
        return files
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory!r}")


def canonical_name(name: str, mtp: bool = False) -> str | None:
    """Maps a checkpoint tensor name to its ``Qwen3_5ForCausalLM`` name; None if skipped
    (``mtp.*`` unless ``mtp``)."""
    if name.startswith(MTP_PREFIX):
        return name if mtp else None
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    return name


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
FP8_DTYPE = "F8_E4M3"  # block-FP8 weights, each with a ``weight_scale_inv`` (spec §9)
# indices as HF writes them (no leading zeros): "experts.02" is not expert 2 (it would then be
# stored twice, one copy silently dropped) but an unexpected tensor
_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.(?:0|[1-9]\d*)\.mlp\.experts\.)"
                         r"(0|[1-9]\d*)\.(gate|up|down)_proj\.weight$")


def _fuse_experts(config: Config, found: dict, problems: list[str]) -> None:
    """Replaces per-expert 2-D tensors in ``found`` by entries for the fused 3-D ones, whose
    "stored" field lists the parts: gate_up_proj [E, 2·I_e, H] = expert e's gate then up rows,
    down_proj [E, H, I_e]. Appends to ``problems`` a missing or misshapen part, a part of a layer
    whose experts are also stored fused (twice), and the per-expert tensors of a layer outside
    ``config.moe_layers`` (unexpected)."""
    parts: dict[str, dict[tuple[int, str], tuple]] = {}
    for name in [n for n in found if _PER_EXPERT.match(n)]:
        prefix, expert, kind = _PER_EXPERT.match(name).groups()
        parts.setdefault(prefix, {})[(int(expert), kind)] = found.pop(name)
    def moe(prefix):  # the MTP layer's block is an MoE one in every MoE model
        if prefix.startswith(MTP_PREFIX):
            return config.mtp_num_hidden_layers and config.num_experts > 0
        return int(prefix.split(".")[2]) in config.moe_layers

    for prefix in [p for p in parts if not moe(p)]:
        problems.extend(f"unexpected tensor {entry[1]} with shape {entry[2]}"
                        for entry in parts.pop(prefix).values())
    e, ie, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    want = {"gate": (ie, h), "up": (ie, h), "down": (h, ie)}
    fused_of = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}
    for prefix, layer in list(parts.items()):
        stored = [prefix + f for f in ("gate_up_proj", "down_proj") if prefix + f in found]
        if stored:  # the layer's experts are stored fused: no per-expert tensor belongs
            problems.extend(
                f"tensor {entry[1]} is stored twice: per expert and in the fused "
                f"{prefix}{fused_of[kind]}" if prefix + fused_of[kind] in found else
                f"unexpected tensor {entry[1]}: the layer's experts are stored fused "
                f"({', '.join(stored)})" for (_, kind), entry in layer.items())
            del parts[prefix]
    for prefix, layer in parts.items():
        for (expert, kind), entry in layer.items():
            if expert >= e:
                problems.append(f"unexpected tensor {entry[1]} (num_experts={e})")
            elif entry[2] != want[kind]:
                problems.append(f"tensor {entry[1]} has shape {entry[2]}, expected {want[kind]}")
        for expert in range(e):
            for kind in want:
                if (expert, kind) not in layer:
                    problems.append(f"missing tensor {prefix}{expert}.{kind}_proj.weight "
                                    f"(expected shape {want[kind]})")
        entry = lambda key: layer.get(key, (None, None))[:2]  # noqa: E731
        found[prefix + "gate_up_proj"] = (
            None, [(entry((x, "gate")), entry((x, "up"))) for x in range(e)], (e, 2 * ie, h))
        found[prefix + "down_proj"] = (None, [(entry((x, "down")),) for x in range(e)],
                                       (e, h, ie))


def holds_mtp_layer(directory: str | os.PathLike) -> bool:
    """Whether a checkpoint directory stores an MTP layer (``mtp.*`` tensors; read from the
    safetensors headers alone). Errors: as :func:`checkpoint_files`, and a ValueError naming a
    damaged file."""
    for path in checkpoint_files(directory):
        with _open(path) as f:
            if any(name.startswith(MTP_PREFIX) for name in f.keys()):
                return True
    return False


def _index_tensors(files: list[str], problems: list[str], fp8: set[str], mtp: bool = False):
    """{canonical name: (file, stored name, shape)} from the headers alone (``mtp.*`` only with
    ``mtp``); appends to
    ``problems`` every tensor stored twice (both layouts, or two shards) or not floating point;
    adds to ``fp8`` the canonical names of the tensors stored as F8_E4M3."""
    found = {}
    for path in files:
        with _open(path) as f:
            for stored in f.keys():
                name = canonical_name(stored, mtp)
                if name is None:
                    continue
                info = f.get_slice(stored)
                if name in found:
                    where = found[name]
                    problems.append(f"tensor {name} is stored twice: {where[1]} in "
                                    f"{os.path.basename(where[0])} and {stored} in "
                                    f"{os.path.basename(path)}")
                if info.get_dtype() == FP8_DTYPE and name.endswith(SCALE_SUFFIX):
                    problems.append(f"tensor {stored} has dtype {FP8_DTYPE}; block scales "
                                    f"must be a float type {FLOAT_DTYPES}")
                elif info.get_dtype() == FP8_DTYPE:
                    fp8.add(name)
                elif info.get_dtype() not in FLOAT_DTYPES:
                    allowed = FLOAT_DTYPES + (() if name.endswith(SCALE_SUFFIX) else (FP8_DTYPE,))
                    problems.append(f"tensor {stored} has dtype {info.get_dtype()}, expected a "
                                    f"float type {allowed}")
                found[name] = (path, stored, tuple(info.get_shape()))
    return found


def quantization_block(top: dict) -> tuple[int, int]:
    """``weight_block_size`` of a ``config.json`` dict's ``quantization_config`` ((128, 128)
    without one). ValueError: a quantisation other than block FP8 e4m3 (``quant_method: fp8``)."""
    q = top.get("quantization_config") or (top.get("text_config") or {}).get(
        "quantization_config")
    if not q:
        return quantization.DEFAULT_BLOCK
    why = f"unsupported quantization_config {q}: jaxdecode reads block FP8 (quant_method " \
          "'fp8', fmt 'e4m3', weight_block_size [b0, b1])"
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(why)
    try:
        return quantization.check_block_size(q.get("weight_block_size")
                                             or quantization.DEFAULT_BLOCK)
    except ValueError:
        raise ValueError(why) from None


def _pair_scales(config: Config, found: dict, fp8: set[str], block, problems: list[str]):
    """Pops the ``weight_scale_inv`` entries out of ``found``; returns {weight name: scale
    entry}. Appends to ``problems`` an FP8 weight without its scale, a scale without an FP8
    weight, a scale of the wrong shape and an FP8 tensor that is not 2-D (fused 3-D experts).
    (An FP8 weight whose rows jaxdecode regroups across its blocks is dequantised at load:
    :func:`_fp8_rows`.)"""
    scales = {}
    for name in [n for n in found if n.endswith(SCALE_SUFFIX)]:
        entry = found.pop(name)
        weight = name[:-len(SCALE_SUFFIX)]
        if weight not in found:
            problems.append(f"unexpected tensor {entry[1]} with shape {entry[2]} (no weight "
                            f"{weight} stored beside it)")
        elif weight not in fp8:
            with _open(found[weight][0]) as f:
                stored_dtype = f.get_slice(found[weight][1]).get_dtype()
            problems.append(f"unexpected tensor {entry[1]} with shape {entry[2]} (its weight "
                            f"{found[weight][1]} is stored as {stored_dtype}, not {FP8_DTYPE})")
        else:
            scales[weight] = entry
    for name in sorted(fp8):
        stored, shape = found[name][1], found[name][2]
        if name not in scales:
            problems.append(f"missing tensor {stored}{SCALE_SUFFIX} (the block scales of an "
                            f"{FP8_DTYPE} weight)")
        elif len(shape) != 2:
            problems.append(f"tensor {stored} is {FP8_DTYPE} with shape {shape}: only 2-D "
                            "Linear weights are read as FP8")
        elif scales[name][2] != quantization.scale_shape(shape, block):
            problems.append(f"tensor {scales[name][1]} has shape {scales[name][2]}, but its "
                            f"weight {stored} as stored, {shape} in blocks {list(block)}, needs "
                            f"{quantization.scale_shape(shape, block)}")
    return scales


def _block_aligned(order: np.ndarray, rows: int) -> bool:
    """Whether the row permutation ``order`` moves whole blocks of ``rows`` rows."""
    if order.size % rows:
        return False
    blocks = order.reshape(-1, rows)
    return bool((blocks[:, :1] % rows == 0).all()
                and (blocks == blocks[:, :1] + np.arange(rows)).all())


def _safetensors_header(path: str) -> tuple[int, dict]:
    """(the byte where a safetensors file's data section starts, its JSON header)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _read_fp8(path: str, stored: str, header: tuple[int, dict]) -> np.ndarray:
    """An F8_E4M3 tensor as float8_e4m3fn numpy (safetensors' numpy reader has no float8): its
    bytes located from the file's ``header`` (:func:`_safetensors_header`, parsed once per file:
    an FP8 MoE release holds thousands of tensors a file, each parse milliseconds)."""
    start, entries = header
    info = entries[stored]
    begin, end = info["data_offsets"]
    data = np.fromfile(path, np.uint8, count=end - begin, offset=start + begin)
    if data.size != end - begin:
        raise ValueError(f"cannot read tensor {stored} from {path!r} (the file is truncated)")
    return data.view(quantization.FP8).reshape(info["shape"])


def _open(path: str):
    """``safe_open`` with a ValueError naming the file for a damaged, truncated or empty one."""
    try:
        return safe_open(path, framework="np")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: say which file
        raise ValueError(f"{path!r} is not a readable safetensors file ({type(e).__name__}: "
                         f"{e})") from None


def _with_generation_eos(config: Config, directory: str) -> Config:
    """``config`` with ``generation_config.json``'s ``eos_token_id`` (an int or a list;
    duplicates dropped; [] = none) where the directory has that file and it names one: HF
    ``generate`` stops at those (``GenerationConfig.from_pretrained`` over the model config;
    Qwen's chat releases add ``<|im_end|>`` there). Where the file names none, config.json's
    are kept (HF would stop at none: a file written for other settings should not silently
    disable EOS). ValueError naming the file for one that is not a JSON object or ids that are
    not non-negative ints."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return config
    generation = read_json(path)
    if not isinstance(generation, dict):
        raise ValueError(f"{path!r} is not a JSON object (an HF GenerationConfig)")
    eos = generation.get("eos_token_id")
    if eos is None:
        return config
    try:
        config = dataclasses.replace(config, eos_token_id=eos)
    except ValueError:
        raise ValueError(f"{path!r}: eos_token_id={eos!r} must be a non-negative int or a flat "
                         "list of them") from None
    return dataclasses.replace(config, eos_token_id=tuple(dict.fromkeys(config.eos_token_id)))


def load_checkpoint(directory: str | os.PathLike, dtype="bfloat16", *,
                    place: Callable[[str, np.ndarray], jax.Array] | None = None,
                    mesh: jax.sharding.Mesh | None = None, check_finite: bool = True,
                    quantize: str | None = None, mtp: bool = False) -> Params:
    """Loads a Hugging Face Qwen3.5 or Qwen3-Next checkpoint directory.

    Args:
      directory: ``config.json`` plus ``model.safetensors`` or shards with
        ``model.safetensors.index.json``, or the path of one ``.safetensors`` file beside its
        ``config.json``; bf16 or float32 on disk.
      dtype: "bfloat16" or "float32"; ``A_log`` and the gated-norm weight stay float32.
      place: optional ``(name, host_array) -> jax.Array`` putting each parameter (its
        ``param_specs`` name: Qwen3-Next's fused tensors already split; cast, in jaxdecode's
        layout: ``params.conv_channel_order``) on device; default ``jnp.asarray``.
      mesh: a ``("data", "model")`` mesh: each tensor goes straight into its sharding as it is
        read (``sharding.checkpoint_placer``); with fewer KV heads than "model" devices each is
        repeated, and ``params.config`` says so (``sharding.config_on``). Not together with
        ``place``.
      check_finite: raise if a tensor holds NaN or inf, or an FP8 weight's block scales a
        negative value (one host pass over each tensor as read; damaged data otherwise loads
        silently and decodes garbage).
      quantize: None, or "fp8": the Linears of ``quantization.QUANTIZED_LEAVES`` quantised at
        load to block FP8 (``quantization.quantize``), as the FP8 releases store them: in the
        checkpoint's ``weight_block_size`` where config.json has one (an FP8 checkpoint), else
        128 x 128 blocks.
      mtp: also load the multi-token-prediction layer (``mtp.*``, spec §6; ``Params.mtp``,
        ``config.mtp_num_hidden_layers = 1``) that speculative decoding drafts with; HF (and
        the default) skip it.

    A block-FP8 checkpoint (``quantization_config: {quant_method: fp8}``, F8_E4M3 weights each
    with a ``weight_scale_inv``; spec §9) loads its quantised Linears as :class:`Fp8Linear`
    (``place`` is called with the weight's name for the float8 values and that name +
    ``"_scale_inv"`` for the float32 scales); an FP8 tensor of another leaf is dequantised at
    load to ``dtype`` (Qwen3-Next's fused projections). The FP8 MoE releases' per-expert FP8
    experts load as block-FP8 stacks (``Fp8Linear`` [E, 2·I, H] / [E, H, I]; dequantised instead
    where ``moe_intermediate_size`` is not a multiple of the block rows, which would split a
    block between gate and up). On a ``mesh`` an FP8 weight and its scales split as its spec
    says where each "model" device gets whole scale blocks; elsewhere it is held dequantised in
    ``dtype``, the FP8 model's values (``sharding.unsplit_fp8``, which warns naming them).

    Returns :class:`Params` (config from ``config.json``, its ``eos_token_id`` from
    ``generation_config.json`` where that names one, the ids HF ``generate`` stops at; a tied
    checkpoint's stored ``lm_head.weight`` is ignored).

    Raises:
      FileNotFoundError: missing ``config.json`` or safetensors files.
      ValueError: ``mtp`` or ``check_finite`` not a bool; a damaged, truncated or empty safetensors
        file (named); an unsupported ``quantization_config`` or ``quantize``; an FP8 weight without
        its scales, or scales whose shape does not fit the weight (both shapes named); a tensor
        with NaN or inf values (named, with the file); an unsupported or malformed config
        (``Config.from_hf_config``), ``generation_config.json`` or index file; one message
        listing every missing, unexpected, misshapen (both shapes), duplicated or non-float
        tensor, by its name in the checkpoint
        (``params.checkpoint_specs``); a config that cannot be split over ``mesh``
        (``sharding.check_mesh``); both ``place`` and ``mesh``; ``mtp`` with a config.json whose
        ``mtp_num_hidden_layers`` is more than 1; weights larger than the default device's free
        memory (without ``place`` or ``mesh``), or a device's shard of them larger than its free
        memory (``mesh``; ``memory.check_fits``), before any is read. A custom ``place`` is not
        checked (where it puts each tensor is its own).
    """
    for name, value in (("mtp", mtp), ("check_finite", check_finite)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name}={value!r} must be a bool")
    directory = os.fspath(directory)
    files = None
    if os.path.isfile(directory) and directory.endswith(".safetensors"):
        directory, files = os.path.dirname(directory) or ".", [directory]
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {directory!r}")
    top = read_json(config_path)  # read once: the config, the MTP check, the FP8 blocks
    config = _with_generation_eos(Config.from_hf_config(top), directory)
    if mtp:
        layers = (top.get("text_config") or top).get("mtp_num_hidden_layers", 1)
        if layers not in (0, 1):  # 0: as to_hf_config writes a config holding no MTP layer
            raise ValueError(f"mtp=True, but config.json has mtp_num_hidden_layers={layers!r}: "
                             "jaxdecode runs one MTP layer (as every published Qwen3.5 and "
                             "Qwen3-Next checkpoint holds)")
        config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    dtype = model_dtype(dtype)
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize={quantize!r} must be None or 'fp8'")
    block = quantization_block(top)
    if mesh is not None:
        if place is not None:
            raise ValueError("pass place or mesh to load_checkpoint, not both")
        place = sharding.checkpoint_placer(config, mesh)
    specs = checkpoint_specs(config)
    problems: list[str] = []
    fp8: set[str] = set()
    found = _index_tensors(files or checkpoint_files(directory), problems, fp8, bool(mtp))
    scales = _pair_scales(config, found, fp8, block, problems)
    _fuse_experts(config, found, problems)
    if config.tie_word_embeddings and "lm_head.weight" in found:
        # A tied checkpoint's stored LM head is not read, but a misshapen one is a wrong file.
        stored_shape = found.pop("lm_head.weight")[2]
        expected = (config.vocab_size, config.hidden_size)
        if stored_shape != expected:
            problems.append(f"tensor lm_head.weight has shape {stored_shape}, expected {expected}")

    missing = specs.keys() - found.keys()
    if mtp and not any(name.startswith(MTP_PREFIX) for name in found):  # one line, not each
        problems.append(f"mtp=True, but the checkpoint holds no {MTP_PREFIX}* tensors (no MTP "
                        "layer to draft with: load it without mtp)")
        missing = {name for name in missing if not name.startswith(MTP_PREFIX)}
    for name in missing:
        problems.append(f"missing tensor {name} (expected shape {specs[name].shape})")
    for name in found.keys() - specs.keys():
        problems.append(f"unexpected tensor {found[name][1]} with shape {found[name][2]}")
    for name in specs.keys() & found.keys():
        if found[name][2] != specs[name].shape:
            problems.append(f"tensor {found[name][1]} has shape {found[name][2]}, expected "
                            f"{specs[name].shape}")
    if problems:
        raise ValueError(f"checkpoint {directory!r} does not match its config.json "
                         f"({len(problems)} problems):\n  " + "\n  ".join(sorted(problems)))

    stacks = _fp8_stacks(config, found, scales, block)
    _warn_mixed_experts(found, scales, stacks, dtype)
    # {stored FP8 tensor: {leaf: its rows}} for those whose every leaf stays FP8
    kept = {name: rows for name in scales.keys() & found.keys()  # (per-expert parts: stacks)
            if (rows := _fp8_rows(config, name, found[name][2][0], block[0]))}
    # the leaves held as block FP8: the loop below decides each by membership here alone
    leaves = param_specs(config)
    fp8_leaves = {name for name in leaves if quantization.is_quantized_leaf(name)
                  and (quantize == "fp8" or name in stacks
                       or any(name in rows for rows in kept.values()))}
    unsplit = set()  # FP8 leaves whose blocks do not split whole on the mesh: the FP8 model's
    if mesh is not None:  # values in the model dtype (experts split by expert: never here)
        unsplit = sharding.unsplit_fp8(config, mesh, {name: (leaves[name].shape, block)
                                                      for name in fp8_leaves})
        fp8_leaves -= unsplit
    held = f"{dtype.name}{', block FP8 where stored or quantised so' if fp8_leaves else ''}"
    if mesh is not None:  # each device holds its shard: check the first one's
        memory.check_fits(f"a shard of the checkpoint's weights ({held}) over {mesh.size} "
                          "devices", sharding.params_shard_bytes(config, mesh, dtype, fp8_leaves,
                                                                 block),
                          mesh.devices.flat[0], advice="use more 'model' devices"
                          + ("" if fp8_leaves else " (or quantize='fp8')"))
    elif place is None:  # on the default device: check it holds them all
        memory.check_fits(f"the checkpoint's weights ({held})",
                          params_bytes(config, dtype, fp8_leaves, block),
                          advice="load onto a mesh (mesh=), or with quantize='fp8'")
    place = place or (lambda name, x: jnp.asarray(x))
    flat = {}
    for name, array in _iter_tensors(found, scales, block, stacks, check_finite):
        if name in stacks:  # per-expert FP8 tensors stacked, kept FP8
            array, scale = array
            if check_finite:
                _check_finite_stack(array, found[name][1])
                _check_finite_stack(scale, found[name][1], SCALE_SUFFIX)
                _check_dequantized(array, scale, block, dtype, lambda lead, row, e=found[name][1]:
                                   _stack_part(e, lead[0], row, array.shape[1]))
            flat[name] = Fp8Linear(place(name, array), place(name + SCALE_SUFFIX, scale), block)
            continue
        if name in scales:
            array, scale = array
            for x, stored in ((array, found[name][1]), (scale, scales[name][1])):
                if check_finite:
                    _check_finite(x, stored, found[name][0] if x is array else scales[name][0],
                                  scales=x is scale)
            if name in kept and check_finite:  # (dequantised ones: checked after the cast)
                _check_dequantized(array, scale, block, dtype,
                                   lambda lead, row: (*found[name][:2], slice(0, None)))
            if name in kept:
                for leaf, rows in kept[name].items():
                    w8, scale_rows = (array, scale) if rows is None else (
                        array[rows], scale[rows[::block[0]] // block[0]])
                    if leaf in unsplit:  # (overflow: checked above)
                        flat[leaf] = place(leaf, quantization.dequantize(
                            w8, scale_rows, block, leaf_dtype(specs[name], dtype)))
                    else:
                        flat[leaf] = Fp8Linear(place(leaf, w8),
                                               place(leaf + SCALE_SUFFIX, scale_rows), block)
                continue
            array = quantization.dequantize(array, scale, block)
        array = array.astype(leaf_dtype(specs[name], dtype), copy=False)
        if check_finite:  # after the cast: overflow counts
            path, stored = found[name][:2]
            if path is None:  # stacked from per-expert tensors
                _check_finite_stack(array, stored)
            else:
                _check_finite(array, stored, path)
        for leaf, part in split_fused(config, name, array).items():
            part = hf_to_internal(config, leaf, part)
            if leaf in fp8_leaves:  # quantize="fp8"
                w8, scale = quantization.quantize(part, block)
                flat[leaf] = Fp8Linear(place(leaf, w8), place(leaf + SCALE_SUFFIX, scale), block)
            elif leaf in unsplit:  # quantize="fp8": the FP8 model's values (as on one device)
                w8, scale = quantization.quantize(part, block)
                flat[leaf] = place(leaf, quantization.dequantize(w8, scale, block, part.dtype))
            else:
                flat[leaf] = place(leaf, part)
    if mesh is not None:  # the placer repeated the KV heads where the mesh needs it
        config = sharding.config_on(config, mesh)
    return params_from_flat(config, flat)


def _damaged(array: np.ndarray, scales: bool = False) -> np.ndarray:
    """The values a file cannot have meant: NaN or inf (``scales``: block scales, negative ones
    too: a scale is a block's largest magnitude / 448)."""
    bad = ~np.isfinite(array)
    return bad | (array < 0) if scales else bad


def _check_finite(array: np.ndarray, stored: str, path: str, scales: bool = False) -> None:
    """ValueError naming ``stored`` and ``path`` for :func:`_damaged` values."""
    bad = _damaged(array, scales)
    if bad.any():
        what = "NaN, inf or negative block scale" if scales else "NaN or inf"
        raise ValueError(f"tensor {stored} in {path!r} has {int(bad.sum())} {what} values as "
                         f"{array.dtype} (a damaged file?); check_finite=False loads it anyway")


def _check_dequantized(w8: np.ndarray, scale: np.ndarray, block, dtype, where) -> None:
    """ValueError when a block of FP8 values [..., N, K] times its scale [..., R, C] exceeds
    ``dtype``'s largest value (the step dequantises to it: inf), naming ``where(lead, row)``
    (the (file, stored name, its rows in the stack) holding that block: ``lead`` its stack
    index, () for a Linear, ``row`` its first row) and the block's index in that tensor.
    Only blocks whose scale allows it (scale · 448 above that value: none in a checkpoint
    quantised from ``dtype``) are read."""
    limit = float(jnp.finfo(dtype).max)
    for idx in np.argwhere(scale.astype(np.float64) * quantization.FP8_MAX > limit):
        *lead, r, c = (int(i) for i in idx)
        part = w8[tuple(lead)][r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
        if float(np.abs(part.astype(np.float64)).max()) * float(scale[tuple(idx)]) > limit:
            path, stored, rows = where(tuple(lead), r * block[0])
            r -= rows.start // block[0]  # the block's row in the stored tensor
            raise ValueError(
                f"tensor {stored} in {path!r}: its FP8 block {r, c} times its weight_scale_inv "
                f"{float(scale[tuple(idx)]):.3g} exceeds {np.dtype(dtype).name}'s largest value "
                "(a damaged file?); check_finite=False loads it anyway")


def _stack_part(experts: list, expert: int, row: int, rows: int) -> tuple[str, str, slice]:
    """(file, stored name, its rows) of the per-expert tensor that holds row ``row`` of expert
    ``expert`` in a stack [E, rows, ...] built from ``experts`` (each expert's (path, stored)
    parts, concatenated along rows, equal in size)."""
    parts = experts[expert]
    size = rows // len(parts)
    i = row // size
    return *parts[i], slice(i * size, (i + 1) * size)


def _check_finite_stack(stack: np.ndarray, experts: list, suffix: str = "") -> None:
    """:func:`_check_finite` of a stack [E, rows, ...] built from per-expert tensors (``experts``
    as :func:`_stack_part`'s), naming the first part that holds a NaN or inf (``stored +
    suffix``: its block scales, negative ones too), and its file."""
    bad = _damaged(stack, scales=bool(suffix)).reshape(*stack.shape[:2], -1).any(axis=2)
    if bad.any():
        e, row = (int(i) for i in np.argwhere(bad)[0])
        path, stored, rows = _stack_part(experts, e, row, stack.shape[1])
        _check_finite(stack[e, rows], stored + suffix, path, scales=bool(suffix))


def _fp8_rows(config: Config, name: str, rows: int, block_rows: int
              ) -> dict[str, np.ndarray | None] | None:
    """{leaf: the rows of stored FP8 tensor ``name`` it takes, in jaxdecode's order (None: all,
    in order)} when each leaf that ``name`` loads as (``split_fused`` then ``hf_to_internal``:
    Qwen3-Next's fused ``in_proj_qkvz`` split, conv channels regrouped per key head) is one the
    releases quantise and takes whole blocks of ``block_rows`` rows: it stays FP8, its scale
    rows picked alike. Else None (the tensor is dequantised at load)."""
    out = {}
    for leaf, order in split_fused(config, name, np.arange(rows)).items():
        order = hf_to_internal(config, leaf, order)
        identity = order.size == rows and (order == np.arange(rows)).all()
        if not quantization.is_quantized_leaf(leaf) or not (
                identity or _block_aligned(order, block_rows)):
            return None
        out[leaf] = None if identity else order
    return out


def _fp8_stacks(config: Config, found: dict, scales: dict, block) -> set[str]:
    """The stacked expert entries of ``found`` (path None) whose every part is an FP8 weight with
    its scales and whose parts' blocks stay whole when an expert's gate and up rows are
    concatenated (``moe_intermediate_size`` a multiple of the block rows; the published
    releases): these load as block-FP8 stacks, the others dequantised."""
    whole = config.moe_intermediate_size % block[0] == 0
    return {name for name, (path, parts, _) in found.items()
            if path is None and (whole or name.endswith("down_proj"))
            and all(canonical_name(stored, mtp=True) in scales
                    for expert in parts for _, stored in expert)}


def _warn_mixed_experts(found: dict, scales: dict, stacks: set[str], dtype) -> None:
    """Warns, naming each, of the stacked expert entries of ``found`` stored partly in FP8 (an
    expert's tensor in another dtype): they load dequantised in ``dtype`` (the same values, more
    memory than the FP8 stacks of :func:`_fp8_stacks`)."""
    mixed = []
    for name, (path, parts, _) in found.items():
        if path is None and name not in stacks:
            stored = [s for expert in parts for _, s in expert]
            n8 = sum(canonical_name(s, mtp=True) in scales for s in stored)
            if 0 < n8 < len(stored):
                mixed.append(f"{name} ({n8} of {len(stored)} tensors {FP8_DTYPE})")
    if mixed:
        warnings.warn(f"jaxdecode: {len(mixed)} expert stacks are stored partly in FP8 and "
                      f"load dequantised in {np.dtype(dtype).name}: " + "; ".join(mixed[:3])
                      + (f"; and {len(mixed) - 3} more" if len(mixed) > 3 else ""),
                      stacklevel=3)


def _iter_tensors(found, scales=None, block=quantization.DEFAULT_BLOCK, stacks=frozenset(),
                  check_finite: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every entry of ``found``: a stored tensor, or (path None) the stack of
    per-expert parts (:func:`_fuse_experts`), each expert's parts concatenated along rows (an
    FP8 part dequantised to float32 first, unless the name is in ``stacks``: then array is
    (float8 [E, ...], float32 scales [E, ...]), the parts' values and scales concatenated); for
    a name in ``scales`` (an FP8 weight: {name: its scale's entry}) array is (float8 values,
    float32 block scales). ``check_finite``: a dequantised part's scales are checked as read
    (:func:`_check_finite`; a negative one leaves finite values)."""
    scales = scales or {}
    with contextlib.ExitStack() as stack:
        handles = {}

        def read(path, stored):
            if path not in handles:
                handles[path] = stack.enter_context(_open(path))
            try:
                return handles[path].get_tensor(stored)
            except Exception as e:  # noqa: BLE001 - a truncated data section
                raise ValueError(f"cannot read tensor {stored} from {path!r} "
                                 f"({type(e).__name__}: {e})") from None

        headers = {}

        def read_fp8(path, stored):
            if path not in headers:
                headers[path] = _safetensors_header(path)
            return _read_fp8(path, stored, headers[path])

        def read_scale(stored):  # the block scales of FP8 weight ``stored``
            return read(*scales[canonical_name(stored, mtp=True)][:2])

        def read_part(path, stored):  # a per-expert tensor; FP8 ones dequantised
            scale = scales.get(canonical_name(stored, mtp=True))
            if scale is None:
                return read(path, stored)
            scale_inv = read(*scale[:2]).astype(np.float32)
            if check_finite:
                _check_finite(scale_inv, scale[1], scale[0], scales=True)
            return quantization.dequantize(read_fp8(path, stored), scale_inv, block)

        for name, (path, stored, _) in sorted(found.items(), key=lambda kv: str(kv[1][0])):
            if name in scales:
                yield name, (read_fp8(path, stored),
                             read(*scales[name][:2]).astype(np.float32))
            elif path is not None:
                yield name, read(path, stored)
            elif name in stacks:
                yield name, (np.stack([np.concatenate([read_fp8(*part) for part in expert])
                                       for expert in stored]),
                             np.stack([np.concatenate([read_scale(part[1]) for part in expert])
                                       for expert in stored]).astype(np.float32))
            else:
                yield name, np.stack([np.concatenate([read_part(*part) for part in expert])
                                      for expert in stored])
