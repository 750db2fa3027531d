#!/usr/bin/env bash
# Qwen3-30B-A3B on 512 GB300 GPUs: 128 nodes x 4 GPUs, NVL72 racks (pure data + expert parallel).
# Needs Transformer Engine (MXFP8, TE layers, CUDA graphs) and Megatron-Core 0.19.x.
#   sbatch examples/qwen3_30b_a3b_gb300.sh        DRY_RUN=1 bash examples/qwen3_30b_a3b_gb300.sh
#SBATCH --job-name=mok-qwen3-30b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --segment=8           # EP=32 group inside one NVLink segment
#SBATCH --exclusive
#SBATCH --time=02:00:00
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh
mok_iters 50000 2000   # ITERS=N trains N iterations (warm-up at most N - 1)

NNODES=128 GPUS_PER_NODE=4 NVLINK_DOMAIN_GPUS=32 GPU=GB300
export CUDA_DEVICE_MAX_CONNECTIONS=32

MODEL_ARGS=(
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
  --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 40960
  --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
  --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 --moe-grouped-gemm
  --moe-router-fusion
)
MOK_ARGS=(   # what `mok plan --recipe` recommends for this layout (tests/test_planner.py holds the two equal)
  --mok-transport collective --mok-minibatch-size 4096   # NCCL, 2 minibatches of the 8192 tokens per rank
  --mok-local-rows fused                       # a rank's own rows join its received rows' expert call
  --mok-sync-free --mok-capacity-multiplier 1.0   # counts stay on the device; 1.0: a captured layer cannot redo an overflow
  --mok-expert-backend torch-fp8               # FP8 experts that run sync-free (TE's GroupedLinear reads counts on the host)
  --cuda-graph-impl transformer_engine --te-rng-tracker   # no --cuda-graph-modules: the whole layer is one CUDA graph
)
# The MoE layer's fwd+bwd replayed from one CUDA graph is what the planner's numbers measured (one H200);
# capturing whole transformer layers in training is not measured here.
# Megatron's own layer (DISPATCHER=alltoall) pads each expert's token count to the FP8 block itself (MoK's
# experts pad in their own permute; the flag would keep MoK off its pipeline) and fuses its permute;
# dropless, it reads the counts on the host, so only attention and the router are graphed.
ALLTOALL_ARGS=(
  --moe-router-padding-for-quantization --moe-permute-fusion
  --cuda-graph-impl transformer_engine --te-rng-tracker --cuda-graph-modules attn moe_router
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1   # 30B fits per GPU with EP + dist. optimizer
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1   # 4 experts per GPU
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather   # data parallel 512
)
PRECISION_ARGS=(
  --bf16 --fp8-format e4m3 --fp8-recipe mxfp8
  --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag   # MXFP8 parameter all-gather through the grad buffer
  --use-precision-aware-optimizer --main-grads-dtype fp32 --main-params-dtype fp32
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 # BF16 Adam moments, fp32 master weights (as Megatron's own MoE recipes)
)
MEMORY_ARGS=(
  # No recompute: activations of a 2048-wide model fit in 288 GB at micro-batch 2.
  --manual-gc --manual-gc-interval 10
)
TRAIN_ARGS=(
  --micro-batch-size 2 --global-batch-size 2048 --train-iters "$ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
  --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-30B-A3B}" --vocab-size 151936 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput)

mok_launch
