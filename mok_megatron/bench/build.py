"""The MoE layers the benches time: one process set up as a world of one, a bench shape's
``TransformerConfig``, and MoK's or Megatron's layer built from it."""

from __future__ import annotations

import os
from datetime import timedelta


def init_single_process():
    """One process as a world of one (NCCL on a GPU, gloo and the CPU bridges otherwise) with Megatron's
    parallel state initialised and its RNG seeded; a process group already set up is kept."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=120),
        )
    if not torch.cuda.is_available():
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def layer_config(shape: dict, dtype):
    """The one-layer ``TransformerConfig`` of a bench shape (hidden, ffn, experts, topk; optional shared)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=8,
        num_moe_experts=shape["experts"],
        moe_ffn_hidden_size=shape["ffn"],
        moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
        # optional: a shared expert of this FFN width, run beside the routed experts (DeepSeek-V3: 2048)
        moe_shared_expert_intermediate_size=shape.get("shared"),
        moe_shared_expert_overlap=bool(shape.get("shared")),
    )


def build(impl: str, cfg, options=None, transport=None):
    """One MoE layer: 'mok', 'megatron' (SequentialMLP, no TE) or 'megatron-te' (TEGroupedMLP).
    ``transport``: given to the MoK layer (e.g. ``transport.loopback.LoopbackTransport``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    if impl == "mok":
        from mok_megatron.spec import get_gpt_layer_with_mok_spec

        mlp = get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp
    elif impl == "megatron":
        mlp = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts).mlp
    elif impl == "megatron-te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_submodules

        mlp = get_gpt_layer_with_transformer_engine_submodules(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=True
        ).mlp
    else:
        raise ValueError(f"unknown implementation {impl!r}: choose mok, megatron, megatron-te")
    layer = mlp(config=cfg, options=options, transport=transport) if impl == "mok" else mlp(config=cfg)
    layer.set_layer_number(1)
    return layer
