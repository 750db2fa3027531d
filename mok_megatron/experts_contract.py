"""``ExpertsContract``: what a MoK layer's routed experts take, read by the engine selection and declared by
each experts backend (``experts.protocol``).

It lives on the bottom floor so that the engine (``engine.select``, which lays out the experts' rows from it)
and the experts (which declare it) both import it downwards.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertsContract:
    """What a layer's experts take, known from their class and the options before they are built."""

    mok: bool  # MoK's experts: device counts, sync-free and CUDA-graph capture possible
    alignment: int = 1  # rows per expert must be a multiple of this for their GEMMs
    host_counts: bool = False  # they read the per-expert counts on the host anyway (TE's m_splits)
    fuses_permute: bool = False  # they take token rows + routing metadata (native FP8 experts)

    @property
    def device_counts(self) -> bool:
        return self.mok and not self.host_counts


MEGATRON_EXPERTS = ExpertsContract(mok=False)
