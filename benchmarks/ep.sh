#!/usr/bin/env bash
# Real expert parallelism on one host (2+ GPUs): MoK's transports and modes against Megatron+TE's alltoall
# layer, the same per-rank work in one process group, fwd+bwd per rank, then the tiny recipe through
# Megatron's training loop (MoK vs alltoall). Run from the project root with megatron-core (and TE for the
# Megatron+TE reference) importable:
#   OUT=<dir> bash benchmarks/ep.sh [bf16|fp8]
#   bf16 (default): local rows fused/overlap x exact / sync-free+graph / +FP8 dispatch, one profiled step;
#     then Megatron's combined 1F1B EP-overlap schedule against the plain one (--schedules plain,1f1b: a
#     one-layer GPT, two micro-batches per call), Megatron's layer and MoK's
#   fp8: native FP8 experts (--expert-backend torch-fp8), exact, sync-free+graph, FP8 dispatch and combine
#   budget: the nvlink transport's communication CTAs, forward / backward (--mok-nvlink-programs[-backward]),
#     against the same layer's EP=1 work: what the GEMMs beside the exchanges lose per CTA taken
set -u
out=${OUT:-/tmp/mok-ep}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 2 ] || { echo "benchmarks/ep.sh needs 2 or more GPUs (found $ngpu)"; exit 2; }
case "${1:-bf16}" in
  bf16)
    timeout ${T_EP:-330} torchrun --nproc-per-node "$ngpu" -m mok_megatron.bench.ep --shapes dsv3,qwen3 \
      --transports ${TRANSPORTS:-collective,copy_engine} --local-rows fused,overlap --chunks ${CHUNKS:-1} \
      --modes ${MODES:-exact,sync-free+graph,sync-free+graph+fp8} --profile --iters 10 --warmup 3 \
      --json "$out/ep.json" > "$out/ep.txt" 2>&1
    echo "== bench ep rc=$?"; grep -E "^\||^profile|EP=|fail|Error" "$out/ep.txt" | cut -c1-200
    timeout ${T_SCHED:-300} torchrun --nproc-per-node "$ngpu" -m mok_megatron.bench.ep --shapes dsv3,qwen3 \
      --schedules plain,1f1b --iters 10 --warmup 3 --json "$out/ep-schedules.json" > "$out/ep-schedules.txt" 2>&1
    echo "== bench ep schedules rc=$?"; grep -E "^\||EP=|fail|Error" "$out/ep-schedules.txt" | cut -c1-200 ;;
  fp8)
    timeout ${T_EP:-330} torchrun --nproc-per-node "$ngpu" -m mok_megatron.bench.ep --shapes dsv3,qwen3 \
      --transports ${TRANSPORTS:-collective,copy_engine} --local-rows fused --chunks 1 \
      --modes ${MODES:-exact,sync-free+graph,sync-free+graph+fp8-both} --expert-backend torch-fp8 --iters 10 \
      --warmup 3 --json "$out/ep-torch-fp8.json" > "$out/ep-torch-fp8.txt" 2>&1
    echo "== bench ep torch-fp8 rc=$?"; grep -E "^\||EP=|fail|Error" "$out/ep-torch-fp8.txt" | cut -c1-200 ;;
  budget)
    timeout ${T_EP:-330} torchrun --nproc-per-node "$ngpu" -m mok_megatron.bench.ep --shapes dsv3,qwen3 \
      --transports ${TRANSPORTS:-nvlink:64/64,nvlink:32/32,nvlink:16/16,nvlink:32/64,nvlink:16/64} --local-rows fused \
      --chunks 1 --modes ${MODES:-exact,sync-free+graph} --iters 10 --warmup 3 --json "$out/ep-budget.json" \
      > "$out/ep-budget.txt" 2>&1
    echo "== bench ep budget rc=$?"; grep -E "^\||EP=|fail|Error" "$out/ep-budget.txt" | cut -c1-200 ;;
  *) echo "usage: OUT=<dir> bash benchmarks/ep.sh [bf16|fp8|budget]"; exit 2 ;;
esac
for d in mok alltoall; do
  DEVICE=gpu ITERS=50 NPROC=$ngpu DISPATCHER=$d timeout 100 bash examples/tiny_moe.sh > "$out/tiny_$d.log" 2>&1
  echo "tiny $d rc=$?"; grep -E "iteration +(1|10|25|50)/" "$out/tiny_$d.log" | cut -c1-300
done
