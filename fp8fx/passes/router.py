"""Router pass: an MoE router's linear (kept in high precision) to ``fp8fx.small_mm``, one launch at decode.

Matches (Dynamo torch IR) every linear whose weight is an MoE router's, as ``quantize_`` / ``load_checkpoint`` tag it
(``fp8fx.weights.moe.routers``: "routes tokens to ..." or a shared expert's gate; the linear pass reports that site as
not quantized)::

    logits = torch._C._nn.linear(x, w, b)            # or F.linear; Nemotron-H's: F.linear(x.float(), w.float())

and rewrites it to::

    logits = fp8fx.small_mm(x, w, b, dtype)          # F.linear's dtype; float32 casts of 16-bit x or w (Nemotron-H's)
                                                     # left to the kernel, which casts as it loads

which computes the same linear: on CUDA up to 4 rows of x in one Triton launch (``fp8fx.kernels.small_mm``), where
cuBLAS took 4.2-6.1 us at one token (H200, benchmarks/RESULTS.md run 51), and torch's linear for more rows. The
router's report site keeps its reason (not quantized, by design); its kernel column then names ``fp8fx.small_mm``.
A router linear left as it is says why in a debug log line (the linear pass's site already stands for it).
"""
from __future__ import annotations

import logging

import torch
from torch import fx

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx import quant
from fp8fx.passes.base import NodePass, PassContext, fake_value, float32_source, replace_node
from fp8fx.passes.linear import _LINEAR, _read_from
from fp8fx.weights.moe import is_router_reason

log = logging.getLogger("fp8fx")


def _router_weight(w, ctx: PassContext) -> bool:
    source = _read_from(w)
    real = ctx.example.get(source) if isinstance(source, fx.Node) else None
    return is_router_reason(getattr(real, "_fp8fx_skip_reason", None))


def _reason(node: fx.Node, x, w, bias, records_grad: bool) -> str:
    xv, wv, bv, out = fake_value(x), fake_value(w), fake_value(bias), fake_value(node)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.dim() < 1 or wv.dim() != 2:
        return "not a linear of a tensor by a 2-D weight"
    if wv.dtype not in quant.HIGH_PRECISION or xv.dtype != wv.dtype \
            or bias is not None and getattr(bv, "dtype", None) != wv.dtype:
        return f"dtypes x {xv.dtype}, w {wv.dtype}, bias {getattr(bv, 'dtype', None)} (F.linear takes one)"
    if not isinstance(out, torch.Tensor) or out.dtype != wv.dtype:  # (torch.autocast computes it in another dtype)
        return f"its result is {getattr(out, 'dtype', None)} from {wv.dtype} operands (autocast)"
    if bias is not None and tuple(getattr(bv, "shape", ())) != (wv.shape[0],):
        return f"a bias of shape {tuple(getattr(bv, 'shape', ()))}, not [N] (broadcast)"
    if records_grad and any(getattr(v, "requires_grad", False) for v in (xv, wv, bv)):
        return "an operand requires grad (fp8fx.small_mm has no autograd formula)"
    return ""


class RouterPass(NodePass):
    """MoE routers' linears -> ``fp8fx.small_mm`` (see the module docstring). ``enabled=False``: nothing is
    rewritten (``Fp8Backend(fast_router=False)``)."""

    def visit(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext, records_grad: bool) -> bool:
        if node.op != "call_function" or node.target not in _LINEAR or set(node.kwargs) - {"input", "weight", "bias"}:
            return False
        args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
        w = args.get("weight")
        if not _router_weight(w, ctx):
            return False
        x, bias = args.get("input"), args.get("bias")
        why = _reason(node, x, w, bias, records_grad)
        if why:
            log.debug("fp8fx: router linear %s kept as torch's: %s", node.name, why)
            return False
        out_dtype = fake_value(w).dtype
        call = (*((float32_source(x), float32_source(w)) if out_dtype == torch.float32 else (x, w)), bias, out_dtype)
        replace_node(gm.graph, node, torch.ops.fp8fx.small_mm.default, call, fake_value(node))
        for cast, source in ((x, call[0]), (w, call[1])):  # (the casts bypassed, where nothing else reads them)
            if cast is not source and not cast.users:
                gm.graph.erase_node(cast)
        return True
