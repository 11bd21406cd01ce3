"""FP8 GEMM with per-tensor / per-row scales applied in the epilogue (Triton).

    y[M, N] = (a[M, K] @ b[N, K].T) * a_scale[M or 1] * b_scale[N or 1] (+ bias[N]), in y's dtype

a: float8_e4m3fn activations (row-major), b: float8_e4m3fn weight [N, K] (row-major, i.e. K-major
for the dot), scales float32. The dot stays on the fp8 operands (Hopper fp8 tensor cores) with an
fp32 accumulator; the scales, the bias and the output cast are applied once per output tile.

Used for decode-sized M (<= 64), where cuBLAS fp8 is slower than streaming the weight at HBM
bandwidth (H200, torch 2.11: down 4096x14336 at M=16 took 0.047 ms through `torch._scaled_mm` vs
0.042 ms in bf16; this kernel 0.026-0.037 ms, benchmarks/RESULTS.md). Tiles are picked by `tile_config` rather than autotuned so launches are
deterministic, CUDA-graph capturable and run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def fp8_gemm_kernel(
    # tensors
    a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    # sizes
    M, N, K,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_ym, stride_yn,
    # schemes
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped ordering of the output tiles: GROUP_M row-tiles share the same b columns in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # a tile: [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # b.T tile: [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # epilogue: scales, bias, cast
    if A_ROWWISE:
        acc *= tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    else:
        acc *= tl.load(a_scale_ptr)
    if B_ROWWISE:
        acc *= tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        acc *= tl.load(b_scale_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tile_config(m: int, n: int, k: int) -> dict:
    """Tiles by problem size, from benchmarks/tune_decode.py on the H200 (torch 2.11, triton 3.6):
    decode streams the weight, so narrow N tiles give every SM its own slice and long K tiles with
    deep pipelining keep enough bytes in flight (down 4096x14336 at M=1: 2.24 TB/s with BLOCK_K=512
    and 6 stages vs 1.86 TB/s with 256 and 5; gate_up 28672x4096: 2.84 TB/s; cuBLAS fp8: 1.25-2.2)."""
    long_k = k >= 8192
    if m <= 16:
        if long_k:
            return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=6)
        if n >= 16384:  # gate_up 28672x4096: 0.0413 ms vs 0.0442 with the tiles below
            return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        # qkv 6144x4096: 0.0153 ms (sweep), while the tiles above took 0.0253 ms in benchmark run 6
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=5)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=32 if long_k else 64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=5)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """a: [M, K] fp8, b: [N, K] fp8, a_scale: [M, 1] or 1 element, b_scale: [N, 1] or 1 element."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"fp8_gemm: a is [{m}, {k}] but b is {list(b.shape)}; b must be [N, {k}]")
    a_scale = a_scale.float().reshape(-1).contiguous()
    b_scale = b_scale.float().reshape(-1).contiguous()
    y = torch.empty(m, n, device=a.device, dtype=out_dtype)
    cfg = dict(config or tile_config(m, n, k))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    fp8_gemm_kernel[grid](
        a, b, y, a_scale, b_scale, bias if bias is not None else a_scale,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        A_ROWWISE=a_scale.numel() != 1,
        B_ROWWISE=b_scale.numel() != 1,
        HAS_BIAS=bias is not None,
        **cfg,
    )
    return y
