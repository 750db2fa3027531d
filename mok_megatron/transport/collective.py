"""``CollectiveTransport``: the exchange as one ``torch.distributed`` all-to-all (NCCL on GPUs, gloo on
CPU), with exact splits or the sync-free fixed capacity per peer. Works across nodes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok_megatron.transport.base import Direction, SendPlan, group_link, splits
from mok_megatron.transport.comm import group_size


class CollectiveTransport:
    name = "collective"

    def __init__(self, group):
        self.group = group
        self.ep = self.peers = group_size(group)
        self.link = group_link(group)

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        in_splits, out_splits = splits(mb, direction, self.ep)
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=self.group)
        return out
