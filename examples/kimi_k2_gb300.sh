#!/usr/bin/env bash
# Kimi-K2-like (about 1T total, 32B active; 384 routed experts + 1 shared, MLA) on 512 GB300 GPUs:
# 128 nodes x 4 GPUs, NVL72 racks. Needs Transformer Engine and Megatron-Core 0.19.x.
#   sbatch examples/kimi_k2_gb300.sh              DRY_RUN=1 bash examples/kimi_k2_gb300.sh
#SBATCH --job-name=mok-kimi-k2
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --segment=16          # 64 GPUs per NVLink segment: EP=64 inside one NVL72 rack
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh
mok_iters 50000 2000   # ITERS=N trains N iterations (warm-up at most N - 1)

NNODES=128 GPUS_PER_NODE=4 NVLINK_DOMAIN_GPUS=64 GPU=GB300
export CUDA_DEVICE_MAX_CONNECTIONS=32

MODEL_ARGS=(
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432   # dense FFN of the first layer
  --num-attention-heads 64 --kv-channels 128                   # half of DeepSeek-V3's heads
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512
  --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
  --rotary-scaling-factor 32 --mscale 1.0 --mscale-all-dim 1.0 --rotary-base 50000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --position-embedding-type rope
  --attention-dropout 0.0 --hidden-dropout 0.0
  --seq-length 4096 --max-position-embeddings 4096
)
MOE_ARGS=(
  --num-experts 384 --moe-ffn-hidden-size 2048 --moe-router-topk 8
  --moe-layer-freq "([0]*1+[1]*60)"                            # first layer dense
  --moe-shared-expert-intermediate-size 2048
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-topk-scaling-factor 2.827 --moe-router-num-groups 1 --moe-router-group-topk 1
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 --moe-grouped-gemm
  --moe-router-fusion
)
MOK_ARGS=(   # what `mok plan --recipe` recommends for this layout (tests/test_planner.py holds the two equal)
  --mok-transport collective --mok-minibatch-size 2048   # NCCL, 2 minibatches of the 4096 tokens per rank
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
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 8
  --pipeline-model-parallel-layout "E|(tt|)*30tL"   # 32 stages = PP 8 x VPP 4; 30 x 2 + 1 = 61 layers
  --expert-model-parallel-size 64 --expert-tensor-parallel-size 1   # 6 experts per GPU
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather   # data parallel 64
)
PRECISION_ARGS=(
  --bf16 --fp8-format e4m3 --fp8-recipe mxfp8
  --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag   # MXFP8 parameter all-gather through the grad buffer
  --use-precision-aware-optimizer --main-grads-dtype fp32 --main-params-dtype fp32
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 # BF16 Adam moments, fp32 master weights (as Megatron's own MoE recipes)
)
MEMORY_ARGS=(
  # no moe_act: the torch-fp8 experts above do not recompute it (MoK's bf16 torch experts do)
  --recompute-granularity selective --recompute-modules mla_up_proj layernorm mlp
  --manual-gc --manual-gc-interval 10
)
TRAIN_ARGS=(
  --micro-batch-size 1 --global-batch-size 4096 --train-iters "$ITERS"
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
  --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
)
DATA_ARGS=("${DATA_SOURCE[@]}" --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model "${TOKENIZER:-moonshotai/Kimi-K2-Base}" --vocab-size 163840 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput)

mok_launch
