"""Where the time goes: kernel-level profile of the Llama-3-8B MLP block (fp8fx vs torchao), and
Inductor's generated code for fp8fx, written under --out.

    python benchmarks/profile_mlp.py --out DIR [--m 4096] [--max-autotune] [--coordinate-descent]
                                     [--fuse-horizontal] [--fuse-mlp] [--h-group G] [--fp8fx-only]

Each table ends with the block's time as a CUDA-graph replay next to the sum of its kernels' GPU times:
at decode sizes the difference is what the launches between kernels cost.
"""
from __future__ import annotations

import argparse
import os

import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

import fp8fx
from benchmarks.bench_linear import FALLBACKS, MLP, bench, torchao_rowwise


def profiled(fn, x, steps=10):
    """torch.profiler's record of ``steps`` calls of ``fn(x)`` on the GPU, after three warm-up calls."""
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn(x)
            torch.cuda.synchronize()
    return prof


def per_call(prof, calls: int):
    """``prof``'s GPU events (torch.profiler) in start order, cut into ``calls`` lists, one call's kernels each; or a
    str saying why they do not cut so (a count that is no multiple of ``calls``, calls that ran other kernels)."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events or len(events) % calls:
        return f"({len(events)} GPU events in {calls} calls: not a whole number a call)"
    per = len(events) // calls
    groups = [events[i * per:(i + 1) * per] for i in range(calls)]
    if any([e.name for e in group] != [e.name for e in groups[0]] for group in groups):
        return "(the calls launched different kernels)"
    return groups


def kernel_table(fn, x, steps=10):
    prof = profiled(fn, x, steps)
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            rows.append((e.device_time_total / steps / 1000, e.count // steps, e.key[:110]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    fallbacks = len(FALLBACKS)
    with torch.no_grad():
        replay = bench(fn, x, True)
    how = "CUDA-graph replay" if len(FALLBACKS) == fallbacks else "plain calls (graph capture failed)"
    launches = sum(r[1] for r in rows)
    return "\n".join([f"total {total:.4f} ms/step in {launches} kernels; {how} {replay:.4f} ms"]
                     + [f"{ms:8.4f} ms  x{n}  {name}" for ms, n, name in rows])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="profile_out")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--max-autotune", action="store_true")
    p.add_argument("--coordinate-descent", action="store_true",
                   help="Inductor's coordinate_descent_tuning for fp8fx's graph (its reduction and pointwise kernels)")
    p.add_argument("--fuse-horizontal", action="store_true", help="Fp8Backend(fuse_horizontal=True): gate/up as one GEMM")
    p.add_argument("--fuse-mlp", action="store_true", help="Fp8Backend(fuse_mlp=True): the MLP in two kernels (decode)")
    p.add_argument("--h-group", type=int, default=0,
                   help="with --fuse-mlp: Fp8Backend(mlp_h_group=G), h quantized in 1 x G groups (0: the backend's "
                        "default, mlp_h_group='auto': 1x32 groups at one token, 1x128 from two)")
    p.add_argument("--fp8fx-only", action="store_true", help="no torchao and bf16 tables (their compiles take ~1 min)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(args.m, 4096, device="cuda", dtype=torch.bfloat16)
    base = MLP().cuda().to(torch.bfloat16)
    state = base.state_dict()

    def fresh():
        m = MLP().cuda().to(torch.bfloat16)
        m.load_state_dict(state)
        return m

    cfg = {"max_autotune": True} if args.max_autotune else {}
    if args.coordinate_descent:
        cfg["coordinate_descent_tuning"] = True
    mod = fresh()
    fp8fx.quantize_(mod, fp8fx.Fp8Config())
    backend = fp8fx.Fp8Backend(inductor_config=cfg, fuse_horizontal=args.fuse_horizontal, fuse_mlp=args.fuse_mlp,
                               **({"mlp_h_group": args.h_group} if args.h_group else {}))
    fn = torch.compile(mod, backend=backend)
    with torch.no_grad():
        _, code = run_and_get_code(fn, x)
    tag = "fp8fx" + "".join(suffix for on, suffix in (
        (args.max_autotune, "_autotune"), (args.coordinate_descent, "_cd"), (args.fuse_horizontal, "_fused"),
        (args.fuse_mlp, "_mlp"), (args.fuse_mlp and args.h_group, f"_g{args.h_group}")) if on)
    with open(os.path.join(args.out, f"{tag}_code.py"), "w") as f:
        f.write("\n\n# ----\n\n".join(code))
    report = [f"== {tag} M={args.m}", kernel_table(fn, x)]
    ao, why = (None, "torchao and bf16: --fp8fx-only") if args.fp8fx_only else torchao_rowwise(fresh())
    if ao is not None:
        ao_fn = torch.compile(ao, mode="max-autotune-no-cudagraphs" if args.max_autotune else None)
        with torch.no_grad():
            _, code = run_and_get_code(ao_fn, x)
        with open(os.path.join(args.out, "torchao_code.py"), "w") as f:
            f.write("\n\n# ----\n\n".join(code))
        report += [f"== torchao M={args.m}", kernel_table(ao_fn, x)]
    else:
        report.append(why)
    if not args.fp8fx_only:
        bf16 = torch.compile(fresh(), mode="max-autotune-no-cudagraphs" if args.max_autotune else None)  # as torchao
        report += [f"== bf16 Inductor M={args.m}", kernel_table(bf16, x)]
    text = "\n".join(report)
    print(text)
    with open(os.path.join(args.out, f"{tag}_profile.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
