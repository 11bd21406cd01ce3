"""Gated-MLP fusion for decode: gate, up, act * mul, its quantization and down as one op.

Matches (after the linear pass), with the same ``xq`` / ``x_scale`` feeding gate and up::

    g = fp8fx.scaled_mm(xq, x_scale, w1, s1, None, x_block, w_block, dtype, fast)
    u = fp8fx.scaled_mm(xq, x_scale, w3, s3, None, x_block, w_block, dtype, fast)
    h = silu(g) * u                                     # or u * silu(g)
    hq, h_scale = fp8fx.quantize(h, h_block)            # or fp8fx.quantize_static(h, s)
    y = fp8fx.scaled_mm(hq, h_scale, w2, s2, b2, h_block, w2_block, dtype, fast)

Rewrites to ``y = fp8fx.gated_mlp(xq, x_scale, w1, s1, w3, s3, w2, s2, b2, ...)``, which runs two Triton
kernels on CUDA (``fp8fx.kernels.gated_mlp``): at decode sizes the step is weight streaming plus launch
gaps, and this drops the act * mul + quantization kernel and the split-K ticket zeroing from it.

Only where the graph's token count is static and at most ``fp8fx.ops.GATED_MAX_M`` (16: measured faster
there, slower at 64; larger batches keep the Triton / cuBLAS GEMMs with the quantization fused into the
producers by Inductor) and the scales are per-tensor / per-row. Every matched MLP that is not fused says
why in its three sites' report lines.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
from torch import fx

from fp8fx.ops import GATED_MAX_M, _tensor_or_row
from fp8fx.passes.base import Fp8Pass, PassContext, amend_sites, fake_value, set_fake_value
from fp8fx.passes.linear import _name_of
from fp8fx.report import Site

_SCALED_MM = torch.ops.fp8fx.scaled_mm.default
_QUANTIZE = torch.ops.fp8fx.quantize.default
_QUANTIZE_STATIC = torch.ops.fp8fx.quantize_static.default
_GATED = torch.ops.fp8fx.gated_mlp.default
_SILU = (torch.nn.functional.silu, torch.ops.aten.silu.default, torch.ops.aten.silu)
_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


@dataclasses.dataclass
class _Mlp:
    gate: fx.Node
    up: fx.Node
    act: fx.Node
    mul: fx.Node
    quant: list[fx.Node]  # the quantization's nodes (quantize and its getitems, or quantize_static)
    down: fx.Node
    h_static: Optional[fx.Node]

    @property
    def gemms(self) -> list[fx.Node]:
        return [self.gate, self.up, self.down]


def _is_gemm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is _SCALED_MM


def _input(node: fx.Node):
    """An activation function's input: its first argument, positional or ``input=``."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _in_place(node: fx.Node) -> bool:
    return node.kwargs.get("inplace") is True or len(node.args) > 1 and node.args[1] is True


def _is_silu(node: fx.Node) -> bool:
    if _in_place(node):
        return False
    return node.op == "call_function" and node.target in _SILU or node.op == "call_method" and node.target == "silu"


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


def _match(down: fx.Node) -> tuple[Optional[_Mlp], str]:
    """(the gated MLP ending in ``down``, "") - the structure only, `_why_not` checks the rest - or, for
    ``down(act(gate(x)) * up(x))`` with another activation than an out-of-place SiLU, (it, why it is not
    fused); (None, "") for anything else."""
    found = _quantized(down)
    if found is None:
        return None, ""
    h, quant, h_static = found
    if not isinstance(h, fx.Node) or not _is_mul(h) or len(h.args) != 2 or h.kwargs:
        return None, ""
    for act, up in (h.args, reversed(h.args)):
        if isinstance(act, fx.Node) and act.op in ("call_function", "call_method") and _is_gemm(_input(act)) \
                and _is_gemm(up):
            mlp = _Mlp(_input(act), up, act, h, quant, down, h_static)
            if _is_silu(act):
                return mlp, ""
            what = _name_of(act) + (" in place" if _in_place(act) else "")
            return mlp, f"the activation is {what}; the fused MLP takes SiLU (out of place)"
    return None, ""


class GatedMlpPass(Fp8Pass):
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if not self.enabled:  # opt-in (Fp8Backend(fuse_mlp=True)): sites keep their scheme as it is
            return 0
        fused = 0
        for node in list(gm.graph.nodes):
            mlp, reason = _match(node) if _is_gemm(node) else (None, "")
            if mlp is None:
                continue
            names = ",".join(self._name(n, ctx) for n in mlp.gemms)
            reason = reason or self._why_not(mlp)
            if reason:
                amend_sites(ctx, mlp.gemms, f"not fused into a gated MLP ({names}): {reason}")
                continue
            new = self._fuse(gm.graph, mlp)
            amend_sites(ctx, mlp.gemms, f"fused({names}: gated MLP, 2 kernels)", node=Site.origin_of(new))
            fused += 3
        gm.recompile()
        return fused

    @staticmethod
    def _why_not(mlp: _Mlp) -> str:
        gate, up, down = mlp.gemms
        static = [n.args[0].target is _QUANTIZE_STATIC for n in (gate, up) if isinstance(n.args[0], fx.Node)]
        if gate.args[:2] != up.args[:2] and static == [True, True]:
            return "gate and up have their own static input scales (x is quantized once for each)"
        if gate.args[:2] != up.args[:2] or gate.args[5:] != up.args[5:]:
            return "gate and up read different activations or quantize them differently"
        if gate.args[4] is not None or up.args[4] is not None:
            return "gate or up has a bias"
        if fake_value(gate.args[2]).shape != fake_value(up.args[2]).shape:
            return "gate and up weights differ in shape"
        x_block, w_block = gate.args[5:7]
        h_block, w2_block = down.args[5:7]
        if not (_tensor_or_row(x_block, w_block) and _tensor_or_row(h_block, w2_block)):
            return (f"blocks x {list(x_block)}, w {list(w_block)}, h {list(h_block)}, down {list(w2_block)}: "
                    "per-tensor / per-row scales only")
        sole = lambda n, user: list(n.users) == [user]  # noqa: E731
        quantize, outputs = mlp.quant[0], mlp.quant[1:] or mlp.quant  # what only down may read
        if not (sole(gate, mlp.act) and sole(mlp.act, mlp.mul) and sole(up, mlp.mul) and sole(mlp.mul, quantize)
                and all(sole(n, down) for n in outputs) and set(quantize.users) <= set(outputs) | {down}):
            return "an intermediate (gate, up, act, their product or its quantization) has another reader"
        rows = 1
        for d in fake_value(gate.args[0]).shape[:-1]:
            if not isinstance(d, int):
                return ("the token count is dynamic: decode graphs with a static batch are fused (torch.compile(..., "
                        "dynamic=False), or torch._dynamo.mark_static on the batch dimension)")
            rows *= d
        if not 0 < rows <= GATED_MAX_M:
            return (f"{rows} tokens: the fused MLP is for 1-{GATED_MAX_M} tokens (slower than the unfused GEMMs at 64 "
                    "on the H200); larger batches keep the GEMMs with each quantization fused into its producer")
        return ""

    @staticmethod
    def _fuse(graph: fx.Graph, mlp: _Mlp) -> fx.Node:
        gate, up, down = mlp.gemms
        xq, x_scale, w1, s1, _, x_block, w_block, _, fast = gate.args
        _, _, w2, s2, bias, h_block, w2_block, out_dtype, _ = down.args
        h_dtype = fake_value(mlp.mul).dtype  # the model's act * mul dtype (autocast may differ from gate's)
        args = (xq, x_scale, w1, s1, up.args[2], up.args[3], w2, s2, bias, list(x_block), list(w_block),
                list(h_block), list(w2_block), mlp.h_static, "silu", h_dtype, out_dtype, fast)
        with graph.inserting_before(down):
            new = graph.call_function(_GATED, args)
        set_fake_value(new, _GATED, args)
        new.meta.update({k: v for k, v in down.meta.items() if k not in ("example_value", "val")})
        down.replace_all_uses_with(new)
        for node in [down, *reversed(mlp.quant), mlp.mul, mlp.act, up, gate]:
            graph.erase_node(node)
        return new

    @staticmethod
    def _name(node: fx.Node, ctx: PassContext) -> str:
        i = node.meta.get("fp8fx_site")
        return node.name if i is None else ctx.report.sites[i].fqn.rsplit(".", 1)[-1]
