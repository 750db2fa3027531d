#!/usr/bin/env bash
# Session 5, run C (one H200, TE 2.20.2): after the Triton router top-k (MoKTopKRouter.routing).
# GPU kernel cases (topk, router vs Megatron's TopKRouter), the layer's kernel profile, eager vs CUDA
# graph, and `mok bench layer` against Megatron+TE on the issue-4 target shapes.
# Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_c.sh
set -u
out=${OUT:-/tmp/mok-s5c}; mkdir -p "$out"
timeout 150 python -m pytest -q tests/test_kernels.py tests/test_gpu.py -k "topk or router or parity_vs_megatron_on_gpu or captures or deterministic" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|Error" "$out/gpu_tests.txt" | head -5
timeout 100 python benchmarks/fp8_host_profile.py > "$out/profile.txt" 2>&1
echo "== profile rc=$?"; grep -E "^==|ms x" "$out/profile.txt" | cut -c1-150 | head -64
timeout 100 python benchmarks/layer_graph.py > "$out/graph.txt" 2>&1
echo "== graph rc=$?"; grep -v -i warn "$out/graph.txt" | tail -2
MOK_EXPERT_BACKEND=torch-fp8 timeout 100 python benchmarks/layer_graph.py > "$out/graph_fp8.txt" 2>&1
echo "== graph fp8 rc=$?"; grep -v -i warn "$out/graph_fp8.txt" | tail -2
timeout 150 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --impl mok,megatron-te,mok-torch-fp8 \
  --iters 20 --json "$out/layer.json" --png "$out/layer.png" > "$out/layer.txt" 2>&1
echo "== bench layer rc=$?"; grep -E "^\| (mok|megatron)" "$out/layer.txt"
