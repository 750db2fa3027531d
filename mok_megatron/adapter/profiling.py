"""Where a MoK layer spends its time: dispatch, experts, combine, forward and backward.

    with profiling.record(model) as prof:
        ... run training steps ...
    print(prof.summary())        # seconds per phase, forward and backward

``record(model)`` gives every MoK layer of ``model`` the profile (its dispatcher's ``profile``); a layer
without one (outside ``record``) passes ``None`` to every hook here, which is then a no-op. On CUDA the
phases are timed with events on the current stream and read once, in ``summary()``; on CPU with the wall
clock (ops are synchronous). Backward phases are timed with identity autograd nodes placed at the phase
boundaries: the gradient passes the combine output, then the expert output, then the expert input, then
the dispatch input.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

PHASES = ("dispatch", "experts", "combine", "pipeline")  # pipeline: overlapped dispatch+experts+combine


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class PhaseProfile:
    """Accumulated (start, end) stamps per (direction, phase); converted to seconds on demand."""

    def __init__(self):
        self.spans: dict[tuple[str, str], list] = defaultdict(list)
        self.clock: _Clock | None = None
        self._open_fwd: dict[tuple[int, str], object] = {}
        self._open_bwd: dict[tuple[int, str], object] = {}

    def stamp(self, device: torch.device):
        if self.clock is None:
            self.clock = _Clock(device)
        return self.clock.now()

    def add(self, direction: str, name: str, start, end) -> None:
        self.spans[(direction, name)].append((start, end))

    def open(self, key: int, name: str, device: torch.device) -> None:
        self._open_fwd[(key, name)] = self.stamp(device)

    def close(self, key: int, name: str, device: torch.device) -> None:
        start = self._open_fwd.pop((key, name), None)
        if start is not None:
            self.add("forward", name, start, self.stamp(device))

    def seconds(self) -> dict[tuple[str, str], float]:
        if self.clock is None:
            return {}
        if self.clock.cuda:
            torch.cuda.synchronize()
        return {k: sum(self.clock.elapsed(a, b) for a, b in v) for k, v in self.spans.items()}

    def summary(self) -> dict[str, dict[str, float]]:
        secs = self.seconds()
        return {d: {p: secs.get((d, p), 0.0) for p in PHASES} for d in ("forward", "backward")}


def _dispatchers(model) -> list:
    """The MoK dispatchers of ``model`` (modules whose ``token_dispatcher`` has a ``profile``)."""
    found = []
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if d is not None and hasattr(d, "profile"):
            found.append(d)
    return found


@contextlib.contextmanager
def record(model):
    """Collect phase times of every MoK layer of ``model`` run inside the block."""
    prof = PhaseProfile()
    dispatchers = _dispatchers(model)
    before = [d.profile for d in dispatchers]
    for d in dispatchers:
        d.profile = prof
    try:
        yield prof
    finally:
        for d, p in zip(dispatchers, before, strict=True):
            d.profile = p


@contextlib.contextmanager
def phase(prof: PhaseProfile | None, name: str, device: torch.device):
    """Time a forward phase into ``prof`` (no-op when None)."""
    if prof is None:
        yield
        return
    start = prof.stamp(device)
    try:
        yield
    finally:
        prof.add("forward", name, start, prof.stamp(device))


def open_span(prof: PhaseProfile | None, key: int, name: str, device: torch.device) -> None:
    """Start a forward span that another call closes (e.g. experts: after dispatch, before combine)."""
    if prof is not None:
        prof.open(key, name, device)


def close_span(prof: PhaseProfile | None, key: int, name: str, device: torch.device) -> None:
    if prof is not None:
        prof.close(key, name, device)


class _BackwardMark(torch.autograd.Function):
    """Identity; in backward closes the span ``closes`` (if open) and opens ``opens``."""

    @staticmethod
    def forward(ctx, x, prof, key, closes, opens):
        ctx.prof, ctx.key, ctx.closes, ctx.opens = prof, key, closes, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        prof, now = ctx.prof, ctx.prof.stamp(g.device)
        if ctx.closes is not None:
            opened = prof._open_bwd.pop((ctx.key, ctx.closes), None)
            if opened is not None:
                prof.add("backward", ctx.closes, opened, now)
        if ctx.opens is not None:
            prof._open_bwd[(ctx.key, ctx.opens)] = now
        return g, None, None, None, None


def backward_mark(
    prof: PhaseProfile | None, x: torch.Tensor, key: int, closes: str | None, opens: str | None
) -> torch.Tensor:
    """Insert a backward timing boundary on ``x`` into ``prof`` (no-op when None or x needs no grad).

    ``key`` tells apart layers (use ``id(layer)``), so spans of different layers never mix.
    """
    if prof is None or not x.requires_grad:
        return x
    return _BackwardMark.apply(x, prof, key, closes, opens)
