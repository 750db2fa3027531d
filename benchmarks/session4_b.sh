#!/usr/bin/env bash
# Session 4, run B (two H200): EP=2 after the fixes: local rows fused vs overlap, exact vs sync-free + CUDA
# graph (capture fixed), FP8 dispatch. Repo root, PYTHONPATH=/tmp/site:$PWD.   OUT=<dir> bash benchmarks/session4_b.sh
set -u
out=${OUT:-/tmp/mok-s4b}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout ${T_EP:-330} torchrun --nproc-per-node 2 -m mok_megatron.bench.overlap ep --shapes dsv3,qwen3 \
  --transports ${TRANSPORTS:-collective,copy_engine} --local-rows fused,overlap --chunks ${CHUNKS:-1} \
  --modes ${MODES:-exact,sync-free+graph,sync-free+graph+fp8} --profile --iters 10 --warmup 3 \
  --json "$out/ep.json" > "$out/ep.txt" 2>&1
echo "== bench ep rc=$?"; grep -E "^\||^profile|EP=|fail|Error" "$out/ep.txt" | cut -c1-200
