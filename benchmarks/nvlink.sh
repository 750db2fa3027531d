#!/usr/bin/env bash
# The NVLink transport on the H200 machine(s), from the project root, megatron-core importable:
#   OUT=<dir> bash benchmarks/nvlink.sh [all|tests|bench|layer]
#   all (default): the GPU tests of tests/test_nvlink.py (loopback N=2,4,8 on one GPU; the EP=2 layer,
#       bitwise vs the collective transport, with 2 GPUs) and, on 2 GPUs, the dispatch/combine bandwidth bench.
#   layer (longer): ``mok bench ep`` with the nvlink transport (barrier and per-peer flags) beside
#       collective / copy_engine / Megatron.
set -u
out=${OUT:-/tmp/mok-nvlink}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PY:-python3}
phase=${1:-all}
ngpu=$($py -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $ngpu"
if [ "$phase" = all ] || [ "$phase" = tests ]; then
  timeout 72 $py -m pytest -q -m gpu tests/test_nvlink.py -p no:cacheprovider -o addopts="" --timeout 65 -rs \
    > "$out/nvlink_tests.txt" 2>&1
  echo "== nvlink GPU tests rc=$?"; grep -E "passed|failed|error|Error|SKIP" "$out/nvlink_tests.txt" | tail -12
fi
if { [ "$phase" = all ] || [ "$phase" = bench ]; } && [ "$ngpu" -ge 2 ]; then
  timeout 42 torchrun --nproc-per-node 2 -m benchmarks.nvlink --iters 20 --warmup 3 \
    --json "$out/nvlink_bench.json" > "$out/nvlink_bench.txt" 2>&1
  echo "== nvlink bench rc=$?"; grep -E "GB/s|Error|error" "$out/nvlink_bench.txt" | head -20
fi
if [ "$phase" = layer ] && [ "$ngpu" -ge 2 ]; then
  timeout 500 torchrun --nproc-per-node 2 -m mok_megatron.bench.ep --transports collective,copy_engine,nvlink,nvlink-flags \
    --chunks 1,2 --iters 12 --warmup 3 --json "$out/ep_nvlink.json" > "$out/ep_nvlink.txt" 2>&1
  echo "== bench_overlap ep rc=$?"; grep -E "^\||ms" "$out/ep_nvlink.txt" | head -30
fi
