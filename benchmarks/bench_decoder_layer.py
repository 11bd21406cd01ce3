"""A whole Llama-3-8B decoder layer at decode - attention over a KV cache and the MLP - through fp8fx against bf16
Inductor and torchao float8, in one process on the GPU.

    python benchmarks/bench_decoder_layer.py [--out DIR] [--ms 1,16,32,64] [--context 1024] [--rounds 5]
    python benchmarks/bench_decoder_layer.py --cpu-smoke   # tiny dims on CPU: the fp8fx variants still compile

``DecoderLayer`` is Llama's layer written out: RMSNorm, q/k/v (32 query heads and 8 KV heads of 128), the rotary
embedding, each sequence's new token attending over its bf16 KV cache of ``--context`` positions (the new token's
keys and values written into the last one, in place: before v's projection, which fp8fx's passes handle), o, the
residual, RMSNorm, the gated MLP, the residual. M sequences decode one token each. Where ``bench_linear.py`` times
the MLP block alone, this times what a decode step pays between the GEMMs too (norms, rotary, attention, residuals)
and q/k/v and o, which the MLP block has not.

Variants: bf16 Inductor; torchao float8 row-wise (its weights per channel, activations per token); fp8fx
``Fp8Backend()``; ``fp8fx_fused``: ``Fp8Backend(fuse_horizontal=True, fuse_mlp=True)`` - q/k/v one GEMM, the MLP in two
kernels; on request, ``bf16_inductor_pdl``: Inductor's kernels launched as programmatic dependents (its
``triton.enable_pdl``: each starts while the one before runs, waits before it reads what that one wrote, and lets the
next start once it has read), and ``fp8fx_fused_pdl``: the fused variant so, and its decode GEMMs (programmatic
dependents on sm_90 by default, ``fp8_gemm.DECODE_PDL``) letting the next start once they have waited
(``bench_linear.PDL_KEYS``); ``fp8fx_fused_ipdl`` / ``fp8fx_fused_gpdl``: Inductor's part alone / fp8fx's alone.
The KV cache stays bf16 in every variant. Each variant is compiled per M (``dynamic=False``, as decode's CUDA graphs are
per batch size) and timed as CUDA-graph replays after a clean L2 flush (``bench_linear.timer``), the variants in turn
for ``--rounds`` rounds; each row has its median and every round's time, its errors against the same layer in float32 -
of the layer's update (its output less x: the residual would hide the GEMMs' error), of the attention branch (o's
output) and of the keys and values it wrote into the cache - and for fp8fx how many of the layer's seven linears its
report says were rewritten and fused. Writes decoder_layer.json after each M; exits 1 where an fp8fx variant left a
linear unrewritten or unfused (``fp8fx_fused``: all but o) or missed fp8's accuracy.
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
from bench_linear import MLP, PDL_KEYS, rel_err, timed_in_rounds, timer, torchao_rowwise  # noqa: E402
from bench_linear import with_kernel_setting  # noqa: E402  (benchmarks/ on sys.path)

LLAMA3_8B = dict(dim=4096, hidden=14336, heads=32, kv_heads=8, head_dim=128)
TINY = dict(dim=256, hidden=512, heads=4, kv_heads=2, head_dim=64)
VARIANTS = ("bf16_inductor", "torchao_rowwise", "fp8fx", "fp8fx_fused", "bf16_inductor_pdl", "fp8fx_fused_pdl",
            "fp8fx_fused_ipdl", "fp8fx_fused_gpdl", "fp8fx_fused_nopdl", "fp8fx_fused_pre", "fp8fx_fused_pdlpre")
DEFAULT_VARIANTS = VARIANTS[:4]
# the *_pdl variants: Inductor's kernels (``PDL``) and fp8fx's decode GEMMs (``fp8_gemm.DECODE_PDL``) as programmatic
# dependents; *_ipdl Inductor's alone, *_gpdl fp8fx's alone; *_nopdl: fp8fx's decode GEMMs launched plainly (as before
# run 35; ``DECODE_PDL = None``); *_pre: fp8fx's decode GEMMs loading their weight's first K steps before their wait
# (``DECODE_PDL = {"PRE_WAIT": --pre-wait}``), *_pdlpre: *_pdl so
PDL = {"triton.enable_pdl": True}
FUSED = {"fuse_horizontal": True, "fuse_mlp": True}
BACKENDS = {"fp8fx": {}, "fp8fx_fused": FUSED, "fp8fx_fused_pdl": {**FUSED, "inductor_config": PDL},
            "fp8fx_fused_ipdl": {**FUSED, "inductor_config": PDL}, "fp8fx_fused_gpdl": FUSED,
            "fp8fx_fused_nopdl": FUSED, "fp8fx_fused_pre": FUSED,
            "fp8fx_fused_pdlpre": {**FUSED, "inductor_config": PDL}}
LINEARS = 7  # q, k, v, o, gate, up, down


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [..., D] at one position: Llama's pairs (i, i + D/2) turned by its angles."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class DecoderLayer(nn.Module):
    """Llama's decoder layer for ``batch`` sequences decoding one token each, their KV cache of ``context``
    positions a buffer; the new token is at the last position (its keys and values written there each call).
    Returns the layer's output and its attention branch (o's output, which the error checks read)."""

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [batch, dim]
        m = x.shape[0]
        h = self.input_layernorm(x)
        q = rotate(self.q_proj(h).view(m, self.heads, self.head_dim), self.cos, self.sin)
        k = rotate(self.k_proj(h).view(m, self.kv_heads, self.head_dim), self.cos, self.sin)
        self.k_cache[:, :, -1] = k
        self.v_cache[:, :, -1] = self.v_proj(h).view(m, self.kv_heads, self.head_dim)
        # grouped-query attention: a KV head's query heads are the rows of one attention over its cache
        q = q.view(m, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)
        attention = self.o_proj(a.reshape(m, self.heads * self.head_dim))
        x = x + attention
        return x + self.mlp(self.post_attention_layernorm(x)), attention


def layer_factory(dims: dict, device, seed: int = 0):
    """A function of (batch, context, dtype) returning a new ``DecoderLayer`` on ``device``, built there; every one
    with the same weights (drawn once from ``seed``: N(0, 1 / K) for a linear of K inputs, so each GEMM's output, and
    the layer's update of x, is O(1) like x) and, for one (batch, context), the same cache (unit-variance keys and
    values, seeded by the two)."""
    torch.manual_seed(seed)
    with torch.device(device):
        base = DecoderLayer(**dims, batch=1, context=2)
    weights = {}
    for name, p in base.named_parameters():
        weights[name] = p.detach() if name.endswith("layernorm.weight") else torch.randn_like(p) / p.shape[1] ** 0.5
    del base

    def fresh(batch: int, context: int, dtype=torch.bfloat16) -> DecoderLayer:
        with torch.device(device):
            layer = DecoderLayer(**dims, batch=batch, context=context)
        layer.load_state_dict(weights, strict=False)
        g = torch.Generator(device).manual_seed(batch * 100003 + context)
        for cache in (layer.k_cache, layer.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=g, device=device))
        return layer.to(dtype)
    return fresh


def compiled(variant: str, layer: DecoderLayer, pre_wait: int = 1):
    """(the compiled layer, fp8fx's backend or None, why it is missing: "" where it is not); ``pre_wait``: the *pre
    variants' ``PRE_WAIT``."""
    if variant.startswith("bf16_inductor"):
        return torch.compile(layer, dynamic=False, options=PDL if variant.endswith("_pdl") else None), None, ""
    if variant == "torchao_rowwise":
        ao, why = torchao_rowwise(layer)
        return (torch.compile(ao, dynamic=False) if ao is not None else None), None, why
    fp8fx.quantize_(layer, fp8fx.Fp8Config())
    backend = fp8fx.Fp8Backend(**BACKENDS[variant])
    fn = torch.compile(layer, backend=backend, dynamic=False)
    if variant.endswith(("_pdl", "_gpdl")):  # (set while each call runs, the CUDA graph's capture among them)
        fn = with_kernel_setting(fn, "DECODE_PDL", PDL_KEYS)
    elif variant.endswith("_nopdl"):
        fn = with_kernel_setting(fn, "DECODE_PDL", None)
    elif variant.endswith("_pre"):
        fn = with_kernel_setting(fn, "DECODE_PDL", {"PRE_WAIT": pre_wait})
    elif variant.endswith("_pdlpre"):
        fn = with_kernel_setting(fn, "DECODE_PDL", {**PDL_KEYS, "PRE_WAIT": pre_wait})
    return fn, backend, ""


def site_counts(backend) -> dict:
    """How many of the layer's linear sites fp8fx's report has rewritten, and fused with others (their scheme ends
    in what a later pass fused them into, ``fused(...)``; "not fused ..." notes do not count)."""
    sites = [s for s in backend.report.sites if s.kind == "linear"]
    return dict(linear_sites=len(sites), rewritten=sum(s.rewritten for s in sites),
                fused=sum(s.rewritten and "fused(" in s.scheme for s in sites),
                not_rewritten={s.fqn: s.reason for s in sites if not s.rewritten})


def errors_against(layer: DecoderLayer, out: tuple, ref_layer: DecoderLayer, ref: tuple, x: torch.Tensor) -> dict:
    """Relative errors against the float32 layer: its update of x, its attention branch, the cache rows written."""
    written = [(c[:, :, -1].double(), r[:, :, -1].double())
               for c, r in ((layer.k_cache, ref_layer.k_cache), (layer.v_cache, ref_layer.v_cache))]
    return dict(error=rel_err(out[0].double() - x.double(), ref[0] - x.double()),
                attention_error=rel_err(out[1], ref[1]),
                kv_error=max(rel_err(got, want) for got, want in written))


def kernel_trace(fn, x: torch.Tensor, steps: int = 10) -> str:
    """The kernels of one call of ``fn(x)`` in launch order, each one's GPU time (start to end: with programmatic
    dependent launch, the time it waited included), the median of ``steps`` plain calls (torch.profiler, after
    ``profile_mlp.profiled``'s warm-up calls); a line each, and their sum."""
    from profile_mlp import per_call, profiled

    calls = per_call(profiled(fn, x, steps), steps)
    if isinstance(calls, str):
        return calls
    per = len(calls[0])
    us = [statistics.median(call[i].time_range.elapsed_us() for call in calls) for i in range(per)]
    lines = [f"{t:8.2f} us  {e.name[:100]}" for t, e in zip(us, calls[0])]
    return "\n".join(lines + [f"{sum(us):8.2f} us  in {per} kernels"])


def run(ms: list[int], context: int, rounds: int, variants: list[str], dims: dict, device: str,
        save=lambda result: None, pre_wait: int = 1, kernels: bool = False) -> dict:
    """Each of ``variants`` at each M (``save(result)`` after each M): its errors, report counts and times;
    ``kernels``: also its kernels' GPU times in launch order (``kernel_trace``), printed."""
    fresh = layer_factory(dims, device)
    result = dict(rows=[], missing={})
    graph = device == "cuda"
    for m in ms:
        x = torch.randn(m, dims["dim"], device=device, dtype=torch.bfloat16)
        rows = []
        with torch.no_grad():
            ref_layer = fresh(m, context, torch.float32)
            ref = tuple(t.double() for t in ref_layer(x.float()))
            timers = {}
            for name in variants:
                start = time.perf_counter()
                layer = fresh(m, context)
                fn, backend, why = compiled(name, layer, pre_wait)
                if fn is None:
                    result["missing"][name] = why
                    continue
                row = {"M": m, "context": context, "variant": name,
                       **errors_against(layer, fn(x), ref_layer, ref, x),
                       **(site_counts(backend) if backend is not None else {})}
                if backend is not None:
                    print(backend.report, flush=True)
                print(f"M={m} {name}: first call {time.perf_counter() - start:.1f} s, {row}", flush=True)
                rows.append(row)
                if graph:
                    timers[name] = timer(fn, x, True, reps=max(50, 200 // rounds))
                if graph and kernels:
                    print(f"M={m} {name} kernels, in launch order:\n{kernel_trace(fn, x)}", flush=True)
            times = timed_in_rounds(timers, rounds)
            for row in rows:
                if row["variant"] in times:
                    t = times[row["variant"]]
                    row.update(ms=statistics.median(t), ms_rounds=t, graph_replay=timers[row["variant"]].graph)
            for anchor in ("bf16_inductor", "torchao_rowwise"):
                base = next((r for r in rows if r["variant"] == anchor and "ms" in r), None)
                for row in (r for r in rows if "ms" in r and base is not None):
                    row[f"vs_{anchor}"] = base["ms"] / row["ms"]
                    # each round's ratio: the spread the median hides
                    row[f"vs_{anchor}_rounds"] = [b / t for b, t in zip(base["ms_rounds"], row["ms_rounds"])]
        result["rows"] += rows
        save(result)
        torch._dynamo.reset()
    return result


def fp8fx_ok(row: dict) -> bool:
    """An fp8fx row as it should be: all seven linears rewritten, fused as its backend asks (q/k/v and the MLP's
    three: all but o), every error finite and within fp8's (about 6% on this random data; bf16 alone 0.6%)."""
    fused = LINEARS - 1 if row["variant"].startswith("fp8fx_fused") else 0
    errors = [row["error"], row["attention_error"], row["kv_error"]]
    return (row["rewritten"] == row["linear_sites"] == LINEARS and row["fused"] == fused
            and all(math.isfinite(e) and e < 0.1 for e in errors))


def table(rows: list[dict]) -> str:
    lines = ["| M | variant | ms | vs bf16 (rounds) | vs torchao (rounds) | errors vs float32: update / attention / "
             "k, v written | rewritten / fused |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def ratio(anchor):
            rounds = r.get(f"vs_{anchor}_rounds")
            return f"{r[f'vs_{anchor}']:.3f}x ({min(rounds):.3f}-{max(rounds):.3f})" if rounds else ""
        ms = f"{r['ms']:.4f}" if "ms" in r else "not timed"
        sites = f"{r['rewritten']} / {r['fused']}" if "rewritten" in r else ""
        lines.append(f"| {r['M']} | {r['variant']} | {ms} | {ratio('bf16_inductor')} | {ratio('torchao_rowwise')} "
                     f"| {r['error']:.4f} / {r['attention_error']:.4f} / {r['kv_error']:.4f} | {sites} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--ms", default="1,16,32,64", help="comma-separated batch sizes (one new token a sequence)")
    p.add_argument("--context", type=int, default=1024, help="KV-cache positions a sequence attends over")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--kernels", action="store_true", help="each variant's kernels in launch order, their GPU times")
    p.add_argument("--pre-wait", type=int, default=1, choices=(1, 2, 4), help="the *pre variants' PRE_WAIT (K steps)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny dims on CPU, the fp8fx variants, no timing")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        p.error("a CUDA GPU is needed to time the layer; --cpu-smoke runs it small on the CPU")
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                gpu="cpu" if args.cpu_smoke else torch.cuda.get_device_name())
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)

    def save(result):
        with open(os.path.join(args.out, "decoder_layer.json"), "w") as f:
            json.dump(dict(meta=meta, **result), f, indent=1)
    if args.cpu_smoke:
        result = run([3], 16, 1, ["fp8fx", "fp8fx_fused", "fp8fx_fused_pdl"], TINY, "cpu", save)
    else:
        meta["pre_wait"] = args.pre_wait
        result = run([int(m) for m in args.ms.split(",")], args.context, args.rounds, variants, LLAMA3_8B, "cuda",
                     save, args.pre_wait, args.kernels)
    print(meta)
    print(table(result["rows"]))
    if result["missing"]:
        print("not run:", result["missing"])
    return 0 if all(fp8fx_ok(r) for r in result["rows"] if r["variant"] in BACKENDS) else 1


if __name__ == "__main__":
    sys.exit(main())
