"""``mok bench ep``: the MoE layer at real expert parallelism, one process per GPU under torchrun.

``torchrun --nproc-per-node N -m mok_megatron.bench.ep``: N local experts per rank x N ranks, MoK per
transport and minibatch count vs Megatron-Core's alltoall ``MoELayer`` (TEGroupedMLP when Transformer
Engine is importable), and the same per-rank work at EP=1 (each rank alone), so exposed communication =
t(EP=N) - t(EP=1).

``--schedules plain,1f1b`` (``layer``, the default, is the sweep above; list it to run both): Megatron's
combined 1F1B EP-overlap schedule (``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``), which
overlaps one micro-batch's forward with another's backward layer by layer, against the plain schedule,
for Megatron's alltoall layer and for MoK's, at EP=N: a one-layer GPT (attention + MoE, the shape's
per-rank tokens per micro-batch) through ``forward_backward_no_pipelining`` with ``--microbatches`` (2);
ms per micro-batch pair, the 1f1b / plain ratio and MoK / Megatron per schedule; losses checked first
(MoK's bitwise across the schedules). Needs EP > 1 (``bench.schedules``).

Times are medians of CUDA-event timings (max over ranks); outputs are checked against Megatron first.
On CPU the ranks run over gloo in fp32 (``--shapes tiny`` runs in seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from mok_megatron.bench.shapes import EP_SHAPES
from mok_megatron.bench.steps import MODES, graphed, inputs, median_time, stepper, stream_overlap

DEFAULT_SHAPES = "dsv3,qwen3"
LAUNCH = "torchrun --nproc-per-node 2 -m mok_megatron.bench.ep --shapes tiny"
CPU_REFUSAL = (
    "mok bench ep --shapes {shapes}: no CUDA GPU: on CPU ranks these shapes take hours and their times say "
    "nothing about GPUs; run on GPUs, use --shapes tiny to check the command, or add --allow-cpu"
)
NOT_LAUNCHED = (
    "mok bench ep runs one process per GPU and must be launched with torchrun (RANK and WORLD_SIZE are "
    "not set), e.g.: " + LAUNCH
)


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


def _ep_config(s, world, ep, dtype):
    from mok_megatron.bench.build import layer_config

    cfg = layer_config(dict(hidden=s["hidden"], ffn=s["ffn"], experts=s["local"] * ep, topk=s["topk"]), dtype)
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
    from mok_megatron.bench.build import build
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
        x, dout = inputs(s["tokens"], s["hidden"], dtype, device, seed=rank)
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
            t = tmax(median_time(stepper(ref, x, dout), iters, warmup))
            rows.append(dict(shape=name, ep=ep, impl=meg, transport="nccl a2a", chunks=1, ms=1e3 * t))
            if profile and cuda and ep > 1:
                rows[-1]["profile"] = _profiled(name, meg, stepper(ref, x, dout), device, rank)
                if kernels:
                    _kernels(f"{name} EP={ep} {meg}", stepper(ref, x, dout), 1e3 * t, rank)
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
                step = stepper(layer, x, dout)
                if graph:
                    try:
                        step = graphed(layer, x, dout)
                    except Exception as e:  # report, never hide
                        if rank == 0:
                            print(
                                f"{name} {label} {mode}: CUDA graph capture failed: {e!r}"[:3000], flush=True
                            )
                        continue
                t = tmax(median_time(step, iters, warmup))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mok bench ep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help=f"comma list of {', '.join(EP_SHAPES)} (default {DEFAULT_SHAPES}); tiny runs on CPU in seconds",
    )
    p.add_argument("--chunks", default="1,2,4,8", help="minibatches per layer call to sweep")
    p.add_argument(
        "--transports",
        default="collective,copy_engine",
        help="MoK transports (also nvlink, nvlink-flags; nvlink:F/B sets the CTAs that communicate in "
        "forward / backward, e.g. nvlink:32/16)",
    )
    p.add_argument("--modes", default="exact", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--profile", action="store_true", help="also profile one step per 1-minibatch variant")
    p.add_argument("--no-b", action="store_true", help="also time each transport without local region B")
    p.add_argument(
        "--local-rows",
        default="overlap,fused",
        help="comma list of --mok-local-rows settings to time (default overlap,fused)",
    )
    p.add_argument("--kernels", action="store_true", help="with --profile: also print top kernels/host ops")
    p.add_argument(
        "--schedules",
        default="layer",
        help="comma list of layer (one MoE layer fwd+bwd, the sweep above), plain, 1f1b (a one-layer GPT "
        "through Megatron's forward_backward_no_pipelining without / with its combined 1F1B EP overlap, "
        "--overlap-moe-expert-parallel-comm; needs EP > 1)",
    )
    p.add_argument(
        "--microbatches", type=int, default=2, help="--schedules plain,1f1b: micro-batches per call"
    )
    p.add_argument(
        "--expert-backend",
        default="torch",
        help="the MoK layers' expert GEMMs (torch | torch-fp8; --mok-expert-backend)",
    )
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA GPUs, run shapes other than tiny on CPU ranks anyway (hours for dsv3, qwen3)",
    )
    ns = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    chunks = [int(c) for c in ns.chunks.split(",")]
    shapes = ns.shapes.split(",")
    bad = [n for n in shapes if n not in EP_SHAPES]
    if bad:
        p.error(f"--shapes {','.join(bad)}: ep shapes are {', '.join(EP_SHAPES)}")
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
    if timed and int(os.environ.get("WORLD_SIZE", 1)) < 2:
        print(EP1_ERROR.format(names=",".join(timed)), file=sys.stderr)
        return 2
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(NOT_LAUNCHED, file=sys.stderr)
        return 2
    import torch

    big = [n for n in shapes if n != "tiny"]
    if big and not torch.cuda.is_available() and not ns.allow_cpu:
        if int(os.environ["RANK"]) == 0:
            print(CPU_REFUSAL.format(shapes=",".join(big)), file=sys.stderr)
        return 2
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
        local_rows=ns.local_rows.split(","),
        expert_backend=ns.expert_backend,
        schedules=schedules,
        microbatches=ns.microbatches,
    )
    if int(os.environ["RANK"]) == 0:
        print(format_ep(rows))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
