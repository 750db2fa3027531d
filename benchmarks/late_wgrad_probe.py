"""Session 10 probe: capture the loopback-pipelined layer (sync-free) in a CUDA graph with late weight
gradients on and off; print the full error if a capture fails, and the step times.

    python benchmarks/late_wgrad_probe.py [shape] [gbps] [chunks] [local_rows]
"""

from __future__ import annotations

import math
import sys
import traceback

import torch

from mok_megatron.bench import _config, _init_single_process, build
from mok_megatron.bench_overlap import OVERLAP_SHAPES, _graphed, _inputs, _stepper, _time
from mok_megatron.options import MoKOptions


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "dsv3-4k"
    gbps = float(sys.argv[2]) if len(sys.argv) > 2 else 900.0
    chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    local_rows = sys.argv[4] if len(sys.argv) > 4 else "fused"
    _init_single_process()
    s = OVERLAP_SHAPES[shape]
    cfg = _config(s, torch.bfloat16)
    x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))
    for late in (True, False):
        opts = MoKOptions(
            minibatch_size=math.ceil(s["tokens"] / chunks),
            transport="loopback",
            loopback_ep=s["ep"],
            loopback_gbps=gbps,
            local_rows=local_rows,
            sync_free=True,
            late_wgrad=late,
        )
        torch.manual_seed(0)
        layer = build("mok", cfg, options=opts).cuda()
        step = _stepper(layer, x, dout)
        print(f"late={late} eager {1e3 * _time(step, 5, 2):.2f} ms", flush=True)
        try:
            replay = _graphed(layer, x, dout)
            print(f"late={late} graph {1e3 * _time(replay, 8, 2):.2f} ms", flush=True)
        except Exception:
            traceback.print_exc()
            continue
        del layer, step
    return 0


if __name__ == "__main__":
    sys.exit(main())
