"""An MoE router's steps alone: fp8fx.topk (one launch) against torch.topk (a radix select, and a sort when
sorted), fp8fx.small_mm (one launch) against torch's linear (cuBLAS) for the router's logits, and a softmax router's
softmax, top-k and normalization compiled three ways.

    python benchmarks/bench_routing.py [--out DIR] [--rounds 5]
    python benchmarks/bench_routing.py --cpu-smoke   # the kernels under TRITON_INTERPRET=1 against torch, no timing

Top-k rows: rows x n, k, dtype; torch.topk sorted (the default, what HF's routers call) and unsorted, and fp8fx.topk
(sorted). Checked: fp8fx's values equal torch's sorted values, bit for bit, and each index points at its value.
Router rows: tokens x H by E experts' [E, H] weight (bias or not), dtype; torch's linear and fp8fx.small_mm. Checked:
within 1e-2 (bf16) / 1e-5 (float32) of the float64 product, relative to its largest value. Softmax-router rows:
tokens x E logits, k, form (Qwen3-MoE's: a float32 softmax, its top-k renormalized and cast to bf16; GPT-OSS's: the
softmax of the k top logits; Mixtral's: float32 weights; Qwen2-MoE's: not renormalized), each compiled by Inductor
alone (torch's top-k), with ``Fp8Backend(fuse_routing=False)`` (fp8fx.topk between Inductor's softmax and
normalization) and ``Fp8Backend()`` (fp8fx.softmax_topk, one launch). Checked: the ids torch's, the weights within
1e-5 (float32) / 2^-8 (bf16; 2^-7 under the interpreter, which truncates) of the float64 softmax's, relative. Each
timed as CUDA-graph
replays (bench_linear's ``timer``: after a read of 256 MB), ``rounds`` interleaved rounds, medians. Writes
routing.json; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8fx.kernels import small_mm as router_kernel  # noqa: E402
from fp8fx.kernels import topk as kernel  # noqa: E402

# (rows, n, k): routers' top-k at decode and prefill token counts (Qwen3-30B-A3B / Nemotron-3-Nano: 128 experts, top
# 8 / 6; GPT-OSS-20B: 32, top 4; DeepSeek-V3: 256, top 8, and its 8 groups' top 2 of 32; Qwen3-Next: 512, top 10)
SHAPES = [(1, 128, 8), (4, 128, 8), (16, 128, 8), (64, 128, 8), (256, 128, 8), (2048, 128, 8), (1, 32, 4),
          (64, 32, 4), (1, 256, 8), (64, 256, 8), (8, 32, 2), (1, 512, 10), (64, 512, 10)]
SMOKE = [(1, 128, 8), (3, 32, 4), (2, 100, 7), (5, 512, 10), (2, 8, 8)]
# (tokens, H, E, bias, weight dtype): Qwen3-30B-A3B's router, GPT-OSS-20B's (a bias), Nemotron-3-Nano's (float32, on
# the 16-bit hidden states' cast), DeepSeek-V3's
ROUTERS = [(t, h, e, b, d) for t in (1, 2, 4) for h, e, b, d in (
    (2048, 128, False, torch.bfloat16), (2880, 32, True, torch.bfloat16), (2688, 128, False, torch.float32),
    (7168, 256, False, torch.bfloat16))]
ROUTERS_SMOKE = [(1, 96, 8, False, torch.bfloat16), (3, 64, 4, True, torch.bfloat16), (5, 80, 16, False, torch.float32)]
# (tokens, E, k, form): Qwen3-30B-A3B's router (128, top 8), GPT-OSS-20B's (32, top 4), Mixtral's (8, top 2),
# Qwen1.5-MoE-A2.7B's (60, top 4, not renormalized)
SOFTMAX_ROUTERS = [(t, e, k, form) for t in (1, 64) for e, k, form in (
    (128, 8, "qwen3"), (32, 4, "gpt_oss"), (8, 2, "mixtral"), (60, 4, "qwen2"))]
SOFTMAX_SMOKE = [(1, 128, 8, "qwen3"), (3, 32, 4, "gpt_oss"), (2, 8, 2, "mixtral"), (2, 60, 4, "qwen2")]


def softmax_router(form: str, k: int):
    """HF's softmax router of ``form`` from the logits: (weights, ids)."""
    def route(logits):
        if form == "gpt_oss":
            top, ids = torch.topk(logits, k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype), ids
        probs = torch.softmax(logits.float() if form == "mixtral" else logits, -1, dtype=torch.float)
        top, ids = torch.topk(probs, k, dim=-1)
        if form == "qwen2":
            return top, ids
        top = top / top.sum(dim=-1, keepdim=True)
        return (top, ids) if form == "mixtral" else (top.to(logits.dtype), ids)
    return route


def check_softmax_router(logits: torch.Tensor, k: int, form: str, weights, ids) -> float:
    """The weights' relative error against the float64 softmax at torch's ids; inf where the ids are not torch's."""
    want_ids = torch.topk(logits.float(), k).indices
    if not torch.equal(ids, want_ids):
        return float("inf")
    probs = torch.gather(torch.softmax(logits.double(), -1), -1, want_ids)
    ref = probs if form == "qwen2" else probs / probs.sum(-1, keepdim=True)
    return ((weights.double() - ref).abs() / ref).max().item()


def check_router(x: torch.Tensor, w: torch.Tensor, b) -> float:
    """fp8fx.small_mm's relative error against the float64 linear (its largest value)."""
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    return ((router_kernel.small_mm(x, w, b, w.dtype).double() - ref).abs().max() / ref.abs().max()).item()


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
    for tokens, h, e, bias, dtype in ROUTERS_SMOKE if args.cpu_smoke else ROUTERS:
        torch.manual_seed(tokens * h + e)
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        w = (torch.randn(e, h, device=device) / h ** 0.5).to(dtype)
        b = torch.randn(e, device=device, dtype=dtype) if bias else None
        err = check_router(x, w, b)  # (past the kernel's MAX_ROWS / MAX_X the op takes torch's: timed all the same)
        row = dict(router=f"{tokens}x{h} by {e}", bias=bias, dtype=str(dtype).removeprefix("torch."), err=err,
                   ok=err < (1e-5 if dtype == torch.float32 else 1e-2))
        ok &= row["ok"]
        if device == "cuda":
            from bench_linear import timed_in_rounds, timer

            fns = {"torch_ms": lambda x: torch.nn.functional.linear(x.to(dtype), w, b),
                   "fp8fx_ms": lambda x: router_kernel.small_mm(x, w, b, dtype)}
            times = timed_in_rounds({name: timer(fn, x, True) for name, fn in fns.items()}, args.rounds)
            row.update({name: statistics.median(t) for name, t in times.items()})
            row["vs_torch"] = row["torch_ms"] / row["fp8fx_ms"]
        rows.append(row)
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    for tokens, e, k, form in SOFTMAX_SMOKE if args.cpu_smoke else SOFTMAX_ROUTERS:
        torch.manual_seed(tokens * e + k)
        logits = (torch.randn(tokens, e, device=device) * 2).to(torch.bfloat16)
        if device == "cpu":  # the kernel alone, under the interpreter
            weights, ids = kernel.softmax_topk(logits, k, form != "qwen2", torch.float32 if form in (
                "mixtral", "qwen2") else torch.bfloat16)
            compiled = {"fp8fx": lambda x: (weights, ids)}
        else:
            import fp8fx

            route = softmax_router(form, k)
            compiled = {"inductor": torch.compile(route, dynamic=False), "fp8fx_unfused": torch.compile(
                route, backend=fp8fx.Fp8Backend(fuse_routing=False), dynamic=False),
                "fp8fx": torch.compile(route, backend=fp8fx.Fp8Backend(), dynamic=False)}
        errs = {name: check_softmax_router(logits, k, form, *fn(logits)) for name, fn in compiled.items()}
        # float32: its exponentials' rounding; bf16: one rounding to nearest, 2^-8 relative (the interpreter
        # truncates: 2^-7)
        bound = 1e-5 if form in ("mixtral", "qwen2") else 2 ** -8 + 1e-5 if device == "cuda" else 2 ** -7
        row = dict(softmax_router=form, tokens=tokens, e=e, k=k, **{f"err_{n}": v for n, v in errs.items()},
                   ok=all(v <= bound for v in errs.values()))
        ok &= row["ok"]
        if device == "cuda":
            from bench_linear import timed_in_rounds, timer

            times = timed_in_rounds({name: timer(fn, logits, True) for name, fn in compiled.items()}, args.rounds)
            row.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
            row["vs_inductor"] = row["inductor_ms"] / row["fp8fx_ms"]
            row["vs_unfused"] = row["fp8fx_unfused_ms"] / row["fp8fx_ms"]
        rows.append(row)
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "routing.json"), "w") as f:
        json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
