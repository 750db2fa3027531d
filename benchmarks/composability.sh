#!/usr/bin/env bash
# Megatron's schedules driving MoK layers on 2 GPUs: the tiny recipe (examples/tiny_moe.sh, EP=2, bf16, mock
# data) through Megatron's training loop, MoK vs Megatron's alltoall layer.
#   bash benchmarks/composability.sh [outdir] [group]    group: graphs (default) | memory | all
# graphs: MoK iteration time with and without CUDA graphs (--cuda-graph-impl local, attn + moe_router), and
#         Megatron's 1F1B EP overlap + delayed wgrad driving MoK layers (2 micro-batches per step).
# all:    graphs + the same for Megatron's alltoall layer + memory.
# memory: a wider model (hidden 1024, 4k tokens per micro-batch) with and without selective recompute of
#         the MoE module (moe) or its activation (moe_act): Megatron's "max allocated" after iteration 1.
# Prints one table; logs stay in outdir.
set -u
out=${1:-${OUT:-/tmp/mok-composability}}; group=${2:-graphs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name dispatcher iters extra-args
  local name=$1 disp=$2 iters=$3; shift 3
  DEVICE=gpu NPROC=2 ITERS=$iters DISPATCHER=$disp EXTRA_ARGS="--global-batch-size 16 $*" \
    timeout 150 bash examples/tiny_moe.sh > "$out/$name.log" 2>&1
  echo "$name rc=$? flags: $*" >> "$out/runs.txt"
}
GRAPHS="--cuda-graph-impl local --cuda-graph-modules attn moe_router"
WIDE="--moe-grouped-gemm --hidden-size 1024 --ffn-hidden-size 2048 --moe-ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024"
if [ "$group" != memory ]; then
  run mok mok 30
  run mok_graphs mok 30 $GRAPHS
  run mok_ep_overlap mok 30 --overlap-moe-expert-parallel-comm --delay-wgrad-compute
fi
if [ "$group" = all ]; then
  run alltoall alltoall 30
  run alltoall_graphs alltoall 30 $GRAPHS
fi
if [ "$group" = memory ] || [ "$group" = all ]; then
  run wide_mok mok 5 $WIDE
  run wide_mok_recompute_moe mok 5 $WIDE --recompute-granularity selective --recompute-modules moe
  run wide_mok_recompute_moe_act mok 5 $WIDE --recompute-granularity selective --recompute-modules moe_act
fi
python3 - "$out" <<'PY'
import re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| run | rc | iters | median ms/iter (iters 5+) | loss first -> last | max allocated MiB (rank 0) |")
print("|---|---|---|---|---|---|")
for line in (out / "runs.txt").read_text().splitlines():
    name, rc = line.split()[0], line.split()[1]
    log = (out / f"{name}.log").read_text(errors="replace")
    its = re.findall(r"iteration +(\d+)/ *\d+ .*?per iteration \(ms\): ([\d.]+).*?lm loss: ([\d.E+-]+)", log)
    ms = [float(t) for i, t, _ in its if int(i) >= 5]
    mem = re.findall(r"\(after 1 iterations\) memory \(MB\).*?max allocated: ([\d.]+)", log)
    med = f"{statistics.median(ms):.1f}" if ms else "-"
    loss = f"{float(its[0][2]):.4f} -> {float(its[-1][2]):.4f}" if its else "-"
    print(f"| {name} | {rc} | {len(its)} | {med} | {loss} | {mem[0] if mem else '-'} |")
    if not its:
        err = [l for l in log.splitlines() if "Error" in l or "error:" in l][-3:]
        print("   " + " / ".join(e.strip()[:200] for e in err))
PY
