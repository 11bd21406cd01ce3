"""Horizontal fusion: fp8 GEMMs that read the same quantized activation become one GEMM.

Matches (after the linear pass, which quantizes each activation once), for n >= 2 weights that are
parameters::

    y_i = fp8fx.scaled_mm(xq, x_scale, wq_i, s_i, b_i, x_block, w_block, dtype, fast)   # q/k/v, gate/up

Rewrites to::

    y = fp8fx.scaled_mm_fused(xq, x_scale, [wq_i], [s_i], [b_i], x_block, w_block, dtype, fast)
    y_i = y[..., offset_i : offset_i + N_i]        # .contiguous() where y_i leaves the graph

Each y_i is then a column slice, its rows the fused row's length apart: a group is kept apart where anything its
outputs reach through views depends on that layout (``_layout_bound``).

Once the graph is compiled, the parameters are moved into one tensor each for weights, scales and
biases (the model's parameters become back-to-back views of it, so memory does not grow; a shard without a bias -
Whisper's k_proj - leaves zeros between the others', in a tensor that holds nothing else), and
``scaled_mm_fused`` then runs one GEMM on the whole. Per-channel and block scales concatenate exactly
(blocks need every N_i but the last to be a multiple of the block's rows). Per-tensor shards keep their
weights and their own scales: the fused GEMM takes the shards' scales as one per-channel scale vector
(each shard's scale repeated over its rows), exact. (FP8 checkpoints of fused QKV / w13 layers requantize
per-tensor shards to their max scale instead, one more fp8 rounding for the others; the parameters here
must stay what a checkpoint loads into them: ``load_state_dict`` after fusion writes each shard's rows
and its own scale.) A parameter replaced afterwards by another tensor is still used correctly, one GEMM
per weight.

Static activations: each layer quantizes the input with its own ``input_scale``. A group of them quantizes it once,
with the largest of their scales (vLLM's fused QKV / w13 of a static checkpoint: the max of the shards' input
scales), computed in the graph from the parameters at each call; calibrated on one input, their scales are equal and
the result is the unfused one.

Layers called again with the same weights (shared layers, ALBERT) are fused at every call, into the same tensor. A
GEMM that reads a group's activation but is kept out of the group (weight scales of another granularity, another
output dtype) says why in the report, as does one whose input was quantized apart from the group's: the linear pass
quantizes an activation again after an in-place write that may reach it.
"""
from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import fx

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx.config import granularity_from_block, weight_granularity_name
from fp8fx.passes.base import Fp8Pass, PassContext, amend_sites, fake_value, set_fake_value, site_names
from fp8fx.passes.linear import _RETURNS_INPUT, _Layouts, _may_alias, _mutates, _own_storage, _written
from fp8fx.passes.linear import graph_inputs_memory, overloads
from fp8fx.report import Site

_SCALED_MM = torch.ops.fp8fx.scaled_mm.default
_FUSED = torch.ops.fp8fx.scaled_mm_fused.default
_STATIC = torch.ops.fp8fx.quantize_static.default
_QUANTIZE = torch.ops.fp8fx.quantize.default
_STATIC_KEY = "static"  # (a group key's x_scale is (_STATIC_KEY, epoch) where its GEMMs quantize their input x, its
# xq, with static scales: static_epochs)
# gm.meta key: callables the backend runs once the graph is compiled
AFTER_COMPILE = "fp8fx_after_compile"
# gm.meta[SHARED_INPUTS]: each fused group's (weights, scales, biases) as the graph's input positions (None: a shard
# without a bias) and its weight block: the backend moves another module's parameters, met at those positions by
# the compiled code Dynamo runs again for it (a block's frame after a graph break, a second model of one class)
SHARED_INPUTS = "fp8fx_shared_inputs"


def fuse_weights(
    ws: list[torch.Tensor], ss: list[torch.Tensor], w_block
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(fused weight [sum N_i, K], fused scale) from the shards' fp8 weights and scales; the scale is None
    for per-tensor shards, which keep their own."""
    if tuple(w_block) == (-1, -1):
        return torch.cat(ws), None
    return torch.cat(ws), torch.cat([s.reshape(-1, s.shape[-1]) for s in ss])


def _rebind(params: list[Optional[torch.Tensor]], fused: torch.Tensor, sizes: Optional[list[int]] = None) -> None:
    """Each parameter becomes a view of its rows of ``fused`` (same values; memory shared).
    Rows are dim 0: weights [N, K], scales [N, 1] or [N / bn, K / bk], biases [N]. With ``sizes`` (each shard's
    rows), a None parameter (a shard without a bias) leaves its rows of ``fused`` to no one."""
    offset = 0
    for i, p in enumerate(params):
        if p is not None:
            p.data = fused.narrow(0, offset, p.shape[0]).view(p.shape)
        offset += p.shape[0] if sizes is None else sizes[i]


@contextlib.contextmanager
def _building(inference: bool, device: str) -> Iterator[None]:
    """Where ``share_memory`` makes and binds fused tensors: in the parameters' own mode (inference tensors or not),
    without autograd, without the caller's autocast."""
    with torch.inference_mode(inference), torch.no_grad(), torch.autocast(device, enabled=False):
        yield


def share_memory(weights, scales, biases, w_block) -> None:
    """Move the shards' parameters into one tensor each (what ``scaled_mm_fused`` runs as one GEMM). ``biases``: one
    per shard, None for a shard without one (its rows of the fused bias are zeros). Everything is built before the
    first parameter changes. Parameters that already are (a recompile) stay where they are: graphs captured
    earlier (CUDA graphs) keep their addresses."""
    adjacent = fp8fx.ops._adjacent
    sizes = [w.shape[0] for w in weights]
    has_bias = any(b is not None for b in biases)
    if (
        adjacent(weights) is not None
        and (tuple(w_block) == (-1, -1) or adjacent([s.reshape(-1, s.shape[-1]) for s in scales]) is not None)
        and (not has_bias or fp8fx.ops._bias_view(biases, sizes) is not None)
    ):
        return
    # (under the caller's torch.autocast, its cat of fp8 tensors failed: "Unexpected floating ScalarType"; a model
    # quantized under inference_mode has inference tensors for parameters, which a tensor made outside it must not
    # replace: every view of them then failed, "Inference tensors do not track version counter", the eager model's
    # too; quantize_ leaves the bias as it was: it may be of the other mode, and keeps its own. The pass fuses no
    # group whose weights and scales, or whose biases, are of both modes)
    device = weights[0].device.type
    of_weights = weights[0].is_inference()
    of_biases = next((b for b in biases if b is not None), weights[0]).is_inference()
    with _building(of_weights, device):
        weight, scale = fuse_weights(weights, scales, w_block)
    with _building(of_biases, device):
        # a tensor of its own (the gaps' zeros are then no one else's rows: ``ops._adjacent_with_gaps``)
        bias = fp8fx.ops._fused_bias(biases, sizes).clone() if has_bias else None
    with _building(of_weights, device):
        _rebind(weights, weight)
        if scale is not None:
            _rebind(scales, scale)
    if bias is None:
        return
    with _building(of_biases, device):
        _rebind(biases, bias, sizes)  # each bias becomes a view of its rows; a shard without one leaves zeros there
    if any(b is None for b in biases):  # what ops._adjacent_with_gaps takes: this tensor, its gaps zeros
        for b in biases:
            if b is not None:
                setattr(b, fp8fx.ops.BIAS_GAPS, bias.untyped_storage().data_ptr())


def _in_stored_order(nodes: list[fx.Node], ctx: PassContext) -> list[fx.Node]:
    """``nodes`` (GEMMs of one group) in the order their weights sit in one tensor, where an earlier graph fused them
    (``share_memory``): a graph calling them in another order (k then q, where the first called q then k) fused them
    again in its own order, which moved the weights into a new tensor; the first graph then ran one GEMM per weight
    (its weights no longer back to back) while its report said fused. Otherwise as they are (the graph's order)."""
    weights = [ctx.example.get(n.args[2]) for n in nodes]
    if not all(isinstance(w, torch.nn.Parameter) for w in weights):  # (refused by _why_not, with its reason)
        return nodes
    try:
        if len(_storages(weights)) != 1:
            return nodes
    except (NotImplementedError, RuntimeError):  # (a tensor subclass with no storage of its own)
        return nodes
    return sorted(nodes, key=lambda n: ctx.example[n.args[2]].storage_offset())


def _storages(weights: list[torch.Tensor]) -> set[int]:
    """Where ``weights`` sit: one storage for the weights of a group an earlier graph fused (``share_memory``)."""
    return {w.untyped_storage().data_ptr() for w in weights}


class _GroupKey(NamedTuple):
    """What GEMMs must share to run as one: the quantized activation and its scale (the same input), the scale
    layouts, the output dtype and fast accumulation (with or without a bias: a shard without one adds zeros)."""

    xq: fx.Node
    x_scale: Any
    x_block: tuple
    w_block: tuple
    dtype: torch.dtype
    fast: bool


def _is_static(key: _GroupKey) -> bool:
    return isinstance(key.x_scale, tuple) and key.x_scale[:1] == (_STATIC_KEY,)


def static_epochs(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each static quantization's count of the in-place writes before it that may reach its input (the linear
    pass's rule, ``_may_alias``): two quantizations of one input share a count where no such write lies between
    them, and may become one (``share_static``)."""
    statics = [n for n in graph.nodes if n.op == "call_function" and n.target is _STATIC]
    if len(statics) < 2:
        return dict.fromkeys(statics, 0)
    inputs = graph_inputs_memory(graph)
    writes = dict.fromkeys((n.args[0] for n in statics), 0)
    epochs = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _STATIC:
            epochs[node] = writes[node.args[0]]
        elif _mutates(node):
            written = _written(node)
            for x in writes:
                writes[x] += _may_alias(x, written, inputs)
    return epochs


def share_static(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """The GEMMs ``nodes``, each reading the input quantized with its own static scale, read it quantized once
    with the largest of their scales (``torch.maximum`` of the scale parameters, in the graph); the quantizations
    no GEMM reads any more are dropped."""
    graph = gm.graph
    old = list(dict.fromkeys(n.args[0] for n in nodes))
    scales = list(dict.fromkeys(n.args[1] for n in nodes))
    first = next(n for n in graph.nodes if n in old)  # (the earliest, in graph order)
    with graph.inserting_before(first):
        scale = scales[0]
        for other in scales[1:]:
            scale = graph.call_function(torch.maximum, (scale, other))
            set_fake_value(scale, torch.maximum, scale.args)
        xq = graph.call_function(_STATIC, (first.args[0], scale))
        set_fake_value(xq, _STATIC, xq.args)
    for n in nodes:
        n.args = (xq, scale, *n.args[2:])
    for q in old:
        if not q.users:
            graph.erase_node(q)


def _quantized_from(xq: Any) -> Optional[fx.Node]:
    """The activation that ``xq`` (a GEMM's fp8 input: ``fp8fx.quantize``'s codes or ``quantize_static``) quantizes."""
    q = xq.args[0] if isinstance(xq, fx.Node) and xq.target is operator.getitem else xq
    if isinstance(q, fx.Node) and q.target in (_QUANTIZE, _STATIC) and isinstance(q.args[0], fx.Node):
        return q.args[0]
    return None


# ops whose result is (or may be) a view of their first argument: a fused GEMM's output slice reaches their users too
_ALIASING_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "unsqueeze", "squeeze", "t", "flatten",
    "unflatten", "expand", "expand_as", "narrow", "detach", "to", "type", "type_as", "split", "chunk", "unbind",
    "__getitem__", "movedim", "swapaxes", "mT", "select", "unfold", "moveaxis", "swapdims", "broadcast_to",
    "tensor_split", "vsplit", "hsplit", "dsplit", "split_with_sizes", "diagonal", "view_as_real", "view_as_complex",
    "conj", "resolve_conj", "resolve_neg", "positive", "unsafe_chunk", "unsafe_split",
})
_ALIASING_FUNCTIONS = frozenset({
    torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.flatten, torch.narrow,
    torch.t, operator.getitem, torch.split, torch.chunk, torch.unbind, torch.detach, torch.movedim, torch.swapaxes,
    torch.select, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.transpose, torch.Tensor.permute,
    torch.Tensor.unsqueeze, torch.Tensor.flatten, torch.Tensor.narrow, torch.Tensor.to, torch.Tensor.detach,
    torch.unflatten, torch.moveaxis, torch.swapdims, torch.broadcast_to, torch.atleast_1d, torch.atleast_2d,
    torch.atleast_3d, torch.tensor_split, torch.vsplit, torch.hsplit, torch.dsplit, torch.diagonal, torch.ravel,
    torch.view_as_real, torch.view_as_complex, torch.Tensor.unflatten, torch.Tensor.expand, torch.Tensor.contiguous,
    torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as, torch.Tensor.unbind, torch.Tensor.split,
    torch.conj, torch.resolve_conj, torch.resolve_neg, torch.positive, torch.real, torch.unsafe_chunk,
    torch.unsafe_split, torch.broadcast_tensors, torch.einsum,
    *_RETURNS_INPUT,  # (dropout in eval, or of p = 0, returns its input itself)
    # ``q += 1``: Dynamo records the in-place operators as functions, which return their tensor
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
})
# methods that return their tensor itself where it already has the dtype / device asked for (``.float()`` of a float32
# output), and attributes that are views (Dynamo records ``q.mT`` as ``getattr(q, "mT")``)
_CASTS = frozenset({"float", "half", "bfloat16", "double", "cpu", "cuda", "contiguous", "requires_grad_", "ravel"})
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
# ops that read or change a tensor's layout itself: Dynamo baked the unfused output's strides into the graph
# (``as_strided(q, ..., (q.stride(0), ...))``), or the op rewrites the storage the fused output shares
_LAYOUT_OPS = frozenset({"as_strided", "as_strided_", "resize_", "resize_as_", "set_", "storage_offset"})


# reshapes that keep the rows of a linear's input (its last dim): ``x.view(-1, d)``, ``x.flatten(0, 1)``
_RESHAPE_METHODS = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
                              "reshape_as"})
_RESHAPE_FUNCTIONS = frozenset({torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.unflatten,
                                torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten})


def _reshapes(node: fx.Node) -> bool:
    """Whether ``node`` reshapes its first argument keeping its last dim, so that a linear reads the same rows."""
    if not (node.op == "call_method" and node.target in _RESHAPE_METHODS
            or node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS):
        return False
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    old, new = fake_value(node.args[0]), fake_value(node)
    return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.dim() >= 1 and new.dim() >= 1
            and old.shape[-1] == new.shape[-1] and old.numel() == new.numel())


def _layout_bound(nodes: list[fx.Node], ctx: PassContext) -> str:
    """Why the GEMMs' outputs cannot become column slices of one output, or "". Fused, each output is a slice whose
    rows are the fused row's length apart, where each GEMM's own output is contiguous. Followed through every op
    that may return a view of it (``_ALIASING_*``), each replayed on the fake slice, nothing may: fail on the slice
    (``q(x).view(-1)``: the graph failed to compile), nor read or change the layout itself (``as_strided`` with
    strides Dynamo recorded from the unfused output, ``resize_``: wrong numbers). Any other op reads values only
    (arithmetic, SDPA, ``cat``, ``contiguous``), whatever the strides. An output that leaves the graph gets a
    contiguous copy of its columns, and so does one given to an op that may read it by its layout (a custom op of
    another library, a higher-order op: ``_needs_own_layout``, ``_fuse``)."""
    outs = [fake_value(n) for n in nodes]
    if not all(isinstance(o, torch.Tensor) and o.dim() >= 1 for o in outs):
        return ""
    mode = getattr(outs[0], "fake_mode", None)
    if mode is None:
        return ""
    offset = 0
    with mode:
        fused = outs[0].new_empty((*outs[0].shape[:-1], sum(o.shape[-1] for o in outs)))
        for node, out in zip(nodes, outs):
            why = _slice_use(node, fused.narrow(-1, offset, out.shape[-1]), out.new_empty(out.shape))
            offset += out.shape[-1]
            if why:
                return f"{site_names(ctx, [node])}'s output {why}"
    return ""


def _aliases(user: fx.Node) -> bool:
    """Whether ``user`` may return its first argument or a view of it: a view op, a cast that may be a no-op, an
    in-place method (``k.mul_(2)`` returns ``k``) or function (``F.relu(k, inplace=True)``, ``torch.relu_(k)``), a
    view attribute, an ATen op whose schema says its result aliases an input (``aten.reshape``)."""
    if user.op == "call_method":
        name = user.target
        return (name in _ALIASING_METHODS or name in _CASTS
                or name.endswith("_") and not name.startswith("_"))
    if user.op != "call_function":
        return False
    target = user.target
    if target in _ALIASING_FUNCTIONS or target is getattr and len(user.args) == 2 and user.args[1] in _VIEW_ATTRIBUTES:
        return True
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return any(r.alias_info is not None for o in overloads(target) for r in o._schema.returns)
    # an in-place function returns the tensor it writes (not setitem's None, nor _foreach_*'s), its first argument
    # (also by keyword: F.relu(input=q, inplace=True)) or its out= (torch.mul(k, 2, out=q) returns q)
    if "out" in user.kwargs:
        return True
    first = user.args[0] if user.args else user.kwargs.get("input")
    return (target is not operator.setitem and not getattr(target, "__name__", "").startswith("_foreach")
            and first is not None and _mutates(user) and _written(user) == [first])


def _opaque(user: fx.Node) -> bool:
    """Whether ``user`` may read its inputs by their memory layout: a custom op of another library (a C++ or Triton
    kernel that takes its input as contiguous rows), a higher-order op (``torch.cond``, a checkpointed region, a user
    Triton kernel: their bodies were traced with the GEMM's own, contiguous output) or a submodule call. ATen's,
    torch's functions and Tensor methods read values whatever the strides; fp8fx's ops too."""
    if user.op == "call_module":
        return True
    if user.op != "call_function":
        return False
    target = user.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in ("aten", "prims", "fp8fx")
    if isinstance(target, torch._ops.OpOverloadPacket):  # (torch.ops.ns.op(x): Dynamo keeps the packet, which has
        # no namespace attribute)
        return target._qualified_op_name.partition("::")[0] not in ("aten", "prims", "fp8fx")
    return False


def _needs_own_layout(node: fx.Node) -> bool:
    """Whether ``node``'s value, or what may alias it (``_aliases``), is an output of the graph or reaches an op that
    may read it by its layout (``_opaque``): the caller's code (its ``q.view(-1)``) or the op's kernel expects the
    GEMM's contiguous output, and a column slice of the fused output failed there or read wrong numbers."""
    todo, seen = [node], set()
    while todo:
        for user in todo.pop().users:
            if user.op == "output" or _opaque(user):
                return True
            if _aliases(user) and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _slice_use(node: fx.Node, part: Any, own: Any) -> str:
    """How the users of ``node``, replayed with ``part`` (a fake column slice of the fused output, or what a view
    op made of it) in its place, depend on its layout: "" where none does (``_layout_bound``). ``own``: a fake of the
    GEMM's own, contiguous output, replayed alongside: an op that returns a view of it but a copy of the slice
    (``q.reshape(-1)``, ``q.contiguous()``), where a write in place reaches the one or the other, splits what the
    model wrote into one memory (``q.reshape(-1).mul_(2)`` doubled q; fused, a copy of it)."""
    roots = (_own_storage(part), _own_storage(own))
    todo, seen = [(node, part, own, None)], set()
    # the nodes where own and slice part ways, each with the nodes that follow it (its side); the in-place writes
    # into either's memory, each with the parting it is behind (None: the GEMM's output's own memory on both sides)
    sides: dict[fx.Node, list[fx.Node]] = {}
    writes: list[tuple[fx.Node, Optional[fx.Node]]] = []
    while todo:
        node, part, own, parted = todo.pop()
        # (a list - split's, unbind's - shares nothing itself: its items, taken by getitem, are tensors)
        shares = tuple(isinstance(t, torch.Tensor) and _own_storage(t) == root for t, root in zip((part, own), roots))
        if parted is None and shares[0] != shares[1]:
            parted = node
        if parted is not None:
            sides.setdefault(parted, []).append(node)
        for user in node.users:
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if name in _LAYOUT_OPS or user.target is torch.as_strided:
                return f"is given to {name} ({user.name}), which reads or changes its strides"
            written = _written(user) if any(shares) and _mutates(user) else []
            if written is None or node in written:
                writes.append((user, parted))
            if not _aliases(user) or user in seen:
                continue
            seen.add(user)
            results = []
            for value in (part, own):
                replace = lambda a, node=node, value=value: value if a is node else fake_value(a)  # noqa: E731
                args = fx.node.map_aggregate(user.args, replace)
                kwargs = fx.node.map_aggregate(user.kwargs, replace)
                try:
                    if user.op == "call_method":
                        results.append(getattr(args[0], user.target)(*args[1:], **kwargs))
                    elif user.target is getattr:
                        results.append(getattr(*args))
                    else:
                        results.append(user.target(*args, **kwargs))
                except (RuntimeError, ValueError, TypeError):  # (ValueError: from fake tensors' stride checks)
                    if value is own:  # (an op the replay cannot make: nothing known of its layout either way)
                        results.append(None)
                        continue
                    return (f"is viewed ({user.name}) in a way that a column slice of one fused output cannot be "
                            "(reshape instead of view to fuse them)")
            todo.append((user, *results, parted))
    if sides and writes:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        for write, behind in writes:
            for parted, side in sides.items():
                # a write before the parting reaches both (the copy is taken after it); after it, one side misses
                # it: a write through the copy's side (meant for the output), or one into the output while the
                # copy's side is read after it
                if order[write] > order[parted] and (behind is parted or any(
                        order[u] > order[write] for m in side for u in m.users)):
                    return (f"is made a view of the GEMM's own output but a copy of a column slice of the fused one "
                            f"({parted.name}) and written in place after it ({write.name}): fused, the write would "
                            "miss what the model reads")
    return ""


class HorizontalFusionPass(Fp8Pass):
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if not self.enabled:  # an opt-in optimization: sites keep their scheme as it is
            return 0
        groups: dict[_GroupKey, list[fx.Node]] = defaultdict(list)
        epochs = static_epochs(gm.graph)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is _SCALED_MM:
                xq, x_scale, _, _, bias, x_block, w_block, dtype, fast = node.args
                if isinstance(xq, fx.Node) and xq.target is _STATIC:  # grouped by the input itself, each layer
                    # quantizing it with its own scale (share_static), between the same in-place writes into it
                    xq, x_scale = xq.args[0], (_STATIC_KEY, epochs[xq])
                groups[_GroupKey(xq, x_scale, tuple(x_block), tuple(w_block), dtype, fast)].append(node)
        fused = 0
        claimed: dict[fx.Node, str] = {}  # weight -> the group it was fused with in this graph
        fused_groups: set[tuple] = set()  # the weights of each group fused in this graph
        for nodes in groups.values():
            if len(nodes) < 2:
                continue
            nodes = _in_stored_order(nodes, ctx)
            weights = tuple(n.args[2] for n in nodes)
            reason = self._why_not(nodes, ctx)
            taken = [claimed[w] for w in weights if w in claimed]
            if taken and weights in fused_groups:
                taken = []  # the same layers called again (shared weights, ALBERT): the same fused tensor
            if taken:  # a layer read by two groups (a(x), b(x), b(y), c(y)): its weight can sit in one fused tensor
                reason = f"shares a layer with {taken[0]}"
            if reason:
                amend_sites(ctx, nodes, f"not fused with {site_names(ctx, nodes)}: {reason}")
                continue
            claimed.update({w: f"fused({site_names(ctx, nodes)})" for w in weights})
            fused_groups.add(weights)
            static = nodes[0].args[0].target is _STATIC
            if static:
                share_static(gm, nodes)
            y = self._fuse(gm, nodes, ctx)
            # every fused site is found by the one GEMM in Inductor's output code (the report's kernel column); with
            # static scales, each layer's input at the group's largest (a layer's own was no sign of it)
            amend_sites(ctx, nodes, f"fused({site_names(ctx, nodes)})" + (
                " (the input quantized once, at the largest of their static input scales)" if static else ""),
                node=Site.origin_of(y))
            fused += len(nodes)
        layouts = _Layouts(gm.graph)
        self._explain_singles(groups, ctx, layouts)
        self._explain_static(groups, ctx)
        self._explain_reshaped(groups, ctx, layouts)
        gm.recompile()
        return fused

    @staticmethod
    def _explain_singles(groups: dict[_GroupKey, list[fx.Node]], ctx: PassContext, layouts: "_Layouts") -> None:
        """A GEMM alone in its group while others read the same activation (a per-tensor shard among per-channel
        ones, another output dtype, the activation quantized again after an in-place write) says what kept it
        apart; a fused group, which readers of its very tensor a write kept out."""
        by_input: dict[tuple, list[_GroupKey]] = defaultdict(list)
        by_source: dict[tuple, list[_GroupKey]] = defaultdict(list)
        for key in groups:
            by_input[(key.xq, key.x_scale)].append(key)
            if (source := _quantized_from(key.xq)) is not None and not _is_static(key):  # (_explain_static)
                by_source[layouts.key(source)].append(key)  # (one tensor, through any of its nodes: ``_layout``)
        # one activation quantized apart for this GEMM (dynamic scales): in other blocks than the others' (a layer's
        # own activation granularity), or in the same ones again after an in-place write that may reach it (the
        # linear pass reuses a quantization up to such a write)
        for keys in by_source.values():
            for key in keys:
                others = [k for k in keys if k.xq is not key.xq]
                if not others or len(by_input[(key.xq, key.x_scale)]) > 1:
                    continue  # (another group reads this very quantization: what kept them apart is said below)
                alike = [k for k in others if k.x_block == key.x_block]
                names = site_names(ctx, [n for k in alike or others for n in groups[k]])
                if len(groups[key]) > 1:  # fused: the readers of its input a write kept out
                    if alike:
                        verb = "reads" if sum(len(groups[k]) for k in alike) == 1 else "read"
                        amend_sites(ctx, groups[key], f"(not with {names}, which {verb} the same input, quantized "
                                                      "apart with an in-place write that may reach it in between)")
                    continue
                if alike:
                    why = (f"{names} read the same input, quantized apart with an in-place write that may reach it "
                           "in between")
                else:
                    mine = granularity_from_block(list(key.x_block))
                    why = f"its input is quantized {mine}, where {names} read it quantized otherwise"
                amend_sites(ctx, groups[key], f"not fused horizontally: {why}")
        for keys in by_input.values():
            for key in keys:
                if len(groups[key]) > 1 or len(keys) < 2:
                    continue
                other = max((k for k in keys if k != key), key=lambda k: len(groups[k]))
                names = site_names(ctx, groups[other])
                has = "has" if len(groups[other]) == 1 else "have"
                if key.w_block != other.w_block:
                    mine, theirs = (weight_granularity_name(granularity_from_block(list(b), weight=True))
                                    for b in (key.w_block, other.w_block))
                    why = f"{mine} weight scales where {names} {has} {theirs}"
                elif key.dtype != other.dtype:
                    why = f"output dtype {key.dtype} where {names} {has} {other.dtype}"
                elif key.fast != other.fast:
                    why = "use_fast_accum differs"
                else:
                    why = f"its input's blocks differ from {names}'"
                amend_sites(ctx, groups[key], f"not fused horizontally: {why}")

    @staticmethod
    def _explain_static(groups: dict[_GroupKey, list[fx.Node]], ctx: PassContext) -> None:
        """A static layer among dynamic ones that read the same input: they read different fp8 activations; one
        alone between in-place writes that may reach the input (``static_epochs``)."""
        by_x: dict[fx.Node, list[_GroupKey]] = defaultdict(list)
        dynamic: dict[fx.Node, list[fx.Node]] = defaultdict(list)  # input -> the GEMMs quantizing it dynamically
        dynamic_keys: dict[fx.Node, list[_GroupKey]] = defaultdict(list)  # (and their groups)
        for key in groups:
            if _is_static(key):
                by_x[key.xq].append(key)
            elif (source := _quantized_from(key.xq)) is not None:
                dynamic[source] += groups[key]
                dynamic_keys[source].append(key)
        for x, keys in by_x.items():
            nodes = [n for k in keys for n in groups[k]]
            for key in keys:
                others = [k for k in keys if k.x_scale != key.x_scale]
                if len(groups[key]) == 1 and others:
                    amend_sites(ctx, groups[key], f"not fused horizontally: "
                                                  f"{site_names(ctx, [n for k in others for n in groups[k]])} read the "
                                                  "same input, quantized apart with an in-place write that may reach "
                                                  "it in between")
            if dynamic.get(x):  # one static layer among dynamic ones: it said nothing
                verb = "quantizes" if len(dynamic[x]) == 1 else "quantize"
                alone = [n for k in keys if len(groups[k]) == 1 for n in groups[k]]
                amend_sites(ctx, alone, f"not fused horizontally: it quantizes the input with its own static "
                                        f"input_scale, where {site_names(ctx, dynamic[x])} {verb} it dynamically")
                # (static layers fused with each other: "fused(q_proj,k_proj)", and why the dynamic ones are not in)
                amend_sites(ctx, [n for n in nodes if n not in alone],
                            f"(not with {site_names(ctx, dynamic[x])}, which {verb} the input dynamically where "
                            "these take their static input_scale)")
                # and the dynamic ones, the other way round (a dynamic layer alone among static ones said nothing)
                static_names, take = site_names(ctx, nodes), "takes" if len(nodes) == 1 else "take"
                for key in dynamic_keys[x]:
                    if len(groups[key]) == 1:
                        amend_sites(ctx, groups[key], f"not fused horizontally: it quantizes the input dynamically, "
                                                      f"where {static_names} {take} a static input_scale")
                    else:
                        amend_sites(ctx, groups[key], f"(not with {static_names}, which {take} a static input_scale "
                                                      "where these quantize the input dynamically)")

    @staticmethod
    def _explain_reshaped(groups: dict[_GroupKey, list[fx.Node]], ctx: PassContext, layouts: "_Layouts") -> None:
        """GEMMs that read one tensor through reshapes of other shapes (``k_proj(x.view(-1, d))`` beside ``q_proj(x)``):
        the same rows, but other nodes, each quantized apart, and a fused GEMM reads one quantized tensor. (Nodes of
        one layout - ``x.view(-1, d)`` beside ``x.flatten(0, 1)`` - share one quantization, the linear pass's, and
        are fused.) Each says so, where the reshape is what keeps them apart: GEMMs whose groups differ in more
        than their input (another activation or weight block, output dtype, accumulation, a static scale beside
        dynamic ones) would not be fused reading one node either. (Fusing them would take the quantization of the
        tensor itself, reshaped, and each output slice reshaped back: not done.)"""
        by_root: dict[tuple, dict[fx.Node, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
        for key, nodes in groups.items():
            if (source := key.xq if _is_static(key) else _quantized_from(key.xq)) is None:
                continue
            root, hops = source, 0
            while hops < 8 and _reshapes(root):
                root, hops = root.args[0], hops + 1
            by_root[(root, key.x_block, key.w_block, key.dtype, key.fast, _is_static(key))][source] += nodes
        for (root, *_, static), sources in by_root.items():
            if len(sources) < 2:
                continue
            for source, mine in sources.items():
                # (dynamic scales: the same tensor read again after a write, in one layout, which _explain_singles
                # says; static ones: each layer quantizes with its own scale, whatever node it reads)
                other_nodes = [n for s, ns in sources.items() if s is not source
                               and (static or not layouts.same(s, source)) for n in ns]
                if not other_nodes:
                    continue
                others = site_names(ctx, other_nodes)
                verb = "reads" if len(other_nodes) == 1 else "read"
                how = "as it is" if source is root else f"reshaped ({source.name}: {list(fake_value(source).shape)})"
                if len(mine) == 1:
                    amend_sites(ctx, mine, f"not fused horizontally: it reads {root.name} {how}, where {others} "
                                           f"{verb} it through another node; a fused GEMM reads one tensor node")
                else:
                    amend_sites(ctx, mine, f"(not with {others}, which {verb} {root.name} through another "
                                           "reshape node)")

    def _why_not(self, nodes: list[fx.Node], ctx: PassContext) -> str:
        inputs = [a for n in nodes for a in n.args[2:5] if a is not None]
        if any(isinstance(a, fx.Node) and a.op == "get_attr" for a in inputs):  # (ctx.example holds them too)
            return ("a weight, scale or bias is a constant of the graph (Inductor's freezing): fusing moves the "
                    "weights into one tensor, which a frozen graph would not read")
        if any(not isinstance(ctx.example.get(a), torch.nn.Parameter) for a in inputs):
            return "a weight, scale or bias is not a parameter"
        if len(set(inputs)) != len(inputs):  # which (a shared weight shares its scale too)
            for j, role in enumerate(("weight", "scale", "bias")):
                column = [n.args[2 + j] for n in nodes if n.args[2 + j] is not None]
                if len(set(column)) != len(column):
                    return f"the GEMMs share a {role} tensor"
            return "the GEMMs share a tensor (one's weight, scale or bias is another's)"
        weights_and_scales = [a for n in nodes for a in n.args[2:4]]
        biases = [n.args[4] for n in nodes if n.args[4] is not None]
        if any(len({ctx.example[a].is_inference() for a in group}) > 1 for group in (weights_and_scales, biases)):
            return ("some of their parameters are inference tensors (quantized under torch.inference_mode) and some "
                    "not: one fused tensor cannot stand in for both; quantize the layers in one mode")
        # one fused tensor has one dtype: a bias (or scale) of another became a view of the fused one, its parameter
        # cast for good (k's bf16 bias of a float32 model under autocast came back float32: state_dict, saves)
        for role, column in (("scales", [n.args[3] for n in nodes]), ("biases", biases)):
            dtypes = [ctx.example[a].dtype for a in column]
            if len(set(dtypes)) > 1:
                listed = ", ".join(f"{site_names(ctx, [n])}: {d}" for n, d in zip(
                    [n for n in nodes if role == "scales" or n.args[4] is not None], dtypes))
                return (f"their {role} are of different dtypes ({listed}): one fused tensor of them would cast a "
                        "layer's parameter; give them one dtype")
        # fused by an earlier graph, but not as exactly this group (one tensor of these weights alone): moving a
        # weight again would undo that fusion
        weights = [ctx.example[n.args[2]] for n in nodes]
        views = [w for w in weights if w.untyped_storage().nbytes() > w.numel() * w.element_size()]
        if views and (len(_storages(weights)) > 1 or views[0].untyped_storage().nbytes() != sum(
                w.numel() * w.element_size() for w in weights)):
            return "a weight already sits in a tensor fused with other layers"
        if not weights[0].shape[-1]:  # (nothing to fuse: each output is its bias; the weights' scales are [n, 0])
            return "in_features is 0"
        w_block = nodes[0].args[6]
        if w_block[0] not in (-1, 1):
            rows = [fake_value(n.args[2]).shape[0] for n in nodes[:-1]]
            if any(r % w_block[0] for r in rows):
                return f"output sizes {rows} are not multiples of the {w_block[0]}-row weight blocks"
        return _layout_bound(nodes, ctx)

    @staticmethod
    def _fuse(gm: fx.GraphModule, nodes: list[fx.Node], ctx: PassContext) -> fx.Node:
        graph = gm.graph
        first = nodes[0]  # (in the order the weights are fused, _in_stored_order: maybe not the graph's)
        members = set(nodes)
        earliest = next(n for n in graph.nodes if n in members)  # the fused GEMM goes before each reader of a part
        xq, x_scale, _, _, _, x_block, w_block, dtype, fast = first.args
        column = lambda i: [n.args[i] for n in nodes]  # noqa: E731
        biases = column(4)  # a tensor or None each
        args = (xq, x_scale, column(2), column(3), biases, x_block, w_block, dtype, fast)
        with graph.inserting_before(earliest):
            y = graph.call_function(_FUSED, args)
            set_fake_value(y, _FUSED, args)
            if "source_fn_stack" in first.meta:  # named after the first linear in Inductor's output code
                y.meta["source_fn_stack"] = first.meta["source_fn_stack"]
            offset = 0
            for node in nodes:
                size = fake_value(node.args[2]).shape[0]
                part = graph.call_function(torch.narrow, (y, -1, offset, size))
                set_fake_value(part, torch.narrow, part.args)
                if _needs_own_layout(node):  # the caller / the op gets a tensor of its own, laid out as the GEMM's
                    part = graph.call_method("contiguous", (part,))
                    set_fake_value(part, torch.Tensor.contiguous, part.args)
                part.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
                node.replace_all_uses_with(part)
                offset += size
        real = lambda i: [ctx.example[a] for a in column(i)]  # noqa: E731  the parameters themselves
        params = (real(2), real(3), [None if b is None else ctx.example[b] for b in biases], w_block)
        where = lambda i: [None if a is None else ctx.positions[a] for a in column(i)]  # noqa: E731
        gm.meta.setdefault(SHARED_INPUTS, []).append((where(2), where(3), where(4), w_block))
        for node in nodes:  # (which takes their arguments)
            graph.erase_node(node)
        # after compilation: AOTAutograd re-reads the inputs' layout as Dynamo recorded it
        gm.meta.setdefault(AFTER_COMPILE, []).append(lambda: share_memory(*params))
        return y
