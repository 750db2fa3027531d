"""Named cases of the tile pull (``kernels.tile_pull``), shared by the CPU run under Triton's interpreter and the
GPU runs that need a watchdog (a waiting GEMM whose counters never reach their targets never ends, so those
run in a subprocess with a timeout).

    python -m tests.tile_pull_cases --json OUT                  the kernel against pull_reference, CPU cases,
                                                               each at every tuning of TUNINGS (under
                                                               TRITON_INTERPRET=1: {name: "ok" | error})
    python -m tests.tile_pull_cases --gpu-concurrent NAME       one pull + waiting GEMM case on the GPU; prints
                                                               "ok" or raises

Legend: P source ranks, G local experts, H row width, M received rows, S counter slots, C chunks.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp

SMALL = tg.TileConfig(tile_m=4, tile_n=16, cluster_m=2, max_swizzle=2)
ONE = tg.TileConfig(tile_m=8, tile_n=8, cluster_m=1, max_swizzle=8)


def sources_for(c_PG, width, dtype, device, src_row0_P=None, seed=0, spare=3):
    """One buffer per source holding its rows for this rank from ``src_row0_P[p]`` on (other rows around
    them: the source's rows for other ranks), values distinct per source and row."""
    gen = torch.Generator().manual_seed(seed)
    first = [0] * c_PG.shape[0] if src_row0_P is None else src_row0_P.tolist()
    bufs = []
    for p, n in enumerate(c_PG.sum(1).tolist()):
        t = torch.randn(first[p] + n + spare, width, generator=gen).to(dtype)
        bufs.append(t.to(device))
    return bufs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (NaN equal to the same NaN, unlike ``torch.equal``)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_case(
    c, width, dtype, device, chunk_rows, config, programs, spare_rows=5, src_row0=None, start=0, tuning=None
):
    """The kernel (with ``tuning``: tile_pull's block_bytes / num_warps / stages / copy) and the reference on
    the same plan; returns (recv, counters, want recv, want counters, plan). copy="none" moves no row: the
    receive buffer (every other row NaN, the rest -7: rows in place, as the caller must have them) is wanted
    unchanged, bit for bit, and the counters as the reference releases them."""
    c_PG = torch.tensor(c, dtype=torch.int64, device=device)
    rows = int(c_PG.sum()) + spare_rows
    s0 = None if src_row0 is None else torch.tensor(src_row0, device=device)
    plan = tp.pull_plan(c_PG, rows, config, chunk_rows, src_row0_P=s0)
    bufs = sources_for(c_PG.cpu(), width, dtype, device, None if s0 is None else s0.cpu())
    recv = torch.full((rows, width), -7, dtype=dtype, device=device)
    moves = (tuning or {}).get("copy") != "none"
    if not moves:
        recv[::2] = float("nan")
    counters = torch.full((plan.slots,), start, dtype=torch.int32, device=device)
    want, want_counters = recv.clone(), counters.clone()
    tp.pull_reference(want if moves else want.clone(), bufs, plan, want_counters)
    table = tp.source_table(bufs)
    before, counters_before = recv.clone(), counters.clone()
    tp.tile_pull(recv, table, plan, counters, programs=programs, preload=True, **(tuning or {}))
    if not (same_bits(recv, before) and torch.equal(counters, counters_before)):
        raise AssertionError("tile_pull(preload=True) moved rows or released counters")
    tp.tile_pull(recv, table, plan, counters, programs=programs, **(tuning or {}))
    return recv, counters, want, want_counters, plan


# (name, counts [P][G], width, dtype, chunk_rows, config, programs, src_row0, counters' start)
CPU_CASES = [
    ("hand", [[3, 0, 5], [2, 7, 0]], 6, torch.bfloat16, 3, SMALL, 2, None, 0),
    ("one-program", [[3, 0, 5], [2, 7, 0]], 8, torch.bfloat16, 3, SMALL, 1, None, 0),
    ("more-programs-than-chunks", [[1, 2], [0, 1]], 8, torch.float32, 4, SMALL, 7, None, 0),
    ("chunks-cross-tiles", [[9, 1, 0, 13], [0, 0, 0, 6], [5, 11, 2, 0]], 16, torch.bfloat16, 5, SMALL, 3,
     [4, 0, 2], 0),
    ("chunk-of-one-row", [[2, 3], [4, 0]], 4, torch.float32, 1, ONE, 3, None, 0),
    ("chunk-wider-than-tiles", [[19, 0, 7], [6, 21, 1]], 8, torch.bfloat16, 16, SMALL, 2, None, 0),
    ("odd-width-int16-words", [[3, 4], [5, 1]], 3, torch.bfloat16, 2, ONE, 2, None, 0),
    ("empty-source-and-expert", [[0, 0, 0], [4, 0, 9], [0, 0, 0]], 8, torch.float32, 4, SMALL, 2, None, 0),
    ("nothing-to-pull", [[0, 0], [0, 0]], 8, torch.bfloat16, 4, SMALL, 2, None, 0),
    ("counters-kept-across-steps", [[5, 3], [2, 6]], 8, torch.bfloat16, 3, SMALL, 2, None, 40),
    ("width-not-a-block-multiple", [[6, 2], [3, 5]], 24, torch.bfloat16, 4, SMALL, 2, [1, 0], 0),
]  # fmt: skip


# every case again with blocks of a few bytes, so that a chunk is several blocks (row blocks, and words
# within a row where a row is wider than a block, the last one partly masked at odd widths) and the pipelined copies (stages > 1) run their prologue,
# their steady state and loads past a chunk's last block; the default block (one block per chunk here) with
# stages > 1 runs the prologue alone. Suffix -> tile_pull's tuning.
TUNINGS = {
    "": {},
    "stages1-block16": dict(stages=1, block_bytes=16),
    "stages2": dict(stages=2),
    "stages2-block16": dict(stages=2, block_bytes=16),
    "stages2-block4": dict(stages=2, block_bytes=4),
    "stages3-block16": dict(stages=3, block_bytes=16),
    "stages4-block16": dict(stages=4, block_bytes=16),
    "stages3-block64": dict(stages=3, block_bytes=64),
    "stages4-block32-warps4": dict(stages=4, block_bytes=32, num_warps=4),
    # the TMA copy (tensor descriptors; interpreted: masked copies of the same blocks): rows whose bytes are
    # not a multiple of 16 are refused (``check_cpu_case`` expects the ValueError)
    "tma": dict(copy="tma"),
    "tma-block16": dict(copy="tma", block_bytes=16),
    "tma-block32": dict(copy="tma", block_bytes=32),
    "tma-stages2-block32": dict(copy="tma", stages=2, block_bytes=32),
    "tma-stages3-block16-warps4": dict(copy="tma", stages=3, block_bytes=16, num_warps=4),
    # no row moved (the link time alone): the receive buffer untouched bit for bit, the counters released as
    # the copying paths release them; block and stages are not read (any row width, no budget)
    "none": dict(copy="none"),
    "none-stages4-block65536-warps4": dict(copy="none", stages=4, block_bytes=65536, num_warps=4),
}


def case_name(name: str, suffix: str) -> str:
    return f"{name}/{suffix}" if suffix else name


CPU_RUNS = {
    case_name(case[0], suffix): (case, tuning) for case in CPU_CASES for suffix, tuning in TUNINGS.items()
}


def check_cpu_case(name, c, width, dtype, chunk_rows, config, programs, src_row0, start, tuning=None):
    row_bytes = width * dtype.itemsize
    if (tuning or {}).get("copy") == "tma" and row_bytes % 16:
        try:
            run_case(c, width, dtype, "cpu", chunk_rows, config, programs, src_row0=src_row0, tuning=tuning)
        except ValueError as e:
            assert f"H={width} " in str(e) and "copy='registers'" in str(e), f"{name}: {e}"
            return
        raise AssertionError(f"{name}: copy='tma' took rows of {row_bytes} bytes (not a multiple of 16)")
    recv, counters, want, want_counters, plan = run_case(
        c, width, dtype, "cpu", chunk_rows, config, programs, src_row0=src_row0, start=start, tuning=tuning
    )
    if (tuning or {}).get("copy") == "none":
        assert same_bits(recv, want), f"{name}: copy='none' wrote the receive buffer"
    else:
        assert torch.equal(recv, want), f"{name}: received rows differ from pull_reference"
    assert torch.equal(counters, want_counters), (
        f"{name}: counters {counters.tolist()}, reference {want_counters.tolist()}"
    )
    targets = tg.counter_targets(plan.offs_G, plan.rows, config)
    assert torch.equal(counters - start, targets), f"{name}: counters {counters.tolist()} != start + targets"


def run_cpu_cases() -> dict:
    res = {}
    for name, (case, tuning) in CPU_RUNS.items():
        try:
            check_cpu_case(name, *case[1:], tuning=tuning)
            res[name] = "ok"
        except Exception as e:  # reported per case
            res[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    return res


# ---- GPU: pull + waiting GEMM concurrently -----------------------------------------------------------------

# (counts [P][G], hidden, n, config name, K programs/SMs held back, chunk_rows, delays[, tile_pull tuning])
GPU_CONCURRENT = {
    "qwen3-k4": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]], 256, 448, "QWEN3",
                 4, 48, False),
    "deepseek-k8": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]], 512, 512,
                    "DEEPSEEK", 8, 64, False),
    "qwen3-k2-delays": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]], 256, 448,
                        "QWEN3", 2, 32, True),
    "deepseek-k8-delays": ([[17, 300, 0, 5], [260, 0, 40, 9], [1, 2, 3, 4], [90, 90, 90, 90]], 512, 512,
                           "DEEPSEEK", 8, 40, True),
    "deepseek-k8-stages2-delays": ([[17, 300, 0, 5], [260, 0, 40, 9], [1, 2, 3, 4], [90, 90, 90, 90]], 512, 512,
                                   "DEEPSEEK", 8, 40, True, dict(stages=2, block_bytes=1024)),
    "qwen3-k4-stages4": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]], 256, 448,
                         "QWEN3", 4, 48, False, dict(stages=4, block_bytes=512, num_warps=4)),
    "deepseek-k8-tma-delays": ([[17, 300, 0, 5], [260, 0, 40, 9], [1, 2, 3, 4], [90, 90, 90, 90]], 512, 512,
                               "DEEPSEEK", 8, 40, True, dict(copy="tma")),
    "qwen3-k4-tma-stages2": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]], 256,
                             448, "QWEN3", 4, 48, False, dict(copy="tma", stages=2, block_bytes=1024)),
    # the link time alone: no row moved (the rows in place before the GEMM starts), the counters released at
    # an emulated link's pace (~1 ms here), with and without random delays
    "deepseek-k8-none-paced": ([[17, 300, 0, 5], [260, 0, 40, 9], [1, 2, 3, 4], [90, 90, 90, 90]], 512, 512,
                               "DEEPSEEK", 8, 40, False, dict(copy="none", rate=1.2e9)),
    "qwen3-k4-none-paced-delays": ([[70, 0, 1, 130, 33, 16], [200, 0, 0, 300, 2, 16], [30, 0, 0, 87, 94, 32]],
                                   256, 448, "QWEN3", 4, 48, True, dict(copy="none", rate=0.6e9)),
}  # fmt: skip


def gpu_concurrent(name: str) -> None:
    """The waiting GEMM launched first (counters at 0, receive buffer NaN), then the pull on K programs on
    another stream; the output must equal the same GEMM with counters preset on the fully received buffer
    (bit for bit) and torch._grouped_mm (BF16 tolerance), with no NaN (no tile loaded before its rows).
    copy="none" moves no row: the receive buffer holds every row before the GEMM starts and must hold them
    unchanged after; the GEMM's tiles start as the pull releases their counters."""
    from mok_megatron.kernels.link_delay import spin_ns

    counts, hidden, n, config_name, k, chunk_rows, delays, *tuning = GPU_CONCURRENT[name]
    cfg = getattr(tg, config_name)
    dev = torch.device("cuda")
    c_PG = torch.tensor(counts, device=dev)
    rows = int(c_PG.sum()) + 7
    plan = tp.pull_plan(c_PG, rows, cfg, chunk_rows)
    bufs = sources_for(c_PG.cpu(), hidden, torch.bfloat16, dev)
    table = tp.source_table(bufs)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(c_PG.shape[1], n, hidden, generator=gen) / hidden**0.5).to(dev, torch.bfloat16).mT
    gemm = tg.tile_plan(plan.offs_G, rows, n, cfg)

    full = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=dev)
    tp.pull_reference(full, bufs, plan, torch.zeros(plan.slots, dtype=torch.int32, device=dev))
    preset = tg.tile_grouped_mm(full, w, gemm, gemm.targets_S.clone(), sms_held_back=k)  # compiles
    torch.cuda.synchronize()

    tune = tuning[0] if tuning else {}
    moves = tune.get("copy") != "none"
    recv = (
        torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=dev) if moves else full.clone()
    )
    counters = torch.zeros(plan.slots, dtype=torch.int32, device=dev)
    delay_C = None
    if delays:
        delay_C = torch.randint(0, 40_000, (plan.tasks_C8.shape[0],), generator=gen).to(dev)
    out = torch.empty_like(preset)
    # every kernel the side stream runs is loaded before the GEMM waits: CUDA loads a kernel at its first
    # launch, and that load may wait for the device to go idle, which the waiting GEMM never lets it
    spin_ns(1, dev)
    tp.tile_pull(recv, table, plan, counters, programs=k, delays_C=delay_C, preload=True, **tune)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    unmoved = torch.isnan(recv).all() if moves else torch.equal(recv, full)
    assert unmoved and not counters.any(), "the preload moved rows or released counters"
    start, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    tg.tile_grouped_mm(recv, w, gemm, counters, sms_held_back=k, out=out)  # first: it waits for the pull
    end_ev.record()
    with torch.cuda.stream(side):
        spin_ns(1_000_000, dev)  # the GEMM is resident and waiting before the first row lands
        tp.tile_pull(recv, table, plan, counters, programs=k, delays_C=delay_C, **tune)
    torch.cuda.synchronize()
    if tune.get("rate"):
        # the GEMM ends after the pull's last release: the 1 ms spin, then the program with the most bytes at
        # its share of the rate (rate / K)
        rows_C = plan.tasks_C8[:, tp.ROWS].cpu()
        most = max(int(rows_C[p::k].sum()) for p in range(k))
        paced_ms = most * hidden * 2 * k / tune["rate"] * 1e3
        took = start.elapsed_time(end_ev)
        assert took >= 0.95 * (1.0 + paced_ms), f"the GEMM took {took:.3f} ms, the paced pull {paced_ms:.3f}"
    assert torch.equal(counters, gemm.targets_S), "final counters differ from the GEMM's targets"
    end = int(plan.offs_G[-1])
    assert torch.equal(recv[:end], full[:end]), "received rows differ from pull_reference"
    assert not torch.isnan(out[:end]).any(), "a tile was loaded before its rows arrived"
    assert torch.equal(out[:end], preset[:end]), "output differs from the same GEMM with counters preset"
    want = torch._grouped_mm(full, w, offs=plan.offs_G)
    torch.testing.assert_close(out[:end].float(), want[:end].float(), rtol=1.6e-2, atol=1e-2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--gpu-concurrent")
    a = p.parse_args(argv)
    if a.gpu_concurrent:
        gpu_concurrent(a.gpu_concurrent)
        print("ok", flush=True)
        return 0
    res = run_cpu_cases()
    with open(a.json, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
