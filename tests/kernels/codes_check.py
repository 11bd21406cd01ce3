"""In-kernel fp8 codes against fp8fx.quant's: ``python -m tests.kernels.codes_check cpu`` (under TRITON_INTERPRET=1,
with the GPU's float conversions) or ``check("cuda")``. A module, not a ``-c`` script: Triton compiles a kernel
for the GPU from its source file (the interpreter runs it as Python)."""
import sys

import torch
import triton
import triton.language as tl

from fp8fx import quant
from fp8fx.kernels.fp8_gemm import _codes_of, _saturate


@triton.jit
def codes_kernel(v_ptr, scale_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + offs, mask=ok, other=1.0)
    inv = tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale)
    if EXACT:
        q = _codes_of(v, scale, inv, 448.0)
    else:
        q = _saturate(v * inv, 448.0)
    tl.store(out_ptr + offs, q.to(tl.float8e4nv), mask=ok)


def check(device: str) -> int:
    """Exact codes equal fp8fx.quant's on bf16 values across six decades with their rows' scales, a rounding tie
    (414 / (414 / 84): 84.0, half-way between the codes 80 and 88), inf, NaN and a quotient past the fp8 range;
    the codes by the plain reciprocal miss the tie. Returns how many of those differ."""
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(200_000, generator=g) * torch.logspace(-3, 3, 200_000)).bfloat16().float()
    scale = (v.abs().reshape(-1, 100).amax(1, keepdim=True).clamp(min=1e-12) / 448).expand(-1, 100).reshape(-1)
    v[:4] = torch.tensor([414.0, float("inf"), float("nan"), 1e38])
    scale = scale.clone()
    scale[0] = 414.0 / 84.0
    want = quant.cast_to_fp8(v / scale).float()  # the IEEE quotient, saturated
    got = {}
    for exact in (True, False):
        out = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device=device)
        codes_kernel[(triton.cdiv(v.numel(), 1024),)](v.to(device), scale.to(device), out, v.numel(), EXACT=exact,
                                                       BLOCK=1024)
        got[exact] = out.float().cpu()
    same = torch.equal(got[True].isnan(), want.isnan()) and torch.equal(got[True].nan_to_num(), want.nan_to_num())
    assert same, f"{int((got[True] != want).sum())} exact codes differ from the division's"
    assert got[False][0] != want[0], "the tie must tell the two apart"
    return int((got[False] != want).sum())


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        from tests.triton_rounding import round_to_nearest

        round_to_nearest()
    print("codes ok", check(sys.argv[1]))
