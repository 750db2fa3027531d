"""Where does the pipeline's time go? One GPU, loopback transport at infinite bandwidth vs the plain layer.

python benchmarks/profile_pipeline.py [shape] [--chunks 1,4] [--local-rows auto] [--sync-free] [--link-only]
[--det True,False]
: per configuration, wall ms, GPU kernel ms (sum), host ms to enqueue one step, kernel count, and the
top kernels. Default: minibatches 1 and 4, deterministic on and off (``--det True``: on only).
"""

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import _config, _init_single_process, build  # noqa: E402
from mok_megatron.bench.overlap import OVERLAP_SHAPES, _inputs, _stepper, _time, loopback_options  # noqa: E402
from mok_megatron.bench.kernel_profile import kernel_summary  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="dsv3-4k")
ap.add_argument("--chunks", default="1,4")
ap.add_argument("--local-rows", default="auto")
ap.add_argument("--sync-free", action="store_true")
ap.add_argument(
    "--link-only", action="store_true", help="loopback_bytes='link': no copies (an ideal transport)"
)
ap.add_argument("--det", default="True,False")
ap.add_argument("--top", type=int, default=14)
args = ap.parse_args()
_init_single_process()
name = args.shape
s = OVERLAP_SHAPES[name]
cfg = _config(s, torch.bfloat16)
x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))
configs = {"plain": None}
for chunks in (int(c) for c in args.chunks.split(",")):
    for det in (d == "True" for d in args.det.split(",")):
        configs[f"pipe C={chunks} det={det}"] = loopback_options(
            s,
            chunks,
            0.0,
            deterministic=det,
            local_rows=args.local_rows,
            sync_free=args.sync_free,
            loopback_bytes="link" if args.link_only else "copy",
        )
for label, opts in configs.items():
    torch.manual_seed(0)
    layer = build("mok", cfg, options=opts).cuda()
    step = _stepper(layer, x, dout)
    ms = 1e3 * _time(step, 10, 3)
    print(kernel_summary(step, f"{name} {label}", ms, top=args.top, width=110))
    del layer
