#!/usr/bin/env bash
# On the GPU machine (device tool): install carried wheels, run the whole test suite (cuda tests
# included) and the benchmark; logs and results land in $OUT.
#   usage: bash benchmarks/device_run.sh [all | stages, comma-separated: tests,compile,bench,moe,tune] [bench args...]
# One device call runs at most 10 minutes: 'tests' alone fills most of one (cuda tests <= 5 min, the
# rest <= 4 min); then "moe,tune" (<= 9 min) and "compile,bench" (<= 8 min) in two more calls.
set -uo pipefail
what=${1:-all}; shift || true
[ "$what" = all ] && what=tests,compile,bench,moe
has() { [[ ",$what," == *",$1,"* ]]; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
if has tests; then
  # cuda tests first (what only the GPU can check), then the rest on this torch/transformers; each
  # failure's traceback is written as it happens (a run cut at its time limit prints no summary)
  P="python3 -m pytest -q -rfE --tb=short --timeout 120 -p no:cacheprovider --failures-file $OUT/failures.txt"
  timeout 330 $P -m cuda tests 2>&1 | tee "$OUT/pytest-cuda.log" | tail -5
  timeout 230 $P -m "not cuda" -k "not sm90" tests 2>&1 | tee "$OUT/pytest-cpu.log" | tail -5
  [ -s "$OUT/failures.txt" ] && grep "^=====" "$OUT/failures.txt"
fi
if has compile; then
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for run in cold warm; do echo -n "$run: "; python3 benchmarks/bench_linear.py --compile-time 2>&1 | tail -1; done | tee "$OUT/compile.txt"
  unset TORCHINDUCTOR_CACHE_DIR
fi
if has bench; then
  timeout 420 python3 benchmarks/bench_linear.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if has moe; then
  timeout 200 python3 benchmarks/bench_moe.py --out "$OUT" --sweep 2>&1 | tee "$OUT/moe.log"
  timeout 150 python3 benchmarks/bench_moe_layer.py --out "$OUT" 2>&1 | tee "$OUT/moe_layer.log" | grep "^{"
fi
if has tune; then
  timeout 200 python3 benchmarks/tune_gemm.py --block 2>&1 | tee "$OUT/tune-block.txt"
fi
