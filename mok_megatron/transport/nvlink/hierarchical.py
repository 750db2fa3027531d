"""``HierarchicalTransport``: the NVLink kernels inside each NVLink domain, the collective across domains.

An EP group that spans hosts (or NVLink domains) cannot reach every peer's memory. Each exchange is then
split by destination: rows whose source and destination share a domain move through the domain's
symmetric-memory workspace (``exchange.exchange_rows``: pull for dispatch, push for combine, as
``NVLinkTransport``), the others through one ``all_to_all_v`` over the whole EP group with the
in-domain counts zeroed (NCCL on GPUs). The received rows are put back in source order, so the result is
``all_to_all_single``'s with the full split matrix, bitwise (same rows, nothing reduced).

Domains and their process groups: ``transport.nvlink.domains``.

    m[s][d]     rows rank s sends to rank d in this exchange (``transport.base.split_matrix``)
    D           the EP ranks in my domain (group-relative, ascending)

Costs over one flat exchange: the sent rows are regrouped (one copy) and the received rows concatenated
back into source order (one copy); the domain exchange and the collective run one after the other on the
calling stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok_megatron.transport.base import Direction, SendPlan, group_link, split_matrix
from mok_megatron.transport.comm import all_to_all_v, group_size
from mok_megatron.transport.nvlink import transport as NT
from mok_megatron.transport.nvlink.domains import domain_group, domains_of
from mok_megatron.transport.nvlink.exchange import exchange_rows
from mok_megatron.transport.nvlink.kernels import DEFAULT_PROGRAMS


class HierarchicalTransport:
    name = "hierarchical"

    def __init__(
        self,
        group,
        programs: int = DEFAULT_PROGRAMS,
        names: list[str] | None = None,
        sync: str = "barrier",
        programs_backward: int | None = None,
    ):
        self.group = group
        self.ep = self.peers = group_size(group)
        self.link = group_link(group)
        self.rank = dist.get_rank(group)
        self.programs = programs
        self.programs_backward = programs if programs_backward is None else programs_backward
        self.sync = sync
        names = names if names is not None else domains_of(group)
        self.domain = [r for r, n in enumerate(names) if n == names[self.rank]]
        self.domains = len(set(names))
        self.node_group = domain_group(group)

    def _exchange_in_domain(self, x: torch.Tensor, m, push: bool, programs: int) -> torch.Tensor:
        D = self.domain
        if self.node_group is None:  # alone in my domain: my rows to myself
            return x
        sub = [[m[s][d] for d in D] for s in D]
        ws = NT.workspace(self.node_group, x.device)
        me = D.index(self.rank)
        return exchange_rows(ws, x, sub, me, push, programs, use_triton=x.is_cuda, sync=self.sync)

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        m = split_matrix(mb, direction, self.ep)
        me, ep, D = self.rank, self.ep, set(self.domain)
        sends = x.contiguous().split([m[me][d] for d in range(ep)])
        programs = self.programs_backward if backward else self.programs
        near = self._exchange_in_domain(
            torch.cat([sends[d] for d in self.domain]), m, direction is Direction.COMBINE, programs
        )
        far_out = [0 if d in D else m[me][d] for d in range(ep)]
        far_in = [0 if s in D else m[s][me] for s in range(ep)]
        far = torch.cat([sends[d] for d in range(ep) if d not in D])
        far = all_to_all_v(far, far_in, far_out, self.group)
        near_parts = iter(near.split([m[s][me] for s in self.domain]))
        far_parts = iter(far.split([m[s][me] for s in range(ep) if s not in D]))
        return torch.cat([next(near_parts) if s in D else next(far_parts) for s in range(ep)])


def nvlink_transport(
    group, programs: int = DEFAULT_PROGRAMS, sync: str = "barrier", programs_backward: int | None = None
):
    """``--mok-transport nvlink``: ``NVLinkTransport`` when the EP group is one NVLink domain, else
    ``HierarchicalTransport`` (collective over the EP group: every rank builds its layers in the same order).
    ``programs`` / ``programs_backward``: the CTAs that communicate in the forward / backward."""
    names = domains_of(group)
    if len(set(names)) == 1:
        return NT.NVLinkTransport(group, programs, sync, programs_backward)
    return HierarchicalTransport(group, programs, names, sync, programs_backward)
