"""``CopyEngineTransport``: symmetric-memory pulls on the copy engine (CUDA, one NVLink domain).

Each rank writes its outgoing rows into its own symmetric-memory buffer, a device barrier, then every
rank pulls its rows from its peers' buffers with ``copy_`` (cudaMemcpyAsync over NVLink: the copy
engine, no SMs), and a second barrier before the buffer is reused. No host synchronisation. The buffers
are the EP group's symmetric-memory workspace (``transport.nvlink.workspace``), shared with the NVLink
transport: one byte buffer, grown collectively when an exchange needs more.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mok_megatron.transport.base import Direction, SendPlan, group_link, split_matrix
from mok_megatron.transport.comm import group_size
from mok_megatron.transport.nvlink.workspace import workspace


class CopyEngineTransport:
    """Symmetric-memory pulls on the copy engine (CUDA, all EP ranks in one NVLink domain)."""

    name = "copy_engine"

    def __init__(self, group):
        if not torch.cuda.is_available():
            raise RuntimeError("the copy_engine transport needs CUDA GPUs; use --mok-transport collective")
        self.group = group
        self.ep = self.peers = group_size(group)
        self.link = group_link(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def move(
        self, x: torch.Tensor, mb: SendPlan, direction: Direction, backward: bool = False
    ) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        x = x.contiguous()
        row_shape = tuple(x.shape[1:])
        row_bytes = (
            x[0:1].numel() * x.element_size() if x.shape[0] else math.prod(row_shape) * x.element_size()
        )
        m = split_matrix(mb, direction, self.ep)
        me, ep = self.rank, self.ep
        ws = workspace(self.group, x.device)
        # every rank computes the same size from the global matrix: the same (collective) growth decision
        peers = ws.buffers(torch.uint8, 1, max(sum(r) for r in m) * row_bytes, role=self.name).bufs
        out = x.new_empty((sum(m[s][me] for s in range(ep)),) + row_shape)
        my_bytes = x.numel() * x.element_size()
        if my_bytes:
            peers[me].view(-1)[:my_bytes].copy_(x.view(-1).view(torch.uint8))
        ws.barrier()
        out_bytes = out.view(-1).view(torch.uint8) if out.numel() else None
        dst = 0
        for p in range(ep):
            n = m[p][me]
            if n:
                src = sum(m[p][:me]) * row_bytes
                out_bytes[dst : dst + n * row_bytes].copy_(peers[p].view(-1)[src : src + n * row_bytes])
            dst += n * row_bytes
        ws.barrier()
        return out
