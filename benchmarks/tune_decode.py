"""Sweep the Triton fp8 GEMM's tiles at decode sizes (M = 1, 16, 64) on the Llama-3-8B shapes and
print the best per (M, shape) with its HBM bandwidth on the weight bytes, next to cuBLAS fp8.

    python benchmarks/tune_decode.py
"""
import itertools

import torch
import triton

from fp8fx import quant
from fp8fx.kernels.fp8_gemm import fp8_gemm, tile_config

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096)}


def candidates(m):
    if m <= 16:
        return itertools.product([16], [16, 32, 64], [128, 256, 512], [4], [3, 4, 6])
    return itertools.product([16, 64], [32, 64, 128], [128, 256], [4], [3, 5])


def main():
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 64)):
        w = torch.randn(n, k, device="cuda")
        wq, ws = quant.quantize(w, [1, -1])
        xq, xs = quant.quantize(torch.randn(m, k, device="cuda"), [1, -1])
        ref = fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16).float()
        results = []
        for bm, bn, bk, warps, stages in candidates(m):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages)
            try:
                y = fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg)
                assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
                t = triton.testing.do_bench(lambda: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg),
                                            warmup=10, rep=40, return_mode="median")
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: not a candidate
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        current = triton.testing.do_bench(lambda: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16),
                                          warmup=10, rep=40, return_mode="median")
        cublas = triton.testing.do_bench(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1).contiguous(),
                                     out_dtype=torch.bfloat16), warmup=10, rep=40, return_mode="median")
        best_t, best = results[0]
        tbs = lambda t: n * k / t / 1e9  # noqa: E731  weight bytes / ms -> TB/s
        print(f"{name} M={m}: best {best_t:.4f} ms ({tbs(best_t):.2f} TB/s) {best} | current "
              f"{current:.4f} ms ({tbs(current):.2f} TB/s) {tile_config(m, n, k)} | cuBLAS {cublas:.4f} ms")


if __name__ == "__main__":
    main()
