"""Fused FP8 Mixture-of-Experts (Triton): ``fp8fx.fused_moe`` for per-tensor / per-channel expert scales.

    out[t] = sum_k w[t, k] * w2[e] @ q(silu(g) * u),   (g, u) = w13[e] @ q(x[t]),   e = ids[t, k]

Layouts: x ``[T, H]``; ``ids`` / ``w`` ``[T, K]``; S = T * K (token, k) pairs, pair p = t * K + k.
w13 ``[E, 2I, H]`` fp8 (rows [0, I) gate, [I, 2I) up) with scale ``[E]`` (per-tensor) or ``[E, 2I]`` (per
channel); w2 ``[E, H, I]`` fp8 with ``[E]`` or ``[E, H]``. Activation scales: per row (``[T]`` for x,
``[S]`` for the intermediate) or one element.

1. ``align``: the pairs sorted by expert and each expert's run padded to a multiple of BLOCK_M, in torch
   on the device (no host sync, CUDA-graph capturable; sizes are bounded from shapes alone):
   ``sorted_pair [P]`` (padding = S), ``block_expert [P / BLOCK_M]`` (-1: no work).
2. ``moe_gemm13_kernel``: per (row block, N tile of I): the block's tokens of x (fp8) times the gate and
   the up tile of its expert's w13 (fp8 tensor-core dots, fp32 accumulators), scales, SiLU(g) * u in the
   epilogue -> ``inter [S, I]`` (fp32).
3. ``inter`` quantized to fp8 per pair row (or with the static scale) in torch.
4. ``moe_gemm2_kernel``: per (row block, N tile of H): the block's rows of ``inter`` times its expert's w2,
   scales and the pair's routing weight in the epilogue -> ``y [S, H]`` (fp32).
5. ``y.view(T, K, H).sum(1)``: the combine, deterministic (no atomics).

Accumulation: one promotion of the tensor cores' partial sums into fp32 per K step (see
fp8fx.kernels.fp8_gemm), unless ``fast_accum``.

Not fused yet: the requantization of the intermediate (3) lives between the two launches, and block scales
(128x128 weights, 1x128 activation groups) take the reference path. Tiles come from ``tile_config`` by the
average number of pairs per expert (decode vs prefill), not from autotuning, so launches are deterministic
and run under TRITON_INTERPRET=1. On the H200 (torch 2.11, triton 3.6; benchmarks/RESULTS.md) it ran at
1.09x (Qwen3-30B-A3B) and 1.17x (Mixtral) of bf16 ``torch._grouped_mm`` at 4096 tokens; 16 tokens under
a CUDA graph at 1.45-1.49x the fp8 weight-read floor.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fp8fx import quant
from fp8fx.kernels.fp8_gemm import imprecise_k


# -- 1. routing: pairs sorted and padded by expert ------------------------------------------------
def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair [P], block_expert [P / block_m]) for ``topk_ids [T, K]``; ids outside [0, E) are dropped.

    Expert e's pairs fill ``sorted_pair[start_e : start_e + count_e]`` (in pair order), padded with S up
    to a multiple of ``block_m``; ``block_expert[b]`` is the expert of rows [b * block_m, (b + 1) * block_m)
    or -1. P = S + min(E, S) * (block_m - 1), rounded up to block_m: at most min(E, S) experts have pairs.
    """
    ids = topk_ids.reshape(-1)  # [S]
    s, e, device = ids.numel(), num_experts, ids.device
    p = -(-(s + min(e, s) * (block_m - 1)) // block_m) * block_m
    bucket = torch.where((ids >= 0) & (ids < e), ids, e).long()  # out of range -> bucket E, dropped; int32 ids too
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device).scatter_add_(0, bucket, torch.ones_like(bucket))
    # bucket E (dropped pairs) gets no rows; a mask, not ``padded[e] = 0``, which copies a host scalar
    # (not allowed while a CUDA graph is captured)
    padded = (counts + block_m - 1) // block_m * block_m * (torch.arange(e + 1, device=device) < e)
    start = torch.cumsum(padded, 0) - padded  # [E + 1] first row of each expert's run
    order = torch.sort(bucket, stable=True).indices  # [S] pairs by expert, in pair order within one
    first = torch.cumsum(counts, 0) - counts  # [E + 1] position of each expert's first pair in ``order``
    expert_of = bucket[order]
    row = start[expert_of] + torch.arange(s, device=device) - first[expert_of]
    row = torch.where(expert_of < e, row, p)  # dropped pairs go to a spare slot
    sorted_pair = torch.full((p + 1,), s, dtype=torch.int32, device=device)
    sorted_pair.scatter_(0, row, order.to(torch.int32))
    block_start = torch.arange(0, p, block_m, device=device)
    end = torch.cumsum(padded[:e], 0)  # [E] one past each expert's last padded row
    block_expert = torch.searchsorted(end, block_start, right=True)
    block_expert = torch.where(block_expert < e, block_expert, -1).to(torch.int32)
    return sorted_pair[:p], block_expert


# -- 2. and 4. the grouped GEMMs ---------------------------------------------------------------
@triton.jit
def _block_rows(sorted_pair_ptr, block_expert_ptr, S, K_TOP: tl.constexpr, TOKEN_ROWS: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """(expert, pair ids [BM], rows of A [BM], mask [BM]) of this program's row block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    # int64: pair * stride passes 2**31 for large prefills (e.g. 8 x 40k pairs x 7168)
    pair = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < S
    rows = pair // K_TOP if TOKEN_ROWS else pair  # x is per token, the intermediate per pair
    return expert, pair, rows, valid


@triton.jit
def moe_gemm13_kernel(
    # tensors
    a_ptr, w_ptr, inter_ptr, a_scale_ptr, w_scale_ptr, sorted_pair_ptr, block_expert_ptr,
    # sizes: N = I (the intermediate), K = H
    S, N, K,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_im, stride_in, stride_wse, stride_wsn,
    # schemes
    K_TOP: tl.constexpr, A_ROWWISE: tl.constexpr, W_ROWWISE: tl.constexpr, IMPRECISE_K: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, pair, rows, valid = _block_rows(sorted_pair_ptr, block_expert_ptr, S, K_TOP, True, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # x tile: [BM, BK]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # gate.T tile: [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn  # up rows are I further down
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < N)
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, max_num_imprecise_acc=IMPRECISE_K)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, max_num_imprecise_acc=IMPRECISE_K)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    # epilogue: scales, SiLU(gate) * up
    if A_ROWWISE:
        a_scale = tl.load(a_scale_ptr + rows, mask=valid, other=0.0)[:, None]
    else:
        a_scale = tl.load(a_scale_ptr)
    ws_base = w_scale_ptr + expert * stride_wse
    if W_ROWWISE:
        g_scale = tl.load(ws_base + offs_n * stride_wsn, mask=offs_n < N, other=0.0)[None, :]
        u_scale = tl.load(ws_base + (offs_n + N) * stride_wsn, mask=offs_n < N, other=0.0)[None, :]
    else:
        g_scale = tl.load(ws_base)
        u_scale = g_scale
    gate = acc_g * a_scale * g_scale
    up = acc_u * a_scale * u_scale
    h = gate / (1.0 + tl.exp(-gate)) * up
    i_ptrs = inter_ptr + pair[:, None] * stride_im + offs_n[None, :] * stride_in
    tl.store(i_ptrs, h, mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def moe_gemm2_kernel(
    # tensors
    a_ptr, w_ptr, y_ptr, a_scale_ptr, w_scale_ptr, topk_weights_ptr, sorted_pair_ptr, block_expert_ptr,
    # sizes: N = H, K = I
    S, N, K,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_ym, stride_yn, stride_wse, stride_wsn,
    # schemes
    A_ROWWISE: tl.constexpr, W_ROWWISE: tl.constexpr, IMPRECISE_K: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, pair, rows, valid = _block_rows(sorted_pair_ptr, block_expert_ptr, S, 1, False, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # intermediate tile: [BM, BK]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=IMPRECISE_K)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # epilogue: scales and the routing weight of each pair
    if A_ROWWISE:
        acc *= tl.load(a_scale_ptr + rows, mask=valid, other=0.0)[:, None]
    else:
        acc *= tl.load(a_scale_ptr)
    ws_base = w_scale_ptr + expert * stride_wse
    if W_ROWWISE:
        acc *= tl.load(ws_base + offs_n * stride_wsn, mask=offs_n < N, other=0.0)[None, :]
    else:
        acc *= tl.load(ws_base)
    acc *= tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def tile_config(pairs_per_expert: float, n: int, k: int) -> dict:
    """Tiles by the average number of (token, k) pairs per expert. Decode (a few pairs per expert)
    streams the expert weights: short row blocks, narrow N tiles, long K tiles. Prefill is a GEMM per
    expert: square tiles. Starting points from fp8fx.kernels.fp8_gemm's H200 sweep, not tuned for MoE."""
    if pairs_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256 if k >= 1024 else 128, num_warps=4, num_stages=4)
    if pairs_per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)


# -- the whole op ------------------------------------------------------------------------------
def supports(w_block, act_block) -> bool:
    """Per-tensor / per-channel weights with per-token / per-tensor activations; blocks are not yet here."""
    return tuple(w_block) in ((-1, -1), (1, -1)) and tuple(act_block) in ((-1, -1), (1, -1))


def _act(a: torch.Tensor, act_block, static: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(fp8 a, float32 scale as a flat vector, one scale per row?)."""
    if static is not None:
        return quant.quantize_with_scale(a, static, [-1, -1]), static.float().reshape(1), False
    q, scale = quant.quantize(a, act_block)
    return q, scale.reshape(-1).contiguous(), tuple(act_block) == (1, -1)


def _w_scale(scale: torch.Tensor, e: int) -> tuple[torch.Tensor, bool]:
    s = scale.float().reshape(e, -1).contiguous()  # [E, 1] per-tensor or [E, rows] per-channel
    return s, s.shape[1] > 1


def fused_moe(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype,
    a13_scale=None, a2_scale=None, config: Optional[dict] = None, fast_accum: bool = False,
) -> torch.Tensor:
    """``fp8fx.fused_moe`` (see fp8fx/ops.py) for the schemes ``supports`` accepts."""
    if not supports(w_block, act_block):
        raise NotImplementedError(f"fused_moe kernel: w_block={list(w_block)}, act_block={list(act_block)}")
    t, h = x.shape
    e, two_i, _ = w13.shape
    i, k_top = two_i // 2, topk_ids.shape[1]
    s = t * k_top
    if s == 0:
        return x.new_zeros((t, h), dtype=out_dtype)
    cfg = dict(config or tile_config(s / e, two_i, h))
    tiles = {name: cfg.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    sorted_pair, block_expert = align(topk_ids, e, tiles["BLOCK_M"])
    xq, x_scale, x_rowwise = _act(x, act_block, a13_scale)
    s13, s13_rowwise = _w_scale(w13_scale, e)
    s2, s2_rowwise = _w_scale(w2_scale, e)

    # [S, I]; zeros: rows of pairs routed nowhere (ids outside [0, E)) are not written, and their amax counts
    inter = torch.zeros(s, i, device=x.device, dtype=torch.float32)
    grid = (block_expert.numel(), triton.cdiv(i, tiles["BLOCK_N"]))
    moe_gemm13_kernel[grid](
        xq, w13, inter, x_scale, s13, sorted_pair, block_expert,
        s, i, h,
        xq.stride(0), xq.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0), inter.stride(1),
        s13.stride(0), s13.stride(1),
        K_TOP=k_top, A_ROWWISE=x_rowwise, W_ROWWISE=s13_rowwise, IMPRECISE_K=imprecise_k(tiles, fast_accum),
        **tiles, **cfg,
    )
    iq, i_scale, i_rowwise = _act(inter, act_block, a2_scale)

    # [S, H] in the output dtype (half the traffic of float32 for bf16 models); rows of pairs routed
    # nowhere are never written and must add 0
    y = torch.zeros(s, h, device=x.device, dtype=out_dtype)
    grid = (block_expert.numel(), triton.cdiv(h, tiles["BLOCK_N"]))
    moe_gemm2_kernel[grid](
        iq, w2, y, i_scale, s2, topk_weights.reshape(-1).contiguous(), sorted_pair, block_expert,
        s, h, i,
        iq.stride(0), iq.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), y.stride(1),
        s2.stride(0), s2.stride(1),
        A_ROWWISE=i_rowwise, W_ROWWISE=s2_rowwise, IMPRECISE_K=imprecise_k(tiles, fast_accum), **tiles, **cfg,
    )
    return y.view(t, k_top, h).sum(dim=1, dtype=torch.float32).to(out_dtype)
