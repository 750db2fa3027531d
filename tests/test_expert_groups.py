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
    opts = dict(minibatch_size=16, minibatch_split="experts", transport="loopback", loopback=dict(ep=8))
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
    from mok_megatron.engine.select import MEGATRON_EXPERTS, ExpertsContract, select_engine
    from mok_megatron.options import MoKOptions

    cfg = SimpleNamespace(
        capacity_factor=None,
        router_pad_multiple=0,
        etp_size=1,
        ep_size=1,
        megatron_overlap_flags=(),
        num_local_experts=4,
        topk=2,
    )
    opts = MoKOptions(minibatch_split="experts", transport="loopback")
    te = ExpertsContract(mok=True, host_counts=True)
    for contract, needle in ((MEGATRON_EXPERTS, "Megatron experts"), (te, "TE GroupedLinear")):
        with pytest.raises(MoKConfigError, match="--mok-minibatch-split experts needs MoK's torch") as e:
            select_engine(cfg, opts, None, contract)
        assert needle in str(e.value) and "--mok-expert-backend torch" in str(e.value)
    assert select_engine(cfg, opts, None, ExpertsContract(mok=True)).pipelined


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
