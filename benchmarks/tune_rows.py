"""Warps of the one-pass (persistent) row reductions that ``Fp8Backend(one_pass_rows=...)`` asks of Inductor:
the Llama-3-8B MLP block at prefill M, with ``compat.one_pass_warps`` pinned per row length, against
Inductor's own heuristic (8 warps for rows of 4096, 16 for 14336). Per setting: the block's median ms
(L2 flushed before every call) and the GPU time of each Triton kernel.

    python benchmarks/tune_rows.py [--m 4096] [--warps 4,8,16,32]
"""
from __future__ import annotations

import argparse

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import fp8fx
from benchmarks.bench_linear import MLP
from fp8fx.lowerings import compat


def triton_kernel_times(fn, x, steps=10) -> dict[str, float]:
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn(x)
            torch.cuda.synchronize()
    return {e.key[:60]: e.device_time_total / steps / 1000 for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.key.startswith("triton_")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="4096")
    p.add_argument("--warps", default="4,8,16,32")
    args = p.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    settings = [{}] + [{14336: w} for w in warps] + [{4096: w} for w in warps]
    torch.manual_seed(0)
    base = MLP().cuda().to(torch.bfloat16)
    fp8fx.quantize_(base, fp8fx.Fp8Config())
    inherited = compat.one_pass_warps
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        ref = None
        for setting in settings:
            compat.one_pass_warps = lambda rnumel, s=setting: s.get(rnumel, inherited(rnumel))
            torch._dynamo.reset()
            # the FX-graph cache cannot see a patched function: compile afresh
            fn = torch.compile(base, backend=fp8fx.Fp8Backend(inductor_config={"fx_graph_cache": False}))
            with torch.no_grad():
                out = fn(x)
                if ref is None:
                    ref = out
                same = torch.equal(out, ref)
                ms = triton.testing.do_bench(lambda: fn(x), warmup=10, rep=100, return_mode="median")
            kernels = " ; ".join(f"{k} {v:.4f}" for k, v in sorted(triton_kernel_times(fn, x).items()))
            print(f"M={m} warps {setting or 'Inductor'}: block {ms:.4f} ms, output {'equal' if same else 'DIFFERS'} | "
                  f"{kernels}", flush=True)
    compat.one_pass_warps = inherited


if __name__ == "__main__":
    main()
