#!/usr/bin/env bash
# The GPU checks in one prepared run on a one-GPU CUDA machine (docs/gpus.md), within a wall-clock deadline: the
# benches first, alone on the GPU, then the `cuda` tests in two processes side by side (in-process tests; the tiny job
# as a stream of two rollout actors through Ray). Each part gets what is left of the deadline and writes its log and
# JSON to OUT as it goes, so a part cut short still leaves what it measured; with PACK set, OUT is also packed into
# that one archive after every part (for a machine that returns few files).
#   bash bench/gpu_session.sh OUT [DEADLINE_S] [TOKENIZER]
# OUT: a folder for the logs and JSON; DEADLINE_S: the whole run's seconds (default 540); TOKENIZER: a tokenizer
# folder for the benches (default: their builtin). PYTHON picks the interpreter (default python3); PARTS the parts
# run (default "ladder products tests"; "bench" is bench/gpu_speed.py at the 1.3b shape with its learner row; "step" is
# the whole GRPO step at the Qwen2.5-1.5B shape against TRL, then the learner's step by operator; it needs TOKENIZER),
# e.g. PARTS=tests after a change that needs only the tests again.
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT [DEADLINE_S] [TOKENIZER]}
DEADLINE=${2:-540}
TOK=${3:-}
PY=${PYTHON:-python3}
PARTS=${PARTS:-ladder products tests}
PACK=${PACK:-}
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
  pack
}
pack() { [[ -z "$PACK" ]] || tar -czf "$PACK.tmp" -C "$OUT" . && mv -f "$PACK.tmp" "$PACK" 2>/dev/null; true; }
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

# 2. The model-size ladder (bench/model_ladder.py): Qwen2.5-1.5B and Qwen3-8B at every precision first, then the other
# sizes at bf16, int8 and int4; then each product of the 1.5B and 8B shapes alone, GemLite's kernels beside ours
# (GemLite autotunes the shapes its shipped configs lack: a few seconds each).
if [[ " $PARTS " == *" ladder "* ]]; then
part ladder_main 175 "$PY" bench/model_ladder.py ${TOK:+--tokenizer "$TOK"} --models Qwen2.5-1.5B,Qwen3-8B \
  --precisions bf16,int8,int4,fp8/weight_only,fp8/scaled_mm,nf4 --rows 8,32 --contexts 512,2048 --budget-s 160 \
  --out "$OUT/model_ladder_main.json"
part ladder_sizes 95 "$PY" bench/model_ladder.py ${TOK:+--tokenizer "$TOK"} \
  --models Qwen2.5-0.5B,Qwen3-4B,Qwen2.5-14B --precisions bf16,int8,int4 --rows 8,32 --contexts 512 --budget-s 80 \
  --out "$OUT/model_ladder_sizes.json"
fi
if [[ " $PARTS " == *" products "* ]]; then
part products 75 "$PY" bench/gpu_matmuls.py --models Qwen2.5-1.5B,Qwen3-8B --rows 8,32 \
  --precisions bf16,int8,int4,int4/unpadded,fp8/weight_only,int4/gemlite,int8/gemlite --gemlite-after all \
  --gemlite-autotune default --calls 20 --repeats 3 --budget-s 60 --gemlite-save "$OUT/gemlite_configs.json" \
  --out "$OUT/gpu_matmuls_models.json"
fi

# 3. The whole GRPO step (bench/vs_trl.py on bench/gpu_step.toml, the default job's settings) at the Qwen2.5-1.5B shape
# with random weights, every role on the one GPU: our step with bf16, int8 and int4 rollouts, TRL's GRPOTrainer on the
# same model and batch, a LoRA learner, a stream; each run alone on the GPU. Then the learner's step by operator.
if [[ " $PARTS " == *" step "* ]]; then
M=$(mktemp -d)/qwen2.5-1.5b
part step_model 60 "$PY" bench/model_shapes.py save Qwen2.5-1.5B "$M" --tokenizer "${TOK:?step needs TOKENIZER}" \
  --device cuda
SHARES=(--ours-set learner.num_gpus=0.5 --ours-set reference.num_gpus=0.2 --ours-set rollout.num_gpus=0.3)
part step 330 "$PY" bench/vs_trl.py --device cuda --config bench/gpu_step.toml --model "$M" --label \
  "Qwen2.5-1.5B shape, random bf16 weights (published vocabulary, SmolLM2's tokenizer)" --rounds 1 --steps 4 \
  --prompts 8 --group-size 8 --max-new-tokens 24 --keep-going --budget-s 250 --timeout-s 150 --trl-threads 8 \
  "${SHARES[@]}" --ours-set 'rollout.precision="bf16"' --ours-variant 'int8:rollout.precision="int8"' \
  --ours-variant 'int4:rollout.precision="int4"' --ours-variant 'lora:learner.mode="lora"' \
  --ours-variant 'stream int8:rollout.precision="int8";algo.max_staleness=1' \
  --out "$OUT/gpu_step.json"
part learner_ops 80 "$PY" bench/learner_ops.py --device cuda --config bench/gpu_step.toml --model "$M" \
  --shapes default --out "$OUT/learner_ops_cuda.json"
fi

# 4. The cuda tests: in-process ones and the Ray stream job side by side (the GPU has room for both).
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
pack
