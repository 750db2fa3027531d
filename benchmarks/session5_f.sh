#!/usr/bin/env bash
# Session 5, run F (one H200, TE 2.20.2): the final code's GPU tests (FP8 incl. the TE backend on the
# aligned plan, kernels, router, layer) and `mok bench layer` with every FP8 path against bf16 and
# Megatron+TE.  Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_f.sh
set -u
out=${OUT:-/tmp/mok-s5f}; mkdir -p "$out"
timeout 240 python -m pytest -q tests/test_fp8_gpu.py tests/test_layer_launches.py \
  "tests/test_kernels.py::test_triton_on_gpu_matches_reference" \
  tests/test_gpu.py -k "not demo and not ep2 and not combined_1f1b" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^ERROR|^E  " "$out/gpu_tests.txt" | head -12
timeout 200 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 \
  --impl mok,megatron-te,mok-torch-fp8,mok-te-tensorwise,mok-te-blockwise --iters 20 \
  --json "$out/layer-uniform.json" > "$out/layer.txt" 2>&1
echo "== bench layer rc=$?"; grep -E "^\| (mok|megatron)|skipped" "$out/layer.txt"
