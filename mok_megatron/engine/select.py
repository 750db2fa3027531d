"""Which engine a MoK layer runs: the overlap pipeline (with which transport) or the plain path.

The pipeline (``mok_megatron.engine.pipeline``) runs when expert parallelism is on (or the
loopback transport emulates it) and routing is dropless without expert-TP. Capacity dropping,
drop-and-pad, router padding and expert-TP keep the unpipelined six-phase path, and asking for a
pipeline-only option with them is an error naming the settings.

Composition with Megatron's own EP overlap (``--overlap-moe-expert-parallel-comm``, the combined 1F1B
schedule; also ``--overlap-dispatch-backward-with-experts-wgrad``): Megatron's overlap wins. Its
scheduler runs dispatch, experts and combine as separate nodes on a communication and a compute stream
and overlaps one micro-batch's all-to-all with another's compute; MoK's in-layer pipeline would fold
all three into the experts node (its dispatch/combine nodes would be empty, its exchanges would run on
the compute stream), defeating that schedule. So with those flags the layer runs the six-phase plain
engine, which Megatron's scheduler interleaves like its own alltoall dispatcher, and an explicit
pipeline option (``--mok-engine pipeline``, ``--mok-minibatch-size``, ``--mok-sync-free``, a
``--mok-transport``) is a start-up error naming both flags.
"""

from __future__ import annotations

import torch

from mok_megatron.config import MoKConfig, MoKConfigError
from mok_megatron.transport.collective import CollectiveTransport
from mok_megatron.transport.copy_engine import CopyEngineTransport
from mok_megatron.transport.loopback import LoopbackTransport
from mok_megatron.options import MoKOptions


def _unsupported(cfg: MoKConfig) -> list[str]:
    why = []
    if not cfg.dropless:
        why.append(f"moe_expert_capacity_factor={cfg.capacity_factor} (token dropping)")
    if cfg.router_pad_multiple:
        why.append("moe_router_padding_for_quantization=True")
    if cfg.etp_size > 1:
        why.append(f"expert_tensor_parallel_size={cfg.etp_size}")
    return why


def _explicit(options: MoKOptions) -> list[str]:
    """The --mok-* flags given that only the overlap pipeline honours."""
    return [
        flag
        for flag, on in (
            ("--mok-engine pipeline", options.engine == "pipeline"),
            ("--mok-minibatch-size", options.minibatch_size is not None),
            ("--mok-sync-free", options.sync_free),
            (f"--mok-transport {options.transport}", options.transport != "auto"),
            (f"--mok-local-rows {options.local_rows}", options.local_rows != "auto"),
            ("--mok-fp8-dispatch", options.fp8_dispatch),
            ("--mok-fp8-combine", options.fp8_combine),
        )
        if on
    ]


def select_transport(cfg: MoKConfig, options: MoKOptions, ep_group):
    """The transport of the overlap engine, or None for the unpipelined path."""
    if options.engine == "plain":
        return None
    if cfg.megatron_overlap_flags:
        explicit = _explicit(options)
        if explicit:
            raise MoKConfigError(
                f"{', '.join(explicit)} asks for the MoK overlap pipeline, but {', '.join(cfg.megatron_overlap_flags)} "
                "hands the MoE phases to Megatron's combined 1F1B schedule, which overlaps dispatch and "
                "combine across micro-batches itself; the two cannot both drive this layer. Drop the "
                "--mok-* option(s) (the layer then runs the six-phase plain engine under Megatron's "
                f"overlap) or drop {', '.join(cfg.megatron_overlap_flags)} (MoK's in-layer overlap)."
            )
        return None
    explicit = _explicit(options)
    why = _unsupported(cfg)
    if why:
        if explicit:
            raise MoKConfigError(
                f"{', '.join(explicit)} need(s) the MoK overlap pipeline, which supports dropless routing "
                f"without expert tensor parallelism; this layer has {', '.join(why)}. Drop the --mok-* "
                "option(s) (the layer then runs unpipelined) or change those settings."
            )
        return None
    if options.transport == "loopback":
        if cfg.ep_size != 1:
            raise MoKConfigError(
                f"--mok-transport loopback emulates expert parallelism on one rank; this layer has "
                f"EP={cfg.ep_size}. Use collective or copy_engine with real EP ranks."
            )
        return LoopbackTransport(
            options.loopback_ep,
            cfg.num_local_experts,
            cfg.topk,
            options.loopback_gbps,
            copies=options.loopback_bytes == "copy",
        )
    if cfg.ep_size == 1:
        return None  # nothing to move, nothing to overlap
    if options.transport == "nvlink":
        if not torch.cuda.is_available():
            raise MoKConfigError(
                "--mok-transport nvlink needs CUDA GPUs in one NVLink domain; use collective here."
            )
        from mok_megatron.transport.nvlink.hierarchical import nvlink_transport

        # one NVLink domain: NVLinkTransport; an EP group across domains: NVLink inside, NCCL between
        return nvlink_transport(ep_group, options.nvlink_programs, options.nvlink_sync)
    if options.transport == "copy_engine":
        if not torch.cuda.is_available():
            raise MoKConfigError(
                "--mok-transport copy_engine needs CUDA GPUs in one NVLink domain; use collective here."
            )
        return CopyEngineTransport(ep_group)
    return CollectiveTransport(ep_group)
