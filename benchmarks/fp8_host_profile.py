"""Where the native FP8 layer's wall time goes: GPU-busy vs host enqueue, top kernels and host ops,
bf16 vs torch-fp8, one MoK layer fwd+bwd at EP=1 (``kernel_profile.kernel_summary``).

    python benchmarks/fp8_host_profile.py [--shapes deepseek-v3-ep32,qwen3-30b-a3b]     (one GPU, ~30 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from fp8_h200 import build_layer, fwd_bwd, layer_config

    from mok_megatron.bench.layer import SHAPES, _init_single_process, time_steps
    from mok_megatron.bench.kernel_profile import kernel_summary

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="deepseek-v3-ep32,qwen3-30b-a3b")
    p.add_argument("--backends", default="torch,torch-fp8,torch-fp8-unfused")
    p.add_argument("--router-fusion", action="store_true", help="moe_router_fusion (TE's fused top-k)")
    ns = p.parse_args()
    _init_single_process()
    dev = torch.device("cuda")
    for shape_name in ns.shapes.split(","):
        shape = SHAPES[shape_name]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g).to(dev, torch.bfloat16)
        dout = (torch.randn(shape["tokens"], 1, shape["hidden"], generator=g) * 1e-2).to(dev, torch.bfloat16)
        for backend in ns.backends.split(","):
            cfg = dataclasses.replace(layer_config(shape, None), moe_router_fusion=ns.router_fusion)
            # "torch-fp8-unfused": the FP8 layer without the permute / combine fused into its operands
            layer = build_layer(backend.removesuffix("-unfused"), cfg, None)
            if backend.endswith("-unfused"):
                layer.token_dispatcher.fused_experts = False

            def step(layer=layer, cfg=cfg, x=x, dout=dout):
                layer.zero_grad(set_to_none=True)
                return fwd_bwd(layer, cfg, x, dout)

            wall = 1e3 * statistics.median(time_steps(step, 10, 3))
            print(
                kernel_summary(
                    step,
                    f"{shape_name} {backend}{' fused-router' * ns.router_fusion}",
                    wall,
                    top=14,
                    width=100,
                    host_ops=12,
                ),
                flush=True,
            )
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
