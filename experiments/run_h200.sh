#!/usr/bin/env bash
# One device call: the stages named on the command line, in order, each logged under $OUT.
#   SWAJAX_GIT_COMMIT=<sha> bash experiments/run_h200.sh gpu-tests kernels presets generate cold
#   SWAJAX_GIT_COMMIT=<sha> PRESETS=gemma4_e2b bash experiments/run_h200.sh scratch
#   (wheels the card lacks, e.g. fastapi / uvicorn / openai for `serve`: PYTHONPATH=/tmp/site)
# A persistent JAX compilation cache under /tmp is shared by every stage and by later calls
# to the same warm machine. Stages stop at their own time limit (seconds, STAGE_LIMIT_<name>).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SWAJAX_COMPILATION_CACHE_DIR=/tmp/swajax-jax-cache
export JAX_COMPILATION_CACHE_DIR=/tmp/swajax-jax-cache
mkdir -p /tmp/swajax-jax-cache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
run() {  # name limit command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name] rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  tail -n 25 "$OUT/$name.log"
}
for stage in "$@"; do
  case $stage in
    gpu-tests)
      # Workers from the card's free memory: the largest tests (full-size presets, stacks of
      # every layer's experts) hold up to ~16 GiB each, so an 80 GB H100 runs 4 and a 141 GB
      # H200 8. An out-of-memory failure is then a finding, not noise (GPU_TEST_WORKERS wins).
      free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
      workers=${GPU_TEST_WORKERS:-$(( free_mib / 16384 < 1 ? 1 : (free_mib / 16384 > 8 ? 8 : free_mib / 16384) ))}
      echo "gpu-tests: ${free_mib} MiB free, ${workers} workers" | tee -a "$OUT/stages.txt"
      XLA_PYTHON_CLIENT_PREALLOCATE=false run gpu-tests "${STAGE_LIMIT_gpu_tests:-420}" \
        python3 -m pytest -m gpu -v -n "$workers" -p no:cacheprovider -rA \
        --durations=30 --junitxml="$OUT/gpu_tests.xml" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
        ${GPU_TESTS:-tests/} ;;
    stacked)  # the stacked matmul at every preset geometry [STACKED_ARGS="--sweep"]
      run stacked "${STAGE_LIMIT_stacked:-400}" python3 experiments/bench_stacked.py \
        ${STACKED_ARGS:-} --out "$OUT/stacked_h200.json" ;;
    gpu-tests-serial)
      run gpu-tests "${STAGE_LIMIT_gpu_tests:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/ ;;
    kernels)
      run kernels "${STAGE_LIMIT_kernels:-300}" python3 experiments/bench_kernels.py --presets \
        --out "$OUT/kernels_presets_h200.json" ;;
    presets)
      run presets "${STAGE_LIMIT_presets:-560}" python3 experiments/bench_presets.py --timeout 240 \
        --out "$OUT/presets_h200.json" ${PRESETS:+--presets $PRESETS} ;;
    generate)
      # [GENERATE_ARGS="--only gemma3_1b_2k --no-hf"]
      run generate "${STAGE_LIMIT_generate:-500}" python3 experiments/bench_generate.py \
        ${GENERATE_ARGS:-} --out "$OUT/generate_h200.json" ;;
    scratch)  # one model per call: PRESETS=gemma4_e2b [SETUPS=cap_only] [REQUESTS=32]
      # [SCRATCH_NAME=swa_scratch_mixed_h200 SCRATCH_ARGS="--mixed-steps --verify 0"]
      name=${SCRATCH_NAME:-swa_scratch_h200}
      run scratch "${STAGE_LIMIT_scratch:-590}" python3 experiments/swa_scratch_throughput.py \
        --presets "${PRESETS:-gemma4_e2b}" ${SETUPS:+--setups $SETUPS} \
        ${REQUESTS:+--requests $REQUESTS} ${SCRATCH_ARGS:-} --out "$OUT/$name.json" \
        --merge "experiments/results/$name.json" ;;
    repro)  # the reproduction's cells from the pinned tree .repro/ (tools/repro_tree.sh <sha>):
      # PRESETS=gemma4_e2b [SETUPS=cap_only,pinned_8k] -> $OUT/repro_<preset>[_<setups>]_h200.json
      tag=${PRESETS:-gemma4_e2b}${SETUPS:+_${SETUPS//,/-}}
      # online cells: their predicted layouts compiled ahead, in threads (repro_online_layouts.py)
      if [[ -z "${SETUPS:-}" || ",$SETUPS," == *",online,"* ]]; then
        ( cd .repro && SWAJAX_GIT_COMMIT=$(cat COMMIT) PYTHONPATH=. run "repro_online_layouts_$tag" \
            "${STAGE_LIMIT_repro_online:-300}" python3 ../experiments/repro_online_layouts.py \
            --presets "${PRESETS:-gemma4_e2b}" --requests 24 --out "$OUT/online_layouts_${tag}.json" )
      fi
      ( cd .repro && SWAJAX_GIT_COMMIT=$(cat COMMIT) PYTHONPATH=. run "repro_$tag" \
          "${STAGE_LIMIT_repro:-590}" python3 experiments/swa_scratch_throughput.py \
          --presets "${PRESETS:-gemma4_e2b}" ${SETUPS:+--setups $SETUPS} --requests 24 \
          ${REPRO_ARGS:-} --out "$OUT/repro_${tag}_h200.json" ) ;;  # REPRO_ARGS="--control"
    moe)  # one MoE layer's decode products: experts read in the stack vs copied out of it
      run moe "${STAGE_LIMIT_moe:-240}" python3 experiments/bench_moe.py \
        --out "$OUT/moe_decode_h200.json" ;;
    step-cache)  # the step cache on the GPU: plain / cold / warm processes, same tokens
      run step-cache "${STAGE_LIMIT_step_cache:-300}" python3 experiments/probes/probe_step_cache.py \
        --preset "${PROBE_PRESET:-gemma4_e2b}" --out "$OUT/step_cache_h200.json" ;;
    cold)  # COLD_ARGS="" (no decode figures), default --decode
      XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} run cold "${STAGE_LIMIT_cold:-400}" python3 experiments/bench_cold_start.py ${COLD_ARGS---decode} \
        --out "$OUT/cold_start_h200.json" ;;
    donation)  # whether the bookkeeping step keeps the pool roots in place (decode cases)
      run donation "${STAGE_LIMIT_donation:-150}" python3 experiments/probes/probe_donation.py \
        --out "$OUT/donation_h200.json" ;;
    serve)  # MODELS="gemma3_1b gemma4_e2b": the server under load, three rates and the chat mode
      for m in ${MODELS:-gemma3_1b gemma4_e2b}; do
        run "serve_$m" "${STAGE_LIMIT_serve:-240}" python3 experiments/bench_serve.py \
          --model "preset:$m" --rates "${RATES:-2,8,inf}" --chat --out "$OUT/serve_${m}_h200.json"
      done ;;
    spec)  # TARGET=gemma3_27b [DRAFTERS=none,ngram,model:gemma3_1b,oracle:1.0,oracle:0.5]
      t=${TARGET:-gemma3_27b}
      run "spec_$t" "${STAGE_LIMIT_spec:-560}" python3 experiments/bench_speculative.py \
        --target "$t" ${DRAFTERS:+--drafters $DRAFTERS} --batches "${BATCHES:-1,8,32}" \
        --out "$OUT/speculative_${t}_h200.json" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
