"""Where one MoK layer (EP=1) spends its time on the GPU: wall vs GPU-busy ms, kernel launches per
fwd+bwd step, host enqueue time, and the top kernels, forward+backward, bf16.

Each step starts with cleared gradients and a fresh input leaf, as in ``mok bench layer`` (without that,
three of the step's "bf16 add" kernels are ``.grad`` accumulation of fc1, fc2 and the router weight, and an
``add_`` accumulates the input's gradient: profiling artifacts, not layer work).

    python benchmarks/profile_layer.py [shape ...]     (shapes from mok_megatron.bench.layer.SHAPES)
"""

import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import SHAPES, _config, _init_single_process, build, time_steps  # noqa: E402
from mok_megatron.bench.kernel_profile import kernel_summary  # noqa: E402

_init_single_process()
for name in sys.argv[1:] or ["qwen3-30b-a3b", "deepseek-v3-ep32"]:
    s = SHAPES[name]
    torch.manual_seed(0)
    layer = build("mok", _config(s, torch.bfloat16)).cuda()
    x = torch.randn(s["tokens"], 1, s["hidden"], device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)

    def step(layer=layer, x=x, dout=dout):
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x.detach().requires_grad_(True))
        out.backward(dout)

    ms = 1e3 * sorted(time_steps(step, 10, 3))[5]
    print(kernel_summary(step, name, ms, host_ops=15))
    del layer
