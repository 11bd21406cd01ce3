"""Run 33 call 5: test_gated_mlp_op_cuda[per-token/per-tensor-silu-24] with the 17-32-row tiles of 7f4feb7 and with
the 33-64-row tiles they replaced (mma_tile_config at 33 rows): each row's fused-vs-unfused gap against its bound."""
import sys
import torch
sys.path.insert(0, ".")
from tests.kernels.test_gated_mlp import mlp_operands, truth, rel, SCHEMES
from fp8fx import ops
from fp8fx.kernels import fp8_gemm as K
new_cfg = K.mma_tile_config
for label, patch in (("17-32-row tiles (7f4feb7)", None), ("33-64-row tiles (before)", lambda m, n, k, t=True, long_steps=True: new_cfg(max(m, 33) if 17 <= m <= 32 else m, n, k, t, long_steps))):
    K.mma_tile_config = patch or new_cfg
    for scheme in SCHEMES:
        m = 24
        args, ws = mlp_operands(m, 1024, 8192 + 40, 1000, scheme, "cuda", row_gain=torch.logspace(0, 3, m), act="silu")
        y = ops.gated_mlp(*args)
        unfused = ops._gated_mlp_reference(*args)
        want = truth(args, ws)
        worst = max(range(m), key=lambda r: rel(y[r], unfused[r]) - (0.015 + 0.05 * rel(unfused[r], want[r])))
        r = worst
        print(f"{label} {scheme}: worst row {r}: fused-unfused {rel(y[r], unfused[r]):.4f} bound {0.015 + 0.05 * rel(unfused[r], want[r]):.4f}; "
              f"fused-truth {rel(y[r], want[r]):.4f} unfused-truth {rel(unfused[r], want[r]):.4f}; max fused-truth {max(rel(y[i], want[i]) for i in range(m)):.4f} max unfused-truth {max(rel(unfused[i], want[i]) for i in range(m)):.4f}", flush=True)
K.mma_tile_config = new_cfg
