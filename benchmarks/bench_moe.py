"""fp8fx's fused FP8 MoE kernel vs the anchors of ANCHORS.md, in one process on the GPU.

    python benchmarks/bench_moe.py [--out DIR] [--tokens 16,4096] [--schemes per-channel,block] [--sweep] [--cpu-smoke]

Shapes: Qwen3-30B-A3B (E=128, top-8, H=2048, I=768) and Mixtral-8x7B (E=8, top-2, H=4096, I=14336); GPT-OSS-20B
/ 120B (E=32 / 128, top-4, H=I=2880: fp8fx with its biases, interleaved rows and clamped SwiGLU, against the op's
reference; the anchors are timed as SiLU experts of those shapes).
What is timed is the experts computation with SiLU*mul and the combine (routing excluded, as in
ANCHORS.md), from bf16 tokens and a given top-k to the bf16 output:
  * bf16 ``torch._grouped_mm``: sort pairs by expert, gather, grouped GEMM w13, SiLU*mul, grouped GEMM
    w2, routing weights, combine;
  * fp8 ``torch._scaled_grouped_mm`` with eager row-wise quantization of its inputs (same structure);
  * fp8fx: ``fp8fx.kernels.fused_moe.fused_moe`` (align on the GPU, two fused grouped GEMMs; at decode the direct
    path its ``direct_by_default`` picks) with per-channel expert scales and per-token activations, or 128x128 blocks
    and 1x128 groups; timed with fp32 promotion every K step and with Hopper's fast accumulation
    (``fp8fx_fast_accum``); up to BOTH_PATHS_MAX_TOKENS tokens both paths too (``fp8fx_direct_fast_accum``,
    ``fp8fx_aligned_fast_accum``) and, on sm_90, the direct path's GEMMs launched plainly (``*_nopdl_*``) and as
    programmatic dependents with each ``DIRECT_PDL_TRIGGER`` (``*_pdl1_*``, ``*_pdl2_*``). ``--sweep``'s tile
    configurations take the aligned path, ``--sweep-set direct``'s the direct one.
Every row is timed as CUDA-graph replays (plain calls where capture fails: listed in the row's
``graph_capture_failures``). The weight-read floor is all fp8 expert bytes / the GPU's read speed, measured in
the run as ``tune_gemm.py --hbm`` does (a sum over 2 GiB: ``read_tbps``, printed; fixed at the H200's 4.25 TB/s
until h183, 1.39x too tight on an H100's ~3.05); ``anchors_floor_ms`` is ANCHORS.md's own (the bytes / 4.25 TB/s,
the H200's measured copy speed); ``touched_floor_ms`` counts only the experts the tokens are routed to. Both
anchors combine like fp8fx (bf16 terms, float32 sum over top-k).
``--sweep`` also times a set of tile configurations, ``--profile`` records each GPU kernel's time.
Writes moe.json under --out. ``--cpu-smoke`` runs tiny shapes under Triton's interpreter (no timing;
its errors include the interpreter's fp8 conversion bug).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--cpu-smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_linear import FALLBACKS, bench, rel_err, with_kernel_setting  # noqa: E402  (benchmarks/ is on sys.path)
from fp8fx import ops, quant  # noqa: E402
from fp8fx.kernels import fused_moe as moe_kernel  # noqa: E402

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336),  # E, top-k, H, I
          "gpt_oss": (32, 4, 2880, 2880), "gpt_oss_120b": (128, 4, 2880, 2880),  # (timed with SiLU*mul)
          "nemotron_h": (128, 6, 2688, 1856)}  # ungated: w13 [E, I, H], relu(up)^2; fp8fx alone (no ungated anchor)
UNGATED = {"nemotron_h"}
HBM_TBPS = 4.25  # ANCHORS.md's floor: the H200's measured copy speed (``anchors_floor_ms``; the CPU smoke's floor)
BOTH_PATHS_MAX_TOKENS = 8  # up to this many tokens both of fused_moe's paths are timed (``direct``)
SWEEPS = {  # flat: both GEMMs; "gemm2": the second GEMM's own tiles (the first has two accumulators)
    "per-channel": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4, gemm2=dict(BLOCK_N=128)),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, gemm2=dict(BLOCK_N=256)),
    ],
    # K-grouped scales: BLOCK_K is the group (128) and the first GEMM's BLOCK_N the activation group
    "block": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, gemm2=dict(BLOCK_N=256)),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    ],
    # decode tiles (a few pairs per expert: the weights streamed), for --sweep-set decode
    "decode": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=6),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=32)),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=64)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=4),
    ],
    # the direct path's tiles (``--sweep-set direct``: timed with direct=True; BLOCK_M is 16 there whatever is given):
    # the first GEMM's with the second at its default, then the second's
    "direct": [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=64)),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3, gemm2=dict(BLOCK_N=64, BLOCK_K=256,
                                                                                         num_stages=4)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=512, num_warps=4, num_stages=3, gemm2=dict(BLOCK_K=256, num_stages=4)),
        dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=64, BLOCK_K=256)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=6, gemm2=dict(BLOCK_K=256, num_stages=4)),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=4, gemm2=dict(BLOCK_N=64, num_warps=4)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=4, gemm2=dict(num_warps=4)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=32)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=32, BLOCK_K=128)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=128, BLOCK_K=128)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_K=128, num_stages=6)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_N=32, num_warps=2)),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, gemm2=dict(BLOCK_K=512, num_stages=3)),
    ],
}


def problem(shape, tokens, device, seed=0):
    e, k, h, i = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, h, device=device, generator=g).bfloat16()
    rows = i if shape in UNGATED else 2 * i
    w13 = (torch.randn(e, rows, h, device=device, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=device, generator=g) / i**0.5).bfloat16()
    logits = torch.randn(tokens, e, device=device, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).float(), ids, w13, w2


def gpt_oss_form(e, h, i, device) -> dict:
    """fused_moe's GPT-OSS arguments (biases, interleaved rows, the clamped SwiGLU at alpha 1.702, limit 7)."""
    g = torch.Generator(device=device).manual_seed(1)
    return dict(w13_bias=torch.randn(e, 2 * i, device=device, generator=g).bfloat16(),
                w2_bias=torch.randn(e, h, device=device, generator=g).bfloat16(), interleaved=True,
                activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)


def _grouped(x, weights, ids, e):
    """(tokens of the pairs sorted by expert, their pair index, int32 offsets)."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return order // ids.shape[1], order, offs


def bf16_grouped(x, weights, ids, w13, w2):
    t, k = ids.shape
    token, order, offs = _grouped(x, weights, ids, w13.shape[0])
    a = x[token]
    gu = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), w2.transpose(1, 2), offs=offs)
    return _combine(y, weights, order, t, k)


def _combine(y, weights, order, t, k):
    """Routing weights and the sum over top-k, as fp8fx does it: bf16 terms, float32 sum."""
    y = (y.float() * weights.reshape(-1)[order, None]).bfloat16()
    out = torch.zeros(t * k, y.shape[1], device=y.device, dtype=torch.bfloat16).index_copy_(0, order, y)
    return out.view(t, k, -1).sum(1, dtype=torch.float32).bfloat16()


def _rowwise(a):
    q, s = quant.quantize(a, [1, -1])
    return q, s.reshape(-1).float()


def fp8_scaled_grouped(x, weights, ids, q13, s13, q2, s2):
    t, k = ids.shape
    token, order, offs = _grouped(x, weights, ids, q13.shape[0])
    aq, sa = _rowwise(x[token])
    gu = torch._scaled_grouped_mm(aq, q13.transpose(1, 2), sa, s13, offs=offs, out_dtype=torch.bfloat16,
                                  use_fast_accum=True)
    g, u = gu.chunk(2, dim=-1)
    iq, si = _rowwise(F.silu(g) * u)
    y = torch._scaled_grouped_mm(iq, q2.transpose(1, 2), si, s2, offs=offs, out_dtype=torch.bfloat16,
                                 use_fast_accum=True)
    return _combine(y, weights, order, t, k)


def kernel_ms(fn, iters: int = 10) -> dict:
    """{GPU kernel name: ms per call of ``fn()``} from torch.profiler: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        ms = getattr(evt, "self_device_time_total", 0) / iters / 1000
        if ms > 0:
            out[evt.key[:60]] = round(ms, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_ms(fn, graph: bool) -> float:
    """Median ms of ``fn()``: bench_linear's timing (CUDA-graph replays, plain calls where capture fails)."""
    return bench(lambda _: fn(), None, graph)


SCHEMES = {  # name: (expert weight block, activation block)
    "per-channel": ([1, -1], [1, -1]),
    "block": ([128, 128], [1, 128]),  # DeepSeek-V3 style
}


def read_speed(device: str) -> float:
    """TB/s the weight-read floor divides by: on the GPU its read speed, measured now (``tune_gemm._read_speed``, as
    ``tune_gemm.py --hbm`` measures it), on the CPU (no timing) ANCHORS.md's ``HBM_TBPS``."""
    if device != "cuda":
        return HBM_TBPS
    from tune_gemm import _read_speed  # (benchmarks/ is on sys.path)

    return _read_speed()


def run_shape(shape, tokens, device, sweep: bool, scheme: str = "per-channel", profile: bool = False,
              sweep_set: str = "", read_tbps: float = HBM_TBPS) -> dict:
    e, k, h, i = SHAPES[shape]
    w_block, act_block = SCHEMES[scheme]
    if device != "cuda":  # tiny CPU shapes: blocks that fit them
        w_block, act_block = [min(b, 32) if b > 0 else b for b in w_block], [min(b, 32) if b > 0 else b for b in act_block]
    x, weights, ids, w13, w2 = problem(shape, tokens, device)
    form = gpt_oss_form(e, h, i, device) if shape.startswith("gpt_oss") else {}
    if shape in UNGATED:  # Nemotron-H's experts: the op's reference is the reference, no anchor computes them
        form = dict(gated=False, activation="relu2")
    q13, s13 = quant.quantize(w13, w_block)
    q2, s2 = quant.quantize(w2, w_block)
    # the anchors' fp8 path is row-wise whatever fp8fx uses
    r13, rs13 = quant.quantize(w13, [1, -1])
    r2, rs2 = quant.quantize(w2, [1, -1])
    # the bf16 computation is the reference both fp8 paths are measured against (GPT-OSS's form: fp8fx against the
    # op's reference, the anchors timed as SiLU experts)
    ref = None if shape in UNGATED else bf16_grouped(x, weights, ids, w13, w2).float()
    graph = device == "cuda"  # every row as CUDA-graph replays (a compiled model's decode and prefill)
    row = dict(shape=shape, scheme=scheme, tokens=tokens, E=e, top_k=k, H=h, I=i)
    fp8 = lambda cfg=None, fast=False, direct=None, pdl=None: moe_kernel.fused_moe(  # noqa: E731
        x, weights, ids, q13, s13, q2, s2, w_block, act_block, torch.bfloat16, config=cfg, fast_accum=fast,
        direct=direct, pdl=pdl, **form
    )
    out = fp8()
    op_ref = ops.fused_moe_reference(x, weights, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, **form)
    if form:
        ref = op_ref
    else:
        row["fp8fx_err_vs_bf16"] = rel_err(out, ref)
    row["fp8fx_err_vs_op_reference"] = rel_err(out, op_ref)
    if device != "cuda":
        return row
    s13v, s2v = rs13.reshape(e, -1).float().contiguous(), rs2.reshape(e, -1).float().contiguous()
    timings = {
        "bf16_grouped_mm": lambda: bf16_grouped(x, weights, ids, w13, w2),
        "scaled_grouped_mm": lambda: fp8_scaled_grouped(x, weights, ids, r13, s13v, r2, s2v),
        "fp8fx": fp8,  # fp32 promotion every K step
        "fp8fx_fast_accum": lambda: fp8(fast=True),
    }
    if tokens <= BOTH_PATHS_MAX_TOKENS:  # decode: one program per pair (no align, quantize or combine launches) or not
        row["fp8fx_direct_err_vs_aligned"] = rel_err(fp8(fast=True, direct=True), fp8(fast=True, direct=False))
        timings["fp8fx_direct_fast_accum"] = lambda: fp8(fast=True, direct=True)
        timings["fp8fx_aligned_fast_accum"] = lambda: fp8(fast=True, direct=False)
        if device == "cuda" and moe_kernel._hopper(x, exactly=True):  # the direct GEMMs' PDL: off, each trigger
            row["fp8fx_direct_nopdl_err_vs_pdl"] = rel_err(fp8(fast=True, direct=True, pdl=False),
                                                           fp8(fast=True, direct=True))
            row["fp8fx_direct_pdl1_err_vs_pdl"] = rel_err(with_kernel_setting(
                lambda: fp8(fast=True, direct=True, pdl=True), "DIRECT_PDL_TRIGGER", 1, moe_kernel)(),
                fp8(fast=True, direct=True))
            timings["fp8fx_direct_nopdl_fast_accum"] = lambda: fp8(fast=True, direct=True, pdl=False)
            for trigger in (1, 2):
                timings[f"fp8fx_direct_pdl{trigger}_fast_accum"] = with_kernel_setting(
                    lambda: fp8(fast=True, direct=True, pdl=True), "DIRECT_PDL_TRIGGER", trigger, moe_kernel)
    if shape in UNGATED:
        timings = {n: f for n, f in timings.items() if n.startswith("fp8fx")}
    try:
        anchor_out = timings["scaled_grouped_mm"]() if "scaled_grouped_mm" in timings else None
        if not form:
            row["scaled_grouped_err_vs_bf16"] = rel_err(anchor_out, ref)
    except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
        row["scaled_grouped_mm_error"] = repr(exc)[:300]
        timings.pop("scaled_grouped_mm")
    fallbacks = len(FALLBACKS)
    # twice, the second time in reverse order, the faster kept: in run 8 two identical builds timed 10%
    # apart in the order they ran (Qwen3, 16 tokens)
    for name, fn in [*timings.items(), *reversed(timings.items())]:
        ms = time_ms(fn, graph)
        row[f"{name}_ms"] = min(ms, row.get(f"{name}_ms", ms))
    row["graph_capture_failures"] = FALLBACKS[fallbacks:]  # those timings are plain calls
    # the floors read every expert, as ANCHORS.md's does; the experts these tokens touch are the tighter one
    row["floor_ms"] = (q13.numel() + q2.numel()) / (read_tbps * 1e9)  # (``read_speed``)
    row["anchors_floor_ms"] = (q13.numel() + q2.numel()) / (HBM_TBPS * 1e9)
    row["experts_touched"] = int(ids.unique().numel())
    row["touched_floor_ms"] = row["floor_ms"] * row["experts_touched"] / e
    if "bf16_grouped_mm_ms" in row:
        row["vs_bf16"] = row["bf16_grouped_mm_ms"] / row["fp8fx_ms"]
    if "scaled_grouped_mm_ms" in row:
        row["vs_scaled_grouped"] = row["scaled_grouped_mm_ms"] / row["fp8fx_ms"]
    row["vs_floor"] = row["fp8fx_ms"] / row["floor_ms"]
    row["vs_touched_floor"] = row["fp8fx_ms"] / row["touched_floor_ms"]
    # Fp8Backend's default: fast accumulation (the _scaled_grouped_mm anchor uses it too)
    fast = row["fp8fx_fast_accum_ms"]
    if "bf16_grouped_mm_ms" in row:
        row["fast_vs_bf16"] = row["bf16_grouped_mm_ms"] / fast
    if "scaled_grouped_mm_ms" in row:
        row["fast_vs_scaled_grouped"] = row["scaled_grouped_mm_ms"] / fast
    row["fast_vs_floor"] = fast / row["floor_ms"]
    if "fp8fx_direct_fast_accum_ms" in row:
        row["direct_vs_aligned"] = row["fp8fx_aligned_fast_accum_ms"] / row["fp8fx_direct_fast_accum_ms"]
        row["direct_vs_touched_floor"] = row["fp8fx_direct_fast_accum_ms"] / row["touched_floor_ms"]
    if profile:
        for name in (n for n in ("fp8fx_fast_accum", "bf16_grouped_mm") if n in timings):
            row[f"{name}_kernels"] = kernel_ms(timings[name])
    if sweep:
        row["sweep"] = []
        direct = True if sweep_set == "direct" else None  # (a given config takes the aligned path by default)
        for cfg in SWEEPS[sweep_set or scheme]:
            try:
                ms = time_ms(lambda: fp8(dict(cfg), True, direct), graph)
                err = rel_err(fp8(dict(cfg), True, direct), ref)
                kernels = kernel_ms(lambda: fp8(dict(cfg), True, direct), 3) if profile else {}
                row["sweep"].append(dict(cfg, ms=ms, err=err, **{k: v for k, v in kernels.items() if "moe_gemm" in k}))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and go on
                row["sweep"].append(dict(cfg, error=repr(exc)[:200]))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--tokens", default="16,4096")
    p.add_argument("--shapes", default="qwen3,mixtral")
    p.add_argument("--schemes", default="per-channel,block")
    p.add_argument("--sweep", action="store_true", help="time tile configurations (fast accumulation)")
    p.add_argument("--sweep-set", default="", help="the SWEEPS entry to time (default: the scheme's)")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time (torch.profiler)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        SHAPES.clear()
        SHAPES["tiny"] = (4, 2, 64, 32)
        device, tokens, shapes = "cpu", [5], ["tiny"]
    else:
        device, tokens, shapes = "cuda", [int(t) for t in args.tokens.split(",")], args.shapes.split(",")
    os.makedirs(args.out, exist_ok=True)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               read_tbps=read_speed(device))
    print(f"weight-read floor at {env['read_tbps']:.2f} TB/s ("
          + ("the read speed, a sum of 2 GiB" if device == "cuda" else "ANCHORS.md's; not measured on the CPU")
          + f"); anchors_floor_ms at ANCHORS.md's {HBM_TBPS} TB/s", flush=True)
    rows, failed = [], False
    for shape, scheme in ((sh, sc) for sh in shapes for sc in args.schemes.split(",")):
        for t in tokens:
            start = time.perf_counter()
            try:
                row = run_shape(shape, t, device, args.sweep, scheme, args.profile, args.sweep_set, env["read_tbps"])
            except Exception as exc:  # noqa: BLE001 - one row's failure is reported, the others still run
                traceback.print_exc()
                row, failed = dict(shape=shape, scheme=scheme, tokens=t, error=repr(exc)[:500]), True
            row["wall_s"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep"}))
            for s in row.get("sweep", []):
                print("   ", s)
            with open(os.path.join(args.out, "moe.json"), "w") as f:  # after every row: a cut run keeps them
                json.dump(dict(env=env, rows=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
