"""A gated MLP's three FP8 GEMMs in two kernels (three with per-token h at 17-64 tokens), for decode-sized M, and its
prefill kernels (Triton).

    y = down(act(gate(x)) * up(x))    x: fp8 [M, K] with its scale; gate, up: [I, K]; down: [N, I]

What it replaces: the gate/up GEMM(s), a kernel for act * mul with the per-token (or per-tensor)
quantization of its result, and the down GEMM - 4-5 launches per decode step, where the step's GPU
time is ~50 us of weight streaming and each launch boundary costs ~1-2 us on the H200 (the fused MLP's
CUDA-graph replay 0.0559 ms against 0.0522 ms of kernels at M=1 with the L2 left clean before it; the
~0.012 ms gap runs 9-11 reported was mostly the write-back of the dirty lines `do_bench`'s flush leaves,
benchmarks/RESULTS.md run 12).

1. ``gated_gemm_kernel``: each program streams one N tile of both gate and up (two accumulators over
   the same x tile) and finishes the activation in its epilogue: ``h = act(g) * u``, rounded as the model
   rounds it (g, u, act(g) and h in the model's dtype), stored 16-bit, with each row's amax over the
   tile (``parts [M, ceil(I / BLOCK_N)]``). It also zeroes the down GEMM's split-K tickets.
2. ``fp8_gemm_kernel`` with ``A_QUANT``: the down GEMM takes the 16-bit h, reduces each row's partial
   maxima to its scale (or all rows', per tensor) and quantizes each h tile as it loads it.

The quantization is ``fp8fx.quant``'s: scale max(amax, 1e-12) / 448 (IEEE division), codes the correctly
rounded quotient (from the scale's reciprocal, ``fp8_gemm._codes_of``) saturated and cast; the result differs
from the unfused graph's where Inductor kept h in float32.
Run for M <= ``fp8fx.ops.TRITON_MAX_M`` with per-tensor / per-channel weights and per-token / per-tensor
activations; the pass (``fp8fx.passes.mlp``) emits it up to ``GATED_MAX_M`` = 16 tokens, where it was measured
faster than the unfused GEMMs (at 64, each of the down GEMM's N tiles reads the whole [64, I] intermediate).
With per-token h, 17-64 tokens (``ops.GATED_ROWS_MIN_M``, ``ops.GATED_ROWS_MAX_M``) run three kernels: the first
writes h 16-bit with its tile maxima, ``quantize_rows_kernel`` (the prefill one) makes its codes once, and
``fp8_gemm`` reads fp8 h (Llama-3-8B's MLP block on the H200, run 29: 0.0627 ms at 64 tokens against 0.0688
unfused, 1.73x bf16; 0.0600 at 32 against 0.0774-0.0806; other token counts of the range not timed).

With h in 1 x G groups (``QUANT_GROUPS``, ``h_group``; ``Fp8Backend(mlp_h_group=G)``) a group is one N tile of
the first kernel, so its epilogue has the group's amax in registers and writes h's fp8 codes and group scales
(``fp8fx.quant.quantize(h, [1, G])``'s bits); the down GEMM reads them as K-grouped activations. No N tile of
it re-quantizes h, which is what kept per-token h from 64 tokens (``GATED_GROUPS_MAX_M``).

Prefill (``gated_prefill``, from ``fp8fx.ops.GATED_PREFILL_MIN_M`` tokens): ``gated_prefill_kernel`` is the gate/up
kernel made persistent, its operands by TMA copies and gate and up as one 256-wide wgmma per K step; g, u and
act(g) stay float32 in its epilogue (the decode kernel rounds them as the model does), h leaves it 16-bit with its
row maxima per tile, ``quantize_rows_kernel`` streams h to per-token fp8 codes, and cuBLAS runs the
down GEMM (Inductor's Triton templates reached 0.74-0.93x of it at prefill, ANCHORS.md). What this removes from the
unfused MLP: cuBLAS writing g and u ([M, 2 I] 16-bit: 235 MB at Llama-3-8B's M = 4096) and Inductor's act * mul +
quantization reading them back in a one-pass row reduction at half the HBM speed (0.125 ms there, against 0.050
for ``quantize_rows``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from fp8fx import ops, quant
from fp8fx.kernels.fp8_gemm import QUANT_ROWS, QUANT_STATIC, QUANT_TENSOR, _codes_of, _max_nan, _rows_amax, _scale_of
from fp8fx.kernels.fp8_gemm import _hopper, decode_pdl_keys, fp8_gemm, imprecise_k
from fp8fx.kernels.fp8_gemm import for_device, gemv_config, gemv_fits, mma_tile_config, pipeline_stages, stage_budget
from fp8fx.kernels.fp8_gemm import tile_config
from fp8fx.kernels.launch import Relaunch, cdiv, next_power_of_2, sm_count, unchecked_descriptor

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}  # the kernel's ACT for fp8fx.ops.GATED_ACTIVATIONS
# h quantized in 1 x h_group groups by the gate/up kernel's epilogue (an N tile of it per group), read by the down
# GEMM as fp8 codes with K-grouped scales; the other QUANT_* are fp8_gemm's A_QUANT modes
QUANT_GROUPS = 4
H_GROUPS = ops.GATED_H_GROUPS
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _inv_one_plus_exp2(y):
    """1 / (1 + 2^y) in two approximate PTX instructions and an add: ex2.approx.ftz and rcp.approx.ftz, the
    special-function unit's approximations that Triton's own ``tl.exp`` (ex2.approx) and fp32 division
    (``div.full``: rcp.approx and a multiply) use, without the range fix-ups those add around each (a compare and
    two predicated multiplies each, sm_90 SASS). The result differs only where a subnormal is flushed to zero:
    2^y below 2^-126 (1 + it is 1 either way), and 1 / (1 + 2^y) below 2^-126, i.e. silu(g) for g in about
    [-88.7, -87.3], some 1e-36, becomes 0 (beyond that range it was 0 already)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 e; ex2.approx.ftz.f32 e, $1; add.ftz.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 $0, e; }",
        "=f,f", [y], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _bf16_grid(x):
    """x rounded to bfloat16 (to nearest, ties to even) and kept float32, in three FMA-pipe instructions: Veltkamp's
    split with sigma = 2^16 + 1 (0f47800080) keeps the 24 - 16 = 8 significant bits bfloat16 has. The ``.rn``
    suffixes keep ptxas from fusing the multiply and the subtraction into an FMA, which would break the split.
    ``x.to(tl.bfloat16).to(tl.float32)`` compiles to F2F conversions on sm_90 (and F2FP for pairs), which run on the
    16-results-a-clock pipe the epilogue's ex2 and rcp use too. Checked over every float32 on the CPU: the
    conversion's bits for every |x| in [2^-126, 5.19e33] (on the H200, the prefill kernel's h bit for bit as with the
    conversions); -0 gives +0; below 2^-126 (float32 subnormals) it keeps 8 significant bits where bfloat16's own
    subnormals have fewer; from 5.19e33 up the product overflows and the result is NaN (the epilogue's g and u get
    there only with activation and weight scales some 1e28 apart)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 p, d; mul.rn.f32 p, $1, 0f47800080; sub.rn.f32 d, $1, p; add.rn.f32 $0, p, d; }",
        "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rounded(x, H_DTYPE: tl.constexpr, PTX_MATH: tl.constexpr):
    """x rounded to H_DTYPE and back to float32 (by ``_bf16_grid`` for bfloat16 where PTX runs)."""
    if PTX_MATH and H_DTYPE == tl.bfloat16:
        return _bf16_grid(x)
    return x.to(H_DTYPE).to(tl.float32)


@triton.jit
def _tanh_approx(x):
    """tanh(x) by the special-function unit's ``tanh.approx.f32`` (sm_75+): one instruction, relative error at most
    2^-10.99 (PTX ISA)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gated_h(acc_g, acc_u, offs_m, offs_n, M, N, a_scale_ptr, s1_ptr, s3_ptr, A_ROWWISE: tl.constexpr,
             W_ROWWISE: tl.constexpr, ACT: tl.constexpr, H_DTYPE: tl.constexpr, PTX_MATH: tl.constexpr = False,
             MODEL_ROUNDING: tl.constexpr = True, TANH_SILU: tl.constexpr = False):
    """The gate/up kernels' epilogue: the scales of the rows ``offs_m`` and columns ``offs_n``, then act(g) * u
    rounded as the model's 16-bit ops round it (g, u, act(g) and h in H_DTYPE; with ``MODEL_ROUNDING`` off g, u
    and act(g) stay float32). ``PTX_MATH`` (compiled for CUDA
    only; Triton's interpreter runs no PTX): silu's and gelu-tanh's 1 / (1 + e^x) by ``_inv_one_plus_exp2``: silu
    in 5 instructions an element where ``tl.exp`` and the division take 11, gelu-tanh about 4 fewer (sm_90 SASS);
    with ``TANH_SILU`` (and float32 g, u) silu by one ``tanh.approx``. It matters in the prefill kernel, whose
    epilogue is not overlapped with its tensor-core work."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    if A_ROWWISE:
        a_s = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    else:
        a_s = tl.load(a_scale_ptr)
    if W_ROWWISE:
        s1 = tl.load(s1_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        s3 = tl.load(s3_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        s1 = tl.load(s1_ptr)
        s3 = tl.load(s3_ptr)
    g = acc_g * a_s * s1
    u = acc_u * a_s * s3
    if MODEL_ROUNDING:  # (off: g, u and act(g) stay float32, only h is rounded: the prefill kernel's default)
        g = _rounded(g, H_DTYPE, PTX_MATH)
        u = _rounded(u, H_DTYPE, PTX_MATH)
    if ACT == 0 and TANH_SILU and PTX_MATH and not MODEL_ROUNDING:
        # silu(g) u = (g u / 2)(1 + tanh(g / 2)): one special-function instruction an element where ex2 and rcp are
        # two. The prefill kernel's default: 0.3531 ms against 0.3653 at M = 2048, 0.7302 against 0.7462 at 4096
        # (H200 run 27, 9 rounds). Its error: tanh's relative 2^-11 makes silu's at most 2^-12 relative for g > 0 and
        # |g| 2^-12 absolute for g < 0 - there, below g = -7.6 (silu's size under that bound), silu(g) keeps no
        # correct bits and may come out 0; an error of at most 2^-12 of |g u|, where the row's largest h is usually
        # far larger. h's error against float64 did not change in 4 digits (2.441e-3: the fp8 GEMM's fast
        # accumulation and h's bf16 rounding are the larger)
        half = 0.5 * g  # (no instruction of its own: ptxas makes it the multiply's .D2 modifier)
        half_gu = half * u
        return (half_gu + half_gu * _tanh_approx(half)).to(H_DTYPE)
    if ACT == 0:  # silu
        if PTX_MATH:
            g = g * _inv_one_plus_exp2(g * -1.4426950408889634)  # e^-g = 2^(-g log2(e))
        else:
            g = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu: 0.5 g (1 + erf(g / sqrt(2)))
        g = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # gelu, tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        if PTX_MATH:
            g = 0.5 * g * (2.0 - 2.0 * _inv_one_plus_exp2(z * 2.8853900817779268))  # e^2z = 2^(2z log2(e))
        else:
            g = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    if MODEL_ROUNDING:
        g = _rounded(g, H_DTYPE, PTX_MATH)
    return (g * u).to(H_DTYPE)


@triton.jit
def gated_gemm_kernel(
    # tensors: x fp8 [M, K]; gate, up fp8 [N, K] (same strides); h [M, N] 16-bit; parts float32
    # [M, cdiv(N, BLOCK_N)]; tickets: the next kernel's, zeroed here
    a_ptr, w1_ptr, w3_ptr, a_scale_ptr, s1_ptr, s3_ptr, h_ptr, parts_ptr, tickets_ptr,
    M, N, K, n_tickets,
    stride_am, stride_ak, stride_wn, stride_wk, stride_hm, stride_pm,
    A_ROWWISE: tl.constexpr, W_ROWWISE: tl.constexpr, ACT: tl.constexpr, IMPRECISE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False,  # the down GEMM is a programmatic dependent (PDL): let it launch
    # H_GROUPS: h leaves as fp8 codes (h_ptr) with one scale per row and N tile (parts_ptr: 1 x BLOCK_N groups),
    # rounded first as the model rounds it (H_DTYPE); else h_ptr is h in H_DTYPE and parts_ptr its tile maxima
    H_GROUPS: tl.constexpr = False, H_DTYPE: tl.constexpr = None, EPS: tl.constexpr = 1e-12,
    FP8_MAX: tl.constexpr = 448.0,
):
    pid = tl.program_id(0)
    # the down GEMM runs next on this stream: its tickets start at zero without a launch of their own
    for t in range(pid, n_tickets, tl.num_programs(0)):
        tl.store(tickets_ptr + t, 0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n  # N fastest: neighbouring programs share the x tile
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # 64-bit tile bases, 32-bit offsets inside the tiles (as fp8_gemm_kernel)
    a_tile = a_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_am
    w_base = (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    a_offs = tl.arange(0, BLOCK_M)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    w_offs = tl.arange(0, BLOCK_N)[None, :] * stride_wn + offs_k[:, None] * stride_wk  # w.T tile: [BK, BN]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_tile + a_offs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & n_ok[None, :]
        g = tl.load(w1_ptr + w_base + w_offs, mask=w_mask, other=0.0)
        u = tl.load(w3_ptr + w_base + w_offs, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, g, acc_g, max_num_imprecise_acc=IMPRECISE_K)
        acc_u = tl.dot(a, u, acc_u, max_num_imprecise_acc=IMPRECISE_K)
        a_offs += BLOCK_K * stride_ak
        w_offs += BLOCK_K * stride_wk
    if PDL_TRIGGER:  # the weights are read: the down GEMM's programs may start (they wait for this grid's memory)
        tl.extra.cuda.gdc_launch_dependents()

    if H_DTYPE is None:
        h_dtype: tl.constexpr = h_ptr.dtype.element_ty
    else:
        h_dtype: tl.constexpr = H_DTYPE
    h = _gated_h(acc_g, acc_u, offs_m, offs_n, M, N, a_scale_ptr, s1_ptr, s3_ptr, A_ROWWISE, W_ROWWISE, ACT, h_dtype)
    in_bounds = m_ok[:, None] & n_ok[None, :]
    h_ptrs = h_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_hm + tl.arange(0, BLOCK_M)[:, None] * stride_hm
    amax = tl.reduce(tl.where(in_bounds, tl.abs(h.to(tl.float32)), 0.0), 1, _max_nan)  # [BM] over this tile
    if H_GROUPS:  # fp8fx.quant.quantize(h, [1, BLOCK_N])'s codes and scales, from the tile in registers
        scale = _scale_of(amax, EPS, FP8_MAX)
        inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale)
        codes = _codes_of(h.to(tl.float32), scale[:, None], inv[:, None], FP8_MAX)
        tl.store(h_ptrs + offs_n[None, :], codes.to(h_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(parts_ptr + offs_m.to(tl.int64) * stride_pm + pid_n, scale, mask=m_ok)
    else:
        tl.store(h_ptrs + offs_n[None, :], h, mask=in_bounds)
        tl.store(parts_ptr + offs_m.to(tl.int64) * stride_pm + pid_n, amax, mask=m_ok)


@triton.jit
def gated_prefill_kernel(
    # x fp8 [M, K] as a tensor descriptor of [BLOCK_M, BLOCK_K] tiles; w the gate and up weights [N, K] as one
    # [2, N, K] descriptor of [2, BLOCK_N, BLOCK_K] tiles (up first with UP_FIRST); h [M, N] 16-bit, a descriptor
    # of [BLOCK_M, BLOCK_N] tiles; parts float32 [M, cdiv(N, BLOCK_N)]
    x_desc, w_desc, h_desc, a_scale_ptr, s1_ptr, s3_ptr, parts_ptr,
    M, N, K, stride_pm, xt_desc, ht_desc,
    A_ROWWISE: tl.constexpr, W_ROWWISE: tl.constexpr, ACT: tl.constexpr, IMPRECISE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, UP_FIRST: tl.constexpr = False, PTX_MATH: tl.constexpr = False,
    MODEL_ROUNDING: tl.constexpr = False, TANH_SILU: tl.constexpr = False, TAIL_SPLIT: tl.constexpr = 1,
):
    """``gated_gemm_kernel`` for prefill, with g, u and act(g) in float32 (``MODEL_ROUNDING``: rounded to h's dtype as
    the model's 16-bit ops round them, as the decode kernel does). Persistent: ``PROGRAMS`` programs walk the output
    tiles, GROUP_M row tiles at a time (the weight tiles they share stay in L2), and the K loop of the next tile is in
    flight during a tile's epilogue (``flatten``). Every operand tile comes by TMA copies, the gate and up tiles of
    the same BLOCK_N outputs as one [2 BLOCK_N, BLOCK_K] tile, so a K step is one 2 BLOCK_N-wide dot (wgmma m64n256k32
    at BLOCK_N = 128) instead of two BLOCK_N-wide ones, which re-read the x tile from shared memory: on the H200 at
    4096 x 28672 x 4096, two 128-wide dots ran at 0.77x cuBLAS's gate/up GEMM, one 256-wide at 0.96x (run 23). The
    epilogue's activation in PTX (``PTX_MATH``, set on CUDA by ``gated_prefill``; ex2 and rcp until run 27, silu by
    tanh.approx since, ``TANH_SILU``): 0.964x -> 0.977x cuBLAS at M = 2048, 0.967x -> 0.972x at 4096 (run 24, 7
    interleaved rounds). Its bf16 roundings of g, u and act(g) on the FMA pipe (``_bf16_grid``; with
    ``MODEL_ROUNDING`` since run 27), the same bits as conversions: 0.974-0.984x -> 0.979-0.996x at 2048, 0.978-0.985x
    -> 0.990-1.020x at 4096 (run 25, two calls). The last round of tiles split along K over the idle SMs, in a second
    launch, lost (0.968-0.994x at 4096, run 25): flattened with the others, the split made the epilogue conditional
    and Triton no longer overlapped the next tile's loads with it. Since run 28 that round runs in half tiles after
    the flattened loop, in the same launch (``TAIL_SPLIT``, ``prefill_tail_split``): the kernel 1.018x at 4096
    tokens, 1.016x at 3072, the same h bits (H200, calls back to back, 9 rounds); unsplit, its SASS is the kernel's
    before (sm_90, triton 3.9).

    Why float32 until h (run 27): the three roundings are 9 FMA-pipe instructions an element of an epilogue the tensor
    cores wait on. Without them the kernel took 0.3610 ms against 0.3735 at M = 2048 and 0.7377 against 0.7938 at 4096
    (H200, 9 interleaved rounds, calls back to back), and h came closer to float64's act(g) * u of the same codes
    (relative error 2.44e-3 against 3.79e-3). Inductor does not round inside its fused act * mul either: fp8fx's
    unfused graph rounds g and u only as cuBLAS's bf16 outputs.

    Against cuBLAS's gate/up GEMM followed by act * mul and the per-token quantization of h, the [M, 2 N] 16-bit
    g and u never reach memory: h [M, N] does, with each row's maxima per tile, and the quantization of h is a
    streaming pass (``quantize_rows_kernel``) with no row reduction left in it."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    tiles = num_pid_m * num_pid_n
    tail = tiles % PROGRAMS if TAIL_SPLIT > 1 else 0  # (gated_prefill: TAIL_SPLIT * tail <= PROGRAMS)
    for tile in tl.range(tl.program_id(0), tiles - tail, PROGRAMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        _prefill_tile(x_desc, w_desc, h_desc, pid_m, 0, pid_n, k_steps, M, N, a_scale_ptr, s1_ptr, s3_ptr, parts_ptr,
                      stride_pm, A_ROWWISE, W_ROWWISE, ACT, IMPRECISE_K, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, UP_FIRST,
                      PTX_MATH, MODEL_ROUNDING, TANH_SILU)
    if TAIL_SPLIT > 1:  # the last, partial round: each tile's rows in TAIL_SPLIT parts, one program each
        for part in range(tl.program_id(0), tail * TAIL_SPLIT, PROGRAMS):
            pid_m, pid_n = _grouped_tile(tiles - tail + part // TAIL_SPLIT, num_pid_m, num_pid_n, GROUP_M)
            _prefill_tile(xt_desc, w_desc, ht_desc, pid_m, part % TAIL_SPLIT, pid_n, k_steps, M, N, a_scale_ptr,
                          s1_ptr, s3_ptr, parts_ptr, stride_pm, A_ROWWISE, W_ROWWISE, ACT, IMPRECISE_K, BLOCK_M,
                          BLOCK_M // TAIL_SPLIT, BLOCK_N, BLOCK_K, UP_FIRST, PTX_MATH, MODEL_ROUNDING, TANH_SILU)


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the persistent walk's ``tile``: GROUP_M row tiles at a time, down each column tile
    of them, so the weight tiles they share stay in L2."""
    tiles_in_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_in_group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_in_group) % rows_in_group, (tile % tiles_in_group) // rows_in_group


@triton.jit
def _prefill_tile(x_desc, w_desc, h_desc, pid_m, part, pid_n, k_steps, M, N, a_scale_ptr, s1_ptr, s3_ptr, parts_ptr,
                  stride_pm, A_ROWWISE: tl.constexpr, W_ROWWISE: tl.constexpr, ACT: tl.constexpr,
                  IMPRECISE_K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, UP_FIRST: tl.constexpr, PTX_MATH: tl.constexpr, MODEL_ROUNDING: tl.constexpr,
                  TANH_SILU: tl.constexpr):
    """``gated_prefill_kernel``'s output tile: the ROWS rows ``part`` of the row tile ``pid_m`` (all BLOCK_M rows of
    it in the main loop) by the column tile ``pid_n``: the K loop, the epilogue, h by a TMA copy and its rows' maxima.
    (The first row is computed where each use is: one value of it kept across the K loop made the main loop carry it
    through the flattened loop instead of pid_m, and promoted sums spilled 104 bytes a thread where they spill 72:
    sm_90, triton 3.9.)"""
    acc = tl.zeros((ROWS, 2 * BLOCK_N), dtype=tl.float32)
    for k in range(k_steps):  # past K, M and N the copies read zeros
        a = x_desc.load([pid_m * BLOCK_M + part * ROWS, k * BLOCK_K])
        w = tl.reshape(w_desc.load([0, pid_n * BLOCK_N, k * BLOCK_K]), (2 * BLOCK_N, BLOCK_K))
        acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=IMPRECISE_K)
    first, second = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, BLOCK_N)), (0, 2, 1)))
    if UP_FIRST:
        acc_g, acc_u = second, first
    else:
        acc_g, acc_u = first, second
    offs_m = pid_m * BLOCK_M + part * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # (the epilogue's scales loaded before the K loop spilled 528 bytes a thread; prefetched into L1 there, the
    # kernel measured 1% slower: H200 run 24)
    h = _gated_h(acc_g, acc_u, offs_m, offs_n, M, N, a_scale_ptr, s1_ptr, s3_ptr, A_ROWWISE, W_ROWWISE, ACT,
                 h_desc.dtype, PTX_MATH, MODEL_ROUNDING, TANH_SILU)
    h_desc.store([pid_m * BLOCK_M + part * ROWS, pid_n * BLOCK_N], h)  # clipped at M and N
    # columns past N are act(0) * 0 = 0: no mask needed for the maxima
    amax = tl.reduce(tl.abs(h.to(tl.float32)), 1, _max_nan)
    tl.store(parts_ptr + offs_m.to(tl.int64) * stride_pm + pid_n, amax, mask=offs_m < M)


@triton.jit
def quantize_rows_kernel(
    # h [M, N] 16-bit, its row maxima per tile parts [M, N_PARTS]; out: codes fp8 [M, N], scales float32 [M]
    h_ptr, parts_ptr, q_ptr, scale_ptr, M, N, stride_hm, stride_pm, stride_qm,
    N_PARTS: tl.constexpr, PARTS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EPS: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """``fp8fx.quant.quantize(h, [1, -1])``'s codes and scales from h and its partial row maxima: each program
    reduces its rows' maxima (from L2: N_PARTS floats a row), then streams its [BLOCK_M, BLOCK_N] tile of h."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    scale = _scale_of(_rows_amax(parts_ptr, offs_m, M, stride_pm, 1, N_PARTS, PARTS_BLOCK), EPS, FP8_MAX)
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale)
    mask = m_ok[:, None] & (offs_n[None, :] < N)
    rows = offs_m[:, None].to(tl.int64)
    h = tl.load(h_ptr + rows * stride_hm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    codes = _codes_of(h, scale[:, None], inv[:, None], FP8_MAX)
    tl.store(q_ptr + rows * stride_qm + offs_n[None, :], codes.to(q_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + offs_m, scale, mask=m_ok)


def gated_tile_config(m: int, n: int, k: int, h_group: int = 0) -> dict:
    """Tiles of the gate/up kernel: BLOCK_N rows of gate and of up per program, i.e. the bytes per program
    of ``fp8_gemm``'s decode tile (64 rows) on a fused gate/up weight. The best of the H200 sweep at M=1
    (run 10: 32- and 64-wide, 4 and 6 stages within 5%); at M=64 64-wide tiles were 8% faster but spill 344
    bytes per thread (sm_90). With h in groups of 128 (``h_group``: BLOCK_N is the group) above 16 rows, 8 warps:
    at M=64 the op 0.0625 ms against 0.0659 with 4 (H200 run 19, `tune_gemm.py --groups --ms 64`: each candidate
    timed once in the sweep; with the down tile below, 0.0603 in 5 interleaved rounds). Groups of 32 and 64 keep 4
    (not swept above 16 rows)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=8 if h_group >= 128 else 4, num_stages=4)


def down_tile_config(m: int, n: int, k: int, gemv: bool = True, h_group: int = 0) -> dict:
    """The down GEMM's kernel and tiles. Where ``gemv_fits`` (one row; with ``gemv``) the GEMV kernel, quantizing h
    as it loads each K step of it (``gemv_config``; the fused MLP at M=1 0.0507 ms against 0.0568 with the
    tensor-core tile below, 5 interleaved rounds, H200 run 19). Up to 16 rows with K split (Llama-3-8B's 14336):
    the product transposed (``SWAP_AB``: 64 weight rows are wgmma's left operand, fp8 from shared memory, where a
    16-row activation tile on the left runs mma.sync on the weight tile converted in registers), K split in 4, the
    weight by TMA copies - the best of the H200 sweep (run 20 call 1, `tune_gemm.py --gated --swap --tma`, the op
    as a CUDA-graph replay; 5 interleaved rounds at M=16): 0.0554 ms against 0.0578 for run 11's 128-wide mma.sync
    tiles split in 8 (which had beaten `mma_tile_config`'s 64-wide split in 4 by 3%, run 11). Otherwise
    ``mma_tile_config``'s, with BLOCK_K at most 128 above 16 rows (a 16-bit h tile is converted to fp8 in registers;
    M=64's [64, 256] one spilled 680 bytes per thread, sm_90) and K split in 4 (M=64: 0.0991 ms for the whole MLP
    against 0.1363 split in 2 with 32-wide N tiles)."""
    if gemv and gemv_fits(m, n, k):
        return gemv_config(n, k, a_quant=not h_group)
    if h_group:  # fp8 codes in K groups (fp8_gemm's K step is a group): the best of the H200 sweeps at G = 128
        # (the op as a CUDA-graph replay): M=16 transposed as above, 64-wide, K split in 4, TMA, 0.0548 ms against
        # 0.0565 for run 17's mma.sync tile split in 8 (run 20, `tune_gemm.py --gated --swap --tma`, 5 rounds);
        # M=64 64-wide, split in 4, the weight by TMA copies, 0.0630 against 0.0659 for run 17's 128-wide tiles
        # split in 8 (run 19, `--groups --tma`; with the gate/up kernel's 8 warps the op took 0.0603), 5 stages deep:
        # 0.0585 against 0.0608 with 4 (H200 run 21, `tune_gemm.py --m64 --duel`, 7 interleaved rounds; 6 stages
        # 0.0591, 128-wide tiles 0.0586-0.0588). h's tiles by TMA too (TMA_A) measured 1% faster in run 21 (the op
        # 0.0572 against 0.0576), inside the rounds' spread and not run through the GPU tests: not taken. Groups of
        # 32 and 64 take the same tiles, correct (tests) but not timed with them
        if m <= 16:  # (K < 8192, unsplit: transposed too, not timed)
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=h_group, GROUP_M=1, num_warps=4, num_stages=4,
                        SPLIT_K=4 if k >= 8192 else 1, SWAP_AB=True, TMA=True)
        # 17-64 rows: the 64-row tile below. ``mma_tile_config``'s 17-32-row tile (transposed, 32 rows, 6 stages, K
        # split in 4), taken in run 33 from the GEMM alone as a chain of launches (0.0204 / 0.0209 ms at 24 / 32 rows
        # against 0.0210 / 0.0212), lost inside the op, behind the gate/up kernel as its programmatic dependent:
        # 0.0572 / 0.0582 ms for the op against 0.0566 / 0.0571 (H200 run 34 call 3, CUDA-graph replays, 7
        # interleaved rounds; without PDL 0.0567 / 0.0576 against 0.0573 / 0.0583), the decode block at 32 tokens
        # 0.0620 against run 31's 0.0592 (call 2)
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=h_group, GROUP_M=1, num_warps=4, num_stages=5,
                    SPLIT_K=4 if k >= 8192 else 1, TMA=True)
    # 16-bit h: the tiles of 16-bit activations (transposed=False), not those timed with fp8 ones (run 21's TMA
    # copies of both operands at 64 rows, run 22's split tiles of weights with few N tiles at 17-64 rows)
    cfg = mma_tile_config(m, n, k, transposed=False)
    if m <= 16 and cfg.get("SPLIT_K", 1) > 1:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=4,
                    SWAP_AB=True, TMA=True)
    if cfg["BLOCK_K"] > 128:
        cfg = {**cfg, "BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 4, "SPLIT_K": 4}
    return cfg


# the prefill kernels run in plain calls, where Triton's per-call binding was a measured part of the op's host time
# (fp8fx.kernels.launch)
_GATED_PREFILL, _QUANTIZE_ROWS = Relaunch(gated_prefill_kernel), Relaunch(quantize_rows_kernel)


def prefill_tile_config(m: int, n: int, k: int) -> dict:
    """Tiles of ``gated_prefill_kernel``: 128 rows by 128 of gate and 128 of up (one [128, 256] product a K step),
    K steps of 128, 8 warps (two warpgroups of 64 rows), 32 row tiles per sweep of the weight, 3 stages. The best of
    the H200 sweep (run 23 call 3, Llama-3-8B's gate/up, `prefill_study.py --sweep`, each tile timed once) at
    M = 2048 and 4096: 0.975x and 0.956x cuBLAS's gate/up GEMM (which writes g and u and does no act * mul),
    against 0.945-0.963x with 4 stages, 0.916-0.962x with 8 or 32 row tiles a sweep, 0.77-0.79x with K steps of
    256 (2 stages) and 0.79-0.83x with 64-wide N tiles (4 warps); at M = 1024 every 128 x 128 x 128 tile within 1%
    (0.965-0.977x). Since run 29, 32 row tiles a sweep, not 16: at 4096 tokens (32 row tiles) one sweep reads the
    weights from memory once instead of twice, and the kernel took 0.7437 ms against 0.7586 a call back to back
    under the H200's 700 W power cap (1.020x, 3 rounds within 0.743-0.746 and 0.750-0.761; energy 513 against
    524 mJ a call) and 0.6214 against 0.6280 ms called alone (1.010x; `power_study.py --tiles`, run 29 call 5;
    8 row tiles a sweep: 0.981x). Up to 2048 tokens (16 row tiles) the walk is the same either way.
    ``PROGRAMS`` is a constant of the kernel: weights of fewer tiles than SMs compile once per tile count (small
    models; Llama-3-8B's 14336 has 112 N tiles, 1792 tiles at 2048 tokens)."""
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=32, num_warps=8, num_stages=3)


def gated_prefill(xq: torch.Tensor, x_scale: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
                  s3: torch.Tensor, h_dtype: torch.dtype, act: str = "silu", fast_accum: bool = False,
                  config: Optional[dict] = None, programs: Optional[int] = None, model_rounding: bool = False,
                  tanh_silu: bool = True, tail_split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [M, I] in ``h_dtype``, its row maxima per tile [M, ceil(I / BLOCK_N)]) = ``act(g) * u`` by
    ``gated_prefill_kernel``; the operands as ``gated_mlp``'s, K a multiple of 16 and h's rows of a multiple of 16
    bytes. An operand the TMA copies cannot address (transposed, unaligned) is copied first, as cuBLAS's path copies
    a transposed weight (``fp8fx.ops._row_major``), and one tensor for both gate and up (tied) gets a second one:
    their pair is [2, I, K] (``prefill_fits``: no copy needed). ``programs``: the persistent grid (default: the
    GPU's SMs; on the CPU 4). g, u and act(g) stay float32 and h alone is rounded (``gated_prefill_kernel``);
    ``model_rounding=True`` rounds them as the model's 16-bit ops do (the kernel before run 27; for
    ``benchmarks/prefill_study.py --rounding``, which times what those roundings cost). ``tanh_silu`` (the default,
    with float32 g and u, compiled for CUDA): silu by ``tanh.approx`` (``_gated_h``), else by ex2 and rcp.
    ``tail_split`` (the default): the last, partial round of tiles in half tiles where that round has at most half as
    many tiles as there are programs and the halves have 16 rows or more (``prefill_tail_split``)."""
    grid, args, kwargs, h, parts = _gated_prefill_launch(xq, x_scale, w1, s1, w3, s3, h_dtype, act, fast_accum, config,
                                                         programs, model_rounding, tanh_silu, tail_split)
    with torch.cuda.device(xq.device) if xq.is_cuda else contextlib.nullcontext():
        _GATED_PREFILL[grid](*args, **kwargs)
    return h, parts


def _gated_prefill_launch(xq, x_scale, w1, s1, w3, s3, h_dtype, act="silu", fast_accum=False, config=None,
                          programs=None, model_rounding=False, tanh_silu=True, tail_split=True):
    """``gated_prefill``'s launch of ``gated_prefill_kernel``: (grid, arguments, constexprs and options, h, parts)."""
    xq, w1, w3 = (t if _tma_addressable(t) else t.contiguous() for t in (xq, w1, w3))
    if w1.data_ptr() == w3.data_ptr():
        w3 = w3.clone()
    (m, k), i = xq.shape, w1.shape[0]
    cfg = dict(config or prefill_tile_config(m, i, k))
    s1, s3, w_rowwise = _gate_up_scales(s1, s3, i)
    x_scale = _flat_f32(x_scale)
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    h = torch.empty(m, i, device=xq.device, dtype=h_dtype)
    parts = torch.empty(m, cdiv(i, bn), device=xq.device, dtype=torch.float32)
    if programs is None:
        programs = sm_count(xq.device) if xq.is_cuda else 4
    tiles = cdiv(m, bm) * parts.shape[1]
    programs = max(1, min(programs, tiles))
    split = prefill_tail_split(tiles, programs, bm) if tail_split else 1
    up_first = w3.data_ptr() < w1.data_ptr()
    args = _gated_prefill_args(xq, w3 if up_first else w1, w1 if up_first else w3, h, x_scale, s1, s3, parts,
                               (bm, bn, bk), split)
    kwargs = dict(A_ROWWISE=x_scale.numel() == m and m > 1, W_ROWWISE=w_rowwise, ACT=ACTIVATIONS[act],
                  IMPRECISE_K=imprecise_k({"BLOCK_K": bk}, fast_accum), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  PROGRAMS=programs, UP_FIRST=up_first, PTX_MATH=_compiles_ptx(xq), MODEL_ROUNDING=model_rounding,
                  TANH_SILU=tanh_silu, TAIL_SPLIT=split, **cfg)
    return (programs, 1, 1), args, kwargs, h, parts


def _gated_prefill_args(xq, low, high, h, x_scale, s1, s3, parts, blocks: tuple[int, int, int], split: int,
                        descriptor=None) -> tuple:
    """``gated_prefill_kernel``'s arguments up to its constexprs. Gate and up are one [2, I, K] tensor: the weight at
    the higher address (``high``) is at its leading stride from the other (any distance of a multiple of 16 bytes:
    the copies read the two weights' own rows only). ``descriptor``: the tensor descriptors' constructor (default:
    Triton's ``TensorDescriptor``, which checks its arguments; a ``PrefillPlan`` takes ``launch.unchecked_descriptor``
    for operands its first call's checked ones passed)."""
    if descriptor is None:
        from triton.tools.tensor_descriptor import TensorDescriptor as descriptor

    (m, k), i = xq.shape, h.shape[1]
    bm, bn, bk = blocks
    halves = ((descriptor(xq, [m, k], [k, 1], [bm // split, bk]),
               descriptor(h, [m, i], [i, 1], [bm // split, bn])) if split > 1 else (None, None))
    return (descriptor(xq, [m, k], [k, 1], [bm, bk]),
            descriptor(low, [2, i, k], [high.data_ptr() - low.data_ptr(), k, 1], [2, bn, bk]),
            descriptor(h, [m, i], [i, 1], [bm, bn]), x_scale, s1, s3, parts, m, i, k, parts.stride(0), *halves)


def prefill_tail_split(tiles: int, programs: int, block_m: int) -> int:
    """In how many row parts ``gated_prefill_kernel`` runs each tile of its last round: 2 where that round is partial
    (``tiles % programs`` tiles) and its halves find a program each, with halves of 16 rows at least, else 1 (no
    split). The half tiles of that round end it in about half a tile's time where whole ones take a whole one: at
    Llama-3-8B's 4096 tokens 3584 tiles on 132 programs are 27 full rounds and 20 tiles (28 tile times before, 27.5
    after, if a half tile takes half the time). At 2048 tokens the last round's 76 tiles make 152 halves, more than
    132: no split. Measured (H200 run 28, the kernel in calls back to back, 9 rounds): 0.7444 against 0.7556 ms at
    4096 tokens (1.018x), 0.5466 against 0.5595 at 3072 (1.016x). (Split along K instead, that round lost, run 25:
    its partial sums cost more than the round.)"""
    tail = tiles % programs
    return 2 if 0 < 2 * tail <= programs and block_m >= 32 else 1


def _compiles_ptx(t: torch.Tensor) -> bool:
    """Whether the kernels run compiled for an NVIDIA GPU on t's device (so inline PTX is theirs to use): CUDA,
    not ROCm, and not Triton's interpreter (``TRITON_INTERPRET=1`` makes every ``triton.jit`` kernel an
    ``InterpretedFunction``, on CPU and CUDA tensors alike)."""
    from triton.runtime.interpreter import InterpretedFunction

    return t.is_cuda and torch.version.hip is None and not isinstance(gated_prefill_kernel, InterpretedFunction)


def _tma_addressable(t: torch.Tensor) -> bool:
    """Whether the TMA copies read t [R, K] as it is: row-major, its base 16-byte aligned."""
    return t.stride(-1) == 1 and t.stride(0) == t.shape[1] and t.data_ptr() % 16 == 0


def prefill_fits(xq: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, h_dtype: torch.dtype) -> bool:
    """Whether ``gated_prefill`` takes these operands without a copy (TMA copies): x [M, K], gate and up [I, K]
    row-major with 16-byte aligned bases and K a multiple of 16, two distinct weights, and h's rows of a multiple
    of 16 bytes."""
    k, i = xq.shape[-1], w1.shape[0]
    return (all(_tma_addressable(t) and t.shape[1] == k for t in (xq, w1, w3))
            and k % 16 == 0 and (i * h_dtype.itemsize) % 16 == 0 and w1.data_ptr() != w3.data_ptr())


def quantize_rows(h: torch.Tensor, parts: torch.Tensor, block: tuple[int, int] = (8, 512)
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [M, N], float32 scales [M, 1]) of h [M, N] per row, from its partial row maxima ``parts``
    [M, P] (``gated_prefill``'s, or the decode ``gated_gemm_kernel``'s in ``gated_mlp``'s three-kernel route):
    ``fp8fx.quant.quantize(h, [1, -1])``'s bits without its row reduction."""
    grid, args, kwargs, q, scale = _quantize_rows_launch(h, parts, block)
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        _QUANTIZE_ROWS[grid](*args, **kwargs)
    return q, scale


def _quantize_rows_launch(h: torch.Tensor, parts: torch.Tensor, block: tuple[int, int] = (8, 512)):
    """``quantize_rows``'s launch of ``quantize_rows_kernel``: (grid, arguments, constexprs and options, q, scale)."""
    m, n = h.shape
    q = torch.empty(m, n, device=h.device, dtype=quant.FP8_DTYPE)
    scale = torch.empty(m, 1, device=h.device, dtype=torch.float32)
    bm, bn = block
    kwargs = dict(N_PARTS=parts.shape[1], PARTS_BLOCK=next_power_of_2(parts.shape[1]), BLOCK_M=bm, BLOCK_N=bn,
                  EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, num_warps=4)
    return (cdiv(m, bm), cdiv(n, bn), 1), _quantize_rows_args(h, parts, q, scale), kwargs, q, scale


def _quantize_rows_args(h, parts, q, scale) -> tuple:
    """``quantize_rows_kernel``'s arguments up to its constexprs."""
    return h, parts, q, scale, h.shape[0], h.shape[1], h.stride(0), parts.stride(0), q.stride(0)


def prefill_mlp(x2: torch.Tensor, x_scale: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
                s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, bias: Optional[torch.Tensor], w2_block,
                h_dtype: torch.dtype, out_dtype: torch.dtype, act: str, fast_accum: bool) -> torch.Tensor:
    """The gated MLP's prefill route, x2 [M, K]: ``gated_prefill``, ``quantize_rows`` and cuBLAS's down GEMM
    (``fp8fx.ops.cublas_scaled_mm``), for the op's arguments that ``fp8fx.ops.gated_prefill_reason`` lets through.

    Where the operands are as the kernels read them without a copy or a cast (``_plain_operands``), every call of a
    shape after its first goes through that shape's ``PrefillPlan``: the same launches, with what they derive from
    the shapes (tiles, grids, constexprs, the compiled kernels) kept from the first call. What that saves is host
    time: prefill runs without CUDA graphs, and at 2048 tokens the op's host time was as long as its GPU time
    (benchmarks/RESULTS.md runs 25-30)."""
    plain = _plain_operands(x2, x_scale, w1, s1, w3, s3, w2, s2)
    if plain:
        key = (x2.device.index, *x2.shape, w1.shape[0], w2.shape[0], h_dtype, out_dtype, act, fast_accum,
               x_scale.numel(), s1.numel(), w3.data_ptr() < w1.data_ptr())
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(x2, x_scale, w1, s1, w3, s3, w2, s2, bias)
    grid1, args1, kwargs1, h, parts = _gated_prefill_launch(x2, x_scale, w1, s1, w3, s3, h_dtype, act, fast_accum)
    with torch.cuda.device(x2.device) if x2.is_cuda else contextlib.nullcontext():
        _GATED_PREFILL[grid1](*args1, **kwargs1)
        grid2, args2, kwargs2, hq, h_scale = _quantize_rows_launch(h, parts)
        _QUANTIZE_ROWS[grid2](*args2, **kwargs2)
        if plain:
            gate_up, rows = _GATED_PREFILL.bound(args1, kwargs1), _QUANTIZE_ROWS.bound(args2, kwargs2)
            if gate_up is not None and rows is not None:  # (compiled kernels: not under the interpreter)
                if len(_PLANS) >= _MAX_PLANS:
                    del _PLANS[next(iter(_PLANS))]
                _PLANS[key] = PrefillPlan(gate_up, grid1, kwargs1, rows, grid2, h_dtype, out_dtype, fast_accum)
    return ops.cublas_scaled_mm(hq, h_scale, w2, s2, bias, (1, -1), w2_block, out_dtype, fast_accum)


_PLANS: dict[tuple, "PrefillPlan"] = {}  # prefill_mlp's, by shape key (see there); the oldest goes past _MAX_PLANS
_MAX_PLANS = 64


def _plain_operands(x2, x_scale, w1, s1, w3, s3, w2, s2) -> bool:
    """Whether ``prefill_mlp``'s operands are what a ``PrefillPlan`` launches on as they are: x, gate and up
    row-major [*, K] with 16-byte aligned bases (TMA), gate and up two tensors, down [N, I] row-major; the scales
    float32, contiguous, 16-byte aligned, x's per token or per tensor, gate's and up's alike (both per channel or
    both per tensor), down's per channel. Anything else takes the general route, which copies or casts first."""
    k, i, n = x2.shape[1], w1.shape[0], w2.shape[0]
    f32 = torch.float32
    return (x2.stride() == (k, 1) and w1.stride() == (k, 1) and w3.stride() == (k, 1) and w2.stride() == (i, 1)
            and w1.data_ptr() != w3.data_ptr()
            and x_scale.dtype == f32 and s1.dtype == f32 and s3.dtype == f32 and s2.dtype == f32
            and x_scale.is_contiguous() and s1.is_contiguous() and s3.is_contiguous() and s2.is_contiguous()
            and s1.numel() == s3.numel() and s2.numel() == n
            and not (x2.data_ptr() | w1.data_ptr() | w3.data_ptr() | x_scale.data_ptr() | s1.data_ptr()
                     | s3.data_ptr()) & 15)


class PrefillPlan:
    """``prefill_mlp``'s launches for one shape key (the device, M, K, I, N, the dtypes, act, fast accumulation,
    how x, gate and up are scaled, which of gate and up comes first in memory), from the first call with it: its
    kernels compiled for that launch key (``launch.Bound``), their grids, tiles and the tail split. A call makes
    the same launches as the general route with the same arguments for the same operands (``_gated_prefill_args``,
    ``_quantize_rows_args``), and the down GEMM is ``torch._scaled_mm`` with the scales as they are (per token,
    per channel: [M, 1] and a [1, N] view). What it leaves out is the general route's host work: configs, checks of
    each operand's layout, scale glue, launch keys."""

    __slots__ = ("gate_up", "grid1", "blocks", "split", "up_first", "rows", "grid2", "h_dtype", "out_dtype",
                 "fast_accum")

    def __init__(self, gate_up, grid1, kwargs1: dict, rows, grid2, h_dtype, out_dtype, fast_accum: bool):
        self.gate_up, self.grid1, self.rows, self.grid2 = gate_up, grid1, rows, grid2
        self.blocks = (kwargs1["BLOCK_M"], kwargs1["BLOCK_N"], kwargs1["BLOCK_K"])
        self.split, self.up_first = kwargs1["TAIL_SPLIT"], kwargs1["UP_FIRST"]
        self.h_dtype, self.out_dtype, self.fast_accum = h_dtype, out_dtype, fast_accum

    def __call__(self, x2, x_scale, w1, s1, w3, s3, w2, s2, bias) -> torch.Tensor:
        device = x2.device
        switch = x2.is_cuda and device.index != torch.cuda.current_device()  # (launches go to the current device)
        with torch.cuda.device(device) if switch else contextlib.nullcontext():
            (m, _), i = x2.shape, w1.shape[0]
            h = torch.empty(m, i, device=device, dtype=self.h_dtype)
            parts = torch.empty(m, cdiv(i, self.blocks[1]), device=device, dtype=torch.float32)
            low, high = (w3, w1) if self.up_first else (w1, w3)
            self.gate_up[self.grid1](*_gated_prefill_args(x2, low, high, h, x_scale, s1, s3, parts, self.blocks,
                                                          self.split, unchecked_descriptor))
            hq = torch.empty(m, i, device=device, dtype=quant.FP8_DTYPE)
            h_scale = torch.empty(m, 1, device=device, dtype=torch.float32)
            self.rows[self.grid2](*_quantize_rows_args(h, parts, hq, h_scale))
            y = torch._scaled_mm(hq, w2.t(), scale_a=h_scale, scale_b=s2.view(1, -1), out_dtype=self.out_dtype,
                                 use_fast_accum=self.fast_accum)
        return y if bias is None else y + bias.to(self.out_dtype)


def _flat_f32(t: torch.Tensor) -> torch.Tensor:
    """t's values as a contiguous float32 tensor, for a kernel that reads them by pointer in order (its shape does not
    matter): t itself where it already is one, with no op called (each costs the host some microseconds a call)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _vector(scale: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
    """(float32 scale, per-row?) of a weight [n, K]'s per-tensor (one element) or per-channel ([n]) scale."""
    if scale.numel() not in (1, n):
        raise ValueError(f"gated_mlp: a gate/up weight scale has {scale.numel()} elements; per-tensor (1) or "
                         f"per-channel ({n}) scales only")
    return _flat_f32(scale), scale.numel() == n and n > 1


def _gate_up_scales(s1: torch.Tensor, s3: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(gate's, up's float32 scale vectors, per-row?) in one layout for both: a per-tensor scale beside a
    per-channel one becomes a vector too."""
    (s1, rows1), (s3, rows3) = _vector(s1, n), _vector(s3, n)
    if rows1 != rows3:
        s1, s3 = s1.reshape(-1).expand(n).contiguous(), s3.reshape(-1).expand(n).contiguous()
    return s1, s3, rows1 or rows3


def down_launch(x: torch.Tensor, w2: torch.Tensor, h_group: int, rows_pass: bool = False,
                config: Optional[dict] = None, pdl: Optional[bool] = None) -> tuple[dict, bool]:
    """How ``gated_mlp`` of the activation ``x`` [m, k] launches its down GEMM on the weight ``w2`` [n, i]: (its tile,
    whether it is a programmatic dependent of the gate/up kernel). The tile is ``config``, else the default
    (``down_tile_config``; with ``rows_pass``, h's per-token codes, ``tile_config``'s) for ``x``'s GPU, with
    ``fp8_gemm.DECODE_PDL``'s tile keys where it launches so; ``pdl`` None: on sm_90, never with ``rows_pass``
    (``quantize_rows`` runs between the two GEMMs, launched as any kernel). benchmarks/tune_gemm.py times the down
    GEMM alone launched so."""
    m, (n, i) = x.shape[0], w2.shape
    down = tile_config(m, n, i) if rows_pass else down_tile_config(m, n, i, h_group=h_group)  # (rows: fp8 h)
    cfg = {"SPLIT_K": 1, **(config or for_device(down, x.device))}
    pdl = (_hopper(x) if pdl is None else pdl) and not rows_pass
    if pdl and not config:
        cfg.update(decode_pdl_keys(w2, m, gemv=cfg.get("GEMV", False)) or {})
    return cfg, pdl


def gated_mlp(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    bias: Optional[torch.Tensor],
    h_quant: int,
    h_static: Optional[torch.Tensor],
    h_dtype: torch.dtype,
    out_dtype: torch.dtype,
    act: str = "silu",
    fast_accum: bool = False,
    configs: tuple[Optional[dict], Optional[dict]] = (None, None),
    pdl: Optional[bool] = None,
    h_group: int = 0,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` in two kernels (three with per-token h, below). xq: fp8 [M, K] with
    ``x_scale`` per token ([M] / [M, 1]) or per tensor; w1 (gate), w3 (up): fp8 [I, K]; w2 (down): fp8 [N, I]; weight
    scales per tensor or per channel. ``h_quant``: ``QUANT_ROWS`` (per token), ``QUANT_TENSOR``, ``QUANT_STATIC``
    (``h_static``) or ``QUANT_GROUPS`` (1 x ``h_group`` groups, ``H_GROUPS``; the first kernel's BLOCK_N is the group).
    ``configs``: tiles of the two kernels (default: ``gated_tile_config``, ``down_tile_config``). ``pdl``: the down
    GEMM a programmatic dependent launch of the first kernel (default: on CUDA GPUs of compute capability 9.0+,
    where the hardware has it), so its launch overlaps the first kernel's end.

    Per-token h from ``ops.GATED_ROWS_MIN_M`` (17) tokens: three kernels. The gate/up kernel writes h 16-bit with its
    tile maxima, ``quantize_rows`` makes its per-token codes once (h is [M <= 64, I]: 1.8 MB at Llama-3-8B's 64
    tokens), and the down GEMM reads fp8 h with its per-token scale (``fp8_gemm``'s tiles for fp8 activations,
    ``configs[1]``), where in two kernels each of its N tiles would re-quantize all of h (``ops.GATED_MAX_M``). Up to
    16 tokens the two kernels stay, as tuned since run 10; the three were not timed there. The gate/up kernel takes
    the tile of h in groups of 128 (64 x 128, 8 warps: its best at 64 tokens, run 19), not compared with the
    32-wide one on this route."""
    m, k = xq.shape
    i, n = w1.shape[0], w2.shape[0]
    if w3.shape != w1.shape or w1.shape[1] != k or w2.shape[1] != i:
        raise ValueError(f"gated_mlp: x [{m}, {k}], gate {list(w1.shape)}, up {list(w3.shape)}, down "
                         f"{list(w2.shape)}: gate and up must be [I, {k}], down [N, I]")
    if act not in ACTIVATIONS or h_quant not in (QUANT_ROWS, QUANT_TENSOR, QUANT_STATIC, QUANT_GROUPS):
        raise ValueError(f"gated_mlp: act={act!r}, h_quant={h_quant}; acts {list(ACTIVATIONS)}, h_quant QUANT_*")
    if (h_quant == QUANT_GROUPS) != (h_group > 0) or h_group not in (0, *H_GROUPS):
        raise ValueError(f"gated_mlp: h_group={h_group} with h_quant={h_quant}; QUANT_GROUPS takes groups of "
                         f"{list(H_GROUPS)} (h_group), the other QUANT_* none")
    if x_scale.numel() not in (1, m):
        raise ValueError(f"gated_mlp: x_scale has {x_scale.numel()} elements; per token ({m}) or per tensor (1)")
    xq, w1, w3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (xq, w1, w3))
    if w1.stride() != w3.stride():
        w1, w3 = w1.contiguous(), w3.contiguous()
    s1, s3, w_rowwise = _gate_up_scales(s1, s3, i)
    rows_pass = h_quant == QUANT_ROWS and m >= ops.GATED_ROWS_MIN_M  # h per token through quantize_rows (docstring)
    tile_group = h_group or (128 if rows_pass else 0)  # the rows pass takes the gate/up tile of h in groups of 128
    cfg1 = dict(configs[0] or gated_tile_config(m, i, k, tile_group))
    cfg2, pdl = down_launch(xq, w2, h_group, rows_pass, configs[1], pdl)
    if h_group and configs[0] and cfg1["BLOCK_N"] != h_group:  # a group is one N tile of the first kernel
        raise ValueError(f"gated_mlp: h_group={h_group} is the gate/up kernel's BLOCK_N; configs[0] has "
                         f"{cfg1['BLOCK_N']}")
    if tile_group and not configs[0]:
        cfg1["BLOCK_N"] = tile_group
    cfg1["num_stages"] = pipeline_stages({**cfg1, "BLOCK_N": 2 * cfg1["BLOCK_N"]}, 1,  # gate and up tiles
                                         stage_budget(xq.device))
    split_tiles = cdiv(m, cfg2["BLOCK_M"]) * cdiv(n, cfg2["BLOCK_N"]) if cfg2["SPLIT_K"] > 1 else 0
    tickets = torch.empty(max(split_tiles, 1), device=xq.device, dtype=torch.int32)  # zeroed by the first kernel
    h = torch.empty(m, i, device=xq.device, dtype=quant.FP8_DTYPE if h_group else h_dtype)
    parts = torch.empty(m, cdiv(i, cfg1["BLOCK_N"]), device=xq.device, dtype=torch.float32)
    x_scale = _flat_f32(x_scale)
    # everything the down GEMM reads is ready before the first launch: a copy or cast launched between the two
    # kernels would become the down GEMM's predecessor (no overlap)
    h_scale = h_static.float().reshape(1).contiguous() if h_quant == QUANT_STATIC else parts
    w2, s2 = w2.contiguous(), s2.float().contiguous()
    bias = None if bias is None else bias.contiguous()
    grid = (cdiv(m, cfg1["BLOCK_M"]) * parts.shape[1],)
    # Triton compiles for and launches on the current device: make it xq's
    with torch.cuda.device(xq.device) if xq.is_cuda else contextlib.nullcontext():
        gated_gemm_kernel[grid](
            xq, w1, w3, x_scale, s1, s3, h, parts, tickets,
            m, i, k, split_tiles,
            xq.stride(0), xq.stride(1), w1.stride(0), w1.stride(1), h.stride(0), parts.stride(0),
            A_ROWWISE=x_scale.numel() == m and m > 1, W_ROWWISE=w_rowwise, ACT=ACTIVATIONS[act],
            IMPRECISE_K=imprecise_k(cfg1, fast_accum), PDL_TRIGGER=pdl, H_GROUPS=bool(h_group),
            H_DTYPE=_TL_DTYPES[h_dtype], EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, **cfg1,
        )
        if h_group:  # h arrives as fp8 codes with [M, I / h_group] scales: K-grouped activations
            return fp8_gemm(h, w2, parts, s2, bias, out_dtype, config=cfg2, a_block=(1, h_group),
                            fast_accum=fast_accum, tickets=tickets, pdl=pdl)
        if rows_pass:
            hq, hs = quantize_rows(h, parts)
            return fp8_gemm(hq, w2, hs, s2, bias, out_dtype, config=cfg2, a_block=(1, -1), fast_accum=fast_accum,
                            tickets=tickets)
        return fp8_gemm(h, w2, h_scale, s2, bias, out_dtype, config=cfg2, fast_accum=fast_accum, a_quant=h_quant,
                        tickets=tickets, pdl=pdl)
