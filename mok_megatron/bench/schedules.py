"""``mok bench ep --schedules plain,1f1b``: Megatron's combined 1F1B EP-overlap schedule, timed.

Megatron's ``--overlap-moe-expert-parallel-comm`` (with ``--delay-wgrad-compute``) overlaps nothing
inside one MoE layer call. ``forward_backward_no_pipelining`` then runs the combined 1F1B schedule
(pipeline_parallel/combined_1f1b.py): ``model.build_schedule_plan`` splits every transformer layer into
nodes (models/gpt/fine_grained_callables.py: attention + router, dispatch, experts, combine) on a compute
and a communication stream, and one micro-batch's forward runs beside another's backward, layer by
layer, so each all-to-all hides behind the other micro-batch's computation. What the overlap gains is
therefore a property of whole transformer layers and of micro-batch pairs. It is measured here on the
smallest model the schedule works on: a GPT with one transformer layer (attention + MoE), the shape's
MoE (``shapes.EP_SHAPES``: hidden, expert FFN, local experts x EP, top-k; tokens per rank = one
micro-batch's sequence, micro-batch size 1), its attention (``heads``, ``groups``, ``kv_channels``),
RoPE, RMSNorm, a ``VOCAB``-token vocabulary.

Per shape, four models with the same weights (Megatron's model initialises them, MoK's load them):

    Megatron's alltoall ``MoELayer`` (with Transformer Engine: TEGroupedMLP, fused permute, TE attention)
    MoK's layer on its plain engine (the engine Megatron's overlap selects; also under the plain
    schedule, so that only the schedule differs: MoK's own pipeline is what the layer rows time)

each through ``forward_backward_no_pipelining`` with ``--microbatches`` micro-batches (default 2),
without (``plain``) and with (``1f1b``) ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``.

Checked first, on every rank, before anything is timed (a mismatch stops the bench with the numbers):
each layer's losses under 1f1b against plain (MoK's bitwise; Megatron's within ``SCHEDULE_RTOL``);
MoK's against Megatron's under each schedule (``LAYER_RTOL``); 1f1b built one schedule plan per
micro-batch and plain none; MoK ran its plain engine.

Timed: one schedule call (forward + backward of every micro-batch; gradients set to None before it; no
data-parallel gradient reduction: the model is not wrapped in DDP), CUDA events on GPUs, the wall clock
on CPU; the median over ``--iters`` after ``--warmup``, the max over ranks. Reported per row: ms per
micro-batch pair (the call's time x 2 / micro-batches), the 1f1b / plain time ratio of the same layer,
MoK / Megatron under the same schedule. With two micro-batches only the middle of the call's three
steps overlaps (the first forward and the last backward run alone), as in Megatron's schedule.

Requirements: EP > 1 (the world size; Megatron accepts the overlap only with expert parallelism);
bf16 on GPUs (Megatron accepts the overlap only for bf16 / fp16 models); on CPU fp32 with the flags set
after Megatron's validation (nothing in the schedule depends on the dtype), over gloo with Megatron's
CUDA-only schedule calls bridged (``training.cpu_training.megatron_schedule``).
"""

from __future__ import annotations

import statistics

SCHEDULES = ("plain", "1f1b")
# --overlap-moe-expert-parallel-comm --delay-wgrad-compute
OVERLAP_FLAGS = dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
VOCAB = 1024
# Largest relative loss difference accepted, per parameter dtype: Megatron's layer under 1f1b against
# the plain schedule (the same kernels on the same rows; measured bitwise on CPU), and MoK's layer against
# Megatron's under one schedule (the composability tests measure 0.0 in fp32 on CPU; bf16 allows for
# the experts' GEMMs summing in another order).
SCHEDULE_RTOL = {"fp32": 1e-6, "bf16": 1e-3}
LAYER_RTOL = {"fp32": 1e-5, "bf16": 1e-2}

EP1_ERROR = (
    "mok bench ep --schedules {names}: Megatron's --overlap-moe-expert-parallel-comm needs expert "
    "parallelism (EP > 1); launch N >= 2 ranks: torchrun --nproc-per-node N -m mok_megatron.bench.ep "
    "--schedules {names}"
)


def schedule_config(shape: dict, ep: int, dtype, overlap: bool, megatron_fast_path: bool = False):
    """The one-layer GPT's ``TransformerConfig`` for an ``EP_SHAPES`` entry at ``ep``, with
    ``OVERLAP_FLAGS`` if ``overlap`` (in bf16 through Megatron's validation, in fp32 set after it).
    ``megatron_fast_path``: Megatron's TE path (grouped GEMM experts, fused permute)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = dtype == torch.bfloat16
    kw = dict(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        num_query_groups=shape.get("groups"),
        kv_channels=shape.get("kv_channels"),
        num_moe_experts=shape["local"] * ep,
        moe_layer_freq=1,
        moe_ffn_hidden_size=shape["ffn"],
        moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        moe_grouped_gemm=megatron_fast_path,
        moe_permute_fusion=megatron_fast_path,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        expert_model_parallel_size=ep,
        params_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if overlap and bf16:
        kw.update(OVERLAP_FLAGS)
    cfg = TransformerConfig(**kw)
    if overlap and not bf16:
        for k, v in OVERLAP_FLAGS.items():
            setattr(cfg, k, v)
    return cfg


def build_model(impl: str, cfg, seq: int, te: bool, options=None):
    """The one-layer GPT with Megatron's MoE layer (``impl`` megatron / megatron-te) or MoK's (mok)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if impl == "mok":
        from mok_megatron.spec import get_gpt_decoder_block_spec_with_mok

        block = get_gpt_decoder_block_spec_with_mok(
            cfg, use_transformer_engine=te, options=options, normalization="RMSNorm"
        )
    else:
        block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=te, normalization="RMSNorm")
    return GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=seq,
        position_embedding_type="rope",
    )


def _loss(out):
    loss = out.float().mean()
    return loss, {"loss": loss.detach()}


class ScheduleRun:
    """One model's calls of ``forward_backward_no_pipelining`` over fixed micro-batches; the combined
    1F1B schedule runs when the model's config has the EP overlap on. Counts the schedule plans built."""

    def __init__(self, model, batches):
        import torch

        self.model, self.batches = model, batches
        tokens = batches[0][0]
        self.pos = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        self.plans = 0

    def _forward_step(self, data_iterator, model, return_schedule_plan=False):
        tokens, labels = next(data_iterator)
        if return_schedule_plan:
            self.plans += 1
            return model.build_schedule_plan(tokens, self.pos, None, labels=labels), _loss
        return model(tokens, self.pos, None, labels=labels), _loss

    def __call__(self) -> list:
        """One call; the micro-batches' loss tensors (not synchronised)."""
        import torch
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
        from megatron.core.pipeline_parallel.utils import get_comm_stream

        self.model.zero_grad(set_to_none=True)
        out = forward_backward_no_pipelining(
            forward_step_func=self._forward_step,
            data_iterator=iter(self.batches),
            model=[self.model],
            num_microbatches=len(self.batches),
            seq_length=self.batches[0][0].shape[1],
            micro_batch_size=self.batches[0][0].shape[0],
            forward_only=False,
        )
        comm = get_comm_stream()
        if torch.cuda.is_available() and comm is not None:
            torch.cuda.current_stream().wait_stream(comm)  # the timing event sees the comm stream's work
        return [d["loss"] for d in out]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b, strict=True))


def _mok_engines(model) -> list[bool]:
    from mok_megatron.adapter.layer import MoKMoELayer

    return [m.token_dispatcher.pipelined for m in model.modules() if isinstance(m, MoKMoELayer)]


def bench_schedules(
    shapes,
    schedules,
    microbatches,
    iters,
    warmup,
    *,
    ep,
    device,
    dtype,
    megatron_impl,
    tmax,
    rank,
    expert_backend="torch",
) -> list[dict]:
    """Rows of the schedule comparison (module docstring) for every shape in ``shapes`` at EP=``ep``
    (the process group and Megatron's parallel state for it set up by the caller; ``tmax``: the max of a
    float over ranks). ``schedules``: a subset of ``SCHEDULES`` to time (both always run the check)."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from mok_megatron.bench.timing import time_steps
    from mok_megatron.bench.shapes import EP_SHAPES
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.options import MoKOptions
    from mok_megatron.training.cpu_training import megatron_schedule

    if ep < 2:
        raise ValueError(EP1_ERROR.format(names=",".join(schedules)))
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    te = megatron_impl == "megatron-te"
    impls = (megatron_impl, "mok")
    rows = []
    for name in shapes:
        s = EP_SHAPES[name]
        seq = s["tokens"]
        g = torch.Generator().manual_seed(1000 + rank)
        batches = []
        for _ in range(microbatches):
            tokens = torch.randint(0, VOCAB, (1, seq), generator=g)
            batches.append((tokens.to(device), torch.roll(tokens, -1, 1).to(device)))
        runs, sd = {}, None
        with megatron_schedule():
            for impl in impls:
                for sched in SCHEDULES:
                    destroy_moe_metrics_tracker()
                    fast = impl == "megatron-te"
                    cfg = schedule_config(s, ep, dtype, sched == "1f1b", megatron_fast_path=fast)
                    opts = None
                    if impl == "mok":
                        opts = MoKOptions(engine="plain", expert_backend=expert_backend)
                    torch.manual_seed(0)
                    model = build_model(impl, cfg, seq, te, options=opts).to(device)
                    if sd is None:
                        sd = {
                            k: v.detach().clone() if torch.is_tensor(v) else v
                            for k, v in model.state_dict().items()
                        }
                    else:
                        model.load_state_dict(convert_state_dict(sd, "mok") if impl == "mok" else sd)
                    runs[impl, sched] = ScheduleRun(model, batches)
            # checked first: every model's losses from one call each
            losses = {}
            for key, run in runs.items():
                losses[key] = [float(v) for v in run()]
                want = microbatches if key[1] == "1f1b" else 0
                if run.plans != want:
                    raise RuntimeError(
                        f"{name} EP={ep} {key[0]} {key[1]}: {run.plans} schedule plans built in one call, "
                        f"expected {want} (the overlap flags did not select Megatron's combined 1F1B "
                        "schedule)"
                    )
                if key[0] == "mok" and any(_mok_engines(run.model)):
                    raise RuntimeError(f"{name} EP={ep} mok {key[1]}: the layer ran its pipeline engine")
            checks = {}
            for impl in impls:
                a, b = losses[impl, "plain"], losses[impl, "1f1b"]
                rel = tmax(_rel(a, b))
                bitwise = tmax(float(a != b)) == 0.0
                tol = 0.0 if impl == "mok" else SCHEDULE_RTOL[dname]
                if not bitwise and (impl == "mok" or rel > tol):
                    raise RuntimeError(
                        f"{name} EP={ep} {impl}: losses under the combined 1F1B schedule differ from the "
                        f"plain schedule's by {rel:.2e} relative (allowed: "
                        f"{'bitwise' if impl == 'mok' else tol}); rank {rank}: plain {a}, 1f1b {b}"
                    )
                checks[impl] = (rel, bitwise)
            vs_meg = {}
            for sched in SCHEDULES:
                a, b = losses[megatron_impl, sched], losses["mok", sched]
                vs_meg[sched] = rel = tmax(_rel(a, b))
                if rel > LAYER_RTOL[dname]:
                    raise RuntimeError(
                        f"{name} EP={ep} {sched}: MoK's losses differ from Megatron's by {rel:.2e} relative "
                        f"(allowed {LAYER_RTOL[dname]}); rank {rank}: Megatron {a}, MoK {b}"
                    )
            # timed
            ms = {}
            for (impl, sched), run in runs.items():
                if sched not in schedules:
                    continue
                ms[impl, sched] = 1e3 * tmax(statistics.median(time_steps(run, iters, warmup)))
        del runs, run  # the four models, before the next shape's
        for (impl, sched), t in ms.items():
            pair = t * 2 / microbatches
            plain = ms.get((impl, "plain"))
            meg = ms.get((megatron_impl, sched))
            rows.append(
                dict(
                    shape=name,
                    ep=ep,
                    impl=impl,
                    schedule=sched,
                    microbatches=microbatches,
                    tokens_per_microbatch=seq,
                    dtype=dname,
                    expert_backend=expert_backend if impl == "mok" else None,
                    ms=pair,
                    call_ms=t,
                    losses=losses[impl, sched],
                    loss_rel_vs_plain=checks[impl][0] if sched == "1f1b" else None,
                    bitwise_vs_plain=checks[impl][1] if sched == "1f1b" else None,
                    loss_rel_vs_megatron=vs_meg[sched] if impl == "mok" else None,
                    overlapped_over_plain=(t / plain) if sched == "1f1b" and plain else None,
                    mok_over_megatron=(t / meg) if impl == "mok" and meg else None,
                )
            )
            if rank == 0:
                print(
                    f"{name} EP={ep} {impl} schedule {sched}: {pair:.2f} ms per micro-batch pair "
                    f"({microbatches} micro-batches of {seq} tokens)",
                    flush=True,
                )
        if dist.is_initialized():
            dist.barrier()
    return rows


SCHEDULE_COLUMNS = (
    "layer",
    "schedule",
    "ms / micro-batch pair",
    "1f1b / plain",
    "MoK / Megatron",
    "losses vs plain",
)


def format_schedules(rows) -> str:
    """Markdown table per shape of the schedule rows (those with a ``schedule`` key)."""
    out = []
    rows = [r for r in rows if "schedule" in r]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        r0 = rs[0]
        out.append(
            f"\n{shape}: EP={r0['ep']}, Megatron's forward_backward_no_pipelining, {r0['microbatches']} "
            f"micro-batches of {r0['tokens_per_microbatch']} tokens per rank, one transformer layer "
            f"(attention + MoE), {r0['dtype']}\n"
        )
        out.append("| " + " | ".join(SCHEDULE_COLUMNS) + " |")
        out.append("|" + "---|" * len(SCHEDULE_COLUMNS))
        for r in rs:
            if r["schedule"] == "plain":
                match = "-"
            else:
                match = "bitwise" if r["bitwise_vs_plain"] else f"{r['loss_rel_vs_plain']:.1e}"
            ratio = "-" if r["overlapped_over_plain"] is None else f"{r['overlapped_over_plain']:.2f}"
            vs = "-" if r["mok_over_megatron"] is None else f"{r['mok_over_megatron']:.2f}"
            out.append(f"| {r['impl']} | {r['schedule']} | {r['ms']:.2f} | {ratio} | {vs} | {match} |")
    return "\n".join(out)
