"""``MoKConfig``: everything the MoK layer needs, frozen and validated once, at construction.

Megatron's ``TransformerConfig`` is turned into a ``MoKConfig`` at the edge (``from_megatron``); the
functional code below that reads only ``MoKConfig``. Every rejected setting raises ``MoKConfigError``
naming the value, the constraint and the fix, before any collective runs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from mok_megatron.errors import MoKConfigError
from mok_megatron.ops.activation import Activation, ActivationSpec, activation_from_callable

__all__ = ["MoKConfig", "MoKConfigError"]


_SUPPORTED_ACTS = ", ".join(a.value for a in Activation)


@dataclass(frozen=True)
class MoKConfig:
    """Static description of one MoK MoE layer on one rank.

    Sizes are global (before expert-parallel / expert-tensor-parallel splitting) unless named
    ``local``.
    """

    num_experts: int
    topk: int
    hidden_size: int  # expert input/output width (moe_latent_size when latent projections are on)
    ffn_hidden_size: int  # moe_ffn_hidden_size, per expert, before the expert-TP split
    activation: ActivationSpec
    ep_size: int = 1
    etp_size: int = 1
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    router_pad_multiple: int = 0  # moe_router_padding_for_quantization alignment; 0 = off
    apply_probs_on_input: bool = False
    params_dtype: torch.dtype = torch.float32
    delay_wgrad: bool = False  # delay_wgrad_compute: experts' weight gradients wait for backward_dw()
    recompute_activation: bool = False  # recompute_modules has 'moe_act': activation redone in backward
    # Megatron flags on this layer that schedule its phases themselves (cross-micro-batch EP overlap);
    # with any of them the layer keeps the six-phase path (see mok_megatron.engine.select).
    megatron_overlap_flags: tuple[str, ...] = ()

    def __post_init__(self):
        if self.num_experts < 1:
            raise MoKConfigError(f"num_moe_experts={self.num_experts}: must be at least 1.")
        if self.ep_size < 1 or self.etp_size < 1:
            raise MoKConfigError(f"ep_size={self.ep_size}, etp_size={self.etp_size}: must be >= 1.")
        if self.num_experts % self.ep_size != 0:
            raise MoKConfigError(
                f"num_moe_experts={self.num_experts} is not divisible by the expert-parallel size "
                f"{self.ep_size}: every EP rank must hold the same number of experts. Choose "
                f"--expert-model-parallel-size from the divisors of {self.num_experts}, or change "
                "--num-experts."
            )
        if not 1 <= self.topk <= self.num_experts:
            raise MoKConfigError(
                f"moe_router_topk={self.topk} must be between 1 and num_moe_experts={self.num_experts}."
            )
        if self.ffn_hidden_size % self.etp_size != 0:
            raise MoKConfigError(
                f"moe_ffn_hidden_size={self.ffn_hidden_size} is not divisible by the expert tensor-"
                f"parallel size {self.etp_size}; pick --expert-tensor-parallel-size dividing it."
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise MoKConfigError(
                f"moe_expert_capacity_factor={self.capacity_factor} must be positive (or None for dropless)."
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise MoKConfigError(
                "moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor; set a "
                "capacity factor or turn padding off."
            )
        if self.apply_probs_on_input and self.topk != 1:
            raise MoKConfigError(f"moe_apply_probs_on_input=True needs moe_router_topk=1, got {self.topk}.")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_ffn_size(self) -> int:
        """FFN width of one expert on this rank (after the expert-TP split)."""
        return self.ffn_hidden_size // self.etp_size

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, num_tokens: int) -> int:
        """Expert capacity for ``num_tokens`` local tokens (Megatron's ``get_capacity``)."""
        assert self.capacity_factor is not None
        return math.ceil((num_tokens * self.topk / self.num_experts) * self.capacity_factor)

    @classmethod
    def from_megatron(cls, config, ep_size: int = 1, etp_size: int = 1) -> "MoKConfig":
        """Validate a Megatron ``TransformerConfig`` for the MoK layer and freeze what it needs."""
        from mok_megatron.compat import have_te

        if config.num_moe_experts is None:
            raise MoKConfigError("num_moe_experts is None: the MoK layer is an MoE layer; set --num-experts.")
        if config.add_bias_linear:
            raise MoKConfigError(
                "add_bias_linear=True: MoK experts have no bias terms (fc1/fc2 biases are not "
                "supported). Set --disable-bias-linear, or use Megatron's own MoE layer spec for "
                "biased experts."
            )
        act = activation_from_callable(config.activation_func)
        if act is None:
            name = getattr(config.activation_func, "__name__", repr(config.activation_func))
            raise MoKConfigError(
                f"activation_func={name}: MoK experts support {_SUPPORTED_ACTS} (each with or "
                "without gated_linear_unit). Pick one of those, or use Megatron's own MoE layer."
            )
        if config.use_te_activation_func and not have_te():
            raise MoKConfigError(
                "use_te_activation_func=True needs Transformer Engine, which is not installed. "
                "Install the 'te' extra (pip install 'mok-megatron[te]') or turn the option off."
            )
        recompute_act = config.recompute_granularity == "selective" and "moe_act" in (
            config.recompute_modules or []
        )
        overlap_flags = tuple(
            flag
            for flag, field in (
                ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
                (
                    "--overlap-dispatch-backward-with-experts-wgrad",
                    "overlap_dispatch_backward_with_experts_wgrad",
                ),
            )
            if getattr(config, field, False)
        )
        if config.fp8 or config.fp4:
            warnings.warn(
                "MoK's torch experts compute in the parameter dtype; FP8/FP4 recipes are honoured for "
                "routing alignment only (as with Megatron's local SequentialMLP).",
                stacklevel=2,
            )

        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        pad_multiple = 0
        if config.moe_router_padding_for_quantization:
            pad_multiple = int(get_align_size_for_quantization(config))
        return cls(
            num_experts=config.num_moe_experts,
            topk=config.moe_router_topk,
            hidden_size=config.moe_latent_size or config.hidden_size,
            ffn_hidden_size=config.moe_ffn_hidden_size,
            activation=ActivationSpec(
                kind=act,
                gated=bool(config.gated_linear_unit),
                clamp=config.activation_func_clamp_value,
                glu_linear_offset=float(config.glu_linear_offset),
                glu_interleave=config.moe_mlp_glu_interleave_size if config.gated_linear_unit else None,
            ),
            ep_size=ep_size,
            etp_size=etp_size,
            capacity_factor=config.moe_expert_capacity_factor,
            pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity),
            router_pad_multiple=pad_multiple,
            apply_probs_on_input=bool(config.moe_apply_probs_on_input),
            params_dtype=config.params_dtype,
            # TE's GroupedLinear defers for either flag; so do MoK's experts.
            delay_wgrad=bool(
                getattr(config, "delay_wgrad_compute", False)
                or getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False)
            ),
            recompute_activation=recompute_act,
            megatron_overlap_flags=overlap_flags,
        )
