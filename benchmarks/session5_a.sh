#!/usr/bin/env bash
# Session 5, run A (one H200): router GEMM on bf16 tensor cores (MoKTopKRouter). GPU tests of the router
# and layer parity, then where the EP=1 layer's time goes (bf16 and torch-fp8) and eager vs CUDA graph.
# Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_a.sh
set -u
out=${OUT:-/tmp/mok-s5a}; mkdir -p "$out"
timeout 120 python -m pytest -q tests/test_gpu.py -k "router or parity_vs_megatron_on_gpu or deterministic" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"
timeout 150 python benchmarks/fp8_host_profile.py --shapes deepseek-v3-ep32,qwen3-30b-a3b > "$out/profile.txt" 2>&1
echo "== profile rc=$?"; grep -E "^==|ms x" "$out/profile.txt" | cut -c1-150 | head -60
timeout 120 python benchmarks/layer_graph.py > "$out/graph.txt" 2>&1
echo "== graph rc=$?"; grep -v -i warn "$out/graph.txt" | tail -6
