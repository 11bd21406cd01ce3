"""The one place that touches Inductor internals, for every torch version fp8fx supports
(torch 2.11 on the GPU machine, 2.13+ on CPU machines). Everything else imports from here."""
from __future__ import annotations

import contextlib
import re
import threading
import types
import typing
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass  # 2.11 and 2.13
from torch._subclasses.fake_tensor import FakeTensor  # 2.11 and 2.13

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def is_inductor_config(key: str) -> bool:
    """``key`` names an option of ``torch._inductor.config`` (dotted for nested ones: ``"triton.cudagraphs"``)."""
    from torch._inductor import config

    return key in config._config


def freezing_enabled() -> bool:
    """``torch._inductor.config.freezing`` as set in the process (Dynamo reads it when it traces a frame, to pass the
    parameters as attributes of the graph)."""
    from torch._inductor import config

    return bool(config.freezing)


def fx_symbolic_tracing() -> bool:
    """Whether ``torch.fx.symbolic_trace`` is tracing (not torch.compile or torch.export, which
    ``torch.compiler.is_compiling`` tells). A private FX function on 2.11 and 2.13 (``is_fx_tracing`` means both, and
    warns that it does)."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def proxy_tracing() -> bool:
    """Whether ``make_fx``'s proxy mode records the ops that run (it sets the flag ``fx_symbolic_tracing`` reads,
    and its graph records each op on real tensors, where a symbolic trace holds their results as constants); its
    pre-dispatch mode too, which sits on a stack of its own. An FX-internal function on 2.11 and 2.13."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def compiled_module(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, whose state names are the model's own
    (the wrapper's all start with ``_orig_mod.``); ``model`` itself when it is no wrapper."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def inductor_mode_options(mode: str) -> Optional[dict[str, Any]]:
    """The ``torch._inductor.config`` options ``torch.compile(mode=mode)`` sets (``{"triton.cudagraphs": True}`` for
    "reduce-overhead"), or None for a mode Inductor does not have."""
    from torch import _inductor

    try:
        return dict(_inductor.list_mode_options(mode))
    except RuntimeError:  # "Unrecognized mode=..." (torch 2.11 and 2.13)
        return None


def inductor_modes() -> list[str]:
    """The modes ``torch.compile(mode=)`` takes."""
    from torch import _inductor

    return list(_inductor.list_mode_options())


def inductor_config_value(key: str) -> Any:
    """The current value of option ``key`` of ``torch._inductor.config`` (dotted for nested ones)."""
    from torch._inductor import config

    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


_FITS = ((bool, lambda v: type(v) is bool), (int, lambda v: type(v) is int),
         (float, lambda v: type(v) in (int, float)), (str, lambda v: isinstance(v, str)))


def inductor_config_type_error(key: str, value: Any) -> Optional[str]:
    """Why ``value`` does not fit option ``key`` of ``torch._inductor.config``, or None where it fits: a bool takes a
    bool, an int an int, a float a number, a str a str; a custom pass slot a callable or None. The type is the
    option's declared one where the config module keeps it (``Optional[int]`` for ``cpp.simdlen``, None by default:
    a str was taken there, judged by the value it had then), else that of its current value; an option of another
    type (a list, a dict) is not checked."""
    current = inductor_config_value(key)
    if "custom" in key and key.endswith("pass"):
        return None if value is None or callable(value) else (
            "a callable graph pass (or a torch._inductor.custom_graph_pass.CustomGraphPass), or None")
    from torch._inductor import config

    declared = getattr(getattr(config, "_config", {}).get(key), "value_type", None)  # (torch 2.11 and 2.13 alike)
    if declared is None:
        kinds: tuple = (type(current),)
    elif typing.get_origin(declared) in (typing.Union, types.UnionType):  # Optional[int] (2.11), int | None (2.13)
        kinds = typing.get_args(declared)
    else:
        kinds = (declared,)  # (list[str]: no kind of _FITS, not checked)
    optional = type(None) in kinds
    known = [(kind, fits) for kind, fits in _FITS if kind in kinds]
    if not known or len(known) < len([k for k in kinds if k is not type(None)]) or value is None and optional:
        return None  # (a list, a dict, a union of other types: not checked)
    if any(fits(value) for _, fits in known):
        return None
    wanted = " or ".join(f"{'an' if kind is int else 'a'} {kind.__name__}" for kind, _ in known)
    return f"{wanted}{' (or None)' if optional else ''}, as the option is declared (now {current!r})"


def custom_pass_key(value: Any) -> Any:
    """What stands for an ``inductor_config`` value in a cache key: a ``CustomGraphPass``'s ``uuid()`` (its repr
    holds its address, new in every process), else the value."""
    return {"CustomGraphPass.uuid": value.uuid()} if isinstance(value, CustomGraphPass) else value


def compile_fx(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config_patches: Optional[dict] = None,
    extra_decompositions: Optional[Callable[[], dict]] = None,
):
    """Inductor's compile entry point (``torch._inductor.compile_fx.compile_fx``); the table that
    ``extra_decompositions()`` returns is added to Inductor's own (passing a table replaces Inductor's).
    ``extra_decompositions`` is a module-level function: the merged table pickles as a call to it (see
    ``_DecompTable``)."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    decomps = _DecompTable(extra_decompositions) if extra_decompositions is not None else None
    return _compile_fx(gm, example_inputs, config_patches=config_patches or {}, decompositions=decomps)


class _DecompTable(dict):
    """Inductor's decomposition table with ``extra()``'s entries added, that pickles as the name of ``extra``.
    torch 2.13 puts the table a compile is given into the FX graph cache's key, by pickling it, and its ATen
    entries (C++ functions) do not pickle: every compile bypassed the cache. What the table holds is keyed
    already: Inductor's own by the torch version, fp8fx's by the pass manager's uuid (the sources of
    fp8fx.lowerings). torch 2.11 keeps the table out of the key."""

    def __init__(self, extra: Callable[[], dict]):
        from torch._inductor.decomposition import select_decomp_table

        super().__init__({**select_decomp_table(), **extra()})
        self.extra = extra

    def __reduce__(self):
        return _DecompTable, (self.extra,)


def below_autograd(compiled: Callable) -> Callable:
    """``compiled`` run with the autograd dispatch keys excluded, as ``torch.inference_mode()`` excludes them but
    without making inference tensors: for a graph compiled with grad disabled that does not enable it inside
    (``fp8fx.passes.base.may_record_grad``), which records nothing for autograd, and which Dynamo's guard on grad
    mode keeps to calls made with grad disabled. What it saves: an op without an autograd formula (fp8fx's, defined
    by ``torch.library.custom_op``) still passes through custom_op's autograd kernel under ``no_grad`` (a Python
    frame and a redispatch): 62-95 us a call of the fused MLP op on the H200's host (torch 2.11; 0.43 ms a call
    in no_grad, 0.37 in inference_mode). ``compiled``'s attributes (``_boxed_call`` and the like, which its
    callers read) carry over."""
    def run(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return compiled(*args)

    run.__dict__.update(getattr(compiled, "__dict__", {}))
    return run


_DIRECT = threading.local()  # .names: the fp8fx ops this thread's Inductor codegen calls directly, while set


@contextlib.contextmanager
def direct_op_calls(names: Sequence[str], namespace: str = "fp8fx.ops.direct") -> Iterator[None]:
    """While it is open, Inductor's Python wrapper code calls the fallback kernels of the ops ``fp8fx::<name>`` as
    ``<namespace>.<name>(...)`` (imported as ``fp8fx_direct``) instead of ``torch.ops.fp8fx.<name>.default(...)``:
    the same arguments, the same buffer name. Through ``CUSTOM_EXTERN_KERNEL_CODEGEN``, Inductor's table of custom
    codegen for fallback kernels (torch 2.11 and 2.13); its entries for fp8fx's ops write the default call (an
    ``ExternKernelAllocLine``) outside this context, so another backend's graphs are untouched. Where the table is
    missing (another torch), the ops are called through the dispatcher, as before."""
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen
    except ImportError:
        yield
        return
    for name in names:
        CUSTOM_EXTERN_KERNEL_CODEGEN.setdefault(f"torch.ops.fp8fx.{name}.default",
                                                CustomCodegen(python=_DirectCall(name, namespace)))
    saved = getattr(_DIRECT, "names", None)
    _DIRECT.names = frozenset(names)
    try:
        yield
    finally:
        _DIRECT.names = saved


class _DirectCall:
    """The Python wrapper codegen of one fp8fx op's fallback kernel (``direct_op_calls``)."""

    def __init__(self, name: str, namespace: str):
        self.name, self.namespace = name, namespace

    def __call__(self, node: Any, writeline: Callable[[Any], None]) -> None:
        from torch._inductor.codegen.wrapper import ExternKernelAllocLine
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
        if self.name not in (getattr(_DIRECT, "names", None) or ()) or V.graph.cpp_wrapper:  # C++: no Python calls
            writeline(ExternKernelAllocLine(wrapper, node))  # what Inductor writes without this entry
            return
        module, _, attr = self.namespace.rpartition(".")
        wrapper.add_import_once(f"from {module} import {attr} as fp8fx_direct")
        args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
        writeline(f"{node.get_name()} = fp8fx_direct.{self.name}({args})")


def profiler_on() -> bool:
    """Whether a torch profiler (``torch.profiler.profile``, ``torch.autograd.profiler.profile``) is recording."""
    return torch.autograd.profiler._is_profiler_enabled


class _OnePassRows:
    """Inductor's choices handler in place (``base``), except that INNER reductions (along the contiguous
    last dimension) of up to ``limit`` elements are persistent and not split. A module-level class, so
    that Inductor can pickle the handler (subprocess / async compile modes)."""

    def __init__(self, base, limit: int):
        self._base, self._limit = base, limit

    def __getattr__(self, name):  # only for what the instance lacks: every other heuristic
        if name.startswith("__") or name in ("_base", "_limit"):  # e.g. pickle probing a bare instance
            raise AttributeError(name)
        return getattr(self._base, name)

    def should_use_persistent_reduction(self, features, cooperative_reduction: bool) -> bool:
        from torch._inductor import config
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V

        if (
            config.triton.persistent_reductions
            and not cooperative_reduction
            and features.get_reduction_hint() == ReductionHint.INNER
            and V.graph.sizevars.statically_known_leq(features.reduction_numel, self._limit)
        ):
            return True
        return self._base.should_use_persistent_reduction(features, cooperative_reduction)

    def reduction_split_factor(self, device, reduction_numel_hint: int, numel_hint: int, inner_reduction: bool) -> int:
        """Rows up to the limit are not split. Inductor splits a row reduction into two reductions and a
        pointwise kernel when there are fewer than 2 rows per SM and a row has more than 8192 elements
        (sm_90): SiLU*mul + quantization of a decode step's 14336-wide row took 3 launches (0.0035 +
        0.0010 + 0.0011 ms of GPU time, H200, run 9) where one program per row reads its 57 KB once."""
        from torch._inductor import config

        # as the persistent rule above, but on the size hint: a dynamic row length that grows past the
        # limit at run time is then one looped program per row, never wrong
        if inner_reduction and config.triton.persistent_reductions and reduction_numel_hint <= self._limit:
            return 1
        return self._base.reduction_split_factor(device, reduction_numel_hint, numel_hint, inner_reduction)


@contextlib.contextmanager
def one_pass_row_reductions(limit: Optional[int], choices_class: Optional[type] = None) -> Iterator[None]:
    """Inside the block, Inductor reduces rows (reductions along the contiguous last dimension) of up
    to ``limit`` elements in one pass, the row held in registers (a "persistent" reduction), one program
    per row. Its own heuristic does that only up to 1024 elements (a smaller ``limit`` changes nothing);
    longer rows take the looped form, which reads its input twice when the result feeds the same kernel's
    output (amax -> divide -> cast: activation quantization), and rows of over 8192 elements in batches of
    few rows (decode) are split into three kernels. ``None`` leaves Inductor's heuristics alone.

    Installed through Inductor's choices handler (``V.set_choices_handler``, thread-local, restored on
    exit) for this block only, over ``choices_class()`` where given (an ``inductor_choices_class`` of the
    compilation's config patches: Inductor builds its default handler from the config once, at its first use in a
    thread, which is before the patches apply) else Inductor's handler. Inductor's FX-graph cache key does not see
    the handler: a caller must put ``limit`` into its own key (``Fp8Backend`` does, through its pass manager's
    uuid)."""
    if limit is None:
        yield
        return
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_OnePassRows(choices_class() if choices_class is not None else V.choices, limit)):
        yield


# -- seeing what was compiled (graph dumps, the report) -----------------------------------------------
@contextlib.contextmanager
def capture_output_code() -> Iterator[list[str]]:
    """Collects the Python wrapper code of every graph Inductor compiles (or loads from its cache) inside
    the block. Uses the hook Inductor's own ``run_and_get_code`` uses, chained to any hook already set
    and restored on exit."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code

    def save(code: str) -> None:
        codes.append(code)
        if previous is not None:
            previous(code)

    GraphLowering.save_output_code = save
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = previous


_bytecode_hooks: list = []  # handles of the hooks after_dynamo_bytecode registered


def after_dynamo_bytecode(callback: Callable[[types.CodeType, types.CodeType], None]) -> bool:
    """Calls ``callback(code, new_code)`` once, when Dynamo has generated the bytecode of the frame it is
    tracing now (a backend runs before that bytecode exists). False when no Dynamo frame is being traced.

    A hook cannot unregister itself while Dynamo iterates over the hooks, so each call removes the hooks
    of the calls before: at most one hook, inert once it has run, stays registered."""
    from torch._dynamo import convert_frame
    from torch._dynamo.symbolic_convert import InstructionTranslator

    while _bytecode_hooks:
        _bytecode_hooks.pop().remove()
    try:
        frame_code = InstructionTranslator.current_tx().f_code
    except AttributeError:  # not inside Dynamo's tracing (e.g. a backend called by hand)
        return False
    ran: list[bool] = []

    def hook(code: types.CodeType, new_code: types.CodeType) -> None:
        if code is frame_code and not ran:
            ran.append(True)
            callback(code, new_code)

    _bytecode_hooks.append(convert_frame.register_bytecode_hook(hook))
    return True


def forget_dynamo_bytecode() -> None:
    """Unregisters the hook of the last ``after_dynamo_bytecode`` call, whose callback has not run yet (a backend
    call whose graph Dynamo discards: the callback must not write about it). Not from inside the callback."""
    while _bytecode_hooks:
        _bytecode_hooks.pop().remove()


def input_source(node: Any) -> Optional[str]:
    """Dynamo's name of what a graph input is (``L['self']._modules['l']._parameters['weight']``; 2.11 and 2.13 keep
    it as a property of the source in the placeholder's ``grapharg``), or None."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else None


def wrapped_tensor_kind(value: Any) -> Optional[str]:
    """What a traced value that is no plain tensor is, or None for a plain one: a tensor of torch.func's transforms
    (``vmap``'s batched tensor, ``grad``'s), or a nested tensor (``torch.nested``, jagged or strided)."""
    if not isinstance(value, torch.Tensor):
        return None
    if torch._C._functorch.is_functorch_wrapped_tensor(value):
        return "a torch.func transform's tensor (vmap's batched tensor, say)"
    if value.is_nested:
        return "a nested tensor (torch.nested)"
    return None


def is_dynamo_retrace(exc: BaseException) -> bool:
    """``exc``, raised inside a backend, means: Dynamo discards this attempt at the graph and traces the frame
    again (the backend is called again for the new graph); not a failure of the backend.

    Of the ``torch._dynamo.exc.RestartAnalysis`` family only ``TensorifyScalarRestartAnalysis`` is that, on torch
    2.11 and 2.13: AOTAutograd raises it (inside Inductor's compile, with dynamic shapes) when it turns a Python
    float of the graph into a tensor, and Dynamo's ``OutputGraph.call_user_compiler`` re-raises it unchanged, so
    ``convert_frame`` restarts the analysis. Any other ``RestartAnalysis`` a backend raised is wrapped into
    ``BackendCompilerFailed`` there: the compile fails (a real failure). ``SkipFrame`` passes through as well,
    but the frame then runs uncompiled, never traced again; ``ShortenTraceback`` (``BackendCompilerFailed``) is
    a failure."""
    from torch._dynamo import exc as dynamo_exc

    retrace = getattr(dynamo_exc, "TensorifyScalarRestartAnalysis", None)
    return retrace is not None and isinstance(exc, retrace)


def dynamo_events() -> tuple[list[str], list[str], list[str]]:
    """Dynamo's process-wide record so far: the reason of every graph break and of every guard failure
    that made it recompile (first lines), and a line for each frame it gave up on and ran uncompiled (a graph break
    in a loop: counted as no graph break), with the reasons it recorded as unsupported. Compare two snapshots to see
    what a piece of code caused. A cache entry of another ``torch.compile`` call (BACKEND_MATCH) is not a recompile of
    this one."""
    from torch._dynamo import utils

    breaks = [_break_reason(reason) for reason, n in utils.counters["graph_break"].items() for _ in range(n)]
    failures = [str(r).splitlines()[0] for reasons in utils.guard_failures.values() for r in reasons]
    frames = utils.counters["frames"]
    skipped = ["frame"] * (frames["total"] - frames["ok"]) + [
        _break_reason(reason) for reason, n in utils.counters["unimplemented"].items() for _ in range(n)]
    return breaks, [r for r in failures if "BACKEND_MATCH" not in r], skipped


# how Dynamo files a frame it ran uncompiled at a recompile limit, as unsupported (torch 2.11, 2.13)
RECOMPILE_LIMIT_REASON = "Dynamo recompile limit exceeded"


def recompile_limit_hits() -> tuple[Any, dict[str, int]]:
    """Dynamo's record of the frames that hit a recompile limit in this process (any frame, any backend), each run
    uncompiled from then on: (the record itself, which ``torch._dynamo.utils.counters.clear()`` replaces by a new one;
    {the limit's name, ``recompile_limit`` or ``accumulated_recompile_limit``: hits}). Dynamo files each hit as
    unsupported, "Dynamo recompile limit exceeded ... exceeding the <limit> cache size limit" (torch 2.11, 2.13),
    once a frame; ``torch._dynamo.reset()`` keeps the record."""
    from torch._dynamo import utils

    record = utils.counters["unimplemented"]
    hits: dict[str, int] = {}
    for reason, n in record.items():
        if reason.startswith(RECOMPILE_LIMIT_REASON):
            limit = re.search(r"exceeding the (\w+) cache size limit", reason)
            name = limit[1] if limit else "recompile_limit"
            hits[name] = hits.get(name, 0) + n
    return record, hits


def frame_graphs() -> Optional[tuple[str, int, int]]:
    """For the graph Dynamo is compiling now: (its compile id, "0/7"; how many graphs Dynamo has compiled for its frame,
    this one included; ``torch._dynamo.config.recompile_limit``, past which Dynamo runs the frame uncompiled), or None
    outside a compile. ``CompileContext`` and ``frame_compile_id`` on 2.11 and 2.13."""
    from torch._dynamo import config
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_compile_id is None:
        return None
    limit = getattr(config, "recompile_limit", None) or config.cache_size_limit  # (the older name)
    return f"{compile_id.frame_id}/{compile_id.frame_compile_id}", compile_id.frame_compile_id + 1, limit


def reset_with_dynamo(backend) -> None:
    """Have ``torch._dynamo.reset()`` call ``backend.reset()`` next time, as it does for the backends of the
    ``torch.compile`` calls made since its last reset (``eval_frame.cached_backends``) and not for one whose compiled
    model runs on across a reset (its graphs' frame ids were then counted as the new frames'). Nothing where the
    dict is gone (2.11 and 2.13 have it)."""
    from torch._dynamo import eval_frame

    cached = getattr(eval_frame, "cached_backends", None)
    if isinstance(cached, dict):
        cached.setdefault(id(backend), backend)


def compiled_static() -> bool:
    """Whether the graph Dynamo is compiling now comes from ``torch.compile(..., dynamic=False)``, which sets
    ``torch._dynamo.config.automatic_dynamic_shapes`` False while it compiles (None and True leave it True; True also
    sets ``assume_static_by_default`` False), on 2.11 and 2.13."""
    from torch._dynamo import config

    return not config.automatic_dynamic_shapes


def _break_reason(reason: str) -> str:
    """A graph break's reason in one line: its first, with the ``Explanation:`` line of torch 2.11+'s reasons where
    there is one (the first line alone, "Failed to trace builtin operator", did not name the ``print``)."""
    lines = [line.strip() for line in reason.splitlines()]
    why = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {why}" if why and lines else (lines[0] if lines else reason)


__all__ = [
    "CustomGraphPass",
    "FakeTensor",
    "RECOMPILE_LIMIT_REASON",
    "TORCH_VERSION",
    "after_dynamo_bytecode",
    "capture_output_code",
    "compile_fx",
    "compiled_static",
    "dynamo_events",
    "forget_dynamo_bytecode",
    "frame_graphs",
    "is_dynamo_retrace",
    "one_pass_row_reductions",
    "recompile_limit_hits",
]
