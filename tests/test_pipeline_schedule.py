"""The overlap engine's schedule, checked on CPU through the order of events and the op counts.

Local rows never travel; the dispatch is launched before region A's experts and the combine before
region B's; in backward, the combine-backward exchange starts before region B's backward and the
dispatch-backward before region A's (the late ``_Arrived`` nodes). gloo, 4 processes (EP=4), and
one process with the loopback transport standing in for EP=4. A pinned bound on the aten ops per
pipeline call (views excluded: those launch no kernel) keeps the host enqueue from growing unseen.
"""

from __future__ import annotations

import pytest

from mok_megatron.transport.base import COMBINE, DISPATCH
from tests import pipeline_cases as pc

# Measured (EP=4, 64 tokens, one minibatch, steady state, test experts included): plan 49 + forward
# 128 and backward 85 work ops; ~20 % headroom. Raise only with a reason: each op is a GPU launch.
MAX_FWD_OPS, MAX_BWD_OPS = 210, 105


def _expected_log(chunks: int) -> list:
    """Per minibatch forward: dispatch x + meta, A, remote, combine, B; then ``after_combines``. Backward: every minibatch's
    combine-backward exchange first (last minibatch first), then per minibatch in reverse: B,
    remote, its dispatch-backward (x + meta), A."""
    fwd = [("move", DISPATCH)] * 2 * chunks
    bwd = []
    for c in range(chunks):
        a, remote, b = 3 * c, 3 * c + 1, 3 * c + 2
        fwd += [("fwd", a), ("fwd", remote), ("move", COMBINE), ("fwd", b)]
        bwd = [("bwd", b), ("bwd", remote), ("move", COMBINE), ("move", COMBINE), ("bwd", a)] + bwd
    fwd += [("after_combines",)]  # the hook (the shared expert's fc2) sees every combine launched
    return fwd + [("forward_done",)] + [("move", DISPATCH)] * chunks + bwd


def _events(log):
    return [e[:2] for e in log]


@pytest.mark.parametrize("chunks", [1, 2])
def test_schedule_order_and_locality_ep4(pool, chunks):
    for rank, r in enumerate(pool.run("tests.pipeline_cases:schedule_case", chunks=chunks)):
        assert r["max_err"] < 1e-5, (rank, r["max_err"])
        assert r["x_grad"] and r["w_grad"]
        assert r["minibatches"] == chunks
        assert _events(r["log"]) == _expected_log(chunks), (rank, r["log"])
        # Only (token, other rank) rows travel; every sent row counted once.
        assert sum(r["remote_rows"]) == r["remote_pairs"]
        moved = [e[2] for e in r["log"] if e[0] == "move" and e[1] == DISPATCH][: 2 * chunks : 2]
        assert sum(moved) == r["remote_pairs"]


def test_host_ops_per_call_are_bounded(pool):
    one, two = (pool.run("tests.pipeline_cases:schedule_case", chunks=c) for c in (1, 2))
    for r1, r2 in zip(one, two, strict=True):
        assert r1["plan_ops"] + r1["fwd_ops"] <= MAX_FWD_OPS, r1["ops_by_name"]
        assert r1["bwd_ops"] <= MAX_BWD_OPS, r1["ops_by_name"]["bwd"]
        # A second minibatch adds at most one minibatch's worth of ops (no per-call blow-up).
        total = [r["plan_ops"] + r["fwd_ops"] + r["bwd_ops"] for r in (r1, r2)]
        assert total[1] <= 2 * total[0], total


def test_loopback_moves_the_emulated_share_with_full_bytes():
    # One process standing in for EP=4: region R (3/4 of the tokens) travels, 1/4 stays; the
    # link is charged the bytes of every token's remote rows, as before the local/remote split.
    tokens = 64
    r = pc.schedule_case(0, 1, emulated_ep=4, tokens=tokens)
    assert r["max_err"] < 1e-5
    assert r["remote_rows"] == [tokens - tokens // 4]
    assert r["local_here"] == [tokens // 4]
    assert _events(r["log"]) == _expected_log(1)
    row_bytes = pc.H * 4  # fp32 rows
    x_bytes = tokens * row_bytes * r["factor"]  # one dispatch of x, as if every token moved
    meta_bytes = tokens * 2 * pc.L * 4 * r["factor"]
    # forward: dispatch x + meta, combine; backward: the three reversed.
    assert r["bytes_moved"] == pytest.approx(2 * (2 * x_bytes + meta_bytes))


@pytest.mark.parametrize("emulated_ep", [1, 3, 32])
def test_region_labels_follow_the_host_rule(emulated_ep):
    # The device labels (counts, capturable) and the host rule (sizes) must agree on every token.
    import mok_megatron.engine.pipeline_plan as P

    for min_half in (1, 4, 256):
        with pc._MinLocalHalf(min_half):
            for T, size in ((1, 1), (7, 3), (64, 64), (100, 16), (1000, 333)):
                bounds = P.minibatch_bounds(T, size)
                expect = []
                for c in range(len(bounds) - 1):
                    r, a, b = P.regions(bounds[c + 1] - bounds[c], emulated_ep)
                    expect += [3 * c] * r + [3 * c + 1] * a + [3 * c + 2] * b
                got = P._labels(T, bounds[1] - bounds[0], emulated_ep, "cpu")
                assert got.tolist() == expect, (T, size, min_half)


@pytest.mark.parametrize("emulated_ep,ep", [(1, 1), (1, 3), (4, 1), (32, 1)])
def test_region_counts_are_the_host_rules_region_sums(emulated_ep, ep):
    # Counts by segment sums (no atomics) = each region's rows per (destination, local expert) and
    # token rows per destination, summed on the host from the host rule's regions; empty regions 0.
    import torch

    import mok_megatron.engine.pipeline_plan as P

    L = 3
    g = torch.Generator().manual_seed(emulated_ep * 10 + ep)
    for split_local in (True, False):
        for T, size in ((1, 1), (7, 3), (600, 600), (1100, 256), (2049, 700)):
            rm = torch.rand(T, ep * L, generator=g) < 0.3
            bounds = P.minibatch_bounds(T, size)
            got = P._counts(rm, bounds, ep, L, emulated_ep, split_local)
            for c in range(len(bounds) - 1):
                lo = bounds[c]
                for k, n in enumerate(P.regions(bounds[c + 1] - lo, emulated_ep, split_local)):
                    rows = rm[lo : lo + n].view(n, ep, L)
                    expect = torch.cat([rows.sum(0), rows.any(-1).sum(0, keepdim=True).t()], 1)
                    assert torch.equal(got[3 * c + k], expect), (T, size, c, k, split_local)
                    lo += n


def test_sync_free_local_rows_need_no_capacity(pool):
    # Every token routes to its own rank's experts: nothing travels, so even a tiny capacity
    # cannot overflow (local rows are never padded into the exchange buffers).
    for r in pool.run("tests.pipeline_cases:schedule_case", sync_free=True, capacity=0.05, to="own"):
        assert r["overflow"] is False
        assert r["max_err"] < 1e-5 and r["x_grad"] and r["w_grad"]


def test_sync_free_overflow_counts_remote_rows(pool):
    # Every token routes to rank 0: ranks 1..3 send all 64 tokens there, over a capacity of ~3.
    for r in pool.run("tests.pipeline_cases:schedule_case", sync_free=True, capacity=0.05, to="rank0"):
        assert r["overflow"] is True
    # With room for every token the same routing fits, and the result is exact.
    for r in pool.run("tests.pipeline_cases:schedule_case", sync_free=True, capacity=1.0, to="rank0"):
        assert r["overflow"] is False
        assert r["max_err"] < 1e-5


def test_sync_free_pipeline_moves_no_host_data(pool):
    # Sync-free mode must be capturable in a CUDA graph: no host read, no tensor built from Python
    # values, no Python-list index anywhere in the plan, forward or backward (exact mode reads the
    # counts once, by design).
    for r in pool.run("tests.pipeline_cases:schedule_case", sync_free=True, chunks=2):
        assert r["host_data"] == [] and r["max_err"] < 1e-5, r["host_data"]
    # also with the expert rows padded by the permute (the native FP8 experts' layout)
    for r in pool.run("tests.pipeline_cases:schedule_case", sync_free=True, chunks=2, fuse=True, align=16):
        assert r["host_data"] == [] and r["max_err"] < 1e-5, r["host_data"]
    exact = pool.run("tests.pipeline_cases:schedule_case", chunks=1)
    assert all(any("tolist" in h or "cpu" in h for h in r["host_data"]) for r in exact)


@pytest.mark.parametrize("sync_free", [False, True])
def test_fused_local_rows_one_expert_call_per_minibatch(pool, sync_free):
    # --mok-local-rows fused: no region B, the local rows run in the received rows' expert call
    # (one call per minibatch, after the dispatch lands); results as exact as the split schedule.
    split = pool.run("tests.pipeline_cases:schedule_case", chunks=2, sync_free=sync_free)
    fused = pool.run("tests.pipeline_cases:schedule_case", chunks=2, sync_free=sync_free, fuse=True)
    for s, f in zip(split, fused, strict=True):
        assert f["max_err"] < 1e-5 and f["x_grad"] and f["w_grad"]
        calls = [e for e in f["log"] if e[0] == "fwd"]
        assert len(calls) == f["minibatches"] == 2
        # Each call comes after its minibatch's dispatch and before its combine.
        moves = [i for i, e in enumerate(f["log"]) if e[0] in ("move", "fwd")]
        kinds = [f["log"][i][0] if f["log"][i][0] == "fwd" else f["log"][i][1] for i in moves]
        assert kinds[:4] == [DISPATCH, DISPATCH, DISPATCH, DISPATCH] and kinds[4:6] == ["fwd", COMBINE]
        assert len([e for e in s["log"] if e[0] == "fwd"]) > 2  # the split schedule calls more
        assert f["fwd_ops"] < s["fwd_ops"] and f["bwd_ops"] < s["bwd_ops"]
        if sync_free:
            assert f["host_data"] == []


def test_fp8_dispatch_halves_the_dispatched_bytes():
    # Loopback (one process standing in for EP=4): the same call with FP8 dispatch moves each
    # dispatched fp32 row of H=16 values (64 bytes) as 16 e4m3 bytes + a 4-byte scale padded to 32;
    # the combine and every backward exchange keep their bytes.
    full, fp8 = (pc.schedule_case(0, 1, emulated_ep=4, tokens=64, fp8=f) for f in (False, True))
    assert fp8["max_err"] < 0.1 * max(1.0, full["max_err"] + 1.0) and fp8["x_grad"] and fp8["w_grad"]
    # The loopback charges region R's rows as the minibatch's whole exchange (x Tc / r): all 64 tokens.
    saved = 64 * (pc.H * 4 - 32) * full["factor"]
    assert abs((full["bytes_moved"] - fp8["bytes_moved"]) - saved) < 1e-6 * full["bytes_moved"]


@pytest.mark.parametrize("loopback_bytes", ["copy", "link"])
def test_loopback_bytes_option_keeps_the_link_bytes(loopback_bytes):
    # 'link' drops the emulated rank's copies (GPU only: the received rows are the sent ones), never the
    # bytes the link time is charged for: both settings count the same bytes and return the same rows.
    import torch

    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    tr = LoopbackTransport(LoopbackLink(ep=8, gbps=900.0, bytes=loopback_bytes), num_local_experts=8, topk=2)
    assert tr.copies is (loopback_bytes == "copy")
    x = torch.randn(12, 16)
    out = tr.move(x, None, DISPATCH)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert tr.bytes_moved == pytest.approx(x.numel() * 4 * tr.factor) and tr.factor > 1
