"""How Inductor fuses the 1 x G activation quantization (128x128-block models) into an RMSNorm producer, by the form
of fp8fx's ATen decomposition (``fp8fx.lowerings.aten._quantize``), on the GPU.

``RMSNorm -> Linear`` quantized with ``Fp8Config(weight_block_size=[128, 128])``, compiled by ``Fp8Backend`` at one M,
once per form (the decomposition swapped before each compile; each compile keyed apart by its own source):

- ``shipped``: the tree's decomposition (``quant.quantize_rows``, the scale laid out by ``ops.act_scale_layout``);
- ``rowmajor``: the same with the scale left row-major (before the M-major scales; cuBLAS then copies it per call);
- ``groups``: x viewed as [M * K/G, G], each row quantized whole, so the amax and the codes divided by it run over
  one iteration space (the softmax shape: a reduction and the pointwise after it), the scale M-major;
- ``groups_rowmajor``: ``groups`` with the scale row-major.

Per form: the GPU kernels of one call (torch.profiler), its median time as CUDA-graph replays (each form's graph
captured right after its compile, the forms replayed in rotating order), and whether the codes and scales of the
norm + quantization compiled alone equal the first form's bit for bit (not the eager op's: compiled, Inductor keeps
the norm's output in float32 where eager rounds it to bf16, so the scales differ by up to a bf16 step).

    python benchmarks/group_quant_study.py [--shapes qkv,down] [--ms 2048]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8fx  # noqa: E402
from benchmarks.bench_linear import LAYERS, timed_in_rounds, timer  # noqa: E402
from benchmarks.block_prefill import kernels_of  # noqa: E402
from fp8fx import ops, quant  # noqa: E402
from fp8fx.lowerings import aten  # noqa: E402

SHIPPED = aten._quantize


def rowmajor(x, block):
    q, scale = quant.quantize_rows(x, block)
    return q.contiguous(), scale.contiguous()


def _groups(x, block, m_major: bool):
    """x as [M * K/G, G] rows, each quantized whole (``quant.quantize``, per row): the reduction and the codes over
    one iteration space."""
    k, g = x.shape[-1], block[1]
    if block[0] != 1 or g <= 0 or k % g or k == g:
        return SHIPPED(x, block)
    q, scale = quant.quantize(quant.as_rows(x).reshape(-1, g), [1, -1])
    scale = scale.reshape(-1, k // g)
    return q.reshape(x.shape).contiguous(), ops.act_scale_layout(scale) if m_major else scale.contiguous()


FORMS = {"shipped": SHIPPED, "rowmajor": rowmajor, "groups": lambda x, b: _groups(x, b, True),
         "groups_rowmajor": lambda x, b: _groups(x, b, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,down")
    p.add_argument("--ms", default="2048")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    # every form compiles anew: fp8fx's cache key hashes the decomposition's source, which the swap leaves as it was
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    for name in args.shapes.split(","):
        n, k = LAYERS[name]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            compiled, timers = {}, {}
            for form in args.forms.split(","):
                aten._quantize = FORMS[form]
                try:
                    torch.manual_seed(0)
                    model = nn.Sequential(nn.RMSNorm(k, eps=1e-5), nn.Linear(k, n, bias=False)).cuda().bfloat16()
                    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
                    torch._dynamo.reset()  # (drops the forms before: each is timed by its graph, captured here)
                    fn = torch.compile(model, backend=fp8fx.Fp8Backend(), dynamic=False)
                    with torch.no_grad():
                        y = fn(x)
                        names = kernels_of(fn, x)
                        timers[form] = timer(lambda _, fn=fn: fn(x), None, graph=True)
                        # the quantization alone, compiled the same way
                        quantized = torch.compile(lambda v, mod=model[0]: torch.ops.fp8fx.quantize(mod(v), [1, 128]),
                                                  backend=fp8fx.Fp8Backend(), dynamic=False)(x)
                    compiled[form] = (y, names, quantized)
                finally:
                    aten._quantize = SHIPPED
            times = timed_in_rounds(timers, args.rounds)
            first = next(iter(compiled))
            y0, _, (q0, s0) = compiled[first]
            for f, (y, names, (q, s)) in compiled.items():
                diff = (y.float() - y0.float()).abs().max().item()
                how = "" if timers[f].graph else " (graph capture failed: plain calls, recompiled with the shipped form)"
                print(f"{name} {n}x{k} M={m} {f}: {statistics.median(times[f]):.4f} ms{how}; codes / scales equal to "
                      f"{first}'s {torch.equal(q.view(torch.uint8), q0.view(torch.uint8))} / {torch.equal(s, s0)} "
                      f"(scale strides {s.stride()}); max |y - {first}'s| {diff:.3g}; {len(names)} kernels: "
                      + " | ".join(v[:70] for v in names), flush=True)

if __name__ == "__main__":
    main()
