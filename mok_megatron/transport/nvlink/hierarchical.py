"""``HierarchicalTransport``: the NVLink kernels inside each NVLink domain, the collective across domains.

An EP group that spans hosts (or NVLink domains) cannot reach every peer's memory. Each exchange is then
split by destination: rows whose source and destination share a domain move through the domain's
symmetric-memory workspace (``exchange.exchange_rows``: pull for dispatch, push for combine, as
``NVLinkTransport``), the others through one ``all_to_all_v`` over the whole EP group with the
in-domain counts zeroed (NCCL on GPUs). The received rows are put back in source order, so the result is
``all_to_all_single``'s with the full split matrix, bitwise (same rows, nothing reduced).

Domains: ranks whose ``node_name()`` agree (the host name, or ``MOK_NVLINK_DOMAIN`` when set: e.g. one GB300
NVL72 rack spans 18 hosts and is one domain, which also needs symmetric memory across hosts: untested;
tests use it to split localhost into "nodes"). The domain groups are created by every rank of the job in
the same order, once, before the model is built (``init_nvlink_domains``: torch requires every rank to
take part in every group creation).

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

from mok_megatron.config import MoKConfigError
from mok_megatron.transport.comm import all_to_all_v, group_size
from mok_megatron.engine.pipeline_plan import SendPlan
from mok_megatron.transport.base import COMBINE
from mok_megatron.transport.nvlink import transport as NT
from mok_megatron.transport.nvlink.exchange import exchange_rows
from mok_megatron.transport.nvlink.kernels import DEFAULT_PROGRAMS

DOMAIN_ENV = "MOK_NVLINK_DOMAIN"


def node_name() -> str:
    """This process's NVLink domain name: ``$MOK_NVLINK_DOMAIN`` if set, else the host name."""
    return os.environ.get(DOMAIN_ENV) or socket.gethostname()


def domains_of(group) -> list[str]:
    """Every EP rank's domain name (collective over ``group``)."""
    names = [None] * group_size(group)
    dist.all_gather_object(names, node_name(), group=group)
    return names


_domain_groups: dict = {}  # EP group's global ranks -> my domain's process group (None: alone in it)


def init_nvlink_domains(ep_group=None) -> None:
    """Create the NVLink-domain groups that ``--mok-transport nvlink`` needs when an EP group spans domains.

    A collective over every rank of the job (like Megatron's own group creation): call it once on every
    rank after ``initialize_model_parallel`` and before the model is built (``mok-pretrain-gpt`` does,
    from its layer spec). Every rank gathers every rank's EP group and domain name, then creates, in the
    same order on every rank, one process group per (EP group, domain) of two or more ranks. ``ep_group``:
    this rank's EP group (default: Megatron's expert-model-parallel group)."""
    if ep_group is None:
        from megatron.core import parallel_state as ps

        ep_group = ps.get_expert_model_parallel_group()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tuple(dist.get_process_group_ranks(ep_group)), node_name()))
    me = dist.get_rank()
    domain = [name for _, name in everyone]
    for ep in sorted({ranks for ranks, _ in everyone}):
        mine = None
        for name in dict.fromkeys(domain[r] for r in ep):  # in order of first appearance: same on every rank
            members = [r for r in ep if domain[r] == name]
            if len(members) > 1:
                pg = dist.new_group(members)  # every rank calls, members or not (torch's rule)
                if me in members:
                    mine = pg
        if me in ep:
            _domain_groups[ep] = mine


def domain_group(group):
    """My domain's process group inside the EP group ``group`` (None: alone in my domain)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _domain_groups:
        raise MoKConfigError(
            f"--mok-transport nvlink: the EP group {list(ranks)} spans NVLink domains, whose process groups "
            "must be created on every rank before the model is built: call "
            "mok_megatron.transport.nvlink.hierarchical.init_nvlink_domains() on every rank after Megatron's "
            "initialize_model_parallel (mok-pretrain-gpt does), or use --mok-transport collective."
        )
    return _domain_groups[ranks]


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
        self.ep = group_size(group)
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

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int, backward: bool = False) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        m = NT.split_matrix(mb, direction, self.ep)
        me, ep, D = self.rank, self.ep, set(self.domain)
        sends = x.contiguous().split([m[me][d] for d in range(ep)])
        programs = self.programs_backward if backward else self.programs
        near = self._exchange_in_domain(
            torch.cat([sends[d] for d in self.domain]), m, direction == COMBINE, programs
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
