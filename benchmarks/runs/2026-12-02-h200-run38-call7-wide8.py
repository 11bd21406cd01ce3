"""H200 run 38 call 7: the down GEMM 4096x14336 at 32 and 64 rows in 128-wide transposed tiles with 8 warps (two
warpgroups, each wgmma's 64 weight rows; half the activation's reads of a 64-wide tile), against the default, each
as a chain of launches (tune_gemm._chain_duel), 7 interleaved rounds; also the default as programmatic dependents
with the trigger. Run from the repository root: python3 benchmarks/runs/2026-12-02-h200-run38-call7-wide8.py"""
import sys

sys.path.insert(0, "benchmarks")
from tune_gemm import _chain_duel, _decode_problem  # noqa: E402

WIDE = dict(BLOCK_N=128, GROUP_M=1, num_warps=8, SPLIT_K=4, SWAP_AB=True, TMA=True)
for m in (32, 64):
    default = _decode_problem("down", m)[3]
    tiles = {"default": default, "default, pdl, trigger": {**default, "pdl": True, "PDL_TRIGGER": True},
             "128 wide, K 256, 3-4 stages": {**WIDE, "BLOCK_M": m, "BLOCK_K": 256, "num_stages": 3 if m == 64 else 4,
                                             "TMA_A": m == 64},
             "128 wide, K 128, 5-6 stages": {**WIDE, "BLOCK_M": m, "BLOCK_K": 128, "num_stages": 5 if m == 64 else 6,
                                             "TMA_A": m == 64}}
    _chain_duel("down", m, tiles, 7, 256 << 20)
