"""Session 10 probe: what does the loopback's link-time emulation cost a GEMM running beside it?
Times DeepSeek's fc2 weight-gradient-sized GEMM chain alone, beside a one-warp wall-clock spin, beside a
device-to-host copy into pinned memory (copy engine, no SM) of the same duration, and beside the loopback's
device-to-device copies; prints which engine the D2D copy is (profiler name).

    python benchmarks/delay_engine_probe.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import probe_timing  # benchmarks/probe_timing.py (this script's directory is on sys.path)
from mok_megatron.kernels.link_delay import spin_ns


def main():
    dev = torch.device("cuda")
    # fc2 weight gradient of the DeepSeek slice: [8 experts] x (7168 x 2048) over 4096 rows each
    dy = torch.randn(8, 7168, 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(8, 4096, 2048, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    d2d_src = torch.empty(57 << 20, dtype=torch.uint8, device=dev)
    d2d_dst = torch.empty_like(d2d_src)

    def gemm():
        return torch.bmm(dy, a)

    def timed(fn, reps=5):
        return min(probe_timing.times_ms(fn, reps))

    for _ in range(3):
        gemm()
        spin_ns(1000, dev)
        host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    alone = timed(gemm)
    d2h_ms = timed(lambda: host.copy_(src, non_blocking=True))
    print(
        f"GEMM alone {alone:.3f} ms; D2H copy of 256 MB {d2h_ms:.3f} ms ({0.256e3 / d2h_ms:.1f} GB/s)",
        flush=True,
    )

    def beside(side_work):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                side_work()
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        return run

    dur_ns = int(0.6 * alone * 1e6)
    nbytes = int(dur_ns * 1e-9 * 0.256e9 / (d2h_ms * 1e-3))
    print(
        f"beside a spin of {dur_ns / 1e6:.3f} ms: {timed(beside(lambda: spin_ns(dur_ns, dev))):.3f} ms",
        flush=True,
    )
    print(
        f"beside a D2H copy of {nbytes >> 20} MB (~{dur_ns / 1e6:.3f} ms): "
        f"{timed(beside(lambda: host[:nbytes].copy_(src[:nbytes], non_blocking=True))):.3f} ms",
        flush=True,
    )

    def d2d7():
        for _ in range(7):
            d2d_dst.copy_(d2d_src)

    print(
        f"D2D copies (7 x 57 MB) alone {timed(d2d7):.3f} ms; GEMM beside them {timed(beside(d2d7)):.3f} ms",
        flush=True,
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        d2d_dst.copy_(d2d_src)
        torch.cuda.synchronize()
    print(
        "D2D copy's profiler events:", sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    )


if __name__ == "__main__":
    main()
