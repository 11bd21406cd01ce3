"""``save_pretrained`` of a transformers model that fp8fx quantized writes a ``quantization_config`` that describes its
files, so its readers load them right, or refuse them.

``save_pretrained`` writes ``model.state_dict()``: an fp8fx layer's fp8 codes under ``weight`` and its float32
``weight_scale`` / ``weight_scale_inv`` / ``input_scale``, with the model's own ``config.json``. With no
``quantization_config`` in it, ``from_pretrained`` took the codes as bf16 weights, unscaled, and warned only of
unexpected keys: logits thousands of times off. Where those files are what ``save_checkpoint`` writes (a dense
model: the tensors have the checkpoint's names), the config describes them, in the format transformers reads them in
(``fp8`` for 128x128-style blocks, ``compressed-tensors`` otherwise: transformers' ``fp8`` loader takes block scales
only); ``from_pretrained``, vLLM and ``fp8fx.load_checkpoint`` load them. Where they are not (experts, which
transformers' ``save_pretrained`` writes per expert while their scales keep fp8fx's fused names; block scales that
compressed-tensors names ``weight_scale``; layers written in high precision), it is a config every reader refuses,
saying why and to save with ``fp8fx.save_checkpoint``.

The config is computed at each ``save_pretrained`` call, from the model as it is then, and set on
``model.config`` for that call only.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from fp8fx import quant
from fp8fx.checkpoint.load import _looks_like_scale
from fp8fx.checkpoint.save import _planned, _unwrapped, ragged_blocks, untied_embeddings
from fp8fx.weights.linear import ModelHeld

log = logging.getLogger("fp8fx")


# where the plan's notes on what save_checkpoint would write go: nowhere (they are for its own saves). A logger of
# its own, outside logging's registry: nothing global is configured
_QUIET = logging.Logger("fp8fx.quiet")
_QUIET.disabled = True
# save_pretrained calls set and restore a config's quantization_config: one at a time (two models may share a config)
_SAVING = threading.RLock()


class SavePretrained(ModelHeld):
    """``model.save_pretrained`` as ``describe`` sets it (an attribute of the instance; the class is left as it is):
    transformers' own, with ``model.config.quantization_config`` set for the call to what it writes
    (``quantization_config``, from the model as it is then: a calibrated ``input_scale`` or a KV-cache scale attached
    after ``quantize_`` is in it) and put back after it, one call at a time. The config object is not changed
    otherwise: a config shared with another model (``from_config(cfg)`` twice) describes no model it was not saved
    with. The model is held as ``ModelHeld`` holds it. A ``copy.copy`` of the model shares the original's (it shares
    its ``__dict__``'s values) and saves the original: copy with deepcopy."""

    __slots__ = ()
    what = "save_pretrained"

    def __call__(self, *args, **kwargs):
        model = self.held()
        if not any(t.dtype == quant.FP8_DTYPE for t in (*model.parameters(), *model.buffers())):
            # (nothing fp8 left: a part dequantized since - model.model.dequantize() -, whose parent kept this: a
            # plain save, where it wrote a config every reader refuses)
            return type(model).save_pretrained(model, *args, **kwargs)
        with _SAVING:
            config = model.config
            missing = object()
            before = vars(config).get("quantization_config", missing)
            config.quantization_config = quantization_config(model)
            # an lm_head quantized on its own (the README's untying) under a config that says tied: written tied,
            # the files' fp8 lm_head was refused by load_checkpoint, and transformers and vLLM tie it again
            tied = [c for c in (config, getattr(config, "text_config", None))
                    if c is not None and getattr(c, "tie_word_embeddings", None) is True] if untied_embeddings(
                model) else []
            if tied:
                log.warning("fp8fx: save_pretrained writes tie_word_embeddings: false: the model's output embeddings "
                            "are not its input embeddings (an lm_head quantized on its own is untied), though its "
                            "config says they are tied (the model's config is unchanged)")
            try:
                for c in tied:
                    c.tie_word_embeddings = False
                return type(model).save_pretrained(model, *args, **kwargs)
            finally:
                for c in tied:
                    c.tie_word_embeddings = True
                if before is missing:
                    del config.quantization_config
                else:
                    config.quantization_config = before


class Dequantize(ModelHeld):
    """``model.dequantize(dtype=None)`` as ``describe`` sets it: ``fp8fx.dequantize_`` of the model, then a cast to
    ``dtype`` if given, returning the model, as transformers' own does (which said "You need to first quantize your
    model in order to dequantize it" of a model fp8fx quantized)."""

    __slots__ = ()
    what = "dequantize"

    def __call__(self, dtype: Optional[torch.dtype] = None):
        from fp8fx.weights.dequantize import dequantize_

        # (checked before dequantize_ changes the model: an 8-bit float, which a floating-point test let through,
        # dequantized every layer and then cast the whole model to fp8, norms and embeddings too)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                                      and dtype.itemsize >= 2):
            raise TypeError(f"dequantize(dtype={dtype!r}): a 16- or 32-bit floating-point torch.dtype (torch.bfloat16, "
                            "torch.float16, torch.float32), the high precision the weights come back in (nothing was "
                            "changed)")
        model = dequantize_(self.held())
        return model.to(dtype) if dtype is not None else model


def describe(model: nn.Module) -> None:
    """Has the ``save_pretrained`` of ``model`` and of each transformers model inside it (a base model, a VLM's
    language model: its own ``save_pretrained`` writes its own files) write a ``quantization_config`` that describes its
    files (``SavePretrained``), and its ``dequantize()`` give its high-precision weights back (``Dequantize``), where it
    holds fp8 tensors; leaves any other module as it is."""
    for m in model.modules():
        if not (callable(getattr(type(m), "save_pretrained", None)) and callable(getattr(getattr(m, "config", None),
                                                                                         "to_dict", None))):
            continue
        if not isinstance(vars(m).get("save_pretrained"), SavePretrained) and any(
                t.dtype == quant.FP8_DTYPE for t in (*m.parameters(), *m.buffers())):
            m.save_pretrained = SavePretrained(m)
            if callable(getattr(type(m), "dequantize", None)):
                m.dequantize = Dequantize(m)


def quantization_config(model: nn.Module) -> dict[str, Any]:
    """The quantization_config of the files ``save_pretrained`` writes of ``model``: save_checkpoint's, in the format
    transformers reads it in, where save_checkpoint would write the same fp8 tensors and scales under the same names;
    else one every reader refuses (``_refused``)."""
    try:
        try:
            planned = _planned(model, "fp8", None, check_values=False, say=_QUIET)
            if not planned[-1].get("weight_block_size"):  # per-tensor fp8: transformers' fp8 loader takes blocks only
                raise ValueError("per-tensor")
        except ValueError:  # several schemes (or per-tensor weights): compressed-tensors describes any mix
            planned = _planned(model, "compressed-tensors", None, check_values=False, say=_QUIET)
    except ValueError as e:  # save_checkpoint refuses the model too: its fix, not save_checkpoint's files
        return _refused(str(e), refused_by_save_checkpoint=True)
    model, modules, schemes, tensors, qc = planned
    ragged = ragged_blocks(modules, schemes) if qc.get("weight_block_size") else []
    if ragged:  # (its compressed-tensors loader refuses such a layer itself)
        return _refused(f"{ragged[0]}: transformers' fp8 loader takes the block size from the scale grid, and "
                        "refuses a layer its blocks do not divide or misreads it")
    other = _not_as_state_dict(model, tensors)
    return _refused(other) if other else qc


def _not_as_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> str:
    """Why the tensors ``save_checkpoint`` writes (``tensors``) are not ``model.state_dict()`` under its names, the
    files ``save_pretrained`` writes; "" where they are. Said of the model's state_dict, which save_pretrained writes
    renamed only as transformers renames its own weights (which ones depends on its version: 5.25 writes fused
    experts per expert beside fp8fx's fused scale names, 5.17 per-expert scale names too): a scale of the state_dict
    that save_checkpoint names otherwise first, then a tensor of save_checkpoint's the state_dict lacks or holds
    otherwise."""

    def key(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr() if not t.is_meta else id(t), t.storage_offset(), tuple(t.shape), t.dtype)

    state = {_unwrapped(n): t for n, t in model.state_dict().items()}
    written = {key(t) for t in tensors.values()}
    unread = [n for n, t in state.items()
              if (t.dtype == quant.FP8_DTYPE or _looks_like_scale(n)) and n not in tensors and key(t) not in written]
    scale = next((n for n in unread if _looks_like_scale(n)), None)
    if scale is not None:
        return (f"the model's state_dict, which save_pretrained writes, holds {scale}, which fp8fx.save_checkpoint and "
                "the readers name otherwise (experts written per expert beside their fused scales, or a scale "
                "under another name than the format's)")
    for name, t in tensors.items():
        held = state.get(name)
        if held is None and t.dtype != quant.FP8_DTYPE and not _looks_like_scale(name):
            continue  # a high-precision tensor renamed (bf16 experts per expert): transformers renames it as well
        if held is None:
            return (f"fp8fx.save_checkpoint writes {name}, which the model's state_dict (what save_pretrained writes, "
                    "renamed only where transformers renames its own weights) has not")
        if key(held) != key(t):
            return (f"the model's state_dict, which save_pretrained writes, holds {name} as {held.dtype} "
                    f"{list(held.shape)}, fp8fx.save_checkpoint writes it as {t.dtype} {list(t.shape)}")
    if unread:
        return (f"the model's state_dict, which save_pretrained writes, holds {unread[0]}, which "
                "fp8fx.save_checkpoint names otherwise or leaves out")
    return ""


def _refused(why: str, refused_by_save_checkpoint: bool = False) -> dict[str, Any]:
    """A quantization_config every reader refuses, saying ``why`` and the fix: an ``activation_scheme`` no fp8 reader
    takes (transformers, vLLM and fp8fx name the value in their error). ``refused_by_save_checkpoint``: ``why`` is
    save_checkpoint's refusal of the model (half-quantized, cast to float64, ...), worded for a call that wrote
    nothing: said as what save_checkpoint refuses, where save_pretrained has written the files, and its fix is the
    one to follow (saving with save_checkpoint instead is refused the same)."""
    if refused_by_save_checkpoint:
        why = re.sub(r" \(nothing was (?:written|done)\)$", "", re.sub(r"^save_checkpoint(?:\([^)]*\))?: ", "", why))
        reason = (f"not loadable: this checkpoint was written by save_pretrained of a model fp8fx quantized, which "
                  f"fp8fx.save_checkpoint refuses as well ({why}); fix the model as that says, then save it again")
    else:
        reason = (f"not loadable: this checkpoint was written by save_pretrained of a model fp8fx quantized, and its "
                  f"files are not what a checkpoint reader loads ({why}); save the model with "
                  "fp8fx.save_checkpoint(model, path) instead")
    return {"quant_method": "fp8", "activation_scheme": reason, "fp8fx_not_loadable": reason}
