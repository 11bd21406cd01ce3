"""KV-cache scales: ``k_scale`` / ``v_scale`` (and ``q_scale`` / ``prob_scale``) of attention modules.

Checkpoints name them two ways:

- on the attention module: ``model.layers.0.self_attn.k_scale`` (compressed-tensors, llm-compressor) or
  ``model.layers.0.self_attn.attn.k_scale`` (vLLM, whose ``Attention`` is a child ``attn``);
- as output scales of the projections: ``model.layers.0.self_attn.k_proj.output_scale`` (AutoFP8),
  mapped by ``Fp8Config.get_cache_scale``.

The attention module is the one that holds the KV cache (``kv_cache_attentions``), under the model's own names:
a BERT-style model used as a decoder (``is_decoder=True``) has its scales on ``BertSelfAttention``, saved as
``bert.encoder.layer.0.attention.self.k_scale``, not on the ``BertAttention`` around it. That is the name of the
module that reads the cache (a naming convention, not a defect: vLLM's would be its ``Attention`` child,
``attention.self.attn.k_scale``, which its KV-scale remapping reaches from this name, and fp8fx reads either:
``attention_owner``); ``load_checkpoint`` puts them back where ``save_checkpoint`` took them.

A scale is one positive finite float (``q_fp8 = k / k_scale``). It is attached to the attention module
as a float32 buffer of shape ``[]`` under its name, so ``state_dict()`` saves it where other engines
look for it; model code does not read it (the eager attention keeps computing in high precision).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from fp8fx.config import Fp8Config

log = logging.getLogger("fp8fx")

KV_SCALE_NAMES = ("k_scale", "v_scale", "q_scale", "prob_scale")
# Absent ones take the layer's other one, or 1.0 without either, when the checkpoint quantizes the KV cache
# (as vLLM does, with a warning).
DEFAULTED = ("k_scale", "v_scale")


# KV-cache scales stored under the projection that makes the cached tensor (ModelOpt), which vLLM remaps to
# the attention: the separate k / v projections and a fused qkv one
_PROJECTION_KV_SCALES = {("k_proj", "k_scale"), ("v_proj", "v_scale"), ("qkv_proj", "k_scale"), ("qkv_proj", "v_scale")}


def kv_scale_target(name: str) -> Optional[tuple[str, str]]:
    """Checkpoint tensor name -> ``(owner path, scale name)`` if it is a KV-cache scale in either
    naming, else None. The owner may end in ``.attn`` (vLLM's naming): see ``attention_owner``."""
    mapped = Fp8Config.get_cache_scale(name) or name
    owner, _, leaf = mapped.rpartition(".")
    if leaf == "kv_scale":  # the deprecated single KV scale: vLLM reads it as the attention's k_scale (v_scale
        # then follows it), never a projection's: k_proj.kv_scale addresses k_proj (no place: vLLM drops it)
        return (owner, "k_scale") if owner else None
    parent, _, proj = owner.rpartition(".")
    if parent and (proj, leaf) in _PROJECTION_KV_SCALES:
        owner = f"{parent}.attn"  # ModelOpt's k_proj.k_scale / v_proj.v_scale: the attention's (as vLLM remaps)
    return (owner, leaf) if owner and leaf in KV_SCALE_NAMES else None


def attention_owner(owner: str, modules: Mapping[str, nn.Module]) -> Optional[str]:
    """The attention module of ``modules`` that holds a scale addressed to ``owner``: ``owner`` itself, or its
    parent when ``owner`` is vLLM's ``<attention>.attn`` and the model has no such child; None where that is not an
    attention module (``is_attention``). A scale left addressed to a projection (v_proj.kv_scale, k_proj.v_scale:
    no remapping covers them), an MLP, a decoder layer or an embedding would give that module a KV-cache scale no
    attention reads (vLLM drops such tensors with a warning); the loader refuses them as scales with no place."""
    if owner.endswith(".attn") and owner not in modules:
        owner = owner[: -len(".attn")]
    return owner if owner in modules and is_attention(modules[owner]) else None


def check_kv_scale_layout(name: str, shape, dtype: torch.dtype) -> None:
    """ValueError naming ``name`` unless a tensor of ``shape`` and ``dtype`` can be a KV-cache scale (one float):
    what the loader checks from a checkpoint's header, before it reads any tensor."""
    if math.prod(shape) != 1:
        raise ValueError(
            f"{name}: a KV-cache scale is one value, got shape {list(shape)}; the checkpoint must hold "
            "one scale per attention layer (per-head KV scales are not supported)"
        )
    if not dtype.is_floating_point or dtype.itemsize < 2:  # (an 8-bit float one was taken, rounded: 4.7% off)
        raise ValueError(f"{name}: dtype {dtype} is not a float of 16 bits or more; KV-cache scales are "
                         "float32/bf16/fp16")


def check_kv_scale(name: str, value: torch.Tensor) -> float:
    """The scale as a float; ValueError naming ``name`` unless it is one positive finite float."""
    check_kv_scale_layout(name, value.shape, value.dtype)
    scale = value.float().item()
    # a subnormal float32 (1e-40) is positive, but 1 / scale, what the KV cache is quantized with, is inf
    if not (math.isfinite(scale) and scale >= torch.finfo(torch.float32).tiny):
        raise ValueError(
            f"{name}={scale}: a KV-cache scale must be a positive finite float32 of normal range (at least "
            f"{torch.finfo(torch.float32).tiny:g}: 1 / scale is taken); fix or drop the tensor "
            "(an absent k_scale / v_scale takes the layer's other one, or 1.0)"
        )
    return scale


def kv_slot_error(module: nn.Module, fqn: str, name: str, default: bool = False) -> Optional[str]:
    """Why the KV-cache scale ``name`` cannot be attached to ``module`` (at ``fqn``) as a buffer, or None: not a
    KV-cache scale name; an attribute of that name that is not a buffer (a float, a parameter, a submodule), which
    ``register_buffer`` refuses; or a buffer of the model's own that its forward computes with (Gemma3n's audio
    attention scales its queries by a non-persistent ``q_scale``): a checkpoint tensor would replace it unseen. A
    persistent buffer of its own is part of the model's state, which a checkpoint tensor loads as any other, but a
    ``default`` (a scale the checkpoint does not hold) never replaces it. Buffers fp8fx attached
    (``attach_kv_scales``) are free."""
    where = f"{fqn}.{name}" if fqn else name
    if name not in KV_SCALE_NAMES:
        return f"{where}: {name!r} is not a KV-cache scale; use one of {KV_SCALE_NAMES}"
    if name not in module._buffers and hasattr(module, name):
        return (
            f"{where}: {type(module).__name__} already has an attribute {name!r} "
            f"({type(getattr(module, name)).__name__}) that is not a buffer, so the KV-cache scale cannot be "
            f"attached there; rename that attribute in the model, or drop the {name} tensors from the checkpoint"
        )
    own = name in module._buffers and name not in module.__dict__.get("_fp8fx_kv_scales", ())
    if own and (default or name in module._non_persistent_buffers_set):
        return (
            f"{where}: {type(module).__name__} already has a buffer {name!r} of its own"
            f"{' (not in its state_dict)' if name in module._non_persistent_buffers_set else ''}, which its forward "
            f"computes with, so the KV-cache scale cannot replace it; rename that buffer in the model, or drop the "
            f"{name} tensors from the checkpoint"
        )
    return None


def complete_kv_scales(scales: dict[str, float], free: Callable[[str], bool],
                       neither: Optional[float]) -> tuple[list[str], list[str]]:
    """Fill the ``DEFAULTED`` scales ``scales`` lacks, in place: one of k_scale / v_scale present serves the other (as
    vLLM's BaseKVCacheMethod lets a k_scale or legacy kv_scale alone serve v_scale; a v_scale alone, which its assert
    refuses, serves k_scale so too); neither: ``neither``, or nothing where it is None. A name ``free`` refuses (the
    model uses it for an attribute of its own) is left out. Returns (the names filled, each ``"name"`` or
    ``"name=source"``; the names left out)."""
    present = [name for name in DEFAULTED if name in scales]
    filled, taken = [], []
    for name in DEFAULTED:
        if name in scales or not present and neither is None:
            continue
        if not free(name):
            taken.append(name)
            continue
        scales[name] = scales[present[0]] if present else neither
        filled.append(name + (f"={present[0]}" if present else ""))
    return filled, taken


def attach_kv_scales(module: nn.Module, scales: Mapping[str, float], device=None) -> None:
    """Register ``scales`` (``{"k_scale": 0.02, ...}``) on ``module`` as float32 ``[]`` buffers: all of them, or
    (ValueError, see ``kv_slot_error``; an allocation's out-of-memory error) none. The names are kept on the module,
    so they stay fp8fx's. ``make_kv_scales`` then ``assign_kv_scales``, which a caller that must not fail partway
    (``load_checkpoint``'s commit) calls apart: the tensors made first, while a failure changes nothing."""
    assign_kv_scales(module, make_kv_scales(module, scales, device))


def kv_scale_tensor(value: float, device=None) -> torch.Tensor:
    """One KV-cache scale as the float32 ``[]`` tensor it is attached as: a new tensor on ``device`` (on a GPU, an
    allocation, which can run out of memory)."""
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def make_kv_scales(module: nn.Module, scales: Mapping[str, float], device=None,
                   fqn: str = "") -> dict[str, torch.Tensor]:
    """What ``attach_kv_scales`` registers, made and checked without changing ``module``: ``{name: tensor}``
    (``kv_scale_tensor``). ValueError (``kv_slot_error``, naming ``fqn.name``) for a name the module cannot take; an
    out-of-memory error from the allocation. ``assign_kv_scales`` then registers them, which cannot fail."""
    for name in scales:
        why = kv_slot_error(module, fqn, name)
        if why is not None:
            raise ValueError(why)
    return {name: kv_scale_tensor(value, device) for name, value in scales.items()}


def assign_kv_scales(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Register ``make_kv_scales``'s ``tensors`` on ``module`` as buffers, with the pre-hook that refuses bad scales
    at ``load_state_dict`` (once a module), and record their names as fp8fx's. Nothing here allocates a tensor or
    fails: the names were checked free when they were made (nothing may take them between the two calls)."""
    for name, tensor in tensors.items():
        module.register_buffer(name, tensor)
    if "_fp8fx_kv_scales" not in module.__dict__:  # (once a module)
        module.register_load_state_dict_pre_hook(refuse_bad_kv_scales)
    module._fp8fx_kv_scales = frozenset(module.__dict__.get("_fp8fx_kv_scales", ())) | set(tensors)


def held_kv_scales(module: nn.Module) -> frozenset:
    """The names of the KV-cache scales ``attach_kv_scales`` gave ``module`` (none of the model's own buffers)."""
    return frozenset(module.__dict__.get("_fp8fx_kv_scales", ()))


def refuse_bad_kv_scales(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook of a module ``attach_kv_scales`` gave scales: a KV-cache scale that is not one
    positive finite float (``check_kv_scale``, as ``load_checkpoint`` refuses it) is refused, naming it, and the
    module keeps its own (loaded, a NaN ``k_scale`` made the attention's outputs NaN, silently). ``state_dict`` is
    the copy ``load_state_dict`` makes: the module's own value stands in for the refused one there."""
    assign = isinstance(local_metadata, Mapping) and local_metadata.get("assign_to_params_buffers", False)
    for name, why in kv_scale_refusals(module, state_dict, prefix, assign):
        error_msgs.append(f"{why} (this scale was not loaded)")
        state_dict[prefix + name] = module._buffers[name]


def kv_scale_refusals(module: nn.Module, state_dict, prefix: str, assign: bool = False) -> list[tuple[str, str]]:
    """(name, why) for each KV-cache scale ``attach_kv_scales`` gave ``module`` whose entry of ``state_dict`` (under
    ``prefix``) is not one positive finite float (``check_kv_scale``), or, loaded with ``assign=True`` (which puts the
    tensor in as it is), not float32 (a bf16 scale became the attention's, rounded, and was saved so: h154); a meta
    entry is left to torch."""
    refusals = []
    for name in sorted(held_kv_scales(module)):
        given = state_dict.get(prefix + name)
        if isinstance(given, torch.Tensor) and not given.is_meta and module._buffers.get(name) is not None:
            try:
                check_kv_scale(prefix + name, given.detach())
            except ValueError as e:
                refusals.append((name, str(e)))
                continue
            if assign and given.dtype != torch.float32:
                refusals.append((name, f"{prefix}{name}: a {given.dtype} KV-cache scale, where fp8fx's are "
                                       "torch.float32; load_state_dict(assign=True) puts it in as it is: cast the "
                                       "state_dict's scales back (.to(torch.float32)), or load without assign=True, "
                                       "which copies them into the attention's float32 scales"))
    return refusals


def kv_scales(module: nn.Module) -> dict[str, float]:
    """The KV-cache scales attached to ``module``."""
    return {n: module._buffers[n].item() for n in KV_SCALE_NAMES if module._buffers.get(n) is not None}


def is_attention(module: nn.Module) -> bool:
    """Attention modules by class name (``LlamaAttention``, ``DeepseekV3Attention``, ...)."""
    return type(module).__name__.endswith("Attention")


def outermost_attentions(modules: Mapping[str, nn.Module]) -> list[str]:
    """The attention modules of ``modules`` (``{fqn: module}``) that are not inside another one: BERT's
    ``BertAttention`` and not the ``BertSelfAttention`` it holds, which would get KV-cache scales of its own."""
    found = [fqn for fqn, m in modules.items() if is_attention(m)]
    outer = set(found)
    return [fqn for fqn in found if not any(fqn.startswith(f"{o}.") for o in outer)]


def has_kv_cache_mark(module: nn.Module) -> bool:
    """Whether ``module`` carries transformers' mark of an attention that reads and writes the KV cache: a
    ``layer_idx`` (its slot in the ``Cache``), which decoder self- and cross-attentions have (``LlamaAttention``,
    ``MllamaTextCrossAttention``) and vision / audio encoder attentions do not (``CLIPAttention``, Qwen2-VL's
    ``VisionAttention``, ``MllamaVisionAttention``, ``SiglipAttention``)."""
    return getattr(module, "layer_idx", None) is not None


def kv_cache_attentions(modules: Mapping[str, nn.Module], model: Optional[nn.Module] = None) -> list[str]:
    """The attentions of ``modules`` that have a KV cache, which a declared fp8 KV cache gives scales (as vLLM gives
    ``Fp8KVCacheMethod`` to its ``Attention`` layers only, not to the cacheless ``MultiHeadAttention`` /
    ``MMEncoderAttention`` of vision towers): those inside the decoder ``model.get_decoder()`` returns where it is one
    of its modules (Gemma4's language model, whose vision and audio towers' attentions carry a ``layer_idx`` too;
    an encoder-decoder's decoder); of them, where some carry a ``layer_idx`` (``has_kv_cache_mark``: a transformers
    model), those, at any depth, the others being encoder attentions (a vision tower's) or wrappers of an attention
    (T5's ``T5LayerSelfAttention`` around the ``T5Attention`` that holds the cache: the outermost ones had been taken,
    the wrappers given scales of 1.0 beside the inner ones' loaded scales, h154); a model none of whose attentions
    carries one: all of them. Of an attention inside another, the outer one only (``outermost_attentions``)."""
    found = {fqn: m for fqn, m in modules.items() if is_attention(m)}
    decoder = getter_module(model, "get_decoder", modules)[1]
    if decoder:
        found = {fqn: m for fqn, m in found.items() if fqn.startswith(f"{decoder}.")}
    cached = {fqn: m for fqn, m in found.items() if has_kv_cache_mark(m)}
    return outermost_attentions(cached or found)


def related(fqn: str, others) -> bool:
    """Whether one of ``others`` is the module ``fqn``, inside it, or holds it."""
    return any(o == fqn or o.startswith(f"{fqn}.") or fqn.startswith(f"{o}.") for o in others)


def getter_module(model: Optional[nn.Module], method: str,
                  modules: Mapping[str, nn.Module]) -> tuple[Optional[nn.Module], Optional[str]]:
    """What a transformers getter of ``model`` (``get_decoder``, ``get_output_embeddings``) returns, and its name
    among ``modules`` ("" for the model itself): (None, None) where the model has no such method, the method raises
    (a model that has no such part may raise instead of returning None) or returns no module; (module, None) where
    the module is not among ``modules``."""
    get = getattr(model, method, None)
    try:
        found = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        return None, None
    if not isinstance(found, nn.Module):
        return None, None
    return found, next((fqn for fqn, m in modules.items() if m is found), None)
