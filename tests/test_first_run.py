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
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("i", range(len(BAD_FLAGS)), ids=[" ".join(e) for e, _ in BAD_FLAGS])
def test_bad_mok_flags_fail_in_one_line_right_after_parsing(startup, i):
    _one_error_line(startup[f"bad{i}"], *BAD_FLAGS[i][1])


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


def _tiny_command(iters: int, dispatcher: str = "mok") -> list[str]:
    """The tiny recipe's launch command: 2 gloo ranks, EP=2 (its rendezvous on a free port here)."""
    r = _run(
        ["bash", "examples/tiny_moe.sh"],
        DRY_RUN="1",
        ITERS=str(iters),
        NPROC="2",
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


def test_patches_update_a_tree_an_earlier_patch_set_changed(tmp_path):
    import megatron.training.arguments as margs

    from mok_megatron.training import patches

    f = next(p for p in patches.Manifest.load().files if p.path == ARGS_PY)
    old = f.superseded[0]
    dst = tmp_path / ARGS_PY
    dst.parent.mkdir(parents=True)
    dst.write_text(
        patches.apply_diff(Path(margs.__file__).read_text(), (patches.PATCH_DIR / old.patch).read_text())
    )
    assert patches.status(tmp_path, [ARGS_PY]) == {ARGS_PY: patches.SUPERSEDED}
    r = _run(
        [sys.executable, "-m", "mok_megatron.cli", "patches", "check", str(tmp_path), "--files", ARGS_PY]
    )
    assert r.returncode == 1 and "mok patches apply" in r.stderr, r.stdout + r.stderr
    assert patches.apply(tmp_path, [ARGS_PY]) == [ARGS_PY]
    assert patches.status(tmp_path, [ARGS_PY]) == {ARGS_PY: patches.APPLIED}


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
