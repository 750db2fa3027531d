#!/usr/bin/env bash
# Session 4, run B (two H200): EP=2 with the sync-free pipeline captured in a CUDA graph (capture fixed),
# exact mode, no-B variants; then the one-GPU loopback sweep. Repo root, PYTHONPATH=/tmp/site:$PWD.
#   OUT=<dir> bash benchmarks/session4_b.sh
set -u
out=${OUT:-/tmp/mok-s4b}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout ${T_EP:-300} torchrun --nproc-per-node 2 -m mok_megatron.bench_overlap ep --shapes dsv3,qwen3 \
  --transports ${TRANSPORTS:-collective,copy_engine,nvlink} --chunks ${CHUNKS:-1} --modes exact,sync-free+graph \
  --profile --iters 12 --warmup 3 --json "$out/ep.json" > "$out/ep.txt" 2>&1
echo "== bench ep rc=$?"; grep -E "^\||^profile|EP=|fail|Error" "$out/ep.txt" | cut -c1-200
timeout ${T_LB:-150} python -m mok_megatron.bench_overlap overlap --shapes dsv3-4k,qwen3-ep8 --gbps 0,450,50 \
  --chunks 1,2,4 --modes exact,sync-free+graph --iters 10 --warmup 3 --json "$out/overlap.json" > "$out/overlap.txt" 2>&1
echo "== bench overlap rc=$?"; grep -E "^\||^profile|fail|Error" "$out/overlap.txt" | cut -c1-200
