"""``mok bench ep --schedules plain,1f1b``: Megatron's combined 1F1B EP-overlap schedule against the plain
one, for Megatron's alltoall layer and MoK's (mok_megatron/bench/schedules.py). On CPU: the refusals
(EP=1, unknown names) and one tiny run at EP=2 under torchrun over gloo, whose JSON rows and table are
checked here; the timings themselves mean something on GPUs only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mok_megatron.bench import ep
from mok_megatron.bench.schedules import LAYER_RTOL, SCHEDULE_COLUMNS, SCHEDULE_RTOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROW_KEYS = {
    "shape",
    "ep",
    "impl",
    "schedule",
    "microbatches",
    "tokens_per_microbatch",
    "dtype",
    "expert_backend",
    "ms",
    "call_ms",
    "losses",
    "loss_rel_vs_plain",
    "bitwise_vs_plain",
    "loss_rel_vs_megatron",
    "overlapped_over_plain",
    "mok_over_megatron",
}


def test_schedules_refuse_ep1_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ep.main(["--shapes", "tiny", "--schedules", "plain,1f1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "EP > 1" in err and "torchrun --nproc-per-node N" in err and "--schedules plain,1f1b" in err


def test_unknown_schedule_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        ep.main(["--schedules", "plain,2f2b"])
    assert e.value.code == 2 and "--schedules 2f2b: choose from layer, plain, 1f1b" in capsys.readouterr().err


def test_schedules_at_ep2_under_torchrun(tmp_path):
    """Both schedules x both layers at EP=2 (tiny, fp32 on CPU): every row has the schema, a positive
    time and losses that match (MoK's bitwise across the schedules); the table lists the four rows."""
    from tests.pool import free_port

    out = tmp_path / "sched.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "-m", "mok_megatron.bench.ep", "--shapes", "tiny"]
    cmd += ["--schedules", "plain,1f1b", "--iters", "1", "--warmup", "0", "--json", str(out)]
    env = {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all(set(row) == ROW_KEYS for row in rows), [sorted(set(row) ^ ROW_KEYS) for row in rows]
    by = {(row["impl"] == "mok", row["schedule"]): row for row in rows}
    assert len(rows) == 4 and set(by) == {(m, s) for m in (False, True) for s in ("plain", "1f1b")}
    for row in rows:
        assert row["ep"] == 2 and row["microbatches"] == 2 and row["tokens_per_microbatch"] == 256
        assert row["dtype"] == "fp32" and row["ms"] > 0 and row["ms"] == pytest.approx(row["call_ms"])
        assert len(row["losses"]) == 2 and all(v > 0 for v in row["losses"])
    meg, mok = by[False, "1f1b"], by[True, "1f1b"]
    assert mok["bitwise_vs_plain"] and mok["loss_rel_vs_plain"] == 0.0
    assert mok["losses"] == by[True, "plain"]["losses"]
    assert meg["loss_rel_vs_plain"] <= SCHEDULE_RTOL["fp32"]
    assert all(by[True, s]["loss_rel_vs_megatron"] <= LAYER_RTOL["fp32"] for s in ("plain", "1f1b"))
    for is_mok in (False, True):
        ratio = by[is_mok, "1f1b"]["overlapped_over_plain"]
        assert ratio == pytest.approx(by[is_mok, "1f1b"]["ms"] / by[is_mok, "plain"]["ms"])
    for s in ("plain", "1f1b"):
        assert by[True, s]["mok_over_megatron"] == pytest.approx(by[True, s]["ms"] / by[False, s]["ms"])
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert table[0] == "| " + " | ".join(SCHEDULE_COLUMNS) + " |" and len(table) == 6
    assert "| mok | 1f1b |" in r.stdout and table[-1].endswith("| bitwise |")
