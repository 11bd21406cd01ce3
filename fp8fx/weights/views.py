"""The dequantized weight an fp8 layer shows in eager mode refuses in-place writes.

An fp8 layer's ``weight`` (an experts module's ``gate_up_proj`` / ``down_proj``) is a new tensor at each read, made
from the fp8 codes and their scales: a write into it changed that copy and was lost, silently. PEFT's
``merge_and_unload`` (``base_layer.weight.data += delta``) left an fp8 base model without its adapter (outputs 107%
off the adapted model's), ``nn.init`` calls did nothing. In eager mode the view is a ``Dequantized`` tensor, whose
``__torch_function__`` refuses an in-place op on it, on its ``.data`` (PEFT's idiom) or on a view of either (``w[0]``,
``w.t()``, ``w.T``, and ``w.contiguous()`` / ``w.to(its dtype)``, which return ``w`` itself: a write through one
changes the same copy), naming the tensor and the fix. Every other op runs as on a plain tensor and returns a tensor
of the caller's own to write into (torch's refusal of an operand of another dtype is raised again naming the weight
and the cast). ``w.numpy()`` / ``np.asarray(w)`` give a read-only array. ``set_`` (no torch function sees it) is not
caught: ``register_parametrization`` calls it on the view before it deletes the parameter, which is refused with its
own message (``fp8_delattr``).
Under ``torch.compile``, FX tracing and fake tensors the view stays a plain tensor: the linear pass finds the
dequantization in the graph and says there that a write into it does not persist.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

from fp8fx import quant
from fp8fx.lowerings import compat

log = logging.getLogger("fp8fx")

# in-place methods that change no value a read of the weight gives
_METADATA = frozenset({"requires_grad_", "share_memory_", "detach_"})


class Dequantized(torch.Tensor):
    """A dequantized fp8 weight, as a read of the layer's attribute gives it: a plain tensor but for refusing in-place
    writes into it, into its ``.data`` and into views of either (``_fp8fx_of``: what it is the weight of, for the
    message). Every other op returns a plain tensor: a tensor made from it (``detach()``, ``clone()``, ``w * 2``) is
    the caller's own, for writes that are meant for it (``detach()`` gives an unguarded ``Dequantized``, as
    ``nn.Parameter(w)`` needs its class kept)."""

    _fp8fx_of: Optional[str]

    def numpy(self, *, force: bool = False):
        """The array shares the copy's memory, and numpy's writes reach no torch function: it is read-only where the
        tensor is guarded (a write raises numpy's "assignment destination is read-only"); ``np.asarray(w)`` too."""
        array = super().numpy(force=force)
        if _guarded(self) and self.device.type == "cpu":  # (force=True of a GPU tensor: a copy of the caller's own)
            array.flags.writeable = False
        return array

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _reaches_guarded(args, kwargs):  # the caller's own (nn.Parameter(w)'s): a plain tensor, this class kept
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            # (nn.Parameter(t) detaches t and wants the class kept)
            return _named(out, None) if getattr(func, "__name__", "") == "detach" else out
        if _grad_asked(func, args, kwargs):
            raise RuntimeError(
                f"{args[0]._fp8fx_of} is dequantized from its fp8 codes and scales at each read, so asking it for "
                "gradients (requires_grad) would mark a copy and be lost: the layer would train nothing, silently. An "
                "fp8 layer's codes take no gradients; to train this layer, keep it in high precision (ignored_layers "
                "at quantize_), or train an adapter around it, or fp8fx.dequantize_(model) first")
        target = _written(func, args, kwargs)
        if target is not None:
            name = getattr(func, "__name__", str(func))
            op = {"__set__": "assigning .data", "__setitem__": "an indexed assignment"}.get(name, f"{name} in place")
            raise RuntimeError(
                f"{target._fp8fx_of} is dequantized from its fp8 codes and scales at each read, so {op} would change a "
                "copy and be lost: an fp8 layer takes no writes into its weight. Change the high-precision weights "
                "before quantize_ (merge an adapter into the bf16 model - fp8fx.dequantize_(model) gives one -, then "
                "quantize_ it), or load new fp8 codes and scales with load_state_dict / fp8fx.load_checkpoint")
        with torch._C.DisableTorchFunctionSubclass():
            if func in _PRINTED:  # printed as the plain tensor it is
                args = (args[0].as_subclass(torch.Tensor), *args[1:])
            try:
                out = func(*args, **kwargs)
            except RuntimeError as error:
                _name_dtype_mismatch(func, args, kwargs, error)
                raise
            if not (args and isinstance(args[0], Dequantized)):
                return out
            name = getattr(func, "__name__", "")
            if name != "detach" and _guarded(args[0]) and isinstance(out, (torch.Tensor, tuple, list)):
                out = _guard_views(out, args[0])
            if not isinstance(out, torch.Tensor):
                return out
            if name == "__get__" and _is_data(func) and _guarded(args[0]):  # layer.weight.data: the same copy,
                return _named(out, args[0]._fp8fx_of)  # guarded
            if name == "detach":  # the caller's own, of this class: nn.Parameter(w) detaches and wants it kept
                return _named(out.as_subclass(torch.Tensor), None)
            if out is args[0] and name not in _METADATA:  # a no-op that returned self (.float() of a float32 copy,
                # contiguous(), .to() its own dtype): the same copy, guarded as the weight is (a write into a real
                # layer's would change its parameter); an unguarded one (nn.Parameter(w)'s) stays the caller's, plain
                return out if _guarded(out) else out.as_subclass(torch.Tensor)
            return out

    def __deepcopy__(self, memo):  # a plain copy (torch's deep copy of a subclass asks for new_empty); a parameter
        # made of one (nn.Parameter(layer.weight)) a plain parameter, a leaf as the original is
        with torch._C.DisableTorchFunctionSubclass():
            copied = self.as_subclass(torch.Tensor).detach().clone()
        copied = torch.nn.Parameter(copied, self.requires_grad) if getattr(self, "_is_param", False) else copied
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):  # pickled (torch.save) as a plain tensor, which weights_only loads take
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


_PRINTED = (torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__str__)


def _name_dtype_mismatch(func, args: tuple, kwargs: dict, error: RuntimeError) -> None:
    """Raises ``error`` again naming the weight, when it is torch's refusal of operands of two dtypes (``F.linear`` of
    a float32 input on a bf16 layer: "expected m1 and m2 to have the same dtype") and a tensor of another floating
    dtype than the weight's is among the operands, or a matmul's input is an integer or bool tensor. PEFT's
    ``prepare_model_for_kbit_training`` casts every bf16 / fp16 parameter but the fp8 codes to float32, and the first
    fp8 layer then failed with torch's unnamed message."""
    if not re.search(r"dtype|scalar type", str(error)):
        return
    tensors = [t for t in _operands(args, kwargs) if isinstance(t, torch.Tensor)]
    weight = next((t for t in tensors if _guarded(t)), None)
    if weight is None:
        return
    other = next((t for t in tensors if t.is_floating_point() and t.dtype != weight.dtype), None)
    if other is None and getattr(func, "__name__", "") in _MATMULS:
        # an integer / bool input (token ids where activations belong) got torch's bare message: the matrix operand of
        # a matmul (F.linear's first, Conv1D's addmm's second); an integer operand of another op (an embedding's
        # indices, grouped_mm's offsets) is that op's to refuse as torch does
        other = next((t for t in tensors if not _guarded(t) and not t.is_floating_point() and not t.is_complex()),
                     None)
    if other is None:
        return
    raise RuntimeError(
        f"{weight._fp8fx_of} is {weight.dtype} (the fp8 layer's weight, dequantized to the dtype the layer computes "
        f"in) and {getattr(func, '__name__', func)} got a {other.dtype} tensor with it ({error}): an fp8 layer computes "
        f"in the dtype its model was quantized in or last cast to. {dtype_fix(other.dtype, weight.dtype)}. (PEFT's "
        "prepare_model_for_kbit_training casts every bf16 / fp16 parameter but the fp8 codes to float32: call "
        "model.to(torch.float32) after it, or leave it out)") from error


_MATMULS = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "addbmm", "__matmul__", "__rmatmul__"})


def dtype_fix(given: torch.dtype, weight: torch.dtype) -> str:
    """The fix for an fp8 layer computing in ``weight`` given an input of ``given`` (eager here, the linear pass's
    compile-time refusal): a cast of the model as a whole where ``given`` is a dtype fp8 layers compute in
    (``quant.COMPUTE_DTYPES``: bf16/fp16/fp32, float64 as the reference), else a cast of the input. A float8 input
    (fp8 codes passed where an activation belongs) was told ``model.to(torch.float8_e4m3fn)``, a cast quantize_'s
    model refuses (``fp8fx.weights.linear``), and an integer one would have been told ``model.to(torch.int64)``."""
    if given in quant.COMPUTE_DTYPES:
        return (f"Cast the model as a whole - model.to({given}) makes its fp8 layers compute in {given}, their codes "
                f"and scales kept - or the input to {weight}")
    return (f"{given} is no dtype an fp8 layer computes in (bf16/fp16/fp32, or float64 as a reference): cast the "
            f"input to {weight}, or to another of those with the model cast to it (model.to(torch.float32))")


def dequantized(w: torch.Tensor, owner: torch.nn.Module, attr: str) -> torch.Tensor:
    """``w`` (a fresh dequantization) as the tensor a read of ``owner.<attr>`` gives: a ``Dequantized`` one in eager
    mode, ``w`` itself under torch.compile (nothing here is traced: a name read from the module would be a constant
    Dynamo guards on, and a frame compiled for one block would be compiled again for the next), FX tracing, or for a
    tensor of another class (fake, functional, batched ones of a tracer)."""
    if torch.compiler.is_compiling():  # (before anything reads the module: see above)
        return w
    name = f"{getattr(owner, '_fp8fx_prefix', '') or type(owner).__name__}.{attr}"
    tracing = compat.fx_symbolic_tracing()
    if tracing and type(w) is torch.Tensor and not compat.proxy_tracing():
        _warn_fx_constant(name)
    if type(w) is not torch.Tensor or tracing:
        return w
    return _named(w, name)


_FX_CONSTANT_WARNED: set[str] = set()  # the weights the warning below named, once each a process


def _warn_fx_constant(name: str) -> None:
    """torch.fx's symbolic tracing read an fp8 weight: the dequantization ran on real tensors, and where the traced
    code passes the result to an op (``F.linear(x, layer.weight)``, or the forward of a layer FX traces into: an
    experts module, a subclass of nn.Linear defined outside torch) the graph holds it as a constant, a
    high-precision copy that does not follow the fp8 codes (a load_state_dict of the model misses it) and that
    fp8fx's backend cannot rewrite. A read of its dtype or shape alone leaves none: the warning says "where"."""
    if name in _FX_CONSTANT_WARNED:
        return
    _FX_CONSTANT_WARNED.add(name)
    log.warning("fp8fx: torch.fx symbolic tracing read %s, an fp8 weight dequantized at each read: where the traced "
                "code passes it to an op (F.linear(x, layer.weight), or the forward of a layer FX traces into: "
                "experts, an nn.Linear subclass of your own), the graph holds its dequantized values as a constant "
                "(no fp8, not following the layer's codes); torch.compile and torch.export trace the "
                "dequantization instead (said once for this weight)", name)


def _guard_views(out, w: Dequantized):
    """``out`` (an op's result on the guarded ``w``) with each tensor that is a view of ``w``'s values (``w[0]``,
    ``w.t()``, ``w.T``, ``w.view(...)``, ``w.unbind(0)``'s) guarded as ``w`` is: a write through it changed the same
    copy and was lost, silently (``layer.weight[0].zero_()``)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_guard_views(t, w) for t in out) if any(isinstance(t, torch.Tensor) for t in out) else out
    if not isinstance(out, torch.Tensor) or out is w or not out._is_view():
        return out
    return _named(out, w._fp8fx_of) if out._base is (w._base if w._is_view() else w) else out


def _named(w: torch.Tensor, of: Optional[str]) -> Dequantized:
    view = w.as_subclass(Dequantized)
    view._fp8fx_of = of
    return view


def _written(func, args: tuple, kwargs: dict) -> Optional[Dequantized]:
    """The guarded ``Dequantized`` tensor ``func`` writes into, else None."""
    out = kwargs.get("out")
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if _guarded(t):
            return t
    name = getattr(func, "__name__", "").partition(".")[0]  # (an OpOverload's: "mul_.Tensor")
    if name == "__set__":  # a property's setter: only .data = ... changes the values
        return args[0] if _is_data(func) and _guarded(args[0]) else None
    in_place = name == "__setitem__" or name.endswith("_") and not name.endswith("__") or kwargs.get("inplace") is True
    if not in_place or name in _METADATA:
        return None
    # self of a method, the tensor list of torch._foreach_add_ and the like, nn.init's tensor= (its functions pass
    # their tensor by keyword), F.relu(w, inplace=True)'s input
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    for t in first if isinstance(first, (tuple, list)) else (first,):
        if _guarded(t):
            return t
    return None


def _grad_asked(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` asks a guarded weight read (``layer.weight``) that takes no gradients for them:
    ``requires_grad_()`` / ``requires_grad_(True)``, ``w.requires_grad = True`` (the flag landed on the copy and was
    lost, with no word: "unfreezing" an fp8 lm_head trained nothing, h157). A read that has gradients (of scales that
    take them) is left alone, as is asking for none."""
    w = args[0] if args else None
    if not _guarded(w):
        return False
    with torch._C.DisableTorchFunctionSubclass():  # (a read of the flag here came back to this class: recursion)
        if w.requires_grad:
            return False
    if getattr(func, "__name__", "") == "requires_grad_":
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return getattr(func, "__self__", None) is torch.Tensor.requires_grad and len(args) > 1 and bool(args[1])


def _operands(args: tuple, kwargs: dict):
    """``args`` and ``kwargs``' values, those in a list there one by one (``torch._foreach_*``'s)."""
    for a in (*args, *kwargs.values()):
        yield from a if isinstance(a, (tuple, list)) else (a,)


def _reaches_guarded(args: tuple, kwargs: dict) -> bool:
    """A guarded tensor (``_guarded``) is among ``args`` / ``kwargs`` (or in a list there: ``torch._foreach_*``)."""
    return any(_guarded(t) for t in _operands(args, kwargs))


def _is_data(func) -> bool:
    """``func`` is the getter or the setter of ``Tensor.data`` (a new method-wrapper at each access)."""
    return getattr(func, "__self__", None) is torch._C.TensorBase.data


def _guarded(t: Any) -> bool:
    """``t`` is a layer's weight as its attribute gave it, or that tensor's ``.data``. (A ``Dequantized`` that torch
    made without ``_named``, as ``nn.Parameter`` of one may, is the caller's own.)"""
    return isinstance(t, Dequantized) and getattr(t, "_fp8fx_of", None) is not None
