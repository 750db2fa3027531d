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
mok_iters 50000 2000   # ITERS=N trains N iterations (warm-up at most N - 1)

NNODES=128 GPUS_PER_NODE=4 NVLINK_DOMAIN_GPUS=32 GPU=GB300
export CUDA_DEVICE_MAX_CONNECTIONS=32

MODEL_ARGS=(
  --num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288
  --num-attention-heads 64 --group-query-attention --num-query-groups 4 --kv-channels 128
  --qk-layernorm                                   # Qwen3: RMSNorm on Q and K
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 40960
  --attention-dropout 0.0 --hidden-dropout 0.0     # also what a graphed core_attn recompute needs
)
MOE_ARGS=(
  --num-experts 128 --moe-ffn-hidden-size 1536 --moe-router-topk 8   # every layer MoE, no shared expert
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-router-dtype fp32 --moe-grouped-gemm --moe-router-fusion
)
MOK_ARGS=(   # what `mok plan --recipe` recommends for this layout (tests/test_planner.py holds the two equal)
  --mok-transport collective --mok-minibatch-size 1024   # NCCL, 2 minibatches of the 2048 tokens per rank (sequence parallel over TP 2)
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
  --tensor-model-parallel-size 2 --sequence-parallel   # attention with 64 heads split over 2 GPUs
  --pipeline-model-parallel-size 8
  --pipeline-model-parallel-layout "Et*5|(t*6|)*14t*5L"   # 16 stages = PP 8 x VPP 2; 5+14x6+5 = 94 layers
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1   # 4 experts per GPU
  --context-parallel-size 1        # data parallel = 512 / (2 x 8) = 32
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
PRECISION_ARGS=(
  --bf16 --fp8-format e4m3 --fp8-recipe mxfp8      # MXFP8: sm_100+ only
  --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag   # MXFP8 parameter all-gather through the grad buffer
  --use-precision-aware-optimizer --main-grads-dtype fp32 --main-params-dtype fp32
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 # BF16 Adam moments, fp32 master weights (as Megatron's own MoE recipes)
)
MEMORY_ARGS=(
  # no moe_act: the torch-fp8 experts above do not recompute it (MoK's bf16 torch experts do)
  --recompute-granularity selective --recompute-modules layernorm core_attn
  --manual-gc --manual-gc-interval 10
)
TRAIN_ARGS=(
  --micro-batch-size 1 --global-batch-size 2048 --train-iters "$ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
  --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-235B-A22B}" --vocab-size 151936 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput)

mok_launch
