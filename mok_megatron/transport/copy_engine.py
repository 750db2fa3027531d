"""``CopyEngineTransport``: symmetric-memory pulls on the copy engine (CUDA, one NVLink domain).

Each rank writes its outgoing rows into its own symmetric-memory buffer, a device barrier, then every
rank pulls its rows from its peers' buffers with ``copy_`` (cudaMemcpyAsync over NVLink: the copy
engine, no SMs), and a second barrier before the buffer is reused. No host synchronisation.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mok_megatron.engine.pipeline_plan import SendPlan
from mok_megatron.transport.base import COMBINE
from mok_megatron.transport.comm import group_size


class _Workspace:
    """One symmetric-memory byte buffer per EP group, grown (collectively) when an exchange needs more."""

    def __init__(self, group):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = group
        self.group_name = group.group_name if group is not None else dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.nbytes = 0
        self.buf = None
        self.hdl = None
        self.peers: list[torch.Tensor] = []

    def ensure(self, nbytes: int, device) -> None:
        if nbytes <= self.nbytes:
            return
        nbytes = max(nbytes, 2 * self.nbytes)  # every rank computes the same size: same decision
        nbytes = (nbytes + 127) // 128 * 128
        self.buf = self.symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.hdl = self.symm_mem.rendezvous(self.buf, self.group_name)
        ws = self.hdl.world_size
        self.peers = [self.hdl.get_buffer(p, (nbytes,), torch.uint8, 0) for p in range(ws)]
        self.nbytes = nbytes


class CopyEngineTransport:
    """Symmetric-memory pulls on the copy engine (CUDA, all EP ranks in one NVLink domain)."""

    name = "copy_engine"
    _workspaces: dict = {}

    def __init__(self, group):
        if not torch.cuda.is_available():
            raise RuntimeError("the copy_engine transport needs CUDA GPUs; use --mok-transport collective")
        self.group = group
        self.ep = group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def _ws(self, device) -> _Workspace:
        key = (id(self.group), device)
        ws = CopyEngineTransport._workspaces.get(key)
        if ws is None:
            ws = CopyEngineTransport._workspaces[key] = _Workspace(self.group)
        return ws

    def _matrix(self, mb: SendPlan, direction: int):
        if mb.capacity is not None:
            return [[mb.capacity] * self.ep for _ in range(self.ep)]
        m = [list(r) for r in mb.split_matrix]
        if direction == COMBINE:
            m = [list(r) for r in zip(*m, strict=True)]
        return m

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        x = x.contiguous()
        row_shape = tuple(x.shape[1:])
        row_bytes = (
            x[0:1].numel() * x.element_size() if x.shape[0] else math.prod(row_shape) * x.element_size()
        )
        m = self._matrix(mb, direction)
        me, ep = self.rank, self.ep
        ws = self._ws(x.device)
        ws.ensure(max(sum(r) for r in m) * row_bytes, x.device)
        out = x.new_empty((sum(m[s][me] for s in range(ep)),) + row_shape)
        my_bytes = x.numel() * x.element_size()
        if my_bytes:
            ws.buf[:my_bytes].copy_(x.view(-1).view(torch.uint8))
        ws.hdl.barrier(channel=0)
        out_bytes = out.view(-1).view(torch.uint8) if out.numel() else None
        dst = 0
        for p in range(ep):
            n = m[p][me]
            if n:
                src = sum(m[p][:me]) * row_bytes
                out_bytes[dst : dst + n * row_bytes].copy_(ws.peers[p][src : src + n * row_bytes])
            dst += n * row_bytes
        ws.hdl.barrier(channel=0)
        return out
