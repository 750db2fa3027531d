#!/usr/bin/env bash
# The GPU side of the project in phases that each fit one 10-minute call, from the project root with
# megatron-core (+TE, torchtitan) importable:
#   bash benchmarks/gpu.sh tests|layer|overlap|ep|wgrad|split|gather|tiles|tiles-layer|tiles-layer-backward|tiles-bench|tiles-ceiling|fp8-weights|te [outdir]
#   tests    every GPU test (skips cleanly what this machine cannot run)
#   layer    mok bench layer, every shape (uniform / zipf / one-hot routing), one process per shape
#   overlap  benchmarks/overlap.sh;  ep  benchmarks/ep.sh (2+ GPUs)
#   wgrad    benchmarks.wgrad (weight gradients in 1 vs 4 calls: summed, merged, accumulated; QuACK if installed)
#            and the loopback sweep's late-wgrad A/B (one weight-gradient GEMM per layer call vs per minibatch)
#   split    the loopback sweep with minibatches split by tokens and by experts (--mok-minibatch-split),
#            with the emulated copies and link time only, against the graphed no-communication layer
#   gather   benchmarks.gather (fc1 over gathered rows, QuACK, vs the permuted copy + torch's grouped GEMM)
#   tiles    the tile kernels' and the tiles engine's GPU tests (waiting GEMM, pull, completion-driven combine; QuACK needed), then
#            their gate sweep at K 0/2/4/8 over the five tile configurations
#   tiles-layer  benchmarks.tile_pull and benchmarks.tile_layer: the pull's GB/s per K, and the forward's
#            exposed and hidden time at 900 / 450 GB/s against the graphed layer without communication
#   tiles-layer-backward  benchmarks.tile_layer forward and backward (8 CuTe compiles: give it its own call)
#   tiles-bench  mok bench layer: MoK's layer on the tiles engine beside the default engine and SonicMoE (no
#            communication: the tile GEMMs' layer against the fastest layer measured)
#   tiles-ceiling  benchmarks.tile_layer forward and backward at K 8/16, 900 / 450 GB/s, the register copy
#            against the link time only (--copy none: no byte moved, the ceiling the schedule allows), the
#            two default slices, then the 16k-token DeepSeek-V3 slice in a process (and timeout) of its own
#   fp8-weights  the dgrad weight quantization's column-block kernel against the segment kernels: bitwise GPU
#            tests, then benchmarks.kernels --weights at several launches (GB/s)
#   te       the te backend's GPU tests (TE, cuBLASLt 13.6+ preloaded for the grouped route) and the Qwen3 layer
#            with every FP8 expert path, the single grouped weight included
# Each phase leaves its logs in outdir and, with OUT set, one tarball $OUT/<phase>.tgz.
set -u
phase=${1:?phase: tests, ep, layer, overlap, wgrad, split, gather, tiles, tiles-layer, tiles-layer-backward, tiles-bench, tiles-ceiling, fp8-weights or te}
out=${2:-/tmp/mok-evidence/$phase}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=python3
case "$phase" in
  tests)  # every GPU test (skips cleanly what this machine cannot run)
    timeout 540 $py -m pytest -q -m gpu tests -p no:cacheprovider \
      -o addopts="" --timeout 300 -rs 2>&1 | tail -60 > "$out/gpu_tests.txt"
    tail -25 "$out/gpu_tests.txt"
    ;;
  ep)     # real EP layer times (MoK engines vs Megatron+TE) + the tiny recipe, MoK vs alltoall
    OUT=$out bash benchmarks/ep.sh
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
    OUT=$out bash benchmarks/overlap.sh
    ;;
  wgrad)
    timeout 240 $py -m benchmarks.wgrad --shape deepseek-v3-ep32,qwen3-30b-a3b --calls 4 --iters 10 \
      --json "$out/wgrad.json" 2>&1 | grep -v -i warn | tee "$out/wgrad.txt"
    CUDA_VISIBLE_DEVICES=0 timeout 300 $py -m benchmarks.overlap --iters 20 \
      --shapes dsv3-4k,qwen3-ep8 --gbps 0,900 --chunks 2,4 --modes sync-free+graph,sync-free+graph+late-wgrad \
      --json "$out/late-wgrad.json" 2>&1 | grep -v -i warn | tee "$out/late-wgrad.txt"
    ;;
  split)
    CUDA_VISIBLE_DEVICES=0 timeout ${SPLIT_TIMEOUT:-540} $py -m benchmarks.overlap --iters ${ITERS:-10} \
      --warmup 3 --shapes ${SHAPES:-dsv3-4k,dsv3-16k,qwen3-ep8} --gbps ${GBPS:-0,900} --chunks ${CHUNKS:-1,2,4} \
      --modes ${MODES:-sync-free+graph,sync-free+graph+experts,sync-free+graph+link-only,sync-free+graph+experts+link-only} \
      --json "$out/split.json" 2>&1 | grep -v -i warn | tee "$out/split.txt"
    ;;
  gather)
    timeout 240 $py -m benchmarks.gather --shape deepseek-v3-ep32,qwen3-30b-a3b \
      --json "$out/gather.json" 2>&1 | grep -v -i warn | tee "$out/gather.txt"
    ;;
  tiles)
    timeout 300 $py -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs tests/test_tile_gemm.py \
      tests/test_tile_pull.py tests/test_tile_combine.py tests/test_tiles_engine.py 2>&1 | tail -40 \
      | tee "$out/tile_gpu_tests.txt"
    timeout 280 $py -m benchmarks.tile_gemm_gate --all-configs --k 0,2,4,8 --rounds 7 --case-timeout 60 \
      --json "$out/gate.json" 2>&1 | tail -30 | tee "$out/gate.txt"
    ;;
  tiles-layer)
    timeout 150 $py -m benchmarks.tile_pull --k 8,16 --gbps '' --copy registers,tma --block-bytes 32768,65536 \
      --stages 1,2 --json "$out/pull.json" 2>&1 | tail -40 | tee "$out/pull.txt"
    timeout 380 $py -m benchmarks.tile_layer --phase forward --combine after --k 8,16,24,32 --gbps 900,450,0 \
      --json "$out/layer-fwd.json" 2>&1 | tail -40 | tee "$out/layer-fwd.txt"
    ;;
  tiles-layer-backward)
    timeout 560 $py -m benchmarks.tile_layer --phase both --combine after --k 8,16 --gbps 900,450,0 \
      --json "$out/layer.json" 2>&1 | tail -60 | tee "$out/layer.txt"
    ;;
  tiles-bench)
    for s in qwen3-30b-a3b deepseek-v3-ep32; do
      timeout 270 $py -m mok_megatron.cli bench layer --shape "$s" --iters ${ITERS:-20} --impl mok,mok-tiles,sonic \
        --json "$out/tiles-bench-$s.json" 2>&1 | grep "^|" | tee "$out/tiles-bench-$s.txt"
    done
    ;;
  tiles-ceiling)  # 560 s in all: the two slices (~3 min with QuACK's compiles cold), then the 16k slice
    timeout 300 $py -m benchmarks.tile_layer --phase both --combine after --k 8,16 --copy registers,none \
      --gbps 900,450 --json "$out/ceiling.json" 2>&1 | tail -60 | tee "$out/ceiling.txt"
    timeout 260 $py -m benchmarks.tile_layer --shapes deepseek-v3-ep32-16k --phase both --combine after \
      --k 8,16 --copy registers,none --gbps 900,450 --json "$out/ceiling-16k.json" 2>&1 | tail -40 \
      | tee "$out/ceiling-16k.txt"
    ;;
  fp8-weights)
    timeout 200 $py -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfs tests/test_fp8_gpu.py \
      tests/test_fp8_quant_kernels.py -k "fp8_quant or weight" 2>&1 | tail -15 | tee "$out/fp8_quant_gpu_tests.txt"
    timeout 300 $py -m benchmarks.kernels --weights --weight-plans 1x16w16,1x32w16,1x64w16,2x16,2x32,4x16w4,4x32w4 \
      --json "$out/fp8_weights.json" 2>&1 | grep -v -i warn | tee "$out/fp8_weights.txt"
    ;;
  te)
    timeout 300 $py -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_te_grouped_gpu.py \
      tests/test_fp8_gpu.py 2>&1 | grep -v "DEBUG\|dcp_logger" | tail -40 | tee "$out/te_gpu_tests.txt"
    timeout 280 $py -m mok_megatron.cli bench layer --shape qwen3-30b-a3b --iters 10 --warmup 2 --impl \
      mok,mok-torch-fp8,mok-torch-fp8-step,mok-te-tensorwise,mok-te-blockwise,mok-te-tensorwise-single,mok-te-blockwise-single \
      --json "$out/te-layer.json" 2>&1 | grep "^|" | tee "$out/te-layer.txt"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/$phase.tgz" -C "$(dirname "$out")" "$(basename "$out")"; fi
