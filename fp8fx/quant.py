"""FP8 quantization math in plain torch: the reference every kernel is checked against.

Layout: a tensor ``x: [..., R, C]`` is cut into ``block = (bR, bC)`` tiles over its last two dims
(``-1`` = the whole dim; ragged edge tiles allowed) and each tile gets one float32 scale, so
``scale: [..., ceil(R / bR), ceil(C / bC)]`` and ``x ~= q.float() * scale`` tile by tile with
``q`` in float8_e4m3fn.

Every cast to fp8 is preceded by a clamp to +-448: torch 2.11 eager turns out-of-range values into
NaN while 2.13 and Inductor saturate (FACTS.md, checked on both), and the clamp makes both agree.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false  # (torch 2.11 and 2.13)

FP8_DTYPE = torch.float8_e4m3fn
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)  # activations, outputs, unquantized weights
# what a quantized layer may compute in: the fp8 GEMMs' dtypes, and float64 - the dequantized weight as a reference
# (``model.double()``), which the passes leave to torch with a reason in the report
COMPUTE_DTYPES = HIGH_PRECISION + (torch.float64,)
# the tensor methods that cast or copy a tensor: a weight read as ``w.to(x.dtype)`` or ``w.contiguous()`` is still the
# weight to the linear pass, and to ``calibrate``, which must see every linear the pass rewrites
CAST_METHODS = frozenset(("to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous"))


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is one of ``dst`` (a kernel may then load ``src`` and compute in ``dst``): the
    same dtype, or a 16-bit float to float32."""
    return src == dst or dst == torch.float32 and src in (torch.bfloat16, torch.float16)
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# amax below this is treated as this, so all-zero tiles get a finite, non-zero scale and
# q == 0; values smaller than AMAX_EPS / 448 in such tiles flush to zero.
AMAX_EPS = 1e-12


def resolve_block(block: Sequence[int], rows: int, cols: int) -> tuple[int, int]:
    """``(bR, bC)`` with ``-1`` replaced by the dim's size (at least 1)."""
    b_r, b_c = block
    return (max(rows, 1) if b_r == -1 else b_r, max(cols, 1) if b_c == -1 else b_c)


def known(cond) -> bool:
    """``cond`` (a size comparison), where it is a plain bool; a symbolic one only where it can be decided without a
    guard (an unbacked size, a batch marked so, answers no question: False). Plain bools skip torch's helper: the
    ops check sizes on every call."""
    return cond if type(cond) is bool else guard_or_false(cond)


def without_trailing_ones(shape) -> tuple:
    """``shape`` without its trailing 1-dims: a scale's layout whatever 1s it is stored with ([N] / [N, 1], [E, R] /
    [E, R, 1])."""
    shape = tuple(shape)
    while shape and known(shape[-1] == 1):  # (an unbacked size is taken as not 1)
        shape = shape[:-1]
    return shape


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scale of a tensor of ``shape`` quantized with ``block``."""
    *lead, rows, cols = shape
    # a whole-dim block is one scale even for an empty dim (M == 0: an empty batch, an idle expert); integer
    # ceil-division, which asks no question of a symbolic size (an unbacked batch: max() and / guarded on it)
    n_r = 1 if block[0] == -1 else -(-rows // block[0])
    n_c = 1 if block[1] == -1 else -(-cols // block[1])
    return (*lead, n_r, n_c)


def _tiles(x: torch.Tensor, block: Sequence[int],
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, tuple[int, int]]:
    """x: [..., R, C] -> zero-padded view [..., R/bR, bR, C/bC, bC] (in ``dtype``)."""
    *lead, rows, cols = x.shape
    b_r, b_c = resolve_block(block, rows, cols)
    pad_r, pad_c = -rows % b_r, -cols % b_c
    x = x.to(dtype)
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    n_r, n_c = (rows + pad_r) // b_r, (cols + pad_c) // b_c
    return x.reshape(*lead, n_r, b_r, n_c, b_c), (b_r, b_c)


def expand_scale(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """scale: [..., R/bR, C/bC] (any shape of that numel) -> broadcastable to ``shape``."""
    *lead, rows, cols = shape
    b_r, b_c = resolve_block(block, rows, cols)
    scale = scale.reshape(scale_shape(shape, block))
    if b_r > 1 and b_r != rows:
        scale = scale.repeat_interleave(b_r, dim=-2)[..., :rows, :]
    if b_c > 1 and b_c != cols:
        scale = scale.repeat_interleave(b_c, dim=-1)[..., :cols]
    return scale


def compute_scale(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """float32 scale = amax / 448 per tile; x: [..., R, C] -> [..., ceil(R/bR), ceil(C/bC)]. A float64 ``x`` with a
    finite value past float32's range is refused where its values can be read (``_check_float32_range``)."""
    if x.numel() == 0:
        return torch.full(scale_shape(x.shape, block), AMAX_EPS / FP8_MAX, device=x.device, dtype=torch.float32)
    tiles, _ = _tiles(x, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    if x.dtype == torch.float64 and _readable(x) and torch.isinf(amax).any():
        _check_float32_range(x)
    # divided by a tensor, not a Python number: eager CUDA torch turns division by a number into
    # multiplication by its reciprocal (1 ulp off the quotient for about half the values); by a tensor it
    # divides (IEEE), as CPU torch and fp8fx's Triton kernels (div_rn) do: eager scales are the same bits
    # on every device. (Compiled, Inductor may still fold the constant divisor into a reciprocal.)
    return amax.clamp(min=AMAX_EPS) / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)


F32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38


def _readable(x: torch.Tensor) -> bool:
    """Whether reading a value of ``x`` costs no GPU sync and breaks no trace: a real CPU tensor, outside
    ``torch.compile`` (as ``fp8fx.ops`` reads a static scale's value)."""
    return (x.device.type == "cpu" and not isinstance(x, torch._subclasses.FakeTensor)
            and not torch.compiler.is_compiling())


def _check_float32_range(x: torch.Tensor) -> None:
    """A float64 ``x`` holds no finite value past float32's range: fp8fx's scales are float32 and its quantizers read
    ``x`` in float32, where such a value is inf (its tile's scale came out inf and its codes NaN, the tensor's finite
    values turned into NaN with no word). Every bf16 / fp16 / fp32 value is in that range; an inf or NaN itself is
    not refused, as in those dtypes. Called where ``x``'s amax in float32 is inf (a tensor in range pays one look at
    its tiles' amax) and ``x`` is readable (``_readable``): on CUDA, where a look would be a GPU sync a call, and in a
    trace such a tile's scale is inf, its codes NaN."""
    big = x[torch.isfinite(x) & torch.isinf(x.float())].abs()  # (one that rounds to float32's max is in range)
    if big.numel():
        raise ValueError(
            f"fp8fx: a torch.float64 tensor of amax {big.max().item():g} ({big.numel()} of its {x.numel()} values "
            f"past float32's range, {F32_MAX:.3g}) cannot be quantized: fp8fx's scales are float32 and its quantizers "
            "read the values in float32, where these are inf (the scale would be inf, the codes NaN); bring the "
            "tensor into float32's range (scale it down) or keep it in high precision"
        )


def cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast (clamp first: see the module docstring)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """q = saturate(x / scale) with ``scale`` given per tile (static quantization). The codes are those of the
    float32 quotient by the float32 scale, rounded to nearest even: where x * 448 / amax is an exact tie between two
    fp8 values, the rounded scale can put the quotient a float32 ulp to one side, and the code is that side's
    (86 of 1.14M codes of random bf16 tiles, each one fp8 step; fp8fx's kernels make the same codes)."""
    return cast_to_fp8(x.float() / expand_scale(scale.float(), x.shape, block))


def quantize(x: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization: x: [..., R, C] -> (q fp8 [..., R, C], scale fp32 [..., R/bR, C/bC])."""
    if x.dim() < 2:
        raise ValueError(f"quantize needs a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    scale = compute_scale(x, block)
    return quantize_with_scale(x, scale, block), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q.float() * scale (broadcast per tile) in ``dtype``; in float64 for float64, where the product is exact (in
    float32 a code's 4 significant bits times a scale's 24 can round)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(wide) * expand_scale(scale.to(wide), q.shape, block)).to(dtype)


def dequantize_scale_grad(grad: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          block: Sequence[int]) -> torch.Tensor:
    """The gradient of ``dequantize(q, scale, block)`` with respect to ``scale``, given the output's ``grad``: the
    sum of ``grad * q`` over each scale's tile, in the scale's shape and dtype."""
    wide = torch.float64 if torch.float64 in (grad.dtype, scale.dtype) else torch.float32
    tiles, _ = _tiles(grad.to(wide) * q.to(wide), block, wide)
    return tiles.sum(dim=(-3, -1)).reshape(scale.shape).to(scale.dtype)


def rows_of(x: torch.Tensor):
    """M of x: [..., K], the product of the leading dims (symbolic ones too)."""
    m = 1
    for d in x.shape[:-1]:
        m = m * d
    return m


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] as [M, K] (``reshape(-1, K)`` cannot tell M when K = 0)."""
    return x.reshape(rows_of(x), x.shape[-1])


def quantize_rows(x: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations: x: [..., K] quantized as the 2-D view [M, K]; scale: [M/bM, K/bK]."""
    q, scale = quantize(as_rows(x), block)
    return q.reshape(x.shape), scale


def scaled_mm_reference(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    x_block: Sequence[int],
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    w_block: Sequence[int],
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = dequant(xq) @ dequant(wq).T + bias in float32, cast to ``out_dtype``.

    xq: [..., K] fp8 with x_scale over its [M, K] view; wq: [N, K] fp8; bias: [N]; y: [..., N].
    """
    x = dequantize(as_rows(xq), x_scale, x_block)
    w = dequantize(wq, w_scale, w_block)
    y = float32_mm(x, w.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*xq.shape[:-1], wq.shape[0])


def float32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of float32 tensors in float32 also under the caller's ``torch.autocast``, whose thread-local state
    reaches into a custom op's implementation: it computed the references' products in bf16 (3e-3 off where the ops
    promise float32 accumulation) and the MoE reference's into its float32 buffer failed ("Index put requires the
    source and destination dtypes match")."""
    with torch.autocast(a.device.type, enabled=False):
        return a @ b


def requantize_shards(
    q: torch.Tensor, shard_scales: Sequence[torch.Tensor], shard_sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused weight (e.g. QKV or w13) whose ``len(shard_sizes)`` row-shards each carry a per-tensor
    scale -> the same weight under one per-tensor scale, the max of the shard scales.

    q: [sum(shard_sizes), K] fp8 -> (q' [same], scale [1]); shards already at the max are unchanged.
    """
    if sum(shard_sizes) != q.shape[0] or len(shard_sizes) != len(shard_scales):
        raise ValueError(
            f"requantize_shards: shard sizes {list(shard_sizes)} do not cover the {q.shape[0]} rows "
            f"with {len(shard_scales)} scales"
        )
    scales = torch.stack([s.float().reshape(()) for s in shard_scales])
    max_scale = scales.max()
    out = torch.empty_like(q)
    # a few rows at a time: the float32 temporaries of the whole fused weight were ~12 bytes an element (3 GB for a
    # 70B model's gate_up_proj), on the device the checkpoint loads to; elementwise, so the bits are the same
    step = max(1, _REQUANTIZE_NUMEL // max(q[0].numel(), 1)) if q.shape[0] else 1
    start = 0
    for size, scale in zip(shard_sizes, scales):
        for row in range(start, start + size, step):
            rows = slice(row, min(row + step, start + size))
            out[rows] = cast_to_fp8(q[rows].float() * scale / max_scale)
        start += size
    return out, max_scale.reshape(1)


_REQUANTIZE_NUMEL = 1 << 18  # elements requantize_shards converts at a time (as weights.chunked.CHUNK_NUMEL)


def bad_scales(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` (scales, as float32) cannot dequantize - how many are not positive finite floats of float32's normal
    range, the first of them and where - or None: a 0, <0, NaN or Inf scale makes its outputs zero or NaN, silently,
    and a subnormal one (below 1.2e-38) an inf 1 / scale (static activations are divided by it; fp8fx's own scales
    are at least 1e-12 / 448)."""
    bad = ~(torch.isfinite(t) & (t >= torch.finfo(torch.float32).tiny))
    if not bad.any():
        return None
    where = tuple(bad.nonzero()[0].tolist())
    return (f"{bad.sum().item()} scales are not positive finite floats ({t[where].item()} at {list(where)}); a scale "
            "of 0, <0, below float32's normal range (1.2e-38), NaN or Inf cannot dequantize")


def max_input_scale(scales: Sequence[torch.Tensor]) -> torch.Tensor:
    """Static input scales of fused shards collapse to their max (one activation scale per GEMM)."""
    return torch.stack([s.float().reshape(()) for s in scales]).max().reshape(1)
