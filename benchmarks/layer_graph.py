"""MoK layer (EP=1, dropless, bf16) forward+backward: eager vs the same step captured in one CUDA graph.

At EP=1 the dropless layer never reads the device from the host, so the whole step can be captured;
the graph removes the host's kernel-launch time, which is what separates wall time from GPU-busy time
in ``benchmarks/profile_layer.py``. Median of 20 CUDA-event-timed steps after 3 warm-up steps.

    python benchmarks/layer_graph.py [--router-fusion] [shape ...]   (shapes from mok_megatron.bench.layer.SHAPES;
                                                   --router-fusion: TE's fused top-k, moe_router_fusion)
    MOK_EXPERT_BACKEND=torch-fp8 python benchmarks/layer_graph.py ...   (the native FP8 experts; the
                                                                       graph re-quantizes the weights)
"""

import dataclasses
import os
import statistics
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import SHAPES, _config, _init_single_process, build, time_steps  # noqa: E402
from mok_megatron.bench.overlap import _graphed, _inputs  # noqa: E402

_init_single_process()
args = sys.argv[1:]
fusion = "--router-fusion" in args
names = [a for a in args if a != "--router-fusion"] or ["qwen3-30b-a3b", "deepseek-v3-ep32"]
for name in names:
    s = SHAPES[name]
    torch.manual_seed(0)
    backend = os.environ.get("MOK_EXPERT_BACKEND", "torch")
    cfg = dataclasses.replace(_config(s, torch.bfloat16), moe_router_fusion=fusion)
    if backend == "torch":
        layer = build("mok", cfg).cuda()
    else:
        from mok_megatron.bench.fp8_layers import build_mok_layer

        layer = build_mok_layer(backend, cfg).cuda()
    x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))

    def eager(layer=layer, x=x, dout=dout):
        layer.zero_grad(set_to_none=True)  # as mok bench layer: no gradient accumulation in the step
        out, _ = layer(x.detach().requires_grad_(True))
        out.backward(dout)

    flops = 3 * 2 * s["tokens"] * s["topk"] * 3 * s["hidden"] * s["ffn"]
    ms = {}
    for label, step in (("eager", eager), ("cuda graph", _graphed(layer, x, dout))):
        ms[label] = 1e3 * statistics.median(time_steps(step, 20, 3))
    print(
        f"{name} [{backend}{', router fusion' if fusion else ''}]: eager {ms['eager']:.2f} ms ({flops / ms['eager'] / 1e9:.0f} TFLOP/s) | "
        f"CUDA graph {ms['cuda graph']:.2f} ms ({flops / ms['cuda graph'] / 1e9:.0f} TFLOP/s)"
    )
    del layer
    torch.cuda.empty_cache()
