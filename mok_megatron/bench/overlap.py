"""Overlap benchmarks: how much expert-parallel communication the MoK pipeline hides.

``mok bench overlap`` (one GPU): the layer holds one EP rank's experts; the loopback transport moves
the bytes that rank would move at the emulated EP size (expected remote ranks per token under
uniform routing) with the copy engine and waits ``bytes / bandwidth`` on a delay stream. For each
link bandwidth and minibatch count it reports the layer time (fwd+bwd), the link time of the bytes
moved, and the exposed fraction ``(t - t0) / link time``, where ``t0`` is the same layer with no
communication and no pipelining (MoK's plain EP=1 path). On CPU the loopback only clones the rows (no
link time is waited), so the rows there carry ``link_emulated: False`` and no exposed fraction; a CPU run
first prints its estimated cost (``bench.cpu_cost``).

``mok bench ep`` (``torchrun --nproc-per-node N -m mok_megatron.bench.overlap ep``): real expert
parallelism over N GPUs (N local experts per rank x N ranks), MoK per transport and minibatch count vs
Megatron-Core's alltoall ``MoELayer`` (TEGroupedMLP when Transformer Engine is importable), and the
same per-rank work at EP=1 (each rank alone), so exposed communication = t(EP=N) - t(EP=1).

``mok bench ep --schedules plain,1f1b`` (``layer``, the default, is the sweep above; list it to run both):
Megatron's combined 1F1B EP-overlap schedule (``--overlap-moe-expert-parallel-comm
--delay-wgrad-compute``), which overlaps one micro-batch's forward with another's backward layer by
layer, against the plain schedule, for Megatron's alltoall layer and for MoK's, at EP=N: a one-layer GPT
(attention + MoE, the shape's per-rank tokens per micro-batch) through ``forward_backward_no_pipelining``
with ``--microbatches`` (2); ms per micro-batch pair, the 1f1b / plain ratio and MoK / Megatron per
schedule; losses checked first (MoK's bitwise across the schedules). Needs EP > 1 (``bench.schedules``).

Times are medians of CUDA-event timings (max over ranks); outputs are checked against Megatron first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback

OVERLAP_SHAPES = {
    # name: per-rank slice (L local experts), emulated EP size
    "dsv3-4k": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096, ep=32),
    "dsv3-16k": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=16384, ep=32),
    # the same slice with DeepSeek-V3's shared expert (ffn 2048), overlapped as Megatron's
    # --moe-shared-expert-overlap does: its GEMMs run on a side stream beside the exchanges
    "dsv3-4k-shared": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096, ep=32, shared=2048),
    "qwen3-ep8": dict(hidden=2048, ffn=768, experts=16, topk=8, tokens=16384, ep=8),
    "tiny": dict(hidden=64, ffn=64, experts=4, topk=2, tokens=256, ep=4),
    "tiny-shared": dict(hidden=64, ffn=64, experts=4, topk=2, tokens=256, ep=4, shared=64),
}
EP_SHAPES = {
    # per-rank: local experts, tokens; attention (heads, KV groups, head size) of --schedules' model
    # (bench.schedules): DeepSeek-V3's MLA stood in for by 56 heads of 128 (205M parameters against
    # MLA's 187M), Qwen3-30B-A3B's GQA as published (32 heads of 128, 4 KV groups)
    "dsv3": dict(hidden=7168, ffn=2048, local=8, topk=8, tokens=4096, heads=56),
    "qwen3": dict(hidden=2048, ffn=768, local=64, topk=8, tokens=16384, heads=32, groups=4, kv_channels=128),
    "tiny": dict(hidden=64, ffn=64, local=4, topk=2, tokens=256, heads=4),
}


def _time(step, iters: int, warmup: int) -> float:
    from mok_megatron.bench.layer import time_steps

    return statistics.median(time_steps(step, iters, warmup))


def _stepper(layer, x, dout):
    def step():
        xi = x.detach().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(dout)
        layer.zero_grad(set_to_none=True)
        return out

    return step


def _graphed(layer, x, dout):
    """Capture one forward+backward of ``layer`` in a CUDA graph; returns the replay function.
    (Sync-free mode only: the exact mode reads counts on the host.)"""
    import torch

    xs = x.detach().clone().requires_grad_()

    def fwd_bwd():
        out, _ = layer(xs)
        out.backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)  # captured backward writes fresh gradients, as an eager step after
    xs.grad = None  # zero_grad does: no accumulation kernels in the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd_bwd()
    return graph.replay


MODES = {  # label: (MoKOptions overrides, capture in a CUDA graph)
    "exact": ({}, False),
    "sync-free": (dict(sync_free=True), False),
    "sync-free+graph": (dict(sync_free=True), True),
    "exact+fp8": (dict(fp8_dispatch=True), False),  # --mok-fp8-dispatch
    "sync-free+graph+fp8": (dict(sync_free=True, fp8_dispatch=True), True),
    # --mok-fp8-dispatch --mok-fp8-combine: both exchanges' rows in e4m3 (gradients bf16)
    "sync-free+graph+fp8-both": (dict(sync_free=True, fp8_dispatch=True, fp8_combine=True), True),
    # --mok-late-wgrad: weight gradients after the last dispatch-backward exchange (A/B against the default)
    "sync-free+graph+late-wgrad": (dict(sync_free=True, late_wgrad=True), True),
    # the loopback's link time only, its bytes not copied (received rows = sent rows): the schedule's hiding
    # when the bytes move beside the GEMMs (they do not on one GPU: benchmarks/paced_copy_probe.py)
    "sync-free+graph+link-only": (dict(sync_free=True, loopback_bytes="link"), True),
    "sync-free+graph+late-wgrad+link-only": (
        dict(sync_free=True, late_wgrad=True, loopback_bytes="link"),
        True,
    ),
    # --mok-minibatch-split experts: each minibatch every token through one group of local experts
    "exact+experts": (dict(minibatch_split="experts"), False),
    "sync-free+graph+experts": (dict(sync_free=True, minibatch_split="experts"), True),
    "sync-free+graph+experts+link-only": (
        dict(sync_free=True, minibatch_split="experts", loopback_bytes="link"),
        True,
    ),
    # no option: the layer as built, replayed from a CUDA graph (the no-communication baselines)
    "graph": ({}, True),
}


def loopback_layer_args(shape: dict, chunks: int, gbps: float, loopback_bytes: str = "copy", **overrides):
    """The MoK layer's ``options`` and ``transport`` (``bench.layer.build`` keywords) for one loopback point
    of an ``OVERLAP_SHAPES`` entry: ``chunks`` minibatches over its tokens, the loopback transport standing
    in for its EP size at ``gbps`` per direction (0 = infinite), moving its bytes as ``loopback_bytes``
    (``LoopbackBytes``); other ``MoKOptions`` fields as ``overrides``."""
    from mok_megatron.options import MoKOptions
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    link = LoopbackLink(ep=shape["ep"], gbps=gbps, bytes=loopback_bytes)
    options = MoKOptions(minibatch_size=math.ceil(shape["tokens"] / chunks), **overrides)
    transport = LoopbackTransport(link, shape["experts"], shape["topk"])  # the layer holds the slice
    return dict(options=options, transport=transport)


def transport_options(label: str) -> dict:
    """``mok bench ep --transports`` label -> ``MoKOptions`` fields. ``nvlink-flags``: the nvlink transport
    signalled by per-peer ready flags; ``nvlink:F/B`` (or ``nvlink-flags:F/B``): F CTAs communicate in the
    forward and B in the backward (the communication budget; ``nvlink:F`` for both)."""
    name, _, budget = label.partition(":")
    opts = dict(transport=name, nvlink_sync="barrier")
    if name == "nvlink-flags":
        opts.update(transport="nvlink", nvlink_sync="flags")
    if budget:
        if opts["transport"] != "nvlink":
            raise ValueError(f"transport {label!r}: a CTA budget (':F/B') applies to nvlink only")
        fwd, _, bwd = budget.partition("/")
        try:
            opts.update(nvlink_programs=int(fwd), nvlink_programs_backward=int(bwd) if bwd else None)
        except ValueError:
            raise ValueError(
                f"transport {label!r}: the budget is ':F' or ':F/B' in CTAs, e.g. nvlink:32/16"
            ) from None
    return opts


def _inputs(tokens, hidden, dtype, device, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 1, hidden, generator=g).to(device, dtype)
    dout = (torch.randn(tokens, 1, hidden, generator=g) * 1e-2).to(device, dtype)
    return x, dout


def stream_overlap(step, device) -> dict:
    """Profile one step: busy time of each CUDA stream and the time two or more streams run at once."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import time

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t_host = time.perf_counter()
        step()
        t_host = time.perf_counter() - t_host  # host enqueue (and any host waits) of one step
        torch.cuda.synchronize()
    spans: dict[int, list] = {}
    kernels = 0
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        kernels += 1
        stream = getattr(e, "stream", None) or getattr(e, "device_resource_id", 0)
        spans.setdefault(stream, []).append((e.time_range.start, e.time_range.end))

    def union(iv):
        iv = sorted(iv)
        out = []
        for a, b in iv:
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    busy = {s: union(v) for s, v in spans.items()}
    # time covered by >= 2 streams
    marks = sorted(
        [(a, 1) for v in busy.values() for a, _ in v] + [(b, -1) for v in busy.values() for _, b in v]
    )
    depth, last, both = 0, None, 0.0
    for t, d in marks:
        if depth >= 2 and last is not None:
            both += t - last
        depth += d
        last = t
    starts = [a for v in busy.values() for a, _ in v]
    ends = [b for v in busy.values() for _, b in v]
    return {
        "busy_ms_per_stream": {str(s): sum(b - a for a, b in v) / 1e3 for s, v in busy.items()},
        "concurrent_ms": both / 1e3,
        "gpu_span_ms": (max(ends) - min(starts)) / 1e3 if starts else 0.0,
        "gpu_ops": kernels,
        "host_ms": 1e3 * t_host,
    }


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

    from mok_megatron.bench.layer import _config, _init_single_process, build
    from mok_megatron.options import MoKOptions

    _init_single_process()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in shapes:
        s = OVERLAP_SHAPES[name]
        cfg = _config(s, dtype)
        x, dout = _inputs(s["tokens"], s["hidden"], dtype, device)
        torch.manual_seed(0)
        base = build("mok", cfg, options=MoKOptions(expert_backend=expert_backend)).to(device)
        sd = base.state_dict()
        ref = base(x)[0].detach().float()
        t0 = _time(_stepper(base, x, dout), iters, warmup)
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
                    step = _stepper(layer, x, dout)
                    step()
                    b0 = tr.bytes_moved
                    step()
                    per_step = tr.bytes_moved - b0
                    if graph:
                        try:
                            step = _graphed(layer, x, dout)
                        except Exception as e:  # report, never hide
                            traceback.print_exc()
                            print(f"{name} {mode}: CUDA graph capture failed: {e!r}"[:3000], flush=True)
                            continue
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    t = _time(step, iters, warmup)
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
            cfg = _config(s, dtype)
            args = loopback_layer_args(s, best["chunks"], best["gbps"], expert_backend=expert_backend)
            layer = build("mok", cfg, **args).to(device)
            x, dout = _inputs(s["tokens"], s["hidden"], dtype, device)
            step = _stepper(layer, x, dout)
            step()
            prof = stream_overlap(step, device)
            rows.append(dict(shape=shapes[0], profile=prof, gbps=best["gbps"], chunks=best["chunks"]))
            print(f"profile {shapes[0]} {best['gbps']} GB/s chunks {best['chunks']}: {prof}", flush=True)
    return rows


def _graphed_baselines(rows, shapes, iters, warmup, expert_backend, dtype, device) -> None:
    """The graphed rows' fair baseline: the no-communication layer's step replayed from a CUDA graph
    too (no host launch gaps; on an H200 0.7-2.3 ms faster than eager: docs/results/2026-12-01-late-wgrad-*,
    docs/results/2026-12-01-loopback-overlap-5). Timed after every pipelined
    row, so that no graph of it is alive while they capture; each graphed row's exposed time is then
    taken against the faster baseline (``t0_ms``); eager rows keep the eager one."""
    import torch

    from mok_megatron.bench.layer import _config, build
    from mok_megatron.options import MoKOptions

    for name in shapes:
        s = OVERLAP_SHAPES[name]
        x, dout = _inputs(s["tokens"], s["hidden"], dtype, device)
        torch.manual_seed(0)
        base = build("mok", _config(s, dtype), options=MoKOptions(expert_backend=expert_backend)).to(device)
        try:
            t0g = _time(_graphed(base, x, dout), iters, warmup)
        except Exception as e:  # report, never hide
            print(f"{name}: plain layer CUDA graph capture failed: {e!r}"[:3000], flush=True)
            continue
        finally:
            del base
        rows.append(dict(shape=name, gbps=None, chunks=0, ms=1e3 * t0g, comm_ms=0.0, graph=True))
        print(f"{name} [{expert_backend}]: no communication, CUDA graph: {1e3 * t0g:.2f} ms", flush=True)
        t0 = min(r["ms"] for r in rows if r["shape"] == name and r.get("gbps", 0) is None)
        for r in rows:
            graphed = r.get("mode") is not None and MODES[r["mode"].split()[0]][1]
            if r["shape"] == name and r.get("gbps") is not None and "profile" not in r and graphed:
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


# ---- real EP over torchrun ----------------------------------------------------------------------


def _ep_config(s, world, ep, dtype):
    from mok_megatron.bench.layer import _config

    cfg = _config(dict(hidden=s["hidden"], ffn=s["ffn"], experts=s["local"] * ep, topk=s["topk"]), dtype)
    cfg.expert_model_parallel_size = ep
    return cfg


def _reinit(ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)


def bench_ep(
    shapes,
    transports,
    chunks_list,
    iters,
    warmup,
    modes=("exact",),
    profile=False,
    no_b=False,
    kernels=False,
    local_rows=("overlap", "fused"),
    expert_backend="torch",
    schedules=("layer",),
    microbatches=2,
) -> list[dict]:
    """``schedules``: ``layer`` (this sweep) and / or ``plain``, ``1f1b`` (``bench.schedules``, with
    ``microbatches`` per call). ``expert_backend``: the MoK layers' experts (``--mok-expert-backend``;
    Megatron's layer keeps its own). ``profile``: also one profiled step (streams busy and concurrent,
    GPU ops, host enqueue) of Megatron's layer and of every one-minibatch exact-mode MoK variant at EP=N
    (``kernels``: also its top kernels and host ops, ``kernel_profile.kernel_summary``). ``no_b``: also
    each transport with all local rows in region A (``pipeline_plan.MIN_LOCAL_HALF`` set huge).
    ``local_rows``: the ``--mok-local-rows`` settings to time per transport (overlap, fused)."""
    import torch
    import torch.distributed as dist

    import mok_megatron.engine.pipeline_plan as plan_module
    from mok_megatron.bench.layer import build
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.compat import have_te
    from mok_megatron.options import MoKOptions

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    meg = "megatron-te" if have_te() else "megatron"
    default_half = plan_module.MIN_LOCAL_HALF

    def tmax(t):
        v = torch.tensor([t], device=device, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    rows = []
    for name in shapes if "layer" in schedules else ():
        s = EP_SHAPES[name]
        x, dout = _inputs(s["tokens"], s["hidden"], dtype, device, seed=rank)
        for ep in (world, 1):
            _reinit(ep)
            cfg = _ep_config(s, world, ep, dtype)
            torch.manual_seed(0)
            ref_cfg = cfg
            if meg == "megatron-te":  # Megatron's fast path: TEGroupedMLP + fused permute
                import copy

                ref_cfg = copy.copy(cfg)
                ref_cfg.moe_permute_fusion = True
            ref = build(meg, ref_cfg).to(device)
            sd = ref.state_dict()
            ref_out = ref(x)[0].detach().float()
            t = tmax(_time(_stepper(ref, x, dout), iters, warmup))
            rows.append(dict(shape=name, ep=ep, impl=meg, transport="nccl a2a", chunks=1, ms=1e3 * t))
            if profile and cuda and ep > 1:
                rows[-1]["profile"] = _profiled(name, meg, _stepper(ref, x, dout), device, rank)
                if kernels:
                    _kernels(f"{name} EP={ep} {meg}", _stepper(ref, x, dout), 1e3 * t, rank)
            del ref
            mok_sd = convert_state_dict(sd, "mok")
            variants = [("plain", None, 1, "exact")]
            if ep == 1 and cuda:
                # the same work replayed from a CUDA graph: the fair baseline of graphed MoK rows (on an H200
                # the one-GPU layer runs 0.7-2.3 ms faster so); after every EP=N row
                variants += [("plain+graph", None, 1, "graph")]
            if ep > 1:
                variants += [
                    (f"{tr} {lr}", tr, c, m)
                    for tr in transports
                    for lr in local_rows
                    for c in chunks_list
                    for m in modes
                ]
                # Local rows in one region A (no B): one expert call and one weight-gradient add
                # fewer, but the combine (forward) and combine-backward are not hidden.
                variants += [(f"{tr} no-B", tr, 1, "exact") for tr in transports if no_b]
            for label, tr, chunks, mode in variants:
                plan_module.MIN_LOCAL_HALF = 10**9 if label.endswith("no-B") else default_half
                extra, graph = MODES[mode]
                # one dispatch, experts, combine (no pipeline)
                opts = MoKOptions(engine="plain", expert_backend=expert_backend)
                if tr is not None:
                    lr = "fused" if label.endswith("fused") else "overlap"
                    opts = MoKOptions(
                        minibatch_size=math.ceil(s["tokens"] / chunks),
                        **transport_options(tr),
                        local_rows=lr,
                        expert_backend=expert_backend,
                        **extra,
                    )
                layer = build("mok", cfg, options=opts).to(device)
                layer.load_state_dict(mok_sd)
                out = layer(x)[0].detach().float()
                err = tmax(((out - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-12)).item())
                step = _stepper(layer, x, dout)
                if graph:
                    try:
                        step = _graphed(layer, x, dout)
                    except Exception as e:  # report, never hide
                        if rank == 0:
                            print(
                                f"{name} {label} {mode}: CUDA graph capture failed: {e!r}"[:3000], flush=True
                            )
                        continue
                t = tmax(_time(step, iters, warmup))
                label_mode = label if tr is None else f"{label} {mode}"
                prof = None
                if profile and cuda and ep > 1 and chunks == 1:
                    # a graph replay too: its span and streams split the layer's time into exposed link
                    # and engine work where the host is out of the way
                    try:
                        prof = _profiled(name, f"mok {label_mode}", step, device, rank)
                    except Exception as e:  # report, never hide; the timing above stands
                        if rank == 0:
                            print(f"{name} {label_mode}: profiling failed: {e!r}"[:300], flush=True)
                    if kernels and not graph:
                        _kernels(f"{name} EP={ep} mok {label_mode}", step, 1e3 * t, rank)
                rows.append(
                    dict(
                        shape=name,
                        ep=ep,
                        impl="mok",
                        expert_backend=expert_backend,
                        transport=label_mode,
                        chunks=chunks,
                        ms=1e3 * t,
                        rel_err=err,
                        **({"profile": prof} if prof else {}),
                    )
                )
                if rank == 0:
                    print(
                        f"{name} EP={ep} mok {label_mode} chunks {chunks}: {1e3 * t:.2f} ms (err {err:.1e})",
                        flush=True,
                    )
                del layer, step
            if rank == 0:
                meg_row = next(r for r in rows if r["shape"] == name and r["ep"] == ep and r["impl"] == meg)
                print(f"{name} EP={ep} {meg}: {meg_row['ms']:.2f} ms", flush=True)
    timed = [n for n in schedules if n != "layer"]
    if timed:
        from mok_megatron.bench.schedules import bench_schedules

        _reinit(world)
        rows += bench_schedules(
            shapes,
            timed,
            microbatches,
            iters,
            warmup,
            ep=world,
            device=device,
            dtype=dtype,
            megatron_impl=meg,
            tmax=tmax,
            rank=rank,
            expert_backend=expert_backend,
        )
    return rows


def _kernels(label, step, wall_ms, rank) -> None:
    """Top kernels and host ops of one step on every rank (collectives need all); rank 0 prints."""
    from mok_megatron.bench.kernel_profile import kernel_summary

    text = kernel_summary(step, label, wall_ms, top=18, width=110, host_ops=12)
    if rank == 0:
        print(text, flush=True)


def _profiled(shape, label, step, device, rank) -> dict:
    """One profiled step on every rank (collectives need all of them); rank 0 prints."""
    prof = stream_overlap(step, device)
    if rank == 0:
        busy = ", ".join(f"{v:.2f}" for v in prof["busy_ms_per_stream"].values())
        print(
            f"profile {shape} {label}: GPU span {prof['gpu_span_ms']:.2f} ms, streams busy [{busy}] ms, "
            f"concurrent {prof['concurrent_ms']:.2f} ms, {prof['gpu_ops']} GPU ops, host "
            f"{prof['host_ms']:.2f} ms",
            flush=True,
        )
    return prof


def format_ep(rows) -> str:
    """The layer rows' tables (``--schedules layer``), then the schedule rows' (``bench.schedules``)."""
    from mok_megatron.bench.schedules import format_schedules

    out = []
    sched = [r for r in rows if "schedule" in r]
    rows = [r for r in rows if "schedule" not in r]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        ep = max(r["ep"] for r in rs)
        meg = next(r for r in rs if r["ep"] == ep and r["impl"] != "mok")
        meg1 = next(r for r in rs if r["ep"] == 1 and r["impl"] != "mok")
        mok1 = next(r for r in rs if r["ep"] == 1 and r["impl"] == "mok")
        meg_comm = meg["ms"] - meg1["ms"]
        out.append(
            f"\n{shape}: EP={ep}; {meg['impl']} {meg['ms']:.2f} ms (EP=1 same work {meg1['ms']:.2f}, "
            f"exposed comm {meg_comm:.2f} ms); MoK EP=1 same work {mok1['ms']:.2f} ms\n"
        )
        out.append(
            "| MoK transport | minibatches | ms | vs Megatron | exposed comm ms | hidden vs Megatron's comm |"
        )
        out.append("|---|---|---|---|---|---|")
        for r in rs:
            if r["impl"] != "mok" or r["ep"] != ep or "ms" not in r:
                continue
            exp = r["ms"] - mok1["ms"]
            hid = 100 * (1 - exp / meg_comm) if meg_comm > 0 else float("nan")
            out.append(
                f"| {r['transport']} | {r['chunks']} | {r['ms']:.2f} | {meg['ms'] / r['ms']:.2f}x | "
                f"{exp:.2f} | {hid:.0f}% |"
            )
    if sched:
        out.append(format_schedules(sched))
    return "\n".join(out)


DEFAULT_SHAPES = {"overlap": "dsv3-4k,dsv3-16k,qwen3-ep8", "ep": "dsv3,qwen3"}


def _warn_cpu_cost(ns, shapes: list[str], chunks: list[int]) -> None:
    """On CPU, once, before anything runs: the estimated cost of this sweep (stderr)."""
    import torch

    from mok_megatron.bench.cpu_cost import cpu_warning, matmul_gflops

    if torch.cuda.is_available():
        return
    modes = [m for m in ns.modes.split(",") if not MODES[m][1]]  # CUDA-graph modes are skipped on CPU
    points = len(ns.gbps.split(",")) * len(chunks) * len(modes) * len((ns.local_rows or "auto").split(","))
    msg = cpu_warning({n: OVERLAP_SHAPES[n] for n in shapes}, points, ns.iters, ns.warmup, matmul_gflops())
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mok bench overlap|ep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["overlap", "ep"])
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma list; overlap: {', '.join(OVERLAP_SHAPES)} (default {DEFAULT_SHAPES['overlap']}); "
        f"ep: {', '.join(EP_SHAPES)} (default {DEFAULT_SHAPES['ep']}); tiny runs on CPU in seconds",
    )
    p.add_argument(
        "--gbps", default="0,900,450,50", help="overlap: emulated link GB/s per direction (0 = infinite)"
    )
    p.add_argument("--chunks", default="1,2,4,8", help="minibatches per layer call to sweep")
    p.add_argument(
        "--transports",
        default="collective,copy_engine",
        help="ep: MoK transports (also nvlink, nvlink-flags; nvlink:F/B sets the CTAs that communicate in "
        "forward / backward, e.g. nvlink:32/16)",
    )
    p.add_argument("--modes", default="exact", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--profile", action="store_true", help="ep: also profile one step per 1-minibatch variant")
    p.add_argument("--no-b", action="store_true", help="ep: also time each transport without local region B")
    p.add_argument(
        "--local-rows",
        default=None,
        help="comma list of --mok-local-rows settings to time (ep default: overlap,fused; overlap default: auto)",
    )
    p.add_argument(
        "--kernels", action="store_true", help="ep, with --profile: also print top kernels/host ops"
    )
    p.add_argument(
        "--schedules",
        default="layer",
        help="ep: comma list of layer (one MoE layer fwd+bwd, the sweep above), plain, 1f1b (a one-layer GPT "
        "through Megatron's forward_backward_no_pipelining without / with its combined 1F1B EP overlap, "
        "--overlap-moe-expert-parallel-comm; needs EP > 1)",
    )
    p.add_argument(
        "--microbatches", type=int, default=2, help="ep --schedules plain,1f1b: micro-batches per call"
    )
    p.add_argument(
        "--expert-backend",
        default="torch",
        help="the MoK layers' expert GEMMs (torch | torch-fp8; --mok-expert-backend; overlap: the baseline too)",
    )
    ns = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    chunks = [int(c) for c in ns.chunks.split(",")]
    table = OVERLAP_SHAPES if ns.what == "overlap" else EP_SHAPES
    shapes = (ns.shapes or DEFAULT_SHAPES[ns.what]).split(",")
    bad = [n for n in shapes if n not in table]
    if bad:
        p.error(f"--shapes {','.join(bad)}: {ns.what} shapes are {', '.join(table)}")
    for label in ns.transports.split(","):
        try:
            from mok_megatron.options import MoKOptions

            MoKOptions(**transport_options(label))
        except ValueError as e:
            p.error(f"--transports: {e}")
    bad = [m for m in ns.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes {','.join(bad)}: choose from {', '.join(MODES)}")
    from mok_megatron.bench.schedules import EP1_ERROR, SCHEDULES

    schedules = ns.schedules.split(",")
    bad = [n for n in schedules if n not in ("layer", *SCHEDULES)]
    if bad:
        p.error(f"--schedules {','.join(bad)}: choose from layer, {', '.join(SCHEDULES)}")
    if ns.microbatches < 2:
        p.error(f"--microbatches {ns.microbatches}: the combined 1F1B schedule pairs micro-batches (>= 2)")
    timed = [n for n in schedules if n in SCHEDULES]
    if ns.what == "ep" and timed and int(os.environ.get("WORLD_SIZE", 1)) < 2:
        print(EP1_ERROR.format(names=",".join(timed)), file=sys.stderr)
        return 2
    if ns.what == "overlap":
        _warn_cpu_cost(ns, shapes, chunks)
        rows = bench_overlap(
            shapes,
            [float(g) for g in ns.gbps.split(",")],
            chunks,
            ns.iters,
            ns.warmup,
            modes=ns.modes.split(","),
            local_rows=(ns.local_rows or "auto").split(","),
            expert_backend=ns.expert_backend,
        )
        text = format_overlap(rows)
        rank0 = True
    else:
        rows = bench_ep(
            shapes,
            ns.transports.split(","),
            chunks,
            ns.iters,
            ns.warmup,
            modes=ns.modes.split(","),
            profile=ns.profile,
            no_b=ns.no_b,
            kernels=ns.kernels,
            local_rows=(ns.local_rows or "overlap,fused").split(","),
            expert_backend=ns.expert_backend,
            schedules=schedules,
            microbatches=ns.microbatches,
        )
        text = format_ep(rows)
        rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        print(text)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
