"""Why does the decode MLP block's bf16 anchor move between device calls? (Runs 17-21 at M = 1: bf16 Inductor
0.0864-0.0987 ms, fp8fx's fused MLP 0.0532-0.0544.) One process, the Llama-3-8B MLP at M = 1: two separate
``torch.compile``s of the bf16 module, the bf16 module eager (cuBLAS), and fp8fx's fused MLP, as CUDA-graph replays
after a clean L2 flush in interleaved rounds; then the kernels each runs (``profile_mlp.kernel_table``).

    PYTHONPATH=. python benchmarks/anchor_study.py [--m 1] [--rounds 7]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_linear import bench, fp8fx_module, mlp_factory
from benchmarks.profile_mlp import kernel_table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    fresh = mlp_factory("cuda")

    variants = {"bf16 Inductor A": torch.compile(fresh(), dynamic=False),
                "bf16 Inductor B": torch.compile(fresh(), dynamic=False),
                "bf16 eager": fresh(),
                "fp8fx fused MLP": fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)[0]}
    x = torch.randn(args.m, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for fn in variants.values():
            fn(x)
        times = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 else list(variants)[::-1]):
                times[name].append(bench(variants[name], x, True))
    for name, t in times.items():
        t = sorted(t)
        print(f"M={args.m} {name}: median {t[len(t) // 2]:.4f} ms (rounds {t[0]:.4f}-{t[-1]:.4f})", flush=True)
    for name, fn in variants.items():
        print(f"== {name}\n{kernel_table(fn, x)}", flush=True)


if __name__ == "__main__":
    main()
