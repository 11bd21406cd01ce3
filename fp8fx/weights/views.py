"""The dequantized weight an fp8 layer shows in eager mode refuses in-place writes.

An fp8 layer's ``weight`` (an experts module's ``gate_up_proj`` / ``down_proj``) is a new tensor at each read, made
from the fp8 codes and their scales: a write into it changed that copy and was lost, silently. PEFT's
``merge_and_unload`` (``base_layer.weight.data += delta``) left an fp8 base model without its adapter (outputs 107%
off the adapted model's), ``nn.init`` calls did nothing. In eager mode the view is a ``Dequantized`` tensor, whose
``__torch_function__`` refuses an in-place op on it, or on a view of it (``.data``, ``.t()``, indexing), naming the
tensor and the fix; every other op runs as on a plain tensor and returns plain tensors. Under ``torch.compile``,
FX tracing and fake tensors the view stays a plain tensor: the linear pass finds the dequantization in the graph and
says there that a write into it does not persist.
"""
from __future__ import annotations

from typing import Any

import torch

from fp8fx.lowerings import compat

# in-place methods that change no value a read of the weight gives
_METADATA = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


class Dequantized(torch.Tensor):
    """A dequantized fp8 weight: a plain tensor but for refusing in-place writes (``_fp8fx_of``: what it is the
    weight of, for the message)."""

    _fp8fx_of: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if isinstance(target, Dequantized):
            name = getattr(func, "__name__", str(func))
            op = {"__set__": "assigning .data", "__setitem__": "an indexed assignment"}.get(name, f"{name} in place")
            raise RuntimeError(
                f"{target._fp8fx_of} is dequantized from its fp8 codes and scales at each read, so {op} would change a "
                "copy and be lost: an fp8 layer takes no writes into its weight. Change the high-precision weights "
                "before quantize_ (merge an adapter into the bf16 model, then quantize_ it), or load new fp8 codes and "
                "scales with load_state_dict / fp8fx.load_checkpoint")
        with torch._C.DisableTorchFunctionSubclass():
            return _views_kept(func(*args, **kwargs), [a for a in args if isinstance(a, Dequantized)])


def dequantized(w: torch.Tensor, owner: torch.nn.Module, attr: str) -> torch.Tensor:
    """``w`` (a fresh dequantization) as the tensor a read of ``owner.<attr>`` gives: a ``Dequantized`` one in eager
    mode, ``w`` itself under torch.compile (nothing here is traced: a name read from the module would be a constant
    Dynamo guards on, and a frame compiled for one block would be compiled again for the next), FX tracing, or for a
    tensor of another class (fake, functional, batched ones of a tracer)."""
    if torch.compiler.is_compiling() or type(w) is not torch.Tensor or compat.fx_symbolic_tracing():
        return w
    return _named(w, f"{getattr(owner, '_fp8fx_prefix', '') or type(owner).__name__}.{attr}")


def _named(w: torch.Tensor, of: str) -> Dequantized:
    view = w.as_subclass(Dequantized)
    view._fp8fx_of = of
    return view


def _written(func, args: tuple, kwargs: dict) -> Any:
    """The tensor ``func`` writes into, where it is one of ours, else None."""
    out = kwargs.get("out")
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, Dequantized):
            return t
    name = getattr(func, "__name__", "")
    if name == "__set__":  # a property's setter: only .data = ... changes the values
        return args[0] if getattr(func, "__self__", None) is torch._C.TensorBase.data and args else None
    if not (name == "__setitem__" or name.endswith("_") and not name.endswith("__")) or name in _METADATA:
        return None
    # self of a method, the tensor list of torch._foreach_add_ and the like, nn.init's tensor= (its functions pass
    # their tensor by keyword)
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    for t in first if isinstance(first, (tuple, list)) else (first,):
        if isinstance(t, Dequantized):
            return t
    return None


def _views_kept(out: Any, ours: list) -> Any:
    """``out`` with each tensor that shares storage with one of ``ours`` (a view of it: ``.data``, ``.t()``, ``w[0]``,
    ``.detach()``) made a ``Dequantized`` one too; the others plain. (Runs with torch functions of subclasses off.)"""
    if not ours:
        return out
    if type(out) in (tuple, list):
        return type(out)(_views_kept(o, ours) for o in out)
    if type(out) is not torch.Tensor:
        return out
    try:
        ptr = out.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # a tensor with no storage of its own (vmap's batched tensors)
        return out
    owner = next((a for a in ours if ptr and a.untyped_storage().data_ptr() == ptr), None)
    return _named(out, owner._fp8fx_of) if owner is not None else out
