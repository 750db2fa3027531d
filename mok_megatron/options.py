"""``MoKOptions``: the MoK-only knobs that Megatron's ``TransformerConfig`` has no field for.

Typed (enums) and frozen; strings are accepted once, here, and become the enum (``MoKOptions(transport=
"collective")``), so a bad value fails at construction with the choices. They reach a layer explicitly:

    get_gpt_layer_with_mok_spec(..., options=MoKOptions(...))      # a spec carries them to every layer
    mokify(spec, options=...)                                      # likewise for any Megatron spec
    python -m mok_megatron.pretrain_gpt ... --mok-*                # the flags build them once at start-up

``MoKMoELayer`` hands its options to its dispatcher and its experts; nothing reads a process-wide default.

Each field that has a command-line flag describes itself once, in its ``Flag`` (the field's metadata): the
flag is ``--mok-`` + the field name, its help a sentence (``help``, the README's flags table) and more detail
(``detail``, added by ``--help``). ``mok_megatron.training.arguments`` builds the argparse flags from them and
prints the README's table (``python -m mok_megatron.training.arguments --markdown``).

Every reduction is deterministic (fixed-order gather-sums in fp32): the layer is bitwise repeatable run
to run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum


class MoKOptionsError(ValueError):
    """A bad ``--mok-*`` option. The message names the value and the fix."""


# the most SMs the tiles engine holds back for communication: a quarter of an H200's 132, the tile GEMMs keep
# the rest (their measured gate, within 3 % of torch's grouped GEMM, holds only up to K = 4-8)
MAX_TILE_SMS = 32


class Engine(StrEnum):
    AUTO = "auto"
    PIPELINE = "pipeline"
    PLAIN = "plain"
    TILES = "tiles"


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


@dataclass(frozen=True)
class Flag:
    """A ``MoKOptions`` field's command-line flag: ``--mok-<field name>``, its description and how its
    default reads. The one description of the option; argparse's help and the README's table come from it."""

    help: str  # one sentence: argparse's help and the README's flags table
    detail: str = ""  # more, for --help only
    default_text: str | None = None  # the default as the help and table write it (None: from the value)
    metavar: str | None = None  # N, F, ... for numbers (choices list themselves)
    negatable: bool = False  # a boolean that also has --no-mok-<name>


def flag_name(name: str) -> str:
    """The command-line flag of the ``MoKOptions`` field ``name``."""
    return "--mok-" + name.replace("_", "-")


def option(default, *, label: str | None = None, **flag):
    """A dataclass field with its ``Flag`` (keywords of ``Flag``) or, without a flag, the ``label`` its
    messages use."""
    meta = {"flag": Flag(**flag)} if flag else {}
    if label is not None:
        meta["label"] = label
    return field(default=default, metadata=meta)


def flag_fields(cls=None) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``cls`` (``MoKOptions``) that have a command-line flag, in declaration order."""
    cls = cls or MoKOptions
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _label(cls, name: str) -> str:
    """How a message names the field ``name`` of ``cls``: its flag, its label, or the name."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if "flag" in f.metadata:
                return flag_name(name)
            return f.metadata.get("label", name)
    return name


def _coerce(obj, name: str, enum: type[StrEnum]) -> None:
    value = getattr(obj, name)
    if isinstance(value, enum):
        return
    try:
        object.__setattr__(obj, name, enum(value))
    except ValueError:
        choices = ", ".join(e.value for e in enum)
        raise MoKOptionsError(f"{_label(type(obj), name)}={value!r}: choose one of {choices}.") from None


@dataclass(frozen=True)
class MoKOptions:
    engine: Engine = option(
        Engine.AUTO,
        help="pipeline: minibatched overlap; plain: Megatron's six phases; tiles: tile kernels; "
        "auto: pipeline at EP > 1 if routing allows",
        detail="plain keeps Megatron's row layout; auto follows engine.select.select_engine and never picks "
        "tiles; tiles runs the experts on the tile kernels (engine.tiles: sm_90 with QuACK at EP = 1, their "
        "torch references elsewhere, correct but not fast)",
    )
    minibatch_size: int | None = option(
        None,
        help="tokens per pipelined minibatch",
        detail="the automatic size is engine.pipeline_plan.auto_minibatch_size; a value >= the tokens per "
        "rank turns pipelining off",
        default_text="automatic",
        metavar="N",
    )
    minibatch_split: MinibatchSplit = option(
        MinibatchSplit.TOKENS,
        help="minibatches as runs of tokens or as groups of local experts (no weight-gradient sums)",
        detail="tokens: each minibatch a run of tokens through every local expert (a weight-gradient sum per "
        "extra minibatch, GEMMs shrink); experts: each minibatch every token through one group of local "
        "experts (as many groups as --mok-minibatch-size gives minibatches, else "
        "engine.pipeline_plan.AUTO_EXPERT_GROUPS, at most one per local expert; GEMMs keep their height, a "
        "token travels once per group it uses; sync-free buffers are sized per group); MoK's torch and "
        "torch-fp8 experts",
    )
    capacity_multiplier: float = option(
        1.0,
        help="sync-free receive buffer per source, a fraction of its tokens in (0, 1]; overflow redone, not "
        "dropped",
        detail="1.0 can never overflow; smaller saves memory; an overflow is detected and the call's "
        "exchange redone with exact sizes",
        metavar="F",
    )
    sync_free: bool = option(
        False,
        help="exchange token counts on the device: no host sync in the layer (CUDA-graph capturable)",
        detail="the layer never reads the device from the host; receive buffers have fixed sizes",
    )
    transport: TransportKind = option(
        TransportKind.AUTO,
        help="EP exchange: NCCL/gloo all-to-all, copy-engine pulls, or Triton NVLink kernels",
        detail="collective: NCCL / gloo all-to-all; copy_engine: symmetric-memory peer pulls on the copy "
        "engine, one NVLink domain; nvlink: Triton kernels read / write peers' symmetric memory (NVLink "
        "inside a domain, the collective across domains). A transport object given to the layer "
        "(MoKMoELayer(..., transport=...), e.g. the one-GPU transport.loopback.LoopbackTransport of "
        "benchmarks and tests) replaces it",
    )
    expert_backend: ExpertBackend = option(
        ExpertBackend.TORCH,
        help="expert GEMMs: bf16 grouped GEMM, native rowwise FP8 (sm_90+, no TE), or TE GroupedLinear "
        "(--fp8-format / --fp8-recipe)",
        detail="torch: bf16 torch._grouped_mm; torch-fp8: native rowwise FP8 on Hopper or newer GPUs, "
        "without TE; te: Transformer Engine GroupedLinear under Megatron's --fp8-format / --fp8-recipe",
    )
    te_single_weight: bool = option(
        False,
        help="te: one TE grouped weight per projection, one call at any expert count (TE-experimental)",
        detail="Transformer Engine's single_grouped_weight (labelled experimental by TE): each projection's "
        "local experts in one [L, N, K] Parameter, quantized by one grouped launch per pass instead of one "
        "per expert, so one grouped GEMM call covers every local expert (no 64-expert cap, no host read: "
        "--mok-sync-free runs at any expert count); state dicts and dist-checkpoints keep TEGroupedMLP's "
        "per-expert keys. Needs TE >= 2.20 and its grouped GEMM for the recipe here; not with "
        "--fp8-param-gather",
    )
    nvlink_programs: int = option(
        64,
        help="nvlink: CTAs that communicate",
        detail="each CTA that communicates is one the GEMMs beside it lose",
        metavar="N",
    )
    nvlink_programs_backward: int | None = option(
        None,
        help="the same in the backward",
        detail="the backward runs twice the forward's GEMMs beside the exchange",
        default_text="as --mok-nvlink-programs",
        metavar="N",
    )
    nvlink_sync: NVLinkSync = option(
        NVLinkSync.BARRIER,
        help="nvlink: one device barrier per exchange, or per-peer ready flags",
        detail="flags: a destination reads each source as soon as that source has staged",
    )
    local_rows: LocalRows = option(
        LocalRows.AUTO,
        help="hidden behind dispatch and combine, or in the received rows' expert call",
        detail="pipeline: rows whose expert is on this rank. overlap: computed in two halves while the "
        "dispatch and the combine fly; fused: in the received rows' expert call (one grouped GEMM per "
        "weight); auto: fused inside one NVLink domain, overlap across nodes",
    )
    fp8_dispatch: bool = option(
        False,
        help="dispatched rows travel as e4m3 + one fp32 scale (about half the bytes)",
        detail="pipeline only; the combine and the gradients stay bf16",
    )
    fp8_combine: bool = option(
        False,
        help="opt-in: expert output rows back in e4m3 too (up to 2^-4 relative error per route)",
        detail="pipeline only; the combine's bytes halved, which is why DeepEP and TE keep the combine in "
        "bf16; gradients stay bf16",
    )
    late_wgrad: bool = option(
        False,
        help="opt-in: expert weight gradients wait for the last dispatch-backward exchange",
        detail="pipeline, MoK's bf16 experts: a layer call's weight gradients run while the last "
        "dispatch-backward exchange flies, one grouped GEMM per weight over every expert call's rows where "
        "that moves fewer bytes than the sums (the per-call sums up to the order of additions; more "
        "activation memory held; on one GPU it gained 0.2-0.5 ms only at 4 minibatches)",
        negatable=True,
    )
    tile_sms: int = option(
        4,
        help="tiles: SMs for the pull",
        detail="forward: the pull of exchanged rows runs on them, the waiting fc1 GEMM on the rest; only a "
        "layer given a transport that exposes its peers' buffers pulls (the one-GPU loopback of benchmarks and "
        "tests), no --mok-transport does, so on the command line it changes nothing; on one H200 the GEMM "
        "gate is met with up to 4 held back on DeepSeek-V3's EP=32 slice and 8 on Qwen3's",
        metavar="K",
    )
    tile_sms_backward: int | None = option(
        None,
        help="the same in the backward",
        detail="the output gradient's pull, beside fc2's input gradient",
        default_text="as --mok-tile-sms",
        metavar="K",
    )

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
        for name in ("tile_sms", "tile_sms_backward"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 1 <= int(value) <= MAX_TILE_SMS):
                raise MoKOptionsError(
                    f"{flag_name(name)}={value}: must be in [1, {MAX_TILE_SMS}] (SMs held back for the pull "
                    "beside the waiting GEMMs, which keep the rest)"
                    + ("." if name == "tile_sms" else ", or omitted to use --mok-tile-sms.")
                )
        if self.engine is Engine.TILES:
            pipeline = [f for f in self.pipeline_only() if f != "--mok-engine tiles"]
            if pipeline:
                raise MoKOptionsError(
                    f"--mok-engine tiles with {', '.join(pipeline)}: those are the overlap pipeline's; the tiles "
                    "engine overlaps inside its GEMMs. Drop them, or use --mok-engine pipeline."
                )
        if self.te_single_weight and self.expert_backend is not ExpertBackend.TE:
            raise MoKOptionsError(
                f"--mok-te-single-weight with --mok-expert-backend {self.expert_backend.value}: the single "
                "grouped weight is Transformer Engine's; use --mok-expert-backend te or drop "
                "--mok-te-single-weight."
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

    @property
    def tile_sms_bwd(self) -> int:
        """SMs the tiles engine holds back for the backward's pull."""
        return self.tile_sms if self.tile_sms_backward is None else self.tile_sms_backward

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
