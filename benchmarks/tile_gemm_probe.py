"""Tile-level consumption on one GPU (mok_megatron.nvlink.tile_gemm): does a grouped GEMM whose tiles start as
their rows land hide the rows' arrival, and what does its Triton GEMM cost against torch._grouped_mm?

    python benchmarks/tile_gemm_probe.py [--out results.json]

Per shape (the experts' fc1 / fc2 GEMMs of DeepSeek-V3's EP=32 slice and of Qwen3-30B-A3B at 16k tokens):
  1. the GEMM alone: torch._grouped_mm (cuBLAS, what the layer runs) and the Triton GEMM per tile config;
  2. rows arriving at a link's bandwidth (the mover paced by %globaltimer, ``programs`` CTAs on a side
     stream; it copies locally, so it also costs this GPU memory traffic that a peer's writes would not):
       serial   mover, then the cuBLAS GEMM (what a minibatch-level pipeline does with one minibatch)
       tiles    mover and the Triton GEMM at once, each tile waiting for its rows' chunks
     hidden = (serial - tiles) / mover: the fraction of the arrival time the tiles hide.
Times: CUDA events, median of ``--iters`` after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mok_megatron.nvlink.tile_gemm import grouped_mm_landed, land_rows

SHAPES = {  # name: (rows per expert, experts, K, N)
    "dsv3-fc1": (4096, 8, 7168, 4096),
    "dsv3-fc2": (4096, 8, 2048, 7168),
    "qwen3-fc1": (1024, 128, 2048, 1536),
    "qwen3-fc2": (1024, 128, 768, 2048),
}
TILES = [  # (BM, BN, BK, warps, stages), TMA
    ((128, 256, 64, 8, 3), False),
    ((128, 256, 64, 8, 3), True),
    ((128, 256, 64, 8, 4), True),
    ((128, 128, 64, 8, 4), True),
    ((256, 128, 64, 8, 3), True),
    ((128, 256, 64, 4, 3), True),
]
MOVER_PROGRAMS = 16


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def probe(name, rows_e, E, K, N, iters, gbps_list):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    R = rows_e * E
    x = (torch.randn(R, K, device=dev, generator=g) * 0.1).bfloat16()
    w = (torch.randn(E, N, K, device=dev, generator=g) * 0.1).bfloat16()
    ends = torch.full((E,), rows_e, device=dev).cumsum(0).to(torch.int32)
    flop = 2 * R * K * N
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"shape": dict(rows=R, experts=E, K=K, N=N), "gemm_ms": {}}
    cublas = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)  # noqa: E731
    for _ in range(3):
        cublas()
    out["gemm_ms"]["cublas"] = timed(cublas, iters)
    best = None
    for tile, tma in TILES:
        key = f"{tile}{' tma' if tma else ''}"
        try:
            fn = lambda t=tile, m=tma: grouped_mm_landed(x, w, ends, tile=t, tma=m)  # noqa: E731
            for _ in range(2):
                fn()
            ms = timed(fn, iters)
        except Exception as e:  # a config that does not fit (shared memory): skip it, say why
            out["gemm_ms"][key] = repr(e)[:120]
            continue
        out["gemm_ms"][key] = ms
        if best is None or ms < best[2]:
            best = (tile, tma, ms)
    out["tflops"] = {k: flop / v / 1e9 for k, v in out["gemm_ms"].items() if isinstance(v, float)}
    tile, tma = best[0], best[1]
    out["best_tile"] = [list(tile), tma]
    landed = torch.zeros((R + 127) // 128, dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int64, device=dev)
    dst = torch.empty_like(x)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    out["arrival"] = {}
    ref = grouped_mm_landed(x, w, ends, tile=tile, tma=tma)
    for gbps in gbps_list:

        def mover(gbps=gbps):
            land_rows(dst, x, landed, epoch, chunk=128, programs=MOVER_PROGRAMS, gbps=gbps)

        def serial():
            epoch.add_(1)
            mover()
            cublas()

        def tiles():
            epoch.add_(1)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                mover()
            programs = sms - MOVER_PROGRAMS
            grouped_mm_landed(dst, w, ends, landed, epoch, chunk=128, programs=programs, tile=tile, tma=tma)
            main.wait_stream(side)

        def mover_alone():
            epoch.add_(1)
            mover()

        for f in (serial, tiles, mover_alone):
            f()
        r = dict(
            mover_ms=timed(mover_alone, iters), serial_ms=timed(serial, iters), tiles_ms=timed(tiles, iters)
        )
        r["hidden"] = (r["serial_ms"] - r["tiles_ms"]) / r["mover_ms"]
        y = grouped_mm_landed(dst, w, ends, landed, epoch, chunk=128, tile=tile, tma=tma)
        r["equal"] = bool(torch.equal(y, ref))
        out["arrival"][str(gbps)] = r
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gbps", default="900,300,50")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out")
    a = ap.parse_args()
    gbps = [float(v) for v in a.gbps.split(",")]
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name in a.shapes.split(","):
        res[name] = probe(name, *SHAPES[name], a.iters, gbps)
        r = res[name]
        print(name, json.dumps(r["gemm_ms"]), flush=True)
        print("  TFLOP/s", {k: round(v) for k, v in r["tflops"].items()}, flush=True)
        for k, v in r["arrival"].items():
            print(
                f"  {k:>6} GB/s",
                {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()},
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
