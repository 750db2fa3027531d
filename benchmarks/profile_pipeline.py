"""Where does the pipeline's time go? One GPU, loopback transport at infinite bandwidth vs the plain layer.

python benchmarks/profile_pipeline.py [shape] : per configuration, wall ms, GPU kernel ms (sum),
host ms to enqueue one step, kernel count, and the top kernels.
"""

import math
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench import _config, _init_single_process, build  # noqa: E402
from mok_megatron.bench_overlap import OVERLAP_SHAPES, _inputs, _stepper, _time  # noqa: E402
from mok_megatron.kernel_profile import kernel_summary  # noqa: E402
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
    print(kernel_summary(step, f"{name} {label}", ms, top=14, width=110))
    del layer
