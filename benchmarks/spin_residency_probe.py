"""Session 11 probe: does a one-warp kernel (the loopback's link-time spin, or any signalling kernel of a
real transport) get an SM while the pipeline's grouped GEMMs run on another stream?

For each GEMM kind of DeepSeek's EP=32 slice (8 experts, 4096 rows each, hidden 7168, ffn 2048; the
``torch._grouped_mm`` calls the experts make: fc1 forward, fc2 forward, fc1 weight gradient) and for
``torch.bmm``: three GEMMs back to back on stream A; stream B waits for the first GEMM to *start* (an event
after a tiny kernel ahead of it), then spins 0.46 ms. Printed: how long B took from ready to done (0.46 ms
when the spin got an SM at once), and the GEMMs' time with and without the spin. Repeated with the spin on
a high-priority stream, and with ``torch._C._set_sm_carveout_experimental(n)`` (SMs left free by the GEMMs
that honour it). Everything replays from a CUDA graph (no host in the way), as the pipelined layer does.

    python benchmarks/spin_residency_probe.py
"""

from __future__ import annotations

import torch

import probe_timing  # benchmarks/probe_timing.py (this script's directory is on sys.path)
from mok_megatron.kernels.link_delay import spin_ns

SPIN_NS = 460_000


def main():
    dev = torch.device("cuda")
    bf = torch.bfloat16
    rows, hid, ffn, ne = 32768, 7168, 2048, 8
    offs = torch.arange(1, ne + 1, device=dev, dtype=torch.int32) * (rows // ne)
    x = torch.randn(rows, hid, device=dev, dtype=bf)
    w1 = torch.randn(ne, 2 * ffn, hid, device=dev, dtype=bf)
    a = torch.randn(rows, ffn, device=dev, dtype=bf)
    w2 = torch.randn(ne, hid, ffn, device=dev, dtype=bf)
    dy1 = torch.randn(rows, 2 * ffn, device=dev, dtype=bf)
    bm_a = torch.randn(8, 7168, 4096, device=dev, dtype=bf)
    bm_b = torch.randn(8, 4096, 2048, device=dev, dtype=bf)
    gemms = {
        "grouped fc1 fwd": lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
        "grouped fc2 fwd": lambda: torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs),
        "grouped fc1 wgrad": lambda: torch._grouped_mm(dy1.t(), x, offs=offs),
        "bmm (fc2 wgrad-sized)": lambda: torch.bmm(bm_a, bm_b),
    }
    tiny = torch.zeros(1, device=dev)
    lo, hi = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

    graphed, timed = probe_timing.graphed, probe_timing.median_ms

    def case(gemm, side):
        """GEMMs on the current stream; the spin on `side` once the first GEMM has started. Returns
        (chain alone ms, chain with the spin ms, the side stream's ready-to-done ms)."""
        chain = graphed(lambda: [gemm() for _ in range(3)])  # its replay
        started = torch.cuda.Event()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

        def with_spin():
            tiny.add_(1)  # a tiny kernel ahead of the GEMM: the event after it fires as the GEMM starts
            started.record()
            gemm()
            side.wait_event(started)
            with torch.cuda.stream(side):
                spin_ns(SPIN_NS, dev)
            gemm()
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        both = timed(graphed(with_spin))
        # the side stream's ready-to-done time, eager (timing events cannot be captured): launch the
        # GEMMs, then the spin behind an event that fires when the first GEMM starts
        waits = []
        for _ in range(5):
            torch.cuda.synchronize()
            tiny.add_(1)
            started.record()
            gemm()
            gemm()
            gemm()
            side.wait_event(started)
            with torch.cuda.stream(side):
                ev[0].record()
                spin_ns(SPIN_NS, dev)
                ev[1].record()
            torch.cuda.synchronize()
            waits.append(ev[0].elapsed_time(ev[1]))
        waits.sort()
        return timed(chain), both, waits[2]

    spin_ns(1000, dev)
    for name, gemm in gemms.items():
        for label, side, carve in (
            ("normal", lo, 0),
            ("high-priority", hi, 0),
            ("normal, carveout 2", lo, 2),
        ):
            torch._C._set_sm_carveout_experimental(carve or None)
            alone, both, wait = case(gemm, side)
            print(
                f"{name:22s} spin on a {label:19s} stream: 3 GEMMs {alone:.3f} ms, with the spin {both:.3f} ms; "
                f"spin ready-to-done {wait:.3f} ms (0.460 = it got an SM at once)",
                flush=True,
            )
    torch._C._set_sm_carveout_experimental(None)


if __name__ == "__main__":
    main()
