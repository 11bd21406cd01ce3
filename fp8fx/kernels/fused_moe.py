"""Fused FP8 Mixture-of-Experts (Triton): ``fp8fx.fused_moe`` for per-tensor, per-channel and block scales.

    out[t] = sum_k w[t, k] * (w2[e] @ q(act(g, u)) + b2[e]),   (g, u) = w13[e] @ q(x[t]) + b13[e],   e = ids[t, k]

act: silu(g) * u, GPT-OSS's clamped SwiGLU, DeepSeek-V4's clamped SiLU, Gemma-4's GELU (tanh) or the exact GELU
(``ACT``); the biases are optional (``HAS_BIAS``). Ungated experts (``GATED`` false: Nemotron-H's) have no gate: w13
``[E, I, H]`` holds up alone and act is one of SiLU, the GELUs or the squared ReLU of it.
Layouts: x ``[T, H]``; ``ids`` / ``w`` ``[T, K]``; S = T * K (token, k) pairs, pair p = t * K + k.
w13 ``[E, 2I, H]`` fp8 (rows [0, I) gate, [I, 2I) up; interleaved, ``ROW_STEP`` = 2: row 2j gate j, 2j + 1 up j),
w2 ``[E, H, I]`` fp8; biases ``[E, 2I]`` (w13's row order) and ``[E, H]``. Every scale is read through
strides, so one kernel takes every layout:

==========================  =====================================  =====================================
scale                       activations (x: T rows, inter: S)      weights (w13, w2)
==========================  =====================================  =====================================
per-tensor                  one element (stride 0 on both axes)    ``[E]`` as ``[E, 1, 1]`` (strides 0)
per-row / per-channel       ``[rows, 1]``                          ``[E, rows, 1]``
K groups / blocks           ``[rows, ceil(K / GK)]`` (1 x GK)      ``[E, ceil(rows / BN), ceil(K / GK)]``
==========================  =====================================  =====================================

Scales constant along K are applied once, in the epilogue; K-varying ones (DeepSeek-V3's 128x128 weight
blocks with 1x128 activation groups) multiply each K step's partial product, so BLOCK_K == GK there.

1. ``align``: the pairs sorted by expert and each expert's run padded to a multiple of BLOCK_M, on the
   device (no host sync, CUDA-graph capturable; sizes are bounded from shapes alone): by one Triton
   program for decode-sized pair counts (``align_kernel``), else in torch:
   ``sorted_pair [P]`` (padding = S), ``block_expert [P / BLOCK_M]`` (-1: no work).
2. ``quantize_rows_kernel``: x to fp8 per token (or per 1 x GK group, or with a static scale), one pass.
3. ``moe_gemm13_kernel``: per (row block, N tile of I): the block's tokens of x times the gate and the up
   tile of its expert's w13 (fp8 tensor-core dots, fp32 accumulators), scales, biases, act(g, u) in the
   epilogue -> ``inter [S, I]`` (fp32).
4. ``quantize_rows_kernel`` again: ``inter`` to fp8 per pair row (or static scale), in one pass over
   ``inter``: step 3's epilogue leaves each row's amax over each of its N tiles. With 1 x GK
   activation groups step 3's epilogue does it all instead (its N tiles are the groups): the activation and the
   requantization in one kernel, no float32 intermediate in memory.
5. ``moe_gemm2_kernel``: per (row block, N tile of H): the block's rows of ``inter`` times its expert's w2,
   scales, the bias and the pair's routing weight in the epilogue -> ``y [S, H]`` in the output dtype.
6. ``combine_kernel``: out[t] = the sum of its pairs' rows of y in float32, in k order (deterministic, no
   atomics), pairs routed nowhere skipped.

Decode takes the DIRECT path instead (``direct_by_default``: one token, or a few tokens where re-reading the experts
two of them share costs less than the launches saved): no step 1 - program m of each GEMM holds pair m alone, its
row padded to the fp8 dot's 16 and its expert read from the ids; x's per-token, per-tensor or static quantization
runs in step 3's loads and the intermediate's in step 5's (from step 3's partial maxima, or by its epilogue in 1 x GK
groups), on the pair's row only; and step 5's last program to finish each (token, N tile) sums the token's rows of
y as step 6 would (a ticket per token and tile: deterministic). Two launches in a CUDA graph, where the aligned path
takes six (an eager call also zero-fills its tickets; 1 x GK activation groups add x's quantization by step 2 - a
group's amax before each K step's dot cost more than the launch). Each expert a token picked is read once; the
output is the aligned path's bit for bit.

Accumulation: one promotion of the tensor cores' partial sums into fp32 per K step (see
fp8fx.kernels.fp8_gemm), unless ``fast_accum``. Quantization matches ``fp8fx.quant`` bit for bit on the
GPU (IEEE division, clamp, round-to-nearest-even cast).

Not fused: per-token (and per-tensor) intermediates make a round trip through memory in float32 between
steps 3 and 4 (their amax spans every N tile of step 3; float32 keeps the quantization that of
``fp8fx.quant`` on the exact product, where a bf16 round trip would round twice). Tiles come from
``tile_config`` by the average number of pairs per expert (decode vs prefill), not from autotuning, so
launches are deterministic and run under TRITON_INTERPRET=1. On the H200 (torch 2.11, triton 3.6;
benchmarks/RESULTS.md, run 9, CUDA-graph replays, fast accumulation) per-channel experts ran 2.38x
(Qwen3-30B-A3B) and 1.81x (Mixtral) faster than bf16 ``torch._grouped_mm`` at 4096 tokens, and at 16
tokens at 0.94x (Qwen3: 83 of 128 experts touched) and 1.14x (Mixtral) the fp8 weight-read time of
all experts.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from fp8fx import quant
from fp8fx.kernels import tickets as _tickets
from fp8fx.kernels.fp8_gemm import (_all_rows_amax, _hopper, _max_nan, _pdl_start, _rows_amax, _scale_of,
                                    _to_fp8_range, FP8_DOT_MIN_K, imprecise_k, tile_value_refusal)
from fp8fx.kernels.launch import cdiv, next_power_of_2


# -- 1. routing: pairs sorted and padded by expert ------------------------------------------------
# One Triton program aligns up to this many pairs x experts (each rounded up to a power of 2): its
# cumsum along the pairs takes 4 bytes of shared memory per element (128 KiB here; sm_90 has 227), and
# up to ALIGN_ONE_PROGRAM_PAIRS pairs (decode; longer prefills take the torch version, whose ~15 kernels
# are small next to their GEMMs)
ALIGN_ONE_PROGRAM_MAX = 32768
ALIGN_ONE_PROGRAM_PAIRS = 1024
# fused_moe's DIRECT path (decode: one program per pair; no align, no combine, x and the intermediate quantized in
# the GEMMs) saves launches and costs a second read of an expert's weights for each pair whose expert another token
# also picked (the aligned path reads each expert once). ``direct_by_default`` weighs the two: the saving measured
# as the aligned path's time less the direct path's at one token (H200, run 49's call 3, per-token activations):
# 6.9 us for GPT-OSS-20B's experts, 8.4 for Qwen3-30B-A3B's, 8.2 for Nemotron-3-Nano's; the re-reads at the read speed.
DIRECT_SAVED_S = 6e-6
DIRECT_READ_BYTES_PER_S = 4.25e12
DIRECT_MAX_TOKENS = 16
# The DIRECT path's two GEMMs launch as programmatic dependents (PDL, sm_90; fused_moe's ``pdl``): each program of
# the first waits for the kernel before it, then lets the second GEMM launch - right after its wait (1) or once its
# K loop has read its weights (2, as gated_mlp's gate/up kernel lets its down GEMM in) - so the second GEMM's launch
# and its programs' start overlap the first's last programs; each program of the second waits for the first before
# it touches memory. None: both launched plainly. H200 run 50 (bench_moe.py, CUDA-graph replays, 1-4 tokens of
# Nemotron-3-Nano's, GPT-OSS-20B's and Qwen3-30B-A3B's experts): trigger 2 1.000-1.025x the plain launches with
# per-channel scales, 0.977-1.032x with 128x128 blocks, a tie in the whole MoE layer; trigger 1 down to 0.86x (its
# second GEMM's programs hold SMs the first one's second wave needs).
DIRECT_PDL_TRIGGER: Optional[int] = 2


def _align_rows(s: int, e: int, block_m: int) -> int:
    """P = S + min(E, S) * (block_m - 1), rounded up to block_m: at most min(E, S) experts have pairs."""
    return -(-(s + min(e, s) * (block_m - 1)) // block_m) * block_m


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair [P], block_expert [P / block_m]) for ``topk_ids [T, K]``; ids outside [0, E) are dropped.

    Expert e's pairs fill ``sorted_pair[start_e : start_e + count_e]`` (in pair order), padded with S up
    to a multiple of ``block_m``; ``block_expert[b]`` is the expert of rows [b * block_m, (b + 1) * block_m)
    or -1 (P: ``_align_rows``). On the GPU, few pairs (decode) are aligned by one Triton program
    (``align_one_program``: two launches where the torch version below takes ~15), the rest in torch.
    """
    s = topk_ids.numel()
    small = 0 < s <= ALIGN_ONE_PROGRAM_PAIRS and _pow2(s) * _pow2(num_experts) <= ALIGN_ONE_PROGRAM_MAX
    if topk_ids.is_cuda and small:
        return align_one_program(topk_ids, num_experts, block_m)
    return align_torch(topk_ids, num_experts, block_m)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def align_kernel(ids_ptr, sorted_pair_ptr, block_expert_ptr, S, NB, E: tl.constexpr, BLOCK_M: tl.constexpr,
                 S_P: tl.constexpr, E_P: tl.constexpr, NB_P: tl.constexpr):
    """``align`` in one program: pairs x experts one-hot, per-expert counts and ranks by scans. S and NB
    (blocks) are runtime sizes: one compiled kernel per power-of-2 size class, not per token count."""
    pairs = tl.arange(0, S_P)
    ids = tl.load(ids_ptr + pairs, mask=pairs < S, other=-1)
    routed = (pairs < S) & (ids >= 0) & (ids < E)
    experts = tl.arange(0, E_P)
    hot = ((ids[:, None] == experts[None, :]) & routed[:, None]).to(tl.int32)  # [S_P, E_P]
    counts = tl.sum(hot, axis=0)  # [E_P]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)  # one past each expert's last padded row
    start = end - padded
    rank = tl.cumsum(hot, axis=0) - hot  # pairs of the same expert before this one
    row = tl.sum(hot * (start[None, :] + rank), axis=1)  # [S_P]
    tl.store(sorted_pair_ptr + row, pairs, mask=routed)  # padding (S) was written by the caller
    blocks = tl.arange(0, NB_P)
    expert = tl.sum(((end[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < E)).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, tl.where(expert < E, expert, -1), mask=blocks < NB)


def align_one_program(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` by ``align_kernel`` (two launches: the padding fill and the kernel); same output."""
    ids = topk_ids.reshape(-1).contiguous()  # the kernel reads pair p at ids_ptr + p (a view may be strided)
    s = ids.numel()
    p = _align_rows(s, num_experts, block_m)
    sorted_pair = torch.full((p,), s, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(p // block_m, dtype=torch.int32, device=ids.device)
    align_kernel[(1,)](ids, sorted_pair, block_expert, s, p // block_m, E=num_experts, BLOCK_M=block_m,
                       S_P=_pow2(s), E_P=_pow2(num_experts), NB_P=_pow2(p // block_m), num_warps=8)
    return sorted_pair, block_expert


def align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` in torch (any number of pairs; CPU and GPU)."""
    ids = topk_ids.reshape(-1)  # [S]
    s, e, device = ids.numel(), num_experts, ids.device
    p = _align_rows(s, e, block_m)
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


# -- 2. and 4. activation quantization ------------------------------------------------------------
@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, parts_ptr,
    C, stride_xm, stride_qm, stride_sm, stride_sg, stride_pm, n_parts,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, STATIC: tl.constexpr, PARTS: tl.constexpr, EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Program (row, group): the row's columns [g * GROUP, (g + 1) * GROUP) to fp8 with scale
    amax / FP8_MAX (at least EPS / FP8_MAX), stored at scale[row, g]; with STATIC the scale is read.
    PARTS (a power of 2 >= n_parts): one group per row whose amax is the max of the row's ``n_parts``
    partial maxima at ``parts_ptr`` (the first GEMM's, one per N tile) - one pass over the row, not two."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    elif PARTS:
        part = tl.arange(0, PARTS)
        parts = tl.load(parts_ptr + row * stride_pm + part, mask=part < n_parts, other=0.0)
        scale = _scale_of(tl.reduce(parts, 0, _max_nan), EPS, FP8_MAX)
        tl.store(scale_ptr + row * stride_sm, scale)
    else:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c in range(0, GROUP, CHUNK):
            offs = start + c + tl.arange(0, CHUNK)
            v = tl.load(x_row + offs, mask=(offs < C) & (c + tl.arange(0, CHUNK) < GROUP), other=0.0)
            amax = _max_nan(amax, tl.abs(v.to(tl.float32)))
        scale = _scale_of(tl.reduce(amax, 0, _max_nan), EPS, FP8_MAX)
        tl.store(scale_ptr + row * stride_sm + group * stride_sg, scale)
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        mask = (offs < C) & (c + tl.arange(0, CHUNK) < GROUP)
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + offs, _to_fp8_range(v, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask)


# -- 3. and 5. the grouped GEMMs ---------------------------------------------------------------
@triton.jit
def _block_rows(sorted_pair_ptr, block_expert_ptr, S, E, K_TOP: tl.constexpr, TOKEN_ROWS: tl.constexpr,
                BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, pair ids [BM], rows of A [BM], mask [BM]) of this program's row block. DIRECT: program m holds
    pair m alone (row 0 of its tile) and ``block_expert_ptr`` is the ids ``[S]``: no ``align``; expert -1 where
    the id is outside [0, E)."""
    pid_m = tl.program_id(0)
    if DIRECT:
        raw = tl.load(block_expert_ptr + pid_m)  # (checked before the cast: an int64 id of 2**32 is not expert 0)
        expert = tl.where((raw >= 0) & (raw < E), raw, -1).to(tl.int32)
        local = tl.arange(0, BLOCK_M)
        pair = pid_m.to(tl.int64) + local  # rows past the first are masked
        valid = local == 0
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        # int64: pair * stride passes 2**31 for large prefills (e.g. 8 x 40k pairs x 7168)
        pair = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pair < S
    rows = pair // K_TOP if TOKEN_ROWS else pair  # x is per token, the intermediate per pair
    return expert, pair, rows, valid


@triton.jit
def _row_amax(row_ptr, K, BLOCK_K: tl.constexpr):
    """The amax (NaN kept) of one 16-bit row of K elements, BLOCK_K at a time."""
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        amax = _max_nan(amax, tl.abs(tl.load(row_ptr + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)))
    return tl.reduce(amax, 0, _max_nan)


@triton.jit
def _first_row_fp8(row_ptr, offs_k, k_left, scale, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr,
                   dtype: tl.constexpr):
    """A [BLOCK_M, BK] tile of ``dtype`` (fp8) whose first row is this K step of the 16-bit or float32 row at
    ``row_ptr`` divided by ``scale`` (as quantize_rows_kernel quantizes), the other rows zero. A DIRECT program
    holds one pair: the division runs on its row alone (quantizing the whole tile, 15 rows of padding, made the
    experts 2.5-4.5x slower at one token on the H200: run 49)."""
    v = tl.load(row_ptr + offs_k, mask=offs_k < k_left, other=0.0).to(tl.float32)  # [BK]
    q = _to_fp8_range(v, scale, FP8_MAX)
    first = tl.arange(0, BLOCK_M) == 0
    return tl.where(first[:, None], q[None, :], 0.0).to(dtype)


@triton.jit
def moe_gemm13_kernel(
    # tensors
    a_ptr, w_ptr, inter_ptr, a_scale_ptr, w_scale_ptr, sorted_pair_ptr, block_expert_ptr, inter_scale_ptr, bias_ptr,
    # sizes: N = I (the intermediate), K = H; UP_SHIFT: up j's row after gate j's (I, or 1 interleaved); E experts
    S, N, K, UP_SHIFT, E,
    # the clamped activations' alpha and limit (ACT 1 and 2)
    alpha, limit,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_im, stride_in,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_ism, stride_isg, stride_be, stride_bn,
    # schemes: K-varying scales (per K step) or not (epilogue); weight rows per scale row
    K_TOP: tl.constexpr, K_GROUPED: tl.constexpr, W_BLOCK_N: tl.constexpr, IMPRECISE_K: tl.constexpr,
    # gate j's row: ROW_STEP * j (2: gate and up rows interleaved, as GPT-OSS stores them); biases; the activation
    ROW_STEP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    # GATED: act(gate) * up; else w13 holds one I-row block (ungated experts, Nemotron-H's) and the output is act(w13 x)
    GATED: tl.constexpr,
    # QUANT_OUT: the intermediate leaves as fp8 with one scale per row of each N tile (1 x BLOCK_N groups);
    # AMAX_OUT: it leaves as float32, with each row's amax over each N tile (for the per-row quantization)
    QUANT_OUT: tl.constexpr, AMAX_OUT: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # DIRECT: one pair per program, its expert read from the ids (``_block_rows``; decode). X_QUANT (DIRECT only):
    # x arrives 16-bit and each K step of the pair's token is quantized as it is loaded, as quantize_rows_kernel
    # does, by the token's amax (1), every token's (2: per tensor) or a static scale at a_scale_ptr (3). (1 x GK
    # groups are not done here: each K step's amax before its dot cost 8 us of 29 at one token, run 49.)
    DIRECT: tl.constexpr = False, X_QUANT: tl.constexpr = 0, ROW_BLOCK: tl.constexpr = 1024,
    # PDL (DIRECT_PDL_TRIGGER): the program waits for the kernel before it first; PDL_TRIGGER 1 then lets the next
    # kernel launch, 2 does so after the K loop
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = 0,
):
    _pdl_start(PDL_WAIT, PDL_TRIGGER == 1)
    expert, pair, rows, valid = _block_rows(sorted_pair_ptr, block_expert_ptr, S, E, K_TOP, True, BLOCK_M, DIRECT)
    if expert < 0:
        if DIRECT and AMAX_OUT:  # a pair routed nowhere: no amax, for the per-tensor scale over every pair
            tl.store(inter_scale_ptr + tl.program_id(0) * stride_ism + tl.program_id(1) * stride_isg, 0.0)
        return
    x_row = a_ptr + (tl.program_id(0) // K_TOP).to(tl.int64) * stride_am  # (DIRECT) the pair's token
    if X_QUANT == 1:  # the token's scale, from its row (ROW_BLOCK at a time: one round trip to L2 up to 4096)
        x_s = _scale_of(_row_amax(x_row, K, ROW_BLOCK), EPS, FP8_MAX)
    elif X_QUANT == 2:
        x_amax = tl.full((), 0.0, tl.float32)
        token_row = a_ptr  # stepped, not t * stride: a 32-bit product would wrap past 2**31 elements
        for _ in range(0, S // K_TOP):
            x_amax = _max_nan(x_amax, _row_amax(token_row, K, ROW_BLOCK))
            token_row += stride_am
        x_s = _scale_of(x_amax, EPS, FP8_MAX)
    elif X_QUANT == 3:
        x_s = tl.load(a_scale_ptr).to(tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of I
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit row / tile bases, 32-bit offsets within a tile (see fp8_gemm: [BM, BK] / [BK, BN] tensors of
    # 64-bit addresses carried through the pipelined loop spilled registers)
    a_rows = a_ptr + rows[:, None] * stride_am  # [BM, 1]: the gathered tokens
    g_rows = offs_n * ROW_STEP  # [BN]: w13's rows of these gate columns; up's are UP_SHIFT further
    g_tile = w_ptr + expert.to(tl.int64) * stride_we + (tl.program_id(1) * BLOCK_N * ROW_STEP).to(tl.int64) * stride_wn
    u_tile = g_tile + UP_SHIFT * stride_wn  # (2I * H < 2**31 within one expert)
    a_offs = offs_k[None, :] * stride_ak  # [1, BK]
    # gate.T / up.T tile: [BK, BN]
    w_offs = tl.arange(0, BLOCK_N)[None, :] * (ROW_STEP * stride_wn) + offs_k[:, None] * stride_wk
    a_s_ptrs = a_scale_ptr + rows * stride_asm  # [BM]
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    g_s_ptrs = ws_base + (g_rows // W_BLOCK_N) * stride_wsn  # [BN]
    u_s_ptrs = ws_base + ((g_rows + UP_SHIFT) // W_BLOCK_N) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        if not X_QUANT:
            a = tl.load(a_rows + a_offs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & n_ok[None, :]
        g = tl.load(g_tile + w_offs, mask=w_mask, other=0.0)
        if GATED:  # (constexpr: an ungated kernel has no up tile; the gated one's instructions as before)
            u = tl.load(u_tile + w_offs, mask=w_mask, other=0.0)
        if X_QUANT:
            a = _first_row_fp8(x_row + k * BLOCK_K, offs_k, k_left, x_s, FP8_MAX, BLOCK_M, g.dtype)
        if K_GROUPED:
            if X_QUANT:
                a_s = x_s
            else:
                a_s = tl.load(a_s_ptrs + k * stride_ask, mask=valid, other=0.0)[:, None]
            g_s = tl.load(g_s_ptrs + k * stride_wsk, mask=n_ok, other=0.0)[None, :]
            if GATED:
                u_s = tl.load(u_s_ptrs + k * stride_wsk, mask=n_ok, other=0.0)[None, :]
            acc_g += tl.dot(a, g) * (a_s * g_s)
            if GATED:
                acc_u += tl.dot(a, u) * (a_s * u_s)
        else:
            acc_g = tl.dot(a, g, acc_g, max_num_imprecise_acc=IMPRECISE_K)
            if GATED:
                acc_u = tl.dot(a, u, acc_u, max_num_imprecise_acc=IMPRECISE_K)
        a_offs += BLOCK_K * stride_ak
        w_offs += BLOCK_K * stride_wk
    if PDL_TRIGGER == 2:  # the weights are read: the second GEMM's programs may start (they wait for this grid)
        tl.extra.cuda.gdc_launch_dependents()

    # epilogue: the scales constant along K, the biases, act(gate, up)
    if not K_GROUPED:
        a_s = x_s if X_QUANT else tl.load(a_s_ptrs, mask=valid, other=0.0)[:, None]
        acc_g *= a_s * tl.load(g_s_ptrs, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_u *= a_s * tl.load(u_s_ptrs, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + g_rows * stride_bn
        acc_g += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptrs + UP_SHIFT * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # columns past N are 0 (weights and biases loaded as 0), and so is every activation of them. The clamps keep a
    # NaN, as torch's clamp does (PTX's min.f32 / max.f32 return the other operand: a NaN gate became the limit)
    if ACT == 1:  # GPT-OSS: gate clamped above, up on both sides; (up + 1) * gate * sigmoid(alpha * gate)
        g = tl.minimum(acc_g, limit, propagate_nan=tl.PropagateNan.ALL)
        h = g / (1.0 + tl.exp(-alpha * g)) * (tl.clamp(acc_u, -limit, limit, propagate_nan=tl.PropagateNan.ALL) + 1.0)
    elif ACT == 2:  # DeepSeek-V4: SiLU of the gate clamped above, times up clamped on both sides
        g = tl.minimum(acc_g, limit, propagate_nan=tl.PropagateNan.ALL)
        h = g / (1.0 + tl.exp(-g)) * tl.clamp(acc_u, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    else:  # act(gate) (* up where GATED)
        if ACT == 3:  # Gemma-4: GELU's tanh approximation; (1 + tanh(z)) / 2 = 1 - 1 / (1 + e^2z)
            z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            h = acc_g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z)))
        elif ACT == 4:  # the exact GELU: x * (1 + erf(x / sqrt(2))) / 2
            h = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476))
        elif ACT == 5:  # Nemotron-H's squared ReLU (a NaN stays NaN, as torch's relu keeps it: max.f32 gives 0)
            r = tl.where(acc_g < 0.0, 0.0, acc_g)
            h = r * r
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g))
        if GATED:
            h = h * acc_u
    i_ptrs = inter_ptr + pair[:, None] * stride_im + offs_n[None, :] * stride_in
    i_mask = valid[:, None] & n_ok[None, :]
    if QUANT_OUT or AMAX_OUT:
        amax = tl.reduce(tl.abs(h), 1, _max_nan)  # [BM]: each row's over this N tile
        # QUANT_OUT: the tile's fp8 codes and their scale (as quantize_rows_kernel, on the tile in registers);
        # AMAX_OUT: the float32 tile and its amax, for the per-row quantization
        per_row = _scale_of(amax, EPS, FP8_MAX) if QUANT_OUT else amax
        tl.store(inter_scale_ptr + pair * stride_ism + tl.program_id(1) * stride_isg, per_row, mask=valid)
    if QUANT_OUT:
        tl.store(i_ptrs, _to_fp8_range(h, per_row[:, None], FP8_MAX).to(inter_ptr.dtype.element_ty), mask=i_mask)
    else:
        tl.store(i_ptrs, h, mask=i_mask)


@triton.jit
def moe_gemm2_kernel(
    # tensors
    a_ptr, w_ptr, y_ptr, a_scale_ptr, w_scale_ptr, topk_weights_ptr, sorted_pair_ptr, block_expert_ptr, bias_ptr,
    out_ptr, tickets_ptr,
    # sizes: N = H, K = I; E experts
    S, N, K, E,
    # strides
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be, stride_bn, stride_om,
    # schemes
    K_GROUPED: tl.constexpr, W_BLOCK_N: tl.constexpr, IMPRECISE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # DIRECT (decode; see moe_gemm13_kernel): one pair per program, and the combine done here - the last of a
    # token's K_TOP pairs to finish an N tile (an int32 ticket per token and tile, zero on entry and left zero)
    # sums their rows of y into out. A_QUANT (DIRECT only): the intermediate arrives float32 and each tile is
    # quantized as it is loaded, per row (1) or per tensor (2) from the first GEMM's N_PARTS partial maxima at
    # a_scale_ptr, or by the static scale there (3) (fp8_gemm's QUANT_ROWS / QUANT_TENSOR / QUANT_STATIC)
    DIRECT: tl.constexpr = False, K_TOP: tl.constexpr = 1, A_QUANT: tl.constexpr = 0, N_PARTS: tl.constexpr = 1,
    PARTS_BLOCK: tl.constexpr = 64, EPS: tl.constexpr = 1e-12, FP8_MAX: tl.constexpr = 448.0,
    # PDL: launched while the first GEMM drains; the program waits for its memory before it touches any
    PDL_WAIT: tl.constexpr = False,
):
    _pdl_start(PDL_WAIT, False)
    expert, pair, rows, valid = _block_rows(sorted_pair_ptr, block_expert_ptr, S, E, K_TOP, False, BLOCK_M, DIRECT)
    if DIRECT:  # a pair routed nowhere runs no K step and stores nothing, but takes its ticket
        valid = valid & (expert >= 0)
        k_steps = tl.where(expert >= 0, tl.cdiv(K, BLOCK_K), 0)
        expert = tl.maximum(expert, 0)
    else:
        if expert < 0:
            return
        k_steps = tl.cdiv(K, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] of H
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None] * stride_am  # [BM, 1]: the intermediate's rows of these pairs
    w_tile = w_ptr + expert.to(tl.int64) * stride_we + (tl.program_id(1) * BLOCK_N).to(tl.int64) * stride_wn
    a_offs = offs_k[None, :] * stride_ak  # [1, BK]
    w_offs = tl.arange(0, BLOCK_N)[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    a_s_ptrs = a_scale_ptr + rows * stride_asm  # [BM]
    w_s_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse + (offs_n // W_BLOCK_N) * stride_wsn  # [BN]
    # (DIRECT) the pair's row of the intermediate and its scale
    a_row = a_ptr + tl.program_id(0).to(tl.int64) * stride_am
    if A_QUANT == 1:
        a_q = _scale_of(tl.reduce(_rows_amax(a_scale_ptr, tl.program_id(0) + tl.arange(0, 1), S, stride_asm,
                                             stride_ask, N_PARTS, PARTS_BLOCK), 0, _max_nan), EPS, FP8_MAX)
    elif A_QUANT == 2:  # every pair's maxima (zero for pairs routed nowhere)
        a_q = _scale_of(_all_rows_amax(a_scale_ptr, S, stride_asm, stride_ask, N_PARTS, PARTS_BLOCK, BLOCK_M), EPS,
                        FP8_MAX)
    elif A_QUANT == 3:
        a_q = tl.load(a_scale_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_steps):
        k_left = K - k * BLOCK_K
        w = tl.load(w_tile + w_offs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
        if A_QUANT:
            a = _first_row_fp8(a_row + k * BLOCK_K, offs_k, k_left, a_q, FP8_MAX, BLOCK_M, w.dtype)
        else:
            a = tl.load(a_rows + a_offs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if K_GROUPED:
            if A_QUANT:
                a_s = a_q
            else:
                a_s = tl.load(a_s_ptrs + k * stride_ask, mask=valid, other=0.0)[:, None]
            w_s = tl.load(w_s_ptrs + k * stride_wsk, mask=n_ok, other=0.0)[None, :]
            acc += tl.dot(a, w) * (a_s * w_s)
        else:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=IMPRECISE_K)
        a_offs += BLOCK_K * stride_ak
        w_offs += BLOCK_K * stride_wk

    # epilogue: the scales constant along K, the bias and the routing weight of each pair
    if not K_GROUPED:
        a_s = a_q if A_QUANT else tl.load(a_s_ptrs, mask=valid, other=0.0)[:, None]
        acc *= a_s * tl.load(w_s_ptrs, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + offs_n * stride_bn
        acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
    if DIRECT:
        # as _store_tile's split-K: the barrier orders every thread's row before the (release) ticket; the
        # last pair reads the others' rows from L2 (.cg), sums them as combine_kernel does and zeroes the ticket
        # for the next launch (every pair of the token has taken it by then)
        tl.debug_barrier()
        token = (tl.program_id(0) // K_TOP).to(tl.int64)
        ticket_ptr = tickets_ptr + token * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == K_TOP - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in tl.static_range(K_TOP):
                p = token * K_TOP + j
                e_j = tl.load(block_expert_ptr + p)
                term = tl.load(y_ptr + p * stride_ym + offs_n * stride_yn, mask=n_ok, other=0.0, cache_modifier=".cg")
                total += tl.where((e_j >= 0) & (e_j < E), term.to(tl.float32), 0.0)
            tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(ticket_ptr, 0)


def tile_config(pairs_per_expert: float, n: int, k: int, k_grouped: bool = False) -> dict:
    """Tiles by the average number of (token, k) pairs per expert. Decode (a few pairs per expert)
    streams the expert weights: short row blocks, narrow N tiles, long K tiles. Prefill is a GEMM per
    expert: 128-row blocks; the second GEMM (one accumulator, where the first has two) takes N tiles of
    256. H200 sweep of 2026-11-29 (benchmarks/RESULTS.md, run 8), 4096 tokens, first + second GEMM:
    Mixtral-8x7B 1.92 + 0.79 ms (2.11 + 0.91 with 128-wide N tiles for both), Qwen3-30B-A3B 0.29 + 0.20;
    16-, 32- and 64-row blocks slower. ``k_grouped`` (scales varying along K, e.g. 128x128 blocks): each
    K step's product is scaled before it is added, so a second [BM, BN] float32 tile per accumulator is
    live: 64-row blocks with 8 warps (Mixtral 4.02 + 1.79 ms; 128-row blocks 9.00 + 1.63, 4 warps 13.1).
    Run 9's sweep (same shapes): 4 pipeline stages for the first GEMM (Mixtral 3.88 ms, Qwen3 0.516; 3 stages
    4.03, 0.526) and 256-wide N tiles for the second where H >= 4096 (Mixtral 1.81 vs 1.84; Qwen3's H=2048
    then has 8 N tiles: 0.320 vs 0.278)."""
    if pairs_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256 if k >= 1024 else 128, num_warps=4, num_stages=4)
    if pairs_per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if k_grouped:
        wide_h = dict(gemm2=dict(BLOCK_N=256)) if k >= 4096 else {}
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, **wide_h)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, gemm2=dict(BLOCK_N=256))


# -- 6. the combine ----------------------------------------------------------------------------
@triton.jit
def combine_kernel(y_ptr, ids_ptr, out_ptr, H, stride_y, stride_o, E: tl.constexpr, K_TOP: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """out[t] = sum over k of y[t * K + k] in float32 (k in order: deterministic), cast to out's dtype.
    Pairs routed nowhere (ids outside [0, E)) add 0: their rows of y were never written."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K_TOP):
        pair = t.to(tl.int64) * K_TOP + k
        expert = tl.load(ids_ptr + pair)
        term = tl.load(y_ptr + pair * stride_y + offs, mask=h_ok, other=0.0).to(tl.float32)
        acc += tl.where((expert >= 0) & (expert < E), term, 0.0)  # unwritten rows: whatever they hold
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# -- the whole op ------------------------------------------------------------------------------
def _k_group(block) -> Optional[int]:
    """The K group of an fp8fx block, None when its scale is constant along K."""
    return None if block[1] == -1 else block[1]


def supports(w_block, act_block, w13_shape: Optional[tuple] = None, interleaved: bool = False,
             gated: bool = True) -> bool:
    """Per-tensor / per-channel / block weights with per-tensor / per-token / 1 x GK activations, where
    every K-varying scale uses the same group GK in {32, 64, 128} (the fp8 dot's smallest K on sm_90 is
    32; BLOCK_K = GK, and BLOCK_N = GK with fused quantization: 256 spills registers and 512 exceeds
    shared memory at these tiles) and, given w13's shape ``[E, 2I, H]``, weight blocks do not straddle
    gate and up (I % rows == 0; interleaved rows mix them in any block, each row with its block's scale; ungated
    experts' w13 is up alone), and there is an expert (E = 0 leaves no expert's tile to size the grid by)."""
    if w13_shape is not None and w13_shape[0] == 0:
        return False
    groups = {g for g in (_k_group(w_block), _k_group(act_block)) if g is not None}
    if act_block[0] not in (1, -1) or (act_block[0] == -1 and act_block[1] != -1):
        return False
    if w_block[0] == -1 and w_block[1] != -1:  # whole-column K groups: not a layout checkpoints use
        return False
    if w13_shape is not None and gated and not interleaved and _k_group(w_block) is not None \
            and (w13_shape[1] // 2) % w_block[0]:
        return False
    return len(groups) <= 1 and groups <= {32, 64, 128}


QuantizeAct = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (a, act_block, static, amax_parts=None)


def quantize_act(a: torch.Tensor, act_block, static: Optional[torch.Tensor],
                 amax_parts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 a [R, C], float32 scale [R or 1, groups]) as ``fp8fx.quant`` computes them: one pass of
    ``quantize_rows_kernel`` for per-row, 1 x GK and static scales; per-tensor dynamic scales (one amax
    over the whole tensor) in torch. ``amax_parts`` ``[R, n]`` (per-row scales): each row's amax is the
    max of its n partial maxima, and the kernel reads the row once instead of twice."""
    r, c = a.shape
    if static is None and tuple(act_block) == (-1, -1):
        q, scale = quant.quantize(a, act_block)
        return q, scale.reshape(1, 1)
    if c and a.stride(1) != 1:  # the kernel walks each row with unit stride
        a = a.contiguous()
    q = torch.empty(r, c, device=a.device, dtype=quant.FP8_DTYPE)
    group = c if static is not None or act_block[1] == -1 else act_block[1]
    n_groups = 1 if static is not None else cdiv(c, group)
    scale = static.float().reshape(1, 1) if static is not None else torch.empty(
        r, n_groups, device=a.device, dtype=torch.float32
    )
    parts = amax_parts.contiguous() if amax_parts is not None and static is None and n_groups == 1 else None
    if r and c:
        quantize_rows_kernel[(r, cdiv(c, group))](
            a, q, scale, scale, scale if parts is None else parts,
            c, a.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            0 if parts is None else parts.stride(0), 0 if parts is None else parts.shape[1],
            GROUP=group, CHUNK=min(next_power_of_2(group), 1024), STATIC=static is not None,
            PARTS=0 if parts is None else next_power_of_2(parts.shape[1]),
            EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, num_warps=4,
        )
    return q, scale


def torch_quantize_act(a, act_block, static, amax_parts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act`` in plain torch (fp8fx.quant): for Triton's interpreter, whose fp32 -> fp8
    conversion is wrong for ~3% of values (FACTS.md), so kernel tests compare GEMMs, not that bug.
    ``amax_parts`` is not needed: a max of partial maxima is the max itself."""
    if static is not None:
        return quant.quantize_with_scale(a, static, [-1, -1]), static.float().reshape(1, 1)
    q, scale = quant.quantize(a, act_block)
    return q, scale.reshape(a.shape[0] if act_block[0] == 1 else 1, -1)


def _act_strides(scale: torch.Tensor) -> tuple[int, int]:
    """(row, group) strides of an activation scale; 0 where it has one row or one group."""
    return tuple(0 if scale.shape[d] == 1 else scale.stride(d) for d in (0, 1))


def _weight_scale(scale: torch.Tensor, w: torch.Tensor, w_block) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """(scale as [E, rows/BN, K/GK], its strides with 0 on single-entry axes, weight rows per scale row)."""
    e, rows, cols = w.shape
    s = scale.float().reshape(quant.scale_shape(w.shape, w_block)).contiguous()
    strides = tuple(0 if s.shape[d] == 1 else s.stride(d) for d in (0, 1, 2))
    return s, strides, quant.resolve_block(w_block, rows, cols)[0]


def direct_by_default(t: int, k_top: int, e: int, pair_bytes: int) -> bool:
    """Whether fused_moe takes the DIRECT path for ``t`` tokens routed to ``k_top`` of ``e`` experts whose weights
    take ``pair_bytes`` each: always for one token (its top-k experts are distinct: nothing is read twice); up to
    DIRECT_MAX_TOKENS where the expected re-reads (each token's top-k a uniform draw) cost less than the launches
    saved. On run 49's shapes: Nemotron-3-Nano's experts direct up to 4 tokens and Qwen3-30B-A3B's up to 5 (measured
    1.04x and 1.15x faster at 4; at 8, 0.96x and 1.05x), GPT-OSS-20B's up to 2 (1.09x; 0.99x at 4), Mixtral's at one
    token only."""
    if t <= 1:
        return True
    if t > DIRECT_MAX_TOKENS or e <= 0:
        return False
    touched = e * (1 - (1 - min(k_top, e) / e) ** t)  # expected distinct experts
    return (t * k_top - touched) * pair_bytes / DIRECT_READ_BYTES_PER_S < DIRECT_SAVED_S


# fused_moe's activation -> moe_gemm13_kernel's ACT
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1, "silu_clamped": 2, "gelu_tanh": 3, "gelu": 4, "relu2": 5}


def _bias(bias: Optional[torch.Tensor], fallback: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(pointer, expert stride, row stride) of a [E, R] bias; with none, any tensor and strides 0 (not read)."""
    return (fallback, 0, 0) if bias is None else (bias, bias.stride(0), bias.stride(1))


def _gemm13(xq, x_scale, w13, s13, s13_strides, s13_rows, sorted_pair, block_expert, k_top, s, fuse_group,
            zero_unrouted, consts, cfg, amax_out=False, form: Optional[dict] = None, x_quant: int = 0):
    """Step 3: the intermediate ``[S, I]``: float32, or with ``fuse_group`` (== BLOCK_N) already fp8 with its
    ``[S, I / group]`` scales. Rows of pairs routed nowhere (ids outside [0, E)) are never written and never
    read by the second GEMM; ``zero_unrouted`` zeroes them for an amax over the whole tensor. ``amax_out``:
    (float32 intermediate, each row's amax over each N tile ``[S, I / BLOCK_N]``). ``form``: fused_moe's
    ``w13_bias``, ``interleaved``, ``activation``, ``swiglu_alpha``, ``swiglu_limit`` and ``gated`` (False: w13 is
    ``[E, I, H]``, the intermediate act(w13 x)). ``consts["DIRECT"]``: one program per pair (``block_expert`` is the
    ids, ``sorted_pair`` not read); ``x_quant``: its X_QUANT (``xq`` 16-bit, quantized in the kernel)."""
    form = form or {}
    i = w13.shape[1] // 2 if form.get("gated", True) else w13.shape[1]
    interleaved, b13 = form.get("interleaved", False), form.get("w13_bias")
    bias = _bias(b13, s13)
    dtype = quant.FP8_DTYPE if fuse_group else torch.float32
    inter = (torch.zeros if zero_unrouted else torch.empty)(s, i, device=xq.device, dtype=dtype)
    groups = cdiv(i, consts["BLOCK_N"]) if fuse_group or amax_out else 1
    i_scale = torch.empty(s, groups, device=xq.device, dtype=torch.float32)
    grid = (block_expert.numel(), cdiv(i, consts["BLOCK_N"]))
    moe_gemm13_kernel[grid](
        xq, w13, inter, x_scale, s13, sorted_pair, block_expert, i_scale, bias[0],
        s, i, w13.shape[2], 1 if interleaved else i, w13.shape[0],
        form.get("swiglu_alpha", 1.0), form.get("swiglu_limit", 1.0),
        xq.stride(0), xq.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0), inter.stride(1),
        *_act_strides(x_scale), *s13_strides, i_scale.stride(0), i_scale.stride(1), *bias[1:],
        K_TOP=k_top, W_BLOCK_N=s13_rows, ROW_STEP=2 if interleaved else 1, HAS_BIAS=b13 is not None,
        ACT=ACTIVATIONS[form.get("activation", "silu")], GATED=form.get("gated", True), QUANT_OUT=bool(fuse_group),
        AMAX_OUT=amax_out and not fuse_group, X_QUANT=x_quant, ROW_BLOCK=min(4096, next_power_of_2(w13.shape[2])),
        EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, **consts, **cfg,
    )
    return (inter, i_scale) if fuse_group or amax_out else inter


# the keys of fused_moe's ``config`` (``tile_config``'s): both GEMMs' tiles and Triton's launch options; ``gemm2``, a
# dict of the second GEMM's own
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "num_ctas", "maxnreg")


def _check_config(config: dict) -> None:
    """A ``config`` given to fused_moe: the keys of ``tile_config``'s tiles (``gemm2`` a dict of them), BLOCK_M,
    BLOCK_N and BLOCK_K given, each value one the kernels take. Unchecked, a key they do not read (a typo:
    ``num_stage``) was dropped by Triton's launch unsaid, a missing tile failed as a KeyError and a tile that is not
    a power of 2 of 16 or more (the fp8 dot's least; 32 for BLOCK_K, which BLOCK_K=16 compiled for sm_90 failed
    on) deep in Triton."""
    gemm2 = config.get("gemm2", {})
    if not isinstance(gemm2, dict):
        raise ValueError(f"fused_moe config: gemm2={gemm2!r}; it takes a dict of the second GEMM's own tile keys "
                         f"({list(CONFIG_KEYS)})")
    for where, cfg, keys in (("config", config, (*CONFIG_KEYS, "gemm2")), ("config gemm2", gemm2, CONFIG_KEYS)):
        unknown = [key for key in cfg if key not in keys]
        if unknown:
            raise ValueError(f"fused_moe {where}: keys {unknown} are not the GEMMs' tile keys; it takes {list(keys)} "
                             f"(fp8fx.kernels.fused_moe.tile_config gives the default tiles)")
        for key, v in cfg.items():
            if key.startswith("BLOCK_") or key in ("num_warps", "num_stages", "num_ctas"):
                least = FP8_DOT_MIN_K if key == "BLOCK_K" else 16 if key.startswith("BLOCK_") else 1 if (
                    key == "num_warps") else None  # (the fp8 dot's least M / N, and K: FP8_DOT_MIN_K)
                why = tile_value_refusal(key, v, least)
                if why:
                    raise ValueError(f"fused_moe {where}: {why}")
    missing = [key for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if key not in config]
    if missing:
        raise ValueError(f"fused_moe config {config} has no {missing}; both GEMMs need BLOCK_M, BLOCK_N and BLOCK_K "
                         f"(fp8fx.kernels.fused_moe.tile_config gives the default tiles)")


def fused_moe(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype,
    a13_scale=None, a2_scale=None, config: Optional[dict] = None, fast_accum: bool = False,
    quantize: QuantizeAct = quantize_act, fuse_quant: bool = True, w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None, interleaved: bool = False, activation: str = "silu",
    swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, gated: bool = True, direct: Optional[bool] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """``fp8fx.fused_moe`` (see fp8fx/ops.py) for the schemes ``supports`` accepts. ``quantize``
    quantizes the activations (``torch_quantize_act`` for Triton's interpreter). With 1 x GK activation
    groups and ``fuse_quant`` the first GEMM's epilogue quantizes the intermediate (N tiles of GK). ``direct``: the
    decode path (see the module's docstring), by ``direct_by_default`` where it is None and no ``config`` is given (a
    given config's tiles are the aligned path's; the direct path takes 16-row tiles); with the default ``quantize``
    and ``fuse_quant`` it quantizes x and the intermediate inside its GEMMs, else through ``quantize``. ``pdl``: the
    direct path's GEMMs as programmatic dependents (``DIRECT_PDL_TRIGGER``; sm_90 and newer), by default where it
    was timed: the direct path on sm_90."""
    if not supports(w_block, act_block, tuple(w13.shape), interleaved, gated):
        raise NotImplementedError(
            f"fused_moe kernel: w_block={list(w_block)}, act_block={list(act_block)}, w13 {tuple(w13.shape)}"
        )
    if pdl and not _hopper(x):
        raise ValueError(f"fused_moe: pdl=True launches the direct path's GEMMs as programmatic dependents, which "
                         f"needs a CUDA GPU of compute capability 9.0 or newer; x is on {x.device}: pass pdl=None or "
                         f"False")
    gemm2 = config.get("gemm2", {}) if config else {}  # (not a dict: _check_config says so, below)
    launch_keys = config and sorted({"launch_pdl", "PDL_WAIT", "PDL_TRIGGER"}
                                    & {*config, *(gemm2 if isinstance(gemm2, dict) else ())})
    if launch_keys:  # (a launch_pdl without the programs' wait would let them read before the kernel before ends)
        raise ValueError(f"fused_moe config: {launch_keys} are fused_moe's to set (its pdl argument and "
                         f"DIRECT_PDL_TRIGGER); drop them from the config")
    if config:
        _check_config(config)
    t, h = x.shape
    e, two_i, _ = w13.shape  # (ungated: [E, I, H])
    k_top = topk_ids.shape[1]
    s = t * k_top
    if s == 0 or h == 0 or two_i == 0:  # no pairs, or an empty sum (the tiles below need H, I > 0)
        if s and h and w2_bias is not None:  # I = 0: each routed pair's w2 bias, weighted
            from fp8fx.ops import fused_moe_reference
            return fused_moe_reference(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block,
                                       out_dtype, w2_bias=w2_bias, gated=gated)
        return x.new_zeros((t, h), dtype=out_dtype)
    group_k = _k_group(w_block) or _k_group(act_block)
    cfg = dict(config or tile_config(s / e, two_i, h, k_grouped=group_k is not None))
    if direct is None:
        pair_bytes = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
        direct = config is None and direct_by_default(t, k_top, e, pair_bytes)
    if pdl is None:
        pdl = direct and DIRECT_PDL_TRIGGER is not None and _hopper(x, exactly=True)
    elif pdl and not direct:
        raise ValueError(f"fused_moe: pdl=True launches the direct path's GEMMs as programmatic dependents; this call "
                         f"takes the aligned path (direct={direct}{', a config given' if config else ''}): pass "
                         f"direct=True, or pdl=None or False")
    if pdl and DIRECT_PDL_TRIGGER not in (None, 1, 2):
        raise ValueError(f"fp8fx.kernels.fused_moe.DIRECT_PDL_TRIGGER={DIRECT_PDL_TRIGGER!r}; it takes None, 1 (the "
                         f"second GEMM let in after the first's wait) or 2 (after its K loop)")
    gemm2 = cfg.pop("gemm2", {})  # the second GEMM's own tiles, where the config gives them
    cfg2 = {**cfg, **gemm2}
    tiles = {name: cfg.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    tiles2 = {name: cfg2.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    if tiles2["BLOCK_M"] != tiles["BLOCK_M"]:
        raise ValueError(f"fused_moe config: both GEMMs walk the same row blocks, got BLOCK_M {tiles['BLOCK_M']} "
                         f"and gemm2 BLOCK_M {tiles2['BLOCK_M']}")
    if group_k:
        tiles["BLOCK_K"] = tiles2["BLOCK_K"] = group_k  # K-varying scales are applied per K step
    if direct:  # one pair per program: its row, padded to the fp8 dot's least M (a prefill config's 128 would
        tiles["BLOCK_M"] = tiles2["BLOCK_M"] = 16  # spill its float32 intermediate's stages out of shared memory)
    fuse_group = _k_group(act_block) if fuse_quant and a2_scale is None else None
    if fuse_group:
        tiles["BLOCK_N"] = fuse_group  # one N tile of the first GEMM = one activation group
    consts, consts2 = (dict(K_GROUPED=group_k is not None, IMPRECISE_K=imprecise_k(t, fast_accum), DIRECT=direct, **t)
                       for t in (tiles, tiles2))
    if pdl:  # (as programmatic dependents: a copy or cast between the two GEMMs would be the second's predecessor -
        # correct, its wait is for that one, but with no overlap - so everything the second reads is made before the
        # first; a quantize hook or fuse_quant=False still runs its quantization between them)
        consts.update(PDL_WAIT=True, PDL_TRIGGER=DIRECT_PDL_TRIGGER or 0)
        consts2.update(PDL_WAIT=True)
        cfg["launch_pdl"] = cfg2["launch_pdl"] = True
    # pair p at ids[p] for the kernels that read it: a [T, K] view (e.g. one column of a wider tensor)
    # reshapes to a strided view
    ids = topk_ids.reshape(-1).contiguous()
    pair_weights = topk_weights.reshape(-1).contiguous()
    if direct:  # each program reads its pair's expert from the ids
        sorted_pair, block_expert = ids, ids
    else:
        sorted_pair, block_expert = align(ids.view(t, k_top), e, tiles["BLOCK_M"])
    in_kernel = direct and fuse_quant and quantize is quantize_act  # every quantization in the GEMMs
    per_tensor = a2_scale is None and tuple(act_block) == (-1, -1)
    per_row = a2_scale is None and tuple(act_block) == (1, -1)  # the first GEMM leaves partial row maxima
    # x quantized in the first GEMM (X_QUANT) where its scale is one per token, per tensor or static; 1 x GK groups
    # take quantize_rows_kernel's launch (see moe_gemm13_kernel)
    x_quant = (3 if a13_scale is not None else {(1, -1): 1, (-1, -1): 2}.get(tuple(act_block), 0)) if in_kernel else 0
    if x_quant:
        xq = x if x.stride(1) == 1 else x.contiguous()  # (the kernel's row amax walks H with unit stride)
        x_scale = a13_scale.float().reshape(1, 1) if a13_scale is not None else x.new_empty(1, 1, dtype=torch.float32)
    else:
        xq, x_scale = quantize(x, act_block, a13_scale)
    s13, s13_strides, s13_rows = _weight_scale(w13_scale, w13, w_block)
    s2, s2_strides, s2_rows = _weight_scale(w2_scale, w2, w_block)
    a2_static = a2_scale.float().reshape(1, 1) if in_kernel and a2_scale is not None else None
    # [S, H]: bf16 for bf16 outputs (half the traffic of float32; each pair's term is rounded once
    # before the float32 sum over top-k, ~2**-9 relative, where the reference rounds only the sum),
    # float32 otherwise (an fp16 term can overflow where the sum would not). Rows of pairs routed
    # nowhere are never written; the combine skips them (no memset).
    y = torch.empty(s, h, device=x.device, dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    out = torch.empty(t, h, device=x.device, dtype=out_dtype)
    grid2 = (block_expert.numel(), cdiv(h, tiles2["BLOCK_N"]))
    tickets = _tickets.zeroed(x.device, t * grid2[1]) if direct else y  # (not read unless direct; left zero)
    # the per-tensor amax over the whole intermediate: in torch over rows zeroed where no pair wrote, or in the
    # second GEMM over the first's partial maxima (zero for pairs routed nowhere)
    inter = _gemm13(xq, x_scale, w13, s13, s13_strides, s13_rows, sorted_pair, block_expert, k_top, s, fuse_group,
                    per_tensor and not in_kernel, consts, cfg, amax_out=per_row or (per_tensor and in_kernel),
                    form=dict(w13_bias=w13_bias, interleaved=interleaved, activation=activation,
                               swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, gated=gated), x_quant=x_quant)
    a_quant = 0  # the second GEMM's A_QUANT
    if fuse_group:
        iq, i_scale = inter
    elif in_kernel and a2_scale is not None:
        iq, i_scale, a_quant = inter, a2_static, 3
    elif in_kernel:
        (iq, i_scale), a_quant = inter, 1 if per_row else 2
    elif per_row:
        iq, i_scale = quantize(inter[0], act_block, None, amax_parts=inter[1])
    else:
        iq, i_scale = quantize(inter, act_block, a2_scale)

    bias2 = _bias(w2_bias, s2)
    n_parts = i_scale.shape[1] if a_quant in (1, 2) else 1
    moe_gemm2_kernel[grid2](
        iq, w2, y, i_scale, s2, pair_weights, sorted_pair, block_expert, bias2[0],
        out, tickets, s, h, iq.shape[1], e,
        iq.stride(0), iq.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), y.stride(1),
        *_act_strides(i_scale), *s2_strides, *bias2[1:], out.stride(0),
        W_BLOCK_N=s2_rows, HAS_BIAS=w2_bias is not None, K_TOP=k_top, A_QUANT=a_quant, N_PARTS=n_parts,
        PARTS_BLOCK=min(64, next_power_of_2(n_parts)), EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, **consts2, **cfg2,
    )
    if direct:  # the second GEMM combined the pairs
        return out
    block_h = min(1024, next_power_of_2(h))
    combine_kernel[(t, cdiv(h, block_h))](
        y, ids, out, h, y.stride(0), out.stride(0), E=e, K_TOP=k_top, BLOCK_H=block_h, num_warps=4,
    )
    return out
