"""The MoK spec inside Megatron-Core's GPTModel: same losses and gradients as Megatron's own MoE layers."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    # attention TP needs sequence parallelism, which torch norms (no TE, no apex) do not support
    "layout",
    [(1, 1, 1), (1, 2, 1), (1, 2, 2), (1, 4, 1)],
    ids=["ep1", "ep2", "ep2-etp2", "ep4"],
)
def test_gpt_model_parity(pool, layout):
    tp, ep, etp = layout
    results = pool.run("tests.cases:gpt_parity_case", tp=tp, ep=ep, etp=etp, steps=3)
    for rank, res in enumerate(results):
        assert res["mok_layers"] == 2, "moe_layer_freq [1, 0, 1] must give two MoK layers and one dense"
        assert res["worst"] < 1e-5, f"rank {rank}: {res}"
        for l_ref, l_mok in res["losses"]:
            assert abs(l_ref - l_mok) < 1e-6


def test_gpt_model_with_mtp_layer(pool):
    """An MTP block built from the MoK decoder spec is MoK too, and still matches Megatron."""
    results = pool.run("tests.cases:gpt_parity_case", ep=2, steps=2, mtp=True)
    for res in results:
        assert res["mok_layers"] == 3  # two decoder MoE layers + the MTP layer's
        assert res["worst"] < 1e-5, res
