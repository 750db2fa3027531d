"""Whole-model checkpoints: inside a GPTModel, Megatron renames the keys of MoK's expert factories
(TransformerBlock moves ``layers.{i}.`` into a layer axis; optimizer state gets a prefix). The built
ShardedTensors must follow the renamed keys, exactly as Megatron's own SequentialMLP's do."""

from __future__ import annotations

import pytest


def _built_keys(sharded: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    apply_factories(sharded)
    return {
        (t.key, t.global_offset, t.global_shape)
        for t in nested_values(sharded)
        if isinstance(t, ShardedTensor) and ".experts." in t.key
    }


@pytest.mark.usefixtures("single_rank")
def test_gpt_expert_keys_match_megatron_and_follow_optimizer_prefix():
    import torch
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from mok_megatron.tools.demo import DemoArgs, build_model

    # every layer MoE: TransformerBlock folds `layers.{i}.` into a layer axis of the sharded tensors
    _, mok = build_model(DemoArgs(nproc=1, layers=2, hidden=32, experts=4, layer="mok"), ep=1)
    _, ref = build_model(DemoArgs(nproc=1, layers=2, hidden=32, experts=4, layer="megatron"), ep=1)
    got, want = _built_keys(mok.sharded_state_dict()), _built_keys(ref.sharded_state_dict())
    assert got == want
    assert {k for k, _, _ in got} == {
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc2.weight",
    }

    factory = mok.sharded_state_dict()["decoder.layers.1.mlp.experts.fc2_weight"]
    opt_sh = make_sharded_optimizer_tensor(factory, torch.zeros_like(factory.data), "optimizer.state.exp_avg")
    keys = {k for k, _, _ in _built_keys({"x": opt_sh})}
    assert keys == {"optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"}
