"""Host time of the fused MLP's prefill op, piece by piece, and of the compiled blocks (H200 study, issue 3).

Run 25 measured the fused block's host time above its GPU time at 2048 tokens (0.625 against 0.523 ms a call) and
the fused op's own host time (0.33-0.35 ms called directly) without breaking it down. This script, in one process:

1. the host time a call (no sync; bursts of ``--calls`` calls after a sync, median over ``--bursts``) of the op
   through ``torch.ops`` (no_grad, and below autograd as ``Fp8Backend`` runs no-grad graphs), its CUDA function
   called directly, ``fp8fx.ops.direct`` (what Inductor's code calls), and each piece of it: the checks,
   ``gated_prefill``, ``quantize_rows``, the down GEMM, the bare launches of the gate/up kernel through Triton's
   ``kernel[grid]`` and through its compiled kernel, the tensor descriptors, the allocations; each launch-bearing
   piece both with ``Relaunch`` (this tree) and with Triton's path;
2. whether the blocks' host time depends on the GPU: each compiled block's host time a call with the GPU idle at
   the burst's start and with the GPU held busy (``torch.cuda._sleep``) through the whole burst;
3. the compiled blocks (fused MLP with its ops called directly and through the dispatcher, unfused fp8fx, torchao)
   in interleaved rounds of ``bench_linear.bench`` (``do_bench``, L2 flushed before each call), as
   ``bench_linear.py`` times them;
4. each block's plain call against a CUDA-graph replay of it, after the same flush: what the host costs it;
5. ``--interleaved ROUNDS``: the op through ``torch.ops`` and ``fp8fx.ops.direct``, and the fused block compiled
   with and without direct calls, in bursts taken in turn (single measurements drift up to 2x on these hosts); with
   ``--against DIR``, also the op's CUDA function and the fused block of an earlier revision of fp8fx, copied into
   DIR as the package ``fp8fx_rev`` by ``--make-rev REV DIR`` (on a machine with the git history; its ops register
   as ``torch.ops.fp8fx_rev``, so both load in one process).

    python benchmarks/host_study.py --ms 2048,4096 [--rounds 7] [--no-pieces] [--no-blocks] [--interleaved 60]
        [--against DIR] [--out DIR]
    python benchmarks/host_study.py --make-rev REV DIR
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_linear import DIM, bench, capture, fp8fx_module, l2_flushes, mlp_factory, replay_ms  # noqa: E402
from benchmarks.bench_linear import host_ms, torchao_rowwise  # noqa: E402
from benchmarks.prefill_study import Operands  # noqa: E402
from fp8fx import ops, quant  # noqa: E402
from fp8fx.kernels import gated_mlp as gm  # noqa: E402
from fp8fx.kernels.launch import sm_count  # noqa: E402


def plain_ms(fn, reps: int = 100) -> float:
    """Median ms of fn() timed by its own events, each after do_bench's flush (as ``replay_ms`` times replays)."""
    flush = l2_flushes()["dirty"]
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


@contextlib.contextmanager
def triton_path():
    """The prefill kernels launched through Triton's ``kernel[grid]`` on every call (as before ``Relaunch``)."""
    saved = gm._GATED_PREFILL, gm._QUANTIZE_ROWS
    gm._GATED_PREFILL, gm._QUANTIZE_ROWS = gm.gated_prefill_kernel, gm.quantize_rows_kernel
    try:
        yield
    finally:
        gm._GATED_PREFILL, gm._QUANTIZE_ROWS = saved


def fused_op_inputs(m: int, ops_: Operands) -> tuple:
    """(x [m, DIM] bf16, its per-token codes and scales, the fused MLP op's arguments on them as the pass emits
    them: per-token x and h, per-channel weights, silu, bf16, fast accumulation)."""
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = quant.quantize(x, [1, -1])
    row, bf16 = [1, -1], torch.bfloat16
    return x, xq, xs, (xq, xs, ops_.w1, ops_.s1, ops_.w3, ops_.s3, ops_.w2, ops_.s2, None, row, row, row, row, None,
                       "silu", bf16, bf16, True)


def below_autograd(fn):
    """fn() with the autograd dispatch keys excluded, as ``Fp8Backend`` runs graphs compiled under no_grad."""
    def run():
        with torch._C._AutoDispatchBelowAutograd():
            fn()
    return run


def pieces(m: int, ops_: Operands, calls: int, bursts: int, out: list) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, xq, xs, args = fused_op_inputs(m, ops_)
    row, bf16 = [1, -1], torch.bfloat16
    impl = ops.gated_mlp._backend_fns["cuda"]
    h, parts = gm.gated_prefill(xq, xs, ops_.w1, ops_.s1, ops_.w3, ops_.s3, bf16, "silu", True)
    hq, hs = gm.quantize_rows(h, parts)
    i = ops_.w1.shape[0]
    # gated_prefill's own launch (its grid, arguments, constexprs and options), on buffers of its own
    grid, launch_args, launch_kw, _, _ = gm._gated_prefill_launch(xq, xs, ops_.w1, ops_.s1, ops_.w3, ops_.s3, bf16,
                                                                  "silu", True)
    descs = launch_args[:3]  # x, the gate/up pair, h (the last round's half-tile ones, where there are, not timed)
    compiled = gm.gated_prefill_kernel[grid](*launch_args, **launch_kw)
    names = gm.gated_prefill_kernel.arg_names
    positional = (*launch_args, *(launch_kw[n] for n in names[len(launch_args):]))

    def checks():
        ops._check_gated_mlp_args(xq, ops_.w1, ops_.w3, ops_.w2, None, row, row, row, row, None, "silu")
        ops._check_gated_mlp_tensors(xq, xs, ops_.w1, ops_.s1, ops_.w3, ops_.s3, ops_.w2, ops_.s2, row, row, row,
                                     bf16, bf16)
        ops.gated_prefill_reason(m, DIM, i, DIM, row, row, row, row, None, bf16, bf16, xq.device)

    def device_context():
        with torch.cuda.device(xq.device):
            pass

    cases = {
        "op (torch.ops, no_grad)": lambda: ops.gated_mlp(*args),
        "op (torch.ops, below autograd)": below_autograd(lambda: ops.gated_mlp(*args)),
        "op's CUDA function": lambda: impl(*args),
        "fp8fx.ops.direct.gated_mlp (Inductor's call)": lambda: ops.direct.gated_mlp(*args),
        "checks (args, tensors, prefill reason)": checks,
        "gated_prefill": lambda: gm.gated_prefill(xq, xs, ops_.w1, ops_.s1, ops_.w3, ops_.s3, bf16, "silu", True),
        "quantize_rows": lambda: gm.quantize_rows(h, parts),
        "cublas_scaled_mm (down)": lambda: ops.cublas_scaled_mm(hq, hs, ops_.w2, ops_.s2, None, row, row, bf16, True),
        "torch._scaled_mm (down, scales ready)": lambda: torch._scaled_mm(
            hq, ops_.w2.t(), scale_a=hs, scale_b=ops_.s2r, out_dtype=bf16, use_fast_accum=True),
        "gate/up launch, kernel[grid]": lambda: gm.gated_prefill_kernel[grid](*launch_args, **launch_kw),
        "gate/up launch, compiled[grid]": lambda: compiled[grid](*positional),
        "3 TensorDescriptors": lambda: [TensorDescriptor(d.base, d.shape, d.strides, d.block_shape) for d in descs],
        "2 torch.empty": lambda: (torch.empty(m, i, device="cuda", dtype=bf16),
                                  torch.empty(m, parts.shape[1], device="cuda")),
        "torch.cuda.device(x.device) enter/exit": device_context,
        "get_device_properties (before run 28)": (
            lambda: torch.cuda.get_device_properties(xq.device).multi_processor_count),
        "sm_count (its cached lookup since)": lambda: sm_count(xq.device),
        "_gate_up_scales + x_scale prep": lambda: (gm._gate_up_scales(ops_.s1, ops_.s3, i), gm._flat_f32(xs)),
        "_tma_addressable x3 + _compiles_ptx": lambda: ([gm._tma_addressable(t) for t in (xq, ops_.w1, ops_.w3)],
                                                        gm._compiles_ptx(xq)),
        "Relaunch key (gate/up)": lambda: gm._GATED_PREFILL._key(launch_args, launch_kw),
    }
    ab = {"op (torch.ops, below autograd)", "op's CUDA function", "gated_prefill", "quantize_rows"}
    with torch.no_grad():
        for name, fn in cases.items():
            fn()
            row_ = {"M": m, "what": "host ms a call", "case": name, "ms": host_ms(fn, calls, bursts)}
            if name in ab:
                with triton_path():
                    fn()
                    row_["ms_triton_path"] = host_ms(fn, calls, bursts)
            out.append(row_)
            extra = f"  (Triton's path {row_['ms_triton_path']:.4f})" if "ms_triton_path" in row_ else ""
            print(f"M={m} {name:45s} {row_['ms']:.4f} ms{extra}", flush=True)


def make_rev(rev: str, dest: str) -> None:
    """fp8fx at git revision ``rev`` as the package ``fp8fx_rev`` under ``dest``: every whole word ``fp8fx`` in its
    Python files renamed (imports, the op library's name, the logger's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "fp8fx"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    for path in files:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True).stdout
        target = os.path.join(dest, "fp8fx_rev" + path[len("fp8fx"):])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if path.endswith(".py"):
            text = re.sub(rb"\bfp8fx\b", b"fp8fx_rev", text)
        with open(target, "wb") as f:
            f.write(text)
    print(f"fp8fx at {rev} -> {dest}/fp8fx_rev ({len(files)} files)")


def interleaved(m: int, calls: int, rounds: int, out: list, against: str = "") -> None:
    """Host time a call of the fused op through ``torch.ops`` (below autograd) and through ``fp8fx.ops.direct``, and
    of the compiled fused block with and without ``direct_calls``: bursts of each in turn, ``rounds`` times, so that
    the host's drift (which moved single measurements by up to 2x in run 26) falls on all alike. ``against``: a
    directory holding ``fp8fx_rev`` (``make_rev``): its op's CUDA function and fused block join the rounds."""
    fresh = mlp_factory("cuda")
    ops_ = Operands(fresh())
    x, _, _, args = fused_op_inputs(m, ops_)
    blocks_ = {name: fp8fx_module(fresh(), {"fuse_mlp": True, "direct_calls": name.endswith("direct")},
                                  dynamic=False)[0] for name in ("block, direct", "block, dispatcher")}
    fns = {"op, torch.ops": below_autograd(lambda: ops.gated_mlp(*args)),
           "op, direct": below_autograd(lambda: ops.direct.gated_mlp(*args)),
           "op's function, direct": below_autograd(lambda: ops._CUDA_FNS["gated_mlp"](*args)),
           "op's CUDA kernel (checked)": below_autograd(lambda: (ops._gated_mlp_checks(*args),
                                                                 ops._CUDA_FNS["gated_mlp"](*args))),
           **{name: (lambda b: lambda: b(x))(b) for name, b in blocks_.items()}}
    if against:
        sys.path.insert(0, against)
        rev = importlib.import_module("fp8fx_rev")
        importlib.import_module("fp8fx_rev.ops")
        # (the revision's function has the checks in it: set against this tree's direct one, the difference counts
        # them too; against the checked kernel, not)
        fns["op's CUDA function, rev"] = below_autograd(lambda: rev.ops._CUDA_FNS["gated_mlp"](*args))
        module = fresh()
        rev.quantize_(module, rev.Fp8Config())
        block_rev = torch.compile(module, backend=rev.Fp8Backend(fuse_mlp=True), dynamic=False)
        fns["block, direct, rev"] = lambda: block_rev(x)
    times = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(host_ms(fn, calls, 1))
    for name, t in times.items():
        out.append({"M": m, "what": "host ms a call, interleaved", "case": name, "ms": statistics.median(t),
                    "rounds": t})
        print(f"M={m} {name:26s} host {statistics.median(t):.4f} ms a call (median of {rounds} interleaved bursts; "
              f"quartiles {statistics.quantiles(t)[0]:.4f}-{statistics.quantiles(t)[2]:.4f})", flush=True)
    for new, old in (("op's function, direct", "op's CUDA function, rev"),
                     ("op's CUDA kernel (checked)", "op's CUDA function, rev"),
                     ("block, direct", "block, direct, rev")):
        if old in times:
            d = [b - a for a, b in zip(times[new], times[old])]
            print(f"M={m} {new}: {statistics.median(d):.4f} ms a call less than at the revision (median of per-round "
                  f"differences; faster in {sum(v > 0 for v in d)} of {len(d)} rounds)", flush=True)


def blocks(ms: list[int], rounds: int, calls: int, bursts: int, out: list) -> None:
    """The compiled blocks: fused MLP with fp8fx's ops called directly (the default) and through the dispatcher
    (``direct_calls=False``), unfused fp8fx, torchao."""
    fresh = mlp_factory("cuda")
    variants = {
        "fp8fx_fused_mlp": fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)[0],
        "fp8fx_fused_mlp_dispatcher": fp8fx_module(fresh(), {"fuse_mlp": True, "direct_calls": False},
                                                   dynamic=False)[0],
        "fp8fx": fp8fx_module(fresh(), dynamic=False)[0],
    }
    ao, why = torchao_rowwise(fresh())
    if ao is not None:
        variants["torchao_rowwise"] = torch.compile(ao, dynamic=False)
    else:
        print(why, flush=True)
    names = list(variants)
    for m in ms:
        x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for name, fn in variants.items():
                fn(x)
                idle = host_ms(lambda: fn(x), calls, bursts)
                busy = host_ms(lambda: fn(x), calls, bursts, busy_cycles=100_000_000)
                out.append({"M": m, "what": "block host ms a call", "variant": name, "idle": idle, "busy": busy})
                print(f"M={m} {name:32s} host {idle:.4f} ms a call (GPU idle at start), {busy:.4f} (GPU busy)",
                      flush=True)
            times = {n: [] for n in names}
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(bench(variants[name], x, graph=False))
            for name, t in times.items():
                out.append({"M": m, "what": "block ms (bench)", "variant": name, "ms": statistics.median(t),
                            "rounds": t})
                print(f"M={m} {name:32s} {statistics.median(t):.4f} ms (median of {rounds})", flush=True)
            # plain calls against CUDA-graph replays of the same call, both after do_bench's flush: where the plain
            # call is slower, the host (launch gaps), not the kernels, set its time
            for name in variants:
                plain, replay = [], []
                graph = capture(variants[name], x)
                for _ in range(3):
                    plain.append(plain_ms(lambda: variants[name](x)))
                    replay.append(replay_ms(graph, l2_flushes()["dirty"], 100))
                del graph
                row = {"M": m, "what": "plain vs graph ms", "variant": name, "plain": statistics.median(plain),
                       "graph": statistics.median(replay)}
                out.append(row)
                print(f"M={m} {name:32s} plain {row['plain']:.4f} ms, CUDA-graph replay {row['graph']:.4f} ms "
                      f"(same flush)", flush=True)
            if "torchao_rowwise" in times:
                ao_t = times["torchao_rowwise"]
                for name in ("fp8fx_fused_mlp", "fp8fx_fused_mlp_dispatcher", "fp8fx"):
                    ratios = [a / b for a, b in zip(ao_t, times[name])]
                    print(f"M={m} {name} vs torchao: median of per-round ratios {statistics.median(ratios):.3f}x "
                          f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="2048,4096")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--bursts", type=int, default=15)
    p.add_argument("--no-blocks", action="store_true")
    p.add_argument("--no-pieces", action="store_true")
    p.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                   help="the op and the fused block with and without direct calls, in interleaved bursts")
    p.add_argument("--against", default="", metavar="DIR", help="a directory holding fp8fx_rev (--make-rev)")
    p.add_argument("--make-rev", nargs=2, metavar=("REV", "DIR"), help="copy fp8fx at REV into DIR, then exit")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.make_rev:
        return make_rev(*args.make_rev)
    ms = [int(v) for v in args.ms.split(",")]
    out: list = []
    try:
        if not args.no_pieces:
            ops_ = Operands(mlp_factory("cuda")())
            for m in ms:
                pieces(m, ops_, args.calls, args.bursts, out)
            del ops_
        if args.interleaved:
            for m in ms:
                interleaved(m, args.calls, args.interleaved, out, args.against)
        if not args.no_blocks:
            blocks(ms, args.rounds, args.calls, args.bursts, out)
    finally:
        with open(os.path.join(args.out, "host_study.json"), "w") as f:
            json.dump({"torch": torch.__version__, "rows": out}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
