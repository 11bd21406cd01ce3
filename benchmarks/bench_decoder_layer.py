"""A whole Llama-3-8B decoder layer at decode - attention over a KV cache and the MLP - through fp8fx against bf16
Inductor and torchao float8, in one process on the GPU.

    python benchmarks/bench_decoder_layer.py [--out DIR] [--ms 1,16,32,64] [--context 1024] [--rounds 5]
    python benchmarks/bench_decoder_layer.py --cpu-smoke   # tiny dims on CPU: the fp8fx variants still compile

``DecoderLayer`` is Llama's layer written out: RMSNorm, q/k/v (32 query heads and 8 KV heads of 128), the rotary
embedding, each sequence's new token attending over its bf16 KV cache of ``--context`` positions (the new token's
keys and values written into the last one, in place), o, the residual, RMSNorm, the gated MLP, the residual. M
sequences decode one token each. Where ``bench_linear.py`` times the MLP block alone, this times what a decode
step pays between the GEMMs too (norms, rotary, attention, residuals) and q/k/v and o, which the MLP block has not.

Variants: bf16 Inductor; torchao float8 row-wise (its weights per channel, activations per token); fp8fx
``Fp8Backend()``; ``fp8fx_fused``: ``Fp8Backend(fuse_horizontal=True, fuse_mlp=True)`` - q/k/v one GEMM, the MLP in
two kernels. The KV cache stays bf16 in every variant. Each variant is compiled per M (``dynamic=False``, as decode's
CUDA graphs are per batch size) and timed as CUDA-graph replays after a clean L2 flush (``bench_linear.timer``), the
variants in turn for ``--rounds`` rounds; each row has its median and every round's time, the error of the layer's
update (its output less x) against the same layer in float32, and for fp8fx how many of the layer's seven linears its report says were rewritten and fused.
Writes decoder_layer.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8fx  # noqa: E402
from bench_linear import MLP, rel_err, timer, torchao_rowwise  # noqa: E402  (run as a script: benchmarks/ on sys.path)

LLAMA3_8B = dict(dim=4096, hidden=14336, heads=32, kv_heads=8, head_dim=128)
TINY = dict(dim=256, hidden=512, heads=4, kv_heads=2, head_dim=64)
VARIANTS = ("bf16_inductor", "torchao_rowwise", "fp8fx", "fp8fx_fused")
BACKENDS = {"fp8fx": {}, "fp8fx_fused": {"fuse_horizontal": True, "fuse_mlp": True}}
LINEARS = 7  # q, k, v, o, gate, up, down


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [..., D] at one position: Llama's pairs (i, i + D/2) turned by its angles."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class DecoderLayer(nn.Module):
    """Llama's decoder layer for ``batch`` sequences decoding one token each, their KV cache of ``context``
    positions a buffer; the new token is at the last position (its keys and values written there each call)."""

    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, batch: int, context: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp = MLP(dim, hidden)
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, context, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, context, head_dim))
        angles = (context - 1) / 500000.0 ** (torch.arange(0, head_dim, 2) / head_dim)  # Llama-3's rope theta
        self.register_buffer("cos", angles.cos().repeat(2))
        self.register_buffer("sin", angles.sin().repeat(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [batch, dim]
        m = x.shape[0]
        h = self.input_layernorm(x)
        q = rotate(self.q_proj(h).view(m, self.heads, self.head_dim), self.cos, self.sin)
        k = rotate(self.k_proj(h).view(m, self.kv_heads, self.head_dim), self.cos, self.sin)
        self.k_cache[:, :, -1] = k
        self.v_cache[:, :, -1] = self.v_proj(h).view(m, self.kv_heads, self.head_dim)
        # grouped-query attention: a KV head's query heads are the rows of one attention over its cache
        q = q.view(m, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)
        x = x + self.o_proj(a.reshape(m, self.heads * self.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_factory(dims: dict, device, seed: int = 0):
    """A function of (batch, context) returning a new bf16 ``DecoderLayer`` on ``device``; every one with the same
    weights (drawn once from ``seed``: N(0, 1 / K) for a linear of K inputs, so each GEMM's output, and the layer's
    update of x, is O(1) like x) and, for one (batch, context), the same cache (unit-variance keys and values, seeded
    by the two)."""
    torch.manual_seed(seed)
    base = DecoderLayer(**dims, batch=1, context=2)
    for name, p in base.named_parameters():
        if not name.endswith("layernorm.weight"):
            p.data = torch.randn_like(p) / p.shape[1] ** 0.5
    weights = {k: v.clone() for k, v in base.state_dict().items() if "cache" not in k and k not in ("cos", "sin")}

    def fresh(batch: int, context: int) -> DecoderLayer:
        layer = DecoderLayer(**dims, batch=batch, context=context)
        layer.load_state_dict(weights, strict=False)
        g = torch.Generator().manual_seed(batch * 100003 + context)
        for cache in (layer.k_cache, layer.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=g))
        return layer.to(device, torch.bfloat16)
    return fresh


def compiled(variant: str, layer: DecoderLayer):
    """(the compiled layer, fp8fx's backend or None, why it is missing: "" where it is not)."""
    if variant == "bf16_inductor":
        return torch.compile(layer, dynamic=False), None, ""
    if variant == "torchao_rowwise":
        ao, why = torchao_rowwise(layer)
        return (torch.compile(ao, dynamic=False) if ao is not None else None), None, why
    fp8fx.quantize_(layer, fp8fx.Fp8Config())
    backend = fp8fx.Fp8Backend(**BACKENDS[variant])
    return torch.compile(layer, backend=backend, dynamic=False), backend, ""


def site_counts(backend) -> dict:
    """How many of the layer's linear sites fp8fx's report has rewritten, and fused with others (its scheme says so:
    ``passes.base`` appends what a later pass fused a site into)."""
    sites = [s for s in backend.report.sites if s.kind == "linear"]
    return dict(linear_sites=len(sites), rewritten=sum(s.rewritten for s in sites),
                fused=sum(s.rewritten and "fused" in s.scheme for s in sites),
                not_rewritten={s.fqn: s.reason for s in sites if not s.rewritten})


def run(ms: list[int], context: int, rounds: int, variants: list[str], dims: dict, device: str) -> dict:
    fresh = layer_factory(dims, device)
    rows, errors, missing = [], {}, {}
    graph = device == "cuda"
    for m in ms:
        x = torch.randn(m, dims["dim"], device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = fresh(m, context).float()(x.float()).double()
            timers, counts = {}, {}
            for name in variants:
                start = time.perf_counter()
                fn, backend, why = compiled(name, fresh(m, context))
                if fn is None:
                    missing[name] = why
                    continue
                # (the layer's update, its output less x: the residual would hide the GEMMs' error)
                errors[f"M={m} {name}"] = rel_err(fn(x).double() - x.double(), ref - x.double())
                counts[name] = site_counts(backend) if backend is not None else {}
                if backend is not None:
                    print(backend.report, flush=True)
                print(f"M={m} {name}: first call {time.perf_counter() - start:.1f} s, update's error against float32 "
                      f"{errors[f'M={m} {name}']:.4f} {counts[name]}", flush=True)
                if graph:
                    timers[name] = timer(fn, x, True, reps=max(50, 200 // rounds))
            times = {name: [] for name in timers}
            for r in range(rounds if timers else 0):
                names = list(timers)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(timers[name]())
            for name in counts:
                row = {"M": m, "context": context, "variant": name, "error": errors[f"M={m} {name}"], **counts[name]}
                if name in times:
                    row.update(ms=statistics.median(times[name]), ms_rounds=times[name],
                               graph_replay=timers[name].graph)
                rows.append(row)
            for anchor in ("bf16_inductor", "torchao_rowwise"):
                base = next((r for r in rows if r["M"] == m and r["variant"] == anchor and "ms" in r), None)
                for row in (r for r in rows if r["M"] == m and "ms" in r and base is not None):
                    row[f"vs_{anchor}"] = base["ms"] / row["ms"]
                    # each round's ratio: the spread the median hides
                    row[f"vs_{anchor}_rounds"] = [b / t for b, t in zip(base["ms_rounds"], row["ms_rounds"])]
        torch._dynamo.reset()
    return dict(rows=rows, missing=missing)


def table(rows: list[dict]) -> str:
    lines = ["| M | variant | ms | vs bf16 (rounds) | vs torchao (rounds) | update's error vs float32 | rewritten / fused |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def ratio(anchor):
            rounds = r.get(f"vs_{anchor}_rounds")
            return f"{r[f'vs_{anchor}']:.3f}x ({min(rounds):.3f}-{max(rounds):.3f})" if rounds else ""
        ms = f"{r['ms']:.4f}" if "ms" in r else "not timed"
        sites = f"{r['rewritten']} / {r['fused']}" if "rewritten" in r else ""
        lines.append(f"| {r['M']} | {r['variant']} | {ms} | {ratio('bf16_inductor')} | {ratio('torchao_rowwise')} "
                     f"| {r['error']:.4f} | {sites} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--ms", default="1,16,32,64", help="comma-separated batch sizes (one new token a sequence)")
    p.add_argument("--context", type=int, default=1024, help="KV-cache positions a sequence attends over")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny dims on CPU, the fp8fx variants, no timing")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    if args.cpu_smoke:
        result = run([3], 16, 1, ["fp8fx", "fp8fx_fused"], TINY, "cpu")
    else:
        if not torch.cuda.is_available():
            p.error("a CUDA GPU is needed to time the layer; --cpu-smoke runs it small on the CPU")
        result = run([int(m) for m in args.ms.split(",")], args.context, args.rounds, variants, LLAMA3_8B, "cuda")
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decoder_layer.json"), "w") as f:
        json.dump(dict(meta=meta, **result), f, indent=1)
    print(meta)
    print(table(result["rows"]))
    if result["missing"]:
        print("not run:", result["missing"])
    fp8_rows = [r for r in result["rows"] if r["variant"] in BACKENDS]
    # every linear rewritten and the output near float32 (fp8's ~6% relative error on random data, run 31's MLP)
    ok = all(r["rewritten"] == r["linear_sites"] == LINEARS and math.isfinite(r["error"]) and r["error"] < 0.1
             for r in fp8_rows)
    return 0 if ok and fp8_rows else 1


if __name__ == "__main__":
    sys.exit(main())
