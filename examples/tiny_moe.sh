#!/usr/bin/env bash
# A tiny MoE GPT (2 layers, 8 experts) through Megatron's real training loop, mock data.
# Runs on one GPU (NPROC=1) and on a CPU (no GPU: gloo, fp32, local modules; NPROC processes = EP).
#   bash examples/tiny_moe.sh                      DISPATCHER=alltoall bash examples/tiny_moe.sh
#   DRY_RUN=1 bash examples/tiny_moe.sh            ITERS=50 NPROC=2 bash examples/tiny_moe.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh

NPROC=${NPROC:-1}
mok_iters 20 2   # 20 iterations, 2 of warm-up (ITERS=N: N iterations, warm-up at most N - 1)
PY=${PYTHON:-$(command -v python3 || command -v python)}
if [ -z "${DEVICE:-}" ]; then
  DEVICE=$("$PY" -c 'import torch; print("gpu" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu)
fi
# any GPU holds it; on a CPU the layout line says gpu=cpu (NPROC gloo processes)
NNODES=1 GPUS_PER_NODE=$NPROC NVLINK_DOMAIN_GPUS=$NPROC GPU=${GPU:-$([ "$DEVICE" = cpu ] && echo cpu || echo H100)}

MODEL_ARGS=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --seq-length 64 --max-position-embeddings 64)
MOE_ARGS=(--num-experts 8 --moe-ffn-hidden-size 64 --moe-router-topk 2
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2)
MOK_ARGS=()
PARALLEL_ARGS=(--expert-model-parallel-size "$NPROC")    # every process holds 8 / NPROC experts
if [ "$DEVICE" = cpu ]; then
  # What mok_megatron.training.cpu_training.CPU_FLAGS lists: gloo, no GPU-only fused kernels, fp32.
  PRECISION_ARGS=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
    --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
    --no-persist-layer-norm)
  export OMP_NUM_THREADS=1
else
  PRECISION_ARGS=(--bf16 --no-gradient-accumulation-fusion)   # the fused wgrad needs apex's CUDA extension
  # Without Transformer Engine: Megatron-Core's own modules.
  "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null || PRECISION_ARGS+=(--transformer-impl local)
fi
MEMORY_ARGS=()
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size $((4 * NPROC)) --train-iters "$ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --clip-grad 1.0 --seed 1234)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type NullTokenizer --vocab-size 128 --split 1,0,0)
LOG_ARGS=(--log-interval 1 --eval-iters 0 --eval-interval "$ITERS")

mok_launch
