"""Transports: how one minibatch's token rows move between EP ranks (dispatch) and back (combine).

Each transport implements ``move(x, mb, direction)``: rows of ``x`` grouped by destination go to
their ranks; the result holds the rows received, grouped by source. ``DISPATCH`` uses the minibatch's
send splits, ``COMBINE`` the reverse. ``exchange`` wraps it in autograd: the gradient of a dispatch
is a combine of the gradients and vice versa (all-to-all is its own adjoint with the splits swapped).
It runs on whatever stream is current, so the pipeline puts it on its communication stream.

    collective   torch.distributed all-to-all (NCCL on GPUs, gloo on CPU); exact splits, or the
                 sync-free capacity per peer. Works across nodes.
    copy_engine  CUDA, one NVLink domain: each rank writes its outgoing rows into its own
                 symmetric-memory buffer, a device barrier, then every rank pulls its rows from its
                 peers' buffers with ``copy_`` (cudaMemcpyAsync over NVLink: the copy engine, no SMs),
                 and a second barrier before the buffer is reused. No host synchronisation.
    loopback     one GPU standing in for EP ranks (benchmarks): the rows are copied (device to device)
                 as many times as the emulated rank would move them, and a delay stream waits for
                 ``bytes / bandwidth``; the exchange ends when both are done. ``copies=False``: no
                 copy (the received rows are the sent ones), only the link time is emulated.

Legend: N rows sent, R rows received, EP ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mok_megatron.functional.comm import group_size
from mok_megatron.functional.pipeline_plan import SendPlan

DISPATCH, COMBINE = 0, 1


def _splits(mb: SendPlan, direction: int, ep: int):
    """(in_splits = rows I send per peer, out_splits = rows I receive per peer)."""
    if mb.capacity is not None:
        s = (mb.capacity,) * ep
        return s, s
    if direction == DISPATCH:
        return mb.send_splits, mb.recv_splits
    return mb.recv_splits, mb.send_splits


class CollectiveTransport:
    name = "collective"

    def __init__(self, group):
        self.group = group
        self.ep = group_size(group)

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int) -> torch.Tensor:
        if self.ep == 1:
            return x.clone()
        in_splits, out_splits = _splits(mb, direction, self.ep)
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=self.group)
        return out


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


def expected_remote_ranks(ep: int, num_local_experts: int, topk: int) -> float:
    """Expected number of *other* EP ranks one token visits (uniform top-k over ep * L experts)."""
    if ep <= 1:
        return 0.0
    e = ep * num_local_experts
    miss = 1.0
    for i in range(topk):
        miss *= max(e - num_local_experts - i, 0) / (e - i)
    return ep * (1.0 - miss) * (ep - 1) / ep


class LoopbackTransport:
    """One GPU plays one rank of an EP group: the same bytes copied, the link time emulated.

    The link time (``bytes / gbps``) runs on a delay stream as a wall-clock spin
    (``kernels.link_delay.spin_ns``) beside the copies; the exchange ends when both have.

    ``copies``: copy the rows as many times as the emulated rank moves them (its HBM traffic). These
    device-to-device copies (~3.6 TB/s of traffic) behave like SM work: on one H200 they make almost no
    progress while a grouped GEMM holds the SMs and finish after it (``benchmarks/paced_copy_probe.py``,
    s11). ``copies=False``: the link time alone stands for the
    exchange; on GPUs the received rows *are* the sent rows (no copy at all; on CPU a clone): an ideal
    transport whose bytes land beside the GEMMs unhindered, the schedule's own bound."""

    name = "loopback"

    def __init__(self, emulated_ep: int, num_local_experts: int, topk: int, gbps: float, copies: bool = True):
        self.factor = expected_remote_ranks(emulated_ep, num_local_experts, topk)
        self.copies = copies
        self.gbps = gbps
        self._delay_stream = None
        self.bytes_moved = 0  # emulated link bytes so far (benchmarks read it)

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int) -> torch.Tensor:
        nbytes = x.numel() * x.element_size() * self.factor
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
        # The emulated rank pulls `factor` rows per token: copy that many bytes (at least once). Without
        # `copies` the rows are not copied at all: the received rows are the sent ones (a copy, even one,
        # would wait for the GEMMs beside it and hold the exchange until they end, s11).
        for _ in range(max(1, round(self.factor)) if self.copies else 0):
            out.copy_(x)
        if self.gbps > 0:
            cur.wait_stream(self._delay_stream)
        return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, transport, mb, direction):
        ctx.transport, ctx.mb, ctx.direction = transport, mb, direction
        return transport.move(x, mb, direction)

    @staticmethod
    def backward(ctx, g):
        back = COMBINE if ctx.direction == DISPATCH else DISPATCH
        return ctx.transport.move(g.contiguous(), ctx.mb, back), None, None, None


def exchange(x: torch.Tensor, transport, mb: SendPlan, direction: int) -> torch.Tensor:
    return _Exchange.apply(x, transport, mb, direction)
