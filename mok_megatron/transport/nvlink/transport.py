"""``NVLinkTransport``: the overlap pipeline's exchanges as device-initiated peer reads and writes.

Same interface as ``mok_megatron.transport.base`` (``move(x, mb, direction)``): DISPATCH pulls
(each destination rank's kernel reads its rows from every source's symmetric buffer), COMBINE pushes
(each expert rank's kernel writes its output rows into the source ranks' buffers). The backward of a
dispatch is a combine and vice versa, so backward uses both kernels too. ``programs`` bounds the CTAs
that communicate in the forward, ``programs_backward`` in the backward (None: the same), as MoK's
``fwd_num_comm_sms`` / ``bwd_num_comm_sms``: every CTA that communicates is one the GEMMs beside it do not
get, and the backward's GEMMs are twice the forward's; ``sync`` how the ranks signal each exchange: 'barrier' (symmetric memory's barrier)
or 'flags' (per-peer ready flags, ``transport.nvlink.signals``). One NVLink domain only (the workspace checks it);
across nodes the collective transport stays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok_megatron.transport.base import Direction, SendPlan, group_link, split_matrix
from mok_megatron.transport.comm import group_size
from mok_megatron.transport.nvlink.exchange import exchange_rows
from mok_megatron.transport.nvlink.kernels import DEFAULT_PROGRAMS
from mok_megatron.transport.nvlink.workspace import workspace


class NVLinkTransport:
    name = "nvlink"

    def __init__(
        self,
        group,
        programs: int = DEFAULT_PROGRAMS,
        sync: str = "barrier",
        programs_backward: int | None = None,
    ):
        self.group = group
        self.ep = self.peers = group_size(group)
        self.link = group_link(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.programs = programs
        self.programs_backward = programs if programs_backward is None else programs_backward
        self.sync = sync

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        ws = workspace(self.group, x.device)
        m = split_matrix(mb, direction, self.ep)
        push = direction is Direction.COMBINE
        # CPU tensors (tests with a shared-memory workspace) take the torch references.
        programs = self.programs_backward if backward else self.programs
        return exchange_rows(ws, x, m, self.rank, push, programs, use_triton=x.is_cuda, sync=self.sync)
