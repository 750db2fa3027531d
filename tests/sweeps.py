"""Running the repository's research sweeps (``benchmarks/``) as their README documents: ``python -m
benchmarks.NAME`` from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_sweep(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    env.pop("PYTHONPATH", None)  # the checkout's root, the working directory, is what python -m puts first
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def refusal_of(name: str, *args: str, tiny: str) -> str:
    """On a CPU-only machine the sweep refuses in one line naming --allow-cpu, before running anything."""
    p = run_sweep(name, *args, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2 and p.stdout == "", p.stdout[-2000:] + p.stderr[-2000:]
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"python -m benchmarks.{name}: no CUDA GPU"), err
    assert "--allow-cpu" in err and tiny in err, err
    return err
