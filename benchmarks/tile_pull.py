"""The tile engine's pull beside its waiting GEMM: how much of the exchange does fc1 forward hide?

One GPU stands in for an EP rank (loopback): every source rank's rows for this rank sit in a buffer of this
GPU, and K programs (``kernels.tile_pull``) pull them expert by expert into the expert-major receive buffer,
releasing each row tile's counter, while the waiting grouped GEMM (``kernels.tile_gemm``, QuACK's order,
``132 - K`` SMs) runs fc1 forward on another stream, launched first.

Timed, per slice and K, in one process:
    pull alone            unpaced: achieved GB/s (received bytes / time)
    torch._grouped_mm     fc1 on all SMs (the fully received buffer)
    GEMM alone            the waiting GEMM, counters preset, K SMs held back
    layer                 the counters zeroed (one small kernel), the GEMM launched first, then the pull (paced
                          at each --gbps rate, 0: unpaced) on another stream; the time until both are done
    exposed = layer - GEMM alone; link = the received bytes at the rate (unpaced: the pull alone's time);
    hidden = 1 - exposed / link
Every layer run's output is checked against the GEMM with counters preset (bit for bit) before it is timed.

The pull's tuning (``kernels.tile_pull``: --block-bytes, --warps, --stages, --copy, each a comma list):
every combination is timed at every K and rate in the same process, its lines labelled ``block B warps W
stages S`` (and ``copy C`` when --copy is given, ``per-sm N`` when --per-sm is: K x N programs, N for each of
the K SMs the GEMM leaves, more bytes in flight per SM as far as the SM holds N of them at once) and its JSON
rows carrying block_bytes, num_warps, stages and copy (the kernel's defaults where not given). --copy
registers,tma times the register path against the TMA bulk copies (``copy="tma"``) at the same blocks;
``copy="none"`` (no row moved) is refused here, where the copy is what is timed: ``benchmarks.tile_layer
--copy none`` times the link-only ceiling. A combination over the kernel's budget (``tile_pull.check_tuning``:
registers, or shared memory for tma) is skipped with the reason, and so is a --per-sm N whose N programs'
blocks in flight alone fill an SM's registers (or exceed its shared memory for tma: ``unresident``): the
programs past those resident would start only as others end. Below that bound whether N programs share an SM
depends on the compiled kernel's registers, which this benchmark does not read. A value the kernel refuses on
its own is refused.

A waiting GEMM whose counters never reach their targets never ends: ``--case-timeout`` ends the process
(status 3) after writing the JSON gathered so far (``tile_gemm_gate.CaseWatchdog``).

Legend: P source ranks, G local experts, H hidden, F expert FFN width, M rows received.

    python -m benchmarks.tile_pull --json pull.json       # sm_90 (QuACK needed: pip install quack-kernels)
    python -m benchmarks.tile_pull --k 4,8 --gbps 900 --shapes qwen3-ep8
    python -m benchmarks.tile_pull --k 8,16 --gbps 900,450 --shapes deepseek-v3-ep32-16k   # 4x the rows
    python -m benchmarks.tile_pull --k 8,16 --gbps 0 --block-bytes 32768,65536 --stages 1,2,4
    python -m benchmarks.tile_pull --k 8,16 --gbps '' --stages 1,2,4      # the pull alone (no GEMM beside it)
    python -m benchmarks.tile_pull --k 8,16 --gbps '' --copy registers,tma --stages 1,2   # TMA vs registers
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch

from benchmarks.tile_gemm_gate import (
    DEFAULT_SHAPES,
    SHAPE_CONFIG,
    SHAPES,
    CaseWatchdog,
    counts_by_source,
    parse_ks,
    time_ms,
)

CHUNK_ROWS = 64  # rows per pulled chunk (a chunk of DeepSeek-V3's 7168-wide bf16 rows: 0.9 MB)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """One combination of the pull's tuning; ``label`` is "" when no tuning option was given (the kernel's
    defaults, printed as before)."""

    block_bytes: int
    num_warps: int
    stages: int
    label: str
    copy: str = "registers"
    per_sm: int = 1  # pulling programs per held-back SM (programs = K x per_sm)

    def kwargs(self) -> dict:
        return dict(
            block_bytes=self.block_bytes, num_warps=self.num_warps, stages=self.stages, copy=self.copy
        )


def parse_ints(flag: str, text: str) -> list[int]:
    """A comma list of integers, duplicates dropped, in order."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}; it must be a comma list of integers, e.g. 1,2,4") from None
    if not values:
        raise ValueError(f"{flag} {text!r}; it must name at least one value")
    return list(dict.fromkeys(values))


def parse_names(flag: str, text: str) -> list[str]:
    """A comma list of names, duplicates dropped, in order."""
    values = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not values:
        raise ValueError(f"{flag} {text!r}; it must name at least one value")
    return values


def unresident(per_sm: int, copy: str, block_bytes: int, stages: int) -> str | None:
    """Why ``per_sm`` programs of this tuning cannot all be resident on one SM, or None: their blocks in flight
    alone fill its register file (copy "registers": nothing left for addresses and indices) or exceed a CTA's
    shared memory (copy "tma"). Programs past those resident start only as others end, so the rows would time
    a queue of paced programs, not ``per_sm`` programs copying at once. Below these bounds residency still
    depends on the compiled kernel's registers (``kernels.tile_pull``'s notes: 64 per thread at 16 warps and
    64 KiB blocks, so two such programs fill an SM's registers)."""
    from mok_megatron.kernels import tile_pull as tp

    held = per_sm * stages * block_bytes
    if copy == "tma":
        limit, what, over = tp.SHARED_PER_CTA, "shared memory", held > tp.SHARED_PER_CTA
    else:
        limit, what = tp.REGISTERS_PER_SM * 4, "register file"
        over = held >= limit
    if per_sm == 1 or not over:
        return None
    return (
        f"{per_sm} programs x stages={stages} x block_bytes={block_bytes} = {held} bytes in flight on one SM, "
        f"against its {what} of {limit} bytes: they cannot all be resident at once (the later ones would start "
        "as the earlier end); lower --per-sm, --stages or --block-bytes"
    )


def tunings(
    block_bytes: str | None,
    warps: str | None,
    stages: str | None,
    copy: str | None = None,
    per_sm: str | None = None,
) -> tuple[list[Tuning], list[str]]:
    """Every combination of the comma lists (the kernel's default where a list is None), and one line per
    combination skipped for the kernel's budget. Raises ValueError for a value the kernel refuses on its own
    or when every combination is over the budget."""
    from mok_megatron.kernels import tile_pull as tp

    given = any(x is not None for x in (block_bytes, warps, stages, copy, per_sm))
    copies = parse_names("--copy", copy) if copy is not None else ["registers"]
    per_sms = parse_ints("--per-sm", per_sm) if per_sm is not None else [1]
    if min(per_sms) < 1:
        raise ValueError(f"--per-sm {per_sm!r}; every value must be >= 1 (pulling programs per held-back SM)")
    if "none" in copies:
        raise ValueError(
            "--copy none; this benchmark times the pull's copy (GB/s, rows checked as they land) and "
            "copy none moves no row: time the link-only ceiling with benchmarks.tile_layer --copy none"
        )
    lists = [
        parse_ints(flag, text) if text is not None else [default]
        for flag, text, default in (
            ("--block-bytes", block_bytes, tp.BLOCK_BYTES),
            ("--warps", warps, tp.NUM_WARPS),
            ("--stages", stages, tp.STAGES),
        )
    ]
    out, skipped = [], []
    for n, cp, b, w, st in itertools.product(per_sms, copies, *lists):
        name = f"block {b} warps {w} stages {st}" + (f" copy {cp}" if copy is not None else "")
        name += f" per-sm {n}" if per_sm is not None else ""
        tp.check_tuning(b, w, st, op=name, budget=False, copy=cp)
        try:
            tp.check_tuning(b, w, st, op=name, copy=cp)
        except ValueError as e:
            skipped.append(f"skipped {e}")
            continue
        if why := unresident(n, cp, b, st):
            skipped.append(f"skipped {name}: {why}")
            continue
        out.append(Tuning(b, w, st, name if given else "", cp, n))
    if not out:
        raise ValueError(f"every tuning is over the kernel's budget: {'; '.join(skipped)}")
    return out, skipped


def problem(shape: dict, device, chunk_rows: int):
    """Sources, receive buffer, fc1 weights and the pull plan of one slice (QuACK's tile order)."""
    from mok_megatron.kernels import tile_gemm as tg
    from mok_megatron.kernels import tile_pull as tp

    cfg = getattr(tg, SHAPE_CONFIG[shape["name"]])
    c_PG = counts_by_source(shape).to(device)
    rows = int(c_PG.sum())
    h, f, g = shape["hidden"], shape["ffn"], shape["local"]
    bf = torch.bfloat16
    bufs = [torch.randn(int(n), h, device=device, dtype=bf) for n in c_PG.sum(1).tolist()]
    plan = tp.pull_plan(c_PG, rows, cfg, chunk_rows)
    gemm = tg.tile_plan(plan.offs_G, rows, 2 * f, cfg)
    return dict(
        config=cfg,
        rows=rows,
        bytes=rows * h * 2,
        bufs=bufs,
        table=tp.source_table(bufs),
        plan=plan,
        gemm=gemm,
        w=torch.randn(g, 2 * f, h, device=device, dtype=bf).mT,  # fc1: y = x @ w1[g].T
        recv=torch.empty(rows, h, device=device, dtype=bf),
        counters=torch.zeros(plan.slots, dtype=torch.int32, device=device),
    )


def sweep_shape(name, a, ks, rates, tunes, watchdog, side, rows_out) -> None:
    """Times one slice at every K, tuning and rate, appending one row per (K, tuning, rate) to
    ``rows_out``."""
    from mok_megatron.kernels import tile_gemm as tg
    from mok_megatron.kernels import tile_pull as tp

    dev = torch.device("cuda")
    shape = dict(SHAPES[name], name=name)
    pr = problem(shape, dev, a.chunk_rows)
    plan, gemm, recv, counters, w = pr["plan"], pr["gemm"], pr["recv"], pr["counters"], pr["w"]
    gb = pr["bytes"] / 1e9
    # the received buffer and the GEMM's output with counters preset: what every layer run must give
    tp.pull_reference(recv, pr["bufs"], plan, counters.zero_())
    ref = torch._grouped_mm(recv, w, offs=plan.offs_G)
    with watchdog.case(f"{name} torch._grouped_mm"):
        torch_ms = time_ms(lambda: torch._grouped_mm(recv, w, offs=plan.offs_G), a.iters, a.rounds)
    print(
        f"{name}: {pr['rows']} rows, {gb:.3f} GB received; torch._grouped_mm fc1 {torch_ms:.3f} ms",
        flush=True,
    )
    for k in ks:
        out = torch.empty_like(ref)

        def gemm_preset(k=k, out=out):
            tg.tile_grouped_mm(recv, w, gemm, gemm.targets_S, sms_held_back=k, out=out)

        gemm_preset()  # compiles
        with watchdog.case(f"{name} k={k} GEMM alone"):
            torch.cuda.synchronize()
            preset = out.clone()
            gemm_ms = time_ms(gemm_preset, a.iters, a.rounds)

        gemm_line = f"GEMM alone {gemm_ms:.3f} ms ({gemm_ms / torch_ms:.3f}x torch)"
        if tunes[0].label:
            print(f"  k={k:2d}: {gemm_line}", flush=True)
        for tune in tunes:
            at = f" {tune.label}" if tune.label else ""  # "" (defaults): the lines as without a tuning
            values = dict(tuning=tune.label, per_sm=tune.per_sm, **tune.kwargs())
            programs = k * tune.per_sm

            def pull_alone(programs=programs, tune=tune):
                tp.tile_pull(recv, pr["table"], plan, counters.zero_(), programs=programs, **tune.kwargs())

            pull_alone()
            with watchdog.case(f"{name} k={k}{at} pull alone"):
                torch.cuda.synchronize()
                pull_ms = time_ms(pull_alone, a.iters, a.rounds)
            pull_line = f"pull alone {pull_ms:.3f} ms = {gb / pull_ms * 1e3:.0f} GB/s"
            print(
                f"  k={k:2d}{at}: {pull_line}" if at else f"  k={k:2d}: {gemm_line}, {pull_line}", flush=True
            )
            if not rates:  # --gbps '': the pull alone only
                rows_out.append(dict(shape=name, k=k, bytes=pr["bytes"], **values, pull_ms=pull_ms,
                                     pull_gbps=gb / pull_ms * 1e3))  # fmt: skip
            for gbps in rates:
                rate = gbps * 1e9

                def layer(k=k, out=out, rate=rate, tune=tune, programs=programs):
                    counters.zero_()
                    side.wait_stream(torch.cuda.current_stream())
                    tg.tile_grouped_mm(recv, w, gemm, counters, sms_held_back=k, out=out)  # first: it waits
                    with torch.cuda.stream(side):
                        tp.tile_pull(
                            recv, pr["table"], plan, counters, programs=programs, rate=rate, **tune.kwargs()
                        )
                    torch.cuda.current_stream().wait_stream(side)

                case = f"{name} k={k}{at} layer at {gbps:g} GB/s"
                # loaded before the GEMM waits for it: a kernel's first launch may wait for an idle device
                tp.tile_pull(recv, pr["table"], plan, counters, programs=programs, rate=rate, preload=True,
                             **tune.kwargs())  # fmt: skip
                with watchdog.case(case):
                    recv.fill_(float("nan"))
                    layer()
                    torch.cuda.synchronize()
                    same = bool(torch.equal(out, preset))
                    if not same:
                        print(
                            f"  {case}: output differs from the GEMM with counters preset; not timed",
                            flush=True,
                        )
                        rows_out.append(dict(shape=name, k=k, gbps=gbps, **values, error="output differs"))
                        continue
                    layer_ms = time_ms(layer, a.iters, a.rounds)
                link_ms = pr["bytes"] / rate * 1e3 if rate > 0 else pull_ms
                exposed = layer_ms - gemm_ms
                row = dict(
                    shape=name,
                    config=repr(pr["config"]),
                    rows=pr["rows"],
                    bytes=pr["bytes"],
                    k=k,
                    gbps=gbps,
                    chunk_rows=a.chunk_rows,
                    **values,
                    torch_ms=torch_ms,
                    gemm_ms=gemm_ms,
                    gemm_ratio=gemm_ms / torch_ms,
                    pull_ms=pull_ms,
                    pull_gbps=gb / pull_ms * 1e3,
                    layer_ms=layer_ms,
                    layer_ratio=layer_ms / torch_ms,
                    exposed_ms=exposed,
                    link_ms=link_ms,
                    hidden=1 - exposed / link_ms,
                )
                rows_out.append(row)
                print(
                    f"  k={k:2d}{at} {'unpaced' if rate == 0 else f'{gbps:g} GB/s':>9s}: layer {layer_ms:.3f} "
                    f"ms ({layer_ms / torch_ms:.3f}x torch), exposed {exposed:.3f} ms of link {link_ms:.3f} "
                    f"ms: hidden {row['hidden']:.1%}",
                    flush=True,
                )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"a comma list of {', '.join(SHAPES)}")
    p.add_argument("--k", default="2,4,8,16", help="SMs that pull (held back from the GEMM), a comma list")
    p.add_argument(
        "--gbps",
        default="900,450,0",
        help="paced link rates in GB/s, a comma list; 0: unpaced; '' (none): the pull alone, no layer runs",
    )
    p.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    p.add_argument("--block-bytes", default=None, help="bytes per block (a power of two), a comma list")
    p.add_argument("--warps", default=None, help="warps per pulling program, a comma list")
    p.add_argument("--stages", default=None, help="blocks in flight per pulling program, a comma list")
    p.add_argument("--copy", default=None, help="the pull's copy path (registers, tma), a comma list")
    p.add_argument(
        "--per-sm",
        default=None,
        help="pulling programs per held-back SM (K x this programs on the K SMs the GEMM leaves), a comma list",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--case-timeout", type=float, default=120.0, help="seconds per case; 0: no limit")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        ks = parse_ks(a.k)
        rates = [float(x) for x in a.gbps.split(",") if x.strip()]
        tunes, skipped = tunings(a.block_bytes, a.warps, a.stages, a.copy, a.per_sm)
    except ValueError as e:
        print(f"tile_pull: {e}", file=sys.stderr)
        return 2
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"tile_pull: --shapes {','.join(unknown)}; known: {','.join(SHAPES)}", file=sys.stderr)
        return 2
    if min(ks) < 1 or min(rates, default=0) < 0:
        print(
            f"tile_pull: --k {a.k} --gbps {a.gbps}; every K must be >= 1 and every rate >= 0", file=sys.stderr
        )
        return 2
    for line in skipped:
        print(f"tile_pull: {line}", flush=True)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("tile_pull: needs an sm_90 GPU (QuACK's sm_90 kernels); none here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows_out: list[dict] = []
    result = dict(device=torch.cuda.get_device_name(dev), argv=sys.argv[1:] if argv is None else argv)
    if skipped:
        result["skipped"] = skipped

    def write(incomplete=None) -> str:
        if not a.json:
            return "no --json: nothing written"
        with open(a.json, "w") as fh:
            json.dump(dict(result, incomplete=incomplete, rows=rows_out), fh, indent=1)
        return f"results so far in {a.json}"

    watchdog = CaseWatchdog(a.case_timeout, lambda case: write(incomplete=f"timed out: {case}"))
    side = torch.cuda.Stream()

    for name in shapes:
        sweep_shape(name, a, ks, rates, tunes, watchdog, side, rows_out)
        torch.cuda.empty_cache()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
