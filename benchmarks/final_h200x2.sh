#!/usr/bin/env bash
# EP=2 profile + the tiny recipe through Megatron's training loop (MoK vs alltoall), 2 x H200.
set -u
out=${OUT:-/tmp/mok-final}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 120 torchrun --nproc-per-node 2 benchmarks/profile_ep.py dsv3 2>&1 | grep -v -i warn | grep -v "^\[\|^W1" > "$out/profile_ep.txt"
for d in mok alltoall; do
  DEVICE=gpu ITERS=50 NPROC=2 DISPATCHER=$d timeout 200 bash examples/tiny_moe.sh > "$out/tiny_$d.log" 2>&1
  echo "tiny $d rc=$?" >> "$out/summary.txt"
done
cat "$out/profile_ep.txt"
cat "$out/summary.txt"
for d in mok alltoall; do grep -E "iteration +(1|10|25|50)/" "$out/tiny_$d.log" | cut -c1-400; tail -3 "$out/tiny_$d.log" | cut -c1-300; done
