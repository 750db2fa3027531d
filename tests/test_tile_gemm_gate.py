"""benchmarks/tile_gemm_gate.py as documented: the rows each expert receives, and one line on a machine
without an sm_90 GPU."""

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
