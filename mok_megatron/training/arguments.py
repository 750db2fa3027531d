"""The ``--mok-*`` command-line flags for Megatron-LM's argument parser, and ``mok`` as a dispatcher.

Use with any ``megatron.training`` entry point::

    from mok_megatron.training.arguments import extra_args_provider, options_from_args
    args = parse_and_validate_args(extra_args_provider=extra_args_provider)
    set_default_options(options_from_args(args))

``--moe-token-dispatcher-type mok`` selects the MoK MoE layer. Megatron-Core builds dispatchers from a
hard-coded list and keys many checks off the string ``alltoall`` (config validation, shared-expert
overlap, EP A2A overlap, ``should_free_input``); MoK reproduces the alltoall dispatcher's math, so
the flag is an alias: after parsing, ``args.moe_token_dispatcher_type == "alltoall"`` and
``args.mok == True``. Megatron's own checks then run unchanged, and the entry point picks the MoK
layer spec from ``args.mok``. With any other dispatcher type the ``--mok-*`` flags are ignored
(with a warning), so one command line A/B-compares the two layers by changing only the type.

Validation runs right after parsing, before Megatron's ``validate_args`` and before any process
group exists. argparse has no post-parse hook, so ``extra_args_provider`` wraps the parser's
``parse_known_args`` (which ``parse_args`` calls); a bad combination exits like an argparse error
(status 2, ``prog: error: <message naming the value and the fix>``).

    flag                        MoKOptions field      default
    --mok-engine E              engine                auto (pipeline when EP > 1 and supported)
    --mok-minibatch-size N      minibatch_size        automatic
    --mok-minibatch-split S     minibatch_split       tokens (experts: each minibatch a group of local experts)
    --mok-capacity-multiplier   capacity_multiplier   1.0 (never overflows)
    --mok-sync-free             sync_free             off
    --mok-transport T           transport             auto
    --mok-expert-backend B      expert_backend        torch (bf16; torch-fp8 | te for FP8)
    --mok-nvlink-programs N     nvlink_programs       64
    --mok-nvlink-programs-backward N   nvlink_programs_backward   as --mok-nvlink-programs
    --mok-nvlink-sync S         nvlink_sync           barrier (flags: per-peer ready flags)
    --mok-local-rows R          local_rows            auto (fused in one NVLink domain, else overlap)
    --mok-fp8-dispatch          fp8_dispatch          off (e4m3 dispatch rows, rowwise scales)
    --mok-fp8-combine           fp8_combine           off (opt-in: e4m3 expert output rows back too)
    --mok-late-wgrad            late_wgrad            off (opt-in: weight gradients after the last exchange)
"""

from __future__ import annotations

import argparse
import os
import re
import warnings

from mok_megatron.config import MoKConfigError
from mok_megatron.engine.select import check_options, pipeline_blockers

from mok_megatron.options import (
    Engine,
    ExpertBackend,
    LocalRows,
    MinibatchSplit,
    MoKOptions,
    MoKOptionsError,
    NVLinkSync,
    TransportKind,
)


def _choices(enum) -> list[str]:
    return [e.value for e in enum]


DISPATCHER_FLAG = "--moe-token-dispatcher-type"
MOK = "mok"
# Megatron's dispatcher whose semantics MoK reproduces; `mok` is parsed into it.
MOK_BASE_DISPATCHER = "alltoall"
_MARK = "_mok_flags_added"


class MoKArgumentError(ValueError):
    """A command line MoK cannot run. The message names the value, the constraint and the fix."""


class _DispatcherTypeAction(argparse._StoreAction):
    """Stores ``--moe-token-dispatcher-type``; ``mok`` becomes ``alltoall`` plus ``args.mok = True``."""

    def __call__(self, parser, namespace, values, option_string=None):
        use_mok = values == MOK
        namespace.mok = use_mok
        super().__call__(parser, namespace, MOK_BASE_DISPATCHER if use_mok else values, option_string)


def _widen_dispatcher_choices(parser: argparse.ArgumentParser) -> None:
    action = parser._option_string_actions.get(DISPATCHER_FLAG)
    if action is None:
        raise MoKArgumentError(
            f"{DISPATCHER_FLAG} is not defined on this parser: call extra_args_provider on a parser that "
            "already has Megatron's arguments (megatron.training.arguments.parse_args does this)."
        )
    if action.choices is not None and MOK not in action.choices:
        action.choices = [*action.choices, MOK]
    action.__class__ = _DispatcherTypeAction
    action.help = (action.help or "") + f" '{MOK}': the MoK MoE layer (alltoall semantics)."
    parser.set_defaults(mok=False)


def add_mok_flags(parser) -> None:
    """The ``--mok-*`` flags alone (no dispatcher widening), e.g. for a plain argparse parser."""
    d = MoKOptions()
    g = parser.add_argument_group(title="mok", description="MoK MoE layer (--moe-token-dispatcher-type mok)")
    g.add_argument(
        "--mok-engine",
        choices=_choices(Engine),
        default=d.engine,
        help="pipeline: the minibatched overlap engine; plain: one dispatch/experts/combine per layer "
        "call (Megatron's row layout); auto (default): pipeline when EP > 1 and routing allows",
    )
    g.add_argument(
        "--mok-minibatch-size",
        type=int,
        default=d.minibatch_size,
        help="tokens per pipelined dispatch/expert/combine minibatch (default: automatic)",
    )
    g.add_argument(
        "--mok-minibatch-split",
        choices=_choices(MinibatchSplit),
        default=d.minibatch_split,
        help="pipeline: tokens (default): each minibatch a run of tokens through every local expert; "
        "experts: each minibatch all tokens through one group of local experts (as many groups as "
        "--mok-minibatch-size gives minibatches, else 4, at most one per local expert; no weight-gradient "
        "sums; MoK's torch / torch-fp8 experts)",
    )
    g.add_argument(
        "--mok-capacity-multiplier",
        type=float,
        default=d.capacity_multiplier,
        help="sync-free receive buffer per source rank as a fraction of its tokens, in (0, 1]; "
        "overflow is detected and redone exactly, never dropped (default: %(default)s)",
    )
    g.add_argument(
        "--mok-sync-free",
        action="store_true",
        help="exchange token counts on device: no host sync in the layer (CUDA-graph capturable)",
    )
    g.add_argument(
        "--mok-transport",
        choices=_choices(TransportKind),
        default=d.transport,
        help="EP exchange: collective (NCCL/gloo all-to-all), copy_engine (symmetric-memory peer "
        "pulls inside one NVLink domain), auto (default)"
        ", nvlink (Triton kernels read/write peer memory, one NVLink domain)",
    )
    g.add_argument(
        "--mok-local-rows",
        choices=_choices(LocalRows),
        default=d.local_rows,
        help="pipeline: rows whose expert is local. overlap: two halves hidden behind dispatch and "
        "combine; fused: one expert call with the received rows; auto (default): fused inside one "
        "NVLink domain, overlap across nodes",
    )
    g.add_argument(
        "--mok-fp8-dispatch",
        action="store_true",
        help="pipeline: dispatch token rows in FP8 (e4m3, one fp32 scale per row; about half the "
        "bytes); combine and gradients stay bf16",
    )
    g.add_argument(
        "--mok-fp8-combine",
        action="store_true",
        help="pipeline, opt-in: the expert output rows travel back in FP8 too (e4m3, one fp32 scale per "
        "row; the combine's bytes halved, up to 2^-4 relative error per route); gradients stay bf16",
    )
    g.add_argument(
        "--mok-late-wgrad",
        action=argparse.BooleanOptionalAction,
        default=d.late_wgrad,
        help="pipeline, opt-in: the experts' weight gradients wait until the last dispatch-backward "
        "exchange flies and hide it, one GEMM per weight over all expert calls' rows where that moves fewer "
        "bytes than the sums (default: off; on one GPU it gained 0.2-0.5 ms only at 4 minibatches)",
    )
    g.add_argument(
        "--mok-nvlink-programs",
        type=int,
        default=d.nvlink_programs,
        help="--mok-transport nvlink: CTAs (SMs) that communicate (default: %(default)s)",
    )
    g.add_argument(
        "--mok-nvlink-programs-backward",
        type=int,
        default=d.nvlink_programs_backward,
        help="--mok-transport nvlink: CTAs that communicate in the backward (default: as --mok-nvlink-programs)",
    )
    g.add_argument(
        "--mok-nvlink-sync",
        choices=_choices(NVLinkSync),
        default=d.nvlink_sync,
        help="--mok-transport nvlink: signal each exchange with symmetric memory's barrier, or with "
        "per-peer ready flags (a destination reads each source as soon as it has staged; default: %(default)s)",
    )
    g.add_argument(
        "--mok-expert-backend",
        choices=_choices(ExpertBackend),
        default=d.expert_backend,
        help="experts' GEMMs: torch (bf16 grouped GEMM, default), torch-fp8 (native rowwise FP8, "
        "Hopper+, no TE), te (Transformer Engine GroupedLinear under --fp8-format/--fp8-recipe)",
    )


# A '%' in help text that is not a format spec: argparse's ``--help`` formats every help string with
# ``%`` and raises on it (megatron-core 0.19 generates help from config docstrings such as "1.10 = 10%)").
_PERCENT = re.compile(r"%%|%\([a-z_]+\)[sdr]|%")


def escape_help(parser: argparse.ArgumentParser) -> None:
    """Escape stray ``%`` in every help string of ``parser``, so ``--help`` prints instead of raising."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(), action.help)


def _exit_once(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit with status 2; the message once per job (rank 0, or a process outside torchrun), without
    Megatron's ~700-line usage in front of it."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    parser.exit(2, f"{parser.prog}: error: {message}\n" if rank0 else None)


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the MoK flags and validation. Idempotent.

    Every ``--mok-*`` value and combination is checked right after parsing; a bad one exits with one
    line that names the value and the fix (argparse's own choice and type errors on ``--mok-*`` flags
    too), printed once per job."""
    if getattr(parser, _MARK, False):
        return parser
    _widen_dispatcher_choices(parser)
    add_mok_flags(parser)
    escape_help(parser)
    parse_known = parser.parse_known_args
    argparse_error = parser.error

    def error(message: str):
        if "--mok-" in message:
            _exit_once(parser, message)
        argparse_error(message)

    def parse_known_args(args=None, namespace=None):
        parser.error = error
        try:
            ns, rest = parse_known(args, namespace)
        finally:
            parser.error = argparse_error
        try:
            validate(ns)
        except (MoKArgumentError, MoKOptionsError, MoKConfigError) as e:
            _exit_once(parser, str(e))
        return ns, rest

    parser.parse_known_args = parse_known_args
    setattr(parser, _MARK, True)
    return parser


def install() -> None:
    """Make every parser ``megatron.training.arguments`` builds in this process know the MoK flags.

    Megatron re-parses ``sys.argv`` on its own during ``pretrain`` (``ft_integration.setup`` and
    in-process restart call ``parse_args(ignore_unknown_args=True)`` without the entry point's
    ``extra_args_provider``); unknown ``--mok-*`` flags are ignored there, but the value ``mok`` of a
    known flag is not. The entry point calls this; the Megatron-LM patch set do the same inside Megatron-LM.
    Idempotent.
    """
    from megatron.training import arguments as margs

    add = margs.add_megatron_arguments
    if getattr(add, "_mok", False):
        return

    def add_megatron_arguments(parser):
        return extra_args_provider(add(parser))

    add_megatron_arguments._mok = True
    add_megatron_arguments.__wrapped__ = add
    margs.add_megatron_arguments = add_megatron_arguments


def combine(*providers):
    """One ``extra_args_provider`` from several (``None`` entries skipped)."""

    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


def options_from_args(args) -> MoKOptions:
    """``MoKOptions`` from parsed flags (raises ``MoKOptionsError`` on bad values)."""
    return MoKOptions(
        engine=args.mok_engine,
        minibatch_size=args.mok_minibatch_size,
        minibatch_split=getattr(args, "mok_minibatch_split", MoKOptions().minibatch_split),
        capacity_multiplier=args.mok_capacity_multiplier,
        sync_free=args.mok_sync_free,
        transport=args.mok_transport,
        expert_backend=getattr(args, "mok_expert_backend", "torch"),
        nvlink_programs=getattr(args, "mok_nvlink_programs", MoKOptions().nvlink_programs),
        nvlink_programs_backward=getattr(args, "mok_nvlink_programs_backward", None),
        nvlink_sync=getattr(args, "mok_nvlink_sync", MoKOptions().nvlink_sync),
        local_rows=getattr(args, "mok_local_rows", MoKOptions().local_rows),
        fp8_dispatch=getattr(args, "mok_fp8_dispatch", False),
        fp8_combine=getattr(args, "mok_fp8_combine", False),
        late_wgrad=getattr(args, "mok_late_wgrad", MoKOptions().late_wgrad),
    )


def _given_mok_flags(args) -> list[str]:
    d = MoKOptions()
    given = options_from_args(args)
    return [
        "--mok-" + f.replace("_", "-")
        for f in (
            "engine",
            "minibatch_size",
            "minibatch_split",
            "capacity_multiplier",
            "sync_free",
            "transport",
            "expert_backend",
            "nvlink_programs",
            "nvlink_programs_backward",
            "nvlink_sync",
            "local_rows",
            "fp8_dispatch",
            "fp8_combine",
            "late_wgrad",
        )
        if getattr(given, f) != getattr(d, f)
    ]


def validate(args) -> None:
    """Checks that need only the command line (no process groups). Raises ``MoKArgumentError`` /
    ``MoKOptionsError``; ``extra_args_provider`` turns them into ``parser.error``."""
    options_from_args(args)  # value checks live in MoKOptions
    if not getattr(args, "mok", False):
        given = _given_mok_flags(args)
        if given:
            warnings.warn(
                f"{', '.join(given)} given with {DISPATCHER_FLAG} {args.moe_token_dispatcher_type}: "
                f"ignored (they apply to {DISPATCHER_FLAG} {MOK} only).",
                stacklevel=2,
            )
        return
    experts = args.num_experts
    if not experts:
        raise MoKArgumentError(
            f"{DISPATCHER_FLAG} {MOK} needs an MoE model: --num-experts is {experts}. Add "
            "--num-experts N (and --moe-router-topk K), or drop the dispatcher flag for a dense model."
        )
    ep = args.expert_model_parallel_size
    if ep < 1 or experts % ep != 0:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise MoKArgumentError(
            f"{DISPATCHER_FLAG} {MOK}: --num-experts {experts} is not divisible by "
            f"--expert-model-parallel-size {ep}; every EP rank must hold the same number of experts. "
            f"Use an EP size from {divisors}."
        )
    topk = args.moe_router_topk
    if not 1 <= topk <= experts:
        raise MoKArgumentError(f"--moe-router-topk {topk}: must be between 1 and --num-experts {experts}.")
    # The same combination rules the layer applies when it is built (engine.select), from the flags.
    etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
    overlap = tuple(
        flag
        for flag, field in (
            ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
            (
                "--overlap-dispatch-backward-with-experts-wgrad",
                "overlap_dispatch_backward_with_experts_wgrad",
            ),
        )
        if getattr(args, field, False)
    )
    check_options(
        options_from_args(args),
        ep_size=ep,
        blockers=pipeline_blockers(
            getattr(args, "moe_expert_capacity_factor", None),
            bool(getattr(args, "moe_router_padding_for_quantization", False)),
            etp,
        ),
        megatron_overlap_flags=overlap,
    )


# Lowest CUDA compute capability with hardware support for each FP8 recipe (TE's requirements).
FP8_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def check_environment(args) -> None:
    """Checks against this machine (run by the entry point right after parsing, not by the parser, so a
    command line can be parsed and checked anywhere, e.g. by ``mok recipe check``): Megatron's default
    Transformer Engine modules need TE; a GPU transport needs GPUs; FP8 needs TE and a GPU that has the
    recipe."""
    import torch

    from mok_megatron.compat import cuda_capability, have_te

    if getattr(args, "transformer_impl", None) == "transformer_engine" and not have_te():
        raise MoKArgumentError(
            "--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which is "
            "not importable here. Install it (pip install 'mok-megatron[te]'), or pass --transformer-impl "
            "local (Megatron-Core's own modules)."
        )
    if getattr(args, "mok", False):
        check_options(
            options_from_args(args),
            ep_size=args.expert_model_parallel_size,
            blockers=[],
            cuda=torch.cuda.is_available(),
        )
    if not getattr(args, "fp8", None):
        return

    recipe = getattr(args, "fp8_recipe", "delayed")
    if not have_te():
        raise MoKArgumentError(
            f"--fp8-format {args.fp8} (recipe {recipe}) needs Transformer Engine, which is not installed "
            "here. Install it (pip install 'mok-megatron[te]') or drop --fp8-format."
        )
    cap = cuda_capability()
    need = FP8_MIN_CAPABILITY.get(recipe)
    if cap is not None and need is not None and cap < need:
        supported = [r for r, c in FP8_MIN_CAPABILITY.items() if cap >= c]
        raise MoKArgumentError(
            f"--fp8-recipe {recipe} needs compute capability {need[0]}.{need[1]}+, this GPU is "
            f"{cap[0]}.{cap[1]}. Use one of {supported} here (Hopper: blockwise), or run on a newer GPU."
        )
