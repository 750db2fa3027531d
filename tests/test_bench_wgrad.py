"""``python -m benchmarks.wgrad`` on CPU: refused without ``--allow-cpu``; the N-call variants are checked
against the fp32 reference before timing, QuACK's variants are skipped with the reason, and a wrong
accumulation is caught."""

from __future__ import annotations

import pytest
import torch

from benchmarks import wgrad
from tests.sweeps import refusal_of


def test_tiny_runs_and_reports_every_variant():
    res = wgrad.bench_wgrad("tiny", calls=4, iters=2, warmup=1)
    names = [r["variant"] for r in res["rows"]]
    assert names == ["torch-one", "torch-one+add", "torch-sum", "torch-sum+add", "torch-acc", "torch-merged"]
    assert {s["variant"] for s in res["skipped"]} == {"quack-one", "quack-acc"}
    assert all("CUDA" in s["reason"] for s in res["skipped"])
    assert all(r["rel_err"] < 1e-5 for r in res["rows"] if "one" not in r["variant"])
    assert all(r["rel_err"] is None for r in res["rows"] if "one" in r["variant"])
    assert set(res["ratios"]) == {
        "torch-sum/torch-one",
        "torch-merged/torch-one",
        "torch-merged/torch-sum",
        "torch-acc/torch-one+add",
    }
    assert "| torch-acc |" in wgrad.markdown(res)


def test_an_accumulation_that_drops_a_call_is_caught(monkeypatch):
    real = wgrad._torch_wgrad
    calls = []

    def drop_one_call(dy, x, offs):
        # the fp32 reference makes calls 1-8 (fc1 and fc2 of 4 pieces); the variant's check 9-16:
        # its second piece's gradients (11, 12) go missing
        calls.append(1)
        out = real(dy, x, offs)
        return torch.zeros_like(out) if len(calls) in (11, 12) else out

    monkeypatch.setattr(wgrad, "_torch_wgrad", drop_one_call)
    with pytest.raises(RuntimeError, match="relative error"):
        wgrad.bench_wgrad("tiny", calls=4, iters=1, warmup=0, variants=("torch-sum",))


def test_calls_must_divide_the_rows():
    with pytest.raises(SystemExit):
        wgrad.main(["--shape", "tiny", "--calls", "3", "--allow-cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_refuses_a_cpu_in_one_line():
    refusal_of("wgrad", "--shape", "tiny", tiny="--shape tiny")
