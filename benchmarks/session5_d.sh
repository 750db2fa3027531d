#!/usr/bin/env bash
# Session 5, run D (one H200, no TE needed): GPU tests of the router changes, the grouped-GEMM layout
# probe, the top-k launch sweep.  Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session5_d.sh
set -u
out=${OUT:-/tmp/mok-s5d}; mkdir -p "$out"
timeout 200 python -m pytest -q tests/test_kernels.py tests/test_gpu.py -k "topk or router or parity_vs_megatron_on_gpu or captures or deterministic" > "$out/gpu_tests.txt" 2>&1
echo "== GPU tests rc=$?: $(tail -1 "$out/gpu_tests.txt")"; grep -E "^FAILED|^E " "$out/gpu_tests.txt" | head -12
timeout 100 python benchmarks/gemm_layout_probe.py > "$out/gemm_layout.txt" 2>&1
echo "== gemm layout rc=$?"; grep -v -i warn "$out/gemm_layout.txt"
timeout 100 python benchmarks/topk_probe.py > "$out/topk.txt" 2>&1
echo "== topk rc=$?"; grep -v -i warn "$out/topk.txt" | sort -t: -k2 -n | head -0; cat "$out/topk.txt" | grep -E "==|block_t" | awk '/==/{print; next} {print}' | head -80 > /dev/null; grep "==" "$out/topk.txt"
python - "$out/topk.txt" <<'PY'
import re, sys
best = {}
cur = None
for line in open(sys.argv[1]):
    if line.startswith("\n") or not line.strip():
        continue
    if line.startswith("=="):
        cur = line.strip(); best[cur] = []
    elif cur and "block_t" in line:
        us = float(line.split(":")[1].split()[0]); best[cur].append((us, line.strip()))
for k, v in best.items():
    print(k, "| best:", sorted(v)[:3])
PY
