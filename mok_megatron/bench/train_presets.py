"""The models ``mok bench train --preset NAME`` trains, each a full Megatron flag list (docs/bench-train.md
prints them).

A preset holds the model, the MoE layer, the precision and the optimizer/data settings; ``mok bench train``
adds what it controls itself: the token dispatcher of each run, ``--train-iters``, ``--global-batch-size``
(``--micro-batch-size`` x data-parallel size, so one preset serves any number of GPUs),
``--expert-model-parallel-size`` (the process count, experts permitting), logging, and the checkpoint
both runs load. ``--moe-router-dtype fp32`` everywhere: the loss comparison between the layers needs the
routing decided in fp32.

qwen3-30b-a3b   Qwen3-30B-A3B's layer at 4 of its 48 layers: 128 experts of width 768, top-8, GQA 32/4.
deepseek-v3     DeepSeek-V3's layer at 4 layers, hidden 7168: MLA, a dense first layer, a shared expert,
                group-limited sigmoid routing (8 groups, 4 chosen) with expert bias, top-8, experts of width
                2048 -- as many as fit one H200 with Adam (``DEEPSEEK_V3_EXPERTS``, arithmetic below).
mixtral-8x7b    Mixtral-8x7B at 2 of its 32 layers, full width: 8 experts of width 14336, top-2.
tiny            2 layers, hidden 64, 8 experts: runs on a CPU in seconds per step (the tests use it).

DeepSeek-V3 expert count (``mok_megatron.tools.recipe.memory.estimate`` of the preset on one GPU; the test
file checks the numbers): bf16 weights 2 + fp32 gradients 4 + Adam 12 (fp32 master + two moments) = 18 bytes
per parameter. Everything but the routed experts -- embedding and output layer 2 x 129280 x 7168 = 1.85 G,
MLA 4 x 0.19 G, the dense layer 0.40 G, 3 shared experts 0.13 G -- is 3.13 G parameters = 56.4 GB;
activations of one 4096-token micro-batch with its fp32 logits 9.0 GB; 5 GiB overhead: 70.8 GB before any
routed expert. One routed expert of width 2048 is 3 x 7168 x 2048 = 44.0 M parameters = 0.79 GB with Adam,
2.38 GB over the 3 MoE layers. (141 - 70.8) / 2.38 = 29.5: 29 experts fit (139.7 GB estimated), 30 do not
(142.1 GB). The count must also split into the 8 routing groups: 24 experts (8 groups of 3), 127.8 GB
estimated of the H200's 141 GB, which leaves room for the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSEEK_V3_EXPERTS = 24
# The names ``--runs`` takes: MoK's layer (also under Megatron's 1F1B EP overlap, and with each of its FP8
# expert backends named), Megatron's dispatchers, and the bf16 runs of an FP8 comparison.
MOK_RUNS = ("mok", "mok-overlap", "mok-torch-fp8", "mok-te", "mok-bf16")
# MoK runs that set their own --mok-expert-backend: FP8 experts, so the comparison needs --fp8-format.
FP8_BACKEND_RUNS = {"mok-torch-fp8": "torch-fp8", "mok-te": "te"}
# Runs that drop the pass-through FP8 flags (the same layer in bf16, from the same initial weights): the
# run each one repeats. MoK's bf16 run gets the bf16 experts (--mok-expert-backend torch).
BF16_RUNS = {"mok-bf16": "mok", "alltoall-bf16": "alltoall"}
# The bf16 run an FP8 run's step is read against: the same layer, FP8 flags dropped.
BF16_OF = {"mok": "mok-bf16", "mok-torch-fp8": "mok-bf16", "mok-te": "mok-bf16", "alltoall": "alltoall-bf16"}
RUN_NAMES = (
    "mok", "mok-overlap", "alltoall", "alltoall-unfused", "flex", "alltoall-overlap",
    *FP8_BACKEND_RUNS, *BF16_RUNS,
)  # fmt: skip


# The optimizer and schedule of every GPU preset (the measured Qwen3-30B-A3B command's), and the data.
_OPTIMIZER = (
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--clip-grad", "1.0", "--seed", "1234",
)  # fmt: skip


def _mock_data(vocab: int) -> tuple[str, ...]:
    return (
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--split", "1,0,0",
        "--eval-iters", "0", "--log-throughput",
    )  # fmt: skip


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    flags: tuple[str, ...]  # model, MoE, precision, micro-batch, optimizer, data
    needs_gpu: bool = True  # False: also runs on a CPU (gloo, fp32)
    gpu_flags: tuple[str, ...] = ()  # added on a GPU only (precision for presets that also run on a CPU)


QWEN3_30B_A3B = Preset(
    "qwen3-30b-a3b",
    "Qwen3-30B-A3B at 4 layers: hidden 2048, 128 experts of width 768, top-8, GQA 32/4, seq 4096, bf16",
    (
        "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "6144",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "4",
        "--kv-channels", "128", "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--num-experts", "128", "--moe-ffn-hidden-size", "768", "--moe-router-topk", "8",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-router-dtype", "fp32",
        "--bf16", "--no-gradient-accumulation-fusion", "--micro-batch-size", "4",
        *_OPTIMIZER, *_mock_data(32000),
    ),
)  # fmt: skip

DEEPSEEK_V3 = Preset(
    "deepseek-v3",
    f"DeepSeek-V3 at 4 layers: hidden 7168, MLA, dense first layer, shared expert, {DEEPSEEK_V3_EXPERTS} "
    "experts of width 2048, top-8 of 4 of 8 groups, sigmoid + expert bias, seq 4096, bf16",
    (
        "--num-layers", "4", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
        "--num-attention-heads", "128", "--multi-latent-attention", "--q-lora-rank", "1536",
        "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
        "--kv-channels", "128", "--qk-layernorm", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "10000",
        "--untie-embeddings-and-output-weights", "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--moe-layer-freq", "([0]*1+[1]*3)",
        "--num-experts", str(DEEPSEEK_V3_EXPERTS), "--moe-ffn-hidden-size", "2048",
        "--moe-shared-expert-intermediate-size", "2048", "--moe-router-topk", "8",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-3", "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", "1e-4", "--moe-router-dtype", "fp32",
        "--bf16", "--no-gradient-accumulation-fusion", "--micro-batch-size", "1",
        *_OPTIMIZER, *_mock_data(129280),
    ),
)  # fmt: skip

MIXTRAL_8X7B = Preset(
    "mixtral-8x7b",
    "Mixtral-8x7B at 2 layers, full width: hidden 4096, 8 experts of width 14336, top-2, GQA 32/8, seq 4096, bf16",
    (
        "--num-layers", "2", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
        "--kv-channels", "128", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "1000000",
        "--untie-embeddings-and-output-weights", "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--num-experts", "8", "--moe-ffn-hidden-size", "14336", "--moe-router-topk", "2",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-router-dtype", "fp32",
        "--bf16", "--no-gradient-accumulation-fusion", "--micro-batch-size", "4",
        *_OPTIMIZER, *_mock_data(32000),
    ),
)  # fmt: skip

TINY = Preset(
    "tiny",
    "2 layers, hidden 64, 8 experts of width 64, top-2, seq 64 (CPU or GPU; the tests use it)",
    (
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--seq-length", "64", "--max-position-embeddings", "64",
        "--num-experts", "8", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-router-dtype", "fp32",
        "--micro-batch-size", "4",
        "--lr", "3e-3", "--min-lr", "3e-4", *_OPTIMIZER[4:], *_mock_data(128),
    ),
    needs_gpu=False,
    gpu_flags=("--bf16", "--no-gradient-accumulation-fusion"),
)  # fmt: skip

PRESETS = {p.name: p for p in (QWEN3_30B_A3B, DEEPSEEK_V3, MIXTRAL_8X7B, TINY)}
