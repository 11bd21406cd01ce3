"""FP8 linear pass.

Matches (Dynamo torch IR), for every linear site::

    w = fp8fx.dequantize(wq, w_scale, w_block, dtype, input_scale, act_block)
    y = torch._C._nn.linear(x, w, bias)          # also matmul(x, w.t()) / x @ w.T / torch.mm(x, w.t()) /
                                                 # torch.addmm(bias, x, w.t()) and aten's forms of them

Rewrites to (dynamic activations)::

    xq, x_scale = fp8fx.quantize(x, act_block)      # once per x and scheme, shared by its consumers
    y = fp8fx.scaled_mm(xq, x_scale, wq, w_scale, bias, act_block, w_block, x.dtype, use_fast_accum)

or, with a static ``input_scale``, ``xq = fp8fx.quantize_static(x, input_scale)`` and a per-tensor
activation block; or, weight-only (GPUs without fp8 tensor cores, or forced)::

    y = fp8fx.weight_only_mm(x, wq, w_scale, bias, w_block)

The weight's dequantize (and transpose) go with the site when nothing else reads them. Linear sites
whose weight is not an fp8fx dequantized view are left as they are and reported with the reason
(tagged on the weight by ``quantize_``, else "not fp8").
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import operator
import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx import quant
from fp8fx.config import LayerScheme, granularity_from_block, weight_granularity_name
from fp8fx.kernels import launch
from fp8fx.lowerings import compat
from fp8fx.passes.base import Fp8Pass, PassContext, fake_value, input_path, may_record_grad, module_path, set_fake_value
from fp8fx.passes.base import bytes_saved, dequant_args
from fp8fx.report import NOT_QUANTIZED, ROOT, Site
from fp8fx.weights.linear import is_conv1d_class
from fp8fx.weights.views import dtype_fix

log = logging.getLogger("fp8fx")

# (aten's: a graph of torch.export's program, a model calling torch.ops.aten.linear)
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear, torch.ops.aten.linear.default)
# x @ w.T in its other spellings: torch.mm(x, w.t()), x.matmul(w.T), and aten's, which a torch.export program calls
# after ``run_decompositions()`` (``mm(view(x), permute(w, [1, 0]))``)
_MATMUL = (operator.matmul, torch.matmul, torch.mm, "matmul", "mm", "__matmul__", torch.ops.aten.matmul.default,
           torch.ops.aten.mm.default)
# addmm(bias, x, w.t()): nn.Linear's decomposition in a torch.export program, also torch.addmm and bias.addmm(..)
_ADDMM = (torch.addmm, "addmm", torch.ops.aten.addmm.default)
_DEQUANT = (torch.ops.fp8fx.dequantize, torch.ops.fp8fx.dequantize.default)
# a quantized model cast to float64 (``model.double()``) is the exact reference of its fp8 layers, on purpose
FLOAT64_REFERENCE = "activation dtype torch.float64: the float64 reference, computed with the dequantized weight"
_ACT_DTYPES = quant.HIGH_PRECISION


def _transposed(node) -> fx.Node | None:
    """``n`` if ``node`` is ``n.t()``, ``n.T``, ``n.mT``, ``n.adjoint()``, ``torch.t(n)``, a swap of a 2-D ``n``'s dims
    (``transpose``, ``swapaxes``, ``swapdims``, ``permute(1, 0)``) or of any ``n``'s last two, or aten's forms of them
    in a torch.export program (``aten.t``, ``aten.numpy_T``, ``aten.mT``, ``aten.transpose.int``, ``aten.permute``)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function") or not node.args:
        return None
    source = node.args[0]
    ndim = getattr(fake_value(source), "ndim", 2) if isinstance(source, fx.Node) else 2
    if node.target in _TRANSPOSES_ALL or node.target is getattr and node.args[1] in ("T", "mT"):
        return source
    if node.target in _SWAPS:
        dims = list(node.args[1:3]) + [node.kwargs.get(k) for k in ("dim0", "dim1", "axis0", "axis1")
                                       if k in node.kwargs]
        swapped = len(dims) == 2 and all(isinstance(d, int) for d in dims)
        if swapped and (sorted(dims) == [-2, -1] or ndim == 2 and sorted(d % 2 for d in dims) == [0, 1]):
            return source
    if node.target in _PERMUTES and ndim == 2:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = node.kwargs.get("dims", dims)
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]:
            return source
    return None


# ops that transpose a 2-D tensor (or the last two dims of any), and those that swap or permute the dims they are given
_TRANSPOSES_ALL = ("t", "adjoint", torch.t, torch.adjoint, torch.ops.aten.t.default, torch.ops.aten.numpy_T.default,
                   torch.ops.aten.mT.default, torch.ops.aten.adjoint.default)
_SWAPS = ("transpose", "swapaxes", "swapdims", torch.transpose, torch.swapaxes, torch.swapdims,
          torch.ops.aten.transpose.int, torch.ops.aten.swapaxes.default, torch.ops.aten.swapdims.default)
_PERMUTES = ("permute", torch.permute, torch.ops.aten.permute.default)


# casts and copies of a tensor (``quant.CAST_METHODS``), called as functions
_CAST_FUNCTIONS = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.contiguous)


def _cast_source(node) -> fx.Node | None:
    """``n`` if ``node`` is a cast or ``contiguous`` of ``n`` (``n.to(..)``, ``n.float()`` ...), else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_method" and node.target in quant.CAST_METHODS or (
            node.op == "call_function" and node.target in _CAST_FUNCTIONS):
        return node.args[0]
    return None


def _noop_cast_source(node) -> fx.Node | None:
    """``n`` if ``node`` is a cast or ``contiguous`` of ``n`` that changes neither its dtype, device nor shape
    (by the fake values), so it computes what ``n`` holds: ``w.to(x.dtype)`` where ``w`` is already in it."""
    src = _cast_source(node)
    before, after = fake_value(src), fake_value(node)
    if src is None or not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    if (before.dtype, before.device, tuple(before.shape)) != (after.dtype, after.device, tuple(after.shape)):
        return None
    return src


def _without_noop_casts(node):
    """``node`` read through its no-op casts and ``contiguous`` calls (see ``_noop_cast_source``)."""
    while (src := _noop_cast_source(node)) is not None:
        node = src
    return node


def _is_weight(node, ctx: PassContext) -> bool:
    """``node`` is a module's weight, read directly or through casts: a graph input that is an ``nn.Parameter``
    (or a tensor ``quantize_`` tagged), a parameter by ``get_attr``, or an fp8fx dequantize (of a quantized one)."""
    for _ in range(6):
        src = _cast_source(node)
        if src is None:
            break
        node = src
    if _from_dequantize(node):
        return True
    if not isinstance(node, fx.Node):
        return False
    if node.op not in ("placeholder", "get_attr"):
        return False
    real = ctx.example.get(node)  # (a get_attr's tensor too: the pass manager puts the graph's attributes there)
    return isinstance(real, torch.nn.Parameter) or any(
        hasattr(real, tag) for tag in ("_fp8fx_fqn", "_fp8fx_skip_reason", "_fp8fx_owners"))


def _linear_operands(node: fx.Node, ctx: PassContext):
    """(x, weight, bias) of a linear site, or None. The weight is seen through casts and ``contiguous`` calls
    that change nothing (``F.linear(x, w.to(x.dtype))`` of a ``w`` already in that dtype)."""
    if node.op not in ("call_function", "call_method"):
        return None
    if node.op == "call_function" and node.target in _LINEAR:
        args = list(node.args) + [None] * 3
        w = _without_noop_casts(node.kwargs.get("weight", args[1]))
        return node.kwargs.get("input", args[0]), w, node.kwargs.get("bias", args[2])
    bias = None
    if node.target in _ADDMM:  # (alpha= and beta= other than 1: ``_other_arguments``)
        operands = _bound(node, _ADDMM_OPERANDS)
        bias, node_args = (operands[0], operands[1:]) if operands else (None, None)
    elif node.target in _MATMUL:
        node_args = _bound(node, _MATMUL_OPERANDS)
    else:
        return None
    if node_args is None:
        return None
    w = _transposed(_without_noop_casts(node_args[1]))
    w = _without_noop_casts(w)
    wv = fake_value(w) if w is not None else None
    # a matmul with a transposed operand is a linear when that operand is a quantized weight, or a 2-D
    # weight (reported as not quantized); q @ k.transpose(-1, -2) of attention, a CLIP-style text @ image.t()
    # of two activations, are neither: no sites
    if w is not None and (_from_dequantize(w) or getattr(wv, "ndim", 2) == 2 and _is_weight(w, ctx)):
        return node_args[0], w, bias
    return None


def _last_two_swapped(node: fx.Node) -> fx.Node | None:
    """``t`` if ``node`` swaps ``t``'s last two dims by any spelling (``t.transpose(1, 2)`` of a 3-D ``t``,
    ``t.mT``), else None."""
    source = _transposed(node)
    if source is None and node.target in _SWAPS and isinstance(node.args[0], fx.Node):
        ndim = getattr(fake_value(node.args[0]), "ndim", 0)
        dims = node.args[1:3]
        if ndim >= 2 and len(dims) == 2 and all(isinstance(d, int) for d in dims) and sorted(
                d % ndim for d in dims) == [ndim - 2, ndim - 1]:
            source = node.args[0]
    if source is not None and node.target is getattr and node.args[1] == "T" and fake_value(source).ndim > 2:
        return None  # (t.T of a 3-D t reverses all its dims)
    return source


def _weight_on_the_left(graph: fx.Graph, node: fx.Node, transposes: dict, ctx: PassContext) -> bool:
    """Rewrites ``w @ x`` of an fp8fx-quantized 2-D weight ``w`` [N, K] (Mamba's ``dt_proj.weight @
    t.transpose(1, 2)``: ``x`` [..., K, M]), or of a linear's bf16 weight ``fp8fx inspect`` named (tagged
    ``_fp8fx_fqn``, with no reason: where ``inspect`` had said "in no traced graph"), to the linear it is,
    ``(x.mT @ w.t()).mT.contiguous()`` (the strides
    ``w @ x`` has), which the pass then finds as ``x @ w.T`` (a 1-D ``x``: ``x @ w.t()``); True if it did. The same
    numbers in another order: the fp8 op's tokens are ``x``'s columns. ``x.mT`` is ``t`` for ``x = t.mT``, and one
    node per other ``x`` (``transposes``), so that layers reading one ``x`` quantize it once and fuse. Not when the
    call has other arguments (``out=``)."""
    if node.op not in ("call_function", "call_method") or node.target not in _MATMUL or node.kwargs:
        return False
    operands = list(node.args)
    if len(operands) != 2 or not all(isinstance(a, fx.Node) for a in operands):
        return False
    w, x = _without_noop_casts(operands[0]), operands[1]
    wv, xv = fake_value(w), fake_value(x)
    # (a weight quantize_ left in high precision, tagged with its reason too, stays torch's ``w @ x``: the same
    # numbers and strides as eager, its row from _report_tagged_readers; only the linears inspect named are taken,
    # as their quantized reads would be)
    real = ctx.example.get(w) if w.op in ("placeholder", "get_attr") else None
    named = hasattr(real, "_fp8fx_fqn") and not hasattr(real, "_fp8fx_skip_reason")
    if not (w.target in _DEQUANT or named) or getattr(wv, "ndim", 0) != 2 or getattr(xv, "ndim", 0) < 1:
        return False
    with graph.inserting_before(node):
        source = _last_two_swapped(x) if xv.ndim > 1 else None
        if source is not None:  # x = t.transpose(1, 2): x.mT is t
            x = source
        elif xv.ndim > 1:
            if x not in transposes:  # (before the first of them: the graph's order)
                transposes[x] = graph.call_function(torch.transpose, (x, -2, -1))
                set_fake_value(transposes[x], torch.transpose, transposes[x].args)
            x = transposes[x]
        wt = graph.call_function(torch.t, (operands[0],))
        set_fake_value(wt, torch.t, wt.args)
        y = graph.call_function(torch.matmul, (x, wt))
        # (its fake value from w @ x's: torch 2.11's matmul of fake tensors with symbolic sizes, a Mamba layer
        # recompiled for another length, failed in "Cannot call numel() on tensor with symbolic sizes")
        set_fake_value(y, lambda v: (v.transpose(-2, -1) if v.ndim > 1 else v).contiguous(), (node,))
        y.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
        out = y
        if xv.ndim > 1:
            yt = graph.call_function(torch.transpose, (y, -2, -1))
            set_fake_value(yt, torch.transpose, yt.args)
            out = graph.call_method("contiguous", (yt,))
            set_fake_value(out, torch.Tensor.contiguous, out.args)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


# the operands' keywords: torch's (``torch.mm(x, mat2=..)``, ``matmul(x, other=..)``), aten's (``self``)
_MATMUL_OPERANDS = (("input", "self"), ("mat2", "other"))
_ADDMM_OPERANDS = (("input", "self"), ("mat1",), ("mat2",))
_OPERAND_KEYWORDS = {"input", "weight", "bias", "self", "mat1", "mat2", "other"}


def _bound(node: fx.Node, keywords: tuple) -> Optional[list]:
    """``node``'s operands, given by position or by one of their ``keywords`` (a method's first is its ``self``), or
    None where one is missing or one is given twice."""
    operands = list(node.args)
    if len(operands) > len(keywords):
        return None
    for names in keywords[len(operands):]:
        given = [node.kwargs[n] for n in names if n in node.kwargs]
        if len(given) != 1:
            return None
        operands.append(given[0])
    return operands


def _weight_written(w: fx.Node, writes: dict) -> str:
    """Why a site whose dequantized weight was written in place before it (``w.mul_(2)``, ``w[:16] = 0``: the
    layer's weight is a fresh dequantized tensor at each read, and the linear reads what was written) stays as it
    is, or "": the fp8 op would read the quantized weight, without the write."""
    writers = writes.get(_storage(w), [])
    if not writers:
        return ""
    return (f"the dequantized weight is written in place by {', '.join(sorted({_name_of(n) for n in writers}))} "
            "before the linear: computed with the dequantized weight")


def _other_arguments(node: fx.Node) -> str:
    """Why a linear site with arguments beyond its operands stays as it is, or "": ``out=`` (the rewritten op
    returns a new tensor, and the buffer the program reads after the call would keep its old values)."""
    extra = sorted(set(node.kwargs) - _OPERAND_KEYWORDS)
    out_dtype = node.kwargs.get("out_dtype")
    if out_dtype is not None:  # torch.mm(x, w.t(), out_dtype=torch.float32): the fp8 op returns any of _ACT_DTYPES
        if out_dtype not in _ACT_DTYPES:
            return (f"called with out_dtype={out_dtype}, which the fp8 op does not return (it returns bf16, fp16 or "
                    "fp32): computed with the dequantized weight")
        extra.remove("out_dtype")
    if node.target in _ADDMM:  # aten's addmm(bias, x, w.t(), beta=, alpha=): bias * beta + alpha * x @ w.t()
        scales = [f"{k}={node.kwargs[k]}" for k in ("beta", "alpha") if node.kwargs.get(k, 1) != 1]
        if scales:
            return (f"called with {', '.join(scales)}, which the fp8 op does not take: computed with the dequantized "
                    "weight")
        extra = [k for k in extra if k not in ("beta", "alpha")]
    if not extra:
        return ""
    return (f"called with {', '.join(f'{k}=' for k in extra)}, which the fp8 op does not write: computed with the "
            "dequantized weight (drop the out= buffer and assign the result to rewrite it)")


def _under_autocast(node: fx.Node, device_type: str) -> bool:
    """Whether ``node`` runs under an enabled ``torch.autocast`` of ``device_type``: the innermost one entered inside
    the graph (Dynamo's ``_enter_autocast(device, dtype, enabled, cache)`` / ``_exit_autocast(enter)`` nodes around
    it: ``enabled=False`` turns it off there), else the one around the compiled call (enabled while the backend
    compiles it)."""
    entered: list[fx.Node] = []
    for n in node.graph.nodes:
        if n is node:
            break
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_enter_autocast" and n.args and n.args[0] == device_type:
            entered.append(n)
        elif name == "_exit_autocast" and n.args and n.args[0] in entered:
            entered.remove(n.args[0])
    if entered:
        return bool(entered[-1].args[2]) if len(entered[-1].args) > 2 else True
    return torch.is_autocast_enabled(device_type)


def _mixed_dtypes(node: fx.Node, x, w, bias) -> str:
    """Why a linear whose activation, weight and bias dtypes differ outside ``torch.autocast`` (or under one that leaves
    one of them as it is: ``_casts``) stays torch's, or "":
    eager and Inductor raise ("mat1 and mat2 must have the same dtype"), where the fp8 op would compute it, and
    return a promoted float32 for a bias of another dtype (an fp16 model fed bf16, a float32 bias)."""
    values = {"activation": fake_value(x), "weight": fake_value(w), "bias": fake_value(bias)}
    dtypes = {k: v.dtype for k, v in values.items() if isinstance(v, torch.Tensor)}
    out_dtype = node.kwargs.get("out_dtype")
    if out_dtype is not None and dtypes.get("bias") == out_dtype:  # addmm(b, x, w.t(), out_dtype=b.dtype)
        del dtypes["bias"]
    act, weight = dtypes.get("activation"), dtypes.get("weight")
    under = _under_autocast(node, values["activation"].device.type)
    if len(set(dtypes.values())) < 2 or (under and (act == weight or (_casts(act) and _casts(weight)))):
        return ""
    shown = ", ".join(f"{k} {v}" for k, v in dtypes.items()).replace("torch.", "")
    # (a layer cast to an integer or 8-bit dtype is refused at the cast)
    fix = ("cast the input (or the layer) to one dtype, or run it under torch.autocast"
           if act in _ACT_DTYPES and not under else
           "cast the input (or the layer) to one dtype" if act in quant.COMPUTE_DTYPES else
           f"cast the input to the layer's dtype ({str(act).replace('torch.', '')} is no dtype a layer computes in)")
    return (f"{MIXED_DTYPES} ({shown}) {_where(under)}: a linear takes one dtype, and torch "
            f"raises on it as eager does; {fix}")


def _casts(dtype: Optional[torch.dtype]) -> bool:
    """Whether ``torch.autocast`` casts a linear's operand of ``dtype`` to its own dtype: every floating dtype but
    float64 (float8 too), never an integer or bool one. Under autocast a linear whose activation or weight it leaves
    as they are, of two dtypes, raises as outside it: an integer input into a bf16 fp8 model, or a float32 one into a
    float64 model (``model.double()``), compiled and failed with torch's error naming no layer, or fp8fx.scaled_mm's
    (out_dtype float64)."""
    return dtype is not None and dtype.is_floating_point and dtype != torch.float64


def _where(under_autocast: bool) -> str:
    return ("under torch.autocast (which casts no float64, integer or bool operand)" if under_autocast
            else "outside torch.autocast")


MIXED_DTYPES = "dtypes differ"
# LoRA's adapter layers in a PEFT model: <layer>.lora_A.<adapter name>
_PEFT_ADAPTER = re.compile(r"\.(lora_A|lora_B)\.[^.]+$")


def _refuse_mixed_dtypes(fqn: str, node: fx.Node, x: fx.Node, w: fx.Node) -> None:
    """An fp8 layer's linear given an activation of another dtype than its weight's, outside torch.autocast (or
    under one that leaves either as it is: ``_casts``): torch's linear would raise at run time ("mat1 and mat2 must
    have the same dtype"), naming no layer, where eager names it (``fp8fx.weights.views``); so the compile raises,
    naming it. A bias of another dtype alone is promoted, and stays torch's."""
    xv = fake_value(x)
    xd, wd = getattr(xv, "dtype", None), getattr(fake_value(w), "dtype", None)
    if not (isinstance(w, fx.Node) and w.target in _DEQUANT) or xd is None or wd is None or xd == wd:
        return
    under = _under_autocast(node, xv.device.type)
    # (torch.autocast casts a float32 / 16-bit activation to its dtype, never a float64 or an integer one)
    autocast = ", or run the model under torch.autocast" if xd in _ACT_DTYPES and not under else ""
    raise TypeError(
        f"fp8fx: {fqn}'s weight is {wd} (the fp8 layer's weight, dequantized to the dtype the layer computes in) and "
        f"its linear gets a {xd} activation, {_where(under)}, which torch's linear refuses (mat1 and mat2 must "
        f"have the same dtype): an fp8 layer computes in the dtype its model was quantized in or last cast to. "
        f"{dtype_fix(xd, wd)}{autocast}")


def _hop_operands(node: fx.Node) -> list:
    """The operands a higher-order op passes to its bodies' placeholders, in their order: ``cond``'s tuple,
    ``invoke_subgraph``'s after its identifier, the others' after their bodies (``tag_activation_checkpoint``)."""
    if node.target is torch.ops.higher_order.cond:
        return list(node.args[3]) if len(node.args) > 3 else []
    start = 2 if node.target is getattr(torch.ops.higher_order, "invoke_subgraph", None) else 1
    return [a for a in node.args[start:] if not (isinstance(a, fx.Node) and a.op == "get_attr")]


def _report_tagged_readers(graph: fx.Graph, ctx: PassContext) -> None:
    """A row for each weight ``quantize_`` left in high precision with its reason (``_fp8fx_skip_reason``) that a
    matmul reads as it is stored, ``x @ w`` / ``addmm(b, x, w)``, or on the left, ``w @ x``: no linear site, for its
    weight is not transposed.
    transformers' ``Conv1D`` (GPT-2's layers: a weight [in, out]) ran so, and its layers had no row in the report,
    only ``quantize_``'s warning (quantize_ quantizes them now: an fp8 Conv1D reads ``dequantize(...).t()``, a linear
    site); a linear-like layer of another class still does. Experts (3-D weights: the MoE pass says why) and weights
    a site of this graph names already are passed by. Like a linear site, the row is a frame's (``ctx.frame_site``):
    blocks that reuse the frame Dynamo compiled for the first, after a graph break, have theirs too. So has a
    Conv1D quantize_ never reached (a block left out of a model quantized part by part), untagged, with the reason
    an nn.Linear's gets. The row's weight shape is a linear's, [out, in]: the transpose of a weight read on the
    right, as a quantized Conv1D's row and ``fp8fx inspect`` give it."""
    named = {site.fqn for site in ctx.report.sites if site.graph == ctx.graph_index}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or node.target not in _ADDMM + _MATMUL:
            continue
        operands = _bound(node, _ADDMM_OPERANDS if node.target in _ADDMM else _MATMUL_OPERANDS)
        # the weight as stored on the right (x @ w), or on the left of a matmul (Mamba's dt_proj.weight @ x, left
        # bf16 where a block does not divide it: listed in no site, only among the unhandled weights)
        sides = (operands[-1], *(operands[:1] if node.target in _MATMUL else ())) if operands else ()
        for side, w in enumerate(map(_without_noop_casts, sides)):
            real = ctx.example.get(w) if isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr") else None
            reason, fqn = getattr(real, "_fp8fx_skip_reason", None), getattr(real, "_fp8fx_fqn", None)
            if reason and fqn is not None and getattr(real, "ndim", 0) == 2:
                break
            if side == 0 and getattr(real, "ndim", 0) == 2 and _in_conv1d(node) and not hasattr(real, "_fp8fx_of"):
                reason, fqn = None, LinearPass._fqn(node, w, ctx)
                break
        else:
            continue
        if fqn in named:
            continue
        named.add(fqn)
        ctx.frame_site(fqn, module_path(node), w)
        shape = Site.shape_of(fake_value(w))
        why = f"{NOT_QUANTIZED}{reason}" if reason else LinearPass._why_not(None, w, None, ctx, fqn, node)
        ctx.report.add(Site("linear", fqn, False, why, "", ctx.graph_index,
                            weight_shape=shape[::-1] if side == 0 else shape, node=Site.origin_of(node),
                            weight_id=Site.token_of(real)))


def _in_linear_module(node: Optional[fx.Node]) -> bool:
    """``node`` runs in the forward of a module ``quantize_`` takes as a linear (an ``nn.Linear``, transformers'
    ``Conv1D``), by Dynamo's module stack: not a parameter another module reads by ``F.linear`` (an embedding's, for
    tied logits; a raw ``self.weight``), which no ``quantize_`` call quantizes (h147)."""
    cls = _innermost_class(node) if isinstance(node, fx.Node) else None
    return cls is not None and (issubclass(cls, torch.nn.Linear) or is_conv1d_class(cls))


def _in_conv1d(node: fx.Node) -> bool:
    """``node`` runs in the forward of a transformers ``Conv1D`` (Dynamo's module stack)."""
    cls = _innermost_class(node)
    return cls is not None and is_conv1d_class(cls)


def _innermost_class(node: fx.Node) -> Optional[type]:
    """The class of the innermost module whose forward created ``node`` (Dynamo's module stack), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    cls = list(stack.values())[-1][1] if stack else None
    return cls if isinstance(cls, type) else None


def _report_nested(graph: fx.Graph, ctx: PassContext) -> None:
    """Quantized weights read inside a higher-order op's bodies (``torch.cond``, activation checkpointing, a
    ``nested_compile_region`` called more than once): fp8fx's passes rewrite the top-level graph, so each is
    reported, once for each call of the op, as computed with the dequantized weight - nothing silently left
    undone (those sites were in no report: "0 of 0 sites")."""
    owner = graph.owning_module
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        bodies = [getattr(owner, a.target, None) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        operands = _hop_operands(node)
        named: set[str] = set()
        for body in bodies:
            if not isinstance(body, fx.GraphModule):
                continue
            places = [p for p in body.graph.nodes if p.op == "placeholder"]
            outer = dict(zip(places, operands)) if len(places) == len(operands) else {}
            for dq in body.graph.nodes:
                if dq.op != "call_function" or dq.target not in _DEQUANT:
                    continue
                source = outer.get(dq.args[0])
                real = ctx.example.get(source) if isinstance(source, fx.Node) else None
                fqn = getattr(real, "_fp8fx_fqn", None)
                fqn = f"{node.name}.{dq.name}" if fqn is None else fqn
                if fqn in named:
                    continue
                named.add(fqn)
                value = fake_value(dq)
                ctx.report.add(Site(
                    "moe" if getattr(value, "ndim", 2) == 3 else "linear", fqn, False,
                    f"read inside {node.target.name()} ({node.name}), whose bodies fp8fx's passes do not rewrite: "
                    "computed with the dequantized weight (call the layer outside it to rewrite it)", "",
                    ctx.graph_index, weight_shape=Site.shape_of(value), node=node.name,
                ))


# what to do where torch's own ops read the weights of nn.TransformerEncoderLayer / nn.MultiheadAttention: the
# inference fast path (eval, batch_first) and F.multi_head_attention_forward, which Dynamo keeps as one call
_FAST_PATH = ("; PyTorch's fused transformer fast path reads the weights itself: "
              "torch.backends.mha.set_fastpath_enabled(False) runs the layer's linears as linears")
_READER_HINTS = {
    "_transformer_encoder_layer_fwd": _FAST_PATH,
    "_native_multi_head_attention": _FAST_PATH,
    "multi_head_attention_forward": "; nn.MultiheadAttention computes its out_proj there: add it to ignored_layers to "
                                    "keep it in high precision (fp8 adds its error and saves nothing)",
}


def _name_of(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{target} ({node.op})"


def _read_from(node, depth: int = 6) -> Optional[fx.Node]:
    """What ``node`` is read from through views, slices, casts or indexes (each op's first input, ``depth`` nodes at
    most): the first dequantize on the way, else the node those ops start from (a placeholder: a parameter); None
    where the chain is longer or an op has no input."""
    for _ in range(depth):
        if not isinstance(node, fx.Node):
            return None
        if node.op not in ("call_function", "call_method") or node.target in _DEQUANT:
            return node
        if not node.args:
            return None
        node = node.args[0]
    return None


def _dequantize_of(node, depth: int = 6) -> Optional[fx.Node]:
    """The dequantize node ``node`` is (or is a view, slice, cast or index of, a few ops back), or None."""
    source = _read_from(node, depth)
    return source if source is not None and source.target in _DEQUANT else None


def _from_dequantize(node) -> bool:
    return _dequantize_of(node) is not None


def _kept_expert(w, ctx: PassContext) -> bool:
    """Whether ``w`` is read, through indexes, views or casts, from stacked experts that quantize_ or a loader kept in
    high precision (tagged ``_fp8fx_moe_role`` and ``_fp8fx_skip_reason``: one expert of a loop over them). The MoE
    pass reports those experts as one site with that reason; a linear site per expert GEMM told the user to run
    quantize_ on what they had ignored on purpose. So also for fp8 experts the MoE pass left as they are
    (``weight_only``: its site in this graph says why), whose loop added a site per expert GEMM (of one expert's
    weight)."""
    source = _read_from(w)
    one = getattr(fake_value(w), "ndim", 0) == 2  # one expert's weight (a 3-D read of them all says why it is none)
    if source is not None and source.target in _DEQUANT and one:
        real = ctx.example.get(source.args[0])
        fqn = getattr(real, "_fp8fx_fqn", None)
        return bool(getattr(real, "_fp8fx_moe_role", None)) and any(s.kind == "moe" and s.graph == ctx.graph_index
                                                                    and s.fqn == fqn and not s.rewritten
                                                                    for s in ctx.report.sites)
    real = ctx.example.get(source) if source is not None and source.op not in ("call_function", "call_method") else None
    return bool(getattr(real, "_fp8fx_moe_role", None) and getattr(real, "_fp8fx_skip_reason", None))


_INPLACE_NAMES = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
                  "rshift")
_INPLACE_OPERATORS = {getattr(operator, f"i{op}") for op in _INPLACE_NAMES}
_INPLACE_DUNDERS = {f"__i{op}__" for op in _INPLACE_NAMES}  # h.__imul__(2), as a method call
# higher-order ops that run bodies of the graph's (its get_attr submodules) and write an operand only where a body
# does (torch 2.13 lets cond's branches and a checkpointed function write theirs); any other - a user's Triton kernel
# (``triton_kernel_wrapper_mutation``), one torch adds later - may write what it is given
_BODY_HOPS = ("cond", "while_loop", "invoke_subgraph", "tag_activation_checkpoint", "wrap", "map_impl", "scan",
              "associative_scan", "flex_attention")


def _writing_hop(node: fx.Node) -> bool:
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    return node.target.name() not in _BODY_HOPS or _body_writes(node)


def _body_writes(node: fx.Node) -> bool:
    """Whether a body the higher-order op ``node`` runs (a submodule its get_attr operands name) writes in place, or
    cannot be read (then it may)."""
    root = node.graph.owning_module
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if not (isinstance(a, fx.Node) and a.op == "get_attr"):
            continue
        try:
            body = operator.attrgetter(a.target)(root)
        except AttributeError:
            return True
        if isinstance(body, fx.GraphModule) and any(_mutates(n) for n in body.graph.nodes):
            return True
    return False


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write a tensor in place (``x.mul_(3)``, ``x += y``, ``torch.add(.., out=x)``,
    ``aten.*_``): conservative (``_written`` and ``_may_alias`` then say which activations it may reach)."""
    if node.op == "call_method":
        return (node.target.endswith("_") and not node.target.endswith("__")
                or node.target == "__setitem__" or node.target in _INPLACE_DUNDERS)
    if node.op != "call_function":
        return False
    if "out" in node.kwargs or node.target is operator.setitem or node.target in _INPLACE_OPERATORS:
        return True
    if _writing_hop(node):
        return True
    if node.kwargs.get("inplace") is True or _inplace_positional(node):  # F.relu(x, inplace=True), nn.ReLU(True)
        return True
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        # any overload that may write (a custom op with mutates_args, vLLM's fused_add_rms_norm) counts
        return any(_schema_writes(o._schema, node) for o in overloads(node.target))
    name = getattr(node.target, "__name__", "")
    # torch.relu_, F.relu_ (not operator.and_ / or_ / not_ / is_, which write nothing)
    return name.endswith("_") and not name.endswith("__") and getattr(node.target, "__module__", "") != "_operator"


def overloads(target) -> list:
    """An ATen or custom op's overloads: the ``OpOverload`` itself, or each of a packet's (``torch.ops.ns.op(x)``:
    Dynamo keeps the packet), whose schemas say what it writes or returns."""
    if isinstance(target, torch._ops.OpOverload):
        return [target]
    return [getattr(target, name) for name in target.overloads()]


def _schema_writes(schema: Any, node: fx.Node) -> bool:
    """Whether an op of ``schema`` called as ``node`` may write an argument: one it may write that is positional, or
    keyword-only and given (an ``out`` overload writes nothing where no ``out=`` is passed: ``torch.ops.aten.linear``,
    a packet of ``default`` and ``out``, was taken for a write into its own weight)."""
    return any(a.alias_info is not None and a.alias_info.is_write and (not a.kwarg_only or a.name in node.kwargs)
               for a in schema.arguments)


def _written(node: fx.Node) -> Optional[list]:
    """The tensors that ``node`` (``_mutates``) writes, where one argument says which: ``x[i] = v``, ``x.mul_(3)``,
    ``x += y``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)`` write x, ``out=`` its tensor; None where that is not
    known (an op whose schema may write some of its arguments: all of them count)."""
    if _writing_hop(node):  # a user's Triton kernel: any tensor it takes (which it writes is not recorded)
        operands = node.kwargs.get("kwargs")
        return [v for v in operands.values() if isinstance(v, fx.Node)] if isinstance(operands, dict) else None
    if "out" in node.kwargs:  # (a tuple of tensors for an op of several outputs)
        out = node.kwargs["out"]
        return list(out) if isinstance(out, (list, tuple)) else [out]
    first = node.args[0] if node.args else node.kwargs.get("input")  # (F.relu(input=x, inplace=True))
    if first is None:
        return None
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    # methods, setitem, in-place operators, inplace=True, torch.relu_ and the like; a list of tensors: _foreach_mul_'s
    return list(first) if isinstance(first, (list, tuple)) else [first]


# ops that return their input itself in some modes (``F.dropout(h, p, training=False)``, p = 0) where Dynamo's fake
# value is a fresh tensor (torch's decomposition clones): their outputs count as their input's memory
_RETURNS_INPUT = {F.dropout, torch.dropout, F.alpha_dropout, torch.alpha_dropout, F.feature_alpha_dropout,
                  torch.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d}


# ops that may return their input as it is (checked on the fake values: one memory, geometry and dtype)
_ALIAS_METHODS = frozenset({"contiguous", "to", "type", "type_as", "float", "half", "bfloat16", "detach", "view",
                            "view_as", "reshape"})
_ALIAS_FUNCTIONS = (torch.detach, operator.getitem)
# ops that may return a view of their first argument in another shape (``_layout``)
_VIEW_METHODS = _ALIAS_METHODS | {"flatten", "unflatten", "squeeze", "unsqueeze", "reshape_as"}
_VIEW_FUNCTIONS = (*_ALIAS_FUNCTIONS, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.unflatten,
                   torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten)


# ops that read fp8 weights: a graph holding one (before or after the passes) is of a model quantize_ or
# load_checkpoint ran on
_FP8_WEIGHT_OPS = frozenset(getattr(torch.ops.fp8fx, name).default for name in (
    "dequantize", "scaled_mm", "scaled_mm_fused", "gated_mlp", "fused_moe", "small_mm", "weight_only_mm"))


def _tags_lost(ctx: PassContext) -> bool:
    """Whether the graph's fp8 inputs carry none of the tags quantize_ / load_checkpoint set on the tensors they make
    (``_fp8fx_fqn``): tensors saved and loaded without them, as by torch.export.save / load."""
    fp8 = [v for v in ctx.example.values() if isinstance(v, torch.Tensor) and v.dtype == quant.FP8_DTYPE]
    return bool(fp8) and not any(hasattr(v, "_fp8fx_fqn") for v in fp8)


def _same_tensor(node: fx.Node, layouts: bool) -> fx.Node:
    """The node whose tensor ``node``'s is, through ops that return their input as it is (``x.contiguous()`` of a
    contiguous x, ``x.to(its dtype)``, ``x.detach()``, ``x[:]``): one memory, offset, shape, strides, dtype and no
    negative / conjugate bit, so one value at every point of the graph, whatever is written into either. ``node``
    itself where ``layouts`` is False: in a graph whose fake values' layouts are no guide (``layouts_hold``: ``set_``,
    or a layout changed in place, recorded for every point of the graph)."""
    if not layouts:
        return node
    while (node.op == "call_method" and node.target in _ALIAS_METHODS or node.op == "call_function"
           and node.target in _ALIAS_FUNCTIONS) and node.args and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        a, b = fake_value(node), fake_value(src)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.dim() != b.dim():
            break
        if not all(statically_known_true(i == j) for i, j in zip((*a.shape, *a.stride(), a.storage_offset()),
                                                                 (*b.shape, *b.stride(), b.storage_offset()))):
            break  # (sizes may be symbolic: equal where they are known to be, without a guard)
        if (a.is_neg(), a.is_conj()) != (b.is_neg(), b.is_conj()):
            break
        memory = _own_storage(a)
        if memory is None or memory != _own_storage(b):
            break
        node = src
    return node


def _layout(node: fx.Node) -> Optional[tuple]:
    """What makes ``node``'s tensor the one tensor as another node's, where both are read at one point of the graph:
    the node it is a view of (through reshapes and ``_same_tensor``'s ops, each returning a view of its input's
    memory: a write into either reaches both) and its dtype, sizes, strides, offset and negative / conjugate bits
    (sizes as their symbolic expressions: equal where they are the same expression). None where the node's fake value
    is no guide: no tensor, no memory of its own. (Nor is it in a graph ``layouts_hold`` refuses: the caller's to
    check, once a graph.)"""
    value = fake_value(node)
    if not isinstance(value, torch.Tensor) or (memory := _own_storage(value)) is None:
        return None
    root = node
    while (root.op == "call_method" and root.target in _VIEW_METHODS or root.op == "call_function"
           and root.target in _VIEW_FUNCTIONS) and root.args and isinstance(root.args[0], fx.Node):
        base = fake_value(root.args[0])
        if not isinstance(base, torch.Tensor) or _own_storage(base) != memory:
            break  # (a reshape that copied)
        root = root.args[0]

    def exprs(sizes) -> tuple:
        return tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in sizes)

    return (root, value.dtype, exprs(value.shape), exprs(value.stride()), exprs([value.storage_offset()]),
            value.is_neg(), value.is_conj())


class _Layouts:
    """The ``_layout`` of a graph's nodes, each read once; none in a graph ``layouts_hold`` refuses (``hold``, read
    once a graph: the scan is over every node)."""

    def __init__(self, graph: fx.Graph):
        self.hold = layouts_hold(graph)
        self.seen: dict[fx.Node, Optional[tuple]] = {}

    def of(self, node: fx.Node) -> Optional[tuple]:
        if self.hold and node not in self.seen:
            self.seen[node] = _layout(node)
        return self.seen.get(node)

    def same(self, a: fx.Node, b: fx.Node) -> bool:
        layout = self.of(a)
        return layout is not None and layout == self.of(b)

    def key(self, node: fx.Node) -> Any:
        """What tells ``node``'s tensor from others: its layout, or the node itself."""
        return self.of(node) or node


class _Quantized(dict):
    """One graph's quantizations, (activation, input scale, block) -> (xq, x_scale), and each one's activation's
    layout (``layout``: the graph's ``_Layouts``) -> its key, for another node of the same tensor to find it."""

    def __init__(self, graph: fx.Graph):
        super().__init__()
        self.layout = _Layouts(graph)
        self.by_layout: dict[tuple, tuple] = {}

    def forget(self, key: tuple) -> None:
        """Drop quantization ``key`` (an in-place write may have reached its activation), and its layout's entry."""
        del self[key]
        for layout in [layout for layout, k in self.by_layout.items() if k == key]:
            del self.by_layout[layout]


def _own_storage(value: torch.Tensor) -> Optional[StorageWeakRef]:
    """The memory of ``value`` itself (``_storage``: of a node, through ops that return their input)."""
    try:
        return StorageWeakRef(value.untyped_storage())
    except NotImplementedError:  # "Cannot access storage of BatchedTensorImpl" (TensorWrapper, ...)
        return None


# in-place ops that change a tensor's sizes, strides or offset: Dynamo's fake tensor of a node so changed later holds
# the changed layout at every point of the graph, before the change too
_RELAYOUT_IN_PLACE = frozenset({"as_strided_", "resize_", "resize_as_", "squeeze_", "unsqueeze_", "t_", "transpose_",
                                "swapdims_", "swapaxes_", "set_"})


def layouts_hold(graph: fx.Graph) -> bool:
    """Whether the fake values' layouts (``_layout``) tell the graph's tensors apart: not in a graph that changes a
    tensor's layout in place (``h.unsqueeze_(0)``, ``as_strided_``, ``set_``), where a node read before the change
    records the layout after it - two tensors could then read as one."""
    for n in graph.nodes:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "") if n.op == "call_function" \
            else ""
        if isinstance(name, str) and name.split(".")[0] in _RELAYOUT_IN_PLACE:  # (aten's "unsqueeze_.default")
            return False
    return True


def _sets_storage(graph: fx.Graph) -> bool:
    """Whether ``graph`` calls ``set_`` (``y.set_(x)``): it changes the storage of the fake tensor Dynamo recorded
    for ``y``, which then reads as x's memory at every point of the graph, before the call too; the memory the fake
    values record is no guide to what may alias what in such a graph."""
    return any(n.op == "call_method" and n.target == "set_" or n.op == "call_function" and (
        n.target is torch.Tensor.set_ or getattr(n.target, "__name__", "").startswith("set_.")
        or n.target is getattr(torch.ops.aten, "set_", None)) for n in graph.nodes)


def _storage(node) -> Optional[StorageWeakRef]:
    """The memory of ``node``'s fake tensor (views share their base's; ``_RETURNS_INPUT``'s outputs their input's);
    None where the node records none, or its tensor has no storage of its own: functorch's tensors in a
    ``torch.vmap`` or ``torch.func.grad`` body (transformers' image-token mask code of Gemma 3 writes one in place; the
    compile failed). None is "may alias anything" to ``_may_alias``; a weight is never such a tensor."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _RETURNS_INPUT and node.args:
        node = node.args[0]
    value = fake_value(node) if isinstance(node, fx.Node) else None
    return _own_storage(value) if isinstance(value, torch.Tensor) else None


def _may_alias(x: fx.Node, written: Optional[list], inputs: Optional[set]) -> bool:
    """Whether the activation ``x`` may share memory with a tensor in ``written`` (``_written``). It may not only
    where x was computed in this graph - its memory is none of the graph inputs' (``inputs``: two inputs may share
    memory on a later call though they did not when Dynamo traced; a computed tensor cannot share an input's) - and
    no written tensor is a view of it. So a KV cache written between q/k/v's projections (``k_cache[..] = k`` before
    ``v_proj(h)``) leaves h's quantization to v; ``h.mul_(2)`` or a write into a view of h does not. Where x is a
    graph input (an attention module compiled alone), a write into a tensor computed in the graph (``q.mul_(scale)``
    of the GEMM output) cannot reach it either. ``inputs`` None: a graph whose fake memory is no guide
    (``_sets_storage``), where any write may reach x."""
    mine = _storage(x)
    if written is None or mine is None or inputs is None:
        return True
    theirs = [_storage(w) for w in written]
    if mine in inputs:
        return any(t is None or t in inputs for t in theirs)
    return any(t is None or t == mine for t in theirs)


def graph_inputs_memory(graph: fx.Graph) -> Optional[set]:
    """The memory of ``graph``'s inputs, for ``_may_alias``; None where it is no guide (``_sets_storage``)."""
    if _sets_storage(graph):
        return None
    return {_storage(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")} - {None}


def _inplace_positional(node: fx.Node) -> bool:
    """``inplace`` passed by position (``F.hardtanh(x, -1, 1, True)``)."""
    if not node.args or not callable(node.target):
        return False
    try:
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, arguments that do not bind
        return False
    return bound.arguments.get("inplace") is True


def lacks_fp8_tensor_cores(example_inputs) -> bool:
    """True when the graph runs on a CUDA GPU older than compute capability 8.9 (no fp8 tensor cores)."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return not launch.has_fp8_tensor_cores(t.device)
    return False


# modules that wrap a layer under a name of their own (PEFT's LoRA layer holds it as base_layer, torch's activation
# checkpointing as _checkpoint_wrapped_module, a compiled submodule as _orig_mod, FSDP as _fsdp_wrapped_module)
_WRAPPER_PARTS = frozenset({"base_layer", "_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def _named_at(name: str, owner: str) -> bool:
    """Whether a weight that ``quantize_`` found in the layer ``name`` and a frame reads as a tensor of ``owner`` is
    still that layer: ``owner`` is the name, with wrappers above it (a PEFT model's base_model.model.) or around the
    layer (its base_layer), or its tail (the frame of a block compiled alone)."""
    parts = [p for p in owner.split(".") if p not in _WRAPPER_PARTS]
    at = "." + ".".join(parts) + "."
    return not parts or f".{name}." in at or f".{name}.".endswith(at)  # (no parts: the wrapper compiled alone)


class LinearPass(Fp8Pass):
    """``weight_only``: rewrite to ``fp8fx.weight_only_mm`` (fp8 weights, 16-bit activations) instead;
    None decides per graph: weight-only on GPUs without fp8 tensor cores. ``fusing``: the backend's fusions are on,
    which take fp8 GEMMs only: a weight-only site's scheme says it was not fused."""

    def __init__(self, use_fast_accum: bool = False, weight_only: Optional[bool] = None, fusing: bool = False):
        self.use_fast_accum = use_fast_accum
        self.weight_only = weight_only
        self.fusing = fusing

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        graph = gm.graph
        count = 0
        weight_only = self.weight_only
        if weight_only is None:
            weight_only = lacks_fp8_tensor_cores(ctx.example.values())
        transposes: dict[fx.Node, fx.Node] = {}
        for node in list(graph.nodes):
            _weight_on_the_left(graph, node, transposes, ctx)
        # one quantization per (activation, scheme): q/k/v and gate/up read the same x
        quantized = _Quantized(graph)
        inputs = graph_inputs_memory(graph)
        writes: dict[StorageWeakRef, list[fx.Node]] = {}  # memory -> the in-place writes into it so far
        for node in list(graph.nodes):
            if _mutates(node):  # a quantization taken before an in-place write into x must not be reused after it
                written = _written(node)
                for key in [key for key in quantized if _may_alias(key[0], written, inputs)]:
                    quantized.forget(key)
                for t in written if written is not None else node.all_input_nodes:
                    if (memory := _storage(t)) is not None:
                        writes.setdefault(memory, []).append(node)
            operands = _linear_operands(node, ctx)
            if operands is None:
                continue
            x, w, bias = operands
            fqn = self._fqn(node, w, ctx)
            reason = (_other_arguments(node) or self._why_not(x, w, bias, ctx, fqn, node)
                      or _mixed_dtypes(node, x, w, bias) or _weight_written(w, writes))
            if reason and _kept_expert(w, ctx):  # the MoE pass's site of the experts says why they stay bf16
                continue
            source = w.args[0] if isinstance(w, fx.Node) and w.target in _DEQUANT else _read_from(w)
            ctx.frame_site(fqn, module_path(node), source)  # (the site is added below)
            if reason:
                # (its weight's token too: ``Report.unhandled_weights`` tells two models' layers of one name apart)
                ctx.report.add(Site("linear", fqn, False, reason, "", ctx.graph_index,
                                    weight_shape=Site.shape_of(fake_value(w)), node=Site.origin_of(node),
                                    weight_id=Site.token_of(ctx.example.get(source))))
                if reason.startswith(MIXED_DTYPES):
                    _refuse_mixed_dtypes(fqn, node, x, w)
                continue
            # read before the rewrite, which erases the weight's dequantize node
            details = dict(weight_shape=Site.shape_of(fake_value(w)), node=Site.origin_of(node),
                           bytes_saved=bytes_saved(w),
                           weight_id=Site.token_of(ctx.example.get(w.args[0])))
            if weight_only:
                scheme, new = self._rewrite_weight_only(graph, node, x, w, bias)
                if self.fusing:  # chosen for this GPU (no fp8 tensor cores): fuse_mlp / fuse_horizontal do not apply
                    scheme += "; not fused: the fusions take fp8 GEMMs, this GPU has no fp8 tensor cores"
            else:
                scheme, new = self._rewrite(graph, node, x, w, bias, quantized)
            new.meta["fp8fx_site"] = len(ctx.report.sites)  # later passes amend this site
            ctx.report.add(Site("linear", fqn, True, "", scheme, ctx.graph_index, **details))
            count += 1
        self._report_other_readers(graph, ctx)
        _report_tagged_readers(graph, ctx)
        _report_nested(graph, ctx)
        gm.recompile()
        return count

    def _report_other_readers(self, graph: fx.Graph, ctx: PassContext) -> None:
        """Quantized weights that something other than a linear still reads (``torch.mm``, ``einsum``,
        ``addmm``, a matmul without a transpose ...) run on the dequantized weight: each goes into the report
        with its readers, unless a site of this graph already names it (nothing is silently left undone)."""
        named = {site.fqn: i for i, site in enumerate(ctx.report.sites) if site.graph == ctx.graph_index}
        # a weight without quantize_'s name tag (Fp8LinearMethod used directly): its site found by the weight
        by_weight = {site.weight_id: site.fqn for site in ctx.report.sites
                     if site.graph == ctx.graph_index and site.weight_id}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in _DEQUANT or not node.users:
                continue
            real = ctx.example.get(node.args[0])
            tag = getattr(real, "_fp8fx_fqn", None)  # ("": a layer quantized on its own, named by its path)
            fqn = tag or (by_weight.get(Site.token_of(real)) if real is not None else None)
            if fqn is None:  # no site names it (the graph of its weight property alone: nn.Linear.compile()); a layer
                # quantize_ was given itself has no path here (the root, or a layer of a container compiled in place)
                fqn = f"(a layer quantized on its own: {node.name})" if tag == "" else node.name
            readers = ", ".join(sorted(
                {f"{_name_of(r)} of its transpose" for u in node.users if _transposed(u) is node for r in u.users}
                | {_name_of(u) for u in node.users if _transposed(u) is not node}
            ))
            # a write into the dequantized weight (``layer.weight.div_(2)`` in a forward: RWKV's rescale) changes a
            # copy, while the model may go on as if the layer's weight had changed: said in the row and the log
            writes = sorted({_name_of(u) for u in node.users if _mutates(u) and u.args and u.args[0] is node})
            lost = (f"; its in-place write by {', '.join(writes)} does not persist (the fp8 layer's .weight is a "
                    "dequantized copy of its codes and scales: later reads see the weight as it was)") if writes else ""
            if writes:
                log.warning("fp8fx: %s: %s writes into the dequantized weight, a copy: the fp8 weight stays as it was",
                            fqn or ROOT, ", ".join(writes))
            if fqn in named:  # a linear of this weight is in the report: say what else reads it
                i = named[fqn]
                site = ctx.report.sites[i]
                if site.rewritten and readers:  # (none: a transpose whose result nothing reads, a shape read of it)
                    note = f"; also read by {readers} (on the dequantized weight){lost}"
                    ctx.report.sites[i] = dataclasses.replace(site, scheme=site.scheme + note)
                elif lost:
                    ctx.report.sites[i] = dataclasses.replace(site, reason=site.reason + lost)
                continue
            named[fqn] = len(ctx.report.sites)
            if [u.op for u in node.users] == ["output"] and sum(n.op == "call_function" for n in graph.nodes) == 1:
                # the graph of the weight property alone: Dynamo compiled its getter as a frame, called from a
                # layer's forward it runs uncompiled (torch.nn's own code, called by a frame it skips: nn.Sequential's
                # after a graph break in an earlier child, or torch.nn's module itself given Module.compile())
                reason = ("the dequantized weight is all this graph computes: the layer ran uncompiled (Dynamo "
                          "compiled only its weight's property, the caller's frame being one it runs eagerly: a "
                          "frame it skipped for a graph break inside a loop, nn.Sequential's forward after a graph "
                          "break, or a torch.nn module such as nn.Sequential or nn.Linear compiled in place by its "
                          ".compile(), whose forward Dynamo skips; other layers of its class that ran so reuse this "
                          "graph and have no row: report.unhandled_weights(model) lists them); compile the module "
                          "that calls the layer with torch.compile(module), or remove the graph break")
            else:
                readers = readers or ", ".join(sorted(f"{_name_of(u)}, whose result nothing reads" for u in node.users))
                reason = (f"the quantized weight is read by {readers}, not by a linear (F.linear / x @ w.T): "
                          f"computed with the dequantized weight{lost}")
                reason += "".join(hint for op, hint in _READER_HINTS.items() if f"{op} (" in readers)
            ctx.report.add(Site(
                "linear", fqn, False, reason, "", ctx.graph_index,
                weight_shape=Site.shape_of(fake_value(node)), node=Site.origin_of(node),
            ))

    @staticmethod
    def _fqn(node: fx.Node, w, ctx: PassContext) -> str:
        dq = _dequantize_of(w)  # the quantized weight's own name, also through a view or cast of it
        # (a weight in high precision: its tags, also through an index of it - an expert of stacked ones)
        wq = dq.args[0] if dq is not None else (_read_from(w) or w)
        real = ctx.example.get(wq) if isinstance(wq, fx.Node) else None
        path = module_path(node)
        owners = getattr(real, "_fp8fx_owners", {})
        if path in owners:  # a weight several layers share: the one running here
            return path
        # (a frame of a block compiled alone: its paths are the block's, the owners' names the model's)
        mine = [o for o in owners if path and o.endswith(f".{path}")]
        if len(mine) == 1:
            return mine[0]
        tag = getattr(real, "_fp8fx_fqn", None)  # ("" for a quantized root module: its name in named_modules)
        if tag:
            # where quantize_ found the layer; its weight read at a place none of the layer's names there are related
            # to (that name, the tail of it as in a block's own frame, or it under a wrapper) is a copy of it put
            # elsewhere (a deep-copied block appended as blocks.1) or a layer moved into another model: named where it
            # runs (h136: a copied block was reported as the original twice)
            read = input_path(wq) if isinstance(wq, fx.Node) else None
            owner = read.rpartition(".")[0] if read else ""
            names = getattr(real, "_fp8fx_names", None)
            if owner and names and not any(_named_at(n, owner) for n in names):
                return owner
            return tag
        if tag == "":  # a layer quantized on its own (quantize_(layer)): its path in the compiled model, if any
            return path or ""
        if path is not None:
            return path  # ("" for the root module too, not Dynamo's node name)
        of = getattr(real, "_fp8fx_of", None)  # an fp8 layer's weight read in eager code and passed in: that layer
        if of:
            return of.rpartition(".")[0]
        # no module around the linear, an untagged weight (F.linear(x, self.w) in the traced module's own forward):
        # the parameter's name in that module
        return input_path(wq) or node.name

    @staticmethod
    def _why_not(x, w, bias, ctx: PassContext, fqn: str = "", site: Optional[fx.Node] = None) -> str:
        if not isinstance(w, fx.Node) or w.target not in _DEQUANT:
            source = _read_from(w)  # the parameter's tags, also through a cast of it (w.type_as(x), w.float())
            real = ctx.example.get(source) if source is not None else None
            tagged = getattr(real, "_fp8fx_owners", {}).get(fqn) or getattr(real, "_fp8fx_skip_reason", None)
            if tagged:
                return f"{NOT_QUANTIZED}{tagged}"
            if _from_dequantize(w):
                return (f"weight is read through {_ops_to_dequantize(w)} of a quantized weight, not the quantized "
                        "weight itself: computed with the dequantized weight")
            of = getattr(real, "_fp8fx_of", None)
            if of:  # (fp8fx.weights.views: the eager read of an fp8 layer's weight)
                return (f"weight is {of} dequantized in eager code and passed in as a tensor, not the fp8 layer's "
                        "codes: computed with the dequantized weight; call the layer (or read its weight) inside the "
                        "compiled code")
            adapter = _PEFT_ADAPTER.search(fqn)
            if adapter:  # (quantize_ tags the adapters of a PEFT model it is given: these came after it)
                return (f"{NOT_QUANTIZED}an adapter layer (PEFT's {adapter.group(1)}) added after quantize_: adapters "
                        "stay in high precision, their base_layer is quantized")
            if ((input_path(source) or "").rpartition(".")[2] == "weight"  # (an nn.Linear's, not a raw parameter)
                    and _tags_lost(ctx) and any(n.target in _FP8_WEIGHT_OPS for n in w.graph.nodes)):
                # other layers of this graph are fp8, but none of their tensors carries fp8fx's tags: they were saved
                # and loaded (torch.export.save / load), and so was this weight, whose tag said why it kept high
                # precision. (A part quantized with a prefix keeps its tags: a layer outside it was never quantized.)
                return ("weight is not an fp8fx-quantized weight, in a graph whose other layers are: quantize_ or "
                        "load_checkpoint kept it in high precision (its reason, a tag of the tensor, is lost where "
                        "the tensor was saved and loaded, as by torch.export.save / load) or it was added after them")
            if (_in_linear_module(site) and input_path(source) == f"{fqn}.weight"
                    and any(n.target in _FP8_WEIGHT_OPS for n in w.graph.nodes)):
                # (outside the parts of a model quantized part by part, or put in after quantize_: transformers'
                # resize_token_embeddings replaces lm_head; the advice to run quantize_ met "already fp8-quantized" on
                # the model: h146)
                return ("weight is not an fp8fx-quantized weight, in a graph whose other layers are: a layer no "
                        "quantize_ call took (outside the parts quantized, or put in after quantize_: transformers' "
                        "resize_token_embeddings makes a new lm_head); quantize it on its own: "
                        f"fp8fx.quantize_(layer, config, prefix={fqn!r})")
            return ("weight is not an fp8fx-quantized weight (run fp8fx.quantize_ or load an fp8 checkpoint: they "
                    "quantize nn.Linear and transformers' Conv1D layers and experts modules, not a parameter another "
                    "module reads by F.linear)")
        wv = fake_value(w)
        if isinstance(wv, torch.Tensor) and wv.dim() != 2:
            return (f"weight is {wv.dim()}-D {list(wv.shape)}, not a linear's [N, K] (stacked experts are the "
                    "MoE pass's)")
        xv = fake_value(x)
        if (isinstance(xv, torch.Tensor) and xv.dtype not in _ACT_DTYPES and site is not None
                and getattr(wv, "dtype", xv.dtype) != xv.dtype):
            # a float64 / integer / float8 activation into a layer of another dtype (a bf16 model fed float64): torch's
            # linear refuses it, so it is a mixed-dtype site, which the pass refuses naming the layer, as it does a
            # float32 activation there. It was the float64 reference (the weight is no float64) or "not
            # bf16/fp16/fp32", and the call failed with torch's error naming no layer
            mixed = _mixed_dtypes(site, x, w, bias)
            if mixed:
                return mixed
        if (isinstance(xv, torch.Tensor) and xv.dtype == torch.float64
                and getattr(wv, "dtype", torch.float64) == torch.float64):  # model.double(): the exact reference
            return FLOAT64_REFERENCE
        if not isinstance(xv, torch.Tensor) or xv.dtype not in _ACT_DTYPES:
            return f"activation dtype {getattr(xv, 'dtype', None)} is not bf16/fp16/fp32"
        wrapped = compat.wrapped_tensor_kind(xv)
        if wrapped:  # (fp8fx's ops have no batching rule, and read a plain tensor's rows)
            return f"activation is {wrapped}, which fp8fx's ops do not take: torch's linear, on the dequantized weight"
        if xv.dim() < 1:
            return "activation is a scalar"
        bv = fake_value(bias)
        n = wv.shape[0] if isinstance(wv, torch.Tensor) else None
        if isinstance(bv, torch.Tensor) and (bv.dim() != 1 or n is not None and bv.shape[0] != n):
            # F.linear broadcasts a [1, N] bias; the fp8 ops take one value per output column
            return f"bias of shape {list(bv.shape)}, not [{n}]"
        # (the dequantized weight requires grad where its scale does: model.requires_grad_()). A site whose own value
        # records no history (a frozen layer under torch.no_grad() inside a forward traced with grad: a distillation
        # target) needs no autograd formula, whatever its inputs require
        records = getattr(fake_value(site), "requires_grad", True) if site is not None else True
        if records and any(getattr(v, "requires_grad", False) for v in (xv, wv, bv)) and may_record_grad(x.graph):
            return (
                "traced with autograd (activation, weight scale or bias requires grad); fp8fx rewrites inference: "
                "call the compiled model under torch.no_grad() or torch.inference_mode()"
            )
        return ""

    @staticmethod
    def _quantize(graph, x: fx.Node, input_scale, act_block, site: fx.Node, quantized: dict) -> tuple[fx.Node, fx.Node]:
        """Nodes (xq, x_scale) quantizing ``x``, inserted before its first rewritten consumer ``site``
        and shared by the later ones (through ``quantized``, one graph's cache)."""
        # (q_proj(x), k_proj(x.contiguous()): one quantization, so one fused GEMM; the first quantizes what it read)
        key = (_same_tensor(x, quantized.layout.hold), input_scale, tuple(act_block))
        # another node of the same memory in the same layout (q_proj(x.flatten(0, 1)), k_proj(x.view(-1, d))): the
        # same values, so the same quantization and, horizontally, one GEMM
        layout = quantized.layout.of(x)
        if key not in quantized and layout is not None:
            key = quantized.by_layout.get((layout, *key[1:]), key)
        if key in quantized:
            return quantized[key]
        if layout is not None:
            quantized.by_layout[(layout, *key[1:])] = key
        with graph.inserting_before(site):
            if input_scale is not None:
                xq = graph.call_function(torch.ops.fp8fx.quantize_static.default, (x, input_scale))
                set_fake_value(xq, torch.ops.fp8fx.quantize_static.default, xq.args)
                quantized[key] = (xq, input_scale)
                return quantized[key]
            qs = graph.call_function(torch.ops.fp8fx.quantize.default, (x, list(act_block)))
        set_fake_value(qs, torch.ops.fp8fx.quantize.default, qs.args)
        with graph.inserting_after(qs):
            x_scale = graph.call_function(operator.getitem, (qs, 1))
        with graph.inserting_after(qs):
            xq = graph.call_function(operator.getitem, (qs, 0))
        for i, n in enumerate((xq, x_scale)):
            if "example_value" in qs.meta:
                n.meta["example_value"] = qs.meta["example_value"][i]
        quantized[key] = (xq, x_scale)
        return xq, x_scale

    @staticmethod
    def _rewrite_weight_only(graph: fx.Graph, node: fx.Node, x: fx.Node, w: fx.Node, bias) -> tuple[str, fx.Node]:
        wq, w_scale, w_block = w.args[:3]
        out = fake_value(node)
        with graph.inserting_before(node):
            if isinstance(out, torch.Tensor) and out.dtype != fake_value(x).dtype:
                # the linear's own output dtype (e.g. bf16 under autocast with fp32 activations): the op computes
                # in its activations' dtype
                x = graph.call_method("to", (x, out.dtype))
                set_fake_value(x, torch.Tensor.to, x.args)
            args = (x, wq, w_scale, bias, list(w_block))
            y = graph.call_function(torch.ops.fp8fx.weight_only_mm.default, args)
        set_fake_value(y, torch.ops.fp8fx.weight_only_mm.default, args)
        _replace(graph, node, y)
        weight = weight_granularity_name(granularity_from_block(w_block, weight=True))
        return f"w:{weight} a:{fake_value(x).dtype} (weight-only)".replace("torch.", ""), y

    def _rewrite(self, graph: fx.Graph, node: fx.Node, x: fx.Node, w: fx.Node, bias,
                 quantized: dict) -> tuple[str, fx.Node]:
        wq, w_scale, w_block, _dtype, input_scale, act_block = dequant_args(w)
        act_block = act_block or [1, -1]
        out_dtype = fake_value(node).dtype  # what the linear returned (autocast may differ from x's)
        if input_scale is not None:
            act_block = [-1, -1]
        xq, x_scale = self._quantize(graph, x, input_scale, act_block, node, quantized)
        args = (xq, x_scale, wq, w_scale, bias, list(act_block), list(w_block), out_dtype, self.use_fast_accum)
        with graph.inserting_before(node):
            y = graph.call_function(torch.ops.fp8fx.scaled_mm.default, args)
        set_fake_value(y, torch.ops.fp8fx.scaled_mm.default, args)
        _replace(graph, node, y)
        scheme = LayerScheme(granularity_from_block(w_block, weight=True), granularity_from_block(act_block),
                             input_scale is not None)
        return str(scheme), y


def _ops_to_dequantize(node: fx.Node) -> str:
    """The ops between a weight and the dequantize it is read from, the weight's side first, each with what it does
    where that is a cast to another dtype or an index: ``float (call_method: a cast to float32)``."""
    ops = []
    while isinstance(node, fx.Node) and node.target not in _DEQUANT:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        what = node.op
        before, after = fake_value(node.args[0]), fake_value(node)
        if _cast_source(node) is not None and getattr(before, "dtype", None) != getattr(after, "dtype", None):
            what += f": a cast to {getattr(after, 'dtype', '?')}".replace("torch.", "")
        elif node.target in (operator.getitem, torch.select, torch.narrow) or node.target in ("select", "narrow"):
            what += ": an index or slice, e.g. one expert of stacked experts"
        ops.append(f"{target} ({what})")
        node = node.args[0]
    return " of ".join(ops)


def _replace(graph: fx.Graph, node: fx.Node, new: fx.Node) -> None:
    """``new`` takes ``node``'s place, its users and its source metadata (module stack, stack trace);
    the weight's dequantize (and transpose) that fed only ``node`` go with it. No graph-wide dead-code
    elimination: it would also drop Dynamo's in-place ``copy_`` / ``scatter_`` nodes, whose results
    nobody reads (DeepSeek-V3's attention and router produced NaN that way)."""
    new.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
    inputs = [a for a in node.all_input_nodes if a.op == "call_function" or a.op == "call_method"]
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    while inputs:
        producer = inputs.pop()
        if not producer.users and (producer.target in _DEQUANT or _transposed(producer) is not None
                                   or _noop_cast_source(producer) is not None):
            inputs.extend(a for a in producer.all_input_nodes if a.op in ("call_function", "call_method"))
            graph.erase_node(producer)
