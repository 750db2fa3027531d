"""Checkpoints: dist_checkpointing round trips (also across layouts and parallel sizes) and plain
state-dict conversion between MoK, SequentialMLP and TEGroupedMLP layouts."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.experts.checkpoint import LAYOUTS, convert_state_dict, detect_layout, expert_prefixes

# (kind, tp, ep, etp)
RESHARD = [
    (("mok", 1, 2, 1), ("mok", 1, 2, 1)),  # same layout: everything bitwise, router included
    (("mok", 1, 2, 1), ("mok", 1, 4, 1)),  # EP resharding
    (("mok", 2, 2, 2), ("mok", 1, 1, 1)),  # expert-TP 2 -> 1 (SwiGLU halves re-split), EP 2 -> 1
    (("megatron", 1, 2, 1), ("mok", 1, 4, 1)),  # resume a Megatron SequentialMLP checkpoint with MoK
    (("mok", 1, 4, 1), ("megatron", 2, 1, 2)),  # and go back, with a different layout
]


@pytest.mark.parametrize("save,load", RESHARD, ids=lambda s: "-".join(map(str, s)))
def test_dist_checkpointing_round_trip(pool, tmp_path_factory, save, load):
    path = str(tmp_path_factory.mktemp("ckpt"))
    results = pool.run("tests.cases:dist_ckpt_case", path=path, save=save, load=load)
    for rank, res in enumerate(results):
        assert res["expert_keys"] == ["experts.fc1_weight", "experts.fc2_weight"]
        assert all(res["bitwise"].values()), f"rank {rank}: {res['bitwise']}"
        assert all(res["changed_by_load"].values()), "the fresh layer already had the saved weights"
        if res["router_bitwise"] is not None:
            assert res["router_bitwise"]


def test_dist_checkpointing_non_gated_activation(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    results = pool.run(
        "tests.cases:dist_ckpt_case", path=path, save=("mok", 2, 2, 2), load=("megatron", 1, 4, 1), act="gelu"
    )
    assert all(all(r["bitwise"].values()) for r in results)


@pytest.mark.parametrize(
    "save,load", [(("megatron", 1, 2, 1), ("mok", 1, 2, 1)), (("mok", 2, 2, 2), ("megatron", 2, 2, 2))]
)
def test_dist_checkpointing_singleton_local_shards(pool, tmp_path_factory, save, load):
    """Megatron's `singleton_local_shards` format (one key per global expert) interchanges too."""
    path = str(tmp_path_factory.mktemp("ckpt"))
    results = pool.run("tests.cases:dist_ckpt_case", path=path, save=save, load=load, singleton=True)
    assert all(all(r["bitwise"].values()) and all(r["changed_by_load"].values()) for r in results)


def _model_sd(num_layers=2, experts=4, f1=16, h=8, f=8):
    g = torch.Generator().manual_seed(0)
    sd = {"embedding.word_embeddings.weight": torch.randn(32, h, generator=g)}
    for layer in range(num_layers):
        p = f"decoder.layers.{layer}.mlp."
        sd[p + "router.weight"] = torch.randn(experts, h, generator=g)
        sd[p + "shared_experts.linear_fc1.weight"] = torch.randn(f1, h, generator=g)
        for i in range(experts):
            sd[p + f"experts.local_experts.{i}.linear_fc1.weight"] = torch.randn(f1, h, generator=g)
            sd[p + f"experts.local_experts.{i}.linear_fc2.weight"] = torch.randn(h, f, generator=g)
            sd[p + f"experts.local_experts.{i}.linear_fc1._extra_state"] = None
            sd[p + f"experts.local_experts.{i}.linear_fc2._extra_state"] = None
    return sd


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] is None and b[k] is None, k


def test_state_dict_conversion_round_trips_exactly():
    seq = _model_sd()
    assert expert_prefixes(seq) == ["decoder.layers.0.mlp.experts.", "decoder.layers.1.mlp.experts."]
    mok = convert_state_dict(seq, "mok")
    assert detect_layout(mok, "decoder.layers.1.mlp.experts.") == "mok"
    assert mok["decoder.layers.0.mlp.experts.fc1_weight"].shape == (4, 16, 8)
    assert torch.equal(
        mok["decoder.layers.0.mlp.experts.fc2_weight"][3],
        seq["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"],
    )
    te = convert_state_dict(mok, "te_grouped")
    assert torch.equal(
        te["decoder.layers.1.mlp.experts.linear_fc1.weight2"],
        seq["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"],
    )
    assert "decoder.layers.1.mlp.experts.linear_fc1._extra_state" in te
    # every path back lands on the same tensors
    _same(convert_state_dict(te, "sequential"), seq)
    _same(convert_state_dict(convert_state_dict(te, "mok"), "sequential"), seq)
    _same(convert_state_dict(convert_state_dict(seq, "te_grouped"), "mok"), mok)
    for layout in LAYOUTS:  # converting to the layout a dict is already in changes nothing
        once = convert_state_dict(seq, layout)
        _same(convert_state_dict(once, layout), once)


def test_conversion_refuses_a_wrong_expert_count():
    from mok_megatron.experts.checkpoint import to_mok_layout

    sd = _model_sd(num_layers=1)
    with pytest.raises(ValueError, match=r"has 4 experts in the sequential layout, this MoK layer holds 2"):
        to_mok_layout(sd, "decoder.layers.0.mlp.experts.", num_local_experts=2)
