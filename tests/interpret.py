"""Run a module's Triton kernel cases under ``TRITON_INTERPRET=1`` in a subprocess (the interpreter flag
must be set before Triton is imported) and return its ``--json`` results: ``{case: "ok" | error}``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(module: str, *args: str) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"mok_{module.replace('.', '_')}_{os.getpid()}.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", module, *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"interpreter run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads(out.read_text())
    out.unlink()
    return results
