"""``mok env``'s te backend lines on CPU: an H200 (sm_90), Transformer Engine, its cuBLASLt and its route
predicate are stood in for by fakes at ``compat``'s probes, so ``experts.te.route_for`` runs as on the GPU;
without TE or a GPU the ``missing`` lines say what is off."""

from __future__ import annotations

import pytest
import torch

from mok_megatron import compat
from mok_megatron.experts.backend import _fp8_recipe_name
from mok_megatron.tools import env

HOPPER = (9, 0)
LIB = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib"


@pytest.fixture
def hopper_te(monkeypatch):
    """sm_90 with TE 2.20.2 whose cuBLASLt is 13.5 (bf16 and tensorwise grouped, blockwise not yet) and an
    ``nvidia-cublas`` 13.10 wheel installed but not loaded."""
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", raising=False)
    for mod in (env, compat):
        monkeypatch.setattr(mod, "cuda_capability", lambda: HOPPER)
        monkeypatch.setattr(mod, "te_cublaslt_version", lambda: 130500)
    monkeypatch.setattr(env, "have_te", lambda: True)
    monkeypatch.setattr(env, "te_version", lambda: "2.20.2")
    monkeypatch.setattr(env, "te_single_grouped_weight_supported", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 7))
    monkeypatch.setattr(compat, "quantization_recipe", _fp8_recipe_name)  # the fake predicate reads the name
    monkeypatch.setattr(
        compat, "te_grouped_tensor_predicate", lambda: lambda recipe, dtype: recipe in (None, "tensorwise")
    )
    monkeypatch.setattr(compat, "cublas_wheel", lambda: compat.CublasWheel("13.10.0.20", LIB))


def test_env_lists_each_recipes_te_route_and_why(hopper_te):
    r = env.report()
    t = r["te_backend"]
    assert t["cublaslt"] == "13.5" and t["single_grouped_weight"] is True and "error" not in t
    assert list(t["routes"]) == ["bf16", "delayed", "tensorwise", "blockwise"]  # the recipes sm_90 runs
    assert t["routes"]["bf16"] == t["routes"]["tensorwise"] == "grouped"
    assert t["routes"]["delayed"] == "per-expert: TE's grouped GEMM does not take delayed on sm_90"
    assert t["routes"]["blockwise"] == (
        "per-expert: needs cuBLASLt >= 13.6 on sm_90, this process loaded 13.5; nvidia-cublas 13.10.0.20 is "
        f'installed but not loaded: start with LD_PRELOAD="{LIB}/libcublasLt.so.13 {LIB}/libcublas.so.13"'
    )
    text = env.format_report(r)
    head = "  --mok-expert-backend te: cuBLASLt 13.5, one grouped weight (--mok-te-single-weight): yes"
    lines = text.splitlines()
    at = lines.index(head)
    assert lines[at + 1 : at + 4] == [
        "    grouped GEMM     bf16, tensorwise",
        "    per-expert GEMMs delayed: TE's grouped GEMM does not take delayed on sm_90",
        "    per-expert GEMMs blockwise: " + t["routes"]["blockwise"].removeprefix("per-expert: "),
    ]
    assert lines[at + 4] == ""


def test_env_te_lines_say_the_switch_and_an_old_te(hopper_te, monkeypatch):
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", "0")
    monkeypatch.setattr(env, "te_single_grouped_weight_supported", lambda: False)
    lines = env.format_report(env.report()).splitlines()
    assert "one grouped weight (--mok-te-single-weight): no (TE >= 2.20)" in "\n".join(lines)
    assert [x for x in lines if "GEMM" in x and "--mok" not in x] == [
        "    per-expert GEMMs bf16, delayed, tensorwise, blockwise: NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=0"
    ]


def test_env_te_lines_report_a_te_that_raises(hopper_te, monkeypatch):
    def boom():
        raise RuntimeError("no device")

    monkeypatch.setattr(compat, "te_grouped_tensor_predicate", lambda: lambda recipe, dtype: boom())
    r = env.report()
    assert r["te_backend"]["routes"] == {}
    assert (
        "    routes           asking TE for the routes raised RuntimeError: no device" in env.format_report(r)
    )


def test_env_without_te_or_gpu_says_so_once_in_missing(monkeypatch):
    monkeypatch.setattr(env, "have_te", lambda: False)
    monkeypatch.setattr(env, "cuda_capability", lambda: None)
    r = env.report()
    assert r["te_backend"] is None
    text = env.format_report(r)
    assert "--mok-expert-backend te:" not in text
    missing = [m for m in r["missing"] if "--mok-expert-backend te" in m]
    assert [m.split(":")[0] for m in missing] == ["transformer-engine", "CUDA GPU"]
