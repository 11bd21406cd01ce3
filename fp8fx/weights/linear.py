"""Load-time weight hooks for linear layers (the lifecycle of vLLM's ``Fp8LinearMethod``).

After quantization a layer stores what FP8 checkpoints store, under their names:

- ``weight``: float8_e4m3fn ``[N, K]``
- ``weight_scale``: float32, per-tensor ``[1]`` (or one per logical shard while loading), per-channel
  ``[N, 1]``; or ``weight_scale_inv``: float32 ``[ceil(N / bn), ceil(K / bk)]`` for blocks
- ``input_scale``: float32 ``[1]`` for static activations

(a transformers ``Conv1D``'s too: its ``[in, out]`` weight is quantized as ``[out, in]``, and its view is the
dequantized codes transposed back), and its class becomes a subclass of its own whose ``weight`` attribute is a
*dequantized view* (``torch.ops.fp8fx.dequantize`` of the fp8 tensor and its scale). Code that reads ``module.weight``
keeps working in eager mode; under ``torch.compile`` the view announces the quantized weight to the
linear pass. ``state_dict()`` reads ``_parameters`` and so holds the fp8 tensors.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import logging
import math
import operator
import re
import sys
import threading
import weakref
from typing import Any, Mapping, NoReturn, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from fp8fx import quant
from fp8fx.config import (Fp8Config, LayerScheme, PerBlock, PerRow, PerTensor, config_or, granularity_from_block,
                          transformers_skips)
from fp8fx.ops import BIAS_GAPS
from fp8fx.weights import chunked, views
from fp8fx.weights.counter import CopyNumelCounter
from fp8fx.weights.kv_cache import KV_SCALE_NAMES, held_kv_scales, kv_scale_refusals

log = logging.getLogger("fp8fx")

_FP8_CLASSES: dict[type, type] = {}


def _dequantized_weight(self) -> torch.Tensor:
    """The layer's ``.weight``: a new tensor at each read, so that writes into it (``copy_``, ``nn.init``, ``.data =``)
    change a copy; new weights come as fp8 codes with their scales (``load_state_dict`` of a quantized model's
    ``state_dict``, ``load_checkpoint``), or through ``quantize_`` of a model built with them."""
    w_block, act_block = self._fp8fx_w_block, self._fp8fx_act_block
    scale = self._parameters["weight_scale_inv" if self._fp8fx_block_scales else "weight_scale"]
    check_codes_held(self, "weight")
    q = self._parameters["weight"]
    if q is not None and q.dtype != quant.FP8_DTYPE:  # (nn.Module.__setattr__ registers a new nn.Parameter over it)
        raise RuntimeError(
            f"{module_name(self)}: its weight parameter was replaced by a "
            f"{q.dtype} one{' on the meta device' if q.is_meta else ''}, where the fp8 layer holds {quant.FP8_DTYPE} "
            "codes and their scales, and it takes no high-precision weights: build the model with the new weights and "
            "quantize_ it. (accelerate's offload - cpu_offload, disk_offload, a device_map that offloads - and "
            "load_checkpoint_and_dispatch do this: they read the weight through the layer's dequantized view and put "
            "back a tensor of its dtype; keep a quantized model on one device, and load fp8 checkpoints with "
            "fp8fx.load_checkpoint)")
    w = torch.ops.fp8fx.dequantize(q, scale, w_block, self._fp8fx_dtype, self._parameters.get("input_scale"), act_block)
    # (a Conv1D's weight is [in, out]: its codes are stored as a linear's, and the layer's addmm reads the transpose,
    # addmm(b, x, dequantize(...).t()), which the linear pass takes as the linear it is)
    return views.dequantized(w.t() if self._fp8fx_transposed else w, self, "weight")


_NO_PARAMETRIZATION = ("an fp8 weight is codes and scales, which no parametrization takes; parametrize the "
                       "high-precision model, then quantize_ it")


def as_index(value: object) -> Optional[int]:
    """``value`` as an int index (Python's, numpy's, a 0-d integer tensor's), or None for anything else: a bool too,
    which indexes as 1 or 0 (a mask: ``data[True] = q`` wrote every expert; shard_id=True wrote shard 1)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _shard_index(what: str, shard_id: object, sizes: Sequence[int]) -> Optional[int]:
    """``shard_id`` as the index of one of the output partitions ``sizes`` (None: the whole tensor), else a
    ValueError naming ``what``."""
    if shard_id is None:
        return None
    index = as_index(shard_id)
    if index is None or not 0 <= index < len(sizes):
        raise ValueError(f"{what}: shard_id={shard_id!r}, but the layer's output partitions are {list(sizes)}: pass an "
                         f"int 0..{len(sizes) - 1}, or None for the whole tensor")
    return index


def module_name(module: nn.Module) -> str:
    """How messages name an fp8fx module: the name quantize_ or create_weights gave it, else its class."""
    return getattr(module, "_fp8fx_prefix", "") or type(module).__name__


def _refuse_unprocessed(module: nn.Module, args: tuple) -> None:
    """The forward pre-hook of a layer ``Fp8LinearMethod`` quantizes online, until its process_weights_after_loading:
    the layer refuses to run on a weight still loading."""
    raise RuntimeError(
        f"{module_name(module)}: called before "
        "process_weights_after_loading ran on it, while its weight is still loading (the shards loaded so far and "
        "uninitialized memory); load every shard, then call the method's process_weights_after_loading(layer)")


# torch's hook-based reparametrizations read the weight (its dequantized view here), then take it out of
# ``_parameters`` directly, past ``fp8_delattr``: weight_norm's old API then failed at setting the weight with the
# fp8 codes already gone for good, prune failed registering the view as weight_orig. Their read is refused (by its
# caller's code object: the read is the one step before the deletion that fp8fx sees), the module left as it was.
_REPARAMETRIZERS = {
    inspect.unwrap(WeightNorm.apply).__code__: ("torch.nn.utils.weight_norm", "apply weight_norm to"),  # (deprecated: wrapped)
    inspect.unwrap(prune.BasePruningMethod.apply.__func__).__code__: ("torch.nn.utils.prune", "prune"),
}


def check_codes_held(module: nn.Module, name: str) -> None:
    """Refuses a read of an fp8 module's ``name`` once its fp8 codes are gone from it (taken out of ``_parameters``
    by hand: ``fp8_delattr`` refuses ``del``), where the read failed with a bare KeyError, and the read of
    ``_REPARAMETRIZERS`` (called by the view's getter: the getter's caller is two frames up)."""
    if not torch.compiler.is_compiling():  # (a compiled graph reads the view from the model's forward alone)
        what = _REPARAMETRIZERS.get(sys._getframe(2).f_code)
        if what is not None:
            raise RuntimeError(
                f"{module_name(module)}.{name}: {what[0]} reparametrizes a weight by taking it out of the module "
                f"(the fp8 codes, with no way back): {_NO_PARAMETRIZATION} ({what[1]} the model before quantize_; "
                "nothing was changed)")
    if name not in module._parameters:
        raise RuntimeError(
            f"{module_name(module)}.{name}: its fp8 codes were removed "
            f"from the module: {_NO_PARAMETRIZATION} (this module lost its codes: quantize_ a fresh model)")
    if module.__dict__.get("_fp8fx_processed") is False:  # (its view ran on codes and scales still loading: NaN)
        raise RuntimeError(
            f"{module_name(module)}.{name}: read before "
            "process_weights_after_loading ran on this module, while its codes and scales may still be loading (a "
            "scale not loaded yet is a marker, and per-tensor shards' scales are merged there); load every tensor, "
            "then call the method's process_weights_after_loading(layer)")


def fp8_delattr(self, name: str) -> None:
    """``__delattr__`` of the classes ``fp8_class`` and ``fp8fx.weights.moe``'s ``fp8_experts_class`` make: fp8 codes
    and their scales are not deleted. ``register_parametrization`` (PEFT's ``target_parameters``, its LoRA on MoE
    experts, too) deletes the parameter it parametrizes; the layer then held a scale over no codes, and the refusal
    came after the deletion. Refused here, before it, the module is left as it was."""
    t = self._parameters.get(name)
    if t is not None and is_fp8_state(name, t):
        raise RuntimeError(
            f"{module_name(self)}.{name} ({t.dtype}, {list(t.shape)}) holds "
            "the fp8 layer's codes or their scales, which it is not run without, so they are not deleted (a "
            f"parametrization - torch.nn.utils.parametrize.register_parametrization, PEFT's target_parameters - "
            f"deletes the parameter it parametrizes): {_NO_PARAMETRIZATION} (nothing was changed)")
    made = next(c for c in type(self).__mro__ if "_fp8fx_maker" in c.__dict__)
    super(made, self).__delattr__(name)


def remember_trainable(module: nn.Module) -> None:
    """Records, once, which of ``module``'s parameters took gradients before fp8fx made it an fp8 layer (``quantize_``
    freezes its bias, a load builds its tensors anew): ``dequantize_`` gives that back (a PEFT model's frozen base
    layers came back trainable)."""
    if "_fp8fx_trainable" not in vars(module):
        module._fp8fx_trainable = {n: p.requires_grad for n, p in module._parameters.items() if p is not None}


def is_fp8_state(name: str, t: torch.Tensor) -> bool:
    """An fp8 module's tensor of the fp8 state: its fp8 codes or a scale (weight, input). A dtype cast of the module
    leaves it as it is, ``del`` refuses it, ``dequantize_`` drops it."""
    return (t.dtype.is_floating_point and t.dtype.itemsize == 1) or name.endswith(("scale", "scale_inv"))


def fp8_apply(self, fn, recurse=True):
    """``Module._apply`` of a quantized module (``.to(dtype)``, ``.half()``, ``.cuda()``, ``.to_empty()``, ...):
    the fp8 tensors and their float32 scales follow device moves but not dtype casts, which would turn them into
    bf16 tensors that no longer hold the quantized values. A floating-point cast instead becomes the module's compute
    dtype (the dequantized view's and the output's, as for a bf16 model cast), and casts the other parameters
    (bias). Whether ``fn`` casts is read from what it does to an empty tensor of the same dtype and device.
    float64 (``model.double()``) is the quantized model's reference: its fp8 weights dequantized exactly, the
    layers run by torch (the passes leave float64 linears and experts unrewritten, saying so in the report). A cast
    to another dtype (an 8-bit float) is refused naming the layer, after the modules before it were cast: their own
    ``_apply`` ran first; the model ``quantize_`` / ``load_checkpoint`` was given refuses it before that
    (``guard_casts``)."""
    kept = {id(t) for n, t in self._parameters.items() if t is not None and is_fp8_state(n, t)}

    def apply(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in kept:
            return fn(t)
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        return fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)

    dtype, cast, refused = _cast_of(self, fn)
    if refused:
        if not _cast_from_outside():
            raise ValueError(f"{refused} (nothing was converted)")
        raise ValueError(f"{refused} (this layer and the ones after it were not converted, but a cast of a module "
                         "holding it converts the modules it reaches before this layer, if any: cast the model "
                         "quantize_ or load_checkpoint was given, which refuses it before converting anything)")
    tags = {n: {a: v for a, v in vars(t).items() if a.startswith("_fp8fx_")}
            for n, t in self._parameters.items() if t is not None}
    super(type(self), self)._apply(apply, recurse)
    for n, t in self._parameters.items():  # a parameter the move replaced keeps its tags for the report
        for a, v in tags.get(n, {}).items():
            if t is not None and not hasattr(t, a):
                setattr(t, a, v)
        # but not the zero-gapped bias storage it lay in (fp8fx.passes.horizontal): a moved or cast bias is a tensor
        # of its own, which ops._adjacent_with_gaps concatenates with zeros
        if t is not None and getattr(t, BIAS_GAPS, None) not in (None, t.untyped_storage().data_ptr()):
            delattr(t, BIAS_GAPS)
    if dtype is not None and cast != dtype and cast.is_floating_point:
        self._fp8fx_dtype = cast
    return self


def _cast_of(module: nn.Module, fn) -> tuple[Optional[torch.dtype], Optional[torch.dtype], str]:
    """(compute dtype, what the cast ``fn`` makes of it, why that is refused or "") of a quantized module, read from
    what ``fn`` does to an empty tensor of that dtype; (None, None, "") for a module without one. An 8-bit float (no
    fp8 layer computes in one) is refused, naming the layer."""
    dtype = getattr(module, "_fp8fx_dtype", None)
    if dtype is None:
        return None, None, ""
    device = next((t.device for t in module._parameters.values() if t is not None), None)
    cast = fn(torch.empty(0, dtype=dtype, device=device)).dtype
    name = getattr(module._parameters.get("weight"), "_fp8fx_fqn", None) or getattr(module, "_fp8fx_prefix", "")
    name = name or type(module).__name__
    if cast == dtype or not cast.is_floating_point and not cast.is_complex:
        return dtype, cast, ""
    if cast in quant.COMPUTE_DTYPES:
        return dtype, cast, _overflow_of(module, name, cast)
    return dtype, cast, (f"{name}: cast to {cast}, but fp8 layers compute in bf16/fp16/fp32 (or fp64, as a "
                         "reference); cast the model to one of these")


def _overflow_of(module: nn.Module, name: str, cast: torch.dtype) -> str:
    """Why the dequantized weights of ``module`` (fp8 * scale, the ``.weight`` view and the reference kernels) would
    hold inf in ``cast`` (float16: a scale above 65504 / 448 = 146.2 where the fp8 values reach that far), or "".
    load_checkpoint refuses such a layer for a float16 model; a cast of the loaded model to float16 made it, with no
    error."""
    found = _overflow(module, cast, module._parameters)
    if found is None:
        return ""
    largest, count, w = found
    return (f"{name}: cast to {cast}, but a scale of {largest:g} times fp8 values up to {quant.FP8_MAX:g} is beyond "
            f"{cast}'s range (at most {torch.finfo(cast).max:g}): {count} values of its dequantized {w} would be inf "
            "(outputs NaN); keep the model in bfloat16 or float32")


def _overflow(module: nn.Module, cast: torch.dtype, params: Mapping[str, Optional[torch.Tensor]],
              block: Optional[Sequence[int]] = None) -> Optional[tuple[float, int, str]]:
    """(largest scale, count, weight name) of the first fp8 weight in ``params`` (the module's own, or a state dict's
    over them) whose dequantized values ``cast`` cannot hold, or None. The fp8 tensors are counted only where their
    largest scale is beyond the range. ``block``: the scales' (default the module's weight block)."""
    suffix = "_scale_inv" if getattr(module, "_fp8fx_block_scales", False) else "_scale"
    for w in ("weight", "gate_up_proj", "up_proj", "down_proj"):  # (up_proj: ungated experts' first weight)
        q, scale = params.get(w), params.get(w + suffix)
        if q is None or scale is None or q.dtype != quant.FP8_DTYPE or not scale.numel():
            continue
        largest = float(scale.detach().float().max())
        if not torch.isinf(torch.tensor(largest * quant.FP8_MAX).to(cast)):  # (rounded as the cast rounds)
            continue
        block = module._fp8fx_w_block if block is None else block
        count = sum(chunked.dequantized_overflow(qe.detach(), se.detach(), block, cast)
                    for qe, se in (zip(q, scale) if q.dim() == 3 else [(q, scale)]))
        if count:
            return largest, count, w
    return None


def _cast_from_outside() -> bool:
    """Whether the running cast reached this module through torch's ``Module._apply`` of a module holding it, which
    converted the modules it met before (a module built around the model after ``quantize_``, which has no guard),
    rather than by a call on this module itself (``layer.half()``, ``model.to(dtype)``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_apply"


_CHECKING = threading.local()  # .depth: the _checked_apply calls running on this thread


def _checked_apply(self, fn, recurse=True):
    """A quantized model's own ``_apply`` (``guard_casts``): a cast that an fp8 layer of it refuses raises before any
    module of the model is converted, then the model's class' ``_apply`` runs as always. The guarded modules below
    it (``guard_casts``) are called by that ``_apply``: they were checked with it, and run as their class' alone
    (each checking its whole part again made a cast's checks O(layers x depth))."""
    if getattr(_CHECKING, "depth", 0):
        return type(self)._apply(self, fn, recurse)
    _CHECKING.depth = 1
    try:
        return _checked_cast(self, fn, recurse)
    finally:
        _CHECKING.depth = 0


def _checked_cast(self, fn, recurse: bool):
    for m in self.modules():  # an online layer Fp8LinearMethod made and did not process: a cast rounded the input
        # scales loaded after it, and the layer, processed, still computed in the dtype it was made for
        if vars(m).get("_fp8fx_processed") is False and "_fp8fx_pending" in vars(m):
            device = next((t.device for t in m._parameters.values() if t is not None and not t.is_meta), None)
            cast = fn(torch.empty(0, dtype=m._fp8fx_dtype, device=device)).dtype
            if cast != m._fp8fx_dtype and (cast.is_floating_point or cast.is_complex):
                done = ("nothing of this module was converted, but a cast of a module holding it converts the modules "
                        "it reaches before this one" if _cast_from_outside() else "nothing was converted")
                raise ValueError(f"{module_name(m)}: cast to {cast} while its weights are loading (Fp8LinearMethod."
                                 f"create_weights made it to compute in {m._fp8fx_dtype}): create the weights with "
                                 f"params_dtype={cast}, or cast after process_weights_after_loading ({done})")
        refused = _cast_of(m, fn)[2] if getattr(type(m), "_apply", None) is fp8_apply else ""
        if refused and _cast_from_outside():
            raise ValueError(f"{refused} (nothing of this model was converted, but a cast of a module holding it "
                             "converts the modules it reaches before this model, if any: cast this model itself, which "
                             "refuses it before converting anything)")
        if refused:
            raise ValueError(f"{refused} (nothing was converted)")
    # the KV-cache scales (float32 buffers of the attentions, kv_cache.attach_kv_scales) follow device moves but not
    # dtype casts, as the layers' scales do: bf16 rounded 0.0123 to 0.01233 (and save_checkpoint wrote that)
    kv = [(m, n, b) for m in self.modules() for n, b in m._buffers.items()
          if n in KV_SCALE_NAMES and b is not None and b.dtype == torch.float32]
    # and those Fp8KVCacheMethod made, still parameters until process_weights_after_loading: a cast between rounded
    # the scales loaded after it (0.0123 -> 0.012329 in bf16)
    loading = [(p, p.data) for m in self.modules() if "_fp8fx_kv_prefix" in vars(m) for n, p in m._parameters.items()
               if n in KV_SCALE_NAMES and p is not None and p.dtype == torch.float32]
    out = type(self)._apply(self, fn, recurse)
    for m, n, before in kv:
        after = m._buffers.get(n)
        if after is not None and after.dtype != torch.float32:
            m._buffers[n] = before.to(after.device)
    for p, before in loading:
        if p.dtype != torch.float32:
            p.data = before.to(p.device)
    return out


class ModelHeld:
    """A callable that fp8fx sets as an attribute of a model instance (``model._apply``, ``model.save_pretrained``),
    holding the model by a weak reference (a strong one made a cycle, model -> its ``__dict__`` -> the model, so
    ``del model`` freed nothing, GPU memory included, until Python's cyclic collector ran). A deep copy of the model
    gets one of the copy (the copy is in ``memo`` before its ``__dict__`` is copied); a pickle holds the model itself,
    which the pickle memoizes. ``what``: the attribute, for the message of a ``copy.copy`` that outlived its model."""

    __slots__ = ("_model",)
    what = ""

    def __init__(self, model: Optional[nn.Module]):
        self._model = weakref.ref(model) if model is not None else lambda: None

    def held(self) -> nn.Module:
        """The model; refused where it is gone: a copy.copy of a model shares its ``__dict__``'s attribute, which
        outlived the model it was made for."""
        model = self._model()
        if model is None:
            raise RuntimeError(
                f"fp8fx: this model was copied with copy.copy from a quantized model that is gone, and its {self.what} "
                "was that model's; copy quantized models with copy.deepcopy (or keep the original)")
        return model

    def __deepcopy__(self, memo):
        model = self._model()
        return type(self)(memo.get(id(model), model))

    def __reduce__(self):
        return type(self), (self._model(),)  # (None where it is gone: the copy's calls say so)


class _CheckedApply(ModelHeld):
    """``model._apply`` as ``guard_casts`` sets it: ``_checked_apply`` of the model it holds."""

    __slots__ = ()
    what = "cast guard"

    def __call__(self, fn, recurse=True):
        return _checked_apply(self.held(), fn, recurse)

    def __deepcopy__(self, memo):
        model = self._model()
        copied = memo.get(id(model), model)
        # the fp8fx tags of parameters no fp8fx class holds (a layer ignored_layers keeps: its report reason): a deep
        # copy of a Parameter keeps its data alone. The model's _modules come before this _apply in its __dict__, so
        # their copies are in memo by now (the quantized layers' own copies carry theirs: reduce_made_class)
        for p in model.parameters() if copied is not model else ():
            new = memo.get(id(p))
            for k, v in carried_tags(p).items() if new is not None else ():
                if not hasattr(new, k):
                    setattr(new, k, copy.deepcopy(v, memo))
        return _CheckedApply(copied)


def guard_kv_casts(module: nn.Module) -> None:
    """Has a dtype cast of ``module`` - or of a model holding it, which casts its children through their own
    ``_apply`` - keep the KV-cache scales ``kv_cache.attach_kv_scales`` gave it float32: its own ``_apply`` is a
    ``_CheckedApply`` (``Fp8KVCacheMethod``'s attention; ``guard_casts`` does so for a model ``quantize_`` or
    ``load_checkpoint`` made)."""
    if "_apply" not in vars(module):
        module._apply = _CheckedApply(module)


def guard_casts(model: nn.Module) -> None:
    """Has ``model.to(dtype)`` (``.half()``, ...) keep its KV-cache scales float32 and refuse a cast its fp8 layers
    cannot compute in (or whose range their dequantized weights exceed) before it converts anything: torch converts
    the modules one by one, so the first fp8 layer's refusal (``fp8_apply``) came after the modules before it had
    been cast, leaving a model of two dtypes. The check is the own ``_apply`` of ``model`` and of every module in it
    that holds an fp8 layer (``model.model.half()``, a decoder layer's ``.half()``: the modules before the refusing
    layer were cast), and of each attention holding KV-cache scales but no fp8 layer (``guard_kv_casts``: its own
    ``.half()``), an attribute of that instance (its class is left as it is). It is a ``_CheckedApply``, so the
    model still pickles (a bound method does not) and is freed as soon as it is dropped. A module already guarded
    keeps its guard; one that ``quantize_`` guards later (a part quantized on its own) gets its own. Those modules
    and the model get a ``LoadCheck`` too. A ``copy.copy`` of a guarded module (of the model or of a part) shares the
    original's guard, as it shares its parameters' dict: casting it needs the original alive (``copy.deepcopy`` gives
    a copy its own)."""
    holders: set[int] = set()  # ids of the modules above an fp8 layer
    for fqn, m in model.named_modules(remove_duplicate=False):  # (a layer shared by two parents: both hold it)
        if getattr(type(m), "_apply", None) is fp8_apply:
            parts = fqn.split(".") if fqn else []
            holders.update(id(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))
    for m in model.modules():
        if id(m) in holders and getattr(type(m), "_apply", None) is not fp8_apply and "_apply" not in vars(m):
            m._apply = _CheckedApply(m)
        elif held_kv_scales(m):  # an attention holding no fp8 layer (its projections ignored): its own .half() had
            guard_kv_casts(m)  # rounded its KV-cache scales to float16, and they were saved so (h154)
    if getattr(type(model), "_apply", None) is not fp8_apply and "_apply" not in vars(model):
        model._apply = _CheckedApply(model)  # (also a model of no fp8 layer: its copies keep the reasons' tags)
    for m in {id(m): m for m in model.modules() if id(m) in holders or m is model}.values():
        # a load of the model or of any module that holds an fp8 layer (model.model.load_state_dict(...)) is checked
        # before any module loads; an fp8 layer checks its own (fp8_load_from_state_dict: its hooks run after that)
        if type(m)._load_from_state_dict is not fp8_load_from_state_dict and not any(
                isinstance(getattr(h, "hook", h), LoadCheck) for h in m._load_state_dict_pre_hooks.values()):
            # (with_module=False: torch's own binding holds the module by a weak reference, and a copy.copy of the
            # model, which shares this dict, met "the hook of a dead Module" once the original was gone: LoadCheck
            # says why)
            m._register_load_state_dict_pre_hook(LoadCheck(m))


class LoadCheck(ModelHeld):
    """A pre-hook of the model ``quantize_`` / ``load_checkpoint`` was given and of each module in it that holds an fp8
    layer (``guard_casts``): a ``load_state_dict`` of any of them that one of its fp8 layers refuses
    (``load_refusal``), under any of the layer's names, raises before any module loads. torch loads
    module by module and raises the errors gathered at the end, so the modules before and after the refusing layer
    had taken the new values (a bf16 fine-tune loaded into the fp8 model: its embeddings and norms replaced, logits
    1.0 off, after the error). The state each fp8 layer was checked against is remembered for this thread, so the
    layer's own check (``fp8_load_from_state_dict``), and the hooks of the modules between it and the one loaded,
    do not scan its codes again."""

    what = "load_state_dict check"

    def __call__(self, state_dict, prefix: str, *args) -> None:
        model = self.held()
        done = _checked_loads()
        if not prefix:  # the module a load_state_dict was called on: what earlier loads left (one that raised on the
            done.clear()  # way, in another hook or module, before its layers took their records) is theirs
        refusals, checked = _Refusals(), {}
        # every name of a module (one registered under two: torch loads it under each)
        for name, m in model.named_modules(prefix=prefix[:-1], remove_duplicate=False):
            at = f"{name}." if name else ""
            if type(m)._load_from_state_dict is fp8_load_from_state_dict:
                given = _given(m, state_dict, at)
                if not _passed(done.get((id(m), at)), m, given):  # (checked by the hook of a module around this one)
                    refusals.add(m, at, "load", load_refusal(m, state_dict, at, _assigns(args)))
                checked[(id(m), at)] = _record(m, given)
            else:
                refusals.add(m, at, "kept", _kept_refusal(m, state_dict, at))
                # (the attention's own pre-hook keeps a bad KV scale, but torch had loaded the modules around it
                # by the time it raised: h137)
                for scale, why in kv_scale_refusals(m, state_dict, at, _assigns(args)):
                    refusals.add(m, at, scale, why)
        refusals = refusals.lines()
        if refusals:
            done.clear()
            loaded = ("nothing was loaded" if not prefix else
                      f"nothing of {prefix[:-1]} was loaded; modules outside it that this load reached before it, if "
                      "any, were")
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                               + "\n\t".join(refusals) + f"\n({loaded})")
        done.update(checked)


class _Refusals:
    """``LoadCheck``'s refusals, one a module: a module registered under several names (``m.a = attn; m.b = attn``),
    which torch loads under each, refused alike under each (the same NaN ``k_scale`` at ``a.k_scale`` and
    ``b.k_scale``) is one line, under its first name, naming the others: ``a.k_scale (also b.k_scale)=nan: ...``
    (it was a line a name, as if of as many modules). Alike: the refusal under a later name is the first one's word
    for word once the later prefix is read as the first (``_as_first``); otherwise (a NaN ``a.k_scale``, an inf
    ``b.k_scale``) it is a line of its own. ``what`` is which check refused: ``load`` (``load_refusal``), ``kept``
    (``_kept_refusal``) or a KV-cache scale's name (``kv_scale_refusals``)."""

    def __init__(self):
        self.groups: list[list] = []  # [module, what, first prefix, its refusal, [later prefixes]], in the load's order

    def add(self, module: nn.Module, at: str, what: str, why: str) -> None:
        if not why:
            return
        for group in self.groups:
            if group[0] is module and group[1] == what and _as_first(why, at, group[2]) == group[3]:
                group[4].append(at)
                return
        self.groups.append([module, what, at, why, []])

    def lines(self) -> list[str]:
        out = []
        for _, what, first, why, also in self.groups:
            # the name it leads with: the prefix and the tensor's name (a KV-cache scale's, or the word after it)
            name = what if what not in ("load", "kept") else re.match(r"\w*", why[len(first):]).group()
            if also and why.startswith(first + name):
                key = first + name
                why = f"{key} (also {', '.join(a + name for a in also)}){why[len(key):]}"
            elif also:  # (every refusal leads with its tensor's name; should one not, its other names are still said)
                why = f"{why} (also under {', '.join(a[:-1] for a in also)})"
            out.append(why)
        return out


def _as_first(why: str, at: str, first: str) -> str:
    """A refusal said of the entries under the prefix ``at``, with each name under ``at`` (the prefix where no word
    or dot comes before it) read under ``first``: equal to the refusal under ``first`` where the two are alike."""
    return re.sub(r"(?<![\w.])" + re.escape(at), lambda _: first, why) if at else why


def _kept_refusal(module: nn.Module, state_dict: Mapping[str, object], prefix: str) -> str:
    """Why ``module``, no fp8 layer of fp8fx's (a layer kept in high precision, a norm, an embedding) at ``prefix``,
    refuses the entries of ``state_dict`` for it, or "": fp8 codes for one of its high-precision tensors, from a
    state dict of a model quantized with another scheme or ignore list (the layer fp8 there). Copied in, the codes
    were taken for the weight's values, unscaled (outputs ~100x off): with ``strict=False`` silently, with
    ``strict=True`` after every module had loaded, torch refusing the layer's scales as unexpected keys (h136). (That
    model's scales alone, with no codes, are left to torch: a hook is not told whether the load is strict.)"""
    own = dict(module._parameters)
    own.update((k, b) for k, b in module._buffers.items() if k not in module._non_persistent_buffers_set)
    for key, tensor in own.items():
        given = state_dict.get(prefix + key)
        if (isinstance(tensor, torch.Tensor) and isinstance(given, torch.Tensor) and _float8(given.dtype)
                and not _float8(tensor.dtype)):
            return _kept_message(module, prefix, prefix + key, f"holds {given.dtype} codes {list(given.shape)}", tensor,
                                 ", and its codes, loaded here, would be taken for the layer's values, unscaled")
    return ""


def _float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1  # (e4m3fn, e5m2, their fnuz variants, e8m0fnu)


def _kept_message(module: nn.Module, prefix: str, key: str, what: str, tensor: torch.Tensor, harm: str) -> str:
    reason = getattr(tensor, "_fp8fx_skip_reason", "") or "not quantized"
    return (f"{key}: the state dict {what}, but {prefix[:-1] or 'the model'} ({type(module).__name__}) is kept in "
            f"{tensor.dtype} here ({reason}): the state dict is of a model quantized with another scheme or ignore "
            f"list{harm}; quantize this model as that one was (the same Fp8Config), or load a state dict of this "
            "model's")


# (id(fp8 module), its prefix) -> weak references to the module and to the state_dict's tensors for it, which a
# LoadCheck passed in this thread; each is taken by the module's own load (fp8_load_from_state_dict). Weak: a load
# that raised before a layer took its record (another hook's error) kept the layer and the tensors alive
_CHECKED_LOADS = threading.local()


def _checked_loads() -> dict:
    if not hasattr(_CHECKED_LOADS, "modules"):
        _CHECKED_LOADS.modules = {}
    return _CHECKED_LOADS.modules


def _record(module: nn.Module, given: tuple) -> tuple:
    return weakref.ref(module), tuple(weakref.ref(t) if isinstance(t, torch.Tensor) else t for t in given)


def _passed(checked: Optional[tuple], module: nn.Module, given: tuple) -> bool:
    """``checked`` (an entry of ``_CHECKED_LOADS``, ``_record``'s) is a pass of ``module`` with the same ``given``."""
    return checked is not None and checked[0]() is module and all(
        (a() if isinstance(a, weakref.ref) else a) is b for a, b in zip(checked[1], given))


def _given(module: nn.Module, state_dict, prefix: str) -> tuple:
    return tuple(state_dict.get(prefix + name) for name in module._parameters)


def check_online(what: str, loaded: torch.Tensor, dtype: torch.dtype, prefix: str, kind: str,
                 values_checked: bool = False) -> None:
    """Online, the loaders (``Fp8LinearMethod``, ``Fp8MoEMethod``) quantize what they get, through a buffer of the
    layer's ``dtype``: high-precision values it holds only. An fp8 tensor was taken for real values (a second, wrong
    quantization); a NaN / Inf, or a value past a float16 buffer's 65504, made the scale NaN / Inf. The pass over the
    values is skipped with ``values_checked``, where the caller's own pass did it."""
    if loaded.dtype not in quant.HIGH_PRECISION:
        fix = (" (an fp8 checkpoint: load it as stored, with Fp8Config(is_checkpoint_fp8_serialized=True))"
               if loaded.dtype == quant.FP8_DTYPE else "")
        raise ValueError(f"{what}: the tensor is {loaded.dtype}; online quantization takes bf16/fp16/fp32 {kind}{fix}")
    if values_checked:
        return
    bad, overflow, largest = chunked.count_unloadable(loaded.detach(), dtype)
    if bad:
        raise ValueError(f"{what} has {bad} NaN/Inf values; fix the weights or add {prefix!r} to ignored_layers")
    if overflow:
        raise ValueError(f"{what} has {overflow} values that a {dtype} copy makes inf (largest {largest:g}); fix the "
                         f"weights, load them into a wider dtype, or add {prefix!r} to ignored_layers")


def refuse_script(self) -> NoReturn:
    """``__prepare_scriptable__`` of an fp8 layer or experts module, which ``torch.jit.script`` calls before it compiles
    a module: it refuses, naming the layer. TorchScript cannot compile the property that dequantizes the weight; it
    failed with its own internals ("Module 'Fp8Linear' has no attribute '_parameters'", then "Can't redefine method:
    __weight_getter")."""
    name = getattr(self._parameters.get("weight"), "_fp8fx_fqn", None) or getattr(self, "_fp8fx_prefix", "")
    raise RuntimeError(f"torch.jit.script: {name or type(self).__name__} is an fp8fx layer, whose weight is a property "
                       "that dequantizes its fp8 codes, which TorchScript cannot compile; use torch.jit.trace (it "
                       "records fp8fx.dequantize on the codes and scales), torch.export, or torch.compile(model, "
                       "backend=fp8fx.Fp8Backend())")


def fp8_load_from_state_dict(self, state_dict, prefix, *args) -> None:
    """``Module._load_from_state_dict`` of a quantized layer or experts module: a state dict it refuses
    (``load_refusal``) loads nothing of the module, and says why."""
    checked = _checked_loads().pop((id(self), prefix), None)
    refused = "" if _passed(checked, self, _given(self, state_dict, prefix)) else load_refusal(
        self, state_dict, prefix, _assigns(args))
    if refused:
        args[-1].append(refused)  # (torch's error_msgs: load_state_dict raises them once every module had its turn)
        return
    made = next(c for c in type(self).__mro__ if "_fp8fx_maker" in c.__dict__)
    tags = {n: (p, carried_tags(p)) for n, p in self._parameters.items() if p is not None}
    super(made, self)._load_from_state_dict(state_dict, prefix, *args)
    for n, (old, carried) in tags.items():  # load_state_dict(assign=True) put new Parameters in: they carry the
        new = self._parameters.get(n)  # fp8fx tags the passes find the layer by (experts ran as bf16 grouped GEMMs)
        for k, v in carried.items() if new is not None and new is not old else ():
            if not hasattr(new, k):
                setattr(new, k, v)


def _assigns(args: tuple) -> bool:
    """Whether the load a ``_load_from_state_dict`` or its pre-hook (``args``: local_metadata, ...) serves puts the
    given tensors in as they are (``load_state_dict(assign=True)``) instead of copying their values."""
    return bool(args and isinstance(args[0], Mapping) and args[0].get("assign_to_params_buffers", False))


def load_refusal(self: nn.Module, state_dict: Mapping[str, object], prefix: str, assign: bool = False) -> str:
    """Why a quantized layer or experts module (``self``, at ``prefix``) refuses the entries of ``state_dict``, or "".
    An fp8 parameter's tensor of another dtype (a bf16 state dict loaded into the quantized model): copied in, its
    values were cast to fp8 and read as codes under the old scales (outputs off by ~100%). Scales no loader takes (0,
    <0, NaN, Inf: ``quant.bad_scales``) and NaN codes, which ``load_checkpoint`` refuses: loaded, the layer's outputs
    were NaN, zero or negated, silently. fp8 codes without their scales, or scales without their codes (``strict=False``
    of a model quantized with another scheme, whose scales have other names: the codes were read under the old
    scales, relative errors of 0.7-3, with only a missing-keys list to say so). Codes or scales of another shape
    (per-channel scales [N, 1] for a per-tensor layer's [1]): torch copied the codes, then refused the scale, leaving
    the codes under the old scale (outputs 1.5x their norm off after the error). Scales of another dtype than float32
    loaded with ``assign=True``, which puts them in as they are (a state dict whose float32 tensors were halved: the
    layer held float16 scales, which save_checkpoint then refused, blaming a cast). Codes and scales whose dequantized
    weight the layer's float16 compute dtype cannot hold (inf, outputs NaN), as its cast to float16 is refused. Codes
    without the static input scale the layer holds, or with one it has no place for (a state_dict of the other
    activation scheme: every layer's codes were replaced before torch named the missing or unexpected keys, the new
    codes left under the old calibration's scales)."""
    for name, codes in self._parameters.items():
        given = state_dict.get(prefix + name)
        if codes is None or not is_fp8_state(name, codes) or not isinstance(given, torch.Tensor) or given.is_meta:
            continue
        scale = name.endswith(("scale", "scale_inv"))
        if (scale or given.dtype == codes.dtype) and given.shape != codes.shape and not (
                codes.dim() == 0 and given.shape == (1,)):  # (torch's own allowance: [1] into a 0-dim parameter)
            # (an experts module's [E, a, b] as [E, b, a] too)
            transposed = given.dim() == codes.dim() >= 2 and given.shape[:-2] == codes.shape[:-2] and (
                given.shape[-2:] == codes.shape[-2:][::-1])
            conv1d = is_conv1d_class(type(self)) and name == "weight" and transposed
            # (a reshape is the fix only where the shapes differ by dims of 1, [N] for [N, 1]: one of a transposed
            # [K/128, N/128] block scale gave it the shape and scrambled which block each scale is for)
            squeezed = [d for d in given.shape if d != 1] == [d for d in codes.shape if d != 1]
            why = ("a Conv1D's fp8 codes as checkpoints hold its weight, [in, out], where the layer holds them [out, "
                   "in]: load the checkpoint with fp8fx.load_checkpoint, or transpose it (.t().contiguous())"
                   if conv1d else
                   f"the same {given.numel()} values in another shape: reshape it to {list(codes.shape)}"
                   if squeezed else
                   "the transposed shape, a writer's [in, out] layout ([K blocks, N blocks] for a block scale): "
                   f"transpose it ({'.t()' if codes.dim() == 2 else '.transpose(-2, -1)'}.contiguous()); a reshape "
                   "would put its values in the wrong places"
                   if transposed else
                   f"as many values ({given.numel()}) in another layout: load the state_dict of a model quantized as "
                   "this one is"
                   if given.numel() == codes.numel() else
                   "a state_dict of a model quantized with another scheme or block: load the state_dict of a model "
                   "quantized as this one is, or quantize_ the high-precision model with that scheme")
            return (f"{prefix}{name}: shape {list(given.shape)}, where this module's is {list(codes.shape)} ({why}; "
                    "this module was not loaded)")
        if scale and assign and given.dtype != codes.dtype:
            return (f"{prefix}{name}: a {given.dtype} scale, where fp8fx's scales are {codes.dtype}; "
                    "load_state_dict(assign=True) puts it in as it is: cast the state_dict's scales back "
                    f"(.to({codes.dtype})), or load without assign=True, which copies them into the layer's "
                    f"{codes.dtype} scales (this module was not loaded)")
        if scale:
            why = quant.bad_scales(given.detach().float())
            if why:
                return (f"{prefix}{name}: {why}; load the scales the quantized model's state_dict holds, or quantize "
                        "the layer again from its high-precision weight (this module was not loaded)")
            continue
        if given.dtype != codes.dtype:
            return (f"{prefix}{name}: a {given.dtype} tensor for a module fp8fx quantized (its {name} is {codes.dtype} "
                    "codes scaled by its scales), whose values would be taken as codes; load 16-bit weights into the "
                    "model before fp8fx.quantize_, or fp8 ones with their scales (a state_dict of the quantized model, "
                    "fp8fx.load_checkpoint)")
        bad = chunked.count_nonfinite(given.detach())
        if bad:
            return (f"{prefix}{name} has {bad} NaN codes, which no loader takes; fix the weights (this module was "
                    "not loaded)")
    for name, codes in self._parameters.items():  # codes and the scales that scale them come together, or not at all
        if codes is None or codes.dtype != quant.FP8_DTYPE:
            continue
        pair = [prefix + n for n in (name, *_weight_scales(self, name))]
        given = [n for n in pair if n in state_dict]
        if given and len(given) < len(pair):
            missing = next(n for n in pair if n not in state_dict)
            return (f"{missing} is not in the state_dict, which holds {', '.join(given)}: fp8 codes and their scales "
                    "are loaded together (codes read under another scale, or a scale over other codes, give wrong "
                    "weights: a state_dict of a model quantized with another scheme, or a partial one); load both, as "
                    "the quantized model's state_dict holds them (this module was not loaded)")
    for name, codes in self._parameters.items():  # codes of static activations come with their input scale, and
        if codes is None or codes.dtype != quant.FP8_DTYPE or prefix + name not in state_dict:  # dynamic ones with none
            continue
        scale = "input_scale" if name == "weight" else f"{name}_input_scale"  # (a linear's; an experts module's)
        held, given = self._parameters.get(scale) is not None, prefix + scale in state_dict
        if held and not given:  # (the new codes were left under the old calibration's input scale)
            return (f"{prefix}{scale} is not in the state_dict, which holds {prefix}{name}: this module quantizes "
                    "its input with a static scale (activation_scheme='static') and the state_dict is of a model "
                    "quantized with dynamic activations, another scheme; load a state_dict of a model quantized as "
                    "this one is, or quantize this model with dynamic activations (this module was not loaded)")
        if given and not held:
            return (f"{prefix}{scale}: the state_dict holds a static input scale for {prefix}{name}, and this module "
                    "quantizes its input dynamically (no input scale): a state_dict of a model quantized with static "
                    "activations (activation_scheme='static'), another scheme; load a state_dict of a model quantized "
                    "as this one is, or quantize this model with static activations (this module was not loaded)")
    dtype = getattr(self, "_fp8fx_dtype", None)
    if dtype == torch.float16:  # (the one compute dtype whose range fp8 codes times a scale can exceed)
        params = {n: state_dict.get(prefix + n, p) for n, p in self._parameters.items()}
        params = {n: p if isinstance(p, torch.Tensor) and not p.is_meta else None for n, p in params.items()}
        found = _overflow(self, dtype, params)
        if found is not None:
            largest, count, w = found
            return (f"{prefix}{w}: a scale of {largest:g} times fp8 values up to {quant.FP8_MAX:g} is beyond "
                    f"{dtype}'s range (at most {torch.finfo(dtype).max:g}), the dtype this module computes in: "
                    f"{count} values of its dequantized {w} would be inf (outputs NaN); load them into a bfloat16 or "
                    "float32 model (model.to(torch.bfloat16) first) (this module was not loaded)")
    return ""


def _weight_scales(module: nn.Module, name: str) -> list[str]:
    """The names of the scales the module holds for its fp8 tensor ``name`` (a linear's ``weight_scale`` or
    ``weight_scale_inv``; an experts module's ``gate_up_proj_scale`` / ``_scale_inv``): not its input scales."""
    base = "weight" if name == "weight" else name
    return [n for n in (f"{base}_scale", f"{base}_scale_inv") if module._parameters.get(n) is not None]


def fp8_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``weight`` is the dequantized view (one per class, cached)."""
    if getattr(cls, "_fp8fx_quantized", False):
        return cls
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(
            f"Fp8{cls.__name__}",
            (cls,),
            {"weight": property(_dequantized_weight), "_apply": fp8_apply, "_fp8fx_quantized": True,
             "_load_from_state_dict": fp8_load_from_state_dict, "__delattr__": fp8_delattr,
             "__module__": cls.__module__, "__reduce_ex__": reduce_made_class, "__setstate__": setstate_made_class,
             "__prepare_scriptable__": refuse_script, "_fp8fx_maker": fp8_class,
             "_fp8fx_transposed": is_conv1d_class(cls)},
        )
    return _FP8_CLASSES[cls]


def reduce_made_class(module: nn.Module, protocol: int):
    """``__reduce_ex__`` of the classes ``fp8_class`` (and ``fp8fx.weights.moe``'s ``fp8_experts_class``) make: a
    pickle (``torch.save(model)``, multiprocessing) names no such class by module and name (there is none to look
    up), but the maker and the class it was made from, which remakes it; the state as ``nn.Module`` pickles it."""
    cls = type(module)
    # the parameters' fp8fx tags (_fp8fx_fqn, _fp8fx_moe_role, ...: what the passes find a layer by) travel in the
    # state: a deep copy of a Parameter keeps its data alone (a copied model's MoE experts were not fused)
    tags = {name: carried_tags(p) for name, p in module._parameters.items() if p is not None}
    return _remade, (cls._fp8fx_maker, cls.__mro__[1]), {**module.__getstate__(), _TAGS: tags}


_TAGS = "_fp8fx_parameter_tags"


def carried_tags(p: torch.Tensor) -> dict:
    """The fp8fx tags a copy of parameter ``p`` carries."""
    return {k: v for k, v in vars(p).items() if k.startswith("_fp8fx_")}


def setstate_made_class(module: nn.Module, state: dict) -> None:
    """``__setstate__`` of the classes ``fp8_class`` / ``fp8_experts_class`` make: ``nn.Module``'s, then each
    parameter's fp8fx tags put back (``reduce_made_class``)."""
    state = dict(state)
    tags = state.pop(_TAGS, {})
    nn.Module.__setstate__(module, state)
    for name, attrs in tags.items():
        p = module._parameters.get(name)
        for k, v in attrs.items() if p is not None else ():
            setattr(p, k, v)


def _remade(maker, base: type) -> nn.Module:
    cls = maker(base)
    return cls.__new__(cls)


def is_quantized(module: nn.Module) -> bool:
    return getattr(type(module), "_fp8fx_quantized", False)


def is_conv1d_class(cls: type) -> bool:
    """``cls`` is transformers' ``Conv1D`` or a subclass of it: the projections of GPT-2, OpenAI GPT, ImageGPT,
    Decision Transformer and CLVP, a linear whose weight is stored transposed, ``[in_features, out_features]``, and
    run as ``addmm(bias, x, weight)``. Matched by name, so that fp8fx imports no transformers."""
    return any(c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils" for c in cls.__mro__)


def is_linear(module: nn.Module) -> bool:
    """A layer ``quantize_`` quantizes as a linear: an ``nn.Linear``, or transformers' ``Conv1D``
    (``is_conv1d_class``), whose fp8 codes are stored as a linear's, ``[out_features, in_features]`` (as
    transformers' own quantizers - bitsandbytes' - store a quantized Conv1D's), its ``weight`` the dequantized codes
    transposed back to ``[in, out]``."""
    return isinstance(module, nn.Linear) or is_conv1d_class(type(module))


def target_classes(module: nn.Module) -> tuple[str, ...]:
    """The class names a compressed-tensors target matches ``module`` by: its class's and its bases' (a ``"Linear"``
    target covers nn.Linear's subclasses), and ``"Linear"`` for a Conv1D, which vLLM builds as one of its linear
    layers."""
    names = tuple(c.__name__ for c in type(module).__mro__)
    return (*names, "Linear") if is_conv1d_class(type(module)) else names


def linear_weight(module: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a linear's, ``[out_features, in_features]``: a high-precision Conv1D's transposed (a
    view); a quantized layer's fp8 codes, which are stored so."""
    weight = module._parameters.get("weight")
    weight = module.weight if weight is None else weight  # (a parametrized weight: computed)
    return weight.t() if is_conv1d_class(type(module)) and not is_quantized(module) else weight


def is_foreign_linear(module: nn.Module) -> bool:
    """A module with a 2-D weight of its own that is neither a linear (``is_linear``) nor an embedding (a router
    module, a linear of a library's own class): fp8fx quantizes none, and says so."""
    weight = module._parameters.get("weight")
    return not is_linear(module) and not isinstance(module, nn.Embedding) and isinstance(weight, torch.Tensor) \
        and weight.dim() == 2


def foreign_linear_reason(module: nn.Module) -> Optional[str]:
    """Why ``quantize_`` leaves a linear-like module that is no ``nn.Linear`` (``is_foreign_linear``) in high
    precision, as its weight's tag and the report say it; None for any other module."""
    return f"{type(module).__name__} is no nn.Linear" if is_foreign_linear(module) else None


def layer_scheme(module: nn.Module) -> LayerScheme:
    """The scheme a quantized layer runs with, read back from the layer."""
    static = "input_scale" in module._parameters
    act = granularity_from_block([-1, -1] if static else module._fp8fx_act_block)
    return LayerScheme(granularity_from_block(module._fp8fx_w_block, weight=True), act, static)


# nn.MultiheadAttention's out_proj (torch's NonDynamicallyQuantizableLinear; torchao's quantize_ skips it too)
MHA_OUT_PROJ = ("nn.MultiheadAttention's out_proj, which torch computes inside F.multi_head_attention_forward: no fp8 "
                "GEMM runs it (in fp8 it would add its error and save nothing at run time)")


def skip_reason(layer: nn.Module, fqn: str, config: Fp8Config) -> Optional[str]:
    """Why ``layer`` (an ``nn.Linear``) cannot be quantized with ``config``, or None."""
    if config.is_ignored(fqn):
        return "in ignored_layers"
    if isinstance(layer, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return MHA_OUT_PROJ
    if parametrize.is_parametrized(layer, "weight"):
        return ("its weight is parametrized (weight_norm, spectral_norm, ...: computed at each call), not a parameter "
                "to store in fp8; remove the parametrization first (torch.nn.utils.parametrize."
                "remove_parametrizations(layer, 'weight'))")
    hook = _weight_hook(layer)
    if hook is not None:
        what, fix = {WeightNorm: ("weight_norm", "torch.nn.utils.remove_weight_norm(layer)"),
                     SpectralNorm: ("spectral_norm", "torch.nn.utils.remove_spectral_norm(layer)")}.get(
            type(hook), ("pruning", "torch.nn.utils.prune.remove(layer, 'weight'), which keeps the pruned zeros"))
        return (f"its weight is computed at each call by a forward pre-hook ({what}: {type(hook).__name__}), not a "
                f"parameter to store in fp8; make it one first ({fix}), then quantize_")
    weight = layer._parameters.get("weight")
    if weight is None:
        held = "a buffer" if isinstance(layer._buffers.get("weight"), torch.Tensor) else "no tensor"
        return (f"its weight is {held}, not a parameter: quantize_ stores a layer's weight parameter in fp8; register "
                "it as an nn.Parameter, or add the layer to ignored_layers")
    why = foreign_tensor_reason(weight)
    if why is not None:
        return why
    if weight.dim() != 2:
        return (f"its weight is {weight.dim()}-D {list(weight.shape)}, not a linear's [out_features, in_features]; "
                "add the layer to ignored_layers")
    if weight.dtype not in quant.HIGH_PRECISION:
        return (f"weight dtype {weight.dtype} is not bf16/fp16/fp32; cast the layer to one of these (layer.to(torch."
                "bfloat16)) or add it to ignored_layers")
    w = config.weight
    n, k = linear_weight(layer).shape
    if isinstance(w, PerBlock) and (n % w.block_n or k % w.block_k):
        return (
            f"weight [{n}, {k}] is not divisible by the {w.block_n}x{w.block_k} block; use per-channel "
            "scales or add it to ignored_layers"
        )
    return None


def foreign_tensor_reason(weight: torch.Tensor) -> Optional[str]:
    """Why ``quantize_`` cannot read ``weight``, a parameter that is no plain tensor, or None: a tensor subclass of
    another library (torchao's ``Float8Tensor``, ``AffineQuantizedTensor``: already quantized, its dtype still saying
    bf16; ``DTensor``), which fp8fx's checks and casts cannot run on (they failed inside that library's dispatch,
    naming no layer)."""
    if type(weight) in (nn.Parameter, torch.Tensor):
        return None
    cls = type(weight)
    return (f"its weight is a {cls.__module__}.{cls.__qualname__}, a tensor subclass of another library (quantized "
            "or sharded by it), not a plain bf16/fp16/fp32 tensor; quantize_ the unquantized model instead, or add "
            "the layer to ignored_layers")


def check_no_lazy_modules(model: nn.Module, where: str, undone: str) -> None:
    """Refuses a model holding a lazy module whose parameters are not initialized yet (``nn.LazyLinear`` before its
    first forward): fp8fx's checks of its weight failed in torch's "Attempted to use an uninitialized parameter",
    naming no module."""
    for fqn, module in model.named_modules():
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{where}: {fqn or 'the model'} ({type(module).__name__}) is a lazy module whose weights "
                             "are not initialized yet; run a forward with a batch first, which gives them their shapes "
                             f"and values, then {where} (nothing was {undone})")


def check_no_in_place_rescale(model: nn.Module, where: str, undone: str) -> None:
    """Refuses a model that rescales its weights in place at its first forward in eval mode: transformers' RWKV
    (``config.rescale_every > 0``, ``layers_are_rescaled`` still False) runs ``weight.div_`` on its blocks'
    ``attention.output`` and ``feed_forward.value``. An fp8 layer's ``weight`` is a dequantized copy, so the division
    was lost while the model still halved its hidden states: outputs 0.85 off, silently, every site reported
    rewritten (found by an HF architecture sweep). ``rescale_every = 0`` turns both off: RWKV rescales to keep float16
    activations from overflowing, which bf16's range does not need."""
    for fqn, module in model.named_modules():
        every = getattr(getattr(module, "config", None), "rescale_every", None)
        if getattr(module, "layers_are_rescaled", None) is False and isinstance(every, int) and every > 0:
            raise ValueError(
                f"{where}: {fqn or 'the model'} ({type(module).__name__}) divides its blocks' attention.output and "
                f"feed_forward.value weights in place at its first forward in eval mode (config.rescale_every="
                f"{every}), which fp8 layers cannot take: the write would change a copy of the dequantized weight, "
                "while the model still halves its hidden states (wrong outputs); set model.config.rescale_every = 0 "
                f"first, which turns both off (nothing was {undone})")


def kept_by_the_model(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """fqn -> why it stays in high precision, for the ``nn.Linear`` layers that a transformers model keeps out of
    quantization: those its ``_keep_in_fp32_modules`` names (the instance's: transformers gathers its submodels'
    into it), read as transformers' fp8 quantizer reads them (it adds them to ``modules_to_not_convert``: a
    suffix, a name or a regex). DeepSeek-V3.2's ``indexer.weights_proj``, which its FP8 checkpoints store in bf16
    (vLLM builds it with ``quant_config=None``); T5's ``wo``. Names are matched inside ``model``: a part quantized
    on its own (``prefix``) is matched by its own list, if it has one."""
    patterns = getattr(model, "_keep_in_fp32_modules", None)
    if not isinstance(patterns, (list, tuple, set, frozenset)) or not patterns:  # (transformers: None, or a set)
        return {}
    patterns = sorted(p for p in patterns if isinstance(p, str))
    kept = {}
    for fqn, layer in model.named_modules():
        if fqn and is_linear(layer):
            hits = [p for p in patterns if _keeps(fqn, p)]
            if hits:
                kept[f"{prefix}.{fqn}" if prefix else fqn] = (
                    f"kept in high precision by {type(model).__name__}._keep_in_fp32_modules ({hits[0]!r}), as "
                    "transformers' fp8 quantizer keeps it; to quantize it anyway, remove it from that list first")
    return kept


def adapters(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """fqn -> why it stays in high precision, for the ``nn.Linear`` layers of adapters a PEFT model trains (LoRA's
    ``lora_A`` / ``lora_B``: those under the module dicts an adapter layer names in its ``adapter_layer_names``, as
    every PEFT tuner layer does). ``quantize_`` of a PEFT model made them fp8 and froze them: nothing left to train,
    silently. Their ``base_layer`` is quantized (the QLoRA recipe, in fp8)."""
    kept = {}
    for owner, m in model.named_modules(prefix=prefix):
        names = getattr(m, "adapter_layer_names", None)
        if not isinstance(names, (tuple, list)) or not isinstance(getattr(m, "base_layer", None), nn.Module):
            continue
        for name in names:
            holder = getattr(m, name, None) if isinstance(name, str) else None
            for fqn, layer in holder.named_modules(prefix=f"{owner}.{name}") if isinstance(holder, nn.Module) else ():
                if isinstance(layer, nn.Linear):
                    kept[fqn] = (f"an adapter {type(m).__name__} trains ({name}): adapters stay in high precision, "
                                 "their base_layer is quantized")
    return kept


def _keeps(fqn: str, pattern: str) -> bool:
    try:
        return transformers_skips(fqn, [pattern])
    except re.error:  # (a pattern that is no regex: transformers fails on it; here it names a suffix)
        return fqn.endswith(pattern)


def _weight_hook(layer: nn.Module):
    """The forward pre-hook that computes ``layer.weight`` at each call, or None: ``torch.nn.utils.weight_norm``'s
    (deprecated) form (``weight_g`` / ``weight_v`` parameters), the hook form of ``spectral_norm`` and
    ``torch.nn.utils.prune``'s methods (``weight_orig``; its mask or power-iteration vectors buffers). The weight is
    then a plain attribute, which quantize_ said was "no tensor" (register it as a parameter: no fix)."""
    for hook in layer._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)) and hook.name == "weight":
            return hook
        if isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == "weight":
            return hook
    return None


def weight_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors ``layer``'s weight is read from: the weight, or those of its parametrization (weight_norm's
    ``original0`` / ``original1``) or of the forward pre-hook that computes it (``_weight_hook``: ``weight_g`` /
    ``weight_v``, ``weight_orig`` and ``weight_mask``: ``layer.weight`` is a new tensor at each access or call), for
    the report's tags."""
    if parametrize.is_parametrized(layer, "weight"):
        return list(layer.parametrizations.weight.parameters())
    if _weight_hook(layer) is not None:  # weight_norm's weight_g / weight_v; spectral_norm's, pruning's weight_orig
        # and their buffers (pruning's weight_mask, which its product reads first)
        return [t for n, t in (*layer._parameters.items(), *layer._buffers.items())
                if n.startswith("weight_") and t is not None]
    return [layer.weight] if isinstance(layer.weight, torch.Tensor) else []


def same_layout(name: str, loaded: tuple, dest: tuple) -> bool:
    """``loaded`` fits ``dest`` as it is: a weight with the same shape; a scale with the same shape once
    trailing 1-dims are dropped (checkpoints store [N] / [] / [E, rows] where fp8fx keeps [N, 1] / [1] /
    [E, rows, 1]). Only the element count agreeing is not enough: a transposed tensor has it too."""
    if name == "weight":
        return loaded == dest
    return quant.without_trailing_ones(loaded) == quant.without_trailing_ones(dest)


def float16_range_error(name: str, largest: float, count: int, weight: str, experts: bool = False) -> ValueError:
    """``process_weights_after_loading``'s refusal of a float16 layer (or experts) whose scales times fp8 values
    float16 cannot hold (``_overflow``'s finding: inf weights, NaN outputs)."""
    it, them = ("these experts", "them") if experts else ("this layer", "it")
    return ValueError(
        f"{name}: a scale of {largest:g} times fp8 values up to {quant.FP8_MAX:g} is beyond float16's range (at most "
        f"{torch.finfo(torch.float16).max:g}), the dtype {it} computes in: {count} values of its dequantized {weight} "
        f"would be inf (outputs NaN); create {them} with params_dtype=torch.bfloat16 or torch.float32 ({it} is as it "
        "was)")


def check_bias_values(what: str, loaded, dtype: torch.dtype) -> None:
    """A bias a method class's ``weight_loader`` takes (``what`` names it) into a layer computing in ``dtype``: a
    16- or 32-bit float tensor with values, no NaN/Inf, and none that ``dtype`` makes inf (a bf16 or fp32 bias into
    a float16 layer: 65504 at most; it was stored as inf, the outputs inf / NaN)."""
    if not isinstance(loaded, torch.Tensor) or not loaded.is_floating_point() or loaded.dtype.itemsize < 2:
        raise ValueError(f"{what}: a {getattr(loaded, 'dtype', type(loaded).__name__)} tensor; a bias loads as "
                         "bf16/fp16/fp32 (nothing was loaded)")
    refuse_meta(what, loaded)
    bad, overflow, largest = chunked.count_unloadable(loaded.detach(), dtype)
    if bad:
        raise ValueError(f"{what} has {bad} NaN/Inf values: re-export the checkpoint (nothing was loaded)")
    if overflow:
        raise ValueError(f"{what} has {overflow} values that the layer's {dtype} makes inf (largest {largest:g}): "
                         "create the layer with params_dtype=torch.bfloat16 or torch.float32 (nothing was loaded)")


def refuse_meta(what: str, loaded: torch.Tensor) -> None:
    """A method class's ``weight_loader`` given a tensor on the meta device, which has no values to copy (its checks
    failed in torch's "Tensor.item() cannot be called on meta tensors", naming nothing)."""
    if loaded.is_meta:
        raise ValueError(f"{what}: the tensor is on the meta device and holds no values; pass the checkpoint's "
                         "tensor, read from its file (nothing was loaded)")


def _bias_in(layer: nn.Module, bias: torch.Tensor, device) -> torch.Tensor:
    """A method class's layer's ``bias`` in the dtype the layer computes in: its values, or zeros where it is on meta
    (made where create_weights said, else on ``device``: the loaded tensor's)."""
    if not bias.is_meta:
        return bias.detach().to(layer._fp8fx_dtype)
    device = layer._fp8fx_device if layer._fp8fx_device is not None else device
    return torch.zeros(bias.shape, dtype=layer._fp8fx_dtype, device=device)


def created_by(layer: nn.Module, method: str) -> str:
    """The layer's name, where ``method``'s (``Fp8LinearMethod``'s, ``Fp8MoEMethod``'s) create_weights made its
    weights (else the method's other calls failed with a bare AttributeError or KeyError)."""
    marks = {"Fp8LinearMethod": ("_fp8fx_partitions", "this layer's"), "Fp8MoEMethod": ("_fp8fx_intermediate",
                                                                                     "these experts'")}
    mark, whose = marks[method]
    if hasattr(layer, mark):
        return layer._fp8fx_prefix
    other = next((m for m, (a, _) in marks.items() if m != method and hasattr(layer, a)), None)
    what = f"{other} created them: load them with {other}" if other else f"call {method}.create_weights(layer, ...) "
    name = getattr(layer, "_fp8fx_prefix", None) or type(layer).__name__
    raise ValueError(f"{name}: {method} did not create {whose} weights ({what}{'' if other else 'first'}) (nothing was "
                     "loaded)")


def method_config(config: Any, where: str) -> Fp8Config:
    """A method class's ``config`` (``Fp8LinearMethod(config)``, ``Fp8MoEMethod(config)``), an ``Fp8Config``: a
    checkpoint's quantization_config dict, None or the class failed at the first call with an AttributeError."""
    config = config_or(config, None, where, takes="an Fp8Config")
    if config is None:
        raise ValueError(f"{where}(config=None): it takes an Fp8Config, e.g. {where}(Fp8Config()), or "
                         f"{where}(Fp8Config.from_config(quantization_config)) for a checkpoint's")
    return config


_PLANNING = contextvars.ContextVar("fp8fx_planning", default=False)
# a layer's attribute: its loader checks the dequantized weight's range itself (load_checkpoint: naming the checkpoint
# entry), so process_weights_after_loading's float16 check leaves it to that
RANGE_CHECKED = "_fp8fx_range_checked"


@contextlib.contextmanager
def planning():
    """``create_weights`` on the meta device, for a plan that loads nothing (``convert``'s look at its source)."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def check_create_target(where: str, layer: nn.Module, created: bool, device) -> None:
    """``create_weights``' layer and device (``Fp8LinearMethod``'s, ``Fp8MoEMethod``'s), checked before anything of the
    layer changes. ``created``: the layer holds fp8fx's weights already (``quantize_``, ``load_checkpoint`` or an
    earlier ``create_weights``, a load maybe under way), which a second call replaced with empty ones, silently (the
    model's forward then refused it). A ``device`` no tensor can be made on failed in torch with no name (``cuda`` in a
    CPU build), the layer half-created."""
    if created:
        raise ValueError(f"{where}: its weights were created already (it holds fp8fx's fp8 weights, or a load into "
                         "them is under way); create_weights makes a layer's weights once: load into them with "
                         "weight_loader, or create them on a fresh module (nothing of the layer changed)")
    try:
        made = torch.empty(0, device=device).device  # (device=None: torch's default, a torch.device("meta") block's)
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: device={device!r}: no tensor can be made there ({str(e).splitlines()[0]}); "
                         "pass a device this machine has (nothing of the layer changed)") from None
    if made.type == "meta" and not _PLANNING.get():  # (loads into it did nothing, then failed naming no layer)
        made_by = "the default device" if device is None else "meta"
        raise ValueError(f"{where}: device={device!r} makes meta tensors ({made_by}), which hold no values for "
                         "weight_loader to fill: pass the device the weights load to, "
                         "e.g. device='cuda' (the module itself may stay on meta) (nothing of the layer changed)")


def check_create_arguments(where: str, params_dtype: torch.dtype, **sizes) -> None:
    """The arguments of ``create_weights`` (``Fp8LinearMethod``'s, ``Fp8MoEMethod``'s), checked before anything of
    the layer changes: each size an int >= 0 (``output_partition_sizes``: a list of them, one at least; ``tp_size``
    >= 1), ``params_dtype`` the dtype the layer computes in. Unchecked, a negative or fractional size failed in
    torch with no name, and an integer dtype at the first weight loaded, each leaving the layer half-created."""
    def size(v) -> Optional[int]:  # (numpy's and torch's ints too: operator.index takes them, not floats or bools)
        try:
            return None if isinstance(v, bool) else operator.index(v)
        except TypeError:
            return None

    for name, value in sizes.items():
        many = name == "output_partition_sizes"
        least = 1 if name in ("tp_size", "num_experts") else 0  # (0 experts: processing failed in an IndexError)
        try:
            values = list(value) if many and not isinstance(value, (str, bytes)) else [value]
        except TypeError:  # (an int for the list)
            values = []
        if not values or any(n is None or n < least for n in map(size, values)):
            what = "a list of ints >= 0, one for each fused shard" if many else f"an int >= {least}"
            raise ValueError(f"{where}: create_weights({name}={value!r}): {what} (nothing of the layer changed)")
    if params_dtype not in quant.HIGH_PRECISION:
        raise ValueError(f"{where}: create_weights(params_dtype={params_dtype!r}): the dtype the layer computes in "
                         "(its dequantized weight's and outputs'), torch.bfloat16, torch.float16 or torch.float32 "
                         "(nothing of the layer changed)")


def refuse_again(what: str, arrived: Optional[set], part: Optional[int], kind: str, thing: str) -> None:
    """A scale or bias (``what``, a ``thing``) loaded again: ``part`` (a ``kind``'s index, shard or expert; None: the
    whole tensor) where ``arrived`` (the parts loaded before, "all" for the whole) covers it. Refused as a weight's
    repeat is: the last copy had replaced the first, silently (a bias's: h145)."""
    if arrived and (part is None or "all" in arrived or part in arrived):
        raise ValueError(f"{what} ({kind} {part}) was loaded before ({kind}s {sorted(arrived, key=str)}; all: the whole "
                         f"tensor); each {kind}'s {thing} must arrive once (nothing was loaded)")


class Fp8LinearMethod:
    """create_weights -> weight_loader (full tensor or shards) -> process_weights_after_loading.

    Online (``is_checkpoint_fp8_serialized=False``): the bf16 weight is received into a high-precision
    buffer and quantized as soon as its last element has arrived (counted by ``CopyNumelCounter``),
    so loading holds at most one bf16 weight per layer in flight; the shards of a fused layer whose scales are their
    rows' own (per channel, or blocks within a shard) are quantized as they arrive, with no buffer. Serialized: fp8
    weights and scales are copied as stored; per-shard per-tensor scales of a fused layer are requantized to their
    max in ``process_weights_after_loading``.
    """

    def __init__(self, config: Fp8Config, scheme: Optional[LayerScheme] = None):
        self.config = method_config(config, type(self).__name__)
        self.scheme = scheme or self.config.scheme()

    # -- create ------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        device: Optional[torch.device] = None,
        prefix: str = "",
    ) -> None:
        """``prefix``: the layer's name in its model, which every error of the loader names (default: its class)."""
        if isinstance(params_dtype, int) or not isinstance(prefix, (str, type(None))):
            # vLLM's positional order: the error named the layer "torch.bfloat16", its dtype having fallen into prefix
            # (h145); prefix None, as "": the layer's class names it
            raise ValueError(
                f"{type(layer).__name__}: create_weights(layer, {input_size!r}, {output_partition_sizes!r}, "
                f"{params_dtype!r}, {device!r}, {prefix!r}): fp8fx's order is (layer, input_size, "
                "output_partition_sizes, params_dtype, device=None, prefix=''), not vLLM's (layer, "
                "input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype); pass "
                "params_dtype= and prefix= by keyword (nothing of the layer changed)")
        where = prefix or type(layer).__name__
        check_create_arguments(where, params_dtype, input_size=input_size,
                               output_partition_sizes=output_partition_sizes)
        w = self.scheme.weight
        if (self.config.is_checkpoint_fp8_serialized and isinstance(w, PerBlock)
                and any(size % w.block_n for size in output_partition_sizes[:-1])):
            raise ValueError(
                f"{where}: output partitions {list(output_partition_sizes)} of a fused {w} layer: every partition but "
                f"the last must be a multiple of block_n={w.block_n}, so that no scale block spans two partitions"
            )
        check_create_target(where, layer, is_quantized(layer) or "_fp8fx_pending" in vars(layer), device)
        n, k = sum(output_partition_sizes), input_size

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        # the tensors first (an allocation that fails leaves the layer as it was), then the layer's attributes
        serialized = self.config.is_checkpoint_fp8_serialized
        unloaded = torch.finfo(torch.float32).min  # marks a scale that was never loaded
        new = {}
        if self.scheme.static_activation:
            new["input_scale"] = param(
                torch.full((len(output_partition_sizes),), unloaded, dtype=torch.float32, device=device)
            )
        if not serialized:  # online: a high-precision receive buffer; fp8 params are made when it is full
            new["weight"] = param(torch.empty(n, k, dtype=params_dtype, device="meta"))
        else:
            new["weight"] = param(torch.empty(n, k, dtype=quant.FP8_DTYPE, device=device))
            # scales start at the "never loaded" marker: process_weights_after_loading refuses any left there
            if isinstance(self.scheme.weight, PerBlock):
                shape = quant.scale_shape((n, k), self.scheme.weight.block)
                new["weight_scale_inv"] = param(torch.full(shape, unloaded, dtype=torch.float32, device=device))
            elif isinstance(self.scheme.weight, PerRow):
                new["weight_scale"] = param(torch.full((n, 1), unloaded, dtype=torch.float32, device=device))
            else:  # one per logical shard until process_weights_after_loading
                new["weight_scale"] = param(
                    torch.full((len(output_partition_sizes),), unloaded, dtype=torch.float32, device=device)
                )
        layer._fp8fx_prefix = where
        layer._fp8fx_partitions = tuple(output_partition_sizes)
        layer._fp8fx_dtype = params_dtype
        layer._fp8fx_w_block = list(self.scheme.weight.block)
        layer._fp8fx_act_block = list(self.scheme.activation.block)
        layer._fp8fx_block_scales = isinstance(self.scheme.weight, PerBlock)
        layer._fp8fx_processed = False
        layer._fp8fx_copied = 0
        # weight / scale name -> the shards received ("all": the whole tensor): a repeat must not count twice
        layer._fp8fx_arrived = {}
        layer._fp8fx_device = device  # (where a bias on meta, and online the weight, are made as they load)
        bias = layer._parameters.get("bias")
        # the bias shards loaded through weight_loader so far ("all": whole): one on meta must arrive so, every shard
        # of it; one built on its device (vLLM builds layers so) may come in a plain copy instead, but once a shard
        # came through weight_loader, every shard must (the others kept nn.Linear's random init, silently)
        layer._fp8fx_bias_loaded = set() if isinstance(bias, torch.Tensor) else None
        layer._parameters.update(new)
        if not serialized:
            # until process_weights_after_loading the layer is the model's own over a receive buffer still filling
            # (it ran on the shards loaded so far and uninitialized memory: outputs of 1e8, silently)
            layer.__dict__["_fp8fx_pending"] = layer.register_forward_pre_hook(_refuse_unprocessed)
            if "_apply" not in vars(layer):  # its own cast refused (``_checked_cast``) until processed, then dropped
                layer.__dict__["_apply"] = layer.__dict__["_fp8fx_loading_guard"] = _CheckedApply(layer)
            return
        layer.__class__ = fp8_class(type(layer))

    # -- load --------------------------------------------------------------------------------
    def weight_loader(
        self, layer: nn.Module, name: str, loaded: torch.Tensor, shard_id: Optional[int] = None,
        values_checked: bool = False,
    ) -> None:
        """Copy ``loaded`` into ``layer.<name>``: the whole tensor (``shard_id=None``) or logical
        shard ``shard_id`` of the fused output dim (e.g. q/k/v = 0/1/2). Refused before anything changes: a shard id
        out of range, a scale that is not a positive finite float, fp8 codes with a NaN, and online a weight that is
        not bf16/fp16/fp32 or holds NaN/Inf or values the layer's dtype cannot hold - the pass over the weight skipped
        with ``values_checked``, where the caller's own pass did it (``quantize_``, ``load_checkpoint``). Online, the
        load that completes the weight quantizes it; where that fails (out of memory) the load is not counted: the
        same shard (or whole weight) loads again. ``bias``: the layer's high-precision bias, whole or its shard's
        rows."""
        who = created_by(layer, "Fp8LinearMethod")
        if name == "bias":
            return self._load_bias(layer, loaded, shard_id)
        refuse_meta(f"{who}.{name} (shard {shard_id})", loaded)
        if name in ("weight_scale", "weight_scale_inv") and not self.config.is_checkpoint_fp8_serialized:
            # (after the last shard the parameter exists, computed: a load had replaced it, silently)
            raise ValueError(f"{who}.{name} (shard {shard_id}): online quantization computes the weight's scales; "
                             "load only the bf16 weight (and an input_scale), or fp8 weights with their scales with "
                             "Fp8Config(is_checkpoint_fp8_serialized=True) (nothing was loaded)")
        target = layer._parameters.get(name)
        if target is None:
            takes = [n for n in ("weight", "weight_scale", "weight_scale_inv", "input_scale") if n in layer._parameters]
            raise KeyError(f"{who}: no fp8fx parameter {name!r}; it takes {takes}")
        sizes = layer._fp8fx_partitions
        shard_id = _shard_index(f"{who}.{name}", shard_id, sizes)
        if layer._fp8fx_processed:  # (a scale then went into the one scale every shard shares; weights were refused)
            raise ValueError(f"{who}.{name} (shard {shard_id}): process_weights_after_loading already ran on this "
                             "layer, which merged its shards' scales; load every tensor before it (nothing was "
                             "loaded)")
        online_weight = name == "weight" and not self.config.is_checkpoint_fp8_serialized
        arrived = layer._fp8fx_arrived.get(name, ())
        if name != "weight":  # (as a weight shard's: a second copy of a shard's scale replaced the first, silently)
            refuse_again(f"{who}.{name}", arrived, shard_id, "shard", "scale")
        if name != "weight":  # the kernels multiply by them: a 0, <0, NaN or Inf made the outputs zero or NaN
            why = quant.bad_scales(loaded.detach().float().reshape(loaded.shape or (1,)))
            if why:
                raise ValueError(f"{who}.{name} (shard {shard_id}): {why}: re-export the checkpoint")
        if online_weight:
            check_online(f"{who}.weight (shard {shard_id})", loaded, layer._fp8fx_dtype, who, "weights",
                         values_checked)
        if (online_weight and target.is_meta and shard_id is None and not layer._fp8fx_copied
                and self._can_adopt(layer, target, loaded)):  # (after shards quantized aside: refused below, h145)
            # the whole weight in the layer's dtype: quantize it as it is, no second bf16 copy; counted once quantized
            # (a quantization that failed, out of memory, had left it adopted and counted: loaded again, it was
            # refused as loaded before, and process_weights_after_loading asked for it)
            self._quantize_online(layer, loaded)
            layer._fp8fx_copied = loaded.numel()
            return
        if name == "weight" and self.config.is_checkpoint_fp8_serialized and loaded.dtype != quant.FP8_DTYPE:
            raise ValueError(
                f"{who}: weight of dtype {loaded.dtype} for an fp8-serialized layer; load the "
                "fp8 weight with its scale, or quantize bf16 weights with Fp8Config(is_checkpoint_fp8_serialized=False)"
            )
        bad = chunked.count_nonfinite(loaded.detach()) if name == "weight" and not (
            online_weight or values_checked) else 0
        if bad:  # (NaN codes: the layer's outputs NaN, silently)
            raise ValueError(f"{who}.weight (shard {shard_id}) has {bad} NaN fp8 codes: re-export the checkpoint")
        if name == "weight" and shard_id is not None and shard_id in arrived:
            # completeness is counted in elements: a repeat would stand in for a shard never loaded
            raise ValueError(
                f"{who}: weight shard {shard_id} was loaded twice; each shard of "
                f"{list(layer._fp8fx_partitions)} must arrive once"
                + ("" if self.config.is_checkpoint_fp8_serialized else " (it is quantized when all have)")
            )
        if name == "weight" and layer._fp8fx_copied + loaded.numel() > target.numel():
            # a whole weight again, or a shard after the whole: online, it would be copied raw into the fp8 weight
            raise ValueError(
                f"{who}: weight (shard {shard_id}) of {loaded.numel()} elements, but "
                f"{layer._fp8fx_copied} of the weight's {target.numel()} were loaded before; the whole weight, or "
                "each of its shards, must arrive once"
            )
        one_per_shard = name == "input_scale" or (name == "weight_scale" and isinstance(self.scheme.weight, PerTensor))
        if shard_id is None and one_per_shard and len(sizes) > 1 and loaded.numel() == 1:
            # a layer fused in the checkpoint (Phi-3's qkv_proj, gate_up_proj) into one of logical partitions: its
            # one scale is every shard's, as vLLM's fused loaders take it (the weight then needs no requantizing)
            loaded = loaded.reshape(1).expand(len(sizes))
        dest = self._shard_slice(layer, name, target.data, shard_id)  # (of the meta weight too: shapes only)
        if not same_layout(name, tuple(loaded.shape), tuple(dest.shape)):
            # (transformers' Conv1D stores its weight [in, out], as GPT-2's checkpoints hold it; its codes: [out, in])
            transposed = (name == "weight" and loaded.dim() == 2 and tuple(loaded.shape[::-1]) == tuple(dest.shape)
                          and is_conv1d_class(type(layer).__mro__[1] if is_quantized(layer) else type(layer)))
            raise ValueError(
                f"{who}.{name} shard {shard_id}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit the "
                f"parameter slice of shape {tuple(dest.shape)} (output partitions {list(sizes)}); "
                + ("a Conv1D's weight is stored [in, out]: pass it transposed, tensor.t()" if transposed else
                   "load the checkpoint's tensor for this layer and shard"))
        if online_weight and shard_id is not None and self._quantizes_shards(layer):
            self._quantize_shard(layer, loaded, shard_id)
            return
        if name == "weight" and target.is_meta:  # the receive buffer, once every check passed: where create_weights
            device = layer._fp8fx_device if layer._fp8fx_device is not None else loaded.device  # said, or the tensor's
            target = nn.Parameter(torch.empty_like(target, device=device), requires_grad=False)
            layer._parameters["weight"] = target
            dest = self._shard_slice(layer, name, target.data, shard_id)
        with CopyNumelCounter() as counter:
            dest.copy_(loaded.reshape(dest.shape))
        copied = layer._fp8fx_copied + counter.copied_numel
        if online_weight and copied >= target.numel():
            # quantized before the last shard is counted as arrived: a quantization that failed (out of memory) leaves
            # the shard unloaded, to be loaded again (counted first, it was refused as "loaded twice", and
            # process_weights_after_loading asked for every shard, all received: the layer could not be finished)
            self._quantize_online(layer, target.data)
        layer._fp8fx_arrived.setdefault(name, set()).add("all" if shard_id is None else shard_id)
        if name == "weight":
            layer._fp8fx_copied = copied

    @staticmethod
    def _can_adopt(layer: nn.Module, target: torch.Tensor, loaded: torch.Tensor) -> bool:
        if layer._fp8fx_device is None:
            return False
        device = torch.device(layer._fp8fx_device)  # "cuda" means the current cuda device
        same_device = loaded.device.type == device.type and device.index in (None, loaded.device.index)
        return same_device and loaded.dtype == target.dtype and loaded.shape == target.shape

    def _load_bias(self, layer: nn.Module, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        """The high-precision bias, whole or shard ``shard_id``'s rows (a fused q/k/v bias): not a scale (a negative
        bias was refused as "not positive", and one on meta was copied into nothing)."""
        who, target = layer._fp8fx_prefix, layer._parameters.get("bias")
        if target is None:
            raise ValueError(f"{who}.bias (shard {shard_id}): the layer has no bias (built with bias=False); build it "
                             "with one, or leave the checkpoint's out (nothing was loaded)")
        sizes = layer._fp8fx_partitions
        shard_id = _shard_index(f"{who}.bias", shard_id, sizes)  # ('q' indexed nothing; -1 wrote shard 2's rows as -1)
        check_bias_values(f"{who}.bias (shard {shard_id})", loaded, layer._fp8fx_dtype)
        refuse_again(f"{who}.bias", getattr(layer, "_fp8fx_bias_loaded", None), shard_id, "shard", "bias")
        rows = (0, target.shape[0]) if shard_id is None else (sum(sizes[:shard_id]), sizes[shard_id])
        if target.dim() != 1 or tuple(loaded.shape) != (rows[1],):
            raise ValueError(f"{who}.bias shard {shard_id}: checkpoint tensor of shape {tuple(loaded.shape)} does not "
                             f"fit the bias's rows {list(rows)} (output partitions {list(sizes)}) (nothing was loaded)")
        if target.is_meta or target.dtype != layer._fp8fx_dtype:  # (in the layer's dtype: nn.Linear's own is float32
            # for a float16 layer; made where create_weights said, or on the tensor's device, where it was on meta)
            target = nn.Parameter(_bias_in(layer, target, loaded.device), requires_grad=target.requires_grad)
            layer._parameters["bias"] = target
        with torch.no_grad():
            target.narrow(0, *rows).copy_(loaded)
        if getattr(layer, "_fp8fx_bias_loaded", None) is not None:
            layer._fp8fx_bias_loaded.add("all" if shard_id is None else shard_id)

    def _shard_slice(self, layer: nn.Module, name: str, dest: torch.Tensor, shard_id: Optional[int]) -> torch.Tensor:
        """The part of ``dest`` (a parameter's data) that logical shard ``shard_id`` of the fused output
        dim owns: its rows of the weight and of per-channel / block scales, its entry of per-shard scales."""
        if shard_id is None:
            return dest
        sizes = layer._fp8fx_partitions
        start, size = sum(sizes[:shard_id]), sizes[shard_id]
        if name == "weight" or (name == "weight_scale" and isinstance(self.scheme.weight, PerRow)):
            return dest.narrow(0, start, size)  # rows [start, start + size)
        if name == "weight_scale_inv":  # partitions start on block rows (checked in create_weights)
            block_n = self.scheme.weight.block_n
            return dest.narrow(0, start // block_n, math.ceil(size / block_n))
        if dest.numel() == len(sizes):  # one scale per shard (per-tensor weight_scale, input_scale)
            return dest[shard_id : shard_id + 1]
        return dest

    def _quantizes_shards(self, layer: nn.Module) -> bool:
        """Online, each shard of a fused layer is quantized as it arrives where its scales are its rows' own
        (per-channel; blocks where no block spans two partitions): the result is the whole weight's, bit for bit,
        and no bf16 copy of the whole weight is held. A per-tensor scale needs every shard's values first."""
        w = self.scheme.weight
        if isinstance(w, PerRow):
            return True
        return isinstance(w, PerBlock) and not any(size % w.block_n for size in layer._fp8fx_partitions[:-1])

    def _quantize_shard(self, layer: nn.Module, loaded: torch.Tensor, shard_id: int) -> None:
        """Quantize shard ``shard_id`` (checked by ``weight_loader``) into the layer's fp8 weight and scales, held
        aside (``_fp8fx_shard_parts``) until the last shard makes them the layer's parameters: until then the layer
        is as unloaded as with the bf16 receive buffer."""
        n, k = layer._parameters["weight"].shape
        block = self.scheme.weight.block
        if getattr(layer, "_fp8fx_shard_parts", None) is None:
            device = layer._fp8fx_device if layer._fp8fx_device is not None else loaded.device
            q = torch.empty(n, k, dtype=quant.FP8_DTYPE, device=device)
            scale = torch.empty(quant.scale_shape((n, k), block), dtype=torch.float32, device=device)
            layer._fp8fx_shard_parts = (q, scale)
        q, scale = layer._fp8fx_shard_parts
        sizes = layer._fp8fx_partitions
        start, size = sum(sizes[:shard_id]), sizes[shard_id]
        # (cast to the layer's dtype first, as the copy into its bf16 receive buffer would)
        part = loaded.to(device=q.device, dtype=layer._fp8fx_dtype)
        _, part_scale = chunked.quantize(part, block, out=q.narrow(0, start, size))
        rows = 1 if isinstance(self.scheme.weight, PerRow) else self.scheme.weight.block_n
        scale.narrow(0, start // rows, part_scale.shape[0]).copy_(part_scale)
        layer._fp8fx_arrived.setdefault("weight", set()).add(shard_id)
        layer._fp8fx_copied += loaded.numel()
        if layer._fp8fx_copied >= n * k:
            del layer._fp8fx_shard_parts
            self._install(layer, q, scale)

    def _quantize_online(self, layer: nn.Module, weight: torch.Tensor) -> None:
        """bf16 ``weight`` (fully loaded) -> the layer's fp8 weight + scale; the bf16 tensor is dropped. The layer is
        changed only once both are made: a quantization that fails leaves it as it was."""
        q, scale = chunked.quantize(weight, self.scheme.weight.block)
        if isinstance(self.scheme.weight, PerTensor):
            scale = scale.reshape(1)
        self._install(layer, q, scale)

    @staticmethod
    def _install(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        """The quantized weight and its scale become the layer's parameters; the layer is an fp8 layer."""
        cls = fp8_class(type(layer))  # (first: nothing of the layer changes where it fails)
        layer._parameters["weight"] = nn.Parameter(q, requires_grad=False)
        scale_name = "weight_scale_inv" if layer._fp8fx_block_scales else "weight_scale"
        layer._parameters[scale_name] = nn.Parameter(scale, requires_grad=False)
        layer.__class__ = cls

    # -- finish ------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Runs once (idempotent): shard scales -> one scale, shard input scales -> their max."""
        name = created_by(layer, "Fp8LinearMethod")
        if layer._fp8fx_processed:
            return
        params = layer._parameters
        # a bias on meta, or one whose shards came through weight_loader in part (zeros where none came); one made
        # real otherwise (load_state_dict(assign=True)) is the caller's
        arrived = getattr(layer, "_fp8fx_bias_loaded", None) or set()
        bias = params.get("bias")
        # (a partition of no rows has no bias shard in a checkpoint, as no scale: passed by)
        missing = [i for i, width in enumerate(layer._fp8fx_partitions) if i not in arrived and width > 0]
        on_meta = isinstance(bias, torch.Tensor) and bias.is_meta
        if on_meta or arrived and "all" not in arrived and missing:
            why = ("the layer was built with its bias on the meta device" if on_meta else
                   f"shard(s) {sorted(arrived)} came through weight_loader, the others kept the bias's initial values")
            raise ValueError(f"{name}: bias shard(s) {missing} of output partitions {list(layer._fp8fx_partitions)} "
                             f"never loaded ({why}); load them through weight_loader(layer, 'bias', ...) before "
                             "process_weights_after_loading (the layer is as it was)")
        through = (f" through {type(self).__name__}.weight_loader (a copy into the parameter itself, vLLM's default "
                   "loader's, is not counted)")
        if params["weight"].dtype != quant.FP8_DTYPE:
            raise RuntimeError(
                f"{name}: weight received {layer._fp8fx_copied} of {params['weight'].numel()} elements; "
                f"load every shard{through} before process_weights_after_loading"
            )
        unloaded = torch.finfo(torch.float32).min
        if self.config.is_checkpoint_fp8_serialized and layer._fp8fx_copied < params["weight"].numel():
            raise ValueError(f"{name}: weight received {layer._fp8fx_copied} of {params['weight'].numel()} elements; "
                             f"load every shard{through} before process_weights_after_loading")
        # every check before any change (the weight's requantization ran before a missing input_scale was found:
        # the layer was left half-processed, and a scale loaded after it replaced every shard's)
        per_tensor = isinstance(self.scheme.weight, PerTensor)
        for scale_name in ("weight_scale", "weight_scale_inv", "input_scale"):
            if scale_name not in params:
                continue
            scales = params[scale_name].data
            if scale_name == "input_scale" or per_tensor:  # one per logical shard: named by shard
                values, widths = scales.reshape(-1).tolist(), list(layer._fp8fx_partitions)
                # (a partition of no rows has no tensor in a checkpoint: its placeholder is passed by, as vLLM's
                # requantization skips it, the scale's max above it)
                shards = [i for i, v in enumerate(values)
                          if v == unloaded and (len(widths) != len(values) or widths[i] > 0)]
                if shards:
                    raise ValueError(
                        f"{name}: {scale_name} was never loaded for shard(s) {shards} (of output partitions "
                        f"{list(layer._fp8fx_partitions)})"
                        + ("; static activations need one per layer: load it from the checkpoint or pass "
                           "input_scales= (see fp8fx.calibrate)" if scale_name == "input_scale" else
                           "; load it from the checkpoint")
                        + " (the layer is as it was)")
            else:  # every size: a [1, 1] per-channel scale (a one-row head) or one block is as unloaded as a long one
                missing = int((scales == unloaded).sum())
                if missing:
                    raise ValueError(f"{name}: {missing} of {scales.numel()} entries of {scale_name} "
                                     "were never loaded; load the checkpoint's scales with the weight")
            # weight_loader refuses a scale of 0, <0, NaN or Inf; one copied into the parameter itself (vLLM's
            # default loader) had made every output NaN or zero, silently
            # (the placeholder of a partition of no rows, passed by above, is no scale)
            scales = scales.float()
            why = quant.bad_scales(torch.where(scales == unloaded, 1.0, scales))
            if why:
                raise ValueError(f"{name}.{scale_name}: {why} (copied into the parameter, not through weight_loader, "
                                 "which refuses them): re-export the checkpoint (the layer is as it was)")
        # (load_checkpoint, load_state_dict and .half() refuse it too; load_checkpoint's own check names the entry)
        if layer._fp8fx_dtype == torch.float16 and not getattr(layer, RANGE_CHECKED, False):
            if per_tensor and params["weight_scale"].numel() > 1:  # each shard's rows under its own scale
                rows = torch.repeat_interleave(params["weight_scale"].data.float().reshape(-1),
                                               torch.tensor(layer._fp8fx_partitions)).reshape(-1, 1)
                found = _overflow(layer, torch.float16, {"weight": params["weight"], "weight_scale": rows},
                                  block=(1, -1))
            else:
                found = _overflow(layer, torch.float16, params)
            if found is not None:
                raise float16_range_error(name, *found)
        if per_tensor and params["weight_scale"].numel() > 1:
            q, s = quant.requantize_shards(params["weight"].data, list(params["weight_scale"].data),
                                           layer._fp8fx_partitions)
            params["weight"] = nn.Parameter(q, requires_grad=False)
            params["weight_scale"] = nn.Parameter(s, requires_grad=False)
        if "input_scale" in params:
            scales = params["input_scale"].data
            params["input_scale"] = nn.Parameter(quant.max_input_scale(list(scales)), requires_grad=False)
        pending = layer.__dict__.pop("_fp8fx_pending", None)
        if pending is not None:
            pending.remove()
        guard = layer.__dict__.pop("_fp8fx_loading_guard", None)
        if guard is not None and vars(layer).get("_apply") is guard:  # (fp8_apply's checks take over)
            del layer.__dict__["_apply"]
        layer._fp8fx_processed = True
