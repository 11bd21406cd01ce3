"""``quantize_``: an already-built bf16/fp16 model -> fp8 weights, layer by layer."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import itertools
import logging
import math
import sys
import weakref
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from fp8fx import quant
from fp8fx.config import Fp8Config, config_or, entry_covers, first_named, online_fix
from fp8fx.lowerings import compat
from fp8fx.weights import moe
from fp8fx.weights.chunked import count_nonfinite
from fp8fx.weights.linear import Fp8LinearMethod, foreign_linear_reason, guard_casts, is_foreign_linear, is_quantized
from fp8fx.weights.linear import is_conv1d_class, is_linear, linear_weight
from fp8fx.weights.linear import adapters, remember_trainable, skip_reason
from fp8fx.weights.linear import MHA_OUT_PROJ, check_no_in_place_rescale, check_no_lazy_modules, kept_by_the_model
from fp8fx.weights.linear import weight_tensors
from fp8fx.weights.views import Dequantized

log = logging.getLogger("fp8fx")


def quantize_(
    model: nn.Module,
    config: Optional[Fp8Config] = None,
    *,
    input_scales: Optional[Mapping[str, float]] = None,
    strict: bool = False,
    prefix: str = "",
) -> nn.Module:
    """Quantize every ``nn.Linear`` of ``model`` in place (online: ``config`` must not be serialized), and every
    transformers ``Conv1D`` (GPT-2's projections, a weight [in, out]: its fp8 codes are stored as a linear's, [out,
    in], and its ``weight`` stays [in, out]), and every experts module (3-D ``gate_up_proj`` / ``down_proj``, or
    ungated ``up_proj`` / ``down_proj``: ``fp8fx.weights.moe``).

    Each layer goes through ``Fp8LinearMethod`` and its bf16 weight is released before the next
    layer starts. Layers that cannot be quantized (ignored, shape not divisible by the block,
    unsupported dtype) stay as they are, their weight tagged with the reason for the report; with
    ``strict=True`` any such layer other than an ignored one raises instead. Static activations
    (``activation_scheme="static"``) need ``input_scales``: ``{fqn: scale}`` for every quantized layer, and
    for an experts module ``{fqn}.gate_up_proj`` (ungated: ``{fqn}.up_proj``) and ``{fqn}.down_proj`` (the inputs
    of its two GEMMs), e.g.
    from ``fp8fx.calibrate``. Every check runs before the first layer changes.

    ``prefix``: the name of ``model`` inside the model it belongs to (vLLM's ``prefix``), for a model quantized
    part by part (``quantize_(layer, cfg, prefix=f"model.layers.{i}")``): layers are named, reported, matched
    against ``ignored_layers`` and looked up in ``input_scales`` by their full names, so that two parts'
    ``q_proj`` are not both reported as ``self_attn.q_proj``. A config or scales for the whole model serve each
    part: ``ignored_layers`` entries and ``input_scales`` of other parts are left to them. A part sees no weight it
    shares with the rest of the model: an ``lm_head`` tied to the embeddings (``tie_word_embeddings``) quantized as
    a part of its own is untied (the embeddings keep bf16); leave it to ``ignored_layers``, or quantize the whole
    model, which keeps a tied weight as it is.

    A ``torch.compile`` wrapper is quantized through the model it wraps, under the model's own names (not
    ``_orig_mod.<name>``), and returned.
    """
    config = config_or(config, Fp8Config(), "quantize_")
    check_prefix(prefix, "quantize_")
    wrapper, model = model, compat.compiled_module(model)  # torch.compile's wrapper: the model's own names
    if type(strict) is not bool:  # "no" would read as True
        raise ValueError(f"quantize_(strict={strict!r}): True or False")
    if config.is_checkpoint_fp8_serialized:
        raise ValueError(
            "quantize_ quantizes a bf16/fp16 model online, but the config has is_checkpoint_fp8_serialized=True (an "
            "fp8 checkpoint's: Fp8Config.from_config of its quantization_config); load the fp8 checkpoint with "
            f"load_checkpoint, or quantize with the same scheme: {online_fix('config')}"
        )
    modules = list(model.named_modules(prefix=prefix))
    done = {name: m for name, m in modules if is_quantized(m) or moe.is_quantized_experts(m)}
    resume = (config, prefix, strict)  # a quantize_ that failed on the way (_Undo): the same call finishes it
    unfinished = vars(model).get(_UNFINISHED)
    if done and unfinished is not None and unfinished != resume:
        was = "; ".join(f"it had {k}={v!r}, this call {k}={now!r}"
                        for k, v, now in zip(("config", "prefix", "strict"), unfinished, resume) if v != now)
        raise RuntimeError(
            f"quantize_: the model is half-quantized by a quantize_ call that stopped on the way ({len(done)} fp8 by "
            f"now, the rest still in high precision), and this call's arguments differ from it: {was}; call "
            "quantize_ again with that call's arguments to finish it, or quantize_ a fresh model (nothing was done)")
    if done and unfinished != resume:
        # (a model quantized part by part: the rest goes part by part too; one call over the whole model, the parts
        # done before in ignored_layers, would meet their tags, input scales and undo state as its own)
        raise RuntimeError(
            f"quantize_: {first_named(done)} is already fp8-quantized; quantize_ a fresh bf16 model instead of "
            "quantizing twice, or, for a model quantized part by part, each part not quantized yet with its prefix "
            "(quantize_(model.layers[1], config, prefix=\"layers.1\"))"
        )
    modules = [(name, m) for name, m in modules if name not in done]
    check_no_in_place_rescale(model, "quantize_", "quantized")
    check_no_lazy_modules(model, "quantize_", "quantized")
    config = checked_ignores(config, model, prefix, "quantized")
    plan: list[tuple[str, nn.Linear]] = []
    skipped: list[tuple[str, nn.Linear, str]] = []
    unmeant: dict[str, list[str]] = {}  # reason -> the layers skipped for it that nothing keeps in high precision
    decide = LinearDecider(model, prefix)
    for fqn, module in modules:
        if not is_linear(module):  # (nn.Linear, and transformers' Conv1D: GPT-2's)
            continue
        reason, on_purpose = decide(fqn, module, config)
        if reason is None:
            plan.append((fqn, module))
        elif strict and not on_purpose:
            raise _strict_refusal(fqn, model, reason)
        else:
            skipped.append((fqn, module, reason))
            if not on_purpose:
                unmeant.setdefault(reason, []).append(fqn)
    # experts modules (3-D gate_up_proj [E, 2I, H] or ungated up_proj [E, I, H], and down_proj [E, H, I]):
    # fp8fx.weights.moe
    experts: list[tuple[str, nn.Module]] = []
    experts_skipped: list[tuple[str, nn.Module, str]] = []
    for fqn, module in modules:
        if not moe.is_any_experts(module):
            continue
        reason = moe.skip_reason(module, fqn, config)
        if reason is None:
            experts.append((fqn, module))
        elif strict and reason != "in ignored_layers":
            raise _strict_refusal(fqn, model, reason)
        else:
            experts_skipped.append((fqn, module, reason))

    for fqn, module in plan:
        w = module.weight
        if w.is_meta:
            raise ValueError(
                f"{fqn}.weight is on the meta device: quantize_ needs the weights' values; build the model with "
                "torch.device('meta') and fp8fx.load_checkpoint(model, path) instead (nothing was quantized)"
            )
        # (on a detached view: a parameter made under inference_mode is an inference tensor, on which an op with
        # autograd recording it refuses to run; count_nonfinite also keeps the pass over a large weight chunked)
        bad = count_nonfinite(w.detach())
        if bad:
            raise ValueError(
                f"{fqn}.weight has {bad} NaN/Inf values; fix the weights or add {fqn!r} to ignored_layers "
                "(nothing was quantized)"
            )
    w = None  # (the last layer's bf16 weight: freed when that layer is quantized, not when quantize_ returns)
    for fqn, module in experts:
        for name in (moe.w13_name(module), moe.W2):
            if module._parameters[name].is_meta:
                raise ValueError(
                    f"{fqn}.{name} is on the meta device: quantize_ needs the weights' values; build the model with "
                    "torch.device('meta') and fp8fx.load_checkpoint(model, path) instead (nothing was quantized)"
                )
            bad = count_nonfinite(module._parameters[name].detach())
            if bad:
                raise ValueError(
                    f"{fqn}.{name} has {bad} NaN/Inf values; fix the weights or add {fqn!r} to ignored_layers "
                    "(nothing was quantized)"
                )
    if not plan and not experts:
        _nothing_to_quantize(model, modules, skipped + experts_skipped, strict)
    planned = [fqn for fqn, _ in plan] + [name for fqn, m in experts for name in moe.input_scale_names(fqn, m)]
    # a resumed call takes the same input_scales: those of the layers quantized before it failed are known names
    held = _held_input_scales(done)
    planned += list(held)
    not_quantized = {fqn: reason for fqn, _, reason in skipped}
    not_quantized.update({name: reason for fqn, m, reason in experts_skipped for name in moe.input_scale_names(fqn, m)})
    scales = _check_input_scales(config, planned, input_scales, not_quantized, prefix, _scale_owners(experts),
                                 _first_names(model, prefix))
    _check_resumed_scales(held, scales)

    untagged = _tags_of(model)  # (put back where quantize_ fails before it quantized anything)
    for fqn, module, reason in skipped:  # tags the report reads back from the compiled graph's inputs
        _tag_skipped(module, fqn, reason)
        log.info("fp8fx: %s not quantized: %s", fqn, reason)
    moe.tag_routers(model, decide.routers, prefix)
    method = Fp8LinearMethod(config)
    undo = _Undo(model, resume, len(plan) + len(experts) + len(done), len(done), untagged, plan + experts)
    del untagged  # (it holds every parameter: each bf16 weight is freed as its layer is quantized, not at the end)
    names = module_names(model, prefix)
    for fqn, module in plan:
        with undo.layer(fqn, module):
            remember_trainable(module)
            weight = linear_weight(module).detach()  # [out, in]: a Conv1D's [in, out] transposed, then copied
            weight = weight.contiguous() if is_conv1d_class(type(module)) else weight  # (into a linear's layout)
            n, k = weight.shape
            method.create_weights(module, k, [n], weight.dtype, device=weight.device, prefix=fqn)
            method.weight_loader(module, "weight", weight, values_checked=True)  # (checked above)
            del weight
            if fqn in scales:
                input_scale = torch.tensor([scales[fqn]], dtype=torch.float32, device="cpu")  # (not a meta block's)
                method.weight_loader(module, "input_scale", input_scale)
            method.process_weights_after_loading(module)
            module._parameters["weight"]._fp8fx_fqn = fqn
            # every name of the layer here: a copy of it run at another place is told from the layer run under
            # another of its names (``LinearPass._fqn``)
            module._parameters["weight"]._fp8fx_names = tuple(names.get(id(module), (fqn,)))
            bias = module._parameters.get("bias")  # (a parametrized bias is computed: its original stays trainable)
            if bias is not None:  # the layer is frozen fp8 from here on
                bias.requires_grad_(False)
    log.info("fp8fx: quantized %d linear layers (%s), skipped %d", len(plan), config.scheme(), len(skipped))
    for fqn, module, reason in experts_skipped:
        moe.tag_skipped(module, fqn, reason)
        log.info("fp8fx: %s not quantized: %s", fqn, reason)
    for fqn, module in experts:
        static = tuple(scales[name] for name in moe.input_scale_names(fqn, module)) if scales else None
        with undo.layer(fqn, module):
            remember_trainable(module)
            moe.quantize_experts(module, fqn, config, static)
    if experts or experts_skipped:
        log.info("fp8fx: quantized %d experts modules, skipped %d", len(experts), len(experts_skipped))
    for reason, fqns in unmeant.items() if plan or experts else ():  # (else _nothing_to_quantize says it)
        # what neither the config nor the model keeps in high precision is said at the default level (INFO went
        # unseen: a pruned layer stayed bf16 without a word); once the call succeeded (a failure in the loops above
        # undoes it all: the layers were not "left")
        log.warning("fp8fx: quantize_ left %d %s in high precision (%s): %s", len(fqns),
                    "layer" if len(fqns) == 1 else "layers", _shown(fqns), reason)
    _left_alone(modules, decide.routers, warn=bool(plan or experts))  # (else _nothing_to_quantize said it)
    vars(model).pop(_UNFINISHED, None)
    if plan or experts or done or skipped or experts_skipped or decide.routers:
        # (also where nothing was quantized: the guard's deep copy carries the weights' tags, the report's reasons)
        guard_casts(model)
    from fp8fx.checkpoint import pretrained  # (it imports the checkpoint package, which imports this module)

    if not prefix:
        pretrained.describe(model)
        part = _transformers_part(model) if plan or experts else ""
        if part:  # (its own save_pretrained is described; its parent's not)
            _warn_part_save(model, prefix, maybe=part == "maybe")
    elif (plan or experts) and ("transformers" in sys.modules or any(  # (a bare nn.Linear part of an HF model: its
            type(m).__module__.startswith("transformers.") for m in model.modules())):  # parent is out of reach)
        _warn_part_save(model, prefix)
    return wrapper


_PART_SAVE_WARNED = False


def _scale_owners(experts: Iterable[tuple[str, nn.Module]]) -> dict[str, str]:
    """Each experts module's input scale names (``{fqn}.gate_up_proj`` / ``{fqn}.down_proj``) -> its fqn, which
    ``ignored_layers`` takes."""
    return {name: fqn for fqn, m in experts for name in moe.input_scale_names(fqn, m)}


def _transformers_part(model: nn.Module) -> str:
    """"part" for a transformers module that is, or may be, a part of a larger model: a base model (``LlamaModel``,
    whose ``base_model`` is itself: a ForCausalLM's ``.model``, a VLM's language model) or a module with no
    ``save_pretrained`` of its own (a decoder layer); "maybe" for a model with output embeddings whose
    ``base_model`` is itself because its ``base_model_prefix`` names an attribute it lacks (``Llama4ForCausalLM``'s
    ``language_model``, ``T5ForConditionalGeneration``'s ``transformer``): whole on its own, its own
    ``save_pretrained`` describing it, and the language model of a VLM too (Llama-4's; InstructBLIP's flan-T5),
    which nothing in the module tells apart - but for a model of sub-models (its config has ``sub_configs``: Blip-2,
    an EncoderDecoderModel), which is the composite itself; else "". A PEFT model is judged by the model it wraps.
    (A part whose ``base_model`` is another module - Blip-2's ``OPTForCausalLM`` language model - looks whole: no
    warning, and the VLM's ``save_pretrained`` writes no quantization_config.)"""
    get_base = getattr(model, "get_base_model", None)
    if type(model).__module__.startswith("peft.") and callable(get_base):
        model = get_base()
    if not type(model).__module__.startswith("transformers."):
        return ""
    if not callable(getattr(model, "save_pretrained", None)):
        return "part"
    if getattr(model, "base_model", None) is not model:
        return ""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # (a model of its own that does not say: a part, as before)
        head = None
    if head is not None and getattr(type(getattr(model, "config", None)), "sub_configs", None):
        return ""  # (Blip2ForConditionalGeneration, VisionEncoderDecoderModel: the composite)
    return "maybe" if head is not None else "part"


def _warn_part_save(part: nn.Module, prefix: str, maybe: bool = False) -> None:
    """A part quantized with a prefix belongs to a model that fp8fx cannot reach: that model's ``save_pretrained``
    (transformers) writes the part's fp8 codes with no ``quantization_config``, and ``from_pretrained`` read them
    back as bf16 weights, unscaled (logits ~1.4x their norm off), warning only of unexpected keys. Said once a
    process (a loader quantizes every layer as a part), where the part holds a transformers module or transformers
    is imported (a part that is a bare ``nn.Linear`` of an HF model holds none)."""
    global _PART_SAVE_WARNED
    if _PART_SAVE_WARNED:
        return
    _PART_SAVE_WARNED = True
    if maybe:  # (a whole model, or a VLM's language model: ``_transformers_part``)
        log.warning("fp8fx: quantize_(%s) quantized a model that may also be a part of another, as a VLM's language "
                    "model: its own save_pretrained writes its quantization_config, but that of a model holding it "
                    "does not know its layers are fp8 and writes their codes with no quantization_config, which "
                    "from_pretrained reads as bf16 weights: save such a model with fp8fx.save_checkpoint(model, "
                    "folder) (said once)", type(part).__name__)
        return
    log.warning("fp8fx: quantize_(%s%s) quantized what may be a part of a model; if that model is a transformers "
                "one (a ForCausalLM whose .model this is), its save_pretrained does not know its layers are fp8 and "
                "writes their codes with no quantization_config, which from_pretrained reads as bf16 weights: save "
                "the model with fp8fx.save_checkpoint(model, folder) (said once)",
                type(part).__name__, f", prefix={prefix!r}" if prefix else "")


_UNFINISHED = "_fp8fx_unfinished"


def _tag_skipped(layer: nn.Module, fqn: str, reason: str) -> None:
    """Tags the weights of ``layer``, left in high precision for ``reason``, for the report (which reads them back
    from the compiled graph's inputs)."""
    for weight in weight_tensors(layer):
        weight._fp8fx_skip_reason = reason
        weight._fp8fx_fqn = fqn
        # a weight shared by several layers: each one's name and reason (the two above are the last one's)
        weight._fp8fx_owners = {**getattr(weight, "_fp8fx_owners", {}), fqn: reason}


def check_finished(model: nn.Module, what: str) -> None:
    """Refuses a model (or one with a submodule) that a failed ``quantize_`` left half-quantized (``_Undo``):
    ``what`` names the caller, which has done nothing yet."""
    fqn = next((f for f, m in model.named_modules() if _UNFINISHED in vars(m)), None)
    if fqn is not None:
        raise ValueError(
            f"{what}: {fqn or 'the model'} is half-quantized (a quantize_ call on it stopped on the way, its later "
            "layers still bf16): call quantize_ again with the same arguments to finish it first (nothing was done)")


def _tags_of(model: nn.Module) -> dict[int, tuple[torch.Tensor, dict]]:
    """The fp8fx tags (``_fp8fx_*`` attributes) of each of ``model``'s parameters and buffers, by id."""
    tensors = [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
    return {id(t): (t, {k: v for k, v in vars(t).items() if k.startswith("_fp8fx_")}) for t in tensors}


def _put_tags(model: nn.Module, tags: dict[int, tuple[torch.Tensor, dict]]) -> None:
    """Each tensor of ``model`` gets back the fp8fx tags ``tags`` (``_tags_of``) held for it, and no others."""
    for key, (t, _) in _tags_of(model).items():
        for k in [k for k in vars(t) if k.startswith("_fp8fx_")]:
            delattr(t, k)
        vars(t).update(tags.get(key, (t, {}))[1])


class _Undo:
    """What ``quantize_`` does when it fails on the way, after every check passed (an out-of-memory error in a late
    layer: a half-quantized model was left, which quantize_ then refused to finish). The layer it was quantizing is
    put back as it was (class, attributes, parameter and buffer dicts, its parameters' fp8fx tags and requires_grad);
    the layers before it stay fp8 (their bf16 weights are freed one by one: keeping them all to undo everything would
    hold the bf16 and the fp8 model at once); the model is marked so that the same ``quantize_`` call finishes the
    rest, and the error says so. The layers still bf16 are tagged with why, which the compiled model's report gives
    for them (it rewrites the fp8 ones: a half-quantized model still runs)."""

    def __init__(self, model: nn.Module, key: tuple, total: int, done: int, untagged: dict,
                 planned: list[tuple[str, nn.Module]]):
        self.model, self.key, self.total, self.done = model, key, total, done
        # the model's tensors' fp8fx tags before this call (_tags_of), put back where the first layer fails: dropped
        # once a layer is done, for it holds every parameter (the bf16 model and the fp8 one were both kept to the end)
        self.untagged = untagged if not done else None
        self.planned = planned  # the layers and experts modules this call quantizes, in its order

    @contextlib.contextmanager
    def layer(self, fqn: str, module: nn.Module):
        # (the hook dict copied too: an online layer refuses to run until processed, a pre-hook the failed call added)
        cls, attrs = module.__class__, {**vars(module), "_parameters": dict(module._parameters),
                                        "_buffers": dict(module._buffers),
                                        "_forward_pre_hooks": module._forward_pre_hooks.copy()}
        params = [(p, p.requires_grad, {k: v for k, v in vars(p).items() if k.startswith("_fp8fx_")})
                  for p in module._parameters.values() if p is not None]
        try:
            yield
        except BaseException as error:
            module.__class__ = cls
            vars(module).clear()
            vars(module).update(attrs)
            for p, grad, tags in params:
                for k in [k for k in vars(p) if k.startswith("_fp8fx_") and k not in tags]:
                    delattr(p, k)
                vars(p).update(tags)
                p.requires_grad_(grad)
            if not self.done:  # the first layer: nothing is fp8, the model is as it was (its reasons' tags too)
                _put_tags(self.model, self.untagged)
                if isinstance(error, Exception):
                    error.add_note(f"fp8fx: quantize_ stopped at {fqn}, the first layer it quantizes: nothing was "
                                   "quantized (the model is as it was)")
                raise
            vars(self.model)[_UNFINISHED] = self.key
            guard_casts(self.model)  # (its fp8 layers refuse a cast before any module converts, as when finished)
            from fp8fx.checkpoint import pretrained

            # its save_pretrained writes a quantization_config every reader refuses (save_checkpoint's refusal of a
            # half-quantized model): transformers' own wrote the fp8 layers' codes with none, read back as bf16
            pretrained.describe(self.model)
            reason = (f"quantize_ stopped at {fqn} ({type(error).__name__}) before it quantized this layer; call "
                      "quantize_ again with the same arguments to finish")
            for name, m in self.planned:
                if moe.is_any_experts(m) and not moe.is_quantized_experts(m):
                    moe.tag_skipped(m, name, reason)
                elif is_linear(m) and not is_quantized(m):
                    _tag_skipped(m, name, reason)
            if isinstance(error, Exception):
                error.add_note(
                    f"fp8fx: quantize_ stopped at {fqn}, which is as it was; {self.done} of {self.total} layers are "
                    "fp8 by now: call quantize_ again with the same arguments to finish (it goes on from there)")
            raise
        self.done += 1
        self.untagged = None


OUTPUT_EMBEDDINGS_KEPT = "output embeddings stored in high precision"  # (an fp8 checkpoint's lm_head: vLLM and
# transformers never quantize it for the fp8 format)


def kept_as_stored(fqn: str, head: Optional[str], kept: Mapping[str, str], routers: Mapping[str, str],
                   stored_high: Optional[Callable[[str], bool]]) -> Optional[str]:
    """Why an fp8 checkpoint's linear ``fqn`` loads in high precision whatever its ignore list says, or None: the
    output embeddings (``head``), a layer the model keeps (``kept``) or a router (``routers``), where the checkpoint
    stores it so (``stored_high(fqn)``; None: no checkpoint at hand, taken as so, as fp8 checkpoints store them).
    ``load_checkpoint``'s rule, and ``LinearDecider``'s for ``inspect`` and ``get_quant_method``."""
    reason = OUTPUT_EMBEDDINGS_KEPT if fqn == head else kept.get(fqn) or routers.get(fqn)
    return reason if reason is not None and (stored_high is None or stored_high(fqn)) else None


class LinearDecider:
    """``quantize_``'s decision for each ``nn.Linear`` of ``model`` (named with ``prefix``, as ``quantize_``'s):
    ``decide = LinearDecider(model, prefix)``; ``decide(fqn, layer, config)`` -> ``(reason, on_purpose)``: why the
    layer stays in high precision (None: it is quantized), and whether it is kept so on purpose (ignored, a tied
    weight, an MoE router, a layer the model keeps out of quantization: ``kept_by_the_model``), which ``strict``
    accepts. ``fp8fx inspect`` predicts each layer with it (for an fp8
    checkpoint's config, as ``load_checkpoint`` loads it). The order of
    the checks is part of the decision: a tied weight is reported as tied even where it is ignored; a router is a
    router unless the config (``ignored_layers``) or torch (``MultiheadAttention``'s ``out_proj``) keeps it.
    ``routers``: ``moe.routers(model, prefix)``, the routers that are no ``nn.Linear`` included.

    For an fp8 checkpoint, what such checkpoints store in high precision whatever their ignore list says (the output
    embeddings, the routers, the layers the model keeps) loads as stored: ``stored_high(fqn)`` says whether the
    checkpoint holds it in high precision (``load.stored_in_high_precision``); None, where no checkpoint is at hand
    (``inspect`` of a config alone, ``get_quant_method``), takes them as kept, as most fp8 checkpoints store them."""

    def __init__(self, model: nn.Module, prefix: str = "", stored_high: Optional[Callable[[str], bool]] = None):
        # (the model by a weak reference: get_quant_method keeps a model's decider while the model lives)
        self.model, self.prefix, self.stored_high = weakref.ref(model), prefix, stored_high
        # a weight shared by several modules (tied lm_head / embeddings); one module registered under two names
        # (``self.last = self.layers[-1]``) shares nothing
        self.owners: dict[int, dict[int, str]] = {}  # id(parameter) -> {id(owning module): its parameter's name}
        for owner, mod in model.named_modules(prefix=prefix, remove_duplicate=False):
            for leaf, p in mod._parameters.items():
                if p is not None:
                    self.owners.setdefault(id(p), {}).setdefault(id(mod), f"{owner}.{leaf}" if owner else leaf)
        self.routers = moe.routers(model, prefix)
        self.kept = kept_by_the_model(model, prefix)
        self.adapters = adapters(model, prefix)

    @functools.cached_property
    def head(self) -> Optional[str]:
        """The output embeddings' linear (``load.output_embeddings``), under ``prefix``; read for fp8 checkpoints
        only."""
        from fp8fx.checkpoint.load import output_embeddings

        model = self.model()
        name = None if model is None else output_embeddings(model, dict(model.named_modules()))
        return name if name is None or not self.prefix else f"{self.prefix}.{name}"

    def __call__(self, fqn: str, layer: nn.Module, config: Fp8Config) -> tuple[Optional[str], bool]:
        others = self.owners.get(id(layer._parameters.get("weight")), {})
        shared = [n for m, n in others.items() if m != id(layer)]
        if shared:  # quantizing one user of a tied weight unties it (the other keeps bf16); checkpoints store it once
            return f"weight tied to {shared[0]}", True
        if fqn in self.adapters:
            return self.adapters[fqn], True
        if config.is_checkpoint_fp8_serialized:  # (fp8fx inspect of an fp8 checkpoint's config) load_checkpoint's
            # plan: the layer loads as stored (a weight the block does not divide has ragged last blocks)
            if config.is_ignored(fqn):  # (a router the config targets too: the loader takes it as stored)
                return "in ignored_layers", True
            kept = kept_as_stored(fqn, self.head, self.kept, self.routers, self.stored_high)
            if kept is not None:
                return kept, True
            return (None, False) if layer._parameters.get("weight") is not None else (
                skip_reason(layer, fqn, config) or "no weight", False)
        reason = skip_reason(layer, fqn, config)
        chosen = reason in ("in ignored_layers", MHA_OUT_PROJ)
        if not chosen and fqn in self.kept:  # the model's keep holds whatever the scheme (T5's wo: a block that did not
            # divide it told the user to use per-channel scales, which kept it bf16 all the same, and strict refused)
            return self.kept[fqn], True
        if fqn in self.routers:  # a router, unless the config or torch keeps it: the reason that holds whatever the
            # scheme (a block not dividing a one-output gate told the user to use per-channel scales, which kept it
            # bf16 all the same)
            return reason if chosen else self.routers[fqn], True
        return reason, chosen


def _strict_refusal(fqn: str, model: nn.Module, reason: str) -> ValueError:
    """``strict=True``'s error for the layer ``fqn`` skipped for ``reason``. Where the model passed is itself the
    layer (its name is ''; the message began ": weight [100, 128] ...", and pointed to ignored_layers, which names
    the layers inside a model: h152), the model by its class, and the fix that applies."""
    if fqn:
        return ValueError(f"{fqn}: {reason} (strict=True: nothing was quantized)")
    return ValueError(f"the {type(model).__name__} passed to quantize_: {reason} (strict=True: nothing was quantized; "
                      "it is the layer itself, which no ignored_layers entry names: to keep it in high precision, do "
                      "not pass it to quantize_)")


def _nothing_to_quantize(model: nn.Module, modules, skipped, strict: bool) -> None:
    """quantize_ found no layer it would quantize: a warning (an error with ``strict``) that says why - each
    skipped layer's reason, or the linear-like modules that are no linear (``is_foreign_linear``)."""
    message = nothing_quantized("quantize_", model, {fqn: reason for fqn, _, reason in skipped}, modules)
    if strict and (not skipped or any(reason != "in ignored_layers" for _, _, reason in skipped)):
        raise ValueError(message)
    log.warning("fp8fx: %s", message)


def nothing_quantized(what: str, model: nn.Module, reasons: Mapping[str, str], modules) -> str:
    """The message of a call (``quantize_``, ``load_checkpoint``) that quantized nothing: the layers it skipped, by
    reason (``{fqn: reason}``), and the linear-like ``modules`` that are no ``nn.Linear``."""
    by_reason: dict[str, list[str]] = {}
    for fqn, reason in reasons.items():
        by_reason.setdefault(reason, []).append(fqn)
    why = [f"{len(f)} {'layer' if len(f) == 1 else 'layers'} ({f[0] or 'the model itself'}"
           f"{', ...' if len(f) > 1 else ''}): {r}"
           for r, f in by_reason.items()] or ["it has no nn.Linear and no experts module"]
    others = sorted({type(m).__name__ for _, m in modules if is_foreign_linear(m)})
    if others:
        why.append(f"modules of other kinds with 2-D weights, which fp8fx does not quantize: {others}")
    return f"{what}: nothing in this {type(model).__name__} is quantized: {'; '.join(why)}"


def _left_alone(modules, routers, warn: bool) -> None:
    """Tags the weights of the modules quantize_ passes by with why, for the compile report, and warns of them
    (``warn``) by kind: linear-like modules that are no linear (``is_foreign_linear``) and experts of a layout
    fp8fx does not read (DBRX's, JetMoE's): they stay in high precision. Routers are meant to."""
    kinds: dict[str, list[str]] = {}
    for fqn, m in modules:
        why = moe.foreign_experts(m) or foreign_linear_reason(m)
        if why and fqn not in routers:
            kinds.setdefault(why, []).append(fqn)
            moe.tag_left_alone(m, fqn, why)
    for why, fqns in kinds.items() if warn else ():
        log.warning("fp8fx: quantize_ left %d modules in high precision (%s): %s", len(fqns), _shown(fqns), why)


def _shown(names: list[str]) -> str:
    """The first three of ``names`` for a message, `` ...`` after them if there are more."""
    return f"{names[:3]}{' ...' if len(names) > 3 else ''}"


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """The closest of ``names``, or the one ending in ``.name`` (``lm_head`` of a PEFT model, whose name is
    ``base_model.model.lm_head``: too far for difflib). A name one part below one of ``names`` (a parameter of a
    module, ``experts.gate_up_proj``; an expert of fused experts, ``experts.3``) gets that module, unless the part
    is close to one of its children's (a misspelt child): difflib's pick over the whole name had been a sibling that
    only shared the prefix (``experts.act_fn``, h149)."""
    names = list(names)
    parent = max((n for n in names if name.startswith(f"{n}.")), key=len, default=None)
    part = name[len(parent) + 1:] if parent is not None else ""
    if part and "." not in part:
        children = {n[len(parent) + 1:].split(".")[0] for n in names if n.startswith(f"{parent}.")}
        if not (part.isdigit() and any(c.isdigit() for c in children)):  # (layers.99: the closest index is no answer)
            # a child by its last part: close, or holding it (model.embed: embed_tokens, under difflib's cutoff)
            near = difflib.get_close_matches(part, children, n=1) or sorted(c for c in children if part in c)[:1]
            if near:
                return f" (did you mean {parent + '.' + near[0]!r}?)"
            close = difflib.get_close_matches(name, names, n=1)
            if close and not (close[0] + ".").startswith(f"{parent}."):  # (elsewhere in the model: model.lm_head)
                return f" (did you mean {close[0]!r}?)"
            return f" (did you mean {parent!r}? {part!r} is none of its modules)"
    close = difflib.get_close_matches(name, names, n=1)
    ends = [n for n in names if n.endswith(f".{name}")]
    if not close and len(ends) > 1:  # (q_proj of every layer: one of them would be no answer)
        return f" (the last part of {len(ends)} names, {ends[0]!r} ...: each by its full name)"
    close = close or ends
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_prefix(prefix: str, where: str) -> None:
    if not isinstance(prefix, str) or prefix.startswith(".") or prefix.endswith(".") or ".." in prefix:
        raise ValueError(
            f"{where}(prefix={prefix!r}): the dotted name of the module inside its model, e.g. 'model.layers.0' "
            "('' for the whole model)"
        )


def checked_ignores(config: Fp8Config, model: nn.Module, prefix: str, undone: str) -> Fp8Config:
    """``config`` as ``quantize_`` and ``calibrate`` go by it: its ``ignored_layers`` checked against every name of
    ``model``'s modules (``check_ignored_layers``: a module registered twice is named by either), and widened to the
    names ``named_modules()`` gives such modules (``ignoring_aliases``)."""
    aliases = [fqn for fqn, _ in model.named_modules(prefix=prefix, remove_duplicate=False)]
    check_ignored_layers(config, aliases, f"this {type(model).__name__}", undone, prefix)
    return ignoring_aliases(config, model, prefix)


def module_names(model: nn.Module, prefix: str = "") -> dict[int, list[str]]:
    """id(module) -> every name of it, its first (``named_modules()``'s) first."""
    names: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(prefix=prefix, remove_duplicate=False):
        names.setdefault(id(module), []).append(fqn)
    return names


def ignoring_every_name(config: Fp8Config, model: nn.Module) -> Fp8Config:
    """``config``, its ``ignored_layers`` naming every name of each module it names by one (``convert``'s plan reads
    a checkpoint's tensors under whichever name it holds them)."""
    if not (config.ignored_layers or config.modules_to_not_convert):
        return config
    more = tuple(x for n in module_names(model, "").values() if len(n) > 1 and any(map(config.is_ignored, n))
                 for x in n if not config.is_ignored(x))
    return dataclasses.replace(config, ignored_layers=tuple(config.ignored_layers or ()) + more) if more else config


def _first_names(model: nn.Module, prefix: str) -> dict[str, str]:
    """A module's other names -> its first (one module registered twice, ``model.b = model.a``)."""
    return {other: n[0] for n in module_names(model, prefix).values() for other in n[1:]}


def ignoring_aliases(config: Fp8Config, model: nn.Module, prefix: str) -> Fp8Config:
    """``config``, its ``ignored_layers`` naming also the first name of each module that an entry names by another
    of its names (one module registered twice, ``self.last = self.layers[-1]``; or under a parent registered twice):
    ``named_modules()`` gives such a module once, under its first name, which no entry covered."""
    if not (config.ignored_layers or config.modules_to_not_convert):
        return config
    names = module_names(model, prefix)
    more = tuple(n[0] for n in names.values() if not config.is_ignored(n[0]) and any(map(config.is_ignored, n[1:])))
    return dataclasses.replace(config, ignored_layers=tuple(config.ignored_layers or ()) + more) if more else config


def _misplaced_prefix(entry: str, prefix: str, names: list[str]) -> Optional[str]:
    """The name this part likely has in its model, where ``entry`` (outside ``prefix``) names one of its modules under
    a name that ends with ``prefix`` or is its end (``quantize_(model.model.layers[0], prefix="layers.0")`` with an
    entry ``model.layers.0.mlp.down_proj``): the prefix likely misses the model's root or has one too many; else
    None. (A model-wide config's entry of another part, ``model.layers.1.mlp.down_proj``, is none of these; one of
    ``encoder.layers.0`` beside a part ``layers.0`` is, which is why the caller warns and does not refuse.)"""
    for fqn in names:  # (the part itself among them, named prefix)
        rel = fqn[len(prefix):]  # "" for the part itself, else ".mlp.down_proj"
        if fqn.startswith(prefix) and (entry.endswith(rel) if rel else True):
            head = entry[:len(entry) - len(rel)]
            if head and head != prefix and (head.endswith("." + prefix) or prefix.endswith("." + head)):
                return head
    return None


def check_ignored_layers(config: Fp8Config, names: Iterable[str], where: str, undone: str, prefix: str = "") -> None:
    """Every ``ignored_layers`` entry names one of ``names`` (modules: of a model, or of a checkpoint) or a prefix
    of some: a misspelt entry would quantize the very layer it was meant to keep in high precision. ``where``
    and ``undone`` complete the message: "names no module of <where>", "(nothing was <undone>)"."""
    names = [fqn for fqn in dict.fromkeys(names) if fqn]
    for entry in config.ignored_layers or ():
        if entry in (config.modules_to_not_convert or ()):  # (read as transformers reads it: it may name no module)
            continue
        if prefix and not (entry_covers(entry, prefix) or entry_covers(prefix, entry)):
            # a model-wide config quantizing one part (prefix): the entry is another part's, unless it names a
            # module of this part by its name inside the part, which would quantize the layer it meant to keep
            inside = [fqn for fqn in names if entry_covers(entry, fqn[len(prefix) + 1:])]
            if inside:
                raise ValueError(
                    f"Fp8Config.ignored_layers: {entry!r} names {inside[0]!r} by its name inside the part "
                    f"(prefix={prefix!r}), and entries are full names: write {inside[0]!r}; if it names a module "
                    f"outside this part, pass this part a config without it, as the name is ambiguous here "
                    f"(nothing was {undone})"
                )
            head = _misplaced_prefix(entry, prefix, names)
            if head is not None:  # (a warning: a model with both "layers.0" and "encoder.layers.0" has it right)
                log.warning(
                    "fp8fx: Fp8Config.ignored_layers: %r names %s of a part named %r, and this part was given "
                    "prefix=%r, which %r %s with: if that part is this one, its prefix is wrong and the layer is not "
                    "kept in high precision; pass the part's full name inside the model, prefix=%r", entry,
                    entry[len(head) + 1:] or "the part", head, prefix, head,
                    "ends" if head.endswith("." + prefix) else "is the end of", head)
            continue
        if not any(entry_covers(entry, fqn) for fqn in names):
            raise ValueError(
                f"Fp8Config.ignored_layers: {entry!r} names no module of {where}{did_you_mean(entry, names)}; "
                f"correct or remove the entry: a module's full name or a prefix of names, no regex or suffix "
                f"(nothing was {undone})"
            )


def _held_input_scales(done: Mapping[str, nn.Module]) -> dict[str, Optional[torch.Tensor]]:
    """The layers quantized before (a resumed call) by their names in ``input_scales`` -> the static input scale each
    holds (None under dynamic activations): a linear's, or an experts module's two (``moe.input_scale_names``)."""
    held = {}
    for fqn, module in done.items():
        if moe.is_quantized_experts(module):
            for name in moe.input_scale_names(fqn, module):
                held[name] = module._parameters.get(f"{name.rpartition('.')[2]}_input_scale")
        else:
            held[fqn] = module._parameters.get("input_scale")
    return held


def _check_resumed_scales(held: Mapping[str, Optional[torch.Tensor]], scales: Mapping[str, float]) -> None:
    """A resumed call (``_Undo``) is the failed one again: the layers it had quantized hold their static input
    scales (``held``), and ``scales`` must give them the same ones (float32), or the model would end up calibrated
    two ways."""
    for name, scale in held.items():
        if scale is None or name not in scales:
            continue
        given = float(torch.tensor(scales[name], dtype=torch.float32, device="cpu"))
        if scale.float().item() != given:
            raise ValueError(
                f"quantize_: {name} was quantized with the input scale {scale.float().item():.6g} by the call "
                f"that stopped on the way, and input_scales now gives it {given:.6g}; finish with that call's "
                "input_scales, or quantize_ a fresh bf16 model with the new ones (nothing more was quantized)"
            )


def _same_scale(a, b) -> bool:
    """Whether two ``input_scales`` values are one float32 number, as the layer holds it (a float, a 1-element
    tensor); any other value is only itself (the check of each value names it)."""
    try:
        return float(torch.tensor(float(a), dtype=torch.float32)) == float(torch.tensor(float(b), dtype=torch.float32))
    except (TypeError, ValueError, RuntimeError):
        return a is b


def _check_input_scales(config, planned: list[str], input_scales, not_quantized: Mapping[str, str],
                        prefix="", owners: Optional[Mapping[str, str]] = None,
                        first_names: Optional[Mapping[str, str]] = None) -> dict[str, float]:
    """``input_scales`` as floats, checked against ``planned`` (the names that take a scale: linears, and the
    experts' ``{fqn}.gate_up_proj`` / ``{fqn}.down_proj``) and ``not_quantized`` (name -> why); ``owners``: an experts
    scale's name -> its experts module, which ``ignored_layers`` takes; ``first_names``: a module's other names -> the
    one ``planned`` has (``_first_names``), an entry under another name is taken as the module's."""
    owners, first_names = owners or {}, first_names or {}
    if input_scales is not None and not isinstance(input_scales, Mapping):  # (a list, a tensor: a bare TypeError)
        raise ValueError(f"quantize_(input_scales={input_scales!r:.80}): a {type(input_scales).__name__}; it takes "
                         "a dict of layer name -> scale, as fp8fx.calibrate(model, batches) returns")
    if config.activation_scheme != "static":
        if input_scales:
            raise ValueError(f"quantize_(input_scales=...) with activation_scheme={config.activation_scheme!r}: the "
                             "scales serve static activations only; pass Fp8Config(activation_scheme='static'), or "
                             "leave input_scales out (nothing was quantized)")
        return {}
    given = dict(input_scales or {})
    for fqn in given:
        if not isinstance(fqn, str):  # a layer index, the module itself: difflib would fail on it
            raise ValueError(
                f"input_scales key {fqn!r:.60} ({type(fqn).__name__}): keys are layer names (str), e.g. "
                f"{(planned or ['model.layers.0.mlp.down_proj'])[0]!r}, as fp8fx.calibrate returns them "
                "(nothing was quantized)"
            )
    if first_names:  # (model.b = model.a: input_scales["b"] is a's, as ignored_layers=["b"] ignores a)
        renamed: dict[str, tuple[str, object]] = {}
        for fqn, value in given.items():
            head = next((h for h in (fqn, fqn.rpartition(".")[0]) if h in first_names), None)
            first = fqn if head is None else first_names[head] + fqn[len(head):]
            if first not in planned and first not in not_quantized:  # (a typo: named as given in what follows)
                first = fqn
            if first in renamed and not _same_scale(renamed[first][1], value):
                raise ValueError(f"input_scales[{renamed[first][0]!r}]={renamed[first][1]!r} and input_scales[{fqn!r}]"
                                 f"={value!r}: two names of one layer, two scales; keep one (nothing was quantized)")
            renamed[first] = (fqn, value)
        given = {first: value for first, (_, value) in renamed.items()}
    others = []  # scales of other parts, or of this part under its own names (calibrate(part) without prefix=)
    if prefix:  # the scales of a whole model (calibrate(model)), this part quantized: its own
        others = [fqn for fqn in given if not entry_covers(prefix, fqn)]
        given = {fqn: v for fqn, v in given.items() if entry_covers(prefix, fqn)}
    for fqn in given:
        if fqn in not_quantized:  # e.g. calibrated with a config that did not ignore it: the scale has no use
            log.info("fp8fx: input_scales[%r] unused: the layer is not quantized (%s)", fqn, not_quantized[fqn])
        elif fqn not in planned:
            raise ValueError(
                f"input_scales[{fqn!r}]: no linear layer (or experts' gate_up_proj / down_proj) of the model has "
                f"that name{did_you_mean(fqn, planned)}; correct or remove the entry (nothing was quantized)"
            )
    missing = [fqn for fqn in planned if fqn not in given]
    if missing:
        shown = _shown(missing)
        # scales under this part's own names (calibrate(part) without prefix=): the prefix is what they lack; scales
        # of other parts (the whole model's calibrate, which gave this part's layers none) say why below
        if not given and any(f"{prefix}.{fqn}" in planned or f"{prefix}.{fqn}" in not_quantized for fqn in others):
            raise ValueError(
                f"activation_scheme='static' needs an input scale for every quantized layer; missing {shown}: "
                f"input_scales names no layer under prefix={prefix!r} (e.g. {others[0]!r}); scales of this part alone "
                f"take its prefix too: fp8fx.calibrate(part, batches, prefix={prefix!r}), or pass the whole model's "
                "fp8fx.calibrate(model, batches) (nothing was quantized)"
            )
        if not given and not others:
            raise ValueError(f"activation_scheme='static' needs an input scale for every quantized layer; missing "
                             f"{shown}; pass input_scales=fp8fx.calibrate(model, batches)")
        # scales for other layers: most likely calibrate's, which has none for a layer it never saw run
        modules = list(dict.fromkeys(owners.get(fqn, fqn) for fqn in missing))  # (ignored_layers names the experts)
        linears = [fqn for fqn in missing if fqn not in owners]
        them = 'it' if len(modules) == 1 else 'them'
        # (a part: calibrate of the whole model also drops the scale of a layer whose inputs were all zero where the
        # whole model's quantize_ keeps it - a weight tied to another part's -, which this part's quantize_ quantizes)
        zero = (", or, calibrating the whole model, to one whose inputs were all zero in every batch where the whole "
                "model's quantize_ keeps it in high precision (a weight tied to another part's: calibrate's warning "
                "names it), as this part's quantize_ does not") if prefix else ""
        raise ValueError(
            f"activation_scheme='static' needs an input scale for every quantized layer; missing {shown} in "
            "input_scales" + (f" (it names no layer under prefix={prefix!r}, e.g. {others[0]!r})" if not given else "")
            + ": fp8fx.calibrate gives none to a layer that received no input during calibration (a "
            "branch the batches did not take" + (", experts no token was routed to" if len(linears) < len(missing)
                                                 else "")
            + (", or a layer whose weight is read in a spelling the linear pass does not take either" if linears
               else "") + f"){zero}; calibrate with batches that reach {them}"
            + (" with nonzero inputs" if prefix else "") + f", or add {_shown(modules)} to ignored_layers (nothing "
            "was quantized)"
        )
    checked = {}
    for fqn, value in given.items():  # as the layers get them, float32: what is checked here is what they hold
        try:
            scale = None if isinstance(value, (str, bytes, bool)) else float(value)  # a number or a 1-element tensor
        except (TypeError, ValueError, RuntimeError):
            scale = None
        # a normal float32 (a subnormal one's reciprocal, which the kernels multiply by, is inf)
        as_f32 = None if scale is None else float(torch.tensor(scale, dtype=torch.float32, device="cpu"))
        if as_f32 is None or not torch.finfo(torch.float32).tiny <= as_f32 < float("inf"):
            f32 = "" if scale is None or not 0 < scale < float("inf") else (
                f" in float32's normal range, 1.2e-38 to 3.4e38 (the scales' dtype: it holds this one as {as_f32})")
            raise ValueError(f"input_scales[{fqn!r}]={value!r} must be a positive finite float{f32} (nothing was "
                             "quantized)")
        checked[fqn] = as_f32
    return checked


class _WeightReads(TorchFunctionMode):
    """Records, as ``record(fqns, x)``, the input ``x`` of every linear of a tracked ``nn.Linear`` weight (``fqns``: the
    layers that hold it, several where they share it) that is not a call of the module, in the spellings the linear
    pass rewrites: ``F.linear(x, layer.weight)``, ``x @ layer.weight.t()``, ``torch.mm(x, w.T)``,
    ``torch.addmm(b, x, w.mT)``, the weight read through ``.t()``, ``.T``, ``.mT``, ``transpose``, ``permute``, casts
    that change nothing (to its own dtype and device) and ``contiguous``, or on the left (``w @ x``): a module hook
    does not see these, and static activations need their scales. A call of the module itself, whose ``F.linear``
    is seen too, is measured by that (``calibrate``'s ``read``). An fp8 layer's weight, dequantized anew at each read,
    is found by its name (``named``)."""

    _MATMULS = frozenset(("matmul", "mm", "__matmul__"))

    def __init__(self, weights: Mapping[str, torch.Tensor], record: Callable[[list[str], torch.Tensor], None],
                 named: Optional[Mapping[str, list[str]]] = None):
        super().__init__()
        self.record = record
        self.reads = WeakIdKeyDictionary()  # tensor -> (fqns, transposed): the weights and their views, casts
        for fqn, w in weights.items():
            self.reads.setdefault(w, ([], False))[0].append(fqn)  # (two linears may share one weight)
        self.named = dict(named or {})  # an fp8 layer's dequantized weight's name (views.Dequantized) -> [its fqn]

    def _read(self, t):
        if not isinstance(t, torch.Tensor):
            return None
        found = self.reads.get(t)
        if found is None and isinstance(t, Dequantized) and getattr(t, "_fp8fx_of", None) in self.named:
            if t.dim() == 2 and t.is_contiguous():  # (the layer's weight as read; its views are tracked above)
                found = (self.named[t._fp8fx_of], False)
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        first = self._read(args[0]) if args else None
        if first is not None and isinstance(out, torch.Tensor) and out is not args[0]:
            src = args[0]
            if name in quant.CAST_METHODS and (out.shape, out.dtype, out.device) == (src.shape, src.dtype, src.device):
                # (a cast that changes nothing, as the pass looks through: ``w.float()`` of a bf16 weight computes
                # in float32 on the dequantized weight, not rewritten, and its input widened the layer's scale)
                self.reads[out] = first
            elif _transposing_view(src, out):  # .t(), .T, .mT, permute(1, 0) ...
                self.reads[out] = (first[0], not first[1])
        if name == "linear":
            x, w = (kwargs.get("input", args[0] if args else None),
                    kwargs.get("weight", args[1] if len(args) > 1 else None))
            self._seen(x, self._read(w), transposed=False)
        elif name in self._MATMULS or name == "addmm":
            operands = list(args) + [kwargs[k] for k in ("input", "self", "mat1", "mat2", "other") if k in kwargs]
            operands = operands[1:] if name == "addmm" else operands  # (addmm's bias first)
            if len(operands) == 2:
                self._seen(operands[0], self._read(operands[1]), transposed=True)
                if name != "addmm" and self._read(operands[1]) is None:  # ``w @ x``: the linear of x's columns,
                    self._seen(operands[1], self._read(operands[0]), transposed=False)  # (x.mT @ w.t()).mT
        return out

    def _seen(self, x, read, transposed: bool) -> None:
        if read is None or read[1] != transposed or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        self.record(read[0], x)


def _transposing_view(src: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` is ``src.t()``: a view of the 2-D ``src``'s memory with its shape and strides reversed."""
    try:
        return (out.ndim == 2 and src.ndim == 2 and out.shape == src.shape[::-1] and out.stride() == src.stride()[::-1]
                and out.data_ptr() == src.data_ptr())
    except RuntimeError:  # (a tensor subclass without strides or storage: not taken for a weight's view)
        return False


def _takes_keywords(model: nn.Module, batch: Mapping) -> bool:
    """``model(**batch)`` binds to the forward's parameters (else the mapping is one argument, for a forward that
    takes one dict). A mapping some of whose keys name the forward's parameters is refused where it does not bind
    (a tokenizer's attention_mask for a forward(input_ids)): it went to the model as one argument, and failed in
    torch, or in the hooks, naming nothing."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(**batch)
    except TypeError as e:
        named = [k for k in batch if isinstance(k, str) and k in signature.parameters]
        if named:
            others = [k for k in batch if k not in signature.parameters]
            fix = f"drop the keys it does not take ({others})" if others else "give each batch the arguments it lacks"
            raise ValueError(
                f"calibrate: a batch's keys {list(batch)} do not bind to {type(model).__name__}.forward{signature} "
                f"({e}); {fix}, or give each batch as the forward takes it") from None
        return False
    return True


def _record(amax: dict[str, float], name: str, value: float, batch_no: int) -> None:
    if not math.isfinite(value):  # max() would drop a NaN and leave a scale of ~2e-15
        raise ValueError(
            f"calibrate: the input of {name} holds NaN or Inf values in batch {batch_no} (amax {value}); a static "
            "scale needs finite activations: fix or drop that batch"
        )
    amax[name] = max(amax.get(name, 0.0), value)


def fused_activation(module: nn.Module) -> Optional[str]:
    """fused_moe's name of the experts module's ``act_fn`` where it computes it, else None: a one-argument SiLU
    (nn.SiLU, transformers' SiLUActivation, F.silu) ``"silu"``; GELU's tanh approximation (nn.GELU("tanh"),
    transformers' GELUTanh: Gemma-4's) ``"gelu_tanh"``; the exact GELU (nn.GELU(), transformers' GELUActivation)
    ``"gelu"``; the squared ReLU (transformers' ReLUSquaredActivation, "relu2": Nemotron-H's) ``"relu2"``. Not the
    Python formulas (``use_gelu_tanh_python``, ``use_gelu_python``), whose ops the MoE pass does not read."""
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is nn.functional.silu:
        return "silu"
    if isinstance(act, nn.GELU):
        return {"tanh": "gelu_tanh", "none": "gelu"}.get(act.approximate)
    if type(act).__name__ == "ReLUSquaredActivation":
        return "relu2"
    inner = getattr(act, "act", None)  # transformers' GELUTanh: functools.partial(F.gelu, approximate="tanh")
    if (type(act).__name__ in ("GELUTanh", "PytorchGELUTanh") and getattr(inner, "func", None) is
            nn.functional.gelu and getattr(inner, "keywords", {}) == {"approximate": "tanh"}):
        return "gelu_tanh"
    return "gelu" if type(act).__name__ == "GELUActivation" and inner is nn.functional.gelu else None


def _gate_of(mod: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' activation of their first GEMM's output [..., 2I]: HF's ``_apply_gate``, which its grouped_mm /
    batched_mm code calls (GPT-OSS's interleaved, clamped SwiGLU; ``act_fn(gate) * up`` by default); else
    ``act_fn(gate) * up`` of the halves, SiLU for a module with no act_fn (a loop calling F.silu,
    examples/moe_reference.py: the activation the MoE pass fuses). Ungated experts: ``act_fn`` of the output [..., I]
    (HF's grouped_mm / batched_mm code for ``has_gate=False``)."""
    if moe.is_ungated_experts(mod):  # (calibrate refused those with no act_fn before it ran)
        return mod.act_fn
    if callable(getattr(mod, "_apply_gate", None)):
        return mod._apply_gate
    act = mod.act_fn if getattr(mod, "act_fn", None) is not None else nn.functional.silu

    def gated(g1: torch.Tensor) -> torch.Tensor:
        gate, up = g1.chunk(2, dim=-1)
        return act(gate) * up
    return gated


def _read_from_code(mod: nn.Module) -> bool:
    """Gated experts with neither ``_apply_gate`` nor ``act_fn``: their own code computes the activation (a loop such as
    examples/moe_reference.py's), which the MoE pass reads from the graph and ``_gate_of`` takes to be SiLU of
    gate_up_proj's halves."""
    return not (moe.is_ungated_experts(mod) or callable(getattr(mod, "_apply_gate", None))
                or getattr(mod, "act_fn", None) is not None)


def _experts_recorder(fqn: str, amax: dict[str, float], batch_no: list[int], expected: dict, empty: set[str]):
    """A forward pre-hook of an experts module ``forward(hidden_states, top_k_index, top_k_weights)`` (HF's):
    the amax of the tokens its experts get, and of each expert's activation (``_gate_of``) on them. An experts module
    called with the hidden states only (Llama-4's dense form, ``fp8fx.passes.moe``): expert e's rows are the e-th
    E-th of them. For experts whose activation is their code's (``_read_from_code``), the output that reading gives
    goes into ``expected`` for ``_experts_checker``. A call on no tokens puts the module's two scale names in
    ``empty``."""

    def record(mod, args, kwargs):
        bound = inspect.signature(mod.forward).bind(*args, **kwargs).arguments
        x, ids, wts = (list(bound.values()) + [None, None])[:3]
        w13 = getattr(mod, moe.w13_name(mod))
        w13 = w13.transpose(1, 2) if moe.is_transposed(mod) else w13  # [E, 2I, H] (ungated: [E, I, H])
        experts = w13.shape[0]
        if ids is None and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] % experts == 0:
            ids = torch.arange(experts, device=x.device).repeat_interleave(x.shape[0] // experts)
        if not (isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex()):
            raise ValueError(
                f"calibrate: {fqn}'s forward takes {list(bound)[:3]}; it measures experts modules called as HF's, "
                "forward(hidden_states, top_k_index, top_k_weights), or Llama-4's forward(hidden_states) on [E * T, "
                "H]: add the module to ignored_layers"
            )
        x = x.reshape(-1, x.shape[-1])
        if not x.shape[0]:  # no token (an empty batch): nothing to measure, and said so, as for linears (h137: it
            empty.update(moe.input_scale_names(fqn, mod))  # was "received no input ... a branch not taken")
            return
        ids = ids.reshape(x.shape[0], -1)
        gated = _gate_of(mod)
        b13 = getattr(mod, moe.w13_name(mod) + "_bias", None)  # GPT-OSS's
        name13, name2 = moe.input_scale_names(fqn, mod)
        check = _read_from_code(mod) and isinstance(wts, torch.Tensor) and wts.numel() == ids.numel()
        if check:  # (what the module gives if its experts compute act_fn(gate) * up as read: SiLU of the halves)
            w2 = getattr(mod, moe.W2)
            w2 = w2.transpose(1, 2) if moe.is_transposed(mod) else w2  # [E, H, I]
            want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            wts = wts.reshape(ids.shape)
        for e in ids.unique().tolist():
            if not 0 <= e < experts:  # an expert-parallel sentinel: no expert of this module
                continue
            rows = (ids == e).any(-1)
            xe = x[rows]
            h = gated(nn.functional.linear(xe, w13[e], None if b13 is None else b13[e]))
            _record(amax, name13, xe.abs().max().float().item(), batch_no[0])
            _record(amax, name2, h.abs().max().float().item(), batch_no[0])
            if check:
                weight = (wts * (ids == e)).sum(-1)[rows].float()
                want[rows] += weight[:, None] * nn.functional.linear(h, w2[e]).float()
        if check:
            expected[id(mod)] = want

    return record


def _experts_checker(fqn: str, expected: dict):
    """A forward hook of experts whose activation is their code's (``_read_from_code``): their output against the one
    ``_experts_recorder`` computed as it reads them (SiLU of gate_up_proj's halves). Where they differ, down_proj's
    input scale would come from another function than the one the model computes, and fused_moe quantizes: a GELU,
    interleaved gate/up rows gave scales 0.88x and 0.2x the input's (its values clipped); refused, naming the fix."""

    def check(mod, args, kwargs, out):
        want = expected.pop(id(mod), None)
        if want is None or not isinstance(out, torch.Tensor):
            return
        got = out.detach().reshape(-1, out.shape[-1]).float() if out.numel() == want.numel() else None
        apart = float("inf") if got is None else float((got - want).norm() / want.norm().clamp_min(1e-30))
        if apart > 0.03:  # (bf16 experts: ~0.5% apart where the reading holds; SiLU for a GELU: ~10%)
            raise ValueError(
                f"calibrate: {fqn} has neither act_fn nor _apply_gate, and its output is not what calibrate takes its "
                f"experts to compute, act_fn(gate) * up with SiLU on gate_up_proj's first and second halves, weighted "
                f"by top_k_weights ({apart:.1%} apart): down_proj's input scale would come from another function than "
                "the module's; give the module its activation as act_fn (and _apply_gate(gate_up_output) for another "
                f"layout of its gate and up rows), or add {fqn!r} to ignored_layers (nothing was calibrated)")

    return check


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable, config: Optional[Fp8Config] = None, *,
              prefix: str = "") -> dict[str, float]:
    """Static activation scales ``{fqn: amax / 448}`` from running ``model`` (eager) on ``batches``; ``prefix``
    as ``quantize_``'s (the fqns are ``prefix.<name in model>``). An experts module (``fp8fx.weights.moe``) gets
    two: ``{fqn}.gate_up_proj`` (ungated experts: ``{fqn}.up_proj``), the amax of the tokens routed to its experts,
    and ``{fqn}.down_proj``, of the activation over each expert's tokens (HF's ``_apply_gate``: GPT-OSS's clamped
    SwiGLU of its biased output; else ``act_fn(gate) * up``, SiLU for a module with none), vLLM's static MoE scales
    after their max over experts.

    Each batch is passed as ``model(**batch)`` if it is a mapping whose keys are the forward's parameters (a
    tokenizer's output), ``model(*batch)`` if it is a tuple or list, else ``model(batch)`` (a model whose forward
    takes one dict too). The model runs in eval mode (dropout off) and is put back as it was; a ``torch.compile``
    wrapper runs the model it wraps, eagerly, and the scales carry the model's own names. A model already quantized
    (dynamic activations) is measured through its fp8 weights, as it runs; ``quantize_`` does not quantize it again,
    so its scales serve a fresh bf16 copy (``quantize_(fresh, config, input_scales=...)``).

    A layer the batches did not reach is warned of, and one whose inputs were all zero refused, where ``quantize_``
    with ``config`` quantizes it; a layer it keeps in high precision (a router, a tied weight, a layer the model keeps)
    is not, and gets no scale where its inputs were all zero (a warning says so, but for a router: a quantize_ of a
    part that holds it would quantize it and ask for one).
    """
    config = config_or(config, Fp8Config(activation_scheme="static"), "calibrate")
    check_prefix(prefix, "calibrate")
    model = compat.compiled_module(model)  # torch.compile's wrapper: the model's own names, run eagerly
    check_finished(model, "calibrate")  # (its fp8 layers' outputs would be measured as the bf16 model's)
    if not isinstance(batches, Iterable) or isinstance(batches, (str, bytes)):
        raise ValueError(f"calibrate: batches is {batches!r:.80}; pass an iterable of batches, e.g. [x] for one batch")
    if isinstance(batches, torch.Tensor):  # iterating it would run one batch per row
        raise ValueError(f"calibrate: batches is a tensor {list(batches.shape)}; pass an iterable of batches, e.g. "
                         "[x] for one batch")
    if isinstance(batches, Mapping):  # one tokenizer output: iterating it ran the model on its keys (strings)
        raise ValueError(f"calibrate: batches is one mapping (keys {list(batches)[:3]}), a single batch; pass an "
                         "iterable of batches, e.g. [batch] for one batch")
    # a misspelt entry would measure, and then quantize statically, the layer it was meant to keep (quantize_ refuses
    # it too)
    named = list(model.named_modules(prefix=prefix))
    config = checked_ignores(config, model, prefix, "measured")
    amax: dict[str, float] = {}
    batch_no = [0]
    modules = [(fqn, m) for fqn, m in named if not config.is_ignored(fqn)]
    # (skip_reason leaves out the experts quantize_ keeps bf16, an act_fn fused_moe does not compute among them)
    # (fp8 experts too: a model quantized with dynamic activations, calibrated for static ones; its fp8 linears are)
    experts = [(fqn, m) for fqn, m in modules if moe.is_any_experts(m) and (
        moe.is_quantized_experts(m) or moe.skip_reason(m, fqn, config) is None)]
    for fqn, m in experts:  # (gated experts with none are measured with SiLU; ungated ones have no default)
        if moe.is_ungated_experts(m) and getattr(m, "act_fn", None) is None:
            raise ValueError(
                f"calibrate: {fqn} holds ungated experts with no act_fn; calibrate measures down_proj's input as "
                "act_fn(up_proj(x)): give the module its activation as act_fn, or add it to ignored_layers (nothing "
                "was run)"
            )
    expected: dict[int, torch.Tensor] = {}  # id(experts) -> their output as calibrate reads them (_experts_checker)
    empty: set[str] = set()  # the layers (and experts' scale names) given an input of no rows (0 tokens)

    # each call of a linear is measured once (each .item() a GPU sync, taken when the call returns): the input of its
    # own F.linear, which the GEMM quantizes (a subclass may transform its input first: muP's MuReadout, a pre-norm),
    # else the module's input (a forward calibrate sees no F.linear of). A stack a layer: a call inside a call of it.
    # (It had compared the input with the last one measured by the tensor's version, which inference tensors keep
    # none of: under torch.inference_mode a layer called again on a tensor written in place was measured once.)
    calls: dict[str, list[list]] = {}  # fqn -> [[amax tensor or None, its F.linear seen, entry number], ...]
    entries = itertools.count()  # (the innermost of the calls under way: the last entered)

    def measure(fqn: str, x) -> Optional[torch.Tensor]:
        if not isinstance(x, torch.Tensor):  # (a numpy batch: the hook's own x.numel() failed, naming nothing)
            raise TypeError(f"calibrate: batch {batch_no[0]} gave {fqn} a {type(x).__module__}.{type(x).__qualname__} "
                            "input, not a torch.Tensor; give calibrate batches of tensors as the model takes them "
                            "(torch.from_numpy(a) for a numpy array) (nothing was calibrated)")
        if x.numel() == 0:  # no rows this batch (an expert no token reached): nothing to measure
            empty.add(fqn)
            return None
        return x.detach().abs().max()

    def entered(fqn: str, args: tuple, kwargs: dict) -> None:
        # (the input by keyword under any name: Conv1D's forward(x), a subclass's forward(hidden_states))
        x = args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))
        calls.setdefault(fqn, []).append([measure(fqn, x), False, next(entries)])

    def returned(fqn: str, output) -> None:
        value = calls[fqn].pop()[0]
        if value is not None and output is not None:  # (None: its forward raised - a path tried, then another -, and
            _record(amax, fqn, value.float().item(), batch_no[0])  # its GEMM quantized nothing)

    def read(fqns: list[str], x: torch.Tensor) -> None:
        """A linear of the weight of ``fqns`` (``_WeightReads``; several where linears share one weight): within a
        call of one of them, what that layer's GEMM reads (the innermost call's, where one runs inside another);
        outside any, each one's input (another module's ``F.linear(x, layer.weight)``). (Each of two layers sharing
        a weight was given the other's input too.)"""
        active = [fqn for fqn in fqns if calls.get(fqn)]
        for fqn in [max(active, key=lambda f: calls[f][-1][2])] if active else fqns:
            value = measure(fqn, x)
            stack = calls.get(fqn)
            if not stack:
                if value is not None:
                    _record(amax, fqn, value.float().item(), batch_no[0])
                continue
            top = stack[-1]
            top[0] = (value if not top[1] or top[0] is None else top[0] if value is None
                      else torch.maximum(top[0], value))
            top[1] = True

    linears = {fqn: module for fqn, module in modules if is_linear(module)}
    # the linears' weights read by other modules: F.linear(x, layer.weight), x @ layer.weight.t(); an fp8 layer's
    # weight is dequantized anew at each read, found by its name (``views.Dequantized``)
    plain = {fqn: m.weight for fqn, m in linears.items() if not is_quantized(m) and isinstance(m.weight, torch.Tensor)}
    named: dict[str, list[str]] = {}
    for fqn, m in linears.items():
        if is_quantized(m):
            named.setdefault(f"{getattr(m, '_fp8fx_prefix', '') or type(m).__name__}.weight", []).append(fqn)
    reads = _WeightReads(plain, read, {name: fqns for name, fqns in named.items() if len(fqns) == 1})
    ran = 0  # batches run
    training = {m: m.training for m in model.modules()}  # dropout would scale the activations it measures
    # the hooks are registered inside the try that removes them: an error before the first batch (reading a
    # parametrized weight above: out of memory) had left them on the model, measuring every later forward
    hooks = []
    try:
        for fqn, module in experts:
            hooks.append(module.register_forward_pre_hook(
                _experts_recorder(fqn, amax, batch_no, expected, empty), with_kwargs=True))
            if _read_from_code(module):
                hooks.append(module.register_forward_hook(_experts_checker(fqn, expected), with_kwargs=True))
        for fqn, module in linears.items():
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, fqn=fqn: entered(fqn, args, kwargs), with_kwargs=True))
            hooks.append(module.register_forward_hook(
                lambda mod, args, output, fqn=fqn: returned(fqn, output), always_call=True))
        model.eval()
        for batch_no[0], batch in enumerate(batches):
            ran += 1
            # (a module compiled inside the model runs eagerly too: Dynamo would trace the mode and the hooks)
            with reads, torch.compiler.set_stance("force_eager"):
                if isinstance(batch, Mapping) and _takes_keywords(model, batch):
                    model(**batch)
                else:
                    model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in training.items():  # each module's own flag, as it was
            m.training = mode
    if ran == 0:
        raise ValueError("calibrate: batches gave no batch (an empty list, or a generator already used up); pass "
                         "the calibration batches, e.g. a list of the model's inputs")
    # an experts module's input scales are named <experts>.gate_up_proj / .down_proj: ignored_layers takes the module
    owner = _scale_owners(experts)

    def to_ignore(names: list[str]) -> str:
        """The advice to keep them in high precision: the modules ignored_layers takes, or the model itself."""
        owners = [fqn for fqn in dict.fromkeys(owner.get(name, name) for name in names) if fqn]
        return (f"add {_shown(owners)} to ignored_layers" if owners else
                "keep the model in high precision: it is the layer itself, which ignored_layers does not name")

    # the layers quantize_ keeps in high precision with this config (a router, a tied weight, a layer the model
    # keeps, a shape the scheme does not take): it asks no scale of them, so none is missing (they were warned of, or
    # refused, with advice to add them to ignored_layers)
    decide = LinearDecider(model, prefix)
    kept = {fqn for fqn, m in linears.items() if not is_quantized(m) and decide(fqn, m, config)[0] is not None}
    dropped = [fqn for fqn in kept if amax.get(fqn, 1.0) < quant.AMAX_EPS]
    for fqn in dropped:
        # (no scale, rather than one of ~2e-15: quantize_ of a part, which does not see the weight it shares with
        # another part, quantizes such a layer, and would have saturated every activation; it says the scale is
        # missing instead)
        del amax[fqn]
    dropped = [fqn for fqn in dropped if fqn not in decide.routers]  # (a router: no quantize_ quantizes it)
    if dropped:  # (where that part's quantize_ asks for it, the user learns why here: h147)
        log.warning("fp8fx: calibrate: the inputs of %s were all zero in every batch, and quantize_ of the model "
                    "keeps them in high precision (%s: %s), so they get no input scale; a quantize_ of a part that "
                    "quantizes one (prefix=...) needs batches that give it nonzero inputs", _shown(dropped),
                    dropped[0], decide(dropped[0], linears[dropped[0]], config)[0])
    zero = [fqn for fqn, a in amax.items() if a < quant.AMAX_EPS]
    if zero:  # the scale would be ~2e-15: every nonzero activation saturates at inference
        raise ValueError(
            f"calibrate: the inputs of {_shown(zero)} were all zero in every batch, or below {quant.AMAX_EPS:g} "
            f"(amax {amax[zero[0]]:g}), which fp8fx's scales do not go below: a static scale from them would saturate "
            "every larger activation at inference: "
            f"calibrate with more or other batches, or {to_ignore(zero)}"
        )
    unseen = [fqn for fqn, m in modules if is_linear(m) and fqn not in amax and fqn not in kept]
    unseen += [name for fqn, m in experts for name in moe.input_scale_names(fqn, m) if name not in amax]
    called = [fqn for fqn in unseen if fqn in empty]
    if called:  # (it said "a branch the batches did not take" of a layer that was called on 0 rows)
        log.warning("fp8fx: calibrate: %s were called on inputs of no rows only (no token reached them: an expert "
                    "no token was routed to, or batches of 0 tokens), which give no amax, so they get no input scale; "
                    "calibrate with batches whose tokens reach them, or %s", _shown(called),
                    to_ignore(called))
    unseen = [fqn for fqn in unseen if fqn not in empty]
    if unseen:  # quantize_ will ask for their scales
        log.warning("fp8fx: calibrate: %s received no input during calibration (a branch the batches did not take, "
                    "or a layer whose weight is read in a spelling the linear pass does not take either), so they get "
                    "no input scale; "
                    "calibrate with batches that reach them, or %s", _shown(unseen),
                    to_ignore(unseen))
    return {fqn: max(a, quant.AMAX_EPS) / quant.FP8_MAX for fqn, a in amax.items()}
