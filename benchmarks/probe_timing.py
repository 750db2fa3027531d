"""Timing helpers shared by the one-GPU probes (session 11 on): CUDA-graph capture and median event time.

graphed(fn) -> replay     capture ``fn`` (it may fork onto side streams and join back) in a CUDA graph
median_ms(fn, reps)       median milliseconds of ``fn`` between events on the current stream, synced
"""

from __future__ import annotations

import torch


def graphed(fn):
    """Run ``fn`` once (warm-up), capture it in a CUDA graph, return the graph's replay: the host's launch
    cost is not timed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def times_ms(fn, reps: int = 9) -> list[float]:
    """``reps`` timings of ``fn`` (each synced before and after), in milliseconds, in run order."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def median_ms(fn, reps: int = 9) -> float:
    """Median of ``reps`` timings of ``fn``, in milliseconds."""
    out = sorted(times_ms(fn, reps))
    return out[len(out) // 2]
