"""The ``mok`` command line: ``mok env``, ``mok demo``, ``mok bench layer|train|ep``, ``mok convert``,
``mok patches check|apply|revert``, ``mok recipe check``, ``mok plan``."""

from __future__ import annotations

import argparse
import json
import sys


def _env(argv) -> int:
    p = argparse.ArgumentParser(
        prog="mok env", description="Versions, GPUs, FP8 recipes, and what is missing."
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = p.parse_args(argv)
    from mok_megatron.tools.env import format_report, report

    r = report()
    print(json.dumps(r, indent=2) if ns.json else format_report(r))
    return 0


def _convert(argv) -> int:
    p = argparse.ArgumentParser(
        prog="mok convert",
        description="Rewrite the MoE expert weights of a torch.save'd state dict into another layout "
        "(mok, sequential = Megatron SequentialMLP, te_grouped = Megatron TEGroupedMLP). "
        "dist_checkpointing checkpoints need no conversion.",
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=("mok", "sequential", "te_grouped"))
    p.add_argument("--key", default=None, help="the state dict lives under this key of the file (e.g. model)")
    p.add_argument(
        "--unsafe-load",
        action="store_true",
        help="load SRC with full pickle (weights_only=False): a file from elsewhere can then run arbitrary "
        "code on this machine. Only for files you made yourself that hold objects beyond tensors and "
        "Megatron's checkpoint metadata.",
    )
    ns = p.parse_args(argv)
    import pickle

    import torch

    from mok_megatron.experts.checkpoint import convert_state_dict, expert_prefixes

    try:
        obj = _load_checkpoint_file(ns.src, unsafe=ns.unsafe_load)
    except (pickle.UnpicklingError, RuntimeError) as e:
        print(
            f"mok convert: {ns.src} holds objects a weights-only load refuses ({str(e).splitlines()[0]}). "
            "If you made this file yourself and trust it, add --unsafe-load (full pickle: it can run code).",
            file=sys.stderr,
        )
        return 1
    sd = obj[ns.key] if ns.key else obj
    n = len(expert_prefixes(sd))
    if n == 0:
        print(f"mok convert: no MoE expert weights found in {ns.src}", file=sys.stderr)
        return 1
    converted = convert_state_dict(sd, ns.to)
    if ns.key:
        obj = dict(obj)
        obj[ns.key] = converted
    else:
        obj = converted
    torch.save(obj, ns.dst)
    print(f"mok convert: {n} MoE layer(s) -> {ns.to}, written to {ns.dst}")
    return 0


def _load_checkpoint_file(path: str, unsafe: bool):
    """``torch.load`` with ``weights_only=True`` (tensors, containers and the few classes Megatron's
    ``torch.save`` checkpoints hold: its argparse ``Namespace`` and enums); ``unsafe``: full pickle."""
    import argparse as _argparse

    import torch

    if unsafe:
        return torch.load(path, map_location="cpu", weights_only=False)
    safe = [_argparse.Namespace]
    try:
        from megatron.core.enums import ModelType
        from megatron.core.transformer.enums import AttnBackend, AttnMaskType

        safe += [ModelType, AttnBackend, AttnMaskType]
    except ImportError:
        pass
    with torch.serialization.safe_globals(safe):
        return torch.load(path, map_location="cpu", weights_only=True)


BENCH_COMMANDS = {
    "layer": (
        "mok_megatron.bench.layer",
        "one MoE layer fwd+bwd, MoK vs Megatron and peers, checked then timed (one process)",
    ),
    "train": (
        "mok_megatron.bench.train",
        "Megatron's training loop, MoK vs Megatron from identical weights (tokens/s/GPU, loss)",
    ),
    "ep": (
        "mok_megatron.bench.ep",
        "the layer at real expert parallelism, one process per GPU: torchrun --nproc-per-node N "
        "-m mok_megatron.bench.ep",
    ),
}
# The research sweeps of the repository's benchmarks/ (not in the wheel): how each is run from a checkout.
RESEARCH_SWEEPS = {
    "overlap": "python -m benchmarks.overlap",
    "wgrad": "python -m benchmarks.wgrad",
    "gather": "python -m benchmarks.gather",
    "nvlink": "torchrun --nproc-per-node 2 -m benchmarks.nvlink",
    "kernels": "python -m benchmarks.kernels",
}
BENCH_USAGE = (
    "usage: mok bench {" + ",".join(BENCH_COMMANDS) + "} [options]   (mok bench COMMAND --help)\n\n"
    + "\n".join(f"  {name:<6} {text}" for name, (_, text) in BENCH_COMMANDS.items())
    + "\n\nResearch sweeps (loopback overlap, wgrad, gather, NVLink bandwidth, kernels) live in the "
    "repository's benchmarks/, run from a checkout (benchmarks/README.md): "
    + "; ".join(RESEARCH_SWEEPS.values())
)


def _bench(rest) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print(BENCH_USAGE)
        return 0 if rest else 2
    name = rest[0]
    if name not in BENCH_COMMANDS:
        where = f" ({name} is a research sweep: {RESEARCH_SWEEPS[name]})" if name in RESEARCH_SWEEPS else ""
        print(
            f"mok bench: unknown bench command {name!r}{where}; choose from {', '.join(BENCH_COMMANDS)}. "
            "The research sweeps live in the repository's benchmarks/ (benchmarks/README.md).",
            file=sys.stderr,
        )
        return 2
    module = __import__(BENCH_COMMANDS[name][0], fromlist=["main"])
    return module.main(rest[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "env": _env,
        "demo": lambda rest: __import__("mok_megatron.tools.demo", fromlist=["main"]).main(rest),
        "convert": _convert,
        "bench": _bench,
        "patches": lambda rest: __import__("mok_megatron.training.patches", fromlist=["main"]).main(rest),
        "recipe": lambda rest: __import__("mok_megatron.tools.recipe.check", fromlist=["main"]).main(rest),
        "plan": lambda rest: __import__("mok_megatron.tools.planner.main", fromlist=["main"]).main(rest),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: mok {env,demo,bench,convert,patches,recipe,plan} [options]\n\n"
            "  env      versions, GPUs, FP8 recipes available here, and what is missing\n"
            "  demo     pretrain a tiny MoE GPT with the MoK layer (the main job)\n"
            "  bench    layer: one MoE layer fwd+bwd, MoK vs Megatron, checked then timed;\n"
            "           train: Megatron's training loop, MoK vs Megatron from identical weights (tokens/s/GPU);\n"
            "           ep: real expert parallelism (torchrun --nproc-per-node N -m mok_megatron.bench.ep)\n"
            "  convert  move expert weights of a saved state dict between MoK / Megatron layouts\n"
            "  patches  check|apply|revert DIR: make a Megatron-LM checkout accept --moe-token-dispatcher-type mok\n"
            "  recipe   check SCRIPT...: a recipe's parallel layout and memory per GPU, from its DRY_RUN command\n"
            "  plan     --model M | --recipe R: MoK vs Megatron per layer/step, the flags to run; --validate, --compare"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
