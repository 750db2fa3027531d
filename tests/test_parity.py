"""MoK layer vs Megatron-Core's own MoELayer (alltoall dispatcher), multi-process on CPU with gloo.

Same weights (copied through load_state_dict), same per-rank input and upstream gradient. Checked:
forward output, input gradient, every expert / shared-expert / router weight gradient (the router's
includes the aux-loss gradient), and the logged aux / z losses. fp32 throughout.

Routing here is Megatron's own on both sides: on CPU tensors (outside Triton's interpreter)
``MoKTopKRouter`` keeps Megatron's ``torch.topk`` selection. Its Triton selection and its tie rule
(equal scores to the lower expert index) are held against Megatron's router in ``tests/kernel_cases.py``
(``router/*``).
"""

from __future__ import annotations

import itertools

import pytest

# (attention TP, EP, expert TP) layouts on 4 ranks.
LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 1, 2), (2, 2, 2), (2, 2, 1), (2, 4, 1)]
TOPK = [1, 2, 8]
SCORES = ["softmax", "sigmoid"]
MODES = ["dropless", "drop_probs", "drop_position", "pad_probs", "pad_position", "rpad16", "rpad32"]
SHARED = [dict(), dict(shared=True), dict(shared=True, shared_overlap=True)]

# fp32: the MoK path does the same arithmetic in the same order as Megatron's except where it is
# more careful (fp32 sums in combine); differences are at rounding level of the output's scale.
RTOL = 1e-5
ATOL = 1e-7


def check(res: dict, where: str) -> None:
    bad = []
    for key, diff in res.items():
        if key in ("aux_names", "tokens_per_expert") or key.endswith("_scale"):
            continue
        scale = res["dx_scale"] if key == "dx" else res["out_scale"] if key == "out" else 1.0
        scale = res.get(f"{key}_scale", scale)  # a gradient: relative to its own magnitude
        if not diff <= ATOL + RTOL * max(scale, 1.0):
            bad.append(f"{key}: {diff:.3e}")
    assert not bad, f"{where}: MoK differs from Megatron: " + ", ".join(bad)


def _grid():
    cases = []
    for n, (layout, topk, score, mode) in enumerate(itertools.product(LAYOUTS, TOPK, SCORES, MODES)):
        shared = SHARED[n % len(SHARED)]  # every shared-expert setting meets every layout and mode
        cases.append(
            pytest.param(
                layout,
                topk,
                score,
                mode,
                shared,
                id=f"tp{layout[0]}-ep{layout[1]}-etp{layout[2]}-k{topk}-{score}-{mode}-{'+'.join(shared) or 'noshared'}"
                + ("-overlap" if shared.get("shared_overlap") else ""),
            )
        )
    return cases


@pytest.mark.parametrize("layout,topk,score,mode,shared", _grid())
def test_parity_grid(pool, layout, topk, score, mode, shared):
    tp, ep, etp = layout
    results = pool.run(
        "tests.cases:parity_case", tp=tp, ep=ep, etp=etp, topk=topk, score=score, mode=mode, **shared
    )
    for rank, res in enumerate(results):
        check(res, f"rank {rank}")
        assert res["out_scale"] > 0.1, "outputs too small for the comparison to mean anything"
        assert "load_balancing_loss" in res["aux_names"]


FEATURES = {
    "expert_bias": dict(
        score="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3
    ),
    "group_limited": dict(topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss"),
    "aux_and_seq_aux": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[1e-2, 1e-3]
    ),
    "z_loss": dict(moe_z_loss_coeff=1e-3),
    "topk_scaling": dict(topk=4, score="sigmoid", moe_router_topk_scaling_factor=2.5),
    "probs_on_input": dict(topk=1, moe_apply_probs_on_input=True),
    "geglu": dict(act="geglu"),
    "gelu": dict(act="gelu"),
    "relu": dict(act="relu"),
    "squared_relu": dict(act="squared_relu"),
    "quick_geglu_clamp": dict(act="quick_geglu_clamp"),
    "shared_gate": dict(shared=True, moe_shared_expert_gate=True),
    "shared_gate_overlap": dict(shared=True, shared_overlap=True, moe_shared_expert_gate=True),
    "router_fp32": dict(moe_router_dtype="fp32"),
    "sixteen_experts": dict(num_experts=16, topk=6),
}


@pytest.mark.parametrize(
    "layout,feature",
    # layout-major order: each layout change rebuilds Megatron's process groups in every worker
    [
        pytest.param(lay, f, id=f"{name}-{f}")
        for lay, name in (((1, 2, 1), "ep2"), ((2, 2, 2), "tp2-ep2-etp2"))
        for f in sorted(FEATURES)
    ],
)
def test_parity_features(pool, feature, layout):
    """Megatron's routing and expert features, two steps each (router state carries over)."""
    tp, ep, etp = layout
    kw = dict(FEATURES[feature])
    results = pool.run("tests.cases:parity_case", tp=tp, ep=ep, etp=etp, steps=2, **kw)
    for rank, res in enumerate(results):
        check(res, f"rank {rank}")
    if "aux" in feature:
        expected = {
            "seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss",
        }
        for k, name in expected.items():
            if k in feature:
                assert name in results[0]["aux_names"]
    if feature == "z_loss":
        assert "z_loss" in results[0]["aux_names"]
