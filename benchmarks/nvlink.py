"""Dispatch/combine bandwidth of the NVLink transport vs NCCL ``all_to_all_single`` (and the copy-engine
transport) at the same bytes. Run on one NVLink domain, from the repository root:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m benchmarks.nvlink --json out.json

Routing is uniform top-k; a token goes once to each rank holding one of its experts (the pipeline's
layout), so each rank sends ``rows[s][d]`` token rows of H bf16 to rank d. Bandwidth follows DeepEP's
bottleneck definition: bytes a rank sends over NVLink (rows to *other* ranks x row bytes) / time, the
slowest rank's. Times are per exchange as the layer pays them: nvlink dispatch = stage + barrier +
pull kernel + barrier; combine = barrier + push kernel + barrier + copy-out. Every exchange's result is
checked bitwise against all_to_all_single's. Timing one direction repeatedly reuses one buffer, so
nvlink pays two barriers per exchange there; ``both`` (dispatch then combine, the pipeline's pattern)
pays one per exchange. ``--syncs barrier,flags``: also the per-peer ready flags (``transport.nvlink.signals``: publish +
a pull that waits per source; no barrier).

Legend: T tokens per rank, H hidden, K top-k, E experts, P ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

PROG = "python -m benchmarks.nvlink"
LAUNCH = "torchrun --nproc-per-node 2 -m benchmarks.nvlink --json out.json"
SHAPES = {  # per-rank slices (tokens per rank) of the two models
    "dsv3": dict(tokens=4096, hidden=7168, topk=8, experts=16),
    "qwen3": dict(tokens=16384, hidden=2048, topk=8, experts=128),
}


def _routing_rows(T, K, E, P, seed, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids_TK = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    to_TP = torch.zeros(T, P, dtype=torch.bool)
    to_TP.scatter_(1, ids_TK // (E // P), True)
    d_N, t_N = to_TP.t().nonzero(as_tuple=True)  # dest-major, token order inside a destination
    return t_N.to(device), to_TP.sum(0).tolist()


def _time(fn, iters, warmup):
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters / 1e3


def _kernel_time(ws, x, matrix, me, push, programs, ns, slowest):
    import torch

    from mok_megatron.transport.nvlink import kernels as K
    from mok_megatron.transport.nvlink.exchange import _segment_table, _words, buffer_rows

    word, W = _words(x)
    peers = ws.buffers(word, W, buffer_rows(matrix), push)
    seg = _segment_table(matrix, me, push, x.device)
    if push:
        local = K.as_words(x, word)
        return slowest(_time(lambda: K.push_rows(local, peers, seg, programs), ns.iters, ns.warmup))
    R = sum(matrix[s][me] for s in range(len(matrix)))
    out = torch.empty((R, W), dtype=word, device=x.device)
    return slowest(_time(lambda: K.pull_rows(out, peers, seg, programs), ns.iters, ns.warmup))


def _bench_shape(name, ns, rank, P, device, slowest, smallest) -> list[dict]:
    import torch
    import torch.distributed as dist

    from mok_megatron.transport.copy_engine import CopyEngineTransport
    from mok_megatron.transport.nvlink.exchange import exchange_rows
    from mok_megatron.transport.nvlink.workspace import workspace

    def kernel_time(*args):
        return _kernel_time(*args, slowest)

    rows = []
    s = SHAPES[name]
    T, H = s["tokens"], s["hidden"]
    tok_N, send = _routing_rows(T, s["topk"], s["experts"], P, seed=rank, device=device)
    everyone = [None] * P
    dist.all_gather_object(everyone, send)
    m = [list(r) for r in everyone]  # m[src][dst]
    mt = [list(r) for r in zip(*m, strict=True)]
    x_TH = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    x_NH = x_TH[tok_N].contiguous()
    recv = [m[q][rank] for q in range(P)]
    row_bytes = H * 2
    sent_remote = sum(m[rank][d] for d in range(P) if d != rank) * row_bytes  # dispatch
    back_remote = sum(m[q][rank] for q in range(P) if q != rank) * row_bytes  # combine sends these
    ref_R = x_NH.new_empty((sum(recv), H))
    ref_N = x_NH.new_empty(x_NH.shape)

    def a2a_dispatch():
        dist.all_to_all_single(ref_R, x_NH, recv, list(m[rank]))

    def a2a_combine():
        dist.all_to_all_single(ref_N, ref_R, list(m[rank]), recv)

    def a2a_both():
        a2a_dispatch()
        a2a_combine()

    a2a_both()
    results = {
        "nccl a2a": (
            slowest(_time(a2a_dispatch, ns.iters, ns.warmup)),
            slowest(_time(a2a_combine, ns.iters, ns.warmup)),
            True,
            slowest(_time(a2a_both, ns.iters, ns.warmup)),
        )
    }
    from mok_megatron.transport.base import COMBINE, DISPATCH

    ce = CopyEngineTransport(dist.group.WORLD)
    mb = SimpleNamespace(capacity=None, split_matrix=tuple(map(tuple, m)))
    ok = torch.equal(ce.move(x_NH, mb, DISPATCH), ref_R) and torch.equal(ce.move(ref_R, mb, COMBINE), ref_N)
    results["copy_engine"] = (
        slowest(_time(lambda: ce.move(x_NH, mb, DISPATCH), ns.iters, ns.warmup)),
        slowest(_time(lambda: ce.move(ref_R, mb, COMBINE), ns.iters, ns.warmup)),
        ok,
        slowest(_time(lambda: (ce.move(x_NH, mb, DISPATCH), ce.move(ref_R, mb, COMBINE)), ns.iters, ns.warmup)),
    )
    ws = workspace(dist.group.WORLD, device)
    for sync in ns.syncs.split(","):
        for progs in [int(v) for v in ns.programs.split(",")]:
            exch = lambda x, mm, push, g=progs, sy=sync: exchange_rows(ws, x, mm, rank, push, g, sync=sy)  # noqa: E731
            ok = torch.equal(exch(x_NH, m, False), ref_R) and torch.equal(exch(ref_R, mt, True), ref_N)
            td = slowest(_time(lambda f=exch: f(x_NH, m, False), ns.iters, ns.warmup))
            tc = slowest(_time(lambda f=exch: f(ref_R, mt, True), ns.iters, ns.warmup))
            tb = slowest(_time(lambda f=exch: (f(x_NH, m, False), f(ref_R, mt, True)), ns.iters, ns.warmup))
            label = f"nvlink programs={progs}" if sync == "barrier" else f"nvlink {sync} p={progs}"
            results[label] = (td, tc, ok, tb)
            if sync != "barrier":
                continue
            # The kernels alone (no staging, no barriers): re-reading the same staged rows and re-writing
            # the same rows is race-free, so this is the raw NVLink rate of the pull and push kernels.
            exchange_rows(ws, x_NH, m, rank, push=False, programs=progs)  # stage the rows once
            torch.cuda.synchronize()
            dist.barrier()
            kd = kernel_time(ws, x_NH, m, rank, False, progs, ns)
            kc = kernel_time(ws, ref_R, mt, rank, True, progs, ns)
            results[f"nvlink kernels only p={progs}"] = (kd, kc, ok, kd + kc)
    for label, (td, tc, ok, tb) in results.items():
        row = dict(
            shape=name,
            transport=label,
            dispatch_ms=1e3 * td,
            combine_ms=1e3 * tc,
            dispatch_then_combine_ms=1e3 * tb,
            dispatch_gbps=smallest(sent_remote / td / 1e9),
            combine_gbps=smallest(back_remote / tc / 1e9),
            bitwise_equal_a2a=bool(smallest(float(ok))),
            dispatch_bytes_per_rank=sent_remote,
            matrix=m,
        )
        rows.append(row)
        if rank == 0:
            print(
                f"{name:6s} {label:20s} dispatch {row['dispatch_ms']:.3f} ms {row['dispatch_gbps']:6.1f} GB/s | "
                f"combine {row['combine_ms']:.3f} ms {row['combine_gbps']:6.1f} GB/s | "
                f"both {row['dispatch_then_combine_ms']:.3f} ms | "
                f"equal a2a {row['bitwise_equal_a2a']}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default="dsv3,qwen3")
    p.add_argument("--programs", default="16,32,64,128", help="CTAs that communicate, comma list")
    p.add_argument("--syncs", default="barrier,flags", help="nvlink signalling: barrier, flags (comma list)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or "RANK" not in os.environ:
        print(f"{PROG}: needs CUDA GPUs on one NVLink domain, one process each: {LAUNCH}", file=sys.stderr)
        return 2
    for k, v in dict(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    ).items():
        os.environ.setdefault(k, v)

    import torch.distributed as dist

    from mok_megatron.transport.nvlink.workspace import close_all

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, P = dist.get_rank(), dist.get_world_size()

    def slowest(t):
        v = torch.tensor([t], device=device, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    def smallest(x):
        v = torch.tensor([x], device=device, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return v.item()

    rows_out = []
    for name in ns.shapes.split(","):
        rows_out += _bench_shape(name, ns, rank, P, device, slowest, smallest)
    close_all()
    if rank == 0 and ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
