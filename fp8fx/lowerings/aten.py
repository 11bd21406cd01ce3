"""The ATen lowering of fp8fx ops on CUDA: decompositions applied while Inductor traces the graph.

Why decompositions first (before fp8fx's own Triton templates):
- ``fp8fx.quantize`` becomes plain ATen (abs -> amax -> div -> clamp -> cast), so Inductor fuses the
  activation quantization into its producer (RMSNorm, SiLU*mul, residual add) instead of making a
  separate pass over memory.
- ``fp8fx.scaled_mm`` with per-tensor / per-row scales becomes ``aten._scaled_mm``, whose Inductor
  lowering offers cuBLAS and (with ``max_autotune``) Triton templates, with epilogue fusion of the bias
  and whatever pointwise op follows.
Where cuBLAS does not apply (block scales, shapes it refuses) ``scaled_mm`` decomposes to the
reference math (dequantize, fp32 GEMM), which Inductor compiles. The table is only used for graphs on
CUDA (Inductor refuses an op that has both a decomposition and a fallback kernel, so a decomposition
cannot decline): on CPU the fp8fx ops stay opaque and compiled output is bit-identical to eager.
"""
from __future__ import annotations

from fp8fx import ops, quant


def _quantize(x, block):
    return quant.quantize_rows(x, block)


def _quantize_static(x, scale):
    return quant.quantize_with_scale(x.reshape(-1, x.shape[-1]), scale, [-1, -1]).reshape(x.shape)


def _scaled_mm(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype):
    y = ops.cublas_scaled_mm(xq, x_scale, wq, w_scale, bias, x_block, w_block, out_dtype)
    if y is None:
        y = quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, bias, out_dtype)
    return y


def applies(example_inputs) -> bool:
    """The decompositions are for graphs on CUDA."""
    import torch

    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def decompositions():
    """{op overload: decomposition} for ``compile_fx(..., decompositions=...)``."""
    import torch

    fp8 = torch.ops.fp8fx
    return {
        fp8.quantize.default: _quantize,
        fp8.quantize_static.default: _quantize_static,
        fp8.scaled_mm.default: _scaled_mm,
    }
