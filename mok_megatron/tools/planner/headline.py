"""The one headline ``mok plan`` prints (and ``--compare`` and docs/planner.md quote): predicted
tokens/s/GPU of MoK as recommended against Megatron's alltoall layer and against Megatron's best
configuration, saying which is fitted and which is a bound.

    fitted  Megatron's alltoall layer: the EP=1 fit of Megatron+TE plus the all-to-all fully exposed
            (as every EP=2 measurement showed); MoK: the fitted layer model of the recommended option
    bound   Megatron with --overlap-moe-expert-parallel-comm (its combined 1F1B schedule hides one
            micro-batch's all-to-all behind another's compute): modelled with the all-to-all entirely
            hidden and never measured here, so it is an upper bound on Megatron and MoK's gain
            against it a lower bound
"""

from __future__ import annotations

from dataclasses import dataclass

from mok_megatron.tools.planner import predict
from mok_megatron.tools.planner.calibrate import Calibration
from mok_megatron.tools.planner.hardware import Cluster
from mok_megatron.tools.planner.recommend import Recommendation, recommend
from mok_megatron.tools.planner.shapes import Layout, Model

MEGATRON_OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"
KIND = {"megatron": "fitted", "megatron-1f1b": "bound", "mok": "fitted"}
LABEL = {"megatron": "megatron alltoall", "megatron-1f1b": f"megatron alltoall {MEGATRON_OVERLAP_FLAG}"}
PROSE = {"megatron": "its alltoall layer", "megatron-1f1b": f"alltoall with {MEGATRON_OVERLAP_FLAG}"}


@dataclass(frozen=True)
class Headline:
    megatron: predict.StepPrediction  # fitted: alltoall, all-to-all exposed
    best_megatron: predict.StepPrediction  # Megatron's best configuration (the EP-overlap bound)
    mok: predict.StepPrediction  # fitted: the recommended MoK option
    recommendation: Recommendation

    @property
    def gain(self) -> float:
        """MoK / Megatron alltoall - 1 (tokens/s/GPU)."""
        return self.mok.tokens_per_s_gpu / self.megatron.tokens_per_s_gpu - 1

    @property
    def gain_vs_best(self) -> float:
        """MoK / Megatron's best configuration - 1: a lower bound when that configuration is a bound."""
        return self.mok.tokens_per_s_gpu / self.best_megatron.tokens_per_s_gpu - 1

    def text(self) -> str:
        best = self.best_megatron.layer.impl
        return (
            f"Headline: MoK as recommended (fitted) {self.mok.tokens_per_s_gpu:.0f} tokens/s/GPU, "
            f"{self.gain:+.1%} over Megatron's alltoall layer (fitted, {self.megatron.tokens_per_s_gpu:.0f}) "
            f"and {self.gain_vs_best:+.1%} against Megatron's best configuration, {PROSE[best]} "
            f"({KIND[best]}, {self.best_megatron.tokens_per_s_gpu:.0f}"
            + ("; all-to-all entirely hidden, never measured" if KIND[best] == "bound" else "")
            + ")."
        )


def from_options(
    options: list[predict.LayerPrediction], model: Model, layout: Layout, cluster: Cluster
) -> Headline:
    rec = recommend(options, model, layout, fast_link=layout.ep <= cluster.nvlink_domain)
    steps = {
        impl: predict.step(model, layout, cluster, predict.best(options, impl))
        for impl in ("megatron", "megatron-1f1b")
    }
    best = max(steps.values(), key=lambda s: s.tokens_per_s_gpu)
    return Headline(steps["megatron"], best, predict.step(model, layout, cluster, rec.layer), rec)


def headline(
    cal: Calibration, model: Model, layout: Layout, cluster: Cluster, a: predict.Assumptions | None = None
) -> Headline:
    opts = predict.layer_options(cal, model, layout, cluster, a or predict.Assumptions())
    return from_options(opts, model, layout, cluster)
