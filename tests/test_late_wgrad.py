"""Late weight gradients (``experts.late_wgrad``): the pipelined layer's expert weight gradients wait until
the last dispatch-backward exchange is launched, then run while it flies.

gloo on CPU: EP=2 over the real pipeline (one and three minibatches, local rows overlapped and fused,
exact and sync-free) and one process per rank with the loopback transport (EP=4 emulated): the
gradients of the same layer without it over two accumulating backward passes (bitwise at one expert call;
at several, one weight-gradient GEMM per weight instead of one per call, equal to fp32 rounding), each weight's
post-accumulate hook (where Megatron's DDP hooks in) fired once per backward, and the queue run after
the last dispatch-backward exchange and before the packs' backward (which waits for the exchanges). The gate alone: its sums, and a
stranger's gradient rejected.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.experts.torch_mlp import WgradQueue
from mok_megatron.experts.late_wgrad import LateWgrad

CASE = "tests.pipeline_cases:late_wgrad_case"


def _check(results, calls_per_step):
    for rank, r in enumerate(results):
        for step, s in enumerate(r["steps"]):
            where = (rank, step, s)
            # one expert call: the same GEMM, bitwise; more: one GEMM per weight over all calls' rows
            assert s["bitwise"] if calls_per_step == 1 else s["close"], where
            assert s["wgrad_gemms"] == [2, 2 * calls_per_step], where
            assert s["expert_grads"] == ["experts.fc1_weight", "experts.fc2_weight"], where
            assert s["hooks_late"] == {"fc1_weight": 1, "fc2_weight": 1} == s["hooks_plain"], where
            assert s["late_wgrad_runs"] == 1 and s["plain_wgrad_runs"] == 0, where
            # two GEMMs (fc1, fc2) per expert call
            assert s["queued"] == [2 * calls_per_step], where
            assert s["after_last_dispatch_back"] and s["before_pack_backward"] and s["before_x_grad"], where


@pytest.mark.parametrize(
    "chunks,local_rows,sync_free,calls",
    [(1, "fused", False, 1), (1, "overlap", True, 2), (3, "overlap", False, 6), (3, "fused", True, 3)],
)
def test_late_wgrad_equal_and_ordered_ep2(pool, chunks, local_rows, sync_free, calls):
    opts = dict(minibatch_size=-(-32 // chunks), local_rows=local_rows, sync_free=sync_free)
    # overlap: region A (dispatch in flight) + the received rows; region B stays empty at these sizes
    _check(pool.run(CASE, ep=2, opts=opts, topk=4), calls)


def test_late_wgrad_loopback_one_rank(pool):
    _check(pool.run(CASE, ep=1, opts=dict(minibatch_size=16, local_rows="fused"), topk=4), 2)


def test_gate_sums_in_production_order_and_rejects_strangers():
    w1 = torch.nn.Parameter(torch.randn(2, 3, 4))
    w2 = torch.nn.Parameter(torch.randn(2, 4, 3))
    late = LateWgrad((w1, w2))
    late.open()
    s1, s2 = late.weights
    parts = [torch.randn(2, 3, 4) for _ in range(3)]
    for p in parts:
        late.queue.push(s1, lambda p=p: p)
    y = (s1.sum() + s2.sum()) * 0  # the stand-ins' own (zero) gradients add to the queued ones
    y.backward()
    assert torch.equal(w1.grad, (parts[0] + parts[1]) + parts[2])
    assert torch.equal(w2.grad, torch.zeros_like(w2))
    late.open()
    late.queue.push(torch.nn.Parameter(torch.zeros(1)), lambda: torch.zeros(1))
    with pytest.raises(RuntimeError, match="belongs to no weight of this gate"):
        (late.weights[0].sum() * 0).backward()
    assert isinstance(late.queue, WgradQueue)


def test_gate_keeps_no_reference_cycle():
    # Dropped without backward, a call's gate must be freed at once, with no garbage-collector run (a
    # cycle through its autograd node can be collected inside a later CUDA graph capture).
    import gc
    import weakref

    w = torch.nn.Parameter(torch.randn(4, 4))
    late = LateWgrad((w,))
    late.open()
    y = late.weights[0] * torch.randn(4, 4)
    refs = [weakref.ref(late), weakref.ref(late.weights[0])]
    gc.disable()
    try:
        del y, late
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_gate_refuses_a_gradient_outside_the_queue_under_fusion():
    """Under gradient accumulation fusion the gate hands autograd a dummy; a gradient reaching a stand-in
    from outside the queue would vanish in it, so the gate raises instead."""
    w = torch.nn.Parameter(torch.randn(2, 3))
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(2, 3), False
    late = LateWgrad((w,))
    late.open()
    late.queue.push(late.weights[0], lambda: (w.main_grad.add_(1.0), None)[1], main_grad_of=w)
    with pytest.raises(RuntimeError, match="outside the queue"):
        late.weights[0].sum().backward()
