"""Where one MoK layer (EP=1) spends its time on the GPU: wall vs GPU-busy ms, kernel launches per
fwd+bwd step, host enqueue time, and the top kernels, forward+backward, bf16.

Each step starts with cleared gradients and a fresh input leaf, as in ``mok bench layer`` (without that,
three of the step's "bf16 add" kernels are ``.grad`` accumulation of fc1, fc2 and the router weight, and an
``add_`` accumulates the input's gradient: profiling artifacts, not layer work).

    python benchmarks/profile_layer.py [shape ...]     (shapes from mok_megatron.bench.SHAPES)
"""

import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

warnings.filterwarnings("ignore")
from mok_megatron.bench import SHAPES, _config, _init_single_process, build, time_steps  # noqa: E402

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
    torch.cuda.synchronize()
    h0 = time.perf_counter()
    step()
    host = 1e3 * (time.perf_counter() - h0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    cuda = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    busy = sum(k.self_device_time_total for k in cuda) / 1e3
    n = sum(k.count for k in cuda)
    print(
        f"\n== {name}: wall {ms:.2f} ms | GPU kernels {busy:.2f} ms in {n} launches | host enqueue {host:.2f} ms"
    )
    for k in sorted(cuda, key=lambda k: -k.self_device_time_total)[:25]:
        print(f"   {k.self_device_time_total / 1e3:8.3f} ms x{k.count:4d}  {k.key[:120]}")
    cpu = [k for k in prof.key_averages() if k.device_type.name == "CPU" and k.key.startswith("aten::")]
    print("   top host ops (count, self CPU ms):")
    for k in sorted(cpu, key=lambda k: -k.count)[:15]:
        print(f"   x{k.count:4d} {k.self_cpu_time_total / 1e3:7.2f} ms  {k.key}")
    del layer
