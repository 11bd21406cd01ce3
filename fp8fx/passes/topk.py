"""Top-k pass: short rows' ``torch.topk`` (an MoE router's experts) to fp8fx's one-launch top-k.

Matches (Dynamo torch IR) every top-k over the last dim whose two results are only indexed::

    top = torch.topk(x, k, dim=-1, largest=True, sorted=True)    # or x.topk(k, ...)
    values, indices = top[0], top[1]

and, where ``fp8fx.kernels.topk_limits.reason`` is empty (float32 / bf16 / fp16 rows of k to 4096 elements, k <= 32),
rewrites it to::

    top = fp8fx.topk(x, k, largest)                               # values, int64 indices; sorted

which returns what torch's does, sorted (a ``sorted=False`` caller takes any order), of equal values the lower index
first. On CUDA that is one launch where torch's takes a radix select and, sorted, a second kernel that sorts:
MoE routing's top-k ran 9 us against the experts' two GEMMs' 9 us each (Qwen3-30B-A3B's layer at one token on the
H200, benchmarks/RESULTS.md run 51); elsewhere the op calls torch's. Every top-k the pass sees goes into the report's
``topk`` list, rewritten or with the reason it is not.

A softmax router's steps around its top-k join the top-k's launch (``fuse_routing=True``, the default)::

    probs = softmax(logits, -1, dtype=torch.float)    # or softmax(logits.float(), -1): Qwen3-MoE, Mixtral, OLMoE
    top = torch.topk(probs, k, dim=-1)
    w = top[0] / top[0].sum(-1, keepdim=True)         # (renormalized: norm_topk_prob; ``/=`` too)
    w = w.to(torch.bfloat16)                          # (a cast of the weights, where there is one)

    top = torch.topk(logits, k, dim=-1)                # GPT-OSS: the softmax of the k top logits
    w = softmax(top[0], dim=-1, dtype=...)

become ``top = fp8fx.softmax_topk(logits, k, renormalize, out_dtype)``, whose weights are the probabilities of the
logits' k largest (renormalized: over the k, which is the softmax of the k). The softmax, the division and the cast
were a kernel each (Inductor's, 2.3 us of Qwen3-30B-A3B's one-token layer besides the top-k's 2 us, H200, run 51).
The experts are ranked by their logits, as softmax orders them; torch's graph ranks the float32 probabilities, so
only two logits that round to one probability can be taken otherwise (there the larger logit, not the lower index),
or the experts of a row with a NaN or +inf logit (its weights NaN either way). A probabilities' tensor that something
else reads is still computed for it. Left as the graph has them (a plain ``fp8fx.topk``, or the softmax joined alone):
probabilities or logits that an op between the softmax and the top-k may write (``probs[:, 0] = 0``), a softmax of
the k in a dtype narrower than the values, a normalization whose values something else reads, and casts of weights
that are not float32 (rounded twice in the graph).

A sigmoid router's grouped top-k (DeepSeek-V3's, Nemotron-H's: ``_grouped``'s form, from float32 logits; where it
drops groups, a power of 2 of experts and of groups) joins too, first: its three top-ks (each group's two best, the
best groups, the experts), the group mask, the gather of the weights, their renormalization and scale become one
``fp8fx.grouped_topk``, where the graph took eight kernels (9.6 us of Nemotron-3-Nano's one-token layer on the H200,
run 52). Its experts are the graph's (the graph's top-k is unsorted: these come sorted), its weights float32 as the
graph's, but where two choices are equal: it takes the lower index, and ``torch.topk`` (CPU or CUDA) may take the
other (sigmoids that round to 1.0 beside equal biases: a token routed to other experts than the uncompiled model's;
``Fp8Backend(fast_topk=False)`` keeps the graph's top-ks). Left as the graph has it: a form any of whose steps
something else reads (the mask, the top-k's values), a top-k over another dim, or one that an op between its steps
may write (the logits, scores or choices).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
from torch import fx

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx import quant
from fp8fx.kernels import topk_limits as kernel  # (no Triton: the kernels' module is imported when one runs)
from fp8fx.passes.base import (NodePass, PassContext, fake_value, float32_source, may_record_grad, module_path,
                               replace_node)
from fp8fx.report import Site

_PARAMS = ("input", "k", "dim", "largest", "sorted")  # torch.topk's, in order (a method's first is ``self``)
_DEFAULTS = {"dim": -1, "largest": True, "sorted": True}


def _topk_args(node: fx.Node) -> dict | None:
    """torch.topk's arguments of ``node`` by name (defaults filled in), or None where ``node`` is no top-k."""
    # (aten.topk: the graph of an exported program, compiled as the README's export route says)
    if not (node.op == "call_function" and node.target in (torch.topk, torch.ops.aten.topk.default)
            or node.op == "call_method" and node.target == "topk"):
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


_SOFTMAX_PARAMS = {torch.softmax: ("input", "dim", "dtype"), torch.nn.functional.softmax: ("input", "dim",
                   "_stacklevel", "dtype"), torch.special.softmax: ("input", "dim", "dtype"), "softmax": ("input",
                   "dim", "dtype")}
_DIVIDE = (operator.truediv, operator.itruediv, torch.div, torch.true_divide)
_DIVIDE_METHODS = ("div", "div_", "true_divide", "true_divide_", "__truediv__", "__itruediv__")
_CAST_METHODS = ("to", "type", "float", "bfloat16", "half")


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _over_last(node: fx.Node, dim) -> bool:
    """Whether ``dim`` is the last dim of ``node``'s value."""
    value = fake_value(node)
    return isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(dim, int) \
        and dim % value.dim() == value.dim() - 1


def _softmax_of(node) -> Optional[fx.Node]:
    """What ``node`` is the softmax over the last dim of (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``,
    without other arguments than dim and dtype), with a 16-bit or float32 result, or None."""
    if not isinstance(node, fx.Node) or not (node.op == "call_method" and node.target == "softmax"
                                             or node.op == "call_function" and node.target in _SOFTMAX_PARAMS):
        return None
    params = _SOFTMAX_PARAMS[node.target]
    args = dict(zip(params, node.args), **node.kwargs)
    source, out = args.pop("input", None), fake_value(node)
    args.pop("_stacklevel", None)
    if set(args) - {"dim", "dtype"} or not isinstance(source, fx.Node) or not _over_last(source, args.get("dim")) \
            or not isinstance(out, torch.Tensor) or out.dtype not in quant.HIGH_PRECISION:
        return None
    return source


def _is_row_sum(node: fx.Node, of: fx.Node) -> bool:
    """Whether ``node`` is ``of.sum(-1, keepdim=True)`` (the method or torch.sum, dim the last)."""
    if not (node.op == "call_method" and node.target == "sum" or node.op == "call_function" and node.target is
            torch.sum):
        return False
    args = dict(zip(("input", "dim", "keepdim"), node.args), **node.kwargs)
    return set(args) == {"input", "dim", "keepdim"} and args["input"] is of and args["keepdim"] is True \
        and _over_last(of, args["dim"][0] if isinstance(args["dim"], (list, tuple)) and len(args["dim"]) == 1
                       else args["dim"])


def _is_division(node: fx.Node, a: fx.Node, b: fx.Node) -> bool:
    """Whether ``node`` is ``a / b`` (or ``a /= b``, ``torch.div(a, b)``, ``a.div(b)``)."""
    return (node.op == "call_function" and node.target in _DIVIDE or node.op == "call_method"
            and node.target in _DIVIDE_METHODS) and tuple(node.args) == (a, b) and not node.kwargs


def _cast(node: Optional[fx.Node]) -> Optional[torch.dtype]:
    """The dtype ``node`` casts its input to, where it is a plain cast to a 16-bit or float32 dtype, else None."""
    if node is None or node.op != "call_method" or node.target not in _CAST_METHODS or node.kwargs \
            or not all(isinstance(a, torch.dtype) for a in node.args[1:]):
        return None
    value = fake_value(node)
    return value.dtype if isinstance(value, torch.Tensor) and value.dtype in quant.HIGH_PRECISION else None


@dataclasses.dataclass
class _Routing:
    """A softmax router's top-k with what joins its launch: ``logits`` (the top-k's input or what its softmax
    reads), ``renormalize``, the weights' ``out_dtype``, ``final`` (the node whose users then read the op's weights)
    and the nodes that go (``chain``, ``final`` last; then ``prologue``, the softmax and its cast, where unread)."""

    logits: fx.Node
    renormalize: bool
    out_dtype: torch.dtype
    final: fx.Node
    chain: list
    prologue: list

    def describe(self, k: int, n) -> str:
        how = "its softmax, renormalized" if self.renormalize and self.prologue else (
            "the softmax of the k" if self.renormalize else "its softmax")
        return f"k={k} of {n} with {how}, {str(self.out_dtype).removeprefix('torch.')}"


_IN_PLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift}


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` may write a tensor it reads: an in-place method or function (``x.mul_()``, ``x[i] = v``,
    ``x /= y``, ``torch.relu_``), ``out=``, or an aten op whose schema says so."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    schema = getattr(node.target, "_schema", None)
    return node.op in ("call_method", "call_function") and (
        node.target in _IN_PLACE or name.endswith("_") and not name.startswith("_") or "out" in node.kwargs
        or bool(schema is not None and schema.is_mutable))


def _written_between(start: fx.Node, end: fx.Node, tensors: set, skip: frozenset = frozenset()) -> bool:
    """Whether a node after ``start`` and before ``end`` may write one of ``tensors`` (the softmax's probabilities,
    its input, the logits) or a tensor made from them there (a view): an in-place op between the graph's softmax and
    its top-k (``probs[:, 0] = 0``, ``logits.mul_(-1)``), which the op that replaces both, reading the logits once,
    would not see, or see where the softmax did not. ``skip``: nodes of the form itself."""
    tensors = set(tensors)
    node = start.next
    while node is not end and node.op != "root":
        if node not in skip and any(n in tensors for n in node.all_input_nodes):
            if _writes(node):
                return True
            tensors.add(node)  # (it may be a view of them)
        node = node.next
    return False


def _routing(node: fx.Node, args: dict) -> Optional[_Routing]:
    """The softmax router's form around the top-k ``node`` (module docstring), or None."""
    values = [u for u in node.users if u.args[1] == 0]
    if args["largest"] is not True or len(values) > 1:
        return None
    value = values[0] if values else None
    probs = args["input"]
    read = _softmax_of(probs)
    if read is not None and fake_value(probs).dtype == torch.float32:  # softmax first: the weights are probabilities
        logits = float32_source(read)
        prologue = [probs] + ([read] if read is not logits else [])
        if _written_between(read, node, {probs, read, logits}):
            return None
        chain, renormalize, final = [], False, value
        if value is not None and len(value.users) == 2:
            total = next((u for u in value.users if _is_row_sum(u, value)), None)
            divide = next((u for u in value.users if u is not total), None)
            if total is not None and list(total.users) == [divide] and _is_division(divide, value, total):
                chain, renormalize, final = [total, divide], True, divide
    elif value is not None and _softmax_of(_only_user(value)) is value \
            and fake_value(_only_user(value)).dtype in (fake_value(value).dtype, torch.float32):
        # the softmax of the k (GPT-OSS), computed in float32 from the values or in their own dtype (a narrower
        # dtype= would round them first)
        logits, prologue, renormalize = probs, [], True
        final = _only_user(value)
        chain = [final]
    else:
        return None
    if not isinstance(fake_value(logits), torch.Tensor) or kernel.reason(fake_value(logits), args["k"]):
        return None
    out_dtype = fake_value(final).dtype if final is not None else torch.float32
    # a cast of float32 weights: the kernel's one rounding is the graph's (a cast of rounded weights would be a second)
    if final is not None and out_dtype == torch.float32 and _cast(_only_user(final)) is not None:
        out_dtype = _cast(_only_user(final))
        final = _only_user(final)
        chain.append(final)
    return _Routing(logits, renormalize, out_dtype, final, chain, prologue)


def _method(node, name: str, nargs: Optional[int] = None) -> bool:
    """Whether ``node`` is a call of the tensor method ``name`` (with ``nargs`` positional arguments, self included)."""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name \
        and (nargs is None or len(node.args) == nargs)


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _before(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` comes before ``b`` in their graph."""
    node = a.next
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


@dataclasses.dataclass
class _Grouped:
    """A sigmoid router's grouped top-k (DeepSeek-V3's, as HF computes it): the op's arguments, the top-ks it
    replaces (the groups' two, the groups', the experts'), ``weights`` (the node whose users then read the op's
    weights, or None) and ``matched`` (every node of the form: those left unread go)."""

    logits: fx.Node
    bias: fx.Node
    k: int
    groups: int
    topk_group: int
    renormalize: bool
    eps: float
    scale: float
    fill: float
    topks: list
    weights: Optional[fx.Node]
    matched: list

    def describe(self, n) -> str:
        steps = ", renormalized" if self.renormalize else ""
        steps += f", times {self.scale:g}" if self.scale != 1 else ""
        return (f"k={self.k} of {n} experts in {self.topk_group} of {self.groups} groups, sigmoid weights{steps} "
                "(grouped_topk)")


def _grouped(node: fx.Node, args: dict) -> Optional[_Grouped]:
    """The DeepSeek-V3 router whose experts' top-k ``node`` is (``args``: its ``_topk_args``; the transformers 5
    graph, Nemotron-H's the same), or None::

        scores = logits.sigmoid(); choice = scores + bias                      # float32 logits, bias [E]
        group_score = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_score, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_score); group_mask.scatter_(1, group_idx, 1)
        mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        ids = torch.topk(choice.masked_fill(~mask.bool(), fill), k=k, dim=-1, sorted=False)[1]   # <- node
        weights = scores.gather(1, ids)
        weights /= weights.sum(dim=-1, keepdim=True) + eps                    # (norm_topk_prob)
        weights = weights * scale                                             # (routed_scaling_factor)
    """
    masked = args["input"]
    if args["largest"] is not True or not _method(masked, "masked_fill", 3) or masked.kwargs:
        return None
    choice, invert, fill = masked.args
    if not isinstance(fill, (int, float)) or not _call(invert, operator.invert, torch.bitwise_not, torch.logical_not):
        return None
    as_bool = invert.args[0]
    if not _method(as_bool, "bool", 1) or not _method(as_bool.args[0], "reshape") and not _method(as_bool.args[0],
                                                                                                     "view"):
        return None
    expand = as_bool.args[0].args[0]
    if not _method(expand, "expand") or not _method(expand.args[0], "unsqueeze", 2) or expand.args[0].args[1] != -1:
        return None
    group_mask = expand.args[0].args[0]
    scatters = [u for u in group_mask.users if _method(u, "scatter_", 4) and not u.kwargs]
    if not _call(group_mask, torch.zeros_like) or len(group_mask.users) != 2 or len(scatters) != 1:
        return None
    scatter = scatters[0]
    _, dim, group_idx, one = scatter.args
    group_score = group_mask.args[0]
    if dim not in (1, -1) or one != 1 or scatter.users or not _call(group_idx, operator.getitem) \
            or group_idx.args[1] != 1 or _only_user(group_idx.args[0]) is not group_idx:
        return None
    group_topk = _topk_args(group_idx.args[0])
    if not group_topk or group_topk["input"] is not group_score or group_topk["largest"] is not True \
            or set(group_topk) - set(_PARAMS) or not _method(group_score, "sum", 1) \
            or group_score.kwargs.get("dim") != -1 or set(group_score.kwargs) != {"dim"} \
            or not _over_last(group_score, group_topk["dim"]):
        return None
    pairs = group_score.args[0]
    if not _call(pairs, operator.getitem) or pairs.args[1] != 0 or _only_user(pairs.args[0]) is not pairs:
        return None
    pair_topk = _topk_args(pairs.args[0])
    grid = pair_topk and pair_topk["input"]
    if not pair_topk or pair_topk["k"] != 2 or pair_topk["largest"] is not True or set(pair_topk) - set(_PARAMS) \
            or not _method(grid, "view") or grid.args[0] is not choice or not _call(choice, operator.add, torch.add) \
            or choice.kwargs or len(choice.args) != 2 or not _over_last(grid, pair_topk["dim"]):
        return None
    scores, bias = choice.args
    if not (_method(scores, "sigmoid", 1) or _call(scores, torch.sigmoid) and len(scores.args) == 1):
        return None
    logits, x, b, g = scores.args[0], fake_value(scores.args[0]), fake_value(bias), fake_value(grid)
    if not all(isinstance(t, torch.Tensor) for t in (x, b, g)) or x.dim() != 2 or g.dim() != 3 \
            or tuple(b.shape) != (x.shape[1],) or b.dtype not in quant.HIGH_PRECISION or type(x.shape[1]) is not int \
            or g.shape[1] * g.shape[2] != x.shape[1]:
        return None
    groups, topk_group = g.shape[1], group_topk["k"]
    if type(groups) is not int or type(topk_group) is not int \
            or kernel.grouped_reason(x, args["k"], groups, topk_group):
        return None
    shapes = [tuple(getattr(fake_value(n), "shape", ())) for n in (as_bool, expand)]
    if shapes != [tuple(x.shape), tuple(g.shape)] or not _before(scatter, expand.args[0]):
        return None
    matched = [scores, choice, grid, pairs.args[0], pairs, group_score, group_idx.args[0], group_idx, group_mask,
               scatter, expand.args[0], expand, as_bool.args[0], as_bool, invert, masked]
    # each step read by the next alone (the group mask: by the scatter_ that fills it and the unsqueeze), so that
    # erasing them changes nothing else; the choices by the groups' view and the mask; the top-k's values unread
    chain = [(choice, {grid, masked}), (grid, {pairs.args[0]}), (group_score, {group_idx.args[0], group_mask}),
             (group_idx, {scatter}), (group_mask, {scatter, expand.args[0]}), (expand.args[0], {expand}),
             (expand, {as_bool.args[0]}), (as_bool.args[0], {as_bool}), (as_bool, {invert}), (invert, {masked}),
             (masked, {node})]
    if any(set(n.users) != users for n, users in chain) or any(u.args[1] == 0 for u in node.users):
        return None
    # the weights: the sigmoid at the ids, renormalized, scaled, each where the graph does so
    ids = [u for u in node.users if u.args[1] == 1]
    weights, renormalize, eps, scale = None, False, 0.0, 1.0
    if len(ids) == 1:
        gather = next((u for u in ids[0].users if _method(u, "gather", 3) and u.args[0] is scores and u.args[1] in (
            1, -1) and u.args[2] is ids[0] and not u.kwargs), None)
        if gather is not None:
            weights = gather
            matched.append(gather)
            total = next((u for u in gather.users if _is_row_sum(u, gather)), None)
            plus = _only_user(total) if total is not None else None
            divide = next((u for u in gather.users if u is not total), None)
            if len(gather.users) == 2 and plus is not None and _call(plus, operator.add, torch.add) \
                    and len(plus.args) == 2 and plus.args[0] is total and isinstance(plus.args[1], (int, float)) \
                    and not plus.kwargs and divide is not None and _is_division(divide, gather, plus):
                weights, renormalize, eps = divide, True, float(plus.args[1])
                matched += [total, plus, divide]
            times = _only_user(weights)
            if times is not None and _call(times, operator.mul, torch.mul) and len(times.args) == 2 \
                    and times.args[0] is weights and isinstance(times.args[1], (int, float)) and not times.kwargs:
                weights, scale = times, float(times.args[1])
                matched.append(times)
    # nothing else between the sigmoid and the last step the op takes may write the logits, the scores or a view
    if _written_between(scores, weights or node, {logits, scores, bias}, skip=set(matched)):
        return None
    return _Grouped(logits, bias, args["k"], groups, topk_group, renormalize, eps, scale, float(fill),
                    [pairs.args[0], group_idx.args[0], node], weights, matched)


def _site_name(node: fx.Node, ctx: PassContext) -> str:
    """The report's name of the module of ``node``: its path, joined to the frame's root where the graph is a frame of
    a block's forward (whose paths are the block's; the report's names are the model's)."""
    fqn, root = module_path(node) or "", ctx.report.frames.get(ctx.graph_index)
    return (f"{root}.{fqn}" if fqn else root) if root else fqn


class TopkPass(NodePass):
    """``torch.topk`` of short rows -> ``fp8fx.topk``, and a softmax router's -> ``fp8fx.softmax_topk`` (see the
    module docstring). ``enabled=False``: the pass looks at nothing and rewrites nothing (``Fp8Backend(fast_topk=
    False)``); ``fuse_routing=False``: every top-k becomes ``fp8fx.topk``, its softmax and normalization left."""

    def __init__(self, enabled: bool = True, fuse_routing: bool = True):
        super().__init__(enabled)
        self.fuse_routing = fuse_routing

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        # first the sigmoid routers' grouped top-ks, whose three top-ks the node loop would take one at a time
        grouped = self.enabled and self.fuse_routing and sum(self.visit_grouped(gm, node, ctx) for node in list(
            gm.graph.nodes) if not node._erased and _topk_args(node) is not None)
        return grouped + super().__call__(gm, ctx)

    def visit_grouped(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> bool:
        """``node``, a sigmoid router's experts' top-k, and its form (``_grouped``) -> ``fp8fx.grouped_topk``."""
        args = _topk_args(node)
        if _reason(node, args, may_record_grad(gm.graph)):
            return False
        form = _grouped(node, args)
        if form is None:
            return False
        for top in form.topks:
            x = fake_value(_topk_args(top)["input"])
            ctx.report.add_topk(Site(
                kind="topk", fqn=_site_name(top, ctx), rewritten=True, reason="", graph=ctx.graph_index,
                weight_shape=Site.shape_of(x),
                scheme=form.describe(fake_value(form.logits).shape[-1]) if top is node else "in fp8fx.grouped_topk",
                kernel="extern fp8fx.grouped_topk", node=Site.origin_of(top)))
        call = (form.logits, form.bias, form.k, form.groups, form.topk_group, form.renormalize, form.eps, form.scale,
                form.fill)
        new = replace_node(gm.graph, node, torch.ops.fp8fx.grouped_topk.default, call)
        if form.weights is not None:
            with gm.graph.inserting_after(new):
                weights = gm.graph.call_function(operator.getitem, (new, 0))
            weights.meta["example_value"] = new.meta["example_value"][0]
            form.weights.replace_all_uses_with(weights)
        for gone in reversed(form.matched):  # (each that nothing reads now, last first)
            if not gone.users:
                gm.graph.erase_node(gone)
        return True

    def visit(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext, records_grad: bool) -> bool:
        args = _topk_args(node)
        if args is None:
            return False
        why = _reason(node, args, records_grad)
        x = fake_value(args.get("input"))
        n = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else "?"
        order = "" if args.get("largest") is not False else " smallest"
        routing = _routing(node, args) if self.fuse_routing and not why else None
        scheme = "" if why else routing.describe(args["k"], n) if routing else f"k={args['k']} of {n}{order}"
        name = "softmax_topk" if routing else "topk"
        op = getattr(torch.ops.fp8fx, name).default
        ctx.report.add_topk(Site(
            kind="topk", fqn=_site_name(node, ctx), rewritten=not why, reason=why, scheme=scheme,
            graph=ctx.graph_index, weight_shape=Site.shape_of(x), kernel="" if why else f"extern fp8fx.{name}",
            node=Site.origin_of(node),
        ))
        if why:
            return False
        if routing is None:
            replace_node(gm.graph, node, op, (args["input"], args["k"], args["largest"]))
            return True
        new = replace_node(gm.graph, node, op, (routing.logits, args["k"], routing.renormalize, routing.out_dtype))
        weights = next((u for u in new.users if u.args[1] == 0), None)
        if routing.final is not None and routing.final is not weights:
            routing.final.replace_all_uses_with(weights)
            for gone in reversed(routing.chain):
                gm.graph.erase_node(gone)
        if weights is not None:
            weights.meta["example_value"] = new.meta["example_value"][0]
        for gone in routing.prologue:  # (the probabilities, where nothing else reads them)
            if not gone.users:
                gm.graph.erase_node(gone)
        return True
