"""Prefill MLP block with act * mul in the gate/up GEMM's epilogue (H200 study, issue 3).

The default prefill path is cuBLAS's gate/up GEMM (bf16 g and u out: 235 MB at M = 4096), Inductor's act * mul with
the per-token quantization of h (a row reduction over 14336 values, 0.124 ms in run 9, half the HBM speed) and
cuBLAS's down GEMM. ``gated_prefill`` writes h (117 MB) and its row maxima per tile instead, and ``quantize_rows``
streams h to fp8 with no reduction left. This script times, on one GPU, in one process:

1. ``--sweep``: the gate/up kernel's tiles against cuBLAS's gate/up GEMM, and ``quantize_rows`` against Inductor's
   act * mul + quantization (each once, ``do_bench``);
2. the block: fp8fx as it compiles today, torchao float8 row-wise, bf16 Inductor and the new path (x quantized by a
   compiled kernel, ``gated_prefill``, ``quantize_rows``, cuBLAS down) in interleaved rounds, with each one's error
   against the float32 MLP;
3. ``--profile``: where each compiled block's GPU time goes (torch.profiler: every kernel of a call, its time, and
   the call's span from its first kernel's start to its last one's end, the gaps between kernels included);
4. ``--gate-up NAME=FILE,...``: the gate/up kernel of this tree against those in the FILEs (``git show
   REV:fp8fx/kernels/gated_mlp.py > FILE``), and this tree's at the ``GATE_UP_TILES``, in interleaved rounds;
5. ``--down``: the down GEMM with h quantized as it loads it (``fp8_gemm``'s ``A_QUANT``, the decode path's) against
   ``quantize_rows`` + cuBLAS's down GEMM;
6. ``--rounding``: the gate/up kernel with and without the model's bf16 roundings of g, u and act(g) (and silu by
   tanh.approx), against cuBLAS's gate and up GEMMs, back to back;
7. ``--tail``: the gate/up kernel with its last, partial round of tiles in whole tiles and in half tiles.

    python benchmarks/prefill_study.py --ms 2048,4096 --rounds 7 [--sweep] [--profile] [--gate-up NAME=FILE,...] [--down]
        [--rounding] [--tail] [--no-rounds] [--out DIR]
    python benchmarks/prefill_study.py --ncu-driver --ms 2048   (under ncu: device_run.sh stage ncuprefill)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_linear import DIM, MLP, fp8fx_module, mlp_factory, rel_err, torchao_rowwise  # noqa: E402
from fp8fx import quant  # noqa: E402
from fp8fx.kernels import gated_mlp as gm  # noqa: E402
from fp8fx.kernels.launch import cdiv, sm_count  # noqa: E402

TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    (128, 128, 128, 16, 8, 4), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 8, 3), (128, 128, 128, 16, 8, 3),
    (128, 128, 128, 32, 8, 4), (128, 128, 256, 16, 8, 2), (128, 64, 128, 8, 4, 4),
]
QUANT_BLOCKS = [(8, 512), (4, 1024), (16, 256), (2, 2048), (1, 4096)]


def _ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _tile(t: tuple) -> dict:
    bm, bn, bk, group, warps, stages = t
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)


class Operands:
    """The MLP's weights quantized per channel, as fp8fx.Fp8Config quantizes them."""

    def __init__(self, mlp: MLP):
        self.w1, self.s1 = quant.quantize(mlp.gate_proj.weight.data, [1, -1])
        self.w3, self.s3 = quant.quantize(mlp.up_proj.weight.data, [1, -1])
        self.w2, self.s2 = quant.quantize(mlp.down_proj.weight.data, [1, -1])
        self.w13 = torch.cat([self.w1, self.w3])
        self.s13 = torch.cat([self.s1, self.s3]).reshape(1, -1).float()
        self.s2r = self.s2.reshape(1, -1).float()
        self.x_quant = torch.compile(lambda x: quant.quantize(x, [1, -1]), dynamic=False)

    def gate_up(self, xq, xs, tile: dict | None):
        return gm.gated_prefill(xq, xs, self.w1, self.s1, self.w3, self.s3, torch.bfloat16, fast_accum=True,
                                config=tile)

    def cublas_gate_up(self, xq, xs):
        """cuBLAS's merged gate/up GEMM (g and u in bf16), per-token x."""
        return torch._scaled_mm(xq, self.w13.t(), scale_a=xs.reshape(-1, 1).float(), scale_b=self.s13,
                                out_dtype=torch.bfloat16, use_fast_accum=True)

    def cublas_g_u(self, xq, xs):
        """(g, u): cuBLAS's gate and up GEMMs one by one, per-token x."""
        return tuple(torch._scaled_mm(xq, w.t(), scale_a=xs.reshape(-1, 1).float(), scale_b=s.reshape(1, -1).float(),
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
                     for w, s in ((self.w1, self.s1), (self.w3, self.s3)))

    def eager_h(self, g, u):
        """act(g) * u in eager ops: what the gate/up kernel's h is checked against (g, u: ``cublas_g_u``'s)."""
        return torch.nn.functional.silu(g) * u

    def cublas_down(self, hq, hs):
        return torch._scaled_mm(hq, self.w2.t(), scale_a=hs, scale_b=self.s2r, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    def new_path(self, tile: dict | None = None, block=QUANT_BLOCKS[0]):
        def run(x):
            xq, xs = self.x_quant(x)
            h, parts = self.gate_up(xq, xs, tile)
            return self.cublas_down(*gm.quantize_rows(h, parts, block))
        return run


def sweep(ops: Operands, m: int, out: list) -> tuple[dict, tuple]:
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    cublas = _ms(lambda: ops.cublas_gate_up(xq, xs))
    out.append({"M": m, "what": "cuBLAS gate_up", "ms": cublas})
    print(f"M={m} cuBLAS gate_up {cublas:.4f} ms", flush=True)
    g, u = ops.cublas_g_u(xq, xs)
    want = ops.eager_h(g, u)
    best = (float("inf"), None)
    for t in TILES:
        tile = _tile(t)
        try:
            h, parts = ops.gate_up(xq, xs, tile)
            err = rel_err(h, want)
            ms = _ms(lambda: ops.gate_up(xq, xs, tile))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
            print(f"M={m} tile {t}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            out.append({"M": m, "what": "gated_prefill", "tile": t, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        out.append({"M": m, "what": "gated_prefill", "tile": t, "ms": ms, "vs_cublas": cublas / ms, "h_err": err})
        print(f"M={m} tile {t}: {ms:.4f} ms ({cublas / ms:.3f}x cuBLAS gate_up), h vs cuBLAS+eager {err:.2e}",
              flush=True)
        best = min(best, (ms, t), key=lambda b: b[0])
    h, parts = ops.gate_up(xq, xs, _tile(best[1]))
    inductor = torch.compile(lambda g, u: quant.quantize(torch.nn.functional.silu(g) * u, [1, -1]), dynamic=False)
    from fp8fx.lowerings import compat

    with compat.one_pass_row_reductions(16384):
        inductor(g, u)
    t_ind = _ms(lambda: inductor(g, u))
    out.append({"M": m, "what": "Inductor act*mul+quant (one pass)", "ms": t_ind})
    print(f"M={m} Inductor act*mul + per-token quant {t_ind:.4f} ms", flush=True)
    want_q, want_s = quant.quantize(h, [1, -1])
    best_q = (float("inf"), QUANT_BLOCKS[0])
    for block in QUANT_BLOCKS:
        q, s = gm.quantize_rows(h, parts, block)
        same = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s.float())
        ms = _ms(lambda: gm.quantize_rows(h, parts, block))
        out.append({"M": m, "what": "quantize_rows", "block": block, "ms": ms, "bits_equal": same})
        print(f"M={m} quantize_rows {block}: {ms:.4f} ms ({(h.numel() * 3) / ms / 1e9:.2f} TB/s), bits equal {same}",
              flush=True)
        best_q = min(best_q, (ms, block), key=lambda b: b[0])
    return _tile(best[1]), best_q[1]


GATE_UP_TILES = {  # name: (config, programs per SM)
    "4 stages": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=4), 1),
    "GROUP_M 8": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3), 1),
}


def gate_up_ab(ops: Operands, baselines: str, m: int, rounds: int, out: list) -> None:
    """This tree's gate/up kernel against those of the files in ``baselines`` (``NAME=FILE,...``; same tile), and
    at ``GATE_UP_TILES``, in interleaved rounds."""
    import importlib.util

    modules = {}
    for item in baselines.split(","):
        name, path = item.split("=", 1)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    sms = sm_count(torch.device("cuda"))
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    args = (xq, xs, ops.w1, ops.s1, ops.w3, ops.s3, torch.bfloat16)
    want = ops.eager_h(*ops.cublas_g_u(xq, xs)).float()
    variants = {"cuBLAS gate_up": lambda: ops.cublas_gate_up(xq, xs),
                **{name: (lambda mod=mod: mod.gated_prefill(*args, fast_accum=True)) for name, mod in modules.items()},
                "this tree": lambda: gm.gated_prefill(*args, fast_accum=True)}
    for name, (cfg, per_sm) in GATE_UP_TILES.items():
        variants[name] = (lambda c=cfg, p=per_sm: gm.gated_prefill(*args, fast_accum=True, config=c, programs=p * sms))
    mine = gm.gated_prefill(*args, fast_accum=True)[0]
    for name in list(variants):
        try:
            r = variants[name]()
            if name != "cuBLAS gate_up":
                err = rel_err(r[0], want)
                same = (r[0] == mine).float().mean().item()
                out.append({"M": m, "what": "gate_up h error vs cuBLAS + eager", "variant": name, "rel_err": err,
                            "same_bits_as_this_tree": same})
                print(f"M={m} {name}: h vs cuBLAS + eager silu * mul {err:.2e}; bits as this tree's {same:.6f}",
                      flush=True)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
            print(f"M={m} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            out.append({"M": m, "what": "gate_up", "variant": name, "error": str(e)[:300]})
            del variants[name]
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_ms(variants[name]))
    base = times.get("cuBLAS gate_up") or [float("nan")] * rounds  # (cuBLAS failed: no ratios)
    for name in names:
        med = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in zip(base, times[name]))
        out.append({"M": m, "what": "gate_up", "variant": name, "ms": med, "vs_cublas": ratio, "ms_rounds": times[name]})
        print(f"M={m} gate_up {name}: {med:.4f} ms, {ratio:.3f}x cuBLAS gate_up (rounds "
              f"{min(times[name]):.4f}-{max(times[name]):.4f})", flush=True)


DOWN_TILES = [  # fp8_gemm configs for the down GEMM with h quantized in its loads (A_QUANT rows)
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
]


def down_probe(ops: Operands, m: int, out: list) -> None:
    """The down GEMM with h quantized in its loads against ``quantize_rows`` + cuBLAS (each timed once)."""
    from fp8fx.kernels import fp8_gemm as fg

    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    h, parts = ops.gate_up(xq, xs, None)

    def two_passes():
        return ops.cublas_down(*gm.quantize_rows(h, parts))

    want = two_passes()
    base = _ms(two_passes)
    hq, hs = gm.quantize_rows(h, parts)
    cublas = _ms(lambda: ops.cublas_down(hq, hs))
    out.append({"M": m, "what": "quantize_rows + cuBLAS down", "ms": base, "cublas_down_ms": cublas})
    print(f"M={m} quantize_rows + cuBLAS down {base:.4f} ms (cuBLAS down alone {cublas:.4f})", flush=True)
    for cfg in DOWN_TILES:
        for exact in (True, False):
            run = lambda: fg.fp8_gemm(h, ops.w2, parts, ops.s2r, None, torch.bfloat16,  # noqa: E731
                                      config={**cfg, "EXACT_CODES": exact}, fast_accum=True, a_quant=fg.QUANT_ROWS)
            tag = {k: v for k, v in cfg.items() if k != "TMA"} | {"EXACT_CODES": exact}
            try:
                err = rel_err(run(), want)
                ms = _ms(run)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                print(f"M={m} down A_QUANT {tag}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                out.append({"M": m, "what": "down A_QUANT", "tile": tag, "error": str(e)[:300]})
                continue
            out.append({"M": m, "what": "down A_QUANT", "tile": tag, "ms": ms, "vs_two_passes": base / ms,
                        "err_vs_two_passes": err})
            print(f"M={m} down A_QUANT {tag}: {ms:.4f} ms ({base / ms:.3f}x quantize_rows + cuBLAS), "
                  f"vs them {err:.2e}", flush=True)


def ncu_driver(m: int) -> None:
    """The launches for ncu: the gate/up kernel and quantize_rows twice each (the first compiles them; ncu reads
    both launches), then the gate/up kernel, cuBLAS's gate/up GEMM, quantize_rows and cuBLAS's down GEMM once."""
    ops = Operands(mlp_factory("cuda")())
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    h, parts = ops.gate_up(xq, xs, None)  # compiles; the launches below are the ones to read
    hq, hs = gm.quantize_rows(h, parts)
    torch.cuda.synchronize()
    ops.gate_up(xq, xs, None)
    ops.cublas_gate_up(xq, xs)
    gm.quantize_rows(h, parts)
    ops.cublas_down(hq, hs)
    torch.cuda.synchronize()


def _add_torchao(variants: dict, fresh) -> None:
    """torchao float8 row-wise, compiled, into ``variants`` (the MLP from ``fresh``), or why it is missing printed."""
    ao, why = torchao_rowwise(fresh())
    if ao is not None:
        variants["torchao_rowwise"] = torch.compile(ao, dynamic=False)
    else:
        print(why, flush=True)


def rounding(ops: Operands, m: int, rounds: int, out: list, reps: int = 20) -> None:
    """The gate/up kernel with the model's bf16 roundings of g, u and act(g), without them (float32 until h; silu by
    ex2 and rcp, or by tanh.approx, the default), and cuBLAS's gate and up GEMMs: each the median of ``reps`` calls
    in a row (CUDA events, no flush, as a block's calls follow one another), in turn over ``rounds``; with each h's
    error against float64's act(g) * u of the same codes, and against the float32 epilogue with ex2 / rcp (the same
    GEMM, so the epilogues' own differences: where g > 0, relative; everywhere, over the row's largest)."""
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    w1, w3 = (quant.dequantize(w, s, [1, -1], torch.float64) for w, s in ((ops.w1, ops.s1), (ops.w3, ops.s3)))
    xd = quant.dequantize(xq, xs, [1, -1], torch.float64)
    g = xd @ w1.t()
    ref = torch.nn.functional.silu(g) * (xd @ w3.t())
    g_pos = g > 0
    del w1, w3, xd, g
    cases = {"model rounding": lambda: gm.gated_prefill(xq, xs, ops.w1, ops.s1, ops.w3, ops.s3, torch.bfloat16,
                                                        fast_accum=True, model_rounding=True),
             "float32 g, u": lambda: gm.gated_prefill(xq, xs, ops.w1, ops.s1, ops.w3, ops.s3, torch.bfloat16,
                                                      fast_accum=True, model_rounding=False, tanh_silu=False),
             "float32, silu by tanh": lambda: gm.gated_prefill(xq, xs, ops.w1, ops.s1, ops.w3, ops.s3,
                                                               torch.bfloat16, fast_accum=True, tanh_silu=True),
             "cuBLAS gate + up": lambda: ops.cublas_g_u(xq, xs)}
    kernels = [name for name in cases if not name.startswith("cuBLAS")]
    h32 = ref.bfloat16()  # float64's h, rounded once
    base = cases["float32 g, u"]()[0].float()  # the epilogues against each other, where the GEMM's error is shared
    row_max = base.abs().amax(1, keepdim=True)
    for name in kernels:
        h = cases[name]()[0]
        diff = (h.float() - base).abs()
        vs_base = {"bits_as_float32_ex2": (h.float() == base).float().mean().item(),
                   "worst_rel_where_g_pos": (diff / base.abs().clamp_min(1e-30))[g_pos & (base != 0)].max().item(),
                   "worst_vs_row_max": (diff / row_max).max().item()}
        print(f"M={m} {name} against float32 g, u with ex2 / rcp: " + ", ".join(f"{k} {v:.3e}" for k, v in
                                                                                  vs_base.items()), flush=True)
        err = ((h.double() - ref).norm() / ref.norm()).item()
        same = (h == h32).float().mean().item()
        worst = ((h.double() - ref).abs() / ref.abs().amax(1, keepdim=True)).max().item()
        out.append({"M": m, "what": "h error vs float64", "case": name, "rel_err": err, "bits_as_float64_rounded": same,
                    "worst_vs_row_max": worst, "vs_float32_ex2": vs_base})
        print(f"M={m} {name}: h relative error vs float64 {err:.3e}; bits of float64's h rounded to bf16 in "
              f"{same:.4f}; worst error / its row's max {worst:.2e}", flush=True)
    del ref
    _chained_rounds(cases, kernels, m, rounds, out, reps)


def _chained_rounds(cases: dict, kernels: list, m: int, rounds: int, out: list, reps: int) -> None:
    """Each case the median of ``reps`` calls in a row (CUDA events, no flush), in turn over ``rounds``; the
    ``kernels`` against the first of them and against the case "cuBLAS gate + up", as medians of per-round ratios."""
    names = list(cases)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            events = []
            for _ in range(reps):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                cases[name]()
                ev[1].record()
                events.append(ev)
            torch.cuda.synchronize()
            times[name].append(statistics.median(a.elapsed_time(b) for a, b in events))
    for name in names:
        out.append({"M": m, "what": "gate/up ms, chained", "case": name, "ms": statistics.median(times[name]),
                    "rounds": times[name]})
        print(f"M={m} {name}: {statistics.median(times[name]):.4f} ms", flush=True)
    for name in kernels[1:]:
        r = sorted(a / b for a, b in zip(times[kernels[0]], times[name]))
        print(f"M={m} {name} vs {kernels[0]}: {statistics.median(r):.3f}x (rounds {r[0]:.3f}-{r[-1]:.3f})", flush=True)
    for name in kernels:
        r = sorted(a / b for a, b in zip(times["cuBLAS gate + up"], times[name]))
        print(f"M={m} {name} vs cuBLAS gate + up: {statistics.median(r):.3f}x (rounds {r[0]:.3f}-{r[-1]:.3f})",
              flush=True)


def tail(ops: Operands, m: int, rounds: int, out: list, reps: int = 20) -> None:
    """The gate/up kernel with its last, partial round of tiles in whole tiles and in half tiles
    (``gm.prefill_tail_split``), against cuBLAS's gate and up GEMMs, back to back (``_chained_rounds``); the h of
    the two against each other."""
    xq, xs = ops.x_quant(torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16))
    args = (xq, xs, ops.w1, ops.s1, ops.w3, ops.s3, torch.bfloat16)
    cfg = gm.prefill_tile_config(m, ops.w1.shape[0], DIM)
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(ops.w1.shape[0], cfg["BLOCK_N"])
    sms = min(sm_count(torch.device("cuda")), tiles)  # (gated_prefill's programs)
    split = gm.prefill_tail_split(tiles, sms, cfg["BLOCK_M"])
    cases = {"whole tiles": lambda: gm.gated_prefill(*args, fast_accum=True, tail_split=False),
             "last round in half tiles": lambda: gm.gated_prefill(*args, fast_accum=True),
             "cuBLAS gate + up": lambda: ops.cublas_g_u(xq, xs)}
    whole, halves = cases["whole tiles"]()[0], cases["last round in half tiles"]()[0]
    same = torch.equal(whole, halves)
    out.append({"M": m, "what": "tail split", "tiles": tiles, "programs": sms, "split": split, "same_h_bits": same})
    print(f"M={m}: {tiles} tiles on {sms} programs, last round {tiles % sms} tiles, split {split}; the same h bits: "
          f"{same}", flush=True)
    _chained_rounds(cases, ["whole tiles", "last round in half tiles"], m, rounds, out, reps)


def profile(ms: list[int], out: list, calls: int = 20) -> None:
    """Each compiled block's kernels per call (torch.profiler), their GPU time and the call's span."""
    from benchmarks.profile_mlp import profiled

    fresh = mlp_factory("cuda")
    variants = {"fp8fx_fused_mlp": fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)[0],
                "fp8fx": fp8fx_module(fresh(), dynamic=False)[0]}
    _add_torchao(variants, fresh)
    for m in ms:
        x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
        for name, fn in variants.items():
            prof = profiled(fn, x, calls)
            host = []
            with torch.no_grad():
                torch.cuda.synchronize()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn(x)
                    host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            out.append({"M": m, "what": "host ms a call", "variant": name, "ms": statistics.median(host)})
            print(f"M={m} {name}: host {statistics.median(host):.4f} ms a call (no sync)", flush=True)
            if name == "fp8fx_fused_mlp":  # where the host time goes
                import cProfile
                import io
                import pstats

                prof_py = cProfile.Profile()
                with torch.no_grad():
                    prof_py.enable()
                    for _ in range(calls):
                        fn(x)
                    prof_py.disable()
                    torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(25)
                print(text.getvalue()[-6000:], flush=True)
            kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                             key=lambda e: e.time_range.start)
            per_call = len(kernels) // calls
            if not per_call or len(kernels) % calls:
                print(f"M={m} {name}: {len(kernels)} kernels in {calls} calls, not a whole number a call", flush=True)
                continue
            spans, busy, rows = [], [], {}
            for c in range(calls):
                ks = kernels[c * per_call:(c + 1) * per_call]
                spans.append((ks[-1].time_range.end - ks[0].time_range.start) / 1e3)
                busy.append(sum(k.time_range.elapsed_us() for k in ks) / 1e3)
                for i, k in enumerate(ks):
                    rows.setdefault((i, k.name[:90]), []).append(k.time_range.elapsed_us() / 1e3)
            span, gpu = statistics.median(spans), statistics.median(busy)
            out.append({"M": m, "what": "profile", "variant": name, "span_ms": span, "kernels_ms": gpu,
                        "kernels": [{"name": n, "ms": statistics.median(t)} for (_, n), t in sorted(rows.items())]})
            print(f"M={m} {name}: {per_call} kernels a call, span {span:.4f} ms, kernels {gpu:.4f} ms, gaps "
                  f"{span - gpu:.4f} ms", flush=True)
            for (_, n), t in sorted(rows.items()):
                print(f"    {statistics.median(t):.4f} ms  {n}", flush=True)


def block_rounds(ms: list[int], rounds: int, tiles: dict, out: list) -> None:
    fresh = mlp_factory("cuda")
    ref_mod = fresh().float()
    ops = Operands(fresh())
    variants = {"bf16_inductor": torch.compile(fresh(), dynamic=False),
                "fp8fx": fp8fx_module(fresh(), dynamic=False)[0],
                # the op's prefill kernels from GATED_PREFILL_MIN_M tokens (below: the unfused GEMMs, as fp8fx)
                "fp8fx_fused_mlp": fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)[0]}
    _add_torchao(variants, fresh)
    for m in ms:
        tile, block = tiles.get(m, (None, QUANT_BLOCKS[0]))
        variants_m = {**variants, "fp8fx_prefill_epilogue": ops.new_path(tile, block)}
        x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ref = ref_mod(x.float()).double()
            for name, fn in variants_m.items():
                out.append({"M": m, "what": "error vs float32", "variant": name, "rel_err": rel_err(fn(x), ref)})
            times = {name: [] for name in variants_m}
            names = list(variants_m)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(_ms(lambda: variants_m[name](x)))
        for name in names:
            out.append({"M": m, "what": "mlp block", "variant": name, "ms": statistics.median(times[name]),
                        "ms_rounds": times[name]})
        for anchor in ("torchao_rowwise", "bf16_inductor", "fp8fx"):
            for name in ("fp8fx", "fp8fx_fused_mlp", "fp8fx_prefill_epilogue") if anchor in times else ():
                r = sorted(a / b for a, b in zip(times[anchor], times[name]))
                print(f"M={m} {name} vs {anchor}: median {statistics.median(r):.3f}x (rounds {r[0]:.3f}-{r[-1]:.3f})",
                      flush=True)
        print(f"M={m} " + ", ".join(f"{n} {statistics.median(t):.4f}" for n, t in times.items()), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="2048,4096")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--profile", action="store_true", help="each block's kernels per call (torch.profiler)")
    p.add_argument("--gate-up", default="", metavar="NAME=FILE,...", help="the gate/up kernel against FILEs', tiles")
    p.add_argument("--down", action="store_true", help="the down GEMM with h quantized in its loads")
    p.add_argument("--rounding", action="store_true", help="the gate/up kernel with and without the model's roundings")
    p.add_argument("--tail", action="store_true", help="the gate/up kernel's last round in whole and in half tiles")
    p.add_argument("--ncu-driver", action="store_true", help="one launch of each prefill kernel (for ncu), then exit")
    p.add_argument("--no-rounds", action="store_true", help="skip the timed block rounds")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    if args.ncu_driver:
        return ncu_driver(ms[0])
    out: list = []
    tiles = {}
    try:
        if args.sweep:
            ops = Operands(mlp_factory("cuda")())
            for m in ms:
                tiles[m] = sweep(ops, m, out)
            del ops
        if args.gate_up:
            ops = Operands(mlp_factory("cuda")())
            for m in ms:
                gate_up_ab(ops, args.gate_up, m, args.rounds, out)
            del ops
        if args.down:
            ops = Operands(mlp_factory("cuda")())
            for m in ms:
                down_probe(ops, m, out)
            del ops
        if args.rounding:
            ops = Operands(mlp_factory("cuda")())
            for m in ms:
                rounding(ops, m, args.rounds, out)
            del ops
        if args.tail:
            ops = Operands(mlp_factory("cuda")())
            for m in ms:
                tail(ops, m, args.rounds, out)
            del ops
        if args.profile:
            profile(ms, out)
        if not args.no_rounds:
            block_rounds(ms, args.rounds, tiles, out)
    finally:
        with open(os.path.join(args.out, "prefill_study.json"), "w") as f:
            json.dump({"torch": torch.__version__, "rows": out}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
