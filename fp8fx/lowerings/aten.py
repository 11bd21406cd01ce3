"""The ATen lowering of fp8fx's activation quantization on CUDA.

``fp8fx.quantize`` / ``fp8fx.quantize_static`` decompose, while Inductor traces the graph, into plain
ATen (abs -> amax -> div -> clamp -> cast), so Inductor fuses the activation quantization into its
producer (RMSNorm, SiLU*mul, residual add) instead of making a separate pass over memory: checked
in tests/e2e/test_fusion.py by reading the generated code.

``fp8fx.scaled_mm`` stays an opaque op whose CUDA kernel picks, at run time from M, the Triton GEMM
(decode) or cuBLAS (prefill). Decomposing it into ``aten._scaled_mm`` instead gave Inductor's own
choice between cuBLAS and its Triton templates: with max-autotune its templates lost to cuBLAS at
every Llama-3-8B shape at M=4096 (H200, torch 2.11: best template 0.52-0.60 ms vs cuBLAS 0.34-0.35 ms
for gate/up), and an extern cuBLAS call fuses no epilogue either, so nothing was lost.

The table is only used for graphs on CUDA: Inductor refuses an op that has both a decomposition and
a fallback kernel, so a decomposition cannot decline, and on CPU the fp8fx ops stay opaque so that
compiled output is bit-identical to eager.
"""
from __future__ import annotations

from fp8fx import quant
from fp8fx.ops import act_scale_layout, check_block, check_static_scale


def _quantize(x, block):
    check_block(block, "block")  # the op's own checks: the decomposition replaces it under compile
    q, scale = quant.quantize_rows(x, block)
    # the layouts the op and its fake promise: a transposed x gave codes of its strides, which a .view traced
    # against the fake then could not take (free where x is row-major, as it is at every linear); the scale M-major,
    # written so by the kernel that computes it
    return q.contiguous(), act_scale_layout(scale)


def _quantize_static(x, scale):
    check_static_scale(scale)
    return quant.quantize_with_scale(quant.as_rows(x), scale, [-1, -1]).reshape(x.shape).contiguous()


def applies(example_inputs, gm) -> bool:
    """The decompositions are for graphs on CUDA whose quantized activations have sizes with hints: the
    quantization's math (fp8fx.quant) branches on sizes (an empty tensor, a ragged last block), which an unbacked
    size cannot answer (a batch marked with ``mark_unbacked``, rows picked by a mask: compiling failed). Such a
    graph keeps the ops opaque, their kernels quantizing at run time. ``gm``: the graph after fp8fx's passes."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def unbacked(node) -> bool:
        v = node.meta.get("val", node.meta.get("example_value")) if hasattr(node, "meta") else None
        return isinstance(v, torch.Tensor) and bool(free_unbacked_symbols(v.shape))

    ops = (torch.ops.fp8fx.quantize.default, torch.ops.fp8fx.quantize_static.default)
    return _on_cuda(example_inputs) and not any(
        unbacked(n.args[0]) for n in gm.graph.nodes if n.op == "call_function" and n.target in ops)


def _on_cuda(example_inputs) -> bool:
    import torch

    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


def decompositions():
    """{op overload: decomposition} for ``compile_fx(..., decompositions=...)``."""
    import torch

    fp8 = torch.ops.fp8fx
    return {fp8.quantize.default: _quantize, fp8.quantize_static.default: _quantize_static}
