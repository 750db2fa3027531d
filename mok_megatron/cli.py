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
    from mok_megatron.tools.convert import main as convert

    return convert(argv)


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
    if argv and argv[0] not in commands and argv[0] not in ("-h", "--help"):
        import difflib

        close = difflib.get_close_matches(argv[0], list(commands), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(
            f"mok: unknown command '{argv[0]}'{hint}; choose from {', '.join(commands)} (mok --help says what "
            "each does).",
            file=sys.stderr,
        )
        return 2
    if not argv or argv[0] in ("-h", "--help"):
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
