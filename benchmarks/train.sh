#!/usr/bin/env bash
# MoK vs Megatron in Megatron's training loop on one H200 (mok bench train; docs/bench-train.md): tokens/s/GPU,
# TFLOP/s/GPU, step times, peak memory and loss curves from identical initial weights. From the project root,
# megatron-core (+ Transformer Engine for Megatron's grouped-GEMM layer) importable:
#   OUT=<dir> bash benchmarks/train.sh [all|qwen3|qwen3-fp8|deepseek|mixtral|qwen3-fp8-backends|deepseek-fp8-backends ...]
#   qwen3      --preset qwen3-30b-a3b, bf16
#   qwen3-fp8  --preset qwen3-30b-a3b -- --fp8-format e4m3 --fp8-recipe blockwise, MoK's torch-fp8 experts
#   deepseek   --preset deepseek-v3;  mixtral  --preset mixtral-8x7b
#   qwen3-fp8-backends, deepseek-fp8-backends  the preset in FP8 blockwise, --runs mok-torch-fp8,mok-te,mok-bf16,alltoall:
#              both MoK FP8 expert backends against Megatron's FP8 run, beside MoK's bf16 step (needs TE)
# Each writes $OUT/<name>.json, <name>.png and <name>.txt; each fits one 10-minute call (ITERS steps, 12).
# A comparison whose losses disagree beyond the limits (exit 3) is reported and the next one still runs.
set -u
out=${OUT:-/tmp/mok-bench-train}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
iters=${ITERS:-12}
which=("$@")
[ ${#which[@]} -eq 0 ] || [ "${which[0]}" = all ] && which=(qwen3 qwen3-fp8 deepseek mixtral)

bench() {  # bench NAME ARGS...
  local name=$1
  shift
  timeout "${TIMEOUT:-570}" "$py" -m mok_megatron.cli bench train --iters "$iters" --workdir "$out/work-$name" \
    --json "$out/$name.json" --png "$out/$name.png" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "== $name rc=$rc"
  grep -E "^run |^(mok|alltoall|flex)|^loss agreement|error|failed" "$out/$name.txt" | cut -c1-220
  rm -rf "$out/work-$name/initial-checkpoint"
}

for w in "${which[@]}"; do
  case "$w" in
    qwen3) bench qwen3-30b-a3b --preset qwen3-30b-a3b ;;
    qwen3-fp8)
      bench qwen3-30b-a3b-fp8 --preset qwen3-30b-a3b -- \
        --fp8-format e4m3 --fp8-recipe blockwise --mok-expert-backend torch-fp8 ;;
    deepseek) bench deepseek-v3 --preset deepseek-v3 ;;
    mixtral) bench mixtral-8x7b --preset mixtral-8x7b ;;
    qwen3-fp8-backends | deepseek-fp8-backends)
      preset=qwen3-30b-a3b
      [ "$w" = deepseek-fp8-backends ] && preset=deepseek-v3
      bench "$preset-fp8-backends" --preset "$preset" --runs mok-torch-fp8,mok-te,mok-bf16,alltoall -- \
        --fp8-format e4m3 --fp8-recipe blockwise ;;
    *) echo "benchmarks/train.sh: unknown comparison '$w' (all, qwen3, qwen3-fp8, deepseek, mixtral," \
      "qwen3-fp8-backends, deepseek-fp8-backends)" >&2; exit 2 ;;
  esac
done
