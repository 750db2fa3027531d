#!/usr/bin/env bash
# Qwen3-235B-A22B on 512 GB300 GPUs: 128 nodes x 4 GPUs, NVL72 racks.
# Needs Transformer Engine (MXFP8, TE layers, CUDA graphs) and Megatron-Core 0.19.x.
#   sbatch examples/qwen3_235b_a22b_gb300.sh      DRY_RUN=1 bash examples/qwen3_235b_a22b_gb300.sh
#SBATCH --job-name=mok-qwen3-235b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --segment=8           # 8 nodes = 32 GPUs per NVLink segment: the EP=32 group stays in one rack
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh

NNODES=128 GPUS_PER_NODE=4 NVLINK_DOMAIN_GPUS=32 GPU=GB300
export CUDA_DEVICE_MAX_CONNECTIONS=32

MODEL_ARGS=(
  --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288
  --num-attention-heads 64 --group-query-attention --num-query-groups 4 --kv-channels 128
  --qk-layernorm                                   # Qwen3: RMSNorm on Q and K
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 40960
)
MOE_ARGS=(
  --num-experts 128 --moe-ffn-hidden-size 1536 --moe-router-topk 8   # every layer MoE, no shared expert
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-router-dtype fp32 --moe-grouped-gemm
)
MOK_ARGS=(
  --mok-transport copy_engine      # EP=32 inside one NVLink segment
  --mok-sync-free --mok-capacity-multiplier 0.5
)
# Megatron's own layer pads each expert's token count to the FP8 block itself; MoK's experts pad their
# rows in their own permute, so only the alltoall A/B run gets the flag (it would keep MoK off its pipeline).
ALLTOALL_ARGS=(--moe-router-padding-for-quantization)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel   # attention with 64 heads split over 2 GPUs
  --pipeline-model-parallel-size 8
  --pipeline-model-parallel-layout "Et*5|(t*6|)*14t*5L"   # 16 stages = PP 8 x VPP 2; 5+14x6+5 = 94 layers
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1   # 4 experts per GPU
  --context-parallel-size 1        # data parallel = 512 / (2 x 8) = 32
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
PRECISION_ARGS=(
  --bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather   # MXFP8: sm_100+ only
)
MEMORY_ARGS=(
  --recompute-granularity selective --recompute-modules layernorm core_attn
  --cuda-graph-impl transformer_engine --te-rng-tracker --cuda-graph-modules attn moe_router
  --manual-gc --manual-gc-interval 10
)
TRAIN_ARGS=(
  --micro-batch-size 1 --global-batch-size 2048 --train-iters 50000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
  --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-235B-A22B}" --vocab-size 151936 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput)

mok_launch
