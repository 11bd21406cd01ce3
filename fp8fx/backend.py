"""``fp8_backend`` / ``Fp8Backend``: Dynamo graph -> fp8fx passes -> Inductor."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from torch import SymInt, fx, is_tensor

from fp8fx import ops
from fp8fx.dump import (DUMP_FILE, ForeignDumpFile, GraphDump, check_own, lock_folder, locked_elsewhere, unlock_folder,
                        written_by_fp8fx)
from fp8fx.lowerings import aten, compat
from fp8fx.ops import GATED_H_GROUPS
from fp8fx.passes import PassManager, default_passes
from fp8fx.passes.base import FLOAT_INPUTS, is_float_input, may_record_grad
from fp8fx.passes.horizontal import AFTER_COMPILE, SHARED_INPUTS, share_memory
from fp8fx.report import Report, Site, first_line

log = logging.getLogger("fp8fx")

_COMPILERS = ("inductor", "eager")
_LOWERINGS = ("aten", "op")
ONE_PASS_ROWS = 16384  # Fp8Backend's default one_pass_rows: rows up to a Llama-3 MLP's 14336 reduce in one pass
# the live backend of this process writing into each dump folder (its real path): a second one writes beside it
_DUMP_WRITERS: "weakref.WeakValueDictionary[str, Fp8Backend]" = weakref.WeakValueDictionary()
# every backend of this process that has written a dump, reset or not: a new dump clears no folder of theirs
_DUMPERS: "weakref.WeakSet[Fp8Backend]" = weakref.WeakSet()
# the lock (``fp8fx.dump.lock_folder``) this process holds on each folder a backend claimed, until that backend's
# garbage collection (``_release_folder``; a reset frees the folder for this process's backends alone: another
# process's first graph would clear the files of a backend still held, which ``_evict`` moves only here): other
# processes' backends write beside it
_DUMP_LOCKS: dict[str, int] = {}
_MAX_DUMP_FOLDERS = 64  # backend<k> folders tried before a graph goes undumped
_fork_hook_registered = False  # whether _forget_dump_locks is registered to run in forked children


def _release_folder(real: str) -> None:
    """A backend that claimed dump folder ``real`` was garbage-collected: this process lets go of the folder's lock,
    unless another live backend of it writes there now."""
    if _DUMP_WRITERS.get(real) is None:
        unlock_folder(_DUMP_LOCKS.pop(real, None))


def _first_subfolder(root: str, take: Callable[[str], bool]) -> Optional[str]:
    """The first of ``root/backend2`` ... ``root/backend{_MAX_DUMP_FOLDERS}`` that ``take`` takes, or None."""
    folders = (os.path.join(root, f"backend{k}") for k in range(2, _MAX_DUMP_FOLDERS + 1))
    return next((folder for folder in folders if take(folder)), None)


def _forget_dump_locks() -> None:
    """In a forked child (a DataLoader worker): its copies of the parent's locked descriptors would hold the parent's
    folders after the parent let go of them (a lock goes with its last descriptor), and the parent's backends are
    not the child's."""
    for fd in _DUMP_LOCKS.values():
        unlock_folder(fd)
    _DUMP_LOCKS.clear()
    _DUMP_WRITERS.clear()
    _DUMPERS.clear()  # (else the child's first dump "evicted" the parent's backends, moving their files: h133)


class _Fixed:
    """An option ``Fp8Backend`` reads at each compile and keys Inductor's caches by (``cache_key``), or builds its
    passes from, both from what the constructor was given: set later, a graph cached under the old value would be
    served for the new one (and the reverse), or the passes would not see it, so it is read-only."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, backend, owner=None):
        if backend is None:
            return self
        try:
            return backend.__dict__["_" + self.name]
        except KeyError:  # (read before __init__ set it: getattr's default and hasattr need an AttributeError)
            raise AttributeError(f"Fp8Backend.{self.name} is not set yet (Fp8Backend.__init__ sets it)") from None

    def __set__(self, backend, value):
        raise AttributeError(f"Fp8Backend.{self.name} is fixed when the backend is made (Inductor's caches are keyed "
                             f"by it): make a new backend, Fp8Backend({self.name}={value!r}, ...)")


class _FixedConfig(dict):
    """``Fp8Backend.inductor_config``: read-only, as ``_Fixed`` says why."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("Fp8Backend.inductor_config is fixed when the backend is made (Inductor's caches are keyed by "
                        "it): make a new backend, Fp8Backend(inductor_config={...}), or pass the patch for one compile "
                        "as torch.compile(..., options={...})")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):  # (pickle and copy rebuild a dict subclass item by item: through __setitem__)
        return type(self), (dict(self),)


class Fp8Backend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=Fp8Backend(...))``.

    Options:
    - ``compiler``: ``"inductor"`` (default) or ``"eager"`` (run the rewritten graph as is: for
      debugging the passes without Inductor).
    - ``dump_dir``: write, per compiled graph, the graph before and after each pass (Python), Inductor's
      output code, the report and Dynamo's decompiled bytecode into this folder (``fp8fx.dump``). A folder
      another live backend writes into, of this process or another, is not shared: this one writes into its
      ``backend2`` (``backend3``, ...) subfolder, with a warning, and ``dump_dir`` says where (a backend
      keeps its folder until ``torch._dynamo.reset()``; a new backend taking it after the reset moves the files of
      the backend it was, if still held, to a ``backend<k>`` folder, where that backend writes on). A dump clears
      the files an earlier one left and no others: a file there named as a dump's (``report.json``) that fp8fx did
      not write is refused, naming it, before anything is written (ValueError here; found at a compile, that
      graph is not dumped, with a warning).
    - ``inductor_config``: extra Inductor config patches for this backend's compilations.
    - ``lowering``: ``"aten"`` (default) decomposes the activation quantization on CUDA into ATen so
      Inductor fuses it into its producer (``fp8fx.lowerings.aten``); ``"op"`` keeps every fp8fx op
      an opaque kernel.
    - ``use_fast_accum``: let fp8 GEMMs (linears and the fused MoE's) accumulate in Hopper's fast
      mode, without promoting partial sums to fp32 every K step (as torchao's float8 inference does;
      measured accuracy in benchmarks/RESULTS.md). Default True. It applies where a GEMM runs on wgmma:
      cuBLAS, tiles of 64+ rows and, since run 20, the transposed tiles of 2-16 rows; the one-row GEMV
      and the untransposed 16-row tiles (mma.sync) always sum in float32.
    - ``cudagraphs``: run the compiled graphs as CUDA graphs (Inductor's cudagraph trees), which
      decode-sized batches need to reach their speed. Default False.
    - ``weight_only``: fp8 weights with 16-bit activations and math (``fp8fx.weight_only_mm``); None
      (default) picks it on GPUs without fp8 tensor cores (compute capability < 8.9). MoE experts are then
      left to run on their dequantized weights (``fused_moe`` takes fp8 activations only), reported so.
    - ``fuse_horizontal``: fuse GEMMs that read the same input (q/k/v, gate/up) into one
      (``fp8fx.passes.horizontal``): once compiled, the fused layers' weights (and per-channel or block
      scales) are moved into one tensor and run as one GEMM; per-tensor shards keep their own scales, taken
      as one per-channel scale vector (exact). Default False.
    - ``fuse_mlp``: a gated MLP (``down(act(gate(x)) * up(x))``, SiLU or GELU, gate and up apart or one
      merged layer) in graphs of 1-64 tokens (a static decode batch: compile with ``dynamic=False``) runs
      as two kernels, gate/up with act(g) * up in the epilogue and down quantizing the intermediate as it
      loads it (``fp8fx.passes.mlp``), where the unfused MLP takes three GEMMs and a quantization kernel
      (Llama-3-8B MLP on the H200: 1.22-1.24x faster than unfused at 1 and 16 tokens, run 12); by default
      h in 1 x 128 groups (1 x 32 at one token), up to 64 tokens (``mlp_h_group``); with h per token
      (``mlp_h_group=None``) in graphs
      of 17-64 tokens as three, h quantized once between the two GEMMs (1.10x
      faster than unfused at 64 tokens, 1.29-1.34x at 32, run 29); and in graphs
      of ``fp8fx.ops.GATED_PREFILL_MIN_M`` (2048) tokens or more with per-token h, as the prefill kernels: gate/up
      with act(g) * up in its epilogue, a streaming quantization of h, cuBLAS's down (1.04-1.07x faster than
      unfused at 2048 and 4096 tokens, run 23). Default False.
    - ``mlp_h_group``: with ``fuse_mlp``, quantize the fused decode MLP's intermediate ``act(g) * up`` in 1 x G
      groups (G of 32, 64, 128; 128 measured fastest) instead of the graph's per-token (or per-tensor) dynamic
      scale, in the gate/up kernel's epilogue, so the down GEMM reads fp8 codes; MLPs of up to 64 tokens are then
      fused. ``"auto"`` (the default): groups of 32 at one token and of 128 from two
      (``fp8fx.passes.mlp.auto_h_group``). Llama-3-8B MLP block on the H200, CUDA-graph replays (run 31): 1 x 128
      groups 1.71-1.77x bf16 at 2-64 tokens against 1.63-1.75x with per-token h, faster at each of 1, 2, 4, 8, 16,
      32 and 64 tokens in one sweep; relative error vs the float32 MLP 0.0618-0.0628 against 0.0628-0.0645 per
      token, as a group's scale is at most its row's. Prefill (2048 tokens or more) keeps h per token (its kernels
      quantize it so), and a static scale (``calibrate``) stays as it is. None: h as the graph quantizes it (per
      token: the unfused linears' scheme, as vLLM's dynamic fp8 quantizes activations).

    - ``one_pass_rows``: reduce rows of up to this many elements in one pass, held in registers, where
      Inductor's heuristic stops at 1024 (``compat.one_pass_row_reductions``): the per-token
      quantization of a 4096- or 14336-wide activation then reads it once instead of twice. Default
      16384 (Llama-3-8B MLP block at M=4096 on the H200, two runs: 1.345 and 1.330 ms against 1.379 and
      1.574 with Inductor's heuristic; M <= 2048 within run-to-run spread); None keeps Inductor's.
    - ``direct_calls``: Inductor's code calls fp8fx's ops as plain functions (``fp8fx.ops.direct``: the kernel the
      op would dispatch to, for scaled_mm and gated_mlp without the dtype and shape checks the op's fake impl ran when
      the graph was traced; ``compat.direct_op_calls``), not through the dispatcher, which
      boxes their arguments into Python and runs custom_op's layers on every call (0.05-0.075 ms less host time a
      call of the fused MLP's prefill op on the H200's host, 0.04-0.10 ms a compiled block; benchmarks/RESULTS.md
      run 26). Default True; False keeps ``torch.ops.fp8fx.*`` calls (the ops' names show in profiler traces
      either way).

    - ``fast_topk``: every ``torch.topk`` over the last dim of rows of up to 4096 float32 / bf16 / fp16 elements,
      k <= 32 (an MoE router's experts), runs as ``fp8fx.topk``: one launch on CUDA where torch's takes a radix
      select and a sort (``fp8fx.passes.topk``; ties to the lower index); the report's ``topk`` list says which.
      Default True.
    - ``fuse_routing``: with ``fast_topk``, a softmax router's softmax before its top-k (Qwen3-MoE, Mixtral) and the
      renormalization and cast of its weights after it, or the softmax of the k top logits (GPT-OSS), join the
      top-k's launch (``fp8fx.softmax_topk``): one kernel where there were three. Experts are then ranked by their
      logits, not the graph's float32 probabilities (the same order but where two logits round to one probability,
      or in a row with a NaN or +inf logit, whose weights are NaN either way). A sigmoid router's grouped top-k
      (DeepSeek-V3, Nemotron-H: three top-ks, the group mask, the weights' gather, renormalization and scale) joins
      as one ``fp8fx.grouped_topk``. Default True.
    - ``fast_router``: an MoE router's linear (its weight kept in high precision, tagged by ``quantize_`` /
      ``load_checkpoint``) runs as ``fp8fx.small_mm``: on CUDA up to 4 rows of x in one Triton launch, where cuBLAS
      took 4.2-6.1 us at one token on the H200 (``fp8fx.passes.router``); torch's linear for more rows. Default True.

    ``report`` lists every linear site of every graph this backend compiled. A graph compiled under
    ``torch.no_grad()`` runs with the autograd dispatch keys excluded, as under ``torch.inference_mode()``
    (``compat.below_autograd``): fp8fx's ops then skip custom_op's autograd kernel, 62-95 us a call of host time
    on the H200's host; its outputs are ordinary tensors, as under no_grad.
    """

    def __init__(
        self,
        *args,
        compiler: str = "inductor",
        dump_dir: Optional[str] = None,
        inductor_config: Optional[dict[str, Any]] = None,
        lowering: str = "aten",
        use_fast_accum: bool = True,
        cudagraphs: bool = False,
        weight_only: Optional[bool] = None,
        fuse_horizontal: bool = False,
        fuse_mlp: bool = False,
        mlp_h_group: Union[int, None, str] = "auto",
        one_pass_rows: Optional[int] = ONE_PASS_ROWS,
        direct_calls: bool = True,
        fast_topk: bool = True,
        fast_router: bool = True,
        fuse_routing: bool = True,
    ):
        if args and isinstance(args[0], fx.GraphModule):  # torch.compile(model, backend=fp8fx.Fp8Backend)
            raise TypeError("torch.compile(backend=fp8fx.Fp8Backend): the class was given, and torch called it with "
                            "the graph; pass an instance, backend=fp8fx.Fp8Backend() (its .report says what was "
                            "rewritten), or backend=fp8fx.fp8_backend")
        if args:
            raise TypeError(f"Fp8Backend({', '.join(repr(a) for a in args)[:80]}): the options are keywords, e.g. "
                            "Fp8Backend(compiler='eager', dump_dir='dumps')")
        if compiler not in _COMPILERS:
            raise ValueError(f"Fp8Backend(compiler={compiler!r}): use one of {_COMPILERS}")
        if lowering not in _LOWERINGS:
            raise ValueError(f"Fp8Backend(lowering={lowering!r}): use one of {_LOWERINGS}")
        if one_pass_rows is not None and (type(one_pass_rows) is not int or one_pass_rows < 1):
            raise ValueError(f"Fp8Backend(one_pass_rows={one_pass_rows!r}): a positive int (row length) or None")
        flags = dict(use_fast_accum=use_fast_accum, cudagraphs=cudagraphs, fuse_horizontal=fuse_horizontal,
                     fuse_mlp=fuse_mlp, direct_calls=direct_calls, fast_topk=fast_topk,
                     fast_router=fast_router, fuse_routing=fuse_routing)
        for name, value in flags.items():  # a truthy string ("false") would switch the option on
            if type(value) is not bool:
                raise ValueError(f"Fp8Backend({name}={value!r}): True or False")
        if type(mlp_h_group) is str and mlp_h_group == "auto":
            mlp_h_group = "auto" if fuse_mlp is True else None  # (the pass picks the groups by token count)
        elif mlp_h_group is not None and (type(mlp_h_group) is not int or mlp_h_group not in GATED_H_GROUPS):
            raise ValueError(f"Fp8Backend(mlp_h_group={mlp_h_group!r}): a group size of {list(GATED_H_GROUPS)}, "
                             "None (h quantized as the graph does) or 'auto' (the default)")
        elif mlp_h_group is not None and not fuse_mlp:
            raise ValueError(f"Fp8Backend(mlp_h_group={mlp_h_group}): it sets how the fused MLP quantizes its "
                             "intermediate; add fuse_mlp=True")
        if weight_only is not None and type(weight_only) is not bool:
            raise ValueError(f"Fp8Backend(weight_only={weight_only!r}): True, False or None (decided per GPU)")
        if weight_only and (fuse_mlp or fuse_horizontal):  # the fusions take the fp8-activation GEMMs
            given = [n for n, on in (("fuse_mlp", fuse_mlp), ("fuse_horizontal", fuse_horizontal)) if on]
            raise ValueError(f"Fp8Backend(weight_only=True, {', '.join(f'{n}=True' for n in given)}): the fusions "
                             "rewrite fp8 GEMMs, and weight-only GEMMs take 16-bit activations; drop one")
        inductor_only = {"cudagraphs": cudagraphs is True, "inductor_config": bool(inductor_config),
                         "lowering": lowering != "aten", "one_pass_rows": one_pass_rows != ONE_PASS_ROWS,
                         "direct_calls": direct_calls is not True}
        if compiler == "eager" and any(inductor_only.values()):
            given = [name for name, set_ in inductor_only.items() if set_]
            raise ValueError(f"Fp8Backend(compiler='eager') with {', '.join(given)}: options of Inductor, which this "
                             "compiler does not run; drop them or use compiler='inductor'")
        _check_inductor_config(inductor_config, "Fp8Backend(inductor_config=")
        if cudagraphs and (inductor_config or {}).get("triton.cudagraphs", True) is not True:
            raise ValueError(f"Fp8Backend(cudagraphs=True, inductor_config={{'triton.cudagraphs': "
                             f"{inductor_config['triton.cudagraphs']!r}}}): the two disagree; keep one")
        if isinstance(dump_dir, (str, os.PathLike)):  # '~/dumps': the home's (a Path too: it made a folder named ~)
            dump_dir = os.path.expanduser(os.fspath(dump_dir))
        _check_dump_dir(dump_dir)  # last: it makes the folder
        self.__dict__.update(_one_pass_rows=one_pass_rows, _direct_calls=direct_calls, _lowering=lowering,
                             _compiler=compiler, _use_fast_accum=use_fast_accum, _weight_only=weight_only,
                             _fuse_horizontal=fuse_horizontal, _fuse_mlp=fuse_mlp, _mlp_h_group=mlp_h_group,
                             _fast_topk=fast_topk, _fast_router=fast_router, _fuse_routing=fuse_routing,
                             _cudagraphs=cudagraphs)
        # the folder asked for, as made now (a later chdir does not move it); dump_dir may become a subfolder of it
        self._dump_root = None if dump_dir is None else os.path.abspath(dump_dir)
        self.dump_dir = self._dump_root
        inductor_config = dict(inductor_config or {})
        if cudagraphs:
            inductor_config["triton.cudagraphs"] = True
        self.__dict__["_inductor_config"] = _FixedConfig(inductor_config)
        options = {
            "compiler": compiler,
            "lowering": lowering,
            "use_fast_accum": use_fast_accum,
            "weight_only": weight_only,
            "fuse_horizontal": fuse_horizontal,
            "fuse_mlp": fuse_mlp,
            "mlp_h_group": mlp_h_group,
            "one_pass_rows": one_pass_rows,
            "direct_calls": direct_calls,
            "fast_topk": fast_topk,
            "fast_router": fast_router,
            "fuse_routing": fuse_routing,
            "inductor_config": sorted((k, compat.custom_pass_key(v)) for k, v in self.inductor_config.items()),
        }
        passes = default_passes(use_fast_accum=use_fast_accum, weight_only=weight_only, fuse_horizontal=fuse_horizontal,
                                fuse_mlp=fuse_mlp, mlp_h_group=mlp_h_group, fast_topk=fast_topk,
                                fast_router=fast_router, fuse_routing=fuse_routing)
        self.pass_manager = PassManager(passes, options)
        self.report = Report()

    one_pass_rows = _Fixed()
    direct_calls = _Fixed()
    lowering = _Fixed()
    compiler = _Fixed()
    inductor_config = _Fixed()
    # (the passes' options, built into the pass manager once: set later, they were taken and did nothing)
    use_fast_accum = _Fixed()
    weight_only = _Fixed()
    fuse_horizontal = _Fixed()
    fuse_mlp = _Fixed()
    mlp_h_group = _Fixed()
    fast_topk = _Fixed()
    fast_router = _Fixed()
    fuse_routing = _Fixed()
    cudagraphs = _Fixed()

    def __deepcopy__(self, memo) -> "Fp8Backend":
        """The backend itself: a copy would compile with a report of its own, which the user never sees.
        transformers' ``CompileConfig(backend=...)`` deep-copies its fields before it hands them to torch.compile
        (``generate`` with a static cache), and the report of the backend given stayed empty."""
        return self

    def cache_key(self) -> str:
        """Changes whenever a pass's source or an option changes (fed to Inductor's FX-graph cache)."""
        return self.pass_manager.uuid()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: Optional[str] = None,
                 options: Optional[dict[str, Any]] = None):
        """Compile one graph Dynamo captured. ``mode`` and ``options`` are ``torch.compile``'s, which it hands to its
        backend: Inductor's options of that mode, then ``options``, go over this backend's ``inductor_config`` for
        this compilation (as ``torch.compile(mode=..., options=...)`` sets them for Inductor)."""
        call_config = _call_config(mode, options, self.compiler)  # (refused before anything is traced or reported)
        if self.inductor_config.get("triton.cudagraphs") and call_config.get("triton.cudagraphs", True) is not True:
            raise ValueError("torch.compile(options={'triton.cudagraphs': False}) with Fp8Backend(cudagraphs=True) "
                             "or its inductor_config's: the two disagree; keep one")
        index = self.report.graphs
        self.report.watch_recompile_limit()  # (a frame that gives no graph hits the limit unseen: Dynamo counts it)
        frame = compat.frame_graphs()
        if frame is not None:  # (a graph that fails is one of this backend's too, for the recompile limit's count)
            self.report.graph_of_frame(index, frame[0])
            compat.reset_with_dynamo(self)  # (its frame ids are forgotten at Dynamo's next reset)
        dump = self._dump(gm, index)
        code: list[str] = []
        # (a float input a pass may take as a constant: the graph as traced runs the calls where its value changed)
        traced = _copy(gm) if any(map(is_float_input, example_inputs)) else None
        try:
            (dump.passes(self.pass_manager) if dump else self.pass_manager).run(gm, example_inputs, self.report)
            after_compile = gm.meta.pop(AFTER_COMPILE, ())  # e.g. moving fused weights into one tensor
            shared = gm.meta.pop(SHARED_INPUTS, [])  # (those of another module Dynamo runs this graph for)
            floats = gm.meta.pop(FLOAT_INPUTS, [])
            compiled = (gm.forward if self.compiler == "eager"
                        else self._inductor(gm, example_inputs, index, code, call_config))
            if floats:
                compiled = _check_floats(compiled, floats, traced, index)
            for fn in after_compile:
                fn()
        except BaseException as e:  # Dynamo may run the frame eagerly instead: nothing of this graph was rewritten
            if compat.is_dynamo_retrace(e):  # not a failure: Dynamo drops this graph and traces the frame again
                self._discard(index, dump)
                raise
            self.report.fail_graph(index, f"the graph failed to compile ({type(e).__name__}: {first_line(e, 200)})")
            if dump:
                dump.finish(self.report, code)
            raise
        if frame is not None and frame[1] >= frame[2]:  # Dynamo's last graph for the frame
            # (static: each shape a graph of its own, dynamic=False and no dim marked dynamic, which stays symbolic)
            static = compat.compiled_static() and not any(
                isinstance(v, SymInt) or is_tensor(v) and not all(isinstance(d, int) for d in v.shape)
                for v in example_inputs)
            self.report.at_recompile_limit(index, *frame, static=static)
        return self._done(compiled, index, dump, code, shared)

    def _discard(self, index: int, dump: Optional[GraphDump]) -> None:
        """Undo what the attempt at graph ``index`` left: its sites and kernels in the report, and its dump files
        (``graph<index>_*``) with the hook that would write its bytecode. The attempt that follows, the same
        frame traced again, is graph ``index``."""
        log.debug("fp8fx: graph %d discarded by Dynamo, which traces the frame again", index)
        self.report.discard_graph(index)
        if dump is None:
            return
        compat.forget_dynamo_bytecode()
        prefix = f"graph{index:03d}_"  # GraphDump.write's names; report.json/.txt are written only by a finished graph
        for name in os.listdir(dump.dir):
            if name.startswith(prefix) and DUMP_FILE.fullmatch(name):  # (a user's own files in the folder stay)
                os.remove(os.path.join(dump.dir, name))

    def _inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any], index: int, code: list[str],
                  call_config: Mapping[str, Any]):
        # the pass manager takes Inductor's post-grad post pass slot for its cache key: a pass of the user's
        # there (torch.compile's options, this backend's inductor_config, or torch._inductor.config) runs with it
        key = "post_grad_custom_post_pass"
        config = {**self.inductor_config, **call_config}
        user_pass = config.get(key, compat.inductor_config_value(key))
        names = [n.name for n in gm.graph.nodes]  # (the names the report matches the output code by)
        patches = {**config, key: self.pass_manager.with_user_pass(user_pass, names)}
        decomps = aten.decompositions if self.lowering == "aten" and aten.applies(example_inputs, gm) else None
        direct = compat.direct_op_calls(list(vars(ops.direct))) if self.direct_calls else contextlib.nullcontext()
        rows = compat.one_pass_row_reductions(self.one_pass_rows, config.get("inductor_choices_class"))
        with compat.capture_output_code() as captured, rows, direct:
            compiled = compat.compile_fx(gm, example_inputs, config_patches=patches, extra_decompositions=decomps)
        code += captured
        self.report.add_output_code(index, "\n".join(code), gm)
        if not may_record_grad(gm.graph):  # an inference graph (compiled under no_grad)
            compiled = compat.below_autograd(compiled)
        return compiled

    def _dump(self, gm: fx.GraphModule, index: int) -> Optional[GraphDump]:
        if self.dump_dir is None:
            return None
        try:
            if _DUMP_WRITERS.get(os.path.realpath(self.dump_dir)) is not self:  # the first graph, or one after a reset
                # after a reset the folder it had, if no other backend took it meanwhile: not another backend's
                free = _DUMP_WRITERS.get(os.path.realpath(self.dump_dir)) is None
                self.dump_dir = self._claim_dump_dir(self.dump_dir if free else self._dump_root)
                self._evict(self.dump_dir)
                if index == 0:  # files an earlier run left would read as this backend's
                    GraphDump.clear(self.dump_dir, live={os.path.realpath(b.dump_dir) for b in _DUMPERS})
            dump = GraphDump(self.dump_dir, index)
        except OSError as e:  # (the folder made a file since, say) a debugging aid must not fail the compile
            log.warning("fp8fx: graph %d is not dumped: %s: %s; fix Fp8Backend(dump_dir=%r)", index, type(e).__name__,
                        e, self.dump_dir)
            return None
        dump.start(gm)
        return dump

    def _claim_dump_dir(self, dump_dir: str) -> str:
        """``dump_dir``, or where another live backend writes into it (its files and this one's would both be
        ``graph000_*``, and each backend's first graph clears the folder), the first free ``dump_dir/backend<k>``
        (k = 2, 3, ...), with a warning; ``self.dump_dir`` says which. A backend of another process that writes
        into a folder holds a lock on it (``fp8fx.dump.lock_folder``). Dynamo holds every backend it compiled with
        until ``torch._dynamo.reset()``, which calls `reset`: a backend's folder is free again for this process's
        backends from then on, and for other processes' once it is collected (kept
        by the backend past it, it came back after a compile that raised: Dynamo leaks the backend then), and the
        files of a backend still held move out of the way when another takes it (``_evict``)."""
        folder = dump_dir if self._claim(dump_dir) else _first_subfolder(dump_dir, self._claim)
        if folder is None:  # (an OSError: the graph is not dumped, with a warning, and compiles)
            raise OSError(f"backend2/ to backend{_MAX_DUMP_FOLDERS}/ of {dump_dir} are all other live backends' "
                          "folders")
        if folder != dump_dir:
            log.warning("fp8fx: dump_dir %s is another live backend's dump folder (of this process or another); this "
                        "backend writes its dump into %s (give each backend a folder of its own)", dump_dir, folder)
        _DUMPERS.add(self)
        return folder

    def _claim(self, folder: str) -> bool:
        """Whether ``folder`` is this backend's now: no other live backend of this process writes into it, and
        this process holds its lock or took it now."""
        global _fork_hook_registered
        real = os.path.realpath(folder)
        if _DUMP_WRITERS.get(real) not in (None, self):
            return False
        if real not in _DUMP_LOCKS:
            os.makedirs(folder, exist_ok=True)  # (made again if removed since: the lock is the folder's)
            lock = lock_folder(folder)
            if lock is None:  # another process's live backend
                return False
            if not _fork_hook_registered and hasattr(os, "register_at_fork"):  # (once: at this process's first lock)
                os.register_at_fork(after_in_child=_forget_dump_locks)
                _fork_hook_registered = True
            _DUMP_LOCKS[real] = lock
        if _DUMP_WRITERS.get(real) is not self:
            weakref.finalize(self, _release_folder, real)
        _DUMP_WRITERS[real] = self
        return True

    def _evict(self, folder: str) -> None:
        """Backends still held that dumped into ``folder``, which this one takes now (they let go of it at a reset):
        their files move to a ``backend<k>`` folder of their own, where they write on. A new backend's first graph
        had cleared them (h131), from under a backend the user still held and compiled with."""
        real = os.path.realpath(folder)
        for old in [b for b in _DUMPERS if b is not self and os.path.realpath(b.dump_dir) == real]:
            taken = {os.path.realpath(b.dump_dir) for b in _DUMPERS if b is not old}
            # (a folder of its own: one that exists may be the user's, or hold another run's files)
            dest = _first_subfolder(old._dump_root, lambda d: os.path.realpath(d) not in taken
                                    and not os.path.lexists(d) and old._claim(d))
            if dest is None:  # (its files are cleared with the others: said, as a graph not dumped is)
                log.warning("fp8fx: a reset backend's dump in %s is overwritten: backend2/ to backend%d/ of %s are all "
                            "taken", folder, _MAX_DUMP_FOLDERS, old._dump_root)
                continue
            # (a file named as a dump's that fp8fx did not write stays: the clear refuses the folder, naming it)
            moved = [f for f in os.listdir(folder) if DUMP_FILE.fullmatch(f)
                     and written_by_fp8fx(os.path.join(folder, f))]
            for f in moved:
                os.replace(os.path.join(folder, f), os.path.join(dest, f))
            old.dump_dir = dest
            log.warning("fp8fx: dump_dir %s was taken by a new backend after torch._dynamo.reset(); the dump of the "
                        "backend that wrote there before, still alive (held by you, or kept by Dynamo after a compiled "
                        "call raised), moved to %s (%d files), where it writes on if it compiles again", folder, dest,
                        len(moved))

    def reset(self=None) -> None:
        """Called by ``torch._dynamo.reset()`` on the backends Dynamo holds: the report's graphs are of no frame
        Dynamo will count again (``Report.forget_frames``), and this one's dump folder is free for another backend
        (a graph this one compiles later claims a folder again, its own if still free; one taken meanwhile moved
        its files out: ``_evict``). Called on the class too (``backend=fp8fx.Fp8Backend``, refused at its first
        graph): nothing to free. The folder's lock stays this process's until the backend is collected: free for
        another process, its first graph had cleared the files of this backend, held still (h133)."""
        if self is None:
            return
        self.report.forget_frames()  # (Dynamo numbers frames from 0 again)
        for folder, backend in list(_DUMP_WRITERS.items()):
            if backend is self:
                del _DUMP_WRITERS[folder]

    def _done(self, compiled, index: int, dump: Optional[GraphDump], output_code: list[str], shared=()):
        self.report.log_graph(index)
        if dump:
            dump.finish(self.report, output_code)
        frame = bool(self.report.frame_weights.get(index))  # (a module's frame, or a model's graph another runs)
        if frame or shared:
            return _watch_reuse(compiled, self.report, index, dump, shared, frame)
        return compiled


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as it is, apart from the passes that change ``gm`` in place (the nodes' meta shared, not copied)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _check_floats(compiled, floats: list[tuple[int, float, str]], traced: fx.GraphModule, index: int):
    """``compiled`` for the calls whose float inputs (``FLOAT_INPUTS``: position, value, name) hold the values a
    pass took as constants; Dynamo does not guard them, so a call where one differs (the model's attribute changed,
    or another module of the class runs the frame) runs ``traced``, the graph as Dynamo traced it, and a warning
    says so once."""
    warned = [False]

    def run(*args):
        for position, value, name in floats:
            now = float(args[position])  # (a 0-d CPU tensor: no device sync)
            if now != value:
                if not warned[0]:
                    warned[0] = True
                    log.warning("fp8fx: graph %d was compiled with %s = %r as a constant of its fp8 kernels, and "
                                "is called with %r: this call, and any other with a value it was not compiled "
                                "with, runs the graph as traced (on the dequantized weights); compile again "
                                "(torch._dynamo.reset()) to rewrite it for the new value", index, name, value, now)
                return traced(*args)
        return compiled(*args)
    return run


def _watch_reuse(compiled, report: Report, index: int, dump: Optional[GraphDump] = None, shared=(),
                 frame: bool = True):
    """``compiled`` acting the first time it runs with another module's weights, for a graph Dynamo runs again for
    other modules: one that traced a module's forward (``frame``: Dynamo runs its code for every module of that
    class, ``Report.frames``; or a whole model's, which another model of its class runs), whose sites
    ``report.reused`` adds; one whose GEMMs the horizontal pass fused
    (``shared``: the groups' input positions, ``SHARED_INPUTS``), whose parameters of the new module are moved into
    one tensor each as the first module's were (else each of its fused GEMMs ran as one GEMM per layer, under a
    report that called them fused), or whose fused layer got a new weight (``load_state_dict(..., assign=True)`` of
    k alone: the group's others stayed in the old tensor, and it ran as one GEMM per layer, the report saying fused).
    Only such graphs are watched; the check is an identity comparison of each watched weight a call (by weak
    references). The dump's reports are written again where that added sites."""
    positions = [p for _, p in report.frame_weights[index]] if frame else []
    watched = (positions or [shared[0][0][0]])[0]
    inputs = max(positions + [p for group in shared for part in group[:3] for p in part if p is not None])
    # the first weight, then each fused group's (once)
    watch = list(dict.fromkeys([watched] + [p for ws, _, _, _ in shared for p in ws]))
    # the first weight's token (a module run so far) -> its watched weights when its groups were last fused, weakly:
    # a reference would keep a dropped model alive, and an id() alone was taken by the next model's weight, whose
    # block then ran unwatched (its fused GEMMs one per layer, no rows). A frame's graph runs module after module: a
    # call looks its module up (a dict lookup and an identity check a weight); a whole model's compares the last's.
    known: dict[int, list[weakref.ref]] = {}
    bound = [64]  # (known's size at which its freed weights' tokens are dropped)
    last: list[Optional[list[weakref.ref]]] = [None]

    def same(args, refs: Optional[list[weakref.ref]]) -> bool:
        return refs is not None and all(args[p] is ref() for p, ref in zip(watch, refs))

    def look(args) -> None:
        if inputs >= len(args):  # the weights are no inputs of the compiled code: Inductor's freezing made them its
            return  # constants (a frame's graph that other modules run cannot be told apart then)
        if same(args, last[0]):
            return
        token = Site.token_of(args[watched])
        held = known.get(token)
        if same(args, held):
            last[0] = held
            return
        new, traced = held is None, not known  # (traced: the first call, with the inputs Dynamo traced)
        known[token] = last[0] = [weakref.ref(args[p]) for p in watch]
        for ws, ss, bs, w_block in shared:  # another module's groups, or a fused layer's new weight (parameters
            # already in one tensor stay where they are)
            try:
                share_memory([args[p] for p in ws], [args[p] for p in ss],
                             [None if p is None else args[p] for p in bs], w_block)
            except Exception as e:  # noqa: BLE001 - the GEMMs then run one per layer, with the same numbers
                log.warning("fp8fx: graph %d: fused layers' new parameters could not be moved into one tensor "
                            "(%s: %s); they run one GEMM each", index, type(e).__name__, e)
        if len(known) > bound[0]:  # a freed weight's token comes no more: kept, a graph called with a new tensor
            # each time (F.linear(x, w) of a w made per call) grew it by one at each call. (This call's weight is
            # live: known stays non-empty, and no later call counts as the first.)
            live = Site.live_tokens()
            for gone in [t for t in known if t not in live]:
                del known[gone]
            bound[0] = max(64, 2 * len(known))
        if not new or traced or not frame:
            return
        try:
            before = len(report.sites) + len(report.topk)
            report.reused(index, [args[p] for p in positions])
            if dump is not None and len(report.sites) + len(report.topk) > before:
                dump.write_reports(report)
        except Exception as e:  # noqa: BLE001 - the report's, never the model's failure
            log.warning("fp8fx: graph %d: the report could not add the sites of another module running it "
                        "(%s: %s)", index, type(e).__name__, e)

    def run(*args):  # (Dynamo calls a backend's function with the inputs as arguments, Inductor's too)
        look(args)
        return compiled(*args)
    return run


def _check_dump_dir(dump_dir: Optional[str]) -> None:
    """The dump folder, made now if missing: a path that cannot be one fails here, not at the first compile, and so
    does one holding a file named as a dump's that fp8fx did not write (``fp8fx.dump.check_own``)."""
    if dump_dir is None:
        return
    if not isinstance(dump_dir, (str, os.PathLike)):
        raise ValueError(f"Fp8Backend(dump_dir={dump_dir!r}): a folder's path (str or os.PathLike) or None")
    if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
        raise ValueError(f"Fp8Backend(dump_dir={dump_dir!r}): a file, not a folder; pass a folder")
    try:
        os.makedirs(dump_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"Fp8Backend(dump_dir={dump_dir!r}): cannot make that folder ({e.strerror}); pass a "
                         "writable folder") from None
    if not os.access(dump_dir, os.W_OK | os.X_OK):
        raise ValueError(f"Fp8Backend(dump_dir={dump_dir!r}): cannot write into that folder; pass a writable one")
    # a file there named as a dump's that fp8fx did not write (the user's report.json): the first graph's clear took
    # it; refused now, before anything is written (the folder a live backend writes into: this one writes beside it)
    if not locked_elsewhere(dump_dir):
        try:
            check_own(dump_dir)
        except ForeignDumpFile as e:
            raise ValueError(f"Fp8Backend(dump_dir={dump_dir!r}): {e}") from None


def _check_inductor_config(config: Optional[Mapping[str, Any]], where: str) -> None:
    """ValueError (``where`` + what was given + why) unless ``config`` is None or a dict of torch._inductor.config
    options with values of their types."""
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"{where}{config!r}): a dict of torch._inductor.config options, e.g. {{'max_autotune': True}}")
    unknown = [k for k in (config or {}) if not compat.is_inductor_config(k)]
    if unknown:
        raise ValueError(f"{where}{{{unknown[0]!r}: ...}}): not an option of torch._inductor.config (nested ones are "
                         "dotted: 'triton.cudagraphs')")
    for key, value in (config or {}).items():  # a wrong type failed only inside the first compile
        why = compat.inductor_config_type_error(key, value)
        if why:
            raise ValueError(f"{where}{{{key!r}: {value!r}}}): {why}")
    if (config or {}).get("freezing") and not compat.freezing_enabled():
        log.warning("fp8fx: %s{'freezing': True}) freezes nothing: Dynamo decides it as it traces, from the process's "
                    "torch._inductor.config.freezing (the parameters stay inputs of the graph); set that instead, e.g. "
                    "with torch._inductor.config.patch(freezing=True) around the first call", where)


def _call_config(mode: Optional[str], options: Optional[Mapping[str, Any]], compiler: str) -> dict[str, Any]:
    """The Inductor options of ``torch.compile(mode=..., options=...)``: the mode's, then ``options``."""
    if mode is None and not options:
        return {}
    if compiler == "eager":
        given = ", ".join(f"{n}={v!r}" for n, v in (("mode", mode), ("options", options)) if v)
        raise ValueError(f"torch.compile({given}) with Fp8Backend(compiler='eager'): options of Inductor, which this "
                         "compiler does not run; drop them or use compiler='inductor'")
    config = {}
    if mode is not None:
        config = compat.inductor_mode_options(mode)
        if config is None:
            raise ValueError(f"torch.compile(mode={mode!r}): not one of Inductor's modes "
                             f"{compat.inductor_modes()}; pass one of them, or options=")
    _check_inductor_config(options, "torch.compile(options=")
    return {**config, **(options or {})}


def fp8_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any):
    """``torch.compile(model, backend=fp8fx.fp8_backend)``: ``Fp8Backend()`` with default options (``mode`` and
    ``options`` of torch.compile as ``Fp8Backend`` takes them). Each call site of ``torch.compile`` gets the same
    stateless default; use ``Fp8Backend`` to read the report. Each graph is a new backend's graph 0: its log line
    names it by the count of fp8_backend's graphs in the process ("fp8_backend #3, graph 0")."""
    backend = Fp8Backend()
    backend.report.label = f"fp8_backend #{next(_DEFAULT_GRAPHS)}, "
    return backend(gm, example_inputs, **compile_kwargs)


_DEFAULT_GRAPHS = itertools.count(1)  # the graphs fp8_backend compiled in this process (their log lines)
