#!/usr/bin/env bash
# The GPU checks in one prepared run on a one-GPU CUDA machine (docs/gpus.md), within a wall-clock deadline: the
# benches first, alone on the GPU, then the `cuda` tests in two processes side by side (in-process tests; the tiny job
# as a stream of two rollout actors through Ray). Each part gets what is left of the deadline and writes its log and
# JSON to OUT as it goes, so a part cut short still leaves what it measured.
#   bash bench/gpu_session.sh OUT [DEADLINE_S] [TOKENIZER]
# OUT: a folder for the logs and JSON; DEADLINE_S: the whole run's seconds (default 540); TOKENIZER: a tokenizer
# folder for bench/gpu_speed.py (default: its builtin). PYTHON picks the interpreter (default python3); PARTS the
# parts run (default "bench tests"), e.g. PARTS=tests after a change that needs only the tests again.
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT [DEADLINE_S] [TOKENIZER]}
DEADLINE=${2:-540}
TOK=${3:-}
PY=${PYTHON:-python3}
PARTS=${PARTS:-bench tests}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# part NAME MAX_S CMD...: runs CMD with at most MAX_S seconds (less if the deadline is nearer), log in OUT/NAME.log
part() {
  local name=$1 max=$2; shift 2
  local t=$(left); (( t > max )) && t=$max
  if (( t < 20 )); then echo "$name: skipped, deadline reached" | tee -a "$OUT/summary.txt"; return; fi
  local s=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - s )) s (limit $t s)" | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1

# 1. Speed, each bench alone on the GPU.
if [[ " $PARTS " == *" bench "* ]]; then
part gpu_speed 200 "$PY" bench/gpu_speed.py ${TOK:+--tokenizer "$TOK"} --precisions bf16,int8,int4,fp8,fp8/weight_only \
  --loops graphs,graphs_fused --rows 8,16,64 --repeats 2 --no-baseline --budget-s 160 --learner-reserve-s 35 \
  --out "$OUT/gpu_speed.json"
part gpu_matmuls 80 "$PY" bench/gpu_matmuls.py --rows 8,64 --calls 20 --repeats 3 --out "$OUT/gpu_matmuls.json"
fi

# 2. The cuda tests: in-process ones and the Ray stream job side by side (the GPU has room for both).
if [[ " $PARTS " == *" tests "* ]]; then
T=(-p no:cacheprovider -o addopts="" -rA --timeout 300 -q)
part tests_inprocess 260 "$PY" -m pytest -m cuda tests/test_cuda.py tests/test_quant_devices.py \
  tests/test_requant_storage.py tests/test_w8_triton.py -k "not tiny_job and not two_learner" "${T[@]}" &
# its own model cache (the two processes would build the tiny model at once); the run's metrics copied to OUT
S=$(mktemp -d)
part tests_stream 260 env QGRPO_TEST_CACHE="$S/cache" "$PY" -m pytest -m cuda tests/test_cuda.py \
  -k stream_of_two_actors --basetemp "$S/tmp" "${T[@]}" &
wait
find "$S/tmp" -name metrics.jsonl -exec cp {} "$OUT/stream_metrics.jsonl" \;
fi
echo "done in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
