"""A few rows times a small high-precision weight: an MoE router's logits at decode (``fp8fx.small_mm``).

A router is ``F.linear(x, w[, b])`` (in float32 for some: Nemotron-H's casts x and w) with w [E, H] of E = 8-512
experts, kept in high precision (as vLLM keeps it). At one token cuBLAS takes 4.2-4.8 us for it on the H200
(Qwen3-30B-A3B's 128 x 2048 bf16; GPT-OSS-20B's 32 x 2880 with bias another 1.9 us of split-K reduction), where the
weight's 0.2-0.5 MB take a tenth of that to read (run 51). Here each program holds every row of x (up to
``MAX_ROWS``) and ``BLOCK_N`` rows of w, multiplies on the CUDA cores and sums over K in float32; the bias is added
in float32 and the sum rounded once to the output dtype, as cuBLAS's 16-bit GEMM does (its order of summation is
another: results differ by float32 rounding before that). A float32 output takes 16-bit x and w as they are, cast as
loaded (exact), where the model casts them first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8fx.kernels.launch import cdiv, next_power_of_2
from fp8fx.quant import HIGH_PRECISION, exact_cast

# rows of x a launch takes (all in each program), and x's elements: each program reads all of x, and past these the
# kernel lost to cuBLAS on the H200 (run 51, bench_routing.py: 4 rows 1.08-1.99x cuBLAS's speed where x held at most
# 11520 elements, 0.72x with 28672 - DeepSeek-V3's 7168 wide; 16 rows 0.36-0.76x in 16-bit)
MAX_ROWS = 4
MAX_X = 16384
MAX_N = 1024  # rows of w (experts)


@triton.jit
def small_mm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program n: out[:, n * BLOCK_N:(n + 1) * BLOCK_N] for every row of x."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)  # (x may be a view into a tensor past 2**31 elements)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + k + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def reason(x: torch.Tensor, w: torch.Tensor, bias, out_dtype: torch.dtype) -> str:
    """Why ``fp8fx.small_mm(x, w, bias, out_dtype)`` is not this kernel's (on the GPU, at run time), or ""."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if out_dtype not in HIGH_PRECISION or not (exact_cast(x.dtype, out_dtype) and exact_cast(w.dtype, out_dtype)) \
            or bias is not None and bias.dtype != out_dtype:
        return f"dtypes x {x.dtype}, w {w.dtype}, bias {getattr(bias, 'dtype', None)}, out {out_dtype}"
    if w.dim() != 2 or not 1 <= w.shape[0] <= MAX_N or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        return f"w {tuple(w.shape)} (the kernel takes [1-{MAX_N}, K]) with x {tuple(x.shape)}"
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        return f"a bias of shape {tuple(bias.shape)} (the kernel takes [N] = [{w.shape[0]}])"
    if not 1 <= rows <= MAX_ROWS or rows * x.shape[-1] > MAX_X:
        return f"x of {rows} rows of {x.shape[-1]} (the kernel takes 1-{MAX_ROWS} rows, {MAX_X} elements)"
    return ""


def small_mm(x: torch.Tensor, w: torch.Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x.to(out_dtype), w.to(out_dtype), bias)`` in one launch (x's and w's elements cast as loaded),
    where ``reason(x, w, bias, out_dtype)`` is ""."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=out_dtype, device=x.device)
    block_m = max(next_power_of_2(rows.shape[0]), 1)
    block_n = 2 if block_m <= 4 else 1
    block_k = min(max(next_power_of_2(k), 16), 2048 // block_m // block_n * 4)
    small_mm_kernel[(cdiv(n, block_n),)](rows, w, bias if bias is not None else w, out, rows.shape[0], n, k,
                                         rows.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
