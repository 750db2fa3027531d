"""Session 10 probe: does the loopback's link-time spin (one warp) start when GEMMs on another stream
hold the SMs? Times a 5 ms ``spin_ns`` launched (a) before 30 GEMMs on another stream, (b) the same on a
high-priority stream, (c) after the GEMMs were launched, (d) = (c) on a high-priority stream; and the
same four with ``out.copy_(x)`` of 400 MB (the loopback's copies) in place of the spin.

    python benchmarks/spin_starvation_probe.py
"""

from __future__ import annotations

import time

import torch

from mok_megatron.kernels.link_delay import spin_ns


def main():
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    src = torch.empty(400 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    gemm_stream = torch.cuda.Stream()
    lo, hi = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    spin_ns(1000, dev)
    for _ in range(3):
        a @ a
        dst.copy_(src)
    torch.cuda.synchronize()

    def gemms():
        with torch.cuda.stream(gemm_stream):
            for _ in range(30):
                a @ a

    def alone(work, stream):
        with torch.cuda.stream(stream):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            work()
            e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    def run(work, stream, first: bool):
        with torch.cuda.stream(stream):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if not first:
                gemms()
                time.sleep(0.002)  # the GEMMs are running
            s.record()
            work()
            e.record()
            if first:
                gemms()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    works = {"spin 5 ms": lambda: spin_ns(5_000_000, dev), "copy 400 MB": lambda: dst.copy_(src)}
    for name, work in works.items():
        print(f"{name}: alone {alone(work, lo):.2f} ms", flush=True)
        for first in (True, False):
            for label, stream in (("normal", lo), ("high-priority", hi)):
                when = "launched before the GEMMs" if first else "launched while GEMMs run"
                print(f"{name}, {when}, {label} stream: {run(work, stream, first):.2f} ms", flush=True)
    gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gs.record(gemm_stream)
    gemms()
    ge.record(gemm_stream)
    torch.cuda.synchronize()
    print(f"30 GEMMs alone: {gs.elapsed_time(ge):.2f} ms")


if __name__ == "__main__":
    main()
