#!/usr/bin/env bash
# session 17's prepared call (no machine was left for it): on an H200 the decode MLP block at 16 / 1 / 64 tokens (issue
# 4's one H200 miss, run 72: 1.67x at 16 rows) first; then on any GPU the forms of the 1 x G quantization's
# decomposition after an RMSNorm (benchmarks/group_quant_study.py: kernels, times, codes against the eager op), the
# compiled block linear against the GEMM alone (block_prefill.py), the cuda tests of the files session 17 touched
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee -a "$OUT/env.txt"
md5sum fp8fx/*.py fp8fx/*/*.py benchmarks/*.py >> "$OUT/env.txt"
if grep -q H200 "$OUT/env.txt"; then
  timeout 230 python3 benchmarks/bench_linear.py --out "$OUT/mlp" --skip-gemms --ms 16,1,64 --rounds 5 --graph-max-m 64 \
    --variants bf16_inductor,torchao_rowwise,fp8fx_fused_mlp 2>&1 | grep -v Warn | tee "$OUT/mlp.log" | tail -30
  rm -f "$OUT"/*/plot.png; echo "mlp done at $SECONDS s"
fi
timeout 200 python3 benchmarks/group_quant_study.py --shapes qkv,down --ms 2048 --rounds 3 2>&1 | grep -v Warn | tee "$OUT/group_quant.log"
echo "group_quant done at $SECONDS s"
left=$((${END_S:-570} - SECONDS)); [ $left -gt 60 ] && timeout $((left < 100 ? left : 100)) python3 benchmarks/block_prefill.py --ms 2048,4096 --shapes qkv,down,gate_up --rounds 3 2>&1 | grep -v Warn | tee "$OUT/block_prefill.log"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 12"
left=$((${END_S:-570} - SECONDS)); [ $left -gt 40 ] && timeout $left python3 -m pytest -q -p no:cacheprovider $XD -m cuda --failures-file "$OUT/failures.txt" tests/unit/test_ops.py tests/kernels/test_fp8_gemm.py tests/e2e/test_fusion.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
echo "done at $SECONDS s"
