"""``mok bench train``: tokens per second per GPU in Megatron's own training loop, MoK's MoE layer against
Megatron's, on the same model, data, seed and initial weights, in one command.

    mok bench train --preset qwen3-30b-a3b [--iters 12] [--nproc-per-node N] [--runs auto|mok,alltoall,...]
                    [--profile-step N] [--json F] [--png F] [-- <any Megatron / --mok-* flag>]

Steps (each a ``torchrun --standalone`` of this package's entry points, so N processes on one host work the
same way as one):

1. ``init``: ``-m mok_megatron.training.initial_checkpoint`` builds the model with Megatron's layer (the
   ``alltoall`` run's flags) and saves its weights and RNG states as built, iteration 0, torch_dist.
2. one run per layer: ``-m mok_megatron.pretrain_gpt ... --load INIT --no-load-optim``. MoK's experts write
   exactly the ShardedTensors of Megatron's ``SequentialMLP`` / ``TEGroupedMLP``, so the one checkpoint
   loads into every layer: identical weights, identical RNG (dropout) states, identical mock data.
   Runs: ``mok`` (``--moe-token-dispatcher-type mok``), ``alltoall`` (Megatron's layer; with Transformer
   Engine ``--moe-grouped-gemm --moe-permute-fusion``, without it Megatron-Core's local ``SequentialMLP``:
   the local spec has no grouped GEMM), ``flex`` (DeepEP, when importable and TP x EP > 1; automatic),
   ``alltoall-overlap`` (``--overlap-moe-expert-parallel-comm``, EP > 1; on request), ``mok-overlap`` (MoK's
   layer under the same flag: Megatron's combined 1F1B schedule drives its plain engine), ``alltoall-unfused``
   (TE's grouped GEMM with torch's permute: the same math as ``alltoall`` rounded in another order; on
   request, it measures how far two Megatron layers drift apart). With ``--fp8-format``
   Megatron's runs also get ``--moe-router-padding-for-quantization`` (MoK's experts pad their own rows).
   An FP8 comparison (``--fp8-format`` passed through) also takes ``mok-torch-fp8`` and ``mok-te`` (MoK with
   ``--mok-expert-backend torch-fp8`` / ``te``: both FP8 expert backends in one command) and the bf16 runs
   ``mok-bf16`` (MoK with the bf16 ``torch`` experts) and ``alltoall-bf16``, which drop every FP8 flag and
   load the same initial weights, so each FP8 step reads against its own layer's bf16 step.
3. every log line is parsed as it arrives (a progress bar per run); then per run: tokens/s/GPU, Megatron's
   TFLOP/s/GPU, step time min/median/max after warm-up, peak memory, final and mean loss, MoK's speed-up over
   the first Megatron run of the same precision and an FP8 run's median step over its layer's bf16 run's;
   MoK's speed-up over each Megatron run of the same precision; the loss agreement of MoK with the first
   Megatron run of the same precision (limits: step 1 within 1e-3 relative, every step within 2 %, their
   mean within 0.5 %), and of every other Megatron run with that one (Megatron against itself: the floor
   any second implementation meets, reported, not a MoK check).

Both MoK FP8 backends against Megatron's FP8 run, with MoK's bf16 step beside them (one H200 each; add
``alltoall-bf16`` for Megatron's own bf16 step)::

    mok bench train --preset qwen3-30b-a3b --runs mok-torch-fp8,mok-te,mok-bf16,alltoall --json q.json \\
        -- --fp8-format e4m3 --fp8-recipe blockwise
    mok bench train --preset deepseek-v3 --runs mok-torch-fp8,mok-te,mok-bf16,alltoall --json d.json \\
        -- --fp8-format e4m3 --fp8-recipe blockwise

``--profile-step N``: every run traces iteration N under Megatron's PyTorch profiler (``--profile
--use-pytorch-profiler --profile-step-start N --profile-step-end N+1 --profile-ranks 0``, each run its own
``--tensorboard-dir``); after the runs, each trace's GPU kernel time by category (GEMM, FP8 quantization,
MoE routing/permute, attention, optimizer, communication, other) and its top kernels are printed and written
to the JSON (``mok_megatron.bench.train_profile``). Iterations N-1..N+1 leave the step-time statistics.

Flags after ``--`` or not known here go to every run; ``--mok-*`` flags go to the MoK runs only (a run named
for its expert backend refuses a passed ``--mok-expert-backend``). The bench sets
``--train-iters``, ``--log-interval``, ``--load`` and the dispatcher itself and refuses them as pass-through.
Without a GPU the run is Megatron's CPU mode (gloo, fp32; the ``tiny`` preset). Exit status: 0, 1 (a run
failed), 2 (bad input: one line, before anything starts), 3 (losses disagree beyond the limits).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from mok_megatron.bench.train_presets import BF16_RUNS, FP8_BACKEND_RUNS, MOK_RUNS, PRESETS, RUN_NAMES
from mok_megatron.bench.train_profile import (
    PROFILER_FLAGS,
    megatron_profile_flags,
    trace_path,
    untimed_iterations,
    valid_profile_steps,
)
from mok_megatron.training.cpu_training import CPU_FLAGS

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Flags the bench sets on every run itself.
OWNED = {
    "--train-iters": "set the number of steps with --iters",
    "--log-interval": "the bench reads every iteration's log line (--log-interval 1)",
    "--load": "the runs load the bench's initial checkpoint",
    "--save": "the runs save nothing (the initial checkpoint is the bench's)",
    "--finetune": "the runs load the initial checkpoint as iteration 0 already",
    "--pretrained-checkpoint": "the runs load the bench's initial checkpoint",
    "--moe-token-dispatcher-type": "choose the layers with --runs",
}


class BenchTrainError(ValueError):
    """Bad input; the message is one line naming the value and the fix."""


@dataclass(frozen=True)
class Machine:
    """What decides the flags: a GPU per process (else CPU mode), Transformer Engine, DeepEP."""

    cuda: bool
    gpus: int
    te: bool
    deepep: bool
    name: str = ""

    @staticmethod
    def detect() -> Machine:
        """Without creating a CUDA context here: the runs may need all of a GPU's memory (and an
        exclusive-process GPU takes one process only). Transformer Engine and DeepEP count as present when
        installed (Megatron-Core imports them in the runs)."""
        import importlib.util

        import torch

        from mok_megatron.compat import te_version

        cuda = torch.cuda.is_available()  # the driver's device count; no context
        te = cuda and te_version() is not None and importlib.util.find_spec("transformer_engine") is not None
        deepep = cuda and importlib.util.find_spec("deep_ep") is not None
        return Machine(
            cuda, torch.cuda.device_count() if cuda else 0, te, deepep, _gpu_name() if cuda else "cpu"
        )


def _gpu_name() -> str:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "cuda"
    return r.stdout.strip() or "cuda"


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    module: str
    argv: tuple[str, ...]
    trace: str | None = None  # with --profile-step: where Megatron writes rank 0's trace
    fp8: bool = False  # trains with the pass-through --fp8-format (a bf16 run of an FP8 comparison: False)


def _tensorboard_dir(run: Run) -> str | None:
    return run.argv[run.argv.index("--tensorboard-dir") + 1] if run.trace else None


@dataclass(frozen=True)
class Plan:
    preset: str
    nproc: int
    iters: int
    warmup: int
    ep: int
    init: Run
    runs: tuple[Run, ...]
    profile_step: int | None = None  # the iteration every run traces (--profile-step)

    @property
    def untimed(self) -> tuple[int, ...]:
        """Iterations left out of the step-time statistics (the profiler's)."""
        return untimed_iterations(self.profile_step)

    @property
    def init_dir(self) -> str:
        return self.init.argv[self.init.argv.index("--save") + 1]

    def command(self, torchrun: str, run: Run) -> list[str]:
        return [torchrun, "--standalone", f"--nproc-per-node={self.nproc}", "-m", run.module, *run.argv]


# ---- flags ----------------------------------------------------------------------------------------


def split_mok_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """(flags for every run, ``--mok-*`` flags with their values, for the MoK run only)."""
    common, mok, target = [], [], None
    for tok in flags:
        if tok.startswith("--"):
            target = mok if tok.startswith("--mok-") else common
        (target if target is not None else common).append(tok)
    return common, mok


# Pass-through flags a bf16 run of an FP8 comparison drops (with their values): Megatron's FP8 settings and
# bf16-layer exceptions, its router padding for quantized experts, MoK's FP8 exchange and its expert backend
# (the bf16 run sets --mok-expert-backend torch itself).
_FP8_ONLY = re.compile(
    r"--(no-|disable-)?fp8-.*|--first-last-layers-bf16|--num-layers-at-(start|end)-in-bf16"
    r"|--keep-fp8-transpose-cache|--reuse-grad-buf-for-mxfp8-param-ag|--moe-router-padding-for-(quantization|fp8)"
    r"|--mok-fp8-.*|--mok-expert-backend"
)


def drop_fp8_flags(flags: list[str]) -> list[str]:
    """``flags`` without the FP8 ones (``_FP8_ONLY``) and their values: the same run in bf16."""
    out, dropping = [], False
    for tok in flags:
        if tok.startswith("--"):
            dropping = _FP8_ONLY.fullmatch(tok.split("=", 1)[0]) is not None
        if not dropping:
            out.append(tok)
    return out


def drop_te_flags(flags: list[str]) -> list[str]:
    """``flags`` without the te backend's own ``--mok-te-*`` flags (for runs that set another backend)."""
    out, dropping = [], False
    for tok in flags:
        if tok.startswith("--"):
            dropping = tok.split("=", 1)[0].startswith("--mok-te-")
        if not dropping:
            out.append(tok)
    return out


def _last(flags: list[str], name: str, cast=int, default=None):
    """The value of the last ``name VALUE`` / ``name=VALUE`` in ``flags`` (argparse keeps the last one)."""
    value = default
    for i, tok in enumerate(flags):
        if tok == name and i + 1 < len(flags):
            value = cast(flags[i + 1])
        elif tok.startswith(name + "="):
            value = cast(tok.split("=", 1)[1])
    return value


def _sizes(flags: list[str], world: int) -> dict:
    s = {k: _last(flags, f"--{k}-model-parallel-size", default=1) for k in ("tensor", "pipeline")}
    s["context"] = _last(flags, "--context-parallel-size", default=1)
    split = s["tensor"] * s["pipeline"] * s["context"]
    if world % split:
        raise BenchTrainError(
            f"{world} process(es) do not split into TP {s['tensor']} x PP {s['pipeline']} x CP {s['context']} "
            f"= {split}: choose --nproc-per-node as a multiple of {split}, or smaller parallel sizes."
        )
    s["data"] = world // split
    experts = _last(flags, "--num-experts")
    ep = _last(flags, "--expert-model-parallel-size")
    if ep is None:  # every process an EP rank, experts permitting
        ep = math.gcd(experts or 1, world // (s["tensor"] * s["pipeline"]))
    s["expert"] = ep
    s["micro_batch"] = _last(flags, "--micro-batch-size", default=1)
    return s


def megatron_flags(name: str, machine: Machine, sizes: dict, fp8: bool) -> tuple[str, list[str]]:
    """(label, flags) of one of Megatron's layers."""
    disp = "flex" if name == "flex" else "alltoall"
    flags = ["--moe-token-dispatcher-type", disp]
    label = f"Megatron {disp}"
    if name == "flex":
        flags += ["--moe-flex-dispatcher-backend", "deepep"]
        label += " (DeepEP)"
    if machine.te and name == "alltoall-unfused":
        flags += ["--moe-grouped-gemm"]
        label += " + TE grouped GEMM"
    elif machine.te:
        flags += ["--moe-grouped-gemm", "--moe-permute-fusion"]
        label += " + TE grouped GEMM + permute fusion"
    else:
        label += " + local SequentialMLP"
    if name == "alltoall-overlap":
        flags += ["--overlap-moe-expert-parallel-comm"]
        label += " + EP comm overlap"
    if fp8:
        flags += ["--moe-router-padding-for-quantization"]
    return label, flags


def run_flags(
    name: str, machine: Machine, sizes: dict, fp8: bool, mok_only: list[str]
) -> tuple[str, list[str]]:
    """(label, flags) of one run's layer: MoK's (``mok_only``: its --mok-* pass-through flags) or Megatron's."""
    mok = ["--moe-token-dispatcher-type", "mok"]
    if name == "mok":
        return "MoK", mok + mok_only
    if name == "mok-overlap":
        return "MoK + EP comm overlap", mok + ["--overlap-moe-expert-parallel-comm"] + mok_only
    if name in FP8_BACKEND_RUNS:
        backend = FP8_BACKEND_RUNS[name]
        what = "TE GroupedLinear" if backend == "te" else "MoK's FP8 grouped GEMM"
        own = mok_only if backend == "te" else drop_te_flags(mok_only)
        return f"MoK, {backend} experts ({what}), FP8", mok + own + ["--mok-expert-backend", backend]
    if name == "mok-bf16":
        own = drop_te_flags(drop_fp8_flags(mok_only))
        return "MoK, torch experts, bf16", mok + own + ["--mok-expert-backend", "torch"]
    if name in BF16_RUNS:
        label, flags = megatron_flags(BF16_RUNS[name], machine, sizes, fp8=False)
        return f"{label}, bf16", flags
    return megatron_flags(name, machine, sizes, fp8)


def _check_runs(names: list[str], machine: Machine, sizes: dict, fp8: bool, mok_only: list[str]) -> None:
    bad = [n for n in names if n not in RUN_NAMES]
    if bad:
        raise BenchTrainError(f"--runs {','.join(bad)}: unknown; choose from {', '.join(RUN_NAMES)} or auto.")
    _check_fp8_runs(names, machine, fp8, mok_only)
    if "flex" in names:
        if not machine.deepep:
            raise BenchTrainError(
                "--runs flex: DeepEP (deep_ep) is not importable here; install it or drop flex."
            )
        if sizes["tensor"] * sizes["expert"] < 2:
            raise BenchTrainError(
                "--runs flex: Megatron's flex dispatcher needs TP x EP > 1; run on more processes "
                "(--nproc-per-node) or drop flex."
            )
    for name in ("alltoall-overlap", "mok-overlap"):
        if name in names and sizes["expert"] < 2:
            raise BenchTrainError(
                f"--runs {name}: --overlap-moe-expert-parallel-comm needs expert parallelism (EP > 1); "
                f"run on more processes (--nproc-per-node) or drop {name}."
            )
        if name in names and not machine.cuda:
            raise BenchTrainError(f"--runs {name}: needs bf16 on GPUs; this machine runs in CPU mode.")
    if all(n in MOK_RUNS for n in names):
        raise BenchTrainError(f"--runs {','.join(names)}: no Megatron run to compare with; add alltoall.")
    if fp8 and all(n in MOK_RUNS or n in BF16_RUNS for n in names):
        raise BenchTrainError(
            f"--runs {','.join(names)}: no Megatron FP8 run to compare the FP8 runs with; add alltoall."
        )
    if "alltoall-unfused" in names and not machine.te:
        raise BenchTrainError(
            "--runs alltoall-unfused: TE's grouped GEMM without --moe-permute-fusion needs Transformer "
            "Engine, which is not importable here; install it or drop alltoall-unfused."
        )
    if len(set(names)) != len(names):
        raise BenchTrainError(f"--runs {','.join(names)}: a run is listed twice.")


def _check_fp8_runs(names: list[str], machine: Machine, fp8: bool, mok_only: list[str]) -> None:
    """The runs of an FP8 comparison: MoK's FP8 expert backends by name, and the bf16 runs."""
    named = [n for n in names if n in FP8_BACKEND_RUNS or n in BF16_RUNS]
    if not named:
        return
    fp8_example = "-- --fp8-format e4m3 --fp8-recipe blockwise"
    if not machine.cuda:
        raise BenchTrainError(
            f"--runs {','.join(named)}: FP8 comparisons run on GPUs; this machine runs in CPU mode (use "
            "--runs mok,alltoall here)."
        )
    for name in named:
        if not fp8 and name in FP8_BACKEND_RUNS:
            raise BenchTrainError(
                f"--runs {name}: runs MoK's {FP8_BACKEND_RUNS[name]} experts in FP8 and needs --fp8-format; "
                f"add {fp8_example}, or use mok for the bf16 layer."
            )
        if not fp8:
            raise BenchTrainError(
                f"--runs {name}: the bf16 run of an FP8 comparison drops the FP8 flags, and none is given; add "
                f"{fp8_example}, or use {BF16_RUNS[name]}."
            )
    if "mok-te" in names and not machine.te:
        raise BenchTrainError(
            "--runs mok-te: MoK's te expert backend runs Transformer Engine's GroupedLinear, which is not "
            "importable here; install it (pip install 'mok-megatron[te]') or drop mok-te."
        )
    backend = _last(mok_only, "--mok-expert-backend", cast=str)
    owners = [n for n in names if n in FP8_BACKEND_RUNS or n == "mok-bf16"]
    if backend is not None and owners:
        raise BenchTrainError(
            f"--mok-expert-backend {backend}: --runs {','.join(owners)} "
            f"{'sets its' if len(owners) == 1 else 'set their'} own expert backend; drop the flag (the mok "
            f"run takes it: --runs mok,... with --mok-expert-backend {backend})."
        )


def make_plan(
    preset_name: str,
    runs: str,
    iters: int,
    warmup: int,
    nproc: int,
    forwarded: list[str],
    machine: Machine,
    init_dir: str,
    grad_accum_fusion: bool = False,
    profile_step: int | None = None,
) -> Plan:
    """Every command line of one comparison; raises ``BenchTrainError`` on bad input. ``grad_accum_fusion``:
    drop the presets' ``--no-gradient-accumulation-fusion`` (Megatron's default back on, for both layers).
    ``profile_step``: every run traces that iteration under Megatron's PyTorch profiler
    (``mok_megatron.bench.train_profile``), its trace beside ``init_dir``."""
    if preset_name not in PRESETS:
        raise BenchTrainError(f"--preset {preset_name}: unknown; choose from {', '.join(PRESETS)}.")
    preset = PRESETS[preset_name]
    if preset.needs_gpu and not machine.cuda:
        raise BenchTrainError(
            f"--preset {preset_name} needs CUDA GPUs and none is visible here; on a CPU use --preset tiny."
        )
    if nproc < 1:
        raise BenchTrainError(f"--nproc-per-node {nproc}: must be at least 1.")
    if machine.cuda and nproc > machine.gpus:
        raise BenchTrainError(f"--nproc-per-node {nproc}: this machine has {machine.gpus} GPU(s).")
    if iters < 1 or warmup < 0 or warmup >= iters:
        raise BenchTrainError(
            f"--iters {iters} --warmup {warmup}: need iters >= 1 and 0 <= warmup < iters (steps after the "
            "warm-up are the timed ones)."
        )
    if profile_step is not None and profile_step not in valid_profile_steps(iters, warmup):
        valid = valid_profile_steps(iters, warmup)
        fix = f"choose N in {valid[0]}..{valid[-1]}" if valid else f"raise --iters to {warmup + 3} or more"
        raise BenchTrainError(
            f"--profile-step {profile_step}: needs --warmup {warmup} < N < --iters {iters} and a timed step "
            f"outside N-1..N+1 (the profiler's warm-up, trace and export steps leave the timing); {fix}."
        )
    for tok in forwarded:
        name = tok.split("=", 1)[0]
        if name in OWNED:
            raise BenchTrainError(f"{name}: the bench sets it itself ({OWNED[name]}).")
        if profile_step is not None and name in PROFILER_FLAGS:
            raise BenchTrainError(
                f"{name}: --profile-step sets Megatron's profiler flags per run "
                f"({' '.join(PROFILER_FLAGS)}); drop it or drop --profile-step."
            )
    common, mok_only = split_mok_flags(forwarded)
    base = list(preset.flags)
    if machine.cuda:
        base += list(preset.gpu_flags)
        if not machine.te:
            base += ["--transformer-impl", "local"]
    else:
        base += list(CPU_FLAGS)
    if grad_accum_fusion:
        if not (machine.cuda and machine.te):
            raise BenchTrainError(
                "--gradient-accumulation-fusion: Megatron fuses the weight-gradient accumulation in Transformer "
                "Engine's linears on a GPU (its local linears need apex); this machine has "
                f"{'no GPU' if not machine.cuda else 'no Transformer Engine'}. Drop the flag."
            )
        base = [t for t in base if t != "--no-gradient-accumulation-fusion"]
    merged = base + common
    sizes = _sizes(merged, nproc)
    names = ["mok", "alltoall"] if runs == "auto" else [n.strip() for n in runs.split(",") if n.strip()]
    if runs == "auto" and machine.deepep and sizes["tensor"] * sizes["expert"] > 1:
        names.append("flex")
    fp8 = any(t.split("=", 1)[0] == "--fp8-format" for t in merged)
    _check_runs(names, machine, sizes, fp8, mok_only)
    gbs = (
        []
        if "--global-batch-size" in merged
        else ["--global-batch-size", str(sizes["micro_batch"] * sizes["data"])]
    )
    ep = (
        []
        if "--expert-model-parallel-size" in merged
        else ["--expert-model-parallel-size", str(sizes["expert"])]
    )
    shared = base + gbs + ep + common
    loop = ["--train-iters", str(iters), "--log-interval", "1", "--eval-interval", str(iters)]
    loop += ["--log-memory-interval", str(iters)] + (
        [] if "--log-throughput" in shared else ["--log-throughput"]
    )
    load = ["--load", init_dir, "--no-load-optim", "--exit-on-missing-checkpoint"]
    _, init_flags = megatron_flags("alltoall", machine, sizes, fp8)
    init = Run(
        "init",
        "initial weights (Megatron's layer, as built)",
        "mok_megatron.training.initial_checkpoint",
        tuple(
            shared
            + init_flags
            + loop
            + ["--save", init_dir, "--save-interval", "1", "--no-save-optim", "--skip-train"]
        ),
    )
    out = []
    for name in names:
        label, flags = run_flags(name, machine, sizes, fp8, mok_only)
        trace, profile = None, []
        if profile_step is not None:
            tensorboard = os.path.join(os.path.dirname(init_dir), "profile", name, "tensorboard")
            trace, profile = trace_path(tensorboard), megatron_profile_flags(profile_step, tensorboard)
        run_fp8 = fp8 and name not in BF16_RUNS
        argv = tuple(
            (shared if run_fp8 or not fp8 else drop_fp8_flags(shared)) + flags + loop + load + profile
        )
        out.append(Run(name, label, "mok_megatron.pretrain_gpt", argv, trace, run_fp8))
    return Plan(preset_name, nproc, iters, warmup, sizes["expert"], init, tuple(out), profile_step)


def find_torchrun(explicit: str | None) -> str:
    if explicit:
        if shutil.which(explicit):
            return shutil.which(explicit)
        raise BenchTrainError(f"--torchrun {explicit}: no such executable.")
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchrun")
    if not found:
        raise BenchTrainError(
            f"torchrun not found beside {sys.executable} nor on PATH; it ships with PyTorch (pip install torch), "
            "or pass --torchrun PATH."
        )
    return found


def preflight(plan: Plan) -> None:
    """Every run's flags through Megatron's parser (with the --mok-* flags) before anything starts, in a
    child process that sees no GPU (Megatron's imports would otherwise hold a CUDA context here)."""
    import json

    argvs = {run.name: list(run.argv) for run in (plan.init, *plan.runs)}
    env = dict(run_env(), CUDA_VISIBLE_DEVICES="")
    code = "import sys; from mok_megatron.bench.train import _parse_flags; sys.exit(_parse_flags())"
    r = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(argvs), capture_output=True, text=True, env=env
    )
    if r.returncode != 0:
        lines = [ln for ln in r.stdout.splitlines() if ln.strip()] or r.stderr.strip().splitlines()[-1:]
        raise BenchTrainError(lines[-1] if lines else f"Megatron's parser exited {r.returncode}")


def _parse_flags() -> int:
    """``preflight``'s child: {run: argv} as JSON on stdin; prints the first refusal as one line."""
    import contextlib
    import io
    import json
    import logging
    import warnings

    warnings.simplefilter("ignore")
    # Importing Megatron's arguments loads torch.utils.cpp_extension, which warns about CUDA_HOME.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from megatron.training.arguments import add_megatron_arguments

    from mok_megatron.training.arguments import extra_args_provider

    parser = extra_args_provider(
        add_megatron_arguments(argparse.ArgumentParser(prog="megatron", allow_abbrev=False))
    )
    for name, argv in json.load(sys.stdin).items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(argv)
        except SystemExit:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            reason = lines[-1].split("error: ", 1)[-1] if lines else "refused"
            print(
                f"the {name} run's flags are refused by their argument parser (Megatron's and MoK's): {reason}"
            )
            return 1
    return 0


# ---- running --------------------------------------------------------------------------------------


class Progress:
    """One bar per run on a terminal (redrawn per iteration), else a line per iteration for runs of up to
    ``EVERY_STEP`` iterations and a line per tenth of longer runs (first and last iteration included)."""

    WIDTH = 24
    EVERY_STEP = 20

    def __init__(self, name: str, total: int, stream=None):
        self.name, self.total = name, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = -1
        self.t0 = time.monotonic()

    def start(self, what: str) -> None:
        print(f"[{self.name}] {what}", file=self.stream, flush=True)

    def step(self, step) -> None:
        done = min(step.iteration, self.total)
        fill = round(self.WIDTH * done / self.total)
        loss = f"  loss {step.loss:.4f}" if step.loss is not None else ""
        text = f"[{self.name}] |{'#' * fill}{'.' * (self.WIDTH - fill)}| {done}/{self.total}  {step.ms:.1f} ms{loss}"
        if self.tty:
            print("\r" + text, end="", file=self.stream, flush=True)
        elif self.total <= self.EVERY_STEP or done * 10 // self.total > self.shown or done == self.total:
            self.shown = done * 10 // self.total
            print(text, file=self.stream, flush=True)

    def end(self, rc: int) -> None:
        if self.tty:
            print(file=self.stream)
        state = "done" if rc == 0 else f"FAILED (exit {rc})"
        print(f"[{self.name}] {state} in {time.monotonic() - self.t0:.0f} s", file=self.stream, flush=True)


def run_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def launch(cmd: list[str], log_path: str, progress: Progress, verbose: bool, timeout_s: float | None):
    """Run ``cmd``, teeing its output to ``log_path``; returns (exit status, TrainLog, last lines)."""
    import queue
    import threading
    from collections import deque

    from mok_megatron.bench.train_log import TrainLog

    log, tail, lines = TrainLog(), deque(maxlen=200), queue.Queue()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=run_env(),
            start_new_session=True,  # its own process group: stopped as one on a timeout or Ctrl-C
        )

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    _stop(proc)
                    tail.append(f"TimeoutError: the run took longer than --timeout-s {timeout_s:g}\n")
                    break
                if line is None:
                    break
                f.write(line)
                tail.append(line)
                if verbose:
                    sys.stdout.write(line)
                step = log.feed(line)
                if step is not None:
                    progress.step(step)
            rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    return rc, log, list(tail)


def _stop(proc) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---- main -----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--preset", default="qwen3-30b-a3b", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--iters", type=int, default=12, help="training steps per run (Megatron's --train-iters)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing statistics")
    p.add_argument(
        "--runs",
        default="auto",
        help=f"comma list of {', '.join(RUN_NAMES)}; auto: mok,alltoall (+flex with DeepEP); "
        "mok-torch-fp8, mok-te, mok-bf16 and alltoall-bf16 need --fp8-format",
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes (GPUs) on this host, via torchrun"
    )
    p.add_argument("--json", default=None, help="write every number and curve to this JSON file")
    p.add_argument(
        "--png", default=None, help="write loss curves and throughput bars to this PNG (matplotlib)"
    )
    p.add_argument(
        "--workdir", default=None, help="initial checkpoint and logs (default: a new temporary directory)"
    )
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the initial checkpoint afterwards")
    p.add_argument(
        "--torchrun", default=None, help="the torchrun executable (default: beside python, or on PATH)"
    )
    p.add_argument("--timeout-s", type=float, default=None, help="stop a run that takes longer (seconds)")
    p.add_argument(
        "--gradient-accumulation-fusion",
        action="store_true",
        help="drop the presets' --no-gradient-accumulation-fusion: Megatron's default, weight gradients added "
        "straight into main_grad (TE's linears; MoK's experts where QuACK is installed); GPU with TE",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        metavar="N",
        help="trace iteration N of every run under Megatron's PyTorch profiler (rank 0) and print its GPU "
        "kernel time by category and the top kernels; warmup < N < iters",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command lines and stop")
    p.add_argument("--verbose", action="store_true", help="stream Megatron's logs too")
    return p


def _fail(msg: str) -> int:
    print(f"mok bench train: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    original = list(argv)
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    else:
        passthrough = []
    ns, unknown = parser().parse_known_args(argv)
    forwarded = unknown + passthrough
    ns.original_argv = original
    try:
        torchrun = find_torchrun(ns.torchrun)
        machine = Machine.detect()
        workdir = os.path.abspath(ns.workdir) if ns.workdir else None

        def plan_in(d: str) -> Plan:
            init_dir = os.path.join(d, "initial-checkpoint")
            return make_plan(
                ns.preset,
                ns.runs,
                ns.iters,
                ns.warmup,
                ns.nproc_per_node,
                forwarded,
                machine,
                init_dir,
                ns.gradient_accumulation_fusion,
                ns.profile_step,
            )

        plan = plan_in(workdir or "WORKDIR")
        if ns.dry_run:
            for run in (plan.init, *plan.runs):
                print(f"# {run.name}: {run.label}")
                print(shlex.join(plan.command(torchrun, run)))
            return 0
        for path, flag in ((ns.json, "--json"), (ns.png, "--png")):
            if path:
                _check_writable(path, flag)
        preflight(plan)
    except BenchTrainError as e:
        return _fail(str(e))
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    else:
        workdir = tempfile.mkdtemp(prefix="mok-bench-train-")
        plan = plan_in(workdir)
    from mok_megatron.bench.train_report import report

    return report(plan, execute(plan, torchrun, workdir, ns), machine, ns, workdir)


def _check_writable(path: str, flag: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise BenchTrainError(f"{flag} {path}: directory {d} does not exist or is not writable.")


def execute(plan: Plan, torchrun: str, workdir: str, ns) -> dict:
    """The initial checkpoint, then every run; returns {name: {"rc", "log", "tail", "seconds", "command"}}."""
    results = {}
    print(
        f"mok bench train: preset {plan.preset}, {plan.nproc} process(es), EP {plan.ep}, {plan.iters} steps "
        f"({plan.warmup} warm-up), runs {', '.join(r.name for r in plan.runs)}; logs in {workdir}",
        flush=True,
    )
    shutil.rmtree(plan.init_dir, ignore_errors=True)  # a kept one from an earlier comparison
    try:
        for run in (plan.init, *plan.runs):
            progress = Progress(run.name, plan.iters)
            progress.start(run.label)
            if run.trace:  # a fresh directory: no trace of an earlier comparison is read as this one's
                shutil.rmtree(os.path.dirname(run.trace), ignore_errors=True)
                os.makedirs(_tensorboard_dir(run), exist_ok=True)
            cmd = plan.command(torchrun, run)
            t0 = time.monotonic()
            rc, log, tail = launch(
                cmd, os.path.join(workdir, f"{run.name}.log"), progress, ns.verbose, ns.timeout_s
            )
            progress.end(rc)
            results[run.name] = {
                "rc": rc,
                "log": log,
                "tail": tail,
                "seconds": time.monotonic() - t0,
                "command": cmd,
            }
            if run is plan.init and rc != 0:
                break
    finally:
        if not ns.keep_checkpoint:
            shutil.rmtree(plan.init_dir, ignore_errors=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
