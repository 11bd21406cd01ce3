"""Does the L2 flush before each timed call add to the decode MLP block's time? ``do_bench`` flushes by
zeroing a 256 MB buffer, which leaves the 50 MB L2 full of dirty lines for the timed kernels to write back
to HBM while they stream their weights; a read of the same buffer leaves clean lines (as a previous layer's
weights would). CUDA-graph replays, median ms, for fp8fx (fused MLP), torchao row-wise and bf16 Inductor.
Run 12 (RESULTS.md): the zeroing flush added 0.004-0.009 ms to every replay, none at all gave the clean
flush's times; ``bench_linear.bench`` has timed replays after the clean flush since.

    python benchmarks/flush_study.py [--ms 1,16]
"""
from __future__ import annotations

import argparse

import torch

import fp8fx
from benchmarks.bench_linear import MLP, capture, l2_flushes, replay_ms, torchao_rowwise


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,16")
    args = p.parse_args()
    flushes = l2_flushes()
    torch.manual_seed(0)
    base = MLP().cuda().to(torch.bfloat16)
    state = base.state_dict()
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        times = {}
        # fp8fx first: bf16 Inductor's compile at M=1 once took 306 s (run 11), so it goes last
        for name in ("fp8fx fused MLP", "torchao row-wise", "bf16 Inductor"):
            mod = MLP().cuda().to(torch.bfloat16)
            mod.load_state_dict(state)
            if name == "bf16 Inductor":
                fn = torch.compile(mod, dynamic=False)
            elif name == "torchao row-wise":
                mod, why = torchao_rowwise(mod)
                if mod is None:
                    print(why)
                    continue
                fn = torch.compile(mod, dynamic=False)
            else:
                fp8fx.quantize_(mod, fp8fx.Fp8Config())
                fn = torch.compile(mod, backend=fp8fx.Fp8Backend(fuse_mlp=True), dynamic=False)
            with torch.no_grad():
                g = capture(fn, x)
                for _ in range(10):
                    g.replay()
                times[name] = {f: replay_ms(g, flush) for f, flush in flushes.items()}
            print(f"M={m} {name}: " + ", ".join(f"{f} {t:.4f} ms" for f, t in times[name].items()), flush=True)
        fx = times["fp8fx fused MLP"]
        for other in (n for n in times if n != "fp8fx fused MLP"):
            print(f"M={m} fp8fx fused MLP vs {other}: " + ", ".join(
                f"{f} {times[other][f] / fx[f]:.2f}x" for f in flushes), flush=True)


if __name__ == "__main__":
    main()
