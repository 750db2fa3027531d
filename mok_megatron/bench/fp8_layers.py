"""MoK MoE layers with an FP8 expert backend, built as training builds them (for benchmarks and tests).

fp8_config(cfg, recipe)             ``cfg`` with Megatron's ``--fp8-format e4m3 --fp8-recipe recipe`` (nvfp4:
                                    ``--fp4-format e2m1 --fp4-recipe nvfp4``); None keeps bf16
build_mok_layer(backend, cfg, **o)  the spec's MoK layer with ``--mok-expert-backend backend`` (and
                                    ``MoKOptions(**o)``'s other fields)
InQuantContext(layer, cfg)          runs ``layer`` under Megatron's FP8 context, as ``TransformerBlock`` does
unavailable(backend, recipe)        why that path cannot run here (None: it can)
"""

from __future__ import annotations

import dataclasses

import torch


def fp8_config(cfg, recipe: str | None):
    if recipe is None:
        return cfg
    if recipe == "nvfp4":
        from megatron.core.enums import Fp4Recipe

        return dataclasses.replace(cfg, fp4="e2m1", fp4_recipe=Fp4Recipe.nvfp4)
    from megatron.core.enums import Fp8Recipe

    return dataclasses.replace(cfg, fp8="e4m3", fp8_recipe=Fp8Recipe(recipe))


def build_mok_layer(backend: str, cfg, **options):
    """``mok_megatron.bench.layer.build('mok', cfg)`` with ``--mok-expert-backend backend`` and the other
    ``MoKOptions`` fields in ``options``."""
    from mok_megatron.bench.build import build
    from mok_megatron.options import MoKOptions

    return build("mok", cfg, options=MoKOptions(expert_backend=backend, **options))


class InQuantContext(torch.nn.Module):
    """``layer`` whose forward runs under ``compat.quantization_context(cfg)`` (its parameters are the
    layer's, under the prefix ``layer.``)."""

    def __init__(self, layer, cfg):
        super().__init__()
        self.layer, self.cfg = layer, cfg

    def forward(self, *args, **kwargs):
        from mok_megatron.compat import quantization_context

        with quantization_context(self.cfg):
            return self.layer(*args, **kwargs)


def unavailable(backend: str, recipe: str | None) -> str | None:
    from mok_megatron.compat import cuda_capability, have_te, te_version
    from mok_megatron.ops.fp8_grouped_gemm import unavailable_reason
    from mok_megatron.experts.recipes import available_recipes

    if backend == "torch-fp8":
        return unavailable_reason("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "te":
        if not have_te():
            return "needs Transformer Engine (not importable here)"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU"
        if recipe is not None:
            a = available_recipes(cuda_capability(), True, te_version())[recipe]
            return None if a.available else a.reason
    return None
