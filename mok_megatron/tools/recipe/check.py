"""``mok recipe check <script> [...]``: run a recipe with ``DRY_RUN=1``, parse its launch command with
Megatron's real argument parser plus the MoK flags, check the parallel layout (``layout``), the MoK
layer's build-time rules that need only the command line (CUDA-graph scope, expert backend against
recompute and sync-free) and estimate memory per GPU (``memory``) against the recipe's ``GPU=``. Exit 1
on an impossible layout, a MoK layer that would refuse to build, or an estimate above the GPU's HBM;
the message names the problem and the fix."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from mok_megatron.tools.recipe.layout import Cluster, LayoutError, Parallel, parallel
from mok_megatron.tools.recipe.memory import GIB, HBM_BYTES, Estimate, estimate

ENTRY = "mok_megatron.pretrain_gpt"
CPU = "cpu"  # a recipe's GPU= on a machine without one (examples/tiny_moe.sh): gloo processes, no HBM limit


@contextlib.contextmanager
def quiet():
    """Megatron's import-time notes (missing TE / Apex / absl, torch's CUDA_HOME line): the check reads the
    command line only, so they say nothing about the recipe. Refusals still print (argparse, our lines)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


class RecipeError(ValueError):
    """The recipe does not run, print, or parse; the message says which and how to fix it."""


@dataclass(frozen=True)
class Recipe:
    path: Path
    cluster: Cluster
    argv: list[str]  # the arguments after ``-m mok_megatron.pretrain_gpt``


@dataclass(frozen=True)
class Report:
    recipe: Recipe
    parallel: Parallel | None
    estimates: list[Estimate]
    hbm: float | None
    problems: list[str]
    gpu: str = ""  # the GPU checked against: --gpu, else the recipe's GPU=

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> Estimate | None:
        return max(self.estimates, key=lambda e: e.total, default=None)


def dry_run(script: Path, env: dict | None = None) -> Recipe:
    """Run ``script`` with ``DRY_RUN=1`` and read its ``# layout:`` line and launch command."""
    if not Path(script).is_file():
        raise RecipeError(f"{script}: no such file (the recipes are examples/*.sh)")
    r = subprocess.run(
        ["bash", str(script)],
        env={**os.environ, **(env or {}), "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stdout.splitlines()
    said = r.stderr.strip().splitlines()
    if r.returncode and said:  # the recipe refused its settings itself (e.g. a bad ITERS): its own line
        raise RecipeError(f"{script}: DRY_RUN=1 exited {r.returncode}: {said[-1]}")
    if r.returncode or len(lines) < 2 or not lines[0].startswith("# layout: "):
        raise RecipeError(
            f"{script}: DRY_RUN=1 exited {r.returncode} without the '# layout:' line and the command "
            f"(recipes must source examples/lib/common.sh and call mok_launch). stderr: {r.stderr.strip()[-400:]}"
        )
    kv = dict(x.split("=", 1) for x in lines[0].removeprefix("# layout: ").split())
    cmd = shlex.split(lines[1])
    if cmd[0] != "torchrun" or ENTRY not in cmd or cmd[cmd.index("--nnodes") + 1] != kv["nodes"]:
        raise RecipeError(
            f"{script}: the printed command is not 'torchrun ... -m {ENTRY}' for {kv['nodes']} nodes"
        )
    cluster = Cluster(
        int(kv["nodes"]), int(kv["gpus_per_node"]), int(kv["nvlink_domain_gpus"]), kv.get("gpu", "")
    )
    return Recipe(Path(script), cluster, cmd[cmd.index(ENTRY) + 1 :])


@functools.cache
def parser() -> argparse.ArgumentParser:
    """Megatron's full training parser with the MoK flags and their validation."""
    from megatron.training.arguments import add_megatron_arguments

    from mok_megatron.training.arguments import extra_args_provider

    return extra_args_provider(
        add_megatron_arguments(argparse.ArgumentParser(prog=ENTRY, allow_abbrev=False))
    )


def parse(recipe: Recipe) -> argparse.Namespace:
    try:
        return parser().parse_args(recipe.argv)
    except SystemExit as e:  # argparse already printed "<prog>: error: <why>"
        raise RecipeError(
            f"{recipe.path}: Megatron's parser refused the command (exit {e.code}); see above"
        ) from None


def mok_layer_problems(args) -> list[str]:
    """The MoK layer's build-time refusals that the command line alone decides (the layer raises the same
    messages when it is built): CUDA-graph scope vs a host-free dispatch plan and the capacity multiplier
    (``adapter.cuda_graphs``), the expert backend vs moe_act recompute and sync-free (``experts.backend``)."""
    if not getattr(args, "mok", False):
        return []
    from types import SimpleNamespace

    from mok_megatron.adapter.cuda_graphs import check_cuda_graphs
    from mok_megatron.errors import MoKConfigError
    from mok_megatron.engine.select import pipeline_blockers
    from mok_megatron.experts.backend import check_expert_backend
    from mok_megatron.options import Engine, ExpertBackend
    from mok_megatron.training.arguments import options_from_args

    options = options_from_args(args)
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    blockers = pipeline_blockers(
        args.moe_expert_capacity_factor, args.moe_router_padding_for_quantization, etp
    )
    megatron_overlap = (
        args.overlap_moe_expert_parallel_comm or args.overlap_dispatch_backward_with_experts_wgrad
    )
    pipelined = (
        args.expert_model_parallel_size > 1
        and options.engine is not Engine.PLAIN
        and not blockers
        and not megatron_overlap
    )
    recompute_act = args.recompute_granularity == "selective" and "moe_act" in (args.recompute_modules or [])
    graph_config = SimpleNamespace(
        cuda_graph_impl=args.cuda_graph_impl, cuda_graph_modules=args.cuda_graph_modules
    )
    cfg = SimpleNamespace(pad_to_capacity=bool(args.moe_pad_expert_input_to_capacity))
    problems = []
    try:
        check_cuda_graphs(graph_config, cfg, options, pipelined, mok_experts=True)
    except MoKConfigError as e:
        problems.append(f"MoK layer: {e}")
    backend = ExpertBackend(options.expert_backend)
    # the backend rules that need no GPU: recompute (any non-torch backend), sync-free (te)
    if backend is not ExpertBackend.TORCH and (recompute_act or backend is ExpertBackend.TE):
        try:
            check_expert_backend(
                backend,
                args,
                "cuda",
                have_te=True,
                sync_free=options.sync_free,
                recompute_activation=recompute_act,
            )
        except MoKConfigError as e:
            problems.append(f"MoK layer: {e}")
    return problems


def check(recipe: Recipe, gpu: str | None = None) -> Report:
    with quiet():
        args = parse(recipe)
        problems = mok_layer_problems(args)
    gpu = gpu or recipe.cluster.gpu
    hbm = HBM_BYTES.get(gpu)
    if hbm is None and gpu != CPU:
        problems.append(
            f"GPU '{gpu}' is unknown: set GPU= in the recipe or pass --gpu one of {sorted(HBM_BYTES)}."
        )
    try:
        p = parallel(args, recipe.cluster)
    except LayoutError as e:
        return Report(recipe, None, [], hbm, [*problems, f"layout: {e}"], gpu)
    ests = estimate(args, p)
    peak = max(ests, key=lambda e: e.total)
    if hbm is not None and peak.total > hbm:
        problems.append(
            f"memory: pipeline rank {peak.pp_rank} needs ~{peak.total / GIB:.0f} GiB, above the {gpu}'s "
            f"{hbm / GIB:.0f} GiB. Fix: add recompute (--recompute-modules layernorm mla_up_proj moe_act, or "
            "--recompute-granularity full), raise EP/PP/TP, use --use-distributed-optimizer, or lower "
            "--micro-batch-size."
        )
    return Report(recipe, p, ests, hbm, problems, gpu)


def format_report(r: Report) -> str:
    c, p = r.recipe.cluster, r.parallel
    gpu = r.gpu or c.gpu
    cpu = gpu == CPU
    nodes = f"{c.nodes} node{'s' if c.nodes != 1 else ''}"
    if cpu:
        lines = [f"{r.recipe.path.name}: {nodes} x {c.gpus_per_node} CPU process(es) (gloo), no GPU"]
    else:
        lines = [f"{r.recipe.path.name}: {nodes} x {c.gpus_per_node} {gpu or '?'} GPUs"]
    if p is not None:
        domain = "" if cpu else f"  NVLink domain {c.nvlink_domain_gpus} GPUs"
        lines.append(
            f"  TP {p.tp}  PP {p.pp}  VPP {p.vpp}  CP {p.cp}  DP {p.dp}  EP {p.ep}  ETP {p.etp}  EDP {p.edp}  "
            f"micro-batches/step {p.microbatches}{domain}"
        )
        hdr = f"  {'pp rank':>7} {'params B':>9} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'other':>8} {'total':>8}"
        lines += [hdr + f"   GiB, vs {r.hbm / GIB:.0f} GiB HBM" if r.hbm else hdr + "   GiB"]
        shown = r.estimates if len(r.estimates) <= 4 else [r.estimates[0], r.peak, r.estimates[-1]]
        for e in dict.fromkeys(shown):
            lines.append(
                f"  {e.pp_rank:>7} {e.params / 1e9:>9.2f} "
                + " ".join(
                    f"{b / GIB:>8.1f}"
                    for b in (e.weights, e.grads, e.optimizer, e.activations, e.overhead, e.total)
                )
                + ("   <- peak" if e is r.peak and len(r.estimates) > 1 else "")
            )
    lines += [f"  FAIL {m}" for m in r.problems] or ["  OK"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mok recipe",
        description="check: run recipes with DRY_RUN=1, parse their command with Megatron's parser, check "
        "the TP/PP/VPP/CP/DP/EP/ETP layout and estimate memory per GPU. Exit 1 on any problem.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check one or more recipe scripts")
    c.add_argument("scripts", nargs="+", type=Path)
    c.add_argument(
        "--gpu", choices=sorted(HBM_BYTES), help="check against this GPU (default: the recipe's GPU=)"
    )
    ns = ap.parse_args(argv)
    failed = 0
    for script in ns.scripts:
        try:
            r = check(dry_run(script), ns.gpu)
        except RecipeError as e:
            print(f"{script}: FAIL {e}", file=sys.stderr)
            failed += 1
            continue
        print(format_report(r))
        failed += not r.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
