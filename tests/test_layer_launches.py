"""How much work one MoK layer forward+backward issues, pinned so that fused passes stay fused.

CPU (``tests.layer_launches`` under ``TRITON_INTERPRET=1``, the GPU's code paths): aten ops that do work plus
Triton launches per step, the six fused kernels by name, no unfused activation / permute ops left in MoK's
part, and the fused layer equal to the torch-path layer. GPU: CUDA kernels per step from torch.profiler on a
Qwen3-30B-A3B-like layer (fewer tokens), and no host synchronisation inside the MoK layer's forward+backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton

REPO = Path(__file__).resolve().parents[1]
# Measured 58 aten ops + 6 Triton launches (of which Megatron's router and aux loss: 25 forward + ~20 backward).
MAX_OPS_PER_STEP = 70
FUSED = Counter(
    {
        "_scatter_kernel": 2,
        "_gather_sum_kernel": 2,
        "_swiglu_fwd_kernel": 1,
        "_swiglu_bwd_kernel": 1,
        # the router's top-k (routing and the aux-loss map: MoKTopKRouter) and the plan's expert ids
        # from Megatron's dense routing map (engine.plan.build_aligned_plan)
        "_topk_kernel": 3,
        # the plan's routing metadata (kernels.routing: no sort)
        "_rank_in_block_kernel": 1,
        "_scan_kernel": 1,
        "_place_kernel": 1,
    }
)
# What the fused kernels replaced: none of these may come back in MoK's part of the step.
UNFUSED = {"silu", "silu_backward", "cat", "index_select", "index_put", "index_add", "mul", "add", "copy_"}
MOK_BACKWARD_NODES = ("_Permute", "_Combine", "_SwiGLU", "_GroupedLinear", "_Linear", "_ActFc2")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    if not have_triton():
        pytest.skip("Triton is not installed")
    if torch.cuda.is_available():  # Megatron's router moves CPU weights to a GPU wherever one exists
        pytest.skip("counts the CPU (interpreter) run; on a GPU host the GPU tests below count launches")
    out = tmp_path_factory.mktemp("launches") / "ops.json"
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tests.layer_launches", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_ops_per_step_stay_under_the_pinned_bound(counted):
    total = len(counted["aten"]) + len(counted["triton"])
    assert total <= MAX_OPS_PER_STEP, Counter(op for op, _ in counted["aten"]).most_common(12)


def test_the_fused_kernels_run_once_each_per_pass(counted):
    assert Counter(counted["triton"]) == FUSED


def test_no_unfused_elementwise_pass_left_in_moks_part(counted):
    mine = [
        (op, where)
        for op, where in counted["aten"]
        if where.startswith("fwd mok") or where.startswith(tuple(f"bwd {n}" for n in MOK_BACKWARD_NODES))
    ]
    assert mine, "no op was attributed to MoK: the attribution is broken"
    assert not [(op, where) for op, where in mine if op in UNFUSED]


def test_fused_layer_matches_the_torch_path_layer(counted):
    assert counted["max_rel_err"] < 3e-2  # bf16: the fused SwiGLU rounds once, Megatron's ops twice


# ---- on the GPU ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# 151 CUDA kernels per step with the unfused torch ops the Triton kernels replace (measured on one H200).
MAX_CUDA_KERNELS_PER_STEP = 120


def _gpu_layer():
    from mok_megatron.bench.build import layer_config, build

    shape = dict(hidden=2048, ffn=768, experts=128, topk=8, tokens=4096)
    torch.manual_seed(0)
    layer = build("mok", layer_config(shape, torch.bfloat16)).cuda()
    x = torch.randn(shape["tokens"], 1, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x) * 1e-2

    def step():
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x.detach().requires_grad_(True))
        out.backward(dout)

    for _ in range(2):  # compile the Triton kernels, warm the allocator
        step()
    torch.cuda.synchronize()
    return step


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("single_rank")
def test_cuda_kernels_per_step_on_gpu():
    from torch.profiler import ProfilerActivity, profile

    step = _gpu_layer()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"\nMoK layer fwd+bwd: {len(kernels)} CUDA kernels/memsets per step")
    assert len(kernels) <= MAX_CUDA_KERNELS_PER_STEP, Counter(e.name[:60] for e in kernels).most_common(15)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("single_rank")
def test_layer_step_needs_no_host_sync_on_gpu():
    step = _gpu_layer()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
