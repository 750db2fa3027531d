#!/usr/bin/env bash
# Session 5, run H (one H200): the split segment-quantization kernels: GPU bitwise tests, the tile probe,
# and the FP8 layer's kernel profile.  Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_h.sh
set -u
out=${OUT:-/tmp/mok-s5h}; mkdir -p "$out"
timeout 90 python -m pytest -q tests/test_fp8_gpu.py -k "quant_kernel or native or torch_fp8" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^E  " "$out/gpu_tests.txt" | head -6
timeout 100 python benchmarks/fp8_seg_probe.py > "$out/seg_probe.txt" 2>&1
echo "== probe rc=$?"; grep -E "^==|^split" "$out/seg_probe.txt"
timeout 70 python benchmarks/fp8_host_profile.py --backends torch-fp8 > "$out/profile.txt" 2>&1
echo "== profile rc=$?"; grep -E "^==|_segment|ms x" "$out/profile.txt" | cut -c1-140 | head -24
