"""``HierarchicalTransport``: the NVLink kernels inside each NVLink domain, the collective across domains.

An EP group that spans hosts (or NVLink domains) cannot reach every peer's memory. Each exchange is then
split by destination: rows whose source and destination share a domain move through the domain's
symmetric-memory workspace (``exchange.exchange_rows``: pull for dispatch, push for combine, as
``NVLinkTransport``), the others through one ``all_to_all_v`` over the whole EP group with the
in-domain counts zeroed (NCCL on GPUs). The received rows are put back in source order, so the result is
``all_to_all_single``'s with the full split matrix, bitwise (same rows, nothing reduced).

Domains: ranks whose ``node_name()`` agree (the host name, or ``MOK_NVLINK_DOMAIN`` when set: e.g. one GB300
NVL72 rack spans 18 hosts and is one domain; tests use it to split localhost into "nodes"). The domain
subgroups are created once per EP group, by the member ranks only (``use_local_synchronization``).

    m[s][d]     rows rank s sends to rank d in this exchange (``transport.split_matrix``)
    D           the EP ranks in my domain (group-relative, ascending)

Costs over one flat exchange: the sent rows are regrouped (one copy) and the received rows concatenated
back into source order (one copy); the domain exchange and the collective run one after the other on the
calling stream.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from mok_megatron.functional.comm import all_to_all_v, group_size
from mok_megatron.functional.pipeline_plan import SendPlan
from mok_megatron.functional.transport import COMBINE
from mok_megatron.nvlink import transport as NT
from mok_megatron.nvlink.exchange import exchange_rows
from mok_megatron.nvlink.kernels import DEFAULT_PROGRAMS

DOMAIN_ENV = "MOK_NVLINK_DOMAIN"


def node_name() -> str:
    """This process's NVLink domain name: ``$MOK_NVLINK_DOMAIN`` if set, else the host name."""
    return os.environ.get(DOMAIN_ENV) or socket.gethostname()


def domains_of(group) -> list[str]:
    """Every EP rank's domain name (collective over ``group``)."""
    names = [None] * group_size(group)
    dist.all_gather_object(names, node_name(), group=group)
    return names


_subgroups: dict = {}  # (EP group name, member global ranks) -> the domain's process group


def domain_group(group, names: list[str], backend: str | None = None):
    """The process group of my domain's EP ranks (created once; only its members call this)."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    members = tuple(ranks[r] for r, n in enumerate(names) if n == names[me])
    key = (group.group_name if group is not None else "WORLD", members)
    pg = _subgroups.get(key)
    if pg is None:
        pg = _subgroups[key] = dist.new_group(list(members), backend=backend, use_local_synchronization=True)
    return pg


class HierarchicalTransport:
    name = "hierarchical"

    def __init__(self, group, programs: int = DEFAULT_PROGRAMS, names: list[str] | None = None):
        self.group = group
        self.ep = group_size(group)
        self.rank = dist.get_rank(group)
        self.programs = programs
        names = names if names is not None else domains_of(group)
        self.domain = [r for r, n in enumerate(names) if n == names[self.rank]]
        self.domains = len(set(names))
        self.node_group = domain_group(group, names) if len(self.domain) > 1 else None

    def _exchange_in_domain(self, x: torch.Tensor, m, push: bool) -> torch.Tensor:
        D = self.domain
        if self.node_group is None:  # alone in my domain: my rows to myself
            return x
        sub = [[m[s][d] for d in D] for s in D]
        ws = NT.workspace(self.node_group, x.device)
        return exchange_rows(ws, x, sub, D.index(self.rank), push, self.programs, use_triton=x.is_cuda)

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        m = NT.split_matrix(mb, direction, self.ep)
        me, ep, D = self.rank, self.ep, set(self.domain)
        sends = x.contiguous().split([m[me][d] for d in range(ep)])
        near = self._exchange_in_domain(torch.cat([sends[d] for d in self.domain]), m, direction == COMBINE)
        far_out = [0 if d in D else m[me][d] for d in range(ep)]
        far_in = [0 if s in D else m[s][me] for s in range(ep)]
        far = torch.cat([sends[d] for d in range(ep) if d not in D])
        far = all_to_all_v(far, far_in, far_out, self.group)
        near_parts = iter(near.split([m[s][me] for s in self.domain]))
        far_parts = iter(far.split([m[s][me] for s in range(ep) if s not in D]))
        return torch.cat([next(near_parts) if s in D else next(far_parts) for s in range(ep)])


def nvlink_transport(group, programs: int = DEFAULT_PROGRAMS):
    """``--mok-transport nvlink``: ``NVLinkTransport`` when the EP group is one NVLink domain, else
    ``HierarchicalTransport`` (collective over the EP group: every rank builds its layers in the same order)."""
    names = domains_of(group)
    if len(set(names)) == 1:
        return NT.NVLinkTransport(group, programs)
    return HierarchicalTransport(group, programs, names)
