#!/usr/bin/env bash
# Session 5, run E (one H200, no TE): the aligned EP=1 plan for the native FP8 experts (permute writes
# the padded layout). GPU tests, kernel profile bf16 vs torch-fp8, eager vs CUDA graph, bench layer.
# Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_e.sh
set -u
out=${OUT:-/tmp/mok-s5e}; mkdir -p "$out"
timeout 200 python -m pytest -q tests/test_fp8_gpu.py tests/test_layer_launches.py tests/test_gpu.py -k "not te_ and not demo and not ep2 and not combined_1f1b and not dist_checkpoint" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^E " "$out/gpu_tests.txt" | head -12
timeout 100 python benchmarks/fp8_host_profile.py > "$out/profile.txt" 2>&1
echo "== profile rc=$?"; grep -E "^==|ms x" "$out/profile.txt" | cut -c1-150 | head -64
for b in torch torch-fp8; do
  MOK_EXPERT_BACKEND=$b timeout 100 python benchmarks/layer_graph.py > "$out/graph_$b.txt" 2>&1
  echo "== graph $b rc=$?"; grep -v -i warn "$out/graph_$b.txt" | tail -2
done
timeout 150 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --impl mok,mok-torch-fp8 \
  --iters 20 --json "$out/layer.json" > "$out/layer.txt" 2>&1
echo "== bench layer rc=$?"; grep -E "^\| (mok|megatron)" "$out/layer.txt"
