"""The loopback overlap sweep: how much expert-parallel communication the MoK pipeline hides, on one GPU.

    python -m benchmarks.overlap --shapes dsv3-4k,qwen3-ep8 --gbps 0,900,450 --chunks 1,2 --json ov.json

(from the repository root). The layer holds one EP rank's experts (``mok_megatron.bench.shapes.
OVERLAP_SHAPES``); the loopback transport moves the bytes that rank would move at the emulated EP size
(expected remote ranks per token under uniform routing) with the copy engine and waits ``bytes /
bandwidth`` on a delay stream. For each link bandwidth and minibatch count it reports the layer time
(fwd+bwd), the link time of the bytes moved, and the exposed fraction ``(t - t0) / link time``, where
``t0`` is the same layer with no communication and no pipelining (MoK's plain EP=1 path).

It measures GPU streams: without a CUDA GPU it refuses in one line with its estimated cost
(``cpu_cost``); ``--allow-cpu`` runs it anyway (``--shapes tiny``: seconds). On CPU the loopback only
clones the rows (no link time is waited), so the rows there carry ``link_emulated: False`` and no exposed
fraction. Real expert parallelism over several GPUs is ``mok bench ep``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

from benchmarks.cpu_cost import cpu_estimate, cpu_refusal
from mok_megatron.bench.shapes import OVERLAP_SHAPES
from mok_megatron.bench.steps import MODES, graphed, inputs, median_time, stepper, stream_overlap

DEFAULT_SHAPES = "dsv3-4k,dsv3-16k,qwen3-ep8"
PROG = "python -m benchmarks.overlap"


def loopback_layer_args(shape: dict, chunks: int, gbps: float, loopback_bytes: str = "copy", **overrides):
    """The MoK layer's ``options`` and ``transport`` (``bench.build.build`` keywords) for one loopback point
    of an ``OVERLAP_SHAPES`` entry: ``chunks`` minibatches over its tokens, the loopback transport standing
    in for its EP size at ``gbps`` per direction (0 = infinite), moving its bytes as ``loopback_bytes``
    (``LoopbackBytes``); other ``MoKOptions`` fields as ``overrides``."""
    from mok_megatron.options import MoKOptions
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    link = LoopbackLink(ep=shape["ep"], gbps=gbps, bytes=loopback_bytes)
    options = MoKOptions(minibatch_size=math.ceil(shape["tokens"] / chunks), **overrides)
    transport = LoopbackTransport(link, shape["experts"], shape["topk"])  # the layer holds the slice
    return dict(options=options, transport=transport)


def bench_overlap(
    shapes,
    gbps_list,
    chunks_list,
    iters,
    warmup,
    profile_one=True,
    modes=("exact",),
    local_rows=("auto",),
    expert_backend="torch",
) -> list[dict]:
    """``expert_backend``: the experts' GEMMs of every layer timed, the no-communication baseline included
    (``--mok-expert-backend``; 'torch-fp8': native FP8, whose pipeline expert calls take padded rows)."""
    return _bench_overlap(
        shapes, gbps_list, chunks_list, iters, warmup, profile_one, modes, local_rows, expert_backend
    )


def _bench_overlap(
    shapes, gbps_list, chunks_list, iters, warmup, profile_one, modes, local_rows, expert_backend
) -> list[dict]:
    import torch

    from mok_megatron.bench.build import layer_config, init_single_process, build
    from mok_megatron.options import MoKOptions

    init_single_process()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in shapes:
        s = OVERLAP_SHAPES[name]
        cfg = layer_config(s, dtype)
        x, dout = inputs(s["tokens"], s["hidden"], dtype, device)
        torch.manual_seed(0)
        base = build("mok", cfg, options=MoKOptions(expert_backend=expert_backend)).to(device)
        sd = base.state_dict()
        ref = base(x)[0].detach().float()
        t0 = median_time(stepper(base, x, dout), iters, warmup)
        rows.append(dict(shape=name, gbps=None, chunks=0, ms=1e3 * t0, comm_ms=0.0))
        print(f"{name} [{expert_backend}]: no communication, no pipelining: {1e3 * t0:.2f} ms", flush=True)
        del base
        for gbps in gbps_list:
            for chunks in chunks_list:
                for mode, lr in [(m, lr) for m in modes for lr in local_rows]:
                    extra, graph = MODES[mode]
                    if graph and device.type != "cuda":
                        continue
                    args = loopback_layer_args(
                        s, chunks, gbps, local_rows=lr, expert_backend=expert_backend, **extra
                    )
                    opts = args["options"]
                    mode = mode if lr == "auto" else f"{mode} {lr}"
                    layer = build("mok", cfg, **args).to(device)
                    layer.load_state_dict(sd)
                    out = layer(x)[0].detach().float()
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                    fp8 = (
                        opts.fp8_dispatch or opts.fp8_combine or expert_backend != "torch"
                    )  # 2^-4 per e4m3 row
                    if err > (0.1 if fp8 else 2e-2):
                        raise RuntimeError(
                            f"{name}: pipelined output differs from the plain layer ({err:.2e})"
                        )
                    tr = layer.token_dispatcher.transport
                    step = stepper(layer, x, dout)
                    step()
                    b0 = tr.bytes_moved
                    step()
                    per_step = tr.bytes_moved - b0
                    if graph:
                        try:
                            step = graphed(layer, x, dout)
                        except Exception as e:  # report, never hide
                            traceback.print_exc()
                            print(f"{name} {mode}: CUDA graph capture failed: {e!r}"[:3000], flush=True)
                            continue
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    t = median_time(step, iters, warmup)
                    comm = per_step / (gbps * 1e9) if gbps else 0.0
                    emulated = device.type == "cuda"  # the link time is waited on GPUs only
                    row = dict(
                        shape=name,
                        expert_backend=expert_backend,
                        mode=mode,
                        gbps=gbps,
                        chunks=chunks,
                        minibatch=opts.minibatch_size,
                        ms=1e3 * t,
                        comm_ms=1e3 * comm,
                        exposed_ms=1e3 * (t - t0),
                        bytes_per_step=per_step,
                        exposed_frac=((t - t0) / comm) if comm and emulated else None,
                        link_emulated=emulated,
                        rel_err=err,
                        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                    )
                    rows.append(row)
                    frac = "-" if row["exposed_frac"] is None else f"{100 * row['exposed_frac']:.0f}%"
                    print(
                        f"{name} {mode} link {gbps or 'inf'} GB/s chunks {chunks}: {row['ms']:.2f} ms, link "
                        f"time {row['comm_ms']:.2f} ms, exposed {row['exposed_ms']:.2f} ms ({frac})",
                        flush=True,
                    )
                    del layer, step
    if device.type == "cuda" and any(MODES[m][1] for m in modes):
        _graphed_baselines(rows, shapes, iters, warmup, expert_backend, dtype, device)
    if profile_one and device.type == "cuda":
        s = OVERLAP_SHAPES[shapes[0]]
        best = min(
            (
                r
                for r in rows
                if r["shape"] == shapes[0] and r.get("gbps") and r["chunks"] > 1 and r["mode"] == "exact"
            ),
            key=lambda r: r["ms"],
            default=None,
        )
        if best:
            cfg = layer_config(s, dtype)
            args = loopback_layer_args(s, best["chunks"], best["gbps"], expert_backend=expert_backend)
            layer = build("mok", cfg, **args).to(device)
            x, dout = inputs(s["tokens"], s["hidden"], dtype, device)
            step = stepper(layer, x, dout)
            step()
            prof = stream_overlap(step, device)
            rows.append(dict(shape=shapes[0], profile=prof, gbps=best["gbps"], chunks=best["chunks"]))
            print(f"profile {shapes[0]} {best['gbps']} GB/s chunks {best['chunks']}: {prof}", flush=True)
    return rows


def _graphed_baselines(rows, shapes, iters, warmup, expert_backend, dtype, device) -> None:
    """The graphed rows' fair baseline: the no-communication layer's step replayed from a CUDA graph
    too (no host launch gaps; on an H200 0.7-2.3 ms faster than eager: docs/results/2026-12-01-loopback/shipped).
    Timed after every pipelined
    row, so that no graph of it is alive while they capture; each graphed row's exposed time is then
    taken against the faster baseline (``t0_ms``); eager rows keep the eager one."""
    import torch

    from mok_megatron.bench.build import layer_config, build
    from mok_megatron.options import MoKOptions

    for name in shapes:
        s = OVERLAP_SHAPES[name]
        x, dout = inputs(s["tokens"], s["hidden"], dtype, device)
        torch.manual_seed(0)
        opts = MoKOptions(expert_backend=expert_backend)
        base = build("mok", layer_config(s, dtype), options=opts).to(device)
        try:
            t0g = median_time(graphed(base, x, dout), iters, warmup)
        except Exception as e:  # report, never hide
            print(f"{name}: plain layer CUDA graph capture failed: {e!r}"[:3000], flush=True)
            continue
        finally:
            del base
        rows.append(dict(shape=name, gbps=None, chunks=0, ms=1e3 * t0g, comm_ms=0.0, graph=True))
        print(f"{name} [{expert_backend}]: no communication, CUDA graph: {1e3 * t0g:.2f} ms", flush=True)
        t0 = min(r["ms"] for r in rows if r["shape"] == name and r.get("gbps", 0) is None)
        for r in rows:
            in_graph = r.get("mode") is not None and MODES[r["mode"].split()[0]][1]
            if r["shape"] == name and r.get("gbps") is not None and "profile" not in r and in_graph:
                r["t0_ms"] = t0
                r["exposed_ms"] = r["ms"] - t0
                r["exposed_frac"] = (r["exposed_ms"] / r["comm_ms"]) if r["comm_ms"] else None


OVERLAP_COLUMNS = (
    "shape",
    "mode",
    "link GB/s",
    "minibatches",
    "layer ms",
    "link ms",
    "exposed ms",
    "exposed %",
    "peak GiB",
)
CPU_NOTE = (
    "On CPU the loopback transport waits no link time: 'link ms' is the nominal bytes / bandwidth, and "
    "an exposed fraction is not defined ('-')."
)


def format_overlap(rows) -> str:
    """Markdown table of ``OVERLAP_COLUMNS``: one row per timed point and per no-communication baseline
    ('plain EP=1', mode column), in the order timed; ``CPU_NOTE`` under it when a row waited no link time."""
    out = ["| " + " | ".join(OVERLAP_COLUMNS) + " |", "|" + "---|" * len(OVERLAP_COLUMNS)]
    for r in rows:
        if "profile" in r:
            continue
        if r["gbps"] is None:
            label = "plain EP=1 (CUDA graph)" if r.get("graph") else "plain EP=1"
            cells = [r["shape"], label, "none", "1", f"{r['ms']:.2f}", "0", "0", "-", "-"]
        else:
            frac = f"{100 * r['exposed_frac']:.0f}" if r["exposed_frac"] is not None else "-"
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
            cells = [r["shape"], r["mode"], f"{r['gbps'] or 'inf'}", f"{r['chunks']}", f"{r['ms']:.2f}"]
            cells += [f"{r['comm_ms']:.2f}", f"{r['exposed_ms']:.2f}", frac, peak]
        out.append("| " + " | ".join(cells) + " |")
    if any(r.get("link_emulated") is False for r in rows):
        out += ["", CPU_NOTE]
    return "\n".join(out)


def _cpu_cost(ns, shapes: list[str], chunks: list[int]) -> str:
    """The estimated cost of this sweep on this CPU (``cpu_cost.cpu_estimate``)."""
    from benchmarks.cpu_cost import matmul_gflops

    modes = [m for m in ns.modes.split(",") if not MODES[m][1]]  # CUDA-graph modes are skipped on CPU
    points = len(ns.gbps.split(",")) * len(chunks) * len(modes) * len(ns.local_rows.split(","))
    return cpu_estimate({n: OVERLAP_SHAPES[n] for n in shapes}, points, ns.iters, ns.warmup, matmul_gflops())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help=f"comma list of {', '.join(OVERLAP_SHAPES)} (default {DEFAULT_SHAPES}); "
        "tiny runs on CPU in seconds",
    )
    p.add_argument("--gbps", default="0,900,450,50", help="emulated link GB/s per direction (0 = infinite)")
    p.add_argument("--chunks", default="1,2,4,8", help="minibatches per layer call to sweep")
    p.add_argument("--modes", default="exact", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--local-rows", default="auto", help="comma list of --mok-local-rows settings to time")
    p.add_argument(
        "--expert-backend",
        default="torch",
        help="the MoK layers' expert GEMMs, the baseline's too (torch | torch-fp8; --mok-expert-backend)",
    )
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA GPU (estimated cost printed)")
    ns = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    chunks = [int(c) for c in ns.chunks.split(",")]
    shapes = ns.shapes.split(",")
    bad = [n for n in shapes if n not in OVERLAP_SHAPES]
    if bad:
        p.error(f"--shapes {','.join(bad)}: overlap shapes are {', '.join(OVERLAP_SHAPES)}")
    bad = [m for m in ns.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes {','.join(bad)}: choose from {', '.join(MODES)}")
    import torch

    if not torch.cuda.is_available():
        cost = _cpu_cost(ns, shapes, chunks)
        if not ns.allow_cpu:
            print(cpu_refusal(PROG, cost), file=sys.stderr)
            return 2
        print(f"{PROG}: no CUDA GPU, running on CPU: {cost}", file=sys.stderr, flush=True)
    rows = bench_overlap(
        shapes,
        [float(g) for g in ns.gbps.split(",")],
        chunks,
        ns.iters,
        ns.warmup,
        modes=ns.modes.split(","),
        local_rows=ns.local_rows.split(","),
        expert_backend=ns.expert_backend,
    )
    print(format_overlap(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
