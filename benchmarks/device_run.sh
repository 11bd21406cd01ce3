#!/usr/bin/env bash
# On the GPU machine (device tool): install carried wheels, run the whole test suite (cuda tests
# included) and the benchmark; logs and results land in $OUT.
#   usage: bash benchmarks/device_run.sh [all | stages, comma-separated: tests,compile,bench,moe] [bench args...]
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
  timeout 360 python3 -m pytest -q -rsfE --tb=short --timeout 40 --durations=25 tests 2>&1 | tee "$OUT/pytest.log" | tail -40
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
  timeout 220 python3 benchmarks/bench_moe.py --out "$OUT" --sweep 2>&1 | tee "$OUT/moe.log"
fi
