"""FP8 GEMM with its scales applied where their layout allows (Triton).

    y[M, N] = sum_k a[m, k] * sa(m, k) * b[n, k] * sb(n, k)  (+ bias[N]), in y's dtype

Layouts (``a``: activations ``[M, K]``, ``b``: weight ``[N, K]`` row-major, i.e. K-major for the
dot; scales float32):

==============  =====================================  ===========================================
scale           a (activations)                        b (weight)
==============  =====================================  ===========================================
per-tensor      ``a_scale``: 1 element                 ``b_scale``: 1 element
per-row         ``a_scale``: ``[M]`` (per token)       ``b_scale``: ``[N]`` (per channel)
grouped/blocks  ``a_scale``: ``[M, ceil(K / GK)]``     ``b_scale``: ``[ceil(N / BN_W), ceil(K / GK)]``
==============  =====================================  ===========================================

Per-tensor and per-row scales factor out of the K sum and are applied once per output tile, in the
epilogue. Scales that change along K (1 x GK activation groups, BN_W x GK weight blocks, DeepSeek-V3
style) multiply each K step's partial product, so BLOCK_K == GK there (the step's scales loaded one step
ahead, by one FMA an element where they are one a row of the tile). The dots stay on the fp8
operands (Hopper fp8 tensor cores, fp32 accumulator) - unless ``A_FP8`` is False: the weight-only
variant takes bf16/fp16 activations, upcasts each fp8 weight tile in registers and runs a 16-bit dot
(GPUs without fp8 tensor cores, compute capability < 8.9).

Accumulation: on sm_90 Triton lets an fp8 ``tl.dot`` chain accumulate in the tensor cores' reduced
precision for the whole K loop unless told otherwise (``max_num_imprecise_acc_default = 2**30`` in
triton's NVIDIA backend, 3.6 and 3.9) - cuBLAS's fast-accumulation mode. ``imprecise_k`` says how many
K elements may be summed that way before the partial sum is promoted into the fp32 accumulator:
BLOCK_K (every K step, like cuBLAS without fast accumulation) unless ``fast_accum``; the K-group path
promotes every step anyway (a fresh ``tl.dot`` per K step, scaled, then added).

Used for decode-sized M (<= 64), where cuBLAS fp8 is slower than streaming the weight at HBM
bandwidth (H200, torch 2.11: down 4096x14336 at M=16 took 0.047 ms through `torch._scaled_mm` vs
0.042 ms in bf16; this kernel 0.026-0.037 ms, benchmarks/RESULTS.md), and for block scales where
cuBLAS's block-scaled GEMM does not apply (``fp8fx.ops.cublas_block_fits``: decode sizes, ragged blocks).
Tiles are picked by `tile_config` rather than autotuned so launches are deterministic, CUDA-graph
capturable and run under TRITON_INTERPRET=1. ``SPLIT_K`` > 1 splits the K loop over that many programs
per output tile for decode shapes whose output tiles are too few to keep every SM streaming weight
(down 4096x14336 at BLOCK_N=64: 64 tiles for 132 SMs; split in 4 it ran 6% faster on the H200,
`tile_config`, with the partials then summed by two more kernels). Each split writes a float32 partial
and the last split of a tile to finish (an int32 ticket per tile) sums them in split order: deterministic,
and the GEMM's only launch. The tickets count in periods, so a launch captured into a CUDA graph keeps tickets of
its own that no replay zeroes again (``fp8fx.kernels.tickets``: a memset before each launch cost 1.1 us of qkv's
10-13); other launches zero fresh ones.

One row (M = 1, ``GEMV_MAX_M``; every scheme, K groups of a multiple of 16): ``fp8_gemv_kernel`` instead, on
the CUDA cores. A 16-row tensor-core tile would be 15/16 padding, and its weight tiles pass through shared memory;
the GEMV's programs are 1-2 warps that stream 4-8 weight rows 16 bytes a thread (through a 3-stage cp.async
pipeline in shared memory since run 19, ``K_STAGES``; no tensor-core operand staging) and keep a float32 product
per element. On the H200 (run 16, before the pipelining; CUDA-graph replays, the two in the same process):
qkv 6144x4096 0.0123 ms against 0.0166, down 4096x14336 0.0198 against 0.0221, gate 14336x4096 0.0206 against
0.0216, gate_up 28672x4096 0.0343 against 0.0332 (the one shape it loses, by 3%: weights of over 4x more rows than
columns stay on the tensor-core tile, ``gemv_fits``); the MLP block through the default backend 0.0639 ms against
0.0680-0.0684, through the fused MLP (its down GEMM) 0.0559 against 0.0600.

``A_QUANT``: the activations arrive 16-bit with partial row maxima (or a static scale) and each a tile is
quantized to fp8 as it is loaded - the down GEMM of ``fp8fx.kernels.gated_mlp``, whose first kernel writes
the maxima in its epilogue, so no quantization pass runs between the two.

Addresses: 64-bit bases per program and 32-bit offsets inside its tiles (``fp8_gemm`` makes both operands
row-major, so an offset stays under BLOCK_M * K or BLOCK_N * K); [BM, BK] tensors of 64-bit pointers
carried through the pipelined K loop spilled registers at the prefill tiles.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fp8fx import quant
from fp8fx.kernels import tickets as _tickets
from fp8fx.kernels.launch import capability, cdiv, has_fp8_tensor_cores, next_power_of_2, shared_memory

# scale layouts, on the host (the kernel takes them as constexpr flags: Triton kernels may not read
# module globals unless they are tl.constexpr objects)
PER_TENSOR, PER_ROW, PER_K_GROUP = 0, 1, 2
# quantization of 16-bit activations inside the GEMM (``a_quant``): none (a is fp8, or weight-only), per
# row or per tensor from partial row maxima (the producer's, one per N tile of it), or a static scale
NO_QUANT, QUANT_ROWS, QUANT_TENSOR, QUANT_STATIC = 0, 1, 2, 3
# split-K tickets of a SPLIT_K that is a power of 2 (up to this) count in periods of this many (``_store_tile``)
TICKET_PERIOD = tl.constexpr(1 << 16)


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN, as torch's amax does (PTX ``max.f32`` drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scale_of(amax, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    """``fp8fx.quant``'s scale: max(amax, EPS) / FP8_MAX, IEEE division (NaN kept)."""
    return tl.math.div_rn(_max_nan(amax, EPS), FP8_MAX)


@triton.jit
def _saturate(v, FP8_MAX: tl.constexpr):
    """v clamped to +-FP8_MAX (NaN kept), as fp8fx.quant does before its cast: ready for the round-to-nearest cast."""
    return tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _to_fp8_range(v, scale, FP8_MAX: tl.constexpr):
    """v / scale, IEEE division, saturated to +-FP8_MAX (NaN kept)."""
    return _saturate(tl.math.div_rn(v, scale), FP8_MAX)


@triton.jit
def _codes_of(v, scale, inv, FP8_MAX: tl.constexpr):
    """v / scale saturated to +-FP8_MAX (NaN kept), ready for the fp8 cast: the quotient correctly rounded, as
    ``fp8fx.quant``'s IEEE division, from ``inv`` = 1 / scale (correctly rounded) with two FMAs instead of a
    division: q = v * inv is close to v / scale (measured within 1.5 ulp), the residual v - q * scale is exact
    in one FMA, and q plus the residual times inv is the rounded quotient (Markstein's correction; q can be 1.5
    ulp off, past the theorem's 1 ulp, so it rests on checks: a review's of every bf16 value at every bf16 row
    scale in the GPU's float32 operations, and ``tests/kernels/codes_check.py``'s, on the interpreter and the
    GPU). Without it a code differed from the reference's at a
    rounding tie of the quotient (97 in 200,000: 414 at scale 414 / 84 is 84, the codes 80 by the division, 88
    by the product). q is first held to +-2 FP8_MAX, so a quotient past the fp8 range stays finite through the
    correction (inf - inf would be NaN) and saturates as the division's does; a zero q is kept as it is (its
    sign: -0 would come out +0; an inf scale: inf times a zero inv would give NaN)."""
    q = tl.clamp(v * inv, -2 * FP8_MAX, 2 * FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _saturate(tl.where(q == 0, q, tl.fma(tl.fma(-q, scale, v), inv, q)), FP8_MAX)


@triton.jit
def _e4m3_from_bits(bits, dtype: tl.constexpr):
    """fp8 e4m3fn codes held as uint8 (``B_BITS``: Triton has no fp8e4nv type before sm_89) as ``dtype``, exactly, by
    integer operations: the code's sign and its 7 exponent and mantissa bits moved to an fp16's places read as fp16
    are its value / 2**8 - e4m3's exponent bias is 7, fp16's 15, and e4m3's subnormals land on fp16's - times 2**8.
    The NaN codes (0x7F, 0xFF) stay NaN."""
    b16 = bits.to(tl.uint16)
    half = (((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return tl.where((b16 & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0).to(dtype)


@triton.jit
def _rows_amax(parts_ptr, rows, M, stride_pm, stride_pp, N_PARTS: tl.constexpr, CHUNK: tl.constexpr):
    """[len(rows)]: each row's amax, the max of its N_PARTS partial maxima (0 for rows past M), CHUNK at a
    time: each chunk is a dependent round trip to memory before the GEMM's first weight load."""
    cols = tl.arange(0, CHUNK)
    row_ptrs = parts_ptr + rows[:, None].to(tl.int64) * stride_pm
    amax = tl.zeros(rows.shape, dtype=tl.float32)
    for p in range(0, N_PARTS, CHUNK):
        mask = (rows[:, None] < M) & (p + cols[None, :] < N_PARTS)
        part = tl.load(row_ptrs + (p + cols[None, :]) * stride_pp, mask=mask, other=0.0)
        amax = _max_nan(amax, tl.reduce(part, 1, _max_nan))
    return amax


@triton.jit
def _all_rows_amax(parts_ptr, M, stride_pm, stride_pp, N_PARTS: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """The amax over every one of M rows' N_PARTS partial maxima (a per-tensor scale's), BLOCK_M rows at a time."""
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in range(0, M, BLOCK_M):
        amax = _max_nan(amax, _rows_amax(parts_ptr, r + tl.arange(0, BLOCK_M), M, stride_pm, stride_pp, N_PARTS, CHUNK))
    return tl.reduce(amax, 0, _max_nan)


@triton.jit
def _a_quant_scale(a_scale_ptr, offs_m, M, stride_asm, stride_ask, A_QUANT: tl.constexpr, N_PARTS: tl.constexpr,
                   PARTS_BLOCK: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_M] scales of the rows ``offs_m`` of 16-bit activations quantized in the GEMM (``A_QUANT``):
    from the partial maxima at ``a_scale_ptr`` ([M, N_PARTS]: per row, or over every row), or the static
    scale there. As ``fp8fx.quant.compute_scale``: max(amax, EPS) / FP8_MAX."""
    if A_QUANT == 3:  # static
        return tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(a_scale_ptr).to(tl.float32)
    if A_QUANT == 2:  # per tensor: every row's maxima
        amax = _all_rows_amax(a_scale_ptr, M, stride_asm, stride_ask, N_PARTS, PARTS_BLOCK, BLOCK_M)
        return tl.zeros((BLOCK_M,), dtype=tl.float32) + _scale_of(amax, EPS, FP8_MAX)
    return _scale_of(_rows_amax(a_scale_ptr, offs_m, M, stride_asm, stride_ask, N_PARTS, PARTS_BLOCK), EPS, FP8_MAX)


@triton.jit
def _store_tile(acc, y_ptr, out_ptr, ticket_ptr, split, row0, local_m, offs_m, offs_n, M, N, stride_ym, stride_yn,
                stride_ys, SPLIT_K: tl.constexpr):
    """Store an output tile (rows ``row0 + local_m``, columns ``offs_n``), or with split K its float32 partial,
    the last split of the tile to arrive (``ticket_ptr``, zero on entry) summing the partials into ``out_ptr``."""
    y_tile = y_ptr + row0.to(tl.int64) * stride_ym
    y_ptrs = y_tile + local_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    in_bounds = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs + split.to(tl.int64) * stride_ys, acc.to(y_ptr.dtype.element_ty), mask=in_bounds)
    if SPLIT_K > 1:
        # The tile's last split to arrive (a ticket per tile) sums the partials in split order - deterministic
        # whatever the arrival order - and writes the output. This replaces a sum and a cast kernel after the
        # GEMM. The barrier orders every thread's partial before the (release) ticket, taken by one thread;
        # the acquire side reads the partials from L2 (.cg).
        # With SPLIT_K a power of 2 each split adds TICKET_PERIOD / SPLIT_K, so a tile's counter gains one period a
        # call and the last split is the one that completes a period, whether the counter started the call at zero
        # or at a multiple of the period that earlier calls left there: a buffer of tickets can be kept across calls
        # without being zeroed again (int32 wraps at 2**32, a multiple of the period). Other splits count from zero.
        tl.debug_barrier()
        if (SPLIT_K & (SPLIT_K - 1)) == 0:
            ticket = tl.atomic_add(ticket_ptr, TICKET_PERIOD // SPLIT_K, sem="acq_rel")
            last = ((ticket + TICKET_PERIOD // SPLIT_K) & (TICKET_PERIOD - 1)) == 0
        else:
            last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            part_ptrs = y_ptrs  # split s at s * stride_ys: stepped, so no 32-bit product can overflow
            for _ in range(SPLIT_K):
                total += tl.load(part_ptrs, mask=in_bounds, other=0.0, cache_modifier=".cg")
                part_ptrs += stride_ys
            out_ptrs = out_ptr + row0.to(tl.int64) * N + local_m[:, None] * N + offs_n[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _pdl_start(PDL_WAIT: tl.constexpr, PDL_TRIGGER: tl.constexpr):
    """A GEMM program's start as a programmatic dependent (the kernels' ``PDL_*``): the wait for the kernel before,
    then - after the wait: ``DECODE_PDL`` - the next kernel let launch. Before it the program touches no memory.
    (H200 run 35 also prefetched each program's weight rows into L2 before the wait, Hopper's bulk
    ``cp.async.bulk.prefetch.L2``: every decode GEMM's chain ran 2-52% slower with it, so it is gone.)"""
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def fp8_gemm_kernel(
    # tensors (split-K: y is the float32 partials [SPLIT_K, M, N], out the result, tickets one int32 per
    # output tile, zero on entry)
    a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, tickets_ptr,
    # B_DESC: b's [BLOCK_N, BLOCK_K] tiles through a host tensor descriptor (Hopper's TMA), else None; A_DESC: a's
    # [BLOCK_M, BLOCK_K] tiles (fp8 activations)
    b_desc, a_desc,
    # sizes
    M, N, K,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_ym, stride_yn, stride_ys,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    # schemes
    A_ROWWISE: tl.constexpr, A_GROUPED: tl.constexpr, B_ROWWISE: tl.constexpr, B_GROUPED: tl.constexpr,
    B_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    A_FP8: tl.constexpr, IMPRECISE_K: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    # A_QUANT (QUANT_*): a is 16-bit and quantized to fp8 tile by tile as it is loaded, with the scales of
    # `_a_quant_scale` (a_scale_ptr: the partial row maxima [M, N_PARTS], or the static scale)
    A_QUANT: tl.constexpr = 0, N_PARTS: tl.constexpr = 1, PARTS_BLOCK: tl.constexpr = 64, EPS: tl.constexpr = 1e-12,
    FP8_MAX: tl.constexpr = 448.0,
    # launched as a programmatic dependent of the kernel before it (PDL, sm_90): wait for its memory first
    PDL_WAIT: tl.constexpr = False,
    B_DESC: tl.constexpr = False,
    # A_QUANT's codes: the correctly rounded quotient (`_codes_of`), or the product by the reciprocal (a code one
    # step off at a rounding tie) - kept for tune_gemm.py --codes to time the two side by side
    EXACT_CODES: tl.constexpr = True,
    # the product computed transposed, y.T = b @ a.T: the weight tile is the dot's left operand (BLOCK_N rows, a
    # multiple of 64: Hopper's wgmma, fp8 straight from shared memory) and the few activation rows its right one
    # (BLOCK_M of 16 or more), where an [BM <= 16, BK] x [BK, BN] dot runs mma.sync on the weight tile converted
    # in registers; the accumulator is transposed back once, before the epilogue
    SWAP_AB: tl.constexpr = False,
    A_DESC: tl.constexpr = False,
    # weight-only: b holds the fp8 codes as uint8, decoded by `_e4m3_from_bits` (GPUs before sm_89, where Triton has
    # no fp8e4nv type)
    B_BITS: tl.constexpr = False,
    # PDL, sm_90 (``fp8_gemm``'s ``PDL_TRIGGER`` tile key): right after its wait a program lets the next kernel
    # launch (``gdc_launch_dependents``: its programs take each SM this grid leaves)
    PDL_TRIGGER: tl.constexpr = False,
):
    # split-K: SPLIT_K programs share an output tile, each over its own run of K steps, each writing a
    # float32 partial (y_ptr + split * stride_ys); the last of them to finish sums the partials (see the end)
    split = tl.program_id(0) % SPLIT_K
    pid = tl.program_id(0) // SPLIT_K
    # grouped ordering of the output tiles: GROUP_M row-tiles share the same b columns in L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K steps per split
    k_first = split * k_steps
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    # 64-bit bases per program, 32-bit offsets within its tiles: [BM, BK] / [BK, BN] tensors of 64-bit
    # addresses carried through the pipelined loop cost 2 registers an element and spilled at the prefill
    # tiles (sm_90, 128x128x128, 8 warps); M * K and M * N pass 2**31 for long prefills (300k x 7168),
    # a tile's offsets (BLOCK_M rows of K) do not
    local_m = tl.arange(0, BLOCK_M)
    local_n = tl.arange(0, BLOCK_N)
    a_tile = a_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_am
    b_tile = b_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_bn
    a_offs = local_m[:, None] * stride_am + (k_first * BLOCK_K + offs_k[None, :]) * stride_ak  # [BM, BK]
    b_offs = local_n[None, :] * stride_bn + (k_first * BLOCK_K + offs_k[:, None]) * stride_bk  # b.T: [BK, BN]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # [BM], K group 0
    b_scale_ptrs = b_scale_ptr + (offs_n // B_BLOCK_N) * stride_bsn  # [BN], K block 0
    _pdl_start(PDL_WAIT, PDL_TRIGGER)
    if A_QUANT:
        a_q_scale = _a_quant_scale(a_scale_ptr, offs_m, M, stride_asm, stride_ask, A_QUANT, N_PARTS, PARTS_BLOCK, EPS,
                                   FP8_MAX, BLOCK_M)
        # by the reciprocal and two FMAs (`_codes_of`), not divided: every program re-quantizes its a tiles (each
        # N tile, each K step), and with an IEEE division per element the fused MLP took 0.146 ms at M=1 (0.068
        # with the reciprocal; H200, RESULTS.md run 10)
        a_q_inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), a_q_scale)
    # B_SCALAR: each N tile lies in one weight block's rows (its tiles divide the block), so a K step of it has one
    # weight scale
    B_SCALAR: tl.constexpr = B_GROUPED and B_BLOCK_N % BLOCK_N == 0
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(k_first + k_steps, tl.cdiv(K, BLOCK_K))
    # K groups: each step's scales are loaded one step ahead. Loaded in their own step, after its dot, every step
    # waited on a global load the pipeliner does not stage (it stages the dots' operands) on top of the wgmma. H200
    # run 76 (`tune_gemm.py --block --duel`, 128x128 blocks): 1.2-1.3x faster at 2048-4096 rows (gate_up at 4096
    # 1.408 ms against 1.734), 1.01-1.07x at 16-64
    if A_GROUPED:
        a_k = tl.load(a_scale_ptrs + k_first * stride_ask, mask=(offs_m < M) & (k_first < k_end), other=0.0)
    if B_GROUPED:
        if B_SCALAR:  # the tile lies in one weight block's rows: one scale a step
            b_scale_ptrs = b_scale_ptr + ((pid_n * BLOCK_N) // B_BLOCK_N) * stride_bsn
            b_k = tl.load(b_scale_ptrs + k_first * stride_bsk, mask=k_first < k_end, other=0.0)
        else:
            b_k = tl.load(b_scale_ptrs + k_first * stride_bsk, mask=(offs_n < N) & (k_first < k_end), other=0.0)
    for k in range(k_first, k_end):
        k_left = K - k * BLOCK_K
        if A_DESC:  # bulk copies into shared memory, zero past M and K
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        else:
            a = tl.load(a_tile + a_offs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        if B_DESC:  # bulk copies into shared memory, zero past N and K
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
        else:
            b = tl.load(b_tile + b_offs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        a_offs += BLOCK_K * stride_ak
        b_offs += BLOCK_K * stride_bk
        if A_QUANT:  # the 16-bit tile to fp8 codes, saturated as fp8fx.quant does (NaN kept)
            if EXACT_CODES:
                a = _codes_of(a.to(tl.float32), a_q_scale[:, None], a_q_inv[:, None], FP8_MAX).to(b.dtype)
            else:
                a = _saturate(a.to(tl.float32) * a_q_inv[:, None], FP8_MAX).to(b.dtype)
        elif not A_FP8:  # weight-only: upcast the fp8 weight tile, 16-bit dot
            b = _e4m3_from_bits(b, a.dtype) if B_BITS else b.to(a.dtype)
        if A_GROUPED or B_GROUPED:
            if SWAP_AB:
                part = tl.dot(b.T, a.T)  # [BN, BM]
            else:
                part = tl.dot(a, b)
            # this step's scales, then the next step's loaded (masked past the split's last step)
            if A_GROUPED:
                a_s = a_k
                a_k = tl.load(a_scale_ptrs + (k + 1) * stride_ask, mask=(offs_m < M) & (k + 1 < k_end), other=0.0)
            if B_GROUPED:
                b_s = b_k
                b_next = b_scale_ptrs + (k + 1) * stride_bsk
                if B_SCALAR:
                    b_k = tl.load(b_next, mask=k + 1 < k_end, other=0.0)
                else:
                    b_k = tl.load(b_next, mask=(offs_n < N) & (k + 1 < k_end), other=0.0)
            # the step's product scaled and added by one FMA an element where the scales are one a row (a's
            # groups times a scalar b scale, or either alone)
            if B_GROUPED and not B_SCALAR:
                part *= b_s[:, None] if SWAP_AB else b_s[None, :]
            if A_GROUPED:
                if B_SCALAR:
                    a_s *= b_s
                acc = tl.fma(part, a_s[None, :] if SWAP_AB else a_s[:, None], acc)
            elif B_SCALAR:
                acc = tl.fma(part, b_s, acc)
            else:
                acc += part
        elif SWAP_AB:
            acc = tl.dot(b.T, a.T, acc, max_num_imprecise_acc=IMPRECISE_K)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_K)
    if SWAP_AB:
        acc = acc.T  # [BM, BN], as the epilogue takes it

    # epilogue: the scales that are constant along K, bias, cast
    if A_QUANT:
        acc *= a_q_scale[:, None]
    elif A_ROWWISE:
        acc *= tl.load(a_scale_ptrs, mask=offs_m < M, other=0.0)[:, None]
    elif A_FP8 and not A_GROUPED:  # per-tensor (weight-only activations have no scale)
        acc *= tl.load(a_scale_ptr)
    if B_ROWWISE:
        acc *= tl.load(b_scale_ptrs, mask=offs_n < N, other=0.0)[None, :]
    elif not B_GROUPED:  # per-tensor
        acc *= tl.load(b_scale_ptr)
    if HAS_BIAS:  # once: in split 0's partial
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    _store_tile(acc, y_ptr, out_ptr, tickets_ptr + pid, split, pid_m * BLOCK_M, local_m, offs_m, offs_n, M, N,
                stride_ym, stride_yn, stride_ys, SPLIT_K)


@triton.jit
def _gemv_products(a, b, k0, offs_n, n_ok, K, a_scale_ptr, b_scale_ptr, stride_ask, stride_bsn, stride_bsk, a_q_scale,
                   a_q_inv, A_QUANT: tl.constexpr, A_GROUPED: tl.constexpr, B_GROUPED: tl.constexpr,
                   B_BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, FP8_MAX: tl.constexpr, B_BITS: tl.constexpr,
                   B_DTYPE: tl.constexpr):
    """``fp8_gemv_kernel``'s float32 products [BN, W] of a loaded slice of a [W] and of b's codes [BN, W] (B_DTYPE's,
    or bytes: ``B_BITS``), both from K index ``k0`` on; scales that change along K applied."""
    W: tl.constexpr = a.shape[0]
    a = a.to(tl.float32)
    b = _e4m3_from_bits(b, tl.float32) if B_BITS else b.to(tl.float32)
    if A_QUANT:  # the 16-bit row to fp8 codes as fp8_gemm_kernel's A_QUANT makes them
        a = _codes_of(a, a_q_scale, a_q_inv, FP8_MAX).to(B_DTYPE).to(tl.float32)
    if A_GROUPED or B_GROUPED:
        # the K groups of the slice's 16-element pieces (a thread's 16 bytes of a row: one group when 16 | GROUP_K),
        # their scales loaded once a piece and spread over its 16 elements
        piece = k0 + 16 * tl.arange(0, W // 16)
        group = piece // GROUP_K
        g_ok = piece < K
        if A_GROUPED:
            sa = tl.load(a_scale_ptr + group * stride_ask, mask=g_ok, other=0.0)
            a *= tl.reshape(tl.broadcast_to(sa[:, None], (W // 16, 16)), (W,))
        if B_GROUPED:
            sb = tl.load(b_scale_ptr + (offs_n // B_BLOCK_N)[:, None] * stride_bsn + group[None, :] * stride_bsk,
                         mask=n_ok[:, None] & g_ok[None, :], other=0.0)
            b *= tl.reshape(tl.broadcast_to(sb[:, :, None], (b.shape[0], W // 16, 16)), (b.shape[0], W))
    return a[None, :] * b


@triton.jit
def fp8_gemv_kernel(
    # as fp8_gemm_kernel's, for one row of a (M == 1): y the float32 partials [SPLIT_K, 1, N] under split K
    a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, tickets_ptr,
    N, K,
    stride_ak, stride_bn, stride_yn, stride_ys, stride_ask, stride_bsn, stride_bsk,
    A_FP8: tl.constexpr, A_GROUPED: tl.constexpr, B_ROWWISE: tl.constexpr, B_GROUPED: tl.constexpr,
    B_BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    A_QUANT: tl.constexpr = 0, N_PARTS: tl.constexpr = 1, PARTS_BLOCK: tl.constexpr = 64, EPS: tl.constexpr = 1e-12,
    FP8_MAX: tl.constexpr = 448.0, PDL_WAIT: tl.constexpr = False, K_STAGES: tl.constexpr = 1,
    B_BITS: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False, PRE_WAIT: tl.constexpr = 0,
):
    """y[N] = a[K] . b[N, K] on the CUDA cores: each program streams BLOCK_N weight rows (over its split of K) in
    [BLOCK_N, BLOCK_K] tiles of 16-byte loads - straight into registers with ``K_STAGES=1``, else pipelined
    ``K_STAGES`` deep through shared memory (cp.async), never a tensor-core tile padded from 1 row to 16 - and
    keeps a float32 product per loaded element, summed over K once at the end. Products
    of fp8 codes are exact in float32; the sums round as a tensor core's float32 accumulation does, in another
    order. The activation's scale (per tensor = per row here) and b's are applied after the sum; scales that
    change along K (``A_GROUPED``: a's [1, K / GROUP_K], ``B_GROUPED``: b's [N / B_BLOCK_N, K / GROUP_K]) multiply
    each element as it is loaded (a step spans BLOCK_K / GROUP_K groups). ``PDL_TRIGGER``: as fp8_gemm_kernel's.
    ``PRE_WAIT`` (1, 2 or 4): the program's first K steps of the weight are loaded before the PDL wait - while the
    kernel before still runs - and multiplied after it, so the weight must not be what that kernel writes (fp8fx's
    are parameters, quantized at load time)."""
    split = tl.program_id(0) % SPLIT_K
    pid_n = tl.program_id(0) // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_first = split * k_steps
    k_end = tl.minimum(k_first + k_steps, tl.cdiv(K, BLOCK_K))
    b_tile = b_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_bn
    if PRE_WAIT:  # the weight's first PRE_WAIT steps of this split, loaded before the wait (`_pdl_start`)
        offs_pre = tl.arange(0, PRE_WAIT * BLOCK_K)
        # (the split's own steps only; with EVEN_K a multiple of BLOCK_K, so the loads stay 16 bytes wide)
        k_stop = k_end * BLOCK_K
        k_ok_pre = k_first * BLOCK_K + offs_pre < (k_stop if EVEN_K else tl.minimum(k_stop, K))
        b_pre = tl.load(b_tile + tl.arange(0, BLOCK_N)[:, None] * stride_bn + k_first * BLOCK_K + offs_pre[None, :],
                        mask=n_ok[:, None] & k_ok_pre[None, :], other=0.0)
        a_offs_pre = (k_first * BLOCK_K + offs_pre) * stride_ak
    _pdl_start(PDL_WAIT, PDL_TRIGGER)
    b_offs = tl.arange(0, BLOCK_N)[:, None] * stride_bn + k_first * BLOCK_K + offs_k[None, :]  # [BN, BK], K-major
    a_offs = (k_first * BLOCK_K + offs_k) * stride_ak  # [BK]
    a_q_scale, a_q_inv = 1.0, 1.0
    if A_QUANT:  # the row's scale and its reciprocal for `_codes_of`
        a_q_scale = tl.sum(_a_quant_scale(a_scale_ptr, tl.arange(0, 1), 1, 0, stride_ask, A_QUANT, N_PARTS,
                                          PARTS_BLOCK, EPS, FP8_MAX, 1), 0)  # [1] -> its element
        a_q_inv = tl.math.div_rn(1.0, a_q_scale)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PRE_WAIT:  # the steps loaded before the wait, now multiplied (a is the kernel before's to write)
        a_pre = tl.load(a_ptr + a_offs_pre, mask=k_ok_pre, other=0.0)
        part = _gemv_products(a_pre, b_pre, k_first * BLOCK_K, offs_n, n_ok, K, a_scale_ptr, b_scale_ptr, stride_ask,
                              stride_bsn, stride_bsk, a_q_scale, a_q_inv, A_QUANT, A_GROUPED, B_GROUPED, B_BLOCK_N,
                              GROUP_K, FP8_MAX, B_BITS, b_ptr.dtype.element_ty)
        acc += tl.sum(tl.reshape(part, (BLOCK_N, PRE_WAIT, BLOCK_K)), axis=1)
        b_offs += PRE_WAIT * BLOCK_K
        a_offs += PRE_WAIT * BLOCK_K * stride_ak
    for k in tl.range(k_first + PRE_WAIT, k_end, num_stages=K_STAGES):
        if EVEN_K:  # no K mask: the weight loads stay 16 bytes wide whatever Triton knows of K
            b = tl.load(b_tile + b_offs, mask=n_ok[:, None], other=0.0)
            a = tl.load(a_ptr + a_offs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            b = tl.load(b_tile + b_offs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + a_offs, mask=k_ok, other=0.0)
        acc += _gemv_products(a, b, k * BLOCK_K, offs_n, n_ok, K, a_scale_ptr, b_scale_ptr, stride_ask, stride_bsn,
                              stride_bsk, a_q_scale, a_q_inv, A_QUANT, A_GROUPED, B_GROUPED, B_BLOCK_N, GROUP_K,
                              FP8_MAX, B_BITS, b_ptr.dtype.element_ty)
        b_offs += BLOCK_K
        a_offs += BLOCK_K * stride_ak
    y = tl.sum(acc, axis=1)  # [BN]
    if A_QUANT:
        y *= a_q_scale
    elif A_FP8 and not A_GROUPED:  # per tensor (one row: per row too); weight-only activations have no scale
        y *= tl.load(a_scale_ptr)
    if B_ROWWISE:
        y *= tl.load(b_scale_ptr + (offs_n // B_BLOCK_N) * stride_bsn, mask=n_ok, other=0.0)
    elif not B_GROUPED:  # per tensor
        y *= tl.load(b_scale_ptr)
    if HAS_BIAS:  # once: in split 0's partial
        y += tl.where(split == 0, tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32), 0.0)
    row = tl.arange(0, 1)
    _store_tile(y[None, :], y_ptr, out_ptr, tickets_ptr + pid_n, split, tl.full((), 0, tl.int32), row, row, offs_n,
                1, N, 0, stride_yn, stride_ys, SPLIT_K)


# 1: one-row GEMMs take the GEMV kernel (the CUDA cores, no padded tensor-core tile; it takes one row), 0: none
GEMV_MAX_M = 1
# the GEMV's K loop pipeline depth (``K_STAGES``; 1: loads straight to registers, as before run 19), read at each
# call: bench_linear.py's ``*_k1`` variants set it to 1 while they run, to time the two in one process. None: by K
# (``gemv_config``)
GEMV_K_STAGES: Optional[int] = None


def gemv_config(n: int, k: int, a_quant: bool = False) -> dict:
    """``fp8_gemv_kernel``'s tile for a weight [n, k]: BLOCK_N rows of BLOCK_K = 16 x 32 x num_warps bytes a step,
    so each thread loads 16 bytes of each row and the warps split K, not N: the activation slice a thread
    multiplies is then the one it loads itself (an fp8 a needs no exchange through shared memory; with 4 warps
    split over N, each step's a went through shared memory between two barriers). The K loop's loads are
    pipelined through shared memory, ``K_STAGES`` deep (cp.async): more bytes in flight per register, where loads
    straight into registers (``K_STAGES=1``) held the down GEMM at 69-71% of the copy speed.

    From the H200 sweeps (CUDA-graph replays after a clean L2 flush; run 19 call 1, `tune_gemm.py --gemv
    --k-stages 1,2,3,4`, 37-44 tiles a shape; run 16 for the unpipelined shapes):
    - K = 14336 (down): 4 rows, 2 warps, 3 stages 0.0195 ms in the sweep, whose best (1 warp, 4 stages) took
      0.0194 against 0.0203 unpipelined in 5 interleaved rounds. In the fused MLP, quantizing h as it loads it
      (``a_quant``), 8 rows: the whole op 0.0507 ms against 0.0534 unpipelined in 5 rounds (in the sweep 8 rows
      0.0505, 4 rows 0.0512); with h's codes in 1 x 32 groups, 4 rows: 0.0495 against 0.0501 in 5 rounds.
    - K = 4096 (qkv 6144x4096): 4 rows, 1 warp, 3 stages, the sweep's best: 0.0120 ms against 0.0125 (2 rows,
      unpipelined) in 5 rounds. With K groups (1x128 / 128x128 block scales) 4 rows was already the best
      unpipelined (run 16: qkv 0.0138 against 0.0153 with 2 rows and 0.0177 for the tensor-core block tile);
      their pipelined tile was not timed.
    No split K was among any shape's best; a weight of few rows (under 512 programs) has K split in halves
    while each split keeps 4 K steps.

    Since run 35 these launches go as programmatic dependents (``DECODE_PDL``). Timed so, as chains of launches (H200
    run 37: call 6 `tune_gemm.py --gemv-pdl`, 25 tiles a shape and 5 rounds; call 7 `--gemv-pdl --duel`, 7 rounds),
    K below 8192 takes 4 stages, the same tile otherwise (the best of both sweeps): o 4096x4096 0.0065 ms against
    0.0068 / 0.0067 with 3, qkv 0.0086 against 0.0088 in both calls (with ``PDL_TRIGGER``, not the default: o 0.0059
    against 0.0062, qkv 0.0094 against 0.0092). K of 8192 and more keeps run 19's 3: down 4096x14336 0.0169 ms with 3
    against 0.0171 with 4 (call 7). Only the H200 timed these depths, as it did every tile here."""
    block_n, warps = (8 if a_quant else 4, 2) if k >= 8192 else (4, 1)
    split, steps = 1, cdiv(k, 512 * warps)
    while cdiv(n, block_n) * split < 512 and steps >= 8 * split:
        split *= 2
    return dict(GEMV=True, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=512 * warps, num_warps=warps, num_stages=1,
                SPLIT_K=split, K_STAGES=GEMV_K_STAGES or (3 if k >= 8192 else 4))


def tile_config(m: int, n: int, k: int, a_quant: bool = False, transposed: bool = True,
                k_groups: bool = False) -> dict:
    """The kernel and tiles ``fp8_gemm`` runs for [m, k] x [n, k]: the GEMV kernel where ``gemv_fits``
    (``gemv_config``; ``a_quant``: it quantizes a 16-bit a as it loads it), else ``mma_tile_config`` (whose BLOCK_K
    ``fp8_gemm`` sets to the K group, if any: ``k_groups``; ``transposed``: its transposed tiles of 2-16 rows)."""
    if gemv_fits(m, n, k):
        return gemv_config(n, k, a_quant)
    cfg = mma_tile_config(m, n, k, transposed, long_steps=not (a_quant or k_groups))
    if k_groups and transposed and m > 64:
        # fp8 activations in K groups above 64 rows (DeepSeek-V3's 1x128 / 128x128 blocks): both operands by TMA
        # copies. H200 run 76 (`tune_gemm.py --block --tma`, M = 4096, the scales loaded a step ahead): gate_up
        # 28672x4096 0.997 ms against 1.171 with pointer loads, down 4096x14336 0.536 against 0.555, qkv 6144x4096
        # 0.241 against 0.247 (64 x 128 tiles of 4 warps 0.240), o 4096x4096 0.156 against 0.166; cuBLAS's block
        # GEMM 0.750 / 0.382 / 0.175 / 0.122
        cfg = {**cfg, "TMA": True, "TMA_A": True}
    return cfg


HOPPER_ONLY = ("SWAP_AB", "TMA", "TMA_A")  # the tile keys ``for_device`` drops before sm_90


def for_device(cfg: dict, device: torch.device) -> dict:
    """A default tile ``cfg`` as it runs on ``device``: the tiles timed on the H200 with Hopper's features - the
    transposed tiles (``SWAP_AB``: wgmma) and TMA copies of the weight (``TMA``) and of fp8 activations
    (``TMA_A``) - untransposed and with pointer loads on CUDA GPUs
    before sm_90 (no wgmma, no TMA: their 16-row tiles stay as measured in run 18); on the CPU the interpreter runs
    the H200's tiles."""
    if device.type != "cuda" or capability(device) >= (9, 0):
        return cfg
    return {key: v for key, v in cfg.items() if key not in HOPPER_ONLY}


def gemv_fits(m: int, n: int, k: int) -> bool:
    """Whether [m, k] x [n, k] takes the GEMV kernel: one row, where ``GEMV_MAX_M`` is 1 (read at each call:
    bench_linear.py's ``*_mma`` variants set it to 0 while they run), unless the weight has over 4x more rows than
    columns - the one Llama-3-8B shape the tensor-core tile streamed faster (gate_up 28672x4096: 0.0332 ms against
    0.0339-0.0343, with 128x128 blocks 0.0340 against 0.0388; gate 14336x4096, 3.5x: GEMV 0.0206 against 0.0216;
    H200, run 16)."""
    return 0 < m <= GEMV_MAX_M and n <= 4 * k


def mma_tile_config(m: int, n: int, k: int, transposed: bool = True, long_steps: bool = True) -> dict:
    """Tiles by problem size, from benchmarks/tune_gemm.py on the H200 (torch 2.11, triton 3.6; times of
    CUDA-graph replays, 2026-11-29): decode streams the weight, so narrow N tiles give every SM its own
    slice and deep pipelining keeps enough bytes in flight. M=1: gate_up 28672x4096 0.0309 ms (3.81 TB/s
    on the weight; cuBLAS fp8 0.0465), down 4096x14336 0.0207 ms with K split in 4 (2.83 TB/s; 0.0220
    unsplit; cuBLAS 0.0409). M=64: gate_up 0.0366 ms (0.0415 with BLOCK_K=256), down 0.0235 (run 13).
    Where the sweep's best were within a few % (qkv 6144x4096, whose 25 MB stayed in L2 between that
    sweep's replays), BLOCK_K=128: 256 and 512 spill registers at 4 warps (sm_90 stack of 48-2800 bytes
    per thread, triton 3.6 / 3.9; tests/kernels/test_compile_sm90.py).

    Up to 16 rows of a weight with fewer 64-wide N tiles than the H200's 132 SMs (and K of 1024-8191: each split
    keeps 2+ steps): 32-wide tiles with K split in 4 (untransposed: see below), which fill the GPU (run 18, 24
    tiles a shape, CUDA-graph replays after a clean L2 flush). fp8 activations (call 4, `tune_gemm.py --ms 16`):
    qkv 6144x4096 0.0140 ms against 0.0169 for the unsplit 64-wide tile (96 programs) and 0.0203 for cuBLAS; o
    4096x4096 0.0129 against 0.0160 and 0.0173 (the best, 64-wide split in 4, 0.0127). Weight-only, 16-bit
    activations (call 3, `--weight-only`): qkv 0.0169 against 0.0231 and bf16 cuBLAS 0.0187; o 0.0148 against
    0.0227 and 0.0161.
    128x128 weight blocks take the same tiles there; not timed with them.

    ``transposed`` (``fp8_gemm``: fp8 activations, on Hopper: ``for_device``): since run 20 these two split tiles
    compute the product transposed (``SWAP_AB``: 64 weight rows are wgmma's left operand, fp8 from shared memory;
    `tune_gemm.py --swap --ms 16`, each candidate timed once): qkv 64-wide split in 4 0.0143 ms against 0.0150 for
    the 32-wide mma.sync tile (the unsplit transposed tile, 96 programs, 0.0137; o 4096x4096 not timed
    transposed); down 4096x14336 0.0222 against 0.0228 (the same tile untransposed 0.0226 in the same sweep: a tie
    for this GEMM alone; the fused MLP's down GEMM, transposed, gained 4%, ``gated_mlp.down_tile_config``). With
    fast accumulation (``fast_accum``) the transposed tiles sum in wgmma's reduced precision where the mma.sync
    tiles summed in float32 (``imprecise_k``). Weight-only (16-bit activations, the weight upcast in registers)
    keeps run 18's tiles, the ones timed against bf16 cuBLAS; so does the unsplit 64-wide tile of a weight with
    many N tiles (gate_up) up to 16 rows, not swept transposed there (at 17-32 rows gate_up's is, below)."""
    long_k = k >= 8192
    if m <= 16:
        if 1024 <= k < 8192 and cdiv(n, 64) < 132:
            if transposed:  # 64 weight rows: wgmma's left operand
                return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=4,
                            SWAP_AB=True)
            return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=4)
        if long_k:  # few N tiles (4096 / 64): split K to fill the GPU
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=6, SPLIT_K=4,
                        SWAP_AB=transposed)
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        # fp8 activations: both operands by TMA copies at 64 rows (H200 run 21 call 7, `tune_gemm.py --tma-a`, 7
        # interleaved rounds at M = 64: qkv 0.0151 ms against 0.0159 with pointer loads, o 0.0143 against 0.0154,
        # gate_up 0.0364 against 0.0372, down 0.0234 against 0.0237; at 16 rows a tie or a loss - gate_up's TMA_A
        # alone 0.0342 against 0.0336 - so the tiles of up to 16 rows keep theirs). At 17-63 rows the split tiles
        # below take the weight alone: the activation's copies, a 64-row box over fewer rows, lost there - qkv and o
        # at 24-48 rows (run 22), the fused MLP's down GEMM 4096x14336 at 32 rows 0.0187 ms against 0.0232 (run 29
        # calls 9 and 11, the block's profile; the fused block 0.0600 against 0.0654, calls 8 and 12) and gate_up
        # 28672x4096 at 48 rows in the unsplit 64-wide tile (the last one here): 0.0374 ms against 0.0359 with the
        # weight alone by TMA (H200 run 34 call 3, chains, 7 interleaved rounds; at 64 rows 0.0357 against 0.0363),
        # gate 14336x4096 at 24 / 32 rows 0.0249 / 0.0238 against 0.0189 / 0.0190 (call 4)
        tma = dict(TMA=True, TMA_A=True) if transposed else {}
        few_n = 1024 <= k < 8192 and cdiv(n, 64) < 132  # (qkv, o)
        long_step_class = long_steps and few_n and cdiv(n, 32) <= 132  # (o: the long-step tile below)
        if transposed and m <= 32 and (long_k or few_n) and not (long_step_class and m > 24):
            # 17-32 rows transposed in a 32-row tile (64 weight rows are wgmma's left operand, the activation rows
            # its right one), the weight by TMA, where the 64-row tiles below are half padding or more. H200 run 33
            # (`tune_gemm.py --rows32`, chains, 7 interleaved rounds, ms per launch, at 24 / 32 rows): down 0.0192 /
            # 0.0195 against 0.0203 / 0.0201 (K in steps of 256 split in 4); down of x in 1 x 128 groups 0.0204 /
            # 0.0209 against the fused MLP's 0.0210 / 0.0212 (steps of 128, 6 stages; inside the fused MLP it lost,
            # run 34: ``down_tile_config`` keeps its 64-row tile); qkv
            # 0.0108 / 0.0108 against 0.0116 / 0.0116 (unsplit: 96 programs; split in 2 0.0109); o 0.0087 against
            # 0.0098 at 24 rows (split in 2: 128 programs), where at 32 rows the long-step tile below kept its lead
            # (0.0086 against 0.0089). K groups and 16-bit activations take steps of 128, 6 stages (down's of x in
            # groups; for qkv and o not timed so)
            steps = dict(BLOCK_K=256, num_stages=4) if long_steps else dict(BLOCK_K=128, num_stages=6)
            split = 4 if long_k else 1 if 2 * cdiv(n, 64) > 132 else 2
            return dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_warps=4, SPLIT_K=split, SWAP_AB=True, TMA=True,
                        **steps)
        if transposed and m <= 32 and k >= 1024 and cdiv(n, 64) > 2 * 132:
            # a weight of more than two waves of 64-wide N tiles (gate_up 28672x4096: 448) at 17-32 rows, unsplit in
            # the same 32-row tile with K steps of 128: H200 run 34 (`tune_gemm.py --rows32 --shapes gate_up`,
            # chains, 7 interleaved rounds, ms per launch, at 24 / 32 rows) 0.0329 / 0.0331 (3.57 TB/s) against
            # 0.0488 / 0.0457 for the 64-row tile of both operands by TMA below, 0.0353 / 0.0354 with the weight
            # alone by TMA, cuBLAS fp8 0.0450 (24 rows); K steps of 256 0.0331 / 0.0333. Gate 14336x4096 (224
            # tiles) keeps the 64-row tile, the weight alone by TMA: 0.0189 / 0.0190 against 0.0192 / 0.0193 in
            # this tile and 0.0249 / 0.0238 with both operands by TMA (run 34 call 4). K groups take the same tile
            # (steps of a group), not timed so
            return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=True,
                        TMA=True)
        if long_k:  # 64-wide N tiles, K split in 2 (256 programs): 0.0235 ms against 0.0248 for 32-wide unsplit
            # tiles (128 programs for 132 SMs) at down 4096x14336 (run 13 call 3, `tune_gemm.py --wide-n`)
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=2,
                        **{**tma, "TMA_A": m == 64} if tma else {})
        if transposed and long_step_class:
            # a weight of at most 132 32-wide N tiles (o 4096x4096: 128): one program an SM, each over the whole K
            # in steps of 512 - no partial sums wait on a ticket after the last weight byte, and 4 stages of 16 KB
            # of weight keep the bytes in flight that the split tiles below get from two programs an SM. H200 run 32
            # (`tune_gemm.py --small-n --duel`, chains, 7 interleaved rounds, ms per launch): o at 32 / 48 / 64 rows
            # 0.0086 / 0.0087 / 0.0088 against 0.0099 / 0.0101 / 0.0099 for the split tiles below, 24 rows 0.0098
            # against 0.0100. qkv 6144x4096 (192 such programs for 132 SMs: two waves' worth on some) lost it
            # (0.0148-0.0171 against 0.0116-0.0118); K groups (BLOCK_K = the group) and 16-bit activations
            # (``long_steps=False``: a 64 x 512 tile of two bytes an element) keep the split tiles, not timed so
            return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=4)
        if transposed and few_n:
            # a weight with few 64-wide N tiles (o 4096x4096: 64 programs, qkv 6144x4096: 96, for 132 SMs): 32-wide
            # tiles, K split in 2 (4x and 3x the programs). H200 run 22 (`tune_gemm.py --small-n --duel`, each
            # kernel timed as a chain of launches on operands of their own, 7 interleaved rounds, ms per launch):
            # 64 rows with both operands by TMA: o 0.0110 against 0.0119 unsplit, qkv 0.0129 against 0.0132;
            # 24-48 rows with the weight alone by TMA (the activations' TMA copies lost there: qkv 0.0144-0.0168):
            # o 0.0110-0.0112 against 0.0116-0.0118, qkv 0.0128-0.0130 against 0.0130-0.0133. 17-23 rows run
            # the same 64-row tile as 24 (more of its rows masked)
            split = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5, SPLIT_K=2)
            return {**split, **tma, "TMA_A": m == 64}
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5,
                    **{**tma, "TMA_A": m == 64} if tma else {})
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)


def parts_block(n_parts: int, block_m: int) -> int:
    """How many of a row's partial maxima ``A_QUANT`` reads per round trip: all of a decode row's (448 for
    Llama-3-8B's 14336-wide intermediate in 32-wide tiles: 2 round trips of 256 instead of 7 of 64) within
    4096 values per program (32 float32 registers a thread at 4 warps)."""
    return max(16, min(next_power_of_2(n_parts), 256, 4096 // block_m))


STAGE_BUDGET = 200 * 1024  # shared-memory bytes of a program's pipeline stages: what the tiles were timed with (H200)


def pipeline_stages(cfg: dict, a_bytes: int, budget: int = STAGE_BUDGET) -> int:
    """``cfg``'s stages, fewer where an a tile and a b tile per stage would not fit in ``budget`` bytes of shared
    memory (``stage_budget``; bf16 activations of the weight-only variant double the a tile). Triton's cp.async
    pipelines hold one stage fewer than their ``num_stages`` (its TMA pipelines, on sm_90 only, all of them)."""
    stage_bytes = cfg["BLOCK_M"] * cfg["BLOCK_K"] * a_bytes + cfg["BLOCK_K"] * cfg["BLOCK_N"]
    return max(1, min(cfg["num_stages"], budget // stage_bytes))


def stage_budget(device: torch.device) -> int:
    """``pipeline_stages``'s budget on ``device``: 200 KiB - the tiles were timed on the H200, which has 227 - or 1 KiB
    under what a program may take on a smaller GPU (99 KiB on sm_86 and sm_89: the 4-stage 64 x 512 tile of o at
    25-64 rows and the weight-only down tile at 17-64 needed 144 KiB there and would not launch). The CPU's
    interpreter runs the H200's stages."""
    if device.type != "cuda":
        return STAGE_BUDGET
    return min(STAGE_BUDGET, shared_memory(device) - 1024)


def imprecise_k(cfg: dict, fast_accum: bool) -> Optional[int]:
    """``max_num_imprecise_acc`` for the kernels' fp8 dots: None (Triton's default: no promotion on
    sm_90) with ``fast_accum``, else one promotion per K step. It changes only wgmma tiles (BLOCK_M >= 64, and the
    transposed ``SWAP_AB`` tiles of 2-16 rows since run 20): untransposed tiles of fewer rows run mma.sync, which
    accumulates in float32, and compile to the same PTX. (The fused MLP at M=16 measured the same error against
    the float32 MLP with its down GEMM transposed, fast accumulation on: 0.0639 and 0.0630 with h in groups.)"""
    return None if fast_accum else cfg["BLOCK_K"]


def _descriptor(t: torch.Tensor, rows: int, block_k: int):
    """A host tensor descriptor of ``t`` [R, K] in [rows, block_k] tiles (the kernel's loads become Hopper TMA
    copies, zero-filled past the edges), or None where TMA cannot address it: rows and base must be 16-byte aligned,
    rows apart by at least a row (an expanded operand's rows at stride 0 are not a layout TMA was tested with), and
    neither side empty (a descriptor of zero rows or columns is refused: pointer loads then, as before TMA).
    Per tile configuration: ``TMA=True`` the weight (the fused MLP's down GEMM of h in groups takes it,
    ``gated_mlp.down_tile_config``, H200 run 19; ``tune_gemm.py --tma`` sweeps it), ``TMA_A=True`` fp8 activations."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    if 0 in t.shape or t.stride(0) < t.shape[1]:
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, block_k])


def _scale_layout(scale: torch.Tensor, rows: int, k: int, block: Optional[tuple[int, int]], what: str):
    """(mode, scale as 2-D, rows per scale row) for one operand of ``rows`` x ``k``, its size checked."""
    block = (-1, -1) if block is None else tuple(block)
    per = rows if block[0] == -1 else block[0]  # rows per scale row
    if block[1] == -1:  # per tensor or per row (one element or one per row: told apart by the size), row blocks
        mode = PER_TENSOR if scale.numel() == 1 else PER_ROW
        per = 1 if block[0] in (-1, 1) else per
        want, cols = (1, 1) if mode == PER_TENSOR else (-(-rows // per), 1)
    else:
        mode, want, cols = PER_K_GROUP, -(-rows // per) * -(-k // block[1]), -(-k // block[1])
    if scale.numel() != want:
        raise ValueError(f"fp8_gemm: {what} has {scale.numel()} elements (shape {list(scale.shape)}); block "
                         f"{list(block)} of a [{rows}, {k}] operand needs {want}")
    if scale.dtype == torch.float32 and scale.dim() == 2 and scale.shape[1] == cols:
        return mode, scale, 1 if mode == PER_TENSOR else per  # read at its strides (``quantize``'s are M-major)
    return mode, scale.float().reshape(-1, cols).contiguous(), 1 if mode == PER_TENSOR else per


# Default decode launches (M <= DECODE_PDL_MAX_M, no config given, ``pdl`` not False) on sm_90 - where they were timed -
# go as programmatic dependents of the kernel before them (launched while it drains; each program waits for it before
# its first access) with these tile keys; the fused MLP's down GEMM, one already, takes the keys. None: launched
# plainly. Read at each call: bench_linear.py's and bench_decoder_layer.py's ``*_pdl`` variants set it while they run
# (``with_kernel_setting``); ``tune_gemm.py --pdl`` times the GEMMs' chains.
# H200 run 35 (torch 2.11, triton 3.6): as dependents without keys, each decode GEMM's chain of launches ran
# 1.003-1.036x faster (o, qkv, down, gate_up at 1-64 rows), and a whole Llama-3-8B decoder layer at one token 1.018x
# (fp8fx's GEMMs follow Inductor's kernels there; timed with ``PDL_TRIGGER``, which does nothing where no kernel after
# them is a dependent). With ``PDL_TRIGGER`` (the next launch let in right after the wait) o's chain ran 1.09-1.11x
# faster, but qkv's at 1 and 16 rows 0.96x and 0.86x, down's at 16 0.90x (the next GEMM's programs sit on the SMs this
# one needs): so it is not the default. It pays where the next kernel is a dependent: with Inductor's
# ``triton.enable_pdl`` too, that layer ran 1.049x faster than fp8fx without PDL. (``PDL_TRIGGER`` comes after the wait:
# a kernel launched after one of these as a programmatic dependent then starts only once every kernel before this one
# has finished, as one that triggers after its own wait promises - Inductor's PDL code waits only before reading what
# the kernel just before it wrote. It still starts while this one runs: one that touches this one's output before its
# ``griddepcontrol.wait`` would race with it; fp8fx's and Inductor's kernels wait first.)
# H200 run 36, the default itself against None in that layer (fp8fx fused, 5 rounds, a process for each M): 1.4% faster
# at one token, within 0.3% at 16, 24, 32 and 64 tokens (one 32-token process with five variants had it 1.6% slower; one
# with three, a tie): kept up to 64 rows.
# ``PRE_WAIT`` (H200 run 37: the GEMV's first K steps of the weight loaded before the wait, into registers) is not
# in the default either (where set, the weights of one-row default launches must not be what the kernel just before
# writes: fp8fx's are parameters). In chains of one-row launches with ``PDL_TRIGGER``, qkv ran 0.0079 ms a launch
# with 4 steps (75-76% of the read speed) against 0.0092 with the trigger alone and 0.0087 without it, down 0.0155
# with 2 (0.0164 / 0.0167) but 0.0189 with 4; o lost at every count (0.0064-0.0066 against 0.0062). Without the
# trigger it changed nothing, or lost up to 8% with 4 steps. In the decoder layer at one token it lost: 1.3% (2
# steps) and 1.9% (4) on the default, a tie (2) and 3.8% (4) with Inductor's PDL and the trigger. The tensor-core
# tiles' first step loaded so ran 1.0-1.5x slower at 16-64 rows, so those tiles take no ``PRE_WAIT``. What these tiles
# cannot do - their shared-memory ring is the compiler's - a Gluon kernel did (benchmarks/gluon_decode.py, H200 run 39):
# the weight's first K steps copied into its own ring before the wait. As PDL chains it ran qkv 1.06-1.12x faster than
# these tiles at 16-64 rows (60-65% of the read speed), but o 0.78-0.94x: not adopted.
DECODE_PDL: Optional[dict] = {}
DECODE_PDL_MAX_M = 64
PDL_TILE_KEYS = ("PDL_TRIGGER", "PRE_WAIT")
PRE_WAIT_STEPS = (0, 1, 2, 4)  # ``PRE_WAIT``'s values: K steps of the weight loaded before the wait


def _hopper(t: torch.Tensor, exactly: bool = False) -> bool:
    """Whether ``t`` is on a CUDA GPU of compute capability 9.0 or newer (``exactly``: 9.0, the H200's)."""
    if not t.is_cuda:
        return False
    cap = capability(t.device)
    return cap == (9, 0) if exactly else cap >= (9, 0)


def decode_pdl_keys(b: torch.Tensor, m: int, gemv: bool = False) -> Optional[dict]:
    """How a default launch of ``m`` rows on the weight ``b`` goes (``DECODE_PDL``): None - plainly (``DECODE_PDL``
    None, more than ``DECODE_PDL_MAX_M`` rows, or not on sm_90) - or as a programmatic dependent with these tile
    keys; ``PRE_WAIT`` only where the launch takes the GEMV kernel (``gemv``: the tensor-core tiles take none). The
    setting is checked at every launch, whatever it applies to."""
    if DECODE_PDL is None:
        return None
    unknown = sorted(set(DECODE_PDL) - set(PDL_TILE_KEYS))
    if unknown:
        raise ValueError(f"fp8_gemm.DECODE_PDL: keys {unknown}; it takes {list(PDL_TILE_KEYS)} only (or is None: off)")
    _check_pre_wait(DECODE_PDL.get("PRE_WAIT", 0), "fp8_gemm.DECODE_PDL: PRE_WAIT")
    if m > DECODE_PDL_MAX_M or not _hopper(b, exactly=True):
        return None
    return {key: v for key, v in DECODE_PDL.items() if gemv or key != "PRE_WAIT"}


def _check_pre_wait(steps, what: str) -> None:
    """``PRE_WAIT``'s value: an int of ``PRE_WAIT_STEPS`` (K steps of the weight loaded before the PDL wait)."""
    if type(steps) is not int or steps not in PRE_WAIT_STEPS:
        raise ValueError(f"{what}={steps!r}; it takes one of {list(PRE_WAIT_STEPS)} (K steps of the weight loaded "
                         f"before the PDL wait)")


def _check_pdl_keys(cfg: dict, a: torch.Tensor) -> None:
    """A launch's tile keys ``PDL_TRIGGER`` (an sm_90 instruction) and ``PRE_WAIT`` (the GEMV kernel's only:
    ``PRE_WAIT_STEPS``, its first K steps of the weight loaded before the PDL wait; without PDL there is no wait, and
    the steps are only peeled off the loop)."""
    if cfg.get("PDL_TRIGGER", False) and not _hopper(a):
        raise ValueError(f"fp8_gemm: config PDL_TRIGGER=True needs a CUDA GPU of compute capability 9.0 or newer; a is "
                         f"on {a.device}: leave it out of the config")
    if cfg.get("PRE_WAIT", 0) and not cfg.get("GEMV", False):
        raise ValueError(f"fp8_gemm: config PRE_WAIT={cfg['PRE_WAIT']!r} is the GEMV kernel's (GEMV=True, one row); "
                         f"the tensor-core tiles ran 1.0-1.5x slower with their first step loaded before the wait "
                         f"(H200 run 37): leave it out of the config")
    _check_pre_wait(cfg.get("PRE_WAIT", 0), "fp8_gemm: config PRE_WAIT")


# the least K tile of a dot on fp8 operands: wgmma's and mma.sync's K for 8-bit types is 32 on sm_89 / sm_90 (Triton
# asserts "K >= 32" compiling BLOCK_K=16 for sm_90; the interpreter runs it), where 16-bit dots take 16
FP8_DOT_MIN_K = 32

# The keys of a tile configuration (``fp8_gemm``'s ``config``) each kernel reads - its tiles and options, the host's
# switches (``TMA``, ``TMA_A``, ``GEMV``, ``B_BITS``) and Triton's launch options - and those a config must give;
# the GEMV takes the tensor-core tile's TMA / SWAP_AB keys and leaves them (they do not apply to its loads)
_LAUNCH_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
MMA_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "SWAP_AB", "TMA", "TMA_A", "EXACT_CODES",
                   "GEMV", "B_BITS", *PDL_TILE_KEYS, *_LAUNCH_KEYS)
GEMV_CONFIG_KEYS = ("GEMV", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "K_STAGES", "B_BITS", "SWAP_AB", "TMA",
                    "TMA_A", *PDL_TILE_KEYS, *_LAUNCH_KEYS)
_CHECKED_CONFIGS: set = set()  # (a configuration that passed ``_check_config``: items, their types, k_groups)
_BOOL_KEYS = ("SWAP_AB", "TMA", "TMA_A", "EXACT_CODES", "GEMV", "B_BITS", "PDL_TRIGGER")


def _check_config(cfg: dict, k_groups: bool, fp8_dot: bool) -> None:
    """A tile configuration given to ``fp8_gemm``: its keys those of the kernel it picks (``GEMV``), every key that
    kernel needs there (BLOCK_K is the K group's with ``k_groups``), each of a value it takes (``fp8_dot``: the
    tensor-core kernel's dot is on fp8 operands, whose K tile is at least ``FP8_DOT_MIN_K``). Unchecked, a key the
    kernel does not read (a typo: ``SPLITK``) was dropped by Triton's launch unsaid, ``SPLIT_K=0`` launched no
    program and returned ``torch.empty``'s memory, and a missing key or a tile that is not a power of 2 failed as
    a KeyError or deep in Triton; BLOCK_K=16 with fp8 activations ran in the interpreter and failed to compile for
    sm_90. A configuration that passed is not checked again (the fused MLP's down GEMM
    passes its tile at every call: 8 us of checks on a shared CPU, 1.5 us a lookup after the first)."""
    try:
        seen = (tuple(cfg.items()), tuple(map(type, cfg.values())), k_groups, fp8_dot)  # (64.0 == 64: the types too)
        if seen in _CHECKED_CONFIGS:
            return
    except TypeError:  # (an unhashable value: checked, and refused below or by Triton)
        seen = None
    gemv = cfg.get("GEMV", False)
    kernel, keys = ("the GEMV kernel (GEMV=True)", GEMV_CONFIG_KEYS) if gemv else ("the tensor-core kernel",
                                                                                  MMA_CONFIG_KEYS)
    unknown = [key for key in cfg if key not in keys]
    if unknown:
        raise ValueError(f"fp8_gemm: config keys {unknown} are not {kernel}'s; it takes {list(keys)} "
                         f"(fp8fx.kernels.fp8_gemm.tile_config gives the default tile)")
    need = ("BLOCK_N", "BLOCK_K") if gemv else ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_stages") + (
        () if k_groups else ("BLOCK_K",))
    missing = [key for key in need if key not in cfg]
    if missing:
        raise ValueError(f"fp8_gemm: config {cfg} has no {missing}; {kernel} needs {list(need)} "
                         f"(fp8fx.kernels.fp8_gemm.tile_config gives the default tile)")
    least = 1 if gemv else 16  # (tl.dot's least dims; K of an fp8 dot: FP8_DOT_MIN_K)
    for key, v in cfg.items():
        if key in _BOOL_KEYS:
            if type(v) is not bool and v not in (0, 1):
                raise ValueError(f"fp8_gemm: config {key}={v!r}; it takes True or False")
            continue
        if key.startswith("BLOCK_") or key == "num_warps":
            floor = FP8_DOT_MIN_K if key == "BLOCK_K" and fp8_dot and not gemv else least
            why = tile_value_refusal(key, v, 1 if key in ("num_warps", "BLOCK_M") or (key == "BLOCK_K" and k_groups)
                                     else floor)
        elif key in ("SPLIT_K", "GROUP_M", "num_stages", "K_STAGES", "num_ctas"):
            why = tile_value_refusal(key, v)
        else:  # (PRE_WAIT: _check_pdl_keys; maxnreg: Triton's)
            continue
        if why:
            raise ValueError(f"fp8_gemm: config {why}")
    if seen is not None:
        if len(_CHECKED_CONFIGS) >= 4096:  # (a tuning sweep's thousands of tiles)
            _CHECKED_CONFIGS.clear()
        _CHECKED_CONFIGS.add(seen)


def tile_value_refusal(key: str, v, power_of_2_from: Optional[int] = None) -> str:
    """"" where a tile configuration's ``key`` = ``v`` is an int of at least 1 - a power of 2 of at least
    ``power_of_2_from`` where that is given -, else what is wrong and what the key takes: "BLOCK_N=48; it takes an
    int, a power of 2 of at least 16"; a value of another type says its type (numpy's ``int64(16)``: its type, not
    its value, is refused). ``fp8_gemm``'s and ``fused_moe``'s config checks."""
    low = power_of_2_from or 1
    if type(v) is int and v >= low and not (power_of_2_from and v & (v - 1)):
        return ""
    typed = "" if type(v) is int else f" is a {type(v).__name__}"
    takes = f"an int, a power of 2 of at least {low}" if power_of_2_from else "an int of at least 1"
    return f"{key}={v!r}{typed}; it takes {takes}"


def _check_dtypes(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: torch.Tensor,
                  out_dtype: torch.dtype, a_quant: int) -> None:
    """``fp8_gemm``'s operands are matrices of the dtypes its kernels compute with, and ``out_dtype`` one they write.
    Unchecked, a 16-bit b or a 16-bit a with an a_scale failed deep in Triton's dot ("Unsupported lhs dtype"), and an
    integer or fp8 ``out_dtype`` took the float32 result cast to it (truncated, or rounded to fp8), unsaid."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8_gemm: a is {list(a.shape)} and b {list(b.shape)}; it takes matrices, a [M, K] and b "
                         f"[N, K] (reshape a to [-1, K])")
    if b.dtype != quant.FP8_DTYPE:
        raise ValueError(f"fp8_gemm: b is {b.dtype}; the weight must be {quant.FP8_DTYPE} codes (fp8fx.quant.quantize)")
    if a_quant not in (NO_QUANT, QUANT_ROWS, QUANT_TENSOR, QUANT_STATIC) or (a_quant != NO_QUANT and a_scale is None):
        raise ValueError(f"fp8_gemm: a_quant={a_quant!r} with a_scale={None if a_scale is None else 'a tensor'}; it "
                         f"takes NO_QUANT, QUANT_ROWS or QUANT_TENSOR (a_scale: partial row maxima) or QUANT_STATIC "
                         f"(a_scale: the static scale)")
    if a_scale is None or a_quant != NO_QUANT:  # weight-only, or 16/32-bit activations quantized in the kernel
        takes = (torch.bfloat16, torch.float16) if a_scale is None else quant.HIGH_PRECISION
        if a.dtype not in takes:
            how = "weight-only (a_scale=None)" if a_scale is None else f"a_quant={a_quant}"
            raise ValueError(f"fp8_gemm: a is {a.dtype}; {how} takes {', '.join(map(str, takes))} activations"
                             + ("" if a_scale is None else " (for fp8 codes, pass a_quant=NO_QUANT)"))
    elif a.dtype != quant.FP8_DTYPE:
        raise ValueError(f"fp8_gemm: a is {a.dtype} with an a_scale; it takes {quant.FP8_DTYPE} codes (for 16-bit "
                         f"activations without scales, pass a_scale=None: weight-only)")
    for name, scale in (("a_scale", a_scale), ("b_scale", b_scale)):
        if scale is not None and scale.dtype not in quant.COMPUTE_DTYPES:  # (an int scale of 0.02s held 0s)
            raise ValueError(f"fp8_gemm: {name} is {scale.dtype}; scales are float32 (bf16/fp16/fp64 are read as "
                             f"float32)")
    if out_dtype not in quant.HIGH_PRECISION:
        raise ValueError(f"fp8_gemm: out_dtype={out_dtype}; the result is bf16, fp16 or fp32")


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    b_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    config: Optional[dict] = None,
    a_block: Optional[tuple[int, int]] = None,
    b_block: Optional[tuple[int, int]] = None,
    fast_accum: bool = False,
    a_quant: int = NO_QUANT,
    tickets: Optional[torch.Tensor] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """a: [M, K] fp8 (or bf16/fp16 with ``a_scale=None``: weight-only), b: [N, K] fp8.

    ``a_block`` / ``b_block`` are fp8fx blocks (``fp8fx.config``): None or ``[., -1]`` for per-tensor /
    per-row scales (``[M, 1]`` / ``[N, 1]`` or one element), ``[1, GK]`` activation groups with
    ``a_scale: [M, ceil(K / GK)]``, ``[BN_W, GK]`` weight blocks with ``b_scale: [ceil(N / BN_W), ceil(K / GK)]``.

    ``a_quant`` (``QUANT_ROWS`` / ``QUANT_TENSOR``: ``a_scale`` is ``[M, n]`` partial row maxima of the 16- or
    32-bit ``a``; ``QUANT_STATIC``: one static scale): the kernel quantizes ``a`` per token / per tensor as it loads
    it, so no quantization pass over ``a`` runs before. ``tickets``: split-K's, int32 counters at a multiple of
    ``TICKET_PERIOD`` (zero with a split that is not a power of 2): zeroed by an earlier kernel on this stream, or
    left so by earlier launches. Else a launch captured into a CUDA graph takes kept ones of its own
    (``fp8fx.kernels.tickets``: no memset in the graph) and any other launch zeroes fresh ones. ``pdl``: launch
    as a programmatic dependent of the previous kernel (compute capability 9.0+): this kernel's programs wait for
    that kernel's whole grid and memory before their first access, and start early where it signals
    ``gdc_launch_dependents`` (``fp8fx.kernels.gated_mlp``; a config's ``PDL_TRIGGER``: right after their wait).
    ``pdl=None`` (the default): as ``DECODE_PDL`` says (decode launches on sm_90 without a config), False: never.
    """
    _check_dtypes(a, b, a_scale, b_scale, out_dtype, a_quant)
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"fp8_gemm: a is [{m}, {k}] but b is {list(b.shape)}; b must be [N, {k}]")
    # the kernels read bias[n] for every output column n < N, unchecked: a shorter bias was read past its end (garbage
    # added to the columns past it), a longer one or [N, 1] / [M, N] taken as its first N values
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype not in quant.COMPUTE_DTYPES):
        raise ValueError(f"fp8_gemm: bias is {bias.dtype} {list(bias.shape)}; it must be [{n}] (one per output "
                         f"column of b [{n}, {k}]), bf16, fp16, fp32 or fp64, or None")
    # row-major operands: the kernel's 32-bit in-tile offsets (k * stride_k) stay under BLOCK * K
    a = a if a.stride(1) == 1 or k == 1 else a.contiguous()
    b = b if b.stride(1) == 1 or k == 1 else b.contiguous()
    bias = bias if bias is None else bias.contiguous()  # read as bias_ptr + n
    a_fp8 = a_scale is not None
    if not a_fp8 and a_block is not None:
        raise ValueError(
            f"fp8_gemm: weight-only (a_scale=None) takes 16-bit activations without scales; got a_block={a_block}"
        )
    if a_block is not None and (a_block[0] not in (-1, 1) or (a_block[0] == -1 and a_block[1] != -1)):
        # [-1, G] (one row of K groups shared by every row) is not a layout the kernel reads: it indexes the
        # group scales by row
        raise ValueError(f"fp8_gemm: activation scales per token or per tensor along M, K groups per token "
                         f"([1, G]); got a_block={a_block}")
    if pdl and not _hopper(a):
        raise ValueError(f"fp8_gemm: pdl=True (programmatic dependent launch) needs a CUDA GPU of compute "
                         f"capability 9.0 or newer; a is on {a.device}")
    if a_quant != NO_QUANT and (a_block is not None or a.element_size() == 1 or a_scale.dtype != torch.float32):
        raise ValueError(f"fp8_gemm: a_quant={a_quant} takes 16/32-bit activations and float32 maxima or scale, no "
                         f"a_block; got {a.dtype}, {a_scale.dtype}, a_block={a_block}")
    if a_quant in (QUANT_ROWS, QUANT_TENSOR):  # the partial maxima, read as they are
        if a_scale.dim() != 2 or a_scale.shape[0] != m:
            raise ValueError(f"fp8_gemm: a_quant takes partial row maxima [{m}, n]; got {list(a_scale.shape)}")
        a_mode = PER_ROW
    else:
        # weight-only: no activation scale (the kernel reads none; b_scale stands in for the pointer)
        a_mode, a_scale, _ = _scale_layout(a_scale if a_fp8 else b_scale.reshape(-1)[:1], m, k, a_block, "a_scale")
    b_mode, b_scale, b_rows = _scale_layout(b_scale, n, k, b_block, "b_scale")
    group_k = [blk[1] for blk, mode in ((a_block, a_mode), (b_block, b_mode)) if mode == PER_K_GROUP]
    if len(set(group_k)) > 1:
        raise ValueError(f"fp8_gemm: K groups {group_k} of a and b must agree; got blocks {a_block} and {b_block}")
    cfg = dict(config or for_device(tile_config(m, n, k, a_quant=a_quant != NO_QUANT, transposed=a_fp8,
                                                k_groups=bool(group_k)), a.device))
    if config:
        _check_config(cfg, bool(group_k), a_fp8)
    if a_quant != NO_QUANT and not config:  # (a 16-bit a: the 64-row tiles' TMA copies were timed for fp8 a only)
        cfg.pop("TMA", None), cfg.pop("TMA_A", None)
    gemv = cfg.get("GEMV", False)
    decode_keys = decode_pdl_keys(b, m, gemv=gemv) if pdl is None and not config else None
    pdl = bool(pdl) or decode_keys is not None
    cfg.update(decode_keys or {})
    _check_pdl_keys(cfg, a)
    cfg.pop("GEMV", False)
    # weight-only on a GPU before sm_89 (the fallback's GPUs): Triton has no fp8e4nv type there, so the kernels take
    # the weight's codes as bytes and decode them (``B_BITS``; a config may ask for it, as the CPU tests do)
    b_bits = cfg.pop("B_BITS", not a_fp8 and a.is_cuda and not has_fp8_tensor_cores(a.device))
    if b_bits and a_fp8:
        raise ValueError("fp8_gemm: B_BITS (the weight as bytes) is the weight-only variant's; got fp8 activations")
    b = b.view(torch.uint8) if b_bits else b
    # the GEMV scales a thread's 16 bytes of a row by one K group's scale: groups of a multiple of 16 (the ops send
    # groups of 32-256, ops._k_groups_agree)
    if gemv and (m != 1 or (group_k and group_k[0] % 16)):
        raise ValueError(f"fp8_gemm: the GEMV kernel (config GEMV=True) takes one row and K groups of a multiple of "
                         f"16; got M={m}, K groups {group_k}")
    if group_k and not gemv:  # the tensor-core kernel scales each K step's partial product: a step is a group
        if a_fp8 and group_k[0] < FP8_DOT_MIN_K:
            raise ValueError(f"fp8_gemm: K groups of {group_k[0]} with fp8 activations on the tensor-core kernel, "
                             f"whose K step is a group: an fp8 dot takes K steps of {FP8_DOT_MIN_K} or more on sm_90; "
                             f"quantize in groups of {FP8_DOT_MIN_K}-256 (one row takes the GEMV kernel: "
                             f"config GEMV=True)")
        cfg["BLOCK_K"] = group_k[0]
    if not gemv:  # (the GEMV pipelines its loads by its own K_STAGES, not by the launch's num_stages)
        # (a 16-bit a - weight-only, a_quant - doubles its tile)
        cfg["num_stages"] = pipeline_stages(cfg, a.element_size(), stage_budget(a.device))
    cfg.setdefault("SPLIT_K", 1)
    split_k = cfg["SPLIT_K"]
    tiles = cdiv(m, cfg.get("BLOCK_M", 1)) * cdiv(n, cfg["BLOCK_N"])  # (the GEMV: one row)
    # split-K: float32 partials [SPLIT_K, M, N], summed in the kernel by each tile's last split
    y = torch.empty(split_k, m, n, device=a.device, dtype=out_dtype if split_k == 1 else torch.float32)
    out = y[0] if split_k == 1 else torch.empty(m, n, device=a.device, dtype=out_dtype)
    if split_k == 1:
        tickets = y  # not read
    elif tickets is None:
        kept = split_k & (split_k - 1) == 0  # (counting in periods takes a split of a power of 2)
        tickets = _tickets.zeroed(a.device, tiles) if kept else torch.zeros(tiles, device=a.device, dtype=torch.int32)
    elif (tickets.numel() < tiles or tickets.dtype != torch.int32 or tickets.device != a.device
          or not tickets.is_contiguous()):
        # (read as tickets_ptr + tile: a strided view's counters were other tiles', one on another device unreadable)
        raise ValueError(f"fp8_gemm: split-K needs {tiles} contiguous int32 tickets on {a.device}; got "
                         f"{tickets.numel()} {tickets.dtype} on {tickets.device}"
                         + ("" if tickets.is_contiguous() else f", strides {tickets.stride()}"))
    n_parts = a_scale.shape[1] if a_quant in (QUANT_ROWS, QUANT_TENSOR) else 1
    pdl_launch = {"launch_pdl": True} if pdl else {}
    if gemv:  # (its own loads and dot: the tensor-core kernel's TMA and SWAP_AB do not apply)
        cfg.pop("TMA", None), cfg.pop("TMA_A", None), cfg.pop("SWAP_AB", None), cfg.pop("BLOCK_M", None)
        fp8_gemv_kernel[(tiles * split_k,)](
            a, b, y, a_scale, b_scale, bias if bias is not None else a_scale, out, tickets,
            n, k, a.stride(1), b.stride(0), y.stride(2), y.stride(0), a_scale.stride(1), b_scale.stride(0),
            b_scale.stride(1), A_FP8=a_fp8, A_GROUPED=a_mode == PER_K_GROUP, B_ROWWISE=b_mode == PER_ROW,
            B_GROUPED=b_mode == PER_K_GROUP, B_BLOCK_N=b_rows, GROUP_K=group_k[0] if group_k else 1,
            HAS_BIAS=bias is not None,
            EVEN_K=k % cfg["BLOCK_K"] == 0, A_QUANT=a_quant, N_PARTS=n_parts, PARTS_BLOCK=parts_block(n_parts, 1),
            EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, PDL_WAIT=pdl, B_BITS=b_bits, **cfg, **pdl_launch,
        )
        return out
    b_desc = _descriptor(b, cfg["BLOCK_N"], cfg["BLOCK_K"]) if cfg.pop("TMA", False) else None
    # (a 16-bit a - weight-only, a_quant - is converted in registers as it is loaded: pointer loads)
    a_tma = cfg.pop("TMA_A", False) and a.element_size() == 1
    a_desc = _descriptor(a, cfg["BLOCK_M"], cfg["BLOCK_K"]) if a_tma else None
    fp8_gemm_kernel[(tiles * split_k,)](
        a, b, y, a_scale, b_scale, bias if bias is not None else a_scale, out, tickets, b_desc, a_desc,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(1), y.stride(2), y.stride(0),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        A_ROWWISE=a_mode == PER_ROW, A_GROUPED=a_mode == PER_K_GROUP,
        B_ROWWISE=b_mode == PER_ROW, B_GROUPED=b_mode == PER_K_GROUP,
        B_BLOCK_N=b_rows, HAS_BIAS=bias is not None, A_FP8=a_fp8, IMPRECISE_K=imprecise_k(cfg, fast_accum),
        A_QUANT=a_quant, N_PARTS=n_parts, PARTS_BLOCK=parts_block(n_parts, cfg["BLOCK_M"]),
        EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, PDL_WAIT=pdl, B_DESC=b_desc is not None,
        A_DESC=a_desc is not None, B_BITS=b_bits, **cfg, **pdl_launch,
    )
    return out
