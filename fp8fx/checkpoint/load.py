"""``load_checkpoint``: a safetensors checkpoint -> the weights of a model (often built on the meta
device), quantized by fp8fx, all or nothing.

1. Plan, from the headers alone: every checkpoint tensor gets its place (a parameter, a shard of a
   fused linear, a KV-cache scale); dtypes and shapes are checked against the format; a missing or an
   extra tensor is an error before any data is read.
2. Stream, file by file and tensor by tensor, into fresh tensors: quantized linears go through
   ``Fp8LinearMethod`` on a stand-in module, experts through ``Fp8MoEMethod`` (``experts.py``); a bf16
   weight is quantized as soon as all of it arrived (an expert: as soon as its gate and up arrived).
3. Finish: shard scales requantized, KV-cache scales checked and defaulted, buffers no checkpoint
   holds (rotary ``inv_freq``) computed.
4. Commit: the new tensors are swapped into the model. Any error in 1-3 leaves the model as it was.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from fp8fx import quant
from fp8fx.checkpoint import formats, renames
from fp8fx.checkpoint.experts import ExpertsLoader, check_scale_dtype, check_scale_values, check_weight_values
from fp8fx.checkpoint.experts import beyond_dequantized_range, beyond_range_error, dequantized_range_error
from fp8fx.checkpoint.files import CheckpointError, Entry, check_fp8_codes, read_checkpoint, read_config
from fp8fx.checkpoint.files import STATIC_SCALE_MISSING, missing_name, read_tensor
from fp8fx.config import Fp8Config, PerBlock, PerRow, PerTensor, config_or, first_named
from fp8fx.lowerings import compat
from fp8fx.weights import chunked
from fp8fx.weights import moe as moe_weights
from fp8fx.weights.kv_cache import assign_kv_scales, attention_owner, check_kv_scale, check_kv_scale_layout
from fp8fx.weights.kv_cache import complete_kv_scales, getter_module, kv_cache_attentions, kv_scale_target
from fp8fx.weights.kv_cache import kv_slot_error, make_kv_scales, related
from fp8fx.weights.linear import Fp8LinearMethod, fp8_class, guard_casts, is_foreign_linear, is_quantized, skip_reason
from fp8fx.weights.linear import is_conv1d_class, is_linear, linear_weight, target_classes
from fp8fx.weights.linear import RANGE_CHECKED, remember_trainable
from fp8fx.weights.linear import check_no_in_place_rescale, check_no_lazy_modules, kept_by_the_model
from fp8fx.weights.moe import is_any_experts, is_quantized_experts
from fp8fx.weights.quantize import check_ignored_layers, kept_as_stored, module_names, nothing_quantized

log = logging.getLogger("fp8fx")

# Model module -> the checkpoint modules it fuses, in shard order (vLLM's packed_modules_mapping; DeepSeek-V2/V3's
# MLA, also Kimi's and GLM's, fuses q_a_proj and kv_a_proj_with_mqa).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}


@dataclasses.dataclass
class LoadReport:
    """What ``load_checkpoint`` did; ``str(report)`` is a table."""

    path: str
    format: str
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # linear fqn -> scheme
    experts: dict[str, str] = dataclasses.field(default_factory=dict)  # experts module fqn -> scheme
    not_quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # linear fqn -> reason
    fused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # fqn -> checkpoint modules
    kv_scales: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # attention fqn -> scales
    # scales the checkpoint does not hold: "<attention fqn>.v_scale" (1.0) or "<attention fqn>.v_scale=k_scale"
    # (the layer's other scale, as vLLM does)
    kv_defaults: list[str] = dataclasses.field(default_factory=list)
    # defaults not set because the model uses the name for an attribute of its own: "<attention fqn>.v_scale"
    kv_not_set: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)  # checkpoint tensors the model has no use for
    # tensors the model's class says to skip (transformers' _keys_to_ignore_on_load_unexpected: DeepSeek-V3's MTP layer)
    skipped: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0

    def __str__(self) -> str:
        rows = [("quantized", f, s) for f, s in self.quantized.items()]
        rows += [("experts", f, s) for f, s in self.experts.items()]
        rows += [("not quantized", f, r) for f, r in self.not_quantized.items()]
        rows += [("fused", f, "<- " + ", ".join(s)) for f, s in self.fused.items()]
        defaulted = {d.split("=")[0]: d.partition("=")[2] for d in self.kv_defaults}
        for fqn, scales in self.kv_scales.items():
            def note(n: str) -> str:
                if f"{fqn}.{n}" not in defaulted:
                    return ""
                source = defaulted[f"{fqn}.{n}"]
                return f" (= {source}: not in the checkpoint)" if source else " (default)"

            text = " ".join(f"{n}={v:.6g}{note(n)}" for n, v in scales.items())
            rows.append(("kv-cache scales", fqn, text))
        rows += [("kv-cache scales", n, "not set: the model has an attribute of that name") for n in self.kv_not_set]
        rows += [("unexpected", n, "not loaded") for n in self.unexpected]
        if self.skipped:
            more = f" and {len(self.skipped) - 1} more" if len(self.skipped) > 1 else ""
            rows.append(("skipped", f"{self.skipped[0]}{more}",
                         "not loaded: the model's class skips them (_keys_to_ignore_on_load_unexpected)"))
        width = max([len(r[1]) for r in rows] + [4])
        lines = [f"{r[0]:<15} {r[1]:<{width}}  {r[2]}" for r in rows]
        lines.append(
            f"{self.path} ({self.format}): {len(self.quantized)} linear layers quantized, {len(self.not_quantized)} "
            f"not, {len(self.fused)} fused; {len(self.experts)} experts modules quantized; kv-cache scales on "
            f"{len(self.kv_scales)} modules "
            f"({len(self.kv_defaults)} defaulted); {self.tensors} tensors, {self.bytes_read / 2**20:.1f} MiB read"
        )
        return "\n".join(lines)

    __repr__ = __str__

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (its fields; a fused layer's checkpoint modules as a list, as in its JSON)."""
        data = dataclasses.asdict(self)
        data["fused"] = {fqn: list(parts) for fqn, parts in self.fused.items()}
        return data

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON (``kwargs`` go to ``json.dumps``; ``indent`` is 2 unless given)."""
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})


@dataclasses.dataclass
class _Linear:
    """A linear layer loaded through fp8fx: quantized, or fused from several checkpoint modules."""

    fqn: str
    module: nn.Linear
    shards: tuple[str, ...]  # the checkpoint modules it is loaded from, in shard order
    config: Optional[Fp8Config]  # None: not quantized (a fused high-precision layer)
    entries: dict[tuple[str, int], Entry] = dataclasses.field(default_factory=dict)  # (leaf, shard) -> entry
    sizes: list[int] = dataclasses.field(default_factory=list)  # rows of each shard
    stage: Optional[nn.Module] = None  # stand-in that Fp8LinearMethod loads into
    method: Optional[Fp8LinearMethod] = None
    plain: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # weight / bias being assembled
    # (largest scale, its entry) of weight scales whose 448 * scale the model's dtype cannot hold (float16)
    wide_scales: list[tuple[float, Entry]] = dataclasses.field(default_factory=list)
    bias_of: Optional[str] = None  # the layer whose bias this one shares (one Parameter, saved once)
    # a Conv1D's: its checkpoints store its weight [in, out] (GPT-2's), fp8 codes too (vLLM's GPT-2 loader transposes
    # every Conv1D weight it reads), loaded transposed into a linear's layout
    transposed: bool = False

    @property
    def serialized(self) -> bool:
        return self.config is not None and self.config.is_checkpoint_fp8_serialized

    def shard_id(self, i: int) -> Optional[int]:
        return None if len(self.shards) == 1 else i


def _block_rows(fmt: formats.QuantFormat, stored: str) -> Optional[int]:
    """The rows of a weight block of checkpoint module ``stored`` by its quantization config, or None."""
    config = fmt.layer_config(stored, ("Linear",))
    return config.weight.block_n if config is not None and isinstance(config.weight, PerBlock) else None


def stored_in_high_precision(entries: Mapping[str, Entry], fqn: str) -> bool:
    """Whether checkpoint ``entries`` (under the model's names) hold linear ``fqn``'s weight in high precision: stored,
    not fp8, with no scale. An fp8 checkpoint keeps its output embeddings, routers and the layers the model keeps out
    of quantization (``kept_by_the_model``) so, whatever its ignore list says; they load as stored."""
    weight = entries.get(f"{fqn}.weight")
    return weight is not None and weight.dtype != quant.FP8_DTYPE and f"{fqn}.weight_scale" not in entries


def output_embeddings(model: nn.Module, modules: Mapping[str, nn.Module]) -> Optional[str]:
    """The name of the linear layer that is a model's output embeddings (``lm_head``), which fp8 checkpoints keep in
    high precision (vLLM and transformers never quantize it for the fp8 format; DeepSeek-V3's config does not list
    it), else None. ``get_output_embeddings()`` says which module it is; one that wraps a single linear (a head
    with its own scaling or softcapping around ``nn.Linear``) names that linear. Where the method is missing or
    gives none (not a transformers model; a speech backbone), the name says it: ``lm_head`` (vLLM's rule). ``modules``:
    ``model.named_modules()``'s."""
    head, name = getter_module(model, "get_output_embeddings", modules)
    if head is None:
        return "lm_head" if isinstance(modules.get("lm_head"), nn.Linear) else None
    if name is None or isinstance(head, nn.Linear):
        return name
    inner = [f for f, m in head.named_modules() if isinstance(m, nn.Linear)]
    return (f"{name}.{inner[0]}" if name else inner[0]) if len(inner) == 1 else None


def check_checkpoint_ignores(config: Fp8Config, model: nn.Module, entries: Mapping[str, Entry], where: str,
                             undone: str) -> None:
    """``check_ignored_layers`` for a user's config against a checkpoint: its entries may name the model's modules
    or the checkpoint's (unfused: q_proj of a model's qkv_proj; renamed: as stored or as renamed)."""
    names = [fqn for fqn, _ in model.named_modules(remove_duplicate=False)]  # (a module's every name: model.b = a)
    names += [name.rpartition(".")[0] for name in entries]
    names += [e.source.rpartition(".")[0] for e in entries.values() if e.source]  # as stored, before renames
    check_ignored_layers(config, names, where, undone)


def _cast(t: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    """``t`` in the model's ``dtype``; a finite value that the cast makes infinite (a bf16 checkpoint loaded into a
    float16 model: 65504 at most) is an error naming the tensor - the model would compute with inf."""
    out = t.to(dtype)
    if out.dtype == t.dtype or not out.is_floating_point() or torch.finfo(out.dtype).max >= torch.finfo(t.dtype).max:
        return out
    lost = torch.isinf(out) & torch.isfinite(t)
    overflow = int(lost.sum())
    if overflow:
        raise beyond_range_error(key, t.dtype, dtype, overflow, float(t[lost].abs().max()))
    return out


def _dequantized_overflow(layer: nn.Module, dtype: torch.dtype) -> int:
    """Values of a loaded fp8 linear's dequantized ``weight`` view that are inf (``chunked.dequantized_overflow``)."""
    scale = layer._parameters["weight_scale_inv" if layer._fp8fx_block_scales else "weight_scale"].data
    return chunked.dequantized_overflow(layer._parameters["weight"].data, scale, layer._fp8fx_w_block, dtype)


def _check_load_args(config, device, fused) -> None:
    """``load_checkpoint``'s arguments, before anything is read."""
    config_or(config, None, "load_checkpoint")  # (None: the checkpoint's own)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_checkpoint(device={device!r}): not a device ({e})") from None
    if dev.type == "meta":
        raise ValueError("load_checkpoint(device='meta'): the tensors need a real device (the model may be on meta; "
                         "device says where its loaded tensors go), e.g. 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"load_checkpoint(device={device!r}): this torch has no usable CUDA device; use 'cpu'")
    if fused is not None and not isinstance(fused, Mapping):
        raise ValueError(f"load_checkpoint(fused={fused!r:.80}): a {type(fused).__name__}; it takes a dict of model "
                         "module name -> the checkpoint module names it fuses, e.g. "
                         "{'qkv_proj': ['q_proj', 'k_proj', 'v_proj']}")
    for name, parts in (fused or {}).items():
        if isinstance(parts, str) or not all(isinstance(p, str) for p in parts):
            raise ValueError(f"load_checkpoint(fused={{{name!r}: {parts!r}}}): the checkpoint module names it fuses, "
                             "a list, e.g. ['q_proj', 'k_proj', 'v_proj']")
        twice = sorted({p for p in parts if list(parts).count(p) > 1})
        if twice:  # (the second shard would be reported missing from the checkpoint)
            raise ValueError(f"load_checkpoint(fused={{{name!r}: {parts!r}}}): {twice[0]!r} is named twice; each "
                             "checkpoint module is one shard of the fused one, in the order they are stacked")


def named_as_model(model: nn.Module, entries: Mapping[str, Entry], fmt: formats.QuantFormat, path: str,
                   key_mapping: Optional[Mapping[str, str]], where: str
                   ) -> tuple[dict[str, Entry], formats.QuantFormat]:
    """(checkpoint ``entries`` under ``model``'s names: transformers' renames and cuts for it, then ``key_mapping``'s;
    ``fmt`` knowing the checkpoint's names of each renamed module, which its ignore list and targets may use).
    ``inspect`` reads a checkpoint's ignore list through it too, as the load would."""
    entries, sources = renames.apply(entries, renames.resolve(model, key_mapping, where, entries), path)
    fmt = dataclasses.replace(fmt, sources=sources)
    entries, cut_from = renames.cut(entries, model, path, functools.partial(_block_rows, fmt))
    return entries, dataclasses.replace(fmt, sources={**sources, **cut_from})


def load_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    config: Optional[Fp8Config] = None,
    *,
    device: Union[str, torch.device] = "cpu",
    fused: Optional[Mapping[str, Sequence[str]]] = None,
    key_mapping: Optional[Mapping[str, str]] = None,
    progress: bool = True,
) -> LoadReport:
    """Load the safetensors checkpoint in directory ``path`` into ``model`` and quantize its linear layers
    and MoE experts modules (3-D ``gate_up_proj`` / ``down_proj``, stored per expert or fused:
    ``fp8fx.checkpoint.experts``).

    ``config``: None reads ``config.json``'s ``quantization_config`` (``fp8`` per-tensor or blocks,
    ``compressed-tensors``); without one the checkpoint is bf16/fp16 and quantized online with
    ``Fp8Config()``. A given ``config`` overrides both. ``model`` may live on the meta device; tensors
    are created on ``device``, in the dtype of the model's parameters (fp8 weights stay fp8; the
    dequantized ``.weight`` views have the model's dtype). ``fused``: model module name -> checkpoint
    module names it fuses (default ``FUSED``: qkv_proj, gate_up_proj, fused_qkv_a_proj). Checkpoint names the model
    does not have are first renamed as transformers renames them for this model (hub Mixtral's ``block_sparse_moe``
    -> ``mlp``; ``fp8fx.checkpoint.renames``); ``key_mapping``: more renames, regex -> replacement, as
    transformers' ``from_pretrained(key_mapping=...)`` takes them. ``progress``: a tqdm bar over the files.
    Returns a ``LoadReport``. Raises ``CheckpointError`` (a ``ValueError``) naming the tensor for a bad
    checkpoint; the model is then unchanged.
    """
    path = os.fspath(path)
    model = compat.compiled_module(model)  # a torch.compile wrapper: the module it compiles, the checkpoint's names
    _check_load_args(config, device, fused)
    wrapped = [f for f, m in model.named_modules() if f and compat.compiled_module(m) is not m]
    if wrapped:  # its names have "_orig_mod.", the checkpoint's (save_checkpoint's) do not
        raise ValueError(f"load_checkpoint: {first_named(wrapped)} is a torch.compile wrapper of a "
                         "submodule, whose names the checkpoint does not have (save_checkpoint writes them without "
                         "_orig_mod.); load into the model first, then compile its submodules")
    check_no_in_place_rescale(model, "load_checkpoint", "loaded")
    check_no_lazy_modules(model, "load_checkpoint", "loaded")
    config_json = read_config(path)
    files, entries = read_checkpoint(path)
    entries, fmt = named_as_model(model, entries, formats.parse(config_json, config), path, key_mapping,
                                  "load_checkpoint")
    # a user's config, or one config.json holds for quantizing online (fp8fx's own to_dict): a layer it names that
    # neither the model nor the checkpoint has was meant to stay bf16 and would be quantized. The ignore list of an
    # fp8 checkpoint is the producer's record of what it left bf16: its tensors say so too, and load them as stored
    if config is not None or not fmt.config.is_checkpoint_fp8_serialized and fmt.name != "compressed-tensors":
        check_checkpoint_ignores(fmt.config if config is None else config, model, entries,
                                 f"this {type(model).__name__} or the checkpoint {path}", "loaded")
    if not fmt.config.is_checkpoint_fp8_serialized and fmt.config.activation_scheme == "static":
        # weights quantized online hold no input scales: found out after streaming the whole checkpoint otherwise
        # (a bf16 checkpoint with a static config given, or a config.json saying fp8, not serialized, static)
        raise CheckpointError(
            f"{path}: its weights are quantized while loading (not fp8-serialized), which gives no static input "
            "scales, and the config says activation_scheme='static'; load with dynamic activations, or quantize_ "
            "the built model with input_scales=fp8fx.calibrate(model, batches, config)"
        )
    loader = _Loader(model, fmt, torch.device(device), dict(FUSED if fused is None else fused))
    try:
        loader.plan(entries)
        report = LoadReport(path, fmt.describe())
        loader.stream(files, report, progress)
        loader.finish(report)
        loader.commit(report)
        modules, kv_declared = loader.modules, loader.kv_declared
    finally:
        loader.close()
    if not fmt.config.is_checkpoint_fp8_serialized and not report.quantized and not report.experts:
        # (quantize_ warns so too: asked for fp8, the model is all high precision)
        log.warning("fp8fx: %s", nothing_quantized("load_checkpoint", model, report.not_quantized, modules.items()))
    # the format as stored (config.json's quant_method; a config= passed here says how it was read, not what it is:
    # save_checkpoint's default format is this one)
    stored = (config_json.get("quantization_config") or {}).get("quant_method") if fmt.from_user else fmt.name
    model._fp8fx_source = {"format": stored, "config": config_json, "kv_cache": kv_declared}
    guard_casts(model)
    from fp8fx.checkpoint import pretrained  # (it imports this module)

    pretrained.describe(model)
    log.info("fp8fx: loaded %s", str(report).splitlines()[-1])
    return report


def _pending_ties(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """A transformers model's tied tensors not tied yet, ``{target: source}`` (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` where the config says ``tie_word_embeddings``): accelerate's
    ``init_empty_weights`` builds the model untied, and ``from_pretrained`` ties it after loading, so the checkpoint
    holds the source alone ("lm_head.weight is missing" was the error). Only targets still on meta, which nothing
    else would give a value (``_Loader._tie_pending``)."""
    return {t: s for t, s in config_ties(model, "load_checkpoint").items() if t in state and s in state
            and state[t] is not state[s] and state[t].is_meta}


def config_ties(model: nn.Module, where: str) -> dict[str, str]:
    """The tensors a transformers model ties as its config says, ``{target: source}`` (``lm_head.weight`` ->
    ``model.embed_tokens.weight``; BERT's MLM decoder bias -> ``cls.predictions.bias``); {} for any other model, or
    where transformers' lookup fails (said at DEBUG: the model is then read as it is built)."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    try:
        ties = expand(all_submodels=True) if callable(expand) else {}
    except Exception as e:  # noqa: BLE001 - transformers' own lookup
        log.debug("fp8fx: %s: %s's tied weights not read (%s)", where, type(model).__name__, e)
        return {}
    return {t: s for t, s in ties.items() if isinstance(t, str) and isinstance(s, str)}


class _Loader:
    def __init__(self, model: nn.Module, fmt: formats.QuantFormat, device: torch.device, fused: dict,
                 dry: bool = False):
        # dry: convert's plan of its source (nothing loaded: buffers and left-out tensors are not computed, unplaced
        # tensors are copied as stored)
        self.model, self.fmt, self.device, self.fused, self.dry = model, fmt, device, fused, dry
        # a module's other names (model.b = model.a) as names of it the ignore list and targets may use, as they may
        # a renamed module's stored ones: the loader plans it under its first (``_by_first_names``)
        aliases = module_names(model).values()
        self.first_names = {fqn: n[0] for n in aliases for fqn in n}  # every name of a module -> its first
        more = {n[0]: tuple(dict.fromkeys((*(s for x in n for s in fmt.sources.get(x, ())), *n[1:])))
                for n in aliases if len(n) > 1}  # (and the stored names of each: key_mapping to b)
        if more:
            self.fmt = dataclasses.replace(fmt, sources={**fmt.sources, **more})
        self.modules = dict(model.named_modules())
        done = [f for f, m in self.modules.items() if is_quantized(m) or is_quantized_experts(m)]
        if done:
            raise CheckpointError(
                f"{first_named(done)} is already fp8-quantized; load into a freshly built model"
            )
        # state_dict key -> tensor, and tied tensors grouped: id -> every key naming it
        self.state = model.state_dict(keep_vars=True)
        self.aliases: dict[int, list[str]] = {}
        for key, t in self.state.items():
            self.aliases.setdefault(id(t), []).append(key)
        self.linears: dict[str, _Linear] = {}
        self.shard_of: dict[str, tuple[_Linear, int]] = {}  # checkpoint module -> (layer, shard)
        self.not_quantized: dict[str, str] = {}
        self.items: list[tuple[Entry, Callable[[torch.Tensor], None]]] = []
        self.planned: set[str] = set()  # state keys (first alias) to load
        # checkpoint names of a tied tensor that the checkpoint also holds under the name that loads: not loaded
        # (reported unexpected) but compared with it, once every other tensor is read (``stream``)
        self.tied_copies: list[str] = []
        self.tied_items: list[tuple[Entry, Callable[[torch.Tensor], None]]] = []
        self.staged: dict[str, torch.Tensor] = {}  # state key (first alias) -> new tensor
        self.kv: dict[str, dict[str, float]] = {}
        self.kv_tensors: dict[str, dict[str, torch.Tensor]] = {}  # attention fqn -> its scales' new tensors (finish)
        self.kv_entries: dict[tuple[str, str], Entry] = {}
        # (module, name) -> a tensor on meta that no checkpoint holds and the model's _init_weights computes (finish):
        # non-persistent buffers (rotary inv_freq), and what transformers lets checkpoints leave out
        # (_keys_to_ignore_on_load_missing: Marian's sinusoidal embed_positions, its final_logits_bias)
        self.computed: dict[tuple[str, str], torch.Tensor] = {}
        self.unexpected: list[str] = []
        # what transformers skips without a word, by the model's patterns: layers the checkpoint holds and the model
        # does not build (DeepSeek-V3's multi-token-prediction layer 61, which vLLM skips too)
        self.skip = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        self.skipped: list[str] = []
        self.entries: dict[str, Entry] = {}  # the checkpoint's tensors by the model's names (plan)
        self.alias_copies: list[str] = []  # a module's other names, held with the same values, not loaded (plan)
        self.routers = moe_weights.routers(model)  # MoE routers: bf16 where the checkpoint is quantized online
        # layers the model keeps in high precision: where the checkpoint stores them so, or quantizes online
        self.kept = kept_by_the_model(model)
        self.moe = ExpertsLoader(self.modules, self.fmt, device, self.items)
        self.moe.missing_fix = self._missing_fix

    def _tie_pending(self, entries: dict[str, Entry]) -> None:
        """Each of ``_pending_ties`` that the checkpoint holds only the source of becomes an alias of the source, as
        tied tensors are: loaded once, the target layer reported as tied (not quantized), and both names given the
        one tensor at commit; a checkpoint that holds the target too loads it as its own (as transformers does,
        which ties only what the checkpoint leaves out)."""
        for target, source in _pending_ties(self.model, self.state).items():
            if target in entries or source not in entries:
                continue
            old = self.state[target]
            keys = self.aliases[id(self.state[source])]
            keys += self.aliases.pop(id(old))
            self.state[target] = self.state[source]
            self.aliases[id(old)] = keys  # (the target layer's own parameter, which the plan looks up, names both)

    def close(self) -> None:
        """Drops what the loader holds - the model, its tensors from before the load (``state``), the staged ones -
        which its bound method in ``moe`` and the planned items' closures keep in a cycle: the old weights of a model
        built with real ones, and a failed load's staged tensors, stayed alive until Python's cyclic collector ran
        (the model too, after ``del model``)."""
        vars(self.moe).clear()
        vars(self).clear()

    # --- 1. plan -----------------------------------------------------------------------------
    def plan(self, entries: dict[str, Entry]) -> None:
        entries = self._by_first_names(entries)
        self.entries = entries
        self._tie_pending(entries)
        self._find_linears(entries)
        self.moe.find(entries)
        used: set[str] = set()
        for name, entry in entries.items():
            if self._route(name, entry):
                used.add(name)
        self._check_missing_state(used)
        for lin in self.linears.values():
            self._plan_linear(lin)
        self.moe.plan()
        if not self.dry:
            self._check_meta_buffers()
        bad = [n for n in self.unexpected if _looks_like_scale(n)]
        if bad:
            raise CheckpointError(
                f"{first_named([entries[n] for n in bad])} is a scale that no layer takes: "
                f"{self._why_unexpected(bad[0])}"
            )
        # a weight or bias of a module the model has, without that parameter (a bias=False layer): dropped, the
        # layer would run without it - silently wrong outputs; on a quantized layer ``_plan_linear`` refuses it too
        lost = [n for n in self.unexpected if n.rpartition(".")[2] in ("weight", "bias")
                and n.rpartition(".")[0] in self.modules]
        if lost:
            owner, _, leaf = lost[0].rpartition(".")
            raise CheckpointError(
                f"{first_named([entries[n] for n in lost])} has no place in {owner}, a "
                f"{type(self.modules[owner]).__name__} without a {leaf}: it would run without it. Build the model "
                f"with it (the layer's {leaf} in the model's config), or drop the tensor from the checkpoint"
            )
        if self.unexpected and not self.dry:
            log.warning(
                "fp8fx: %d checkpoint tensors have no place in the model and are not loaded: %s%s",
                len(self.unexpected), self._stored_unexpected()[:5], " ..." if len(self.unexpected) > 5 else "",
            )

    def _by_first_names(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """``entries`` named by each module's first name (``named_modules``'): a module registered twice (model.b =
        model.a, an ALBERT block listed N times, a parent under two names) is planned under that one, and a
        checkpoint may hold it under any of its names (safetensors' save_model keeps the alphabetically first; a
        state_dict, every one). Where it holds several, their values must agree - one module takes one - and the
        others are read, compared and not loaded (``alias_copies``)."""
        names = self.first_names
        if all(fqn == one for fqn, one in names.items()):
            return entries
        out: dict[str, Entry] = {}
        later: list[tuple[str, Entry]] = []
        for name, entry in entries.items():
            parts = name.split(".")
            head = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names),
                        "")
            key = names[head] + name[len(head):] if head and names[head] != head else name
            if key == name:
                out[name] = entry
            else:
                later.append((key, dataclasses.replace(entry, name=key, source=entry.source or name)))
        read: dict[str, torch.Tensor] = {}  # (each name's tensor read once, the first name's kept for the others)
        for key, entry in later:
            kept = out.get(key)
            if kept is None:
                out[key] = entry
                continue
            if kept.shape != entry.shape or kept.dtype != entry.dtype:
                raise CheckpointError(
                    f"{entry}: this model's {key} (one module under two names) is also {kept}: the checkpoint holds "
                    "two tensors for one module, a checkpoint of a model where they are two layers; load it into a "
                    "model built that way, or keep one name in the checkpoint")
            if key not in read:
                read[key] = read_tensor(kept)
            compare_tied(kept, key, read[key], entry, entry.source, read_tensor(entry))
            self.alias_copies.append(entry.source)
        return out

    def _find_linears(self, entries: Mapping[str, Entry]) -> None:
        """The linear layers loaded through fp8fx: quantized ones and ones fused from several
        checkpoint modules; every other parameter is loaded as it is."""
        prefixes = {name.rpartition(".")[0] for name in entries}
        head = output_embeddings(self.model, self.modules)  # (fp8 checkpoints keep it high precision: below)
        stored_high = functools.partial(stored_in_high_precision, entries)
        for fqn, module in self.modules.items():
            if not is_linear(module):  # (nn.Linear, and transformers' Conv1D: GPT-2's)
                continue
            parent, _, leaf = fqn.rpartition(".")
            parts = [f"{parent}.{p}" if parent else p for p in self.fused.get(leaf, ())]
            shards = (fqn,)
            if any(p in prefixes for p in parts):
                if fqn in prefixes:
                    raise CheckpointError(
                        f"{fqn}: the checkpoint holds it both fused ({fqn}.*) and as {parts}; keep one"
                    )
                shards = tuple(parts)
            config, reason = self._layer_config(fqn, module, shards)
            kept = kept_as_stored(fqn, head, self.kept, self.routers, stored_high) if (
                config is not None and config.is_checkpoint_fp8_serialized) else None
            if kept is not None:  # (DeepSeek-V3.2's indexer.weights_proj: bf16 in its fp8 checkpoint, listed nowhere
                # but in the model; Qwen2-MoE's shared_expert_gate, which vLLM builds unquantized whatever the ignore
                # list says)
                config, reason = None, kept
            if config is None:
                self.not_quantized[fqn] = reason
                if len(shards) == 1:
                    continue
            lin = _Linear(fqn, module, shards, config)
            self.linears[fqn] = lin
            for i, shard in enumerate(shards):
                self.shard_of[shard] = (lin, i)

    def _layer_config(self, fqn: str, module: nn.Linear, shards: Sequence[str]):
        """(config, "") for a layer to quantize, else (None, why not). The shards of a fused layer
        must agree (vLLM's rule); ignoring the fused name ignores them all."""
        classes = target_classes(module)  # ("Linear" targets nn.Linear's subclasses, and Conv1D)
        configs = {self.fmt.layer_config(s, classes) for s in shards}
        if len(shards) > 1 and self._ignored(fqn, ()):
            configs = {None}
        if len(configs) > 1:
            raise CheckpointError(
                f"{fqn}: its checkpoint shards {list(shards)} are quantized differently "
                f"({sorted(str(c.scheme()) if c else 'not quantized' for c in configs)}); a fused layer has one "
                "scheme: fix the ignore list / targets of quantization_config"
            )
        config = configs.pop()
        if config is None:
            return None, "in ignored_layers" if self._ignored(fqn, shards) else "not targeted by quantization_config"
        weight = module._parameters.get("weight")
        if weight is None:
            return None, skip_reason(module, fqn, config) or "no weight"  # a parametrized one says so
        # (a name of this very module - registered twice, model.b = model.a, an ALBERT block listed N times - is
        # no tie: quantize_ quantizes it once, save_checkpoint writes it under its first name)
        tied = [k for k in self.aliases[id(weight)] if k != f"{fqn}.weight" and self._owner(k) is not module]
        if tied:
            return None, f"weight tied to {tied[0]}"
        if not config.is_checkpoint_fp8_serialized:  # quantized online: as quantize_ would
            reason = skip_reason(module, fqn, config) or self.kept.get(fqn) or self.routers.get(fqn)
            if reason is not None:
                return None, reason
        return config, ""

    def _owner(self, key: str) -> nn.Module:
        """The module a state_dict ``key`` belongs to, under any of its names (``self.modules`` holds one name a
        module: named_modules drops a module's second)."""
        owner = key.rpartition(".")[0]
        return self.modules[owner] if owner in self.modules else self.model.get_submodule(owner)

    def _ignored(self, fqn: str, shards: Sequence[str]) -> bool:
        return any(self.fmt.is_ignored(n) for n in (fqn, *shards))

    def _route(self, name: str, entry: Entry) -> bool:
        """Give checkpoint tensor ``name`` its place; False if the model has none."""
        kv = kv_scale_target(name)
        if kv is not None:
            owner = attention_owner(kv[0], self.modules)
            if owner is not None:
                try:  # from the header: a per-head scale is refused before any tensor is read
                    check_kv_scale_layout(name, entry.shape, entry.dtype)
                except ValueError as e:
                    raise CheckpointError(str(e)) from None
                key = (owner, kv[1])
                if key in self.kv_entries:
                    raise CheckpointError(
                        f"{name}: the {kv[1]} of {owner} is also given as {self.kv_entries[key].name}; keep one"
                    )
                self.kv_entries[key] = entry
                self.items.append((entry, lambda t, key=key: self._load_kv(key, entry, t)))
                return True
        if self.moe.route(name, entry):
            return True
        owner, _, leaf = name.rpartition(".")
        if owner in self.shard_of:
            lin, i = self.shard_of[owner]
            lin.entries[(leaf, i)] = entry
            return True
        if name in self.state:
            self._plan_state(name, entry)
            return True
        if any(p.search(name) for p in self.skip):
            self.skipped.append(entry.source or name)
        else:
            self.unexpected.append(name)
        return False

    def _why_unexpected(self, name: str) -> str:
        kv = kv_scale_target(name)
        if kv is not None and kv[0] in self.modules:
            return (f"a KV-cache scale ({kv[1]}) addressed to {kv[0]}, a {type(self.modules[kv[0]]).__name__}: "
                    "KV-cache scales belong to attention modules (class names ending in 'Attention'); rename the "
                    "tensor to its attention's <attention>.k_scale / .v_scale, or drop it")
        owner = name.rpartition(".")[0]
        why = self.not_quantized.get(owner) or self.moe.not_quantized.get(owner)
        if why:
            return f"{owner} is not quantized ({why}); fix the config's ignore list or the checkpoint"
        if owner in self.modules:  # (a quantizer that also wrote scales of norms or embeddings: no rename helps)
            module = self.modules[owner]
            layer = is_linear(module) or is_any_experts(module)
            return (f"{owner} is a {type(module).__name__}, which takes no tensor named {name.rpartition('.')[2]}"
                    f"{'' if layer else ' (fp8fx quantizes linear layers and experts, and no other module)'}: drop "
                    "the tensor from the checkpoint, or export the checkpoint without it")
        return (f"the model has no module {owner!r}; the checkpoint does not belong to this model, or names its "
                "modules differently: pass key_mapping= (checkpoint name regex -> the model's)")

    def _plan_state(self, key: str, entry: Entry) -> None:
        target = self.state[key]
        aliases = self.aliases[id(target)]
        first = aliases[0]
        owner = key.rpartition(".")[0]
        if entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            check_fp8_codes(entry, key)  # (e5m2: no ignore list fixes that)
            why = self.not_quantized.get(owner) or self.moe.not_quantized.get(owner) or "not a linear layer"
            raise CheckpointError(
                f"{entry}: a float8 tensor for {key}, which is not quantized ({why}); the checkpoint's "
                f"format is {self.fmt.describe()}: fix quantization_config (ignore list) or pass config=..."
            )
        if tuple(entry.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{entry}: the model's {key} has shape {list(target.shape)}; wrong model or checkpoint"
            )
        if entry.dtype.is_floating_point != target.dtype.is_floating_point:
            raise CheckpointError(f"{entry}: the model's {key} is {target.dtype}; wrong model or checkpoint")
        # A tied tensor (lm_head.weight tied to model.embed_tokens.weight) that the checkpoint holds under several
        # of its names: the name that loads is the model's own first one (state_dict order: the module that owns
        # the parameter, the input embedding in HF models), never the file's order (safetensors sorts names, so
        # lm_head came first and its values went into the embedding). That is what vLLM and HF users get: vLLM
        # skips lm_head.weight when tie_word_embeddings is set, HF ties lm_head to embed_tokens after loading;
        # both keep embed_tokens' values. The other names are not loaded (LoadReport.unexpected) but read and
        # compared with it: different values mean the checkpoint is of an untied model, and keeping either one
        # would silently drop the other, so that is refused, naming both.
        loads = next(k for k in aliases if k in self.entries)
        if key != loads:
            self.tied_copies.append(key)
            self.tied_items.append((entry, lambda t: self._compare_tied(first, key, entry, t)))
            return
        self.planned.add(first)
        self.items.append((entry, lambda t: self._load_state(first, target, t)))

    def _check_missing_state(self, used: set[str]) -> None:
        handled = {f"{fqn}.{leaf}" for fqn in self.linears for leaf in ("weight", "bias")} | self.moe.handled()
        # what transformers lets checkpoints leave out: computed by the model's initializer where still on meta
        optional = [re.compile(p) for p in getattr(self.model, "_keys_to_ignore_on_load_missing", None) or ()]
        missing = []
        for keys in self.aliases.values():
            if any(k in used or k in handled for k in keys):
                continue
            if not any(p.search(k) for p in optional for k in keys):
                missing.append(keys[0])
            elif self.state[keys[0]].is_meta and not self.dry:
                if self._initializer(keys[0].rpartition(".")[0]) is None:
                    raise CheckpointError(f"{keys[0]}: on the meta device and not in the checkpoint, and "
                                          f"{type(self.model).__name__} has no _init_weights to compute it; build the "
                                          "model with it on a real device")
                fqn, _, leaf = keys[0].rpartition(".")
                self.computed[(fqn, leaf)] = self.state[keys[0]]
        if missing:
            hint = ""
            if any(self.state[k].dim() == 3 for k in missing):
                hint = (
                    " (3-D expert parameters: the checkpoint holds them per expert, <experts>.<e>.gate_proj.weight / "
                    "up_proj / down_proj or w1 / w3 / w2, or fused, <experts>.gate_up_proj / down_proj)"
                )
            parametrized = next((k.partition(".parametrizations.")[0] for k in missing if ".parametrizations." in k),
                                None)
            if parametrized is not None:  # torch's own load_state_dict refuses it too; say why
                hint += (
                    f" ({parametrized or 'the model'} is parametrized: its weight is computed at each call from "
                    "parametrizations.<name>.original*, which a checkpoint of plain weights does not hold; load the "
                    "checkpoint before parametrizing, or remove the parametrization first: "
                    "torch.nn.utils.parametrize.remove_parametrizations)"
                )
            raise CheckpointError(
                f"{first_named(missing, shown=3)} is missing from the checkpoint{hint}; "
                f"{self._missing_fix()}"
            )

    def _missing_fix(self) -> str:
        """What a 'missing from the checkpoint' error says to do."""
        fix = "wrong checkpoint for this model, or a shard is missing"
        if not self.unexpected:
            return fix
        # e.g. a checkpoint naming the MoE block as a model class transformers does not know renames for
        return (f"the checkpoint has {len(self.unexpected)} tensors the model has no place for "
                f"({self._stored_unexpected()[0]} ...): if it names modules differently, pass key_mapping= "
                f"(checkpoint name regex -> the model's); else {fix}")

    def _stored_unexpected(self) -> list[str]:
        """The unplaced tensors as the checkpoint names them (before any rename)."""
        return [self.entries[n].source or n for n in self.unexpected]

    def _shared_bias_owner(self, lin: _Linear) -> Optional[str]:
        """The layer of the model whose bias ``lin``'s is (one Parameter: save_checkpoint writes it once), where
        the checkpoint holds it under that layer's name and that layer is loaded here; else None."""
        for key in self.aliases.get(id(lin.module.bias), []):
            owner, _, leaf = key.rpartition(".")
            if key != f"{lin.fqn}.bias" and leaf == "bias" and key in self.entries and owner in self.linears:
                other = self.linears[owner]
                if len(other.shards) == 1 and other.module.bias is lin.module.bias:
                    return owner
        return None

    def _plan_linear(self, lin: _Linear) -> None:
        """Check a fp8fx linear's tensors (dtypes, shapes, scales) and plan their loading."""
        n, k = linear_weight(lin.module).shape  # (out_features, in_features)
        conv1d = is_conv1d_class(type(lin.module))
        todo = dict(lin.entries)

        def need(leaf: str, i: int, why: str = "") -> Entry:
            if (leaf, i) not in todo:
                # (a static checkpoint missing one layer's input scale said no fix: h143)
                fix = (STATIC_SCALE_MISSING.format(self.fmt.declared_by) if leaf == "input_scale"
                       else self._missing_fix())
                raise CheckpointError(f"{missing_name(f'{lin.shards[i]}.{leaf}', lin.entries.values())} is missing "
                                      f"from the checkpoint{why}; {fix}")
            return todo.pop((leaf, i))

        weights = []
        for i, shard in enumerate(lin.shards):
            w = need("weight", i)
            self._check_weight_dtype(lin, w)
            shape = tuple(w.shape)
            lin.transposed = conv1d
            if conv1d and len(shape) == 2:
                shape = shape[::-1]
            if len(shape) != 2 or shape[1] != k:
                raise CheckpointError(
                    f"{w}: {lin.fqn} takes [{k}, cols] weights (a Conv1D's weight is [in_features, out_features], "
                    f"in_features={k})" if conv1d else f"{w}: {lin.fqn} takes [rows, {k}] weights (in_features={k})")
            lin.sizes.append(shape[0])
            weights.append(w)
            self.items.append((w, lambda t, lin=lin, i=i, e=w: self._load_weight(lin, i, e, t)))
        if sum(lin.sizes) != n:  # (the entries name the tensors, their dtypes, shapes and files)
            rows = f"{sum(lin.sizes)} rows in all" if len(weights) > 1 else f"{lin.sizes[0]} rows"
            raise CheckpointError(
                f"{', '.join(map(str, weights))}: {lin.fqn} has out_features={n}, its checkpoint weights {rows}; "
                "wrong model or checkpoint"
            )
        if lin.serialized:
            self._plan_scales(lin, need, todo)
        for i in range(len(lin.shards)):
            if lin.module.bias is not None:
                if ("bias", i) not in todo and len(lin.shards) == 1:
                    lin.bias_of = self._shared_bias_owner(lin)
                    if lin.bias_of is not None:
                        continue
                b = need("bias", i)
                if tuple(b.shape) != (lin.sizes[i],) or b.dtype not in quant.HIGH_PRECISION:
                    raise CheckpointError(f"{b}: expected a bf16/fp16/fp32 bias of shape [{lin.sizes[i]}]")
                self.items.append((b, lambda t, lin=lin, i=i: self._load_rows(lin, "bias", i, t)))
        kv = next((e for e in todo.values() if kv_scale_target(e.name) is not None), None)
        if kv is not None:  # (it was blamed on a format mismatch, where the same tensor of a module no layer got the
            # KV-cache reason: h154)
            raise CheckpointError(f"{kv} is a scale that no layer takes: {self._why_unexpected(kv.name)}")
        if todo:
            raise CheckpointError(
                f"{first_named(todo.values())} has no place in {lin.fqn} "
                f"({'quantized: ' + str(lin.config.scheme()) if lin.config else 'not quantized'}"
                f"{', no bias' if lin.module.bias is None else ''}); a format mismatch: the checkpoint is "
                f"read as {self.fmt.describe()}"
            )
        if lin.config is not None:
            dtype = lin.module.weight.dtype
            if dtype not in quant.HIGH_PRECISION:  # (create_weights' refusal named a call the caller never made)
                raise CheckpointError(
                    f"{lin.fqn}: the model's layer is {dtype}, and an fp8 layer is loaded to compute in "
                    f"{', '.join(map(str, quant.HIGH_PRECISION))}: build the model in one of them "
                    "(meta_model(path, dtype=torch.float32)), load it, then cast it (model.double(): a float64 "
                    "reference of the fp8 weights) (nothing was loaded)")
            lin.method = Fp8LinearMethod(lin.config)
            lin.stage = nn.Linear(k, n, bias=False, device="meta")
            try:
                lin.method.create_weights(lin.stage, k, lin.sizes, dtype, device=self.device, prefix=lin.fqn)
                setattr(lin.stage, RANGE_CHECKED, True)  # (_check_dequantized_range, naming the entry)
            except ValueError as e:  # e.g. fused block layer whose shards do not start on block rows (e names fqn)
                fused = f" (the layer fused from {list(lin.shards)})" if len(lin.shards) > 1 else ""
                raise CheckpointError(f"{e}{fused}") from None

    def _check_weight_dtype(self, lin: _Linear, w: Entry) -> None:
        check_fp8_codes(w, lin.fqn)
        fp8 = w.dtype == quant.FP8_DTYPE
        if lin.serialized and not fp8:
            # an ignore entry close to the layer's name (a misspelling: the entry names no module, and the layer it
            # meant is refused as not in the list, with no word of the entry: h156)
            entries = [*(self.fmt.config.ignored_layers or ()), *self.fmt.ignore, *self.fmt.hf_ignore,
                       *(self.fmt.modelopt_exclude or ())]
            names = [str(e) for e in entries if not str(e).startswith("re:")]
            close = [e for e in difflib.get_close_matches(lin.fqn, names, n=1, cutoff=0.9) if e not in self.modules]
            typo = f"; its ignore list's {close[0]!r} names no module: a misspelling of {lin.fqn!r}?" if close else ""
            raise CheckpointError(
                f"{w}: {lin.fqn} is declared float8_e4m3fn by {self.fmt.declared_by} ({self.fmt.describe()}); "
                f"fix it (e.g. add the layer to its ignore list) or re-export the checkpoint{typo}"
            )
        if not lin.serialized and w.dtype not in quant.HIGH_PRECISION:
            if fp8 and self.fmt.name == "none" and self.fmt.from_user:
                hint = ("; the config= passed to load_checkpoint quantizes online (is_checkpoint_fp8_serialized="
                        "False): drop it to read the checkpoint's quantization_config, or pass one that is serialized")
            elif fp8 and self.fmt.name == "none":
                hint = ("; config.json has no quantization_config, so the checkpoint is read as bf16: restore it or "
                        "pass config=Fp8Config(is_checkpoint_fp8_serialized=True, ...)")
            else:
                hint = f"; {lin.fqn} is {'not quantized' if lin.config is None else 'quantized online'} here"
            raise CheckpointError(f"{w}: expected a bf16/fp16/fp32 weight{hint}")

    def _plan_scales(self, lin: _Linear, need, todo) -> None:
        scheme = lin.config.scheme()
        w, k = scheme.weight, linear_weight(lin.module).shape[1]
        for i, rows in enumerate(lin.sizes):
            # transformers' FP8Linear without blocks (FineGrainedFP8Config(weight_block_size=None), what its
            # save_pretrained writes): its one scale is named weight_scale_inv all the same, multiplied as a
            # weight_scale is (_dequantize_fp8_weight), in any one-value shape (transformers 5.25 writes it [1, 1]);
            # its static activation scale is activation_scale
            for theirs, ours in (("weight_scale_inv", "weight_scale"), ("activation_scale", "input_scale")):
                one = (theirs, i) in todo and math.prod(todo[(theirs, i)].shape) == 1
                if one and (ours, i) not in todo and (ours == "input_scale" or isinstance(w, PerTensor)):
                    todo[(ours, i)] = todo.pop((theirs, i))
            if isinstance(w, PerBlock):
                names = [leaf for leaf in ("weight_scale_inv", "weight_scale") if (leaf, i) in todo]
                if len(names) > 1:
                    raise CheckpointError(f"{lin.shards[i]}: both weight_scale_inv and weight_scale; keep one")
                s = need(names[0] if names else "weight_scale_inv", i, f" (blocks {w.block_n}x{w.block_k})")
                expect = quant.scale_shape((rows, k), w.block)
                ok = tuple(s.shape) == expect
                target, shape_text = "weight_scale_inv", f"shape {list(expect)} = ceil([{rows}, {k}] / {list(w.block)})"
            elif ("weight_scale_inv", i) in todo and ("weight_scale", i) not in todo:  # block scales, read otherwise
                raise CheckpointError(
                    f"{todo[('weight_scale_inv', i)]}: block scales, where {self.fmt.declared_by} says {w} weights "
                    f"({self.fmt.describe()}); the checkpoint's config needs its weight_block_size ([128, 128] for "
                    "DeepSeek-V3's) to read them"
                )
            elif isinstance(w, PerRow):
                s = need("weight_scale", i, " (per-channel)")
                ok = s.shape in ((rows, 1), (rows,))
                target, shape_text = "weight_scale", f"shape [{rows}, 1] (one per output channel)"
            else:
                s = need("weight_scale", i, " (per-tensor)")
                ok = s.shape in ((), (1,), (1, 1))
                target, shape_text = "weight_scale", "one value, shape [] or [1]"
            if not ok:
                raise CheckpointError(
                    f"{s}: a {w} weight [{rows}, {k}] needs {shape_text}; the checkpoint does not match "
                    f"{self.fmt.declared_by} ({self.fmt.describe()})"
                )
            check_scale_dtype(s)
            self.items.append((s, lambda t, lin=lin, i=i, s=s, target=target: self._load_scale(lin, target, i, s, t)))
            if scheme.static_activation:
                a = need("input_scale", i, " (activation_scheme static)")
                if a.shape not in ((), (1,), (1, 1)):
                    raise CheckpointError(f"{a}: an input_scale is one value, shape [] or [1]")
                check_scale_dtype(a)
                self.items.append((a, lambda t, lin=lin, i=i, a=a: self._load_scale(lin, "input_scale", i, a, t)))
            elif ("input_scale", i) in todo:
                raise CheckpointError(
                    f"{todo[('input_scale', i)]}: the checkpoint has static input scales but "
                    f"{self.fmt.declared_by} says dynamic activations; set activation_scheme 'static' "
                    "(input_activations dynamic false) or drop the input_scale tensors"
                )

    def _check_meta_buffers(self) -> None:
        """Buffers that no checkpoint holds (non-persistent, e.g. rotary ``inv_freq``) and that are still
        on the meta device are computed by the model's own initializer (HF ``_init_weights``)."""
        for fqn, module in self.modules.items():
            for name, buf in module._buffers.items():
                if buf is None or not buf.is_meta or name not in module._non_persistent_buffers_set:
                    continue
                if self._initializer(fqn) is None:
                    raise CheckpointError(
                        f"{_join(fqn, name)}: a non-persistent buffer on the meta device that no checkpoint holds; "
                        "build the model with its buffers on a real device (only parameters on meta)"
                    )
                self.computed[(fqn, name)] = buf

    # --- 2. stream ---------------------------------------------------------------------------
    def stream(self, files: Sequence[str], report: LoadReport, progress: bool) -> None:
        by_file: dict[str, list] = {f: [] for f in files}
        for entry, load in self.items:
            by_file[entry.file].append((entry, load))
        # the other names of tied tensors last: what they are compared with is staged by then, and no copy of them
        # waits in memory for it (one tensor read at a time, as everywhere here)
        tied = sorted(self.tied_items, key=lambda item: (files.index(item[0].file), item[0].start))
        for file in _progress(files, progress, "fp8fx: loading"):
            for entry, load in [*sorted(by_file[file], key=lambda item: item[0].start),
                                *(item for item in tied if file == files[-1])]:
                tensor = read_tensor(entry)
                load(tensor.to(self.device))
                del tensor
                report.tensors += 1
                report.bytes_read += entry.nbytes

    def _load_state(self, key: str, target: torch.Tensor, t: torch.Tensor) -> None:
        self.staged[key] = _cast(t, target.dtype, key)

    def _compare_tied(self, first: str, key: str, entry: Entry, t: torch.Tensor) -> None:
        """``key``, another name of the tied tensor staged under ``first``: its values must be the same."""
        loads = self.tied_source(key)
        compare_tied(self.entries[loads], loads, self.staged[first], entry, key, t)

    def tied_source(self, key: str) -> str:
        """The name that loads the tied tensor ``key`` (a name in ``tied_copies``) also names."""
        return next(k for k in self.aliases[id(self.state[key])] if k in self.entries)

    def _load_weight(self, lin: _Linear, i: int, entry: Entry, t: torch.Tensor) -> None:
        if lin.config is None:
            self._load_rows(lin, "weight", i, t)
            return
        dtype = lin.module.weight.dtype
        # the pass that looks for NaN/Inf also counts the values that the model's dtype cannot hold: quantized
        # online, the weight is first copied into a buffer of that dtype (Fp8LinearMethod.weight_loader), where
        # 1e5 becomes inf in a float16 model, its scale inf and the layer's outputs NaN. Raised while streaming,
        # as _cast does: nothing was swapped into the model yet (commit), so the model stays as it was.
        check_weight_values(entry, t, dtype, lin.fqn, f"from a {dtype} copy (weight scale inf, outputs NaN)")
        t = t.t().contiguous() if lin.transposed else t  # (a Conv1D's [in, out]: a linear's layout)
        lin.method.weight_loader(lin.stage, "weight", t, lin.shard_id(i), values_checked=True)

    def _load_scale(self, lin: _Linear, name: str, i: int, entry: Entry, t: torch.Tensor) -> None:
        t = check_scale_values(entry, t)
        if name != "input_scale" and t.numel():  # (a layer of no rows has no scale: nothing to dequantize)
            # the dequantized .weight view (fp8 * scale, in the model's dtype) reaches 448 * scale: where that is
            # beyond the dtype's range (float16: 65504), finish() counts the values that would be inf
            top = t.max()
            if beyond_dequantized_range(top, lin.module.weight.dtype):
                lin.wide_scales.append((float(top), entry))
        lin.method.weight_loader(lin.stage, name, t, lin.shard_id(i))

    def _load_rows(self, lin: _Linear, name: str, i: int, t: torch.Tensor) -> None:
        """Rows of shard ``i`` of a high-precision fused weight or bias, assembled in a fresh tensor."""
        param = lin.module._parameters[name]
        if name not in lin.plain:
            lin.plain[name] = torch.empty(param.shape, dtype=param.dtype, device=self.device)
        lin.plain[name].narrow(0, sum(lin.sizes[:i]), lin.sizes[i]).copy_(_cast(t, param.dtype, f"{lin.fqn}.{name}"))

    def _load_kv(self, key: tuple[str, str], entry: Entry, t: torch.Tensor) -> None:
        try:
            self.kv.setdefault(key[0], {})[key[1]] = check_kv_scale(entry.name, t)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    # --- 3. finish ---------------------------------------------------------------------------
    @property
    def kv_declared(self) -> bool:
        return self.fmt.kv_cache or (self.fmt.name == "fp8" and bool(self.kv))

    def finish(self, report: LoadReport) -> None:
        for lin in self.linears.values():
            if lin.config is not None:
                lin.method.process_weights_after_loading(lin.stage)
                self._check_dequantized_range(lin)
        self.moe.finish()
        if self.kv or self.fmt.kv_cache:
            defaults, taken = [], []
            # an fp8 KV cache the checkpoint declares gives every attention its scales: compressed-tensors'
            # kv_cache_scheme, or, in the fp8 format (which has no such field), the scales themselves; other
            # scales complete only their own layer (vLLM reads them only for an fp8 KV cache it is asked for).
            # Of an attention inside another, the one with the KV cache's mark gets them (T5's T5Attention, not its
            # T5LayerSelfAttention; BERT's BertSelfAttention), and none do that have no KV cache (a vision tower's
            # CLIPAttention beside a decoder's LlamaAttention, an encoder's attentions: kv_cache_attentions); nor does
            # one inside or around an attention that holds the checkpoint's scales.
            declared = kv_cache_attentions(self.modules, self.model) if self.kv_declared else []
            owners = list(self.kv) + [f for f in declared if not related(f, self.kv)]
            for fqn in owners:
                scales = self.kv.setdefault(fqn, {})
                # the model may use a name for something else (MiMo-V2-Flash's attention has a float v_scale,
                # Gemma3n's audio attention a q_scale buffer): a default is not forced on it; a scale the checkpoint
                # holds there is refused. Neither k_scale nor v_scale held: 1.0, as vLLM's for an fp8 KV cache.
                filled, left = complete_kv_scales(
                    scales, lambda name: kv_slot_error(self.modules[fqn], fqn, name, default=True) is None, 1.0)
                defaults += [f"{fqn}.{name}" for name in filled]
                taken += [f"{fqn}.{name}" for name in left]
                if not scales:
                    del self.kv[fqn]
            if defaults:
                log.warning(
                    "fp8fx: %d KV-cache scales the checkpoint does not hold: 1.0, or the layer's other scale "
                    "where it has one (%s%s); if this is unintended, check the checkpoint's k_scale / v_scale tensors",
                    len(defaults), defaults[:3], " ..." if len(defaults) > 3 else "",
                )
            if taken:
                log.warning(
                    "fp8fx: %d KV-cache scales the checkpoint does not hold are not set, since the model uses the "
                    "name for an attribute of its own (%s%s): that attention keeps no such scale",
                    len(taken), taken[:3], " ..." if len(taken) > 3 else "",
                )
            report.kv_defaults, report.kv_not_set = defaults, taken
            # attached in commit, which must not fail: a name the module already uses for something else is
            # refused here, and the scales' tensors are made here (on a GPU, allocations, which can run out of
            # memory: made in commit, one that did left every layer fp8 and the later attentions without scales, a
            # model that refused a load again as already quantized), before anything was swapped in
            for fqn, scales in self.kv.items():
                try:
                    self.kv_tensors[fqn] = make_kv_scales(self.modules[fqn], scales, self.device, fqn)
                except ValueError as e:  # (kv_slot_error's, naming fqn.name)
                    raise CheckpointError(str(e)) from None
        self._compute_unsaved()

    def _compute_unsaved(self) -> None:
        """``computed``'s tensors, as transformers' initialization computes them: each module's by the
        ``_init_weights`` of the (sub-)model it belongs to (a VLM's vision tower's ``position_ids`` by its
        CLIPVisionModel's, which knows them: the whole model's did not), called on the module, else on one of its
        ancestors (Falcon-H1 fills its mixers' ``mup_vector`` from its FalconH1Model's). Each call is on a meta copy
        of that module (the model's tensors left as they are), with the tensors to compute made real and unset."""
        todo = dict(self.computed)
        for fqn, name in list(todo):
            if (fqn, name) not in todo:  # (computed with another's ancestor)
                continue
            parts = fqn.split(".") if fqn else []
            for depth in range(len(parts), -1, -1):  # the module first, then each of its ancestors up to the model
                owner = ".".join(parts[:depth])
                under = [key for key in todo if key[0] == owner or owner == "" or key[0].startswith(f"{owner}.")]
                if depth == len(parts):
                    under = [key for key in under if key[0] == fqn]
                for key, value in self._initialized(owner, under).items():
                    self.computed[key] = value
                    del todo[key]
                if (fqn, name) not in todo:
                    break
            else:
                owner = self._initializer(fqn)[0]  # (one exists: _check_meta_buffers, _check_missing_state)
                module = self.modules[fqn]
                what = ("a non-persistent buffer" if name in module._non_persistent_buffers_set else
                        "a tensor the model's class lets checkpoints leave out (_keys_to_ignore_on_load_missing)")
                raise CheckpointError(
                    f"{_join(fqn, name)}: {what}, on the meta device, that no checkpoint holds, and "
                    f"{type(owner).__name__}._init_weights does not compute it (nor on the modules around it); build "
                    "the model with it on a real device"
                )

    def _initializer(self, fqn: str) -> Optional[tuple[nn.Module, Callable[[nn.Module], None]]]:
        """(the model, its ``_init_weights``) transformers initializes module ``fqn`` with: the nearest transformers
        model around it, itself included (``smart_apply``: a VLM's vision tower, a CLIPVisionModel), else the whole
        model's; None where there is none. (A plain module's own ``_init_weights(self)`` is no such initializer.)"""
        parts = fqn.split(".") if fqn else []
        for depth in range(len(parts), 0, -1):
            module = self.modules[".".join(parts[:depth])]
            if callable(getattr(type(module), "_initialize_weights", None)) and hasattr(module, "_init_weights"):
                return module, module._init_weights
        init = getattr(self.model, "_init_weights", None)
        return (self.model, init) if init is not None else None

    def _initialized(self, owner: str, keys: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        """Of ``keys`` (modules under ``owner`` and their tensors' names), those that ``owner``'s initializer, called
        on ``owner``, computes: a meta copy of ``owner`` whose ``keys`` are real and unset (NaN, or the integer
        type's least value) before the call, and are not after it."""
        initializer = self._initializer(owner)
        if initializer is None:
            return {}
        top = self.modules[owner]
        # the copy leaves the model's real tensors alone: meta stand-ins for them (an initializer may write its
        # module's tensors in place), the model's own meta ones copied (meta: no memory)
        memo: dict[int, Any] = {}
        for t in [*top.parameters(), *top.buffers()]:
            if not t.is_meta:
                meta = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        copied = copy.deepcopy(top, memo)
        slots = {}
        with torch.no_grad():  # (HF's initializers write under no_grad; a plain one writing a parameter in place)
            modules = {fqn: copied.get_submodule(fqn[len(owner):].lstrip(".") if owner else fqn) for fqn, _ in keys}
            for module in modules.values():  # (its other tensors real too, as the initializer may read them)
                module.to_empty(device=self.device, recurse=False)
            for fqn, name in keys:
                slot = modules[fqn]._parameters if name in modules[fqn]._parameters else modules[fqn]._buffers
                slot[name].fill_(_unset(slot[name].dtype))
                slots[(fqn, name)] = (slot, name)
            initializer[1](copied)
        done = {}
        for key, (slot, name) in slots.items():
            new = slot[name]
            unset = new.isnan() if _is_float(new.dtype) else new == _unset(new.dtype)
            if not unset.all():
                done[key] = new.detach()
        return done

    def _check_dequantized_range(self, lin: _Linear) -> None:
        """An fp8 layer whose dequantized ``.weight`` view would hold inf in the model's dtype (a float16 model, a
        scale above 65504 / 448 = 146.2) is refused, before commit: the model is unchanged. Only layers with such
        a scale are counted (a second pass over their fp8 weight); one whose fp8 values stay small enough loads."""
        if not lin.wide_scales:
            return
        dtype = lin.module.weight.dtype
        count = _dequantized_overflow(lin.stage, dtype)
        if count:
            largest, entry = max(lin.wide_scales, key=lambda p: p[0])
            raise dequantized_range_error(entry, largest, dtype, count, lin.fqn)

    # --- 4. commit ---------------------------------------------------------------------------
    def commit(self, report: LoadReport) -> None:
        """Swap every new tensor in (nothing here can fail)."""
        for first, tensor in self.staged.items():
            old = self.state[first]
            new = nn.Parameter(tensor, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else tensor
            for key in self.aliases[id(old)]:
                module, leaf = self._owner(key), key.rpartition(".")[2]
                (module._parameters if leaf in module._parameters else module._buffers)[leaf] = new
        for lin in self.linears.values():
            module = lin.module
            if lin.config is not None:
                remember_trainable(module)
            for name, t in lin.plain.items():
                module._parameters[name] = nn.Parameter(t, requires_grad=False)
            if len(lin.shards) > 1:
                report.fused[lin.fqn] = tuple(s.rpartition(".")[2] for s in lin.shards)
            if lin.config is None:
                continue
            module._parameters.update({n: p for n, p in lin.stage._parameters.items() if p is not None})
            for attr, value in vars(lin.stage).items():
                if attr.startswith("_fp8fx_"):
                    setattr(module, attr, value)
            module.__class__ = fp8_class(type(module))
            module._parameters["weight"]._fp8fx_fqn = lin.fqn
            report.quantized[lin.fqn] = str(lin.config.scheme())
        for lin in self.linears.values():  # a shared bias: the other layer's new one (all are in by now)
            if lin.bias_of is not None:
                lin.module._parameters["bias"] = self.linears[lin.bias_of].module._parameters["bias"]
        for fqn, reason in self.not_quantized.items():
            weight = self.modules[fqn]._parameters.get("weight")
            if weight is not None:  # read back by the compile report
                weight._fp8fx_skip_reason, weight._fp8fx_fqn = reason, fqn
            report.not_quantized[fqn] = reason
        self.moe.commit(report)
        self.moe.tag_skipped(self.modules)
        moe_weights.tag_routers(self.model, self.routers)
        for fqn, module in self.modules.items():  # linear-like layers that are no linear (is_foreign_linear) and
            # experts fp8fx does not read (DBRX's): said
            if not fqn or fqn in self.routers or fqn in report.not_quantized:
                continue
            if is_foreign_linear(module):
                report.not_quantized[fqn] = (f"{type(module).__name__} is no nn.Linear: fp8fx quantizes nn.Linear "
                                             "and transformers' Conv1D layers and experts modules (loaded as stored)")
            elif (why := moe_weights.foreign_experts(module)) is not None:
                report.not_quantized[fqn] = f"{why} (loaded as stored)"
            else:
                continue
            moe_weights.tag_left_alone(module, fqn, report.not_quantized[fqn])  # (read back by the compile report)
        for (fqn, name), new in self.computed.items():
            module = self.modules[fqn]
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(new, requires_grad=module._parameters[name].requires_grad)
            else:
                module._buffers[name] = new
        for fqn, tensors in self.kv_tensors.items():  # (made in finish: assigned only)
            assign_kv_scales(self.modules[fqn], tensors)
        report.kv_scales = {f: dict(s) for f, s in self.kv.items()}
        report.unexpected = (self._stored_unexpected() + [self.entries[n].source or n for n in self.tied_copies]
                             + self.alias_copies)
        report.skipped = list(self.skipped)


def compare_tied(kept_entry: Entry, loads: str, kept: torch.Tensor, entry: Entry, key: str, t: torch.Tensor) -> None:
    """Refuses a checkpoint whose tensor ``t`` (``entry``, for the model's ``key``) holds other values than ``kept``
    (``kept_entry``, which loads the tensor the model ties ``key`` to, as ``loads``): compared in row chunks, in
    ``kept``'s dtype."""
    if t.shape != kept.shape:
        raise CheckpointError(f"{entry}: the model ties {key} to {loads} ({list(kept.shape)}), but the "
                              f"checkpoint's {key} is {list(t.shape)}; wrong model or checkpoint")
    flat_kept, flat = kept.reshape(-1), t.reshape(-1)
    differ = 0
    for i in range(0, flat.numel(), chunked.CHUNK_NUMEL):
        a, b = flat_kept[i : i + chunked.CHUNK_NUMEL], flat[i : i + chunked.CHUNK_NUMEL].to(kept.dtype)
        same = torch.isclose(a, b, rtol=0, atol=0, equal_nan=True) if a.is_floating_point() else a == b
        differ += int((~same).sum())
    if differ:
        raise CheckpointError(
            f"{kept_entry} and {entry}: the model ties {key} to {loads} (one tensor), but the checkpoint "
            f"holds different values for them ({differ} of {t.numel()} differ); build the model with them "
            f"untied (embeddings: tie_word_embeddings=False) to load both, or drop {key} from the checkpoint to "
            f"load {loads} into both"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _unset(dtype: torch.dtype):
    """A value no initializer writes everywhere: NaN for floats and complex numbers (rotary tables: Llama-4's
    ``freqs_cis``), the minimum for integers."""
    if _is_float(dtype):
        return float("nan")
    return torch.iinfo(dtype).min if dtype != torch.bool else False


def _looks_like_scale(name: str) -> bool:
    leaf = name.rpartition(".")[2]
    return leaf.endswith(("_scale", "_scale_inv", "zero_point")) or leaf in ("scale", "scale_inv")


def _progress(items: Sequence[Any], enabled: bool, desc: str) -> Iterable[Any]:
    """A tqdm bar over ``items`` when tqdm is installed (shown on terminals only)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="file", disable=None if enabled else True)
