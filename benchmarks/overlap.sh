#!/usr/bin/env bash
# How much expert-parallel communication the overlap engine hides. Run from the project root on a GPU
# machine with megatron-core (and Transformer Engine for the Megatron+TE reference) importable:
#   OUT=<dir> bash benchmarks/overlap.sh
# One GPU: the loopback sweep (one H200 standing in for an EP rank at emulated link bandwidths). Two or
# more GPUs: also real EP under torchrun.
set -u
out=${OUT:-/tmp/mok-overlap}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  timeout 420 torchrun --nproc-per-node "$ngpu" -m mok_megatron.bench.ep --iters "${ITERS:-20}" \
    --shapes "${EP_SHAPES:-dsv3,qwen3}" --chunks "${EP_CHUNKS:-1,2}" --modes "${MODES:-exact,sync-free,sync-free+graph}" --json "$out/ep.json" 2>&1 \
    | grep -v -i warn | tee "$out/ep.txt"
fi
CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m benchmarks.overlap --iters "${ITERS:-20}" \
  --shapes "${OV_SHAPES:-dsv3-4k,dsv3-16k,qwen3-ep8}" --gbps "${OV_GBPS:-0,450,50}" \
  --chunks "${OV_CHUNKS:-1,2,4}" --modes "${MODES:-exact,sync-free,sync-free+graph}" --json "$out/overlap.json" 2>&1 | grep -v -i warn | tee "$out/overlap.txt"
