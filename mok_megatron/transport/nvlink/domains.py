"""NVLink domains: which EP ranks reach each other's memory, and their process groups.

Domains: ranks whose ``node_name()`` agree (the host name, or ``MOK_NVLINK_DOMAIN`` when set: e.g. one GB300
NVL72 rack spans 18 hosts and is one domain, which also needs symmetric memory across hosts: untested;
tests use it to split localhost into "nodes"). The domain groups are created by every rank of the job in
the same order, once, before the model is built (``init_nvlink_domains``: torch requires every rank to
take part in every group creation).
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from mok_megatron.errors import MoKConfigError
from mok_megatron.transport.comm import group_size

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


def _ep_group(ep_group):
    if ep_group is None:
        from megatron.core import parallel_state as ps

        ep_group = ps.get_expert_model_parallel_group()
    return ep_group


def domains_ready(ep_group=None) -> bool:
    """Whether ``init_nvlink_domains`` created the domain groups of this rank's EP group (the same answer on
    every rank: one call creates every EP group's)."""
    return tuple(dist.get_process_group_ranks(_ep_group(ep_group))) in _domain_groups


def init_nvlink_domains(ep_group=None) -> None:
    """Create the NVLink-domain groups that ``--mok-transport nvlink`` needs when an EP group spans domains.

    A collective over every rank of the job (like Megatron's own group creation): call it on every rank
    after ``initialize_model_parallel`` and before the model is built (``mok-pretrain-gpt`` does, from its
    layer spec). Every rank gathers every rank's EP group and domain name, then creates, in the same order
    on every rank, one process group per (EP group, domain) of two or more ranks (``domains_ready`` tells
    whether a call already did). ``ep_group``: this rank's EP group (default: Megatron's
    expert-model-parallel group)."""
    ep_group = _ep_group(ep_group)
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
            "mok_megatron.transport.nvlink.domains.init_nvlink_domains() on every rank after Megatron's "
            "initialize_model_parallel (mok-pretrain-gpt does), or use --mok-transport collective."
        )
    return _domain_groups[ranks]
