#!/usr/bin/env bash
# Session 4, run E (one H200): native FP8 path after the Triton quantization kernels: GPU tests + bench.
#   OUT=<dir> bash benchmarks/session4_e.sh      (repo root, PYTHONPATH=/tmp/site:$PWD)
set -u
out=${OUT:-/tmp/mok-s4e}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 60 python -m pytest -q -rs -p no:cacheprovider -o addopts= tests/test_fp8_gpu.py \
  -k "quant or cache or host_sync or torch_fp8 or padding" > "$out/gpu_tests.txt" 2>&1
echo "== FP8 GPU tests rc=$?"; tail -4 "$out/gpu_tests.txt"; grep -E "^FAILED|Error" "$out/gpu_tests.txt" | head -8
timeout ${T_BENCH:-90} python benchmarks/fp8_quant_bench.py --out "$out" > "$out/bench_log.txt" 2>&1
echo "== fp8_quant_bench rc=$?"; cat "$out/fp8_quant_bench.txt"; grep -m3 -i "error\|Traceback" "$out/bench_log.txt"
