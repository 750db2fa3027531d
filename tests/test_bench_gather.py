"""``python -m benchmarks.gather`` on CPU: refused without ``--allow-cpu``; with it the tiny shape runs through
the command line, every torch variant is checked against the fp32 reference before timing, QuACK's variants
are skipped with the reason, and a wrong gradient is caught."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_quack
from benchmarks import gather
from mok_megatron.ops import gather_gemm
from tests.sweeps import refusal_of


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run: the GPU runs the QuACK variants instead")
def test_tiny_runs_from_the_command_line(capsys):
    assert gather.main(["--shape", "tiny", "--iters", "2", "--warmup", "1", "--allow-cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("torch-fwd", "torch-fwdbwd", "portable-fwdbwd"):
        assert f"| {name} | " in out
    assert "| quack-fwd | skipped: QuACK runs on CUDA GPUs only" in out
    assert "portable-fwdbwd/torch-fwdbwd:" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run: the GPU runs the QuACK variants instead")
def test_tiny_result_is_checked_and_complete():
    res = gather.bench_gather("tiny", iters=2, warmup=1)
    assert [r["variant"] for r in res["results"]] == ["torch-fwd", "torch-fwdbwd", "portable-fwdbwd"]
    assert {s["variant"] for s in res["skipped"]} == {"quack-fwd", "quack-fwdbwd"}
    assert all(r["rel_err"] < 1e-5 and r["ms"] > 0 for r in res["results"])
    assert res["rows"] == 32 * 2 and res["copy_mib"] == 64 * 64 * 4 / 2**20


def test_a_wrong_weight_gradient_is_caught(monkeypatch):
    real = gather_gemm._portable_wgrad
    monkeypatch.setattr(gather_gemm, "_portable_wgrad", lambda dy, x, w, offs: 0.5 * real(dy, x, w, offs))
    with pytest.raises(RuntimeError, match="portable-fwdbwd: relative error"):
        gather.bench_gather("tiny", iters=1, warmup=0, variants=("portable-fwdbwd",))


def test_unknown_shape_is_refused():
    with pytest.raises(SystemExit):
        gather.main(["gather", "--shape", "nope"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and have_quack()),
    reason="needs CUDA sm90+ and quack-kernels>=0.4.1",
)
def test_tiny_runs_every_variant_gpu():
    res = gather.bench_gather("tiny", iters=2, warmup=1)
    assert [r["variant"] for r in res["results"]] == list(gather.VARIANTS) and not res["skipped"]
    assert all(r["rel_err"] < 1e-2 for r in res["results"])
    assert set(res["ratios"]) == {f"{a}/{b}" for a, b in gather.RATIOS}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_refuses_a_cpu_in_one_line():
    refusal_of("gather", "--shape", "tiny", tiny="--shape tiny")
