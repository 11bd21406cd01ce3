#!/usr/bin/env bash
# On the GPU machine (device tool): install carried wheels, run the whole test suite (cuda tests
# included) and the benchmark; logs and results land in $OUT.
#   usage: bash benchmarks/device_run.sh [all | stages, comma-separated: tests,cudatests,compile,bench,moe,tune,decode]
#          [bench args...]   (cudatests: the cuda-marked tests only, restcuda: those
#          but the MoE kernel's, moetests / gemmtests: those of the MoE /
#          GEMM kernels, gatedtests: the fused decode MLP's, fusiontests: the generated-code tests;
#          decode: tune_gemm.py's decode sweep;
#          moesweep: bench_moe.py's tile sweep with per-kernel times; moelayer: bench_moe_layer.py only;
#          profile: profile_mlp.py's kernel tables at M = 1 (gate/up apart and fused) and 4096;
#          profilemlp: the same for the fused decode MLP at M = 1 and 16; tunegated: its tile sweep;
#          pdl: it with and without programmatic dependent launch; codes: with exact h codes or not;
#          groups: tune_gemm.py --groups (h in 1 x G groups);
#          gemv: tune_gemm.py --gemv (M = 1: the GEMV kernel against the tensor-core tile); gemvtests: its cuda tests;
#          tma: its sweep with TMA weight loads too;
#          widek: its sweep with K steps of 256 and 512; bm64: it and the decode GEMMs with 64-row tiles;
#          flush: flush_study.py; ncu: ncu on the fused MLP's kernels; ncupipes: their pipe use and stalls;
#          ncu64: ncu on them at M = 64, h in 1x128 groups; m64: tune_gemm.py --m64;
#          hbm: tune_gemm.py --hbm (each decode kernel alone, TB/s on its weight); hbmchain: the same as chains of
#          launches (--chain-mb 256, cuBLAS fp8 too); modeltests: the cuda tests of tests/e2e, passes, unit and
#          test_fp8_gemm.py's (40, 200, 512) shape; smalln: tune_gemm.py --small-n (qkv, o at 16-64 rows, chained);
#          smallduel: their 17-64-row tiles against each other (at 24-64 rows) (7 rounds) and its fp8_gemm cuda tests;
#          rows: rows_study.py; ncuprefill: ncu on the prefill kernels and cuBLAS's; prefill: prefill_study.py --sweep (PREFILL_MS, PREFILL_ROUNDS); narrow: down-GEMM tiles of 16-32 rows;
#          smallm: the decode GEMMs at M = 64 in 16- and 32-row tiles; widen: in 64-128-wide tiles, K split;
#          rowstests: the cuda tests of per-token h at 17-64 tokens (three kernels); power: power_study.py at 2048 and
#          4096; decode32: the decode MLP block at 32 tokens, every variant; rows16: per-token h's two kernels against
#          the three at 1, 4 and 16 tokens; layer: bench_decoder_layer.py, the whole decoder layer at 1 and 32 tokens;
#          pdltests: the PDL tile keys' GPU tests; pdlchain: tune_gemm.py --pdl (decode GEMMs' chains with PDL, its
#          early trigger); layerpdl: the decoder layer at LAYER_MS (1 32), a process each: bf16 and fp8fx fused with
#          and without PDL (Inductor's triton.enable_pdl; fp8fx's DECODE_PDL - the default - and its trigger),
#          torchao; decodepdl: the decode MLP block with and without fp8fx's PDL, with the trigger (*_pdl);
#          xcuda: every cuda test under pytest-xdist; l2next: tune_gemm.py --l2-next; prewait: tune_gemm.py --pre-wait
#          (the decode GEMMs' chains with their first K steps loaded before the PDL wait) and its cuda tests;
#          gemvpdl: tune_gemm.py --gemv-pdl, GEMV_PDL_TIMEOUT; warps8: tune_gemm.py --warps8; gemvstages: its default
#          at 3 and 4 K stages, and the GPU tests of GEMV launches)
# Carry .whl (expecttest, depyf, astor, dill, torchao; pytest-xdist and execnet for xcuda). One device call runs at
# most 10 minutes; the session has 30 (a cold start costs 1-2): e.g. "xcuda" (every cuda test, ~6 min in run 36),
# "moetests,gemmtests,moesweep" (~9 min), "bench,moelayer --skip-gemms --kernels" (~5 min). Env: XDIST_N, XCUDA_TIMEOUT
# (xcuda), LAYER_MS, LAYER_TIMEOUT, LAYER_VARIANTS, LAYER_PRE_WAIT (layerpdl: the *pre variants' K steps), LAYER_ARGS
# (more bench_decoder_layer.py arguments: --kernels).
set -uo pipefail
what=${1:-all}; shift || true
[ "$what" = all ] && what=tests,compile,bench,moe
has() { [[ ",$what," == *",$1,"* ]]; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ! ls .whl/*.whl >/dev/null 2>&1; then
  # expecttest and depyf (tests), torchao (the benchmark's anchor) are not in the device image
  echo "device_run.sh: no wheels in .whl/: name .whl in the device call's carry" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
# a stage cut at its time limit says so (its pipeline's status is tee's): timeouts.txt, and the call exits 1
timeout() { command timeout "$@"; local rc=$?; [ $rc -eq 124 ] && echo "timed out after $1 s: ${*:2:4}" >>"$OUT/timeouts.txt"; return $rc; }
P="python3 -m pytest -q -rfE --tb=short --timeout 120 --durations=30 -p no:cacheprovider --failures-file $OUT/failures.txt"
moe=tests/kernels/test_fused_moe.py gemm=tests/kernels/test_fp8_gemm.py
# cuda tests first (what only the GPU can check), then the rest on this torch/transformers; each
# failure's traceback is written as it happens (a run cut at its time limit prints no summary)
if has tests || has cudatests || has moetests; then  # first: it decides whether the MoE benchmark is worth running
  timeout 150 $P -m cuda $moe 2>&1 | tee "$OUT/pytest-cuda-moe.log" | tail -5
fi
if has gemmtests; then
  timeout 240 $P -m cuda $gemm 2>&1 | tee "$OUT/pytest-cuda-gemm.log" | tail -5
fi
if has gatedtests; then  # the fused decode MLP's kernels and op
  timeout 200 $P -m cuda tests/kernels/test_gated_mlp.py 2>&1 | tee "$OUT/pytest-cuda-gated.log" | tail -5
fi
if has gemvtests; then  # the one-row (GEMV) kernel's cuda tests: M = 1 GEMMs, weight-only, the fused MLP's down
  timeout 240 $P -m cuda $gemm tests/kernels/test_gated_mlp.py \
    -k "1-96-160 or op_cuda or split_k or weight_only_cuda or codes or -1] or graph_replays or cudagraph or block" 2>&1 | tee "$OUT/pytest-cuda-gemv.log" | tail -5
fi
if has gemv; then  # M = 1: the GEMV kernel's tiles against the tensor-core tile, single GEMMs and the fused MLP
  timeout 330 python3 benchmarks/tune_gemm.py --gemv --shapes gate_up,down,qkv 2>&1 | tee "$OUT/gemv.txt"
fi
if has groups; then  # the fused MLP with h in 1 x G groups (the gate/up kernel's epilogue) against per-token h
  timeout 360 python3 benchmarks/tune_gemm.py --groups 2>&1 | tee "$OUT/groups.txt"
fi
if has codes; then  # the fused decode MLP's down GEMM with exact h codes or codes by the reciprocal
  timeout 150 python3 benchmarks/tune_gemm.py --codes 2>&1 | tee "$OUT/codes.txt"
fi
if has pdl; then  # the fused decode MLP with and without programmatic dependent launch
  timeout 120 python3 benchmarks/tune_gemm.py --gated-pdl 2>&1 | tee "$OUT/gated-pdl.txt"
fi
if has ncu; then  # hardware counters of the fused decode MLP's two kernels (3 calls at M = 1, then 16)
  timeout 200 ncu --clock-control none -k regex:'gated_gemm_kernel|fp8_gemm_kernel' --launch-count 12 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats python3 benchmarks/tune_gemm.py --gated-ncu > "$OUT/ncu.txt" 2>&1
  grep -E "gated_gemm_kernel|fp8_gemm_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|One or More|No Eligible" "$OUT/ncu.txt" | head -120
fi
if has ncu64; then  # the same counters at M = 64 with h in 1x128 groups (3 calls)
  timeout 200 ncu --clock-control none -k regex:'gated_gemm_kernel|fp8_gemm_kernel' --launch-count 6 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats python3 benchmarks/tune_gemm.py --gated-ncu --ms 64 --h-groups 128 > "$OUT/ncu64.txt" 2>&1
  grep -E "gated_gemm_kernel|fp8_gemm_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|One or More|No Eligible|Block Limit" "$OUT/ncu64.txt" | head -80
fi
if has m64; then  # M = 64 with h in groups: the down GEMM grouped vs per row, deeper pipelines, G = 64 vs 128
  timeout 420 python3 benchmarks/tune_gemm.py --m64 2>&1 | tee "$OUT/m64.txt"
fi
if has ncupipes; then  # the fused MLP's kernels at M = 1: which pipes and stalls bound them
  timeout 100 ncu --clock-control none -k regex:'gated_gemm_kernel|fp8_gemm_kernel' --launch-count 2 \
    --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
    python3 benchmarks/tune_gemm.py --gated-ncu > "$OUT/ncu-pipes.txt" 2>&1
  grep -E "gated_gemm_kernel|fp8_gemm_kernel|Pipe|Issue|Ipc|Stall|stall|Executed Instructions" "$OUT/ncu-pipes.txt" | head -80
fi
if has modeltests; then  # what runs the tiles through the passes and models, and the TMA-addressable 17-64-row shape
  timeout 300 $P -m cuda tests/e2e tests/passes tests/unit 2>&1 | tee "$OUT/pytest-cuda-model.log" | tail -5
  timeout 150 $P -m cuda $gemm -k "40-200-512" 2>&1 | tee "$OUT/pytest-cuda-gemm40.log" | tail -5
fi
if has hbm; then  # each decode GEMM and fused-MLP kernel alone at its default tile, one launch per replay
  timeout 200 python3 benchmarks/tune_gemm.py --hbm 2>&1 | tee "$OUT/hbm.txt"
fi
if has hbmchain; then  # the same, each timed in a chain of launches on >= 256 MB of weights, cuBLAS fp8 too
  timeout 240 python3 benchmarks/tune_gemm.py --hbm --chain-mb 256 2>&1 | tee "$OUT/hbm-chain.txt"
fi
if has smalln; then  # qkv and o at 16, 32, 64 rows: tiles of every width, split and transposition, as chains
  timeout 330 python3 benchmarks/tune_gemm.py --small-n 2>&1 | tee "$OUT/small-n.txt"
fi
if has smallduel; then  # qkv and o at 24-64 rows: the tiles against each other, then the fp8_gemm GPU tests
  timeout 150 python3 benchmarks/tune_gemm.py --small-n --duel 2>&1 | tee "$OUT/small-n-duel.txt"
  timeout 240 $P -m cuda $gemm -k "test_fp8_gemm_cuda and not 16-4096-512 or op_cuda or split" 2>&1 | tee "$OUT/pytest-cuda-gemm.log" | tail -5
fi
if has prefill; then  # prefill: act * mul in the gate/up kernel's epilogue against cuBLAS + Inductor (prefill_study.py)
  timeout 420 python3 benchmarks/prefill_study.py --sweep --ms ${PREFILL_MS:-2048,4096} --rounds ${PREFILL_ROUNDS:-5} \
    --out "$OUT" 2>&1 | tee "$OUT/prefill.txt"
fi
if has ncuprefill; then  # hardware counters of the prefill kernels at 2048 tokens (launched 2-3 times) and cuBLAS's
  timeout 240 ncu --clock-control none -k regex:'gated_prefill|quantize_rows|nvjet|gemm|xmma|cutlass' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/prefill_study.py --ncu-driver --ms 2048 > "$OUT/ncu-prefill.txt" 2>&1
  grep -E "gated_prefill|quantize_rows|nvjet|gemm|xmma|cutlass|Duration|SM Busy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Stall|No Eligible|Executed Ipc|Warp Cycles Per Issued" "$OUT/ncu-prefill.txt" | head -120
fi
if has rows; then  # prefill SiLU*mul + quantization: Inductor's one-pass kernel against hand-written row loops
  timeout 120 python3 benchmarks/rows_study.py 2>&1 | tee "$OUT/rows.txt"
fi
if has fusiontests; then  # Inductor's generated code on the GPU (kernel counts)
  timeout 150 $P -m cuda tests/e2e/test_fusion.py 2>&1 | tee "$OUT/pytest-cuda-fusion.log" | tail -5
fi
if has l2next; then  # o's weight prefetched into L2 during attention, after the qkv GEMM, or not
  timeout 150 python3 benchmarks/tune_gemm.py --l2-next 2>&1 | tee "$OUT/l2-next.txt"
fi
if has xcuda; then  # every cuda test, XDIST_N processes on the one GPU (carry pytest-xdist, execnet): run 36 found
  # the cuda suite at 236 tests past a call's 10 minutes in one process (46 done in 480 s: compiles, not the GPU)
  # a test's limit 240 s there, not 120: with 12 processes compiling at once, the fused MoE kernel's per-tensor
  # 257-token compile passed 120 s inside ptxas in runs 41 and 43 (5-17 s alone, where it passed)
  timeout ${XCUDA_TIMEOUT:-420} ${P/--timeout 120/--timeout 240} -n ${XDIST_N:-12} -m cuda tests 2>&1 \
    | tee "$OUT/pytest-cuda-x.log" | tail -5
fi
if has tests || has cudatests || has restcuda; then  # one process: past 480 s since run 36 (xcuda instead)
  timeout 480 $P -m cuda --ignore=$moe tests 2>&1 | tee "$OUT/pytest-cuda.log" | tail -5
fi
if has tests; then
  timeout 200 $P -m "not cuda" -k "not sm90" tests 2>&1 | tee "$OUT/pytest-cpu.log" | tail -5
fi
[ -s "$OUT/failures.txt" ] && grep "^=====" "$OUT/failures.txt"
if has compile; then
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for run in cold warm; do echo -n "$run: "; python3 benchmarks/bench_linear.py --compile-time 2>&1 | tail -1; done | tee "$OUT/compile.txt"
  unset TORCHINDUCTOR_CACHE_DIR
fi
if has bench; then
  timeout 420 python3 benchmarks/bench_linear.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if has moe; then
  timeout 200 python3 benchmarks/bench_moe.py --out "$OUT" --profile 2>&1 | tee "$OUT/moe.log"  # with per-kernel times
fi
if has moe || has moelayer; then  # a whole HF MoE layer, fp8fx vs bf16 Inductor
  timeout 150 python3 benchmarks/bench_moe_layer.py --out "$OUT" 2>&1 | tee "$OUT/moe_layer.log" | grep "^{"
fi
if has decode; then
  timeout 320 python3 benchmarks/tune_gemm.py 2>&1 | tee "$OUT/tune-decode.txt"
fi
if has moesweep; then  # both schemes: per-kernel times, tiles of both GEMMs
  timeout 300 python3 benchmarks/bench_moe.py --out "$OUT/sweep" --schemes per-channel,block --sweep --profile 2>&1 | tee "$OUT/moe-sweep.log"
fi
if has profile; then  # per-kernel GPU times vs the CUDA-graph replay of the MLP block, decode and prefill
  for args in "--m 1" "--m 1 --fuse-horizontal" "--m 4096"; do
    timeout 120 python3 benchmarks/profile_mlp.py --out "$OUT/profile${args// /}" $args 2>&1 | tail -40
  done | tee "$OUT/profile.txt"
fi
if has profilemlp; then  # the fused decode MLP (Fp8Backend(fuse_mlp=True)) at M = 1 and 16, fp8fx only
  for args in "--m 1 --fuse-mlp --fp8fx-only" "--m 16 --fuse-mlp --fp8fx-only"; do
    timeout 120 python3 benchmarks/profile_mlp.py --out "$OUT/profile${args// /}" $args 2>&1 | tail -40
  done | tee "$OUT/profile-mlp.txt"
fi
if has tunegated; then  # the fused decode MLP's tiles
  timeout 300 python3 benchmarks/tune_gemm.py --gated 2>&1 | tee "$OUT/tune-gated.txt"
fi
if has widek; then  # the fused MLP's tiles with K steps of 256 and 512
  timeout 420 python3 benchmarks/tune_gemm.py --gated --wide-k 2>&1 | tee "$OUT/tune-wide-k.txt"
fi
if has bm64; then  # 64-row (wgmma) tiles at M = 1, 16: the fused MLP, then the decode GEMMs gate_up and down
  timeout 240 python3 benchmarks/tune_gemm.py --gated --bm64 2>&1 | tee "$OUT/tune-bm64-gated.txt"
  timeout 200 python3 benchmarks/tune_gemm.py --bm64 --shapes gate_up,down 2>&1 | tee "$OUT/tune-bm64-decode.txt"
fi
if has narrow; then  # down-GEMM tiles of 16-32 rows, little or no split-K: the fused MLP's, then the unfused GEMM's
  timeout 200 python3 benchmarks/tune_gemm.py --gated --narrow 2>&1 | tee "$OUT/tune-narrow-gated.txt"
  timeout 150 python3 benchmarks/tune_gemm.py --narrow --shapes down 2>&1 | tee "$OUT/tune-narrow-down.txt"
fi
if has smallm; then  # the decode GEMMs gate_up and down at M = 64 in row tiles of 16 or 32
  timeout 200 python3 benchmarks/tune_gemm.py --small-m --shapes gate_up,down 2>&1 | tee "$OUT/tune-small-m.txt"
fi
if has widen; then  # the decode GEMMs gate_up and down at M = 64 in 64-row tiles 64-128 wide, K split in 2-8
  timeout 240 python3 benchmarks/tune_gemm.py --wide-n --shapes down,gate_up 2>&1 | tee "$OUT/tune-wide-n.txt"
fi
if has tma; then  # the fused MLP's tiles, each down GEMM tile with TMA weight loads and with pointer loads
  timeout 300 python3 benchmarks/tune_gemm.py --gated --tma 2>&1 | tee "$OUT/tune-tma.txt"
fi
if has rowstests; then  # per-token h at 17-64 tokens (three kernels) and the long-K tile's pointer loads at 17-63 rows
  timeout 240 $P -m cuda tests/kernels/test_gated_mlp.py -k "rows_pass or cudagraph_trees or op_cuda" 2>&1 \
    | tee "$OUT/pytest-cuda-rows.log" | tail -5
fi
if has power; then  # the prefill block and its gate/up GEMMs under the power cap and at full clock (run 29)
  timeout 420 python3 benchmarks/power_study.py --ms 2048,4096 --rounds 3 --bf16 --out "$OUT" 2>&1 | tee "$OUT/power.txt"
fi
if has decode32; then  # the decode MLP block at 32 tokens: the default's three kernels, unfused, in groups, anchors
  timeout 330 python3 benchmarks/bench_linear.py --out "$OUT/decode32" --skip-gemms --ms 32 --rounds 7 --graph-max-m 64 \
    --variants bf16_inductor,torchao_rowwise,fp8fx,fp8fx_fused_mlp,fp8fx_fused_mlp_g128 2>&1 | tee "$OUT/decode32.txt"
fi
if has layer; then  # a whole Llama-3-8B decoder layer at decode: bf16, torchao, fp8fx, fp8fx fused (4 compiles an M)
  timeout 450 python3 benchmarks/bench_decoder_layer.py --out "$OUT/layer" --ms 1,32 --rounds 5 2>&1 \
    | tee "$OUT/layer.txt"
fi
if has pdltests; then  # the GEMMs launched as programmatic dependents that let the next start
  timeout 240 $P -m cuda $gemm tests/kernels/test_gated_mlp.py -k pdl 2>&1 | tee "$OUT/pytest-cuda-pdl.log" | tail -5
fi
if has pdlchain; then  # those launches' chains: each decode GEMM at 1-64 rows, plain / PDL / trigger
  timeout 420 python3 benchmarks/tune_gemm.py --pdl 2>&1 | tee "$OUT/pdl-chains.txt"
fi
if has layerpdl; then  # the same in a decode step: the decoder layer, a process for each M (run 35: compiles slowed
  # down in one for all):
  # bf16, torchao, fp8fx fused with its decode GEMMs as PDL dependents (the default since run 35) and without, with
  # the trigger, and with Inductor's PDL
  v=${LAYER_VARIANTS:-bf16_inductor,torchao_rowwise,fp8fx_fused,fp8fx_fused_nopdl,fp8fx_fused_gpdl,bf16_inductor_pdl,fp8fx_fused_pdl}
  for m in ${LAYER_MS:-1 32}; do
    timeout ${LAYER_TIMEOUT:-270} python3 benchmarks/bench_decoder_layer.py --out "$OUT/layer-m$m" --ms $m --rounds 5 \
      --variants $v --pre-wait ${LAYER_PRE_WAIT:-1} ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer-m$m.txt" \
      | grep -v "^[0-9]  \|^---\|^graph"
  done
fi
if has prewait; then  # the weight's first K steps loaded before the PDL wait: its GPU tests, then the chains
  timeout 150 $P -m cuda $gemm -k "pdl or before_the_wait" 2>&1 | tee "$OUT/pytest-cuda-prewait.log" | tail -5
  timeout 400 python3 benchmarks/tune_gemm.py --pre-wait 2>&1 | tee "$OUT/prewait-chains.txt"
fi
if has warps8; then  # the decode GEMMs' 17-64-row default tiles with 8 warps, as chains
  timeout 200 python3 benchmarks/tune_gemm.py --warps8 2>&1 | tee "$OUT/warps8.txt"
fi
if has gemvpdl; then  # the one-row GEMV's tiles for o and qkv as chains of programmatic dependents
  timeout ${GEMV_PDL_TIMEOUT:-300} python3 benchmarks/tune_gemm.py --gemv-pdl 2>&1 | tee "$OUT/gemv-pdl.txt"
fi
if has gemvstages; then  # its default at 3 and 4 K stages, then the GPU tests of GEMV launches at the default
  timeout 100 python3 benchmarks/tune_gemm.py --gemv-pdl --duel 2>&1 | tee "$OUT/gemv-stages.txt"
  k="(fp8_gemm_cuda and 96-160) or pdl or split_k or weight_only_cuda or before_the_wait"
  timeout 150 $P -n 8 -m cuda $gemm -k "$k" 2>&1 | tee "$OUT/pytest-cuda-gemv.log" | tail -5
fi
if has decodepdl; then  # and the decode MLP block
  v=bf16_inductor,fp8fx,fp8fx_nopdl,fp8fx_pdl,fp8fx_fused_mlp,fp8fx_fused_mlp_nopdl,fp8fx_fused_mlp_pdl
  timeout 280 python3 benchmarks/bench_linear.py --out "$OUT/decode-pdl" --skip-gemms --ms 1,32 --rounds 5 \
    --graph-max-m 64 --variants $v 2>&1 | tee "$OUT/decode-pdl.txt" | tail -30
fi
if has rows16; then  # per-token h at 1-16 tokens: the two kernels (default) against the three of 17-64 tokens
  timeout 330 python3 benchmarks/bench_linear.py --out "$OUT/rows16" --skip-gemms --ms 1,4,16 --rounds 7 \
    --graph-max-m 64 --variants fp8fx_fused_mlp,fp8fx_fused_mlp_rows 2>&1 | tee "$OUT/rows16.txt"
fi
if has flush; then  # the decode MLP block's replay time after a dirty, a clean and no L2 flush
  timeout 330 python3 benchmarks/flush_study.py --ms 1,16 2>&1 | tee "$OUT/flush.txt"
fi
if has tune; then
  timeout 200 python3 benchmarks/tune_gemm.py --block 2>&1 | tee "$OUT/tune-block.txt"
fi
# the stages' pipelines end in tee, so a crashed script leaves only its traceback: make the call say so
if grep -l "^Traceback" "$OUT"/*.txt "$OUT"/*.log 2>/dev/null; then
  echo "device_run.sh: a stage crashed (its traceback is in the files above)" >&2
  exit 1
fi
if [ -s "$OUT/timeouts.txt" ]; then
  cat "$OUT/timeouts.txt" >&2
  exit 1
fi
