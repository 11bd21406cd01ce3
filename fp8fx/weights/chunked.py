"""Quantizing a weight in row chunks, so its float32 temporaries stay small while a checkpoint streams in.

``quant.quantize`` makes a few float32 copies of its input (upcast, padded tiles, ``abs``, the division);
for a ``[N, K]`` weight that is ~12 bytes per element next to the 2 of the bf16 weight itself. Here the
same math runs over slices of rows: per-row and per-block scales do not cross chunks (chunks hold whole
tiles), and a per-tensor scale is the max of the chunks' scales, found in a first pass. The result is
bit-identical to ``quant.quantize``; the temporaries are those of one chunk.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fp8fx import quant

# Elements per chunk. The temporaries are about four float32 copies of one chunk, 16 * CHUNK_NUMEL bytes (4 MiB),
# next to the weight being quantized and its fp8 result - unless one row of scale blocks is larger: a chunk holds
# whole blocks, so with 128x128 blocks it is at least 128 rows (a [512, 18432] weight: ~20 MiB of temporaries).
CHUNK_NUMEL = 1 << 18


def _row_step(rows: int, cols: int, block: Sequence[int], chunk_numel: int) -> int:
    b_r = 1 if block[0] == -1 else quant.resolve_block(block, rows, cols)[0]
    tiles = max(1, chunk_numel // max(cols * b_r, 1))
    return tiles * b_r


def quantize(
    x: torch.Tensor, block: Sequence[int], chunk_numel: int = CHUNK_NUMEL, out: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize(x, block)`` for a 2-D ``x: [N, K]``, computed ``chunk_numel`` elements at a time; the codes
    written into ``out`` (an fp8 ``[N, K]``, e.g. a slice of a larger weight) where given. ``scale``: for one scale
    over all rows (``block[0] == -1``), the scale to quantize with instead of ``x``'s own (``per_tensor_scale``'s
    max over weights that share one: an expert's gate and up)."""
    rows, cols = x.shape
    if scale is not None:
        if block[0] != -1:
            raise ValueError(f"chunked.quantize: a given scale is for one scale over all rows, not block {block}")
        scale = scale.reshape(quant.scale_shape(x.shape, block))
    step = _row_step(rows, cols, block, chunk_numel)
    if rows <= step and scale is None:
        q, scale = quant.quantize(x, block)
        return (q, scale) if out is None else (out.copy_(q), scale)
    chunks = [x[i : i + step] for i in range(0, rows, step)]
    q = torch.empty(x.shape, dtype=quant.FP8_DTYPE, device=x.device) if out is None else out  # q: [N, K]
    if block[0] == -1:  # one scale over all rows: its max first, then the casts
        if scale is None:
            scale = per_tensor_scale(x, block, chunk_numel)  # [1, n_c]
        for i, c in zip(range(0, rows, step), chunks):
            q[i : i + step] = quant.quantize_with_scale(c, scale, block)
        return q, scale
    scales = []
    for i, c in zip(range(0, rows, step), chunks):
        q[i : i + step], s = quant.quantize(c, block)
        scales.append(s)
    return q, torch.cat(scales)  # [ceil(N / bR), ceil(K / bC)]


def per_tensor_scale(x: torch.Tensor, block: Sequence[int] = (-1, -1), chunk_numel: int = CHUNK_NUMEL) -> torch.Tensor:
    """``quant.compute_scale(x, block)`` of a 2-D ``x`` for one scale over all rows (``block[0] == -1``), the max of
    its row chunks' scales."""
    rows, cols = x.shape
    step = _row_step(rows, cols, block, chunk_numel)
    if rows <= step:
        return quant.compute_scale(x, block)
    return torch.stack([quant.compute_scale(x[i : i + step], block) for i in range(0, rows, step)]).amax(dim=0)


def count_nonfinite(x: torch.Tensor, chunk_numel: int = CHUNK_NUMEL) -> int:
    """NaN/Inf elements of ``x`` (float8_e4m3fn has NaN only: bits S.1111.111), a chunk of rows at a time: a
    non-contiguous ``x`` (a transposed view) is copied one chunk at a time, not whole."""
    x = x.reshape(1, -1) if x.dim() < 2 else x
    step = max(1, chunk_numel // max(x[0].numel() if len(x) else 1, 1))
    total = 0
    for i in range(0, x.shape[0], step):
        c = x[i : i + step].reshape(-1)
        if x.dtype == quant.FP8_DTYPE:
            total += int(((c.view(torch.uint8) & 0x7F) == 0x7F).sum())
        else:
            total += int((~torch.isfinite(c)).sum())
    return total


def count_unloadable(t: torch.Tensor, dtype: torch.dtype, chunk_numel: int = CHUNK_NUMEL) -> tuple[int, int, float]:
    """(NaN/Inf values, finite values that a cast to ``dtype`` makes infinite, the largest of those) of a checkpoint
    weight, in one pass of row chunks: a weight quantized online is first copied into a ``dtype`` buffer (a bf16
    checkpoint loaded into a float16 model holds 65504 at most)."""
    if t.dtype == dtype or not t.is_floating_point() or torch.finfo(dtype).max >= torch.finfo(t.dtype).max:
        return count_nonfinite(t, chunk_numel), 0, 0.0
    x = t.reshape(1, -1) if t.dim() < 2 else t
    step = max(1, chunk_numel // max(x[0].numel() if len(x) else 1, 1))
    nonfinite = overflow = 0
    largest = 0.0
    for i in range(0, x.shape[0], step):
        c = x[i : i + step].reshape(-1)
        finite = torch.isfinite(c)
        nonfinite += int((~finite).sum())
        over = torch.isinf(c.to(dtype)) & finite
        n = int(over.sum())
        if n:
            overflow += n
            largest = max(largest, float(c[over].abs().max()))
    return nonfinite, overflow, largest


def dequantized_overflow(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int], dtype: torch.dtype,
                         chunk_numel: int = CHUNK_NUMEL) -> int:
    """Values of the dequantized fp8 weight ``q`` [rows, cols] (``quant.dequantize``: fp8 * scale in float32 - float64
    for float64 -, then ``dtype``, as a quantized layer's ``weight`` view) that are inf, counted a chunk of whole
    scale rows at a time."""
    rows, cols = q.shape
    if block[0] == -1:  # one scale for all rows
        b_r, step = rows, max(1, chunk_numel // max(cols, 1))
    else:
        b_r = quant.resolve_block(block, rows, cols)[0]
        step = b_r * max(1, chunk_numel // max(cols * b_r, 1))
    scale = scale.reshape(quant.scale_shape((rows, cols), block))
    total = 0
    for i in range(0, rows, step):
        s = scale if block[0] == -1 else scale[i // b_r : -(-(i + step) // b_r)]
        total += int(torch.isinf(quant.dequantize(q[i : i + step], s, block, dtype)).sum())
    return total
