# Shared by the recipes: build the launch command from the flag arrays and run it, or print it.
#
#   DRY_RUN=1   print the layout line and the exact launch command (one line, shell-quoted), run nothing
#   DISPATCHER  mok (default) or alltoall: the same command A/B-compares the MoK layer and Megatron's
#   EXTRA_ARGS  more Megatron/MoK flags, appended last (argparse keeps the last value of a repeated flag)
#   ITERS       training iterations (any whole number >= 1); the recipe's warm-up stays below them
#
# MOK_ARGS go to the MoK run only, ALLTOALL_ARGS (optional) to Megatron's alltoall run only.
#
# A recipe sets NNODES, GPUS_PER_NODE, NVLINK_DOMAIN_GPUS, GPU (GB300, GB200, B200, H200, H100: `mok recipe
# check` estimates memory against its HBM, `mok plan --recipe` plans on its cluster) and the arrays MODEL_ARGS, MOE_ARGS,
# PARALLEL_ARGS, PRECISION_ARGS, MEMORY_ARGS, TRAIN_ARGS, DATA_ARGS, LOG_ARGS, then calls mok_launch.

DISPATCHER=${DISPATCHER:-mok}

# mok_iters ITERS WARMUP: the recipe's iterations and warm-up; sets ITERS (the user's ITERS, else the recipe's)
# and WARMUP (the recipe's, at most ITERS - 1: Megatron's scheduler asserts fewer warm-up than decay steps,
# and the decay runs over --train-iters). An ITERS that is not a whole number >= 1 stops here, in one line.
mok_iters() {
  ITERS=${ITERS:-$1}
  case "$ITERS" in
    ''|*[!0-9]*|0*)
      echo "$(basename "${BASH_SOURCE[1]}"): ITERS=$ITERS: must be a whole number >= 1 (e.g. ITERS=$1)." >&2
      exit 2 ;;
  esac
  WARMUP=$(( ITERS > $2 ? $2 : ITERS - 1 ))
}
# Megatron indexed data (prefix of .bin/.idx, or a blend "w1 p1 w2 p2") or mock data.
if [ -n "${DATA_PATH:-}" ]; then read -r -a DATA_SOURCE <<< "--data-path $DATA_PATH"; else DATA_SOURCE=(--mock-data); fi

mok_launch() {
  local nnodes=${NNODES:-1} gpn=${GPUS_PER_NODE:-1}
  local rdzv=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n1)}
  rdzv=${rdzv:-localhost}
  local launcher=(torchrun --nnodes "$nnodes" --nproc-per-node "$gpn"
    --rdzv-backend c10d --rdzv-endpoint "${rdzv}:${MASTER_PORT:-29500}" --rdzv-id "${SLURM_JOB_ID:-mok}")
  local cmd=("${launcher[@]}" -m mok_megatron.pretrain_gpt
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" --moe-token-dispatcher-type "$DISPATCHER"
    "${PARALLEL_ARGS[@]}" "${PRECISION_ARGS[@]}" "${MEMORY_ARGS[@]}"
    "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${LOG_ARGS[@]}")
  if [ "$DISPATCHER" = mok ]; then cmd+=("${MOK_ARGS[@]}"); else cmd+=(${ALLTOALL_ARGS[@]+"${ALLTOALL_ARGS[@]}"}); fi
  if [ -n "${EXTRA_ARGS:-}" ]; then local extra; read -r -a extra <<< "$EXTRA_ARGS"; cmd+=("${extra[@]}"); fi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "# layout: nodes=$nnodes gpus_per_node=$gpn nvlink_domain_gpus=${NVLINK_DOMAIN_GPUS:-$gpn} gpu=${GPU:-unknown}"
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi
  if ! command -v torchrun > /dev/null; then
    echo "$(basename "$0"): torchrun not found: activate the environment mok-megatron is installed in (e.g. source .venv/bin/activate after ./run demo)." >&2
    return 127
  fi
  if [ -n "${SLURM_JOB_ID:-}" ] && [ "$nnodes" -gt 1 ]; then
    srun --ntasks-per-node 1 "${cmd[@]}"   # one torchrun per node
  else
    "${cmd[@]}"
  fi
}
