"""Every documented path works the first time, and bad input gets one clear line.

Each test reaches the product the way a user does: Megatron's own spec loader, the README's commands in a
shell, ``python -m mok_megatron.pretrain_gpt`` in a fresh process with the user's environment (no
``TORCHDYNAMO_DISABLE``), the shipped Megatron-LM patch loaded as Megatron would load it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_te

ROOT = Path(__file__).resolve().parent.parent
ARGS_PY = "megatron/training/arguments.py"
README_SPECS = (  # the names the README lists for `--spec mok_megatron.spec <name>`
    "gpt_layer_local",
    "gpt_layer_local_qk_layernorm",
    "gpt_layer_te",
    "gpt_layer_te_qk_layernorm",
    "gpt_layer_te_mla",
)


def _user_env(**extra) -> dict:
    """The environment a user's shell gives a command: no test-only switches."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHDYNAMO_DISABLE", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _run(cmd, timeout=300, cwd=ROOT, **env):
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_user_env(**env),
        shell=isinstance(cmd, str),
    )


# ---- specs through Megatron's loader ----------------------------------------------------------------


@pytest.mark.parametrize("name", README_SPECS)
def test_spec_names_load_through_megatrons_import_module(name):
    """Megatron-LM's ``--spec mok_megatron.spec <name>`` reads ``vars(module)[name]``
    (``megatron.core.transformer.spec_utils.import_module``), which a lazy module ``__getattr__`` never
    reaches: every README name must be a module attribute."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from mok_megatron.adapter.layer import MoKMoELayer
    from mok_megatron.config import MoKConfigError

    spec = import_module(("mok_megatron.spec", name))
    if "_te" in name and not have_te():
        with pytest.raises(
            MoKConfigError, match=rf"--spec mok_megatron.spec {name} needs Transformer Engine"
        ):
            spec.submodules  # noqa: B018
        return
    assert isinstance(spec, ModuleSpec)
    assert spec.submodules.mlp.func is MoKMoELayer


# ---- the README's commands ------------------------------------------------------------------------------


def test_readme_recipe_check_glob_passes():
    """``mok recipe check examples/*.sh``, as the README writes it, through a shell glob."""
    r = _run(f"{shlex.quote(sys.executable)} -m mok_megatron.cli recipe check examples/*.sh", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# Each command below imports Megatron (~10 s of one core here); they run two at a time, once per module.
PRETRAIN = [sys.executable, "-m", "mok_megatron.pretrain_gpt"]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
BASE += ["--max-position-embeddings", "64", "--num-experts", "8", "--moe-router-topk", "2"]
BASE += ["--micro-batch-size", "2", "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer"]
BASE += ["--vocab-size", "128", "--moe-token-dispatcher-type", "mok"]
BAD_FLAGS = [
    (["--mok-transport", "infiniband"], ("--mok-transport", "infiniband")),
    (["--mok-minibatch-size", "0"], ("--mok-minibatch-size=0",)),
    (
        ["--mok-sync-free", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"],
        ("--mok-sync-free", "--overlap-moe-expert-parallel-comm"),
    ),
    (
        ["--mok-minibatch-size", "64", "--moe-expert-capacity-factor", "1.0"],
        ("--mok-minibatch-size", "moe_expert_capacity_factor=1.0"),
    ),
]


LOCAL = ["--transformer-impl", "local"]
# Bad input a user types, each with what its one line must name: a misspelt flag (the recipe's
# `--num-expert 128`), Megatron's own rules and values, the experts' backend against this machine.
USER_ERRORS = {
    "typo": (
        [("--num-expert" if a == "--num-experts" else a) for a in BASE],
        ("unrecognized argument --num-expert", "did you mean --num-experts?"),
    ),
    "overlap_ep1": (
        BASE + ["--overlap-moe-expert-parallel-comm"],
        (
            "--overlap-moe-expert-parallel-comm",
            "--expert-model-parallel-size 2 or more (got 1)",
            "Drop the flag",
        ),
    ),
    "megatron_value": (BASE + ["--num-layers", "two"], ("--num-layers", "invalid int value: 'two'")),
    # Megatron's scheduler asserts this after building the model and optimizer, as a bare AssertionError
    "warmup_not_below_decay": (
        BASE + ["--lr-warmup-iters", "4"],
        ("--lr-warmup-iters 4 is not below the 4 iterations", "--lr-warmup-iters to at most 3"),
    ),
}
if not torch.cuda.is_available():
    USER_ERRORS["torch_fp8_on_cpu"] = (
        BASE + LOCAL + ["--mok-expert-backend", "torch-fp8"],
        ("--mok-expert-backend torch-fp8 needs an FP8-capable GPU", "default bf16 expert backend"),
    )
if not have_te():
    USER_ERRORS["te_backend_without_te"] = (
        BASE + LOCAL + ["--mok-expert-backend", "te"],
        ("--mok-expert-backend te needs Transformer Engine", "mok-megatron[te]"),
    )


def _run_many(commands: dict, timeout: float = 180) -> dict:
    """{key: (cmd, env)} -> {key: CompletedProcess}, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as ex:
        futures = {k: ex.submit(_run, cmd, timeout, ROOT, **env) for k, (cmd, env) in commands.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.fixture(scope="module")
def startup():
    """Every start-up command of this module's tests, run once: help, each bad flag, rank 1's view of a bad
    flag, a GPU transport on this CPU, Megatron's default (TE) layer without Transformer Engine."""
    commands = {"help": (PRETRAIN + ["--help"], {})}
    for i, (extra, _) in enumerate(BAD_FLAGS):
        commands[f"bad{i}"] = (PRETRAIN + BASE + extra, {})
    commands["rank1"] = (PRETRAIN + BASE + ["--mok-transport", "infiniband"], {"RANK": "1"})
    if not torch.cuda.is_available():
        commands["copy_engine"] = (
            PRETRAIN + BASE + ["--mok-transport", "copy_engine", "--transformer-impl", "local"],
            {},
        )
    if not have_te():
        commands["no_te"] = (PRETRAIN + BASE, {})
    for name, (argv, _) in USER_ERRORS.items():
        commands[name] = (PRETRAIN + argv, {})
    torchrun = [shutil.which("torchrun") or "torchrun", "--standalone", "--nproc-per-node", "1"]
    commands["torchrun_typo"] = (torchrun + ["-m", "mok_megatron.pretrain_gpt", *USER_ERRORS["typo"][0]], {})
    return _run_many(commands)


def test_pretrain_help_lists_the_mok_flags(startup):
    """``mok-pretrain-gpt --help``: megatron-core 0.19 generates help strings with a bare ``%`` (argparse
    formats help with ``%``); the flags must list."""
    r = startup["help"]
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in (
        "--mok-transport",
        "--mok-minibatch-size",
        "--mok-expert-backend",
        "--moe-token-dispatcher-type",
    ):
        assert flag in r.stdout


def _one_error_line(r, *needles):
    lines = [
        line
        for line in r.stderr.splitlines()
        if line.strip() and "Warning" not in line and "warn" not in line
    ]
    errors = [line for line in lines if "error:" in line]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "usage:" not in r.stderr, "the ~700-line usage buries the message"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith("mok-pretrain-gpt: error: "), errors[0]  # one prefix, however it is started
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("i", range(len(BAD_FLAGS)), ids=[" ".join(e) for e, _ in BAD_FLAGS])
def test_bad_mok_flags_fail_in_one_line_right_after_parsing(startup, i):
    _one_error_line(startup[f"bad{i}"], *BAD_FLAGS[i][1])


@pytest.mark.parametrize("name", list(USER_ERRORS))
def test_bad_input_fails_in_one_line_naming_the_fix(startup, name):
    _one_error_line(startup[name], *USER_ERRORS[name][1])


def test_bad_input_under_torchrun_is_named_in_its_failure_summary(startup):
    """torchrun prints its own failure summary after the rank's line: it names the same line (the rank's
    error file), not "error_file: <N/A>"."""
    r = startup["torchrun_typo"]
    line = "mok-pretrain-gpt: error: unrecognized argument --num-expert (did you mean --num-experts?)"
    assert r.returncode != 0 and "usage:" not in r.stderr, r.stderr[-3000:]
    assert f"traceback : {line}" in r.stderr, r.stderr[-3000:]
    assert sum(ln.startswith(line) for ln in r.stderr.splitlines()) == 1, r.stderr[-3000:]


def test_bad_flags_print_once_per_job(startup):
    """Under torchrun every rank parses; only rank 0 prints (all exit non-zero)."""
    r = startup["rank1"]
    assert r.returncode == 2 and "infiniband" not in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer: GPU transports need GPUs")
def test_gpu_transport_without_gpus_fails_before_model_build(startup):
    _one_error_line(startup["copy_engine"], "--mok-transport copy_engine needs CUDA GPUs", "collective")


@pytest.mark.skipif(have_te(), reason="Transformer Engine is installed here")
def test_missing_transformer_engine_names_both_fixes(startup):
    _one_error_line(
        startup["no_te"], "needs Transformer Engine", "mok-megatron[te]", "--transformer-impl local"
    )


# ---- training on a CPU as a user runs it, and a damaged checkpoint ------------------------------------


def test_recipe_without_torchrun_on_the_path_names_the_environment():
    """A recipe started outside the environment mok-megatron is installed in: one line, not bash's
    ``torchrun: command not found``."""
    r = subprocess.run(
        ["bash", "examples/tiny_moe.sh"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin", "ITERS": "2"},
    )
    assert r.returncode == 127 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "tiny_moe.sh: torchrun not found: activate the environment mok-megatron is installed in "
        "(e.g. source .venv/bin/activate after ./run demo)."
    ]


def _tiny_command(iters: int, dispatcher: str = "mok", nproc: int = 2) -> list[str]:
    """The tiny recipe's launch command: ``nproc`` gloo ranks, EP=nproc (rendezvous on a free port here)."""
    r = _run(
        ["bash", "examples/tiny_moe.sh"],
        DRY_RUN="1",
        ITERS=str(iters),
        NPROC=str(nproc),
        DISPATCHER=dispatcher,
        MASTER_PORT=str(_free_port()),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_runs):
    """The tiny recipe on this CPU (Megatron's pretrain() loop: DDP, optimizer, scheduler, mock data) for 4
    iterations, with torch.compile left on (a user's default), saving at iteration 4; its output and the
    checkpoint directory."""
    return tiny_runs["mok"], tiny_runs["ckpt"]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """The tiny recipe as a user runs it, MoK (saving at iteration 4) and DISPATCHER=alltoall, side by side."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    mok = _tiny_command(4) + ["--save", str(ckpt), "--save-interval", "4", "--ckpt-format", "torch_dist"]
    ref = _tiny_command(4, dispatcher="alltoall")
    torchrun = shutil.which("torchrun") or "torchrun"
    runs = _run_many(
        {
            name: ([c if c != "torchrun" else torchrun for c in cmd], {})
            for name, cmd in (("mok", mok), ("ref", ref))
        },
        timeout=600,
    )
    return {**runs, "ckpt": ckpt}


def _free_port() -> int:
    from tests.pool import free_port

    return free_port()


def test_pretrain_runs_on_cpu_without_disabling_torch_compile(saved_checkpoint):
    r, _ = saved_checkpoint
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "iteration        4/       4" in r.stdout, r.stdout[-2000:]


_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def test_tiny_recipe_mok_matches_alltoall(tiny_runs):
    """The same recipe with DISPATCHER=alltoall: Megatron's layer, the same losses (same math)."""
    mok_log = tiny_runs["mok"].stdout + tiny_runs["mok"].stderr
    ref = tiny_runs["ref"]
    ref_log = ref.stdout + ref.stderr
    assert ref.returncode == 0, ref_log[-4000:]
    mok, want = ([float(m.group(2)) for m in _LOSS.finditer(log)] for log in (mok_log, ref_log))
    assert "MoK MoE layers in the layer spec: 2 of 2" in mok_log
    assert "MoK MoE layers" not in ref_log and "Megatron-Core MoELayer" in ref_log
    assert len(mok) == len(want) == 4, (mok, want)
    assert mok[-1] < mok[0], mok  # it learns
    for i, (x, y) in enumerate(zip(mok, want, strict=True)):
        assert abs(x - y) <= 1e-4 * abs(y), (i, mok, want)  # same math as Megatron's alltoall layer


def test_tiny_recipe_trains_any_number_of_iterations():
    """``ITERS=2 bash examples/tiny_moe.sh`` trains 2 steps (Megatron's scheduler needs fewer warm-up steps
    than ITERS: the recipe warms up for at most ITERS - 1); an ITERS that is not a whole number >= 1 is one
    line."""
    for iters in (1, 3):
        flags = _tiny_command(iters)
        warmup = int(flags[flags.index("--lr-warmup-iters") + 1])
        assert flags[flags.index("--train-iters") + 1] == str(iters) and 0 <= warmup < iters, (iters, warmup)
    for bad in ("0", "abc", "-3"):
        r = _run(["bash", "examples/tiny_moe.sh"], DRY_RUN="1", ITERS=bad, timeout=60)
        assert r.returncode == 2 and r.stdout == "", r.stdout
        want = f"tiny_moe.sh: ITERS={bad}: must be a whole number >= 1 (e.g. ITERS=20)."
        assert r.stderr.splitlines() == [want]
    r = _run(["bash", "examples/tiny_moe.sh"], ITERS="2", MASTER_PORT=str(_free_port()), timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert [int(m.group(1)) for m in _LOSS.finditer(log)] == [1, 2], log[-2000:]


def test_truncated_checkpoint_is_named_at_start_up(saved_checkpoint, tmp_path):
    r, ckpt = saved_checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    data = sorted((bad / "iter_0000004").glob("*.distcp"))[0]
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    cmd = _tiny_command(6) + ["--load", str(bad), "--ckpt-format", "torch_dist"]
    r = _run(cmd, timeout=300)
    assert r.returncode != 0
    assert f"checkpoint {bad / 'iter_0000004'} is truncated: {data.name} has {size // 2} bytes" in r.stderr, (
        r.stderr[-3000:]
    )


# Megatron's `torch` checkpoint format pickles ``args`` and loads it with ``weights_only``; one process.
@pytest.fixture(scope="module")
def torch_training(tmp_path_factory):
    """The tiny recipe on one CPU process for 4 iterations, saving at 2 and 4 in the ``torch`` format: the
    run and the checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("torch_ckpt")
    cmd = _tiny_command(4, nproc=1) + ["--save", str(ckpt), "--save-interval", "2", "--ckpt-format", "torch"]
    r = _run(cmd, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r, ckpt


@pytest.fixture(scope="module")
def torch_checkpoint(torch_training):
    return torch_training[1]


@pytest.fixture(scope="module")
def resumed_save(tmp_path_factory):
    """Where the run resumed from iteration 2 saves its iteration 4."""
    return tmp_path_factory.mktemp("resumed_ckpt")


@pytest.fixture(scope="module")
def resumed(torch_checkpoint, resumed_save, tmp_path_factory):
    """Runs that load it: from iteration 2 (saving its iteration 4 in ``resumed_save``); from iteration 4
    with nothing left; with a longer ITERS (another learning-rate schedule), without and with Megatron's
    --override-opt_param-scheduler; a copy whose iteration-4 file is cut in half (Megatron's torch-format
    loader then calls ``sys.exit()``)."""
    load = ["--load", str(torch_checkpoint), "--ckpt-format", "torch"]
    save = ["--save", str(resumed_save), "--save-interval", "2"]
    damaged = tmp_path_factory.mktemp("damaged") / "ckpt"
    shutil.copytree(torch_checkpoint, damaged)
    for f in (damaged / "iter_0000004").rglob("*.pt"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    runs = {
        "damaged": _tiny_command(6, nproc=1) + ["--load", str(damaged), "--ckpt-format", "torch"],
        "from_2": _tiny_command(4, nproc=1) + load + ["--ckpt-step", "2"] + save,
        "at_end": _tiny_command(4, nproc=1) + load,
        "longer": _tiny_command(6, nproc=1) + load,
        "longer_override": _tiny_command(6, nproc=1) + load + ["--override-opt_param-scheduler"],
    }
    return _run_many({name: (cmd, {}) for name, cmd in runs.items()}, timeout=600)


def _iterations(r) -> list[int]:
    return [int(m.group(1)) for m in _LOSS.finditer(r.stdout + r.stderr)]


def _error_lines(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("mok-pretrain-gpt: error: ")]


def test_entry_point_outside_torchrun_names_the_launcher_in_one_line():
    """``mok-pretrain-gpt`` run straight from a shell (no torchrun): one error line naming torchrun, not the
    rendezvous traceback asking for MASTER_ADDR."""
    cmd = _tiny_command(2, nproc=1)
    flags = cmd[cmd.index("mok_megatron.pretrain_gpt") + 1 :]
    argv = [sys.executable, "-m", "mok_megatron.pretrain_gpt", *flags]
    env = {k: v for k, v in _user_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    errors = _error_lines(r)
    assert r.returncode == 2 and _iterations(r) == [], r.stderr[-3000:]
    assert len(errors) == 1 and "MASTER_ADDR and MASTER_PORT not set: start it under torchrun" in errors[0], (
        r.stderr[-3000:]
    )
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_torch_format_checkpoint_resumes_from_its_iteration(resumed, torch_checkpoint):
    r = resumed["from_2"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"> resumed from --load {torch_checkpoint} at iteration 2" in r.stdout, r.stdout[-3000:]
    assert _iterations(r) == [3, 4], r.stdout[-3000:]


def _losses(r) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in _LOSS.finditer(r.stdout + r.stderr)}


def _checkpoint_tensors(ckpt: Path, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of a torch-format checkpoint (one process): model, optimizer state, RNG states."""
    sd = torch.load(ckpt / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    out = {f"model.{k}": v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}
    for i, opt in enumerate(sd["optimizer"]):
        for p, state in opt["state"].items():
            out.update({f"optimizer{i}.{p}.{k}": v for k, v in state.items()})
    for rng in sd["rng_state"]:
        out.update({f"rng.{k}": v for k, v in rng.items() if isinstance(v, torch.Tensor)})
        out.update({f"rng.tracker.{k}": v for k, v in rng["rng_tracker_states"].items()})
    return out


def test_torch_format_resume_trains_as_the_uninterrupted_run(torch_training, resumed, resumed_save):
    """Resumed at iteration 2, the run trains bitwise as the uninterrupted one (dropout on): iteration 3's
    loss, and every weight, optimizer state and RNG state at iteration 4. Megatron logs the first iteration
    of a run without resetting its loss sums, so the run's next line is the mean of its first two iterations
    (uninterrupted: iteration 2; resumed at 2: iteration 4), for either layer."""
    full, ckpt = torch_training
    r = resumed["from_2"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    want, got = _losses(full), _losses(r)
    assert got[3] == want[3], (got, want)
    assert abs(float(got[4]) - (float(want[3]) + float(want[4])) / 2) < 2e-6, (got, want)
    a, b = _checkpoint_tensors(ckpt, 4), _checkpoint_tensors(resumed_save, 4)
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a), sorted(a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def test_unreadable_torch_format_checkpoint_fails_in_one_line(resumed):
    r = resumed["damaged"]
    errors = _error_lines(r)
    assert r.returncode != 0 and _iterations(r) == [], r.stderr[-3000:]
    assert len(errors) == 1 and "could not be read" in errors[0], r.stdout[-2000:] + r.stderr[-3000:]


def test_resume_with_nothing_left_to_train_fails(resumed):
    r = resumed["at_end"]
    errors = _error_lines(r)
    assert r.returncode != 0 and _iterations(r) == [], r.stderr[-3000:]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "nothing was trained. Raise --train-iters above 4" in errors[0], errors[0]


def test_resume_with_another_schedule_names_the_flag_that_resumes_it(resumed):
    r = resumed["longer"]
    errors = _error_lines(r)
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-3000:]
    assert "is intact" in errors[0] and "--override-opt_param-scheduler" in errors[0], errors[0]
    assert "Resume from an earlier checkpoint" not in r.stderr
    ok = resumed["longer_override"]
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    assert _iterations(ok) == [5, 6], ok.stdout[-3000:]


# ---- the Megatron-LM patch -------------------------------------------------------------------------------


def _patched_arguments(tmp_path: Path) -> Path:
    import megatron.training.arguments as margs

    from mok_megatron.training import patches

    dst = tmp_path / ARGS_PY
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(margs.__file__, dst)
    patches.apply(tmp_path, [ARGS_PY])
    return dst


def test_patched_arguments_help_prints(tmp_path):
    dst = _patched_arguments(tmp_path)
    spec = importlib.util.spec_from_file_location("patched_megatron_arguments", dst)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py")).format_help()
    assert "--mok-transport" in text


def test_patched_arguments_surfaces_a_broken_install(tmp_path):
    """The patch skips mok-megatron only when it is not installed; an import error inside it is raised."""
    dst = _patched_arguments(tmp_path)
    fake = tmp_path / "fake" / "mok_megatron"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "arguments.py").write_text("import a_dependency_that_is_missing\n")
    code = (
        "import argparse, importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(dst)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "mod.add_megatron_arguments(argparse.ArgumentParser())\n"
    )
    # cwd: `python -c` puts it first on sys.path, ahead of PYTHONPATH (the checkout would win)
    env = _user_env(PYTHONPATH=str(fake.parent))
    broken = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert broken.returncode != 0 and "a_dependency_that_is_missing" in broken.stderr, broken.stderr[-2000:]
    not_installed = (  # what Python raises where mok-megatron is not installed
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mok_megatron':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n" + code
    )
    absent = subprocess.run(
        [sys.executable, "-c", not_installed], capture_output=True, text=True, cwd=tmp_path, env=_user_env()
    )
    assert absent.returncode == 0, absent.stderr[-2000:]


def test_a_file_an_earlier_patch_set_changed_gets_one_line_to_restore_it(tmp_path):
    """A file as an earlier mok-megatron patched it (recognised by its hash) is not updated in place: one line
    says how to restore the pinned file, then apply."""
    import dataclasses

    import megatron.training.arguments as margs

    from mok_megatron.training import patches

    m = patches.Manifest.load()
    f = next(p for p in m.files if p.path == ARGS_PY)
    assert f.earlier_sha256_patched  # the manifest lists the earlier patched file's hash
    dst = tmp_path / ARGS_PY
    dst.parent.mkdir(parents=True)
    dst.write_text(Path(margs.__file__).read_text() + "# patched by an earlier mok-megatron\n")
    earlier = dataclasses.replace(f, earlier_sha256_patched=(patches._sha(dst.read_bytes()),))
    m = dataclasses.replace(m, files=tuple(earlier if p is f else p for p in m.files))
    assert patches.status(tmp_path, [ARGS_PY], m) == {ARGS_PY: patches.EARLIER}
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)  # fmt: skip
    with pytest.raises(patches.PatchError) as e:
        patches.apply(tmp_path, [ARGS_PY], m)
    assert str(e.value) == (
        f"{ARGS_PY}: patched by an earlier mok-megatron; restore it (git -C {tmp_path} checkout "
        f"{m.commit[:12]} -- {ARGS_PY}), then run 'mok patches apply {tmp_path}'."
    )
    assert dst.read_text().endswith("# patched by an earlier mok-megatron\n")  # untouched


def test_patches_check_on_a_tree_inside_another_checkout_reports_that_tree_only(tmp_path):
    """A site-packages tree (no git checkout of its own) inside some other git repository, here standing for
    a virtual environment inside a checkout: the report names neither that repository's HEAD nor a git
    command to run in the tree."""
    repo = tmp_path / "repo"
    site = repo / ".venv" / "lib" / "site-packages"
    (site / "megatron" / "training").mkdir(parents=True)
    (site / ARGS_PY).write_text("# a local edit\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    r = _run([sys.executable, "-m", "mok_megatron.cli", "patches", "check", str(site), "--files", ARGS_PY])
    assert r.returncode == 1 and f"{ARGS_PY}: unknown" in r.stderr, r.stdout + r.stderr
    assert "not a git checkout" in r.stderr and "git HEAD" not in r.stderr, r.stderr
    assert "git -C" not in r.stderr and "checkout f8837c04ef6c" not in r.stderr, r.stderr
    # the same file in a Megatron-LM git checkout of its own: its HEAD and the git command to restore it
    own = tmp_path / "megatron-lm"
    (own / "megatron" / "training").mkdir(parents=True)
    (own / ARGS_PY).write_text("# a local edit\n")
    subprocess.run(["git", "init", "-q", str(own)], check=True)
    subprocess.run(["git", "-C", str(own), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)  # fmt: skip
    r = _run([sys.executable, "-m", "mok_megatron.cli", "patches", "check", str(own), "--files", ARGS_PY])
    assert r.returncode == 1 and "git HEAD" in r.stderr and f"git -C {own} checkout" in r.stderr, r.stderr


def test_patches_on_a_missing_directory_say_so(tmp_path):
    r = _run([sys.executable, "-m", "mok_megatron.cli", "patches", "check", str(tmp_path / "nowhere")])
    assert r.returncode == 1 and "does not exist" in r.stderr and "stash" not in r.stderr, r.stderr


# ---- mok convert loads weights only ---------------------------------------------------------------------


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_convert_refuses_pickled_code_without_the_unsafe_opt_in(tmp_path):
    from tests.test_checkpoint import _model_sd

    src = tmp_path / "evil.pt"
    torch.save({"model": _model_sd(), "payload": _Exploit()}, src, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    ok = tmp_path / "plain.pt"
    torch.save({"model": _model_sd(), "args": argparse.Namespace(num_layers=2), "iteration": 3}, ok)
    convert = [sys.executable, "-m", "mok_megatron.cli", "convert"]
    runs = _run_many(
        {
            name: (
                convert + [str(path), str(tmp_path / f"{name}-out.pt"), "--to", "mok", "--key", "model"],
                {},
            )
            for name, path in (("evil", src), ("plain", ok))
        }
    )
    evil, plain = runs["evil"], runs["plain"]
    assert evil.returncode == 1 and "--unsafe-load" in evil.stderr, evil.stderr[-2000:]
    assert plain.returncode == 0, plain.stderr[-2000:]
