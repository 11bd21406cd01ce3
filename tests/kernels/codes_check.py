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
    """Exact codes equal fp8fx.quant's, bit for bit, on bf16 values across six decades with their rows' scales, a
    rounding tie (414 / (414 / 84): 84.0, half-way between the codes 80 and 88), inf, NaN, -0, a quotient past the
    fp8 range and a row whose scale is inf (a row holding inf: its finite values' codes are 0); the codes by the
    plain reciprocal miss the tie. Returns how many of those differ (NaN against NaN is no difference)."""
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(200_000, generator=g) * torch.logspace(-3, 3, 200_000)).bfloat16().float()
    scale = (v.abs().reshape(-1, 100).amax(1, keepdim=True).clamp(min=1e-12) / 448).expand(-1, 100).reshape(-1)
    v[:5] = torch.tensor([414.0, float("inf"), float("nan"), 1e38, -0.0])
    scale = scale.clone()
    scale[0] = 414.0 / 84.0
    scale[100:200] = float("inf")  # the second row: scale of a row holding inf
    v[100] = float("inf")
    want = quant.cast_to_fp8(v / scale)  # the IEEE quotient, saturated
    got = {}
    for exact in (True, False):
        out = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device=device)
        codes_kernel[(triton.cdiv(v.numel(), 1024),)](v.to(device), scale.to(device), out, v.numel(), EXACT=exact,
                                                       BLOCK=1024)
        got[exact] = out.cpu()
    nan = want.float().isnan()  # any NaN for a NaN (its sign bit is not the division's business)
    differ = {e: int(((got[e].view(torch.uint8) != want.view(torch.uint8)) & ~(nan & got[e].float().isnan())).sum())
              for e in got}  # bytes: -0 and +0 told apart
    assert differ[True] == 0, f"{differ[True]} exact codes differ from the division's"
    assert got[False][0] != want[0], "the tie must tell the two apart"
    return differ[False]


def check_gemms(device: str) -> None:
    """The same codes through the GEMMs that quantize their 16-bit activations as they load them (``A_QUANT``: the
    fused MLP's down GEMM), the GEMV kernel and the tensor-core tile, split K or not: with an identity weight each
    output is one code times the row's scale, so every code shows, bit for bit. The row holds 2208 (its amax: the
    scale 2208 / 448 = 414 / 84) and 414, the tie; the tensor-core tile's codes by the plain reciprocal miss it."""
    from fp8fx.kernels.fp8_gemm import QUANT_ROWS, fp8_gemm, gemv_config, mma_tile_config

    k = 96
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(1, k, generator=g) * 300).clamp(-2000, 2000).bfloat16()
    h[0, :2] = torch.tensor([2208.0, 414.0])
    scale = (h.float().abs().amax() / 448).reshape(1, 1)  # fp8fx.quant's scale of the row (IEEE division)
    want = quant.cast_to_fp8(h.float() / scale).float() * scale  # each code times the scale, as the GEMMs give it
    eye, ones = torch.eye(k).to(torch.float8_e4m3fn), torch.ones(k, 1)
    parts = h.float().abs().reshape(1, 4, -1).amax(-1)  # partial maxima, as the gate/up kernel writes them
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    hd, eyed, onesd, partsd = dev(h, eye, ones, parts)
    configs = {"gemv": gemv_config(k, k), "gemv split": {**gemv_config(k, k), "BLOCK_K": 32, "SPLIT_K": 3},
               "mma": mma_tile_config(1, k, k), "mma split": {**mma_tile_config(1, k, k), "BLOCK_K": 32, "SPLIT_K": 3}}
    for name, cfg in configs.items():
        y = fp8_gemm(hd, eyed, partsd, onesd, None, torch.float32, config=cfg, a_quant=QUANT_ROWS).cpu()
        assert torch.equal(y, want), (name, int((y != want).sum()), y[0, :2], want[0, :2])
    by_reciprocal = fp8_gemm(hd, eyed, partsd, onesd, None, torch.float32, a_quant=QUANT_ROWS,
                             config={**mma_tile_config(1, k, k), "EXACT_CODES": False}).cpu()
    assert by_reciprocal[0, 1] != want[0, 1], "the tie must tell exact codes from the reciprocal's"


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        from tests.triton_rounding import round_to_nearest

        round_to_nearest()
    differ = check(sys.argv[1])
    check_gemms(sys.argv[1])
    print("codes ok", differ)
