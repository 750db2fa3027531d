"""The package as users install it: a wheel, in an environment of its own, run from outside the checkout.

The wheel is built from this checkout and installed (no dependencies) into a fresh virtual environment whose
only other path is the test environment's site-packages (torch, megatron-core); the checkout is not on
any path. Every command the CLI offers that reads shipped data (the Megatron-LM patch set, the planner's
measurements) runs there, and so does the main job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def purelib_of(py: Path) -> str:
    return subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, mok) of a fresh venv holding only the wheel; the test environment's packages beside it."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("mok_megatron-*.whl")
    env_dir = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    purelib = purelib_of(py)
    # The dependencies (torch, megatron-core) from the test environment; its .pth files are not processed
    # there, so its editable install of this checkout stays inactive (--ignore-installed: pip sees that
    # install's metadata through this path and would otherwise skip the wheel).
    Path(purelib, "test_env_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the dependencies' site-packages may hold an editable install of this checkout, which
    # pip would otherwise take as the package already installed.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index"]
        + ["--ignore-installed", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return py, env_dir / "bin" / "mok", tmp


def _run(installed, *args, timeout=300):
    py, mok, tmp = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCHDYNAMO_DISABLE")}
    env["PATH"] = f"{mok.parent}{os.pathsep}{env.get('PATH', '')}"
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=work, env=env)


def test_the_installed_package_is_the_wheel(installed):
    py, _, tmp = installed
    r = _run(installed, str(py), "-c", "import mok_megatron; print(mok_megatron.__file__)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(tmp / "env") in r.stdout and str(ROOT) not in r.stdout, r.stdout


def test_the_wheel_carries_the_license(installed):
    import zipfile

    (wheel,) = (installed[2] / "dist").glob("mok_megatron-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith("/LICENSE") and ".dist-info/" in n]
        assert names, z.namelist()
        assert z.read(names[0]).decode() == (ROOT / "LICENSE").read_text()
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in metadata


def test_env(installed):
    r = _run(installed, str(installed[1]), "env")
    assert r.returncode == 0 and "megatron_core" in r.stdout, r.stderr[-2000:]


def test_plan(installed):
    r = _run(installed, str(installed[1]), "plan", "--model", "deepseek-v3", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "tokens/s/GPU" in r.stdout


def test_bench_ships_its_commands_and_no_research_sweeps(installed):
    """``mok bench layer / train / ep`` run from the wheel; the sweeps of benchmarks/ and the test harness
    are not in it."""
    import zipfile

    (wheel,) = (installed[2] / "dist").glob("mok_megatron-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "mok_megatron/testing/"))]
    for sweep in ("overlap", "wgrad", "gather", "nvlink", "kernels", "cpu_cost"):
        assert f"mok_megatron/bench/{sweep}.py" not in names
    r = _run(installed, str(installed[1]), "bench", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: mok bench {layer,train,ep}"), r.stdout + r.stderr
    for name in ("layer", "train", "ep"):
        r = _run(installed, str(installed[1]), "bench", name, "--help")
        assert r.returncode == 0 and f"mok bench {name}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_plan_recipe_says_where_the_recipes_are(installed):
    r = _run(installed, str(installed[1]), "plan", "--recipe", "examples/tiny_moe.sh")
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "mok plan: recipe examples/tiny_moe.sh: no such file; the recipes are the examples/*.sh scripts of "
        "the mok-megatron source repository (the installed package has none): give the path of one there, or "
        "plan a model with --model M"
    ]


def test_patches_check(installed, tmp_path):
    import megatron.training.arguments as margs

    tree = tmp_path / "site"
    (tree / "megatron" / "training").mkdir(parents=True)
    shutil.copyfile(margs.__file__, tree / "megatron" / "training" / "arguments.py")
    r = _run(installed, str(installed[1]), "patches", "check", str(tree), "--files", "megatron/training/arguments.py")
    assert r.returncode == 0 and "pristine" in r.stdout, r.stdout + r.stderr[-2000:]


def test_the_wheel_ships_the_patch_set_byte_for_byte(installed):
    """The wheel's mok_megatron/patches/ is the repository's patches/, file for file and byte for byte, and
    the installed package reads its own copy."""
    py, _, tmp = installed
    (wheel,) = (tmp / "dist").glob("mok_megatron-*.whl")
    prefix = "mok_megatron/patches/"
    with zipfile.ZipFile(wheel) as z:
        shipped = {n.removeprefix(prefix): z.read(n) for n in z.namelist() if n.startswith(prefix)}
    source = {p.name: p.read_bytes() for p in (ROOT / "patches").iterdir() if p.is_file()}
    assert "manifest.json" in source and shipped == source, (sorted(shipped), sorted(source))
    r = _run(installed, str(py), "-c", "from mok_megatron.training import patches; print(patches.PATCH_DIR)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == Path(purelib_of(py)) / "mok_megatron" / "patches", r.stdout


def test_demo(installed):
    r = _run(installed, str(installed[1]), "demo", "--steps", "4", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "step   4/4" in r.stdout or "step 4/4" in r.stdout, r.stdout[-2000:]
