"""``LoopbackTransport``: one GPU standing in for an EP rank (benchmarks and tests construct it and give it
to the layer: ``MoKMoELayer(..., transport=LoopbackTransport(LoopbackLink(ep=8), L, topk))``).

The rows are copied (device to device) as many times as the emulated rank would move them, and a delay
stream waits ``bytes / bandwidth``; the exchange ends when both are done. ``LoopbackBytes.LINK``: no copy
(the received rows are the sent ones), only the link time is emulated. The transport reports the emulated
EP size as its ``peers``: the pipeline plan then sends region R, the emulated peers' share of each
minibatch, through it (``engine.pipeline_plan``).

It is also a ``PullSource`` (``transport.base``) for the tiles engine (``engine.tiles``): each local expert's
received rows split over the ``link.ep`` sources as evenly as possible (``even_split``, source 0 this rank),
the emulated peers' send buffers built on this GPU from the rows (``pull_sources``: one gather into a
source-major buffer, each source a view of it grouped by local expert), and the pull paced at the link's rate
(``pull_rate`` = gbps x 1e9 bytes/s; 0 unpaced). What moves there is route rows: every (token, expert) row
of an emulated peer's tokens is its own row on the link, not one row per destination rank as the pipeline's
exchange sends (``factor``, the expected remote ranks per token). ``LoopbackBytes.COPY``: the pull copies
every remote row from those buffers (``pull_moves_rows``). ``LoopbackBytes.LINK``: the link time alone, as
for the pipeline: no source buffer is built, the engine places every row itself (as without a transport)
and the pull's programs only pace and release the GEMM's counters (``tile_pull``'s ``copy="none"``), the
ceiling the schedule allows.

Legend (the pull): P sources (the emulated EP ranks, source 0 this rank), G local experts, M received rows
(expert-major), T tokens, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from mok_megatron.transport.base import Direction, Link, SendPlan

# Below this emulated bandwidth the link counts as slow (an inter-node link): the automatic minibatch
# size and local-row placement then follow the across-nodes rules (``engine.pipeline_plan``).
SLOW_LINK_GBPS = 200


class LoopbackBytes(StrEnum):
    COPY = "copy"  # the emulated rank's bytes as device-to-device copies beside the link time
    LINK = "link"  # the link time only; on GPUs the received rows are the sent rows (an ideal transport)


@dataclass(frozen=True)
class LoopbackLink:
    """The link the loopback transport emulates: one GPU plays one rank of an EP group of ``ep`` ranks."""

    ep: int = 2  # the EP size whose traffic is emulated
    gbps: float = 0.0  # per-direction link bandwidth; 0 = infinite
    bytes: LoopbackBytes = LoopbackBytes.COPY

    def __post_init__(self):
        try:
            object.__setattr__(self, "bytes", LoopbackBytes(self.bytes))
        except ValueError:
            choices = ", ".join(b.value for b in LoopbackBytes)
            raise ValueError(f"loopback bytes={self.bytes!r}: choose one of {choices}.") from None
        if self.ep < 1:
            raise ValueError(f"loopback ep={self.ep}: must be >= 1 (the EP size to emulate).")
        if self.gbps < 0:
            raise ValueError(f"loopback gbps={self.gbps}: must be >= 0 (0 = an infinitely fast link).")


def expected_remote_ranks(ep: int, num_local_experts: int, topk: int, group: int | None = None) -> float:
    """Expected number of *other* EP ranks one token visits (uniform top-k over ep * L experts).
    ``group``: the visits for one group of that many of each rank's local experts (a minibatch of a
    call split by experts: a token visits a rank once per group it uses there)."""
    if ep <= 1:
        return 0.0
    e = ep * num_local_experts
    g = num_local_experts if group is None else group
    miss = 1.0
    for i in range(topk):
        miss *= max(e - g - i, 0) / (e - i)
    return (1.0 - miss) * (ep - 1)


def even_split(counts_G: torch.Tensor, sources: int) -> torch.Tensor:
    """int64 [P, G], P = ``sources``: each expert's ``counts_G[g]`` rows split over the sources as evenly as
    possible, the first ``counts_G[g] % P`` sources one row more (source 0, this rank, first). Sync-free."""
    if sources < 1:
        raise ValueError(f"even_split: sources={sources}; it must be >= 1 (the EP ranks the rows come from)")
    c = counts_G.long()
    p_P1 = torch.arange(sources, device=c.device)[:, None]
    return c[None, :] // sources + (p_P1 < c[None, :] % sources).long()


def source_major_rows(c_PG: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [M], M = ``rows`` (``c_PG``'s total): for each row of the source-major layout (source p's rows
    grouped by local expert, then source p + 1's), its row in the expert-major receive buffer (each expert's
    rows by source). Sync-free."""
    c = c_PG.long()
    flat = c.flatten()  # segments (p, g), source-major
    start = torch.cumsum(flat, 0) - flat  # their first source-major row
    c_GP = c.t().flatten()  # segments (g, p), expert-major
    dst = (torch.cumsum(c_GP, 0) - c_GP).view(c.shape[1], c.shape[0]).t().flatten()  # their first receive row
    shift = torch.repeat_interleave(dst - start, flat, output_size=rows)
    return shift + torch.arange(rows, device=c.device)


class LoopbackTransport:
    """One GPU plays one rank of an EP group of ``link.ep`` ranks: the same bytes copied, the link time
    emulated.

    The layer holds one EP rank's experts; its tokens are cut into the share that would stay on this rank
    and the share the emulated peers hold (region R of each minibatch, ``engine.pipeline_plan``), and
    region R's exchange is charged as the whole minibatch's (``move`` scales its bytes by
    ``tokens / R``). The link time (``bytes / gbps``) runs on a delay stream as a wall-clock spin
    (``kernels.link_delay.spin_ns``) beside the copies; the exchange ends when both have.

    ``LoopbackBytes.COPY``: copy the rows as many times as the emulated rank moves them (its HBM
    traffic). These device-to-device copies (~3.6 TB/s of traffic) behave like SM work: on one H200 they
    make almost no progress while a grouped GEMM holds the SMs and finish after it. ``LoopbackBytes.LINK``:
    the link time alone stands for the exchange; on GPUs the received rows *are* the sent rows (no copy
    at all; on CPU a clone): an ideal transport whose bytes land beside the GEMMs unhindered, the
    schedule's own bound.

    The pull (``PullSource``, the tiles engine): ``pull_split``, ``pull_sources``, ``pull_rate`` and
    ``pull_moves_rows`` (COPY) as in the module's notes; ``bytes_moved`` counts the bytes of the sources'
    rows it builds for the pull to copy (sources 1..P-1: LINK builds none, so the link-only pull's bytes are
    the layer plan's, ``LayerPlan.remote_bytes``), the engine charges the results' return trip at
    ``pull_rate`` itself."""

    name = "loopback"

    def __init__(self, link: LoopbackLink, num_local_experts: int, topk: int):
        self.emulated = link
        self.num_local_experts, self.topk = num_local_experts, topk
        self.factor = expected_remote_ranks(link.ep, num_local_experts, topk)
        self.copies = link.bytes is LoopbackBytes.COPY
        self.gbps = link.gbps
        self.peers = link.ep
        self.link = Link.SLOW if 0 < link.gbps < SLOW_LINK_GBPS else Link.FAST
        self._delay_stream = None
        self.bytes_moved = 0  # emulated link bytes so far (benchmarks read it)
        self.pull_rate = link.gbps * 1e9  # bytes/s; 0: unpaced
        self.pull_moves_rows = self.copies  # LINK: every row placed, the pull paces and releases only

    def pull_split(self, counts_G: torch.Tensor) -> torch.Tensor:
        """int64 [P, G], P = the emulated EP size: ``even_split``."""
        return even_split(counts_G, self.peers)

    def pull_sources(
        self, rows_TH: torch.Tensor, token_M: torch.Tensor, c_PG: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The emulated sources' buffers, built on this GPU: one gather of ``rows_TH[token_M]`` in the
        source-major order (``source_major_rows``), split into P views [rows of p, H] (reads the sizes on the
        host)."""
        rows = token_M.numel()
        order_M = source_major_rows(c_PG.to(token_M.device), rows)
        send_MH = rows_TH[token_M[order_M]]
        sizes = c_PG.sum(1).tolist()
        self.bytes_moved += (rows - sizes[0]) * rows_TH.shape[1] * rows_TH.element_size()
        return tuple(send_MH.split(sizes))

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        # The emulated peers' share (region R) is charged as the minibatch's whole exchange; rows moved
        # outside a pipeline plan (``mb`` None) are charged as they are.
        r = mb.local.regions[0] if mb is not None else 0
        scale = mb.num_tokens / r if r else 1.0
        factor = self.factor
        if mb is not None and mb.group is not None:  # split by experts: this group's visits
            lo, hi = mb.group.experts
            factor = expected_remote_ranks(self.emulated.ep, self.num_local_experts, self.topk, hi - lo)
        nbytes = x.numel() * x.element_size() * factor * scale
        self.bytes_moved += nbytes
        if x.device.type != "cuda":
            return x.clone()
        out = torch.empty_like(x) if self.copies else x
        cur = torch.cuda.current_stream()
        if self.gbps > 0:
            from mok_megatron.kernels.link_delay import spin_ns

            if self._delay_stream is None:
                self._delay_stream = torch.cuda.Stream(device=x.device)
            self._delay_stream.wait_stream(cur)
            with torch.cuda.stream(self._delay_stream):
                spin_ns(round(nbytes / self.gbps), x.device)  # bytes / (GB/s) = ns
        # The emulated rank pulls `factor * scale` rows per row sent: copy that many bytes (at least once).
        # Without copies the received rows are the sent ones (a copy, even one, would wait for the GEMMs
        # beside it and hold the exchange until they end).
        for _ in range(max(1, round(factor * scale)) if self.copies else 0):
            out.copy_(x)
        if self.gbps > 0:
            cur.wait_stream(self._delay_stream)
        return out
