"""Phase timing and peak memory for ``mok bench layer``; ``time_steps``: one step's times for ``mok bench ep``
and the sweeps.

Forward, backward and forward+backward are timed separately: CUDA events around the phase on a GPU, the
wall clock (``time.perf_counter``) on CPU. For the backward the forward runs first, untimed, then the
events bracket ``out.backward(dout)`` alone. Each of these waits for the GPU after every step, so a step
starts on an idle GPU and its time includes the host's enqueue of its first kernels (a layer whose host
work outlasts its GPU work shows the host's time).

Each phase reports the median, min and max over its ``iters`` timed runs.

``steady`` is forward+backward enqueued back to back, as in training: one event between consecutive
steps, one synchronization at the end, so the host may run ahead of the GPU. Per step it is the GPU
time when the host keeps up, and the host's time when it does not (or when the layer syncs the host
itself: Megatron's alltoall dispatcher reads the token counts); its times are per step, after ``warmup``
untimed runs. Peak memory (GPU only) is ``torch.cuda.max_memory_allocated()`` during one
forward+backward minus the memory allocated just before it, i.e. activations, gradients and workspace
on top of the weights and the input; on CPU it is reported as None ("n/a").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

PHASES = ("fwd", "bwd", "fwd_bwd", "steady")


def time_steps(step, iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``step`` after ``warmup`` calls: CUDA events on a GPU, the wall clock on CPU."""
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def _timed(setup: Callable, timed: Callable, iters: int, warmup: int) -> list[float]:
    """Seconds of ``timed(setup())`` per iteration, ``setup`` excluded."""
    import torch

    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        timed(setup())
    out = []
    for _ in range(iters):
        arg = setup()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            timed(arg)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            timed(arg)
            out.append(time.perf_counter() - t0)
    return out


def _timed_back_to_back(step: Callable, iters: int, warmup: int) -> list[float]:
    """Seconds per ``step()`` with the steps enqueued back to back (no synchronization between them)."""
    import torch

    for _ in range(warmup):
        step()
    if not torch.cuda.is_available():
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        step()
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:], strict=False)]


def time_phases(forward: Callable, backward: Callable, reset: Callable, iters: int, warmup: int) -> dict:
    """Median, min and max ms per phase (``SPREAD``). ``forward()`` returns what ``backward(it)`` consumes;
    ``reset()`` clears the gradients before each step so every phase does the same work each time."""

    def fwd_setup():
        reset()

    phases = {
        "fwd": _timed(fwd_setup, lambda _: forward(), iters, warmup),
        "bwd": _timed(lambda: (reset(), forward())[1], backward, iters, warmup),
        "fwd_bwd": _timed(fwd_setup, lambda _: backward(forward()), iters, warmup),
        "steady": _timed_back_to_back(lambda: (reset(), backward(forward())), iters, warmup),
    }
    return {name: spread_ms(t) for name, t in phases.items()}


SPREAD = ("ms", "min_ms", "max_ms")  # median, min, max over the timed iterations


def spread_ms(seconds: list[float]) -> dict:
    """``{"ms": median, "min_ms": min, "max_ms": max}`` of per-iteration times in seconds."""
    if not seconds:
        raise ValueError("spread_ms: no timed iterations (iters must be >= 1)")
    return {
        "ms": 1e3 * statistics.median(seconds),
        "min_ms": 1e3 * min(seconds),
        "max_ms": 1e3 * max(seconds),
    }


def variant_row(name: str, step: Callable, iters: int, warmup: int, flops: float, rel_err) -> dict:
    """One benchmark variant: ``step`` timed back to back (``spread_ms``), TFLOP/s of ``flops`` per step at
    the median, and its checked error."""
    row = {"variant": name, **spread_ms(_timed_back_to_back(step, iters, warmup))}
    return {**row, "tflops": flops / (row["ms"] / 1e3) / 1e12, "rel_err": rel_err}


def peak_memory_mib(forward: Callable, backward: Callable, reset: Callable) -> float | None:
    """Extra GPU memory one forward+backward needs at its peak (MiB); None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backward(forward())
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
