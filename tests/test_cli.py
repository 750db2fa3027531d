"""The `mok` command line: the demo (main job) end to end, env, convert."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys

import pytest
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


def test_unknown_command_is_one_line_with_the_list(capsys):
    from mok_megatron.cli import main as mok

    assert mok(["pln"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    listed = err.split("; choose from ", 1)[1].split(" (mok --help")[0].split(", ")
    assert err.startswith("mok: unknown command 'pln' (did you mean 'plan'?); choose from ")
    assert set(listed) == {"env", "demo", "bench", "convert", "patches", "recipe", "plan"}, listed
    assert mok(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("mok: unknown command 'frobnicate'; choose from env, ")
    assert mok(["--help"]) == 0 and "plan" in capsys.readouterr().out


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def _convert_error(capsys, *args) -> str:
    from mok_megatron.cli import main as mok

    rc = mok(["convert", *map(str, args), "--to", "mok"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("mok convert: error: ") and "\x1b" not in lines[0], lines
    return lines[0]


def test_convert_bad_input_is_one_line_naming_the_value_and_the_fix(tmp_path, capsys, monkeypatch):
    from mok_megatron.options import Engine

    good = tmp_path / "good.pt"
    torch.save({"model": _model_sd(), "iteration": 7, "engine": Engine.PIPELINE}, good)
    out = tmp_path / "out.pt"
    e = _convert_error(capsys, tmp_path / "missing.pt", out)
    assert "missing.pt: no such file" in e
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:4000])
    assert "cut.pt is a cut-off zip archive" in _convert_error(capsys, cut, out)
    text = tmp_path / "notes.txt"
    text.write_text("hello\nnot a checkpoint\n")
    e = _convert_error(capsys, text, out)
    assert "notes.txt is not a torch.save'd file (neither a zip archive nor a pickle)" in e
    assert "--unsafe-load" not in e
    (tmp_path / "empty.pt").write_bytes(b"")
    assert "(an empty file)" in _convert_error(capsys, tmp_path / "empty.pt", out)
    dist = tmp_path / "iter_0000004"
    dist.mkdir()
    (dist / "metadata.json").write_text("{}")
    e = _convert_error(capsys, dist, out)
    assert "iter_0000004 is a dist_checkpointing (torch_dist) checkpoint folder: it needs no conversion" in e
    torch_ckpt = tmp_path / "ckpt" / "iter_0000004" / "mp_rank_00"
    torch_ckpt.mkdir(parents=True)
    torch.save({}, torch_ckpt / "model_optim_rng.pt")
    e = _convert_error(capsys, tmp_path / "ckpt", out)
    assert e.endswith(f"give the torch.save'd file inside it such as {torch_ckpt / 'model_optim_rng.pt'}.")
    e = _convert_error(capsys, good, out, "--key", "modle")
    assert "--key modle: " in e and "has no such key; its keys: model, iteration, engine." in e
    e = _convert_error(capsys, good, out)
    hint = f"no MoE expert weights at the top level of {good}; they are under key 'model': add --key model."
    assert e.endswith(hint)
    for protocol in (2, pickle.DEFAULT_PROTOCOL):  # 2: torch's; above 2 the class is read from the file
        evil = tmp_path / f"evil{protocol}.pt"
        torch.save({"model": _model_sd(), "payload": _RunsCode()}, evil, pickle_protocol=protocol)
        e = _convert_error(capsys, evil, out, "--key", "model")
        assert f"{evil} holds a posix.system object, which a weights-only load refuses (unpickling runs" in e
        assert e.endswith("If you made this file yourself and trust it, add --unsafe-load.")
    assert not out.exists()
    # the saved arguments' enums (Megatron's and MoK's) load weights-only
    from megatron.core.enums import ModelType

    args = argparse.Namespace(model_type=ModelType.encoder_or_decoder, mok_engine=Engine.PIPELINE)
    torch.save({"model": _model_sd(), "args": args}, good)
    from mok_megatron.cli import main as mok

    assert mok(["convert", str(good), str(out), "--to", "mok", "--key", "model"]) == 0
    assert "2 MoE layer(s) -> mok" in capsys.readouterr().out
    # the output path is checked before the load
    import mok_megatron.tools.convert as convert

    monkeypatch.setattr(convert, "load", lambda *a: pytest.fail("loaded before checking the output path"))
    e = _convert_error(capsys, good, tmp_path / "no" / "such" / "out.pt", "--key", "model")
    assert f"folder {tmp_path / 'no' / 'such'} does not exist; create it (mkdir -p" in e
    e = _convert_error(capsys, good, tmp_path)
    assert f"{tmp_path} is a folder; give the path of the file to write" in e


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
