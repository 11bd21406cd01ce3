"""vLLM's KV-cache method for a loader of one's own: ``Fp8KVCacheMethod``.

vLLM gives an fp8 config's attention layers four scalar parameters, ``k_scale``, ``v_scale``, ``q_scale`` and
``prob_scale``, filled with -1.0 ("not loaded"); the checkpoint's scales are copied into them; then
``process_weights_after_loading`` settles them: a ``k_scale`` alone serves ``v_scale`` too, a scale not loaded stays
out (vLLM makes k / v 1.0 for an fp8 KV cache; ``load_checkpoint`` does so where the checkpoint declares one). Here
the settled scales become what ``load_checkpoint`` gives an attention module: float32 ``[]`` buffers under the same
names (``kv_cache.assign_kv_scales``), saved by ``state_dict()`` where engines look for them. fp8fx's own attention
reads none of them (its KV cache is the model's, in the model's dtype). As ``load_checkpoint``, a ``v_scale`` alone
serves ``k_scale`` too (vLLM asserts on it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fp8fx.config import Fp8Config
from fp8fx.weights.kv_cache import KV_SCALE_NAMES, assign_kv_scales, check_kv_scale, complete_kv_scales, held_kv_scales
from fp8fx.weights.kv_cache import kv_scale_target, kv_scale_tensor, kv_slot_error
from fp8fx.weights.linear import guard_kv_casts, method_config

_UNLOADED = -1.0  # (vLLM's mark of a scale no checkpoint tensor filled)


class Fp8KVCacheMethod:
    """create_weights -> weight_loader (or a copy into the parameter) -> process_weights_after_loading, for an
    attention module. ``weight_loader(layer, name, tensor)`` takes ``k_scale``, ``v_scale``, ``q_scale``,
    ``prob_scale`` and the legacy ``kv_scale`` (read as ``k_scale``, as vLLM's loader remaps it)."""

    def __init__(self, config: Fp8Config):
        self.config = method_config(config, type(self).__name__)

    def create_weights(self, layer: nn.Module, prefix: str = "", device: Optional[torch.device] = None) -> None:
        """Registers the four scales on ``layer`` as -1.0 parameters (frozen), on ``device`` (None: the CPU; not a
        ``torch.device("meta")`` block's, whose scalars would hold nothing to load into), but for a name the model
        uses for an attribute of its own (MiMo-V2-Flash's float ``v_scale``, Gemma3n's ``q_scale`` buffer), as
        ``load_checkpoint`` leaves those: a scale the checkpoint holds under it is refused at ``weight_loader``.
        Refused, nothing of the layer changed: a layer holding fp8fx's KV-cache scales or an earlier call's
        parameters."""
        prefix = prefix or type(layer).__name__
        if held_kv_scales(layer) or "_fp8fx_kv_prefix" in layer.__dict__:
            raise ValueError(f"{prefix}: its KV-cache scales were created (or loaded) already; create_weights makes "
                             "them once: load into them with weight_loader (nothing of the layer changed)")
        taken = {name: why for name in KV_SCALE_NAMES if (why := kv_slot_error(layer, prefix, name, default=True))}
        made = {name: nn.Parameter(torch.tensor(_UNLOADED, device=device or "cpu"), requires_grad=False)
                for name in KV_SCALE_NAMES if name not in taken}
        if torch.empty(0, device=device or "cpu").is_meta:
            raise ValueError(f"{prefix}: device={device!r} makes meta tensors, which hold no values to load; pass the "
                             "device the scales load to (nothing of the layer changed)")
        for name, param in made.items():
            layer.register_parameter(name, param)
        layer._fp8fx_kv_prefix = prefix
        layer._fp8fx_kv_taken = taken
        guard_kv_casts(layer)  # (a cast before the scales load keeps them float32, as after processing)

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Copies one checkpoint scale into its parameter, checked first (one positive finite float). ``name``: the
        scale's name (``k_scale``), or the checkpoint's full name of it, which must address this layer (its attention,
        vLLM's ``<attention>.attn`` child, or its projection: ``k_proj.k_scale``, AutoFP8's ``k_proj.output_scale``),
        as ``load_checkpoint`` places them."""
        prefix = self._prefix(layer)
        target = kv_scale_target(name) if "." in name else (prefix, "k_scale" if name == "kv_scale" else name)
        if target is None or target[1] not in KV_SCALE_NAMES:
            raise ValueError(f"{prefix}: {name!r} is no KV-cache scale; weight_loader takes {KV_SCALE_NAMES} "
                             "(or the legacy 'kv_scale', read as 'k_scale'), by name or by the checkpoint's full name")
        owner, leaf = target
        if owner not in (prefix, f"{prefix}.attn"):
            if prefix == type(layer).__name__:  # (create_weights had no prefix: the layer's name is not known)
                raise ValueError(f"{prefix}: {name} is a full name, and this layer's was not given: pass the scale's "
                                 f"name ({leaf!r}), or create_weights(layer, prefix={owner.removesuffix('.attn')!r}) "
                                 "for full names")
            raise ValueError(f"{prefix}: {name} addresses {owner}, not this layer (a projection holds none but "
                             "k_proj.k_scale / v_proj.v_scale); load it into the attention it names, or drop it")
        if not isinstance(tensor, torch.Tensor):  # (a float was said to hold no value: h145)
            raise ValueError(f"{prefix}.{leaf}: got {tensor!r:.60}, a {type(tensor).__name__}, not a tensor; pass the "
                             f"checkpoint's tensor (torch.tensor({tensor!r:.20}) for a number)")
        if tensor.is_meta:
            raise ValueError(f"{prefix}.{leaf}: got a meta tensor, which holds no value; pass the checkpoint's tensor")
        value = check_kv_scale(f"{prefix}.{leaf}", tensor.detach())
        taken = layer.__dict__.get("_fp8fx_kv_taken", {})
        if leaf in taken:
            raise ValueError(f"{taken[leaf]} (the checkpoint's {name})")
        param = layer._parameters.get(leaf)
        if param is None:  # (processed already: the scale is a buffer now)
            raise ValueError(f"{prefix}.{leaf}: process_weights_after_loading ran already; load every scale first")
        loaded = layer.__dict__.setdefault("_fp8fx_kv_loaded", {})
        if leaf in loaded:  # (a legacy kv_scale and a k_scale both: one would win by the order of the tensors)
            raise ValueError(f"{prefix}.{leaf}: loaded already (from {loaded[leaf]}), now from {name}: the checkpoint "
                             "holds it twice; keep one")
        with torch.no_grad():
            param.fill_(value)
        loaded[leaf] = name

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The loaded scales (a parameter still -1.0 was not loaded) -> float32 ``[]`` buffers: the scales loaded, and
        ``k_scale`` / ``v_scale`` taking the other's value where one alone was (as ``load_checkpoint``; none loaded:
        none). Every value is checked before the layer changes; idempotent."""
        prefix = self._prefix(layer)
        taken = layer.__dict__.get("_fp8fx_kv_taken", {})
        params = {name: layer._parameters.get(name) for name in KV_SCALE_NAMES if name not in taken}
        if all(p is None for p in params.values()):
            return  # (processed, or the model holds every name)
        loaded: dict[str, float] = {}
        for name, p in params.items():
            if p is None:
                continue
            value = float(p.detach().float().item())
            if value != _UNLOADED:  # (a copy into the parameter that bypassed weight_loader: checked here)
                loaded[name] = check_kv_scale(f"{prefix}.{name}", torch.tensor(value))
        scales = dict(loaded)  # (none loaded: the checkpoint holds none, none are attached)
        complete_kv_scales(scales, lambda name: name not in taken, None)
        device = next(p for p in params.values() if p is not None).device
        # the buffers made first (on a GPU, allocations: one that ran out of memory after the parameters went left the
        # layer with neither, never to be finished), then nothing fails: the names were free at create_weights
        tensors = {name: kv_scale_tensor(value, device) for name, value in scales.items()}
        for name in params:
            layer._parameters.pop(name, None)
        if tensors:
            assign_kv_scales(layer, tensors)
            guard_kv_casts(layer)  # (as load_checkpoint's model: a model.to(bfloat16) rounded them, silently: h145)

    @staticmethod
    def _prefix(layer: nn.Module) -> str:
        prefix = layer.__dict__.get("_fp8fx_kv_prefix")
        if prefix is None:
            raise ValueError(f"{type(layer).__name__}: Fp8KVCacheMethod.create_weights was not called on this layer; "
                             "call it before loading its KV-cache scales")
        return prefix
