#!/usr/bin/env bash
# Session 6, run D (one H200, TE 2.20.2): the one-pass rowwise + block-amax quantization against the two
# passes it replaces, the FP8 GPU tests, then `mok bench layer` with every peer (Megatron with and
# without TE, torchtitan, plain PyTorch) and the FP8 rows, same run, both shapes; CUDA graph for torch-fp8.
#   Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session6_d.sh
set -u
out=${OUT:-/tmp/mok-s6d}; mkdir -p "$out"
timeout 60 python benchmarks/fp8_partials_probe.py > "$out/partials_probe.txt" 2>&1
echo "== partials probe rc=$?"; grep -v -i warn "$out/partials_probe.txt" | tail -5
timeout 120 python -m pytest -q tests/test_fp8_gpu.py -k "partials or quant_kernel or aligned_plan or pipeline_expert" \
  > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^ERROR|^E  " "$out/gpu_tests.txt" | head -8
timeout 330 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 \
  --impl mok,megatron,megatron-te,torchtitan,plain-pytorch,mok-torch-fp8,mok-te-blockwise --iters 20 \
  --json "$out/layer-uniform.json" --png "$out/layer-uniform.png" > "$out/layer.txt" 2>&1
echo "== bench layer rc=$?"; grep -E "^\| |skipped" "$out/layer.txt" | grep -v "^| impl\|^|---"
MOK_EXPERT_BACKEND=torch-fp8 timeout 60 python benchmarks/layer_graph.py > "$out/graph_torch-fp8.txt" 2>&1
echo "== graph torch-fp8 rc=$?"; grep -v -i warn "$out/graph_torch-fp8.txt" | tail -2
