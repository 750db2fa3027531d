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


def test_bench_help_lists_every_bench_command():
    r = _mok("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: mok bench {layer,train,ep}")
    for name in ("layer", "train", "ep"):
        assert f"\n  {name} " in r.stdout
    assert "benchmarks/" in r.stdout and "python -m benchmarks.overlap" in r.stdout


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


def test_bench_unknown_command_names_the_commands_and_the_sweeps():
    r = _mok("bench", "foo")
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("mok bench: unknown bench command 'foo'; choose from layer, train, ep.")
    assert "benchmarks/" in err
    r = _mok("bench", "overlap")
    assert r.returncode == 2 and "overlap is a research sweep: python -m benchmarks.overlap" in r.stderr
