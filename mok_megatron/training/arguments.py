"""The ``--mok-*`` command-line flags for Megatron-LM's argument parser, and ``mok`` as a dispatcher.

Use with any ``megatron.training`` entry point::

    from mok_megatron.training.arguments import extra_args_provider, options_from_args
    args = parse_and_validate_args(extra_args_provider=extra_args_provider)
    options = options_from_args(args)            # MoKOptions; give them to the layer spec (mokify)

``--moe-token-dispatcher-type mok`` selects the MoK MoE layer. Megatron-Core builds dispatchers from a
hard-coded list and keys many checks off the string ``alltoall`` (config validation, shared-expert
overlap, EP A2A overlap, ``should_free_input``); MoK reproduces the alltoall dispatcher's math, so
the flag is an alias: after parsing, ``args.moe_token_dispatcher_type == "alltoall"`` and
``args.mok == True``. Megatron's own checks then run unchanged, and the entry point picks the MoK
layer spec from ``args.mok``. With any other dispatcher type the ``--mok-*`` flags are ignored
(with a warning), so one command line A/B-compares the two layers by changing only the type.

The flags are the ``MoKOptions`` fields that carry a ``Flag`` (``mok_megatron.options``): name, help,
choices and default come from there; ``add_mok_flags`` builds them and ``flag_table`` writes the README's
table (``python -m mok_megatron.training.arguments --markdown``). Parsed values are plain strings, numbers
and booleans (``args`` is saved inside checkpoints, which load with ``weights_only``).

Validation runs right after parsing, before Megatron's ``validate_args`` and before any process
group exists. argparse has no post-parse hook, so ``extra_args_provider`` wraps the parser's
``parse_known_args`` and ``parse_args``; any bad command line (a bad combination, an unknown flag, a bad
value of any flag) exits with status 2 and one line, ``prog: error: <message naming the value and the fix>``,
without Megatron's ~700-line usage in front of it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import sys
import typing
import warnings
from enum import StrEnum

from mok_megatron.errors import MoKConfigError
from mok_megatron.engine.select import check_options, pipeline_blockers

from mok_megatron.options import MoKOptions, MoKOptionsError, flag_fields, flag_name


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


def _plain(value):
    """A default as argparse stores it: an enum member becomes its string (``args`` holds plain values)."""
    return value.value if isinstance(value, StrEnum) else value


def _default_text(f: dataclasses.Field, flag) -> str:
    """How the help and the README's table write the default of the field ``f``."""
    if flag.default_text is not None:
        return flag.default_text
    value = _plain(f.default)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "automatic"
    return str(value)


def _argparse_kwargs(f: dataclasses.Field, flag, kind) -> dict:
    """``add_argument`` keywords for the field ``f`` of type ``kind``."""
    default = _plain(f.default)
    if kind is bool:
        if flag.negatable:
            return {"action": argparse.BooleanOptionalAction, "default": default}
        return {"action": "store_true", "default": default}
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        return {"choices": [e.value for e in kind], "default": default}
    return {"type": kind, "default": default, "metavar": flag.metavar}


def _field_types() -> dict[str, type]:
    """Each flagged field's value type (``int | None`` -> ``int``)."""
    hints = typing.get_type_hints(MoKOptions)
    out = {}
    for f, _ in flag_fields():
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        out[f.name] = args[0] if args else kind
    return out


def add_mok_flags(parser) -> None:
    """The ``--mok-*`` flags alone (no dispatcher widening), e.g. for a plain argparse parser: one per
    ``MoKOptions`` field with a ``Flag``; values are stored as plain strings / numbers / booleans."""
    g = parser.add_argument_group(title="mok", description="MoK MoE layer (--moe-token-dispatcher-type mok)")
    types = _field_types()
    for f, flag in flag_fields():
        text = flag.help + (f"; {flag.detail}" if flag.detail else "")
        g.add_argument(
            flag_name(f.name),
            help=f"{text} (default: {_default_text(f, flag)})",
            **_argparse_kwargs(f, flag, types[f.name]),
        )


def flag_table() -> str:
    """The README's flags table (Markdown), from the same fields and actions as ``add_mok_flags``."""
    parser = argparse.ArgumentParser(prog="mok-pretrain-gpt", add_help=False)
    add_mok_flags(parser)
    formatter = parser._get_formatter()
    by_dest = {a.dest: a for a in parser._actions}
    rows = ["| flag | meaning | default |", "|---|---|---|"]
    for f, flag in flag_fields():
        spelled = formatter._format_action_invocation(by_dest["mok_" + f.name])
        invocation = ", ".join(f"`{s}`" for s in spelled.split(", "))
        rows.append(f"| {invocation} | {flag.help} | {_default_text(f, flag)} |")
    return "\n".join(rows) + "\n"


# A '%' in help text that is not a format spec: argparse's ``--help`` formats every help string with
# ``%`` and raises on it (megatron-core 0.19 generates help from config docstrings such as "1.10 = 10%)").
_PERCENT = re.compile(r"%%|%\([a-z_]+\)[sdr]|%")


def escape_help(parser: argparse.ArgumentParser) -> None:
    """Escape stray ``%`` in every help string of ``parser``, so ``--help`` prints instead of raising."""
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _PERCENT.sub(lambda m: "%%" if m.group() == "%" else m.group(), action.help)


def tell_launcher(line: str) -> None:
    """Under torchrun: write ``line`` to this rank's error file (``TORCHELASTIC_ERROR_FILE``), so the failure
    summary torchrun prints last names it (instead of "error_file: <N/A>")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def _exit_once(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit with status 2; the message once per job (rank 0, or a process outside torchrun), without
    Megatron's ~700-line usage in front of it."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    line = f"{parser.prog}: error: {message}"
    tell_launcher(line)
    parser.exit(2, f"{line}\n" if rank0 else None)


def unrecognized(parser: argparse.ArgumentParser, rest: list[str]) -> str:
    """The message for command-line words no flag of ``parser`` takes, with the nearest flag per typo."""
    known = list(parser._option_string_actions)
    flags = [w for w in rest if w.startswith("-")] or rest
    named = []
    for word in flags:
        name = word.split("=", 1)[0]
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.75) if name.startswith("--") else []
        named.append(f"{word} (did you mean {near[0]}?)" if near else word)
    noun = "argument" if len(named) == 1 else "arguments"
    return f"unrecognized {noun} {', '.join(named)}; --help lists every flag."


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the MoK flags and validation. Idempotent.

    Every ``--mok-*`` value and combination is checked right after parsing; a bad one exits with one
    line that names the value and the fix, printed once per job. argparse's own errors (an unknown flag, with
    the nearest known one; a bad choice or number for any flag) exit the same way. ``parse_args`` reports
    unknown flags before the checks run, so a misspelt flag is named as such, not as the value it failed to
    set."""
    if getattr(parser, _MARK, False):
        return parser
    _widen_dispatcher_choices(parser)
    add_mok_flags(parser)
    escape_help(parser)
    parse_known = parser.parse_known_args
    argparse_error = parser.error

    def error(message: str):
        _exit_once(parser, message)

    def parse(args, namespace, strict: bool):
        parser.error = error
        try:
            ns, rest = parse_known(args, namespace)
        finally:
            parser.error = argparse_error
        if strict and rest:
            _exit_once(parser, unrecognized(parser, rest))
        try:
            validate(ns)
        except (MoKArgumentError, MoKOptionsError, MoKConfigError) as e:
            _exit_once(parser, str(e))
        return ns, rest

    def parse_known_args(args=None, namespace=None):
        return parse(args, namespace, strict=False)

    def parse_args(args=None, namespace=None):
        return parse(args, namespace, strict=True)[0]

    parser.parse_known_args = parse_known_args
    parser.parse_args = parse_args
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
    """``MoKOptions`` from parsed flags (raises ``MoKOptionsError`` on bad values). A flag the parser does
    not have (a parser built by an earlier patch set) keeps the field's default."""
    return MoKOptions(**{f.name: getattr(args, "mok_" + f.name, f.default) for f, _ in flag_fields()})


def _given_mok_flags(args) -> list[str]:
    given = options_from_args(args)
    return [flag_name(f.name) for f, _ in flag_fields() if getattr(given, f.name) != f.default]


def check_schedule(args) -> None:
    """The learning-rate schedule against what Megatron's ``OptimizerParamScheduler`` asserts when it is
    built: after the model, the optimizer and any checkpoint load, minutes into a large job, as a bare
    ``AssertionError``. The same arithmetic as ``megatron.training.training.get_optimizer_param_scheduler``:
    decay steps are ``--lr-decay-iters`` (else ``--train-iters``) or ``--lr-decay-samples`` (else
    ``--train-samples``); warm-up steps are ``--lr-warmup-fraction`` of them, else ``--lr-warmup-iters`` /
    ``--lr-warmup-samples``; warm-up must stay below decay. Both layers train with this scheduler, so the
    check applies to every dispatcher. ``--skip-train`` builds no optimizer: nothing to check."""
    if getattr(args, "skip_train", False):
        return
    lr = getattr(args, "lr", None)
    min_lr = getattr(args, "min_lr", 0.0) or 0.0
    init = getattr(args, "lr_warmup_init", 0.0) or 0.0
    if min_lr < 0:
        raise MoKArgumentError(f"--min-lr {min_lr} is negative. Give --min-lr 0 or more.")
    if lr is not None and lr < 0:
        raise MoKArgumentError(f"--lr {lr} is negative. Give --lr above 0.")
    if lr is not None and min_lr > lr:
        raise MoKArgumentError(f"--min-lr {min_lr} is above --lr {lr}. Lower --min-lr to at most {lr}.")
    if lr is not None and init > lr:
        raise MoKArgumentError(
            f"--lr-warmup-init {init} is above --lr {lr}: warm-up rises to --lr. Lower --lr-warmup-init."
        )
    _check_weight_decay_schedule(args)
    if getattr(args, "train_iters", None):
        unit, train_flag, train = "iterations", "--train-iters", args.train_iters
        decay_flag, decay_value = "--lr-decay-iters", getattr(args, "lr_decay_iters", None)
        warmup_flag, warmup = "--lr-warmup-iters", getattr(args, "lr_warmup_iters", 0) or 0
        wsd_flag, wsd = "--lr-wsd-decay-iters", getattr(args, "lr_wsd_decay_iters", None)
    elif getattr(args, "train_samples", None):
        unit, train_flag, train = "samples", "--train-samples", args.train_samples
        decay_flag, decay_value = "--lr-decay-samples", getattr(args, "lr_decay_samples", None)
        warmup_flag, warmup = "--lr-warmup-samples", getattr(args, "lr_warmup_samples", 0) or 0
        wsd_flag, wsd = "--lr-wsd-decay-samples", getattr(args, "lr_wsd_decay_samples", None)
    else:
        return  # Megatron names the missing --train-iters / --train-samples itself
    if decay_value is None:
        decay, named = train, f"{train_flag} {train}"
    else:
        decay, named = decay_value, f"{decay_flag} {decay_value}"
    if decay <= 0:
        raise MoKArgumentError(f"{named}: the learning rate must decay over at least 1 of the {unit}.")
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None and fraction >= 1:
        raise MoKArgumentError(
            f"--lr-warmup-fraction {fraction} warms up over all {decay} {unit} the learning rate decays over "
            f"({named}); Megatron's scheduler needs warm-up shorter than decay. Use a fraction below 1."
        )
    if fraction is None and warmup >= decay:
        more = decay_flag if decay_value is not None else train_flag
        raise MoKArgumentError(
            f"{warmup_flag} {warmup} is not below the {decay} {unit} the learning rate decays over "
            f"({named}); Megatron's scheduler needs warm-up shorter than decay. Lower {warmup_flag} to at "
            f"most {decay - 1}, or raise {more} above {warmup}"
            + (" (examples/*.sh: ITERS=N sets both)." if decay_value is None else ".")
        )
    if getattr(args, "lr_decay_style", None) == "WSD" and wsd is None:
        raise MoKArgumentError(f"--lr-decay-style WSD needs {wsd_flag} (the steps of its final decay).")


def _check_weight_decay_schedule(args) -> None:
    """Megatron's scheduler also asserts on the weight decay it steps: from ``--start-weight-decay`` (>= 0)
    up to ``--end-weight-decay`` under ``--weight-decay-incr-style linear / cosine``, else ``--weight-decay``
    throughout (``validate_args`` fills both in, and refuses a missing one itself)."""
    style = getattr(args, "weight_decay_incr_style", "constant")
    if style == "constant":
        wd = getattr(args, "weight_decay", 0.0) or 0.0
        if wd < 0:
            raise MoKArgumentError(f"--weight-decay {wd} is negative. Give --weight-decay 0 or more.")
        return
    start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
    if start is None or end is None:
        return
    if start < 0:
        raise MoKArgumentError(f"--start-weight-decay {start} is negative. Give 0 or more.")
    if end < start:
        raise MoKArgumentError(
            f"--end-weight-decay {end} is below --start-weight-decay {start}: Megatron's scheduler only "
            f"raises weight decay (--weight-decay-incr-style {style}). Raise --end-weight-decay to at least "
            f"{start}, or use --weight-decay alone."
        )


def validate(args) -> None:
    """Checks that need only the command line (no process groups). Raises ``MoKArgumentError`` /
    ``MoKOptionsError``; ``extra_args_provider`` turns them into ``parser.error``."""
    options_from_args(args)  # value checks live in MoKOptions
    check_schedule(args)
    if getattr(args, "overlap_moe_expert_parallel_comm", False) and args.expert_model_parallel_size < 2:
        raise MoKArgumentError(
            "--overlap-moe-expert-parallel-comm overlaps the expert-parallel all-to-all of one micro-batch "
            f"with another's compute and needs --expert-model-parallel-size 2 or more (got "
            f"{args.expert_model_parallel_size}). Drop the flag, or raise --expert-model-parallel-size."
        )
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


def _check_expert_backend(args, options) -> None:
    """The experts' backend against this machine, with the rules the layer applies when it is built
    (``experts.backend.check_expert_backend``): torch-fp8 needs an FP8-capable GPU, te needs Transformer
    Engine and a GPU."""
    import torch

    from mok_megatron.compat import have_te
    from mok_megatron.experts.backend import check_expert_backend

    recompute = getattr(args, "recompute_granularity", None) == "selective" and "moe_act" in (
        getattr(args, "recompute_modules", None) or []
    )
    delay_wgrad = bool(
        getattr(args, "delay_wgrad_compute", False)
        or getattr(args, "overlap_dispatch_backward_with_experts_wgrad", False)
    )
    cuda = torch.cuda.is_available()
    check_expert_backend(
        options.expert_backend,
        args,
        torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        have_te=have_te(),
        sync_free=options.sync_free,
        recompute_activation=recompute,
        delay_wgrad=delay_wgrad,
    )


def check_environment(args) -> None:
    """Checks against this machine (run by the entry point right after parsing, not by the parser, so a
    command line can be parsed and checked anywhere, e.g. by ``mok recipe check``): Megatron's default
    Transformer Engine modules need TE; a GPU transport needs GPUs; the experts' backend needs what it runs
    on (TE, an FP8-capable GPU); FP8 needs TE and a GPU that has the recipe."""
    import torch

    from mok_megatron.compat import cuda_capability, have_te

    if getattr(args, "transformer_impl", None) == "transformer_engine" and not have_te():
        raise MoKArgumentError(
            "--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which is "
            "not importable here. Install it (pip install 'mok-megatron[te]'), or pass --transformer-impl "
            "local (Megatron-Core's own modules)."
        )
    if getattr(args, "mok", False):
        options = options_from_args(args)
        cuda = torch.cuda.is_available()
        check_options(options, ep_size=args.expert_model_parallel_size, blockers=[], cuda=cuda)
        _check_expert_backend(args, options)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m mok_megatron.training.arguments --markdown``: print the README's flags table."""
    parser = argparse.ArgumentParser(
        prog="python -m mok_megatron.training.arguments", description=main.__doc__
    )
    parser.add_argument("--markdown", action="store_true", help="the README's '## Flags' table (Markdown)")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 0
    sys.stdout.write(flag_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
