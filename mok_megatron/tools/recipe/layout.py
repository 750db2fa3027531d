"""Parallel-layout arithmetic of a parsed Megatron command line, without process groups.

The rules are Megatron-Core 0.19's (``parallel_state.initialize_model_parallel`` and
``training.arguments.validate_args``), restated so a 512-GPU command line can be checked on a laptop:

- dense grid: world = TP x CP x DP x PP, so DP = world / (TP x PP x CP) must be a positive integer;
- expert grid: world = ETP x EP x EDP x PP (ETP defaults to TP), i.e. EP x ETP divides TP x CP x DP;
  with the default rank order ``tp-cp-ep-dp-pp`` an expert group is ETP x EP consecutive ranks, so
  it stays inside one NVLink domain of D consecutive GPUs when D is a multiple of EP x ETP;
- pipeline: a ``--pipeline-model-parallel-layout`` must pass Megatron's own layout validation
  (PP x VPP stages, one embedding, one loss, num_layers decoder layers, MTP last), otherwise the
  decoder layers split evenly over PP (x VPP) stages, or over the middle stages when
  ``--decoder-first/last-pipeline-num-layers`` pin the ends;
- num_experts divisible by EP; heads and query groups divisible by TP; global batch divisible by
  micro batch x DP.

``stages()`` returns what each of the PP x VPP model chunks holds, in Megatron's order (chunk ``s``
lives on pipeline rank ``s % PP``); the memory estimate uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

EMBEDDING, LOSS = "embedding", "loss"


class LayoutError(ValueError):
    """A layout Megatron would refuse; the message names the value, the rule and the fix."""


@dataclass(frozen=True)
class Cluster:
    """What the recipe's ``# layout:`` line says about the machines."""

    nodes: int
    gpus_per_node: int
    nvlink_domain_gpus: int
    gpu: str = ""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    microbatches: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def moe_pattern(args) -> list[int]:
    """1 for an MoE decoder layer, 0 for a dense one (Megatron's ``--moe-layer-freq`` semantics)."""
    n = args.num_layers
    if not args.num_experts:
        return [0] * n
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(n)]
    if len(freq) != n:
        raise LayoutError(
            f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {n}: the pattern needs one "
            f"0/1 entry per decoder layer; fix the pattern, e.g. '([0]*k+[1]*{n}-k)'."
        )
    return list(freq)


def parallel(args, cluster: Cluster) -> Parallel:
    """The derived sizes; raises ``LayoutError`` on the first rule the command line breaks."""
    world = cluster.world
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    model = tp * pp * cp
    if world % model:
        raise LayoutError(
            f"world size {world} ({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs) is not divisible by "
            f"TP x PP x CP = {tp} x {pp} x {cp} = {model}: data parallel would be {world / model:g}. "
            f"Pick TP x PP x CP from {_divisors(world)}, or change the node count."
        )
    dp = world // model
    if world % (etp * ep * pp):
        raise LayoutError(
            f"EP x ETP = {ep} x {etp} = {ep * etp} does not divide the {tp * cp * dp} non-expert ranks of a "
            f"pipeline stage (TP x CP x DP = {tp} x {cp} x {dp}); Megatron needs world {world} divisible by "
            f"ETP x EP x PP = {etp * ep * pp}. Use EP x ETP from {_divisors(tp * cp * dp)}."
        )
    if args.num_experts and args.num_experts % ep:
        raise LayoutError(
            f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}. "
            f"Use EP from {_divisors(args.num_experts)}."
        )
    if ep * etp > 1 and cluster.nvlink_domain_gpus % (ep * etp):
        d = cluster.nvlink_domain_gpus
        raise LayoutError(
            f"expert group EP x ETP = {ep} x {etp} = {ep * etp} consecutive GPUs does not fit evenly in the "
            f"{d}-GPU NVLink domain: some groups would span the inter-domain network. Use EP x ETP from "
            f"{_divisors(d)} (or a larger NVLINK_DOMAIN_GPUS if the hardware has one)."
        )
    heads, groups = args.num_attention_heads, args.num_query_groups if args.group_query_attention else None
    for name, n in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if n and n % tp:
            raise LayoutError(f"{name} {n} is not divisible by TP {tp}: use TP from {_divisors(n)}.")
    mbs, gbs = args.micro_batch_size, args.global_batch_size or args.micro_batch_size * dp
    if gbs % (mbs * dp):
        raise LayoutError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size x DP = {mbs} x {dp} = {mbs * dp}. "
            f"Use a global batch that is a multiple of {mbs * dp}."
        )
    vpp = len(stages(args, pp)) // pp
    if vpp > 1 and pp == 1:
        raise LayoutError(
            f"{vpp} virtual pipeline stages with --pipeline-model-parallel-size 1: Megatron's interleaved "
            "schedule needs PP > 1. Drop the virtual stages or raise PP."
        )
    return Parallel(tp, pp, vpp, cp, dp, ep, etp, world // (etp * ep * pp), gbs // (mbs * dp))


def _layout_stages(args, pp: int) -> list[list]:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    text = args.pipeline_model_parallel_layout
    try:
        pl = PipelineParallelLayerLayout(text, pp)
        pl.validate_layer_layout(args.num_layers, args.mtp_num_layers)
    except (AssertionError, KeyError, ValueError) as e:
        raise LayoutError(
            f"--pipeline-model-parallel-layout {text!r} with PP {pp}, --num-layers {args.num_layers}, "
            f"--mtp-num-layers {args.mtp_num_layers}: {e}. Fix the layout: PP x VPP '|'-separated stages "
            "holding one E (embedding) first, num_layers t, the m (MTP) layers, and one L (loss) last."
        ) from None
    out, dec, mtp = [], 0, 0
    vpp = pl.virtual_pipeline_model_parallel_size
    for v in range(vpp):
        for r in range(pp):
            chunk = []
            for t in pl.layout[r][v]:
                if t == LayerType.embedding:
                    chunk.append(EMBEDDING)
                elif t == LayerType.loss:
                    chunk.append(LOSS)
                elif t == LayerType.decoder:
                    chunk.append(("decoder", dec))
                    dec += 1
                else:
                    chunk.append(("mtp", mtp))
                    mtp += 1
            out.append(chunk)
    return out


def _even_stages(args, pp: int) -> list[list]:
    n, vpp = args.num_layers, args.num_virtual_stages_per_pipeline_rank or 1
    if args.num_layers_per_virtual_pipeline_stage:
        vpp = max(1, n // pp // args.num_layers_per_virtual_pipeline_stage)
    stages_n = pp * vpp
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle = stages_n - (first is not None) - (last is not None)
    rest = n - (first or 0) - (last or 0)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise LayoutError(
            f"--num-layers {n} does not split over PP x VPP = {pp} x {vpp} = {stages_n} model chunks"
            + (f" with first {first} / last {last} pinned" if first or last else "")
            + f": {rest} layers over {middle} chunks. Use --num-layers divisible by {middle or 1}, change PP/VPP, "
            "or describe the split with --pipeline-model-parallel-layout."
        )
    sizes = [rest // middle if middle else 0] * stages_n
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    out, dec = [], 0
    for size in sizes:
        out.append([("decoder", dec + i) for i in range(size)])
        dec += size
    out[0].insert(0, EMBEDDING)
    out[-1].extend([("mtp", j) for j in range(args.mtp_num_layers or 0)] + [LOSS])
    return out


def stages(args, pp: int) -> list[list]:
    """The PP x VPP model chunks in Megatron's order: items ``embedding``, ``("decoder", i)``,
    ``("mtp", j)``, ``loss``; chunk ``s`` is on pipeline rank ``s % pp``."""
    if args.pipeline_model_parallel_layout:
        return _layout_stages(args, pp)
    return _even_stages(args, pp)
