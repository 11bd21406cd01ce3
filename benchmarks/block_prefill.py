"""A compiled 128x128-block linear at prefill: the kernels a call runs and its time (issue 4's block target).

``RMSNorm -> Linear`` in bf16, quantized with ``Fp8Config(weight_block_size=[128, 128])`` (x in 1x128 groups),
compiled by ``Fp8Backend`` at one M at a time (static shapes). Inductor fuses the activation quantization into the
RMSNorm kernel (``fp8fx.lowerings.aten``), and the op runs cuBLAS's 1x128 x 128x128 GEMM there
(``ops.cublas_block_fits``). Per shape and M this prints the GPU kernels of one call (torch.profiler) and the call's
median time as CUDA-graph replays (``bench_linear.bench``), next to the cuBLAS block GEMM alone on the same
operands (``bench_linear.cublas_blockwise``): what the compiled call adds to the GEMM is the norm + quantization
kernel and anything else listed - until this script's commit a copy of the activation scales into cuBLAS's layout
at every call (``ops.cublas_block_operands``). It imports the ``fp8fx`` of its own checkout (its folder's parent
goes first on sys.path: PYTHONPATH does not choose the tree); to time another tree, run that tree's copy.

    python benchmarks/block_prefill.py --ms 2048,4096 [--shapes qkv,down] [--rounds 5]
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
from benchmarks.bench_linear import LAYERS, bench, cublas_blockwise, rel_err  # noqa: E402
from benchmarks.profile_mlp import per_call, profiled  # noqa: E402


def kernels_of(fn, x) -> list[str]:
    """The GPU kernels one call of fn(x) runs, by name, in launch order (``profile_mlp``'s profile of a call)."""
    calls = per_call(profiled(fn, x, 1), 1)
    return [calls] if isinstance(calls, str) else [e.name for e in calls[0]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="2048,4096")
    p.add_argument("--shapes", default="qkv,down", help=f"of {', '.join(LAYERS)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the two timings")
    args = p.parse_args()
    print(f"fp8fx from {os.path.dirname(fp8fx.__file__)}; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    for name in args.shapes.split(","):
        n, k = LAYERS[name]
        torch.manual_seed(0)
        model = nn.Sequential(nn.RMSNorm(k, eps=1e-5), nn.Linear(k, n, bias=False)).cuda().bfloat16()
        with torch.no_grad():
            model[1].weight.normal_(0, k**-0.5)
        ref_model = nn.Sequential(nn.RMSNorm(k, eps=1e-5), nn.Linear(k, n, bias=False)).cuda().double()
        ref_model.load_state_dict(model.state_dict())
        fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
        compiled = torch.compile(model, backend=fp8fx.Fp8Backend(), dynamic=False)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                err = rel_err(compiled(x), ref_model(x.double()))
                names = kernels_of(compiled, x)
                # the GEMM alone, on the operands the compiled call hands it (the op's quantization, its scales)
                h = model[0](x)
                xq, xs = torch.ops.fp8fx.quantize(h, [1, 128])
                # (the attribute reads as the dequantized view; the parameter holds the codes)
                wq = dict(model[1].named_parameters())["weight"]
                gemm = cublas_blockwise(xq, xs, wq, model[1].weight_scale_inv)
                call_t, gemm_t = [], []
                for _ in range(args.rounds):
                    call_t.append(bench(lambda _: compiled(x), None, graph=True))
                    gemm_t.append(bench(lambda _: gemm(), None, graph=True))
            c, g = statistics.median(call_t), statistics.median(gemm_t)
            print(f"{name} {n}x{k} M={m}: compiled call {c:.4f} ms, cuBLAS block GEMM alone {g:.4f} ms "
                  f"(call / GEMM {c / g:.3f}); rel err vs float64 {err:.4f}; {len(names)} kernels: "
                  + " | ".join(v[:60] for v in names), flush=True)


if __name__ == "__main__":
    main()
