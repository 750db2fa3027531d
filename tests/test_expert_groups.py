"""The pipeline split by experts (``--mok-minibatch-split experts``): each minibatch is every token through one
group of local experts (``engine.pipeline_plan``, ``experts.groups``).

gloo on CPU at EP 2 and 4: Megatron's alltoall MoELayer is the reference for any number of groups, both
local-row placements, exact and sync-free; the same layer split by tokens gives the same output and input
gradient and, summed in another order, the same weight gradients to fp32 rounding; with local rows fused
the backward sums no weight gradients (split by tokens it does, the measure's negative control); with
gradient accumulation fusion each group's GEMMs fill their slice of ``main_grad``, one pass over it in all
(split by tokens: one pass per minibatch). Bitwise repeatable.
"""

from __future__ import annotations

import math

import pytest

from mok_megatron.engine.pipeline_plan import expert_bounds
from tests.test_pipeline import check

TOKENS = 32  # seq 16 x batch 2 per rank


@pytest.mark.parametrize(
    "ep,groups,topk,local_rows,sync_free",
    [
        (2, 2, 2, "overlap", False),
        (2, 4, 8, "fused", False),
        (2, 3, 8, "overlap", True),
        (4, 2, 4, "fused", True),
        (4, 2, 8, "overlap", False),
    ],
)
def test_expert_split_matches_megatron(pool, ep, groups, topk, local_rows, sync_free):
    opts = dict(
        minibatch_size=math.ceil(TOKENS / groups),
        minibatch_split="experts",
        local_rows=local_rows,
        sync_free=sync_free,
    )
    for r in pool.run("tests.pipeline_cases:megatron_case", ep=ep, topk=topk, opts=opts, min_local_half=2):
        check(r, f"experts ep{ep} groups{groups} k{topk} {local_rows}")
        assert r["pipeline_calls"] == 1
        assert r["overflow_redos"] == 0


def test_expert_split_loopback_matches_megatron(pool):
    # One rank emulating EP=8, 4 local experts in 2 groups: the layer's result is the EP=1 result.
    opts = dict(minibatch_size=16, minibatch_split="experts", loopback=dict(ep=8))
    for r in pool.run("tests.pipeline_cases:megatron_case", ep=1, topk=2, num_experts=4, opts=opts):
        check(r, "experts loopback")
        assert r["pipeline_calls"] == 1


@pytest.mark.parametrize("fusion", [False, True])
def test_expert_split_sums_no_weight_gradients(pool, fusion):
    # 4 local experts in 4 groups, local rows fused: one expert call per weight slice.
    opts = dict(local_rows="fused")
    for r in pool.run(
        "tests.expert_groups_cases:split_case", ep=2, chunks=4, topk=4, opts=opts, fusion=fusion
    ):
        assert r["bounds"] == [(0, 1, 2, 3, 4)], r
        # the same products, each token's rows summed group by group: equal to fp32 rounding
        assert r["out"] <= 1e-5 * r["out_scale"] and r["dx"] <= 1e-5 * r["dx_scale"], r
        assert r["grads"] <= 1e-5 * r["grad_scale"], r
        assert r["sums_experts"] == 0, r
        if fusion:  # every call adds into main_grad: split by experts, each slice once
            assert r["passes_experts"] == 1.0 and r["passes_tokens"] == 4.0, r
        else:
            assert r["sums_tokens"] > 0 and r["passes_tokens"] == 0, r  # the measure sees the sums
        assert r["added"] == [fusion, fusion], r
        assert r["bitwise"], r


def test_expert_bounds():
    assert expert_bounds(8, 3) == (0, 3, 6, 8)
    assert expert_bounds(4, 4) == (0, 1, 2, 3, 4)
    assert expert_bounds(2, 5) == (0, 1, 2)  # at most one group per local expert
    assert expert_bounds(5, 1) == (0, 5)


def test_expert_split_option_errors_name_the_fix():
    from mok_megatron.options import MoKOptions, MoKOptionsError

    with pytest.raises(MoKOptionsError, match="--mok-late-wgrad.*Drop one of them"):
        MoKOptions(minibatch_split="experts", late_wgrad=True)
    with pytest.raises(MoKOptionsError, match="--mok-engine plain runs no pipeline.*--mok-minibatch-split"):
        MoKOptions(engine="plain", minibatch_split="experts")
    with pytest.raises(MoKOptionsError, match="--mok-minibatch-split='rows': choose one of tokens, experts"):
        MoKOptions(minibatch_split="rows")
    assert "--mok-minibatch-split experts" in MoKOptions(minibatch_split="experts").pipeline_only()


def test_expert_split_refuses_experts_without_device_counts():
    from types import SimpleNamespace

    from mok_megatron.config import MoKConfigError
    from mok_megatron.engine.select import select_engine
    from mok_megatron.experts_contract import MEGATRON_EXPERTS, ExpertsContract
    from mok_megatron.options import MoKOptions
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    cfg = SimpleNamespace(
        capacity_factor=None,
        router_pad_multiple=0,
        etp_size=1,
        ep_size=1,
        megatron_overlap_flags=(),
        num_local_experts=4,
        topk=2,
        delay_wgrad=False,
    )
    opts = MoKOptions(minibatch_split="experts")
    loopback = LoopbackTransport(LoopbackLink(), num_local_experts=4, topk=2)
    te = ExpertsContract(mok=True, host_counts=True)
    for contract, needle in ((MEGATRON_EXPERTS, "Megatron experts"), (te, "TE GroupedLinear")):
        with pytest.raises(MoKConfigError, match="--mok-minibatch-split experts needs MoK's torch") as e:
            select_engine(cfg, opts, None, contract, loopback)
        assert needle in str(e.value) and "--mok-expert-backend torch" in str(e.value)
    assert select_engine(cfg, opts, None, ExpertsContract(mok=True), loopback).pipelined
    cfg.delay_wgrad = True  # Megatron's delay_wgrad_compute: refused when the layer is built
    with pytest.raises(MoKConfigError, match="delay_wgrad_compute.*Drop --delay-wgrad-compute or"):
        select_engine(cfg, opts, None, ExpertsContract(mok=True), loopback)


def test_minibatch_split_flag_reaches_the_options():
    import argparse

    from mok_megatron.training.arguments import add_mok_flags, options_from_args

    parser = argparse.ArgumentParser()
    add_mok_flags(parser)
    assert (
        options_from_args(parser.parse_args(["--mok-minibatch-split", "experts"])).minibatch_split
        == "experts"
    )
    assert options_from_args(parser.parse_args([])).minibatch_split == "tokens"


@pytest.mark.parametrize("local_rows", ["overlap", "fused"])
def test_uneven_groups_top1_match_megatron_bitwise_repeatable(pool, local_rows):
    # 6 experts at EP 2: 3 local experts in 2 groups (2 + 1); top-1 leaves most tokens with one group.
    opts = dict(minibatch_size=16, minibatch_split="experts", local_rows=local_rows)
    res = pool.run(
        "tests.pipeline_cases:megatron_case",
        ep=2,
        topk=1,
        num_experts=6,
        opts=opts,
        min_local_half=2,
        repeat=True,
    )
    for r in res:
        check(r, f"uneven groups top-1 {local_rows}")
        assert r["bitwise"] and r["overflow_redos"] == 0, r
        assert len(r["tokens_per_expert"]) == 3, r


def test_probs_on_input_top1_matches_megatron(pool):
    opts = dict(minibatch_size=16, minibatch_split="experts")
    for r in pool.run(
        "tests.pipeline_cases:megatron_case",
        ep=2,
        topk=1,
        num_experts=6,
        opts=opts,
        min_local_half=2,
        moe_apply_probs_on_input=True,
    ):
        check(r, "experts probs on input")


def test_overflow_redo_with_a_group_no_token_uses(pool):
    # Every token to experts 0 and 1 (rank 0, group 0 of (0, 2, 3)): group 1 gets no row on any rank,
    # rank 1 none at all, and a capacity of 1/8 of the tokens overflows: the call is redone with exact
    # sizes, nothing dropped (with the overlapped shared expert, whose fc2 must run once per call).
    opts = dict(minibatch_size=16, minibatch_split="experts", sync_free=True, capacity_multiplier=0.125)
    res = pool.run(
        "tests.pipeline_cases:megatron_case",
        ep=2,
        topk=2,
        num_experts=6,
        opts=opts,
        min_local_half=2,
        shared=True,
        shared_overlap=True,
        score="sigmoid",
        moe_router_enable_expert_bias=True,
        router_bias={0: 100.0, 1: 100.0},
    )
    for rank, r in enumerate(res):
        check(r, "experts overflow redo")
        assert r["overflow_redos"] == 1, r
        ep_rank = rank % 2  # world 4 at EP 2: ranks 0 and 2 hold experts 0-2
        counts = r["tokens_per_expert"]
        assert counts[2] == 0 and (counts[0] > 0) == (ep_rank == 0) and (counts[1] > 0) == (ep_rank == 0), r


@pytest.mark.parametrize("fusion", [False, True])
def test_uneven_groups_top1_weight_gradients(pool, fusion):
    # 3 local experts in 2 groups at EP 2, top-1: each group's slice of each weight gradient (of main_grad
    # under fusion: one pass over it, the dummy handed once) equals the split by tokens'.
    for r in pool.run(
        "tests.expert_groups_cases:split_case", ep=2, chunks=2, topk=1, num_experts=6, fusion=fusion
    ):
        assert r["bounds"] == [(0, 2, 3)], r
        assert r["out"] <= 1e-5 * r["out_scale"] and r["dx"] <= 1e-5 * r["dx_scale"], r
        assert r["grads"] <= 1e-5 * r["grad_scale"] and r["sums_experts"] == 0, r
        assert r["added"] == [fusion, fusion] and r["bitwise"], r
        if fusion:
            assert r["passes_experts"] == 1.0, r


def test_moe_act_recompute_bitwise(pool):
    opts = dict(engine="pipeline", minibatch_size=128, minibatch_split="experts")
    for r in pool.run("tests.composability_cases:recompute_act_case", ep=2, opts=opts, num_experts=6):
        assert r["pipelined"] and r["bitwise"], r
        assert r["experts_saved_bytes"][1] < r["experts_saved_bytes"][0], r


@pytest.mark.parametrize(
    "kw", [dict(), dict(fuse=True), dict(align=16), dict(local_experts=3, groups=3, topk=1)], ids=str
)
def test_sync_free_expert_split_moves_no_host_data(pool, kw):
    # Capturable in a CUDA graph: no host read, no tensor from Python values, in the plan, forward or backward.
    for r in pool.run("tests.expert_groups_cases:host_data_case", **kw):
        if r is None:
            continue
        assert r["host_data"] == [] and r["max_err"] < 1e-5 and r["grads"], r
        bounds = r["bounds"]
        assert r["calls"] == list(zip(bounds[:-1], bounds[1:], strict=True)), r


def test_torch_fp8_experts_split_by_experts_within_fp8_error(pool):
    # Native FP8 experts (GEMMs emulated in fp32 on CPU) through group views of their weights; split by
    # experts the permute is not fused into the FP8 operands (no token_rows_fn).
    opts = dict(minibatch_size=16, minibatch_split="experts", sync_free=True)
    for r in pool.run("tests.pipeline_cases:fp8_token_rows_case", ep=2, num_experts=6, opts=opts):
        assert r["fused_calls"] == 0 and r["bitwise"], r
        assert 1e-3 < r["min_rel_err"] and r["max_rel_err"] < 0.1, r


def test_expert_split_without_a_size_makes_four_groups(pool):
    # 16 experts at EP 2: 8 local experts, the automatic 4 groups (engine.pipeline_plan.AUTO_EXPERT_GROUPS)
    opts = dict(local_rows="fused")
    for r in pool.run(
        "tests.expert_groups_cases:split_case", ep=2, chunks=None, topk=4, num_experts=16, opts=opts
    ):
        assert r["bounds"] == [(0, 2, 4, 6, 8)], r
        assert r["grads"] <= 1e-5 * r["grad_scale"], r
