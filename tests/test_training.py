"""Megatron training integration: the --mok-* flags through Megatron's real parser, the patch set applied
to the wheel's own arguments.py, and every recipe's DRY_RUN command (the training loop itself, MoK against
alltoall: tests/test_first_run.py)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mok_megatron.training import patches
from mok_megatron.training.arguments import MoKArgumentError, check_environment, extra_args_provider, install
from mok_megatron.options import MoKOptions

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "examples").glob("*.sh"))

BASE = ["--num-experts", "8", "--moe-router-topk", "2"]


def _parser():
    from megatron.training.arguments import add_megatron_arguments

    return extra_args_provider(add_megatron_arguments(argparse.ArgumentParser(prog="t", allow_abbrev=False)))


@pytest.fixture(scope="module")
def parser():
    return _parser()


def test_mok_flags_map_onto_options(parser):
    from mok_megatron.training.arguments import options_from_args

    a = parser.parse_args(
        BASE
        + ["--moe-token-dispatcher-type", "mok", "--expert-model-parallel-size", "4"]
        + ["--mok-minibatch-size", "256", "--mok-capacity-multiplier", "0.5", "--mok-sync-free"]
        + ["--mok-transport", "copy_engine", "--mok-engine", "pipeline"]
    )
    # `mok` is an alias: Megatron's checks see alltoall, the entry point sees args.mok.
    assert (a.mok, a.moe_token_dispatcher_type) == (True, "alltoall")
    assert options_from_args(a) == MoKOptions(
        engine="pipeline",
        minibatch_size=256,
        capacity_multiplier=0.5,
        sync_free=True,
        transport="copy_engine",
    )
    b = parser.parse_args(BASE + ["--moe-token-dispatcher-type", "allgather"])
    assert (b.mok, b.moe_token_dispatcher_type) == (False, "allgather")
    assert options_from_args(b) == MoKOptions()
    c = parser.parse_args(BASE + ["--moe-token-dispatcher-type", "mok", "--mok-engine", "plain"])
    assert options_from_args(c) == MoKOptions(engine="plain")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            BASE + ["--moe-token-dispatcher-type", "mok", "--expert-model-parallel-size", "3"],
            r"--num-experts 8 is not divisible by --expert-model-parallel-size 3.*\[1, 2, 4, 8\]",
        ),
        (["--moe-token-dispatcher-type", "mok"], r"needs an MoE model: --num-experts is None"),
        (
            BASE + ["--moe-token-dispatcher-type", "mok", "--mok-capacity-multiplier", "1.5"],
            r"--mok-capacity-multiplier=1.5: values above 1.0 only waste memory",
        ),
        (
            BASE + ["--moe-token-dispatcher-type", "mok", "--mok-minibatch-size", "0"],
            r"--mok-minibatch-size=0: must be a positive number",
        ),
        (BASE + ["--mok-transport", "nvshmem"], r"invalid choice: 'nvshmem'"),
        (BASE + ["--moe-token-dispatcher-type", "deepep"], r"invalid choice: 'deepep'.*'mok'"),
    ],
)
def test_bad_command_lines_exit_with_the_reason(parser, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err[-600:]


def test_parsed_mok_flags_are_plain_values(parser):
    """Megatron saves ``args`` inside checkpoints and loads them with ``weights_only``: no enum objects."""
    a = parser.parse_args(BASE + ["--moe-token-dispatcher-type", "mok", "--mok-engine", "plain"])
    d = parser.parse_args(BASE + ["--moe-token-dispatcher-type", "mok"])
    for ns in (a, d):
        values = {k: v for k, v in vars(ns).items() if k.startswith("mok")}
        assert values and all(type(v) in (str, int, float, bool, type(None)) for v in values.values()), values


def test_every_mok_option_field_with_a_flag_is_a_flag(parser):
    """The flags are the MoKOptions fields: name, choices and default come from the field."""
    import dataclasses

    from mok_megatron.options import flag_fields, flag_name

    actions = {s: a for a in parser._actions for s in a.option_strings}
    for f, flag in flag_fields():
        action = actions[flag_name(f.name)]
        default = f.default.value if hasattr(f.default, "value") else f.default
        assert action.default == default and action.help.startswith(flag.help), f.name
        assert getattr(MoKOptions(), f.name) == f.default
    assert {f.name for f, _ in flag_fields()} <= {f.name for f in dataclasses.fields(MoKOptions)}


def test_mok_flags_with_another_dispatcher_warn(parser):
    with pytest.warns(UserWarning, match=r"--mok-sync-free given with .* alltoall: ignored"):
        parser.parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--mok-sync-free"])


def test_provider_is_idempotent_and_install_reaches_megatron_reparses(monkeypatch):
    p = _parser()
    assert extra_args_provider(p) is p  # a second call adds nothing (no argparse conflict)
    from megatron.training import arguments as margs

    monkeypatch.setattr(margs, "add_megatron_arguments", margs.add_megatron_arguments)
    install()
    install()
    # What ft_integration.setup() does inside pretrain(): re-parse sys.argv with no provider.
    monkeypatch.setattr(sys, "argv", ["x", *BASE, "--moe-token-dispatcher-type", "mok", "--mok-sync-free"])
    a = margs.parse_args(ignore_unknown_args=True)
    assert a.mok and a.mok_sync_free


def test_megatron_runtime_patches_are_all_listed():
    """``training.megatron_hooks.RUNTIME_PATCHES`` names every Megatron attribute the hooks replace: each
    target exists in the installed Megatron-Core, and installing the hooks (the command line, CPU mode where
    no GPU is present, the checkpoint loader) changes no module attribute of Megatron that the list lacks."""
    import importlib
    import json

    from mok_megatron.training.megatron_hooks import RUNTIME_PATCHES

    for patch in RUNTIME_PATCHES:
        parts = patch.target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for name in parts[i:]:
                obj = getattr(obj, name)
            break
        module, _, fn = patch.by.rpartition(".")
        assert callable(getattr(importlib.import_module(module), fn)), patch.by
    code = (
        "import json, sys, types, torch\n"
        "import megatron.training.training, megatron.training.initialize, megatron.training.arguments\n"
        "import megatron.core.fusions.fused_softmax, megatron.core.transformer.utils\n"
        "def snap():\n"
        "    return {f'{n}.{k}': v for n, m in list(sys.modules.items()) if n.startswith('megatron')\n"
        "            and isinstance(m, types.ModuleType) for k, v in list(vars(m).items())}\n"
        "before = snap()\n"
        "from mok_megatron.training import arguments, checkpoint_files, cpu_training\n"
        "arguments.install()\n"
        "if not torch.cuda.is_available():\n"
        "    cpu_training.enable()\n"
        "with checkpoint_files.naming_load_errors(None):\n"
        "    after = snap()\n"
        "print(json.dumps(sorted(k for k in before if k in after and after[k] is not before[k])))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    changed = set(json.loads(r.stdout.strip().splitlines()[-1]))
    listed = {p.target for p in RUNTIME_PATCHES}
    assert changed <= listed, f"megatron_hooks.RUNTIME_PATCHES lacks the runtime patches {changed - listed}"
    import torch

    installed = {
        "mok_megatron.training.arguments.install",
        "mok_megatron.training.checkpoint_files.naming_load_errors",
    }
    if not torch.cuda.is_available():
        installed |= {"mok_megatron.training.cpu.enable", "mok_megatron.training.cpu_training.enable"}
    stale = {p.target for p in RUNTIME_PATCHES if p.by in installed} - changed
    assert not stale, f"megatron_hooks.RUNTIME_PATCHES lists patches nothing installs: {stale}"


def test_fp8_without_transformer_engine_is_refused(parser):
    from mok_megatron.compat import have_te

    if have_te():
        pytest.skip("Transformer Engine is installed here")
    local = ["--transformer-impl", "local"]
    a = parser.parse_args(BASE + local + ["--moe-token-dispatcher-type", "mok", "--fp8-format", "e4m3"])
    with pytest.raises(MoKArgumentError, match=r"--fp8-format e4m3 .* needs Transformer Engine"):
        check_environment(a)
    check_environment(parser.parse_args(BASE + local))  # no FP8: nothing to check


# ---- patches ----------------------------------------------------------------------------------------

ARGS_PY = "megatron/training/arguments.py"


def _wheel_copy(tmp_path: Path) -> Path:
    import megatron.training.arguments as margs

    dst = tmp_path / ARGS_PY
    dst.parent.mkdir(parents=True)
    shutil.copyfile(margs.__file__, dst)
    return dst


def test_patch_applies_to_the_wheels_arguments_py_and_reverts(tmp_path):
    dst = _wheel_copy(tmp_path)
    original = dst.read_bytes()
    assert patches.status(tmp_path, [ARGS_PY]) == {ARGS_PY: patches.PRISTINE}
    assert patches.apply(tmp_path, [ARGS_PY]) == [ARGS_PY]
    assert patches.status(tmp_path, [ARGS_PY]) == {ARGS_PY: patches.APPLIED}
    assert patches.apply(tmp_path, [ARGS_PY]) == []  # idempotent

    # The patched module's parser knows the MoK flags on its own.
    import importlib.util

    spec = importlib.util.spec_from_file_location("patched_megatron_arguments", dst)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = mod.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    a = p.parse_args(BASE + ["--moe-token-dispatcher-type", "mok", "--mok-transport", "collective"])
    assert a.mok and a.mok_transport == "collective"

    assert patches.revert(tmp_path, [ARGS_PY]) == [ARGS_PY]
    assert dst.read_bytes() == original
    assert patches.revert(tmp_path, [ARGS_PY]) == []


def test_patch_refuses_unknown_or_partial_trees(tmp_path):
    dst = _wheel_copy(tmp_path)
    dst.write_text(dst.read_text() + "\n# a local edit\n")
    with pytest.raises(patches.PatchError, match=r"(?s)arguments.py: unknown.*f8837c04ef6c"):
        patches.apply(tmp_path, [ARGS_PY])
    assert dst.read_text().endswith("# a local edit\n")  # untouched
    # The whole set needs a Megatron-LM root (pretrain_gpt.py, gpt_builders.py).
    shutil.copyfile(patches.PATCH_DIR / "manifest.json", tmp_path / "x")  # any file; not a root
    r = subprocess.run(
        [sys.executable, "-m", "mok_megatron.cli", "patches", "apply", str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 1 and "pretrain_gpt.py: missing" in r.stderr, r.stderr


@pytest.mark.skipif(
    not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at the pin"
)
def test_patch_set_on_a_megatron_lm_checkout(tmp_path):
    src = Path(os.environ["MEGATRON_LM_DIR"])
    for f in patches.Manifest.load().files:
        (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f.path, tmp_path / f.path)
    before = {f: (tmp_path / f).read_bytes() for f in patches.status(tmp_path)}
    assert len(patches.apply(tmp_path)) == 3 and patches.apply(tmp_path) == []
    assert set(patches.status(tmp_path).values()) == {patches.APPLIED}
    patches.revert(tmp_path)
    assert {f: (tmp_path / f).read_bytes() for f in before} == before


# ---- recipes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_dry_run_parses_and_its_layout_adds_up(parser, recipe):
    """The layout arithmetic is `mok recipe check`'s (tests/test_recipes.py covers its failures)."""
    from mok_megatron.tools.recipe import check as recipes
    from mok_megatron.tools.recipe.layout import parallel

    r = recipes.dry_run(recipe)
    a = parser.parse_args(r.argv)
    assert a.mok and a.moe_token_dispatcher_type == "alltoall"
    p = parallel(a, r.cluster)  # raises LayoutError naming the broken rule
    assert p.tp * p.pp * p.cp * p.dp == r.cluster.world == p.etp * p.ep * p.edp * p.pp
    # The A/B switch: the same recipe with Megatron's dispatcher drops only the MoK flags (MOK_ARGS come
    # last) and adds only its own (ALLTOALL_ARGS, e.g. router padding for FP8, which MoK's experts do not need).
    ab = recipes.dry_run(recipe, env={"DISPATCHER": "alltoall"}).argv
    i = r.argv.index("--moe-token-dispatcher-type")
    k = next((j for j, x in enumerate(r.argv) if x.startswith("--mok-")), len(r.argv))
    expected = r.argv[:k]
    expected[i + 1] = "alltoall"
    assert r.argv[i + 1] == "mok" and ab[: len(expected)] == expected
    assert all(not x.startswith("--mok-") for x in ab[len(expected) :])
    assert not parser.parse_args(ab).mok


def _recipe_dry_run(recipe: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(recipe)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, DEVICE="cpu", DRY_RUN="1", **env),
    )


def _flag(argv: list[str], flag: str) -> int:
    return int(argv[len(argv) - 1 - argv[::-1].index(flag) + 1])  # the last occurrence, as argparse reads it


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_trains_any_number_of_iterations(parser, capsys, recipe):
    """``ITERS=N`` sets ``--train-iters N`` on every recipe, with its warm-up kept below N (Megatron's
    scheduler asserts fewer warm-up than decay steps); an ITERS that is not a whole number >= 1 stops the
    script in one line naming the recipe's own value; ``EXTRA_ARGS="--train-iters 2"`` (the recipe's warm-up
    left above it) is refused by the parser in one line naming the fix, not by the scheduler's assertion."""
    default = _recipe_dry_run(recipe)
    assert default.returncode == 0, default.stderr
    own = _flag(shlex.split(default.stdout.splitlines()[-1]), "--train-iters")
    for iters in (1, 3):
        r = _recipe_dry_run(recipe, ITERS=str(iters))
        assert r.returncode == 0, r.stderr
        argv = shlex.split(r.stdout.splitlines()[-1])
        argv = argv[argv.index("mok_megatron.pretrain_gpt") + 1 :]
        a = parser.parse_args(argv)
        assert a.train_iters == iters and 0 <= a.lr_warmup_iters < iters, (iters, a.lr_warmup_iters)
    for bad in ("0", "abc", "-3", "007"):
        r = _recipe_dry_run(recipe, ITERS=bad)
        assert r.returncode == 2 and r.stdout == "", r.stdout
        want = f"{recipe.name}: ITERS={bad}: must be a whole number >= 1 (e.g. ITERS={own})."
        assert r.stderr.splitlines() == [want]
    r = _recipe_dry_run(recipe, EXTRA_ARGS="--train-iters 2")
    argv = shlex.split(r.stdout.splitlines()[-1])
    warmup = _flag(argv, "--lr-warmup-iters")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv[argv.index("mok_megatron.pretrain_gpt") + 1 :])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert (
        f"--lr-warmup-iters {warmup} is not below the 2 iterations" in err and "ITERS=N sets both" in err
    ), err


SCHEDULE_ERRORS = [
    (
        ["--train-iters", "2", "--lr-warmup-iters", "2"],
        r"--lr-warmup-iters 2 is not below the 2 iterations the learning rate decays over \(--train-iters 2\)"
        r".* Lower --lr-warmup-iters to at most 1, or raise --train-iters above 2",
    ),
    (
        ["--train-iters", "10", "--lr-decay-iters", "3", "--lr-warmup-iters", "5"],
        r"--lr-warmup-iters 5 is not below the 3 iterations .* \(--lr-decay-iters 3\)"
        r".* raise --lr-decay-iters",
    ),
    (
        ["--train-samples", "64", "--lr-warmup-samples", "64"],
        r"--lr-warmup-samples 64 is not below the 64 samples .* \(--train-samples 64\)",
    ),
    (
        ["--train-iters", "10", "--lr-warmup-fraction", "1.0"],
        r"--lr-warmup-fraction 1.0 warms up over all 10",
    ),
    (["--train-iters", "10", "--lr-decay-iters", "0"], r"--lr-decay-iters 0: the learning rate must decay"),
    (["--train-iters", "10", "--min-lr", "3e-4"], r"--min-lr 0.0003 is above --lr 0.0001"),
    (["--train-iters", "10", "--lr-warmup-init", "1e-3"], r"--lr-warmup-init 0.001 is above --lr 0.0001"),
    (["--train-iters", "10", "--lr-decay-style", "WSD"], r"WSD needs --lr-wsd-decay-iters"),
    (["--train-iters", "10", "--min-lr=-1e-5"], r"--min-lr -1e-05 is negative"),
    (["--train-iters", "10", "--lr=-1e-4", "--min-lr", "0"], r"--lr -0.0001 is negative"),
    (["--train-iters", "10", "--weight-decay=-0.1"], r"--weight-decay -0.1 is negative"),
    (
        [
            "--train-iters",
            "10",
            "--weight-decay-incr-style",
            "linear",
            "--start-weight-decay",
            "0.1",
            "--end-weight-decay",
            "0.01",
        ],
        r"--end-weight-decay 0.01 is below --start-weight-decay 0.1.* Raise --end-weight-decay to at least"
        r" 0.1",
    ),
    (
        [
            "--train-iters",
            "10",
            "--weight-decay-incr-style",
            "cosine",
            "--start-weight-decay=-0.1",
            "--end-weight-decay",
            "0.1",
        ],
        r"--start-weight-decay -0.1 is negative",
    ),
]
SCHEDULES_MEGATRON_BUILDS = [
    ["--train-iters", "2", "--lr-warmup-iters", "1"],
    ["--train-iters", "1"],
    ["--train-iters", "10", "--lr-decay-iters", "6", "--lr-warmup-iters", "5"],
    ["--train-samples", "64", "--lr-warmup-fraction", "0.5"],
    ["--train-iters", "10", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4"],
    ["--train-iters", "10", "--min-lr", "0", "--weight-decay", "0"],
    [
        "--train-iters",
        "10",
        "--weight-decay-incr-style",
        "linear",
        "--start-weight-decay",
        "0.01",
        "--end-weight-decay",
        "0.1",
    ],
]


def _megatron_scheduler(argv: list[str]):
    """Megatron's own scheduler for ``argv`` (its ``get_optimizer_param_scheduler`` on a one-parameter
    optimizer), parsed without MoK's checks."""
    import torch
    from megatron.training import training
    from megatron.training.arguments import add_megatron_arguments

    a = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    if a.weight_decay_incr_style == "constant":  # what validate_args fills in
        a.start_weight_decay = a.end_weight_decay = a.weight_decay
    a.global_batch_size = 4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    old = training.get_args
    training.get_args = lambda: a
    try:
        return training.get_optimizer_param_scheduler(optimizer)
    finally:
        training.get_args = old


@pytest.mark.parametrize("argv, message", SCHEDULE_ERRORS, ids=[" ".join(a) for a, _ in SCHEDULE_ERRORS])
def test_a_schedule_megatron_cannot_build_is_one_line_at_parse_time(parser, capsys, argv, message):
    """Megatron's scheduler asserts on these after the model and optimizer are built (a bare AssertionError);
    the parser refuses them first, naming the flags and the fix."""
    argv = BASE + ["--lr", "1e-4", *argv]
    with pytest.raises(AssertionError):
        _megatron_scheduler(argv)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize("argv", SCHEDULES_MEGATRON_BUILDS, ids=" ".join)
def test_a_schedule_megatron_builds_parses(parser, argv):
    argv = BASE + ["--lr", "1e-4", *argv]
    _megatron_scheduler(argv)
    parser.parse_args(argv)
    parser.parse_args(BASE + ["--train-iters", "2", "--lr-warmup-iters", "5", "--skip-train"])  # no optimizer
