"""The loopback overlap sweep (``python -m benchmarks.overlap``)'s output: the table's columns (every row as
wide as the header, each value under its label), no exposed fraction where the loopback waited no link time
(CPU), every shape in ``--help``, a CPU-only machine refused in one line with the estimated cost (and with
``--allow-cpu`` the cost printed once before anything runs), and real tiny points on CPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks import overlap
from benchmarks.cpu_cost import cpu_estimate, overlap_steps, step_flops, step_seconds
from benchmarks.overlap import CPU_NOTE, OVERLAP_COLUMNS, format_overlap
from mok_megatron.bench.shapes import OVERLAP_SHAPES
from tests.sweeps import refusal_of, run_sweep

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (no link time, cost warning)")


def _timed(mode, gbps, chunks, ms, comm_ms, exposed_ms, frac, emulated, peak=None):
    return dict(
        shape="tiny",
        expert_backend="torch",
        mode=mode,
        gbps=gbps,
        chunks=chunks,
        minibatch=128,
        ms=ms,
        comm_ms=comm_ms,
        exposed_ms=exposed_ms,
        bytes_per_step=1e6,
        exposed_frac=frac,
        link_emulated=emulated,
        rel_err=0.0,
        peak_gib=peak,
    )


GPU_ROWS = [
    dict(shape="tiny", gbps=None, chunks=0, ms=2.0, comm_ms=0.0),
    _timed("exact", 50.0, 2, 3.0, 4.0, 1.0, 0.25, True, peak=1.5),
    _timed("sync-free+graph", 0.0, 4, 2.5, 0.0, 0.5, None, True),
    dict(shape="tiny", gbps=None, chunks=0, ms=1.5, comm_ms=0.0, graph=True),
    dict(shape="tiny", profile={"gpu_ops": 3}, gbps=50.0, chunks=2),
]
CPU_ROWS = [
    dict(shape="tiny", gbps=None, chunks=0, ms=20.0, comm_ms=0.0),
    _timed("exact", 50.0, 2, 25.0, 0.01, 5.0, None, False),
]


def _table(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in ln.strip().strip("|").split("|")]
        for ln in text.splitlines()
        if ln.startswith("|")
    ]


@pytest.mark.parametrize("rows", [GPU_ROWS, CPU_ROWS], ids=["gpu", "cpu"])
def test_every_row_has_the_headers_columns(rows):
    table = _table(format_overlap(rows))
    assert table[0] == list(OVERLAP_COLUMNS)
    assert len(table) == 2 + sum("profile" not in r for r in rows)  # header, rule, one per timed row
    assert all(len(r) == len(OVERLAP_COLUMNS) for r in table)


def test_values_sit_under_their_labels():
    rows = [dict(zip(OVERLAP_COLUMNS, r, strict=True)) for r in _table(format_overlap(GPU_ROWS))[2:]]
    assert rows[0] == {
        **dict.fromkeys(OVERLAP_COLUMNS, "-"),
        "shape": "tiny",
        "mode": "plain EP=1",
        "link GB/s": "none",
        "minibatches": "1",
        "layer ms": "2.00",
        "link ms": "0",
        "exposed ms": "0",
    }
    assert rows[1] == {
        "shape": "tiny",
        "mode": "exact",
        "link GB/s": "50.0",
        "minibatches": "2",
        "layer ms": "3.00",
        "link ms": "4.00",
        "exposed ms": "1.00",
        "exposed %": "25",
        "peak GiB": "1.5",
    }
    assert (rows[2]["link GB/s"], rows[2]["exposed %"], rows[2]["peak GiB"]) == ("inf", "-", "-")
    assert rows[3]["mode"] == "plain EP=1 (CUDA graph)"


def test_cpu_rows_have_no_exposed_fraction_and_say_why():
    text = format_overlap(CPU_ROWS)
    assert _table(text)[3][OVERLAP_COLUMNS.index("exposed %")] == "-"
    assert text.endswith("\n\n" + CPU_NOTE)
    assert CPU_NOTE not in format_overlap(GPU_ROWS)


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        overlap.main(["--help"])
    assert e.value.code == 0
    return re.sub(r"\s+", " ", re.sub(r"-\n\s*", "-", capsys.readouterr().out))


def test_help_lists_every_shape_from_the_tables(capsys):
    text = _help(capsys)
    listed = re.search(r"--shapes SHAPES comma list of (.*?) \(default", text).group(1).split(", ")
    assert listed == list(OVERLAP_SHAPES) and "tiny" in listed


def test_unknown_shape_or_mode_is_named(capsys):
    for args, want in (
        (["--shapes", "tiny,huge"], "--shapes huge: overlap shapes are " + ", ".join(OVERLAP_SHAPES)),
        (["--modes", "exact,fast"], "--modes fast: choose from exact, sync-free"),
    ):
        with pytest.raises(SystemExit) as e:
            overlap.main(args)
        assert e.value.code == 2 and want in capsys.readouterr().err


def test_cost_estimate_hand_worked():
    tiny, shared = OVERLAP_SHAPES["tiny"], OVERLAP_SHAPES["tiny-shared"]
    assert step_flops(tiny) == 3 * 2 * (256 * 2) * 3 * 64 * 64
    assert step_flops(shared) == step_flops(tiny) + 3 * 2 * 256 * 3 * 64 * 64
    # 2 points: baseline (1/3 + 1 + 4) + 2 x (1/3 + 2 + 1 + 4) = 16/3 + 44/3
    assert overlap_steps(2, iters=4, warmup=1) == pytest.approx(20.0)
    gflops = 100.0
    assert step_seconds(tiny, gflops) == pytest.approx(step_flops(tiny) / (0.25 * 100e9) + 0.02)


def test_cpu_estimate_names_the_cost():
    big = {n: OVERLAP_SHAPES[n] for n in ("dsv3-4k", "dsv3-16k", "qwen3-ep8")}
    msg = cpu_estimate(big, points=16, iters=20, warmup=5, gflops=73.0)
    total = sum(step_seconds(s, 73.0) * overlap_steps(16, 20, 5) for s in big.values())
    assert msg.startswith("3 shape(s) x 17 points")
    assert f"estimated ~{total / 3600:.1f} h in all" in msg and "73 GFLOP/s" in msg
    small = cpu_estimate({"tiny": OVERLAP_SHAPES["tiny"]}, points=1, iters=2, warmup=1, gflops=73.0)
    assert re.search(r"estimated ~\d+ s in all", small)


@cpu_only
def test_cpu_only_machine_is_refused_in_one_line_with_the_cost():
    """The default sweep would run for days on a CPU: it refuses before building anything."""
    err = refusal_of("overlap", tiny="--shapes tiny")
    assert re.search(r"3 shape\(s\) x \d+ points .* estimated ~[\d.]+ h in all", err), err


@cpu_only
def test_allow_cpu_prints_the_cost_once_before_the_run(monkeypatch, capsys):
    calls = []

    def fake_bench(shapes, gbps, chunks, iters, warmup, **kw):
        calls.append(capsys.readouterr().err)  # what was printed before the run started
        return CPU_ROWS

    monkeypatch.setattr(overlap, "bench_overlap", fake_bench)
    monkeypatch.setattr("benchmarks.cpu_cost.matmul_gflops", lambda: 50.0)
    args = ["--gbps", "0,50", "--chunks", "1,2", "--modes", "exact,sync-free+graph", "--iters", "3"]
    assert overlap.main([*args, "--allow-cpu"]) == 0
    before = calls[0]
    assert before.count("python -m benchmarks.overlap: no CUDA GPU, running on CPU") == 1
    # 2 link speeds x 2 minibatch counts x 1 mode (the CUDA-graph mode is skipped on CPU): 4 points + baseline
    assert "3 shape(s) x 5 points" in before
    rest = capsys.readouterr()
    assert "no CUDA GPU" not in rest.err and CPU_NOTE in rest.out


@cpu_only
def test_tiny_point_on_cpu(tmp_path):
    """One real point: the printed table and the JSON rows agree with the rules above."""
    out = tmp_path / "ov.json"
    args = ["--shapes", "tiny", "--gbps", "50", "--chunks", "2", "--iters", "1", "--warmup", "0"]
    p = run_sweep("overlap", *args, "--json", str(out), "--allow-cpu")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.count("no CUDA GPU, running on CPU: 1 shape(s) x 2 points") == 1
    rows = json.loads(out.read_text())
    timed = [r for r in rows if r["gbps"] is not None]
    assert len(timed) == 1 and timed[0]["link_emulated"] is False and timed[0]["exposed_frac"] is None
    table = _table(p.stdout)
    assert table[0] == list(OVERLAP_COLUMNS) and len(table) == 4
    assert all(len(r) == len(OVERLAP_COLUMNS) for r in table)
    assert table[3][OVERLAP_COLUMNS.index("exposed %")] == "-" and CPU_NOTE in p.stdout
    assert "exposed" in p.stdout and "(-)" in p.stdout  # the per-point progress line: no percentage either


def test_sweep_runs_and_reports_exposed_communication(tmp_path):
    out = tmp_path / "ov.json"
    args = ["--shapes", "tiny", "--gbps", "0,50", "--chunks", "1,2", "--iters", "2", "--warmup", "1"]
    p = run_sweep("overlap", *args, "--modes", "exact,sync-free", "--json", str(out), "--allow-cpu")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
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
