#!/usr/bin/env bash
# Real EP=2 layer times + the tiny recipe through Megatron's training loop (MoK vs alltoall), 2 x H200.
set -u
out=${OUT:-/tmp/mok-final}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 150 torchrun --nproc-per-node 2 -m mok_megatron.bench.overlap ep --iters 12 --warmup 3 \
  --chunks "${EP_CHUNKS:-1}" --modes exact --json "$out/ep.json" 2>&1 | grep -v -i warn | grep -v "^\[\|^W1" > "$out/ep.txt"
for d in mok alltoall; do
  DEVICE=gpu ITERS=50 NPROC=2 DISPATCHER=$d timeout 100 bash examples/tiny_moe.sh > "$out/tiny_$d.log" 2>&1
  echo "tiny $d rc=$?" >> "$out/summary.txt"
done
grep "^|\|EP=" "$out/ep.txt"
cat "$out/summary.txt"
for d in mok alltoall; do grep -E "iteration +(1|10|25|50)/" "$out/tiny_$d.log" | cut -c1-300; done
