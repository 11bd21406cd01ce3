"""Top-k of short rows in one launch: an MoE router's k experts of E (``fp8fx.topk``, ``fp8fx.passes.topk``).

``torch.topk`` on CUDA selects by radix (``gatherTopK``) and, when the result is to be sorted, sorts it in a second
kernel (``bitonicSortKVInPlace``): 9 us of a Qwen3-30B-A3B MoE layer's 33 at one token on the H200 (run 51), more
than either expert GEMM. A router's row is short (E = 8-512 experts), so one program holds a whole row in registers
and takes its maximum k times: each step one reduction across the program's threads (one warp up to 512 elements).

Order, as torch's: each value is mapped to an unsigned 32-bit key whose order is the floats' (negatives' bits all
flipped, the others' sign bit; -0.0 below +0.0) with every NaN above every number (``TopKTypeConfig<float>``), and
``largest=False`` takes the keys reversed (a NaN last). Of equal keys the lower index comes first (torch leaves that
order unspecified). The values are read back from the row at the chosen indices, bit for bit the input's.

A softmax router's weights in the same launch (``softmax_topk``, ``fp8fx.softmax_topk``): the program that holds the
row also takes its softmax, in float32, and writes the k chosen experts' probabilities (``SOFTMAX = 1``) or those
renormalized over the k (``SOFTMAX = 2``, which is also the softmax of the k top logits: GPT-OSS's router), rounded
once to the output's dtype. Where the graph took three kernels (softmax, top-k, a normalization: 4.3 us of Qwen3-30B-
A3B's one-token layer on the H200, run 51) it is one. The experts are chosen by the logits, not by the float32
probabilities torch's graph ranks: softmax keeps the logits' order, so the two differ only where two distinct logits
round to one probability (torch then takes the lower index, this the larger logit), and in a row holding a NaN or
+inf logit, whose probabilities are all NaN (torch's top-k takes any of them, this the NaN or +inf first; the
weights are NaN either way).

A sigmoid router's grouped top-k in one launch too (``grouped_topk``, ``fp8fx.grouped_topk``: DeepSeek-V3's routing,
eight kernels of Nemotron-3-Nano's one-token layer, run 52): the program scores its row, ranks the groups by their
two best, masks the others and takes the experts, all with the same selection (``_pick``), then their weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8fx.kernels.fp8_gemm import _max_nan
from fp8fx.kernels.launch import next_power_of_2
# (what the kernels take, in a module of no Triton: the passes ask it at trace time, on machines without Triton too)
from fp8fx.kernels.topk_limits import MAX_GROUPS, MAX_K, MAX_ROW, grouped_reason, reason  # noqa: F401


@triton.jit
def topk_kernel(x_ptr, values_ptr, indices_ptr, N, stride_x, K: tl.constexpr, KP: tl.constexpr,
                BLOCK: tl.constexpr, LARGEST: tl.constexpr, SOFTMAX: tl.constexpr = 0):
    """Program r: row r's k largest (smallest) values and their indices, in that order. ``SOFTMAX`` 1: the values
    are the row's softmax at those indices; 2: the softmax of the k values (both float32, then values_ptr's dtype)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    raw = tl.load(x_row + offs, mask=offs < N, other=0.0)
    if raw.dtype == tl.bfloat16:  # a bf16's float32 bits are its own, shifted (Triton's interpreter flushed its
        bits = (raw.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF) << 16  # subnormals to 0 in a float cast)
    else:  # (float16 to float32: exact, order kept)
        bits = raw.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    picked = _pick(bits, offs < N, offs, K, KP, LARGEST)
    kk = tl.arange(0, KP)
    k_ok = kk < K
    out = row * K + kk
    values = tl.load(x_row + picked, mask=k_ok)
    if SOFTMAX != 0:  # exp(x - max) / its sum over the row (1) or the k (2); a NaN anywhere in it makes every one NaN
        top = tl.where(k_ok, values.to(tl.float32), float("-inf"))
        if SOFTMAX == 1:
            xf = tl.where(offs < N, raw.to(tl.float32), float("-inf"))
            high = tl.max(xf, 0)
            total = tl.sum(tl.exp(xf - high), 0)
        else:
            high = tl.max(top, 0)
            total = tl.sum(tl.exp(top - high), 0)
        values = tl.exp(top - high) / total
    tl.store(values_ptr + out, values.to(values_ptr.dtype.element_ty), mask=k_ok)
    tl.store(indices_ptr + out, picked, mask=k_ok)


@triton.jit
def _pick(bits, valid, offs, K: tl.constexpr, KP: tl.constexpr, LARGEST: tl.constexpr):
    """The indices [KP] (K of them) of the K largest (smallest) lanes of ``valid`` by their float32 ``bits`` (int64),
    in order: torch's order (NaN of either sign above every number, -0.0 below +0.0), of equals the lower index."""
    key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    # a NaN (either sign) by its float32 bits, the same test on both paths
    key = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0xFFFFFFFF, key)
    if not LARGEST:
        key = 0xFFFFFFFF - key
    # one int64 a lane: the key above, 4095 - index below (the lower index wins a tie); other lanes below all
    comp = tl.where(valid, (key << 12) | (4095 - offs), -1)
    kk = tl.arange(0, KP)
    picked = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(comp, 0)
        picked = tl.where(kk == j, 4095 - (best & 4095), picked)
        comp = tl.where(comp == best, -1, comp)
    return picked


@triton.jit
def grouped_topk_kernel(x_ptr, bias_ptr, weights_ptr, ids_ptr, stride_x, eps, scale, fill, E: tl.constexpr,
                        BLOCK: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK_GROUP_P: tl.constexpr,
                        K: tl.constexpr, KP: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Program r: a sigmoid router's row r (DeepSeek-V3's, ``grouped_topk``): the k experts of the largest
    ``sigmoid(x) + bias`` among the TOPK_GROUP groups (of G, E // G experts each; where groups are dropped, E and G
    powers of 2 and BLOCK = E) of the largest sum of their two largest, the others ``fill``; their weights
    ``sigmoid(x)``, divided by their sum + eps where RENORMALIZE, times scale (float32)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < E
    x_row = x_ptr + row * stride_x
    scores = tl.sigmoid(tl.load(x_row + offs, mask=valid, other=0.0).to(tl.float32))
    choice = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if TOPK_GROUP < G:  # each group's score: its two largest, summed (torch.topk(2) of the group: a tie counts twice)
        grid = tl.reshape(choice, (G, E // G))
        first = tl.reduce(grid, 1, _max_nan)  # (a NaN kept: torch's top-k takes it first, and the sum is NaN)
        at_first = grid == first[:, None]
        second = tl.reduce(tl.where(at_first, float("-inf"), grid), 1, _max_nan)
        second = tl.where(tl.sum(at_first.to(tl.int32), 1) > 1, first, second)
        group_score = first + second
        groups = tl.arange(0, G)
        # the best groups in torch's order (a NaN first), of equals the lower index
        chosen = _pick(group_score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF, groups < G, groups,
                       TOPK_GROUP, TOPK_GROUP_P, True)
        kept = tl.sum(((groups[:, None] == chosen[None, :]) & (tl.arange(0, TOPK_GROUP_P) < TOPK_GROUP)[None, :])
                      .to(tl.int32), 1) > 0
        keep = tl.reshape(tl.broadcast_to(kept[:, None], (G, E // G)), (E,))
        choice = tl.where(keep, choice, fill)
    bits = choice.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    picked = _pick(bits, valid, offs, K, KP, True)
    kk = tl.arange(0, KP)
    k_ok = kk < K
    weights = tl.where(k_ok, tl.sigmoid(tl.load(x_row + picked, mask=k_ok, other=0.0).to(tl.float32)), 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + eps)
    weights = weights * scale
    tl.store(weights_ptr + row * K + kk, weights, mask=k_ok)
    tl.store(ids_ptr + row * K + kk, picked, mask=k_ok)


def grouped_topk(x: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_group: int, renormalize: bool,
                 eps: float, scale: float, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 ids) [..., k] of a sigmoid router's logits x [..., E] (``grouped_topk_kernel``), the
    ids sorted by their choice score (ties to the lower index). ``grouped_reason`` must be ""."""
    e = x.shape[-1]
    rows = x.reshape(-1, e)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weights = torch.empty((*x.shape[:-1], k), dtype=torch.float32, device=x.device)
    ids = torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    if rows.shape[0]:
        block = e if topk_group < groups else max(next_power_of_2(e), 16)  # (groups dropped: the row, a power of 2)
        grouped_topk_kernel[(rows.shape[0],)](
            rows, bias.contiguous(), weights, ids, rows.stride(0), float(eps), float(scale), float(fill), E=e,
            BLOCK=block, G=groups, TOPK_GROUP=topk_group, TOPK_GROUP_P=max(next_power_of_2(topk_group), 2), K=k,
            KP=max(next_power_of_2(k), 2), RENORMALIZE=renormalize, num_warps=1 if e <= 512 else 4)
    return weights, ids


def topk(x: torch.Tensor, k: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) [..., k] of x's last dim on the GPU, as ``torch.topk(x, k, -1, largest, sorted=True)``
    (ties to the lower index). ``reason(x, k)`` must be ""."""
    return _launch(x, k, largest, 0, x.dtype)


def softmax_topk(x: torch.Tensor, k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(weights of ``out_dtype``, int64 indices) [..., k] on the GPU: the k largest logits of x's last dim, sorted
    (ties to the lower index), and ``softmax(x.float(), -1)`` there, divided by its sum over the k where
    ``renormalize``. ``reason(x, k)`` must be ""."""
    return _launch(x, k, True, 2 if renormalize else 1, out_dtype)


def _launch(x: torch.Tensor, k: int, largest: bool, softmax: int, out_dtype: torch.dtype):
    n = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values = torch.empty((*x.shape[:-1], k), dtype=out_dtype, device=x.device)
    indices = torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    if rows.shape[0]:
        block = max(next_power_of_2(n), 16)
        topk_kernel[(rows.shape[0],)](rows, values, indices, n, rows.stride(0), K=k, KP=max(next_power_of_2(k), 2),
                                      BLOCK=block, LARGEST=largest, SOFTMAX=softmax,
                                      num_warps=1 if block <= 512 else 4)
    return values, indices
