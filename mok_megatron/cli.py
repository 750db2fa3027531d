"""The ``mok`` command line: ``mok env``, ``mok demo``, ``mok bench layer|overlap|ep|train|wgrad|gather``, ``mok convert``,
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


def _bench(rest) -> int:
    if rest[:1] == ["wgrad"]:
        from mok_megatron.bench.wgrad import main as wgrad

        return wgrad(rest)
    if rest[:1] == ["gather"]:
        from mok_megatron.bench.gather import main as gather

        return gather(rest)
    if rest[:1] == ["train"]:
        from mok_megatron.bench.train import main as train

        return train(rest[1:])
    module = "mok_megatron.bench.overlap" if rest[:1] in (["overlap"], ["ep"]) else "mok_megatron.bench.layer"
    return __import__(module, fromlist=["main"]).main(rest)


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
            "           overlap: communication hidden by the pipeline (one GPU, emulated link);\n"
            "           ep: real expert parallelism (torchrun -m mok_megatron.bench.overlap ep);\n"
            "           train: Megatron's training loop, MoK vs Megatron from identical weights (tokens/s/GPU);\n"
            "           wgrad: expert weight gradients over N calls, summed or accumulated in fp32;\n"
            "           gather: fc1 grouped GEMM reading token rows through an index vs the permuted copy\n"
            "  convert  move expert weights of a saved state dict between MoK / Megatron layouts\n"
            "  patches  check|apply|revert DIR: make a Megatron-LM checkout accept --moe-token-dispatcher-type mok\n"
            "  recipe   check SCRIPT...: a recipe's parallel layout and memory per GPU, from its DRY_RUN command\n"
            "  plan     --model M | --recipe R: MoK vs Megatron per layer/step, the flags to run; --validate, --compare"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
