"""Run 34 call 3 (untracked; kept in benchmarks/runs/): (1) the fused MLP op (h in 1x128 groups, the block's
default at 2-64 tokens) at 16-64 rows, its down GEMM on the default tile against run 31's 64-row tile and without
PDL - the block at 24/32 tokens measured 0.0612/0.0620 ms in call 2 against run 31's 0.0592 at 32; (2) gate_up at
48 and 64 rows: the default 64-row tile of both operands by TMA against the weight alone by TMA and transposed."""
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402

from tune_gemm import _chain_duel, _decode_problem, _gated_problem, _medians  # noqa: E402
from fp8fx.kernels.gated_mlp import QUANT_GROUPS, down_tile_config, gated_mlp  # noqa: E402

OLD64 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5, SPLIT_K=4, TMA=True)
for m in (16, 24, 32, 64):
    (xq, xs), w1, w3, w2 = _gated_problem(m)
    op = lambda c2=None, pdl=None: gated_mlp(  # noqa: E731
        xq, xs, *w1, *w3, *w2, None, QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16, configs=(None, c2),
        pdl=pdl, h_group=128)
    runs = {"default": lambda: op()}
    if m in (24, 32):
        runs["run 31's 64-row down tile"] = lambda: op(OLD64)
        runs["default, no PDL"] = lambda: op(pdl=False)
        runs["run 31's tile, no PDL"] = lambda: op(OLD64, False)
    ref = op().float()
    for name, fn in runs.items():
        assert (fn().float() - ref).abs().max() <= 2e-2 * ref.abs().max(), name
    med = _medians(runs, 7)
    print(f"fused MLP op M={m} (down default {down_tile_config(m, 4096, 14336, h_group=128)}): "
          + ", ".join(f"{k} {v:.4f}" for k, v in med.items()), flush=True)

for m in (48, 64):
    default = _decode_problem("gate_up", m)[3]
    swap = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=True, TMA=True)
    tiles = {"default": default, "the weight alone by TMA": {**default, "TMA_A": False}, "transposed 64-row": swap,
             "transposed 64-row, 5 stages": {**swap, "num_stages": 5}}
    _chain_duel("gate_up", m, tiles, 7, 256 << 20)
