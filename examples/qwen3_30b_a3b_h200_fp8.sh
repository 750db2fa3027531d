#!/usr/bin/env bash
# Hopper variant: Qwen3-30B-A3B on 4 nodes x 8 H100/H200 with blockwise FP8 (DeepSeek-style 1x128 /
# 128x128 scaling; MXFP8 needs Blackwell). Needs Transformer Engine and Megatron-Core 0.19.x.
#   sbatch examples/qwen3_30b_a3b_h200_fp8.sh     DRY_RUN=1 bash examples/qwen3_30b_a3b_h200_fp8.sh
#SBATCH --job-name=mok-qwen3-30b-h200
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=02:00:00
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh

NNODES=4 GPUS_PER_NODE=8 NVLINK_DOMAIN_GPUS=8      # NVLink ends at the node on Hopper: EP <= 8
GPU=${GPU:-H100}                                   # checked against the smaller Hopper (80 GB); GPU=H200
export CUDA_DEVICE_MAX_CONNECTIONS=1               # Hopper: in-order kernel queues for TP/SP overlap

MODEL_ARGS=(
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
  --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 40960
)
MOE_ARGS=(
  --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 --moe-grouped-gemm
)
MOK_ARGS=()   # defaults: NCCL transport, exact mode, 1 minibatch in a node (best measured on 2 x H200, docs/benchmarks.md)
# Megatron's own layer pads each expert's token count to the FP8 block itself; MoK's experts pad their
# rows in their own permute, so only the alltoall A/B run gets the flag (it would keep MoK off its pipeline).
ALLTOALL_ARGS=(--moe-router-padding-for-quantization)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2   # 4 chunks of 12 layers
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1   # 16 experts per GPU, EP inside the node
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather   # data parallel 16
)
PRECISION_ARGS=(
  --bf16 --fp8-format e4m3 --fp8-recipe blockwise  # Hopper (sm_90) FP8 with block scaling
)
MEMORY_ARGS=(
  --recompute-granularity selective --recompute-modules layernorm   # 80/141 GB: recompute norms only
  --manual-gc --manual-gc-interval 10             # no CUDA graphs: blockwise FP8 + TE graphs untested here
)
TRAIN_ARGS=(
  --micro-batch-size 1 --global-batch-size 512 --train-iters 20000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-30B-A3B}" --vocab-size 151936 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput)

mok_launch
