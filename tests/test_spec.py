"""Specs: mokify keeps shared-expert builders and custom routers, swaps layer, experts, stock router."""

from __future__ import annotations

from functools import partial

import pytest

from megatron.core.transformer.moe.router import TopKRouter

import mok_megatron
from mok_megatron import spec as mok_spec
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.adapter.layer import MoKMoELayer
from mok_megatron.adapter.router import MoKTopKRouter


def test_layer_spec_swaps_layer_and_experts_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    base = get_gpt_layer_local_spec(num_experts=8)
    mok = mok_spec.get_gpt_layer_with_mok_spec(use_te=False)
    assert isinstance(mok.submodules.mlp, partial) and mok.submodules.mlp.func is MoKMoELayer
    sub, base_sub = mok.submodules.mlp.keywords["submodules"], base.submodules.mlp.keywords["submodules"]
    assert sub.experts is MoKGroupedMLP
    assert base_sub.router is TopKRouter and sub.router is MoKTopKRouter
    assert sub.shared_experts.func is base_sub.shared_experts.func
    assert mok.submodules.self_attention == base.submodules.self_attention
    assert base.submodules.mlp.func is not MoKMoELayer, "mokify must not modify its input"


def test_block_spec_follows_moe_layer_freq(single_rank):
    from tests.cases import tiny_gpt_config

    cfg = tiny_gpt_config(layers=4, moe_layer_freq=[1, 0, 0, 1])
    block = mok_spec.get_gpt_decoder_block_spec_with_mok(cfg, use_transformer_engine=False)
    kinds = [getattr(s.submodules.mlp, "func", None) for s in block.layer_specs]
    assert [k is MoKMoELayer for k in kinds] == [True, False, False, True]


def test_module_level_specs_for_megatron_lm_spec_flag():
    # Megatron-LM resolves `--spec mok_megatron.spec gpt_layer_local` with getattr(module, name).
    assert getattr(mok_spec, "gpt_layer_local").submodules.mlp.func is MoKMoELayer
    assert {"gpt_layer_local", "gpt_layer_te", "gpt_layer_te_mla"} <= set(dir(mok_spec))
    with pytest.raises(AttributeError, match="specs: "):
        getattr(mok_spec, "gpt_layer_nonexistent")


def test_package_exports_load_lazily():
    assert mok_megatron.MoKMoELayer is MoKMoELayer
    assert mok_megatron.get_gpt_layer_with_mok_spec is mok_spec.get_gpt_layer_with_mok_spec


def test_custom_router_is_kept():
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import InferenceTopKRouter

    sub = MoESubmodules(experts=None, router=InferenceTopKRouter)
    mlp = mok_spec._mok_mlp(partial(MoELayer, submodules=sub))
    assert mlp.keywords["submodules"].router is InferenceTopKRouter
    assert mlp.keywords["submodules"].experts is MoKGroupedMLP


def test_layer_options_reach_its_experts_and_dispatcher(single_rank):
    """Options given to a spec (or to mokify) are the options of every submodule of the layer: the experts
    and the dispatcher see the layer's, never a process-wide default."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mok_megatron.options import MoKOptions
    from mok_megatron.spec import get_gpt_layer_with_mok_spec, mokify
    from tests.cases import make_config

    cfg = make_config()
    opts = MoKOptions(nvlink_programs=7, late_wgrad=True)
    for spec in (
        get_gpt_layer_with_mok_spec(use_te=False, options=opts),
        mokify(get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts), options=opts),
    ):
        layer = spec.submodules.mlp(config=cfg)
        assert layer.mok_options is opts
        assert layer.experts.options is opts
        assert layer.token_dispatcher.options is opts
    default = get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp(config=cfg)
    assert default.experts.options == MoKOptions()
