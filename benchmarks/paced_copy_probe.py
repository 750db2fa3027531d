"""Session 11 probe: does the loopback's *burst* of copies cost a GEMM beside it more than the same bytes
paced at the emulated link's rate would?

The loopback moves an exchange's bytes with back-to-back device-to-device copies (0.22 ms for DeepSeek's
7 x 57 MB at ~3.6 TB/s of HBM traffic), then waits out the link time (0.44 ms at 900 GB/s). A real rank's
link writes the same bytes over the whole link time (~1.8 TB/s of HBM traffic at 900 GB/s each way). This
times DeepSeek's fc2 weight-gradient-sized GEMM (8 x 7168 x 4096 x 2048, bf16) alone and beside: the burst
(copies + a spin on another stream, as the loopback runs), and the same copies cut into k pieces, piece i
not before (i+1)/k of the link time (``kernels.link_delay.mark`` / ``spin_until``), for several k.

Then, sustained (~2 s per row, CUDA graphs, SM clock and power sampled by ``nvidia-smi``): 20 GEMMs
alone; the same beside exchanges back to back at the link's rate (copies + spin, as the loopback runs);
the exchanges alone. Says whether the copies slow the GEMMs through the power cap (the SM clock drops)
or through memory bandwidth (it does not).

    python benchmarks/paced_copy_probe.py [--gbps 900]
"""

from __future__ import annotations

import argparse

import torch

import triton
import triton.language as tl

import probe_timing  # benchmarks/probe_timing.py (this script's directory is on sys.path)
from mok_megatron.bench.clocks import ClockSampler
from mok_megatron.kernels.link_delay import spin_ns


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _mark_kernel(t_ptr):
    tl.store(t_ptr, _now())


@triton.jit(do_not_specialize=["ns"])
def _spin_until_kernel(t_ptr, ns):
    deadline = tl.load(t_ptr, volatile=True) + ns
    now = _now()
    while now < deadline:
        now = _now()


@triton.jit(do_not_specialize=["ns", "nap"])
def _nap_ns_kernel(ns, nap):
    # the spin with the warp asleep between clock reads (``nanosleep``): fewer issue slots taken
    t0 = _now()
    now = t0
    while now - t0 < ns:
        tl.inline_asm_elementwise("nanosleep.u32 $1;", "=r,r", [nap], dtype=tl.int32, is_pure=False, pack=1)
        now = _now()


@triton.jit
def _copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    # grid-stride copy of n int64 words: the programs' count bounds the SMs used
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


def sm_copy(dst, src, programs):
    """``dst.copy_(src)`` on ``programs`` CTAs (SMs) instead of the copy engine."""
    d, s = dst.view(torch.int64), src.view(torch.int64)
    _copy_kernel[(programs,)](d, s, d.numel(), BLOCK=4096, num_warps=8)


def mark(t_1):
    _mark_kernel[(1,)](t_1, num_warps=1)


def spin_until(t_1, ns):
    _spin_until_kernel[(1,)](t_1, int(ns), num_warps=1)


def nap_ns(ns, nap):
    _nap_ns_kernel[(1,)](int(ns), nap, num_warps=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gbps", type=float, default=900.0)
    ap.add_argument("--copies", type=int, default=7)
    ap.add_argument("--mb", type=int, default=57)
    ap.add_argument("--sustained-only", action="store_true")
    ap.add_argument("--works", default="", help="comma-separated substrings: sustained rows to run (all)")
    ap.add_argument(
        "--carveout", type=int, default=0, help="SMs the GEMMs leave free (torch's experimental knob)"
    )
    ap.add_argument("--gemm", choices=("bmm", "grouped"), default="bmm")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dy = torch.randn(8, 7168, 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(8, 4096, 2048, device=dev, dtype=torch.bfloat16)
    side, delay = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.empty(args.mb << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_1 = torch.zeros(1, dtype=torch.int64, device=dev)
    nbytes = args.copies * src.numel()
    link_ns = round(nbytes / args.gbps)

    offs = torch.arange(1, 9, device=dev, dtype=torch.int32) * 4096
    x_g = torch.randn(32768, 7168, device=dev, dtype=torch.bfloat16)
    w_g = torch.randn(8, 2048, 7168, device=dev, dtype=torch.bfloat16)

    def gemm():
        if args.gemm == "grouped":  # fc2-forward-sized grouped GEMM of the DeepSeek slice (x @ w^T)
            return torch._grouped_mm(x_g, w_g.transpose(-2, -1), offs=offs)
        return torch.bmm(dy, a)

    if args.carveout:
        torch._C._set_sm_carveout_experimental(args.carveout)

    def burst():
        delay.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(delay):
            spin_ns(link_ns, dev)
        for _ in range(args.copies):
            dst.copy_(src)
        torch.cuda.current_stream().wait_stream(delay)

    def paced(k_per_copy):
        def run():
            mark(t_1)
            chunks = list(zip(dst.chunk(k_per_copy), src.chunk(k_per_copy), strict=True))
            k = args.copies * len(chunks)
            i = 0
            for _ in range(args.copies):
                for d, s in chunks:
                    d.copy_(s)
                    i += 1
                    spin_until(t_1, i * link_ns // k)

        return run

    graphed, timed = probe_timing.graphed, probe_timing.median_ms

    def beside(side_work, gemms=1):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                side_work()
            for _ in range(gemms):
                gemm()
            torch.cuda.current_stream().wait_stream(side)

        return run

    def twice(fn):
        def run():
            fn()
            fn()

        return run

    for _ in range(3):
        gemm()
        burst()
        paced(4)()
        sm_copy(dst, src, 8)
    torch.cuda.synchronize()
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    d2h_src = torch.empty_like(host, device=dev)
    host.copy_(d2h_src, non_blocking=True)
    torch.cuda.synchronize()
    d2h_gbps = host.numel() / (timed(graphed(lambda: host.copy_(d2h_src, non_blocking=True))) * 1e6)
    d2h_bytes = min(host.numel(), int(link_ns * d2h_gbps))

    def d2h_delay():
        delay.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(delay):
            host[:d2h_bytes].copy_(d2h_src[:d2h_bytes], non_blocking=True)
        for _ in range(args.copies):
            dst.copy_(src)
        torch.cuda.current_stream().wait_stream(delay)

    def sm_exchange(programs):
        def run():
            delay.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(delay):
                spin_ns(link_ns, dev)
            for _ in range(args.copies):
                sm_copy(dst, src, programs)
            torch.cuda.current_stream().wait_stream(delay)

        return run

    works = {
        "exchanges (copies + spin: loopback)": burst,
        **{f"exchanges (SM copies, {n} CTAs + spin)": sm_exchange(n) for n in (4, 8, 16, 32)},
        **{
            f"SM copies only, {n} CTAs": (lambda n=n: [sm_copy(dst, src, n) for _ in range(args.copies)])
            for n in (8, 32)
        },
        "spins only": lambda: spin_ns(link_ns, dev),
        "copies only (back to back)": lambda: [dst.copy_(src) for _ in range(args.copies)],
        f"D2H delay ({d2h_gbps:.0f} GB/s) only": lambda: host[:d2h_bytes].copy_(
            d2h_src[:d2h_bytes], non_blocking=True
        ),
        "exchanges (copies + D2H delay)": d2h_delay,
    }
    if args.works:
        keys = args.works.split(",")
        works = {k: v for k, v in works.items() if any(q in k for q in keys)}
    if args.sustained_only:
        return sustained(gemm, works, link_ns, side, graphed)
    g1 = timed(graphed(gemm))
    g2 = timed(graphed(twice(gemm)))
    print(
        f"(CUDA graphs) GEMM alone {g1:.3f} ms, twice {g2:.3f} ms; link {link_ns / 1e6:.3f} ms for "
        f"{nbytes / 1e6:.0f} MB at {args.gbps:.0f} GB/s; copies alone "
        f"{timed(graphed(lambda: [dst.copy_(src) for _ in range(args.copies)])):.3f} ms",
        flush=True,
    )

    def copies():
        for _ in range(args.copies):
            dst.copy_(src)

    rows = [
        ("spin alone (one warp, tight)", lambda: spin_ns(link_ns, dev)),
        ("spin with nanosleep 200 ns", lambda: nap_ns(link_ns, 200)),
        ("spin with nanosleep 1000 ns", lambda: nap_ns(link_ns, 1000)),
        ("copies alone (no spin)", copies),
        ("burst (copies + spin beside)", burst),
    ]
    for k in (1, 4, 16):
        rows.append((f"paced, {args.copies * k} pieces of {args.mb / k:.1f} MB", paced(k)))
    for name, fn in rows:
        alone = timed(graphed(fn))
        pair = timed(graphed(beside(fn)))
        pair2 = timed(graphed(beside(twice(fn), gemms=2)))
        print(
            f"{name:36s} alone {alone:.3f} | with the GEMM {pair:.3f} ms (+{pair - g1:.3f}) | "
            f"two of each {pair2:.3f} ms (+{pair2 - g2:.3f})",
            flush=True,
        )

    sustained(gemm, works, link_ns, side, graphed)


def sustained(gemm, works, link_ns, side, graphed):
    """20 GEMMs on the current stream beside each side work repeated for as long (one graph each);
    ``works``: name -> one exchange's worth of side work."""
    import time

    n_gemm = 20

    def gemms():
        for _ in range(n_gemm):
            gemm()

    g = graphed(gemms)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g()
    torch.cuda.synchronize()
    n_ex = max(1, int((time.perf_counter() - t0) * 1e9 / link_ns))
    stamps = torch.zeros(3, dtype=torch.int64, device="cuda")

    def run(graph, seconds=1.5):
        with ClockSampler() as clocks:
            time.sleep(0.2)
            torch.cuda.synchronize()
            t0 = time.time()
            reps = 0
            while time.time() - t0 < seconds:
                graph()
                torch.cuda.synchronize()
                reps += 1
            t1 = time.time()
        c = clocks.summary(t0, t1) or {}
        return (t1 - t0) * 1e3 / reps, c

    ms, c = run(g)
    print(
        f"sustained: {n_gemm} GEMMs alone {ms:.3f} ms per replay ({c.get('sm_mhz', 0):.0f} MHz, "
        f"{c.get('power_w', 0):.0f} W); {n_ex} exchanges of {link_ns / 1e6:.3f} ms beside them",
        flush=True,
    )
    for name, work in works.items():

        def repeated(work=work):
            for _ in range(n_ex):
                work()

        def both(repeated=repeated):
            mark(stamps[0:1])
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                repeated()
                mark(stamps[2:3])
            gemms()
            mark(stamps[1:2])
            torch.cuda.current_stream().wait_stream(side)

        alone, _ = run(graphed(repeated), 0.7)
        ms, c = run(graphed(both))
        t = stamps.tolist()
        print(
            f"  {name:34s} alone {alone:7.3f} ms | beside: GEMMs done {(t[1] - t[0]) / 1e6:7.3f} ms, side "
            f"done {(t[2] - t[0]) / 1e6:7.3f} ms | {c.get('sm_mhz', 0):.0f} MHz, {c.get('power_w', 0):.0f} W",
            flush=True,
        )


if __name__ == "__main__":
    main()
