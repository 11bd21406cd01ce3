"""What the launch boundaries of the decode MLP block cost, and three ways to cut them (H200, sm_90).

The block compiled as fp8fx compiles it (``Fp8Backend(fuse_mlp=True)`` up to 16 tokens, the default backend
for the unfused GEMMs), one CUDA graph per variant, timed as ``bench_linear.bench`` times decode (replays
after a clean 256 MB read), the variants interleaved over ``--rounds`` rounds (median of the rounds):

- ``gated_pdl``: the fused MLP's gate/up kernel launched as a programmatic dependent of the kernel before
  it (Inductor's quantization of x), so its launch overlaps that kernel's end; ``_pfN``: each program also
  asks for the first N 128-byte lines of its weight rows (into L2) before it waits;
- ``scale_in_loop``: the down GEMM reads its per-token h scales in its first K step, after the pipeline's
  first weight loads are issued, instead of before the loop;
- ``pdl`` (unfused): the decode GEMMs (Triton, M <= 64) launched as programmatic dependents of the
  quantization kernels before them.

Every variant must give the base's bits (asserted). The switches reach the compiled graph at run time: the
ops' CUDA kernels read ``fp8fx.kernels``' tile functions and GEMM entry point on each call.

    python benchmarks/launch_study.py [--fused-ms 1,16] [--unfused-ms 1,16,64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import fp8fx
from benchmarks.bench_linear import DIM, MLP, bench
from fp8fx.kernels import fp8_gemm as gemm_module
from fp8fx.kernels import gated_mlp as gated_module


@contextlib.contextmanager
def switches(gate: dict, down: dict, pdl_gemms: bool):
    """The fused MLP's tile configs with ``gate`` / ``down`` merged in; the decode GEMMs with ``pdl``."""
    saved = gated_module.gated_tile_config, gated_module.down_tile_config, gemm_module.fp8_gemm
    gated_module.gated_tile_config = lambda m, n, k: {**saved[0](m, n, k), **gate}
    gated_module.down_tile_config = lambda m, n, k: {**saved[1](m, n, k), **down}
    if pdl_gemms:
        gemm_module.fp8_gemm = lambda *a, **kw: saved[2](*a, **{**kw, "pdl": True})
    try:
        yield
    finally:
        gated_module.gated_tile_config, gated_module.down_tile_config, gemm_module.fp8_gemm = saved


FUSED = {
    "base": ({}, {}),
    "gated_pdl": ({"PDL_WAIT": True}, {}),
    "gated_pdl_pf2": ({"PDL_WAIT": True, "PREFETCH_LINES": 2}, {}),
    "gated_pdl_pf8": ({"PDL_WAIT": True, "PREFETCH_LINES": 8}, {}),
    "scale_in_loop": ({}, {"SCALE_IN_LOOP": True}),
    "gated_pdl_scale_in_loop": ({"PDL_WAIT": True}, {"SCALE_IN_LOOP": True}),
}
UNFUSED = {"base": False, "pdl": True}


def module(fuse_mlp: bool, state):
    mod = MLP().cuda().to(torch.bfloat16)
    mod.load_state_dict(state)
    fp8fx.quantize_(mod, fp8fx.Fp8Config())
    return torch.compile(mod, backend=fp8fx.Fp8Backend(fuse_mlp=fuse_mlp), dynamic=False)


def study(name, fn, x, variants: dict, rounds: int):
    with torch.no_grad():
        with switches({}, {}, False):
            want = fn(x)
        times = {v: [] for v in variants}
        for _ in range(rounds):
            for v, sw in variants.items():
                with switches(*sw):
                    got = fn(x)
                    assert torch.equal(got, want), f"{name} {v}: not the base's bits"
                    times[v].append(bench(fn, x, True))
    base = statistics.median(times["base"])
    for v, ts in times.items():
        t = statistics.median(ts)
        print(f"{name} {v}: {t:.4f} ms (rounds {min(ts):.4f}-{max(ts):.4f}), {base / t:.3f}x base", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fused-ms", default="1,16")
    p.add_argument("--unfused-ms", default="1,16,64")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    base = MLP().cuda().to(torch.bfloat16)
    for q in base.parameters():
        q.data /= q.shape[1] ** 0.5
    state = base.state_dict()
    for fused, ms in ((True, args.fused_ms), (False, args.unfused_ms)):
        for m in (int(v) for v in ms.split(",") if v):
            x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
            fn = module(fused, state)
            variants = ({v: (*sw, False) for v, sw in FUSED.items()} if fused
                        else {v: ({}, {}, on) for v, on in UNFUSED.items()})
            study(f"M={m} {'fused MLP' if fused else 'unfused'}", fn, x, variants, args.rounds)


if __name__ == "__main__":
    main()
