"""H200 run 38 call 6: which of the 16-row down tiles with the activation by TMA is wrong, the warp-specialized one or
its twin. Needs fp8_gemm_kernel's WARP_SPEC key: apply 2026-12-02-h200-run38-call1-warp-spec.patch's change to
fp8fx/kernels/fp8_gemm.py first (git apply --include=fp8fx/kernels/fp8_gemm.py). Run from the repository root."""
import torch
from fp8fx.kernels.fp8_gemm import fp8_gemm, mma_tile_config
torch.manual_seed(0)
m, n, k = 16, 4096, 14336
a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(n, 1, device="cuda") + 0.5
ref = (a.double() * sa.double()) @ (b.double() * sb.double()).T
default = mma_tile_config(m, n, k)
for label, cfg in [("default", default), ("TMA_A twin", {**default, "TMA_A": True}),
                   ("TMA_A + WS", {**default, "TMA_A": True, "WARP_SPEC": True}),
                   ("TMA both + WS", {**default, "TMA": True, "TMA_A": True, "WARP_SPEC": True})]:
    y = fp8_gemm(a, b, sa, sb, None, torch.float32, config=cfg, a_block=(1, -1))
    torch.cuda.synchronize()
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"{label}: {cfg} max rel error {err:.2e}", flush=True)
