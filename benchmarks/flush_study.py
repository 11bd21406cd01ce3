"""Does the L2 flush before each timed call add to the decode MLP block's time? ``do_bench`` flushes by
zeroing a 256 MB buffer, which may leave the 50 MB L2 full of dirty lines for the timed kernels to write
back to HBM while they stream their weights (a candidate for the ~0.012 ms of every replay that no kernel
covers, RESULTS.md runs 10-11); a read of the same buffer leaves clean lines (as a previous layer's weights
would). CUDA-graph replays, median ms, for bf16 Inductor and fp8fx (fused MLP). Not yet run on the GPU.

    python benchmarks/flush_study.py [--ms 1,16]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import fp8fx
from benchmarks.bench_linear import MLP, capture


def replay_ms(g: torch.cuda.CUDAGraph, flush, reps=200) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,16")
    args = p.parse_args()
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flushes = {"dirty (zero_, as do_bench)": buf.zero_, "clean (a read)": buf.sum,
               "none": lambda: None}
    torch.manual_seed(0)
    base = MLP().cuda().to(torch.bfloat16)
    state = base.state_dict()
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        times = {}
        for name in ("bf16 Inductor", "fp8fx fused MLP"):
            mod = MLP().cuda().to(torch.bfloat16)
            mod.load_state_dict(state)
            if name == "bf16 Inductor":
                fn = torch.compile(mod, dynamic=False)
            else:
                fp8fx.quantize_(mod, fp8fx.Fp8Config())
                fn = torch.compile(mod, backend=fp8fx.Fp8Backend(fuse_mlp=True), dynamic=False)
            with torch.no_grad():
                g = capture(fn, x)
                for _ in range(10):
                    g.replay()
                times[name] = {f: replay_ms(g, flush) for f, flush in flushes.items()}
        for f in flushes:
            bf16, fx = times["bf16 Inductor"][f], times["fp8fx fused MLP"][f]
            print(f"M={m} flush {f}: bf16 Inductor {bf16:.4f} ms, fp8fx fused MLP {fx:.4f} ms, {bf16 / fx:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
