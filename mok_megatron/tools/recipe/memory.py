"""Per-GPU memory estimate of a Megatron MoE command line, per pipeline rank (the largest one counts).

Model (stated, simple, and deliberately a little pessimistic; it is a planning check, not a profiler):

Parameters, per chunk item (h hidden, f dense FFN, fm expert FFN, fs shared-expert FFN, E experts,
g = 3/2 with SwiGLU else 1, V vocabulary padded like Megatron):
  attention   GQA: h*d*(heads + 2*groups) + heads*d*h, / TP.  MLA: q/kv down projections (replicated)
              + up projections and output projection / TP (Megatron's MLA formulas)
  dense MLP   2*g*h*f / TP;  MoE: router h*E (replicated) + shared 2*g*h*fs / TP + experts
              2*g*h*fm*E / (EP*ETP);  norms 2*h per layer (replicated)
  MTP layer   one decoder layer (MoE if the last decoder layer is) + 2 norms + eh_proj 2*h*h / TP,
              plus its own copy of the embedding when it is not on the embedding's rank
  embedding   V*h / TP;  output layer V*h / TP (untied, or tied with PP > 1) + final norm

Bytes per parameter: weights 2 (bf16/fp16) or 4 (fp32); main gradients 4 (bf16 accumulates in fp32
unless --grad-reduce-in-bf16) or 2 (fp16, --grad-reduce-in-bf16); Adam state 12 = fp32 master + 2
moments (8 when the weights are already fp32), divided by DP x CP for dense parameters and by the
expert data-parallel size EDP for expert parameters under --use-distributed-optimizer. With
--use-precision-aware-optimizer the master copy and the moments take the sizes of --main-params-dtype,
--exp-avg-dtype and --exp-avg-sq-dtype (fp32 4, fp16/bf16 2, fp8 1) and the main gradients that of
--main-grads-dtype. FP8 weight copies (--fp8-param-gather and TE's transposes) are not credited or charged.

Activations kept for backward, per micro-batch and decoder layer, T = seq*micro_batch/CP tokens,
2 bytes per element (4 in fp32); "h/tp" means divided by TP only with --sequence-parallel:
  attention   norm input h/tp + norm output h/tp [layernorm] + q,k,v up-projections /TP [mla_up_proj]
              + MLA down-projection outputs + attention output heads*dv/TP (flash attention: no
              seq x seq tensor, so core_attn recompute saves nothing here)
  dense MLP   norm input + norm output [layernorm] + fc1 output 2*f/TP + activation f/TP [mlp]
  MoE         norm input + norm output [layernorm] + router scores 4 bytes*E*2 + per routed token
              (top-k per token, balanced routing) fc1 input h + fc1 output 2*fm/ETP + activation
              fm/ETP [moe_act; moe drops all routed terms] + shared expert 3*fs/TP [shared_experts]
  [x] = dropped by that --recompute-modules entry; --recompute-granularity full keeps only the layer
  input h/tp per layer (plus one layer's full activations while it is recomputed).
  Logits: T*V/TP fp32 (bf16 with --cross-entropy-loss-fusion) on the loss rank, once per MTP layer too.
In flight on pipeline rank r (Megatron's 1F1B / interleaved warm-up): min(M*VPP, (PP-r-1)*(2 if VPP>1
else 1) + (VPP-1)*PP + 1) chunk forwards, chunk of the k-th forward = (k // PP) % VPP.
Overhead: a flat 5 GiB for the CUDA context, NCCL and MoK communication buffers, GEMM workspaces and
allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from mok_megatron.tools.planner.hardware import GPUS
from mok_megatron.tools.recipe.layout import EMBEDDING, LOSS, Parallel, moe_pattern, stages

GIB = 1024**3
OVERHEAD_BYTES = 5 * GIB
# per GPU, the same table ``mok plan`` reads a recipe's GPU= line against
HBM_BYTES = {name: gpu.hbm_gb * 1e9 for name, gpu in GPUS.items()}


@dataclass(frozen=True)
class Params:
    dense: float = 0.0  # TP-sharded or replicated: optimizer shards over DP x CP
    expert: float = 0.0  # EP x ETP-sharded: optimizer shards over EDP

    def __add__(self, o: Params) -> Params:
        return Params(self.dense + o.dense, self.expert + o.expert)

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass(frozen=True)
class Estimate:
    pp_rank: int
    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float
    overhead: float = OVERHEAD_BYTES

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.overhead


def padded_vocab(args) -> int:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP."""
    if not args.vocab_size:
        raise ValueError("--vocab-size is needed for the memory estimate (the tokenizer is not loaded).")
    m = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-args.vocab_size // m) * m


def _glu(args) -> float:
    return 1.5 if args.swiglu else 1.0


def _attention_params(args, tp: int) -> Params:
    h, n = args.hidden_size, args.num_attention_heads
    if args.multi_latent_attention:
        rope, qk, v = args.qk_pos_emb_head_dim, args.qk_head_dim, args.v_head_dim
        q_in = args.q_lora_rank or h
        down = (h * args.q_lora_rank + args.q_lora_rank if args.q_lora_rank else 0) + h * (
            args.kv_lora_rank + rope
        )
        up = q_in * n * (qk + rope) + args.kv_lora_rank * n * (qk + v) + n * v * h
        return Params(dense=down + args.kv_lora_rank + up / tp)
    d = args.kv_channels or h // n
    groups = args.num_query_groups if args.group_query_attention else n
    return Params(dense=(h * d * (n + 2 * groups) + n * d * h) / tp + (2 * d if args.qk_layernorm else 0))


def _layer_params(args, p: Parallel, moe: bool) -> Params:
    h, g = args.hidden_size, _glu(args)
    attn = _attention_params(args, p.tp) + Params(dense=2 * h)
    if not moe:
        return attn + Params(dense=2 * g * h * args.ffn_hidden_size / p.tp)
    fs = args.moe_shared_expert_intermediate_size or 0
    experts = 2 * g * h * args.moe_ffn_hidden_size * args.num_experts / (p.ep * p.etp)
    return attn + Params(dense=h * args.num_experts + 2 * g * h * fs / p.tp, expert=experts)


def chunk_params(args, p: Parallel, chunk: list, with_embedding: bool) -> Params:
    pattern, h = moe_pattern(args), args.hidden_size
    vocab = padded_vocab(args) * h / p.tp
    out = Params()
    for item in chunk:
        if item == EMBEDDING:
            out += Params(dense=vocab)
        elif item == LOSS:
            shared = not args.untie_embeddings_and_output_weights and p.pp == 1
            out += Params(dense=h + (0 if shared else vocab))
        elif item[0] == "decoder":
            out += _layer_params(args, p, bool(pattern[item[1]]))
        else:  # mtp
            out += _layer_params(args, p, bool(pattern[-1])) + Params(dense=2 * h + 2 * h * h / p.tp)
            if item[1] == 0 and not with_embedding:
                out += Params(dense=vocab)
    return out


def _elem_bytes(args) -> int:
    return 2 if (args.bf16 or args.fp16) else 4


def _layer_activation_elems(args, p: Parallel, moe: bool, granularity: str | None) -> float:
    """Elements per token kept for backward by one decoder layer (see the module docstring)."""
    h, n, fc1 = args.hidden_size, args.num_attention_heads, 2 if args.swiglu else 1
    sp = args.sequence_parallel and p.tp > 1
    hs = h / p.tp if sp or p.tp == 1 else h  # a hidden-sized tensor per TP rank
    if granularity == "full":
        return hs
    rec = set(args.recompute_modules or ["core_attn"]) if granularity == "selective" else set()
    norm_out = 0 if "layernorm" in rec else hs
    if args.multi_latent_attention:
        rope, qk, v = args.qk_pos_emb_head_dim, args.qk_head_dim, args.v_head_dim
        down = (args.q_lora_rank or 0) + args.kv_lora_rank + rope
        up = 0 if "mla_up_proj" in rec else n * (2 * (qk + rope) + v) / p.tp
        attn = hs + norm_out + down + up + n * v / p.tp
    else:
        d = args.kv_channels or h // n
        groups = args.num_query_groups if args.group_query_attention else n
        attn = hs + norm_out + (n + 2 * groups) * d / p.tp + n * d / p.tp
    if not moe:
        mlp = hs if "mlp" in rec else hs + norm_out + (fc1 + 1) * args.ffn_hidden_size / p.tp
        return attn + mlp
    fm, fs, k = args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size or 0, args.moe_router_topk
    router = args.num_experts * 2 * 4 / _elem_bytes(args)  # fp32 logits and probs
    routed = 0 if "moe" in rec else k * (h + fc1 * fm / p.etp + (0 if "moe_act" in rec else fm / p.etp))
    shared = 0 if "shared_experts" in rec else 3 * fs / p.tp
    return attn + hs + norm_out + router + routed + shared


def _chunk_activation_bytes(args, p: Parallel, chunk: list) -> float:
    pattern = moe_pattern(args)
    tokens = args.seq_length * args.micro_batch_size / p.cp
    elems = 0.0
    for item in chunk:
        if isinstance(item, tuple):
            moe = bool(pattern[item[1]] if item[0] == "decoder" else pattern[-1])
            elems += _layer_activation_elems(args, p, moe, args.recompute_granularity)
            elems += 2 * args.hidden_size if item[0] == "mtp" else 0
    return tokens * elems * _elem_bytes(args)


def _peak_layer_bytes(args, p: Parallel) -> float:
    """Full recompute re-materializes one layer's activations at a time during backward."""
    if args.recompute_granularity != "full":
        return 0.0
    tokens = args.seq_length * args.micro_batch_size / p.cp
    return tokens * _elem_bytes(args) * max(_layer_activation_elems(args, p, m, None) for m in (False, True))


def _logit_bytes(args, p: Parallel, chunk: list) -> float:
    heads = sum(1 for i in chunk if i == LOSS or (isinstance(i, tuple) and i[0] == "mtp"))
    per = 2 if args.cross_entropy_loss_fusion else 4
    return heads * args.seq_length * args.micro_batch_size / p.cp * padded_vocab(args) / p.tp * per


def in_flight(p: Parallel, rank: int) -> list[int]:
    """Virtual chunk index of each forward kept alive at the peak on pipeline rank ``rank``."""
    warmup = (p.pp - rank - 1) * (2 if p.vpp > 1 else 1) + (p.vpp - 1) * p.pp
    n = min(p.microbatches * p.vpp, warmup + 1)
    return [(k // p.pp) % p.vpp for k in range(n)]


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _grad_and_optimizer_bytes(args, wb: int) -> tuple[int, int]:
    """Bytes per parameter of the main gradient and of the optimizer state (see the module docstring)."""
    gb = 2 if (args.fp16 or (args.bf16 and args.grad_reduce_in_bf16)) else 4
    adam = args.optimizer == "adam"
    if not getattr(args, "use_precision_aware_optimizer", False):
        return gb, (8 if wb == 4 else 12) if adam else (4 if wb == 4 else 8)
    master = 0 if wb == 4 else DTYPE_BYTES[args.main_params_dtype]
    moments = DTYPE_BYTES[args.exp_avg_dtype] + (DTYPE_BYTES[args.exp_avg_sq_dtype] if adam else 0)
    return DTYPE_BYTES[args.main_grads_dtype] if gb == 4 else gb, master + moments


def estimate(args, p: Parallel) -> list[Estimate]:
    """One ``Estimate`` per pipeline rank."""
    chunks = stages(args, p.pp)
    wb = _elem_bytes(args)
    gb, ob = _grad_and_optimizer_bytes(args, wb)
    dist = args.use_distributed_optimizer
    out = []
    for r in range(p.pp):
        mine = [chunks[v * p.pp + r] for v in range(p.vpp)]
        has_embedding = any(EMBEDDING in c for c in mine)
        prm = Params()
        for c in mine:
            prm += chunk_params(args, p, c, has_embedding)
        optim = ob * (prm.dense / (p.dp * p.cp if dist else 1) + prm.expert / (p.edp if dist else 1))
        act = sum(_chunk_activation_bytes(args, p, mine[v]) for v in in_flight(p, r))
        act += sum(_logit_bytes(args, p, c) for c in mine) + _peak_layer_bytes(args, p)
        out.append(Estimate(r, prm.total, prm.total * wb, prm.total * gb, optim, act))
    return out
