"""Top-k pass: short rows' ``torch.topk`` (an MoE router's experts) to fp8fx's one-launch top-k.

Matches (Dynamo torch IR) every top-k over the last dim whose two results are only indexed::

    top = torch.topk(x, k, dim=-1, largest=True, sorted=True)    # or x.topk(k, ...)
    values, indices = top[0], top[1]

and, where ``fp8fx.kernels.topk.reason`` is empty (float32 / bf16 / fp16 rows of k to 4096 elements, k <= 32),
rewrites it to::

    top = fp8fx.topk(x, k, largest)                               # values, int64 indices; sorted

which returns what torch's does, sorted (a ``sorted=False`` caller takes any order), of equal values the lower index
first. On CUDA that is one launch where torch's takes a radix select and, sorted, a second kernel that sorts:
MoE routing's top-k ran 9 us against the experts' two GEMMs' 9 us each (Qwen3-30B-A3B's layer at one token on the
H200, benchmarks/RESULTS.md run 51); elsewhere the op calls torch's. Every top-k the pass sees goes into the report's
``topk`` list, rewritten or with the reason it is not.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx.kernels import topk as kernel
from fp8fx.passes.base import NodePass, PassContext, fake_value, module_path, replace_node
from fp8fx.report import Site

_PARAMS = ("input", "k", "dim", "largest", "sorted")  # torch.topk's, in order (a method's first is ``self``)
_DEFAULTS = {"dim": -1, "largest": True, "sorted": True}


def _topk_args(node: fx.Node) -> dict | None:
    """torch.topk's arguments of ``node`` by name (defaults filled in), or None where ``node`` is no top-k."""
    if not (node.op == "call_function" and node.target is torch.topk or node.op == "call_method"
            and node.target == "topk"):
        return None
    args = dict(zip(_PARAMS, node.args))
    for name, value in node.kwargs.items():
        args["input" if name == "self" else name] = value
    return {**_DEFAULTS, **args}


def _reason(node: fx.Node, args: dict, graph_records_grad: bool) -> str:
    """Why the top-k ``node`` (``args``: ``_topk_args``) stays torch's, or ""."""
    x, k = fake_value(args.get("input")), args.get("k")
    if set(args) - set(_PARAMS):
        return f"called with {', '.join(sorted(set(args) - set(_PARAMS)))}= (fp8fx.topk returns new tensors)"
    if not isinstance(x, torch.Tensor):
        return "its input is not a tensor the graph traced"
    if type(k) is not int:
        return "k is not a constant (a value of the graph)"
    if not all(type(args[n]) is bool for n in ("largest", "sorted")):
        return "largest= or sorted= is not a constant"
    if x.dim() == 0 or not isinstance(args["dim"], int) or args["dim"] % x.dim() != x.dim() - 1:
        return f"over dim {args['dim']!r} of a {x.dim()}-d tensor (fp8fx.topk takes the last dim)"
    if type(x.shape[-1]) is not int:
        return "its rows are of symbolic length"
    why = kernel.reason(x, k)
    if why:
        return why
    if graph_records_grad and x.requires_grad:
        return "its input requires grad (fp8fx.topk has no autograd formula)"
    if not node.users or any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1)
                             for u in node.users):
        return "its result is used whole, not as values [0] and indices [1]"
    return ""


class TopkPass(NodePass):
    """``torch.topk`` of short rows -> ``fp8fx.topk`` (see the module docstring). ``enabled=False``: the pass
    looks at nothing and rewrites nothing (``Fp8Backend(fast_topk=False)``)."""

    def visit(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext, records_grad: bool) -> bool:
        args = _topk_args(node)
        if args is None:
            return False
        why = _reason(node, args, records_grad)
        x = fake_value(args.get("input"))
        n = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else "?"
        order = "" if args.get("largest") is not False else " smallest"
        ctx.report.add_topk(Site(
            kind="topk", fqn=module_path(node) or "", rewritten=not why, reason=why,
            scheme="" if why else f"k={args['k']} of {n}{order}", graph=ctx.graph_index,
            weight_shape=Site.shape_of(x), kernel="" if why else "extern fp8fx.topk", node=Site.origin_of(node),
        ))
        if not why:
            replace_node(gm.graph, node, torch.ops.fp8fx.topk.default, (args["input"], args["k"], args["largest"]))
        return not why
