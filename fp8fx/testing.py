"""Assertions for tests of models compiled with fp8fx::

    backend = fp8fx.testing.assert_compiles_once(model, [(x_small,), (x_large,)])
    fp8fx.testing.assert_rewritten(backend, "model.layers.*", model=model)  # model: its fp8 layers ran compiled
    fp8fx.testing.assert_not_rewritten(backend, "lm_head")
    fp8fx.testing.assert_kernel_count(backend, 5)

Each takes an ``Fp8Backend`` or its ``Report``; each failure says what was expected, what was seen and
why. Patterns are ``fnmatch`` globs on site FQNs (``*`` also matches dots; ``"(root module)"``, as the table names
it, or ``""`` is a linear compiled on its own).
"""
from __future__ import annotations

import collections
import fnmatch
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from fp8fx.backend import Fp8Backend
from fp8fx.lowerings import compat
from fp8fx.report import ROOT, Report, Site, first_line


def assert_rewritten(report: Union[Report, Fp8Backend], *patterns: str, model: Optional[nn.Module] = None) -> None:
    """Every site whose FQN matches one of ``patterns`` (default: every site) was rewritten, and each
    pattern matches at least one site. A site is a linear a compiled graph computed: a quantized layer that ran in
    no graph (under ``torch.compiler.disable``, or in a frame Dynamo skipped) has none; pass the ``model`` to fail on
    those too (its fp8 weights that ``report.unhandled_weights(model)`` lists, whose layer matches a pattern)."""
    names_of = tuple("" if p == ROOT else p for p in patterns)  # (the table's name of a root linear)
    ran_not = []
    if model is not None:
        # a layer by its name in ``model`` and by the one quantize_ gave it, which its sites bear (the whole model's,
        # where ``model`` is a block of it: "layers.0.o" for the block's "o", which no pattern of the sites matched)
        params = dict(compat.compiled_module(model).named_parameters())
        if not any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in params.values()):
            # (nothing would tie the report to it: the sites checked were those of whatever the backend compiled)
            raise AssertionError(
                f"fp8fx: assert_rewritten(model=...) was given a {type(model).__name__} that holds no fp8 weight: "
                "quantize_ it (or load_checkpoint an fp8 checkpoint into it) before compiling, or leave model= out")
        for name, _, dtype, cls in _report(report).unhandled_weights(model):
            names = {name.rpartition(".")[0], getattr(params.get(name), "_fp8fx_fqn", None)} - {None}
            if dtype.startswith("float8") and any(fnmatch.fnmatchcase(n, p) for n in names for p in names_of or "*"):
                ran_not.append((name, cls))
    if ran_not:  # (first: such a layer has no site, and a pattern of it alone "matches no site")
        raise AssertionError(
            f"fp8fx: expected the sites matching {list(patterns or ('*',))} rewritten; these fp8 weights ran in no "
            f"compiled graph (torch.compiler.disable, a frame Dynamo skipped, or a layer never called): "
            f"{', '.join(f'{n} ({c})' for n, c in ran_not)}")
    _check(report, patterns or ("*",), want=True)


def assert_not_rewritten(report: Union[Report, Fp8Backend], *patterns: str) -> None:
    """Every site whose FQN matches one of ``patterns`` was left as it was, and each pattern matches
    at least one site."""
    if not patterns:
        raise ValueError("assert_not_rewritten needs at least one FQN pattern, e.g. 'lm_head'")
    _check(report, patterns, want=False)


def assert_kernel_count(report: Union[Report, Fp8Backend], expected: int, graph: Optional[int] = None) -> None:
    """Inductor generated ``expected`` kernels (Triton / C++) for graph ``graph`` (default: all graphs)."""
    report = _report(report)
    for name, value in (("expected", expected), ("graph", graph)):
        if value is not None and (type(value) is not int or value < 0):  # "2" never equals a count
            raise TypeError(f"assert_kernel_count({name}={value!r}): a count / graph index, an int >= 0")
    if not report.kernels:  # nothing to count: the check would pass for expected=0 whatever ran
        raise AssertionError("fp8fx: no graph was compiled by Inductor (kernels are only counted for "
                             "compiler='inductor'); compile and run the model first")
    if graph is not None and graph not in report.kernels:
        raise AssertionError(f"fp8fx: no graph {graph}: Inductor compiled graphs {sorted(report.kernels)}")
    names = [k for g, ks in sorted(report.kernels.items()) if graph in (None, g) for k in ks]
    if len(names) != expected:
        where = "all graphs" if graph is None else f"graph {graph}"
        raise AssertionError(
            f"fp8fx: expected {expected} generated kernels in {where}, Inductor generated {len(names)}: {names} "
            "(kernels are only counted for compiler='inductor'; see the output code in Fp8Backend(dump_dir=...))"
        )


def assert_compiles_once(
    fn: Callable,
    inputs: Iterable[Sequence[Any]],
    *,
    backend: Optional[Callable] = None,
    dynamic: Optional[bool] = True,
) -> Any:
    """Compiles ``fn`` (a model or a function) with ``backend`` (a new ``Fp8Backend()`` by default) and
    calls it under ``torch.no_grad()`` with each argument tuple of ``inputs``; fails if Dynamo broke the
    graph or compiled again for a later input. ``dynamic`` goes to ``torch.compile`` (with ``False`` or
    ``None`` a new shape recompiles). Returns the backend, to read its report (an ``Fp8Backend``'s: the function
    ``fp8fx.fp8_backend`` keeps none). Resets Dynamo's caches first
    (``torch._dynamo.reset()``): every call compiles ``fn`` anew, and the recompiles of earlier calls would
    otherwise reach Dynamo's recompile limit (8), after which it runs ``fn`` uncompiled."""
    inputs = list(inputs)  # (a generator: the checks below used it up, and no call ran)
    if not inputs:
        raise ValueError("assert_compiles_once needs at least one argument tuple in inputs")
    bare = next((i for i, args in enumerate(inputs) if not isinstance(args, (tuple, list))), None)
    if bare is not None:  # a bare tensor would be unpacked row by row into arguments
        raise ValueError(f"assert_compiles_once: inputs[{bare}] is a {type(inputs[bare]).__name__}, not an argument "
                         "tuple; pass [(x1,), (x2,)] for one argument per call")
    if backend is not None and not callable(backend):  # ("inductor": failed inside Dynamo, after the reset below)
        raise ValueError(f"assert_compiles_once(backend={backend!r}): a backend callable, e.g. fp8fx.Fp8Backend(...) "
                         "or fp8fx.fp8_backend (None: Fp8Backend())")
    # (checked before the reset too: torch's "Expected enable to be a bool" came after every cache was dropped)
    if dynamic is not None and type(dynamic) is not bool:
        raise ValueError(f"assert_compiles_once(dynamic={dynamic!r}): True, False or None (torch.compile's)")
    if not callable(fn):
        raise ValueError(f"assert_compiles_once: fn is a {type(fn).__name__}, not a function or module to compile")
    torch._dynamo.reset()
    backend = backend if backend is not None else Fp8Backend()
    graphs: list[int] = []  # graphs compiled during each call
    failed: list[list[str]] = []  # the graphs of each call that failed to compile (Dynamo's suppress_errors: eager)

    def counting(gm, example_inputs):
        graphs[-1] += 1
        try:
            return backend(gm, example_inputs)
        except BaseException as e:
            graphs[-1] -= 1  # (a retrace: Dynamo drops this graph and traces the frame again; else a failure)
            if not compat.is_dynamo_retrace(e):  # (said as graph breaks of no recorded reason, h131)
                failed[-1].append(f"{type(e).__name__}: {first_line(e, 200)}")
            raise

    if hasattr(backend, "reset"):  # torch._dynamo.reset() calls it (Fp8Backend: its dump folder is free then)
        counting.reset = backend.reset

    compiled = torch.compile(fn, backend=counting, dynamic=dynamic)
    problems = []
    with torch.no_grad():
        for i, args in enumerate(inputs):
            before = compat.dynamo_events()
            graphs.append(0)
            failed.append([])
            compiled(*args)
            breaks, new_guards, new_skips = (_new(b, a) for b, a in zip(before, compat.dynamo_events()))
            frames = new_skips.count("frame")
            unsupported = list(dict.fromkeys(r for r in new_skips if r != "frame"))
            if frames:  # (a graph break in a loop: Dynamo runs the whole frame eagerly, and counts no break)
                how = ("a frame at Dynamo's recompile limit runs uncompiled" if any(
                    r.startswith(compat.RECOMPILE_LIMIT_REASON) for r in unsupported)
                    else "after the graph that failed to compile" if failed[i]
                    else "a graph break inside a loop skips the whole frame")
                problems.append(f"input {i}: Dynamo skipped {frames} frame(s) and ran them uncompiled ({how}); its "
                                f"reasons: {unsupported or ['none recorded']}")
            else:  # Dynamo records a break on a tensor's value (``if t.any():``) as unsupported alone, no graph break
                # (torch 2.11, 2.13): with nothing after it to compile, one graph and no break counted
                breaks += [r for r in unsupported if r not in breaks]
            if i == 0 and (breaks or graphs[0] > 1):
                why = breaks or ["a break Dynamo recorded no reason for (TORCH_LOGS=graph_breaks shows it)"]
                problems.insert(0, f"{graphs[0]} graphs for input 0, graph breaks: {why}")
            elif i and breaks:
                problems.append(f"input {i} ({_shapes(args)}): graph breaks: {breaks}")
            if failed[i]:  # (only where Dynamo's suppress_errors ran the graph eagerly: else the call raised); the
                # cause of what else this call shows (graphs of the fp8 weights' properties, skipped frames): first
                why = " (torch._dynamo.config.suppress_errors)" if torch._dynamo.config.suppress_errors else ""
                problems.insert(0 if i == 0 else len(problems), f"input {i}: {len(failed[i])} graph(s) failed to "
                                f"compile and ran uncompiled{why}: {failed[i][:3]}")
            if i and (graphs[i] or new_guards):  # (a recompile whose new trace holds no graph is one all the same)
                what = f"compiled {graphs[i]} more graph(s)" if graphs[i] else "recompiled the frame (no new graph)"
                problems.append(f"input {i} ({_shapes(args)}) {what}; Dynamo's reasons: {new_guards or 'none recorded'}"
                                f"{_one_sized(inputs[0], args) if dynamic is True else ''}")
    if graphs[0] == 0 and not failed[0]:
        problems.insert(0, "Dynamo compiled no graph for the first input (it skipped the frame)")
    if problems:
        raise AssertionError("fp8fx: expected one graph for every input; " + "; ".join(problems))
    return backend


def _report(obj: Union[Report, Fp8Backend]) -> Report:
    report = getattr(obj, "report", obj)
    if not isinstance(report, Report):
        hint = ("; fp8fx.fp8_backend keeps no report: compile with backend=fp8fx.Fp8Backend() and pass that"
                if callable(obj) and getattr(obj, "__name__", "") == "fp8_backend" else "")
        raise TypeError(f"expected an fp8fx Report or Fp8Backend, got {type(obj).__name__}{hint}")
    return report


def _check(report: Union[Report, Fp8Backend], patterns: Sequence[str], want: bool) -> None:
    report = _report(report)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:  # a list passed as one pattern: pass them as separate arguments
        raise TypeError(f"FQN patterns are strings, one argument each (assert_rewritten(backend, 'a.*', 'b')); got "
                        f"{bad[0]!r}")
    problems = []
    for pattern in patterns:
        # ("(root module)": the report's name of a linear that is the compiled module itself, whose FQN is "")
        matched = [s for s in report.sites if fnmatch.fnmatchcase(s.fqn, "" if pattern == ROOT else pattern)]
        if not matched:
            problems.append(f"no site matches {pattern!r}")
        problems += [_describe(s) for s in matched if s.rewritten != want]
    if problems:
        expected = "rewritten" if want else "not rewritten"
        raise AssertionError(
            f"fp8fx: expected the sites matching {list(patterns)} {expected}; " + "; ".join(problems)
            + f"\nsites seen:\n{report}"
        )


def _describe(site: Site) -> str:
    name = site.fqn or ROOT  # (the compiled module itself: named as the table names it)
    if site.rewritten:
        return f"{name} (graph {site.graph}) was rewritten ({site.scheme})"
    return f"{name} (graph {site.graph}) was not rewritten: {site.reason}"


def _new(before: list[str], after: list[str]) -> list[str]:
    return list((collections.Counter(after) - collections.Counter(before)).elements())


def _one_sized(first: Sequence[Any], args: Sequence[Any]) -> str:
    """A hint where the first input had a dimension of size 0 or 1 that a later one changes: Dynamo compiles such
    sizes as constants even with ``dynamic=True`` (a batch of 1 first, then 2: a recompile)."""
    for a, b in zip(first, args):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() and any(
                m in (0, 1) and m != n for m, n in zip(a.shape, b.shape)):
            return (" (input 0's sizes of 0 or 1 are constants to Dynamo, even with dynamic=True: give the first "
                    "input sizes of 2 or more where later ones differ)")
    return ""


def _shapes(args: Sequence[Any]) -> str:
    return ", ".join(str(list(a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args)
