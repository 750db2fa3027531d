"""``mok bench ep``: the layer at real expert parallelism under torchrun (two ranks over gloo on CPU), its
refusal without torchrun, and its transport labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mok_megatron.bench.ep import transport_options


def test_without_torchrun_refuses_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "mok_megatron.cli", "bench", "ep", "--shapes", "tiny"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and r.stdout == "", r.stdout + err
    assert "must be launched with torchrun" in err
    assert "torchrun --nproc-per-node 2 -m mok_megatron.bench.ep --shapes tiny" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_real_shapes_on_cpu_ranks_refuse_in_one_line():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    cmd = [sys.executable, "-m", "mok_megatron.cli", "bench", "ep", "--shapes", "tiny,dsv3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and r.stdout == "", r.stdout + err
    assert err.startswith("mok bench ep --shapes dsv3: no CUDA GPU") and "--allow-cpu" in err


def test_under_torchrun_compares_with_megatron(tmp_path):
    from tests.pool import free_port

    out = tmp_path / "ep.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "mok_megatron.bench.ep",
            "--shapes",
            "tiny",
            "--transports",
            "collective",
            "--chunks",
            "1,2",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())
    mok2 = [row for row in rows if row["impl"] == "mok" and row["ep"] == 2]
    # one row per transport x --mok-local-rows setting (default: both) x minibatch count
    assert {row["transport"] for row in mok2} == {
        "plain",
        "collective overlap exact",
        "collective fused exact",
    }
    assert sorted(row["chunks"] for row in mok2 if row["transport"] != "plain") == [1, 1, 2, 2]
    assert all(row["expert_backend"] == "torch" for row in mok2)  # the default --expert-backend
    assert all(row["rel_err"] < 1e-4 for row in rows if "rel_err" in row)
    assert "hidden vs Megatron's comm" in r.stdout


def test_transport_labels_set_the_communication_budget():
    from mok_megatron.options import MoKOptions

    assert transport_options("collective") == dict(transport="collective", nvlink_sync="barrier")
    assert transport_options("nvlink-flags") == dict(transport="nvlink", nvlink_sync="flags")
    opts = MoKOptions(**transport_options("nvlink:32/16"))
    assert (opts.nvlink_programs, opts.nvlink_programs_backward) == (32, 16)
    opts = MoKOptions(**transport_options("nvlink-flags:24"))
    assert (opts.nvlink_sync, opts.nvlink_programs, opts.nvlink_programs_backward) == ("flags", 24, None)
    with pytest.raises(ValueError, match="applies to nvlink only"):
        transport_options("collective:32")
    with pytest.raises(ValueError, match="e.g. nvlink:32/16"):
        transport_options("nvlink:many")
