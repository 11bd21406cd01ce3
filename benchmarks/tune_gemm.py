"""Sweep the Triton fp8 GEMM's tiles on the Llama-3-8B shapes on the GPU and print the best per
(M, shape) next to the configuration ``tile_config`` picks now and next to cuBLAS.

    python benchmarks/tune_gemm.py            # decode (M = 1, 64), per-row scales: HBM bandwidth on the weight
    python benchmarks/tune_gemm.py --block    # 128x128 weight blocks, 1x128 activation groups (M = 4096)
    python benchmarks/tune_gemm.py --shapes down   # one layer
    python benchmarks/tune_gemm.py --gated    # the fused decode MLP's two kernels at M = 1, 16 (fp8fx.kernels.gated_mlp)
    python benchmarks/tune_gemm.py --gated-pdl    # only its programmatic-dependent-launch on / off
    python benchmarks/tune_gemm.py --gated --tma   # every down-GEMM candidate also with TMA weight loads
    python benchmarks/tune_gemm.py --gated --wide-k   # K steps of 256 and 512 instead
    python benchmarks/tune_gemm.py [--gated] --bm64   # 64-row (wgmma) tiles at M = 1, 16
    python benchmarks/tune_gemm.py --gated-ncu     # a few calls of it at M = 1 and 16, for ncu
    python benchmarks/tune_gemm.py --codes         # it with the down GEMM's h codes exact or by the reciprocal
    python benchmarks/tune_gemm.py --gemv          # M = 1: the GEMV kernel's tiles against the tensor-core tile,
                                                   # as single GEMMs and as the fused MLP's down GEMM
    python benchmarks/tune_gemm.py --gemv --block  # the same with 1x128 / 128x128 block scales
    python benchmarks/tune_gemm.py --block --duel  # the block kernel's default tile against cuBLAS's, 16-4096 rows
    python benchmarks/tune_gemm.py --gemv --k-stages 1,2,3,4  # GEMV tiles with the K loop pipelined (K_STAGES)
    python benchmarks/tune_gemm.py --groups        # the fused MLP with h in 1 x G groups against per-token h
    python benchmarks/tune_gemm.py --hbm           # each decode GEMM's TB/s on its weight at its default tile
    python benchmarks/tune_gemm.py --hbm --chain-mb 256  # the same, each kernel timed in a chain of launches
    python benchmarks/tune_gemm.py --rows32        # 17-32 rows in 32-row transposed tiles, as chains
    python benchmarks/tune_gemm.py --tickets       # split-K decode GEMMs, tickets zeroed each call or kept
    python benchmarks/tune_gemm.py --read-ceiling  # a read-only kernel at each weight size, timed as the chains
    python benchmarks/tune_gemm.py --down          # the down GEMM at 17-64 rows: tiles, as chains
    python benchmarks/tune_gemm.py --down --deep   # its default against tiles of K steps of 512, 7 rounds
    python benchmarks/tune_gemm.py --small-n       # qkv, o at 16-64 rows: every width / split / transposition, chained
    python benchmarks/tune_gemm.py --small-n --duel  # their 17-64-row tiles against each other, 7 rounds
    python benchmarks/tune_gemm.py --small-n --deep  # narrow unsplit tiles with K steps of 256-512 instead
    python benchmarks/tune_gemm.py --pdl           # decode GEMMs' chains with PDL and its early trigger
    python benchmarks/tune_gemm.py --accum         # ... promoted against fast accumulation (the backend's default)
    python benchmarks/tune_gemm.py --l2-next       # o's weight prefetched into L2 during attention, or not
    python benchmarks/tune_gemm.py --tma-a         # fp8 activation tiles by TMA or cp.async (M = 16, 64)
    python benchmarks/tune_gemm.py --m64           # M = 64, h in groups: where the down GEMM's time goes, deeper
                                                   # pipelines, the gate/up kernel's stages, G = 64 against 128
    python benchmarks/tune_gemm.py --gated --swap  # M = 16: its down GEMM transposed (SWAP_AB) or not
    python benchmarks/tune_gemm.py --swap --ms 16  # the decode GEMMs' tiles, each also transposed
    python benchmarks/tune_gemm.py --weight-only   # M = 16, bf16 activations and the fp8 weight (the fallback for
                                                   # GPUs without fp8 tensor cores) against bf16 cuBLAS

Every candidate is checked against the current configuration's output before it is timed.
"""
import argparse
import itertools
from typing import Optional

import torch
import triton
import triton.language as tl

from bench_linear import bench, cublas_blockwise  # run as a script: benchmarks/ is on sys.path
from fp8fx import quant
from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, mma_tile_config, tile_config

SHAPES = {"gate_up": (28672, 4096), "gate": (14336, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
          "o": (4096, 4096)}


def candidates(m, block: bool, tma: bool = False, bm64: bool = False, narrow: bool = False, small_m: bool = False,
               wide_n: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K, TMA)."""
    return [(*c, t) for c in _tiles(m, block, bm64, narrow, small_m, wide_n)
            for t in ((False, True) if tma else (False,))]


def with_swaps(cands: list[tuple]) -> list[tuple]:
    """``candidates`` each with SWAP_AB False, and again True where its N tile is 64+ rows (wgmma's left operand)."""
    return [(*c, False) for c in cands] + [(*c, True) for c in cands if c[1] >= 64]


def _tiles(m, block: bool, bm64: bool = False, narrow: bool = False, small_m: bool = False, wide_n: bool = False):
    if wide_n:  # M = 64 in 64-row tiles 64-128 wide, K split in 2-8: an activation tile re-read from L2 per weight
        # tile of 32 rows (the default down tile, 128 programs) is 2x the weight's bytes, 0.5x at 128 rows
        return itertools.product([64], [64, 128], [128, 256], [1], [4, 8], [3, 4], [2, 4, 8])
    if small_m:  # M = 64 in row tiles of 16 or 32 (mma.sync, as M <= 16 runs): the M tiles of one weight tile
        # launched next to each other (GROUP_M: all of them), so the weight comes from HBM once, then from L2
        return [(bm, bn, 128, -(-m // bm), 4, st, sk) for bm, bn, st, sk in
                itertools.product([16, 32], [32, 64], [4, 6], [1, 2, 4])]
    if narrow:  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K) of `_narrow_downs`
        return [tuple(c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K"))
                for c in _narrow_downs(16 if m <= 16 else 64)]
    if bm64:  # 64-row tiles at decode sizes: Hopper's wgmma takes the fp8 weight tile from shared memory as it is,
        # where 16-row tiles run mma.sync on fp16 (the weight tile converted in registers, ldmatrix)
        return itertools.product([64], [32, 64, 128], [128], [1], [4], [4], [1, 4, 8])
    if block:  # BLOCK_K is the 128 of the scale groups; prefill only (the target is M >= 2048): ~16 configs
        return itertools.product([64, 128], [128, 256], [128], [8], [4, 8], [3, 4], [1])
    if m <= 16:  # 24 configs per shape: a device call compiles each once (~1 s); BLOCK_K >= 256 spilled
        return itertools.product([16], [32, 64, 128], [128], [1], [4], [4, 6], [1, 2, 4, 8])
    return itertools.product([64], [32, 64], [128, 256], [1], [4], [4, 5], [1, 2, 4])


def time_ms(fn, graph: bool = False):
    """Median ms; as CUDA-graph replays for decode, where a plain call's launch (~20 us of Python)
    would hide a 15-40 us kernel (``bench_linear.bench``: a read of 256 MB before each, so a 25 MB weight does
    not stay in the H200's 50 MB L2 between replays), else plain calls through ``do_bench``."""
    if graph:
        return bench(lambda _: fn(), None, True)
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _gated_problem(m, dim=4096, hidden=14336):
    """Llama-3-8B MLP operands for ``gated_mlp`` at M=m (fp8, per-row scales), seeded."""
    torch.manual_seed(m)
    w1, w3 = (quant.quantize(torch.randn(hidden, dim, device="cuda") / dim**0.5, [1, -1]) for _ in range(2))
    w2 = quant.quantize(torch.randn(dim, hidden, device="cuda") / hidden**0.5, [1, -1])
    return quant.quantize(torch.randn(m, dim, device="cuda"), [1, -1]), w1, w3, w2


def _narrow_downs(bm):
    """Down-GEMM tiles of 16-32 weight rows with K split in 1-4: each program streams a long contiguous run of
    its rows (2-4 lines a step), and with no split, no partials are summed at the end (the split-K tail: a
    ticket's round trip, then the partials' reads, on the kernel's critical path)."""
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk)
            for (bn, sk), bk, w, st in itertools.product([(16, 1), (16, 2), (32, 2), (32, 4)], [256, 512], [2, 4],
                                                         [3, 4])]


def sweep_gated(ms=(1, 16), dim=4096, hidden=14336, tiles=True, tma=False, wide_k=False, bm64=False, narrow=False):
    """The Llama-3-8B MLP through ``gated_mlp`` (two kernels, one CUDA-graph replay, L2 flushed): with and
    without the down GEMM as a programmatic dependent launch; with ``tiles``, the gate/up kernel's tiles with
    the down GEMM's default, then the down GEMM's with the gate/up default. ``wide_k``: K steps of 256 and 512
    (each weight row read 2-4 lines at a time, not one 128-byte line per row and step), narrower N tiles, K
    split so that the steps divide evenly (Llama-3-8B's down: 112 steps of 128)."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config, gated_mlp, gated_tile_config

    for m in ms:
        (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
        run = lambda c1=None, c2=None, pdl=None: gated_mlp(  # noqa: E731
            xq, xs, *w1, *w3, *w2, None, kernels.QUANT_ROWS, None, torch.bfloat16, torch.bfloat16, configs=(c1, c2),
            pdl=pdl)
        ref = run().float()
        assert torch.equal(run(pdl=False).float(), ref)
        if torch.cuda.get_device_capability() < (9, 0):  # no programmatic dependent launch before Hopper
            on = off = time_ms(lambda: run(pdl=False), True)
        else:
            on, off = (time_ms(lambda: run(pdl=pdl), True) for pdl in (True, False))
        print(f"gated MLP M={m}: PDL on {on:.4f} ms, off {off:.4f} ms ({3 * dim * hidden / on / 1e9:.2f} / "
              f"{3 * dim * hidden / off / 1e9:.2f} TB/s on the weights)", flush=True)
        if not tiles:
            continue
        bm = 16 if m <= 16 else 64
        if narrow:  # the down GEMM only
            firsts, downs = [], _narrow_downs(bm)
        elif wide_k:
            firsts = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                      for bn, bk, w, st in itertools.product([16, 32], [256, 512], [4, 8], [3, 4])]
            downs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk)
                     for (bn, bk, sk), w, st in itertools.product(
                         [(128, 128, 8), (128, 256, 8), (128, 256, 14), (64, 256, 7), (64, 256, 8), (64, 256, 14),
                          (64, 512, 7), (64, 512, 14), (32, 256, 8), (32, 256, 14), (32, 512, 4), (32, 512, 7),
                          (32, 512, 14)], [4, 8], [3, 4])]
        elif bm64:  # 64-row tiles (wgmma on the fp8 weight tile as it is in shared memory) at M <= 16
            firsts = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128, num_warps=4, num_stages=st)
                      for bn, st in itertools.product([32, 64], [3, 4, 6])]
            downs = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk)
                     for bn, w, st, sk in itertools.product([64, 128], [4, 8], [3, 4], [4, 8, 16])]
        else:
            # 4 or 8 warps: the down GEMM's 4-warp programs hold 136 registers a thread and leave an SM's
            # schedulers without an eligible warp 57% of the time (ncu, run 12 call 1)
            firsts = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=w, num_stages=st)
                      for bn, w, st in itertools.product([32, 64], [4, 8], [4, 6])]
            downs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk, TMA=t)
                     for bn, w, st, sk, t in itertools.product([64, 128], [4, 8], [4, 6], [4, 8, 16],
                                                               (False, True) if tma else (False,))]
        for which, cands in (("gate/up", [(c, None) for c in firsts]), ("down", [(None, c) for c in downs])):
            results = []
            for c1, c2 in cands:
                try:
                    assert (run(c1, c2).float() - ref).abs().max() <= 2e-2 * ref.abs().max()
                    results.append((time_ms(lambda: run(c1, c2), True), c1 or c2))
                except Exception:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                    continue
            results.sort(key=lambda r: r[0])
            print(f"gated MLP M={m} {which}: {len(results)} of {len(cands)} candidates ran", flush=True)
            current = time_ms(run, True)
            top = " ; ".join(f"{t:.4f} {c}" for t, c in results[:6])
            default = gated_tile_config(m, hidden, dim) if which == "gate/up" else down_tile_config(m, dim, hidden)
            print(f"gated MLP M={m} {which}: current {current:.4f} ms ({3 * dim * hidden / current / 1e9:.2f} TB/s "
                  f"on the weights) {default} | best: {top}", flush=True)


def sweep_codes(ms=(1, 16), dim=4096, hidden=14336, rounds=7):
    """The fused MLP (one CUDA-graph replay, L2 flushed; the down GEMM on its tensor-core tile, whose codes this
    switch sets) with its down GEMM's h codes the correctly rounded
    quotient (``EXACT_CODES``, the default: two FMAs more per element) or the product by the reciprocal, in
    ``rounds`` interleaved rounds."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config, gated_mlp

    for m in ms:
        (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
        run = lambda exact: gated_mlp(  # noqa: E731
            xq, xs, *w1, *w3, *w2, None, kernels.QUANT_ROWS, None, torch.bfloat16, torch.bfloat16,
            configs=(None, {**down_tile_config(m, dim, hidden, gemv=False), "EXACT_CODES": exact}))
        ref = run(True).float()  # the two differ at rounding ties of h's quotients only
        assert (run(False).float() - ref).abs().max() <= 2e-2 * ref.abs().max()
        times = {True: [], False: []}
        for r in range(rounds):
            for exact in ((True, False) if r % 2 else (False, True)):
                times[exact].append(time_ms(lambda: run(exact), True))
        med = {e: sorted(t)[len(t) // 2] for e, t in times.items()}
        print(f"gated MLP M={m}: exact codes {med[True]:.4f} ms, by the reciprocal {med[False]:.4f} ms "
              f"(exact / reciprocal per round: {' '.join(f'{a / b:.3f}' for a, b in zip(times[True], times[False]))})",
              flush=True)


def gemv_candidates(k: int, k_stages=(1,)) -> list[dict]:
    """``fp8_gemv_kernel`` tiles: 1-8 warps splitting K (BLOCK_K = 512 per warp), 2-8 weight rows a program, K split
    so that the splits' steps are equal (up to 8 splits). With ``k_stages`` beyond 1 (the K loop's loads pipelined
    through shared memory, ``K_STAGES``): the run-16 winners' neighbourhood only (1-4 warps, 2-8 rows, K split in 1
    or 2), each at every stage count."""
    if tuple(k_stages) == (1,):
        out = []
        for warps, rows in itertools.product([1, 2, 4, 8], [2, 4, 8]):
            steps = -(-k // (512 * warps))
            for split in [s for s in (1, 2, 4, 7, 8) if steps % s == 0]:
                out.append(dict(GEMV=True, BLOCK_M=1, BLOCK_N=rows, BLOCK_K=512 * warps, num_warps=warps,
                                num_stages=1, SPLIT_K=split))
        return out
    out = []
    for (warps, rows), st in itertools.product([(1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4)], k_stages):
        steps = -(-k // (512 * warps))
        for split in [s for s in (1, 2) if steps % s == 0 and steps // s >= st]:
            out.append(dict(GEMV=True, BLOCK_M=1, BLOCK_N=rows, BLOCK_K=512 * warps, num_warps=warps, num_stages=1,
                            SPLIT_K=split, K_STAGES=st))
    return out


def _medians(runs: dict, rounds: int, graph: bool = True) -> dict:
    """Each of ``runs`` timed as CUDA-graph replays (``graph``; else plain calls through ``do_bench``) in ``rounds``
    interleaved rounds (every other round in reverse order): the median ms of each."""
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 else list(runs)[::-1]):
            times[name].append(time_ms(runs[name], graph))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _duel(label: str, runs: dict, bytes_: int, rounds: int) -> dict:
    """Each of ``runs`` timed as CUDA-graph replays in ``rounds`` interleaved rounds (every other round in reverse
    order); prints and returns the medians, with the bandwidth on ``bytes_``."""
    med = _medians(runs, rounds)
    print(f"{label}: " + ", ".join(f"{name} {t:.4f} ms ({bytes_ / t / 1e9:.2f} TB/s)" for name, t in med.items()),
          flush=True)
    return med


def block_duel(ms=(16, 64, 2048, 4096), rounds=5, shapes=None):
    """128x128 weight blocks with 1x128 activation groups: fp8fx's Triton kernel at its default tile (``fp8_gemm``,
    not the op, which sends M >= 2048 to cuBLAS) against cuBLAS's block-scaled GEMM (``F.scaled_mm``), interleaved
    rounds; CUDA-graph replays up to 512 rows (a plain call's host time is more than these GEMMs' there), plain
    calls through ``do_bench`` above. Run in two processes, one importing an older fp8fx, it times a kernel change
    against the kernel before it (each against the same cuBLAS)."""
    for name, (n, k) in (shapes or {key: SHAPES[key] for key in ("gate_up", "down", "qkv")}).items():
        torch.manual_seed(n + k)
        w = torch.randn(n, k, device="cuda") / k**0.5
        wq, ws = quant.quantize(w, [128, 128])
        for m in ms:
            x = torch.randn(m, k, device="cuda")
            xq, xs = quant.quantize(x, [1, 128])
            runs = {"triton": lambda: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, a_block=(1, 128),
                                               b_block=(128, 128))}
            if m >= 16:  # (cuBLAS's block mode takes no single row)
                runs["cublas"] = cublas_blockwise(xq, xs, wq, ws)
            ref = x.double() @ w.double().t()
            errs = {key: ((fn().double() - ref).abs().max() / ref.abs().max()).item() for key, fn in runs.items()}
            med = _medians(runs, rounds, graph=m <= 512)
            ratio = f", triton vs cuBLAS {med['cublas'] / med['triton']:.3f}x" if "cublas" in med else ""
            print(f"blocks {name} [{n}x{k}] M={m}: " + ", ".join(
                f"{key} {t:.4f} ms ({2 * m * n * k / t / 1e9:.0f} TFLOP/s, error {errs[key]:.4f})"
                for key, t in med.items()) + ratio, flush=True)


def sweep_gemv_blocks(shapes, rounds=5, k_stages=(1,)):
    """M = 1 with 1x128 activation groups and 128x128 weight blocks (DeepSeek-V3 style): GEMV tiles against the
    tensor-core block kernel (``mma_tile_config``, BLOCK_K = the group), interleaved rounds, graph replays."""
    blocks = dict(a_block=(1, 128), b_block=(128, 128))
    for name, (n, k) in shapes.items():
        wq, ws = quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, [128, 128])
        xq, xs = quant.quantize(torch.randn(1, k, device="cuda"), [1, 128])
        gemm = lambda cfg: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg, **blocks)  # noqa: E731
        ref = gemm(mma_tile_config(1, n, k)).float()
        results = []
        for warps, rows, st in itertools.product([1, 2, 4], [2, 4, 8], k_stages):
            cfg = dict(GEMV=True, BLOCK_M=1, BLOCK_N=rows, BLOCK_K=512 * warps, num_warps=warps, num_stages=1,
                       SPLIT_K=1, K_STAGES=st)
            assert (gemm(cfg).float() - ref).abs().max() <= 1e-2 * ref.abs().max()
            results.append((time_ms(lambda: gemm(cfg), True), cfg))
        results.sort(key=lambda r: r[0])
        print(f"{name} M=1 blocks GEMV sweep: " + " ; ".join(f"{t:.4f} {c}" for t, c in results[:4]), flush=True)
        best = results[0][1]
        _duel(f"{name} M=1 blocks [{n}x{k}]", {"gemv best": lambda: gemm(best), "gemv default": lambda: gemm(None),
                                               "mma block tile": lambda: gemm(mma_tile_config(1, n, k))}, n * k, rounds)


def sweep_gemv(shapes, dim=4096, hidden=14336, rounds=5, k_stages=(1,)):
    """M = 1. Each layer's GEMM (fp8 codes in): every GEMV candidate, then the best against the tensor-core tile
    (``mma_tile_config``) and cuBLAS in ``rounds`` interleaved rounds. Then the fused MLP with the down GEMM as a
    GEMV (h quantized as loaded) against its tensor-core down tile, the same way. CUDA-graph replays, L2 clean."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config, gated_mlp

    for name, (n, k) in shapes.items():
        wq, ws = quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, [1, -1])
        xq, xs = quant.quantize(torch.randn(1, k, device="cuda"), [1, -1])
        gemm = lambda cfg: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg)  # noqa: E731
        ref = gemm(mma_tile_config(1, n, k)).float()
        results = []
        for cfg in gemv_candidates(k, k_stages):
            try:
                assert (gemm(cfg).float() - ref).abs().max() <= 1e-2 * ref.abs().max()
                results.append((time_ms(lambda: gemm(cfg), True), cfg))
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is not a candidate
                print(f"{name}: {cfg} failed: {str(exc).splitlines()[0][:160]}")
        results.sort(key=lambda r: r[0])
        print(f"{name} M=1 GEMV sweep ({len(results)} ran): " + " ; ".join(f"{t:.4f} {c}" for t, c in results[:5]),
              flush=True)
        best = results[0][1]
        ws_row = ws.reshape(1, -1).contiguous()
        _duel(f"{name} M=1 [{n}x{k}]", {
            "gemv best": lambda: gemm(best), "gemv default": lambda: gemm(gemv_config(n, k)),
            "mma tile": lambda: gemm(mma_tile_config(1, n, k)),
            "cuBLAS": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)},
            n * k, rounds)

    (xq, xs), w1, w3, w2 = _gated_problem(1, dim, hidden)
    run = lambda c2: gated_mlp(  # noqa: E731
        xq, xs, *w1, *w3, *w2, None, kernels.QUANT_ROWS, None, torch.bfloat16, torch.bfloat16, configs=(None, c2))
    ref = run(down_tile_config(1, dim, hidden, gemv=False)).float()
    results = []
    for cfg in gemv_candidates(hidden, k_stages):
        try:
            assert (run(cfg).float() - ref).abs().max() <= 2e-2 * ref.abs().max()
            results.append((time_ms(lambda: run(cfg), True), cfg))
        except Exception as exc:  # noqa: BLE001
            print(f"fused MLP: {cfg} failed: {str(exc).splitlines()[0][:160]}")
    results.sort(key=lambda r: r[0])
    print(f"fused MLP M=1, down GEMM as GEMV ({len(results)} ran): "
          + " ; ".join(f"{t:.4f} {c}" for t, c in results[:5]), flush=True)
    best = results[0][1]
    _duel("fused MLP M=1 (whole op)", {"gemv best": lambda: run(best),
                                       "gemv default": lambda: run(down_tile_config(1, dim, hidden)),
                                       "mma down": lambda: run(down_tile_config(1, dim, hidden, gemv=False))},
          3 * dim * hidden, rounds)


def _tile_sweep(op, ref, firsts: list, downs: list, label: str):
    """``op(c1, c2)`` - the fused MLP op with the gate/up kernel's tile ``c1`` or the down GEMM's ``c2``, the other at
    its default - timed once per candidate (a CUDA-graph replay) whose output is within 1% of ``ref``'s largest value:
    (the results sorted by time, the best gate/up tile, the best down tile)."""
    results = []
    for c1, c2 in [(c, None) for c in firsts] + [(None, c) for c in downs]:
        try:
            err = (op(c1, c2).float() - ref).abs().max()
            assert err <= 1e-2 * ref.abs().max(), f"off by {err}"
            results.append((time_ms(lambda: op(c1, c2), True), c1, c2))
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is not a candidate
            print(f"{label}: {c1 or c2} failed: {str(exc).splitlines()[0][:160]}")
    results.sort(key=lambda r: r[0])
    best = lambda i: min((r for r in results if r[i] is not None), key=lambda r: r[0])[i]  # noqa: E731
    return results, best(1), best(2)


def sweep_groups(ms=(1, 16, 64), dim=4096, hidden=14336, rounds=5, groups=None, k_stages=(1,), tma=False):
    """The fused MLP with h quantized in 1 x G groups by the gate/up kernel's epilogue (``h_group``: fp8 codes and
    group scales leave it; the down GEMM reads them as K-grouped activations) against per-token h (quantized as the
    down GEMM loads it): a sweep of both kernels' tiles per group size, then the best of each in ``rounds``
    interleaved rounds. CUDA-graph replays of the op, L2 clean."""
    from fp8fx import ops
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import H_GROUPS, QUANT_GROUPS, down_tile_config, gated_mlp, gated_tile_config

    for m in ms:
        (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
        per_token = lambda: gated_mlp(xq, xs, *w1, *w3, *w2, None, kernels.QUANT_ROWS, None,  # noqa: E731
                                      torch.bfloat16, torch.bfloat16)
        grouped = lambda g, c1=None, c2=None: gated_mlp(  # noqa: E731
            xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16, configs=(c1, c2),
            h_group=g)
        bm = 1 if m == 1 else 16 if m <= 16 else 64
        runs = {"per-token h": per_token}
        for g in groups or H_GROUPS:
            args = [xq, xs, *w1, *w3, *w2, None, [1, -1], [1, -1], [1, g], [1, -1], None, "silu", torch.bfloat16,
                    torch.bfloat16, False]
            ref = ops._gated_mlp_reference(*args).float()
            firsts = [dict(gated_tile_config(m, hidden, dim, g), BLOCK_N=g, num_stages=st, num_warps=w)
                      for st, w in ((3, 4), (4, 4), (4, 8))]
            if m == 1:
                downs = [c for c in gemv_candidates(hidden, k_stages) if c["num_warps"] <= 2 and c["BLOCK_N"] <= 4]
            else:
                downs = [dict(BLOCK_M=max(bm, 16), BLOCK_N=bn, BLOCK_K=g, GROUP_M=1, num_warps=w, num_stages=4,
                              SPLIT_K=sk)
                         for bn, w, sk in [*itertools.product([64, 128], [4], [1, 2, 4, 8]), (128, 8, 2), (128, 8, 4)]]
                downs += [{**c, "TMA": True} for c in downs] if tma else []  # the weight by TMA copies
            results, best1, best2 = _tile_sweep(lambda c1, c2, g=g: grouped(g, c1, c2), ref, firsts, downs,
                                                f"M={m} G={g}")
            print(f"M={m} G={g} ({len(results)} ran; default {down_tile_config(m, dim, hidden, h_group=g)}): "
                  + " ; ".join(f"{t:.4f} {c1 or c2}" for t, c1, c2 in results[:5]), flush=True)
            runs[f"G={g} default"] = lambda g=g: grouped(g)
            runs[f"G={g} best"] = lambda g=g, b1=best1, b2=best2: grouped(g, b1, b2)
        _duel(f"fused MLP M={m}", runs, 3 * dim * hidden, rounds)


def sweep_m64(m=64, dim=4096, hidden=14336, rounds=5, groups=(64, 128)):
    """M = 64 with h in 1 x G groups (run 20: the block 1.63-1.66x bf16 against the 1.7x goal), three questions:
    (1) the down GEMM alone with h's K-grouped scales against the same codes with one scale per row (the
    grouped kernel scales each K step's partial product, so it waits for every wgmma; per row it chains them) -
    is that wait what it loses?; (2) deeper pipelines than the 4 stages run 19 swept (bytes in flight per SM);
    (3) the gate/up kernel's stages and warps, and G = 64 (224 programs of the gate/up kernel where G = 128 gives
    112 for 132 SMs). CUDA-graph replays, L2 clean; the best of each in ``rounds`` interleaved rounds."""
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, down_tile_config, gated_mlp, gated_tile_config

    (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
    torch.manual_seed(1)
    h = torch.randn(m, hidden, device="cuda") * torch.rand(m, hidden // 128, 1, device="cuda").repeat_interleave(
        128, 1).reshape(m, hidden)
    downs = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk, TMA=tma)
             for bn, sk, st, w, tma in [
                 *((64, 4, st, 4, tma) for st in (4, 5, 6, 8) for tma in (True, False)),
                 *((64, 2, st, 4, True) for st in (6, 8, 10, 12)),
                 *((64, 8, st, 4, True) for st in (3, 4)),
                 *((128, sk, st, w, True) for sk in (2, 4) for st in (4, 6) for w in (4, 8))]]
    # (1)
    for g in groups:
        hq_g, hs_g = quant.quantize(h, [1, g])
        hq_r, hs_r = quant.quantize(h, [1, -1])
        refs = {name: (q.float() * s.repeat_interleave(g, 1)[:, :hidden] if name == "groups" else q.float() * s)
                @ (w2[0].float() * w2[1].reshape(-1, 1)).t() for name, q, s in (("groups", hq_g, hs_g),
                                                                                   ("rows", hq_r, hs_r))}
        runs = {}
        for cfg in downs:
            cfg = {**cfg, "BLOCK_K": g}
            for name, args in (("groups", (hq_g, w2[0], hs_g, w2[1])), ("rows", (hq_r, w2[0], hs_r, w2[1]))):
                run = lambda c=cfg, a=args, grouped=name == "groups": fp8_gemm(  # noqa: E731
                    *a, None, torch.bfloat16, config=c, a_block=(1, g) if grouped else None)
                try:
                    err = (run().float() - refs[name]).abs().max()
                    assert err <= 1e-2 * refs[name].abs().max(), f"off by {err}"
                    runs[f"{name} {cfg}"] = (time_ms(run, True), run)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is not a candidate
                    print(f"down G={g} {name} {cfg} failed: {str(exc).splitlines()[0][:120]}")
        for name in ("groups", "rows"):
            best = sorted((t, k) for k, (t, _) in runs.items() if k.startswith(name))
            print(f"down M={m} G={g} {name}: " + " ; ".join(f"{t:.4f} {k}" for t, k in best[:6]), flush=True)
        tops = {k: runs[k][1] for k in [min((t, k) for k, (t, _) in runs.items() if k.startswith(n))[1]
                                        for n in ("groups", "rows")]}
        default = {**down_tile_config(m, dim, hidden, h_group=g), "BLOCK_K": g}
        tops["groups default"] = lambda: fp8_gemm(hq_g, w2[0], hs_g, w2[1], None, torch.bfloat16, config=default,
                                                  a_block=(1, g))
        _duel(f"down GEMM M={m} G={g}", tops, dim * hidden, rounds)
    # (2), (3): the op
    runs = {}
    for g in groups:
        op = lambda c1=None, c2=None, g=g: gated_mlp(  # noqa: E731
            xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16, configs=(c1, c2),
            h_group=g)
        ref = op().float()
        firsts = [dict(gated_tile_config(m, hidden, dim, g), BLOCK_N=g, num_stages=st, num_warps=w)
                  for st in (3, 4, 5, 6) for w in (4, 8)]
        results, best1, best2 = _tile_sweep(op, ref, firsts, [{**c, "BLOCK_K": g} for c in downs], f"op G={g}")
        print(f"op M={m} G={g}: " + " ; ".join(f"{t:.4f} {c1 or c2}" for t, c1, c2 in results[:8]), flush=True)
        runs[f"G={g} default"] = op
        runs[f"G={g} best"] = lambda op=op, b1=best1, b2=best2: op(b1, b2)
    _duel(f"fused MLP M={m}", runs, 3 * dim * hidden, rounds)


def _gate_up_launch(m, n, k, g=0, **tile):
    """A closure launching the fused MLP's gate/up kernel alone on random fp8 operands (per-token x, per-channel
    weights): h per token (``g`` 0: 16-bit h and its tile maxima) or in 1 x g groups, the default tile but for
    ``tile``."""
    from fp8fx.kernels.gated_mlp import gated_gemm_kernel, gated_tile_config

    torch.manual_seed(0)
    xq, xs = quant.quantize(torch.randn(m, k, device="cuda"), [1, -1])
    w1, w3 = (quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, [1, -1]) for _ in range(2))
    cfg = {**gated_tile_config(m, n, k, g), **({"BLOCK_N": g} if g else {}), **tile}
    h = torch.empty(m, n, device="cuda", dtype=quant.FP8_DTYPE if g else torch.bfloat16)
    parts = torch.empty(m, triton.cdiv(n, cfg["BLOCK_N"]), device="cuda")
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * parts.shape[1],)
    return lambda: gated_gemm_kernel[grid](
        xq, w1[0], w3[0], xs.reshape(-1), w1[1].reshape(-1), w3[1].reshape(-1), h, parts, parts, m, n, k, 0,
        xq.stride(0), 1, w1[0].stride(0), 1, h.stride(0), parts.stride(0), A_ROWWISE=m > 1, W_ROWWISE=True, ACT=0,
        IMPRECISE_K=None, H_GROUPS=bool(g), H_DTYPE=tl.bfloat16, **cfg)


def balance_probe(m=64, rounds=5):
    """Would the gate/up kernel stream faster on all 132 SMs? At M = 64 with h in 1x128 groups it runs one program
    per group: 112 for Llama-3-8B's 14336 columns. Times the kernel alone (CUDA-graph replays, L2 clean) on shapes
    of about the same weight bytes (2 x 14336 x 4096): 112 programs over K = 4096 against 132 programs (16896 columns)
    over K = 3456, and the 224 programs of 1x64 groups. A stream-K split of the real shape would give each SM the
    second one's work (3584 K steps / 132)."""
    shapes = {"112 x K 4096 (G=128, 8 warps)": (14336, 4096, 128, 8),
              "132 x K 3456 (G=128, 8 warps)": (16896, 3456, 128, 8),
              "132 x K 3456 (G=128, 4 warps)": (16896, 3456, 128, 4),
              "224 x K 4096 (G=64, 4 warps)": (14336, 4096, 64, 4),
              "264 x K 3456 (G=64, 4 warps)": (16896, 3456, 64, 4)}
    runs = {name: _gate_up_launch(m, n, k, g, num_warps=w) for name, (n, k, g, w) in shapes.items()}
    for fn in runs.values():
        fn()
    for name, t in _medians(runs, rounds).items():  # (16896 x 3456 is 0.56% fewer bytes than 14336 x 4096)
        n, k = shapes[name][:2]
        print(f"gate/up kernel alone M={m}, {name}: {t:.4f} ms ({2 * n * k / t / 1e9:.2f} TB/s)", flush=True)


def _layer_operands(m: int):
    """(name, N, K, xq, xs, wq, ws) of each Llama-3-8B layer GEMM (gate and up as one gate_up): fp8 per-token x [m, K],
    per-channel weight [N, K]."""
    for name, (n, k) in SHAPES.items():
        if name != "gate":
            wq, ws = quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, [1, -1])
            yield (name, n, k, *quant.quantize(torch.randn(m, k, device="cuda"), [1, -1]), wq, ws)


def _read_speed() -> float:
    """TB/s of a sum over 2 GiB of bf16 (the GPU's read speed, what a weight stream can reach)."""
    big = torch.ones(2**30, device="cuda", dtype=torch.bfloat16)
    return big.numel() * 2 / triton.testing.do_bench(lambda: big.sum(), rep=200, return_mode="median") / 1e9


GATE_LABEL = "gate (Fp8Backend()'s gate and up each; gate_up: fuse_horizontal's)"
AUTO_GROUP_NOTE = " (fuse_mlp's default groups at this M)"


def _hbm_makers(m: int, dim: int = 4096, hidden: int = 14336, cublas: bool = False) -> dict:
    """name -> (weight bytes, maker): each maker call draws fresh random operands and returns a closure launching
    one kernel on them at its default tile: every Llama-3-8B decode GEMM (``fp8_gemm``, per-token x, per-channel
    weights; with ``cublas`` also ``torch._scaled_mm`` on the same operands: gate_up as ``fuse_horizontal`` runs it,
    gate as the default backend runs gate and up, ``GATE_LABEL``) and the fused MLP's two kernels alone (gate/up per
    token at 1-16 rows and with h in 1x128 groups, and in ``auto_h_group(m)``'s groups where they are other than 128:
    1x32 at one row, what ``Fp8Backend(fuse_mlp=True)`` runs there, ``AUTO_GROUP_NOTE``; its down GEMM on h as that
    kernel leaves it, launched as the op launches it: ``gated_mlp.down_launch``)."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels import gated_mlp
    from fp8fx.passes.mlp import auto_h_group

    def layer(n, k, scaled_mm=False):
        def make():
            xq, xs, wq, ws = _operands(m, n, k)
            if scaled_mm:
                ws_row = ws.reshape(1, -1).contiguous()
                return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)
            return lambda: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16)
        return n * k, make

    def down(g):
        def make():
            h = torch.randn(m, hidden, device="cuda")
            w2, s2 = quant.quantize(torch.randn(dim, hidden, device="cuda") / hidden**0.5, [1, -1])
            cfg, pdl = gated_mlp.down_launch(h, w2, g)  # (the tile and PDL of the op's own launch)
            if g:
                hq, hs = quant.quantize(h, [1, g])
                return lambda: fp8_gemm(hq, w2, hs, s2, None, torch.bfloat16, config=cfg, a_block=(1, g), pdl=pdl)
            # 16-bit h quantized as it is loaded, from the gate/up kernel's tile maxima (32-wide tiles)
            hb = h.bfloat16()
            parts = hb.float().abs().reshape(m, -1, 32).amax(-1)
            return lambda: fp8_gemm(hb, w2, parts, s2, None, torch.bfloat16, config=cfg, a_quant=kernels.QUANT_ROWS,
                                    pdl=pdl)
        return dim * hidden, make

    makers = {}
    for name, (n, k) in SHAPES.items():
        # gate: the default Fp8Backend() runs gate and up as two GEMMs of this shape (at one row the GEMV kernel,
        # gemv_fits), gate_up (the tensor-core tile at one row too) is fuse_horizontal's
        label = GATE_LABEL if name == "gate" else name
        makers[label] = layer(n, k)
        if cublas:
            makers[f"{label}, cuBLAS fp8"] = layer(n, k, scaled_mm=True)
    if cublas:  # what a plain read of each weight size reaches the same way: the bandwidth a kernel of that size has
        for size in sorted({makers[name][0] for name in makers}):
            makers[f"read of {size / 1e6:.1f} MB (torch.sum)"] = (size, lambda size=size: torch.ones(
                size // 2, device="cuda", dtype=torch.bfloat16).sum)
    auto = auto_h_group(m)  # the groups Fp8Backend(fuse_mlp=True) quantizes h in at m rows (mlp_h_group="auto")
    for g in ((0, 128) if m <= 16 else (128,)) + ((auto,) if auto != 128 else ()):
        label = (f"h in 1x{g} groups" if g else "per-token h") + (AUTO_GROUP_NOTE if g == auto != 128 else "")
        makers[f"fused gate/up kernel, {label}"] = (2 * hidden * dim, lambda g=g: _gate_up_launch(m, hidden, dim, g))
        makers[f"fused down GEMM, {label}"] = down(g)
    return makers


def hbm_table(ms=(1, 16, 64), rounds=3, dim=4096, hidden=14336, chain_bytes=0):
    """Issue 4's "each GEMM >= 75% of HBM bandwidth on its weight bytes", at the default tiles (``_hbm_makers``), as
    CUDA-graph replays after a clean L2 flush (the median of ``rounds`` interleaved rounds), each against the H200's
    read speed measured here (a sum over 2 GiB) and the 4.25 TB/s copy of ANCHORS.md.

    ``chain_bytes``: each replay is a chain of R launches of the kernel, each on operands of its own (R = the
    weights' bytes over ``chain_bytes``, 2-16), and its time is the replay's over R: the kernel as a decode step runs
    it, one launch after another in one graph, its start overlapping nothing but not waiting on a graph launch
    either. cuBLAS fp8 (``torch._scaled_mm``) and a plain read of each weight size (``torch.sum``) are timed the same
    way. 0: one launch per replay (runs 16-21)."""
    read = _read_speed()
    print(f"read speed (sum of 2 GiB): {read:.2f} TB/s; copy (ANCHORS.md): 4.25 TB/s"
          + (f"; chains of >= {chain_bytes / 1e6:.0f} MB of weights" if chain_bytes else "; one launch per replay"),
          flush=True)
    for m in ms:
        runs, nbytes, chain = {}, {}, {}
        for name, (size, make) in _hbm_makers(m, dim, hidden, cublas=bool(chain_bytes)).items():
            torch.manual_seed(len(name))
            reps = _chain_len(size, chain_bytes) if chain_bytes else 1
            launches = [make() for _ in range(reps)]
            runs[name] = launches[0] if reps == 1 else lambda launches=launches: [f() for f in launches]
            nbytes[name], chain[name] = size, reps
        for fn in runs.values():
            fn()
        for name, t in _medians(runs, rounds).items():
            t /= chain[name]
            tbs = nbytes[name] / t / 1e9
            print(f"M={m} {name}: {t:.4f} ms" + (f" (chain of {chain[name]})" if chain_bytes else "")
                  + f", {nbytes[name] / 1e6:.1f} MB, {tbs:.2f} TB/s = {tbs / read:.0%} of the read speed, "
                  f"{tbs / 4.25:.0%} of the copy", flush=True)
        del runs
        torch.cuda.empty_cache()


def _chain_len(size: int, chain_bytes: int) -> int:
    """How many launches a chain of kernels on ``size`` bytes of weight each takes to stream ``chain_bytes``: 2-16."""
    return min(16, max(2, -(-chain_bytes // size)))


def _operands(m: int, n: int, k: int, x_block=(1, -1)) -> tuple:
    """(xq, xs, wq, ws): random fp8 x [m, k] (per token, or in ``x_block`` groups) and per-channel weight [n, k] on
    the GPU."""
    return (*quant.quantize(torch.randn(m, k, device="cuda"), list(x_block)),
            *quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, [1, -1]))


def _chain_operands(m: int, n: int, k: int, chain_bytes: int, x_block=(1, -1)) -> list:
    """``_operands`` per launch of a chain (``_chain_len``), each launch's of its own, seeded by m."""
    torch.manual_seed(m)
    return [_operands(m, n, k, x_block) for _ in range(_chain_len(n * k, chain_bytes))]


def sweep_small_n(ms=(16, 32, 64), shapes=("qkv", "o"), chain_bytes=256 << 20, deep=False):
    """The decode GEMMs with few 64-wide N tiles (qkv 6144x4096: 96, o 4096x4096: 64, for 132 SMs) at 2-64 rows:
    tiles 32-128 wide, K split in 1-8, transposed or not, weight (and at 17-64 rows activation) by TMA or not, each
    timed as a chain of launches on >= ``chain_bytes`` of weights (``hbm_table``: as a decode step runs them) next
    to the default tile and cuBLAS fp8, each checked against the default's output first.

    ``deep``: narrow tiles (16-32 weight rows) with long K steps (256-512) and K split in 1-2 instead: unsplit, no
    partial sums wait on a ticket at the end (a store, an atomic and the partials' reads in a row, after the last
    weight byte), and the long steps keep as many bytes in flight per program as the 64-wide split tiles."""
    from fp8fx.kernels import fp8_gemm as kernels

    for name, m in itertools.product(shapes, ms):
        n, k = SHAPES[name]
        ops_ = _chain_operands(m, n, k, chain_bytes)
        reps = len(ops_)
        chain = lambda cfg=None: [fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg)  # noqa: E731
                                  for xq, xs, wq, ws in ops_][0]
        ref = chain().float()
        if deep:
            tiles = itertools.product([16 if m <= 16 else 64], [16, 32], [3, 4, 6], [1, 2], [False, True], [False],
                                      [256, 512])
        elif m <= 16:
            tiles = itertools.product([16], [32, 64], [4, 6], [1, 2, 4, 8], [False, True], [False], [128])
        else:
            tiles = itertools.product([64], [32, 64, 128], [4, 5], [1, 2, 4], [True], [False, True], [128])
        results = []
        for bm, bn, stages, split, tma, tma_a, bk in tiles:
            for swap in (False, True) if bn >= 64 else (False,):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=stages,
                           SPLIT_K=split, TMA=tma, TMA_A=tma_a, SWAP_AB=swap)
                try:
                    assert (chain(cfg).float() - ref).abs().max() <= 1e-2 * ref.abs().max()
                    results.append((time_ms(lambda cfg=cfg: chain(cfg), True) / reps, cfg))
                except Exception:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                    continue
        results.sort(key=lambda r: r[0])
        current = time_ms(chain, True) / reps
        scaled = [(xq, wq.t(), xs, ws.reshape(1, -1).contiguous()) for xq, xs, wq, ws in ops_]
        cublas = time_ms(lambda: [torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                                  for a, b, sa, sb in scaled], True) / reps
        tbs = lambda t: n * k / t / 1e9  # noqa: E731  weight bytes / ms -> TB/s
        print(f"{name} M={m} (chains of {reps}): default {current:.4f} ms ({tbs(current):.2f} TB/s) "
              f"{kernels.tile_config(m, n, k)} | cuBLAS fp8 {cublas:.4f} | "
              + " ; ".join(f"{t:.4f} ({tbs(t):.2f} TB/s) {c}" for t, c in results[:5]), flush=True)


def sweep_down(ms=(32, 64), rounds=5, chain_bytes=256 << 20):
    """The down GEMM 4096x14336 at 17-64 rows, fp8 h per token and in 1 x 128 groups (the fused MLP's default h
    there), as chains of launches (``hbm_table``; split-K tickets kept, as in a captured decode step since run 32):
    tiles 32-128 wide, K steps of 128 or 256, 4-6 stages, K split in 2-8, activations by TMA or not, transposed or
    not, each timed once; the five best re-timed against the default in ``rounds`` interleaved rounds."""
    for m, g in itertools.product(ms, (0, 128)):
        # the default: fp8_gemm's tile for per-token h, the fused MLP's down tile for h in groups (its route there)
        chain, reps, n, k, default = _decode_chain("down-g128" if g else "down", m, chain_bytes)
        ref = chain(default)[0].float()
        results = []
        for bn, bk, stages, split, tma_a in itertools.product([32, 64, 128], [128] if g else [128, 256], [4, 6],
                                                               [2, 4, 8], [False, True]):
            for swap in (False, True) if bn >= 64 else (False,):
                cfg = dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=stages,
                           SPLIT_K=split, TMA=True, TMA_A=tma_a, SWAP_AB=swap)
                t = _chain_tile_ms(chain, cfg, ref, reps)
                results += [(t, cfg)] if t is not None else []
        results.sort(key=lambda r: r[0])
        runs = {"default": lambda: chain(default),
                **{f"#{i + 1} {c}": lambda c=c: chain(c) for i, (_, c) in enumerate(results[:5])}}
        med = _medians(runs, rounds)
        label = f"h in 1x{g} groups" if g else "per-token h"
        print(f"down M={m}, {label} (chains of {reps}; {len(results)} tiles): " + " | ".join(
            f"{name} {t / reps:.4f} ms ({reps * n * k / t / 1e9:.2f} TB/s)" for name, t in med.items()), flush=True)


def down_deep_duel(ms=(32, 64), rounds=7, chain_bytes=256 << 20):
    """The down GEMM 4096x14336 at 17-64 rows, fp8 h per token: the default tile against tiles of K steps of 512
    (o's long-step tile of run 32: 32 wide, unsplit - 128 programs - or split in 2, and 64 wide split in 2), each as a
    chain of launches (``hbm_table``), in ``rounds`` interleaved rounds."""
    tiles = {"default": None, "32 wide, unsplit, 4 stages": LONG_STEPS,
             "32 wide, unsplit, 3 stages": {**LONG_STEPS, "num_stages": 3},
             "32 wide, split 2": {**LONG_STEPS, "SPLIT_K": 2},
             "64 wide, split 2, 3 stages": {**LONG_STEPS, "BLOCK_N": 64, "SPLIT_K": 2, "num_stages": 3}}
    for m in ms:
        _chain_duel("down", m, tiles, rounds, chain_bytes)


def _chain_tile_ms(chain, cfg: dict, ref: torch.Tensor, reps: int, failed: str = "") -> Optional[float]:
    """ms per launch of ``chain(cfg)`` (``_decode_chain``: ``reps`` launches), timed once its first launch's output is
    within 1% of ``ref``'s largest value; None for a tile that fails (out of shared memory etc.: not a candidate),
    printed after ``failed`` where it is given."""
    try:
        assert (chain(cfg)[0].float() - ref).abs().max() <= 1e-2 * ref.abs().max()
        return time_ms(lambda: chain(cfg), True) / reps
    except Exception as e:  # noqa: BLE001 - out of shared memory etc.: not a candidate
        if failed:
            print(f"  {failed} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
        return None


def _decode_problem(name: str, m: int) -> tuple:
    """(n, k, x block, default tile) of the decode GEMM ``name`` at ``m`` rows: ``SHAPES``' weight, fp8 x per token
    and ``fp8_gemm``'s tile; ``down-g128``: down with x in 1 x 128 groups, the fused MLP's h there, and the fused MLP's
    tile for it (``down_tile_config``)."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config

    g = 128 if name.endswith("-g128") else 0
    n, k = SHAPES[name.split("-")[0]]
    default = down_tile_config(m, n, k, h_group=g) if g else kernels.for_device(tile_config(m, n, k),
                                                                                 torch.device("cuda"))
    return n, k, (1, g or -1), default


def _decode_chain(name: str, m: int, chain_bytes: int) -> tuple:
    """(chain, reps, n, k, default tile) of the decode GEMM ``name`` at ``m`` rows (``_decode_problem``):
    ``chain(cfg)`` runs ``fp8_gemm`` on each launch's operands of its own (``_chain_operands``)."""
    n, k, x_block, default = _decode_problem(name, m)
    ops_ = _chain_operands(m, n, k, chain_bytes, x_block)
    blocks = dict(a_block=x_block) if x_block[1] != -1 else {}

    def chain(cfg=None):  # (a config's "pdl": each launch a programmatic dependent of the one before, ``pdl_duel``;
        # "fast": Hopper's fast accumulation, ``accum_duel``)
        pdl, fast = bool(cfg and cfg.get("pdl")), bool(cfg and cfg.get("fast"))
        cfg = {key: v for key, v in cfg.items() if key not in ("pdl", "fast")} if cfg else cfg
        return [fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg, pdl=pdl, fast_accum=fast, **blocks)
                for xq, xs, wq, ws in ops_]
    return chain, len(ops_), n, k, default


def sweep_rows32(ms=(32,), duel_ms=(24, 32), shapes=("down", "down-g128", "qkv", "o"), rounds=7,
                 chain_bytes=256 << 20):
    """17-32 rows in 32-row transposed tiles (``SWAP_AB``: 64-128 weight rows are wgmma's left operand, the 32
    activation rows its right one), which no sweep before run 33 tried: the 17-64-row sweeps (``--down``,
    ``--small-n``) took 64-row tiles, half padding at 32 rows, where the 2-16-row transposed tiles reached 75% of HBM
    on down. Down (fp8 x per token, and in 1 x 128 groups: ``_decode_chain``), qkv, o at ``ms`` rows: tiles 64/128
    wide, K steps of 128/256 at 4-8 stages, K split so the grid has 90-600 programs, the weight by TMA, each checked
    against the default's output and timed once as a chain (``hbm_table``); then at ``duel_ms`` the default against
    the three best in ``rounds`` interleaved rounds (and a default with both operands by TMA, gate_up's, against
    itself with the weight alone by TMA: ``--rows32 --shapes gate_up``)."""
    for name in shapes:
        best = []
        for m in ms:
            chain, reps, n, k, default = _decode_chain(name, m, chain_bytes)
            ref = chain(default)[0].float()
            steps = [(128, 4), (128, 6), (128, 8)] + ([] if name.endswith("-g128") else [(256, 4)])
            results = []
            for bn, (bk, stages), split in itertools.product([64, 128], steps, [1, 2, 4, 8]):
                if not (90 <= triton.cdiv(n, bn) * split <= 600 and k // (bk * split) >= 2):
                    continue
                cfg = dict(BLOCK_M=32, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=stages,
                           SPLIT_K=split, SWAP_AB=True, TMA=True)
                t = _chain_tile_ms(chain, cfg, ref, reps, failed=f"{name} M={m}")
                results += [(t, cfg)] if t is not None else []
            results.sort(key=lambda r: r[0])
            print(f"{name} M={m}: default {time_ms(chain, True) / reps:.4f} ms {default} | {len(results)} tiles, "
                  "each once: " + " ; ".join(f"{t:.4f} {c}" for t, c in results[:5]), flush=True)
            best += [c for _, c in results[:3] if c not in best]
        for m in duel_ms:
            default = _decode_problem(name, m)[3]
            tiles = {"default": default, **{f"#{i + 1} {c}": c for i, c in enumerate(best[:3])}}
            if default.get("TMA_A"):  # (gate_up's 17-63-row tile: the 64-row activation box, untimed there)
                tiles["the default, the weight alone by TMA"] = {**default, "TMA_A": False}
            _chain_duel(name, m, tiles, rounds, chain_bytes)


# 32-wide tiles over the whole K in steps of 512 (``mma_tile_config``'s tile for o at 17-64 rows since run 32)
LONG_STEPS = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=4)


def _chain_duel(name: str, m: int, tiles: dict, rounds: int, chain_bytes: int, exact: bool = False) -> None:
    """``tiles`` (label -> ``fp8_gemm`` config, None: the default) of the decode GEMM ``name`` (``_decode_chain``) at
    ``m`` rows against each other, each as a chain of launches (``hbm_table``) in ``rounds`` interleaved rounds,
    their outputs checked against the first's (``exact``: every launch's, bit for bit: one tile launched otherwise);
    prints ms per launch."""
    chain, reps, n, k, _ = _decode_chain(name, m, chain_bytes)
    runs = {label: lambda cfg=cfg: chain(cfg) for label, cfg in tiles.items()}
    outs = [run() if exact else run()[0].float() for run in runs.values()]
    if exact:
        assert all(torch.equal(a, b) for out in outs for a, b in zip(out, outs[0]))
    else:
        assert all((out - outs[0]).abs().max() <= 1e-2 * outs[0].abs().max() for out in outs)
    med = _medians(runs, rounds)
    print(f"{name} M={m} (chains of {reps}), ms per launch: "
          + ", ".join(f"{label} {t / reps:.4f} ({reps * n * k / t / 1e9:.2f} TB/s)" for label, t in med.items()),
          flush=True)


def pdl_duel(ms=(1, 16, 32, 64), shapes=("o", "qkv", "down", "gate_up"), rounds=5, chain_bytes=256 << 20):
    """Issue 4's 75% of HBM for the small decode GEMMs, where the Triton tiles were swept out (runs 21-34) and a kernel
    that only reads o's 16.8 MB reaches 67% alone (run 32): the time a launch loses ramping up and draining, overlapped
    with the launch before. Each default tile (``_decode_problem``) as a chain of launches (``hbm_table``): plain; each
    launch a programmatic dependent of the one before (``pdl``: its programs wait for it); each also letting the next
    launch as soon as its own programs have waited (``PDL_TRIGGER``: the next one's programs take the SMs this grid
    leaves, and wait). ``rounds`` interleaved rounds, outputs checked bit for bit against the plain chain's; ms per
    launch and TB/s on the weights, against the read speed measured first. (Run 35 timed a third: each program also
    prefetching its weight rows into L2 before the wait, 2-52% slower everywhere, then removed.)"""
    print(f"read speed (sum of 2 GiB): {_read_speed():.2f} TB/s", flush=True)
    for name in shapes:
        for m in ms:
            default = _decode_problem(name, m)[3]
            pdl = {**default, "pdl": True}
            tiles = {"plain": default, "pdl": pdl, "pdl, trigger": {**pdl, "PDL_TRIGGER": True}}
            _chain_duel(name, m, tiles, rounds, chain_bytes, exact=True)


def accum_duel(ms=(16, 32, 64), shapes=("o", "qkv", "down", "down-g128", "gate_up"), rounds=5,
               chain_bytes=256 << 20):
    """Every per-GEMM share of HBM since run 21 (``hbm_table``, ``pdl_duel``, run 40's study) was timed with
    ``fp8_gemm``'s default, ``fast_accum=False``: each K step's product promoted into the float32 sum, which waits
    for the step's wgmma before the next is issued. ``Fp8Backend``'s default is ``use_fast_accum=True``: one
    accumulator over K, the dots left in flight, the way the decode step runs. Run 38 found the tiles' times fit the
    sum of their memory and tensor times, not their maximum; this asks whether promotion is that sum. Each default
    tile at 16-64 rows (the one-row GEMV has no wgmma), promoted and fast, plain and as PDL dependents with the
    trigger, as chains (``hbm_table``) in ``rounds`` interleaved rounds; ms per launch and TB/s on the weights."""
    read = _read_speed()
    print(f"read speed (sum of 2 GiB): {read:.2f} TB/s", flush=True)
    for name in shapes:
        for m in ms:
            default = _decode_problem(name, m)[3]
            trigger = {"pdl": True, "PDL_TRIGGER": True}
            tiles = {"promoted": default, "fast": {**default, "fast": True},
                     "promoted, pdl+trigger": {**default, **trigger}, "fast, pdl+trigger": {**default, **trigger,
                                                                                             "fast": True}}
            _chain_duel(name, m, tiles, rounds, chain_bytes)


def pre_wait_duel(ms=(1,), shapes=("o", "qkv", "down"), rounds=5, chain_bytes=256 << 20):
    """The launch's ramp, overlapped with the launch before by more than its programs' start (``pdl_duel``): each
    program also loads its weight's first K steps before its wait (``PRE_WAIT``: the GEMV's first 1, 2 or 4 steps),
    while the kernel before still runs - into registers, not L2, where run 35's prefetch before the wait lost
    everywhere. Each default tile (``_decode_problem``: the GEMV at one row) as a chain of launches (``hbm_table``),
    each launch a programmatic dependent of the one before, with and without ``PDL_TRIGGER`` (which lets the next
    launch's programs - and their early loads - in as soon as this one's have waited), in ``rounds`` interleaved
    rounds; ms per launch and TB/s on the weights, against the read speed measured first. (H200 run 37 call 1 timed
    the tensor-core tiles' first step so too, ``--ms 1,16,32,64 --shapes o,qkv,down,gate_up`` with
    runs/2026-12-02-h200-run37-call1-tensor-core-pre-wait.patch: 1.0-1.5x slower everywhere, so they take no
    ``PRE_WAIT``.)"""
    print(f"read speed (sum of 2 GiB): {_read_speed():.2f} TB/s", flush=True)
    for name in shapes:
        for m in ms:
            default = _decode_problem(name, m)[3]
            pdl = {**default, "pdl": True}
            tiles = {"pdl": pdl, "pdl, trigger": {**pdl, "PDL_TRIGGER": True}}
            for steps in (1, 2, 4) if default.get("GEMV") else ():
                tiles[f"pdl, pre {steps}"] = {**pdl, "PRE_WAIT": steps}
                tiles[f"pdl, trigger, pre {steps}"] = {**pdl, "PDL_TRIGGER": True, "PRE_WAIT": steps}
            _chain_duel(name, m, tiles, rounds, chain_bytes)


def gemv_pdl_sweep(shapes=("o", "qkv"), rounds=5, chain_bytes=256 << 20, k_stages=(2, 3, 4)):
    """The one-row GEMV's tiles (``gemv_candidates`` at ``k_stages``) as they run by default since run 35: as chains of
    programmatic dependents (``pdl_duel``), where run 19 chose them as single launches. Each tile checked against the
    default's output and timed once; then the default against the best three in ``rounds`` interleaved rounds, as
    dependents and with ``PDL_TRIGGER`` too."""
    for name in shapes:
        chain, reps, n, k, default = _decode_chain(name, 1, chain_bytes)
        ref = chain(default)[0].float()
        results = []
        for cfg in gemv_candidates(k, k_stages):
            t = _chain_tile_ms(chain, {**cfg, "pdl": True}, ref, reps, failed=name)
            results += [(t, cfg)] if t is not None else []
        results.sort(key=lambda r: r[0])
        print(f"{name} M=1: default {time_ms(lambda: chain({**default, 'pdl': True}), True) / reps:.4f} ms {default} | "
              f"{len(results)} tiles, each once: " + " ; ".join(f"{t:.4f} {c}" for t, c in results[:5]), flush=True)
        for trigger in (False, True):
            keys = {"pdl": True, **({"PDL_TRIGGER": True} if trigger else {})}
            tiles = {"default": {**default, **keys}, **{f"#{i + 1} {c}": {**c, **keys}
                                                        for i, (_, c) in enumerate(results[:3])}}
            print("with the trigger:" if trigger else "as dependents:", flush=True)
            _chain_duel(name, 1, tiles, rounds, chain_bytes)


def warps_duel(ms=(32, 64), shapes=("down", "qkv", "o"), rounds=7, chain_bytes=256 << 20):
    """The decode GEMMs' 17-64-row default tiles (``_decode_problem``) with 8 warps, two warpgroups sharing each K
    step's dot, where every sweep since run 13 ran 4; and with 8 warps 2 stages deeper where shared memory holds them;
    as chains of launches (``_chain_duel``), ``rounds`` interleaved rounds. The guess it tested: down at 32-64 rows
    streams as slowly as its memory time plus its tensor time (0.020 ms against 0.014 + 0.004), as if one
    warpgroup's waits on its dots held up its loads. H200 run 38 call 3: slower or a tie in all 6 cells, so the
    defaults keep 4 warps."""
    from fp8fx.kernels.fp8_gemm import pipeline_stages

    for name, m in itertools.product(shapes, ms):
        default = _decode_problem(name, m)[3]
        wide = {**default, "num_warps": 8}
        tiles = {"default (4 warps)": default, "8 warps": wide}
        deeper = {**wide, "num_stages": default["num_stages"] + 2}
        if pipeline_stages(deeper, 1) > default["num_stages"]:  # (else shared memory holds no more)
            tiles[f"8 warps, {deeper['num_stages']} stages"] = deeper
        _chain_duel(name, m, tiles, rounds, chain_bytes)


def gemv_stages_duel(shapes=("o", "qkv", "down"), rounds=7, chain_bytes=256 << 20):
    """The one-row GEMV's default tile (``gemv_config``) at 3 and 4 ``K_STAGES``, each as a chain of programmatic
    dependents (``gemv_pdl_sweep``), with and without ``PDL_TRIGGER``, in ``rounds`` interleaved rounds."""
    for name in shapes:
        default = _decode_problem(name, 1)[3]
        tiles = {f"{st} stages{', trigger' if trigger else ''}": {**default, "K_STAGES": st, "pdl": True,
                                                                   **({"PDL_TRIGGER": True} if trigger else {})}
                 for trigger in (False, True) for st in (3, 4)}
        print(f"{name}: default {default}", flush=True)
        _chain_duel(name, 1, tiles, rounds, chain_bytes)


def small_n_duel(ms=(24, 32, 48, 64), shapes=("qkv", "o"), rounds=7, chain_bytes=256 << 20):
    """Tiles of 17-64 rows for weights with few N tiles (qkv, o) against each other at ``ms`` rows, each as a chain
    of launches (``sweep_small_n``), in ``rounds`` interleaved rounds: the unsplit 64-wide tile (the default before
    run 22), run 22's 64-row tile (32 wide, K split in 2, both operands by TMA: qkv's ``tile_config(64, n, k)``), and
    the 32-row sweep's best (32 wide, K split in 2 or 4, the weight alone by TMA); since run 32 also o's long-step
    tile (``LONG_STEPS``), which ``tile_config(64, 4096, 4096)`` now is."""
    unsplit = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5, TMA=True, TMA_A=True)
    for name, m in itertools.product(shapes, ms):
        split = {**unsplit, "BLOCK_N": 32, "TMA_A": False}
        tiles = {"64 wide, unsplit": unsplit,
                 "32 wide, split 2, TMA both": {**split, "SPLIT_K": 2, "TMA_A": True},  # (run 22's tile at 64 rows)
                 "32 wide, split 2, TMA weight": {**split, "SPLIT_K": 2},
                 "32 wide, split 4, TMA weight": {**split, "SPLIT_K": 4},
                 # run 32's --small-n --deep at 64 rows (each timed once): o 0.0088 ms against 0.0099
                 "32 wide, unsplit, K steps of 512": LONG_STEPS, "the same, 6 stages": {**LONG_STEPS, "num_stages": 6}}
        _chain_duel(name, m, tiles, rounds, chain_bytes)


def tickets_duel(ms=(2, 16, 32, 64), shapes=("qkv", "o", "down"), rounds=7, chain_bytes=256 << 20):
    """The split-K decode GEMMs with their tickets zeroed in each call (``torch.zeros``: a memset in the graph before
    every launch; ``fp8_gemm``'s own choice outside capture, and inside it before run 32) against one kept buffer
    that no call re-zeroes (``_store_tile`` counts in periods), each as a chain of launches (``hbm_table``) in
    ``rounds`` interleaved rounds at the default tiles; the fused MLP's down GEMM too (16-bit h quantized as loaded,
    per token: at up to 16 rows, its route there), as ``_hbm_makers`` launches it."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config

    kept = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    for m in ms:
        for name in (*shapes, "fused down") if m <= 16 else shapes:
            n, k = SHAPES["down" if name == "fused down" else name]
            ops_ = _chain_operands(m, n, k, chain_bytes)
            if name == "fused down":  # h as the gate/up kernel leaves it: 16-bit, partial maxima of 32-wide tiles
                cfg = down_tile_config(m, n, k)
                ops_ = [(xq.bfloat16(), (xq.float().abs().reshape(m, -1, 32).amax(-1)), wq, ws)
                        for xq, _, wq, ws in ops_]
                extra = dict(config=cfg, a_quant=kernels.QUANT_ROWS)
            else:
                cfg, extra = kernels.for_device(tile_config(m, n, k), torch.device("cuda")), {}
            if cfg.get("SPLIT_K", 1) == 1:
                print(f"{name} M={m}: not split ({cfg}); skipped", flush=True)
                continue
            reps = len(ops_)
            tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
            fresh = lambda: torch.zeros(tiles, device="cuda", dtype=torch.int32)  # noqa: E731  (a memset)
            runs = {kind: lambda t=t: [fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, tickets=t(), **extra)
                                       for xq, xs, wq, ws in ops_]
                    for kind, t in (("zeroed each call", fresh), ("kept", lambda: kept))}
            outs = [run()[0] for run in runs.values()]
            assert torch.equal(outs[0], outs[1]), name
            med = _medians(runs, rounds)
            print(f"{name} M={m} (chains of {reps}, SPLIT_K={cfg['SPLIT_K']}), ms per launch: "
                  + ", ".join(f"{kind} {t / reps:.4f} ({reps * n * k / t / 1e9:.2f} TB/s)" for kind, t in med.items()),
                  flush=True)
    assert int((kept & 0xFFFF).count_nonzero()) == 0, "a kept ticket left mid-period"


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Each program reads its CHUNK int32s of x, BLOCK at a time (16-byte loads, pipelined STAGES deep), and
    writes their xor: a plain stream of the bytes, no arithmetic to wait on."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in tl.range(0, CHUNK, BLOCK, num_stages=STAGES):
        offs = start + i + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def read_ceiling(sizes_mb=(16.8, 25.2, 58.7, 117.4), rounds=5, chain_bytes=256 << 20):
    """What a kernel that does nothing but read reaches on each decode weight size, timed as ``hbm_table --chain-mb``
    times the GEMMs (chains of launches on buffers of their own, after a clean L2 flush): a sweep of chunk per
    program (32 KB to one chunk an SM), load width and pipeline depth, then the best three of each size re-timed in
    ``rounds`` interleaved rounds. The fastest is what a launch of that many bytes reached here with nothing to do
    but read them: a GEMM of that weight, which also computes, is not expected to beat it (a better reader than this
    sweep's may exist); the per-GEMM goal (75% of HBM) is read against it."""
    read = _read_speed()
    print(f"read speed (sum of 2 GiB): {read:.2f} TB/s", flush=True)
    for mb in sizes_mb:
        size = int(mb * 1e6) // 16 * 16
        n = size // 4
        reps = _chain_len(size, chain_bytes)
        bufs = [torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", dtype=torch.int32) for _ in range(reps)]
        out = torch.empty(n // 1024 + 1, device="cuda", dtype=torch.int32)
        configs = []
        for chunk_kb, (block, warps), stages in itertools.product(
                (32, 64, 128, 256, size // 132 >> 10, size // 264 >> 10), ((1024, 4), (2048, 8), (2048, 4)), (1, 3, 4)):
            chunk = max(block, (chunk_kb << 10) // 4 // block * block)
            configs.append((chunk, block, warps, stages))

        def run(cfg):
            chunk, block, warps, stages = cfg
            return lambda: [_read_kernel[(triton.cdiv(n, chunk),)](b, out, n, CHUNK=chunk, BLOCK=block, STAGES=stages,
                                                                   num_warps=warps) for b in bufs]
        timed = sorted((time_ms(run(cfg), True) / reps, cfg) for cfg in dict.fromkeys(configs))
        best = {f"chunk {c * 4 >> 10} KB, {b * 4} B a step, {w} warps, {s} stages": run((c, b, w, s))
                for _, (c, b, w, s) in timed[:3]}
        med = _medians(best, rounds)
        print(f"read of {size / 1e6:.1f} MB (chains of {reps}; sweep best {timed[0][0]:.4f} ms): " + "; ".join(
            f"{label} {t / reps:.4f} ms = {size / (t / reps) / 1e9 / read:.0%} of the read speed"
            for label, t in med.items()), flush=True)


@triton.jit
def _l2_prefetch_kernel(x_ptr, nbytes, CHUNK: tl.constexpr, PIECE: tl.constexpr):
    """Each program asks the L2 for its CHUNK bytes of x, PIECE bytes an instruction (``cp.async.bulk.prefetch.L2``:
    no registers, no shared memory, nothing to wait on), then exits."""
    offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK // PIECE).to(tl.int64) * PIECE
    size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [x_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(x: torch.Tensor, chunk: int = 128 << 10, piece: int = 4 << 10) -> None:
    """Launch ``_l2_prefetch_kernel`` over x's bytes (contiguous, 16-byte aligned, a multiple of 16 bytes long): one
    warp a program, one piece a thread (fewer pieces than 32 would be issued by several threads each)."""
    nbytes = x.numel() * x.element_size()
    assert x.is_contiguous() and nbytes % 16 == 0 and x.data_ptr() % 16 == 0
    _l2_prefetch_kernel[(triton.cdiv(nbytes, chunk),)](x.view(torch.uint8), nbytes, CHUNK=chunk, PIECE=piece,
                                                       num_warps=1)


def l2_next_study(ms=(1, 32), rounds=7, copies=8, ctx=1024):
    """Where a decode step's HBM idles: between the q/k/v GEMM and o sit RoPE, the KV-cache write and attention, which
    at one sequence read a few MB in a latency-bound ~10-20 us. A GEMM of o's size cannot reach 75% of the read speed
    as a launch of its own (``read_ceiling``: 67%); this asks whether its weight, prefetched into L2 right after the
    q/k/v GEMM while attention runs, makes o's launch fast enough to pay for the prefetch's launch.

    ``copies`` layers' worth of qkv / o weights and KV caches of ``ctx`` positions (bf16, 8 KV heads, GQA), each layer
    as: qkv GEMM, [prefetch of o's weight,] SDPA, o GEMM. Variants: "plain"; "prefetch" (``l2_prefetch`` of o's
    weight after the qkv GEMM); "no o" (the o GEMM left out: what o adds is the difference); "prefetch only"
    (qkv, prefetch, SDPA: what the prefetch launch costs by itself). CUDA-graph replays after a clean L2 flush,
    ``rounds`` interleaved rounds; o's outputs with the prefetch checked bit for bit against plain. (H200 run 36: the
    prefetch launch cost 3.8-4.0 us, about the time 16.8 MB take at the read speed, and o gained 0.6-0.8 us: each layer
    3.1-3.2 us slower at 1 and 32 rows; not built into fp8fx.)"""
    import torch.nn.functional as F

    read = _read_speed()
    print(f"read speed (sum of 2 GiB): {read:.2f} TB/s", flush=True)
    for m in ms:
        torch.manual_seed(m)
        layers = []
        for _ in range(copies):
            xq, xs, wqkv, sqkv = _operands(m, *SHAPES["qkv"])
            xo, so_, wo, so = _operands(m, *SHAPES["o"])
            q = torch.randn(1, 32, m, 128, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(2, 1, 8, ctx, 128, device="cuda", dtype=torch.bfloat16)
            layers.append((xq, xs, wqkv, sqkv, xo, so_, wo, so, q, kv))

        def step(prefetch: bool, o: bool = True):
            def run():
                outs = []
                for xq, xs, wqkv, sqkv, xo, so_, wo, so, q, kv in layers:
                    fp8_gemm(xq, wqkv, xs, sqkv, None, torch.bfloat16)
                    if prefetch:
                        l2_prefetch(wo)
                    F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)
                    if o:
                        outs.append(fp8_gemm(xo, wo, so_, so, None, torch.bfloat16))
                return outs
            return run
        runs = {"plain": step(False), "prefetch": step(True), "no o": step(False, o=False),
                "prefetch only": step(True, o=False)}
        assert all(torch.equal(a, b) for a, b in zip(runs["plain"](), runs["prefetch"]()))
        med = {name: t / copies for name, t in _medians(runs, rounds).items()}
        o_bytes = SHAPES["o"][0] * SHAPES["o"][1]
        o_plain, o_pf = med["plain"] - med["no o"], med["prefetch"] - med["prefetch only"]
        print(f"M={m} ({copies} layers), ms per layer: " + ", ".join(f"{k} {v:.4f}" for k, v in med.items())
              + f" | o adds {o_plain:.4f} ms plain ({o_bytes / o_plain / 1e9 / read:.0%} of the read speed), "
              f"{o_pf:.4f} after the prefetch ({o_bytes / o_pf / 1e9 / read:.0%}); the prefetch launch costs "
              f"{med['prefetch only'] - med['no o']:.4f}; net per layer {med['plain'] - med['prefetch']:+.4f} ms",
              flush=True)


def down_duel(m=64, g=128, rounds=7, dim=4096, hidden=14336):
    """The fused MLP op at M = 64, h in 1 x g groups, with the down-GEMM tiles that ``sweep_m64`` put first (each
    timed once there, within 1.5% of each other) and the default (``down_tile_config``; run 21 timed this before the
    default became the 5-stage tile), in ``rounds`` interleaved rounds."""
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, gated_mlp

    (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
    tiles = {"64 wide, 4 stages": (64, 4, 4), "64 wide, 5 stages": (64, 4, 5), "64 wide, 6 stages": (64, 4, 6),
             "128 wide, 8 warps, 6 stages": (128, 8, 6), "128 wide, 4 warps, 6 stages": (128, 4, 6)}
    op = lambda cfg=None: gated_mlp(xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS, None, torch.bfloat16,  # noqa: E731
                                    torch.bfloat16, h_group=g, configs=(None, cfg))
    runs = {"default": op}
    runs.update({name: lambda bn=bn, w=w, st=st: op(dict(
        BLOCK_M=64, BLOCK_N=bn, BLOCK_K=g, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=4, TMA=True))
        for name, (bn, w, st) in tiles.items()})
    for fn in runs.values():
        fn()
    _duel(f"fused MLP M={m} G={g}, down tiles", runs, 3 * dim * hidden, rounds)


def tma_a_duel(ms=(16, 64), rounds=7, dim=4096, hidden=14336):
    """fp8 activation tiles by TMA copies (``TMA_A`` in a tile) against pointer loads (cp.async) at the default
    tiles: the decode GEMMs alone (per-token x; with the weight by TMA too; run 21 timed this before the 64-row
    default took both), the fused MLP's down GEMM alone (h in 1x128 groups) and the fused MLP op. CUDA-graph
    replays, L2 clean, ``rounds`` interleaved rounds per M."""
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, down_tile_config, gated_mlp

    for m in ms:
        runs, nbytes = {}, {}
        for name, n, k, xq, xs, wq, ws in _layer_operands(m):
            # the default tile with pointer loads for both operands (at 17-64 rows the default takes both by TMA)
            cfg = {key: v for key, v in tile_config(m, n, k).items() if key not in ("TMA", "TMA_A")}
            for label, extra in ((", pointer loads", {}), (", TMA_A", {"TMA_A": True}),
                                 (", TMA + TMA_A", {"TMA": True, "TMA_A": True})):
                runs[name + label] = lambda xq=xq, xs=xs, wq=wq, ws=ws, c={**cfg, **extra}: fp8_gemm(
                    xq, wq, xs, ws, None, torch.bfloat16, config=c)
                nbytes[name + label] = n * k
        hq, hs = quant.quantize(torch.randn(m, hidden, device="cuda"), [1, 128])
        w2, s2 = quant.quantize(torch.randn(dim, hidden, device="cuda") / hidden**0.5, [1, -1])
        cfg = down_tile_config(m, dim, hidden, h_group=128)  # (the weight by TMA, h by pointer loads)
        (xq, xs), w1, w3, w2_ = _gated_problem(m, dim, hidden)
        for label, extra in (("", {}), (", TMA_A", {"TMA_A": True})):
            runs["fused down, h groups" + label] = lambda c={**cfg, **extra}: fp8_gemm(
                hq, w2, hs, s2, None, torch.bfloat16, config=c, a_block=(1, 128))
            nbytes["fused down, h groups" + label] = dim * hidden
            runs["fused MLP op, h groups" + label] = lambda c={**cfg, **extra}: gated_mlp(
                xq, xs, *w1, *w3, *w2_, None, QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16, configs=(None, c),
                h_group=128)
            nbytes["fused MLP op, h groups" + label] = 3 * dim * hidden
        for fn in runs.values():
            fn()
        for name, t in _medians(runs, rounds).items():
            print(f"M={m} {name}: {t:.4f} ms ({nbytes[name] / t / 1e9:.2f} TB/s)", flush=True)


def sweep_swap(ms=(16,), dim=4096, hidden=14336, rounds=5, tma=False, groups=(0, 128), stages=(4,)):
    """2-16 rows: the fused MLP's down GEMM (its tensor-core kernel) with the product transposed (``SWAP_AB``: the
    weight tile is wgmma's left operand, fp8 straight from shared memory, against mma.sync on the weight tile
    converted in registers), per-token h and h in 1x128 groups; each candidate once, then the best against the
    default and the untransposed tile in ``rounds`` interleaved rounds. CUDA-graph replays of the op, L2 clean.
    ``groups``: h per token (0) and in 1 x G groups; ``stages``: the pipeline depths (runs 20-22 swept 4 alone).
    (Run 20 swept the gate/up kernel transposed too - 64 and 128 weight rows, 4 and 8 warps - and it lost at
    M = 16, 0.0604 ms against 0.0578, and tied at M = 1; that variant is not in the kernel.)"""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, down_tile_config, gated_mlp

    for m in ms:
        (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
        runs = {}
        for g in groups:
            run = lambda c2=None, g=g: gated_mlp(  # noqa: E731
                xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS if g else kernels.QUANT_ROWS, None, torch.bfloat16,
                torch.bfloat16, configs=(None, c2), h_group=g)
            ref = run().float()
            downs = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=st, SPLIT_K=sk,
                          SWAP_AB=swap, TMA=t)
                     for bn, sk, swap, t, st in itertools.product([64, 128], [4, 8] if len(stages) > 1 else [4, 8, 16],
                                                                  (False, True), (False, True) if tma else (False,),
                                                                  stages)]
            results = []
            for c2 in downs:
                try:
                    got = run(c2).float()
                    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max(), (got - ref).abs().max()
                    results.append((time_ms(lambda: run(c2), True), c2))
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is not a candidate
                    print(f"M={m} G={g}: {c2} failed: {str(exc).splitlines()[0][:160]}")
            results.sort(key=lambda r: r[0])
            label = f"G={g}" if g else "per-token h"
            if not any(c["SWAP_AB"] for _, c in results) or all(c["SWAP_AB"] for _, c in results):
                print(f"swap M={m} {label}: the transposed or the untransposed tiles all failed; nothing to compare")
                continue
            print(f"swap M={m} {label} ({len(results)} ran; default {down_tile_config(m, dim, hidden, h_group=g)}): "
                  + " ; ".join(f"{t:.4f} {c}" for t, c in results[:6]), flush=True)
            runs[f"{label} default"] = run
            runs[f"{label} best"] = lambda run=run, c=results[0][1]: run(c)
            best_mma = next(c for _, c in results if not c["SWAP_AB"])
            runs[f"{label} best untransposed"] = lambda run=run, c=best_mma: run(c)
        _duel(f"fused MLP M={m}", runs, 3 * dim * hidden, rounds)


def gated_ncu(ms=(1, 16), dim=4096, hidden=14336, h_group=0):
    """Three plain calls of the fused MLP op per M (h per token, or in 1 x ``h_group`` groups), nothing timed: for
    ncu (device_run.sh's ncu stage)."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, gated_mlp

    for m in ms:
        (xq, xs), w1, w3, w2 = _gated_problem(m, dim, hidden)
        for _ in range(3):
            gated_mlp(xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS if h_group else kernels.QUANT_ROWS, None,
                      torch.bfloat16, torch.bfloat16, h_group=h_group)
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", action="store_true")
    p.add_argument("--gated", action="store_true")
    p.add_argument("--gated-pdl", action="store_true", help="--gated without the tile sweep, M = 1 and 16")
    p.add_argument("--wide-k", action="store_true", help="--gated with K steps of 256 and 512")
    p.add_argument("--bm64", action="store_true", help="64-row tiles (wgmma) at M <= 16; the decode sweep at M = 1, 16")
    p.add_argument("--narrow", action="store_true",
                   help="down-GEMM tiles of 16-32 rows, K split in 1-4 (with --gated: the fused MLP's down GEMM)")
    p.add_argument("--wide-n", action="store_true", help="M = 64 in 64-row tiles 64-128 wide, K split in 2-8")
    p.add_argument("--small-m", action="store_true", help="M = 64 in row tiles of 16 or 32 (the decode sweep)")
    p.add_argument("--gated-ncu", action="store_true",
                   help="three plain calls of the fused MLP at M = 1, 16 (--ms; --h-groups G: h in groups)")
    p.add_argument("--codes", action="store_true", help="the fused MLP with exact h codes or by the reciprocal")
    p.add_argument("--gemv", action="store_true", help="M = 1: GEMV tiles against the tensor-core tile")
    p.add_argument("--groups", action="store_true", help="the fused MLP with h in 1 x G groups, M = 1, 16, 64")
    p.add_argument("--m64", action="store_true",
                   help="M = 64, h in groups: the down GEMM grouped vs per row, deeper pipelines, G = 64 vs 128")
    p.add_argument("--hbm", action="store_true",
                   help="each decode GEMM and fused-MLP kernel at its default tile: TB/s on its weight, M = 1, 16, 64")
    p.add_argument("--chain-mb", type=int, default=0,
                   help="--hbm: time each kernel as a chain of launches on >= this many MB of weights (2-16 launches, "
                        "each on operands of its own), as a decode step runs them; cuBLAS fp8 too")
    p.add_argument("--rows32", action="store_true",
                   help="17-32 rows in 32-row transposed tiles: down, down-g128, qkv, o (--shapes) at 32 rows (--ms), "
                        "the best three against the default at 24 and 32")
    p.add_argument("--tickets", action="store_true",
                   help="split-K decode GEMMs (--ms: 2,16,32,64) with tickets zeroed each call or kept, as chains")
    p.add_argument("--deep", action="store_true",
                   help="--small-n: narrow unsplit tiles with K steps of 256-512 instead; --down: its default "
                        "against tiles of K steps of 512")
    p.add_argument("--down", action="store_true",
                   help="the down GEMM at 17-64 rows (--ms: 32,64), per-token h and 1x128 groups: tiles, as chains")
    p.add_argument("--read-ceiling", action="store_true",
                   help="a kernel that only reads, at each decode weight size, timed as --hbm --chain-mb 256")
    p.add_argument("--small-n", action="store_true",
                   help="qkv and o at 16-64 rows (--ms): tiles of every width, split and transposition, as chains")
    p.add_argument("--accum", action="store_true",
                   help="the decode GEMMs' chains with promoted and fast accumulation, plain and as PDL dependents "
                        "(--ms: 16,32,64; --shapes: o,qkv,down,down-g128,gate_up)")
    p.add_argument("--pdl", action="store_true",
                   help="the decode GEMMs' chains with programmatic dependent launch and its trigger "
                        "(--ms: 1,16,32,64; --shapes: o,qkv,down,gate_up)")
    p.add_argument("--pre-wait", action="store_true",
                   help="the decode GEMMs' chains as PDL dependents with their first K steps loaded before the wait")
    p.add_argument("--gemv-pdl", action="store_true",
                   help="the one-row GEMV's tiles as chains of programmatic dependents (--shapes: o,qkv); with "
                        "--duel: its default at 3 and 4 K stages (o, qkv, down)")
    p.add_argument("--l2-next", action="store_true",
                   help="o's weight prefetched into L2 during attention, after the qkv GEMM (--ms: 1,32)")
    p.add_argument("--warps8", action="store_true", help="decode GEMMs at 32, 64 rows: default tiles with 8 warps")
    p.add_argument("--tma-a", action="store_true",
                   help="M = 16, 64: fp8 activation tiles by TMA (TMA_A) or not, the decode GEMMs and the fused MLP")
    p.add_argument("--balance", action="store_true", help="--m64: the gate/up kernel alone on 112 vs 132 programs")
    p.add_argument("--duel", action="store_true", help="--m64: the op with sweep_m64's best down tiles, 7 rounds; "
                   "--small-n: tiles of qkv and o at 24-64 rows against each other")
    p.add_argument("--swap", action="store_true",
                   help="tiles with the product transposed (SWAP_AB) at M <= 16: the fused MLP's down GEMM (with "
                        "--gated), or in the decode sweep each candidate of 64+ weight rows also transposed")
    p.add_argument("--ms", help="comma-separated token counts (--groups: 1,16,64; the decode sweep: 1,64)")
    p.add_argument("--h-groups", help="--groups: comma-separated group sizes (32,64,128); --gated-ncu: one")
    p.add_argument("--tma", action="store_true",
                   help="each decode / down-GEMM candidate also with TMA loads (the decode sweep: of both operands)")
    p.add_argument("--weight-only", action="store_true",
                   help="M = 16 with bf16 activations (no activation scale), against bf16 cuBLAS")
    p.add_argument("--k-stages", default="1",
                   help="--gemv / --groups at M = 1: comma-separated pipeline depths of the GEMV's K loop (K_STAGES)")
    p.add_argument("--stages", default="4", help="--gated --swap: comma-separated pipeline depths of the down tiles")
    p.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (all; --rows32: down-g128 too)")
    args = p.parse_args(argv)
    k_stages = tuple(int(s) for s in args.k_stages.split(","))
    if args.gated_ncu:  # --ms, and --h-groups G (one) for h in groups
        return gated_ncu(tuple(int(m) for m in (args.ms or "1,16").split(",")),
                         h_group=int(args.h_groups or 0))
    if args.codes:
        return sweep_codes()
    if args.m64:
        return balance_probe() if args.balance else down_duel() if args.duel else sweep_m64()
    if args.rows32:
        return sweep_rows32(tuple(int(m) for m in (args.ms or "32").split(",")),
                            shapes=tuple((args.shapes or "down,down-g128,qkv,o").split(",")))
    if args.tickets:
        return tickets_duel(tuple(int(m) for m in (args.ms or "2,16,32,64").split(",")))
    if args.read_ceiling:
        return read_ceiling()
    if args.down and args.deep:
        return down_deep_duel(tuple(int(m) for m in (args.ms or "32,64").split(",")))
    if args.down:
        return sweep_down(tuple(int(m) for m in (args.ms or "32,64").split(",")))
    if args.block and args.duel:
        return block_duel(tuple(int(m) for m in (args.ms or "16,64,2048,4096").split(",")),
                          shapes={name: SHAPES[name] for name in args.shapes.split(",")} if args.shapes else None)
    if args.hbm:
        return hbm_table(tuple(int(m) for m in (args.ms or "1,16,64").split(",")), chain_bytes=args.chain_mb << 20)
    if args.accum:
        return accum_duel(tuple(int(m) for m in (args.ms or "16,32,64").split(",")),
                          tuple((args.shapes or "o,qkv,down,down-g128,gate_up").split(",")))
    if args.pdl:
        return pdl_duel(tuple(int(m) for m in (args.ms or "1,16,32,64").split(",")),
                        tuple((args.shapes or "o,qkv,down,gate_up").split(",")))
    if args.gemv_pdl and args.duel:
        return gemv_stages_duel(tuple((args.shapes or "o,qkv,down").split(",")))
    if args.gemv_pdl:
        return gemv_pdl_sweep(tuple((args.shapes or "o,qkv").split(",")))
    if args.pre_wait:
        return pre_wait_duel(tuple(int(m) for m in (args.ms or "1").split(",")),
                             tuple((args.shapes or "o,qkv,down").split(",")))
    if args.l2_next:
        return l2_next_study(tuple(int(m) for m in (args.ms or "1,32").split(",")))
    if args.warps8:
        return warps_duel()
    if args.tma_a:
        return tma_a_duel()
    if args.small_n and args.duel:
        return small_n_duel()
    if args.small_n:
        return sweep_small_n(tuple(int(m) for m in (args.ms or "16,32,64").split(",")), deep=args.deep)
    if args.groups:
        return sweep_groups(tuple(int(m) for m in (args.ms or "1,16,64").split(",")),
                            groups=tuple(int(g) for g in (args.h_groups or "32,64,128").split(",")), k_stages=k_stages,
                            tma=args.tma)
    if args.gemv:
        shapes = {name: SHAPES[name] for name in (args.shapes or ",".join(SHAPES)).split(",")}
        if args.block:
            return sweep_gemv_blocks(shapes, k_stages=k_stages)
        return sweep_gemv(shapes, k_stages=k_stages)
    if args.swap and args.gated:
        return sweep_swap(tuple(int(m) for m in (args.ms or "16").split(",")), tma=args.tma,
                          groups=tuple(int(g) for g in (args.h_groups or "0,128").split(",")),
                          stages=tuple(int(s) for s in args.stages.split(",")))
    if args.gated or args.gated_pdl:
        return sweep_gated(tiles=args.gated, tma=args.tma, wide_k=args.wide_k, bm64=args.bm64, narrow=args.narrow)
    shapes = {name: SHAPES[name] for name in (args.shapes or ",".join(SHAPES)).split(",")}
    w_block, a_block = ([128, 128], [1, 128]) if args.block else ([1, -1], [1, -1])
    blocks = dict(a_block=tuple(a_block), b_block=tuple(w_block)) if args.block else {}
    decode_ms = (64,) if args.small_m or args.wide_n else (1, 16) if args.bm64 or args.narrow else (1, 64)
    decode_ms = (16,) if args.weight_only else decode_ms
    decode_ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else decode_ms
    for (name, (n, k)), m in itertools.product(shapes.items(), (4096,) if args.block else decode_ms):
        wq, ws = quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, w_block)
        xq, xs = quant.quantize(torch.randn(m, k, device="cuda"), a_block)
        if args.weight_only:  # 16-bit activations, no scale: the weight upcast in the kernel
            xq, xs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), None
        gemm = lambda cfg=None: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg, **blocks)  # noqa: E731
        ref = gemm().float()
        results, graph = [], not args.block
        cands = candidates(m, args.block, args.tma, args.bm64, args.narrow, args.small_m, args.wide_n)
        for bm, bn, bk, gm, warps, stages, split, tma, swap in (with_swaps(cands) if args.swap else
                                                                [(*c, False) for c in cands]):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages, SPLIT_K=split,
                       TMA=tma, TMA_A=tma, SWAP_AB=swap)  # (--tma: both operands by TMA, as the 64-row default)
            try:
                assert (gemm(cfg).float() - ref).abs().max() <= 1e-2 * ref.abs().max()
                results.append((time_ms(lambda: gemm(cfg), graph), cfg))
            except Exception:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                continue
        results.sort(key=lambda r: r[0])
        current = time_ms(gemm, graph)
        if args.block:
            cublas = time_ms(cublas_blockwise(xq, xs, wq, ws))
        elif args.weight_only:  # the bf16 GEMM the fallback replaces
            wb = (wq.float() * ws.reshape(-1, 1)).bfloat16()
            cublas = time_ms(lambda: torch.nn.functional.linear(xq, wb), graph)
        else:
            ws_row = ws.reshape(1, -1).contiguous()
            cublas = time_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16),
                             graph)
        if not results:
            print(f"{name} M={m}: no candidate ran")
            continue
        best_t, best = results[0]
        tbs = lambda t: n * k / t / 1e9  # noqa: E731  weight bytes / ms -> TB/s
        tflops = lambda t: 2 * m * n * k / t / 1e9  # noqa: E731
        top3 = " ; ".join(f"{t:.4f} {c}" for t, c in results[1:4])
        now = tile_config(m, n, k, transposed=not args.weight_only)  # fp8_gemm's default for these activations
        print(f"{name} M={m}: best {best_t:.4f} ms ({tbs(best_t):.2f} TB/s, {tflops(best_t):.0f} TFLOP/s) {best} | "
              f"current {current:.4f} ms {now} | cuBLAS {cublas:.4f} ms "
              f"(best vs cuBLAS {cublas / best_t:.2f}x) | next: {top3}", flush=True)


if __name__ == "__main__":
    main()
