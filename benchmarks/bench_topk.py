"""fp8fx.topk (one launch) against torch.topk (a radix select, and a sort when sorted) on MoE routers' rows.

    python benchmarks/bench_topk.py [--out DIR] [--rounds 5]
    python benchmarks/bench_topk.py --cpu-smoke   # the kernel under TRITON_INTERPRET=1 against torch, no timing

Each row: rows x n, k, dtype; torch.topk sorted (the default, what HF's routers call) and unsorted, and fp8fx.topk
(sorted), timed as CUDA-graph replays (bench_linear's ``timer``: after a read of 256 MB), ``rounds`` interleaved
rounds, medians. Checked first: fp8fx's values equal torch's sorted values, bit for bit, and each index points at its
value. Writes topk.json; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8fx.kernels import topk as kernel  # noqa: E402

# (rows, n, k): routers' top-k at decode and prefill token counts (Qwen3-30B-A3B / Nemotron-3-Nano: 128 experts, top
# 8 / 6; GPT-OSS-20B: 32, top 4; DeepSeek-V3: 256, top 8, and its 8 groups' top 2 of 32; Qwen3-Next: 512, top 10)
SHAPES = [(1, 128, 8), (4, 128, 8), (16, 128, 8), (64, 128, 8), (256, 128, 8), (2048, 128, 8), (1, 32, 4),
          (64, 32, 4), (1, 256, 8), (64, 256, 8), (8, 32, 2), (1, 512, 10), (64, 512, 10)]
SMOKE = [(1, 128, 8), (3, 32, 4), (2, 100, 7), (5, 512, 10), (2, 8, 8)]


def check(x: torch.Tensor, k: int) -> bool:
    values, indices = kernel.topk(x, k)
    ref = torch.topk(x, k)
    return torch.equal(values, ref.values) and torch.equal(torch.gather(x, -1, indices), values) \
        and bool((indices.sort(-1).values.diff(dim=-1) > 0).all())  # (distinct indices)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    rows, ok = [], True
    for rows_n, n, k in SMOKE if args.cpu_smoke else SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(rows_n * n + k)
            x = torch.randn(rows_n, n, device=device).softmax(-1).to(dtype)  # (a router's probabilities: ties in bf16)
            row = dict(rows=rows_n, n=n, k=k, dtype=str(dtype).removeprefix("torch."), ok=check(x, k))
            ok &= row["ok"]
            if device == "cuda":
                from bench_linear import timed_in_rounds, timer

                fns = {"torch_sorted_ms": lambda x: torch.topk(x, k), "torch_unsorted_ms": lambda x: torch.topk(
                       x, k, sorted=False), "fp8fx_ms": lambda x: kernel.topk(x, k)}
                times = timed_in_rounds({name: timer(fn, x, True) for name, fn in fns.items()}, args.rounds)
                row.update({name: statistics.median(t) for name, t in times.items()})
                row["vs_torch_sorted"] = row["torch_sorted_ms"] / row["fp8fx_ms"]
                row["vs_torch_unsorted"] = row["torch_unsorted_ms"] / row["fp8fx_ms"]
            rows.append(row)
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "topk.json"), "w") as f:
        json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
