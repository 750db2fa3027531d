"""benchmarks/tile_gemm_gate.py as documented: the rows each expert receives from each source rank, the
exchange steps that deliver them, the gate's arithmetic, and one line on a machine without an sm_90 GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_counts_are_the_routed_rows_of_the_local_experts():
    from benchmarks.tile_gemm_gate import SHAPES, counts

    shape = dict(SHAPES["qwen3-ep8"], tokens=64)
    c_L = counts(shape)
    assert c_L.shape == (shape["local"],)
    # every token picks top-k distinct experts; the local experts are the first `local` of `experts`
    assert 0 < int(c_L.sum()) <= shape["tokens"] * shape["ep"] * shape["topk"]
    assert torch.equal(c_L, counts(shape))  # seeded


def test_rows_by_source_and_their_arrival_steps():
    from benchmarks.tile_gemm_gate import SHAPES, arrival_steps, counts, counts_by_source

    shape = dict(SHAPES["deepseek-v3-ep32"], tokens=16, ep=4)
    c_SG = counts_by_source(shape)
    assert c_SG.shape == (4, shape["local"]) and torch.equal(c_SG.sum(0), counts(shape))
    # hand-worked: 2 experts, 3 sources; rank 1 pulls itself at step 0, then rank 2, then rank 0
    c = torch.tensor([[1, 0], [2, 1], [0, 3]])
    assert arrival_steps(c, rank=1).tolist() == [2, 0, 0, 0, 1, 1, 1]


def test_gate_sums_both_gemms_against_torch():
    from benchmarks.tile_gemm_gate import GATE, gate_rows

    def row(gemm, kind, k, ms):
        return dict(shape="s", gemm=gemm, kind=kind, impl=f"{kind} x", k=k, ms=ms)

    rows = [row("fc1", "torch", 0, 2.0), row("fc2_dgrad", "torch", 0, 1.0)]
    rows[0]["impl"] = rows[1]["impl"] = "torch._grouped_mm"
    rows += [row("fc1", "wait-arrival", 8, 2.05), row("fc2_dgrad", "wait-arrival", 8, 1.0)]
    rows += [row("fc1", "wait-arrival", 16, 2.2), row("fc2_dgrad", "wait-arrival", 16, 1.0)]
    rows += [row("fc1", "quack", 8, 2.0), row("fc2_dgrad", "quack", 8, 0.95)]
    rows += [row("fc1", "wait-quack-order", 16, 2.0), row("fc2_dgrad", "wait-quack-order", 16, 1.0)]
    gate = {g["k"]: g for g in gate_rows(rows, ["s"], [8, 16])}
    assert gate[8]["ratio"] == pytest.approx(3.05 / 3) and gate[8]["passes"] and GATE == 1.03
    assert gate[8]["quack_ratio"] == pytest.approx(2.95 / 3) and "quack_order_ratio" not in gate[8]
    assert not gate[16]["passes"] and gate[16]["quack_ms"] is None
    # the same waiting GEMM in QuACK's order (an expert-major pull) gets its own verdict
    assert gate[16]["quack_order_ratio"] == pytest.approx(1.0) and gate[16]["quack_order_passes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_an_sm90_gpu_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.tile_gemm_gate"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "tile_gemm_gate: needs an sm_90 GPU (QuACK's sm_90 kernels); none here"
    ]
