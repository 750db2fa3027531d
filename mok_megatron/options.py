"""``MoKOptions``: the MoK-only knobs that Megatron's ``TransformerConfig`` has no field for.

Typed (enums) and frozen; strings are accepted once, here, and become the enum (``MoKOptions(transport=
"collective")``), so a bad value fails at construction with the choices. They reach a layer explicitly:

    get_gpt_layer_with_mok_spec(..., options=MoKOptions(...))      # a spec carries them to every layer
    mokify(spec, options=...)                                      # likewise for any Megatron spec
    python -m mok_megatron.pretrain_gpt ... --mok-*                # the flags build them once at start-up

``MoKMoELayer`` hands its options to its dispatcher and its experts; nothing reads a process-wide default.

    engine               auto | pipeline (the overlap engine) | plain (one dispatch, experts and combine per
                         layer call, Megatron's row layout). auto: ``engine.select.select_engine``
    minibatch_size       tokens per pipelined minibatch (None: ``engine.pipeline_plan.auto_minibatch_size``)
    minibatch_split      pipeline: how a layer call is cut into minibatches. tokens: each minibatch a run of
                         tokens through every local expert (a weight-gradient sum per extra minibatch, GEMMs
                         shrink); experts: each minibatch every token through one group of local experts (as
                         many groups as token minibatches would be, at most one per local expert; no
                         weight-gradient sums, GEMMs keep their height; a token travels once per group it
                         uses; without minibatch_size, ``engine.pipeline_plan.AUTO_EXPERT_GROUPS`` groups).
                         MoK's torch and torch-fp8 experts (torch-fp8: the permute / combine are not fused into
                         the FP8 operands). Sync-free
                         buffers are sized per group: C groups hold C times the token split's rows
    capacity_multiplier  sync-free mode: receive buffer per source rank, as a fraction of that rank's tokens
                         (1.0 can never overflow; smaller saves memory; an overflow is detected and the call's
                         exchange redone with exact sizes, never dropped)
    sync_free            exchange token counts on the device into fixed buffers: the layer never reads the
                         device from the host (CUDA-graph capturable)
    transport            auto | collective (NCCL / gloo all-to-all) | copy_engine (symmetric-memory peer
                         pulls on the copy engine, one NVLink domain) | nvlink (Triton kernels read / write
                         peers' symmetric memory; NVLink inside a domain, the collective across domains).
                         A transport object given to the layer (``MoKMoELayer(..., transport=...)``, e.g. the
                         one-GPU ``transport.loopback.LoopbackTransport`` of benchmarks and tests) replaces it
    expert_backend       torch (bf16 ``torch._grouped_mm``) | torch-fp8 (native rowwise FP8, Hopper+, no TE) |
                         te (Transformer Engine GroupedLinear under Megatron's --fp8-format/--fp8-recipe)
    nvlink_programs      nvlink transport: CTAs (SMs) that communicate in the forward
    nvlink_programs_backward  the same in the backward (None: as the forward); each CTA that communicates
                         is one the GEMMs beside it lose, and the backward runs twice the forward's GEMMs
    nvlink_sync          nvlink transport: barrier (one device barrier per exchange) | flags (per-peer ready
                         flags: a destination reads each source as soon as that source has staged)
    local_rows           pipeline: rows whose expert is on this rank. overlap: computed in two halves while
                         the dispatch and the combine fly; fused: in the received rows' expert call (one
                         grouped GEMM per weight); auto: fused inside one NVLink domain, overlap across nodes
    fp8_dispatch         pipeline: dispatched rows travel as e4m3 + one fp32 scale per row (about half the
                         bytes); combine and gradients stay bf16
    fp8_combine          pipeline: the expert output rows travel back as e4m3 too (the combine's bytes
                         halved; up to 2^-4 relative error per route, which is why DeepEP and TE keep the
                         combine in bf16); gradients stay bf16
    late_wgrad           pipeline, MoK's bf16 experts: a layer call's weight gradients wait until the last
                         dispatch-backward exchange is launched and run while it flies, one grouped GEMM per
                         weight over every expert call's rows where that moves fewer bytes than the sums
                         (the per-call sums up to the order of additions; more activation memory held)

Every reduction is deterministic (fixed-order gather-sums in fp32): the layer is bitwise repeatable run
to run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum


class MoKOptionsError(ValueError):
    """A bad ``--mok-*`` option. The message names the value and the fix."""


class Engine(StrEnum):
    AUTO = "auto"
    PIPELINE = "pipeline"
    PLAIN = "plain"


class TransportKind(StrEnum):
    AUTO = "auto"
    COLLECTIVE = "collective"
    COPY_ENGINE = "copy_engine"
    NVLINK = "nvlink"


class LocalRows(StrEnum):
    AUTO = "auto"
    OVERLAP = "overlap"
    FUSED = "fused"


class MinibatchSplit(StrEnum):
    TOKENS = "tokens"
    EXPERTS = "experts"


class NVLinkSync(StrEnum):
    BARRIER = "barrier"
    FLAGS = "flags"


class ExpertBackend(StrEnum):
    TORCH = "torch"
    TORCH_FP8 = "torch-fp8"
    TE = "te"


_FLAG = {  # field -> the flag that sets it (for messages)
    "engine": "--mok-engine",
    "transport": "--mok-transport",
    "local_rows": "--mok-local-rows",
    "minibatch_split": "--mok-minibatch-split",
    "nvlink_sync": "--mok-nvlink-sync",
    "expert_backend": "--mok-expert-backend",
}


def _coerce(obj, name: str, enum: type[StrEnum]) -> None:
    value = getattr(obj, name)
    if isinstance(value, enum):
        return
    try:
        object.__setattr__(obj, name, enum(value))
    except ValueError:
        choices = ", ".join(e.value for e in enum)
        raise MoKOptionsError(f"{_FLAG.get(name, name)}={value!r}: choose one of {choices}.") from None


@dataclass(frozen=True)
class MoKOptions:
    engine: Engine = Engine.AUTO
    minibatch_size: int | None = None
    minibatch_split: MinibatchSplit = MinibatchSplit.TOKENS
    capacity_multiplier: float = 1.0
    sync_free: bool = False
    transport: TransportKind = TransportKind.AUTO
    expert_backend: ExpertBackend = ExpertBackend.TORCH
    nvlink_programs: int = 64
    nvlink_programs_backward: int | None = None
    nvlink_sync: NVLinkSync = NVLinkSync.BARRIER
    local_rows: LocalRows = LocalRows.AUTO
    fp8_dispatch: bool = False
    fp8_combine: bool = False
    late_wgrad: bool = False

    def __post_init__(self):
        for name, enum in (
            ("engine", Engine),
            ("transport", TransportKind),
            ("local_rows", LocalRows),
            ("minibatch_split", MinibatchSplit),
            ("nvlink_sync", NVLinkSync),
            ("expert_backend", ExpertBackend),
        ):
            _coerce(self, name, enum)
        if self.minibatch_size is not None and (
            isinstance(self.minibatch_size, bool) or int(self.minibatch_size) < 1
        ):
            raise MoKOptionsError(
                f"--mok-minibatch-size={self.minibatch_size}: must be a positive number of tokens "
                "(or omitted for the automatic rule). Use a value >= the sequence's tokens per rank "
                "to turn pipelining off."
            )
        if not self.capacity_multiplier > 0:
            raise MoKOptionsError(
                f"--mok-capacity-multiplier={self.capacity_multiplier}: must be > 0 (the fraction of a "
                "source rank's tokens one destination can receive; 1.0 never overflows)."
            )
        if self.capacity_multiplier > 1:
            raise MoKOptionsError(
                f"--mok-capacity-multiplier={self.capacity_multiplier}: values above 1.0 only waste "
                "memory (a destination receives each source token at most once); use 1.0."
            )
        if self.engine is Engine.PLAIN and (
            self.minibatch_size is not None
            or self.sync_free
            or self.fp8_dispatch
            or self.fp8_combine
            or self.minibatch_split is not MinibatchSplit.TOKENS
        ):
            raise MoKOptionsError(
                "--mok-engine plain runs no pipeline: drop --mok-minibatch-size / --mok-minibatch-split / "
                "--mok-sync-free / --mok-fp8-dispatch / --mok-fp8-combine, or use --mok-engine pipeline."
            )
        if self.minibatch_split is MinibatchSplit.EXPERTS and self.late_wgrad:
            raise MoKOptionsError(
                "--mok-minibatch-split experts with --mok-late-wgrad: the late-wgrad gate queues whole "
                "weights, expert minibatches use one view per group of experts; the two do not combine. "
                "Drop one of them."
            )
        for on, flag in ((self.fp8_dispatch, "--mok-fp8-dispatch"), (self.fp8_combine, "--mok-fp8-combine")):
            if on and self.transport is TransportKind.NVLINK:
                raise MoKOptionsError(
                    f"{flag} with --mok-transport nvlink: the NVLink kernels move bf16 rows only; use "
                    "--mok-transport collective or copy_engine with FP8 rows."
                )
        if self.nvlink_programs < 1:
            raise MoKOptionsError(
                f"--mok-nvlink-programs={self.nvlink_programs}: must be >= 1 (CTAs that communicate)."
            )
        if self.nvlink_programs_backward is not None and self.nvlink_programs_backward < 1:
            raise MoKOptionsError(
                f"--mok-nvlink-programs-backward={self.nvlink_programs_backward}: must be >= 1 (CTAs that "
                "communicate in the backward), or omitted to use --mok-nvlink-programs."
            )

    def replace(self, **changes) -> MoKOptions:
        """A copy with ``changes`` (validated like a new one)."""
        return dataclasses.replace(self, **changes)

    def pipeline_only(self) -> list[str]:
        """The flags set here that only the overlap pipeline honours (for messages)."""
        return [
            flag
            for flag, on in (
                ("--mok-engine pipeline", self.engine is Engine.PIPELINE),
                ("--mok-minibatch-size", self.minibatch_size is not None),
                (
                    f"--mok-minibatch-split {self.minibatch_split.value}",
                    self.minibatch_split is not MinibatchSplit.TOKENS,
                ),
                ("--mok-sync-free", self.sync_free),
                (f"--mok-transport {self.transport.value}", self.transport is not TransportKind.AUTO),
                (f"--mok-local-rows {self.local_rows.value}", self.local_rows is not LocalRows.AUTO),
                ("--mok-fp8-dispatch", self.fp8_dispatch),
                ("--mok-fp8-combine", self.fp8_combine),
                ("--mok-late-wgrad", self.late_wgrad),
            )
            if on
        ]
