"""The experts backend protocol: what the MoK layer and its engines call on routed experts, and the class of
each backend (``--mok-expert-backend``).

Legend: R rows (expert-major), T tokens, K routes per token, H hidden, F1 fc1 rows (2F with a GLU), F FFN
width, L local experts.

    backend    class                                 module
    torch      ``MoKGroupedMLP``                      ``experts.grouped_mlp`` (GEMMs: ``experts.torch_mlp``)
    torch-fp8  ``MoKFP8GroupedMLP(MoKGroupedMLP)``    ``experts.fp8_mlp``
    te         ``MoKTEGroupedMLP(MoKGroupedMLP)``     ``experts.te``

``contract`` (a classmethod, read before the experts are built) says what the experts take
(``experts_contract.ExpertsContract``); ``engine.select`` lays out their rows from it. The other calls are
made only where the contract allows them: ``token_rows_forward`` where ``fuses_permute``, ``expert_groups``
where ``device_counts`` (stacked weights cut into views), ``late_wgrad`` on MoK's experts (None where the
backend's GEMMs cannot hold their weight gradients back). ``stacked_fc1_weight`` / ``stacked_fc2_weight``
are every backend's weights in one layout, read-only, for conversion and inspection; checkpoints keep each
backend's own parameters and Megatron's keys (``experts.checkpoint``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from mok_megatron.experts.fp8_mlp import MoKFP8GroupedMLP
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.experts.te import MoKTEGroupedMLP
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.options import ExpertBackend, MoKOptions

BACKEND_CLASSES: dict[ExpertBackend, type[MoKGroupedMLP]] = {
    ExpertBackend.TORCH: MoKGroupedMLP,
    ExpertBackend.TORCH_FP8: MoKFP8GroupedMLP,
    ExpertBackend.TE: MoKTEGroupedMLP,
}


@runtime_checkable
class ExpertsBackend(Protocol):
    """Routed experts as the MoK layer calls them (Megatron's experts interface and MoK's additions)."""

    @classmethod
    def contract(cls, config, mok_config, options: MoKOptions) -> ExpertsContract: ...

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs
    ) -> tuple[torch.Tensor, None]:
        """``y_RH`` (already scaled by the probabilities) and no bias, for expert-major rows ``x_RH``,
        per-expert counts ``[L]`` and probabilities ``[R]``."""
        ...

    def late_wgrad(self):
        """A ``experts.late_wgrad.LateWgrad`` gate for one pipelined call, or None."""
        ...

    def backward_dw(self) -> None:
        """The weight gradients Megatron's ``delay_wgrad_compute`` deferred."""
        ...

    @property
    def stacked_fc1_weight(self) -> torch.Tensor:
        """``[L, F1, H]``, read-only; slice l is expert l's ``linear_fc1.weight``."""
        ...

    @property
    def stacked_fc2_weight(self) -> torch.Tensor:
        """``[L, H, F]``, read-only; slice l is expert l's ``linear_fc2.weight``."""
        ...


def experts_class(cls: type, options: MoKOptions) -> type:
    """The class that builds ``cls``'s experts under ``options``: ``MoKGroupedMLP`` in a spec stands for
    MoK's experts, whose class follows ``options.expert_backend``; any other class stays itself."""
    if cls is MoKGroupedMLP:
        return BACKEND_CLASSES[ExpertBackend(options.expert_backend)]
    return cls
