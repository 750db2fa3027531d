"""The pieces every layer measurement of ``mok bench ep`` and of the overlap sweeps shares: one eager or
CUDA-graph-replayed forward+backward step, its median time, the inputs, the MoK modes timed (``MODES``:
``MoKOptions`` overrides and whether the step is captured in a CUDA graph) and a profiled step's stream
overlap."""

from __future__ import annotations

import statistics


def median_time(step, iters: int, warmup: int) -> float:
    """Median seconds per call of ``step`` (``timing.time_steps``)."""
    from mok_megatron.bench.timing import time_steps

    return statistics.median(time_steps(step, iters, warmup))


def stepper(layer, x, dout):
    """One eager forward+backward of ``layer`` on ``x`` with output gradient ``dout``, gradients dropped."""
    def step():
        xi = x.detach().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(dout)
        layer.zero_grad(set_to_none=True)
        return out

    return step


def graphed(layer, x, dout):
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
    # when the bytes move beside the GEMMs (on one GPU they do not)
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


def inputs(tokens, hidden, dtype, device, seed=0):
    """The layer input ``[tokens, 1, hidden]`` and its output gradient (x 1e-2), from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 1, hidden, generator=g).to(device, dtype)
    dout = (torch.randn(tokens, 1, hidden, generator=g) * 1e-2).to(device, dtype)
    return x, dout


def stream_overlap(step, device) -> dict:
    """Profile one step: busy time of each CUDA stream and the time two or more streams run at once."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

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

