"""Session 10 probe: one profiled eager step of the loopback-pipelined layer with late weight gradients
on and off: busy time per CUDA stream, time two streams run at once, and the step's last GPU operations
(name, stream, start, duration) - does the dispatch-backward exchange run beside the weight gradients?

    python benchmarks/late_wgrad_profile.py [shape] [gbps] [chunks] [local_rows]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mok_megatron.bench.layer import _config, _init_single_process, build
from mok_megatron.bench.overlap import OVERLAP_SHAPES, _inputs, _stepper, loopback_options, stream_overlap


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
        opts = loopback_options(
            s,
            chunks,
            gbps,
            local_rows=local_rows,
            sync_free=True,
            late_wgrad=late,
        )
        torch.manual_seed(0)
        layer = build("mok", cfg, options=opts).cuda()
        step = _stepper(layer, x, dout)
        for _ in range(3):
            step()
        tr = layer.token_dispatcher.transport
        b0 = tr.bytes_moved
        print(f"late={late}: {stream_overlap(step, x.device)}", flush=True)
        print(
            f"late={late}: link ms per step {1e3 * (tr.bytes_moved - b0) / (gbps * 1e9):.3f}" if gbps else ""
        )
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ev = sorted(
            (e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0),
            key=lambda e: e.time_range.start,
        )
        t0 = ev[0].time_range.start
        print(f"late={late}: last GPU operations (start us from the step's first, duration us, stream, name)")
        t0 = ev[0].time_range.start
        spins = [e for e in ev if "spin" in e.name]
        print(f"late={late}: spins (us): {[round(e.time_range.elapsed_us()) for e in spins]}")
        print(
            f"late={late}: spins' stream attributes: "
            f"{[(getattr(e, 'stream', None), getattr(e, 'device_resource_id', None)) for e in spins]}"
        )
        big = [e for e in ev if e.time_range.elapsed_us() > 100]
        print(
            f"late={late}: ops over 100 us (start, us, stream, resource, name): "
            f"{[(e.time_range.start - t0, round(e.time_range.elapsed_us()), getattr(e, 'stream', None), getattr(e, 'device_resource_id', None), e.name[:24]) for e in big]}"
        )
        for e in ev[-28:]:
            stream = getattr(e, "stream", None) or getattr(e, "device_resource_id", 0)
            print(
                f"  {e.time_range.start - t0:9.0f} {e.time_range.elapsed_us():7.0f}  s{stream:<4} {e.name[:70]}"
            )
        del layer, step
    return 0


if __name__ == "__main__":
    sys.exit(main())
