"""Gated-MLP fusion for decode and prefill: gate, up, act * mul, its quantization and down as one op (SwiGLU, GeGLU).

Matches (after the linear pass), with the same ``xq`` / ``x_scale`` feeding gate and up::

    g = fp8fx.scaled_mm(xq, x_scale, w1, s1, None, x_block, w_block, dtype, fast)
    u = fp8fx.scaled_mm(xq, x_scale, w3, s3, None, x_block, w_block, dtype, fast)
    h = silu(g) * u                                     # or u * silu(g); GELU (erf or tanh) for silu; then
                                                        # ops that change no value (eval-mode dropout, a cast
                                                        # to h's own dtype, contiguous): taken away with it
    hq, h_scale = fp8fx.quantize(h, h_block)            # or fp8fx.quantize_static(h, s)
    y = fp8fx.scaled_mm(hq, h_scale, w2, s2, b2, h_block, w2_block, dtype, fast)

or gate and up as one merged layer (Phi-3's ``gate_up_proj``, vLLM's merged column layout: gate rows first)::

    gu = fp8fx.scaled_mm(xq, x_scale, w13, s13, None, x_block, w_block, dtype, fast)
    g, u = gu.chunk(2, dim=-1)                          # or torch.chunk / split(I) / split([I, I]) /
                                                        # gu[..., :I], gu[..., I:]; or
                                                        # u, g = ...: the activation on the second half

Rewrites to ``y = fp8fx.gated_mlp(xq, x_scale, w1, s1, w3, s3, w2, s2, b2, ...)`` (a merged layer's halves
as row views ``w13[:I]``, ``w13[I:]`` of its weight and per-channel scale), which runs two Triton
kernels on CUDA (``fp8fx.kernels.gated_mlp``): at decode sizes the step is weight streaming plus launch
gaps, and this drops the act * mul + quantization kernel and the split-K ticket zeroing from it.

Only where the graph's token count is static and at most ``fp8fx.ops.GATED_MAX_M`` (16: measured faster
there, slower at 64; larger batches keep the Triton / cuBLAS GEMMs with the quantization fused into the
producers by Inductor) and the scales are per-tensor / per-row - with h per token up to ``GATED_ROWS_MAX_M`` (64),
from ``GATED_ROWS_MIN_M`` (17) as three kernels, h quantized once between the two GEMMs; or at least
``fp8fx.ops.GATED_PREFILL_MIN_M``
(2048) with h quantized per token (``fp8fx.ops.gated_prefill_reason``), where the op runs the prefill kernels
(``fp8fx.kernels.gated_mlp.gated_prefill``: act * mul in the gate/up GEMM's epilogue, so g and u never reach
memory, then a streaming quantization of h and cuBLAS's down GEMM). With ``h_group`` (``Fp8Backend(mlp_h_group=G)``;
by default G = 32 at one token and 128 from two, ``auto_h_group``) a decode MLP's dynamic quantization of h becomes
one in 1 x G groups, made by the
first kernel's epilogue, and MLPs of up to ``GATED_GROUPS_MAX_M`` (64) tokens are fused. Every matched MLP that
is not fused says why in its three sites' report lines.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
from torch import fx

from fp8fx.config import granularity_from_block, weight_granularity_name
from fp8fx.ops import GATED_GROUPS_MAX_M, GATED_MAX_M, GATED_PREFILL_MIN_M, GATED_ROWS_MAX_M, GATED_ROWS_MIN_M
from fp8fx.ops import _tensor_or_row, gated_prefill_reason
from fp8fx.passes.base import Fp8Pass, PassContext, amend_sites, fake_value, restate_activation, set_fake_value
from fp8fx.passes.base import module_path, site_names
from fp8fx.passes.horizontal import share_static, static_epochs
from fp8fx.passes.linear import _cast_source, _name_of, _noop_cast_source
from fp8fx.report import Site

_SCALED_MM = torch.ops.fp8fx.scaled_mm.default
_QUANTIZE = torch.ops.fp8fx.quantize.default
_QUANTIZE_STATIC = torch.ops.fp8fx.quantize_static.default
_GATED = torch.ops.fp8fx.gated_mlp.default
_SILU = (torch.nn.functional.silu, torch.ops.aten.silu.default, torch.ops.aten.silu)
_GELU = (torch.nn.functional.gelu, torch.ops.aten.gelu.default, torch.ops.aten.gelu)
_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


@dataclasses.dataclass
class _Mlp:
    gate: fx.Node  # the gate GEMM, or the merged gate/up GEMM
    up: fx.Node  # the up GEMM, or the same merged one
    act: fx.Node
    mul: fx.Node
    quant: list[fx.Node]  # the quantization's nodes (quantize and its getitems, or quantize_static)
    down: fx.Node
    h_static: Optional[fx.Node]
    # merged: the chunk (none where the halves are indexed out), gate's and up's getitem
    halves: list[fx.Node] = dataclasses.field(default_factory=list)
    gate_half: int = 0  # merged: which half of the merged output the activation reads (vLLM's layout: the first)
    between: list[fx.Node] = dataclasses.field(default_factory=list)  # no-ops from the product to its quantization

    @property
    def merged(self) -> bool:
        return bool(self.halves)

    @property
    def gemms(self) -> list[fx.Node]:
        return [self.gate, self.down] if self.merged else [self.gate, self.up, self.down]


def _is_gemm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is _SCALED_MM


def _input(node: fx.Node):
    """An activation function's input: its first argument, positional or ``input=``."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _in_place(node: fx.Node) -> bool:
    return node.kwargs.get("inplace") is True or len(node.args) > 1 and node.args[1] is True


def _activation(node: fx.Node) -> Optional[str]:
    """The ``fp8fx.ops.GATED_ACTIVATIONS`` name of an out-of-place SiLU or GELU node, else None."""
    if _in_place(node):
        return None
    function = node.op == "call_function"
    if function and node.target in _SILU or node.op == "call_method" and node.target == "silu":
        return "silu"
    if function and node.target in _GELU or node.op == "call_method" and node.target == "gelu":
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _is_mul(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _MUL or node.op == "call_method" and node.target == "mul"


def _quantized(down: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node], Optional[fx.Node]]]:
    """(h, the quantization's nodes, static scale or None) when ``down`` reads a quantization of one tensor."""
    hq, h_scale = down.args[:2]
    if not isinstance(hq, fx.Node):
        return None
    if hq.op == "call_function" and hq.target is _QUANTIZE_STATIC and hq.args[1] is h_scale:
        return hq.args[0], [hq], h_scale
    getitem = lambda n, i: isinstance(n, fx.Node) and n.target is operator.getitem and n.args[1] == i  # noqa: E731
    if getitem(hq, 0) and getitem(h_scale, 1) and hq.args[0] is h_scale.args[0] and hq.args[0].target is _QUANTIZE:
        q = hq.args[0]
        return q.args[0], [q, hq, h_scale], None
    return None


_CHUNK = (torch.chunk, torch.split, torch.Tensor.chunk, torch.Tensor.split)


def _half(node) -> Optional[tuple[fx.Node, int, Optional[fx.Node]]]:
    """(GEMM, 0 or 1, the chunk / split node) when ``node`` is the first or second half of a GEMM's output cut
    in two along its last dim (``gu.chunk(2, -1)``, ``torch.split(gu, I, -1)``, ``split(gu, [I, I], -1)``), or
    (GEMM, 0 or 1, None) when it indexes that half out (``gu[..., :I]``, ``gu[..., I:]``), else None."""
    if isinstance(node, fx.Node) and node.target is operator.getitem and _is_gemm(node.args[0]):
        return _sliced_half(node)
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] in (0, 1)):
        return None
    cut = node.args[0]
    if not isinstance(cut, fx.Node) or not (cut.op == "call_function" and cut.target in _CHUNK
                                            or cut.op == "call_method" and cut.target in ("chunk", "split")):
        return None
    args = list(cut.args) + [None] * 3
    gemm = args[0] if cut.args else next((cut.kwargs[k] for k in ("input", "tensor", "self") if k in cut.kwargs), None)
    rest = args[1:] if cut.args else args  # the arguments after the tensor
    size = next((cut.kwargs[k] for k in ("chunks", "split_size_or_sections", "split_size") if k in cut.kwargs), rest[0])
    dim = cut.kwargs.get("dim", rest[1] if rest[1] is not None else 0)
    out = fake_value(gemm) if _is_gemm(gemm) else None
    if out is None or dim not in (-1, out.dim() - 1):
        return None
    width = out.shape[-1]
    is_chunk = cut.target in (torch.chunk, torch.Tensor.chunk, "chunk")
    halves = 2 if is_chunk else width // 2
    if isinstance(size, (list, tuple)) and not is_chunk:  # split(gu, [I, I]): the same two halves
        size = size[0] if len(size) == 2 and size[0] == size[1] else None
    if not isinstance(width, int) or width % 2 or size != halves:
        return None
    return gemm, node.args[1], cut


def _sliced_half(node: fx.Node) -> Optional[tuple[fx.Node, int, None]]:
    """`_half` of ``gemm[..., :W/2]`` / ``gemm[..., W/2:]`` (or ``[:, :W/2]`` with one full slice per other dim)."""
    gemm, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    out = fake_value(gemm)
    full = slice(None)
    if out is None or not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    if index[:-1] != (Ellipsis,) and (len(index) != out.dim() or any(i != full for i in index[:-1])):
        return None
    width = out.shape[-1]
    if not isinstance(width, int) or width % 2:
        return None
    start, stop = index[-1].start, index[-1].stop
    if not all(b is None or type(b) is int for b in (start, stop)):
        return None
    start, stop, _ = slice(start, stop).indices(width)  # gu[..., -I:] is gu[..., I:] (it was neither fused nor said)
    halves = {(0, width // 2): 0, (width // 2, width): 1}
    return (gemm, halves[(start, stop)], None) if (start, stop) in halves else None


def _gate_up(act_input, up) -> Optional[tuple[fx.Node, fx.Node, list[fx.Node], int]]:
    """(gate GEMM, up GEMM, [], 0) for two GEMMs, or (merged GEMM, the same, [chunk, gate's getitem, up's
    getitem], the gate's half: 0 or 1) for the two halves of one, else None."""
    if _is_gemm(act_input) and _is_gemm(up):
        return (act_input, up, [], 0) if act_input is not up else None  # act(g) * g: no gate/up pair
    gate, other = _half(act_input), _half(up)
    if gate and other and gate[1] != other[1] and gate[0] is other[0] and gate[2] is other[2]:
        cut = [gate[2]] if gate[2] is not None else []  # (indexed halves have no cut node)
        return gate[0], gate[0], [*cut, act_input, up], gate[1]
    return None


_DROPOUT = (torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default)


def _no_op(node: fx.Node) -> bool:
    """An op that returns its input's values (eval-mode dropout, a cast to the dtype it has or contiguous - the
    linear pass's ``_noop_cast_source`` - clone), which a fused MLP may take away."""
    if _noop_cast_source(node) is not None:
        return True
    source = node.all_input_nodes[0] if node.all_input_nodes else None
    out, src = fake_value(node), fake_value(source)
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dtype == src.dtype
            and out.shape == src.shape and out.device == src.device):
        return False
    if node.op == "call_function" and node.target in _DROPOUT:
        args = list(node.args) + [None] * 3
        p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
        train = node.kwargs.get("train", node.kwargs.get("training", args[2] if args[2] is not None else True))
        return train is False or p == 0
    return node.op == "call_method" and node.target == "clone" or node.op == "call_function" and node.target in (
        torch.clone, torch.Tensor.clone)


def _is_cast(node) -> bool:
    """A dtype cast (the linear pass's ``_cast_source``, ``contiguous`` aside)."""
    return _cast_source(node) is not None and node.target not in ("contiguous", torch.Tensor.contiguous)


def _product_behind(h) -> tuple[Optional[fx.Node], list[fx.Node]]:
    """(the two-factor product ``h`` is, or comes from through a few one-input ops, those ops in graph order)."""
    between: list[fx.Node] = []
    node = h
    for _ in range(4):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return None, []
        if _is_mul(node) and len(node.all_input_nodes) == 2:
            return (node, between[::-1]) if len(node.args) == 2 and not node.kwargs else (None, [])
        if len(node.all_input_nodes) != 1:  # (a product with a number, h * 0.5, is one: it blocks the fusion)
            return None, []
        between.append(node)
        node = node.all_input_nodes[0]
    return None, []


def _match(down: fx.Node) -> tuple[Optional[_Mlp], str]:
    """(the gated MLP ending in ``down``, "") - the structure only, `_why_not` checks the rest - or, for
    ``down(act(gate(x)) * up(x))`` with another activation than an out-of-place SiLU or GELU, or ops between
    the product and ``down`` other than no-ops (``_no_op``), (it, why it is not fused); (None, "") for anything
    else."""
    found = _quantized(down)
    if found is None:
        return None, ""
    h, quant, h_static = found
    h, between = _product_behind(h)
    if h is None:
        return None, ""
    mlp, reason = _match_product(h, quant, down, h_static)
    if mlp is None:
        return None, ""
    mlp.between = between
    blocking = next((n for n in between if not _no_op(n)), None)
    if blocking is not None and not reason:
        reason = (f"{_name_of(blocking)} between act(gate) * up and the down projection (the fused MLP quantizes the "
                  "product as it is)")
    return mlp, reason


def _match_product(h: fx.Node, quant, down: fx.Node, h_static) -> tuple[Optional[_Mlp], str]:
    """`_match` from the product ``h`` of the activation and up."""
    for act, up in (h.args, reversed(h.args)):
        found = _gate_up(_input(act), up) if isinstance(act, fx.Node) and act.op in (
            "call_function", "call_method") else None
        if found:
            gate, up_gemm, halves, gate_half = found
            mlp = _Mlp(gate, up_gemm, act, h, quant, down, h_static, halves, gate_half)
            if _activation(act):
                return mlp, ""
            if len(act.all_input_nodes) > 1:  # (g * sigmoid(g): an op of several inputs, the last of a written-out act)
                return mlp, "the activation is several ops, not one SiLU or GELU op (what the fused MLP takes)"
            what = _name_of(act) + (" in place" if _in_place(act) else "")
            return mlp, f"the activation is {what}; the fused MLP takes SiLU or GELU (out of place)"
    for act, up in (h.args, reversed(h.args)):  # act(g) written as several ops (gelu_new: 0.5 * g * (1 + tanh..))
        if not isinstance(act, fx.Node) or _is_gemm(act) or _half(act):
            continue
        gate = _gemm_behind(act)
        up_gemm = up if _is_gemm(up) or _half(up) or not isinstance(up, fx.Node) else _gemm_behind(up, 2)
        found = _gate_up(gate, up_gemm) if gate is not None else None
        # gate and up read the same activation (with static scales each quantizes it apart, with its own scale)
        if found and (found[0].args[:2] == found[1].args[:2] or _quantized_source(found[0].args[0]) is not None
                      and _quantized_source(found[0].args[0]) is _quantized_source(found[1].args[0])):
            mlp = _Mlp(found[0], found[1], act, h, quant, down, h_static, found[2], found[3])
            if up_gemm is not up or _activation(act):  # an op on up's way, or one activation op on gate's
                extra = up if up_gemm is not up else _input(act)
                why = (" (the fused MLP computes act(gate) * up in the projections' dtype)" if _is_cast(extra) else
                       " (the fused MLP takes act(gate) * up as it is)")
                several = "" if _activation(act) else "; and the activation is several ops, not one SiLU or GELU op"
                return mlp, f"{_name_of(extra)} between a projection and the product{why}{several}"
            return mlp, "the activation is several ops, not one SiLU or GELU op (what the fused MLP takes)"
    return None, ""


_HP_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear.default)
_IN_PLACE_MUL = (operator.imul, torch.Tensor.mul_, torch.ops.aten.mul_.Tensor)


def _in_place_mul(node) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_function" and node.target in _IN_PLACE_MUL
                                          or node.op == "call_method" and node.target == "mul_")


def _projection(node) -> Optional[tuple[str, fx.Node]]:
    """("fp8", the GEMM) for an fp8fx GEMM or half of one, ("high", the call) for a linear left in high precision."""
    half = _half(node)
    if _is_gemm(node) or half:
        return "fp8", half[0] if half else node
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _HP_LINEAR:
        return "high", node
    return None


def _projection_input(kind: str, node: fx.Node) -> Optional[fx.Node]:
    """The tensor a projection reads: an fp8 GEMM's quantized input (``_quantized_source``), a linear's first
    argument."""
    if kind == "fp8":
        return _quantized_source(node.args[0])
    x = node.args[0] if node.args else node.kwargs.get("input")
    return x if isinstance(x, fx.Node) else None


def _reader_projection(node: fx.Node, writer: Optional[fx.Node] = None) -> Optional[tuple[str, fx.Node]]:
    """The projection that reads ``node`` (through one-reader ops: casts, dropout, the fp8 quantization), else None;
    ``writer``: an in-place op on ``node``, not counted among its readers."""
    for _ in range(5):
        users = [u for u in node.users if u is not writer]
        gemms = [g for u in users for g in ([u] if _is_gemm(u) else u.users if u.target is operator.getitem else ())
                 if _is_gemm(g)]
        if users and node.target in (_QUANTIZE, _QUANTIZE_STATIC) and gemms:  # (quantize's getitems, then the GEMM)
            return "fp8", gemms[0]
        if len(users) != 1:
            return None
        (user,) = users
        found = _projection(user)
        if found and found[0] == "high" and user.args[:1] == (node,):
            return found
        if user.op not in ("call_function", "call_method") or len(user.all_input_nodes) != 1 and not (
                user.target in (_QUANTIZE, _QUANTIZE_STATIC)):
            return None
        node = user
    return None


def _quantized_source(xq) -> Optional[fx.Node]:
    """The tensor a GEMM's fp8 activation ``xq`` quantizes (``quantize``'s codes through their getitem, or
    ``quantize_static``'s), else None."""
    q = xq.args[0] if isinstance(xq, fx.Node) and xq.target is operator.getitem else xq
    if isinstance(q, fx.Node) and q.target in (_QUANTIZE, _QUANTIZE_STATIC) and isinstance(q.args[0], fx.Node):
        return q.args[0]
    return None


def _note_unmatched(graph: fx.Graph, ctx: PassContext) -> None:
    """Gated MLPs ``down(act(gate(x)) * up(x))`` that ``_match`` does not take, said on their fp8 GEMMs' sites (they
    were declined with no word): one of the three projections left in high precision (ignored_layers, a layer the
    model keeps), or the product taken in place (``h *= up(x)``, ``h.mul_(up(x))``). GEMMs a note of this pass
    names already are left as they are."""
    said = {n for n in graph.nodes if "fp8fx_site" in n.meta
            and "gated MLP" in ctx.report.sites[n.meta["fp8fx_site"]].scheme}
    for mul in list(graph.nodes):
        if not (_is_mul(mul) or _in_place_mul(mul)) or len(mul.args) != 2 or len(mul.all_input_nodes) != 2:
            continue
        for act, up in (mul.args, reversed(mul.args)):
            if not (isinstance(act, fx.Node) and act.op in ("call_function", "call_method") and _activation(act)):
                continue
            # (h.mul_(u) with its result unread: the projection reads the activation's tensor, written in place)
            down = _reader_projection(mul) or (_reader_projection(act, mul) if _in_place_mul(mul) else None)
            between = None
            if down is None and not _in_place_mul(mul):  # (h * mask: an op of another input before down)
                down, between = _projection_past(mul)
            parts = [_projection(_input(act)), _projection(up), down]
            if None in parts:
                continue
            x = _projection_input(*parts[0])
            if x is None or x is not _projection_input(*parts[1]):  # (gate and up of one x: else no gated MLP to fuse)
                continue
            fp8 = list(dict.fromkeys(n for kind, n in parts if kind == "fp8"))
            high = [module_path(n) or _name_of(n) for kind, n in parts if kind == "high"]
            if not fp8 or any(n in said for n in fp8):
                continue
            if high:
                why = (f"{', '.join(high)} {'is' if len(high) == 1 else 'are'} no fp8 GEMM (left in high precision: "
                       "its row says why), and the fused MLP runs gate, up and down in fp8")
            elif between is not None:
                why = (f"{_name_of(between)} between act(gate) * up and the down projection (the fused MLP quantizes "
                       "the product as it is)")
            elif _in_place_mul(mul):
                why = (f"act(gate) * up is taken in place ({_name_of(mul)}); the fused MLP takes the product out of "
                       "place (h = act(gate) * up)")
            else:
                continue
            amend_sites(ctx, fp8, f"not fused into a gated MLP ({site_names(ctx, fp8)}): {why}")
            said.update(fp8)
            break


def _projection_past(node: fx.Node) -> tuple[Optional[tuple[str, fx.Node]], Optional[fx.Node]]:
    """(the projection that reads ``node`` a few sole-reader ops on, the first of those ops that takes another tensor
    too: ``h * mask``), or (None, None) where there is no such op (``_reader_projection`` has those) or projection."""
    first = None
    for _ in range(4):
        if len(node.users) != 1:
            return None, None
        (user,) = node.users
        if user.op not in ("call_function", "call_method") or _projection(user) or _is_gemm(user):
            return None, None
        if first is None and len(user.all_input_nodes) > 1:
            first = user
        found = _reader_projection(user) if first is not None else None
        if found:
            return found, first
        node = user
    return None, None


def _gemm_behind(node: fx.Node, depth: int = 6) -> Optional[fx.Node]:
    """A GEMM (or half of one) that ``node`` is computed from, a few ops back, else None."""
    frontier, seen = [node], set()
    for _ in range(depth):
        ahead = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if _is_gemm(a) or _half(a):
                    return a
                ahead.append(a)
        frontier = ahead
    return None


def _rows(mlp: _Mlp) -> Optional[int]:
    """The MLP's static token count, None where it is dynamic."""
    rows = 1
    for d in fake_value(mlp.gate.args[0]).shape[:-1]:
        if not isinstance(d, int):
            return None
        rows *= d
    return rows


def _prefill_reason(mlp: _Mlp) -> str:
    """``fp8fx.ops.gated_prefill_reason`` for the matched MLP (its static token count, shapes, blocks, dtypes and the
    weights' device)."""
    gate, down = mlp.gate, mlp.down
    w1 = fake_value(gate.args[2])
    return gated_prefill_reason(_rows(mlp) or 0, w1.shape[1], w1.shape[0] // (2 if mlp.merged else 1),
                                fake_value(down.args[2]).shape[0], *gate.args[5:7], *down.args[5:7], mlp.h_static,
                                fake_value(mlp.mul).dtype, down.args[7], w1.device)


def auto_h_group(rows: Optional[int]) -> int:
    """The 1 x G groups of h that ``Fp8Backend(mlp_h_group="auto")``, the default, takes for a decode MLP of
    ``rows`` tokens: 32 at one token, 128 from two. Llama-3-8B's MLP on the H200, CUDA-graph replays: at one token
    1 x 32 groups were the fastest fused MLP (the op 0.0495 ms against 0.0507 with per-token h, run 19; the block
    0.0532 against 0.0543 with 1 x 128 groups and 0.0542 per token, run 21), and slow at 16 tokens (0.0725 against
    0.0578: the down GEMM's K steps of 32); 1 x 128 groups were faster than per-token h at each of 2-64 tokens
    timed (run 31). Finer groups are also closer to the float32 MLP (benchmarks/bench_linear.py's MLP, N(0, 1/K)
    weights, 1 / 16 / 64 tokens, fp8fx's CPU kernels: 1 x 32 0.0617 / 0.0629 / 0.0627 relative error, 1 x 128 0.0639
    / 0.0641 / 0.0639, per token 0.0655 / 0.0655 / 0.0654; the run-31 figures, 0.061-0.065, were of a near-linear MLP
    whose weights were scaled twice, h183)."""
    return 32 if rows == 1 else 128


def _static_shareable(mlp: _Mlp, epochs: dict) -> bool:
    """gate and up quantize the same x with static scales of their own, with no in-place write that may reach x
    between the two quantizations (``static_epochs``): one quantization with the larger scale may serve both."""
    a, b = mlp.gate.args[0], mlp.up.args[0]
    return (a is not b and all(isinstance(q, fx.Node) and q.target is _QUANTIZE_STATIC for q in (a, b))
            and a.args[0] is b.args[0] and epochs.get(a) == epochs.get(b) is not None)


class GatedMlpPass(Fp8Pass):
    """``h_group``: quantize a fused MLP's intermediate in 1 x ``h_group`` groups where the graph quantizes it
    dynamically (per token or per tensor; a static scale stays), which fuses up to ``GATED_GROUPS_MAX_M`` tokens;
    ``"auto"``: the groups ``auto_h_group`` picks for the MLP's token count."""

    def __init__(self, enabled: bool, h_group: Union[int, None, str] = None):
        self.enabled = enabled
        self.h_group = h_group

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if not self.enabled:  # opt-in (Fp8Backend(fuse_mlp=True)): sites keep their scheme as it is
            return 0
        fused = 0
        epochs = static_epochs(gm.graph)  # (gate and up quantizing x with static scales of their own: one may do)
        for node in list(gm.graph.nodes):
            mlp, reason = _match(node) if _is_gemm(node) else (None, "")
            if mlp is None:
                continue
            names = site_names(ctx, mlp.gemms)
            prefill_why = reason or _prefill_reason(mlp)  # "": the op will run the prefill kernels
            # h in groups is for decode (the Triton down GEMM reads them); prefill's cuBLAS down takes h per token
            h_group = auto_h_group(_rows(mlp)) if self.h_group == "auto" else self.h_group
            group = h_group if h_group and mlp.h_static is None and prefill_why else None
            static_kept = bool(self.h_group) and mlp.h_static is not None  # a calibrated scale stays as it is
            per_token = mlp.h_static is None and list(mlp.down.args[5]) == [1, -1]
            h_mode = "groups" if group else "per token" if per_token else ""
            shared = _static_shareable(mlp, epochs)
            reason = reason or self._why_not(mlp, h_mode, static_kept, prefill_why, shared)
            if reason:
                amend_sites(ctx, mlp.gemms, f"not fused into a gated MLP ({names}): {reason}")
                continue
            if shared:  # x quantized once, with the larger of gate's and up's scales (as the horizontal pass does)
                share_static(gm, [mlp.gate, mlp.up])
            three = h_mode == "per token" and (_rows(mlp) or 0) >= GATED_ROWS_MIN_M  # (before _fuse erases gate)
            new = self._fuse(gm.graph, mlp, group)
            how = (f", h in 1x{group} groups" if group else
                   ", h's static scale kept: mlp_h_group applies to dynamic ones" if static_kept else "")
            what = ("prefill: act * mul in the gate/up GEMM's epilogue, h quantized per token, cuBLAS down"
                    if not prefill_why else
                    "3 kernels: act * mul in the gate/up GEMM's epilogue, h quantized per token, the down GEMM"
                    if three else f"2 kernels{how}")
            what += ", x at the larger of gate's and up's static input scales" if shared else ""  # (in every form)
            if group:  # the down GEMM reads h in groups now, where the graph had it per token or per tensor
                restate_activation(ctx, mlp.down, f"per-group(1x{group})")
            amend_sites(ctx, mlp.gemms, f"fused({names}: gated MLP, {what})", node=Site.origin_of(new))
            fused += len(mlp.gemms)
        _note_unmatched(gm.graph, ctx)
        gm.recompile()
        return fused

    @staticmethod
    def _why_not(mlp: _Mlp, h_mode: str, static_kept: bool, prefill_why: str, shared: bool = False) -> str:
        """Why the matched MLP is not fused ("" where it is); ``h_mode``: "groups" (``h_group``), "per token" (h's
        dynamic per-token scale) or "" (per tensor, static), which sets the most decode tokens fused;
        ``prefill_why``: ``_prefill_reason(mlp)``; ``shared``: gate's and up's static quantizations of x will be
        one (``_static_shareable``)."""
        max_rows = {"groups": GATED_GROUPS_MAX_M, "per token": GATED_ROWS_MAX_M}.get(h_mode, GATED_MAX_M)
        gate, up, down = mlp.gate, mlp.up, mlp.down
        static = [n.args[0].target is _QUANTIZE_STATIC for n in (gate, up) if isinstance(n.args[0], fx.Node)]
        if gate.args[:2] != up.args[:2] and static == [True, True] and not shared and (
                gate.args[0].args[0] is up.args[0].args[0]):
            return ("gate and up quantize x with their own static input scales, apart (an in-place write that may "
                    "reach x in between)")
        if gate.args[:2] != up.args[:2] and not shared:
            kinds = ["a static scale" if isinstance(n.args[0], fx.Node) and n.args[0].target is _QUANTIZE_STATIC
                     else "a dynamic one" for n in (gate, up)]
            sources = [_quantized_source(n.args[0]) for n in (gate, up)]
            if kinds[0] != kinds[1] and sources[0] is sources[1] is not None:  # (one x, quantized two ways)
                return f"gate quantizes x with {kinds[0].replace('one', 'scale')} and up with {kinds[1]}"
            return "gate and up read different activations or quantize them differently"
        names = ("x's scale blocks", "weight scales", "output dtype", "use_fast_accum")
        for what, a, b in zip(names, gate.args[5:], up.args[5:]):
            if a != b:
                if what == "weight scales":
                    a, b = (weight_granularity_name(granularity_from_block(list(v), weight=True)) for v in (a, b))
                return f"gate and up differ in {what}: {a} where up has {b}"
        if gate.args[5:] != up.args[5:]:  # (an argument one gives and the other leaves to its default)
            return "gate and up differ in their GEMMs' arguments (scale blocks, output dtype or use_fast_accum)"
        if gate.args[4] is not None or up.args[4] is not None:
            return "gate or up has a bias"
        if fake_value(gate.args[2]).shape != fake_value(up.args[2]).shape:
            return "gate and up weights differ in shape"
        if mlp.merged and fake_value(gate.args[3]).numel() not in (1, fake_value(gate.args[2]).shape[0]):
            return "the merged gate/up layer's scale is neither per-tensor nor per-channel"
        x_block, w_block = gate.args[5:7]
        h_block, w2_block = down.args[5:7]
        if not (_tensor_or_row(x_block, w_block) and _tensor_or_row(h_block, w2_block)):
            return (f"blocks x {list(x_block)}, w {list(w_block)}, h {list(h_block)}, down {list(w2_block)}: "
                    "per-tensor / per-row scales only")
        sole = lambda n, user: list(n.users) == [user]  # noqa: E731
        quantize, outputs = mlp.quant[0], mlp.quant[1:] or mlp.quant  # what only down may read
        if mlp.merged:  # gu -> chunk -> (gate half -> act, up half -> mul), or gu -> (gu[..., :I], gu[..., I:])
            *cut, first, second = mlp.halves
            gate_ok = (sole(gate, cut[0]) and set(cut[0].users) == {first, second} if cut else
                       set(gate.users) == {first, second}) and sole(first, mlp.act)
            up_ok = sole(second, mlp.mul)
        else:
            gate_ok, up_ok = sole(gate, mlp.act), sole(up, mlp.mul)
        chain = [mlp.mul, *mlp.between, quantize]  # the product, the no-ops after it, its quantization
        if not (gate_ok and up_ok and sole(mlp.act, mlp.mul) and all(sole(a, b) for a, b in zip(chain, chain[1:]))
                and all(sole(n, down) for n in outputs) and set(quantize.users) <= set(outputs) | {down}):
            return "an intermediate (gate, up, act, their product or its quantization) has another reader"
        rows = _rows(mlp)
        if rows is None:  # (named: a [1, s, H] decode input's batch dim is static already, its sequence dim is not)
            shape = fake_value(mlp.gate.args[0]).shape
            dims = [i for i, d in enumerate(shape[:-1]) if not isinstance(d, int)]
            which = f"dim {dims[0]}" if len(dims) == 1 else f"dims {', '.join(map(str, dims))}"
            return (f"the token count is dynamic ({which} of the MLP's input {list(shape)}): graphs with a static one "
                    f"are fused, decode up to {max_rows} tokens and prefill from {GATED_PREFILL_MIN_M} "
                    f"(torch.compile(..., dynamic=False), or torch._dynamo.mark_static on the input dim that gives "
                    f"{'it' if len(dims) == 1 else 'them'})")
        prefill = prefill_why if rows >= GATED_PREFILL_MIN_M else ""
        if rows >= GATED_PREFILL_MIN_M and not prefill:
            return ""
        if not 0 < rows <= max_rows:
            if h_mode == "groups":
                why = f"with h in 1 x G groups, up to the Triton GEMMs' {GATED_GROUPS_MAX_M}"
            elif h_mode == "per token":
                why = f"with per-token h, up to the Triton GEMMs' {GATED_ROWS_MAX_M}"
            elif static_kept:
                why = ("h has a static scale, which mlp_h_group leaves as it is; with it the fused MLP was slower "
                       "than the unfused GEMMs at 64 on the H200")
            else:
                why = ("with h per tensor or by a static scale, which each N tile of the down GEMM applies to all of "
                       "h: slower than the unfused GEMMs at 64 on the H200; per-token h and "
                       f"Fp8Backend(mlp_h_group=128) fuse up to {GATED_GROUPS_MAX_M}")
            return (f"{rows} tokens: the fused MLP is for 1-{max_rows} tokens ({why}) and from {GATED_PREFILL_MIN_M}"
                    f"{' but ' + prefill if prefill else ''}; other batches keep the GEMMs with each quantization "
                    "fused into its producer")
        return ""

    @staticmethod
    def _fuse(graph: fx.Graph, mlp: _Mlp, h_group: Optional[int] = None) -> fx.Node:
        gate, up, down = mlp.gate, mlp.up, mlp.down
        xq, x_scale, w1, s1, _, x_block, w_block, _, fast = gate.args
        w3, s3 = up.args[2:4]
        _, _, w2, s2, bias, h_block, w2_block, out_dtype, _ = down.args
        h_block = [1, h_group] if h_group else h_block  # the dynamic scale becomes one per group
        h_dtype = fake_value(mlp.mul).dtype  # the model's act * mul dtype (autocast may differ from gate's)
        with graph.inserting_before(down):
            if mlp.merged:  # gate's rows and up's: [:I] and [I:] of the weight and of a per-channel scale, or
                # the other way round where the activation reads the second half
                halves = (mlp.gate_half, 1 - mlp.gate_half)
                (w1, s1), (w3, s3) = (GatedMlpPass._rows(graph, w1, s1, half) for half in halves)
            args = (xq, x_scale, w1, s1, w3, s3, w2, s2, bias, list(x_block), list(w_block), list(h_block),
                    list(w2_block), mlp.h_static, _activation(mlp.act), h_dtype, out_dtype, fast)
            new = graph.call_function(_GATED, args)
        set_fake_value(new, _GATED, args)
        new.meta.update({k: v for k, v in down.meta.items() if k not in ("example_value", "val")})
        down.replace_all_uses_with(new)
        for node in [down, *reversed(mlp.quant), *reversed(mlp.between), mlp.mul, mlp.act, *reversed(mlp.halves), up]:
            graph.erase_node(node)
        if not mlp.merged:
            graph.erase_node(gate)
        return new

    @staticmethod
    def _rows(graph: fx.Graph, w: fx.Node, scale, half: int) -> tuple[fx.Node, object]:
        """Nodes for half ``half`` (0: the first rows) of a merged weight and its scale (a per-tensor scale
        serves both halves as it is)."""
        rows = fake_value(w).shape[0] // 2
        parts = []
        for t in (w, scale):
            if t is scale and fake_value(scale).numel() == 1:
                parts.append(scale)
                continue
            node = graph.call_function(torch.narrow, (t, 0, half * rows, rows))
            set_fake_value(node, torch.narrow, node.args)
            parts.append(node)
        return parts[0], parts[1]
