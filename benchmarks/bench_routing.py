"""An MoE router's steps alone: fp8fx.topk (one launch) against torch.topk (a radix select, and a sort when
sorted), fp8fx.small_mm (one launch) against torch's linear (cuBLAS) for the router's logits, and a whole softmax
router (linear, softmax, top-k, normalization) compiled three ways.

    python benchmarks/bench_routing.py [--out DIR] [--rounds 5] [--parts topk,router,softmax,grouped]
    python benchmarks/bench_routing.py --cpu-smoke   # the kernels under TRITON_INTERPRET=1 against torch, no timing

Top-k rows: rows x n, k, dtype; torch.topk sorted (the default, what HF's routers call) and unsorted, and fp8fx.topk
(sorted). Checked: fp8fx's values equal torch's sorted values, bit for bit, and each index points at its value.
Router rows: tokens x H by E experts' [E, H] weight (bias or not), dtype; torch's linear and fp8fx.small_mm. Checked:
within 1e-2 (bf16) / 1e-5 (float32) of the float64 product, relative to its largest value. Softmax-router rows:
tokens x H hidden states to E experts, k, form (Qwen3-MoE's: a float32 softmax, its top-k renormalized and cast to
bf16; GPT-OSS's: a bias, the softmax of the k top logits; Mixtral's: float32 weights; Qwen2-MoE's: not renormalized),
a bf16 router compiled by Inductor alone (cuBLAS, torch's top-k), with ``Fp8Backend(fuse_routing=False)``
(fp8fx.small_mm, Inductor's softmax, fp8fx.topk, Inductor's normalization) and ``Fp8Backend()`` (fp8fx.small_mm,
then fp8fx.softmax_topk: two launches). Checked for each: the ids a top-k of the float64 logits up to their bf16
rounding, the weights within that rounding's effect (and a bf16 weight's own rounding) of the float64 router's. Each
timed as CUDA-graph replays
(bench_linear's ``timer``: after a read of 256 MB), ``rounds`` interleaved rounds, medians. Grouped-router rows:
DeepSeek-V3's sigmoid routing from float32 logits (and Nemotron-3-Nano's, one group), the same three ways
(``Fp8Backend()``: fp8fx.grouped_topk, one launch); checked: the experts the float64 router's (as sets), the weights
within 1e-5 of its.
Writes routing.json; exits 1 if a check fails.
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
# (tokens, H, E, k, bias, form): Qwen3-30B-A3B's router (128, top 8), GPT-OSS-20B's (32, top 4, a bias), Mixtral's
# (8, top 2), Qwen1.5-MoE-A2.7B's (60, top 4, not renormalized)
SOFTMAX_ROUTERS = [(t, *r) for t in (1, 4) for r in ((2048, 128, 8, False, "qwen3"), (2880, 32, 4, True, "gpt_oss"),
                                                   (4096, 8, 2, False, "mixtral"), (2048, 60, 4, False, "qwen2"))]
SOFTMAX_SMOKE = [(1, 96, 128, 8, False, "qwen3"), (3, 64, 32, 4, True, "gpt_oss"), (2, 80, 8, 2, False, "mixtral"),
                 (2, 48, 60, 4, False, "qwen2")]


class SoftmaxRouter(torch.nn.Module):
    """HF's softmax router of ``form`` (its weight tagged as ``quantize_`` tags a router's): (weights, ids)."""

    def __init__(self, h: int, e: int, k: int, bias: bool, form: str):
        super().__init__()
        from fp8fx.weights.moe import router_reason

        self.gate = torch.nn.Linear(h, e, bias=bias)
        self.gate.weight._fp8fx_skip_reason = router_reason("experts")
        self.k, self.form = k, form

    def forward(self, x):
        logits = self.gate(x)
        if self.form == "gpt_oss":
            top, ids = torch.topk(logits, self.k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype), ids
        probs = torch.softmax(logits.float() if self.form == "mixtral" else logits, -1, dtype=torch.float)
        top, ids = torch.topk(probs, self.k, dim=-1)
        if self.form == "qwen2":
            return top, ids
        top = top / top.sum(dim=-1, keepdim=True)
        return (top, ids) if self.form == "mixtral" else (top.to(logits.dtype), ids)


def check_softmax_router(router: SoftmaxRouter, x: torch.Tensor, weights, ids) -> tuple[float, bool]:
    """(the weights' largest relative error against the float64 router's at ``ids``; whether ``ids`` are a top-k of
    the float64 logits up to their 16-bit rounding: 2^-8 of the largest logit)."""
    w, b = router.gate.weight.double(), router.gate.bias
    logits = torch.nn.functional.linear(x.double(), w, None if b is None else b.double())
    chosen = torch.gather(logits, -1, ids)
    left = logits.scatter(-1, ids, float("-inf"))
    valid = bool((chosen.amin(-1) >= left.amax(-1) - 2 ** -8 * logits.abs().amax(-1)).all())
    probs = torch.gather(torch.softmax(logits, -1), -1, ids)
    ref = probs if router.form == "qwen2" else probs / probs.sum(-1, keepdim=True)
    return ((weights.double() - ref).abs() / ref).max().item(), valid


# (tokens, E, groups, kept groups, k, scale): DeepSeek-V3's sigmoid router (256 experts in 8 groups, 4 kept, top 8,
# x2.5), Nemotron-3-Nano's (128, one group, top 6)
GROUPED_ROUTERS = [(t, *r) for t in (1, 4, 64) for r in ((256, 8, 4, 8, 2.5), (128, 1, 1, 6, 1.0))]
GROUPED_SMOKE = [(1, 256, 8, 4, 8, 2.5), (3, 128, 1, 1, 6, 1.0)]


class GroupedRouter(torch.nn.Module):
    """DeepSeek-V3's routing from its float32 logits, as transformers 5 writes it (Nemotron-H's is the same; the tests
    of fp8fx.passes.topk compile it too)."""

    def __init__(self, groups: int, topk_group: int, k: int, scale: float = 2.5, fill: float = float("-inf")):
        super().__init__()
        self.groups, self.topk_group, self.k, self.scale, self.fill = groups, topk_group, k, scale, fill

    def forward(self, logits, bias):
        e = logits.shape[-1]
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, self.groups, e // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        mask = group_mask.unsqueeze(-1).expand(-1, self.groups, e // self.groups).reshape(-1, e)
        ids = torch.topk(choice.masked_fill(~mask.bool(), self.fill), k=self.k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scale, ids


def check_grouped(router: GroupedRouter, logits, bias, weights, ids) -> float:
    """The weights' largest relative error against the float64 router's at the same experts; inf where the experts
    (as sets: the graph's top-k is unsorted) are not the float64 router's."""
    want_w, want_ids = router(logits.double(), bias.double())
    order, got = want_ids.sort(-1), ids.sort(-1)
    if not torch.equal(order.values, got.values):
        return float("inf")
    want = want_w.gather(-1, order.indices)
    return ((weights.gather(-1, got.indices).double() - want).abs() / want).max().item()


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
    p.add_argument("--parts", default="topk,router,softmax,grouped",
                   help="which rows: top-k, router linear, softmax router, grouped sigmoid router")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    device = "cpu" if args.cpu_smoke else "cuda"
    rows, ok = [], True
    for rows_n, n, k in (SMOKE if args.cpu_smoke else SHAPES) if "topk" in parts else ():
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
    for tokens, h, e, bias, dtype in (ROUTERS_SMOKE if args.cpu_smoke else ROUTERS) if "router" in parts else ():
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
    for tokens, h, e, k, bias, form in (SOFTMAX_SMOKE if args.cpu_smoke else SOFTMAX_ROUTERS) if "softmax" in parts \
            else ():
        torch.manual_seed(tokens * e + k)
        router = SoftmaxRouter(h, e, k, bias, form).to(device, torch.bfloat16).eval()
        with torch.no_grad():
            router.gate.weight.mul_(3)  # (logits of a few units, as trained routers give)
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        out_dtype = torch.float32 if form in ("mixtral", "qwen2") else torch.bfloat16
        if device == "cpu":  # the kernels alone, under the interpreter
            logits = router_kernel.small_mm(x, router.gate.weight, router.gate.bias, torch.bfloat16)
            got = kernel.softmax_topk(logits, k, form != "qwen2", out_dtype)
            compiled = {"fp8fx": lambda x, got=got: got}
        else:
            import fp8fx

            # (one forward, compiled afresh for each row: past Dynamo's recompile limit, 8 compiles of one code
            # object, it runs the rest eagerly - run 52's calls 2-3 timed rows past the 8th so)
            torch._dynamo.reset()
            backend = fp8fx.Fp8Backend()
            compiled = {"inductor": torch.compile(router, dynamic=False), "fp8fx_unfused": torch.compile(
                router, backend=fp8fx.Fp8Backend(fuse_routing=False), dynamic=False),
                "fp8fx": torch.compile(router, backend=backend, dynamic=False)}
        row = dict(softmax_router=form, tokens=tokens, h=h, e=e, k=k)
        with torch.no_grad():
            for name, fn in compiled.items():
                row[f"err_{name}"], row[f"ids_{name}"] = check_softmax_router(router, x, *fn(x))
        # the logits' 16-bit rounding (2^-9 of the largest, in two logits' difference) moves a weight by up to
        # exp(2^-8 max |logit|) - 1; a bf16 weight's own rounding adds 2^-8 (the interpreter truncates: 2^-7)
        top = router.gate(x).abs().max().item()
        bound = (2 ** -8 if device == "cuda" else 2 ** -7) * (out_dtype == torch.bfloat16) + 2 ** -8 * top * 1.1
        row["ok"] = all(row[f"err_{n}"] <= bound and row[f"ids_{n}"] for n in compiled)
        if device == "cuda":  # (and the fp8fx column ran the op: a form the pass missed would time the steps apart)
            row["ok"] &= [s.kernel for s in backend.report.topk] == ["extern fp8fx.softmax_topk"]
        ok &= row["ok"]
        if device == "cuda":
            from bench_linear import timed_in_rounds, timer

            with torch.no_grad():
                times = timed_in_rounds({name: timer(fn, x, True) for name, fn in compiled.items()}, args.rounds)
            row.update({f"{name}_ms": statistics.median(t) for name, t in times.items()})
            row["vs_inductor"] = row["inductor_ms"] / row["fp8fx_ms"]
            row["vs_unfused"] = row["fp8fx_unfused_ms"] / row["fp8fx_ms"]
        rows.append(row)
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    for tokens, e, groups, topk_group, k, scale in (GROUPED_SMOKE if args.cpu_smoke else GROUPED_ROUTERS) \
            if "grouped" in parts else ():
        torch.manual_seed(tokens * e + k)
        router = GroupedRouter(groups, topk_group, k, scale)
        logits, bias = torch.randn(tokens, e, device=device) * 2, torch.randn(e, device=device) * 0.3
        if device == "cpu":  # the kernel alone, under the interpreter
            got = kernel.grouped_topk(logits, bias, k, groups, topk_group, True, 1e-20, scale, float("-inf"))
            compiled = {"fp8fx": lambda x, b, got=got: got}
        else:
            import fp8fx

            torch._dynamo.reset()  # (as for the softmax routers)
            backend = fp8fx.Fp8Backend()
            compiled = {"inductor": torch.compile(router, dynamic=False), "fp8fx_unfused": torch.compile(
                router, backend=fp8fx.Fp8Backend(fuse_routing=False), dynamic=False),
                "fp8fx": torch.compile(router, backend=backend, dynamic=False)}
        row = dict(grouped_router=f"{e} in {groups} groups", tokens=tokens, topk_group=topk_group, k=k)
        with torch.no_grad():
            for name, fn in compiled.items():
                row[f"err_{name}"] = check_grouped(router, logits, bias, *fn(logits, bias))
        row["ok"] = all(row[f"err_{n}"] <= 1e-5 for n in compiled)  # (float32 throughout)
        if device == "cuda":
            row["ok"] &= {s.kernel for s in backend.report.topk} == {"extern fp8fx.grouped_topk"}
        ok &= row["ok"]
        if device == "cuda":
            from bench_linear import timed_in_rounds, timer

            with torch.no_grad():
                times = timed_in_rounds({name: timer(lambda x, fn=fn: fn(x, bias), logits, True)
                                         for name, fn in compiled.items()}, args.rounds)
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
