# run 34's device calls (untracked; copied to benchmarks/runs/ afterwards)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
has() { [[ ",$1," == *",$2,"* ]]; }
P="python3 -m pytest -q -rfE --tb=short -p no:cacheprovider"
if has "$1" duel; then
  timeout 170 python3 benchmarks/tune_gemm.py --rows32 --shapes gate_up --ms 32 > "$OUT/duel-gate_up.txt" 2>&1; echo "duel rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" wotests; then
  timeout 120 $P -m cuda tests/kernels/test_fp8_gemm.py -k "weight_only_cuda" > "$OUT/tests-weight-only.txt" 2>&1; echo "wo rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" decode; then
  timeout 280 python3 benchmarks/bench_linear.py --out "$OUT/decode" --skip-gemms --ms 24,32 --rounds 3 --graph-max-m 64 \
    --variants bf16_inductor,torchao_rowwise,fp8fx_fused_mlp > "$OUT/decode.txt" 2>&1; echo "decode rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" fp16tests; then
  timeout 280 $P -m cuda tests/kernels/test_fp8_gemm.py -k "fp8_gemm_cuda and dtype1" > "$OUT/tests-fp16.txt" 2>&1; echo "fp16 rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" diag; then
  timeout 240 python3 run34_diag.py > "$OUT/diag.txt" 2>&1; echo "diag rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" bf16tests; then
  timeout 240 $P -m cuda tests/kernels/test_fp8_gemm.py -k "fp8_gemm_cuda and dtype0 and (40-200-512 or 16-4096-512 or 129-257-384 or 7-200-300)" > "$OUT/tests-bf16.txt" 2>&1; echo "bf16 rc=$?" >> "$OUT/rc.txt"
fi
if has "$1" final; then
  timeout 70 python3 run34_gate.py > "$OUT/gate.txt" 2>&1; echo "gate rc=$?" >> "$OUT/rc.txt"
  timeout 100 python3 benchmarks/tune_gemm.py --hbm --chain-mb 256 --ms 24,48 > "$OUT/hbm.txt" 2>&1; echo "hbm rc=$?" >> "$OUT/rc.txt"
  timeout 120 $P -m cuda tests/kernels/test_gated_mlp.py tests/kernels/test_fp8_gemm.py -k "(op_cuda and (-24] or -33])) or (fp8_gemm_cuda and dtype0 and (40-200-512 or 64-130-1000))" > "$OUT/tests-final.txt" 2>&1; echo "tests rc=$?" >> "$OUT/rc.txt"
  timeout 230 python3 benchmarks/bench_linear.py --out "$OUT/decode" --skip-gemms --ms 24,32 --rounds 5 --graph-max-m 64 \
    --variants bf16_inductor,torchao_rowwise,fp8fx_fused_mlp > "$OUT/decode.txt" 2>&1; echo "decode rc=$?" >> "$OUT/rc.txt"
fi
