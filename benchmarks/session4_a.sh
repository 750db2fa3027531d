#!/usr/bin/env bash
# Session 4, run A (two H200): EP=2 where the time goes, per mode (exact, sync-free, sync-free + CUDA graph),
# with kernel and host-op summaries. Repo root, PYTHONPATH=/tmp/site:$PWD.   OUT=<dir> bash benchmarks/session4_a.sh
set -u
out=${OUT:-/tmp/mok-s4a}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout ${T_EP:-300} torchrun --nproc-per-node 2 -m mok_megatron.bench.overlap ep --shapes ${SHAPES:-dsv3,qwen3} \
  --transports ${TRANSPORTS:-collective,copy_engine} --chunks 1 --modes exact,sync-free,sync-free+graph \
  --profile --kernels --iters 10 --warmup 3 --json "$out/ep.json" > "$out/ep.txt" 2>&1
echo "== bench ep rc=$?"; grep -E "^\||^profile|EP=|fail|Error" "$out/ep.txt" | grep -v "^   " | cut -c1-200
