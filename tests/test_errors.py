"""Bad settings fail with a clear error that names the value, before any collective runs."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_te
from mok_megatron.config import MoKConfig, MoKConfigError
from mok_megatron.ops.activation import Activation, ActivationSpec


def test_experts_not_divisible_by_ep_fails_on_every_rank_without_hanging(pool):
    msgs = pool.run("tests.cases:build_error_case", ep=4, num_experts=6, timeout=120)
    for m in msgs:
        assert m is not None and "num_moe_experts=6" in m and "expert-parallel size 4" in m
    # The group is still healthy: no rank is stuck in a collective.
    res = pool.run("tests.cases:parity_case", ep=4)
    assert all(r["out_scale"] > 0 for r in res)


def test_pad_capacity_above_tokens_fails_before_collectives(pool):
    # top-8 of 8 experts with capacity factor 2: capacity = 2 x tokens, impossible to fill with
    # distinct tokens. Every rank must raise in the plan (pad mode has no count exchange).
    msgs = pool.run(
        "tests.cases:forward_error_case", ep=2, topk=8, mode="pad_probs", moe_expert_capacity_factor=2.0
    )
    for m in msgs:
        assert m is not None and "capacity 64 exceeds the 32 local tokens" in m
    res = pool.run("tests.cases:parity_case", ep=2)
    assert all(r["out_scale"] > 0 for r in res)


def _build(after=None, **kw):
    """Build a MoK layer; ``after`` sets config fields TransformerConfig would not accept directly."""
    from tests.cases import build_mok_only, make_config

    cfg = make_config(**kw)
    for k, v in (after or {}).items():
        setattr(cfg, k, v)
    return build_mok_only(cfg)


@pytest.mark.usefixtures("single_rank")
class TestConfigErrors:
    def test_unsupported_activation(self):
        with pytest.raises(MoKConfigError, match=r"activation_func=tanh: MoK experts support silu, gelu"):
            _build(activation_func=torch.tanh)

    def test_bias(self):
        with pytest.raises(MoKConfigError, match=r"add_bias_linear=True: MoK experts have no bias"):
            _build(add_bias_linear=True)

    def test_dispatcher_type(self):
        with pytest.raises(MoKConfigError, match=r"moe_token_dispatcher_type='allgather'"):
            _build(moe_token_dispatcher_type="allgather")

    def test_delay_wgrad_and_moe_act_are_accepted(self):
        # Supported (tests/test_composability.py checks the gradients).
        layer = _build(
            after=dict(
                delay_wgrad_compute=True, recompute_granularity="selective", recompute_modules=["moe_act"]
            )
        )
        assert layer.experts.wgrad_queue is not None and layer.experts.mok_config.recompute_activation

    @pytest.mark.skipif(have_te(), reason="Transformer Engine is installed here")
    def test_te_only_options_without_te(self):
        from mok_megatron import spec

        with pytest.raises(MoKConfigError, match=r"needs Transformer Engine, which is not installed"):
            spec.get_gpt_layer_with_mok_spec(use_te=True)
        with pytest.raises(MoKConfigError, match=r"needs Transformer Engine"):
            spec.gpt_layer_te.submodules  # noqa: B018  (module-level spec for --spec, used by Megatron)
        with pytest.raises(MoKConfigError, match=r"use_te_activation_func=True needs Transformer Engine"):
            _build(after=dict(use_te_activation_func=True))


SWIGLU = ActivationSpec(kind=Activation.SILU, gated=True)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(num_experts=8, topk=9), r"moe_router_topk=9 must be between 1 and num_moe_experts=8"),
        (
            dict(num_experts=8, topk=2, ep_size=3),
            r"num_moe_experts=8 is not divisible by the expert-parallel size 3",
        ),
        (
            dict(num_experts=8, topk=2, etp_size=3),
            r"moe_ffn_hidden_size=8 is not divisible by the expert tensor-parallel size 3",
        ),
        (
            dict(num_experts=8, topk=2, capacity_factor=-1.0),
            r"moe_expert_capacity_factor=-1.0 must be positive",
        ),
        (
            dict(num_experts=8, topk=2, pad_to_capacity=True),
            r"moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor",
        ),
        (
            dict(num_experts=8, topk=2, apply_probs_on_input=True),
            r"moe_apply_probs_on_input=True needs moe_router_topk=1, got 2",
        ),
    ],
)
def test_mok_config_validation(kwargs, pattern):
    with pytest.raises(MoKConfigError, match=pattern):
        MoKConfig(hidden_size=16, ffn_hidden_size=8, activation=SWIGLU, **kwargs)


@pytest.mark.parametrize(
    "opts,needle",
    [
        (dict(minibatch_size=0), "--mok-minibatch-size=0"),
        (dict(capacity_multiplier=0.0), "--mok-capacity-multiplier=0.0"),
        (dict(capacity_multiplier=1.5), "--mok-capacity-multiplier=1.5"),
        (dict(transport="nvshmem"), "--mok-transport='nvshmem'"),
        (dict(local_rows="split"), "--mok-local-rows='split'"),
        (dict(engine="plain", fp8_dispatch=True), "--mok-fp8-dispatch"),
        (dict(fp8_dispatch=True, transport="nvlink"), "--mok-fp8-dispatch with --mok-transport nvlink"),
        (dict(engine="plain", fp8_combine=True), "--mok-fp8-combine"),
        (dict(fp8_combine=True, transport="nvlink"), "--mok-fp8-combine with --mok-transport nvlink"),
    ],
)
def test_bad_options_name_the_flag(opts, needle):
    from mok_megatron.options import MoKOptions, MoKOptionsError

    with pytest.raises(MoKOptionsError, match="must|choose|only waste|runs no pipeline|bf16 rows only") as e:
        MoKOptions(**opts)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "link,needle",
    [
        (dict(ep=0), "loopback ep=0: must be >= 1"),
        (dict(gbps=-1.0), "loopback gbps=-1.0: must be >= 0"),
        (dict(bytes="none"), "loopback bytes='none': choose one of copy, link"),
    ],
)
def test_bad_loopback_link_names_the_value(link, needle):
    from mok_megatron.transport.loopback import LoopbackLink

    with pytest.raises(ValueError) as e:
        LoopbackLink(**link)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "cfg_kw,opts,needle",
    [
        (dict(mode="drop_probs"), dict(sync_free=True), "moe_expert_capacity_factor=0.75 (token dropping)"),
        # a transport given to the layer (tests.cases.layer_kwargs: the loopback emulating EP=4)
        (dict(mode="dropless"), dict(loopback=dict(ep=4)), "spans 4 EP ranks but this layer's EP group has"),
        (dict(mode="drop_probs"), dict(loopback=dict(ep=4)), "capacity_factor=0.75 (token dropping)"),
        (dict(mode="dropless"), dict(transport="copy_engine"), "needs CUDA GPUs"),
    ],
)
def test_pipeline_options_rejected_where_unsupported(pool, cfg_kw, opts, needle):
    if opts.get("transport") == "copy_engine" and torch.cuda.is_available():
        pytest.skip("copy_engine is available on CUDA")
    msgs = pool.run("tests.cases:build_error_case", ep=2, cfg_ep=2, opts=opts, **cfg_kw)
    for m in msgs:
        assert m is not None and needle in m, m
