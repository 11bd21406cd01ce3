"""What every fp8fx pass shares: the context it runs in and a uuid from its module's source."""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import sys
from typing import Any, Optional

import torch
from torch import fx
from torch.utils import _pytree as pytree


from fp8fx.lowerings import compat
from fp8fx.lowerings.compat import FakeTensor
from fp8fx.quant import HIGH_PRECISION
from fp8fx.report import Report, Site


@dataclasses.dataclass
class PassContext:
    """``example`` maps each placeholder to the real tensor Dynamo passed for it (parameters are
    the module's own ``nn.Parameter`` objects, so tags set at load time are visible)."""

    report: Report
    graph_index: int
    example: dict[fx.Node, Any]
    positions: dict[fx.Node, int] = dataclasses.field(init=False, repr=False)  # placeholder -> its input's index

    def __post_init__(self):
        self.positions = {n: i for i, n in enumerate(self.example)}

    def frame_site(self, fqn: str, path: Optional[str], weight: Any) -> None:
        """What ``Report.frames`` needs of the site the caller adds next (``fqn``, whose module Dynamo names ``path``
        in the graph, with the weight ``weight``): where the layer's name ends in a ``path`` relative to another
        module than the compiled model, the graph traced that module's forward, a frame of its own (after a graph
        break) that Dynamo runs again for the other modules of its class without a new graph; and which graph input
        the weight is, where it is one."""
        frames = self.report.frames
        if self.graph_index not in frames:
            if path and fqn.endswith(f".{path}"):
                frames[self.graph_index] = fqn[:-len(path) - 1]
            elif not path and fqn and getattr(self.example.get(weight), "_fp8fx_fqn", None) == fqn and "." not in (
                    input_path(weight) or ".") and not _on_a_resumed_stack(weight):
                # the layer (its weight's tag) is the frame's own module: a graph of its forward resumed after a
                # break inside it (HF's per-expert loop at nonzero()), which reads the weight as its own attribute;
                # not an untagged weight the compiled module reads itself, nor a child's weight it reads
                # (torch.mm(x, self.b.weight.t()) in its own forward: ``b.weight``; under Inductor's freezing, an
                # attribute of the graph, whose path is not known), nor a module a resume function of its caller
                # took over on its stack
                frames[self.graph_index] = fqn
        if isinstance(weight, fx.Node) and weight in self.positions:
            entry = (len(self.report.sites), self.positions[weight])
            self.report.frame_weights.setdefault(self.graph_index, []).append(entry)


class Fp8Pass:
    """A graph transformation on Dynamo's torch-IR graph. Subclasses implement ``__call__``."""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        """Rewrite ``gm`` in place; return the number of sites rewritten."""
        raise NotImplementedError

    def uuid(self) -> str:
        """Hash of the source of the module that defines the pass (changes whenever the pass may)."""
        source = inspect.getsource(sys.modules[type(self).__module__])
        return hashlib.sha256(source.encode()).hexdigest()


class NodePass(Fp8Pass):
    """A pass that rewrites nodes one at a time, each on its own (``visit``), switched off by ``enabled=False`` (it then
    looks at nothing)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def uuid(self) -> str:
        """The subclass's module, this one's (its loop and ``replace_node`` are the pass's too) and the pass's
        options (``enabled`` and any a subclass adds)."""
        here = inspect.getsource(sys.modules[__name__])
        options = sorted(vars(self).items())
        return hashlib.sha256(f"{super().uuid()}:{here}:{options}".encode()).hexdigest()

    def visit(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext, records_grad: bool) -> bool:
        """Rewrite ``node`` where it is the pass's (``records_grad``: ``may_record_grad`` of the graph); whether it
        did."""
        raise NotImplementedError

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if not self.enabled:
            return 0
        records_grad = may_record_grad(gm.graph)
        return sum(self.visit(gm, node, ctx, records_grad) for node in list(gm.graph.nodes))


# gm.meta key: the graph's float inputs a pass took as constants, as (input position, value, name) each: Dynamo passes
# a module's float attribute as an input under torch.compile(dynamic=True) (an unspecialized float, which it does not
# guard), so the backend checks each call's value and runs the graph as traced where one differs
FLOAT_INPUTS = "fp8fx_float_inputs"


def is_float_input(value: Any) -> bool:
    """What Dynamo passes for a Python float it did not specialize (``torch.compile(dynamic=True)``): a 0-d CPU
    floating tensor (read with ``.item()``)."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() and (
        value.device.type == "cpu")


def float_input_value(node: Any, ctx: PassContext) -> Optional[float]:
    """The value a placeholder Dynamo made of a Python float holds in this compilation (``is_float_input``); None
    for any other node."""
    real = ctx.example.get(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    return float(real) if is_float_input(real) else None


def replace_node(graph: fx.Graph, node: fx.Node, target, args: tuple, example_value: Any = None) -> fx.Node:
    """``node`` replaced by ``target(*args)``, which keeps its meta (module stack, source) and carries
    ``example_value`` (else its fake value from the inputs'); returns the new node."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
    if example_value is None:
        set_fake_value(new, target, args)
    else:
        new.meta["example_value"] = example_value
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def site_names(ctx: PassContext, nodes: list[fx.Node]) -> str:
    """The report sites of ``nodes`` by their last FQN part, comma-separated (``q_proj,k_proj,v_proj``), or by their
    full names where those parts repeat (the k/v of every layer's cross-attention read one encoder output: one group
    across layers, which read ``fused(k_proj,v_proj,k_proj,v_proj)``)."""
    fqns = [ctx.report.sites[n.meta["fp8fx_site"]].fqn for n in nodes if "fp8fx_site" in n.meta]
    last = [f.rsplit(".", 1)[-1] for f in fqns]
    if len(set(last)) == len(last) or len(set(fqns)) < len(fqns):  # (one layer called twice: its name twice)
        return ",".join(last)
    return ",".join(fqns)


def amend_sites(ctx: PassContext, nodes: list[fx.Node], note: str, node: Optional[str] = None) -> None:
    """Append ``note`` to the scheme of the report site of each of ``nodes`` (a later pass fused them, or
    says why not); ``node``: the graph node they now run in (the report's kernel column)."""
    for n in nodes:
        if "fp8fx_site" in n.meta:
            i = n.meta["fp8fx_site"]
            site = ctx.report.sites[i]
            # (a second note after a first, "; " apart: "... scales only fused(gate_proj,up_proj)" read as one; a note
            # in parentheses goes on the one before it)
            sep = "; " if re.search(r"\b(not fused|fused\()", site.scheme) and not note.startswith("(") else " "
            ctx.report.sites[i] = dataclasses.replace(site, scheme=f"{site.scheme}{sep}{note}", node=node or site.node)


def restate_activation(ctx: PassContext, node: fx.Node, scheme: str) -> None:
    """Make the ``a:...`` part of ``node``'s report site ``a:<scheme>``: a later pass changed how that GEMM's
    activation is quantized (the fused MLP's h in groups, where the graph quantized it per token or per tensor)."""
    if "fp8fx_site" in node.meta:
        i = node.meta["fp8fx_site"]
        site = ctx.report.sites[i]
        restated = re.sub(r"\ba:\S+", f"a:{scheme}", site.scheme, count=1)
        ctx.report.sites[i] = dataclasses.replace(site, scheme=restated)


def switches_grad_mode(graph: fx.Graph) -> bool:
    """Whether Dynamo's graph switches grad mode inside: ``torch.enable_grad()`` / ``no_grad()`` in the traced code
    become ``torch._C._set_grad_enabled`` calls (or a ``wrap_with_set_grad_enabled`` region): both targets' names
    hold "set_grad_enabled"."""
    return any(node.op == "call_function" and "set_grad_enabled" in str(node.target) for node in graph.nodes)


def may_record_grad(graph: fx.Graph) -> bool:
    """Whether ops of ``graph`` may record autograd history: grad was enabled where it was traced, or the graph
    enables it somewhere inside. A node whose value requires grad then needs its op's autograd formula (fp8fx's ops
    have none)."""
    return torch.is_grad_enabled() or switches_grad_mode(graph)


_DEQUANTIZE_PARAMS = ("q", "scale", "block", "dtype", "input_scale", "act_block")  # fp8fx.dequantize's, in order


def dequant_args(node: fx.Node) -> list:
    """The arguments of an ``fp8fx.dequantize`` node in its parameters' order (``_DEQUANTIZE_PARAMS``), positional or
    keyword, None for those not given."""
    return [node.kwargs[n] if n in node.kwargs else node.args[i] if len(node.args) > i else None
            for i, n in enumerate(_DEQUANTIZE_PARAMS)]


def bytes_saved(dequantized: fx.Node) -> int:
    """Bytes an fp8 weight saves, from the ``fp8fx.dequantize`` node that reads it: its high-precision view's bytes
    less its codes', its scale's and a static input scale's (the layer stores that one too: the report said 4 bytes
    a static layer more than its state_dict saves)."""
    _, scale, _, _, input_scale, _ = dequant_args(dequantized)
    stored = [fake_value(scale)] + ([fake_value(input_scale)] if isinstance(input_scale, fx.Node) else [])
    return Site.saved_bytes(fake_value(dequantized), *stored)


def fake_value(node: Any) -> Any:
    """The fake tensor Dynamo recorded for ``node`` (or ``node`` itself when it is a constant)."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def set_fake_value(node: fx.Node, target, args, kwargs=None) -> None:
    """Run ``target`` on the inputs' fake tensors so ``node`` carries a correct ``example_value``."""
    vals = fx.node.map_aggregate(args, fake_value)
    kvals = fx.node.map_aggregate(kwargs or {}, fake_value)
    fakes = [v for v in pytree.tree_leaves((vals, kvals)) if isinstance(v, FakeTensor)]
    if not fakes:
        return
    mode = fakes[0].fake_mode
    with mode:
        out = target(*vals, **kvals)
    node.meta["example_value"] = out


# the root of a path: L['self'], L['args'][0], L['fn'] ... up to the first attribute
_ROOT = re.compile(r"^L(\[[^\]]+\])+\.?")
_GLOBAL_ROOT = re.compile(r"^G(\[[^\]]+\])+\.?")
_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")


# a module's dict read as such: PEFT's PeftModel reaches its base model through __getattr__, which Dynamo names
# "L['self'].__dict__['_modules']['base_model']"
_DICT = re.compile(r"\.__dict__\[['\"](_modules|_parameters|_buffers)['\"]\]\[['\"]([^'\"]+)['\"]\]")


def module_path(node: fx.Node) -> Optional[str]:
    """FQN of the innermost module whose forward created ``node`` (from Dynamo's nn_module_stack)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = _DICT.sub(r".\2", list(stack.values())[-1][0])
    # a module Dynamo reached by attribute (a global model called through torch.func.functional_call:
    # "getattr(G['m1'], '0')"): the dotted path under that model, as for the compiled module's own ("L['self']")
    while (flat := _GETATTR.sub(r"\1.\2", path)) != path:
        path = flat
    path = _GLOBAL_ROOT.sub("", _ROOT.sub("", path))
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.lstrip(".")


_ATTRIBUTE = re.compile(r"\._(modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]")


def _on_a_resumed_stack(node: Any) -> bool:
    """Whether the input ``node`` is read from a value a resume function took over on its stack (Dynamo's
    ``L['___stack0']``: the module ``self.post`` loaded before the call that broke the graph, in
    ``self.post(self.blk(x))``): the graph is a resume function of the caller, not the module's own forward."""
    name = compat.input_source(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    return bool(name) and name.startswith("L['___stack")


def _after_root(node: fx.Node) -> Optional[str]:
    """Dynamo's name of the input a placeholder is, after its root (``L['self']``), as ``._modules['l']...``; None
    for any other node or input."""
    name = compat.input_source(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    name = _DICT.sub(r".\1['\2']", name) if name else None
    root = _ROOT.match(name) if name else None
    return None if root is None else "." + name[root.end():].lstrip(".")


def input_path(node: fx.Node) -> Optional[str]:
    """The dotted name of the parameter or buffer a placeholder is (``l.weight``, ``w``), from Dynamo's name of the
    input: relative to the module whose forward the graph traced (the compiled module, or a block Dynamo resumed
    after a graph break, whose name it does not know); None for any other node or input."""
    rest = _after_root(node)
    parts = _ATTRIBUTE.findall(rest) if rest is not None else None
    if not parts or "".join(f"._{kind}['{key}']" for kind, key in parts) != rest.replace('"', "'") \
            or parts[-1][0] == "modules":
        return None
    return ".".join(key for _, key in parts)


def attribute_path(node: fx.Node) -> Optional[str]:
    """The dotted name of the module attribute a placeholder is, whatever its kind (``experts.alpha``: a float that
    Dynamo made an input; ``l.weight``), relative to the traced module; None for any other node or input."""
    rest = _after_root(node)
    return None if rest is None else _ATTRIBUTE.sub(r".\2", rest).lstrip(".") or None


_FLOAT32_CASTS = ("float", "to", "type")  # x.float(), x.to(torch.float32), x.type(torch.float32)


def _float32_cast_of(node) -> Optional[fx.Node]:
    """The tensor ``node`` casts to float32 (``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``), or
    None."""
    if isinstance(node, fx.Node) and node.op == "call_method" and node.target in _FLOAT32_CASTS and not node.kwargs \
            and len(node.args) == (1 if node.target == "float" else 2) and node.args[1:] in ((), (torch.float32,)):
        return node.args[0]
    return None


def float32_source(node):
    """The tensor ``node`` is a float32 cast of, where that tensor is 16-bit or float32, else ``node``: for a kernel
    that casts as it loads (exact), so the cast's own kernel goes (Nemotron-H's router: ``F.linear(x.type(
    torch.float32), self.weight.type(torch.float32))``, a copy of the weight every call, 1.6-2 us; Mixtral's
    ``softmax(logits.float())``)."""
    source = _float32_cast_of(node)
    value = fake_value(source)
    return source if isinstance(value, torch.Tensor) and value.dtype in HIGH_PRECISION else node
