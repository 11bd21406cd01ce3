#!/usr/bin/env bash
set -uo pipefail
# session 16's prepared device call (not run: no machine was lent). Run from the repo root with the wheels of
# .whl (torchao 0.18.0, expecttest, depyf, astor, dill, pytest-timeout, pytest-xdist, execnet) carried: on an H200 part 1
# (the decode MLP block at 16 / 1 / 64 tokens, its 16-row profile, the HBM table, the block GEMMs), else part 2 (the cuda
# tests of tests/unit, passes and e2e, the HBM table, the block GEMMs).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
# ---- part 1 (.whl/run82.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee -a "$OUT/env.txt"
  md5sum fp8fx/*.py fp8fx/*/*.py benchmarks/*.py >> "$OUT/env.txt"
  if ! grep -q H200 "$OUT/env.txt" && [ -z "${ANY_GPU:-}" ]; then echo "not an H200: stop"; exit 0; fi
  timeout ${MLP_S:-260} python3 benchmarks/bench_linear.py --out "$OUT/mlp" --skip-gemms --ms 16,1,64 --rounds 5 --graph-max-m 64 \
    --variants bf16_inductor,torchao_rowwise,fp8fx_fused_mlp 2>&1 | grep -v Warn | tee "$OUT/mlp.log" | tail -30
  echo "mlp done at $SECONDS s"
  timeout 80 python3 benchmarks/profile_mlp.py --out /tmp/prof --m 16 --fuse-mlp --fp8fx-only 2>&1 | grep -v Warn | tail -20 | tee "$OUT/profile16.txt"
  echo "profile done at $SECONDS s"
  timeout 150 python3 benchmarks/tune_gemm.py --hbm --chain-mb 256 2>&1 | grep -v Warn | tee "$OUT/hbm.log" | tail -30
  echo "hbm done at $SECONDS s"
  left=$((${END_S:-575} - SECONDS)); [ $left -gt 30 ] && timeout $left python3 benchmarks/bench_linear.py --out "$OUT/kern" --skip-gemms --skip-mlp --kernels 2>&1 | grep -v Warn | tee "$OUT/kernels.log" | tail -40
  rm -f "$OUT"/*/plot.png "$OUT"/*/results.md; echo "done at $SECONDS s"
else
# ---- part 2 (.whl/run83.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee -a "$OUT/env.txt"
  md5sum fp8fx/*.py fp8fx/*/*.py benchmarks/*.py >> "$OUT/env.txt"
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 12"
  timeout 150 python3 -m pytest -q -p no:cacheprovider $XD -m cuda tests/unit tests/passes tests/e2e 2>&1 | tail -15 | tee "$OUT/tests.txt"
  echo "tests done at $SECONDS s"
  timeout 150 python3 benchmarks/tune_gemm.py --hbm --chain-mb 256 2>&1 | grep -v Warn | tee "$OUT/hbm.log" | tail -40
  echo "hbm done at $SECONDS s"
  left=$((${END_S:-570} - SECONDS)); [ $left -gt 30 ] && timeout $left python3 benchmarks/bench_linear.py --out "$OUT/kern" --skip-gemms --skip-mlp --kernels 2>&1 | grep -v Warn | tee "$OUT/kernels.log" | tail -40
  rm -f "$OUT"/*/plot.png "$OUT"/*/results.md; echo "done at $SECONDS s"
fi
