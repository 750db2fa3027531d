"""Where does the pipeline's time go? One GPU, loopback transport at infinite bandwidth vs the plain layer.

python benchmarks/profile_pipeline.py [shape] : per configuration, wall ms, GPU kernel ms (sum),
host ms to enqueue one step, kernel count, and the top kernels.
"""

import math
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

warnings.filterwarnings("ignore")
from mok_megatron.bench import _config, _init_single_process, build  # noqa: E402
from mok_megatron.bench_overlap import OVERLAP_SHAPES, _inputs, _stepper, _time  # noqa: E402
from mok_megatron.options import MoKOptions  # noqa: E402

_init_single_process()
name = sys.argv[1] if len(sys.argv) > 1 else "dsv3-4k"
s = OVERLAP_SHAPES[name]
cfg = _config(s, torch.bfloat16)
x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))
configs = {"plain": None}
for chunks in (1, 4):
    for det in (True, False):
        configs[f"pipe C={chunks} det={det}"] = MoKOptions(
            minibatch_size=math.ceil(s["tokens"] / chunks),
            transport="loopback",
            loopback_ep=s["ep"],
            loopback_gbps=0.0,
            deterministic=det,
        )
for label, opts in configs.items():
    torch.manual_seed(0)
    layer = build("mok", cfg, options=opts).cuda()
    step = _stepper(layer, x, dout)
    ms = 1e3 * _time(step, 10, 3)
    torch.cuda.synchronize()
    h0 = time.perf_counter()
    step()
    host = 1e3 * (time.perf_counter() - h0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    cuda = [k for k in ka if k.device_type.name == "CUDA"]
    tot = sum(k.self_device_time_total for k in cuda) / 1e3
    n = sum(k.count for k in cuda)
    print(
        f"\n== {name} {label}: wall {ms:.2f} ms | GPU kernels {tot:.2f} ms in {n} launches | host enqueue {host:.2f} ms"
    )
    for k in sorted(cuda, key=lambda k: -k.self_device_time_total)[:14]:
        print(f"   {k.self_device_time_total / 1e3:8.2f} ms x{k.count:4d}  {k.key[:110]}")
    del layer
