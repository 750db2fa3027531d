"""What every transport is: how one minibatch's token rows move between EP ranks and back.

A transport implements ``move(x, mb, direction)``: the rows of ``x``, grouped by destination rank, go
to their ranks; the result holds the rows received, grouped by source rank. ``Direction.DISPATCH`` uses
the minibatch's send splits (``SendPlan``, built by ``engine.pipeline_plan``), ``Direction.COMBINE`` the
reverse. The backward of a dispatch is a combine with the same plan and vice versa (an all-to-all is its
own adjoint with the splits swapped): the overlap engine builds its autograd nodes on that
(``engine.pipeline._Arrived``). ``move`` runs on the current stream and never reads the device from the
host; the engine puts it on its communication stream.

    collective   ``transport.collective``: torch.distributed all-to-all (NCCL / gloo); across nodes
    copy_engine  ``transport.copy_engine``: symmetric-memory peer pulls on the copy engine (one NVLink domain)
    nvlink       ``transport.nvlink``: Triton kernels read / write peers' symmetric memory (one NVLink
                 domain; the hierarchical form across domains)
    loopback     ``transport.loopback``: one GPU emulating an EP rank's traffic (benchmarks)

A transport may also expose its peers' send buffers to a pull kernel (``PullSource``: the tiles engine's
``kernels.tile_pull`` copies the rows from them into its receive buffer beside the GEMM that waits for them):
how the rows each local expert receives split over the source ranks, the sources' buffers for a set of rows,
the link's pace, and whether the pull moves the rows at all (a link-only transport has every row placed and
the pull only paces and releases them). The loopback provides it.

Legend: Tc tokens of one minibatch, N rows sent, R rows received, M (token, local expert) rows, L local
experts, EP ranks; for ``PullSource``: P source ranks (source 0 this rank), G local experts, T tokens, H
hidden.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from mok_megatron.ops.routing import SlotMap


class Direction(Enum):
    """Which way an exchange moves rows: to the experts' ranks, or back to the tokens' ranks."""

    DISPATCH = "dispatch"
    COMBINE = "combine"

    @property
    def reverse(self) -> Direction:
        """The direction of this exchange's gradient."""
        return Direction.COMBINE if self is Direction.DISPATCH else Direction.DISPATCH


DISPATCH, COMBINE = Direction.DISPATCH, Direction.COMBINE


class Link(Enum):
    """How fast a transport's link is, as the minibatch policy sees it (``engine.pipeline_plan``)."""

    FAST = "fast"  # every peer in one node (one NVLink domain): splitting costs more than it hides
    SLOW = "slow"  # peers across nodes (~50 GB/s per GPU): minibatches hide the exchanges


def group_link(group) -> Link:
    """``Link.FAST`` when every rank of ``group`` runs on this host (torchrun's LOCAL_WORLD_SIZE blocks of
    ranks), else ``Link.SLOW``."""
    if group is None or dist.get_world_size(group) == 1:
        return Link.FAST
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    nodes = {r // max(local, 1) for r in dist.get_process_group_ranks(group)}
    return Link.FAST if len(nodes) == 1 else Link.SLOW


@dataclass(frozen=True)
class ExpertGroup:
    """Minibatch ``index`` of a call split by experts: local experts ``[bounds[index], bounds[index + 1])``
    (what an expert call gets to pick its weights; ``bounds`` the same for every call of the layer call)."""

    bounds: tuple[int, ...]
    index: int

    @property
    def experts(self) -> tuple[int, int]:
        return self.bounds[self.index], self.bounds[self.index + 1]


@dataclass(frozen=True)
class ExpertPart:
    """One grouped-GEMM call's rows: the received remote rows, or a local region."""

    rows_M: int  # (token, local expert) rows; sync-free (``padded``): an upper bound
    tokens_per_expert_L: torch.Tensor  # [L] int64 on device (exact mode)
    tokens_per_expert_host: tuple[int, ...] | None  # exact mode: the same on the host
    padded: bool  # rows carry a mask; counts come from what arrived


@dataclass(frozen=True)
class LocalPlan:
    """The rows of one minibatch that stay on this rank, and how the minibatch's output is summed."""

    regions: tuple[int, int, int]  # (r, a, b): tokens [0, r) remote-only, [r, r+a) A, [r+a, r+a+b) B
    here_T: torch.Tensor  # [Tc] bool: the token routes to a local expert (emulated: region A/B)
    remote: ExpertPart  # the rows received from the other ranks
    part_a: ExpertPart
    part_b: ExpertPart
    sum_slots: SlotMap  # [Tc, EP]: rows of cat(remote back, A, B) per token, fixed order


@dataclass(frozen=True)
class SendPlan:
    """One minibatch's *remote* exchange (what a transport reads) plus, in ``local``, its local rows.
    Sizes are Python ints; in sync-free mode they are the fixed capacities (no host read)."""

    start: int  # first token of the minibatch
    num_tokens: int  # Tc
    token_idx_N: torch.Tensor  # [N] token (within the minibatch) of each sent row
    dest_N: torch.Tensor  # [N] destination EP rank of each row
    valid_N: torch.Tensor | None  # [N] row carries a token (sync-free padding: False)
    slots: SlotMap  # [Tc, EP] each token's sent rows (gradient of the gather)
    send_splits: tuple[int, ...] | None  # [EP] rows per destination (None: capacity each)
    recv_splits: tuple[int, ...] | None  # [EP] rows per source
    split_matrix: tuple[tuple[int, ...], ...] | None  # [EP(src)][EP(dest)] rows, every rank's sends
    capacity: int | None  # token rows per (source, destination) when all peers get the same
    rows_M: int  # expanded rows this rank's experts compute from received rows (upper bound if padded)
    tokens_per_expert_L: torch.Tensor  # [L] int64 on device
    tokens_per_expert_host: tuple[int, ...] | None  # exact mode: the same on the host
    local: LocalPlan | None = None  # None: every row goes through the transport (hand-built plans)
    group: ExpertGroup | None = None  # split by experts: this minibatch's group (None: every local expert)


class Transport(Protocol):
    name: str
    peers: int  # the EP ranks whose traffic the exchanges carry (this rank included)
    link: Link  # how fast the link between them is

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        """Rows of ``x`` grouped by destination -> rows received, grouped by source. ``backward``: the move
        is a gradient's, in the layer's backward (a transport may give it other resources: the NVLink
        transport's CTA budget, ``--mok-nvlink-programs-backward``)."""
        ...


@runtime_checkable
class PullSource(Protocol):
    """A transport whose peers' send buffers a pull kernel reads (``kernels.tile_pull``).

    The rows this rank's G local experts receive, expert-major (the receive buffer's order), come from P
    sources; within each expert they are ordered by source (``tile_pull``'s layout), source 0 being this rank,
    whose rows cross no link. Source p's buffer holds exactly its rows for this rank, grouped by local expert.

    pull_rate        bytes/s at which the pull is paced (the link's rate); 0: unpaced
    pull_moves_rows  True: the pull copies the remote rows from the sources' buffers; False: the link time
                     only, every row placed in the receive buffer before the call (an ideal link whose bytes
                     cost the rank nothing) and the pull only paces and releases them (``pull_sources`` is
                     then not called)
    pull_split       c_PG from counts_G: the rows source p sends local expert g
    pull_sources     the P source buffers of a set of rows: the forward's token rows, the backward's output
                     gradient rows (one split for both)
    """

    pull_rate: float
    pull_moves_rows: bool

    def pull_split(self, counts_G: torch.Tensor) -> torch.Tensor:
        """int64 [P, G] on ``counts_G``'s device: the rows each source sends each local expert, summing over
        P to ``counts_G`` [G] (each expert's received rows)."""
        ...

    def pull_sources(
        self, rows_TH: torch.Tensor, token_M: torch.Tensor, c_PG: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """P buffers [rows of p, H]: source p's rows for this rank grouped by local expert, where received row
        m (expert-major, by source within an expert as ``c_PG`` splits it) carries ``rows_TH[token_M[m]]``.
        Contiguous, of ``rows_TH``'s dtype, on its device, 16-byte aligned; they hold their rows in the
        current stream's order."""
        ...


def splits(mb: SendPlan, direction: Direction, ep: int):
    """(in_splits = rows I send per peer, out_splits = rows I receive per peer)."""
    if mb.capacity is not None:
        s = (mb.capacity,) * ep
        return s, s
    if direction is Direction.DISPATCH:
        return mb.send_splits, mb.recv_splits
    return mb.recv_splits, mb.send_splits


def split_matrix(mb: SendPlan, direction: Direction, ep: int) -> list[list[int]]:
    """``m[s][d]``: rows s sends to d in this direction (capacity per pair in sync-free mode)."""
    if mb.capacity is not None:
        return [[mb.capacity] * ep for _ in range(ep)]
    m = [list(r) for r in mb.split_matrix]
    if direction is Direction.COMBINE:
        m = [list(r) for r in zip(*m, strict=True)]
    return m
