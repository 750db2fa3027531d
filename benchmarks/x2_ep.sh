#!/usr/bin/env bash
# The first runs for a two-GPU machine (nvidia-h200-x2), in phases that each fit one 10-minute device call.
# EP=2, per-rank DeepSeek-V3 and Qwen3-30B-A3B slices, MoK transports vs Megatron(+TE) in the same run:
#   bf16   session4_b.sh's sweep: local rows fused/overlap x exact / sync-free+graph / +FP8 dispatch, profiled
#   fp8    the same with native FP8 experts (--expert-backend torch-fp8), exact, sync-free+graph and
#          sync-free+graph with FP8 dispatch and combine (--mok-fp8-combine), fused
#          (ep-torch-fp8.json: the planner fits bf16 experts only)
# Repo root, PYTHONPATH=/tmp/site:$PWD (TE installed for the Megatron+TE reference).
#   OUT=<dir> bash benchmarks/x2_ep.sh bf16|fp8
set -u
out=${OUT:-/tmp/mok-x2}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:?phase: bf16 or fp8}" in
  bf16)
    OUT=$out bash benchmarks/session4_b.sh ;;
  fp8)
    timeout ${T_EP:-330} torchrun --nproc-per-node 2 -m mok_megatron.bench.overlap ep --shapes dsv3,qwen3 \
      --transports ${TRANSPORTS:-collective,copy_engine} --local-rows fused --chunks 1 \
      --modes ${MODES:-exact,sync-free+graph,sync-free+graph+fp8-both} --expert-backend torch-fp8 --iters 10 --warmup 3 \
      --json "$out/ep-torch-fp8.json" > "$out/ep-torch-fp8.txt" 2>&1
    echo "== bench ep torch-fp8 rc=$?"; grep -E "^\||EP=|fail|Error" "$out/ep-torch-fp8.txt" | cut -c1-200 ;;
  *) echo "phase: bf16 or fp8"; exit 2 ;;
esac
