"""FP8 MoE pass.

Matches (Dynamo torch IR), for every experts module whose weights are fp8fx dequantized views
(``fp8fx.weights.moe``), the region of nodes its forward created (their ``nn_module_stack`` holds the
module)::

    w13 = fp8fx.dequantize(w13q, w13_scale, w_block, dtype, a13_scale, act_block)   # [E, 2I, H]
    w2 = fp8fx.dequantize(w2q, w2_scale, w_block, dtype, a2_scale, act_block)        # [E, H, I]
    ... the model's experts code on x [T, H], top_k_index [T, K], top_k_weights [T, K] ...
    out = ...                                                                          # [T, H]

whatever form that code takes: HF transformers 5's ``grouped_mm`` (sort by expert, ``_grouped_mm``
or its CPU fallback op, un-sort, sum over k), ``batched_mm`` (weights gathered per (token, k),
``bmm``), or a per-expert loop Dynamo unrolled (``w13[e]``, ``linear``, masks ``top_k_index == e``;
``examples/moe_reference.py``). Rewrites to::

    out = fp8fx.fused_moe(x, top_k_weights, top_k_index, w13q, w13_scale, w2q, w2_scale,
                          w_block, act_block, out.dtype, a13_scale, a2_scale)

and for GPT-OSS's experts (HF's ``GptOssExperts``: each GEMM's output plus its expert's bias, gathered like the
weights and added in place; gate / up as the even / odd features; ``(up.clamp(-L, L) + 1) * g * sigmoid(g * alpha)``
with ``g = gate.clamp(max=L)``) the same call with ``w13_bias``, ``w2_bias``, ``interleaved=True`` and
``activation="swiglu_oai"``, alpha and L read from the graph's constants; DeepSeek-V4's ``silu(gate.clamp(max=L)) *
up.clamp(-L, L)`` as ``activation="silu_clamped"``, Gemma-4's ``gelu(gate, approximate="tanh") * up`` as
``activation="gelu_tanh"``, the exact GELU as ``"gelu"`` and ``relu(gate).square() * up`` (transformers'
ReLUSquaredActivation: relu, then square or ``** 2``) as ``"relu2"``. Ungated experts (HF's ``has_gate=False``,
Nemotron-H's: w13 is ``up_proj`` [E, I, H], as w2's I tells) compute ``act(up)`` with no split: the same call with
``gated=False``.

Routing (the router, top-k, its normalisation) is outside the experts module and stays the model's.

A region is rewritten only if it computes what fused_moe computes. ``_Interpreter`` follows each node
in graph order and labels what it holds (``Val``): index bookkeeping, hidden states, a weight (which
expert, transposed or not), the first GEMM's output, gate / up halves, SiLU(gate) * up, the second
GEMM's output, that output times its routing weight, and sums of those. Every node must fit one rule
(a GEMM contracts a weight over its stored input dim; chunk(2) or slices of the first or last I (or the even or odd)
features split the first GEMM's output; one of fused_moe's activations (above), the same in every expert; a
bias only of its own GEMM and expert, before the activation / the routing weight; each expert output is weighted once
by its own routing weight; the sum covers every expert once and runs over k; top_k_index and top_k_weights are read
whole: views keeping every (token, k) pair, gathers by a tensor, not ``[:, :1]``, ``[:, [1, 0]]`` or ``expand``);
anything else (another activation, a bias of something else, a norm, a scale, a mutation of an input, an op the pass
does not know) leaves the region as it is, reported with the node and the reason. Trusted, not proven: the index
bookkeeping (sorts, gathers, scatters, clamps) pairs each token with its k-th expert, as the model's own code intends.
Where the order of the rows is followed it is checked: a grouped GEMM's rows are in the experts' order,
routing weights gathered by the sort's permutation too, rows gathered by its inverse (``inv[perm] = arange``,
``argsort(perm)``) back in the routing order; a product of rows and weights in the two known orders, or a sum over k of
rows still sorted, is refused (h161: it was rewritten into fused_moe's routed answer, not the model's own). A gather
by any other index leaves the order unknown, and trusted.

Expert-parallel sentinels: transformers 5.17 (and later versions on an expert-parallel module) guard
against routing ids ``>= num_experts``: ``sentinel = top_k_index >= E`` (any view of it), ids clamped to
``[0, E - 1]``, and hidden states, GEMM outputs or routing weights ``masked_fill``-ed where ``sentinel``
holds. fused_moe takes ids in ``[0, E)``, where that mask is all false: a ``masked_fill`` by exactly that
mask is the identity and is accepted; a ``masked_fill`` by any other mask is not.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import types
from typing import Any, Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true

import fp8fx.ops  # noqa: F401  (registers torch.ops.fp8fx)
from fp8fx import quant
from fp8fx.config import LayerScheme, granularity_from_block
from fp8fx.passes.base import FLOAT_INPUTS, Fp8Pass, PassContext, attribute_path, fake_value, float_input_value
from fp8fx.passes.base import bytes_saved, dequant_args, may_record_grad, module_path, set_fake_value
from fp8fx.passes.linear import lacks_fp8_tensor_cores
from fp8fx.report import NOT_QUANTIZED, Site

_DEQUANT = (torch.ops.fp8fx.dequantize, torch.ops.fp8fx.dequantize.default)
_ACT_DTYPES = quant.HIGH_PRECISION


class _NoMatch(Exception):
    """The region is not the experts computation fused_moe computes; the message says why."""


@dataclasses.dataclass(frozen=True)
class Val:
    """What a region node holds. ``kind``: ``idx`` (indices, masks' sources, sizes), ``mask`` (top_k_index
    == e), ``ids`` (top_k_index or its values rearranged: views, gathers, sorted, clamped), ``ids_sort``
    (sort(ids): values and permutation), ``sentinel`` (ids >= E: false for every id fused_moe takes),
    ``ids_part`` (some of the ids: sliced, reordered or broadcast along k; only their sentinel flags are
    read), ``wts`` (routing weights, every (token, k) pair's), ``x`` (hidden states), ``w13`` / ``w2``
    (weights), ``g1`` (first GEMM), ``chunks`` / ``gate`` / ``up``, ``act`` (SiLU(gate)), ``h`` (act * up), ``y``
    (second GEMM), ``out`` (y times its routing weight), ``zero`` (a fresh accumulator), ``sum`` (the combine).
    ``expert``: for values, None for every (token, k) pair at once (grouped / gathered forms) or an int for
    one expert of an unrolled loop; for weights, None (all experts, stacked), ``"pairs"`` (gathered per
    pair) or an int; for ``sum``, the frozenset of experts summed so far, or ``"all"``. ``fdim``: the feature
    dim (negative) of hidden-state-like values. ``t``: weights whose stored ``[rows, cols]`` are transposed.
    ``b``: a GEMM's output with its expert's bias added (``b13`` / ``b2``: the biases, whole or gathered like
    weights). ``order``: of ids, and of what is gathered by them or computed per pair, the order of the pairs: ``""``
    top_k_index's, ``"sorted"`` an ascending sort's (a grouped GEMM's rows), ``"gathered:<node>"`` that index node's
    gather; of a sort's permutation ``"perm:<ids node>"``.

    GPT-OSS's clamped SwiGLU: ``gate_c`` / ``up_c`` (gate clamped above / up on both sides at ``p = (limit,)``),
    ``gate_a`` (gate_c times alpha: ``p = (limit, alpha)``), ``sig`` (its sigmoid), ``glu`` (gate_c * sig), ``up1``
    (up_c + 1); ``h`` is then up1 * glu. ``act``'s ``p``: ``()`` SiLU of the gate, ``(limit,)`` of gate_c
    (DeepSeek-V4's, times up_c), ``("gelu_tanh",)`` GELU (tanh) of the gate (Gemma-4's)."""

    kind: str
    expert: Any = None
    fdim: int = -1
    t: bool = False
    b: bool = False
    p: tuple = ()
    order: str = ""


def _order_words(order: str) -> str:
    """``Val.order`` as the reasons say it (the internal ``"gathered:<node>"`` names the index node)."""
    if not order:
        return "the routing order (top_k_index's)"
    if order == "sorted":
        return "the experts' ascending order (a sort of the routing ids)"
    kind, _, node = order.partition(":")
    return f"the order of the index {node!r}" if kind == "gathered" else f"the order of the sort of {node!r}"


_IDX = Val("idx")
_INDEX_KINDS = ("idx", "ids", "mask", "sentinel")
# ops that may read ``ids_part`` (as their first operand): they keep it ``ids_part`` or make it sentinel flags
_PART_OPS = ("view", "transpose", "getitem", "ge", "clamp", "masked_fill", "meta")


# -- op names ---------------------------------------------------------------------------------
def _function_names() -> dict:
    f = torch.nn.functional
    names = {
        operator.getitem: "getitem", operator.setitem: "setitem", operator.mul: "mul", torch.mul: "mul",
        operator.add: "add", torch.add: "add", operator.floordiv: "floordiv", operator.eq: "eq", torch.eq: "eq",
        operator.ge: "ge", torch.ge: "ge", torch.greater_equal: "ge", torch.clamp: "clamp", torch.clip: "clamp",
        torch.masked_fill: "masked_fill",
        torch.sort: "sort", torch.argsort: "sort", torch.histc: "idx_op", torch.cumsum: "idx_op",
        torch.bincount: "idx_op", torch.arange: "factory", torch.empty_like: "factory", torch.zeros_like: "factory",
        torch.zeros: "factory", torch.empty: "factory", torch.nn.functional.one_hot: "idx_op", torch.where: "idx_op",
        torch.nonzero: "idx_op", torch.greater: "idx_op", operator.gt: "idx_op", operator.sub: "idx_op",
        torch.sum: "sum", torch.chunk: "chunk", torch.unsqueeze: "view", torch.squeeze: "view", torch.t: "transpose",
        torch.transpose: "transpose", torch.permute: "transpose", torch.reshape: "view", torch.flatten: "view",
        torch.repeat_interleave: "view", f.silu: "silu", torch.index_add: "index_add", torch.sigmoid: "sigmoid",
        f.gelu: "gelu", f.relu: "relu", torch.relu: "relu", torch.square: "square", torch.pow: "pow",
        operator.pow: "pow",
        torch._grouped_mm: "gemm", torch.bmm: "gemm", torch.mm: "gemm", torch.matmul: "gemm",
        operator.matmul: "gemm", torch._C._nn.linear: "gemm", f.linear: "gemm",
        torch._C._set_grad_enabled: "grad_mode",
        # transformers 5.17 asks, on CUDA, whether grouped_mm runs on this GPU: a constant to the experts
        torch.cuda.get_device_capability: "meta",
    }
    if hasattr(f, "grouped_mm"):
        names[f.grouped_mm] = "gemm"
    return names


_FUNCTIONS = _function_names()
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_GROUPED = tuple(f for f in (torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", None)) if f)
_BATCHED = (torch.bmm, torch.matmul, operator.matmul, "bmm", "matmul", "__matmul__")
_METHODS = {
    "view": "view", "reshape": "view", "unsqueeze": "view", "squeeze": "view", "flatten": "view", "contiguous": "view",
    "to": "view", "float": "view", "bfloat16": "view", "half": "view", "clone": "view", "expand": "view",
    "repeat_interleave": "view", "transpose": "transpose", "t": "transpose", "permute": "transpose",
    "chunk": "chunk", "mul": "mul", "add": "add", "sum": "sum", "eq": "eq", "index_add_": "index_add",
    "index_add": "index_add", "int": "idx_op", "long": "idx_op", "cumsum": "idx_op", "histc": "idx_op",
    "size": "meta", "argsort": "sort", "sort": "sort", "greater": "idx_op", "nonzero": "idx_op",
    "__eq__": "eq",  # torch 2.11's Dynamo records `ids == e` as a call of the method
    "ge": "ge", "__ge__": "ge", "greater_equal": "ge", "clamp": "clamp", "clamp_": "clamp", "clip": "clamp",
    "clip_": "clamp", "masked_fill": "masked_fill", "masked_fill_": "masked_fill", "sigmoid": "sigmoid", "add_": "add",
    "relu": "relu", "square": "square", "pow": "pow", "__pow__": "pow",
    "mm": "gemm", "bmm": "gemm", "matmul": "gemm", "__matmul__": "gemm",  # x.matmul(w[e].T): DBRX's expert loop
}
_RUNTIME_ASSERTS = (torch.ops.aten._assert_scalar.default, torch._check,
                    torch.ops.aten.sym_constrain_range_for_size.default)
_GEMM_OPS = {"transformers::grouped_mm_fallback"}  # HF's CPU / non-bf16 grouped GEMM custom op


def _op(node: fx.Node) -> Optional[str]:
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        return "gemm" if target.name() in _GEMM_OPS else None
    if target is getattr:
        attr = node.args[1]
        return "transpose" if attr in ("T", "mT") else "meta" if attr in ("shape", "dtype", "device") else None
    return _FUNCTIONS.get(target)


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.kwargs[name] if name in node.kwargs else node.args[i] if len(node.args) > i else default


def _input(node: fx.Node):
    """The tensor an op or a method reads first (``self`` of a method, ``input`` of a function), however passed."""
    return _arg(node, 0, "self" if node.op == "call_method" else "input")


# -- the interpreter ----------------------------------------------------------------------------
class _Interpreter:
    """Labels every node of ``region`` (graph order); raises ``_NoMatch`` at the first that breaks a rule."""

    def __init__(self, inputs: dict[fx.Node, Val], e: int, i: int, h: int, k: int, gated: bool = True):
        self.val: dict[fx.Node, Optional[Val]] = dict(inputs)
        self.gated = gated  # False: w13 is up alone (Nemotron-H's experts), act(up) is the intermediate
        self.inputs = set(inputs)
        # the hidden states and their views: rows in the input's order (the dense form's GEMM reads one of them)
        self.plain_x = {n for n, v in inputs.items() if v.kind == "x"}
        self.experts, self.inter, self.hidden, self.k = e, i, h, k
        # what the region computes where fused_moe has a choice, one entry per place it shows: w13's rows split in
        # ``halves`` or ``interleaved``; the activation (``form``'s tuples); whether
        # each first / second GEMM output had its bias added. ``form`` checks that each has one value.
        self.seen: dict[str, set] = {"layout": set(), "activation": set(), "b13": set(), "b2": set()}

    def form(self) -> dict[str, Any]:
        """fused_moe's arguments for what the region computes (``interleaved``, ``activation`` and its alpha and
        limit, which biases it adds), or ``_NoMatch`` where parts of it differ."""
        for what, values in self.seen.items():
            if len(values) > 1:
                raise _NoMatch(f"the experts compute in more than one way ({what}: {sorted(map(str, values))}); "
                               "fused_moe computes every expert alike")
        one = {what: next(iter(values), None) for what, values in self.seen.items()}
        # ("silu",), ("gelu_tanh",), ("gelu",), ("relu2",), ("swiglu_oai", alpha, limit), ("silu_clamped", limit)
        act = one["activation"] or ("silu",)
        return {"interleaved": one["layout"] == "interleaved", "activation": act[0], "gated": self.gated,
                "swiglu_alpha": act[1] if act[0] == "swiglu_oai" else 1.702,
                "swiglu_limit": act[-1] if act[0] in ("swiglu_oai", "silu_clamped") else 7.0,
                "b13": bool(one["b13"]), "b2": bool(one["b2"])}

    def run(self, region: list[fx.Node]) -> None:
        for node in region:
            if node.target in _DEQUANT:
                continue  # labelled as inputs
            op = _op(node)
            if op is None:
                raise _NoMatch(f"{node.name} ({_describe(node)}) is not part of an experts computation fused_moe knows")
            read = node.all_input_nodes[1 if op in _PART_OPS else 0:]
            if any(getattr(self.val.get(a), "kind", None) == "ids_part" for a in read):
                self._fail(node, "reads some of the routing ids (top_k_index sliced, reordered or broadcast along k); "
                                 "fused_moe reads every (token, k) pair")
            try:
                self.val[node] = getattr(self, f"_{op}")(node)
            except (IndexError, KeyError, TypeError, ValueError) as e:  # arguments in a form no rule reads
                raise _NoMatch(f"{node.name} ({_describe(node)}) passes its arguments in a form the MoE pass does not "
                               f"read ({type(e).__name__}: {e})") from None

    # helpers
    def _of(self, a) -> Optional[Val]:
        if isinstance(a, fx.Node):
            if a not in self.val:
                raise _NoMatch(f"{a.name} is read by the experts but is not one of their inputs")
            return self.val[a]
        return _IDX  # constants, shapes, dtypes, devices, slices

    def _operands(self, node: fx.Node) -> list[Val]:
        return [self._of(a) for a in node.all_input_nodes]

    def _all_idx(self, node: fx.Node) -> bool:
        return all(v is not None and v.kind in _INDEX_KINDS for v in self._operands(node))

    def _binary(self, node: fx.Node) -> tuple:
        """The two operands of an add / mul however they are passed (``torch.add(input=x, other=y)``); more (add's
        ``alpha``, an ``out``) are refused: fused_moe computes plain sums and products."""
        first = "self" if node.op == "call_method" else "input"
        extra = {k: v for k, v in node.kwargs.items() if k not in (first, "other")}
        if len(node.args) > 2 or extra.keys() - {"alpha"} or extra.get("alpha", 1) != 1:
            self._fail(node, f"takes more than two operands ({list(node.args[2:]) or extra}); fused_moe adds and "
                             "multiplies plainly")
        return _input(node), _arg(node, 1, "other")

    def _fail(self, node: fx.Node, what: str):
        kinds = ", ".join(v.kind if v else "?" for v in self._operands(node))
        raise _NoMatch(f"{node.name} ({_describe(node)}) {what} (operands: {kinds})")

    # ops on indices only
    def _idx_op(self, node):
        if not self._all_idx(node):
            self._fail(node, "computes on values other than indices")
        return _IDX

    _floordiv = _idx_op

    def _sort(self, node):
        """sort / argsort of the flat ids, ascending: ``ids_sort`` ([0] the ids in sorted order, [1] the permutation
        that sorts them), or argsort's permutation (``ids[perm]``: the ids in sorted order). Any other sort (of
        [T, K] ids: within each token) is index bookkeeping of no known order. A descending sort of the flat ids is
        refused: the grouped GEMMs' offsets (``histc`` / ``bincount`` cumsums) count the experts in ascending order,
        and rows sorted the other way run other experts' weights (it was taken for bookkeeping, and fused)."""
        self._idx_op(node)
        src = _input(node)
        flat_ids = self._of(src).kind == "ids" and len(_shape(src)) == 1
        if flat_ids and _arg(node, 2, "descending", False) is not False:
            self._fail(node, "sorts the routing ids in descending order, against the ascending expert offsets a "
                             "grouped GEMM takes")
        if not flat_ids or node.kwargs.keys() - {"input", "self", "dim", "descending", "stable"}:
            perm = self._of(src).order.startswith("perm:") and len(_shape(src)) == 1
            if perm and _op_name(node) == "argsort" and _arg(node, 2, "descending", False) is False:
                return Val("idx", order=f"unsort:{src.name}")  # argsort(perm): the inverse permutation
            return _IDX
        if _op_name(node) == "sort":
            return Val("ids_sort", order=f"perm:{src.name}")
        return Val("idx", order=f"perm:{src.name}")

    def _grad_mode(self, node):
        return None

    def _meta(self, node):
        """What a value is (shape, dtype, device, the GPU's compute capability), not what it holds."""
        return _IDX

    def _factory(self, node):
        if node.target is torch.zeros_like or node.target is torch.zeros:
            return Val("zero")
        if self._all_idx(node):
            return _IDX
        self._fail(node, "makes an uninitialised tensor like a hidden state")

    def _eq(self, node):
        a, b = node.args[:2]
        # expert b's mask only on the routing ids themselves: ``(ids - 1) == b`` (an expert-parallel offset,
        # any arithmetic on the ids) selects other pairs than fused_moe would
        if isinstance(a, fx.Node) and isinstance(b, int) and self._of(a).kind == "ids":
            return Val("mask", b)
        return self._idx_op(node)

    def _ge(self, node):
        a, b = node.args[:2]
        kind = self._of(a).kind if isinstance(a, fx.Node) else None
        if isinstance(b, int) and b == self.experts and kind in ("ids", "ids_part"):
            return Val("sentinel")  # ids >= E: expert-parallel sentinels, none among the ids fused_moe takes
        if kind == "ids_part" and not isinstance(b, fx.Node):
            return _IDX  # a mask of some pairs: no expert's mask, no sentinel
        return self._idx_op(node)

    def _clamp(self, node):
        """Index bookkeeping: ids clamped to [0, E - 1] or wider are the ids (the identity on every id fused_moe
        takes); in place only on a tensor the region made. A narrower clamp (``ids.clamp(0, 3)`` of 8 experts) sends
        pairs to other experts than their ids: its result is an index computed from the ids, which no expert weight
        may be gathered by (``_getitem``)."""
        src = self._of(_input(node))
        if src.kind in ("gate", "up"):
            return self._clamp_half(node, src)
        if src.kind != "ids_part":
            self._idx_op(node)
        if node.target in ("clamp_", "clip_"):
            self._check_owned(node, node.args[0])
        low, high = (_arg(node, i, n) for i, n in ((1, "min"), (2, "max")))
        identity = (low is None or isinstance(low, (int, float)) and low <= 0) and (
            high is None or isinstance(high, (int, float)) and high >= self.experts - 1)
        return src if src.kind in ("ids", "ids_part") and identity else _IDX

    def _clamp_half(self, node, src: Val) -> Val:
        """GPT-OSS's and DeepSeek-V4's clamps: the gate at most ``limit``, the up half within [-limit, limit]."""
        low, high = (_arg(node, i, n) for i, n in ((1, "min"), (2, "max")))
        if node.op == "call_method" and node.target.endswith("_"):
            self._fail(node, "clamps a half of w13's GEMM in place")
        if not (isinstance(high, (int, float)) and high > 0 and math.isfinite(high)):
            self._fail(node, "clamps a half of w13's GEMM with no finite positive upper bound")
        if src.kind == "gate" and low is None:
            return dataclasses.replace(src, kind="gate_c", p=(float(high),))
        if src.kind == "up" and isinstance(low, (int, float)) and low == -high:
            return dataclasses.replace(src, kind="up_c", p=(float(high),))
        self._fail(node, "clamps a half of w13's GEMM other than as GPT-OSS's SwiGLU does (gate.clamp(max=limit), "
                         "up.clamp(-limit, limit))")

    def _masked_fill(self, node):
        """``v.masked_fill(sentinel, c)``: the identity on the ids fused_moe takes, so ``v`` keeps its label."""
        src, mask, value = (_arg(node, i, n) for i, n in enumerate(("self", "mask", "value")))
        v, m = self._of(src), self._of(mask)
        if isinstance(value, fx.Node):
            self._fail(node, "fills with a tensor")
        if v.kind in _INDEX_KINDS and m.kind in _INDEX_KINDS:
            out = _IDX
        elif m.kind != "sentinel":
            self._fail(node, "masks a value with something other than the expert-parallel sentinels (ids >= E)")
        elif v.kind in ("w13", "w2"):
            self._fail(node, "masks an expert weight")
        else:
            out = v
        if node.op == "call_method" and node.target == "masked_fill_":
            self._check_owned(node, src)
            self.val[src] = out
        return out

    def _check_owned(self, node, target):
        """``target`` (modified in place by ``node``) is a tensor the region made, not (a view of) an input."""
        if not (isinstance(target, fx.Node) and target not in self.inputs and _owned(target)):
            self._fail(node, "modifies in place a tensor that may be (a view of) one of the experts' inputs")

    def _setitem(self, node):
        target, index, value = node.args
        if self._all_idx(node) and isinstance(target, fx.Node) and _fresh(target, self.val):
            # inv[perm] = arange(S) (HF's grouped_mm): inv un-sorts what perm sorted (the order of rows: the module docstring)
            if (isinstance(index, fx.Node) and self._of(index).order.startswith("perm:")
                    and isinstance(value, fx.Node) and value.target is torch.arange):
                self.val[target] = Val("idx", order=f"unsort:{index.name}")
            return None
        self._fail(node, "assigns into a tensor other than a fresh index tensor")

    # shape ops
    def _view(self, node):
        src = self._of(node.args[0])
        if src.kind not in (*_INDEX_KINDS, "ids_part", "ids_sort"):  # a value: weights, activations, outputs
            before, after = fake_value(node.args[0]), fake_value(node)
            if (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.is_floating_point()
                    and (not after.is_floating_point() or after.dtype.itemsize == 1)):
                # (routing weights .to(int64) are all 0: the model's output was 0, fused_moe's not)
                self._fail(node, f"casts a value to {after.dtype}, which changes it (fused_moe computes on the values "
                                 "as they are)")
        if src.kind in (*_INDEX_KINDS, "ids_part", "wts"):
            if not self._all_idx_args(node):
                self._fail(node, "reshapes with a non-index argument")
            return self._routing(node, src, _same_numel(node.args[0], node))
        if src.kind in ("w13", "w2"):
            self._fail(node, "reshapes an expert weight")
        before, after = _shape(node.args[0]), _shape(node)
        p = len(before) + src.fdim  # feature dim, counted from the front
        name = _op_name(node)
        if before == after and name != "squeeze":  # to, contiguous, clone, float, same-shape views
            if node.args[0] in self.plain_x and fake_value(node).dtype == fake_value(node.args[0]).dtype:
                self.plain_x.add(node)
            return src
        if name == "unsqueeze":
            q = _arg(node, 1, "dim") % (len(before) + 1)
            p = p + 1 if q <= p else p
        elif name == "squeeze":
            dims = _arg(node, 1, "dim")
            dims = range(len(before)) if dims is None else [dims] if isinstance(dims, int) else dims
            gone = [d % len(before) for d in dims if before[d % len(before)] == 1]
            if p in gone:
                self._fail(node, "squeezes the feature dim")
            p -= sum(d < p for d in gone)
        elif name == "repeat_interleave":
            if _arg(node, 2, "dim") != 0:
                self._fail(node, "repeats along a dim other than the tokens")
        elif before[p:] != after[len(after) - (len(before) - p):] or src.fdim != -1:
            self._fail(node, "reshapes the feature dim")
        else:  # view / reshape / flatten / expand of the leading dims only
            p = len(after) - 1
            if node.args[0] in self.plain_x and name in ("view", "reshape", "flatten"):
                self.plain_x.add(node)
        return dataclasses.replace(src, fdim=p - len(after))

    def _routing(self, node, src: Val, every: bool) -> Val:
        """``src`` rearranged by ``node``; ``every``: each (token, k) pair's id / weight kept once (a view keeping
        the element count, a gather by a tensor). Else ids become ``ids_part``, and routing weights are refused:
        fused_moe weights each pair by its own weight (``top_k_weights[:, :1]``, ``[:, [1, 0]]``, ``.expand``
        would be rewritten into wrong outputs)."""
        if every or src.kind not in ("ids", "wts"):
            return src
        if src.kind == "ids":
            return Val("ids_part")
        self._fail(node, "selects, reorders or broadcasts the routing weights along k; fused_moe weights every "
                         "(token, k) pair by its own weight")

    def _all_idx_args(self, node) -> bool:
        return all(self._of(a).kind in _INDEX_KINDS for a in node.all_input_nodes[1:])

    def _transpose(self, node):
        src = self._of(node.args[0])
        if src.kind in (*_INDEX_KINDS, "ids_part"):
            return Val("ids_part") if src.kind == "ids" and len(_shape(node)) > 1 else src
        if src.kind not in ("w13", "w2"):
            self._fail(node, "transposes a hidden state")
        n = len(_shape(node))
        dims = node.args[1:]
        if _op_name(node) == "permute":
            dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
            swapped = [d % n for d in dims] == list(range(n - 2)) + [n - 1, n - 2]
        else:  # t / T / mT / transpose(a, b)
            swapped = len(dims) < 2 or sorted(d % n for d in dims[:2]) == [n - 2, n - 1]
        if not swapped:
            self._fail(node, "permutes an expert weight other than its last two dims")
        return dataclasses.replace(src, t=not src.t)

    def _getitem(self, node):
        src, index = node.args
        if isinstance(src, fx.Node) and self._of(src).kind == "chunks":
            return dataclasses.replace(self._of(src), kind=("gate", "up")[index])
        val = self._of(src)
        if val.kind == "g1" and not isinstance(index, fx.Node):
            return self._half(node, val)
        if val.kind in ("b13", "b2"):
            return self._bias_of(node, val, index)
        if val.kind == "ids_sort":
            return Val("ids", order="sorted") if index == 0 else Val("idx", order=val.order)
        if not self._all_idx_args(node):
            self._fail(node, "indexes with a non-index value")
        if val.kind in ("ids", "ids_part", "wts"):
            out = self._routing(node, val, _keeps_pairs(node))
            gathers = [i for i in (index if isinstance(index, tuple) else (index,)) if isinstance(i, fx.Node)]
            if out.kind == "wts" and gathers:  # (sorted with the rows by the permutation: a grouped GEMM's order)
                by = gathers[0] if len(gathers) == 1 else None
                sorted_ = by is not None and self._of(by).order.startswith("perm:")
                return dataclasses.replace(out, order="sorted" if sorted_ else f"gathered:{node.name}")
            if out.kind != "ids" or not gathers:
                return out
            # ids[perm] of their own ascending sort: sorted; by anything else: the order of that index node
            by = gathers[0] if len(gathers) == 1 else None
            sorted_ = by is not None and self._of(by).order == f"perm:{src.name}"
            return dataclasses.replace(out, order="sorted" if sorted_ else f"gathered:{by.name if by else node.name}")
        if val.kind == "sentinel":
            return val  # some of the sentinel flags (all false), in some order
        if val.kind in ("idx", "mask"):
            return _IDX
        if val.kind in ("w13", "w2"):  # (stacked and transposed: the last two dims swapped, the experts' dim first)
            if isinstance(index, int) and val.expert is None:
                if not 0 <= index < self.experts:
                    self._fail(node, f"selects expert {index} of {self.experts}")
                return dataclasses.replace(val, expert=index)  # w[e]: one expert of a loop
            if isinstance(index, fx.Node) and val.expert is None:
                if self._of(index).kind not in ("ids", "ids_part"):  # w[E - 1 - ids]: other experts than the ids
                    self._fail(node, "gathers an expert weight by an index computed from the routing ids, not by "
                                     "the ids themselves")
                # w[expert_ids]: gathered per (token, k), in the order of those ids
                return dataclasses.replace(val, expert="pairs", order=self._of(index).order)
            self._fail(node, "indexes an expert weight other than by expert")
        if isinstance(index, fx.Node) and val.expert != "dense":  # (dense rows are each their expert's by position)
            # rows gathered or un-sorted: the feature dim stays; the order, where it is followed (module docstring)
            if self._of(index).order.startswith("unsort:"):
                return dataclasses.replace(val, order="")
            return dataclasses.replace(val, order=f"gathered:{node.name}") if val.order == "sorted" else val
        self._fail(node, "slices a hidden state")

    def _half(self, node, v: Val) -> Val:
        """The gate or up half of w13's GEMM output by slicing its features: ``[..., :I]`` / ``[..., I:]``, or GPT-OSS's
        interleaved rows ``[..., ::2]`` / ``[..., 1::2]``."""
        if not self.gated:
            self._fail(node, "slices the output of up's GEMM: ungated experts have no gate half")
        src, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        n = len(_shape(src))
        if index.count(Ellipsis) == 1:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (n - len(index) + 1) + index[at + 1:]
        index = index + (slice(None),) * (n - len(index))
        fd = n + v.fdim
        if len(index) != n or not all(isinstance(i, slice) for i in index) or any(
                i != slice(None) for d, i in enumerate(index) if d != fd):
            self._fail(node, "indexes w13's GEMM output other than by slicing its features")
        sl, two_i = index[fd], 2 * self.inter
        start, stop, step = sl.start or 0, two_i if sl.stop is None else min(sl.stop, two_i), sl.step or 1
        halves = {(0, self.inter, 1): "gate", (self.inter, two_i, 1): "up"}
        interleaved = {(0, two_i, 2): "gate", (1, two_i, 2): "up"}
        if not all(isinstance(a, int) for a in (start, stop, step)):
            self._fail(node, "slices w13's GEMM output by a computed bound")
        if (start, stop, step) in halves:
            self.seen["layout"].add("halves")
        elif (start, stop, step) in interleaved:
            self.seen["layout"].add("interleaved")
        else:
            self._fail(node, f"slices w13's GEMM output [{sl.start}:{sl.stop}:{sl.step}] of {two_i} features, not its "
                             "gate or up half (the first or last I, or the even or odd ones)")
        self.seen["b13"].add(v.b)
        return dataclasses.replace(v, kind={**halves, **interleaved}[(start, stop, step)])

    def _bias_of(self, node, v: Val, index) -> Val:
        """An expert bias selected as the weights are: ``b[e]`` (a loop over experts), ``b[ids]`` (per pair)."""
        if v.expert is None and isinstance(index, int) and 0 <= index < self.experts:
            return dataclasses.replace(v, expert=index)
        if v.expert is None and isinstance(index, fx.Node) and self._of(index).kind in ("ids", "ids_part"):
            return dataclasses.replace(v, expert="pairs", order=self._of(index).order)
        self._fail(node, "indexes an expert bias other than by expert or by the routing ids")

    def _add_bias(self, node, v: Val, bias: Val, v_node: fx.Node) -> Val:
        """A first (second) GEMM's output (``v``, held by ``v_node``) plus w13's (w2's) bias of the same expert(s),
        along the features."""
        if (v.kind, bias.kind) not in (("g1", "b13"), ("y", "b2")):
            self._fail(node, f"adds {bias.kind} to {v.kind}, not the bias of its own GEMM")
        if v.b:
            self._fail(node, "adds a bias twice")
        same = v.expert == bias.expert if isinstance(v.expert, int) else v.expert is None and bias.expert == "pairs"
        if not same:
            self._fail(node, f"adds the bias of expert(s) {bias.expert} to the output of expert(s) {v.expert}")
        if v.expert is None and bias.order != v.order:  # (b[ids] on rows sorted by expert: other experts' biases)
            self._fail(node, f"adds a bias gathered in {_order_words(bias.order)} to GEMM rows in "
                             f"{_order_words(v.order)}")
        if v.fdim != -1 or _shape(node) != _shape(v_node):
            self._fail(node, "adds a bias other than along the GEMM output's features")
        return dataclasses.replace(v, b=True)

    def _sigmoid(self, node):
        v = self._of(_input(node))
        if v.kind != "gate_a":
            self._fail(node, "applies a sigmoid to something other than the clamped gate times alpha")
        return dataclasses.replace(v, kind="sig")

    # math
    def _activated(self, node, v: Val, name: str) -> Val:
        """fused_moe's activation ``name`` of the gate half (``act``: ``p`` names it, () for SiLU; times up next), or,
        for ungated experts, of up's whole GEMM output (``h``: the intermediate, the second GEMM's input)."""
        if v.kind == "gate":
            return dataclasses.replace(v, kind="act", p=() if name == "silu" else (name,))
        if v.kind == "g1" and not self.gated:
            self.seen["activation"].add((name,))
            self.seen["b13"].add(v.b)
            return dataclasses.replace(v, kind="h", p=())
        what = "the gate half of w13's GEMM" if self.gated else "the output of up's GEMM (ungated experts)"
        self._fail(node, f"applies {name} to something other than {what}")

    def _in_place_ok(self, node, what: str) -> None:
        """An activation with ``inplace=True`` (nn.SiLU(inplace=True)) changes its input and every tensor it is a view
        of: none of them may be read otherwise (a later read would see the activation the pass does not label)."""
        src = _input(node)
        if not _arg(node, 1, "inplace", False):
            return
        if len(getattr(src, "users", ())) != 1:
            self._fail(node, f"applies {what} in place to a value read otherwise too")
        self._views_unread(node, src, f"applies {what} in place to")

    def _views_unread(self, node, src: fx.Node, what: str) -> None:
        """``node`` changes ``src`` in place: the tensors ``src`` is a view of (view / transpose ops, walked to their
        base) may have no reader but the next view (HF's ``bmm(...).squeeze(1)``), or they would see the change."""
        base = src
        while _op(base) in ("view", "transpose") and isinstance(base.args[0], fx.Node):
            base = base.args[0]
            if len(base.users) != 1:
                self._fail(node, f"{what} a view of {base.name}, which is read otherwise too "
                                 f"({sorted(u.name for u in base.users)})")

    def _gelu(self, node):
        """GELU of the gate (ungated: of up's output): the tanh approximation (Gemma-4's act_fn) or the exact one."""
        approximate = _arg(node, 1, "approximate", "none")
        if approximate not in ("none", "tanh"):
            self._fail(node, f"applies a GELU with approximate={approximate!r}")
        return self._activated(node, self._of(_input(node)), "gelu_tanh" if approximate == "tanh" else "gelu")

    def _silu(self, node):
        self._in_place_ok(node, "SiLU")
        v = self._of(_input(node))
        if v.kind == "gate_c":
            return dataclasses.replace(v, kind="act")  # (of the clamped gate: p = (limit,))
        return self._activated(node, v, "silu")

    def _relu(self, node):
        """The first half of the squared ReLU (transformers' ReLUSquaredActivation: relu, then square): ``relu``, whose
        ``p`` keeps what it was applied to. A ReLU nothing squares reaches no rule (fused_moe has no plain ReLU)."""
        self._in_place_ok(node, "ReLU")
        v = self._of(_input(node))
        if v.kind != "gate" and (v.kind != "g1" or self.gated):
            self._fail(node, "applies ReLU to something other than the gate half of w13's GEMM (or, ungated, up's "
                             "output)")
        return dataclasses.replace(v, kind="relu", p=(v.kind,))

    def _square(self, node):
        v = self._of(_input(node))
        if v.kind != "relu":
            self._fail(node, "squares something other than a ReLU of the gate (or, ungated, of up's output)")
        return self._activated(node, dataclasses.replace(v, kind=v.p[0], p=()), "relu2")

    def _pow(self, node):
        exponent = _arg(node, 1, "exponent")
        if isinstance(exponent, fx.Node) or exponent != 2 or isinstance(exponent, bool):
            self._fail(node, f"raises to the power {exponent}, not 2 (the squared ReLU)")
        return self._square(node)

    def _chunk(self, node):
        v = self._of(node.args[0])
        if v.kind in _INDEX_KINDS:
            return _IDX
        chunks, dim = _arg(node, 1, "chunks"), _arg(node, 2, "dim", 0)
        shape = _shape(node.args[0])
        if v.kind != "g1" or chunks != 2 or dim % len(shape) != len(shape) + v.fdim or not self.gated:
            self._fail(node, "splits something other than the features of w13's GEMM in two" + (
                "" if self.gated else " (ungated experts: up's output has no gate half)"))
        self.seen["layout"].add("halves")
        self.seen["b13"].add(v.b)
        return dataclasses.replace(v, kind="chunks")

    def _mul(self, node):
        operands = self._binary(node)
        a, b = (self._of(x) for x in operands)
        kinds = {a.kind, b.kind}
        by = {a.kind: a, b.kind: b}
        if kinds <= set(_INDEX_KINDS):
            return _IDX
        if kinds == {"act", "up"} and a.expert == b.expert and a.fdim == b.fdim and by["act"].p in (
                (), ("gelu_tanh",), ("gelu",), ("relu2",)):
            self.seen["activation"].add(by["act"].p or ("silu",))
            return dataclasses.replace(by["act"], kind="h", p=())
        if kinds == {"act", "up_c"} and a.expert == b.expert and a.fdim == b.fdim and by["act"].p == by["up_c"].p:
            self.seen["activation"].add(("silu_clamped", by["act"].p[0]))  # DeepSeek-V4's swiglu_limit
            return dataclasses.replace(by["act"], kind="h", p=())
        number = [x for x in operands if isinstance(x, (int, float))]
        if kinds == {"gate_c", "idx"} and len(number) == 1 and math.isfinite(number[0]):  # gate * alpha
            return dataclasses.replace(by["gate_c"], kind="gate_a", p=(*by["gate_c"].p, float(number[0])))
        same = a.expert == b.expert and a.fdim == b.fdim
        if kinds == {"gate_c", "sig"} and same and by["sig"].p[0] == by["gate_c"].p[0]:
            return dataclasses.replace(by["sig"], kind="glu")  # gate * sigmoid(alpha * gate)
        if kinds == {"up1", "glu"} and same and by["up1"].p == by["glu"].p[:1]:
            limit, alpha = by["glu"].p
            self.seen["activation"].add(("swiglu_oai", alpha, limit))
            return dataclasses.replace(by["glu"], kind="h", p=())
        if kinds == {"wts", "mask"} and by["wts"].expert is None:
            return Val("wts", by["mask"].expert)
        if kinds == {"y", "wts"} and {by["y"].order, by["wts"].order} == {"", "sorted"}:  # (module docstring: orders)
            self._fail(node, f"weights GEMM rows in {_order_words(by['y'].order)} with routing weights in "
                             f"{_order_words(by['wts'].order)}: each row with another pair's weight")
        if kinds == {"y", "wts"} and by["y"].expert == by["wts"].expert:
            self.seen["b2"].add(by["y"].b)
            return dataclasses.replace(by["y"], kind="out", b=False)
        if kinds == {"y", "wts"}:
            self._fail(node, f"weights expert {by['y'].expert} with the routing weight of expert {by['wts'].expert}")
        self._fail(node, "multiplies values that fused_moe does not multiply")

    def _sum(self, node):
        v = self._of(node.args[0])
        dim = _arg(node, 1, "dim")
        shape = _shape(node.args[0])
        if v.kind in _INDEX_KINDS:
            return _IDX
        if v.kind == "wts" and v.expert is not None and dim in (-1, len(shape) - 1) and len(shape) > 1 \
                and shape[-1] == self.k:
            return v  # sum over k of the masked routing weights [..., T, K]: expert e's weight per token (over all
            # pairs flattened, it was one weight for every token)
        if v.kind == "out" and v.order == "sorted":  # (module docstring: orders)
            self._fail(node, "sums expert outputs whose rows are still in the experts' order (a sort of the routing "
                             "ids): each token's k rows are not its own; un-sort them first")
        if v.kind == "out" and v.expert is None and isinstance(dim, int):
            d = dim % len(shape)
            # pairs token-major ([T, K, H]: k just before the features, when they are last); [K, T, H].sum(0) of the
            # same pairs had k's size and added up other tokens' pairs
            k_dim = len(shape) + v.fdim - 1 if v.fdim == -1 else d
            if d != len(shape) + v.fdim and d == k_dim and shape[d] == self.k:
                return Val("sum", "all", fdim=v.fdim)
        self._fail(node, "sums something other than the k weighted expert outputs of each token")

    def _add(self, node):
        if self._all_idx(node):
            return _IDX
        operands = self._binary(node)
        a, b = (self._of(x) for x in operands)
        if node.op == "call_method" and node.target == "add_":
            return self._add_in_place(node, a, b)
        if {a.kind, b.kind} & {"b13", "b2"}:
            value = 1 if a.kind in ("b13", "b2") else 0
            return self._add_bias(node, (a, b)[value], (b, a)[value], operands[value])
        if {a.kind, b.kind} == {"up_c", "idx"} and any(x == 1 and not isinstance(x, fx.Node) for x in operands):
            return dataclasses.replace(a if a.kind == "up_c" else b, kind="up1")
        return self._accumulate(node, a, b)

    def _add_in_place(self, node, target: Val, other: Val) -> Val:
        """``g1.add_(b13[...])`` / ``y.add_(b2[...])`` (HF's experts with biases): the GEMM's output, which nothing
        has read yet, holds its bias from here on. Every tensor sharing its memory would see the bias too: the views
        it was made by (``bmm(...).squeeze(1)``) may have no other reader (the GEMM's output as another view, read
        after the add, was labelled without the bias)."""
        out = self._add_bias(node, target, other, node.args[0])
        seen = [u.name for u in node.args[0].users if u is not node and u in self.val]
        if seen:
            self._fail(node, f"adds a bias in place to a GEMM output {seen} read before")
        self._views_unread(node, node.args[0], "adds a bias in place to")
        self.val[node.args[0]] = out
        return out

    def _accumulate(self, node, acc: Val, new: Val) -> Val:
        """acc (a fresh zero or a partial sum) + new (a weighted expert output or a partial sum)."""
        if acc.kind == "out":
            acc, new = new, acc
        if acc.kind not in ("zero", "sum") or new.kind not in ("out", "sum"):
            self._fail(node, "adds values other than weighted expert outputs")
        have = frozenset() if acc.kind == "zero" else acc.expert
        more = new.expert if new.kind == "sum" else "all" if new.expert is None else frozenset([new.expert])
        if "all" in (have, more):
            if have and more:  # "all" next to anything but an empty accumulator
                self._fail(node, "adds the outputs of every expert to a partial sum")
            return Val("sum", "all")
        if have & more:
            self._fail(node, f"adds expert(s) {sorted(have & more)} twice")
        return Val("sum", have | more)

    def _index_add(self, node):
        target, dim, _, source = (_arg(node, i, n) for i, n in enumerate(("self", "dim", "index", "source")))
        if _arg(node, 4, "alpha", 1) != 1:
            self._fail(node, "adds scaled (alpha) expert outputs")
        acc, src = self._of(target), self._of(source)
        if dim % len(_shape(target)) == len(_shape(target)) + src.fdim:
            self._fail(node, "adds along the feature dim")
        out = self._accumulate(node, acc, src)
        if node.op == "call_method" and node.target == "index_add_":
            self.val[target] = out  # in place: later reads of the accumulator see the sum
        return out

    def _gemm(self, node):
        a, b = node.args[:2]
        va, vb = self._of(a), self._of(b)
        linear = node.target in _LINEAR
        if linear and _arg(node, 2, "bias") is not None or node.kwargs.get("bias") is not None:
            self._fail(node, "adds a bias")
        if vb.kind in ("w13", "w2") and va.kind not in ("w13", "w2"):
            w, act, act_node, weight_first = vb, va, a, False
        elif va.kind in ("w13", "w2") and vb.kind not in ("w13", "w2") and not linear:
            w, act, act_node, weight_first = va, vb, b, True
        else:
            self._fail(node, "is a GEMM without exactly one expert weight")
        # the weight must be contracted over its stored cols (H for w13, I for w2)
        want_t = not linear and not weight_first
        if w.t != want_t:
            self._fail(node, f"contracts {w.kind} over its output dim (the weight is used transposed)")
        # stacked weights need a grouped GEMM (or a batched one over expert-major rows: the dense form), weights
        # gathered per pair a batched one, one expert's any
        grouped = node.target in _GROUPED or isinstance(node.target,
                                                        (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        if self._dense_gemm(node, w, act, act_node):
            return Val("g1" if w.kind == "w13" else "y", "dense", fdim=-1)
        if (w.expert is None) != grouped or w.expert == "pairs" and node.target not in _BATCHED:
            self._fail(node, f"is not a GEMM for {w.kind} {'stacked' if w.expert is None else w.expert}")
        expert = w.expert if isinstance(w.expert, int) else None
        need = ("x", self.hidden) if w.kind == "w13" else ("h", self.inter)
        if act.kind != need[0] or (w.kind == "w2" and act.expert != expert):
            self._fail(node, f"multiplies {w.kind} (expert {w.expert}) with {act.kind} (expert {act.expert})")
        contracted = -2 if weight_first else -1
        if act.fdim != contracted or _shape(act_node)[contracted] != need[1]:
            self._fail(node, "contracts the activation over a dim other than its features")
        # rows: a grouped GEMM's sorted by expert (sort()'s order), a batched one's as its weights were gathered
        order = "sorted" if w.expert is None else w.order if w.expert == "pairs" else ""
        return Val("g1" if w.kind == "w13" else "y", expert, fdim=-2 if weight_first else -1, order=order)


    def _dense_gemm(self, node, w: Val, act: Val, act_node) -> bool:
        """Whether ``node`` is a GEMM of the dense form (Llama-4's experts: every expert on its own E-th of the rows,
        the router's weights already on the rows)::

            x.view(E, -1, H) @ w13 (stacked, [E, H, 2I]) -> chunk -> SiLU(gate) * up -> @ w2 -> .view(-1, H)

        A batched GEMM of a stacked weight and a 3-D activation of E leading rows, which is hidden states reached
        from the input by views only (row r of the input is then expert r // (R / E)'s, in every view: views keep
        the order of the rows) or the dense h. Anything else of a dense value (a gather of its rows, a sum, a
        routing weight) breaks another rule."""
        if node.target not in _BATCHED or w.expert is not None or w.t is not True:
            return False
        shape = _shape(act_node)
        if len(shape) != 3 or len(_shape(node)) != 3 or not statically_known_true(shape[0] == self.experts):
            return False
        if w.kind == "w13":
            if act.kind != "x" or act_node not in self.plain_x:
                return False
        elif act.kind != "h" or act.expert != "dense":
            return False
        if act.fdim != -1 or shape[-1] != (self.hidden if w.kind == "w13" else self.inter):
            self._fail(node, "contracts the activation over a dim other than its features")
        return True


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.target is getattr:
        return node.args[1]
    return getattr(node.target, "__name__", str(node.target))


def _describe(node: fx.Node) -> str:
    return f"{node.op} {_op_name(node)}"


def _reason(e: Exception) -> str:
    if not isinstance(e, GuardOnDataDependentSymNode):
        return str(e)
    # the checks compare sizes; an unbacked one (torch._dynamo.decorators.mark_unbacked) answers none of them
    return ("the experts' shapes cannot be compared at trace time: the token count is unbacked (marked with "
            "mark_unbacked, or data-dependent); mark the batch dim dynamic instead (torch._dynamo.mark_dynamic), "
            f"or leave it static ({str(e).splitlines()[0][:120]})")


def _shape(node) -> tuple:
    v = fake_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _same_numel(a, b) -> bool:
    return statically_known_true(_numel(_shape(a)) == _numel(_shape(b)))


def _numel(shape) -> Any:
    n = 1
    for d in shape:
        n = n * d
    return n


def _keeps_pairs(node: fx.Node) -> bool:
    """``src[index]`` (``node``) keeps every element of ``src`` once: a gather by tensors (a permutation, as in
    un-sorting, is trusted) with full slices besides, or basic indexing (ints, slices) that keeps the element
    count. Lists, and ints or slices that drop elements, select or reorder them."""
    src, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (list, tuple)) for i in index):
        return False
    tensors = [i for i in index if isinstance(i, fx.Node) and isinstance(fake_value(i), torch.Tensor)]
    if tensors:
        return all(i is None or i is Ellipsis or i == slice(None) or i in tensors for i in index)
    return _same_numel(src, node)


def _owned(node: fx.Node) -> bool:
    """``node`` is a new tensor, sharing no memory with the tensors it was computed from: a factory's, a
    sort's outputs, or a gather (indexing by a tensor)."""
    if node.op == "call_function" and node.target in (torch.empty_like, torch.zeros_like, torch.empty, torch.zeros):
        return True
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    src, index = node.args
    if isinstance(src, fx.Node) and (src.target is torch.sort or src.op == "call_method" and src.target == "sort"):
        return True
    return isinstance(index, fx.Node) and isinstance(fake_value(index), torch.Tensor)


def _fresh(node: fx.Node, labelled) -> bool:
    """``node`` is a tensor the region made itself (not a view of one of its inputs)."""
    return node in labelled and node.op == "call_function" and node.target in (torch.empty_like, torch.zeros_like,
                                                                                torch.empty, torch.zeros)


# -- the pass -----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Site:
    fqn: str  # the experts module's FQN in the model (tagged by quantize_), for the report
    path: Optional[str]  # its path as Dynamo names it (relative to the compiled module; None: it is that module)
    dequant: dict[str, fx.Node]  # role ("w13" / "w2") -> the first dequantize node of that weight
    region: list[fx.Node]  # the nodes its forward created, in graph order


_SCALAR_MATH = (operator.neg, operator.pos, operator.add, operator.sub, operator.mul, operator.truediv)


def _is_item(node: fx.Node) -> bool:
    return isinstance(node.args[0] if node.args else None, fx.Node) and (
        node.op == "call_method" and node.target == "item"
        or node.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default))


class _FoldedFloats:
    """The floats a site reads from inputs, folded to this compilation's values. Under ``torch.compile(dynamic=True)``
    Dynamo passes a module's float attribute (GPT-OSS's alpha / limit) as a 0-d tensor input read with ``.item()``,
    which it does not guard; fused_moe takes them as constants. So each such read in the region, and the scalar
    arithmetic on it (``-limit``), becomes its value; the backend checks the inputs' values at every call
    (``FLOAT_INPUTS``) and runs the graph as traced where one differs. ``undo`` puts the reads back.

    Inductor's compile of such a graph restarts Dynamo (``TensorifyScalarRestartAnalysis``), which traces the frame
    again with the floats specialized, guarded, as constants, but leaves the arithmetic on them as nodes of
    constants (``neg(7.0)``): those are folded too, with nothing to check."""

    def __init__(self, site: _Site, ctx: PassContext):
        self.site, self.region = site, list(site.region)
        self.edits: list[tuple[fx.Node, tuple, dict]] = []  # each reader's args / kwargs before
        self.inputs: dict[fx.Node, float] = {}  # placeholder -> value
        self.values: dict[fx.Node, float] = {}
        inside = set(site.region)
        for n in site.region:
            if _is_item(n):
                v = float_input_value(n.args[0], ctx)
            elif n.op == "call_function" and n.target in _SCALAR_MATH and not n.kwargs and all(
                    a in self.values for a in n.all_input_nodes):  # (or of constants: ``neg(7.0)``, see below)
                args = [self.values.get(a, a) for a in n.args]
                v = n.target(*args) if all(type(a) in (int, float) for a in args) else None
            else:
                v = None
            if v is not None and all(u in inside for u in n.users):
                self.values[n] = float(v)
                if _is_item(n):
                    self.inputs[n.args[0]] = float(v)
        if not self.values:
            return
        for n in self.values:
            for user in [u for u in n.users if u not in self.values]:
                self.edits.append((user, user.args, user.kwargs))
                user.args, user.kwargs = (fx.node.map_arg(a, lambda x: self.values.get(x, x))
                                          for a in (user.args, user.kwargs))
        site.region = [n for n in site.region if n not in self.values]

    def undo(self) -> None:
        for user, args, kwargs in reversed(self.edits):
            user.args, user.kwargs = args, kwargs
        self.site.region = self.region

    def keep(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """The site was rewritten: its folded reads go, and the backend checks the inputs they read."""
        gm.meta.setdefault(FLOAT_INPUTS, []).extend(
            (ctx.positions[p], v, attribute_path(p) or p.name) for p, v in self.inputs.items())
        for n in reversed(list(self.values)):
            if not n.users:
                gm.graph.erase_node(n)


WEIGHT_ONLY = ("weight-only (16-bit activations): fp8fx.fused_moe computes with fp8 activations only, so the experts "
               "run on their dequantized fp8 weights, in 16-bit math")


class MoePass(Fp8Pass):
    """``weight_only``: the backend's (None: decided per graph, on GPUs without fp8 tensor cores): the experts are
    left to run on their dequantized weights, reported as such, since fused_moe has no 16-bit-activation path."""

    def __init__(self, use_fast_accum: bool = False, weight_only: Optional[bool] = None):
        self.use_fast_accum = use_fast_accum  # the experts' fp8 GEMMs in Hopper's fast accumulation mode
        self.weight_only = weight_only

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        graph = gm.graph
        count = 0
        self._report_unquantized(graph, ctx)
        weight_only = self.weight_only
        if weight_only is None:
            weight_only = lacks_fp8_tensor_cores(ctx.example.values())
        for site in self._sites(graph, ctx):
            ctx.frame_site(site.fqn, site.path, next(iter(site.dequant.values())).args[0] if site.dequant else None)
            folded = None
            try:
                if weight_only:
                    raise _NoMatch(WEIGHT_ONLY)
                folded = _FoldedFloats(site, ctx)
                operands = self._check(site, ctx)
            except (_NoMatch, GuardOnDataDependentSymNode) as e:
                if folded is not None:
                    folded.undo()
                ctx.report.add(Site("moe", site.fqn, False, _reason(e), "", ctx.graph_index,
                                    weight_shape=Site.shape_of(fake_value(site.dequant.get("w13"))),
                                    node=Site.origin_of(site.region[-1]) if site.region else ""))
                continue
            token = Site.token_of(ctx.example.get(site.dequant["w13"].args[0]))  # before the rewrite erases it
            shape = Site.shape_of(fake_value(site.dequant["w13"]))
            scheme, saved, origin = self._rewrite(graph, site, operands)
            folded.keep(gm, ctx)
            ctx.report.add(Site("moe", site.fqn, True, "", scheme, ctx.graph_index, weight_shape=shape, node=origin,
                                bytes_saved=saved, weight_id=token))
            count += 1
        gm.recompile()
        return count

    # -- finding sites
    @staticmethod
    def _role(node, ctx: PassContext) -> Optional[str]:
        real = ctx.example.get(node) if isinstance(node, fx.Node) else None
        return getattr(real, "_fp8fx_moe_role", None)

    def _sites(self, graph: fx.Graph, ctx: PassContext) -> list[_Site]:
        sites: dict[str, _Site] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _DEQUANT and self._role(node.args[0], ctx):
                real = ctx.example[node.args[0]]
                path = module_path(node)  # None: the experts module is the compiled module itself
                fqn = getattr(real, "_fp8fx_fqn", None)
                site = sites.setdefault(path, _Site(path or "" if fqn is None else fqn, path, {}, []))
                site.dequant.setdefault(real._fp8fx_moe_role, node)
        for site in sites.values():
            site.region = [n for n in graph.nodes if n.op in ("call_function", "call_method")
                           and (site.path is None or site.path in _stack_paths(n))]
        return list(sites.values())

    @staticmethod
    def _report_unquantized(graph: fx.Graph, ctx: PassContext) -> None:
        """Experts ``quantize_`` left in high precision (their tensors carry the reason)."""
        seen = set()
        for node in graph.nodes:
            real = ctx.example.get(node) if node.op == "placeholder" else None
            reason, fqn = getattr(real, "_fp8fx_skip_reason", None), getattr(real, "_fp8fx_fqn", None)
            if reason and getattr(real, "_fp8fx_moe_role", None) and fqn not in seen:
                seen.add(fqn)
                path = next(filter(None, map(module_path, node.users)), None)  # (its readers')
                ctx.frame_site(fqn, path, node)
                ctx.report.add(Site("moe", fqn, False, f"{NOT_QUANTIZED}{reason}", "", ctx.graph_index,
                                    weight_shape=Site.shape_of(real)))

    # -- checking a site
    @staticmethod
    def _leave_shared_sizes(site: _Site) -> None:
        """Take out of ``site.region`` the size arithmetic later code reuses: with symbolic shapes (a recompile
        after a shape change, dynamic=True) Dynamo computes the token count (``s0 * s1``, or in steps: ``2 * s0``
        then ``* s1``) once, in the first experts module that needs it, for every later layer too. Such sizes are
        no output of the experts (they stay in the graph; the region reads them as inputs): the size nodes read
        by later code, with the size nodes they are computed from, when none of them reads a tensor of the
        region. Likewise the runtime assertions Dynamo records on such sizes (a batch size marked unbacked:
        ``Eq(u1, u0)``, the routing's token count against the hidden states'), which stay in the graph."""
        region = set(site.region)
        sizes: set[fx.Node] = set()  # computed from outside values and other such sizes only (graph order)
        for n in site.region:
            if not isinstance(fake_value(n), (torch.Tensor, tuple, list)) and all(
                    a in sizes or a not in region for a in n.all_input_nodes):
                sizes.add(n)
        shared: set[fx.Node] = set()
        todo = [n for n in sizes if n.target in _RUNTIME_ASSERTS or any(u not in region for u in n.users)]
        while todo:
            n = todo.pop()
            if n not in shared:
                shared.add(n)
                todo += [a for a in n.all_input_nodes if a in sizes]
        site.region = [n for n in site.region if n not in shared]

    def _check(self, site: _Site, ctx: PassContext) -> dict[str, Any]:
        """The fused_moe operands of ``site``, or ``_NoMatch``."""
        if set(site.dequant) != {"w13", "w2"}:
            raise _NoMatch(
                f"only {sorted(site.dequant)} of the expert weights are read in this graph: the experts' forward is "
                "split across graphs (a graph break inside it, e.g. at nonzero() in HF's per-expert loop, "
                "experts_implementation='eager'), so they run on dequantized weights; for HF models use "
                "model.set_experts_implementation('grouped_mm') (or 'batched_mm')"
            )
        self._leave_shared_sizes(site)
        region = set(site.region)
        outputs = [n for n in site.region if any(u not in region for u in n.users)]
        if len(outputs) != 1:
            raise _NoMatch(
                f"the experts region has {len(outputs)} outputs ({[n.name for n in outputs]}), not one "
                "(is the experts module called more than once in this graph, or a weight read outside it?)"
            )
        out = outputs[0]
        e, two_i, h = _shape(site.dequant["w13"])
        i = _shape(site.dequant["w2"])[-1]
        gated = not statically_known_true(two_i == i)  # ungated experts' w13 is up alone: [E, I, H]
        inputs: dict[fx.Node, Val] = {}
        dequants = [n for n in site.region if n.target in _DEQUANT]
        for d in dequants:
            role = self._role(d.args[0], ctx)
            if role is None or d.args[0] is not site.dequant[role].args[0]:
                raise _NoMatch(f"{d.name} dequantizes a weight that is not one of this module's experts")
            inputs[d] = Val(role)
        external = {a for n in site.region if n.target not in _DEQUANT for a in n.all_input_nodes if a not in region}
        biases = self._biases(external, ctx, e, two_i, h)
        inputs.update({n: Val(r) for n, r in biases.items()})
        roles = self._interface(external - set(biases), _shape(out), e, h)
        inputs.update({n: Val(r) if r != "sym" else _IDX for n, r in roles.items()})
        by_role = {r: n for n, r in roles.items()}
        dense = set(by_role) - {"sym"} == {"x"}  # no routing read: the dense form, or nothing fused_moe computes
        if {"x", "ids", "wts"} - set(by_role) and not dense:
            raise _NoMatch("the experts do not read hidden_states, top_k_index and top_k_weights "
                           f"(found {sorted(by_role)})")
        interp = _Interpreter(inputs, e, i, h, 1 if dense else _shape(by_role["ids"])[1], gated)
        interp.run(site.region)
        result = interp.val.get(out)
        if dense:
            if result is None or result != Val("y", "dense") or _shape(out) != _shape(by_role["x"]):
                raise _NoMatch(
                    f"the experts read hidden states only, and their output {out.name} is not each expert's output "
                    "on its E-th of the rows (the dense form: x.view(E, -1, H) @ w13 ... @ w2, as Llama-4's); "
                    "fused_moe also takes top_k_index and top_k_weights"
                )
        elif result is None or result.kind != "sum" or result.fdim != -1:
            raise _NoMatch(f"the experts' output {out.name} is not the sum of the weighted expert outputs")
        elif result.expert != "all" and result.expert != frozenset(range(e)):
            missing = sorted(set(range(e)) - set(result.expert))
            raise _NoMatch(f"the experts' output {out.name} leaves out experts {missing}")
        x = fake_value(by_role["x"])
        if x.dtype == torch.float64:  # model.double(): the exact reference
            raise _NoMatch("hidden_states dtype torch.float64: the float64 reference, computed with the dequantized "
                           "experts")
        if x.dtype not in _ACT_DTYPES:
            raise _NoMatch(f"hidden_states dtype {x.dtype} is not bf16/fp16/fp32")
        ids, wts = (torch.int64, x.dtype) if dense else (fake_value(by_role[r]).dtype for r in ("ids", "wts"))
        if ids not in fp8fx.ops.EXPERT_ID_DTYPES or wts not in _ACT_DTYPES:  # what fused_moe takes
            raise _NoMatch(f"the routing gives {ids} expert ids and {wts} weights; fused_moe takes int32 / int64 ids "
                           "and bf16 / fp16 / fp32 weights")
        grads = [x, *([] if dense else [fake_value(by_role["wts"])]), *map(fake_value, site.dequant.values())]
        # (the weights: where a scale does; experts whose output records no history - frozen under torch.no_grad()
        # in a forward traced with grad - need no autograd formula)
        order = _order(out.graph)
        first_user = min((u for u in out.users if u not in region), key=order)
        records = getattr(fake_value(out), "requires_grad", True)
        # (the fused op goes before the output's first reader outside the experts: under the same grad mode only)
        switched = any("set_grad_enabled" in str(n.target) for n in out.graph.nodes
                       if order(out) < order(n) < order(first_user))
        if (records or switched) and any(v.requires_grad for v in grads) and may_record_grad(out.graph):
            raise _NoMatch(
                "traced with autograd (hidden states, routing weights or expert scales require grad); fp8fx rewrites "
                "inference: "
                "call the compiled model under torch.no_grad() or torch.inference_mode()"
                + ("" if records else " (the experts ran under no_grad, but their output is first read where grad "
                   "is on: the fused op, which goes before that read, would record it)")
            )
        late = [n.name for n in (*by_role.values(), *site.dequant.values()) for a in (n, *n.all_input_nodes)
                if order(a) > order(first_user)]
        if late:
            raise _NoMatch(f"{late} are computed after the experts' output is first used")
        form = interp.form()
        by_bias = {r: n for n, r in biases.items()}
        form.update((r, by_bias[r] if form[r] else None) for r in ("b13", "b2"))
        return {"out": out, "first_user": first_user, "x": by_role["x"], "ids": by_role.get("ids"),
                "wts": by_role.get("wts"), "dense": dense, "form": form}

    def _biases(self, external: set[fx.Node], ctx: PassContext, e, two_i, h) -> dict[fx.Node, str]:
        """The expert biases the region reads (``b13`` [E, 2I], ``b2`` [E, H]: GPT-OSS's, tagged by quantize_)."""
        found = {n: self._role(n, ctx) for n in external if self._role(n, ctx) in ("b13", "b2")}
        if len(set(found.values())) != len(found):
            raise _NoMatch(f"the experts read more than one tensor of a bias ({sorted(n.name for n in found)})")
        for n, role in found.items():
            want = (e, two_i) if role == "b13" else (e, h)
            if not all(statically_known_true(a == b) for a, b in zip(_shape(n), want)) or len(_shape(n)) != 2:
                raise _NoMatch(f"the experts read {n.name} {list(_shape(n))} as a {role} bias; fused_moe adds "
                               f"[{', '.join(map(str, want))}]")
        return found

    @staticmethod
    def _interface(external: set[fx.Node], out_shape: tuple, e: int, h: int) -> dict[fx.Node, str]:
        """Role of each tensor the region reads from outside: ``x`` [T, H], ``ids`` [T, K] int, ``wts``
        [T, K] float; SymInts are sizes."""
        roles = {}
        for n in sorted(external, key=lambda n: n.name):  # (a set: the reason names the same input every compile)
            v = fake_value(n)
            if isinstance(v, (int, torch.SymInt)):
                roles[n] = "sym"
            elif not isinstance(v, torch.Tensor):
                raise _NoMatch(f"the experts read {n.name}, which is not a tensor")
            elif not v.dtype.is_floating_point and v.dim() == 2:
                roles[n] = "ids"
            elif v.dim() == 2 and all(statically_known_true(a == b) for a, b in zip(v.shape, (out_shape[0], h))):
                roles[n] = "x"
            elif v.dim() == 2 and v.dtype.is_floating_point:
                roles[n] = "wts"
            elif v.dim() > 2 and (statically_known_true(v.shape[-1] == h) or not v.dtype.is_floating_point):
                # [B, T, H] hidden states or [B, T, K] routing: a batch dim the experts loop over as tokens
                raise _NoMatch(f"the experts read {n.name} {tuple(v.shape)}: fused_moe takes [T, H] hidden states and "
                               "[T, K] routing; flatten the tokens before the experts (x.view(-1, H))")
            elif v.dim() == 0 and v.dtype.is_floating_point:
                # (torch.compile(dynamic=True) passes a module's float attribute, GPT-OSS's alpha / limit, as a graph
                # input, whose value may change between calls without a recompile: fused_moe takes it as a constant)
                raise _NoMatch(
                    f"the experts read {attribute_path(n) or n.name}, a 0-d tensor: a float attribute of the model "
                    "(GPT-OSS's alpha / limit) that torch.compile(dynamic=True) made a graph input, which fused_moe "
                    "cannot take as the constant it needs; compile without dynamic=True and mark the varying dims "
                    "(torch._dynamo.mark_dynamic(input_ids, 1)), or set torch._dynamo.config.specialize_float = True")
            else:
                raise _NoMatch(f"the experts read {n.name} {tuple(v.shape)} besides their inputs (a bias? a norm?)")
        counts = {r: list(roles.values()).count(r) for r in ("x", "ids", "wts")}
        if any(c > 1 for c in counts.values()):
            raise _NoMatch("cannot tell hidden_states, top_k_index and top_k_weights apart among "
                           f"{sorted(n.name for n in roles)}")
        return roles

    # -- rewriting
    def _rewrite(self, graph: fx.Graph, site: _Site, operands: dict[str, fx.Node]) -> tuple[str, int, str]:
        out = operands["out"]
        w13, w2 = site.dequant["w13"], site.dequant["w2"]
        (w13q, w13s, w_block, _, a13, act_block), (w2q, w2s, _, _, a2, _) = (dequant_args(d) for d in (w13, w2))
        act_block = act_block or [1, -1]
        if a13 is not None:
            act_block = [-1, -1]
        region = set(site.region)
        with graph.inserting_before(operands["first_user"]):
            wts, ids = operands["wts"], operands["ids"]
            if operands["dense"]:
                wts, ids = _parts(graph, dense_routing, (operands["x"], fake_value(w13q).shape[0]), 2)
            args = (operands["x"], wts, ids, w13q, w13s, w2q, w2s, list(w_block), list(act_block),
                    fake_value(out).dtype, a13, a2, self.use_fast_accum)
            form = operands["form"]
            extra = (form["b13"], form["b2"], form["interleaved"], form["activation"], form["swiglu_alpha"],
                     form["swiglu_limit"], form["gated"])
            if extra != (None, None, False, "silu", 1.702, 7.0, True):  # (SiLU experts' calls as before: their dumps)
                args += extra if not form["gated"] else extra[:-1]
            fused = graph.call_function(torch.ops.fp8fx.fused_moe.default, args)
        set_fake_value(fused, torch.ops.fp8fx.fused_moe.default, args)
        fused.meta.update({k: v for k, v in out.meta.items() if k not in ("example_value", "val")})
        saved = bytes_saved(w13) + bytes_saved(w2)
        out.replace_all_uses_with(fused, delete_user_cb=lambda user: user not in region)
        for node in reversed(site.region):
            graph.erase_node(node)
        scheme = str(LayerScheme(granularity_from_block(w_block, weight=True), granularity_from_block(act_block),
                                 a13 is not None))
        if operands["dense"]:
            scheme += ROUTED if _route_dense(graph, fused) else DENSE
        return scheme + _form_note(operands["form"]), saved, Site.origin_of(fused)


def _form_note(form: dict) -> str:
    """What the report's scheme says of experts that are not plain SiLU(gate) * up (GPT-OSS's, Nemotron-H's)."""
    parts = ["ungated" if not form["gated"] else None,
             "biases" if form["b13"] is not None and form["b2"] is not None else "w13 bias" if form["b13"] is not None
             else "w2 bias" if form["b2"] is not None else None,
             "interleaved gate/up" if form["interleaved"] else None,
             f"clamped SwiGLU (alpha {form['swiglu_alpha']:g}, limit {form['swiglu_limit']:g})"
             if form["activation"] == "swiglu_oai" else None,
             f"clamped SiLU (limit {form['swiglu_limit']:g})" if form["activation"] == "silu_clamped" else None,
             "GELU (tanh)" if form["activation"] == "gelu_tanh" else None,
             "GELU" if form["activation"] == "gelu" else None,
             "squared ReLU" if form["activation"] == "relu2" else None,
             "SiLU" if form["activation"] == "silu" and not form["gated"] else None]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


DENSE = (" (dense: every expert on its E-th of the rows, as the model computes them; fused_moe does not skip the "
         "rows the router zeroed)")


def dense_routing(x: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe's routing of the dense form: row r of ``x`` [E * T, H] goes to expert r // T, with weight 1 (the
    router's weights are already on the rows). [R, 1] weights of x's dtype and [R, 1] int64 ids."""
    rows = x.shape[0]
    ids = torch.arange(experts, device=x.device).view(experts, 1).expand(experts, rows // experts).reshape(rows, 1)
    return torch.ones(rows, 1, dtype=x.dtype, device=x.device), ids


ROUTED = (" (routed: the router's top-k of the dense form, its weights on the input rows, as vLLM's "
          "apply_router_weight_on_input)")
_SIGMOID = (torch.sigmoid, torch.nn.functional.sigmoid, torch.special.expit)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _call(node, names: tuple, functions: tuple = ()) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_method" and node.target in names
                                          or node.op == "call_function" and node.target in functions)


def _router_of(scores: fx.Node, t, e) -> Optional[tuple[fx.Node, fx.Node, list, fx.Node]]:
    """(top values, top ids, the elementwise ops from them to ``scores``, the scatter) where ``scores`` [T, E] is the
    router's top-k of its logits scattered into -inf and mapped by elementwise ops with a sigmoid among them (Llama-4's
    ``Llama4Router``: ``sigmoid(full_like(logits, -inf).scatter_(1, ids, values).float()).to(dtype)``): every score of
    an expert the router did not pick is sigmoid(-inf) = 0, exactly. Else None."""
    ops: list = []
    node = scores
    if any(_in_place(u) for u in scores.users):  # (the model's later reads of the scores see that change)
        return None
    while not _call(node, ("scatter_", "scatter"), (torch.scatter,)):
        if node is not scores and len(node.users) != 1:
            return None
        if _call(node, ("float",)):
            ops.append(("float",))
        elif _call(node, ("to",)) and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
            ops.append(("to", node.args[1]))
        elif _call(node, ("sigmoid",), _SIGMOID) and len(node.args) == 1 and not node.kwargs:
            ops.append(("sigmoid",))
        else:
            return None
        node = node.args[0]
    if len(node.users) != 1 or _scores(ops[::-1], torch.tensor(float("-inf"), dtype=fake_value(node).dtype)) != 0:
        return None  # (an expert the router did not pick must weigh exactly 0: sigmoid(-inf), not sigmoid twice)
    target, dim, ids, values = (_arg(node, i, n) for i, n in enumerate(("self", "dim", "index", "src")))
    if node.kwargs.keys() - {"dim", "index", "src"} or not isinstance(dim, int) or dim % 2 != 1:
        return None
    if not (_call(target, (), (torch.full_like,)) and target.args[1:] == (float("-inf"),) and not target.kwargs
            and len(target.users) == 1 and _same(_shape(target), (t, e))):
        return None
    if not (_call(ids, (), (operator.getitem,)) and _call(values, (), (operator.getitem,))
            and ids.args[0] is values.args[0] and (values.args[1], ids.args[1]) == (0, 1)):
        return None
    topk = ids.args[0]
    if not _call(topk, ("topk",), (torch.topk,)) or _arg(topk, 2, "dim", -1) % 2 != 1 \
            or _arg(topk, 3, "largest", True) is not True or len(_shape(ids)) != 2 \
            or not _same(_shape(ids), (t, _shape(ids)[1])) or not _same(_shape(values), _shape(ids)):
        return None
    return values, ids, ops[::-1], node


def _in_place(node: fx.Node) -> bool:
    """``node`` changes a tensor it reads (``add_``, ``x[i] = v``, ``out=``)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (node.op in ("call_method", "call_function") and isinstance(name, str)
            and (name.endswith("_") and not name.endswith("__") or name in ("setitem", "copy_"))
            or "out" in node.kwargs)


def _route_dense(graph: fx.Graph, fused: fx.Node) -> bool:
    """The dense form's fused_moe rewritten to route each token to its top-k experts only, where the block around the
    experts is Llama-4's (``Llama4TextMoe``)::

        rows = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)   # scores: ``_router_of``
        out = fused_moe(rows, ...).reshape(E, -1, H).sum(0)

    becomes fused_moe on the T * K rows ``x[t] * score(t, k)`` with the router's ids, summed over k: the rows of the
    experts the router did not pick are 0 there, and so are their outputs (a zero row quantizes to zeros: 0 in every
    scheme). True if rewritten; else the graph is unchanged."""
    rows = fused.args[0]
    e, two_i, h = _shape(fused.args[3])
    if len(fused.users) != 1 or not _call(rows, ("mul",), (operator.mul, torch.mul)) or len(rows.args) != 2:
        return False
    view = next(iter(fused.users))
    total = _shape(rows)[0]
    if not _call(view, ("reshape", "view")) or len(view.users) != 1 or not _same(_shape(view), (e, total // e, h)):
        return False
    combine = next(iter(view.users))
    if not (_call(combine, ("sum",), (torch.sum,)) and _arg(combine, 1, "dim") in (0, [0], (0,))
            and not combine.kwargs.keys() - {"dim"} and len(combine.args) <= 2):
        return False
    rep, column = rows.args if _call(rows.args[0], ("repeat",)) else rows.args[::-1]
    if not (_call(rep, ("repeat",)) and len(rep.args) == 3 and rep.args[2] == 1 and len(_shape(rep.args[0])) == 2
            and statically_known_true(rep.args[1] == e)) or not _call(column, ("reshape", "view")):
        return False
    x = rep.args[0]
    t = _shape(x)[0]
    transposed = column.args[0]
    if not (_same(_shape(column), (total, 1)) and _call(transposed, ("transpose", "t"), (torch.transpose, torch.t))
            and (transposed.target in ("t", torch.t) or sorted(d % 2 for d in transposed.args[1:3]) == [0, 1])):
        return False
    router = _router_of(transposed.args[0], t, e)
    if router is None:
        return False
    values, ids, ops, scatter = router
    # the routed rows are computed where the model's rows are: a tensor changed in place between the router's top-k and
    # the combine (the hidden states, the top-k values) would give other rows there than the model's; none may be,
    # but the router's own scatter into its fresh -inf tensor
    order = _order(graph)
    if any(_in_place(n) and n is not scatter for n in graph.nodes if order(values.args[0]) < order(n) < order(combine)):
        return False
    with graph.inserting_before(rows):
        args = (*_parts(graph, router_weighted_rows, (x, values, ids, tuple(ops)), 3), *fused.args[3:])
        sparse = graph.call_function(torch.ops.fp8fx.fused_moe.default, args)
        set_fake_value(sparse, torch.ops.fp8fx.fused_moe.default, args)
        sparse.meta.update({k: v for k, v in fused.meta.items() if k not in ("example_value", "val")})
    with graph.inserting_before(combine):
        out = graph.call_function(sum_over_k, (sparse, _shape(ids)[1]))
        set_fake_value(out, sum_over_k, out.args)
    combine.replace_all_uses_with(out)
    dead = [combine, view, fused, *fused.args[1:3], fused.args[1].args[0], rows, rep, column, transposed]
    for node in dead:
        if not node.users:
            graph.erase_node(node)
    return True


def _parts(graph: fx.Graph, fn, args: tuple, n: int) -> list[fx.Node]:
    """The ``n`` outputs of ``fn(*args)`` (a tuple of tensors) as nodes, with their fake values, at the graph's
    insertion point."""
    call = graph.call_function(fn, args)
    set_fake_value(call, fn, args)
    parts = [graph.call_function(operator.getitem, (call, i)) for i in range(n)]
    for i, part in enumerate(parts):
        part.meta["example_value"] = call.meta["example_value"][i]
    return parts


def router_weighted_rows(x: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, ops: tuple):
    """fused_moe's operands for the router's top-k with its weights on the input (``_route_dense``): rows [T * K, H]
    ``x[t] * score(t, k)``, with ``score`` the router's ``ops`` on its top-k ``values`` (as the model maps every
    logit), [T * K, 1] weights 1 and [T * K, 1] ids."""
    scores = _scores(ops, values)
    t, k = ids.shape
    rows = (x.unsqueeze(1) * scores.unsqueeze(2)).reshape(t * k, x.shape[-1])
    return rows, torch.ones(t * k, 1, dtype=rows.dtype, device=x.device), ids.reshape(t * k, 1)


def _scores(ops: tuple, values: torch.Tensor) -> torch.Tensor:
    """The router's elementwise ``ops`` (``_router_of``) on ``values``."""
    for op, *arg in ops:
        values = values.float() if op == "float" else values.to(*arg) if op == "to" else torch.sigmoid(values)
    return values


def sum_over_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """fused_moe's [T * K, H] outputs of ``router_weighted_rows``' rows, summed over each token's K experts."""
    return y.view(-1, k, y.shape[-1]).sum(1)


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _stack_paths(node: fx.Node) -> set[str]:
    """FQNs of every module on ``node``'s ``nn_module_stack`` (the innermost's is ``module_path``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return {module_path(types.SimpleNamespace(meta={"nn_module_stack": {k: v}})) for k, v in stack.items()}
