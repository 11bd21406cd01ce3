"""``dequantize_``: a quantized model (``quantize_``'s, ``load_checkpoint``'s) back to high-precision weights.

What needs high-precision weights - a full fine-tune, merging an adapter (PEFT's ``merge_and_unload``), any write into
a weight - had no way back from an fp8 model: its layers refuse writes (``fp8fx.weights.views``), and
transformers' ``model.dequantize()`` said "You need to first quantize your model". The values are those the fp8 model
computes with (codes times scales, in each layer's compute dtype): quantization's rounding stays, this is not the
model before ``quantize_``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from fp8fx.lowerings import compat
from fp8fx.report import Site
from fp8fx.weights import kv_cache, moe
from fp8fx.weights.linear import LoadCheck, ModelHeld, is_fp8_state, is_quantized
from fp8fx.weights.quantize import _put_tags

log = logging.getLogger("fp8fx")


def dequantize_(model: nn.Module) -> nn.Module:
    """The inverse of ``quantize_`` / ``load_checkpoint``, in place: every fp8 linear layer and experts module of
    ``model`` becomes a module of the class it was made from, each fp8 weight the tensor its dequantized view gives
    (same layout, the layer's compute dtype) as an ``nn.Parameter``, in the same place among the module's
    parameters. The fp8 codes, weight and input scales, fp8fx's KV-cache scales and every fp8fx attribute and tag of
    the model's modules and tensors go, as do the ``save_pretrained`` / ``dequantize`` / cast guard fp8fx gave the
    model's instances, and a transformers config's ``quantization_config`` (a checkpoint's, read by
    ``meta_model``: ``save_pretrained`` would otherwise describe bf16 files as fp8 ones, as transformers' own
    ``dequantize()`` removes it). Each parameter of those modules takes gradients as it did before fp8fx made the
    module fp8 (``quantize_`` froze the bias; a PEFT model's frozen base layers stay frozen; a loaded model's as the
    model was built). ``quantize_`` takes the result again.

    Every new weight is made before any module changes: an error (out of memory) leaves the model as it was. A
    model holding no fp8 layer is refused, as is one holding a layer (or KV-cache scales) still loading: a vLLM
    method's ``create_weights`` made it and its ``process_weights_after_loading`` did not run. A ``torch.compile``
    wrapper is dequantized through the model it wraps and returned; compile again with a new ``Fp8Backend`` (the old
    one's report describes the fp8 graphs). Transformers models get this as ``model.dequantize()`` too."""
    wrapper, model = model, compat.compiled_module(model)
    for fqn, m in model.named_modules():  # (before the "holds no fp8 layer" refusal: a model of loading layers only)
        loading = _still_loading(m)
        if loading is not None:
            # (it was dequantized around: the layer lost the state its loading needs, kept its refusal to run, and
            # its weight stayed a receive buffer - or, for KV-cache scales, the -1.0 placeholders stayed parameters)
            raise ValueError(
                f"dequantize_: {fqn or 'the model'} is still loading ({loading[0]}.create_weights made its "
                f"{loading[1]}, its process_weights_after_loading did not run): load every tensor and call the "
                "method's process_weights_after_loading(layer), then dequantize_ (nothing was done)")
    quantized: dict[int, tuple[str, nn.Module]] = {}
    for fqn, m in model.named_modules():
        if is_quantized(m) or moe.is_quantized_experts(m):
            quantized.setdefault(id(m), (fqn, m))
    if not quantized:
        raise ValueError(f"dequantize_: this {type(model).__name__} holds no fp8 layer (quantize_ and load_checkpoint "
                         "make them), so there is nothing to dequantize (nothing was done)")
    plan = []
    for fqn, m in quantized.values():
        made = next(c for c in type(m).__mro__ if "_fp8fx_maker" in c.__dict__)
        if type(m) is not made:
            raise ValueError(
                f"dequantize_: {fqn or 'the model'} is a {type(m).__name__}, a class made from fp8fx's {made.__name__} "
                f"(a parametrization's, or the caller's own), whose class fp8fx cannot give back; remove what made it "
                "first (nothing was done)")
        views = [name for name, attr in made.__dict__.items() if isinstance(attr, property)]  # weight / experts'
        trainable = vars(m).get("_fp8fx_trainable", {})  # (remember_trainable: as they were before fp8fx)
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            new = {name: getattr(m, name).as_subclass(torch.Tensor).contiguous() for name in views}
        params: dict[str, tuple[Optional[torch.Tensor], bool]] = {}  # the module's parameters, in order
        for name, t in m._parameters.items():
            if name in new:
                grad = trainable.get(name, True)
                params[name] = (nn.Parameter(new[name], requires_grad=grad), grad)
            elif t is None or not is_fp8_state(name, t):
                grad = trainable.get(name, t is not None and t.requires_grad)
                if t is not None and t.is_inference() and t.requires_grad != grad:
                    # (quantize_ under torch.inference_mode froze an inference tensor, which takes no requires_grad
                    # outside it: a copy that does)
                    t = nn.Parameter(t.detach().clone(), requires_grad=grad)
                params[name] = (t, grad)
        plan.append((m, made.__mro__[1], params))
    # nothing below allocates a tensor or fails
    for m, _, _ in plan:  # (the report's rows of their fp8 weights save nothing now)
        for t in m._parameters.values():
            Site.dequantized(t)
    for m, base, params in plan:
        m._parameters.clear()  # (refilled in order: the state_dict's keys come as the bf16 model's did)
        for name, (t, grad) in params.items():
            if t is not None and t.is_floating_point() and t.requires_grad != grad:
                t.requires_grad_(grad)
            m._parameters[name] = t
        m.__class__ = base
    _untag(model)
    log.info("fp8fx: dequantized %d fp8 modules of this %s", len(plan), type(model).__name__)
    return wrapper


def _still_loading(m: nn.Module) -> Optional[tuple[str, str]]:
    """(The method whose ``create_weights`` made ``m``'s weights, what it made) where its
    ``process_weights_after_loading`` has not run (None: no method's, or processed): an ``Fp8LinearMethod`` /
    ``Fp8MoEMethod`` layer's codes and scales may be markers still, an online layer's weight a receive buffer, an
    ``Fp8KVCacheMethod`` attention's scales -1.0 parameters."""
    state = vars(m)
    if state.get("_fp8fx_processed") is False:
        return ("Fp8MoEMethod (or Fp8OnlineMoEMethod)" if "_fp8fx_intermediate" in state else "Fp8LinearMethod",
                "weights")
    if "_fp8fx_kv_prefix" in state and any(m._parameters.get(n) is not None for n in kv_cache.KV_SCALE_NAMES
                                           if n not in state.get("_fp8fx_kv_taken", {})):
        return "Fp8KVCacheMethod", "KV-cache scales"
    return None


def _untag(model: nn.Module) -> None:
    """Every fp8fx attribute of ``model``'s modules and tag of its tensors gone: the attributes fp8fx set on
    instances (``ModelHeld``s), its KV-cache scales and their load hook, a transformers config's
    ``quantization_config``."""
    _put_tags(model, {})  # (no tensor keeps a tag)
    for m in model.modules():
        for name in kv_cache.held_kv_scales(m):
            m._buffers.pop(name, None)
        for key, hook in list(m._load_state_dict_pre_hooks.items()):
            if getattr(hook, "hook", None) is kv_cache.refuse_bad_kv_scales or isinstance(getattr(hook, "hook", None),
                                                                                        LoadCheck):
                del m._load_state_dict_pre_hooks[key]
        for name in [k for k, v in vars(m).items() if k.startswith("_fp8fx_") or isinstance(v, ModelHeld)]:
            delattr(m, name)
        config = getattr(m, "config", None)
        if "quantization_config" in getattr(config, "__dict__", {}):
            del config.quantization_config
