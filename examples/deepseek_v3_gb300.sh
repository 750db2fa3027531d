#!/usr/bin/env bash
# DeepSeek-V3 (671B total, 37B active) on 512 GB300 GPUs: 128 nodes x 4 GPUs, NVL72 racks.
# Needs Transformer Engine (MXFP8, TE layers, CUDA graphs) and Megatron-Core 0.19.x.
#   sbatch examples/deepseek_v3_gb300.sh          DRY_RUN=1 bash examples/deepseek_v3_gb300.sh
#SBATCH --job-name=mok-dsv3
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --segment=16          # 16 nodes = 64 GPUs per NVLink segment: the EP=64 group stays in one NVL72 rack
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source ./lib/common.sh
mok_iters 50000 2000   # ITERS=N trains N iterations (warm-up at most N - 1)

NNODES=128 GPUS_PER_NODE=4 NVLINK_DOMAIN_GPUS=64 GPU=GB300   # 64 of a rack's 72 GPUs per segment
export CUDA_DEVICE_MAX_CONNECTIONS=32              # GB300: let TP/EP comm kernels run beside compute
export NVTE_FWD_LAYERNORM_SM_MARGIN=16 NVTE_BWD_LAYERNORM_SM_MARGIN=16

MODEL_ARGS=(
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432   # dense FFN of the first 3 layers
  --num-attention-heads 128 --kv-channels 128
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512
  --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
  --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --rotary-base 10000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --position-embedding-type rope
  --attention-dropout 0.0 --hidden-dropout 0.0
  --seq-length 4096 --max-position-embeddings 4096
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1            # one multi-token-prediction layer
)
MOE_ARGS=(
  --num-experts 256 --moe-ffn-hidden-size 2048 --moe-router-topk 8
  --moe-layer-freq "([0]*3+[1]*58)"                            # 3 dense layers, then 58 MoE layers
  --moe-shared-expert-intermediate-size 2048                   # one shared expert
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 8 --moe-router-group-topk 4
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-router-dtype fp32 --moe-grouped-gemm --moe-router-fusion
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
# Megatron's GB200 guide runs --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep (DeepEP's
# hybrid-ep build): DISPATCHER=flex EXTRA_ARGS="--moe-flex-dispatcher-backend hybridep" runs that instead.
ALLTOALL_ARGS=(
  --moe-router-padding-for-quantization --moe-permute-fusion
  --cuda-graph-impl transformer_engine --te-rng-tracker --cuda-graph-modules attn moe_router
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1               # MLA + 7168 hidden fits without TP on 288 GB
  --pipeline-model-parallel-size 8
  --pipeline-model-parallel-layout "Et|(tt|)*30mL"   # 32 stages = PP 8 x VPP 4: E+1 layer, 30 x 2 layers, MTP+loss
  --expert-model-parallel-size 64              # 4 experts per GPU; 64 GPUs = one NVLink segment
  --expert-tensor-parallel-size 1
  --context-parallel-size 1                    # data parallel = 512 / (1 x 8 x 1) = 64
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
PRECISION_ARGS=(
  --bf16
  --fp8-format e4m3 --fp8-recipe mxfp8         # MXFP8 needs sm_100+ (Blackwell) and TE >= 2.x
  --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag   # MXFP8 parameter all-gather through the grad buffer
  --use-precision-aware-optimizer --main-grads-dtype fp32 --main-params-dtype fp32
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 # BF16 Adam moments, fp32 master weights (Megatron's GB200 guide)
)
MEMORY_ARGS=(
  --recompute-granularity selective
  # Megatron's GB200 guide recomputes moe_act too: MoK's bf16 torch experts can, but the torch-fp8 experts
  # above do not (nor te), so moe_act stays out for both layers of the A/B
  --recompute-modules mla_up_proj layernorm mlp
  --manual-gc --manual-gc-interval 10
)
TRAIN_ARGS=(
  --micro-batch-size 1 --global-batch-size 4096 --train-iters "$ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
  --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
)
DATA_ARGS=("${DATA_SOURCE[@]}"   # --data-path $DATA_PATH, or --mock-data when DATA_PATH is unset
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:-deepseek-ai/DeepSeek-V3}"
  --vocab-size 129280 --split 99,1,0)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --log-throughput
  ${CKPT_DIR:+--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --ckpt-format torch_dist})

mok_launch
