"""Run 34 call 4 (untracked; kept in benchmarks/runs/): gate 14336x4096 (the unfused MLP's gate and up GEMMs) at
24 and 32 rows, now on gate_up's 32-row transposed tile (taken from the gate_up duel, call 1), against the 64-row
tile it had, both operands by TMA and the weight alone."""
import sys

sys.path.insert(0, "benchmarks")
from tune_gemm import _chain_duel, _decode_problem  # noqa: E402

OLD = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5, TMA=True, TMA_A=True)
for m in (24, 32):
    print("default:", _decode_problem("gate", m)[3], flush=True)
    _chain_duel("gate", m, {"default": None, "the 64-row tile (run 33)": OLD,
                            "the 64-row tile, the weight alone by TMA": {**OLD, "TMA_A": False}}, 7, 256 << 20)
