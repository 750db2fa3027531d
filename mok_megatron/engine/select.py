"""Which engine a MoK layer runs, decided once when the layer is built: ``EngineChoice``.

The overlap pipeline (``engine.pipeline``) runs when expert parallelism is on (or a transport given to the
layer emulates it: the one-GPU loopback of benchmarks and tests) and routing is dropless without
expert-TP. Capacity dropping, drop-and-pad, router padding
and expert-TP keep the plain six-phase engine (``engine.plain``), and asking for a pipeline-only option
with them is an error naming the settings.

Composition with Megatron's own EP overlap (``--overlap-moe-expert-parallel-comm``, the combined 1F1B
schedule; also ``--overlap-dispatch-backward-with-experts-wgrad``): Megatron's scheduler runs dispatch,
experts and combine as separate nodes on a communication and a compute stream and overlaps one
micro-batch's all-to-all with another's compute, and it frees each node's inputs after the node has run.
The in-layer pipeline would fold all three phases into the experts node (its dispatch and combine nodes
empty, its exchanges on the compute stream). So under those flags the layer runs the plain engine, whose
phases Megatron's scheduler interleaves like its own alltoall dispatcher's, and an explicit pipeline
option is a start-up error naming both flags. The plain engine's phases suit that scheduler: no input it
frees (the dispatch node's permuted rows, the experts node's received rows when there are several local
experts, the combine node's expert output) is saved for backward or returned as the node's output (the
experts get their rows sorted into new storage; at one local expert they get the received rows
themselves, and Megatron then keeps that input, as for its own dispatcher), and the only state between
phases is the plan of the call in flight, which one layer's forward phases, run in order, set and drop
(backward reads its autograd graph and the experts' weight-gradient queue, emptied by the schedule's
backward_dw after each backward of the layer). Tested on CPU at EP 2 and 4 (tests/test_composability.py):
bitwise the plain schedule, and Megatron's alltoall layer under the same schedule within 1e-6 relative in
fp32 (measured: bitwise).

The tiles engine (``engine.tiles``) runs only when asked for (``--mok-engine tiles``; ``auto`` never picks
it): ``select_tiles`` refuses in one line a layer it cannot run (``tiles_blockers``) and decides whether its
kernels or their references run. A transport given to a tiles layer must expose its peers' send buffers to
the pull (``transport.base.PullSource``: the loopback, at EP = 1); the layer then pulls its received rows
from it (``EngineChoice.pull``), or, with the loopback's link time only (``LoopbackBytes.LINK``), places
every row and paces the pull's counter releases alone.

What the experts take decides how both engines lay out their rows (``RowLayout``, from the experts'
``ExpertsContract``, known from their class before they are built): MoK's experts take per-expert counts
on the device, so the routing kernels plan the rows without a sort (``ALIGNED``; the plain engine at
EP = 1, every expert call of the pipeline) and the permute writes the padded layout FP8 GEMMs need
(``row_alignment``); the native FP8 experts take token rows and fuse the permute and combine into their
operands (``FUSED``); TE's experts read the counts on the host, so the plain engine sizes their buffer
exactly (``ALIGNED_EXACT``); Megatron's experts get the sorted layout (``SORTED``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.engine.pipeline import PipelineConfig
from mok_megatron.engine.pipeline_plan import MinibatchPolicy
from mok_megatron.engine.plan import RowLayout, aligned_plan_applies
from mok_megatron.engine.tiles import TilesConfig, kernels_unavailable, tile_config
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.options import Engine, MinibatchSplit, MoKOptions, TransportKind
from mok_megatron.transport.base import PullSource


@dataclass(frozen=True)
class EngineChoice:
    """How one MoK layer dispatches, computes and combines; fixed when the layer is built."""

    pipeline: PipelineConfig | None  # the overlap pipeline's config; None: the plain engine
    rows: RowLayout = RowLayout.SORTED  # how the expert calls get their rows
    row_alignment: int = 1  # > 1: the permute writes every expert's rows padded to this
    tiles: TilesConfig | None = None  # the tiles engine's config (``--mok-engine tiles``)
    pull: PullSource | None = None  # the transport the tiles engine pulls its received rows from

    @property
    def transport(self):
        """The layer's transport: the overlap pipeline's (``transport.base.Transport``), or the one the tiles
        engine pulls from; None: the plain engine, or the tiles engine with every row placed."""
        return self.pull if self.pipeline is None else self.pipeline.transport

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    @property
    def folded_phase(self) -> str | None:
        """The one phase dispatch, experts and combine run in (``pipeline`` / ``experts``), or None."""
        if self.pipelined:
            return "pipeline"
        return "experts" if self.rows is RowLayout.FUSED or self.tiles is not None else None


def pipeline_blockers(capacity_factor: float | None, router_padding: bool, etp_size: int) -> list[str]:
    """The settings of a layer that keep it off the overlap pipeline (it then runs the plain engine)."""
    why = []
    if capacity_factor is not None:
        why.append(f"moe_expert_capacity_factor={capacity_factor} (token dropping)")
    if router_padding:
        why.append("moe_router_padding_for_quantization=True")
    if etp_size > 1:
        why.append(f"expert_tensor_parallel_size={etp_size}")
    return why


def check_options(
    options: MoKOptions,
    *,
    ep_size: int,
    blockers: list[str],
    megatron_overlap_flags: tuple[str, ...] = (),
    cuda: bool | None = None,
) -> None:
    """Raise ``MoKConfigError`` for options this layer cannot honour: pipeline-only options where the
    plain engine must run, a GPU transport without GPUs (``cuda`` None: not checked). The command line
    runs this right after parsing; the layer again when it is built."""
    explicit = options.pipeline_only()
    if options.engine is Engine.PLAIN:
        return
    if options.engine is Engine.TILES and megatron_overlap_flags:
        raise MoKConfigError(
            f"--mok-engine tiles with {', '.join(megatron_overlap_flags)}: Megatron's combined 1F1B schedule "
            "drives the six phases itself, which the tiles engine folds into its experts phase. Drop one of them."
        )
    if megatron_overlap_flags and explicit:
        flags = ", ".join(megatron_overlap_flags)
        raise MoKConfigError(
            f"{', '.join(explicit)} asks for the MoK overlap pipeline, but {flags} hands the MoE phases to "
            "Megatron's combined 1F1B schedule, which overlaps dispatch and combine across micro-batches "
            "itself; the two cannot both drive this layer. Drop the --mok-* option(s) (the layer then runs "
            f"the six-phase plain engine under Megatron's overlap) or drop {flags} (MoK's in-layer overlap)."
        )
    if blockers and explicit:
        raise MoKConfigError(
            f"{', '.join(explicit)} need(s) the MoK overlap pipeline, which supports dropless routing "
            f"without expert tensor parallelism; this layer has {', '.join(blockers)}. Drop the --mok-* "
            "option(s) (the layer then runs unpipelined) or change those settings."
        )
    kind = options.transport
    if cuda is False and kind in (TransportKind.NVLINK, TransportKind.COPY_ENGINE):
        raise MoKConfigError(
            f"--mok-transport {kind.value} needs CUDA GPUs in one NVLink domain; use --mok-transport "
            "collective here."
        )


def _check_given_transport(transport, cfg: MoKConfig, options: MoKOptions, blockers: list[str]) -> None:
    """A transport given to the layer needs the overlap pipeline, and one that spans other peers than the
    EP group only stands in for a larger group on one rank (the loopback)."""
    why = list(blockers) + list(cfg.megatron_overlap_flags)
    if options.engine is Engine.PLAIN:
        why.append("--mok-engine plain")
    if why:
        raise MoKConfigError(
            f"the {transport.name} transport given to this layer runs in the MoK overlap pipeline, which "
            f"this layer cannot run ({', '.join(why)}); drop the transport or change those settings."
        )
    if transport.peers != cfg.ep_size and cfg.ep_size != 1:
        raise MoKConfigError(
            f"the {transport.name} transport spans {transport.peers} EP ranks but this layer's EP group has "
            f"{cfg.ep_size} (--expert-model-parallel-size); a transport that emulates a larger group (the "
            "loopback) runs on one rank: use --expert-model-parallel-size 1, or a transport of this group."
        )


def select_transport(cfg: MoKConfig, options: MoKOptions, ep_group, transport=None):
    """The transport of the overlap engine, or None for the plain engine. ``transport``: one given to the
    layer (benchmarks, tests: e.g. ``transport.loopback.LoopbackTransport``), checked and used as it is."""
    blockers = pipeline_blockers(cfg.capacity_factor, bool(cfg.router_pad_multiple), cfg.etp_size)
    check_options(
        options,
        ep_size=cfg.ep_size,
        blockers=blockers,
        megatron_overlap_flags=cfg.megatron_overlap_flags,
        cuda=torch.cuda.is_available(),
    )
    if transport is not None:
        _check_given_transport(transport, cfg, options, blockers)
        return transport
    if options.engine is Engine.PLAIN or cfg.megatron_overlap_flags or blockers:
        return None
    kind = options.transport
    if cfg.ep_size == 1:
        return None  # nothing to move, nothing to overlap
    if kind is TransportKind.NVLINK:
        from mok_megatron.transport.nvlink.hierarchical import nvlink_transport

        # one NVLink domain: NVLinkTransport; an EP group across domains: NVLink inside, NCCL between
        return nvlink_transport(
            ep_group, options.nvlink_programs, options.nvlink_sync, options.nvlink_programs_backward
        )
    if kind is TransportKind.COPY_ENGINE:
        from mok_megatron.transport.copy_engine import CopyEngineTransport

        return CopyEngineTransport(ep_group)
    from mok_megatron.transport.collective import CollectiveTransport

    return CollectiveTransport(ep_group)


def tiles_blockers(
    cfg: MoKConfig, options: MoKOptions, experts: ExpertsContract, transport=None
) -> list[str]:
    """The settings of a layer that the tiles engine cannot run (empty: it can)."""
    why = pipeline_blockers(cfg.capacity_factor, bool(cfg.router_pad_multiple), cfg.etp_size)
    if cfg.pad_to_capacity:
        why.append("moe_pad_expert_input_to_capacity=True")
    if (
        options.expert_backend.value != "torch"
        or not experts.mok
        or experts.fuses_permute
        or experts.host_counts
    ):
        why.append(
            f"--mok-expert-backend {options.expert_backend.value}" if experts.mok else "Megatron's experts"
        )
    act = cfg.activation
    if (
        not (act.kind.value == "silu" and act.gated and act.clamp is None and act.glu_linear_offset == 0.0)
        or act.glu_interleave is not None
    ):
        why.append("an activation other than SwiGLU (gated silu, no clamp, offset or interleave)")
    if cfg.apply_probs_on_input:
        why.append("moe_apply_probs_on_input=True")
    if cfg.delay_wgrad:
        why.append("--delay-wgrad-compute")
    why.extend(cfg.megatron_overlap_flags)
    if transport is not None and not isinstance(transport, PullSource):
        why.append(
            f"a {transport.name} transport given to the layer (it exposes no peer buffers to the pull)"
        )
    elif transport is not None and cfg.ep_size != 1:
        why.append(
            f"a {transport.name} transport at EP={cfg.ep_size} (it stands in for an EP group on one rank: "
            "--expert-model-parallel-size 1)"
        )
    return why


def select_tiles(
    cfg: MoKConfig, options: MoKOptions, experts: ExpertsContract, transport=None
) -> EngineChoice:
    """The tiles engine's choice, or ``MoKConfigError`` naming what this layer has that it cannot run."""
    why = tiles_blockers(cfg, options, experts, transport)
    if why:
        raise MoKConfigError(
            f"--mok-engine tiles runs dropless SwiGLU layers on MoK's torch experts without expert-TP; this "
            f"layer has {', '.join(why)}. Change those settings, or use --mok-engine auto."
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    why_not = kernels_unavailable(device, cfg.params_dtype, cfg.ep_size)
    if why_not is not None and device.type == "cuda":  # the references would be a silently slow layer
        raise MoKConfigError(
            f"--mok-engine tiles on a GPU runs its kernels, and here {why_not}; its pure-torch references run "
            "on CPU (gloo) only. Use --mok-engine auto on this machine."
        )
    config = TilesConfig(
        options.tile_sms, options.tile_sms_bwd, why_not is None, tile_config(cfg.hidden_size)
    )
    rows = RowLayout.ALIGNED if aligned_plan_applies(cfg) else RowLayout.SORTED
    return EngineChoice(None, rows, 1, tiles=config, pull=transport)


def select_engine(
    cfg: MoKConfig, options: MoKOptions, ep_group, experts: ExpertsContract, transport=None
) -> EngineChoice:
    """The engine of one layer: transport (or the plain engine) and the experts' row layout. ``transport``:
    one given to the layer (``select_transport``)."""
    if options.engine is Engine.TILES:
        return select_tiles(cfg, options, experts, transport)
    transport = select_transport(cfg, options, ep_group, transport)
    if options.sync_free and transport is not None and not experts.mok:
        raise MoKConfigError(
            "--mok-sync-free needs MoK's experts (MoKGroupedMLP); these experts read token counts on the "
            "host. Use a MoK spec, or drop --mok-sync-free."
        )
    if (
        options.minibatch_split is MinibatchSplit.EXPERTS
        and transport is not None
        and not experts.device_counts
    ):
        raise MoKConfigError(
            "--mok-minibatch-split experts needs MoK's torch or torch-fp8 experts (each minibatch computes "
            "one group of experts through views of their stacked weights); these experts are "
            f"{'TE GroupedLinear' if experts.mok else 'Megatron experts'}. Use --mok-expert-backend torch or "
            "torch-fp8 with a MoK spec, or drop --mok-minibatch-split."
        )
    if options.minibatch_split is MinibatchSplit.EXPERTS and transport is not None and cfg.delay_wgrad:
        raise MoKConfigError(
            "--mok-minibatch-split experts with delay_wgrad_compute: delayed weight gradients queue whole "
            "weights, expert minibatches use one view per group of experts. Drop --delay-wgrad-compute or "
            "--mok-minibatch-split."
        )
    align = experts.alignment
    if transport is not None:  # every expert call of the pipeline: experts that take device counts
        aligned = experts.device_counts
        exact = False
    else:  # the plain engine: the routing kernels' plan at EP = 1
        aligned = aligned_plan_applies(cfg)
        exact = aligned and experts.mok and experts.host_counts
    if aligned and align > 1 and experts.mok and experts.fuses_permute:
        rows = RowLayout.FUSED
    elif exact:
        rows = RowLayout.ALIGNED_EXACT
    elif aligned:
        rows = RowLayout.ALIGNED
    else:
        rows = RowLayout.SORTED
    # The permute writes the experts' padded layout itself (no pad / unpad copies); in the pipeline only
    # for experts that take device counts.
    row_alignment = align if align > 1 and aligned else 1
    if transport is None:
        return EngineChoice(None, rows, row_alignment)
    config = PipelineConfig(
        transport=transport,
        topk=cfg.topk,
        minibatches=MinibatchPolicy.of(options, transport, cfg.ep_size),
        rows=rows,
        row_alignment=row_alignment,
        fp8_dispatch=options.fp8_dispatch,
        fp8_combine=options.fp8_combine,
    )
    return EngineChoice(config, rows, row_alignment)
