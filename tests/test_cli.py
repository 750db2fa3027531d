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


def test_bench_help_lists_every_bench_command():
    r = _mok("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: mok bench {layer,train,ep}")
    for name in ("layer", "train", "ep"):
        assert f"\n  {name} " in r.stdout
    assert "benchmarks/" in r.stdout and "python -m benchmarks.overlap" in r.stdout


def test_bench_unknown_command_names_the_commands_and_the_sweeps():
    r = _mok("bench", "foo")
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("mok bench: unknown bench command 'foo'; choose from layer, train, ep.")
    assert "benchmarks/" in err
    r = _mok("bench", "overlap")
    assert r.returncode == 2 and "overlap is a research sweep: python -m benchmarks.overlap" in r.stderr
