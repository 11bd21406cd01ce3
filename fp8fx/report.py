"""What the compiler did: one ``Site`` per linear / MoE computation seen in a compiled graph, and one per top-k
(``Report.topk``: ``fp8fx.passes.topk``).

``str(report)`` is a table, ``report.to_json()`` the same as JSON (schema ``SCHEMA``), and the backend
logs one line per compiled graph (``Report.log_graph``) under the ``fp8fx`` logger. Models compiled through one
backend share its report, their rows told apart by graph and name only: ``report.sites_of(model)`` gives one model's.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import re
import weakref
from typing import Any, Iterable, Optional

from fp8fx.lowerings import compat

log = logging.getLogger("fp8fx")
# how a site left in high precision on purpose (its weight tagged with why) says so
NOT_QUANTIZED = "not quantized: "

SCHEMA = "fp8fx.report/1"
# the table's name of a site whose module has the empty name: the model quantize_ was given is itself the linear
# (quantize_(nn.Linear(...))), whether compiled alone, called by a compiled function, or read by F.linear
ROOT = "(root module)"
_TOPK_KEYS = ("fqn", "rewritten", "reason", "scheme", "graph", "weight_shape", "kernel", "node")  # to_dict's "topk"
_TOKENS = itertools.count(1)  # Site.token_of
# id(tensor) -> (a weak reference to the tensor, its token): not an attribute of the tensor, which pickles and copies
# of plain parameters carried (a copy that never ran counted as its original, which had)
_TOKEN_OF: dict[int, tuple[weakref.ref, int]] = {}
_DEQUANTIZED: set[int] = set()  # tokens of the fp8 weights dequantize_ replaced (their layers save nothing now)


@dataclasses.dataclass(frozen=True)
class Site:
    kind: str  # "linear", "moe" or "topk" (``Report.topk``'s: weight_shape is the input's, no weight)
    fqn: str  # module path as in named_modules(), e.g. "model.layers.0.self_attn.q_proj"
    rewritten: bool
    reason: str  # why not rewritten; "" when rewritten
    scheme: str  # e.g. "w:per-channel a:per-token"; "" when the weight is not fp8
    graph: int  # index of the compiled graph (in compile order) the site was seen in
    weight_shape: tuple[int, ...] = ()  # of the high-precision weight, e.g. (N, K); () when unknown, -1 a symbolic dim
    bytes_saved: int = 0  # high-precision weight bytes minus the fp8 weight and its scales; 0 if not rewritten
    kernel: str = ""  # the GEMM Inductor generated for the site, e.g. "extern fp8fx.scaled_mm"; "" when unknown
    node: str = ""  # Dynamo's name for the site's call (``Site.origin_of``): the dumps' pass files end with the name of
    # the fp8fx op that replaced it (``linear_1`` <- ``scaled_mm_default_1``), the name Inductor's code comments give
    # ``Site.token_of`` the weight (fp8, or the one a site not rewritten read): a weight seen in several graphs is
    # saved once, two weights of one name twice (not in the report's data: it means nothing outside this process)
    weight_id: int = dataclasses.field(default=0, compare=False, repr=False)

    @staticmethod
    def origin_of(node: Any) -> str:
        """The name Dynamo gave the call that created ``node`` (``meta["source_fn_stack"]``): a pass that
        replaces a node copies its meta, so the replacement keeps the name; else the node's own name."""
        stack = node.meta.get("source_fn_stack")
        return stack[-1][0] if stack else node.name

    @staticmethod
    def token_of(weight: Any) -> int:
        """A number for ``weight`` (a parameter) no other tensor of this process gets: kept by the tensor's id()
        with a weak reference to it (an id() is reused once its tensor is freed, and a later model's weight would
        count as the freed one)."""
        if weight is None:  # not an input of the graph: the site's name stands in
            return 0
        token = Site.known_token(weight)
        if token is None:
            token, key = next(_TOKENS), id(weight)

            def forget(ref: weakref.ref, key: int = key) -> None:  # (only its own entry: the id may be reused)
                if _TOKEN_OF.get(key, (None,))[0] is ref:
                    del _TOKEN_OF[key]

            _TOKEN_OF[key] = (weakref.ref(weight, forget), token)
        return token

    @staticmethod
    def known_token(weight: Any) -> Optional[int]:
        """``weight``'s token if ``token_of`` gave it one, else None."""
        entry = _TOKEN_OF.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    @staticmethod
    def dequantized(weight: Any) -> None:
        """``weight``, an fp8 tensor ``dequantize_`` replaces with a high-precision one: its rows save nothing now."""
        token = Site.known_token(weight)
        if token is not None:
            _DEQUANTIZED.add(token)

    @staticmethod
    def live_tokens() -> set[int]:
        """The tokens of the weights ``token_of`` numbered that are not freed."""
        return {token for _, token in _TOKEN_OF.values()}

    @staticmethod
    def shape_of(value: Any) -> tuple[int, ...]:
        """Shape of a (fake) tensor, () for anything else; -1 for a symbolic dim (a weight of dynamic size: int() of
        it guarded, forcing the dim static - a recompile per size - or failing on an unbacked one)."""
        shape = getattr(value, "shape", None)
        return tuple(d if type(d) is int else -1 for d in shape) if shape is not None else ()

    @staticmethod
    def saved_bytes(weight: Any, *scales: Any) -> int:
        """Bytes saved by storing ``weight`` (the high-precision view) as fp8 plus ``scales`` (its weight scale, and a
        static layer's input scale, which it stores too)."""
        n = weight.numel()
        return int(n * weight.element_size() - n - sum(s.numel() * s.element_size() for s in scales))


_BEFORE_RESET = "until torch._dynamo.reset(), which lets its frame compile again: "


class Report:
    """Every site each compiled graph held, and the kernels Inductor generated for each graph."""

    def __init__(self):
        self.sites: list[Site] = []
        # every top-k the top-k pass saw (kind "topk"), apart from the weights' sites: no weight, no bytes saved
        self.topk: list[Site] = []
        self.graphs = 0
        self.kernels: dict[int, list[str]] = {}  # graph index -> names of the kernels Inductor generated
        self.failed: dict[int, str] = {}  # graph index -> why it did not compile (its sites, if any, say it too)
        # graph index -> what it means that Dynamo compiled no more graphs for its frame (``at_recompile_limit``)
        self.limits: dict[int, str] = {}
        self._frame_ids: dict[int, str] = {}  # graph -> Dynamo's id of its frame (at_recompile_limit counts its own)
        # Dynamo's record of recompile-limit hits and its counts at the first graph (``recompile_limit_hits``)
        self._limit_hits_from: Optional[tuple[Any, dict[str, int]]] = None
        # graph index -> the module whose forward it traced, where that is not the compiled model (a block's forward
        # after a graph break in it): Dynamo runs the graph's code again for the other modules of that class it
        # meets, with their weights, without a new graph; the backend watches the weights it is called with
        # (frame_weights: site index -> the graph input of its weight) and adds the sites of each new module
        # (``reused``), under that module's names
        self.frames: dict[int, str] = {}
        # graph index -> why its kernel column is empty where it is (``add_output_code``: code that names no node)
        self.unnamed: dict[int, str] = {}
        self.frame_weights: dict[int, list[tuple[int, int]]] = {}
        self._logged: set[tuple[str, str]] = set()
        # what the log calls this report's graphs, before "graph N" (fp8_backend: a backend per graph, each one's
        # graph 0, told apart by the process's count of them)
        self.label = ""

    def add(self, site: Site) -> None:
        self.sites.append(site)
        if not site.rewritten and (site.fqn, site.reason) not in self._logged:
            self._logged.add((site.fqn, site.reason))
            level = logging.INFO if _by_design(site.reason) else logging.WARNING
            log.log(level, "fp8fx: %s %s not rewritten: %s", site.kind, site.fqn or ROOT, site.reason)

    def add_topk(self, site: Site) -> None:
        self.topk.append(site)
        if not site.rewritten:
            log.debug("fp8fx: top-k %s in graph %d kept as torch's: %s", site.fqn or "-", site.graph, site.reason)

    def fail_graph(self, graph: int, reason: str) -> None:
        """Graph ``graph`` did not compile: its sites were not rewritten, for ``reason`` - also where a pass failed
        before it recorded any (the graph's line in the table says so)."""
        self.failed[graph] = reason
        log.warning("fp8fx: graph %d: %s", graph, reason)
        for i, site in enumerate(self.sites):
            if site.graph == graph and site.rewritten:
                self.sites[i] = dataclasses.replace(site, rewritten=False, reason=reason, scheme="", bytes_saved=0,
                                                    kernel="")
                log.warning("fp8fx: %s %s not rewritten: %s", site.kind, site.fqn or ROOT, reason)
        self.topk = [dataclasses.replace(s, rewritten=False, reason=reason, scheme="", kernel="")
                     if s.graph == graph and s.rewritten else s for s in self.topk]

    def graph_of_frame(self, graph: int, compile_id: str) -> None:
        """Graph ``graph`` is one Dynamo compiled for the frame of ``compile_id`` ("frame/n")."""
        self._frame_ids[graph] = compile_id.partition("/")[0]

    def forget_frames(self) -> None:
        """After ``torch._dynamo.reset()``: Dynamo numbers frames from 0 again, and this report's graphs count toward
        no frame's recompile limit (they were counted as the new frame 0's, which hid other backends' graphs)."""
        self._frame_ids.clear()
        if self._limit_hits_from is not None:  # (the frames Dynamo ran uncompiled compile again)
            self._limit_hits_from = compat.recompile_limit_hits()
        # a frame at its limit is no longer: said as what was (it read, in the present, beside the graph the reset
        # let Dynamo compile for just such a call)
        self.limits = {g: why if why.startswith(_BEFORE_RESET) else f"{_BEFORE_RESET}{why}"
                       for g, why in self.limits.items()}

    def watch_recompile_limit(self) -> None:
        """Count Dynamo's recompile-limit hits from now on (``recompile_limit_hits``); called at each graph, counts
        from the first."""
        if self._limit_hits_from is None:
            self._limit_hits_from = compat.recompile_limit_hits()

    @property
    def recompile_limit_hits(self) -> int:
        """How many frames Dynamo ran uncompiled at a recompile limit in this process since this report's first graph
        (Dynamo's record; any frame, of this model or not). ``at_recompile_limit`` says it of a frame whose last graph
        this backend compiled; a frame that never gave it a graph (a graph break before its first op, compiled again
        for each shape: a decorator's wrapper that many methods share, as transformers' ``deprecate_kwarg``) reaches
        the limit unseen, and only this count tells. Counted from ``torch._dynamo.utils.counters.clear()`` where that
        came after the first graph (a hit before it is forgotten there)."""
        return sum(self._limit_hits().values())

    def _limit_hits(self) -> dict[str, int]:
        """``recompile_limit_hits`` by the limit's name (``recompile_limit``, ``accumulated_recompile_limit``)."""
        if self._limit_hits_from is None:
            return {}
        record, now = compat.recompile_limit_hits()
        first, before = self._limit_hits_from
        if record is not first:  # (Dynamo's counters cleared since: every hit in the new record is new)
            before = {}
        return {name: n - before.get(name, 0) for name, n in now.items() if n > before.get(name, 0)}

    def at_recompile_limit(self, graph: int, compile_id: str, graphs: int, limit: int, static: bool) -> None:
        """Graph ``graph`` is the ``limit``-th Dynamo compiled for its frame: a call that needs one more runs the
        frame uncompiled, and no graph, so no row of this report, says so (Dynamo warns once, naming no layer).
        Said in the log, the table and ``to_dict``, while every site of the graphs compiled stays as it is.
        ``static``: compiled with ``dynamic=False``, where each new shape is a graph of its own. Graphs of the frame
        that other backends compiled count too (a new backend for each model of one class): said where there are."""
        frame = self._frame_ids.setdefault(graph, compile_id.partition("/")[0])  # (the backend named it already)
        own = sum(f == frame for f in self._frame_ids.values())
        why = ("a new shape, each a graph of its own with dynamic=False, or another value of an argument guarded on"
               if static else "one whose inputs fail its guards: a new size of a dim kept static, another rank, dtype "
               "or device, or another value of an argument guarded on")
        fix = ("where shapes vary, compile with dynamic=None or mark the dim that varies dynamic "
               "(torch._dynamo.mark_dynamic); " if static else "") + (
               "TORCH_LOGS=recompiles names the guards that failed; raise the limit if each graph is needed")
        others = ""
        if own < graphs:  # (Dynamo counts every backend's graphs of a frame, its reason BACKEND_MATCH, and its
            # compiles of the frame that gave no graph)
            why = f"another backend's, or {why}"
            others = (f"; {graphs - own} of the {graphs} are not this backend's: other backends' (torch.compile with "
                      "another backend, or a new Fp8Backend, for a model of the same class: use one backend for the "
                      "models of one class, or call torch._dynamo.reset() between them), or compiles of the frame that "
                      "gave no graph (a graph break before its first op)")
        self.limits[graph] = (
            f"graph {graph} (Dynamo's compile id {compile_id}) is graph {graphs} of its frame, which is "
            f"torch._dynamo.config.recompile_limit ({limit}){others}: a call that needs another graph ({why}) runs the "
            f"frame uncompiled, in high precision on the dequantized weights, with no fp8 GEMM; {fix}")
        log.warning("fp8fx: %s", self.limits[graph])

    def discard_graph(self, graph: int) -> None:
        """Forget graph ``graph``, the last one begun: Dynamo discarded that attempt and traces the frame again, and
        the graph of the new attempt takes its index. Its sites, kernels and failure go; lines already logged about
        its sites stay (and are not logged again for the same site and reason)."""
        self.sites = [s for s in self.sites if s.graph != graph]
        self.topk = [s for s in self.topk if s.graph != graph]
        self.kernels.pop(graph, None)
        self.failed.pop(graph, None)
        self.limits.pop(graph, None)
        self.unnamed.pop(graph, None)
        self._frame_ids.pop(graph, None)
        self.frames.pop(graph, None)
        self.frame_weights.pop(graph, None)
        if self.graphs == graph + 1:  # the passes counted it (the attempt may have ended before they ran)
            self.graphs = graph

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[Site]:
        return [s for s in self.sites if not s.rewritten]

    @property
    def bytes_saved(self) -> int:
        """Weight bytes saved, each layer counted once however many graphs it appears in."""
        return _bytes_saved(self.sites)

    def unhandled_weights(self, model: Any) -> list[tuple[str, tuple[int, ...], str, str]]:
        """(name, shape, dtype, module class) of each parameter of ``model`` with two or more dims that
        belongs to no site of the report: weights whose computation no fp8fx pass rewrote or looked at
        (embeddings, experts modules no pass matched, and linears that ran in no compiled graph: under
        ``torch.compiler.disable``, or never called). ``model`` may be the ``torch.compile`` wrapper."""
        from fp8fx.lowerings import compat

        model = compat.compiled_module(model)
        modules = dict(model.named_modules())
        params = list(model.named_parameters())
        # a rewritten site knows its weight by the tensor (``weight_id``): its module is covered, whatever names
        # another model compiled with the same backend has (its "b" hid this model's "b", which never ran); the
        # rest are matched by name, and by the tensor too where the site knows it (a layer kept in high precision
        # that ran in one model does not cover the layer of that name of another model, which never ran)
        tokens = {s.weight_id for s in self.sites if s.weight_id and s.rewritten}
        by_tensor = {n.rpartition(".")[0] for n, p in params if Site.known_token(p) in tokens}
        read: dict[str, set[int]] = {}  # a site's name -> the tokens of the weights it read (0: not known)
        for s in self.sites:
            if not (s.weight_id and s.rewritten):
                read.setdefault(s.fqn, set()).add(s.weight_id)

        def ran(fqn: str, p: Any) -> bool:  # a site named fqn read p, or a weight of the module of that name
            ids = read.get(fqn)
            if ids is None:
                return False
            # (an experts site: one of two; a pruned weight's site read its mask buffer first)
            weights = [p, *((*modules[fqn].parameters(), *modules[fqn].buffers()) if fqn in modules else ())]
            return 0 in ids or any(Site.known_token(q) in ids for q in weights)

        rewritten = {s.fqn for s in self.sites if s.rewritten and not s.weight_id}
        found = []
        for name, p in params:
            owner, _, leaf = name.rpartition(".")
            if owner in by_tensor:
                continue
            # a quantized weight's site bears the name quantize_ / load_checkpoint gave it (the whole model's, where
            # one block of it was compiled: "0.q" for the block's "q"); the others' the compiled module's own names.
            # A tag of a site that was not rewritten covers that site's module only: an embedding whose weight a
            # tied lm_head (kept in bf16) shares is still listed, under its own name; a parametrized weight's
            # parameters (weight_norm's original0 / original1) are their layer's; a model wrapped after quantize_
            # (PEFT's get_peft_model) names the layer under its own root: base_model.model.<tag>
            tag = getattr(p, "_fp8fx_fqn", None)
            if tag in rewritten or ran(tag, p) and (owner == tag or owner.endswith(f".{tag}")
                                                    or owner.startswith(f"{tag}.parametrizations.")):
                continue
            # a weight's scales, and 2-D biases (Ernie-4.5-MoE's router's e_score_correction_bias [1, E]), are none
            if p.dim() >= 2 and not ran(owner, p) and not leaf.endswith(("_scale", "_scale_inv", "bias")):
                dtype = str(p.dtype).removeprefix("torch.")
                found.append((name, Site.shape_of(p), dtype, type(modules[owner]).__name__))
        return found

    def sites_of(self, model: Any) -> list[Site]:
        """The sites of ``model`` (or of its ``torch.compile`` wrapper): those whose weight is one of its parameters or
        buffers (``weight_id``), and the rows that know no weight tensor (a weight read by something other than a
        linear, a layer read inside a higher-order op, experts left as they were) of the graphs those are in.
        Models compiled through one backend share its report, and two of one class give rows alike - the same names,
        and the same graph where Dynamo runs the first one's graph for the second -, which the table and ``to_dict``
        cannot tell apart (a weight's token means nothing outside this process): this does, by the tensors; a graph
        both ran gives both its rows that know no tensor. A graph none of whose rows knows a weight of the model
        (Inductor's freezing made them constants: ``weight_id`` 0) gives none."""
        from fp8fx.lowerings import compat

        model = compat.compiled_module(model)
        tokens = {Site.known_token(t) for t in itertools.chain(model.parameters(), model.buffers())} - {None}
        graphs = {s.graph for s in self.sites if s.weight_id in tokens}
        return [s for s in self.sites if s.weight_id in tokens or not s.weight_id and s.graph in graphs]

    def reused(self, graph: int, weights: list[Any]) -> None:
        """Graph ``graph``, a frame of one module's forward (``frames``), ran with another module's ``weights`` (its
        inputs at ``frame_weights``' positions): that module's layers are sites of the graph too, rewritten as the
        first module's, named by their weights' tags (else by the first one's names under the new module); so are
        the graph's top-ks, where the tags named the new module. A graph of a whole model run for another model of
        its class (one backend compiling both) adds the other model's layers by their tags (both models' names)."""
        root = self.frames.get(graph)  # (None: a graph of a whole model, run for another model of its class)
        first = None
        # a layer by its name and weight (two models of one class have the same names), once however often the
        # graph calls it; a site of several weights (experts' w13 and w2) once
        known = {(s.fqn, s.weight_id) for s in self.sites if s.graph == graph}
        # rows of this graph whose weight is gone (freed: load_state_dict(assign=True) of new weights, a model
        # dropped): the layer's row is taken over by its new weight, not added again (a loop over checkpoints grew
        # the report by every layer at each, and bytes_saved counted the freed weights)
        live = Site.live_tokens()
        gone = {s.fqn: j for j, s in enumerate(self.sites) if s.graph == graph and s.weight_id and
                s.weight_id not in live}
        added: set[int] = set()
        for (i, _), weight in zip(self.frame_weights[graph], weights):
            site = self.sites[i]
            tag = getattr(weight, "_fp8fx_fqn", None)
            if root is None:  # the other model's layers by their tags
                fqn = tag or ""
            else:
                if first is None and tag and site.fqn.startswith(f"{root}.") and tag.endswith(site.fqn[len(root):]):
                    first = tag[:len(tag) - len(site.fqn) + len(root)]
                fqn = tag or (f"{first}{site.fqn[len(root):]}" if first is not None else "")
            # a weight of several layers (b.weight = a.weight, kept in high precision) is tagged with the last one's
            # name: this site's own, where it is one of them (the rows of all but that layer were lost)
            owners = getattr(weight, "_fp8fx_owners", {})
            if len(owners) > 1:
                tail = site.fqn[len(root):] if root is not None and site.fqn.startswith(root) else None
                mine = [site.fqn] if root is None else [o for o in owners if tail and o.endswith(tail)]
                if len(mine) == 1 and mine[0] in owners:
                    fqn = mine[0]
            token = Site.token_of(weight)
            if fqn and i not in added and (fqn, token) not in known:
                known.add((fqn, token))
                added.add(i)
                reason = site.reason
                suffix = site.fqn[len(root):] if root is not None and site.fqn.startswith(root) else None
                # a layer left in high precision: the reason its own weight carries (a router's names its block's
                # experts, which need not lie under the frame's module: JetMoE's router.layer and its output_linear)
                tagged = getattr(weight, "_fp8fx_owners", {}).get(fqn) or getattr(weight, "_fp8fx_skip_reason", None)
                if not site.rewritten and tagged and reason.startswith(NOT_QUANTIZED):
                    reason = f"{NOT_QUANTIZED}{tagged}"
                elif root and suffix is not None and fqn.endswith(suffix):  # the reason names the first module's
                    # layers ("routes tokens to model.layers.0.mlp.experts"): this module's, by its own names
                    reason = re.sub(rf"(?<![\w.]){re.escape(root)}(?![\w])", fqn[:len(fqn) - len(suffix)], reason)
                row = dataclasses.replace(site, fqn=fqn, reason=reason, weight_id=token)
                if fqn in gone:
                    self.sites[gone.pop(fqn)] = row
                else:
                    self.add(row)
        if first is not None:  # the frame's top-ks, under the new module's names (each of them: a module's several)
            names = {s.fqn for s in self.topk if s.graph == graph}
            for site in [s for s in self.topk if s.graph == graph and (s.fqn == root or s.fqn.startswith(f"{root}."))]:
                if first + site.fqn[len(root):] not in names:
                    self.add_topk(dataclasses.replace(site, fqn=first + site.fqn[len(root):]))

    def add_output_code(self, graph: int, code: str, gm: Any) -> None:
        """Record what Inductor generated for ``graph`` from its output code: the kernels, and the GEMM
        kernel of each site. ``gm`` is the graph Inductor compiled (the output code names its nodes)."""
        origin = {n.name: Site.origin_of(n) for n in gm.graph.nodes}
        self.kernels[graph] = generated_kernels(code)
        # several nodes of one origin: a GEMM's slices (fp8fx.passes.horizontal) share their linear's, and may
        # feed another GEMM (q @ k.T: bmm). fp8fx's ops and templates first, then other extern kernels, then
        # generated ones; of equals, the first in the code
        chosen: dict[str, str] = {}
        for name, kernel in sorted(gemm_kernels(code).items(), key=lambda item: _kernel_rank(item[1])):
            chosen.setdefault(origin.get(name, name), kernel)
        comments = [m.group(1).strip() for m in _SOURCE_NODES.finditer(code)]
        if comments and not any(comments):  # the code names no node: torch.compile(mode="lite") retraces the graph
            # (selective decomposition) into nodes that keep no origin. An fp8fx op called as an extern kernel as
            # often as the graph holds it is each node's kernel; the other sites' is not known
            calls = collections.Counter(_line_callee(line) for line in code.splitlines())
            ops = collections.Counter(str(n.target).rpartition(".")[0] for n in gm.graph.nodes
                                      if n.op == "call_function" and str(n.target).startswith("fp8fx."))
            for n in gm.graph.nodes:
                op = str(n.target).rpartition(".")[0] if n.op == "call_function" else ""
                name = op.partition(".")[2]
                if (op.startswith("fp8fx.") and (any(p in name for p in ("mm", "mlp")) or f"torch.ops.{op}" in _MOE_OPS)
                        and calls[f"torch.ops.{op}"] == ops[op]):
                    chosen.setdefault(Site.origin_of(n), f"extern {op}")
            self.unnamed[graph] = (
                f"graph {graph}: Inductor's code names none of the graph's nodes (torch.compile(mode='lite') retraces "
                "the graph into nodes that keep no origin, and runs each op as its own kernel): a site rewritten to "
                "an fp8fx op has that op's extern kernel, read from the graph; the kernel of the others is not known "
                "('-'), not none")
        # (experts left as they were run as many kernels, none of them the site's: their node's name could be the
        # router's, whose fp8fx.small_mm the row showed)
        self.sites = [
            dataclasses.replace(s, kernel=chosen[s.node])
            if s.graph == graph and s.node in chosen and (s.rewritten or s.kind != "moe") else s
            for s in self.sites
        ]

    def graph_summary(self, graph: int) -> str:
        sites = [s for s in self.sites if s.graph == graph]
        done = [s for s in sites if s.rewritten]
        line = f"{self.label}graph {graph}: {len(done)} of {len(sites)} sites rewritten"
        line += f", {human_size(_bytes_saved(done))} of weights saved"
        if graph in self.kernels:
            line += f", {_count(len(self.kernels[graph]), 'kernel')} generated"
        missed = [f"{s.fqn or ROOT} ({s.reason})" for s in sites if not s.rewritten]
        if missed:
            more = f" and {len(missed) - 3} more" if len(missed) > 3 else ""
            line += "; not rewritten: " + ", ".join(missed[:3]) + more
        if graph in self.failed:
            line += f"; failed to compile: {self.failed[graph]}"
        return line

    def log_graph(self, graph: int) -> None:
        log.info("fp8fx: %s", self.graph_summary(graph))

    def to_dict(self, graph: Optional[int] = None) -> dict[str, Any]:
        """The report (or only graph ``graph``) as plain data; ``SCHEMA`` names the layout."""
        sites = self._sites(graph)
        graphs = range(self.graphs) if graph is None else [graph]
        kernels = {g: self.kernels.get(g, []) for g in graphs}
        return {
            "schema": SCHEMA,
            "totals": {
                "graphs": len(graphs),
                "sites": len(sites),
                "rewritten": sum(s.rewritten for s in sites),
                "not_rewritten": sum(not s.rewritten for s in sites),
                "bytes_saved": _bytes_saved(sites),
                "kernels": sum(len(k) for k in kernels.values()),
                "recompile_limit_hits": self.recompile_limit_hits,
            },
            "graphs": [{"index": g, "kernels": k, **({"failed": self.failed[g]} if g in self.failed else {}),
                        **({"frame": self.frames[g]} if g in self.frames else {}),
                        **({"kernels_unnamed": self.unnamed[g]} if g in self.unnamed else {}),
                        **({"recompile_limit": self.limits[g]} if g in self.limits else {})}
                       for g, k in kernels.items()],
            "sites": [_plain({k: v for k, v in dataclasses.asdict(s).items() if k != "weight_id"}) for s in sites],
            "topk": [_plain({k: v for k, v in dataclasses.asdict(s).items() if k in _TOPK_KEYS})
                     for s in self.topk if graph in (None, s.graph)],
        }

    def to_json(self, graph: Optional[int] = None, indent: int = 1) -> str:
        return json.dumps(self.to_dict(graph), indent=indent)

    def table(self, graph: Optional[int] = None) -> str:
        """The sites (of every graph, or of ``graph``) as a text table with a totals line."""
        sites = self._sites(graph)
        rows = [("graph", "kind", "site", "weight", "rewritten", "kernel", "scheme / reason")]
        for s in sites:
            shape = "x".join(map(str, s.weight_shape)) or "-"
            rows.append((str(s.graph), s.kind, s.fqn or ROOT, shape, "yes" if s.rewritten else "no", s.kernel or "-",
                         s.scheme if s.rewritten else s.reason))
        lines = _columns(rows)
        lines.insert(1, "-" * len(lines[0]))
        where = f"in {self.graphs} graph(s)" if graph is None else f"in graph {graph}"
        total = f"{sum(s.rewritten for s in sites)} of {len(sites)} sites rewritten {where}"
        total += f"; {human_size(_bytes_saved(sites))} of weights saved"
        kernels = [k for g, names in self.kernels.items() if graph in (None, g) for k in names]
        if kernels:
            total += f"; {_count(len(kernels), 'kernel')} generated"
        lines.append(total)
        if not self.graphs:  # (a compiled model's generate() calls the model's own forward, not the compiled one)
            lines.append("no graph compiled yet: call the compiled model (for HF generate(), compile its forward: "
                         "model.forward = torch.compile(model.forward, backend=...)); a call made already ran "
                         "uncompiled, with no fp8 GEMM, where Dynamo had reached torch._dynamo.config.recompile_limit "
                         "for the frame (every backend's graphs of a frame count: a new backend for each model of one "
                         "class; TORCH_LOGS=recompiles says), or inside torch.vmap (vmap of a compiled model runs it "
                         "uncompiled: compile the vmapped function, torch.compile(torch.vmap(model)))")
        lines += self._topk_lines(graph)
        lines += [f"graph {g} failed to compile, nothing in it rewritten: {why}" for g, why in self.failed.items()
                  if graph in (None, g)]
        lines += [why for g, why in self.limits.items() if graph in (None, g)]
        lines += [why for g, why in self.unnamed.items() if graph in (None, g)]
        for limit, hits in self._limit_hits().items() if graph is None else ():
            lines.append(
                f"Dynamo hit torch._dynamo.config.{limit} for {_count(hits, 'frame')} in this process since this "
                f"report's first graph: such a frame runs uncompiled from then on (Dynamo's warning 'hit "
                f"config.{limit}' names its function), and so do the frames it calls where no graph compiled already "
                "fits the input - for this model's, in high precision on the dequantized weights with no fp8 GEMM, "
                "whatever the rows above say. A frame that gave no graph (a graph break before its first op; a "
                "decorator's wrapper many methods share) reaches the limit with no line of its own: "
                "TORCH_LOGS=recompiles names the guards that failed")
        lines += [f"graph {g} traced {root}'s forward, whose code Dynamo runs for any other module of its class it "
                  "meets (a block after a graph break): their sites are listed as they run" for g, root in
                  self.frames.items() if graph in (None, g)]
        return "\n".join(lines)

    def _topk_lines(self, graph: Optional[int]) -> list[str]:
        """The top-k table's lines (none where the pass saw no top-k)."""
        sites = [s for s in self.topk if graph in (None, s.graph)]
        if not sites:
            return []
        rows = [("graph", "top-k in", "input", "rewritten", "kernel", "k of row / reason")]
        rows += [(str(s.graph), s.fqn or "-", "x".join(map(str, s.weight_shape)) or "-", "yes" if s.rewritten else
                  "no", s.kernel or "-", s.scheme if s.rewritten else s.reason) for s in sites]
        lines = _columns(rows)
        return ["", *lines[:1], "-" * len(lines[0]), *lines[1:],
                f"{sum(s.rewritten for s in sites)} of {len(sites)} top-k rewritten to fp8fx's top-k ops"]

    def _sites(self, graph: Optional[int]) -> list[Site]:
        if graph is None:
            return self.sites
        known = set(range(self.graphs)) | {s.graph for s in self.sites} | set(self.failed)
        if graph not in known:  # (an empty report of a graph that does not exist read as "nothing rewritten")
            raise ValueError(f"Report: no graph {graph!r}; it holds graphs {sorted(known)}")
        return [s for s in self.sites if s.graph == graph]

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


# the reasons (as quantize_, load_checkpoint and the MoE rules word them) of layers kept in high precision by choice
_BY_DESIGN = re.compile(r"in ignored_layers$|an MoE router or gate|^not quantized: weight tied to |"
                        r"^not quantized: output embeddings stored in high precision|"
                        r"^not quantized: nn.MultiheadAttention's out_proj|: the float64 reference, computed with")


def _by_design(reason: str) -> bool:
    """A layer kept in high precision by choice, logged at INFO: one the user ignored, an MoE router or gate (vLLM
    keeps them too), a weight tied to another (an lm_head tied to its embedding), output embeddings a checkpoint
    stores in high precision, a model cast to float64 as the reference. Anything else deserves a look. (tests/e2e
    and test_report.py hold the wordings.)"""
    return _BY_DESIGN.search(reason) is not None


def first_line(e: BaseException, limit: Optional[int] = None) -> str:
    """An error's message on one line, for a report row or a one-line CLI error: its first non-empty line ("" where
    it has none), cut to ``limit`` characters (a multi-line message broke the report's table)."""
    line = next((text.strip() for text in str(e).splitlines() if text.strip()), "")
    return line if limit is None or len(line) <= limit else line[:limit - 1] + "…"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _bytes_saved(sites: Iterable[Site]) -> int:
    """Each weight's saving once, but a weight's ``dequantize_`` replaced. A freed weight's (a model dropped: the
    report still tells what its graphs saved) once per layer, by name and shape, and not where a live fp8 weight took
    the layer over (a model of its class run in its place: the figure counted both models). A site whose weight the
    graph does not take as an input (no token) counts by its name."""
    sites = [s for s in sites if s.rewritten and s.weight_id not in _DEQUANTIZED]
    live = Site.live_tokens()
    held = {(s.fqn, s.weight_shape) for s in sites if s.weight_id in live}
    saved: dict[Any, int] = {}
    for s in sites:
        if not s.weight_id or s.weight_id in live:
            saved[s.weight_id or s.fqn] = s.bytes_saved
        elif (s.fqn, s.weight_shape) not in held:  # (freed: once a layer)
            saved[(s.fqn, s.weight_shape)] = s.bytes_saved
    return sum(saved.values())


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, the last one unpadded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A site's fields as JSON gives them back (``weight_shape`` a list): ``json.loads(report.to_json())`` equals
    ``report.to_dict()``."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in row.items()}


def human_size(n: int) -> str:
    """``n`` bytes as the report writes them: 1.5 MiB, 32.0 KiB, 12 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- reading Inductor's output code -----------------------------------------------------------------
# The Python wrapper Inductor writes defines each kernel it generated as
#     triton_poi_fused_relu_0 = async_compile.triton('triton_poi_fused_relu_0', '''...''')
# and precedes the calls it makes for a group of graph nodes with
#     # Topologically Sorted Source Nodes: [scaled_mm_default, relu], Original ATen: [...]
# then calls an extern kernel (extern_kernels.addmm(...), torch.ops.fp8fx.scaled_mm.default(...), or
# fp8fx_direct.scaled_mm(...): fp8fx's op called without the dispatcher, ``Fp8Backend(direct_calls=True)``) or a
# generated one (triton_tem_fused_mm_0.run(...), cpp_fused_relu_0(...)). Checked on torch 2.13 (CPU)
# and 2.11 (CUDA); Triton GEMM templates (max_autotune) only from Inductor's source, not in a real run.
# The C++ wrapper (``cpp_wrapper=True``) is a Python string of C++ source: a C++ kernel is defined as
#     extern "C"  void  cpp_fused_relu_0(at::BFloat16* in_out_ptr0)
#     {
# (after a declaration of it ending in ";"), the comments start with "//", an fp8fx op is called through the
# dispatcher (``findSchemaOrThrow("fp8fx::scaled_mm", "")``; torch 2.11: through Python, the op named as
# ``PyUnicode_FromString("torch.ops.fp8fx.scaled_mm.default")``), an ATen one as ``aoti_torch_cpu_addmm_out(...)``
# inside ``AOTI_TORCH_ERROR_CODE_CHECK(...)``.
# Checked on torch 2.13 and 2.11 (CPU).
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_CPP_KERNEL_DEF = re.compile(r'^extern "C"\s+void\s+(\w+)\([^;{]*\)\s*\{', re.M)
_CPP_WRAPPER = "CppWrapperCodeCache"  # what loads a C++ wrapper's source
_SOURCE_NODES = re.compile(r"(?:#|//).*Source Nodes: \[([^\]]*)\]")
_CALL = re.compile(r"^\s*(?:\w+ = )?([\w.]+)\(")
# a custom op called from C++: through the dispatcher (2.13), through Python (2.11)
_CPP_OP_CALL = re.compile(r'(?:findSchemaOrThrow\("|PyUnicode_FromString\("torch\.ops\.)(\w+)(?:::|\.)(\w+)')
_CPP_ATEN_CALL = re.compile(r"\baoti_torch_(?:cpu|cuda)_(\w+?)(?:_out)?\(")  # an ATen op called from C++
_MOE_OPS = ("torch.ops.fp8fx.fused_moe",)  # fp8fx's MoE op: an extern kernel on every device
_TEMPLATE_PARAMS = re.compile(r"\b(BLOCK_[MNK]|num_stages|num_warps)\s*(?::\s*tl\.constexpr\s*)?=\s*(\d+)")


def generated_kernels(code: str) -> list[str]:
    """Names of the kernels Inductor generated (Triton, C++), in definition order (a C++ wrapper's after the
    Python wrapper's)."""
    # (the Python wrapper's C++ kernels are strings whose function is named "kernel": only the C++ wrapper's count)
    cpp = _CPP_KERNEL_DEF.findall(code) if _CPP_WRAPPER in code else []
    return list(dict.fromkeys(_KERNEL_DEF.findall(code) + cpp))


def _line_callee(line: str) -> str:
    """The kernel a line of Inductor's code calls (``_callee``'s name: ``torch.ops.fp8fx.scaled_mm``,
    ``extern_kernels.addmm``, ``triton_x``), or ""."""
    call, op_call, aten_call = _CALL.match(line), _CPP_OP_CALL.search(line), _CPP_ATEN_CALL.search(line)
    return ("torch.ops.{}.{}".format(*op_call.groups()) if op_call else
            "extern_kernels." + aten_call.group(1) if aten_call else _callee(call.group(1)) if call else "")


def gemm_kernels(code: str) -> dict[str, str]:
    """{graph node name: the GEMM called for it}: the first extern kernel or Triton template whose name
    has "mm" (or "mlp": ``fp8fx.gated_mlp``; an extern kernel's "linear": oneDNN's), or fp8fx's MoE op
    (``fp8fx.fused_moe``, an extern kernel), else the first other generated kernel with "mm" in its name (a fused
    kernel named after the ops it covers, e.g. an activation quantization fused with the prologue of a GEMM)."""
    generated = set(generated_kernels(code))
    candidates: dict[str, list[tuple[bool, str]]] = {}
    nodes: list[str] = []
    for line in code.splitlines():
        source = _SOURCE_NODES.search(line)
        if source:
            nodes = [n.strip() for n in source.group(1).split(",") if n.strip()]
            continue
        callee = _line_callee(line)
        extern = callee.startswith(("extern_kernels.", "torch.ops."))
        name = callee.rpartition(".")[2]
        # (with freezing on the CPU a high-precision linear is oneDNN's ``mkldnn._linear_pointwise``)
        gemm = (any(part in name for part in ("mm", "mlp")) and (extern or callee in generated)
                or extern and "linear" in name)
        if gemm or callee in _MOE_OPS:  # not a generated kernel named after an input's cast fused with it
            for n in nodes:
                candidates.setdefault(n, []).append((extern or callee.startswith("triton_tem_"), callee))
    return {
        n: _describe(next((c for gemm, c in calls if gemm), calls[0][1]), code, generated)
        for n, calls in candidates.items()
    }


def _kernel_rank(kernel: str) -> int:
    """0: an fp8fx op or a GEMM template, 1: another extern kernel, 2: a generated kernel (``_describe``'s)."""
    return 0 if kernel.startswith(("extern fp8fx.", "template ")) else 1 if kernel.startswith("extern ") else 2


def _callee(text: str) -> str:
    """``triton_x.run`` -> ``triton_x``; ``torch.ops.ns.op.overload`` -> ``torch.ops.ns.op``; an fp8fx op called
    without the dispatcher, ``fp8fx_direct.op``, -> ``torch.ops.fp8fx.op``, the same op."""
    text = text.removesuffix(".run")
    if text.startswith("fp8fx_direct."):
        return "torch.ops.fp8fx." + text.removeprefix("fp8fx_direct.")
    return ".".join(text.split(".")[:4]) if text.startswith("torch.ops.") else text


def _describe(callee: str, code: str, generated: set[str]) -> str:
    if callee not in generated:
        return "extern " + callee.removeprefix("extern_kernels.").removeprefix("torch.ops.")
    if callee.startswith("triton_tem_"):
        return " ".join(["template", callee] + [f"{k}={v}" for k, v in _template_params(callee, code)])
    return "generated " + callee


def _template_params(name: str, code: str) -> Iterable[tuple[str, str]]:
    start = code.find(f"{name} = async_compile.")
    end = code.find("'''", code.find("'''", start) + 3)
    return dict(_TEMPLATE_PARAMS.findall(code[start:end])).items()
