#!/usr/bin/env bash
# Session 6, run F (one H200, no TE): the overlap pipeline with native FP8 experts (each expert call's rows
# padded by the permute) against bf16 experts, loopback transport standing in for EP=32 on the DeepSeek-V3
# slice, infinite / 450 / 50 GB/s links, 1 and 2 minibatches.
#   Repo root, PYTHONPATH=/tmp/site:$PWD.  OUT=<dir> bash benchmarks/session6_f.sh
set -u
out=${OUT:-/tmp/mok-s6f}; mkdir -p "$out"
for b in torch torch-fp8; do
  timeout 100 python -m mok_megatron.cli bench overlap --shapes dsv3-4k --gbps 0,450,50 --chunks 1,2 \
    --modes exact --iters 20 --expert-backend $b --json "$out/overlap-$b.json" > "$out/overlap-$b.txt" 2>&1
  echo "== overlap $b rc=$?"; grep -v -i "warn\|^  \|^$" "$out/overlap-$b.txt" | grep -i "ms" | head -12
done
