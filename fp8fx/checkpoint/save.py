"""``save_checkpoint`` (a quantized model -> safetensors + config.json) and ``convert`` (a bf16
checkpoint -> an FP8 one, file by file, without building the model's weights)."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from fp8fx import quant
from fp8fx.checkpoint import experts as moe_ckpt
from fp8fx.checkpoint import formats, renames
from fp8fx.checkpoint.files import CONFIG, GENERATION_CONFIG, INDEX_SUFFIX, CheckpointError, read_checkpoint, read_config
from fp8fx.checkpoint.files import quantization_config_of, read_json, read_tensor, write_file
from fp8fx.checkpoint.load import FUSED, LoadReport, _Loader, _looks_like_scale, _progress, check_checkpoint_ignores
from fp8fx.checkpoint.load import compare_tied, config_ties
from fp8fx.checkpoint.load import output_embeddings
from fp8fx.config import Fp8Config, PerBlock, PerTensor, config_or, online_fix
from fp8fx.lowerings import compat
from fp8fx.report import first_line
from fp8fx.weights import chunked, moe
from fp8fx.weights.kv_cache import KV_SCALE_NAMES, check_kv_scale, getter_module
from fp8fx.weights.linear import is_conv1d_class, is_linear, is_quantized, kept_by_the_model, layer_scheme, planning
from fp8fx.weights.quantize import _shown, check_finished, ignoring_every_name, module_names

try:
    import fcntl  # (POSIX: the lock that tells a live writer's folder, ``_hold``)
except ImportError:
    fcntl = None

log = logging.getLogger("fp8fx")

# an fp8 experts module's tensors that per-expert names replace
_EXPERT_LEAVES = {base + suffix for base in (moe.W13, moe.UP, moe.W2)
                  for suffix in ("", "_scale", "_scale_inv", "_input_scale")}
_SCALES = ("weight_scale", "weight_scale_inv", "input_scale")  # a linear's, dropped where it is written dequantized

INDEX = "model" + INDEX_SUFFIX
_PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def save_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    format: Optional[str] = None,
    max_shard_size: Union[int, str, None] = None,
    config_json: Optional[Mapping[str, Any]] = None,
    experts: Optional[str] = None,
) -> dict[str, Any]:
    """Write ``model`` (quantized by ``quantize_`` or ``load_checkpoint``) to directory ``path``:
    ``model.safetensors`` (or shards of at most ``max_shard_size`` plus ``model.safetensors.index.json``: bytes, or
    a size as ``save_pretrained`` takes it, ``"5GB"`` = 5 * 10**9 bytes, ``"5GiB"`` = 5 * 2**30) and
    ``config.json`` with its ``quantization_config``, which it returns.

    ``format``: ``"fp8"`` (per-tensor ``weight_scale`` or ``weight_scale_inv`` blocks, one scheme for all
    layers: vLLM's own format; transformers reads only its block variant, FineGrainedFP8, and takes a per-tensor
    one's fp8 values unscaled - save per-tensor models for transformers as compressed-tensors),
    ``"compressed-tensors"`` (any mix; block scales are named ``weight_scale``), or None: the
    format the model was loaded from, else ``fp8`` when it can express the model. ``config_json``: the rest
    of ``config.json`` (default: an HF model's ``model.config`` with ``architectures`` naming the model's class, as
    ``save_pretrained`` writes, else the loaded checkpoint's).
    ``experts``: how experts modules are written: ``"per-expert"`` (the layout of most HF hub checkpoints and
    vLLM: ``<experts>.<e>.gate_proj.weight`` + ``weight_scale`` / ``weight_scale_inv`` / ``input_scale``,
    ``up_proj``, ``down_proj``; w13's per-tensor scale of an expert is written for both gate and up; experts left
    in high precision as weights alone, the ignore list naming their experts module - and, for compressed-tensors,
    which matches names exactly, each expert's modules -, unless their layout does not split: interleaved gate/up,
    biases, a norm after each expert),
    ``"fused"`` (under the module's own names: ``gate_up_proj`` [E, 2I, H] and its scales,
    ``fp8fx.checkpoint.experts``) or None (default): per expert, except for a transformers model that transformers
    loads from fused experts only (no per-expert converter in its conversion mapping: GraniteMoE, whose hub
    checkpoints hold ``block_sparse_moe.input_linear`` / ``output_linear``), whose experts are written fused in its
    hub layout, with a warning: from per-expert tensors from_pretrained loads random experts, with no error, so
    ``"per-expert"`` is refused for it. The config names experts as it names linear layers. A model whose hub
    checkpoints transformers converts gets their names: the projections' (Mixtral's ``w1`` / ``w3`` / ``w2``) and
    its MoE blocks' where transformers renames them (Mixtral's ``block_sparse_moe`` for ``mlp``, GraniteMoE's
    ``input_linear`` for ``experts.gate_up_proj``), as its ``save_pretrained`` writes; names outside MoE blocks are
    the model's (Kimi-Linear's dense ``mlp``).
    Names are written without the ``_orig_mod.`` of torch.compile wrappers (of the model or of submodules).
    KV-cache scales are written on their attention module (``self_attn.k_scale``, ``v_scale``, ``q_scale``), a
    softmax scale as ``self_attn.prob_output_scale``, the one name vLLM reads it by.
    An fp8 layer fused by engines with layers left in high precision (``q_proj`` of a ``k_proj`` / ``v_proj`` a
    weight block does not divide; the groups of ``fp8fx.checkpoint.load.FUSED``) is written in high precision
    (dequantized), in the ignore list with them, with a warning: vLLM refuses a fused layer of two precisions.
    """
    max_shard_size = _shard_bytes(max_shard_size)
    _check_arguments(path, experts)
    path = os.fspath(path)
    model, modules, schemes, tensors, qc = _planned(model, format, experts, check_values=True)
    if config_json is None:
        hf, source = getattr(model, "config", None), getattr(model, "_fp8fx_source", {})
        config_json = hf.to_dict() if hasattr(hf, "to_dict") else source.get("config", {})
        if hasattr(hf, "to_dict"):  # the class that loads it, as save_pretrained writes (a model built from its
            # config has none: meta_model took AutoModelForCausalLM's class, which VLMs have not)
            config_json["architectures"] = [type(model).__name__]
            dtype = _compute_dtype(tensors)
            if dtype is not None:  # the dtype it computes in, as save_pretrained writes (a model cast after it was
                # built has None, and meta_model built it again in bf16); transformers 4's key where it has that one
                key = "torch_dtype" if "torch_dtype" in config_json and "dtype" not in config_json else "dtype"
                config_json[key] = str(dtype).removeprefix("torch.")
    if not isinstance(config_json, Mapping):  # (_config_text's check, before anything reads it)
        _config_text(config_json, qc, "save_checkpoint")
    untied = _untied_config(model, config_json)
    if untied is not config_json:
        _write_config_ties(model, tensors)
    config_json = untied
    _write_head_untied(model, config_json, tensors, modules)
    head = output_embeddings(model, modules)
    if head is not None and head in schemes:
        log.warning("fp8fx: save_checkpoint writes the output embeddings %s in fp8: vLLM loads lm_head in bf16 only "
                    "(an embedding to it, no linear layer), so this checkpoint loads in fp8fx and transformers, not "
                    "vLLM; quantize_ with %r in ignored_layers for one vLLM loads", head, head)
    config_text = _config_text(config_json, qc, "save_checkpoint")  # refused before any file is written
    _warn_per_tensor_fp8(qc, "save_checkpoint", "format='compressed-tensors'")
    ragged = ragged_blocks(modules, schemes)
    if ragged:
        log.warning("fp8fx: save_checkpoint writes layers their weight blocks do not divide (%s): fp8fx and vLLM "
                    "load them with ragged last blocks; transformers' fp8 loader takes the block size from the scale "
                    "grid, and refuses such a layer or misreads it", ", ".join(ragged[:3]) + (
                        f" and {len(ragged) - 3} more" if len(ragged) > 3 else ""))
    _warn_block_experts_ct(qc, [f for f, m in modules.items() if moe.is_quantized_experts(m)
                                and isinstance(moe.experts_scheme(m).weight, PerBlock)], "save_checkpoint",
                           "format='fp8'")
    _write_checkpoint(path, tensors, max_shard_size, config_text, _generation_text(model))
    log.info("fp8fx: saved %d tensors to %s (%s)", len(tensors), path, qc["quant_method"])
    return qc


def _planned(model: nn.Module, format: Optional[str], experts: Optional[str], check_values: bool,
             say: logging.Logger = log
             ) -> tuple[nn.Module, dict[str, nn.Module], dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """What ``save_checkpoint`` writes of ``model`` (the model under its wrapper, its modules by saved name, the
    schemes of the layers written in fp8, the tensors by saved name, the quantization_config), or why it cannot be
    written (a ValueError). ``check_values``: refuse scales and fp8 codes no loader takes (a pass over the weights).
    ``say``: where its notes on what it writes go (a disabled logger for a plan that writes nothing)."""
    model = compat.compiled_module(model)  # a torch.compile wrapper: the module it compiles, the checkpoint's names
    check_finished(model, "save_checkpoint")  # its bf16 layers would be written as ignored on purpose
    # modules by the names they are saved under: a torch.compile wrapper of a submodule puts "_orig_mod." in its
    # module's names, which nothing loads (the wrappers hold nothing of their own)
    modules = {_unwrapped(f): m for f, m in model.named_modules() if compat.compiled_module(m) is m}
    schemes = {f: layer_scheme(m) for f, m in modules.items() if is_quantized(m)}  # the fp8 linears'
    if check_values:
        _check_loadable_values(modules, schemes)
    layout = _experts_layout(model, modules, experts, say)
    schemes, demoted = _fp8_schemes(modules, schemes, layout, say)
    ignored, kv, fmt, method = _ignored_and_format(model, modules, schemes, layout, format)
    tensors = _named_tensors(model, modules, layout, demoted, method)
    meta = [n for n, t in tensors.items() if t.is_meta]
    if meta:  # a model built on the meta device and not loaded (or a part of it left unloaded): no values to write
        raise ValueError(f"save_checkpoint: {meta[0]} is on the meta device ({len(meta)} such tensors): it holds no "
                         "values; load the model's weights first (fp8fx.load_checkpoint), then save (nothing was "
                         "written)")
    wide = [n for n, t in tensors.items() if t.is_floating_point() and t.dtype.itemsize > 4]
    if wide:  # load_checkpoint reads bf16/fp16/fp32 next to the fp8 tensors: refused here, not when loaded
        raise ValueError(f"save_checkpoint: {wide[0]} is {tensors[wide[0]].dtype} ({len(wide)} such tensors); a "
                         f"quantized model cast to float64 is a reference, its checkpoint holds bf16/fp16/fp32 tensors:"
                         f" cast it back (model.to(torch.bfloat16)), then save (nothing was written)")
    tensors, schemes, ignored = _hub_named(model, tensors, schemes, ignored, layout, say)
    if method == "compressed-tensors":
        schemes, ignored = _with_vllm_expert_names(schemes, ignored, layout.names)
    return model, modules, schemes, tensors, formats.quantization_config(schemes, ignored, kv, fmt)


def _compute_dtype(tensors: Mapping[str, torch.Tensor]) -> Optional[torch.dtype]:
    """The dtype a quantized model computes in: that of most of its bf16/fp16/fp32 tensors by size, the fp8 codes
    and their float32 scales aside (a bf16 model's embeddings, norms, unquantized layers)."""
    sizes: dict[torch.dtype, int] = {}
    for name, t in tensors.items():
        if t.dtype in quant.HIGH_PRECISION and not _looks_like_scale(name):
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else None


def ragged_blocks(modules: Mapping[str, nn.Module], schemes: Mapping[str, Any]) -> list[str]:
    """The block-scaled linear layers written in fp8 whose weight the blocks do not divide, as "fqn [N, K] in
    block_n x block_k blocks" (a DeepSeek-V3 checkpoint's 576-row kv_a_proj_with_mqa, loaded and saved again)."""
    found = []
    for fqn, scheme in schemes.items():
        weight = getattr(scheme, "weight", None)
        codes = getattr(modules.get(fqn), "_parameters", {}).get("weight")
        if isinstance(weight, PerBlock) and codes is not None and codes.dim() == 2 and (
                codes.shape[0] % weight.block_n or codes.shape[1] % weight.block_k):
            found.append(f"{fqn} {list(codes.shape)} in {weight.block_n}x{weight.block_k} blocks")
    return found


def _warn_per_tensor_fp8(qc: Mapping[str, Any], where: str, fix: str) -> None:
    """transformers' ``fp8`` loader takes block scales alone: a per-tensor ``fp8`` checkpoint's codes load unscaled
    there (logits off by ~100%, no error), while vLLM and fp8fx load it right."""
    if qc["quant_method"] == "fp8" and not qc.get("weight_block_size"):
        log.warning("fp8fx: %s writes per-tensor weights as quant_method 'fp8', which vLLM and fp8fx load but "
                    "transformers misreads (its fp8 loader takes block scales only); for a checkpoint transformers "
                    "loads, use %s", where, fix)


def _warn_block_experts_ct(qc: Mapping[str, Any], experts: Sequence[str], where: str, fix: str) -> None:
    """transformers' compressed-tensors loader multiplies an experts module's fp8 codes by its block scales without
    expanding them to the blocks, and fails (transformers 5.25: "The size of tensor a (64) must match the size of
    tensor b (2)", h138); fp8fx loads them, and transformers reads the same experts in format fp8."""
    if qc["quant_method"] == "compressed-tensors" and experts:
        log.warning("fp8fx: %s writes the block-scaled experts %s%s as compressed-tensors, which "
                    "fp8fx loads but transformers' compressed-tensors loader refuses (it does not expand an expert's "
                    "block scales); for a checkpoint transformers loads, use %s", where, experts[0],
                    f" and {len(experts) - 1} more" if len(experts) > 1 else "", fix)


def _check_loadable_values(modules: Mapping[str, nn.Module], fp8: Mapping[str, Any]) -> None:
    """Refuses a scale the model holds that no loader takes (0, <0, subnormal, NaN, Inf: load_checkpoint refused the
    checkpoint save_checkpoint had written), naming it, before anything is written: the fp8 linears' (``fp8``) and
    experts' scales, and the attentions' KV-cache scales (those fp8fx attached: a model's own ``q_scale`` is its
    own). So are their fp8 codes with a NaN, which load_checkpoint refuses too. A meta tensor is left to the
    caller's check, which names it."""
    for fqn, m in modules.items():
        for name, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None or t.is_meta or not t.is_floating_point():
                continue
            if t.dtype == quant.FP8_DTYPE and (fqn in fp8 or name in _EXPERT_LEAVES):
                bad = chunked.count_nonfinite(t.detach())
                if bad:
                    raise ValueError(f"save_checkpoint: {fqn}.{name} has {bad} NaN fp8 codes, which no loader takes: "
                                     "fix the weights (or quantize the layer again from its high-precision weight), "
                                     "then save (nothing was written)")
                continue
            if name in m.__dict__.get("_fp8fx_kv_scales", ()):  # (attach_kv_scales's: float32, one value)
                try:
                    check_kv_scale(f"{fqn}.{name}", t.detach())
                except ValueError as e:
                    raise ValueError(f"save_checkpoint: {e} (nothing was written)") from None
                continue
            scale = fqn in fp8 and name in _SCALES or name in _EXPERT_LEAVES and "scale" in name
            why = quant.bad_scales(t.detach().float()) if scale else None
            if why:
                raise ValueError(f"save_checkpoint: {fqn}.{name}: {why}; no loader takes it: fix the scale (or "
                                 "quantize the layer again from its high-precision weight), then save (nothing was "
                                 "written)")


def untied_embeddings(model: nn.Module) -> bool:
    """Whether the model has input and output embeddings that do not share their weight (as its config may say)."""
    # (getter_module: a getter that raises - CLIPModel's get_input_embeddings, "not auto-handled" - gives None)
    (inp, _), (out, _) = (getter_module(model, f"get_{kind}_embeddings", {}) for kind in ("input", "output"))
    return inp is not None and out is not None and out._parameters.get("weight") is not inp._parameters.get("weight")


def _untied_config(model: nn.Module, config_json: dict) -> dict:
    """``config_json`` with ``tie_word_embeddings: false`` where it says true but the model's output embeddings are
    no longer its input embeddings (an lm_head quantized on its own, ``quantize_(model.lm_head, ...)``: the README's
    untying): HF, vLLM and load_checkpoint tie them again from the config, dropping the fp8 lm_head or refusing
    it. The model's own config is not changed."""
    if not untied_embeddings(model):
        return config_json
    fixed = dict(config_json)
    if isinstance(fixed.get("text_config"), dict):  # (multimodal configs tie in their text config)
        fixed["text_config"] = dict(fixed["text_config"])
    for where in (fixed, fixed.get("text_config")):
        if isinstance(where, dict) and where.get("tie_word_embeddings") is True:
            where["tie_word_embeddings"] = False
            log.warning("fp8fx: save_checkpoint writes tie_word_embeddings: false: the model's output embeddings "
                        "are not its input embeddings (an lm_head quantized on its own is untied), though its "
                        "config says they are tied (the model's config is unchanged)")
    return fixed


def _write_head_untied(model: nn.Module, config_json: Mapping, tensors: dict[str, torch.Tensor],
                       modules: Mapping[str, nn.Module]) -> None:
    """The output embeddings' weight, where the model ties it to its input embeddings and ``config_json`` says
    ``tie_word_embeddings: false`` (a config_json passed for the untied model, or a model tied by hand under an
    untied config), stored under its own name too: a tied tensor is stored once, under the input embeddings' name,
    and the untied model that config describes reads both ("lm_head.weight is missing", load_checkpoint said of
    save_checkpoint's output; transformers left the head random)."""
    if not any(isinstance(c, Mapping) and c.get("tie_word_embeddings") is False
               for c in (config_json, config_json.get("text_config"))):
        return
    (inp, inp_name), (out, out_name) = (getter_module(model, f"get_{kind}_embeddings", modules)
                                        for kind in ("input", "output"))
    if inp is None or out is None or inp_name is None or out_name is None:
        return
    weight = inp._parameters.get("weight")
    source, target = (".".join(filter(None, (name, "weight"))) for name in (inp_name, out_name))
    if weight is not None and out._parameters.get("weight") is weight and source in tensors and target not in tensors:
        tensors[target] = tensors[source].clone()


def _write_config_ties(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors the model shares only because its config said ``tie_word_embeddings`` (BERT's MLM decoder bias,
    one tensor with ``cls.predictions.bias``), stored under each name, where ``_untied_config`` wrote the config
    untied: a tied tensor is stored once, and the untied model that config describes has a tensor of its own for
    each name ("cls.predictions.decoder.bias is missing", load_checkpoint said of save_checkpoint's output)."""
    state = model.state_dict(keep_vars=True)
    for target, source in config_ties(model, "save_checkpoint").items():
        if target not in tensors and source in tensors and target in state and state[target] is state.get(source):
            tensors[target] = tensors[source].clone()


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}


def _shard_bytes(max_shard_size: Union[int, str, None]) -> Optional[int]:
    """``max_shard_size`` in bytes: an int, or a size as transformers' ``save_pretrained`` takes it in bytes
    (``"5GB"``, ``"500MB"``, ``"2GiB"``; binary units in any case, ``"2gib"``, as transformers reads them). A decimal
    unit ending in a lowercase b (``"5Gb"``, ``"5gb"``), which transformers reads as bits, is refused as ambiguous."""
    size = max_shard_size
    if isinstance(size, str) and (match := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]I?B)\s*", size.upper())):
        if size.rstrip().endswith("b") and "I" not in match[2]:
            raise ValueError(f"save_checkpoint: max_shard_size={max_shard_size!r}: a unit ending in a lowercase b is "
                             "bits to transformers' save_pretrained and bytes to most readers; write it as "
                             f"{size.strip()[:-1] + 'B'!r} (bytes)")
        size = int(float(match[1]) * _SIZE_UNITS[match[2]])
    if size is not None and (type(size) is not int or size <= 0):
        raise ValueError(f"save_checkpoint: max_shard_size={max_shard_size!r} must be a positive number of bytes "
                         "(an int, e.g. 5 * 2**30) or a size such as '5GB' / '5GiB', or None for one file")
    return size


def _check_arguments(path: Union[str, os.PathLike], experts: Optional[str]) -> None:
    """Refuse arguments ``save_checkpoint`` does not take, and a ``path`` that is a file or already holds a
    checkpoint: a shard or index left from another save would be read back with this model's config."""
    if experts not in (None, "per-expert", "fused"):
        raise ValueError(f"save_checkpoint: experts={experts!r} is not 'per-expert', 'fused' or None (per expert "
                         "where transformers loads them so)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save_checkpoint: {os.fspath(path)} is a file; pass a new or empty directory")
    # another model's weights or config: a shard or index would be read back with this model's config, and this
    # config would describe the pickled weights beside it (a tokenizer's files may be there: they are kept)
    held = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", INDEX_SUFFIX) + _PICKLES) or f == CONFIG
                  ) if os.path.isdir(path) else []
    if held:
        raise ValueError(f"save_checkpoint: {os.fspath(path)} already holds a checkpoint ({', '.join(held[:3])}"
                         f"{', ...' if len(held) > 3 else ''}); pass an empty or new directory (nothing was written)")


@dataclasses.dataclass(frozen=True)
class _ExpertsLayout:
    """How ``save_checkpoint`` writes the model's experts modules, by saved name (``_experts_layout``)."""

    modules: dict[str, nn.Module]  # every experts module
    quantized: dict[str, nn.Module]  # those in fp8
    split: dict[str, nn.Module]  # those written per expert; the others are written fused
    hub_fused: bool  # fused in the hub's layout: transformers reads no per-expert tensors of the model
    names: dict[str, str]  # the per-expert projections' names (moe_ckpt.PROJ, or the hub's: Mixtral's w1 / w3 / w2)


def _experts_layout(model: nn.Module, modules: Mapping[str, nn.Module], experts: Optional[str],
                    say: logging.Logger = log) -> _ExpertsLayout:
    """Which experts modules are written per expert and under which projection names: per expert where they split
    and transformers loads them so, fused otherwise (``experts="fused"``, experts that do not split, or a model
    transformers loads from fused experts only, where ``experts="per-expert"`` is refused: it would load random
    experts, with no error)."""
    all_experts = {f: m for f, m in modules.items() if moe.is_any_experts(m)}
    quantized_experts = {f: m for f, m in all_experts.items() if moe.is_quantized_experts(m)}
    # experts that can be written per expert: quantized ones, and those in high precision that split exactly
    splittable = {f: m for f, m in all_experts.items() if f in quantized_experts or moe_ckpt.split_reason(m) is None}
    # fused in the hub's layout where transformers reads no per-expert tensors of this model (GraniteMoE)
    hub_fused = experts != "fused" and bool(splittable) and renames.per_expert_loadable(model) is False
    if hub_fused:
        config = getattr(model, "config", None)
        what = f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        why = (f"transformers loads the experts of {what} from fused tensors only, as its hub checkpoints hold them "
               "(its conversion mapping has no per-expert converter for them), and from per-expert tensors would load "
               "random experts, with no error")
        if experts == "per-expert":
            raise ValueError(f"save_checkpoint(experts='per-expert'): {why}; leave experts=None to write them fused "
                             "in the hub's layout, or pass experts='fused' (nothing was written)")
        say.warning("fp8fx: save_checkpoint writes experts fused, in the hub's layout, not per expert: %s", why)
    split = {} if experts == "fused" or hub_fused else splittable
    for f, m in all_experts.items() if experts != "fused" and not hub_fused else ():
        if f not in split:
            say.info("fp8fx: save_checkpoint writes %s fused: its experts do not split (%s)", f,
                     moe_ckpt.split_reason(m))
    flipped = [f for f, m in quantized_experts.items() if f not in split and moe.is_transposed(m)]
    if flipped:
        say.warning("fp8fx: save_checkpoint writes the fp8 experts of %s fused in fused_moe's layout, [E, 2I, H] / "
                    "[E, H, I], not the model's transposed [E, H, 2I] / [E, I, H]: fp8fx.load_checkpoint reads them "
                    "back; a reader that takes fused experts in the model's layout would not", _shown(flipped))
    names = moe_ckpt.PROJ
    if split:  # the projections' names of the model's hub checkpoints (Mixtral's w1 / w3 / w2), where known
        leaves = renames.hub_expert_leaves(model)
        names = moe_ckpt.naming(leaves) or moe_ckpt.PROJ
        if names is moe_ckpt.PROJ and leaves:  # a naming load_checkpoint does not read: the loadable one, said
            say.warning(
                "fp8fx: save_checkpoint writes %s's experts per expert as <experts>.<e>.gate_proj / up_proj / "
                "down_proj, but its hub checkpoints name them %s, which fp8fx.load_checkpoint does not read: "
                "transformers and vLLM will not find the experts; fp8fx convert, from the original checkpoint, "
                "writes its names", type(model).__name__, "/".join(leaves.values()),
            )
    return _ExpertsLayout(all_experts, quantized_experts, split, hub_fused, names)


# why a checkpoint holds GPT-2's Conv1D layers in high precision (save_checkpoint dequantizes them, convert leaves them)
CONV1D_IN_HIGH_PRECISION = (
    "transformers' fp8 loaders (fp8, compressed-tensors) quantize nn.Linear layers only, and read a Conv1D's fp8 codes "
    "as its bf16 weight, unscaled, with a note of unexpected scale keys alone (logits 120% off); written in high "
    "precision and in the ignore list, they load so everywhere, fp8fx.load_checkpoint included: for fp8 Conv1D layers, "
    "load the high-precision checkpoint the model came from with fp8fx.load_checkpoint, which quantizes them as it "
    "loads")


def _fp8_schemes(
    modules: Mapping[str, nn.Module], schemes: Mapping[str, Any], layout: _ExpertsLayout, say: logging.Logger = log
) -> tuple[dict[str, Any], list[str]]:
    """The scheme of every layer written in fp8 - the linear layers' ``schemes``, and the experts' under the module
    names they are written with (compressed-tensors targets) -, and the fp8 linears written in high precision
    instead (``_split_groups``). Refuses a model with no fp8 layer left, unprocessed weights, or an fp8 tensor cast by
    hand, which would be written under fp8 names with the wrong values."""
    schemes = dict(schemes)
    quantized_experts = layout.quantized
    for f, m in quantized_experts.items():  # named as the checkpoint names them (compressed-tensors targets)
        schemes.update({n: moe.experts_scheme(m) for n in (moe_ckpt.per_expert_modules(f, m, layout.names)
                                                          if f in layout.split else [f])})
    if not schemes:
        raise ValueError(
            "save_checkpoint: the model has no fp8fx-quantized layer; quantize_ it or load_checkpoint first"
        )
    unprocessed = [
        f for f, m in modules.items() if (f in schemes or f in quantized_experts) and not m._fp8fx_processed
    ]
    if unprocessed:
        raise ValueError(f"{unprocessed[0]}: weights not processed yet; run process_weights_after_loading first")
    # an attention Fp8KVCacheMethod made scales on and did not process: its scales are parameters, the unloaded ones
    # -1.0, which were written (beside a loaded k_scale) and load_checkpoint then refused
    waiting = next((f for f, m in modules.items() if "_fp8fx_kv_prefix" in vars(m)
                    and any(m._parameters.get(n) is not None for n in KV_SCALE_NAMES)), None)
    if waiting is not None:
        raise ValueError(f"{waiting}: its KV-cache scales are still loading (Fp8KVCacheMethod.create_weights made "
                         "them, process_weights_after_loading did not run): run the method's "
                         "process_weights_after_loading(layer) first (nothing was written)")
    for f, m in modules.items():  # a tensor cast by hand would be written under fp8 names with the wrong values
        if f in schemes or f in quantized_experts:
            for n, t in m._parameters.items():
                want = (quant.FP8_DTYPE if n in ("weight", moe.W13, moe.UP, moe.W2)
                        else torch.float32 if n.endswith(("scale", "scale_inv")) else None)
                if t is not None and want is not None and t.dtype != want:
                    raise ValueError(f"save_checkpoint: {f}.{n} of the fp8 layer {f} is {t.dtype}, not {want} "
                                     "(cast after quantize_?); quantize_ the bf16 model again, then save (nothing was "
                                     "written)")
    conv1d = [f for f in schemes if is_conv1d_class(type(modules.get(f)))]
    split, split_warning = _split_groups(modules, schemes)
    demoted = conv1d + [f for f in split if f not in conv1d]
    for f in demoted:
        del schemes[f]
    if not schemes:
        # (refused before the Conv1D warning below: GPT-2, whose fp8 layers are all Conv1D, was told they were being
        # written, then nothing was; and no scheme writes a Conv1D in fp8, so the fused groups' fix does not apply)
        if set(demoted) <= set(conv1d):
            raise ValueError(f"save_checkpoint: every fp8 layer of the model ({_shown(demoted)}) is a Conv1D "
                             f"({CONV1D_IN_HIGH_PRECISION}), and would be written in high precision: the checkpoint "
                             "would hold no fp8 layer; save the high-precision model instead (the one quantize_ took, "
                             "or fp8fx.dequantize_(model) then save_pretrained) and load it with "
                             "fp8fx.load_checkpoint (nothing was written)")
        raise ValueError(f"save_checkpoint: every fp8 layer of the model ({_shown(demoted)}) is a Conv1D or in a "
                         "fused group whose other layers stay in high precision, and would be written in high "
                         "precision; quantize with a scheme the whole group takes, or save the high-precision model "
                         "and load it with fp8fx.load_checkpoint, which quantizes them as it loads (nothing was "
                         "written)")
    if conv1d:
        say.warning("fp8fx: save_checkpoint writes %d Conv1D layers (%s) in high precision (dequantized), in the "
                    "ignore list: %s", len(conv1d), _shown(conv1d), CONV1D_IN_HIGH_PRECISION)
    if split_warning:
        say.warning("%s", split_warning)
    return schemes, demoted


def _ignored_and_format(
    model: nn.Module, modules: Mapping[str, nn.Module], schemes: Mapping[str, Any], layout: _ExpertsLayout,
    format: Optional[str],
) -> tuple[list[str], bool, Optional[str], str]:
    """The ignore list (linear layers and experts modules in high precision), whether the KV-cache scheme is declared,
    the format asked for (else the one the model was loaded from) and the quant_method it gives."""
    ignored = [f for f, m in modules.items() if is_linear(m) and f not in schemes
               or f in layout.modules and f not in layout.quantized]
    source = getattr(model, "_fp8fx_source", {})
    # KV-cache scales declared (kv_cache_scheme) where the model has them, unless they came from a checkpoint
    # that held them without declaring an fp8 KV cache: the saved one says what its source said
    kv = source.get("kv_cache", True) and any(m.__dict__.get("_fp8fx_kv_scales") for m in model.modules())
    fmt = format or (source.get("format") if source.get("format") in formats.WRITTEN_FORMATS else None)
    method = formats.quantization_config(schemes, ignored, kv, fmt)["quant_method"]
    if method == "compressed-tensors":  # its ignore list matches names exactly (or "re:"): experts written per
        # expert need their experts' modules too; fp8's ignored_layers covers the modules under an entry (fp8fx,
        # transformers), and vLLM skips the experts module itself (its FusedMoE layer)
        ignored += [n for f in ignored if f in layout.split and f not in layout.quantized
                    for n in moe_ckpt.per_expert_modules(f, layout.split[f], layout.names)]
    return ignored, kv, fmt, method


def _named_tensors(
    model: nn.Module, modules: Mapping[str, nn.Module], layout: _ExpertsLayout, demoted: list[str], method: str
) -> dict[str, torch.Tensor]:
    """The tensors to write under the model's names: experts written per expert split into theirs, the ``demoted``
    layers' weights dequantized without their scales, tied weights once, block scales named as ``method`` names
    them. Refuses two tensors that would take one name."""
    split = layout.split
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # saved name -> the state_dict name it comes from
    seen: set[tuple] = set()
    pending = dict(split)
    block_leaf = "weight_scale" if method == "compressed-tensors" else "weight_scale_inv"
    for raw, t in model.state_dict().items():
        name = _unwrapped(raw)
        owner, _, leaf = name.rpartition(".")
        if owner in split and leaf in _EXPERT_LEAVES:
            if owner in pending:  # all of its expert tensors at the first of them; any other tensor of it as it is
                for n, v in moe_ckpt.per_expert_tensors(owner, pending.pop(owner), block_leaf, layout.names).items():
                    _put(tensors, origin, n, v, raw)
            continue
        if owner in demoted and leaf in _SCALES:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen and t.numel():  # tied weights are stored once, under their first name
            continue
        seen.add(key)
        if owner in demoted and leaf == "weight":
            t = modules[owner].weight.contiguous()  # the fp8 layer's dequantized view, in its own dtype (a Conv1D's:
            # transposed, [in, out])
        if leaf == "weight_scale_inv" and method == "compressed-tensors":
            name = f"{owner}.weight_scale"
        if leaf == "prob_scale" and owner.rpartition(".")[2] == "self_attn" and leaf in modules[owner]._buffers:
            # the one name of a softmax scale vLLM reads (Fp8Config.get_cache_scale); its loaders remap k / v / q
            # scales on the attention but keep self_attn.prob_scale, a tensor its models have no place for
            name = f"{owner}.prob_output_scale"
        _put(tensors, origin, name, t.detach(), raw)
    return tensors


def _hub_named(
    model: nn.Module, tensors: dict[str, torch.Tensor], schemes: dict[str, Any], ignored: list[str],
    layout: _ExpertsLayout, say: logging.Logger = log,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """``tensors``, ``schemes`` and ``ignored`` in the hub's layout where transformers renames the model's MoE blocks
    (Mixtral's block_sparse_moe, GraniteMoE's input_linear for experts.gate_up_proj) and experts are written per
    expert or fused as the hub holds them; as they are otherwise."""
    if layout.split or layout.hub_fused:
        hub = renames.hub_names(model, set(tensors) | {f"{m}.weight" for m in (*schemes, *ignored)},
                                {f.rpartition(".")[0] for f in layout.modules}, say)
        if hub:
            tensors = {hub[n]: t for n, t in tensors.items()}
            schemes = {hub[f"{m}.weight"].rpartition(".")[0]: s for m, s in schemes.items()}
            ignored = [hub[f"{m}.weight"].rpartition(".")[0] for m in ignored]
    return tensors, schemes, ignored


def _with_vllm_expert_names(schemes: dict[str, Any], ignored: list[str], names: Mapping[str, str],
                            experts: Optional[set[str]] = None) -> tuple[dict[str, Any], list[str]]:
    """Per-expert modules written under the hub's projection names (Mixtral's ``experts.<e>.w1`` / ``w3`` / ``w2``)
    named once more, in ``schemes`` (compressed-tensors targets) and ``ignored``, as ``gate_proj`` / ``up_proj`` /
    ``down_proj``: the names vLLM looks an experts module's scheme up by (``<experts>.0.gate_proj``, ...), whatever
    the checkpoint calls them; compressed-tensors matches names exactly. Without them vLLM built fp8 experts over
    bf16 experts in the ignore list (no error), and refused a model of several schemes (no target matched).
    ``experts``: the per-expert module names to take (default: any ``<...>.<e>.<shard>`` name)."""
    alias = {names[shard]: proj for shard, proj in moe_ckpt.PROJ.items() if names[shard] != proj}

    def vllm_name(name: str) -> Optional[str]:
        owner, _, leaf = name.rpartition(".")
        parent, _, index = owner.rpartition(".")
        if experts is not None and name not in experts:
            return None
        return f"{owner}.{alias[leaf]}" if leaf in alias and parent and index.isdigit() else None

    more = {n: vllm_name(n) for n in (*schemes, *ignored)}
    more = {n: a for n, a in more.items() if a is not None and a not in schemes and a not in ignored}
    return ({**schemes, **{a: schemes[n] for n, a in more.items() if n in schemes}},
            [*ignored, *(more[n] for n in ignored if n in more)])


def _generation_text(model: nn.Module) -> Optional[str]:
    """generation_config.json of a transformers model that generates, as ``save_pretrained`` writes it (its
    differences from the defaults: eos_token_id, sampling settings), which ``from_pretrained``, ``meta_model`` and
    vLLM read; None for any other model."""
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is None or not hasattr(generation, "to_json_string") or not (callable(can_generate)
                                                                               and can_generate()):
        return None
    return generation.to_json_string(use_diff=True)


def _write_checkpoint(path: str, tensors: Mapping[str, torch.Tensor], max_shard_size: Optional[int],
                      config_text: str, generation_text: Optional[str] = None) -> None:
    """Write the shards (one file, or files of at most ``max_shard_size`` bytes), the index where there are several,
    config.json and generation_config.json (where the model has one): the only step that writes anything, run once
    every check has passed."""
    shards = [tensors] if max_shard_size is None else _split(tensors, max_shard_size)
    weight_map: dict[str, str] = {}
    total = 0
    with _staged(path, "save_checkpoint") as stage:  # a full disk, a kill: no partial checkpoint at path
        for i, shard in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(stage, file, shard, weight_map)
        _write_index(stage, weight_map, total)
        _write_text(stage, CONFIG, config_text)
        if generation_text is not None:
            _write_text(stage, GENERATION_CONFIG, generation_text)


def _unwrapped(name: str) -> str:
    """``name`` without the ``_orig_mod`` components of torch.compile wrappers (``layers.0._orig_mod.mlp``)."""
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def _put(tensors: dict, origin: dict, name: str, t: torch.Tensor, raw: str) -> None:
    """``tensors[name] = t``, refusing a name another tensor already took (two modules that differ only by a
    torch.compile wrapper's ``_orig_mod``)."""
    if name in tensors:
        raise ValueError(
            f"save_checkpoint: {origin[name]} and {raw} would both be saved as {name} (names are written without "
            "torch.compile's _orig_mod. components); rename one of the modules, or save the model before compiling "
            "its submodules (nothing was written)"
        )
    tensors[name], origin[name] = t, raw


def _fused_groups(names: Iterable[str]) -> list[list[str]]:
    """Sibling layers that engines run as one (``FUSED``: one parent's q/k/v_proj, gate/up_proj, MLA's q_a_proj and
    kv_a_proj_with_mqa), two or more."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        for fused, parts in FUSED.items():
            if child in parts:
                groups.setdefault((parent, fused), []).append(name)
    return [members for members in groups.values() if len(members) > 1]


def _split_groups(modules: Mapping[str, nn.Module], schemes: Mapping[str, Any]) -> tuple[list[str], str]:
    """The fp8 linears to write in high precision: those of a fused group (``_fused_groups``) with members left in
    high precision (k/v_proj a weight block does not divide): vLLM refuses a layer it fuses from shards of two
    precisions ("some but not all shards ... are quantized") and loads one the ignore list names whole; and the
    warning that says so ("" if none), for the caller to log once it knows it writes them. Members quantized with
    different schemes, which vLLM refuses as well, are refused here."""
    demoted: list[str] = []
    why: list[str] = []
    ignored: list[str] = []  # members kept in high precision by the user's ignored_layers
    unfit = False  # members kept by the scheme (a weight block that does not divide them)
    for group in _fused_groups(f for f, m in modules.items() if isinstance(m, nn.Linear)):
        quantized = [f for f in group if f in schemes]
        kept = [f for f in group if f not in schemes]
        if quantized and kept:
            demoted += quantized
            reasons = {f: getattr(modules[f]._parameters.get("weight"), "_fp8fx_skip_reason", None) for f in kept}
            ignored += [f for f, r in reasons.items() if r == "in ignored_layers"]
            unfit = unfit or any(r != "in ignored_layers" for r in reasons.values())
            why.append(f"{kept[0]}: {reasons[kept[0]] or 'not quantized'}")
        elif len({schemes[f] for f in quantized}) > 1:
            raise ValueError(
                f"save_checkpoint: {', '.join(f'{f} ({schemes[f]})' for f in quantized)} are quantized differently, "
                f"but engines run them as one layer of one scheme (vLLM refuses the checkpoint); quantize them with "
                "one config (nothing was written)"
            )
    if not demoted:
        return demoted, ""
    listed = ", ".join(ignored[:3]) + (f" and {len(ignored) - 3} more" if len(ignored) > 3 else "")
    fixes = [f"remove {listed} from ignored_layers (or, to keep the groups in high precision without this "
             "warning, add their other layers to it)"] if ignored else []
    if unfit:
        fixes.append("quantize with a scheme every layer of the group takes (e.g. a weight block dividing their sizes)")
    more = f"; and {len(why) - 1} more groups" if len(why) > 1 else ""
    return demoted, (f"fp8fx: save_checkpoint writes {', '.join(demoted)} in high precision (dequantized from fp8) and "
                     "in the ignore list: engines run each as one layer with the others of its fused group, which "
                     f"stay in high precision ({why[0]}{more}); to keep them fp8, {'; '.join(fixes)}")


def _split(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_shard(path: str, file: str, tensors: Mapping[str, torch.Tensor], weight_map: dict) -> int:
    """Write one safetensors file; record its tensors in ``weight_map``; return its data bytes."""
    write_file(os.path.join(path, file), tensors, metadata={"format": "pt"})
    weight_map.update({name: file for name in tensors})
    return sum(t.numel() * t.element_size() for t in tensors.values())


_STAGE = ".fp8fx-partial-"  # in the name of the folder a save or convert writes in before it is done


@contextlib.contextmanager
def _staged(path: str, what: str):
    """The folder to write ``path``'s files in: a new one, which becomes ``path`` when the block ends (renamed to it
    where ``path`` does not exist; where it is an empty folder, made inside it, its files moved up: the same file
    system, a mount point too). A process killed on the way (a SIGTERM: timeout, Slurm, docker stop) leaves
    ``path`` as it was, and the hidden ``*.fp8fx-partial-*`` folder, which a new run warns about and ignores; an
    exception (a full disk, NaN in a later file, Ctrl-C) removes the folder and the parents ``what`` made. A folder
    whose run is writing now (its lock held: ``_hold``) stops a second run into ``path`` before it writes."""
    path = os.path.abspath(path)
    exists = os.path.isdir(path)
    if not exists and os.path.lexists(path):  # a broken link (a file was refused before): refused before writing
        raise FileExistsError(17, f"{what}: cannot make the directory {path}: it is "
                              f"{'a broken link' if os.path.islink(path) else 'a file'}; pass a new or empty "
                              "directory where you can write (nothing was written)")
    parent, name = (path, "") if exists else os.path.split(path)
    created = _make_dirs(parent, what, path)
    prefix = f".{name}{_STAGE}" if name else _STAGE
    leftovers = sorted(f for f in os.listdir(parent) if f.startswith(prefix))
    live = [f for f in leftovers if _writing(os.path.join(parent, f))]
    if live:  # two runs into one DST: the later one failed at its end, or their files mixed in an existing folder
        _remove_empty(created)
        raise FileExistsError(17, f"{what}: another run is writing {path} now (in {os.path.join(parent, live[0])}): "
                              "wait for it to end, or pick another directory (nothing was written)")
    if leftovers:  # (none live: their runs were stopped)
        log.warning("fp8fx: %s: %s holds %s, left by a %s that was stopped on the way: remove it (this one writes "
                    "a folder of its own)", what, parent, ", ".join(leftovers), what)
    stage = os.path.join(parent, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
    lock = None
    try:
        _make_dirs(stage, what, shown=path)
        lock = _hold(stage)
        try:
            yield stage
        except OSError as e:
            # a write into the folder (the OS error alone named no file, or the hidden folder, and no fix: h135); a
            # read of the source (shutil.copy2's: the source file, then the destination) is left as it is (h139)
            written = [f for f in (e.filename, e.filename2) if isinstance(f, str)
                       and os.path.commonpath([os.path.abspath(f), stage]) == stage]
            if e.errno not in _WRITE_ERRORS or (e.filename is not None and not written):
                raise
            file = os.path.join(path, os.path.relpath(written[0], stage)) if written else path
            raise type(e)(e.errno, f"{what}: writing {file} failed: {e.strerror or e}; free space, or pick another "
                          "directory where you can write (nothing was written)") from None
        lock = _release(lock, stage)
        if exists:
            names = os.listdir(stage)
            clash = [f for f in names if os.path.lexists(os.path.join(path, f))]
            if clash:  # (the folder held none of them when this run began: save and convert refuse that)
                raise FileExistsError(17, f"{what}: {clash[0]} appeared in {path} while this run wrote (another run "
                                      f"into the same directory?): this run's files were removed, {path}'s kept")
            # config.json last: a run killed between two moves leaves no config.json beside the moved shards, which
            # readers need to take them for a checkpoint. A move that fails (a full disk growing the directory,
            # Ctrl-C) takes back the files moved before it: they were left in the folder, a partial checkpoint (an
            # index naming a shard not moved, shards without config.json) that every later save and convert into it
            # refused as holding files
            order, moved = sorted(names, key=lambda f: f == CONFIG), []
            try:
                for f in order:
                    os.replace(os.path.join(stage, f), os.path.join(path, f))
                    moved.append(f)
            except BaseException as e:
                for f in moved:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(path, f))
                if not isinstance(e, OSError):
                    raise
                failed = os.path.join(path, order[len(moved)])
                raise type(e)(e.errno, f"{what}: moving {failed} into place failed: {e.strerror or e}; free space, "
                              "or pick another directory where you can write (nothing was written)") from None
            os.rmdir(stage)
        else:
            try:
                os.rename(stage, path)
            except OSError:
                if not os.path.lexists(path):
                    raise
                raise FileExistsError(17, f"{what}: {path} was made by another process while this run wrote (another "
                                      f"run into the same directory?): this run's files were removed, {path} is "
                                      "theirs") from None
    except BaseException:
        _release(lock, stage)
        shutil.rmtree(stage, ignore_errors=True)
        _remove_empty(created)
        raise


# an OS error of a write into the folder (no space, a file too large, no quota, read-only, no permission, I/O error):
# said with the file meant and the fix
_WRITE_ERRORS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}

_LOCK = ".fp8fx-writing"  # in a stage folder while its run writes: a lock that run holds (``_hold``)


def _hold(stage: str):
    """An exclusive lock on a file in ``stage``, held while this run writes there: another run tells a live writer's
    folder from one a stopped run left by whether it gets the lock (the system drops it when its process ends,
    however it ends: no process number, which a later process, another machine or a container's pid 1 reuses). None
    where the system has no ``flock`` (every leftover is then taken as stopped)."""
    if fcntl is None:
        return None
    fd = os.open(os.path.join(stage, _LOCK), os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _release(lock, stage: str) -> None:
    """Lets ``_hold``'s lock go and removes its file (before the stage's files become the checkpoint); None."""
    if lock is not None:
        os.close(lock)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(stage, _LOCK))
    return None


def _writing(folder: str) -> bool:
    """Whether a run holds ``folder``'s lock (``_hold``) now: it is writing there."""
    if fcntl is None:
        return False
    try:
        fd = os.open(os.path.join(folder, _LOCK), os.O_RDONLY)
    except OSError:  # no lock file: its run was stopped before it took one, or after it let go
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (BlockingIOError: held)
        return True
    finally:
        os.close(fd)  # (and with it the lock this call may have taken)
    return False


def _remove_empty(folders: list[str]) -> None:
    """Remove the folders (``_make_dirs``' list, deepest first) that are empty: those a failed write made."""
    for folder in folders:
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def _make_dirs(path: str, what: str, shown: Optional[str] = None) -> list[str]:
    """``os.makedirs(path)``; the folders it made, deepest first. An error names the directory of ``what``
    (save_checkpoint's path, convert's DST: ``shown``, where ``path`` is its parent) and the fix, with the OS error's
    type."""
    made, head = [], os.path.abspath(path)
    while not os.path.isdir(head):
        made.append(head)
        head = os.path.dirname(head)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _remove_empty(made)  # (those made before the error)
        blocker = next((p for p in reversed(made) if os.path.lexists(p)), None)  # a file, or a link to nothing
        why = (f"{blocker} is {'a broken link' if os.path.islink(blocker) else 'a file'}" if blocker
               else e.strerror or str(e))
        raise type(e)(e.errno, f"{what}: cannot make the directory {shown or path}: {why}; pass a new or empty "
                      "directory where you can write (nothing was written)") from None
    return made


def _write_index(path: str, weight_map: Mapping[str, str], total: int) -> None:
    """The index, where loaders need one: several files, or one not named ``model.safetensors`` (convert keeps a
    source's ``model-00001-of-00001.safetensors``, which transformers finds through the index only)."""
    if set(weight_map.values()) - {"model.safetensors"}:
        index = {"metadata": {"total_size": total}, "weight_map": dict(weight_map)}
        _write_text(path, INDEX, json.dumps(index, indent=2))


def _write_text(path: str, file: str, text: str) -> None:
    with open(os.path.join(path, file), "w") as f:
        f.write(text)


def _config_text(config_json: Any, qc: dict, what: str) -> str:
    """config.json's text: ``config_json`` with ``qc`` as its quantization_config, checked before the caller writes
    anything (a value json cannot write would otherwise fail after the shards, leaving a checkpoint without it)."""
    if not isinstance(config_json, Mapping):
        raise ValueError(f"{what}: config_json must be a mapping (the rest of config.json), got "
                         f"{type(config_json).__name__}")
    config = dict(config_json)
    config["quantization_config"] = qc
    try:
        return json.dumps(config, indent=2, sort_keys=True, default=str)
    except (TypeError, ValueError) as e:  # a non-string key, a circular reference
        raise ValueError(f"{what}: config_json cannot be written as JSON: {e}") from None


def meta_model(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The HF transformers model that ``path/config.json`` describes, built on the meta device (no memory), in
    ``dtype`` (default: the config's dtype, else bf16): the class its ``architectures`` names (a ``BertModel``, a
    ``T5ForConditionalGeneration``), else the causal LM of its model type. Needs transformers."""
    try:
        import transformers
    except ImportError:  # (fp8fx does not depend on it)
        raise ImportError("fp8fx.checkpoint.meta_model (convert's default model) builds the model with transformers: "
                          "pip install transformers, or pass convert(model=...)") from None

    where = os.path.join(os.fspath(path), CONFIG)
    if not os.path.isfile(where):
        raise CheckpointError(f"meta_model: {where} does not exist; pass a checkpoint's folder (one with config.json)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise ValueError(f"meta_model(dtype={dtype!r}): a floating-point torch.dtype of 16 bits or more "
                         "(torch.bfloat16, torch.float16, torch.float32) or None for the config's (an 8-bit float is "
                         "the fp8 checkpoint's, not the model's)")
    try:  # (transformers' own errors for a bad field: a dataclass validation error, a ZeroDivisionError, ...)
        cfg = transformers.AutoConfig.from_pretrained(os.fspath(path))
        dtype = dtype or getattr(cfg, "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        named = [getattr(transformers, a, None) for a in getattr(cfg, "architectures", None) or ()]
        # (a class of this config's: a fine-tune may keep its base's architectures, a Mistral config naming Llama)
        cls = next((c for c in named if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
                    and isinstance(cfg, c.config_class)), None)
        with torch.device("meta"):
            if cls is not None:  # (the class the checkpoint was saved from: its names are the checkpoint's)
                model = cls._from_config(cfg, dtype=dtype).eval()
            else:
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    except Exception as e:  # noqa: BLE001 - named for the user below, the original chained
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{where}: transformers cannot build the model it describes ({type(e).__name__}: "
                              f"{first}); fix the config, or build the model yourself (convert(model=...), "
                              "load_checkpoint(model, ...))") from e
    # generation_config.json, as from_pretrained reads it (its eos_token_id, sampling settings: generate() ran with
    # the defaults built from config.json); one transformers cannot read is said, and left, as from_pretrained does
    generation = os.path.join(os.fspath(path), GENERATION_CONFIG)
    if os.path.isfile(generation) and model.can_generate():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(os.fspath(path))
        except Exception as e:  # noqa: BLE001 - transformers' own error, said; the model is built
            log.warning("fp8fx: meta_model: %s not read (%s: %s); generate() takes the defaults config.json gives",
                        generation, type(e).__name__, first_line(e, 200))
    return model


def convert(
    src: Union[str, os.PathLike],
    dst: Union[str, os.PathLike],
    config: Optional[Fp8Config] = None,
    *,
    model: Optional[nn.Module] = None,
    format: Optional[str] = None,
    fused: Optional[Mapping[str, Any]] = None,
    key_mapping: Optional[Mapping[str, str]] = None,
    quantize_lm_head: bool = False,
    progress: bool = True,
) -> LoadReport:
    """Turn the bf16/fp16 safetensors checkpoint in ``src`` into an FP8 one in ``dst``, one file at a time.

    ``config``: the online scheme (default ``Fp8Config()``: per-channel weights, per-token activations;
    dynamic activations only). ``model``: which tensors are linear weights (default: ``meta_model(src)``,
    which needs transformers). Each linear weight is quantized on its own, with its own scale, under its
    checkpoint name (``load_checkpoint`` fuses shards). Layers the config ignores, tied weights and
    weights a block does not divide stay bf16 and go to the new config's ignore list, and so do the layers
    engines fuse with them (``q_proj`` of a ``k_proj`` / ``v_proj`` kept bf16: vLLM refuses a fused layer of two
    precisions). The model's output embeddings (``lm_head``) stay bf16 unless ``quantize_lm_head``: vLLM reads an
    fp8 checkpoint's ``lm_head`` as bf16 (an embedding to it, no linear layer), so an fp8 one loads in fp8fx and
    transformers (which reads it as written, h138), not vLLM. Output files mirror the input's; other files of
    ``src`` (tokenizer, ...) are copied; folders, pickles and safetensors files outside the index are not (a warning
    names them).
    MoE experts (modules with 3-D ``gate_up_proj`` / ``down_proj``) are quantized per expert in the layout
    the checkpoint has: per-expert ``<experts>.<e>.gate_proj.weight`` (or ``w1`` ...) with their own
    ``weight_scale`` / ``weight_scale_inv`` (per-tensor: an expert's gate and up one, the larger of their two, the
    one w13 scale fused_moe takes: the load rounds nothing again), or fused ``gate_up_proj`` / ``down_proj`` with
    ``gate_up_proj_scale[_inv]`` ... (``fp8fx.checkpoint.experts``); experts the config ignores (or cannot
    quantize) stay bf16 and their checkpoint modules go to the ignore list. Checkpoint names are matched to
    the model's through transformers' renames and ``key_mapping``, as ``load_checkpoint`` does (hub Mixtral's
    ``block_sparse_moe.experts.<e>.w1`` are ``mlp.experts``' in transformers 5), and written back as stored:
    the output keeps the input's layout, which transformers and vLLM load - but fused experts stored transposed
    (GPT-OSS's [E, H, 2I]), which are written in fused_moe's layout, with a warning, as ``save_checkpoint`` writes
    them.
    Peak memory: one output file plus one bf16 tensor (two: an expert's gate and up, per-tensor). Returns a
    ``LoadReport`` (checkpoint module names; ``experts``: the experts modules quantized).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    config = config_or(config, Fp8Config(), "convert")
    if config.is_checkpoint_fp8_serialized or config.activation_scheme != "dynamic":
        raise ValueError(
            "convert quantizes bf16 weights with dynamic activations: use "
            f"{online_fix('config', activation_scheme=repr('dynamic'))} (the config's weight scheme); static "
            "activation scales need fp8fx.calibrate on a built model"
        )
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"convert: dst {dst} is src; write the fp8 checkpoint to a new directory")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ValueError(f"convert: dst {dst} is a file; pass a new or empty directory")
    held = sorted(f for f in os.listdir(dst) if not f.startswith(_STAGE)) if os.path.isdir(dst) else []
    if held:  # its config.json, tokenizer, ... would be overwritten (a stopped convert's folder: warned about)
        raise ValueError(f"convert: {dst} already holds files ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
                         "; pass an empty or new directory")
    config_json = read_config(src)
    if config_json.get("quantization_config") is not None:
        key = quantization_config_of(read_json(os.path.join(src, CONFIG)))[0]  # (None: hf_quant_config.json's)
        where = (f"config.json already has a {key}" if key is not None else
                 "hf_quant_config.json holds ModelOpt's quantization config")
        raise CheckpointError(f"{src}/{where}; convert takes a bf16/fp16 checkpoint")
    files, entries = read_checkpoint(src)
    _check_high_precision(entries, src)
    model = model if model is not None else meta_model(src)
    entries, sources = renames.apply(entries, renames.resolve(model, key_mapping, "convert", entries), src)
    check_checkpoint_ignores(config, model, entries, f"the checkpoint {src} (or its model)", "written")
    config = ignoring_every_name(renames.with_stored_ignores(config, sources), model)  # (model.b = model.a)
    if type(quantize_lm_head) is not bool:
        raise TypeError(f"convert: quantize_lm_head={quantize_lm_head!r} is not True or False")
    head = output_embeddings(model, dict(model.named_modules())) if quantize_lm_head else None
    if head is not None and config.is_ignored(head):  # (the ignore list won, unsaid)
        raise ValueError(f"convert: quantize_lm_head=True (--quantize-lm-head) asks for {head} in fp8, and the ignore "
                         "list (ignored_layers, --ignore) keeps it in bf16: drop one of the two (nothing was written)")
    _check_model_state(model, entries, src)
    cut_entries, cut_into = renames.cut(entries, model, src)  # (convert writes the stored tensors: not cut, bf16)
    plan = _convert_plan(model, entries, config, dict(FUSED if fused is None else fused), quantize_lm_head, cut_into)
    # (every name of a module: a checkpoint may hold experts registered twice under either)
    expert_plan, expert_tensors, experts = moe_ckpt.convert_plan(dict(model.named_modules(remove_duplicate=False)),
                                                                 entries, config)
    plan.update(expert_plan)
    schemes = {m: config.scheme() for m, reason in plan.items() if not reason}
    # the new quantization_config, the report, this refusal and the tensors under the checkpoint's names (the
    # refusal named hub Mixtral's experts model.layers.0.mlp.experts.0.w1: the model's container, the file's leaf)
    stored = functools.partial(renames.stored, sources=sources)
    plan = {s: r for m, r in plan.items() for s in stored(m)}
    if not schemes:
        why = _plan_summary(plan) if plan else (f"{type(model).__name__} has no nn.Linear (or experts module) whose "
                                                "weight the checkpoint holds")
        raise ValueError(f"convert: no linear weight of {src} can be quantized with {config.scheme()}: {why}")
    expert_plan = {s: r for m, r in expert_plan.items() for s in stored(m)}
    schemes = {s: scheme for m, scheme in schemes.items() for s in stored(m)}
    ignored = sorted(m for m, r in plan.items() if r)
    # an experts module kept bf16 is named itself too, as save_checkpoint names it: vLLM skips its FusedMoE layer by
    # that name, and inspect read the experts of per-expert names only as fp8
    ignored += sorted(s for f, reason in experts.items() if reason for s in stored(f) if s not in ignored)
    qc = formats.quantization_config(schemes, ignored, False, format)
    if qc["quant_method"] == "compressed-tensors":  # (the experts' stored names: Mixtral's w1 / w3 / w2, or PROJ's)
        named = _with_vllm_expert_names(schemes, ignored, {shard: shard for shard in moe_ckpt.PROJ}, set(expert_plan))
        qc = formats.quantization_config(*named, False, format)
    _warn_per_tensor_fp8(qc, "convert", "--format compressed-tensors (format='compressed-tensors')")
    _warn_block_experts_ct(qc, sorted(f for f, r in experts.items() if not r) if isinstance(config.weight, PerBlock)
                           else [], "convert", "--format fp8 (format='fp8')")
    block_inv = qc["quant_method"] == "fp8" and isinstance(config.weight, PerBlock)
    scale_name = "weight_scale_inv" if block_inv else "weight_scale"
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # the source's, as read
    source = "/".join(short[d] for d in short if any(e.dtype == d for e in entries.values())) or "bf16"
    report = LoadReport(src, f"{source} -> {qc['quant_method']} ({config.scheme()})")
    report.quantized = {m: str(s) for m, s in schemes.items() if m not in expert_plan}
    report.experts = {s: str(config.scheme()) for f, reason in experts.items() if not reason for s in stored(f)}
    report.not_quantized = {m: r for m, r in plan.items() if r}
    _check_convert_names(entries, schemes, expert_tensors, scale_name, src)
    # what load_checkpoint's plan refuses in this source it refuses in the output, which holds the same tensors but
    # for the linear weights' codes and scales: a tensor of no place (a bias of a bias-less layer), a dtype the model
    # cannot take, a KV-cache scale of a module that is no attention. Planned on the meta device: nothing is read
    # or staged, the model is not changed (convert's own checks above name its own fixes first)
    dry = _Loader(model, formats.QuantFormat("none", config, sources=sources), torch.device("meta"),
                  dict(FUSED if fused is None else fused), dry=True)
    with planning():  # (create_weights on meta: nothing loads)
        dry.plan(cut_entries)
    kv_scales = {e.name for e in dry.kv_entries.values()}  # their values are checked as they are read (below)

    for key in dry.tied_copies:  # a tied tensor stored under two names: the same values, as load checks (the two
        loads = dry.tied_source(key)  # read before anything is written, a pair at a time: a vocab-sized pair at most)
        compare_tied(cut_entries[loads], loads, read_tensor(cut_entries[loads]), cut_entries[key], key,
                     read_tensor(cut_entries[key]))
    flipped = sorted({f for n, f in expert_tensors.items() if len(entries[n].shape) == 3
                      and moe_ckpt.in_model_layout(model.get_submodule(f), entries[n].dtype)})
    if flipped:  # (as save_checkpoint says it; the docstring's "keeps the input's layout" had no exception)
        log.warning("fp8fx: convert writes the fp8 experts of %s in fused_moe's layout, [E, 2I, H] / [E, H, I], not "
                    "the source's transposed [E, H, 2I] / [E, I, H]: fp8fx.load_checkpoint reads them back; a reader "
                    "that takes fused experts in the model's layout (transformers' from_pretrained) would not",
                    _shown(flipped))
    config_text = _config_text(config_json, qc, "convert")
    partners = moe_ckpt.w13_partners(expert_tensors) if isinstance(config.weight, PerTensor) else {}
    partner_scales: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0
    # e.g. NaN in a later file, a full disk, a kill (timeout's or Slurm's SIGTERM): no partial checkpoint at dst
    with _staged(dst, "convert") as stage:
        for file in _progress(files, progress, "fp8fx: converting"):
            out: dict[str, torch.Tensor] = {}
            for entry in sorted((e for e in entries.values() if e.file == file), key=lambda e: e.start):
                t = read_tensor(entry)
                report.tensors += 1
                report.bytes_read += entry.nbytes
                name = entry.source or entry.name  # as stored
                if entry.name in kv_scales:  # (load_checkpoint's check: 0, <0, subnormal, NaN, Inf)
                    try:
                        check_kv_scale(entry.name, t)
                    except ValueError as e:
                        raise CheckpointError(str(e)) from None
                owner = name.rpartition(".")[0]
                leaf = entry.name.rpartition(".")[2]  # the model's (key_mapping may rename a leaf: .kernel -> .weight)
                if entry.name in expert_tensors:
                    moe_ckpt.check_finite(entry, t, expert_tensors[entry.name])
                    if t.dim() == 3:  # fused [E, rows, cols]: per-expert scales under the fused names
                        if moe_ckpt.in_model_layout(model.get_submodule(expert_tensors[entry.name]), t.dtype):
                            t = t.transpose(1, 2)  # fused_moe's layout is written (as save_checkpoint)
                        out[name], out[name + scale_name[len("weight"):]] = moe_ckpt.quantize_fused(t, config)
                        del t
                        continue
                elif leaf != "weight" or owner not in schemes:
                    out[name] = t
                    continue
                bad = 0 if entry.name in expert_tensors else chunked.count_nonfinite(t)
                if bad:
                    raise CheckpointError(f"{entry} has {bad} NaN/Inf values; fix it or add {owner!r} to "
                                          f"ignored_layers (--ignore {owner})")
                shared = None  # an expert's gate and up, per-tensor: one scale (moe_ckpt.w13_partners)
                if entry.name in partners:
                    shared = partner_scales.pop(entry.name, None)
                    if shared is None:  # the first of the two: the other is read for its scale (and read again)
                        other = entries[partners[entry.name]]
                        u = read_tensor(other)
                        moe_ckpt.check_finite(other, u, expert_tensors[other.name])
                        shared = torch.maximum(chunked.per_tensor_scale(t), chunked.per_tensor_scale(u))
                        partner_scales[other.name] = shared
                        del u
                q, scale = chunked.quantize(t, config.weight.block, scale=shared)
                del t
                out[name] = q
                out[f"{owner}.{scale_name}"] = scale.reshape(1) if isinstance(config.weight, PerTensor) else scale
            total += _write_shard(stage, os.path.basename(file), out, weight_map)
            del out
        _write_index(stage, weight_map, total)
        left = []  # what is not carried over, said (a folder: an original/ of another format, a tokenizer's)
        for f in sorted(os.listdir(src)):
            full = os.path.join(src, f)
            if _STAGE in f:  # (this convert's own staging folder, where dst is inside src)
                continue
            # (safetensors files the index does not name: an adapter's, Mistral's consolidated.safetensors)
            if os.path.isdir(full) or f.endswith(_PICKLES) or f.endswith(".safetensors") and full not in files:
                left.append(f + "/" if os.path.isdir(full) else f)
            elif not os.path.exists(full):  # a link to nothing (a cleared cache's tokenizer.json)
                left.append(f"{f} (a broken link)")
            elif os.path.isfile(full) and not (f.endswith((".safetensors", INDEX_SUFFIX)) or f == CONFIG):
                shutil.copy2(full, os.path.join(stage, f))
        _write_text(stage, CONFIG, config_text)
    if left:
        log.warning("fp8fx: convert did not copy %s from %s (folders, pickled weights and safetensors files outside "
                    "the checkpoint's index are not carried over): copy what the converted checkpoint needs by hand",
                    ", ".join(left), src)
    log.info(
        "fp8fx: converted %s -> %s: %d linear weights and %d experts modules quantized",
        src, dst, len(report.quantized), len(report.experts),
    )
    return report


def _check_model_state(model: nn.Module, entries, src: str) -> None:
    """Refuses, before anything is written, what ``load_checkpoint`` would refuse in the output for the tensors that
    are not linear or expert weights convert plans: a tensor of another shape than the model's of that name (a config
    of other sizes), and a parameter of another module (an embedding, a norm) that no tensor holds, under any of its
    tied names (a --rename that missed it). Linear layers are checked by the plan (fused and cut ones too), experts
    by theirs."""
    state = model.state_dict(keep_vars=True)
    for name, entry in entries.items():
        target = state.get(name)
        if target is not None and tuple(entry.shape) != tuple(target.shape):
            raise CheckpointError(f"{entry}: the model's {name} has shape {list(target.shape)}; a config.json of "
                                  "other sizes, or the wrong checkpoint (nothing was written)")
    names = _parameter_names(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    # what transformers lets be missing (Marian's sinusoidal embed_positions), which load_checkpoint computes with the
    # model's _init_weights: regexes of names
    unsaved = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    missing = [keys[0] for keys in names.values()
               if not any(k in entries for k in keys)
               and not any(isinstance(modules[k.rpartition(".")[0]], nn.Linear) or state[k].dim() == 3
                           or any(re.search(p, k) for p in unsaved) for k in keys)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"convert: the model's {missing[0]} has no tensor in the checkpoint{more}; a checkpoint its config.json "
            "does not describe, a missing shard, or names to map with --rename (key_mapping=); nothing was written"
        )


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """id() of each parameter of ``model`` -> its names (several where tied: lm_head.weight and embed_tokens.weight)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _check_high_precision(entries, src: str) -> None:
    """Refuses an fp8 tensor in convert's source (an fp8 checkpoint without a quantization_config, whose output no
    loader could read), before the plan, which would call its every layer unquantizable."""
    for entry in entries.values():
        if entry.dtype.is_floating_point and entry.dtype.itemsize == 1:
            raise CheckpointError(
                f"{entry}: an fp8 tensor, but {src}/config.json has no quantization_config: convert takes a "
                "bf16/fp16/fp32 checkpoint; an fp8 checkpoint needs its quantization_config to be loaded as stored"
            )


def _plan_summary(plan: Mapping[str, str], shown: int = 2) -> str:
    """Why no layer can be quantized, by reason: its count and the first ``shown`` layers (the plan's every layer
    made one line of tens of KB)."""
    by_reason: dict[str, list[str]] = {}
    for fqn, reason in plan.items():
        by_reason.setdefault(reason, []).append(fqn)
    parts = [f"{len(f)} layer{'s' * (len(f) > 1)} ({', '.join(f[:shown])}{', ...' if len(f) > shown else ''}): "
             f"{reason}" for reason, f in sorted(by_reason.items(), key=lambda item: -len(item[1]))]
    return "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more reasons" if len(parts) > 4 else "")


def _check_convert_names(entries, schemes, expert_tensors, scale_name: str, src: str) -> None:
    """Refuses, before anything is written, a tensor under a name that a scale convert writes would take (a stale
    ``weight_scale`` beside a bf16 weight: one of the two would be lost, and loading would scale the weight by the
    wrong one, silently), or any other scale but a KV-cache one (a stray ``input_scale`` was copied through, into a
    checkpoint whose config says dynamic activations: no loader read it)."""
    stored = {e.source or e.name for e in entries.values()}
    for entry in entries.values():
        name = entry.source or entry.name
        owner, leaf = name.rpartition(".")[0], entry.name.rpartition(".")[2]
        if entry.name in expert_tensors:
            out = name + scale_name[len("weight"):] if len(entry.shape) == 3 else f"{owner}.{scale_name}"
        elif leaf == "weight" and owner in schemes:
            out = f"{owner}.{scale_name}"
        else:
            continue
        if out in stored:
            raise CheckpointError(
                f"{src}: {out} is already in the checkpoint, beside the bf16 weight {name} that convert quantizes "
                f"and whose new scale it writes under that name; remove the stale tensor from the checkpoint "
                f"(or add {owner!r} to ignored_layers: --ignore {owner})"
            )
    for entry in entries.values():  # (load_checkpoint refuses the source for it too; convert copied it through)
        name = entry.source or entry.name
        if _looks_like_scale(name) and name.rpartition(".")[2] not in KV_SCALE_NAMES:
            raise CheckpointError(
                f"{entry}: a scale in a checkpoint without a quantization_config ({src}/config.json), which no layer "
                "of the converted checkpoint would take (its config says what convert writes); remove the tensor"
            )


def _convert_plan(model: nn.Module, entries, config: Fp8Config, fused, quantize_lm_head: bool,
                  cut_into: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """Checkpoint module of every linear weight -> "" to quantize it, else why it stays bf16. ``cut_into``: the
    model's modules -> the checkpoint's that transformers cuts into them (``renames.cut``)."""
    modules = dict(model.named_modules(remove_duplicate=False))  # (a module's every name: model.b = model.a)
    first = {f: n[0] for n in module_names(model).values() for f in n}  # (the name the rules below know)
    linears = {f: m for f, m in modules.items() if is_linear(m)}  # (nn.Linear, and transformers' Conv1D: GPT-2's)
    head = output_embeddings(model, dict(model.named_modules())) if not quantize_lm_head else None
    routers = moe.routers(model)
    kept = kept_by_the_model(model)  # (_keep_in_fp32_modules: bf16, as quantize_ and load_checkpoint keep them)
    names = _parameter_names(model)
    # a weight of several modules is tied; one module's several names are not (quantized once, as the loader does)
    uses = {key: len({id(modules[n.rpartition(".")[0]]) for n in tied}) for key, tied in names.items()}
    plan = {}
    covered = {f for f in cut_into if f in linears}  # the model's linears a checkpoint weight loads into
    cuts: dict[str, list[str]] = {}
    for part, owners in cut_into.items():
        for owner in owners:
            cuts.setdefault(owner, []).append(part)
    for name, entry in entries.items():
        owner, _, leaf = name.rpartition(".")
        parent, _, child = owner.rpartition(".")
        fused_into = [f"{parent}.{f}" if parent else f for f, parts in fused.items() if child in parts]
        fqn = owner if owner in linears else next((f for f in fused_into if f in linears), None)
        if leaf == "weight" and fqn is not None:
            covered.add(fqn)
        if leaf == "weight" and owner in cuts:
            # one tensor here, several layers in the model: quantized as one, a per-tensor scale would span the
            # layers and a block of rows could straddle a cut that no loader could then make
            plan[owner] = (f"transformers cuts it into {', '.join(cuts[owner])} as it loads (written as stored); "
                           "load_checkpoint quantizes the parts: load the bf16 checkpoint, then save_checkpoint")
            continue
        if leaf == "weight" and fqn is None and len(entry.shape) == 2 and owner not in modules:
            # a checkpoint weight no module of the model has (a name the renames did not map: --rename): written as
            # stored, in the ignore list, and reported (it was left bf16 under a config that claimed every Linear)
            plan[owner] = "no module of the model has this weight (written as stored); map its name with --rename"
            continue
        if leaf != "weight" or fqn is None:
            continue
        w = config.weight
        if config.is_ignored(owner) or config.is_ignored(fqn):
            reason = "in ignored_layers"
        elif uses[id(linears[fqn]._parameters["weight"])] > 1:
            reason = "weight tied to another parameter"
        elif first[fqn] in routers:
            reason = routers[first[fqn]]
        elif first[fqn] in kept:
            reason = kept[first[fqn]]
        elif first[fqn] == head:
            reason = ("the output embeddings: vLLM loads lm_head in bf16 only (quantize_lm_head=True, "
                      "--quantize-lm-head: fp8, for fp8fx and transformers)")
        elif len(entry.shape) != 2 or entry.dtype not in quant.HIGH_PRECISION:
            reason = f"{entry} is not a 2-D bf16/fp16/fp32 weight"
        elif is_conv1d_class(type(linears[fqn])):
            reason = CONV1D_IN_HIGH_PRECISION
        elif isinstance(w, PerBlock) and (entry.shape[0] % w.block_n or entry.shape[1] % w.block_k):
            reason = f"weight {list(entry.shape)} is not divisible by the {w.block_n}x{w.block_k} block"
        else:
            reason = ""
        plan[owner] = reason
    out = output_embeddings(model, dict(model.named_modules()))
    weight = linears[out]._parameters["weight"] if out in linears else None
    if weight is not None and out not in covered and uses[id(weight)] > 1:  # stored as another tensor (tied)
        # in the plan either way: its config's ignore list names it, or a loader of compressed-tensors (targets:
        # every Linear) took the head for an fp8 layer whose scale is missing, and made its logits NaN (h135)
        tied = next((n for n in names[id(weight)] if n != f"{out}.weight"), "another parameter")
        plan[out] = (f"tied to {tied}, which the checkpoint stores for both (not a linear weight of it): not "
                     "quantized" + (", quantize_lm_head notwithstanding" if quantize_lm_head else ""))
        if quantize_lm_head:  # (asked for by name: said, not skipped)
            log.warning("fp8fx: convert: quantize_lm_head: %s %s", out, plan[out])
    # a linear of the model without its weight in the checkpoint (a tied one may leave it out): its output would not
    # load (load_checkpoint refuses it), so nothing is written (a name the renames missed: --rename / key_mapping)
    held = {id(linears[f]) for f in covered if f in linears}  # (a module held under any of its names)
    missing = [f for f, m in linears.items() if id(m) not in held and uses[id(m._parameters["weight"])] == 1]
    if missing:
        raise CheckpointError(
            f"convert: the model's linear layer {missing[0]} has no weight in the checkpoint ({missing[0]}.weight"
            f"{f' and {len(missing) - 1} more layers' if len(missing) > 1 else ''}); a checkpoint its config.json does "
            "not describe, a missing shard, or names to map with --rename (key_mapping=); nothing was written"
        )
    for group in _fused_groups(plan):  # as save_checkpoint: a fused group is written in one precision
        kept = [m for m in group if plan[m]]
        for m in group if kept else ():
            if not plan[m]:
                plan[m] = f"fused with {kept[0]} into one layer by engines, which stays bf16: {plan[kept[0]]}"
    return plan
