"""The MoK command-line flags that run a predicted configuration: what ``mok plan`` recommends and what
each examples/*.sh recipe's MoK run passes (tests hold the two equal, so a refit that changes the
recommendation changes the recipes in the same commit).

A predicted mode maps to flags one to one:
    exact                 (no flag: token counts read on the host once per layer call)
    sync-free             --mok-sync-free --mok-capacity-multiplier C (C from the binomial routing bound)
    sync-free+graph       --mok-sync-free --mok-capacity-multiplier 1.0 and a CUDA graph around the whole
                          transformer layer: --cuda-graph-impl transformer_engine --te-rng-tracker with no
                          --cuda-graph-modules (Megatron's "moe" module scope is for drop-and-pad layers
                          only). A captured layer cannot check a smaller buffer for overflow on the host,
                          so the MoK layer refuses a multiplier below 1.0 there.
    local rows            --mok-local-rows fused|overlap
The experts run at the layout's precision, as the prediction assumes: bf16 on the default torch backend,
FP8 (fp8 or mxfp8 layouts) on --mok-expert-backend torch-fp8, the FP8 backend that runs sync-free (TE's
GroupedLinear reads its row counts on the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mok_megatron.tools.planner.calibrate import DATA, split_mode
from mok_megatron.tools.planner.predict import LayerPrediction, best, capacity_multiplier, recommended
from mok_megatron.tools.planner.shapes import Layout, Model

GRAPH_FLAGS = ("--cuda-graph-impl", "transformer_engine", "--te-rng-tracker")
GIB = 1024**3


@dataclass(frozen=True)
class Recommendation:
    layer: LayerPrediction
    fastest_ms: float  # the fastest MoK option's layer time
    mok_flags: tuple[str, ...]  # argv of the --mok-* flags
    graph_flags: tuple[str, ...]  # Megatron's CUDA-graph flags the MoK run needs; () when eager
    buffer_bytes: float  # sync-free receive buffer of one exchange (0 in exact mode)

    @property
    def argv(self) -> list[str]:
        return [*self.mok_flags, *self.graph_flags]

    def text(self) -> str:
        margin = DATA["recommendation_margin"]["value"]
        out = (
            f"Recommended MoK settings (simplest within {margin:.0%} of the fastest, "
            f"{self.layer.total_ms:.2f} ms vs {self.fastest_ms:.2f} ms): {' '.join(self.argv)}"
        )
        if self.graph_flags:
            out += " (no --cuda-graph-modules: the whole layer is one CUDA graph)"
        if self.buffer_bytes:
            out += f"; sync-free receive buffer {self.buffer_bytes / GIB:.2f} GiB per exchange"
        return out + "."


def expert_backend(layout: Layout) -> str:
    return "torch" if layout.precision == "bf16" else "torch-fp8"


def recommend(
    options: list[LayerPrediction], model: Model, layout: Layout, fast_link: bool
) -> Recommendation:
    """The recommended MoK option (``predict.recommended``) as the flags that run it."""
    b = recommended(options, fast_link=fast_link)
    tokens = layout.moe_tokens(model)
    minibatch = math.ceil(tokens / b.chunks)
    base, rows = split_mode(b.mode)
    flags = ["--mok-transport", b.transport, "--mok-minibatch-size", str(minibatch)]
    if rows:
        flags += ["--mok-local-rows", rows]
    graph = "graph" in base
    cap = 0.0
    if "sync-free" in base:
        cap = 1.0 if graph else capacity_multiplier(model, layout)
        flags += ["--mok-sync-free", "--mok-capacity-multiplier", str(cap)]
    flags += ["--mok-expert-backend", expert_backend(layout)]
    buffer = layout.ep * math.ceil(cap * minibatch) * model.hidden * 2.0  # bf16 rows from every source
    return Recommendation(
        b, best(options, "mok").total_ms, tuple(flags), GRAPH_FLAGS if graph else (), buffer
    )
