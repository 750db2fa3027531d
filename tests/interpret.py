"""Run a module's Triton kernel cases under ``TRITON_INTERPRET=1`` in a subprocess (the interpreter flag
must be set before Triton is imported) and return its results: ``{case: "ok" | error}``.

An interpreted run takes one core for tens of seconds, so it starts in the background as soon as pytest
has collected a test that needs it (``start_selected``, called from conftest), and the module's fixture
collects the result (``interpreted``). A test module declares its run as ``INTERPRETED_RUN``: the argv
after ``python``, where ``{json}`` stands for the file the subprocess writes its results to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


class _Run:
    def __init__(self, argv: list[str]):
        self.json = Path(tempfile.mkstemp(prefix="mok_interpret_", suffix=".json")[1])
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, *(a.replace("{json}", str(self.json)) for a in argv)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )

    def result(self) -> dict:
        try:
            rc = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"interpreter run still running after {TIMEOUT_S} s: {self.proc.args}")
        self.stderr.seek(0)
        err = self.stderr.read()
        text = self.json.read_text() if self.json.exists() else ""  # mkstemp made it; empty until written
        self.json.unlink(missing_ok=True)
        if rc != 0 or not text:
            pytest.fail(f"interpreter run failed (rc {rc}):\n{err[-4000:]}")
        return json.loads(text)


_RUNS: dict[tuple[str, ...], _Run] = {}


def _start(argv: list[str]) -> _Run:
    key = tuple(argv)
    if key not in _RUNS:
        _RUNS[key] = _Run(argv)
    return _RUNS[key]


def interpreted(argv: list[str]) -> dict:
    """The results of ``python <argv>`` under the interpreter (started now if it was not already)."""
    return _start(argv).result()


def start_selected(items) -> None:
    """Start the interpreted run of every collected module that declares one (Triton installed)."""
    from mok_megatron.compat import have_triton

    if not have_triton():
        return
    for module in dict.fromkeys(item.module for item in items if item.module is not None):
        argv = getattr(module, "INTERPRETED_RUN", None)
        if argv is not None:
            _start(list(argv))


def stop_all() -> None:
    for run in _RUNS.values():
        if run.proc.poll() is None:
            run.proc.kill()
        run.json.unlink(missing_ok=True)
