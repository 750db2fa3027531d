#!/usr/bin/env bash
# Session 5, run B (one H200, TE 2.20.2): the EP=1 layer after the tensor-core router GEMM, with and
# without TE's fused top-k router (--moe-router-fusion): kernel profile, eager vs CUDA graph, and
# `mok bench layer` against Megatron+TE on the issue-4 target shapes (same config for both).
# Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_b.sh
set -u
out=${OUT:-/tmp/mok-s5b}; mkdir -p "$out"
timeout 100 python benchmarks/fp8_host_profile.py --backends torch --router-fusion > "$out/profile_fused.txt" 2>&1
echo "== profile (fused router) rc=$?"; grep -E "^==|ms x" "$out/profile_fused.txt" | cut -c1-150 | head -34
for f in "" --router-fusion; do
  timeout 100 python benchmarks/layer_graph.py $f > "$out/graph$f.txt" 2>&1
  echo "== graph $f rc=$?"; grep -v -i warn "$out/graph$f.txt" | tail -2
done
for f in "" --router-fusion; do
  timeout 150 python -m mok_megatron.cli bench layer --shape qwen3-30b-a3b,deepseek-v3-ep32 --impl mok,megatron-te \
    --iters 20 $f --json "$out/layer$f.json" > "$out/layer$f.txt" 2>&1
  echo "== bench layer $f rc=$?"; grep -E "^\| (mok|megatron)" "$out/layer$f.txt"
done
