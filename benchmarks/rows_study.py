"""Prefill: the SiLU*mul + per-token fp8 quantization of the Llama-3-8B MLP's intermediate at M = 4096
(gate and up outputs [M, 14336] bf16 in, codes and per-row scales out: 294 MB of traffic), as Inductor
compiles it for fp8fx (one-pass rows, ``compat.one_pass_row_reductions``) against a hand-written Triton
kernel whose programs each walk rows with the next row's loads issued before the current row's
arithmetic (a persistent, software-pipelined row loop). A study for RESULTS.md, not a kernel of the
package: Inductor's kernel ran at ~55% of HBM bandwidth in runs 9-11. Run 12: the hand-written loop was
slower (0.140-0.189 ms against Inductor's 0.1265).

    python benchmarks/rows_study.py [--m 4096]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fp8fx import quant
from fp8fx.kernels.launch import sm_count
from fp8fx.lowerings import compat


def inductor_version(g, u):
    h = torch.nn.functional.silu(g) * u
    amax = h.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.clamp(min=quant.AMAX_EPS) / quant.FP8_MAX
    return (h.float() / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn), scale


@triton.jit
def _silu_mul_quant_rows(g_ptr, u_ptr, q_ptr, s_ptr, M, N, stride_g, stride_u, stride_q,
                         EPS: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)  # 32-bit offsets: M * N < 2**31 at the sizes this study runs
    ok = cols < N
    first = tl.program_id(0)
    step = tl.num_programs(0)
    live = cols < tl.where(first < M, N, 0)  # a row past M loads nothing
    g = tl.load(g_ptr + first * stride_g + cols, mask=live, other=0.0)
    u = tl.load(u_ptr + first * stride_u + cols, mask=live, other=0.0)
    for row in range(first, M, step):
        nxt = row + step  # issued before this row's arithmetic: its bytes arrive while this row is reduced
        live = cols < tl.where(nxt < M, N, 0)
        g_next = tl.load(g_ptr + nxt * stride_g + cols, mask=live, other=0.0)
        u_next = tl.load(u_ptr + nxt * stride_u + cols, mask=live, other=0.0)
        gf = g.to(tl.float32)
        h = (gf / (1.0 + tl.exp(-gf))) * u.to(tl.float32)
        amax = tl.max(tl.where(ok, tl.abs(h), 0.0), axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, EPS), FP8_MAX)
        q = tl.clamp(tl.math.div_rn(h, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)
        g, u = g_next, u_next


def triton_version(g, u, programs, warps):
    m, n = g.shape
    q = torch.empty(m, n, device=g.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, 1, device=g.device, dtype=torch.float32)
    _silu_mul_quant_rows[(programs,)](g, u, q, s, m, n, g.stride(0), u.stride(0), q.stride(0), EPS=quant.AMAX_EPS,
                                      FP8_MAX=quant.FP8_MAX, BLOCK=triton.next_power_of_2(n), num_warps=warps)
    return q, s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=4096)
    args = p.parse_args()
    torch.manual_seed(0)
    g, u = (torch.randn(args.m, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gbytes = (2 * g.numel() * 2 + g.numel() + 4 * args.m) / 1e9
    with compat.one_pass_row_reductions(16384):
        compiled = torch.compile(inductor_version, dynamic=False)
        q_ref, s_ref = compiled(g, u)
    t = triton.testing.do_bench(lambda: compiled(g, u), warmup=25, rep=100, return_mode="median")
    print(f"M={args.m} Inductor one-pass: {t:.4f} ms ({gbytes / t:.2f} TB/s)", flush=True)
    sms = sm_count(g.device)  # (the device g is on, not device 0)
    for per_sm, warps in ((1, 16), (1, 32), (2, 8), (2, 16), (4, 8)):
        q, s = triton_version(g, u, per_sm * sms, warps)
        codes = (q.float() != q_ref.float()).float().mean().item()
        scales = ((s - s_ref).abs() / s_ref).max().item()
        t = triton.testing.do_bench(lambda: triton_version(g, u, per_sm * sms, warps), warmup=25, rep=100,
                                    return_mode="median")
        print(f"M={args.m} Triton rows, {per_sm} program(s) per SM x {warps} warps: {t:.4f} ms ({gbytes / t:.2f} TB/s);"
              f" codes differing from Inductor's {codes:.2e}, scales {scales:.1e}", flush=True)


if __name__ == "__main__":
    main()
