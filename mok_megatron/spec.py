"""Layer specs that put the MoK MoE layer into Megatron-Core models.

Functions (Megatron-Core users)::

    from mok_megatron.spec import get_gpt_layer_with_mok_spec, get_gpt_decoder_block_spec_with_mok
    layer_spec = get_gpt_layer_with_mok_spec(use_te=False)          # every layer an MoK MoE layer
    block_spec = get_gpt_decoder_block_spec_with_mok(config, use_transformer_engine=True)
    # honours moe_layer_freq (dense and MoE layers mixed); MTP specs built from it are MoK too
    GPTModel(config, transformer_layer_spec=block_spec, ...)

Module-level specs for Megatron-LM's ``--spec mok_megatron.spec <name>`` (every layer MoE):

    gpt_layer_local                 Megatron-Core modules (no TE), MoK MoE
    gpt_layer_local_qk_layernorm    same with QK layernorm
    gpt_layer_te                    Transformer Engine attention/norms (needs TE), MoK MoE
    gpt_layer_te_qk_layernorm       same with QK layernorm (Qwen3)
    gpt_layer_te_mla                TE with multi-latent attention (DeepSeek-V3)

Megatron's loader reads them as module attributes (``vars(module)[name]``), so they are built when this
module is imported; the TE ones only where Transformer Engine imports (elsewhere using one raises an
error naming the fix).

``mokify(spec, options=)`` turns any Megatron layer or block spec into its MoK twin: each MoE ``mlp``
builder keeps its shared-expert builder and gets ``MoKMoELayer`` + ``MoKGroupedMLP`` with these
``MoKOptions`` (the layer hands them to its experts and dispatcher); Megatron's stock ``TopKRouter``
becomes ``MoKTopKRouter`` (same routing, fp32 gating GEMM on bf16 tensor cores), a custom router is kept.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from mok_megatron.adapter.layer import MoKMoELayer
from mok_megatron.adapter.router import MoKTopKRouter
from mok_megatron.compat import have_te
from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.options import MoKOptions


def _require_te(what: str) -> None:
    if not have_te():
        raise MoKConfigError(
            f"{what} needs Transformer Engine, which is not installed here. Install the 'te' extra "
            "(pip install 'mok-megatron[te]'), or use the non-TE spec (use_te=False / gpt_layer_local)."
        )


def _mok_submodules(sub: MoESubmodules) -> MoESubmodules:
    """MoK experts; Megatron's stock ``TopKRouter`` becomes ``MoKTopKRouter`` (a custom router stays)."""
    router = MoKTopKRouter if sub.router is TopKRouter else sub.router
    return dataclasses.replace(sub, experts=MoKGroupedMLP, router=router)


def _mok_mlp(mlp, options: MoKOptions | None = None):
    """The MoK version of a Megatron MoE ``mlp`` builder (a partial of MoELayer or a ModuleSpec); a MoK
    one gets ``options`` (None keeps the options it has)."""
    if isinstance(mlp, partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        sub = mlp.keywords.get("submodules")
        new_sub = _mok_submodules(sub if sub is not None else MoESubmodules(experts=MoKGroupedMLP))
        kwargs = dict(mlp.keywords, submodules=new_sub)
        if options is not None:
            kwargs["options"] = options
        return partial(MoKMoELayer, *mlp.args, **kwargs)
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer):
        new = copy.copy(mlp)
        new.module = MoKMoELayer
        if isinstance(mlp.submodules, MoESubmodules):
            new.submodules = _mok_submodules(mlp.submodules)
        if options is not None:
            new.params = {**(mlp.params or {}), "options": options}
        return new
    return mlp


def mokify(spec, options: MoKOptions | None = None):
    """A copy of a Megatron layer spec / block spec whose MoE layers are MoK layers built with ``options``
    (None: ``MoKOptions()``, or the options an already-MoK spec carries)."""
    if options is not None and not isinstance(options, MoKOptions):
        raise TypeError(f"mokify(options=...) takes MoKOptions, got {type(options).__name__}")
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[mokify(s, options) for s in spec.layer_specs])
    if isinstance(spec, ModuleSpec) and spec.submodules is not None and hasattr(spec.submodules, "mlp"):
        new = copy.copy(spec)
        new.submodules = dataclasses.replace(spec.submodules, mlp=_mok_mlp(spec.submodules.mlp, options))
        return new
    return spec


def get_gpt_layer_with_mok_spec(
    use_te: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    normalization: str | None = None,
    options: MoKOptions | None = None,
    **kwargs,
) -> ModuleSpec:
    """A GPT transformer layer whose MLP is the MoK MoE layer (TE or Megatron-Core modules), built with
    ``options``. Extra keyword arguments go to Megatron's ``get_gpt_layer_with_transformer_engine_spec``
    / ``get_gpt_layer_local_spec``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as g

    if use_te:
        _require_te("get_gpt_layer_with_mok_spec(use_te=True)")
        base = g.get_gpt_layer_with_transformer_engine_spec(
            num_experts=1,
            moe_grouped_gemm=True,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            **kwargs,
        )
    else:
        base = g.get_gpt_layer_local_spec(
            num_experts=1,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            normalization=normalization,
            **kwargs,
        )
    return mokify(base, options)


def get_gpt_decoder_block_spec_with_mok(
    config, use_transformer_engine: bool, options: MoKOptions | None = None, **kwargs
) -> TransformerBlockSubmodules:
    """Megatron's GPT decoder block spec (dense/MoE pattern from ``moe_layer_freq``) with MoK MoE layers
    built with ``options``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if use_transformer_engine:
        _require_te("get_gpt_decoder_block_spec_with_mok(use_transformer_engine=True)")
    return mokify(get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs), options)


# ---- module-level specs for `--spec mok_megatron.spec <name>` ------------------------------------


class _NeedsTE:
    """Stands for a TE spec where Transformer Engine does not import: any use names the fix."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        _require_te(f"--spec mok_megatron.spec {self._name}")

    def __repr__(self) -> str:
        return f"<{self._name}: needs Transformer Engine>"


SPEC_NAMES = (
    "gpt_layer_local",
    "gpt_layer_local_qk_layernorm",
    "gpt_layer_te",
    "gpt_layer_te_qk_layernorm",
    "gpt_layer_te_mla",
)

gpt_layer_local = get_gpt_layer_with_mok_spec(use_te=False)
gpt_layer_local_qk_layernorm = get_gpt_layer_with_mok_spec(use_te=False, qk_layernorm=True)
if have_te():
    gpt_layer_te = get_gpt_layer_with_mok_spec(use_te=True)
    gpt_layer_te_qk_layernorm = get_gpt_layer_with_mok_spec(use_te=True, qk_layernorm=True)
    gpt_layer_te_mla = get_gpt_layer_with_mok_spec(
        use_te=True, multi_latent_attention=True, qk_layernorm=True
    )
else:
    gpt_layer_te = _NeedsTE("gpt_layer_te")
    gpt_layer_te_qk_layernorm = _NeedsTE("gpt_layer_te_qk_layernorm")
    gpt_layer_te_mla = _NeedsTE("gpt_layer_te_mla")


def __getattr__(name: str):
    raise AttributeError(
        f"module 'mok_megatron.spec' has no attribute {name!r}; specs: {', '.join(SPEC_NAMES)}"
    )
