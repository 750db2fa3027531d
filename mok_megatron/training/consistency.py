"""Start-up check that every rank builds the same MoE model.

A rank launched with a different ``--num-experts``, top-k or expert-parallel size does not fail on its
own: it fails later, inside an all-to-all, as a shape error or a hang whose message names neither the
setting nor the rank. ``check_moe_config_consistent`` gathers the MoE-relevant settings of every rank
once, before the first step (one ``all_gather_object`` of a small dict), and raises on every rank with
the settings that differ and which ranks hold which value.

    from mok_megatron.training.consistency import check_moe_config_consistent
    check_moe_config_consistent(config)            # after init_process_group, before training
"""

from __future__ import annotations

import torch.distributed as dist

# TransformerConfig fields that must agree on every rank for MoE dispatch to line up.
MOE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_load_balancing_type",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "gated_linear_unit",
    "tensor_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "pipeline_model_parallel_size",
    "params_dtype",
)


class MoEConfigMismatchError(RuntimeError):
    """Ranks of one job were started with different MoE settings."""


def moe_fingerprint(config, extra: dict | None = None) -> dict[str, str]:
    """The settings of ``config`` (a TransformerConfig) that every rank must share, as strings.

    ``extra`` adds settings from outside the config (e.g. which MoE layer implementation is used).
    """
    out = {name: repr(getattr(config, name, None)) for name in MOE_FIELDS}
    for name, value in (extra or {}).items():
        out[name] = repr(value)
    return out


def describe_mismatch(fingerprints: list[dict[str, str]]) -> str | None:
    """None when all fingerprints agree; else one line per differing setting, grouping ranks by value."""
    lines = []
    for name in sorted(set().union(*fingerprints)):
        by_value: dict[str, list[int]] = {}
        for rank, fp in enumerate(fingerprints):
            by_value.setdefault(fp.get(name, "<missing>"), []).append(rank)
        if len(by_value) > 1:
            parts = "; ".join(f"{value} on ranks {ranks}" for value, ranks in by_value.items())
            lines.append(f"  {name}: {parts}")
    return "\n".join(lines) if lines else None


def check_moe_config_consistent(config, extra: dict | None = None, group=None) -> None:
    """Raise ``MoEConfigMismatchError`` on every rank if any rank's MoE settings differ.

    Collective over ``group`` (default: the world): call it on every rank, after
    ``init_process_group`` and before the first forward.
    """
    mine = moe_fingerprint(config, extra)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    diff = describe_mismatch(everyone)
    if diff is not None:
        raise MoEConfigMismatchError(
            "the ranks of this job were started with different MoE settings:\n"
            f"{diff}\n"
            "Every rank must get the same model flags (check the launch command of each node); "
            "nothing was trained."
        )
