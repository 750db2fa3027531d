#!/usr/bin/env bash
# Everything GPU-side the open issues ask for, in phases that each fit one 10-minute device call.
# Run from the repo root on the H200 machine(s) with megatron-core (+TE, torchtitan) on PYTHONPATH.
#   bash benchmarks/gpu_evidence.sh tests|ep|layer|overlap [outdir]
# Each phase leaves its logs in outdir and one tarball ($OUT/<phase>.tgz) for the device tool.
set -u
phase=${1:?phase: tests, ep, layer or overlap}
out=${2:-/tmp/mok-evidence/$phase}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=python3
case "$phase" in
  tests)  # GPU tests of every issue (skip cleanly what this machine cannot run)
    timeout 400 $py -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py -p no:cacheprovider \
      -o addopts="" --timeout 300 -rs 2>&1 | tail -60 > "$out/gpu_tests.txt"
    tail -25 "$out/gpu_tests.txt"
    ;;
  ep)     # real EP=2 layer times (MoK engines vs Megatron+TE) + the tiny recipe, 50 iterations, MoK vs alltoall
    OUT=$out bash benchmarks/final_h200x2.sh
    ;;
  layer)  # mok bench layer, every shape (uniform/zipf/one-hot), one process per shape
    for s in ${SHAPES:-qwen3-30b-a3b deepseek-v3-ep32 qwen3-235b-a22b-ep32 mixtral-8x7b}; do
      timeout ${LAYER_TIMEOUT:-150} $py -m mok_megatron.cli bench layer --shape "$s" --routing ${ROUTING:-all} \
        --iters ${ITERS:-20} --json "$out/layer-$s.json" --png "$out/layer-$s.png" 2>&1 \
        | grep -v -i warn > "$out/layer-$s.txt"
      echo "== $s rc=$?"; grep "^|" "$out/layer-$s.txt" | head -30
    done
    ;;
  overlap) # one-GPU loopback sweep (+ real EP when >= 2 GPUs)
    bash benchmarks/overlap_h200.sh "$out"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/$phase.tgz" -C "$(dirname "$out")" "$(basename "$out")"; fi
