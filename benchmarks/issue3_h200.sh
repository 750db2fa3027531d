#!/usr/bin/env bash
# Issue 3, local-first pipeline schedule: GPU tests + timings. Repo root, PYTHONPATH=/tmp/site:$PWD.
#   OUT=<dir> bash benchmarks/issue3_h200.sh x2   # two H200 (<= 190 s): EP=2 parity test, bench ep
#   OUT=<dir> bash benchmarks/issue3_h200.sh x1   # one H200 (<= 150 s): loopback/graph tests, loopback sweep
set -u
out=${OUT:-/tmp/mok-issue3}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${1:-x2}" = "x2" ]; then
  timeout 45 python -m pytest -q -x tests/test_gpu.py -k "ep2_over_nccl and bfloat16" > "$out/gpu_tests_x2.txt" 2>&1
  echo "== EP=2 parity test rc=$?: $(tail -1 "$out/gpu_tests_x2.txt")"
  timeout 145 torchrun --nproc-per-node 2 -m mok_megatron.bench.overlap ep --shapes dsv3,qwen3 \
    --transports collective,copy_engine,nvlink --chunks 1 --modes exact --profile ${NO_B:+--no-b} \
    --iters 10 --warmup 3 --json "$out/ep.json" 2>&1 | grep -v -i warn | grep -v "^\[\|^W1" > "$out/ep.txt"
  echo "== bench ep rc=${PIPESTATUS[0]}"; grep -E "^\||^profile|^dsv3|^qwen3|fail" "$out/ep.txt" | cut -c1-220
else
  timeout 45 python -m pytest -q -x tests/test_gpu.py -k "loopback or captures" > "$out/gpu_tests_x1.txt" 2>&1
  echo "== loopback/graph tests rc=$?: $(tail -1 "$out/gpu_tests_x1.txt")"
  timeout 100 python -m mok_megatron.bench.overlap overlap --shapes dsv3-4k,qwen3-ep8 --gbps 0,50 \
    --chunks 1,2,4 --iters 10 --warmup 3 --json "$out/overlap.json" 2>&1 | grep -v -i warn > "$out/overlap.txt"
  echo "== bench overlap rc=${PIPESTATUS[0]}"; tail -28 "$out/overlap.txt" | cut -c1-220
fi
