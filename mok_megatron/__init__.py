"""mok_megatron: a Mixture-of-Kittens-style MoE layer for NVIDIA Megatron-Core.

Importing the package is cheap (no Megatron import); the public names below load on first use:

    MoKMoELayer, MoKGroupedMLP, MoKTokenDispatcher   Megatron adapter (mok_megatron.adapter)
    MoKConfig, MoKConfigError                        frozen layer config (mok_megatron.config)
    get_gpt_layer_with_mok_spec, get_gpt_decoder_block_spec_with_mok, mokify   (mok_megatron.spec)
"""

__version__ = "0.1.0"

_LAZY = {
    "MoKMoELayer": "mok_megatron.adapter.layer",
    "MoKGroupedMLP": "mok_megatron.experts.grouped_mlp",
    "MoKTokenDispatcher": "mok_megatron.adapter.dispatcher",
    "MoKConfig": "mok_megatron.config",
    "MoKConfigError": "mok_megatron.config",
    "get_gpt_layer_with_mok_spec": "mok_megatron.spec",
    "get_gpt_decoder_block_spec_with_mok": "mok_megatron.spec",
    "mokify": "mok_megatron.spec",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mok_megatron' has no attribute {name!r}")
