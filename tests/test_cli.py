"""The `mok` command line: the demo (main job) end to end, env, convert."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.test_checkpoint import _model_sd


def _mok(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "mok_megatron.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_trains_and_the_loss_falls(tmp_path):
    out = tmp_path / "demo.json"
    r = _mok("demo", "--steps", "16", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["layer"] == "mok" and s["expert_parallel"] == s["nproc"] >= 1
    assert len(s["losses"]) == 16
    assert s["loss_last"] < 0.8 * s["loss_first"], s["losses"]
    assert s["tokens_per_s"] > 0
    ms = s["moe_ms_per_step"]
    if ms["forward"]["pipeline"] > 0:  # EP > 1: the overlap engine (dispatch+experts+combine overlapped)
        assert ms["backward"]["pipeline"] > 0 and ms["forward"]["dispatch"] > 0, ms
    else:
        for direction in ("forward", "backward"):
            for phase in ("dispatch", "experts", "combine"):
                assert ms[direction][phase] > 0, (direction, phase)
    assert "step  16/16" in r.stdout and "loss" in r.stdout  # progress lines with per-step loss
    assert "dispatch" in r.stdout and "tokens/s" in r.stdout  # summary


def test_demo_rejects_experts_not_divisible_by_processes():
    r = _mok("demo", "--experts", "7", "--nproc", "2")
    assert r.returncode == 2 and "--experts 7 must be divisible by --nproc 2" in r.stderr


def test_env_json():
    r = _mok("env", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["megatron_core"].startswith("0.19")
    assert set(rep["fp8_recipes"]) == {"delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"}
    if not torch.cuda.is_available():
        assert all(v.startswith("no") for v in rep["fp8_recipes"].values())
        assert any("CUDA GPU: none" in m for m in rep["missing"])


def test_convert_command(tmp_path):
    src, dst = tmp_path / "seq.pt", tmp_path / "mok.pt"
    torch.save({"model": _model_sd(), "iteration": 7}, src)
    r = _mok("convert", str(src), str(dst), "--to", "mok", "--key", "model")
    assert r.returncode == 0 and "2 MoE layer(s) -> mok" in r.stdout, r.stderr
    got = torch.load(dst, weights_only=False)
    assert got["iteration"] == 7
    assert got["model"]["decoder.layers.1.mlp.experts.fc1_weight"].shape == (4, 16, 8)


def test_bench_overlap_runs_and_reports_exposed_communication(tmp_path):
    out = tmp_path / "ov.json"
    r = _mok(
        "bench",
        "overlap",
        "--shapes",
        "tiny",
        "--gbps",
        "0,50",
        "--chunks",
        "1,2",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--modes",
        "exact,sync-free",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [row for row in json.loads(out.read_text()) if "profile" not in row]
    plain = [row for row in rows if row["gbps"] is None]
    assert len(plain) == 1 and plain[0]["ms"] > 0
    timed = [row for row in rows if row["gbps"] is not None]
    assert {(row["mode"], row["gbps"], row["chunks"]) for row in timed} == {
        (m, g, c) for m in ("exact", "sync-free") for g in (0.0, 50.0) for c in (1, 2)
    }
    for row in timed:
        assert row["expert_backend"] == "torch"  # the default --expert-backend
        assert row["rel_err"] < 1e-4  # fp32 on CPU: the pipelined layer equals the plain one
        assert (row["bytes_per_step"] > 0) and ((row["comm_ms"] > 0) == (row["gbps"] > 0))


def test_bench_ep_under_torchrun_compares_with_megatron(tmp_path):
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
            "mok_megatron.bench.overlap",
            "ep",
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
        env={**__import__("os").environ, "TORCHDYNAMO_DISABLE": "1"},
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
