"""fp8fx vs the alternatives on Llama-3-8B linear shapes and the MLP block, in one process.

    python benchmarks/bench_linear.py [--out DIR] [--ms 16,2048,4096] [--cpu-smoke]

Every row is a ratio against anchors measured in the same run (ANCHORS.md): bf16 (cuBLAS eager and
Inductor), Inductor's own fp8 lowering (the MLP written with `torch._scaled_mm`, ``ScaledMMMLP``),
cuBLAS fp8 row-wise `torch._scaled_mm` (GEMM only, pre-quantized activations), torchao float8 row-wise
(when importable). M up to --graph-max-m (256) is timed as CUDA-graph replays (each after a 256 MB read
that leaves the L2 clean: ``bench``): without them a compiled call's host time (guards, wrappers, custom-op
dispatch) exceeds the GPU time there.
Writes results.json and results.md (and plot.png when matplotlib is there) under --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

import fp8fx

LAYERS = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096)}
DIM, HIDDEN = 4096, 14336


class MLP(nn.Module):
    """Llama-3-8B MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


FALLBACKS: list[str] = []  # graph captures that failed (those rows are plain calls): reported with the results


class ScaledMMMLP(nn.Module):
    """The anchor "Inductor's own fp8 lowering": the same MLP written with ``torch._scaled_mm`` (weights
    per-channel, activations quantized per token in plain torch, fast accumulation), compiled by Inductor
    as it is: Inductor fuses the quantization into the producers and lowers ``_scaled_mm`` itself."""

    def __init__(self, mlp: MLP):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            wq, ws = fp8fx.quant.quantize(getattr(mlp, name).weight.detach().float(), [1, -1])
            self.register_buffer(f"{name}_wq", wq.t())  # [K, N], column-major: as _scaled_mm takes it
            self.register_buffer(f"{name}_ws", ws.reshape(1, -1).contiguous())

    def _linear(self, x, name):
        x2 = x.reshape(-1, x.shape[-1])
        scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
        xq = (x2.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, getattr(self, f"{name}_wq"), scale_a=scale, scale_b=getattr(self, f"{name}_ws"),
                             out_dtype=torch.bfloat16, use_fast_accum=True)
        return y.reshape(*x.shape[:-1], -1)

    def forward(self, x):
        return self._linear(nn.functional.silu(self._linear(x, "gate_proj")) * self._linear(x, "up_proj"), "down_proj")


def capture(fn, x) -> torch.cuda.CUDAGraph:
    """fn(x) as a CUDA graph, after three warm-up calls (compiles, allocations)."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    return g


def replay_ms(g: torch.cuda.CUDAGraph, flush=None, reps: int = 200) -> float:
    """Median ms of ``g``'s replays, each timed by its own events with ``flush()`` (untimed) before it."""
    import statistics

    for _ in range(5):
        g.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


@functools.lru_cache(maxsize=None)
def l2_flushes(device="cuda") -> dict:
    """What can run before a timed replay: ``do_bench``'s flush (zeroing 256 MB: the L2 is left full of dirty
    lines, written back to HBM while the timed kernels stream their weights), a read of the same buffer
    (clean lines, as a previous layer's weights would leave), or nothing."""
    buf = torch.zeros(256 << 20, dtype=torch.int8, device=device)
    return {"dirty": buf.zero_, "clean": lambda: buf.sum(dtype=torch.int64), "none": None}


def bench(fn, x, graph: bool) -> float:
    """Median ms of fn(x). With ``graph``: CUDA-graph replays, each after a read of 256 MB (the L2 left full
    of clean lines, as a decode step's previous layer leaves it; `do_bench`'s zeroing flush leaves dirty lines
    whose write-back added 0.004-0.009 ms to every decode replay, run 12 call 2, `flush_study.py`); plain calls
    (recorded in ``FALLBACKS``) where capture fails, and without ``graph``, through ``do_bench``."""
    return timer(fn, x, graph)()


def timer(fn, x, graph: bool, reps: int = 200):
    """A callable timing fn(x) as ``bench`` does, each call anew: the CUDA graph captured once (``.graph``
    says whether it was; capture failures are timed plainly and recorded in ``FALLBACKS``)."""
    import triton

    g = None
    if graph:
        try:
            g = capture(fn, x)
        except Exception as exc:  # noqa: BLE001 - a row timed plainly beats a run lost
            print(f"CUDA-graph capture failed ({exc!r:.200}); timing plain calls", file=sys.stderr)
            FALLBACKS.append(f"{exc!r:.200}")
    if g is not None:
        run = lambda: replay_ms(g, l2_flushes()["clean"], reps)  # noqa: E731
    else:
        run = lambda: triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")  # noqa: E731
    run.graph = g is not None
    # the graph holds the addresses of fn's weights and buffers, not the tensors: keep them alive while it replays
    # (run 35: a decoder layer freed after its capture faulted at its next replay)
    run.keeps = (fn, x)
    return run


def timed_in_rounds(timers: dict, rounds: int) -> dict:
    """name -> each round's time of ``timers``' (``timer``s), timed in turn ``rounds`` times over, each round
    starting one name later (no variant always runs first or after the same one)."""
    names = list(timers)
    times = {name: [] for name in names}
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timers[name]())
    return times


# a plain-call row whose host time a call is at least this share of its timed ms is marked host-bound: do_bench then
# times the host as much as the GPU (run 30: the fused MLP at 2048 tokens, 0.718 ms by do_bench against 0.514 ms of
# GPU time on a slow host)
HOST_BOUND = 0.9


def host_ms(fn, calls: int = 20, bursts: int = 5, busy_cycles: int = 0) -> float:
    """Median host time a call of fn(), ms: ``bursts`` bursts of ``calls`` calls, each burst after a sync, none
    waited for - what the host spends issuing one call (the GPU is idle at each burst's start, so it never holds the
    host back; 20 calls of a block are far from filling the launch queue). ``busy_cycles``: the GPU is first given a
    sleep that outlasts the burst, so no call can wait on it finishing anything (``host_study.py``)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(bursts):
        sync()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    sync()
    return statistics.median(times)


def rel_err(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def torchao_rowwise(module: nn.Module):
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except Exception as e:  # noqa: BLE001 - report why the anchor is missing
        return None, f"torchao unavailable: {type(e).__name__}: {e}"
    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return module, ""


def fp8fx_module(module: nn.Module, backend_kwargs=None, dynamic=None):
    fp8fx.quantize_(module, fp8fx.Fp8Config())
    backend = fp8fx.Fp8Backend(**(backend_kwargs or {}))
    return torch.compile(module, backend=backend, dynamic=dynamic), backend


def weight_gbs(variant: str, n: int, k: int, ms: float) -> float:
    """GB/s on an [n, k] weight: 2 bytes an element in bf16 (the ``bf16_cublas`` rows), 1 in fp8."""
    return n * k * (2 if variant == "bf16_cublas" else 1) / ms / 1e6


def run_gemms(ms, device, rows, errors, graph_max_m=64):
    for name, (n, k) in LAYERS.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        wq, ws = fp8fx.quant.quantize(w, [1, -1])
        # compiled for each M with static shapes, as run_mlp's variants are: with dynamic=None the second M recompiled
        # with a symbolic one that then served every later M, next to eager anchors of the exact shape
        fx_mod, _ = fp8fx_module(lin, dynamic=False)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = x.double() @ w.double().t()
            graph = m <= graph_max_m
            xq, xs = fp8fx.quant.quantize(x, [1, -1])
            times = {
                "bf16_cublas": bench(lambda x: torch.nn.functional.linear(x, w), x, graph),
                # fast accumulation, as fp8fx's default (Fp8Backend(use_fast_accum=True)) runs cuBLAS at prefill
                "fp8_cublas_gemm_only": bench(
                    lambda x: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1).contiguous(),
                                               out_dtype=torch.bfloat16, use_fast_accum=True),
                    x, graph,
                ),
            }
            with torch.no_grad():
                y = fx_mod(x)
                times["fp8fx"] = bench(fx_mod, x, graph)
            errors[f"{name} M={m} fp8fx"] = rel_err(y, ref)
            flops = 2 * m * n * k
            for variant, ms_ in times.items():
                rows.append({"what": f"linear {name} {n}x{k}", "M": m, "variant": variant, "ms": ms_,
                             "tflops": flops / ms_ / 1e9, "weight_gbs": weight_gbs(variant, n, k, ms_)})


MLP_VARIANTS = ("bf16_inductor", "fp8fx", "fp8fx_looped_quant", "fp8fx_fused_gate_up", "fp8fx_fused_mlp",
                "fp8fx_fused_mlp_tokens", "fp8fx_fused_mlp_g128", "fp8fx_fused_mlp_g32", "fp8fx_mma",
                "fp8fx_fused_mlp_mma", "fp8fx_fused_mlp_k1", "fp8fx_fused_mlp_rows", "fp8fx_pdl", "fp8fx_fused_mlp_pdl",
                "fp8fx_nopdl", "fp8fx_fused_mlp_nopdl", "inductor_scaled_mm", "torchao_rowwise")
# fp8fx_fused_mlp: Fp8Backend(fuse_mlp=True) as it is (since run 31 h in 1x32 groups at one token, 1x128 from two,
# per token at prefill); _tokens: h per token (mlp_h_group=None); _g128 / _g32: h in 1x128 / 1x32 groups named at
# every token count. The default --variants leave out g128, g32 (h in 1x32 groups, the fused MLP's fastest op
# at M = 1 in H200 run 19: 0.0495 ms against 0.0507 per token), the *_mma ones (the GEMV off), *_k1 (its loads
# unpipelined), *_rows (per-token h through quantize_rows at 1-16 tokens too) and *_pdl (decode GEMMs - programmatic
# dependents on sm_90 by default - letting the next launch start once they have waited: ``PDL_KEYS``,
# ``fp8_gemm.DECODE_PDL``), *_nopdl (those GEMMs launched plainly, as before run 35): they compare kernels, on request
DEFAULT_VARIANTS = tuple(v for v in MLP_VARIANTS
                         if not v.endswith(("_mma", "_k1", "_g128", "_g32", "_rows", "_pdl", "_nopdl")))
# the *_pdl variants' ``fp8_gemm.DECODE_PDL``: the next launch let in once each program has waited (run 35's chains:
# o 1.09-1.11x faster with it, qkv and down at 16 rows 0.86x and 0.90x)
PDL_KEYS = {"PDL_TRIGGER": True}


def with_kernel_setting(fn, name: str, value, module=None):
    """``fn`` with ``module``'s (default ``fp8fx.kernels.fp8_gemm``) ``name`` set to ``value`` while it runs (the
    kernel and its tile are chosen at each call, so a CUDA graph captured through this keeps them):
    ``GEMV_MAX_M = 0`` for the ``*_mma`` variants (one-row GEMMs on the tensor-core tiles, the kernels before the GEMV
    one), ``GEMV_K_STAGES = 1`` for ``*_k1`` (the GEMV's loads unpipelined, as before run 19), ``fp8fx.ops``'
    ``GATED_ROWS_MIN_M = 1`` for ``fp8fx_fused_mlp_rows`` (per-token h through ``quantize_rows`` at 1-16 tokens too,
    where the two kernels run by default: not timed against them as of run 29), ``DECODE_PDL = PDL_KEYS`` for
    ``*_pdl`` and None for ``*_nopdl``, each timed next to the default."""
    if module is None:
        from fp8fx.kernels import fp8_gemm as module

    @functools.wraps(fn)
    def call(*args, **kwargs):
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(module, name, saved)
    return call


def mlp_factory(device, seed: int = 0):
    """A function returning a new bf16 Llama-3-8B MLP on ``device`` each call, every one with the same weights (drawn
    once from ``seed``: N(0, 1 / K) for a linear of K inputs, as ``bench_decoder_layer.layer_factory``'s, so for
    x ~ N(0, 1) gate(x), up(x), h and the output are O(1)): one per variant, as each quantizes or compiles its own.
    (Until h183 nn.Linear's init, U(-1/sqrt(K), 1/sqrt(K)), divided by sqrt(K) again: gate(x) had std 0.009 and h
    4e-5 at K = 4096, where silu(g) is g/2 within 1%: the errors measured on it were a near-linear MLP's.)"""
    torch.manual_seed(seed)
    state = {k: (torch.randn_like(v) / v.shape[1] ** 0.5).to(device, torch.bfloat16)
             for k, v in MLP().state_dict().items()}

    def fresh():
        m = MLP().to(device, torch.bfloat16)
        m.load_state_dict(state)
        return m
    return fresh


def run_mlp(ms, device, rows, errors, compile_times, graph_max_m=64, only=DEFAULT_VARIANTS, save=lambda: None,
            rounds=1):
    """The MLP block at each M for the ``only`` variants; ``save()`` after each M. ``rounds`` > 1: the variants
    are timed in turn, ``rounds`` times over (each round in another order), and each row gets its median over
    the rounds and every round's time (``ms_rounds``): a ratio's spread from round to round is then known
    (run 13: one variant's time moved 5% between device calls, as wide as a goal's margin)."""
    fresh = mlp_factory(device)
    ref_mod = fresh().float()
    # every variant compiled for each M with static shapes, as decode's CUDA graphs are per batch size (the fused
    # MLP pass fuses only a static token count): until run 13 only the fused MLP was, and the others' second M
    # recompiled with a symbolic one (run 11: bf16 Inductor 5% slower that way at M=4096)
    variants = {"bf16_inductor": torch.compile(fresh(), dynamic=False)}
    variants["fp8fx"], backend = fp8fx_module(fresh(), dynamic=False)
    # options against the default: Inductor's own (looped) reduction heuristic; gate and up as one GEMM
    if "fp8fx_looped_quant" in only:
        variants["fp8fx_looped_quant"], _ = fp8fx_module(fresh(), {"one_pass_rows": None}, dynamic=False)
    if "fp8fx_fused_gate_up" in only:
        variants["fp8fx_fused_gate_up"], _ = fp8fx_module(fresh(), {"fuse_horizontal": True}, dynamic=False)
    if "fp8fx_fused_mlp" in only:  # decode: the MLP in two kernels; prefill: the prefill kernels
        variants["fp8fx_fused_mlp"], _ = fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)
    if "fp8fx_fused_mlp_tokens" in only:  # h per token (three kernels at 17-64 tokens)
        variants["fp8fx_fused_mlp_tokens"], _ = fp8fx_module(fresh(), {"fuse_mlp": True, "mlp_h_group": None},
                                                             dynamic=False)
    for g in (128, 32):  # the same with h in 1 x g groups: fused up to 64 tokens
        if f"fp8fx_fused_mlp_g{g}" in only:
            variants[f"fp8fx_fused_mlp_g{g}"], _ = fp8fx_module(fresh(), {"fuse_mlp": True, "mlp_h_group": g},
                                                                dynamic=False)
    if "fp8fx_mma" in only:
        variants["fp8fx_mma"] = with_kernel_setting(fp8fx_module(fresh(), dynamic=False)[0], "GEMV_MAX_M", 0)
    if "fp8fx_fused_mlp_mma" in only:
        variants["fp8fx_fused_mlp_mma"] = with_kernel_setting(
            fp8fx_module(fresh(), {"fuse_mlp": True, "mlp_h_group": None}, dynamic=False)[0], "GEMV_MAX_M", 0)
    if "fp8fx_fused_mlp_k1" in only:
        variants["fp8fx_fused_mlp_k1"] = with_kernel_setting(
            fp8fx_module(fresh(), {"fuse_mlp": True, "mlp_h_group": None}, dynamic=False)[0], "GEMV_K_STAGES", 1)
    if "fp8fx_fused_mlp_rows" in only:
        variants["fp8fx_fused_mlp_rows"] = with_kernel_setting(
            fp8fx_module(fresh(), {"fuse_mlp": True, "mlp_h_group": None}, dynamic=False)[0], "GATED_ROWS_MIN_M", 1,
            module=fp8fx.ops)
    for suffix, decode_pdl in (("_pdl", PDL_KEYS), ("_nopdl", None)):
        for base, options in (("fp8fx", {}), ("fp8fx_fused_mlp", {"fuse_mlp": True})):
            if base + suffix in only:
                variants[base + suffix] = with_kernel_setting(
                    fp8fx_module(fresh(), options, dynamic=False)[0], "DECODE_PDL", decode_pdl)
    if "inductor_scaled_mm" in only:
        variants["inductor_scaled_mm"] = torch.compile(ScaledMMMLP(fresh()), dynamic=False)
    if "torchao_rowwise" in only:
        ao, why = torchao_rowwise(fresh())
        if ao is not None:
            variants["torchao_rowwise"] = torch.compile(ao, dynamic=False)
        else:
            errors["torchao"] = why
    variants = {name: fn for name, fn in variants.items() if name in only}
    for m in ms:
        x = torch.randn(m, DIM, device=device, dtype=torch.bfloat16)
        graph = m <= graph_max_m
        with torch.no_grad():
            ref = ref_mod(x.float()).double()
            timers = {}
            for name, fn in variants.items():
                start = time.perf_counter()
                y = fn(x)
                torch.cuda.synchronize()
                compile_times[f"mlp {name} first call M={m}"] = time.perf_counter() - start
                errors[f"mlp M={m} {name}"] = rel_err(y, ref)
                timers[name] = timer(fn, x, graph, reps=max(50, 200 // rounds))
            times = timed_in_rounds(timers, rounds)
            names = list(timers)
            for name in names:
                t = statistics.median(times[name])
                row = {"what": "mlp block", "M": m, "variant": name, "ms": t,
                       "tflops": 3 * 2 * m * DIM * HIDDEN / t / 1e9, "graph_replay": timers[name].graph}
                if not timers[name].graph:  # plain calls: is the host as slow as the GPU?
                    row["host_ms"] = host_ms(lambda fn=variants[name]: fn(x))
                    if row["host_ms"] >= HOST_BOUND * t:
                        print(f"M={m} {name}: host {row['host_ms']:.4f} ms a call against {t:.4f} ms timed: "
                              "host-bound (do_bench timed the host)", flush=True)
                rows.append({**row, "ms_rounds": times[name]} if rounds > 1 else row)
            for anchor in ("bf16_inductor", "torchao_rowwise"):
                for name in names if rounds > 1 and anchor in times else ():
                    r = sorted(a / b for a, b in zip(times[anchor], times[name]))
                    print(f"M={m} {name} vs {anchor}, per round: min {r[0]:.3f}x, median {statistics.median(r):.3f}x, "
                          f"max {r[-1]:.3f}x", flush=True)
        save()  # a run cut at its time limit keeps the sizes it finished
    print(backend.report)


def cublas_blockwise(xq, xs, wq, ws):
    """cuBLAS 1x128 x 128x128 block-scaled GEMM (``F.scaled_mm``), or None where this torch lacks it: the call
    ``fp8fx.ops.cublas_block_scaled_mm`` makes, its operands laid out as cuBLAS takes them here, once. The scales
    of ``fp8fx.quantize`` (``run_kernels``'s, as a compiled model's) are in cuBLAS's outer-dim-major layout already;
    others would be copied so (empty_strided + copy_: a kernel of its own, ~2 us, several % of a 16-64-row GEMM),
    which the Triton kernels the anchor is set against do not run: timed inside the callable, such a copy would be
    charged to the anchor alone."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm"):
        return None
    x2, wt, scale_a, scale_b = fp8fx.ops.cublas_block_operands(xq, xs, wq, ws)
    return lambda: F.scaled_mm(x2, wt, scale_a, F.ScalingType.BlockWise1x128, scale_b,
                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def run_kernels(rows, errors, graph_max_m=64):
    """Block-scaled GEMMs (GEMM only, both sides pre-quantized) and the weight-only GEMM."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda") / k**0.5
        wq, ws = fp8fx.quant.quantize(w, [128, 128])
        wq_row, ws_row = fp8fx.quant.quantize(w, [1, -1])
        wb = w.bfloat16()
        for m in (1, 16, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w.double().t()
            # the op's activation quantization, as a compiled model runs it: its scales M-major (ops.act_scale_layout),
            # the layout cuBLAS's block GEMM takes (fp8fx.quant.quantize's row-major ones: a copy at each cuBLAS call)
            xq, xs = torch.ops.fp8fx.quantize(x, [1, 128])
            # small M as CUDA-graph replays: a plain call of a custom op costs ~50 us of host time,
            # more than these GEMMs (run 7 timed M <= 16 without graphs and measured the host)
            bench_ = lambda f: bench(lambda _: f(), None, graph=m <= graph_max_m)  # noqa: E731
            # the op (cuBLAS's block GEMM where ops.cublas_block_fits, else the Triton kernel) and the
            # Triton kernel itself
            fx_block = lambda: torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, [1, 128], [128, 128], torch.bfloat16)  # noqa: E731
            fx_triton = lambda: fp8_gemm(  # noqa: E731
                xq, wq, xs, ws, None, torch.bfloat16, a_block=(1, 128), b_block=(128, 128)
            )
            times = {"bf16_cublas": bench_(lambda: torch.nn.functional.linear(x, wb)), "fp8fx_block": bench_(fx_block),
                     "fp8fx_triton_block": bench_(fx_triton)}
            errors[f"block {name} M={m} fp8fx"] = rel_err(fx_block(), ref)
            errors[f"block {name} M={m} fp8fx triton"] = rel_err(fx_triton(), ref)
            cb = cublas_blockwise(xq, xs, wq, ws)
            if cb is not None:
                try:
                    errors[f"block {name} M={m} cublas"] = rel_err(cb(), ref)
                    times["cublas_block"] = bench_(cb)
                except (RuntimeError, ValueError) as e:  # e.g. scale layouts cuBLAS refuses at M=1
                    errors[f"block {name} M={m} cublas"] = f"unavailable: {str(e).splitlines()[0]}"
            if m <= 16:
                wo = lambda: torch.ops.fp8fx.weight_only_mm(x, wq_row, ws_row, None, [1, -1])  # noqa: E731
                times["fp8fx_weight_only"] = bench_(wo)
                errors[f"weight-only {name} M={m}"] = rel_err(wo(), ref)
            for variant, t in times.items():
                rows.append({"what": f"kernels {name} {n}x{k}", "M": m, "variant": variant, "ms": t,
                             "tflops": 2 * m * n * k / t / 1e9, "weight_gbs": weight_gbs(variant, n, k, t)})


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mlp = [r for r in rows if r["what"] == "mlp block"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in sorted({r["variant"] for r in mlp}):
        pts = sorted((r["M"], r["tflops"]) for r in mlp if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Llama-3-8B MLP block, H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios_table(rows):
    """The rows as a markdown table: ms, TFLOP/s, each anchor's ratio, and the host time a call of plain-call MLP
    rows (``host_ms``), marked where it reaches ``HOST_BOUND`` of the row's ms."""
    lines = ["| what | M | variant | ms | TFLOP/s | vs bf16 | vs torchao | vs Inductor fp8 | vs cuBLAS fp8 GEMM "
             "| vs cuBLAS block | host ms a call |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    index = {(r["what"], r["M"], r["variant"]): r["ms"] for r in rows}
    for r in rows:
        def ratio(anchor):
            a = index.get((r["what"], r["M"], anchor))
            return f"{a / r['ms']:.2f}x" if a else ""
        bf16 = "bf16_inductor" if r["what"] == "mlp block" else "bf16_cublas"
        host = r.get("host_ms")
        host = "" if host is None else f"{host:.4f}" + (" (host-bound)" if host >= HOST_BOUND * r["ms"] else "")
        lines.append(f"| {r['what']} | {r['M']} | {r['variant']} | {r['ms']:.4f} | {r['tflops']:.0f} | "
                     f"{ratio(bf16)} | {ratio('torchao_rowwise')} | {ratio('inductor_scaled_mm')} | "
                     f"{ratio('fp8_cublas_gemm_only')} | {ratio('cublas_block')} | {host} |")
    return "\n".join(lines)


def cpu_smoke():
    """Tiny run on CPU so CI keeps the script's fp8fx path working (no timing claims)."""
    torch.manual_seed(0)
    mlp = MLP(256, 512).to(torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x)
        try:  # the Inductor fp8 anchor; torch 2.11's CPU _scaled_mm takes per-tensor scales only
            anchor = f"{rel_err(torch.compile(ScaledMMMLP(mlp))(x), ref):.4f}"
        except RuntimeError as exc:
            anchor = f"not run: {str(exc).splitlines()[0][:120]}"
        fn, backend = fp8fx_module(mlp)
        err = rel_err(fn(x), ref)
    print(backend.report)
    print(f"cpu smoke: mlp rel err vs bf16 {err:.4f}; Inductor _scaled_mm anchor: {anchor}")
    return err if anchor.startswith("not run") else max(err, float(anchor))


COMPILE_TIME_VARIANTS = {"fp8fx": {}, "fp8fx_fused_mlp": {"fuse_mlp": True}}


def compile_time(variant: str = "fp8fx"):
    """First call (Dynamo + passes + Inductor, and the fp8fx kernels' Triton compiles) of the fp8fx MLP block at
    M=2048, as ``variant`` compiles it (one of ``COMPILE_TIME_VARIANTS``); run it in two fresh processes sharing
    TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR to see a cold and a warm cache."""
    mlp = MLP().cuda().to(torch.bfloat16)
    x = torch.randn(2048, DIM, device="cuda", dtype=torch.bfloat16)
    fn, _ = fp8fx_module(mlp, COMPILE_TIME_VARIANTS[variant], dynamic=False if variant != "fp8fx" else None)
    start = time.perf_counter()
    with torch.no_grad():
        fn(x)
    torch.cuda.synchronize()
    print(f"{variant} mlp first call: {time.perf_counter() - start:.2f} s")
    return 0


def main(argv=None, parser_class=argparse.ArgumentParser, prog=None):
    """``parser_class`` / ``prog``: the ``fp8fx bench`` command's (one-line errors, its name)."""
    p = parser_class(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--ms", default="1,16,64,256,2048,4096")
    p.add_argument("--compile-time", action="store_true",
                   help="only time the MLP block's first call, as one variant (--variants fp8fx or fp8fx_fused_mlp)")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--skip-gemms", action="store_true")
    p.add_argument("--skip-mlp", action="store_true")
    p.add_argument("--kernels", action="store_true", help="also block-scaled and weight-only GEMMs")
    p.add_argument("--variants", default=None,
                   help=f"the MLP block's variants, comma-separated, of {', '.join(MLP_VARIANTS)} (default: "
                        f"{', '.join(DEFAULT_VARIANTS)}; with --compile-time: fp8fx)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the MLP variants in turn this many times over (medians, every round kept in the JSON)")
    p.add_argument("--graph-max-m", type=int, default=256,
                   help="time M up to this as CUDA-graph replays (as serving engines run decode and small "
                        "batches); larger M as plain calls")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    variants = (args.variants or (",".join(DEFAULT_VARIANTS) if not args.compile_time else "fp8fx")).split(",")
    unknown = sorted(set(variants) - set(MLP_VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(MLP_VARIANTS)}")
    if args.compile_time and (len(variants) != 1 or variants[0] not in COMPILE_TIME_VARIANTS):
        p.error(f"--compile-time --variants {args.variants}: one of {', '.join(COMPILE_TIME_VARIANTS)}")
    if args.cpu_smoke:
        return 0 if cpu_smoke() < 0.1 else 1
    try:
        ms = [int(m) for m in args.ms.split(",")]
    except ValueError:
        p.error(f"--ms {args.ms!r}: token counts separated by commas, e.g. 1,16,4096")
    if any(m < 1 for m in ms):
        p.error(f"--ms {args.ms!r}: every token count must be positive")
    if not torch.cuda.is_available():
        p.error("the benchmark times CUDA kernels and needs a CUDA GPU; on CPU, --cpu-smoke runs it tiny")
    if args.compile_time:
        return compile_time(variants[0])
    os.makedirs(args.out, exist_ok=True)
    import triton

    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}
    rows, errors, compile_times = [], {}, {}
    # every variant compiles the same MLP.forward once per M (and backend): Dynamo's default limit of 8
    # entries per code object sent the later variants to eager in run 8's first try
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never time an eager fallback as compiled

    def save():  # after every stage: a run cut at its time limit keeps what it measured
        meta["graph_capture_fallbacks"] = FALLBACKS
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "errors": errors, "compile_s": compile_times}, f, indent=1)
        print(ratios_table(rows), flush=True)

    # the MLP block first: the goals are set on it
    if not args.skip_mlp:
        run_mlp(ms, "cuda", rows, errors, compile_times, args.graph_max_m, only=variants, save=save,
                rounds=args.rounds)
    if args.kernels:
        run_kernels(rows, errors, args.graph_max_m)
        save()
    if not args.skip_gemms:
        run_gemms(ms, "cuda", rows, errors, args.graph_max_m)
        save()
    table = ratios_table(rows)
    plot(rows, os.path.join(args.out, "plot.png"))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"{meta}\n\n{table}\n\nerrors: {json.dumps(errors, indent=1)}\n\ncompile: {json.dumps(compile_times, indent=1)}\n")
    print(meta)
    print(json.dumps(errors, indent=1))
    print(json.dumps(compile_times, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
