"""``MoKOptions``: the MoK-only knobs that Megatron's ``TransformerConfig`` has no field for.

They come from the ``--mok-*`` command-line flags (``mok_megatron.training.arguments``), from a spec
(``get_gpt_layer_with_mok_spec(..., options=MoKOptions(...))``), or from the process default that
the flags set (``set_default_options``). Frozen and validated at construction.

    engine               'auto' | 'pipeline' (the overlap engine) | 'plain' (one dispatch, experts and
                         combine per layer call, Megatron's row layout); auto = see
                         ``mok_megatron.engine.select.select_transport``
    minibatch_size       tokens per pipelined minibatch (None: the automatic rule in
                         ``mok_megatron.engine.pipeline_plan.auto_minibatch_size``)
    capacity_multiplier  sync-free mode: receive buffer per source rank, as a fraction of that
                         rank's tokens (1.0 can never overflow; smaller saves memory; overflow is
                         detected and the step's exchange is redone in exact mode, never dropped)
    sync_free            exchange token counts on device and move fixed-capacity buffers, so the
                         layer never reads the device from the host (CUDA-graph capturable)
    deterministic        fixed-order, atomic-free reductions: bitwise-identical run to run (default;
                         the Triton gather-sum is also the fastest on H200). False: index_add_
                         with atomics into an fp32 buffer (kept for comparison; slower, measured)
    transport            'auto' | 'collective' (NCCL / gloo all-to-all) | 'copy_engine'
                         (symmetric-memory peer pulls on the copy engine, one NVLink domain) |
                         'loopback' (one GPU stands in for EP peers; benchmarks only)
    loopback_gbps        loopback transport: emulated per-direction link bandwidth (0 = infinite)
    loopback_ep          loopback transport: the EP size whose traffic is emulated
    loopback_bytes       loopback transport: 'copy' (default) moves the emulated rank's bytes with
                         device-to-device copies beside the link time; 'link' emulates the link time only
                         (on GPUs the received rows are the sent rows, no copy). On one H200 the copies
                         make almost no progress while the grouped GEMMs run (they behave like SM
                         work: s11), so 'copy' charges the bytes after the GEMMs; 'link' stands for a
                         transport whose bytes land beside them unhindered: the schedule's own bound.
    expert_backend       the experts' GEMMs: 'torch' (bf16 grouped_mm, default) | 'torch-fp8' (native
                         rowwise-scaled ``torch._scaled_grouped_mm``, Hopper+, no TE) | 'te' (Transformer
                         Engine GroupedLinear under Megatron's --fp8-format/--fp8-recipe; bf16 without it).
                         Device/TE checks run at layer build: ``mok_megatron.experts.backend``
    transport 'nvlink'   device-initiated peer reads (dispatch) and writes (combine) by Triton kernels
                         over symmetric memory, one NVLink domain (``mok_megatron.transport.nvlink``)
    nvlink_programs      nvlink transport: CTAs (SMs) that communicate
    nvlink_sync          nvlink transport: how ranks signal an exchange. 'barrier' (symmetric memory's
                         device barrier, default: run on two H200) | 'flags' (per-peer ready flags, no
                         barrier: a destination reads each source as soon as it has staged;
                         ``transport.nvlink.signals``)
    local_rows           pipeline: the rows whose expert is on this rank. 'overlap': computed in two
                         halves while the dispatch and the combine fly (three expert calls); 'fused':
                         in the received rows' expert call (one call, nothing local hidden); 'auto':
                         fused inside one NVLink domain (EP exchange cheaper than splitting the
                         GEMMs), overlap across nodes (``engine.pipeline_plan.fuse_local_rows``)
    fp8_dispatch         pipeline: dispatched token rows travel as e4m3 + one fp32 scale per row (about
                         half the bytes; ``transport.fp8_rows``); combine and gradients stay bf16
    fp8_combine          pipeline, opt-in: the expert output rows travel back as e4m3 + one fp32 scale
                         per row too (the combine's bytes halved; each token's output then carries up to
                         2^-4 relative error per route, which is why DeepEP and TE keep it bf16);
                         gradients stay bf16
    late_wgrad           pipeline, MoK's bf16 experts, opt-in: the weight gradients of a layer call wait until
                         the last dispatch-backward exchange is launched and run while it flies
                         (``experts.late_wgrad``; bitwise the same gradients, ~0.7 GB more peak memory on
                         DeepSeek-V3's slice). Off by default: on one H200's loopback it gained nothing
                         consistent (s10c-s10e)
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("auto", "collective", "copy_engine", "loopback", "nvlink")
ENGINES = ("auto", "pipeline", "plain")
LOCAL_ROWS = ("auto", "overlap", "fused")
LOOPBACK_BYTES = ("copy", "link")
NVLINK_SYNCS = ("barrier", "flags")
EXPERT_BACKENDS = ("torch", "torch-fp8", "te")


class MoKOptionsError(ValueError):
    """A bad ``--mok-*`` option. The message names the value and the fix."""


@dataclass(frozen=True)
class MoKOptions:
    engine: str = "auto"
    minibatch_size: int | None = None
    capacity_multiplier: float = 1.0
    sync_free: bool = False
    deterministic: bool = True
    transport: str = "auto"
    loopback_gbps: float = 0.0
    loopback_ep: int = 2
    loopback_bytes: str = "copy"
    expert_backend: str = "torch"
    nvlink_programs: int = 64
    nvlink_sync: str = "barrier"
    local_rows: str = "auto"
    fp8_dispatch: bool = False
    fp8_combine: bool = False
    late_wgrad: bool = False

    def __post_init__(self):
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
        if self.engine not in ENGINES:
            raise MoKOptionsError(f"--mok-engine={self.engine!r}: choose one of {', '.join(ENGINES)}.")
        if self.engine == "plain" and (
            self.minibatch_size is not None or self.sync_free or self.fp8_dispatch or self.fp8_combine
        ):
            raise MoKOptionsError(
                "--mok-engine plain runs no pipeline: drop --mok-minibatch-size / --mok-sync-free / "
                "--mok-fp8-dispatch / --mok-fp8-combine, or use --mok-engine pipeline."
            )
        for on, flag in ((self.fp8_dispatch, "--mok-fp8-dispatch"), (self.fp8_combine, "--mok-fp8-combine")):
            if on and self.transport == "nvlink":
                raise MoKOptionsError(
                    f"{flag} with --mok-transport nvlink: the NVLink kernels move bf16 rows only; use "
                    "--mok-transport collective or copy_engine with FP8 rows."
                )
        if self.transport not in TRANSPORTS:
            raise MoKOptionsError(
                f"--mok-transport={self.transport!r}: choose one of {', '.join(TRANSPORTS)}."
            )
        if self.loopback_gbps < 0:
            raise MoKOptionsError(f"loopback_gbps={self.loopback_gbps}: must be >= 0 (0 = infinite).")
        if self.loopback_bytes not in LOOPBACK_BYTES:
            raise MoKOptionsError(
                f"loopback_bytes={self.loopback_bytes!r}: choose one of {', '.join(LOOPBACK_BYTES)} "
                "(copy: the emulated bytes as device copies; link: the link time only)."
            )
        if self.loopback_ep < 1:
            raise MoKOptionsError(f"loopback_ep={self.loopback_ep}: must be >= 1.")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise MoKOptionsError(
                f"--mok-expert-backend={self.expert_backend!r}: choose one of {', '.join(EXPERT_BACKENDS)} "
                "(torch: bf16 grouped GEMM; torch-fp8: native FP8 on Hopper+; te: Transformer Engine)."
            )
        if self.local_rows not in LOCAL_ROWS:
            raise MoKOptionsError(
                f"--mok-local-rows={self.local_rows!r}: choose one of {', '.join(LOCAL_ROWS)} (overlap: "
                "hide local rows' GEMMs behind the exchanges; fused: one expert call after the dispatch)."
            )
        if self.nvlink_sync not in NVLINK_SYNCS:
            raise MoKOptionsError(
                f"--mok-nvlink-sync={self.nvlink_sync!r}: choose one of {', '.join(NVLINK_SYNCS)} (barrier: "
                "symmetric memory's barrier per exchange; flags: per-peer ready flags)."
            )
        if self.nvlink_programs < 1:
            raise MoKOptionsError(
                f"--mok-nvlink-programs={self.nvlink_programs}: must be >= 1 (CTAs that communicate)."
            )


_default = MoKOptions()


def set_default_options(options: MoKOptions) -> None:
    """Options for MoK layers built without explicit ones (the ``--mok-*`` flags set this)."""
    global _default
    if not isinstance(options, MoKOptions):
        raise TypeError(f"expected MoKOptions, got {type(options).__name__}")
    _default = options


def default_options() -> MoKOptions:
    return _default
