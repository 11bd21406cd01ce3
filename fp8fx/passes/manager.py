"""Runs the fp8fx passes in order and owns the compile-cache key they feed."""
from __future__ import annotations

import hashlib
import json
import logging
import operator
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import fx

from fp8fx.lowerings import compat
from fp8fx.passes.base import Fp8Pass, PassContext
from fp8fx.passes.horizontal import HorizontalFusionPass
from fp8fx.passes.linear import LinearPass
from fp8fx.passes.mlp import GatedMlpPass
from fp8fx.passes.moe import MoePass
from fp8fx.passes.router import RouterPass
from fp8fx.passes.topk import TopkPass
from fp8fx.report import Report

log = logging.getLogger("fp8fx")


def default_passes(
    use_fast_accum: bool = False, weight_only: Optional[bool] = None, fuse_horizontal: bool = False,
    fuse_mlp: bool = False, mlp_h_group: Union[int, None, str] = None, fast_topk: bool = True,
    fast_router: bool = True, fuse_routing: bool = True,
) -> list[Fp8Pass]:
    return [
        # first: the experts leave the graph before linears are sought
        MoePass(use_fast_accum=use_fast_accum, weight_only=weight_only),
        LinearPass(use_fast_accum=use_fast_accum, weight_only=weight_only, fusing=fuse_mlp or fuse_horizontal),
        # before horizontal fusion: a fused MLP reads gate and up apart
        GatedMlpPass(enabled=fuse_mlp, h_group=mlp_h_group),
        HorizontalFusionPass(enabled=fuse_horizontal),
        # after the linear pass, which reports the router's linear as a site (not quantized) by its node
        RouterPass(enabled=fast_router),
        # after the MoE pass, which reads a dense router's top-k (Llama-4's) as torch.topk
        TopkPass(enabled=fast_topk, fuse_routing=fuse_routing),
    ]


class PassManager:
    """Runs ``passes`` on each Dynamo graph; recorded sites go to ``report``.

    Its key is also in Inductor's ``post_grad_custom_post_pass`` slot (``with_user_pass``: a ``_GraphKey``, which
    changes nothing there but runs a pass of the user's that was there), so that its ``uuid()`` — the pass uuids plus
    the backend options — is part of Inductor's FX-graph cache key: a changed pass or option never reuses a stale
    compiled artifact.
    """

    def __init__(self, passes: Sequence[Fp8Pass], options: dict[str, Any]):
        self.passes = list(passes)
        self.options = dict(options)

    def run(self, gm: fx.GraphModule, example_inputs: Sequence[Any], report: Report) -> int:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        example = dict(zip(placeholders, example_inputs))
        # the tensors the graph holds as attributes: the parameters, where Inductor's freezing is on (Dynamo then
        # passes them as get_attr nodes; their fp8fx tags went unread, and an ignored layer was "not quantized: run
        # quantize_")
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            try:
                value = operator.attrgetter(node.target)(gm)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor):
                example[node] = value
        ctx = PassContext(report, report.graphs, example)
        report.graphs += 1
        total = 0
        for p in self.passes:
            n = p(gm, ctx)
            log.debug("fp8fx: %s rewrote %d sites in graph %d", type(p).__name__, n, ctx.graph_index)
            total += n
        gm.graph.lint()
        return total

    def with_user_pass(self, user_pass: Optional[Callable[[fx.Graph], Any]],
                       names: Sequence[str] = ()) -> Callable[[fx.Graph], Any]:
        """What goes in Inductor's ``post_grad_custom_post_pass`` slot for one graph: this manager keyed with the
        graph's node ``names``, and a pass of the user's that was there, which runs. A ``CustomGraphPass`` of the
        user's keys the cache with this one; a plain function cannot be keyed, and Inductor bypasses its FX-graph
        cache for it, as it does without fp8fx.

        Why the names: the report finds each site's kernel by the Dynamo node names Inductor's output code cites,
        and the cache is keyed on the graph after AOTAutograd, which has none of them. Two graphs that differ only
        in those names (an ``nn.Sequential`` and a hand-written forward of the same layers) would share an artifact
        that cites the first one's names, and the second's report would lose its kernels."""
        if isinstance(user_pass, _GraphKey) and user_pass.manager is self:  # (this manager's own key, leaked into
            user_pass = user_pass.user_pass                                # a global config: what it wrapped)
        if user_pass is None:
            return _GraphKey(self, names)
        if isinstance(user_pass, compat.CustomGraphPass):
            return _GraphKey(self, names, user_pass)
        return lambda graph: user_pass(graph)

    def uuid(self) -> str:
        key = {
            "passes": [(type(p).__name__, p.uuid()) for p in self.passes],
            "options": self.options,
            "torch": torch.__version__,
            # what shapes the compiled graph besides the passes: the quantization's ATen decomposition
            # and the Inductor hooks (AOTAutograd's cache key does not see a decomposition table)
            "lowerings": _sources_hash(),
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class _GraphKey(compat.CustomGraphPass):
    """``PassManager.with_user_pass``'s slot: the manager's key, one graph's node names, and the user's pass."""

    def __init__(self, manager: PassManager, names: Sequence[str],
                 user_pass: Optional[compat.CustomGraphPass] = None):
        self.manager, self.names, self.user_pass = manager, list(names), user_pass

    def __call__(self, graph: fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Optional[str]:
        user = self.user_pass.uuid() if self.user_pass is not None else ""
        if user is None:  # the user's pass says it cannot be keyed
            return None
        user = user.hex() if isinstance(user, bytes) else str(user)  # (torch's own example returns bytes)
        return hashlib.sha256(json.dumps([self.manager.uuid(), self.names, user]).encode()).hexdigest()


def _sources_hash() -> str:
    """Hash of the sources that change compiled output without being a pass: fp8fx.quant (the math the
    decompositions emit), fp8fx.lowerings.aten (the decompositions), fp8fx.lowerings.compat, and fp8fx.ops, whose
    fake implementations' shapes and strides and whose signatures the compiled wrapper holds (assert_size_stride,
    the direct calls): a cached wrapper of an older ops.py failed at its first call."""
    import inspect

    from fp8fx import ops, quant
    from fp8fx.lowerings import aten, compat

    return hashlib.sha256("".join(inspect.getsource(m) for m in (quant, aten, compat, ops)).encode()).hexdigest()
