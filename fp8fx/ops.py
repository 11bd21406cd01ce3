"""fp8fx custom ops (``torch.ops.fp8fx.*``): schemas, fake impls, CPU reference and CUDA impls.

Blocks are ``[rows, cols]`` lists over a 2-D view with ``-1`` = whole dim (see ``fp8fx.config``):
``[-1, -1]`` per-tensor, ``[1, -1]`` per-row (per-channel / per-token), ``[1, 128]`` per-group,
``[128, 128]`` per-block. Activations ``x: [..., K]`` are quantized as their ``[M, K]`` view.

- ``quantize(x, block) -> (q, scale)``: dynamic activation quantization; q like x (row-major), scale
  ``[M/bM, K/bK]`` laid out M-major (``act_scale_layout``).
- ``quantize_static(x, scale) -> q``: per-tensor static activation quantization.
- ``dequantize(q, scale, block, dtype, input_scale=None, act_block=None)``: ``q.float() * scale``
  in ``dtype``. This is the dequantized weight view that quantized modules expose as ``.weight``;
  ``input_scale`` / ``act_block`` do not change its value, they record how the consumer of this
  weight should quantize its activations, so the linear pass finds everything on one node.
- ``scaled_mm(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum=False)``:
  ``y [..., N] = dequant(xq) @ dequant(wq).T + bias``; wq: ``[N, K]``. On CUDA: the Triton GEMM of
  ``fp8fx.kernels`` for decode-sized M and for block / group scales, cuBLAS ``torch._scaled_mm``
  for per-tensor / per-row scales above; 1x128 x 128x128 blocks go to cuBLAS's block-scaled GEMM
  where it applies (``cublas_block_fits``: measured faster).
- ``scaled_mm_fused(xq, x_scale, wqs, w_scales, biases, ...)``: several weights that read the same
  activation in one GEMM (``fp8fx.passes.horizontal``).
- ``weight_only_mm(x, wq, w_scale, bias, w_block)``: ``x @ dequant(wq).T + bias`` with 16-bit
  activations (the fallback for GPUs without fp8 tensor cores).

``direct.<op>(...)`` calls what ``torch.ops.fp8fx.<op>(...)`` dispatches to, without the dispatcher and, for
scaled_mm and gated_mlp on CUDA, without the dtype and shape checks a graph's trace ran (what Inductor's code calls
under ``Fp8Backend``; see ``direct`` at the end).
"""
from __future__ import annotations

import functools
import logging
import math
import types
from typing import Callable, Optional, Sequence

import torch

from fp8fx import quant
from fp8fx.kernels import launch  # (no Triton import: launch.py imports torch only)
from fp8fx.kernels.launch import cdiv
from fp8fx.lowerings import compat

# Everything here is functional (no op mutates its inputs).
_LIB = "fp8fx"
# each op's Python functions, as defined here: {name: function} for any device (custom_op's own) and for CUDA;
# ``direct`` calls them without the dispatcher
_DEFAULT_FNS: dict[str, Callable] = {}
_CUDA_FNS: dict[str, Callable] = {}
_OPS: dict[str, object] = {}  # name: its CustomOpDef


def _op(name: str) -> Callable[[Callable], "torch._library.custom_ops.CustomOpDef"]:
    """``torch.library.custom_op("fp8fx::<name>", mutates_args=())``, keeping the function it wraps for ``direct``."""
    def define(fn: Callable):
        _DEFAULT_FNS[name] = fn
        _OPS[name] = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=())(fn)
        return _OPS[name]
    return define


def _on_cuda(name: str, checks: Optional[Callable] = None) -> Callable[[Callable], Callable]:
    """``register_kernel("cuda")`` of the op ``name``, keeping the kernel function for ``direct``. ``checks``: run on
    the arguments before the function by the registered kernel (the op's fake impl runs them when a graph is
    traced), not by ``direct``, which Inductor's code calls on arguments its trace checked."""
    def register(fn: Callable) -> Callable:
        _CUDA_FNS[name] = fn
        if checks is None:
            return _OPS[name].register_kernel("cuda")(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            checks(*args, **kwargs)
            return fn(*args, **kwargs)
        return _OPS[name].register_kernel("cuda")(checked)
    return register


def _act_scale_shape(x: torch.Tensor, block: Sequence[int]):
    m, k = quant.rows_of(x), x.shape[-1]
    b_m, b_k = block
    return (1 if b_m == -1 else cdiv(m, b_m), 1 if b_k == -1 else cdiv(k, b_k))


def act_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """An activation scale [M/bM, K/bK] as ``quantize`` returns it: M-major, each K group's scales of all rows
    side by side (strides (1, M/bM); per-token [M, 1] and per-tensor scales are row-major too). cuBLAS's 1x128 x
    128x128 GEMM takes only this layout (``cublas_block_operands``): row-major scales cost a copy kernel at every
    prefill call. Written so by the quantization - fused into its producer under compile (``fp8fx.lowerings.aten``)
    - it takes no kernel of its own (H100 run 88: none among a compiled block linear's), and fp8fx's Triton GEMMs read
    any strides (a K step's scales of a tile's rows coalesced so). The fake lays out its empty scale with this too:
    the same strides where a dim has one element or none."""
    return scale.t().contiguous().t()


def _check_rows(x: torch.Tensor, what: str) -> None:
    """``x`` is [..., K]: a 0-d tensor has no K (the impls failed with a bare IndexError, and quantize_static's fake
    returned a tensor its real impl could not)."""
    if x.dim() == 0:
        raise ValueError(f"{what} is a 0-d tensor; it takes activations of shape [..., K]")


def _check_high_precision(x: torch.Tensor, what: str) -> None:
    """What the quantizers take: real values in bf16, fp16, fp32 or fp64 (an int or bool tensor was quantized as
    numbers, fp8 codes quantized again)."""
    _check_rows(x, what)
    if x.dtype not in quant.COMPUTE_DTYPES:
        raise ValueError(f"{what} is {x.dtype}; it quantizes bf16/fp16/fp32/fp64 activations")


def check_block(block: Sequence[int], what: str) -> None:
    if len(block) != 2 or any(b == 0 or b < -1 for b in block):
        raise ValueError(f"fp8fx: {what}={list(block)} is not a block; use [rows, cols] with -1 for a whole dim")


# --- quantize -------------------------------------------------------------------------------
@_op("quantize")
def quantize(x: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(block, "block")
    _check_high_precision(x, "fp8fx.quantize: x")
    q, scale = quant.quantize_rows(x, block)
    return q.contiguous(), act_scale_layout(scale)  # the layouts the fake impl promises, whatever x's strides


@quantize.register_fake
def _(x, block):
    check_block(block, "block")  # every fake checks what its real impls check: torch.compile fails at trace time
    _check_high_precision(x, "fp8fx.quantize: x")
    scale = act_scale_layout(x.new_empty(_act_scale_shape(x, block), dtype=torch.float32))  # the real impl's strides
    return x.new_empty(x.shape, dtype=quant.FP8_DTYPE), scale


def _check_out_dtype(what: str, name: str, dtype: torch.dtype, reference: bool = False) -> None:
    """``dtype`` is one the op computes in: bf16, fp16, fp32 - or, with ``reference`` (dequantize: a float64 model),
    float64 too."""
    if dtype not in (quant.COMPUTE_DTYPES if reference else quant.HIGH_PRECISION):
        kinds = "bf16, fp16, fp32 or fp64" if reference else "bf16, fp16 or fp32"
        raise ValueError(f"{what}: {name}={dtype}; the result is {kinds}")


def check_static_scale(scale: torch.Tensor, what: str = "fp8fx.quantize_static: the static input scale") -> None:
    if scale.dtype not in quant.COMPUTE_DTYPES:  # (a complex one lost its imaginary part, a bool read as 1.0, an int
        # failed in another op's check, naming an argument the caller never passed)
        raise ValueError(f"{what} is {scale.dtype}; a static scale is a floating-point tensor (float32)")
    if scale.numel() != 1:
        raise ValueError(f"{what} must have one element, got shape {list(scale.shape)}; per-token or per-group "
                         "activations are dynamic (fp8fx.quantize)")
    _check_positive_value(scale, what)


def _check_positive_value(scale: torch.Tensor, what: str) -> None:
    """A one-element static scale is a positive finite float - where reading it costs no GPU sync (a CPU tensor;
    the loaders check scales on CUDA when they load them): 0 would saturate every value and make zeros NaN."""
    if scale.device.type == "cpu" and not isinstance(scale, torch._subclasses.FakeTensor):
        value = scale.float().reshape(()).item()
        if not torch.finfo(torch.float32).tiny <= value < float("inf"):  # (a subnormal one saturates every value)
            raise ValueError(f"{what} is {value}; a static scale must be a positive finite float in float32's "
                             "normal range (>= 1.2e-38)")


@_op("quantize_static")
def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    check_static_scale(scale)
    _check_high_precision(x, "fp8fx.quantize_static: x")
    return quant.quantize_with_scale(quant.as_rows(x), scale, [-1, -1]).reshape(x.shape).contiguous()


@quantize_static.register_fake
def _(x, scale):
    check_static_scale(scale)  # (its value is not read from a FakeTensor)
    _check_high_precision(x, "fp8fx.quantize_static: x")
    return x.new_empty(x.shape, dtype=quant.FP8_DTYPE)


# --- dequantize (the weight view) ----------------------------------------------------------
@_op("dequantize")
def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: list[int],
    dtype: torch.dtype,
    input_scale: Optional[torch.Tensor] = None,
    act_block: Optional[list[int]] = None,
) -> torch.Tensor:
    _check_dequantize_args(q, scale, block, dtype, input_scale, act_block)
    return quant.dequantize(q, scale, block, dtype).contiguous()


def _check_dequantize_args(q: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype, input_scale=None,
                           act_block=None) -> None:
    check_block(block, "block")
    # (the layer's input scale and activation blocks ride along for the passes: unchecked, a bad one failed later in
    # a compiled graph, naming another op's argument, after the report called the layer rewritten)
    if act_block is not None:
        check_block(act_block, "act_block")
    if input_scale is not None:
        check_static_scale(input_scale, "fp8fx.dequantize: input_scale")
    if q.dtype != quant.FP8_DTYPE:  # a 16-bit weight would be multiplied by a scale as if it held fp8 codes
        raise ValueError(f"fp8fx.dequantize: q is {q.dtype}; it dequantizes {quant.FP8_DTYPE} codes")
    _check_out_dtype("fp8fx.dequantize", "dtype", dtype, reference=True)  # float64: a layer's reference
    if q.dim() < 2:
        raise ValueError(f"fp8fx.dequantize: q has shape {list(q.shape)}; it dequantizes a [N, K] weight (or experts' "
                         "[E, N, K])")
    _check_scale_size("fp8fx.dequantize", "scale", scale, lambda: f"a {list(q.shape)} weight", q.shape, block)


@dequantize.register_fake
def _(q, scale, block, dtype, input_scale=None, act_block=None):
    _check_dequantize_args(q, scale, block, dtype, input_scale, act_block)
    return q.new_empty(q.shape, dtype=dtype)


# the weight view is differentiable in its scale (no gradient reaches fp8 codes): a model whose parameters were set
# requires_grad (model.requires_grad_(), an attribution script's) backpropagates to its inputs, where autograd
# stopped at this op with "no autograd formula was registered"
def _dequantize_setup(ctx, inputs, output) -> None:
    q, scale, block = inputs[:3]
    ctx.save_for_backward(q, scale)
    ctx.block = block


def _dequantize_backward(ctx, grad):
    q, scale = ctx.saved_tensors
    grad_scale = None
    if ctx.needs_input_grad[1]:
        grad_scale = quant.dequantize_scale_grad(grad, q, scale, ctx.block)
        _warn_scale_grad()
    return None, grad_scale, None, None, None, None


_SCALE_GRAD_WARNED = [False]


def _warn_scale_grad() -> None:
    """Once per process: the scales took a gradient, which an optimizer would apply (a fine-tune after
    ``model.requires_grad_()`` drove per-channel scales below 0 in a few dozen AdamW steps, found only at save)."""
    if not _SCALE_GRAD_WARNED[0]:
        _SCALE_GRAD_WARNED[0] = True
        logging.getLogger("fp8fx").warning(
            "fp8fx: fp8 weight scales took a gradient (their parameters require grad: model.requires_grad_()?). An "
            "optimizer step on them changes the fp8 layers and can drive a scale to 0 or below (zero or NaN outputs, "
            "a model save_checkpoint refuses); fp8 layers are for inference: set requires_grad_(False) on the "
            "weight_scale / weight_scale_inv parameters, or fp8fx.dequantize_(model) for a full fine-tune")


dequantize.register_autograd(_dequantize_backward, setup_context=_dequantize_setup)


# --- scaled GEMM ---------------------------------------------------------------------------
@_op("scaled_mm")
def scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_block: list[int],
    w_block: list[int],
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``use_fast_accum`` lets Hopper's fp8 tensor cores skip the periodic promotion of partial
    sums to fp32 (cuBLAS's fast-accumulation mode); the CPU reference always accumulates in fp32.
    Scales are positive finite floats (the loaders and ``quantize`` make no others; reading them here would cost a
    GPU sync a call): with an inf scale the output is undefined, NaN from the reference, which scales each element,
    and +-inf or NaN from the GPU kernels, which scale the sums."""
    _check_scaled_mm_args(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype)
    return quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, bias, out_dtype)


def _check_bias(bias: Optional[torch.Tensor], n: int, what: str) -> None:
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{what}: bias has shape {list(bias.shape)}; it must be [{n}] (one per output column)")
    if bias is not None and bias.dtype not in quant.COMPUTE_DTYPES:  # a complex bias lost its imaginary part
        raise ValueError(f"{what}: bias is {bias.dtype}; it must be bf16, fp16, fp32 or fp64")


def _check_scale_size(what: str, name: str, scale: torch.Tensor, of: Callable[[], str], shape, block) -> None:
    """``scale`` holds as many values as ``block`` over a tensor of ``shape`` (described as ``of()``, formatted only
    for an error: the ops check on every call) needs, and, where they form a grid of several rows and columns of
    blocks, a row of the grid in its last dim: the kernels read it row-major, so a transposed grid ([K/bk, N/bn]
    from a converter) had the count and was read scrambled. Trailing 1s of the grid and of the scale do not count:
    experts' per-channel scales [E, R, 1] (or [E, R]) have R in their last dim that counts, and [R, E] is refused."""
    if scale.dtype not in quant.COMPUTE_DTYPES:  # an int32 scale of 0.02s held 0s: the output was all zeros
        raise ValueError(f"{what}: {name} is {scale.dtype}; scales are float32 (bf16/fp16/fp64 are read as float32)")
    grid = quant.scale_shape(shape, block)
    want = math.prod(grid)
    # where the sizes are symbolic and unbacked (a batch marked so), a check that cannot be decided at trace time is
    # left to the call, which checks real sizes
    if quant.known(scale.numel() != want):
        raise ValueError(f"{what}: {name} has {scale.numel()} elements (shape {list(scale.shape)}); block "
                         f"{list(block)} of {of()} needs {want}")
    row = quant.without_trailing_ones(grid)
    if len(row) > 1 and quant.known(want > row[-1]) and (
            not (last := quant.without_trailing_ones(scale.shape)[-1:]) or quant.known(last[0] != row[-1])):
        raise ValueError(f"{what}: {name} has shape {list(scale.shape)}; block {list(block)} of {of()} needs a grid "
                         f"of scales {list(grid)} (rows of blocks, then one scale a column block, in the last dim): a "
                         "transposed or flattened grid would be read scrambled")


def _check_weight(what: str, x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, w_block) -> None:
    """wq an fp8 [N, K] matrix with x's K, its scale of the size ``w_block`` gives it."""
    if wq.dtype != quant.FP8_DTYPE or wq.dim() != 2:
        raise ValueError(f"{what}: the weight is {wq.dtype} {list(wq.shape)}; it must be a {quant.FP8_DTYPE} [N, K] "
                         "matrix (fp8fx.quantize_ or load_checkpoint makes it)")
    if x.shape[-1] != wq.shape[1]:
        raise ValueError(f"{what}: the activation's K is {x.shape[-1]} ({list(x.shape)}) but the weight is "
                         f"{list(wq.shape)}; they must agree")
    _check_scale_size(what, "w_scale", w_scale, lambda: f"a {list(wq.shape)} weight", wq.shape, w_block)


def _check_scaled_mm_args(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype) -> None:
    """What every real implementation of scaled_mm checks before it computes."""
    check_block(x_block, "x_block")
    check_block(w_block, "w_block")
    _check_rows(xq, "fp8fx.scaled_mm: xq")
    if xq.dtype != quant.FP8_DTYPE:
        raise ValueError(f"fp8fx.scaled_mm: xq is {xq.dtype}; it takes the fp8 codes of the activation "
                         "(fp8fx.quantize / quantize_static), or use fp8fx.weight_only_mm for 16-bit activations")
    _check_weight("fp8fx.scaled_mm", xq, wq, w_scale, w_block)
    _check_scale_size("fp8fx.scaled_mm", "x_scale", x_scale, lambda: f"a {list(xq.shape)} activation",
                      (quant.rows_of(xq), xq.shape[-1]), x_block)  # rows_of: as_rows of a strided xq would copy
    _check_bias(bias, wq.shape[0], "fp8fx.scaled_mm")
    _check_out_dtype("fp8fx.scaled_mm", "out_dtype", out_dtype)


@scaled_mm.register_fake
def _(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum=False):
    _check_scaled_mm_args(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype)
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=out_dtype)


def _tensor_or_row(x_block, w_block) -> bool:
    """Per-tensor or per-row (token / channel) scales on both operands: what cuBLAS's row-wise GEMM takes."""
    return all(tuple(b) in ((-1, -1), (1, -1)) for b in (x_block, w_block))


def _k_groups_agree(x_block, w_block) -> bool:
    """What the Triton GEMM takes for other blocks: it applies K-varying scales per K step, so every operand
    with such scales uses the same group size along K, one ``tl.dot`` K tile (32-256, a power of 2: 1 x 128
    activations with 128 x 128 weight blocks); activation scales per token or per tensor along M (one
    scale row per row of x); weight scales for any number of rows."""
    group_k = {b[1] for b in (x_block, w_block) if b[1] != -1}
    return (
        len(group_k) <= 1
        and group_k <= {32, 64, 128, 256}
        and x_block[0] in (-1, 1)
        and all(b[0] != -1 or b[1] == -1 for b in (x_block, w_block))
    )


# M at or below which the Triton GEMM (fp8fx.kernels.fp8_gemm) beats cuBLAS fp8 for decode.
TRITON_MAX_M = 64


def _scaled_mm_checks(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum=False):
    _check_scaled_mm_args(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype)


@_on_cuda("scaled_mm", checks=_scaled_mm_checks)
def _(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum=False):
    k, n = xq.shape[-1], wq.shape[0]
    x2 = quant.as_rows(xq)  # [M, K]
    m = x2.shape[0]
    if k == 0 or n == 0:  # an empty sum or an empty output: the bias (or zeros), as the reference gives it
        return quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, bias, out_dtype)
    if _tensor_or_row(x_block, w_block) and 0 < m <= TRITON_MAX_M:
        from fp8fx.kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(x2, wq, x_scale, w_scale, bias, out_dtype, fast_accum=use_fast_accum)
    elif _tensor_or_row(x_block, w_block) and _cublas_fits(m, n, k, x_block, w_block, out_dtype):
        y = cublas_scaled_mm(x2, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum)
    elif cublas_block_fits(m, n, k, x_block, w_block, out_dtype):
        y = cublas_block_scaled_mm(x2, x_scale, wq, w_scale, bias, out_dtype)
    elif m > 0 and _k_groups_agree(x_block, w_block):  # block scales, and what cuBLAS refuses
        from fp8fx.kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(x2, wq, x_scale, w_scale, bias, out_dtype, a_block=tuple(x_block), b_block=tuple(w_block))
    else:
        return quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, bias, out_dtype)
    return y.reshape(*xq.shape[:-1], n)


def _cublas_fits(m: int, n: int, k: int, x_block, w_block, out_dtype) -> bool:
    """torch._scaled_mm takes K and N multiples of 16, and row-wise scales only with a bf16 output
    (torch 2.11)."""
    if k % 16 or n % 16 or m == 0:
        return False
    rowwise = tuple(x_block) != (-1, -1) or tuple(w_block) != (-1, -1)
    return out_dtype == torch.bfloat16 or not rowwise


def cublas_scaled_mm(x2, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype, use_fast_accum=False):
    """x2: [M, K] fp8 @ wq: [N, K].T through ``torch._scaled_mm`` (cuBLAS) -> [M, N]. The bias is added to the
    rounded product (the reference and the Triton GEMM add it in float32 before rounding): up to one ulp of
    the output dtype apart."""
    m, n = x2.shape[0], wq.shape[0]
    if tuple(x_block) == (-1, -1) and tuple(w_block) == (-1, -1):
        scale_a, scale_b = x_scale.float().reshape(()), w_scale.float().reshape(())
    else:  # row-wise: scale_a [M, 1], scale_b [1, N]
        scale_a, scale_b = _scale_as(x_scale, (m, 1)), _scale_as(w_scale, (1, n))
    y = torch._scaled_mm(x2.contiguous(), _row_major(wq).t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                         use_fast_accum=use_fast_accum)
    return y if bias is None else y + bias.to(out_dtype)


def _scale_as(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A per-tensor or per-row / per-column scale as the float32 [M, 1] or [1, N] torch._scaled_mm takes; as it is
    where it already is one (``quantize_rows``'s [M, 1] scales: a call's host time counts at prefill), a view of it
    where it holds the values in order (a per-channel [N, 1] weight scale as [1, N]: one op, not four)."""
    if scale.dtype == torch.float32 and scale.is_contiguous():
        if scale.shape == shape:
            return scale
        if scale.numel() == shape[0] * shape[1]:
            return scale.view(shape)
    return scale.float().reshape((-1, 1) if shape[1] == 1 else (1, -1)).expand(shape).contiguous()


def _row_major(wq: torch.Tensor) -> torch.Tensor:
    """cuBLASLt multiplies a row-major A by a column-major B only: a weight stored transposed ([N, K] with
    strides (1, N)) is copied (the Triton GEMM reads either)."""
    return wq if wq.stride(-1) == 1 else wq.contiguous()


def cublas_block_fits(m: int, n: int, k: int, x_block, w_block, out_dtype) -> bool:
    """cuBLAS's 1x128 x 128x128 block-scaled GEMM (``F.scaled_mm``) for prefill, where it was run on the H200
    (runs 7 and 8, Llama-3-8B shapes; N, K multiples of 128; bf16 out): at M = 2048 and 4096 it took
    0.54-0.59x the time of fp8fx's Triton block kernel then, 0.69-0.78x since that kernel loads its scales a step
    ahead and both operands by TMA (run 76, M = 4096). At M = 16 the Triton kernel was as fast or faster
    (gate_up 0.0431 against 0.0493 ms; run 76: 1.18-1.50x cuBLAS's speed at 16 rows, 1.10-1.66x at 64) and cuBLAS
    refuses M = 1, so decode sizes (M <= 64) stay on the Triton kernel, as do ragged blocks, M not a multiple of 16
    and K/128 not a multiple of 4 (torch 2.11's meta check refuses those unpadded)."""
    return (
        hasattr(torch.nn.functional, "scaled_mm")
        and tuple(x_block) == (1, 128) and tuple(w_block) == (128, 128) and out_dtype == torch.bfloat16
        and m > 64 and m % 16 == 0 and n % 128 == 0 and k % 128 == 0
        and (k // 128) % 4 == 0  # torch 2.11 wants scale_b's K/128 rows padded to a multiple of 4
    )


def cublas_block_operands(x2, x_scale, wq, w_scale) -> tuple:
    """``F.scaled_mm``'s block-scaled operands (a, b, scale_a, scale_b) as cuBLAS takes them: A scales
    outer-dim-major, as ``quantize`` returns them (``act_scale_layout``; scales laid out otherwise are copied so, a
    kernel of its own), B scales as [K/128, N/128] (FACTS.md; torch 2.11 checks the strides).
    benchmarks/bench_linear.py lays out its cuBLAS anchor's with it."""
    (m, k), n = x2.shape, wq.shape[0]
    scale_a = x_scale.reshape(m, k // 128)
    if scale_a.dtype != torch.float32 or scale_a.stride() != (1, m):
        scale_a = torch.empty_strided((m, k // 128), (1, m), device=x2.device, dtype=torch.float32)
        scale_a.copy_(x_scale.reshape(m, k // 128))
    scale_b = w_scale.float().reshape(n // 128, k // 128).t()
    return x2.contiguous(), _row_major(wq).t(), scale_a, scale_b


def cublas_block_scaled_mm(x2, x_scale, wq, w_scale, bias, out_dtype):
    """x2: [M, K] fp8 with 1x128 scales [M, K/128] @ wq: [N, K].T with 128x128 scales [N/128, K/128]."""
    F = torch.nn.functional
    a, b, scale_a, scale_b = cublas_block_operands(x2, x_scale, wq, w_scale)
    y = F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise128x128,
                    output_dtype=out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


# --- horizontally fused GEMM (q/k/v, gate/up) ---------------------------------------------
def _adjacent(ts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The single tensor that ``ts`` are back-to-back row slices of (one storage, contiguous), or None."""
    base = ts[0]
    offset = base.storage_offset()
    # row-major strides, compared as they are: is_contiguous() ignores a size-1 dim's stride, so two one-row column
    # halves of one [2, 2K] tensor passed for back-to-back rows, and the fused view read the tensor's second row
    row_major = torch.empty(0, device="meta").new_empty(base.shape).stride()
    for t in ts:
        same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        if not same or t.stride() != row_major or t.storage_offset() != offset or t.shape[1:] != base.shape[1:]:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return base.as_strided((rows, *base.shape[1:]), row_major, base.storage_offset())


# a bias parameter's tag: the storage (data_ptr) of the zero-gapped bias tensor fp8fx.passes.horizontal moved it into
BIAS_GAPS = "_fp8fx_bias_gaps"


def _adjacent_with_gaps(biases: list[Optional[torch.Tensor]], sizes: list[int]) -> Optional[torch.Tensor]:
    """The one ``[sum sizes]`` tensor whose rows the given ``biases`` are, with the shards that have none between
    them, or None. For shards with and without a bias (Whisper's k_proj has none) ``fp8fx.passes.horizontal`` moves
    the biases into one tensor that holds zeros in the gaps and nothing else, and tags each bias with it
    (``BIAS_GAPS``): only that tensor is taken - the layout alone would also take a model's own fused bias whose
    rows between the two are another layer's."""
    base = next(b for b in biases if b is not None)
    storage, total = base.untyped_storage(), sum(sizes)
    if storage.nbytes() != total * base.element_size():
        return None
    offset = 0
    for b, n in zip(biases, sizes):
        if b is not None and (b.untyped_storage().data_ptr() != storage.data_ptr()
                              or getattr(b, BIAS_GAPS, None) != storage.data_ptr() or b.dim() != 1
                              or not b.is_contiguous() or b.storage_offset() != offset or b.dtype != base.dtype):
            return None
        offset += n
    return base.as_strided((total,), (1,), 0)


def _bias_view(biases: list[Optional[torch.Tensor]], sizes: list[int]) -> Optional[torch.Tensor]:
    """The one tensor whose back-to-back rows the shards' biases are (``_adjacent``; with shards that have none,
    ``_adjacent_with_gaps``), or None."""
    if all(b is not None for b in biases):
        return _adjacent(biases)
    return _adjacent_with_gaps(biases, sizes) if any(b is not None for b in biases) else None


def _fused_bias(biases: list[Optional[torch.Tensor]], sizes: list[int]) -> Optional[torch.Tensor]:
    """The bias of the shards' one GEMM: None where no shard has one; the one tensor the biases are rows of
    (``_bias_view``), else their concatenation with zeros for the shards without a bias."""
    present = [b for b in biases if b is not None]
    if not present:
        return None
    view = _bias_view(biases, sizes)
    if view is not None:
        return view
    return torch.cat([b if b is not None else present[0].new_zeros(n) for b, n in zip(biases, sizes)])


def _per_channel(wqs: list[torch.Tensor], ss: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor shard scales as one per-channel scale ``[sum N_i, 1]``: each shard's scale over its rows."""
    return torch.cat([s.float().reshape(1).expand(w.shape[0]) for w, s in zip(wqs, ss)]).reshape(-1, 1)


@_op("scaled_mm_fused")
def scaled_mm_fused(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wqs: list[torch.Tensor],
    w_scales: list[torch.Tensor],
    biases: list[Optional[torch.Tensor]],
    x_block: list[int],
    w_block: list[int],
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``cat([scaled_mm(xq, x_scale, wqs[i], w_scales[i], biases[i], ...)], -1)`` as ONE GEMM when the
    weights (and per-channel or block scales) are back-to-back slices of one tensor, which
    ``fp8fx.passes.horizontal`` arranges (with biases, ``_fused_bias``: a shard without one adds zeros); otherwise
    one GEMM per weight (same result). Per-tensor shards keep their own scales: the one GEMM takes them as a
    per-channel scale vector."""
    _check_fused_args(xq, x_scale, wqs, w_scales, biases, x_block, w_block, out_dtype)
    w = _adjacent(wqs)
    per_tensor = tuple(w_block) == (-1, -1)
    s = _per_channel(wqs, w_scales) if per_tensor else _adjacent([t.reshape(-1, t.shape[-1] if t.dim() else 1)
                                                                   for t in w_scales])  # (a 0-d scale: one block)
    rows = w_block[0]
    # each shard's scale rows stack into the fused weight's: not [-1, G] blocks (one scale row a weight)
    blocks_fit = (rows == 1 or rows == -1 and w_block[1] == -1 or rows > 1
                  and all(wq.shape[0] % rows == 0 for wq in wqs[:-1]))
    if w is not None and s is not None and blocks_fit:
        b = _fused_bias(biases, [wq.shape[0] for wq in wqs])
        return scaled_mm(xq, x_scale, w, s, b, x_block, [1, -1] if per_tensor else w_block, out_dtype, use_fast_accum)
    parts = [
        scaled_mm(xq, x_scale, wq, ws, b, x_block, w_block, out_dtype, use_fast_accum)
        for wq, ws, b in zip(wqs, w_scales, biases)
    ]
    return torch.cat(parts, -1)


def _check_fused_args(xq, x_scale, wqs, w_scales, biases, x_block, w_block, out_dtype) -> None:
    """One scale and one bias (or None) for each of at least one weight, each shard checked as scaled_mm checks
    it (zip cut the longer lists short, and the fake's width disagreed; a shard's bad scale was caught or not
    depending on where its weight lay in memory); the activation, its scale and out_dtype as scaled_mm checks
    them, so the fake refuses what every real call refuses."""
    what = "fp8fx.scaled_mm_fused"
    _check_rows(xq, f"{what}: xq")
    if not (len(wqs) == len(w_scales) == len(biases) >= 1):
        raise ValueError(f"{what}: {len(wqs)} weights, {len(w_scales)} scales and {len(biases)} biases; "
                         "give one scale and one bias (or None) for each of at least one weight")
    check_block(x_block, "x_block")
    check_block(w_block, "w_block")
    if xq.dtype != quant.FP8_DTYPE:
        raise ValueError(f"{what}: xq is {xq.dtype}; it takes the fp8 codes of the activation (fp8fx.quantize / "
                         "quantize_static)")
    _check_scale_size(what, "x_scale", x_scale, lambda: f"a {list(xq.shape)} activation",
                      (quant.rows_of(xq), xq.shape[-1]), x_block)
    _check_out_dtype(what, "out_dtype", out_dtype)
    for i, (wq, ws, b) in enumerate(zip(wqs, w_scales, biases)):
        _check_weight(f"{what} (weight {i})", xq, wq, ws, w_block)
        _check_bias(b, wq.shape[0], f"{what} (weight {i})")


@scaled_mm_fused.register_fake
def _(xq, x_scale, wqs, w_scales, biases, x_block, w_block, out_dtype, use_fast_accum=False):
    _check_fused_args(xq, x_scale, wqs, w_scales, biases, x_block, w_block, out_dtype)
    return xq.new_empty((*xq.shape[:-1], sum(w.shape[0] for w in wqs)), dtype=out_dtype)


# --- gated MLP (decode): gate, up, act * mul, quantization and down in two kernels --------------
# act(g) of the gated MLP: SiLU (Llama, Mistral, Qwen, Phi-3), GELU with erf or its tanh approximation (GeGLU,
# Gemma's gelu_pytorch_tanh)
GATED_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}
# Tokens up to which fp8fx.passes.mlp fuses a gated MLP in two kernels, the down GEMM quantizing h as it loads it.
# Llama-3-8B MLP block on the H200 (run 10, CUDA-graph replays): fused vs unfused 0.0682 vs 0.0756 ms at M=1,
# 0.0694 vs 0.0771 at M=16, but 0.1347 vs 0.0775 at M=64, where each of the down GEMM's N tiles re-reads (and
# re-quantizes) the whole [64, I] intermediate. Per-tensor and static h stop here.
GATED_MAX_M = 16
# Per-token h from GATED_ROWS_MIN_M tokens up to GATED_ROWS_MAX_M: three kernels (``fp8fx.kernels.gated_mlp``: h
# leaves the gate/up kernel 16-bit and ``quantize_rows`` quantizes it once for the down GEMM). Llama-3-8B MLP block
# on the H200 (run 29, CUDA-graph replays): 0.0627 ms at 64 tokens against 0.0688 unfused, 0.0600 at 32 against
# 0.0774-0.0806; the range's other token counts not timed.
GATED_ROWS_MIN_M, GATED_ROWS_MAX_M = GATED_MAX_M + 1, 64
# The intermediate h quantized in 1 x G groups (Fp8Backend(mlp_h_group=G)) instead: the gate/up kernel's epilogue
# writes its fp8 codes, so the down GEMM reads fp8 and no N tile re-quantizes h. Fused up to 64 tokens (the
# Triton GEMMs' range); the op alone on the H200 (run 17, tune_gemm.py --groups, G = 128): 0.0631 ms at M=64
# against 0.1304 with per-token h; 0.0524 vs 0.0541 at M=1, 0.0565 vs 0.0578 at M=16.
GATED_GROUPS_MAX_M = 64
GATED_H_GROUPS = (32, 64, 128)  # the group sizes the kernels take (a group is one N tile of the gate/up kernel)
# Tokens from which the gated MLP with per-token h runs its prefill kernels (``fp8fx.kernels.gated_mlp.gated_prefill``:
# act * mul in the gate/up GEMM's epilogue, a streaming quantization of h, cuBLAS's down GEMM). Llama-3-8B MLP block
# on the H200 through Fp8Backend(fuse_mlp=True), plain calls (run 23 call 4, bench_linear.py, 7 interleaved rounds):
# 0.6028 ms against 0.6435 unfused at M=2048, 1.1984 against 1.2609 at 4096 - but 0.4166 against 0.3429 at 1024,
# where the op's host time (its checks, two Triton launches, cuBLAS) outlasts the GPU's: the kernels alone, called
# one by one, took 0.3041 ms there against 0.3521 (call 3). With CUDA graphs 1024 would gain; not timed.
GATED_PREFILL_MIN_M = 2048


def _h_group(h_block, w2_block) -> int:
    """G where h is quantized in 1 x G groups the fused kernels take (``GATED_H_GROUPS``) and down's weight scale
    is per tensor or per channel, else 0."""
    h_block = tuple(h_block)
    ok = h_block[0] == 1 and h_block[1] in GATED_H_GROUPS and tuple(w2_block) in ((-1, -1), (1, -1))
    return h_block[1] if ok else 0


def _check_gated_mlp_args(xq, w1, w3, w2, bias, x_block, w_block, h_block, w2_block, h_static, act) -> None:
    for block, what in ((x_block, "x_block"), (w_block, "w_block"), (h_block, "h_block"), (w2_block, "w2_block")):
        check_block(block, what)
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"fp8fx.gated_mlp: act={act!r}; one of {list(GATED_ACTIVATIONS)}")
    _check_rows(xq, "fp8fx.gated_mlp: xq")
    k, i = xq.shape[-1], w1.shape[0]
    if tuple(w1.shape) != (i, k) or tuple(w3.shape) != (i, k) or w2.dim() != 2 or w2.shape[1] != i:
        raise ValueError(f"fp8fx.gated_mlp: x [..., {k}], gate {list(w1.shape)}, up {list(w3.shape)}, down "
                         f"{list(w2.shape)}: gate and up must be [I, {k}], down [N, I]")
    if h_static is not None:
        check_static_scale(h_static, "fp8fx.gated_mlp: h_static")
    if h_static is not None and tuple(h_block) != (-1, -1):
        raise ValueError(f"fp8fx.gated_mlp: h_static (a static per-tensor scale) with h_block={list(h_block)}; a "
                         "static scale is per tensor: h_block=[-1, -1]")
    _check_bias(bias, w2.shape[0], "fp8fx.gated_mlp")


def _check_gated_mlp_tensors(xq, x_scale, w1, s1, w3, s3, w2, s2, x_block, w_block, w2_block, h_dtype,
                             out_dtype) -> None:
    """What every real implementation of gated_mlp checks before it computes (the CUDA kernels read scales by
    their layout: a one-element scale with a per-row block would be read as per-tensor)."""
    what = "fp8fx.gated_mlp"
    if xq.dtype != quant.FP8_DTYPE:
        raise ValueError(f"{what}: xq is {xq.dtype}; it takes the fp8 codes of the activation (fp8fx.quantize)")
    _check_scale_size(what, "x_scale", x_scale, lambda: f"a {list(xq.shape)} activation",
                      (quant.rows_of(xq), xq.shape[-1]), x_block)
    _check_weight(f"{what} (gate)", xq, w1, s1, w_block)
    _check_weight(f"{what} (up)", xq, w3, s3, w_block)
    if w2.dtype != quant.FP8_DTYPE:
        raise ValueError(f"{what} (down): the weight is {w2.dtype}; it must be {quant.FP8_DTYPE}")
    _check_scale_size(f"{what} (down)", "w_scale", s2, lambda: f"a {list(w2.shape)} weight", w2.shape, w2_block)
    _check_out_dtype(what, "h_dtype", h_dtype)
    _check_out_dtype(what, "out_dtype", out_dtype)


def _gated_mlp_reference(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static,
                         act, h_dtype, out_dtype, use_fast_accum):
    """The unfused ops, as the linear pass emits them: the model's own act * mul (in ``h_dtype``)."""
    g = scaled_mm(xq, x_scale, w1, s1, None, x_block, w_block, h_dtype, use_fast_accum)
    u = scaled_mm(xq, x_scale, w3, s3, None, x_block, w_block, h_dtype, use_fast_accum)
    h = GATED_ACTIVATIONS[act](g) * u
    if h_static is not None:
        hq, h_scale = quantize_static(h, h_static), h_static
    else:
        hq, h_scale = quantize(h, h_block)
    return scaled_mm(hq, h_scale, w2, s2, bias, h_block, w2_block, out_dtype, use_fast_accum)


def gated_prefill_reason(m: int, k: int, i: int, n: int, x_block, w_block, h_block, w2_block, h_static, h_dtype,
                         out_dtype, device: Optional[torch.device] = None) -> str:
    """Why a gated MLP of ``m`` tokens, x [m, k], gate / up [i, k], down [n, i] on ``device`` does not take the
    prefill kernels (``GATED_PREFILL_MIN_M``), or "" where it does."""
    if m < GATED_PREFILL_MIN_M:
        return f"{m} tokens: the prefill kernels start at {GATED_PREFILL_MIN_M}"
    if not _tensor_or_row(x_block, w_block) or tuple(w2_block) not in ((-1, -1), (1, -1)):
        return f"blocks x {list(x_block)}, w {list(w_block)}, down {list(w2_block)}: per-tensor / per-row scales only"
    if h_static is not None or tuple(h_block) != (1, -1):
        return "h is quantized per tensor or with a static scale: the prefill kernels quantize it per token"
    if h_dtype not in (torch.bfloat16, torch.float16) or out_dtype != torch.bfloat16:
        return f"h in {h_dtype}, out in {out_dtype}: the prefill kernels take a 16-bit h and a bf16 output"
    if k % 16 or i % 16 or n % 16:
        return f"K={k}, I={i}, N={n}: the prefill kernels' copies and cuBLAS take multiples of 16"
    capability = launch.capability(device) if device is not None and device.type == "cuda" else None
    if capability is not None and capability < (9, 0):
        return f"the prefill kernels need sm_90 (TMA copies, wgmma); this GPU is sm_{capability[0]}{capability[1]}"
    return ""


@_op("gated_mlp")
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
    x_block: list[int],
    w_block: list[int],
    h_block: list[int],
    w2_block: list[int],
    h_static: Optional[torch.Tensor],
    act: str,
    h_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``scaled_mm(quantize(act(g) * u), w2) + bias`` with ``g``, ``u`` = ``scaled_mm(xq, w1 / w3)`` in
    ``h_dtype``, h quantized with ``h_block`` (or the static ``h_static``): a gated MLP after the linear pass
    (``fp8fx.passes.mlp``, up to ``GATED_MAX_M`` tokens, ``GATED_ROWS_MAX_M`` with h per token,
    ``GATED_GROUPS_MAX_M`` with h in groups, and from
    ``GATED_PREFILL_MIN_M``; the prefill kernels keep g, u and act(g) in float32, ``gated_mlp.gated_prefill``). On
    CUDA for M <= ``TRITON_MAX_M`` with per-tensor / per-row scales, h also in 1 x G groups (``GATED_H_GROUPS``): two
    kernels (``fp8fx.kernels.gated_mlp``; three with per-token h from ``GATED_ROWS_MIN_M`` tokens); from
    ``GATED_PREFILL_MIN_M`` with per-token h (``gated_prefill_reason``) the prefill kernels
    (``gated_mlp.gated_prefill``, ``quantize_rows``, cuBLAS's down); otherwise these same ops one by one."""
    _check_gated_mlp_args(xq, w1, w3, w2, bias, x_block, w_block, h_block, w2_block, h_static, act)
    _check_gated_mlp_tensors(xq, x_scale, w1, s1, w3, s3, w2, s2, x_block, w_block, w2_block, h_dtype, out_dtype)
    return _gated_mlp_reference(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block,
                                h_static, act, h_dtype, out_dtype, use_fast_accum)


def _gated_mlp_checks(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static, act,
                      h_dtype, out_dtype, use_fast_accum=False):
    _check_gated_mlp_args(xq, w1, w3, w2, bias, x_block, w_block, h_block, w2_block, h_static, act)
    _check_gated_mlp_tensors(xq, x_scale, w1, s1, w3, s3, w2, s2, x_block, w_block, w2_block, h_dtype, out_dtype)


@gated_mlp.register_fake
def _(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static, act, h_dtype,
      out_dtype, use_fast_accum=False):
    _gated_mlp_checks(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static, act,
                      h_dtype, out_dtype)
    return xq.new_empty((*xq.shape[:-1], w2.shape[0]), dtype=out_dtype)


@_on_cuda("gated_mlp", checks=_gated_mlp_checks)
def _(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static, act, h_dtype,
      out_dtype, use_fast_accum=False):
    x2 = quant.as_rows(xq)
    m = x2.shape[0]
    if 0 in (m, x2.shape[1], w1.shape[0], w2.shape[0]):  # empty: no tile, descriptor or scale layout takes it
        return _gated_mlp_reference(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block,
                                    h_static, act, h_dtype, out_dtype, use_fast_accum)
    if not gated_prefill_reason(m, x2.shape[1], w1.shape[0], w2.shape[0], x_block, w_block, h_block, w2_block,
                                h_static, h_dtype, out_dtype, x2.device):
        from fp8fx.kernels.gated_mlp import prefill_mlp

        y = prefill_mlp(x2, x_scale, w1, s1, w3, s3, w2, s2, bias, w2_block, h_dtype, out_dtype, act, use_fast_accum)
        return y if xq.dim() == 2 else y.reshape(*xq.shape[:-1], w2.shape[0])
    h_group = _h_group(h_block, w2_block) if h_static is None else 0
    if not (0 < m <= TRITON_MAX_M and _tensor_or_row(x_block, w_block)
            and (_tensor_or_row(h_block, w2_block) or h_group)):
        return _gated_mlp_reference(xq, x_scale, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block,
                                    h_static, act, h_dtype, out_dtype, use_fast_accum)
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, gated_mlp as two_kernels

    if h_static is not None:
        h_quant = kernels.QUANT_STATIC
    elif h_group:
        h_quant = QUANT_GROUPS
    else:
        h_quant = kernels.QUANT_TENSOR if tuple(h_block) == (-1, -1) else kernels.QUANT_ROWS
    y = two_kernels(x2, x_scale, w1, s1, w3, s3, w2, s2, bias, h_quant, h_static, h_dtype, out_dtype, act,
                    use_fast_accum, h_group=h_group)
    return y.reshape(*xq.shape[:-1], w2.shape[0])


# --- weight-only GEMM (GPUs without fp8 tensor cores) --------------------------------------
def _weight_only_reference(x, wq, w_scale, bias, w_block):
    y = quant.float32_mm(quant.as_rows(x).float(), quant.dequantize(wq, w_scale, w_block).t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])


def _check_weight_only_x(x: torch.Tensor) -> None:
    _check_rows(x, "fp8fx.weight_only_mm: x")
    if x.dtype not in quant.HIGH_PRECISION:  # fp8 codes would be multiplied without their scale
        raise ValueError(f"fp8fx.weight_only_mm: x is {x.dtype}; it takes bf16/fp16/fp32 activations (for fp8 "
                         "activation codes and their scale, use fp8fx.scaled_mm)")


def _check_weight_only_args(x, wq, w_scale, bias, w_block) -> None:
    """What every real implementation of weight_only_mm checks before it computes."""
    check_block(w_block, "w_block")
    _check_weight_only_x(x)
    _check_weight("fp8fx.weight_only_mm", x, wq, w_scale, w_block)
    _check_bias(bias, wq.shape[0], "fp8fx.weight_only_mm")


@_op("weight_only_mm")
def weight_only_mm(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], w_block: list[int]
) -> torch.Tensor:
    """``y [..., N] = x @ dequant(wq).T + bias`` in x's dtype: fp8 weights, 16-bit activations and math."""
    _check_weight_only_args(x, wq, w_scale, bias, w_block)
    return _weight_only_reference(x, wq, w_scale, bias, w_block)


@weight_only_mm.register_fake
def _(x, wq, w_scale, bias, w_block):
    _check_weight_only_args(x, wq, w_scale, bias, w_block)
    return x.new_empty((*x.shape[:-1], wq.shape[0]))


@_on_cuda("weight_only_mm")
def _(x, wq, w_scale, bias, w_block):
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    _check_weight_only_args(x, wq, w_scale, bias, w_block)
    x2 = quant.as_rows(x)
    # the Triton GEMM applies K-varying weight scales per K step (its K tile: a group of 32-256, a power of 2)
    if (0 in x2.shape or wq.shape[0] == 0 or x.dtype not in (torch.bfloat16, torch.float16)
            or not _k_groups_agree([-1, -1], w_block)):
        return _weight_only_reference(x, wq, w_scale, bias, w_block)
    y = fp8_gemm(x2.contiguous(), wq, None, w_scale, bias, x.dtype, b_block=tuple(w_block))
    return y.reshape(*x.shape[:-1], wq.shape[0])


# --- composition (eager W8A8 reference of what the linear pass emits) -----------------------
def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    w_block: Sequence[int],
    act_block: Sequence[int],
    input_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32) -> quantize activations -> fp8 GEMM -> [..., N] in x.dtype."""
    if input_scale is not None:
        xq, x_scale, act_block = quantize_static(x, input_scale), input_scale, [-1, -1]
    else:
        xq, x_scale = quantize(x, list(act_block))
    return scaled_mm(xq, x_scale, wq, w_scale, bias, list(act_block), list(w_block), x.dtype)


# =============================================================================================
# MoE: fused_moe (owned by the MoE work, issue 5; fp8fx.passes.moe emits it)
# =============================================================================================
# fused_moe(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype,
#           a13_scale=None, a2_scale=None, use_fast_accum=False, w13_bias=None, w2_bias=None, interleaved=False,
#           activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, gated=True) -> out [T, H] in out_dtype
#
#   x: [T, H] (bf16/fp16/fp32); topk_ids: [T, K] int (the experts each token is routed to; ids outside
#   [0, E) contribute nothing: expert-parallel sentinels); topk_weights: [T, K] (routing weights).
#   w13: [E, 2I, H] fp8 (rows [0, I) gate, [I, 2I) up; ``interleaved``: rows 2j gate j, 2j + 1 up j, as GPT-OSS
#   stores them), w2: [E, H, I] fp8; their scales are laid out ``[E, rows/bR, cols/bC]`` for ``w_block`` (any
#   shape of that numel: per-tensor [E], per-channel [E, rows, 1], blocks [E, rows/bn, cols/bk]).
#   w13_bias: [E, 2I] (w13's rows' order), w2_bias: [E, H]: each expert's biases, added before the activation
#   and before the routing weight.
#
#   out[t] = sum_k topk_weights[t, k] * (w2[e] @ q(act(g, u)) + b2[e]),  (g, u) = w13[e] @ q(x[t]) + b13[e],
#   e = topk_ids[t, k];  act = "silu": silu(g) * u;  with g' = min(g, limit), u' = clamp(u, -limit, limit):
#   "swiglu_oai" (GPT-OSS, vLLM's swigluoai) g' * sigmoid(alpha * g') * (u' + 1), "silu_clamped" (DeepSeek-V4's
#   swiglu_limit) silu(g') * u';  "gelu_tanh" (Gemma-4): gelu(g, approximate="tanh") * u;  "gelu": gelu(g) * u (erf);
#   "relu2": relu(g)**2 * u.  ``gated=False`` (ungated experts, Nemotron-H's ``down(act(up(x)))``): w13 is [E, I, H],
#   up alone, and act = silu(u), gelu_tanh(u), gelu(u) or relu2(u) (``UNGATED_ACTIVATIONS``; no bias split, no
#   interleaving).
#
# where q() quantizes activations to fp8 as ``act_block`` says (per token [1, -1], 1 x bk groups, per
# tensor [-1, -1]; with a static ``a13_scale`` / ``a2_scale`` [1]: that per-tensor scale): x once per
# token, the intermediate once per (token, expert) row. GEMMs accumulate in float32 (``use_fast_accum``:
# Hopper's fast fp8 accumulation, as for scaled_mm), biases, the activation and the weighted sum are float32.
MOE_ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamped", "gelu_tanh", "gelu", "relu2")
UNGATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2")  # one-input functions: what ungated experts may use


def _moe_quantize_act(a: torch.Tensor, act_block, static_scale: Optional[torch.Tensor]):
    """a: [M, C] -> (dequantized a as the GEMM sees it: float32 [M, C])."""
    if static_scale is not None:
        q = quant.quantize_with_scale(a, static_scale, [-1, -1])
        return quant.dequantize(q, static_scale, [-1, -1])
    q, scale = quant.quantize(a, act_block)
    return quant.dequantize(q, scale, act_block)


def moe_activation(g1: torch.Tensor, interleaved: bool, activation: str, alpha: float, limit: float,
                   gated: bool = True) -> torch.Tensor:
    """fused_moe's activation of the first GEMM's output ``g1`` [..., 2I] (biases added): [..., I]; ungated, of
    ``g1`` [..., I] itself."""
    f = torch.nn.functional
    unary = {"silu": f.silu, "gelu": f.gelu, "gelu_tanh": functools.partial(f.gelu, approximate="tanh"),
             "relu2": lambda v: f.relu(v).square()}.get(activation)  # (UNGATED_ACTIVATIONS)
    if not gated:
        return unary(g1)
    gate, up = (g1[..., 0::2], g1[..., 1::2]) if interleaved else g1.chunk(2, dim=-1)
    if unary is not None:
        return unary(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if activation == "silu_clamped":
        return f.silu(gate) * up
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def fused_moe_reference(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale=None,
    a2_scale=None, w13_bias=None, w2_bias=None, interleaved=False, activation="silu", swiglu_alpha=1.702,
    swiglu_limit=7.0, gated=True,
) -> torch.Tensor:
    """The semantics of ``fp8fx.fused_moe`` in plain torch (float32), one expert at a time."""
    t, h = x.shape
    n_experts, rows13, _ = w13.shape
    inter_size = rows13 // 2 if gated else rows13
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)  # [S], S = T * K pairs, token-major
    token = torch.arange(t * k, device=x.device) // k  # [S]
    xd = _moe_quantize_act(x.float(), act_block, a13_scale)  # [T, H]
    s13 = w13_scale.reshape(quant.scale_shape(w13.shape, w_block))  # [E, 2I/bR, H/bC]
    s2 = w2_scale.reshape(quant.scale_shape(w2.shape, w_block))  # [E, H/bR, I/bC]
    experts = [e for e in ids.unique().tolist() if 0 <= e < n_experts]
    inter = x.new_zeros((t * k, inter_size), dtype=torch.float32)  # [S, I]
    for e in experts:
        rows = (ids == e).nonzero().flatten()
        g1 = quant.float32_mm(xd[token[rows]], quant.dequantize(w13[e], s13[e], w_block).t())
        if w13_bias is not None:
            g1 = g1 + w13_bias[e].float()
        inter[rows] = moe_activation(g1, interleaved, activation, swiglu_alpha, swiglu_limit, gated)
    inter = _moe_quantize_act(inter, act_block, a2_scale)
    y = x.new_zeros((t * k, h), dtype=torch.float32)  # [S, H]
    for e in experts:
        rows = (ids == e).nonzero().flatten()
        y[rows] = quant.float32_mm(inter[rows], quant.dequantize(w2[e], s2[e], w_block).t())
        if w2_bias is not None:
            y[rows] += w2_bias[e].float()
    # pairs routed to no expert contribute nothing, whatever their weight (a NaN one too, as in the kernel)
    routed = ((ids >= 0) & (ids < n_experts)).unsqueeze(-1)
    weights = torch.where(routed, topk_weights.reshape(-1, 1).float(), 0.0)  # [S, 1]
    return (y * weights).reshape(t, k, h).sum(dim=1).to(out_dtype)


@_op("fused_moe")
def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w_block: list[int],
    act_block: list[int],
    out_dtype: torch.dtype,
    a13_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gated: bool = True,
) -> torch.Tensor:
    _check_moe_args(x, topk_weights, topk_ids, w13, w2, w_block, act_block, w13_scale, w2_scale, a13_scale, a2_scale,
                    out_dtype, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, interleaved, gated)
    return fused_moe_reference(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale, a2_scale,
        w13_bias, w2_bias, interleaved, activation, swiglu_alpha, swiglu_limit, gated,
    )


@fused_moe.register_fake
def _(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale=None,
      a2_scale=None, use_fast_accum=False, w13_bias=None, w2_bias=None, interleaved=False, activation="silu",
      swiglu_alpha=1.702, swiglu_limit=7.0, gated=True):
    _check_moe_args(x, topk_weights, topk_ids, w13, w2, w_block, act_block, w13_scale, w2_scale, a13_scale, a2_scale,
                    out_dtype, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, interleaved, gated)
    return x.new_empty((x.shape[0], w2.shape[1]), dtype=out_dtype)


EXPERT_ID_DTYPES = (torch.int32, torch.int64)  # what fused_moe's topk_ids may be


def _check_moe_args(x, topk_weights, topk_ids, w13, w2, w_block, act_block, w13_scale, w2_scale, a13_scale,
                    a2_scale, out_dtype, w13_bias=None, w2_bias=None, activation="silu", swiglu_alpha=1.702,
                    swiglu_limit=7.0, interleaved=False, gated=True) -> None:
    """What every real implementation of fused_moe checks before it computes."""
    check_block(w_block, "w_block")
    check_block(act_block, "act_block")
    if not gated and (interleaved or activation not in UNGATED_ACTIVATIONS):
        raise ValueError(f"fp8fx.fused_moe: gated=False with interleaved={interleaved}, activation={activation!r}; "
                         f"ungated experts have no gate rows to interleave, and act is one of "
                         f"{list(UNGATED_ACTIVATIONS)} of up")
    _check_moe_shapes(x, topk_weights, topk_ids, w13, w2, gated)
    if topk_ids.dtype not in EXPERT_ID_DTYPES:  # the CUDA routing computes in the ids' dtype
        raise ValueError(f"fp8fx.fused_moe: topk_ids is {topk_ids.dtype}; expert ids are int32 or int64")
    if x.dtype not in quant.HIGH_PRECISION:  # fp8 codes would be used without their scale
        raise ValueError(f"fp8fx.fused_moe: x is {x.dtype}; it takes bf16/fp16/fp32 activations (it quantizes them)")
    if topk_weights.dtype not in quant.HIGH_PRECISION:
        raise ValueError(f"fp8fx.fused_moe: topk_weights is {topk_weights.dtype}; routing weights are bf16/fp16/fp32")
    for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if w.dtype != quant.FP8_DTYPE:
            raise ValueError(f"fp8fx.fused_moe: {name} is {w.dtype}; the experts' weights must be {quant.FP8_DTYPE} "
                             "(fp8fx.quantize_ or load_checkpoint makes them)")
        _check_scale_size("fp8fx.fused_moe", f"{name}_scale", scale, lambda: f"{name} {list(w.shape)}", w.shape,
                          w_block)
    for name, scale in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if scale is not None:  # one positive finite value (0 made every output 0, Inf / NaN every output NaN)
            check_static_scale(scale, f"fp8fx.fused_moe: {name}")
    for name, scale, of in (("a13_scale", a13_scale, "x"), ("a2_scale", a2_scale, "the intermediate")):
        if scale is not None and tuple(act_block) != (-1, -1):  # (the block was ignored: quantized per tensor)
            raise ValueError(f"fp8fx.fused_moe: {name} (a static per-tensor scale of {of}) with act_block="
                             f"{list(act_block)}; a static scale is per tensor: act_block=[-1, -1]")
    _check_out_dtype("fp8fx.fused_moe", "out_dtype", out_dtype)
    e, rows13, h = w13.shape
    for name, bias, shape in (("w13_bias", w13_bias, (e, rows13)), ("w2_bias", w2_bias, (e, h))):
        if bias is None:
            continue
        torch._check(tuple(bias.shape) == shape, lambda: f"fp8fx.fused_moe: {name} has shape {list(bias.shape)}; it "
                     f"must be {list(shape)} (each expert's bias, in its weight's row order)")
        if bias.dtype not in quant.COMPUTE_DTYPES:
            raise ValueError(f"fp8fx.fused_moe: {name} is {bias.dtype}; biases are bf16, fp16, fp32 or fp64")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"fp8fx.fused_moe: activation={activation!r}; it computes {list(MOE_ACTIVATIONS)}")
    if activation in ("swiglu_oai", "silu_clamped") and not (math.isfinite(swiglu_alpha) and swiglu_limit > 0):
        raise ValueError(f"fp8fx.fused_moe: swiglu_alpha={swiglu_alpha}, swiglu_limit={swiglu_limit}; the clamped "
                         "SwiGLU takes a finite alpha and a limit > 0 (GPT-OSS: 1.702 and 7.0)")


def _check_moe_shapes(x, topk_weights, topk_ids, w13, w2, gated=True) -> None:
    shape13 = "[E, 2I, H]" if gated else "[E, I, H]"
    if w13.dim() != 3:  # (one expert's [2I, H] slice: a bare unpacking error before)
        raise ValueError(f"fp8fx.fused_moe: w13 has shape {list(w13.shape)}; it must be {shape13}, every expert's "
                         + ("gate and up rows" if gated else "up rows (gated=False)"))
    e, rows13, h = w13.shape
    torch._check(x.dim() == 2 and x.shape[1] == h, lambda: f"fp8fx.fused_moe: x {tuple(x.shape)} is not [T, {h}]")
    torch._check(
        not gated or rows13 % 2 == 0,
        lambda: f"fp8fx.fused_moe: w13 {tuple(w13.shape)} has an odd number of rows; it must be [E, 2I, H] "
        "(gate rows, then up rows)",
    )
    torch._check(
        tuple(w2.shape) == (e, h, rows13 // 2 if gated else rows13),
        lambda: f"fp8fx.fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not {shape13} and [E, H, I]",
    )
    torch._check(
        topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
        lambda: f"fp8fx.fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
        f"are not both [T={x.shape[0]}, K]",
    )


@_on_cuda("fused_moe")
def _(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale=None,
      a2_scale=None, use_fast_accum=False, w13_bias=None, w2_bias=None, interleaved=False, activation="silu",
      swiglu_alpha=1.702, swiglu_limit=7.0, gated=True):
    from fp8fx.kernels import fused_moe as kernel  # triton is imported only when a CUDA MoE runs

    _check_moe_args(x, topk_weights, topk_ids, w13, w2, w_block, act_block, w13_scale, w2_scale, a13_scale, a2_scale,
                    out_dtype, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, interleaved, gated)
    form = dict(w13_bias=w13_bias, w2_bias=w2_bias, interleaved=interleaved, activation=activation,
                swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, gated=gated)
    # the kernel's fp8 x fp8 dots need fp8 tensor cores
    if kernel.supports(w_block, act_block, tuple(w13.shape), interleaved, gated) \
            and launch.has_fp8_tensor_cores(x.device):
        return kernel.fused_moe(
            x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale, a2_scale,
            fast_accum=use_fast_accum, **form,
        )
    # older GPUs, no experts, and what the kernel does not take (K groups other than 32, 64, 128): the (slow,
    # per-expert) reference
    return fused_moe_reference(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, w_block, act_block, out_dtype, a13_scale, a2_scale,
        **form,
    )


# --- top-k of short rows (fp8fx.passes.topk emits it: an MoE router's k experts) ----------------------------
@_op("topk")
def topk(x: torch.Tensor, k: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1, largest=largest, sorted=True)``: (values, int64 indices) [..., k]. On CUDA one
    launch of ``fp8fx.kernels.topk`` (of equal values the lower index first) where its ``reason`` is empty; here and
    elsewhere torch's."""
    _check_topk(x, k)
    return torch.topk(x, k, dim=-1, largest=largest, sorted=True)


def _check_topk(x: torch.Tensor, k: int, name: str = "topk") -> None:
    torch._check(x.dim() >= 1 and 0 <= k <= x.shape[-1], lambda: f"fp8fx.{name}: k={k} of a last dim of "
                 f"{tuple(x.shape)[-1:] or '(a 0-d tensor)'}; k must be in [0, the last dim's size]")


@topk.register_fake
def _(x, k, largest=True):
    _check_topk(x, k)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


@_on_cuda("topk")
def _(x, k, largest=True):
    from fp8fx.kernels import topk as kernel  # triton is imported only when a CUDA top-k runs

    _check_topk(x, k)
    if kernel.reason(x, k):  # (the pass emits the op only where the kernel takes it; a direct caller may not)
        return torch.topk(x, k, dim=-1, largest=largest, sorted=True)
    return kernel.topk(x, k, largest)


# --- a softmax router's top-k and weights in one launch (fp8fx.passes.topk emits it) --------------------------------
@_op("softmax_topk")
def softmax_topk(x: torch.Tensor, k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """An MoE router's (weights, int64 expert ids) [..., k] from its logits x: the ids of the k largest logits of the
    last dim, sorted; the weights ``softmax(x.float(), -1)`` at those ids, divided by their sum where
    ``renormalize`` (equal to the softmax of the k top logits), in ``out_dtype``. On CUDA one launch of
    ``fp8fx.kernels.topk`` (ties to the lower index) where its ``reason`` is empty; here and elsewhere torch's."""
    _check_softmax_topk(x, k, out_dtype)
    return _softmax_topk(x, k, renormalize, out_dtype)


def _softmax_topk(x: torch.Tensor, k: int, renormalize: bool, out_dtype: torch.dtype):
    ids = torch.topk(x, k, dim=-1, sorted=True).indices
    if renormalize:
        weights = torch.softmax(torch.gather(x, -1, ids).float(), -1)
    else:
        weights = torch.gather(torch.softmax(x.float(), -1), -1, ids)
    return weights.to(out_dtype), ids


def _check_softmax_topk(x: torch.Tensor, k: int, out_dtype: torch.dtype) -> None:
    _check_topk(x, k, "softmax_topk")
    if x.dtype not in quant.HIGH_PRECISION or out_dtype not in quant.HIGH_PRECISION:
        raise ValueError(f"fp8fx.softmax_topk: logits {x.dtype}, out_dtype {out_dtype}; both bf16, fp16 or fp32")


@softmax_topk.register_fake
def _(x, k, renormalize, out_dtype):
    _check_softmax_topk(x, k, out_dtype)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=out_dtype), x.new_empty(shape, dtype=torch.int64)


@_on_cuda("softmax_topk")
def _(x, k, renormalize, out_dtype):
    from fp8fx.kernels import topk as kernel  # triton is imported only when a CUDA top-k runs

    _check_softmax_topk(x, k, out_dtype)
    if kernel.reason(x, k):  # (the pass emits the op only where the kernel takes it; a direct caller may not)
        return _softmax_topk(x, k, renormalize, out_dtype)
    return kernel.softmax_topk(x, k, renormalize, out_dtype)


# --- a sigmoid router's grouped top-k and weights in one launch (fp8fx.passes.topk emits it: DeepSeek-V3's) ---------
@_op("grouped_topk")
def grouped_topk(x: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_group: int, renormalize: bool,
                 eps: float, scale: float, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid router's (float32 weights, int64 expert ids) [..., k] from its float32 logits x [..., E], as
    DeepSeek-V3's HF router computes them: ``choice = sigmoid(x) + bias``; each of ``groups`` groups of E / groups
    experts scored by its two largest choices, summed; the ``topk_group`` best groups kept, the others' choices
    ``fill``; the k experts of the largest choices (sorted; of equal groups or choices the lower index, a NaN first);
    their ``sigmoid(x)``, divided by its sum + ``eps`` where ``renormalize``, times ``scale``. On CUDA one launch of
    ``fp8fx.kernels.topk`` where its ``grouped_reason`` is empty; here and elsewhere the same ranking in torch code (a
    stable sort), not ``torch.topk``'s, which of equal choices may take others than the lower index."""
    _check_grouped_topk(x, bias, k, groups, topk_group)
    return _grouped_topk(x, bias, k, groups, topk_group, renormalize, eps, scale, fill)


def _grouped_topk(x, bias, k, groups, topk_group, renormalize, eps, scale, fill):
    def top(v, n):  # the n largest's indices, sorted, of equals the lower index (a NaN first), as the kernel ranks
        return v.sort(dim=-1, descending=True, stable=True).indices[..., :n].contiguous()  # (the fake's strides)

    scores = x.float().sigmoid()
    choice = scores + bias
    if topk_group < groups:
        grid = choice.unflatten(-1, (groups, -1))
        group_score = grid.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_score).scatter(-1, top(group_score, topk_group), 1).bool()
        choice = choice.masked_fill(~kept.unsqueeze(-1).expand_as(grid).flatten(-2), fill)
    ids = top(choice, k)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scale, ids


def _check_grouped_topk(x, bias, k, groups, topk_group) -> None:
    e = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or bias.shape != (e,) or x.dtype != torch.float32 or bias.dtype not in quant.HIGH_PRECISION:
        raise ValueError(f"fp8fx.grouped_topk: logits {tuple(x.shape)} {x.dtype}, bias {tuple(bias.shape)} "
                         f"{bias.dtype}; float32 logits [..., E] and a bias [E] of bf16, fp16 or fp32")
    if groups < 1 or e % groups or not 1 <= topk_group <= groups or not 1 <= k <= e or groups > 1 and e // groups < 2:
        raise ValueError(f"fp8fx.grouped_topk: k={k}, {topk_group} of {groups} groups of {e} experts; groups must "
                         "divide the experts (2 or more each), 1 <= topk_group <= groups, 1 <= k <= experts")


@grouped_topk.register_fake
def _(x, bias, k, groups, topk_group, renormalize, eps, scale, fill):
    _check_grouped_topk(x, bias, k, groups, topk_group)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)


@_on_cuda("grouped_topk")
def _(x, bias, k, groups, topk_group, renormalize, eps, scale, fill):
    from fp8fx.kernels import topk as kernel  # triton is imported only when a CUDA top-k runs

    _check_grouped_topk(x, bias, k, groups, topk_group)
    if kernel.grouped_reason(x, k, groups, topk_group):
        return _grouped_topk(x, bias, k, groups, topk_group, renormalize, eps, scale, fill)
    return kernel.grouped_topk(x, bias, k, groups, topk_group, renormalize, eps, scale, fill)


# --- a few rows times a small high-precision weight (fp8fx.passes.router emits it: an MoE router's logits) ------
@_op("small_mm")
def small_mm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x.to(out_dtype), w.to(out_dtype), bias)`` with w [N, K]: x and w of ``out_dtype`` or, for a float32
    ``out_dtype``, 16-bit (their float32 casts are exact). On CUDA one launch of ``fp8fx.kernels.small_mm`` where its
    ``reason`` is empty (a few rows of x: decode); elsewhere torch's linear."""
    _check_small_mm(x, w, bias, out_dtype)
    return _linear(x, w, bias, out_dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """small_mm's value by torch's linear; autocast off (its thread-local state would compute a float32 router in
    bf16 under ``torch.autocast``: the op's fake impl says ``out_dtype``, and so must this)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x.to(out_dtype), w.to(out_dtype), bias)


def _check_small_mm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> None:
    if w.dim() != 2 or x.dim() < 1:
        raise ValueError(f"fp8fx.small_mm: x {tuple(x.shape)} and w {tuple(w.shape)}; w must be [N, K], x [..., K]")
    torch._check(x.shape[-1] == w.shape[1], lambda: f"fp8fx.small_mm: x {tuple(x.shape)} and w {tuple(w.shape)}: "
                 "x's last dim must be w's K")
    exact = quant.exact_cast(x.dtype, out_dtype) and quant.exact_cast(w.dtype, out_dtype)
    if out_dtype not in quant.HIGH_PRECISION or not exact or bias is not None and bias.dtype != out_dtype:
        raise ValueError(f"fp8fx.small_mm: x {x.dtype}, w {w.dtype}, bias {getattr(bias, 'dtype', None)}, out_dtype "
                         f"{out_dtype}; it computes in bf16, fp16 or fp32 (out_dtype) on x and w of that dtype, or "
                         "16-bit ones for fp32, and a bias of out_dtype")


@small_mm.register_fake
def _(x, w, bias, out_dtype):
    _check_small_mm(x, w, bias, out_dtype)
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


@_on_cuda("small_mm")
def _(x, w, bias, out_dtype):
    from fp8fx.kernels import small_mm as kernel  # triton is imported only when a CUDA router runs

    _check_small_mm(x, w, bias, out_dtype)
    if kernel.reason(x, w, bias, out_dtype):  # (more rows, or a weight the kernel does not take: torch's linear)
        return _linear(x, w, bias, out_dtype)
    return kernel.small_mm(x, w, bias, out_dtype)


# --- the ops as plain function calls -------------------------------------------------------------------------
def _direct_call(name: str) -> Callable:
    default, cuda = _DEFAULT_FNS[name], _CUDA_FNS.get(name, _DEFAULT_FNS[name])
    label = f"{_LIB}::{name}"

    def call(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)  # (keywords too)
        fn = cuda if first is not None and first.is_cuda else default
        if compat.profiler_on():  # the op's name in traces, as a dispatched call has it
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.{_LIB}.{name}(*args, **kwargs)'s kernel, called without the dispatcher."
    return call


# ``direct.<op>(*args, **kwargs)`` runs what ``torch.ops.fp8fx.<op>(*args, **kwargs)`` runs: the op's CUDA kernel
# function for CUDA tensors (the first argument's device), its own function elsewhere. What it leaves out: the
# dispatcher boxing ~18 arguments into Python and custom_op's autograd, aliasing and ``_disable_dynamo`` layers
# (0.05-0.075 ms a call of the fused MLP's prefill op on the H200's host, benchmarks/RESULTS.md run 26), torch.library's
# switch that disables a kernel, and on CUDA the checks of scaled_mm's and gated_mlp's arguments (``_on_cuda``'s
# ``checks``: 10-25 us a call; the other ops' kernels check as before): it is for arguments a graph's trace checked,
# where the op's fake impl ran those same checks on their dtypes and shapes, which Inductor's code keeps (its inputs'
# sizes asserted or guarded); a static scale's value, which a fake tensor does not have, is checked when it is
# loaded (``_check_positive_value``). Inductor's
# code calls these for fp8fx's fallback kernels under ``Fp8Backend`` (``direct_calls``;
# ``fp8fx.lowerings.compat.direct_op_calls``); call ``torch.ops.fp8fx.<op>`` anywhere else. The ops have no autograd
# formula, and the graphs calling these record no gradient (the passes rewrite no site that does).
direct = types.SimpleNamespace(**{name: _direct_call(name) for name in _DEFAULT_FNS})
