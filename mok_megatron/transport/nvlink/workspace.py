"""Workspaces: the buffers every rank of an EP group publishes, allocated once and reused.

``NVLinkWorkspace(group)`` holds symmetric-memory buffers (``torch.distributed._symmetric_memory``)
keyed by row format (word dtype, words per row) and role (the exchange direction); a buffer grows
(collectively: every rank computes the same size from the global split matrix) and is otherwise
reused by every layer and call on the group. ``workspace(group, device)`` returns the cached one;
``close()`` frees it (and drops it from the cache).
Creating one checks, and raises ``MoKConfigError`` naming the fix, that: CUDA and an NCCL group are
there, symmetric memory imports, and every rank of the group is on this host with peer access to this
GPU (one NVLink domain; across nodes use the collective transport).

``signals(me)`` gives a rank's ready flags (``transport.nvlink.signals``: one symmetric int64 word per peer and a
device epoch counter) for exchanges signalled per peer instead of by a barrier.

``LoopbackWorkspace(n, device)`` is the same interface for N emulated ranks in one process: N plain
buffers per format on one device, the same pointer tables and kernels; ``barrier`` is stream order.

Legend: P ranks (peers), W words per row.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from mok_megatron.errors import MoKConfigError
from mok_megatron.transport.comm import group_size
from mok_megatron.transport.nvlink.domains import node_name
from mok_megatron.transport.nvlink.peers import PeerBuffers
from mok_megatron.transport.nvlink.signals import Signals

_FIX = "use --mok-transport collective (or copy_engine inside one node)"


def _grow(rows: int, have: int) -> int:
    return max(rows, 2 * have, 64)


class LoopbackWorkspace:
    """N emulated ranks' buffers on one device (correctness evidence on one GPU, or on CPU interpreted)."""

    def __init__(self, num_ranks: int, device):
        if num_ranks < 1:
            raise MoKConfigError(f"loopback num_ranks={num_ranks}: must be >= 1.")
        self.size = num_ranks
        self.device = torch.device(device)
        self._bufs: dict = {}  # (word dtype, W, role) -> PeerBuffers
        self._sig = None  # (every rank's flag words, every rank's epoch counter)

    def buffers(self, word: torch.dtype, W: int, rows: int, role=None) -> PeerBuffers:
        key = (word, W, role)
        have = self._bufs.get(key)
        if have is not None and have.bufs[0].shape[0] >= rows:
            return have
        n = _grow(rows, have.bufs[0].shape[0] if have else 0)
        bufs = tuple(torch.empty((n, W), dtype=word, device=self.device) for _ in range(self.size))
        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=self.device)
        self._bufs[key] = PeerBuffers(bufs, table)
        return self._bufs[key]

    def barrier(self) -> None:
        """One process, one stream: program order already orders the emulated ranks."""

    def signals(self, me: int) -> Signals:
        """Emulated rank ``me``'s ready flags (``transport.nvlink.signals``): N flag arrays, N epoch counters."""
        if self._sig is None:
            n, dev = self.size, self.device
            flags = tuple(torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(n))
            table = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=dev)
            self._sig = (
                PeerBuffers(flags, table),
                [torch.zeros(1, dtype=torch.int64, device=dev) for _ in flags],
            )
        return Signals(self._sig[0], self._sig[1][me], me)

    def close(self) -> None:
        self._bufs.clear()
        self._sig = None


def check_nvlink_group(group) -> None:
    """Raise MoKConfigError unless ``group`` can use symmetric memory on one NVLink domain (collective:
    every rank must call it)."""
    if not torch.cuda.is_available():
        raise MoKConfigError(f"--mok-transport nvlink needs CUDA GPUs; none here: {_FIX}.")
    if not dist.is_initialized():
        raise MoKConfigError("--mok-transport nvlink needs torch.distributed initialised (NCCL).")
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise MoKConfigError(
            f"--mok-transport nvlink needs an NCCL EP group; this one is {backend!r}: {_FIX}."
        )
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as e:  # pragma: no cover - torch builds without it
        raise MoKConfigError(f"--mok-transport nvlink needs torch symmetric memory ({e}): {_FIX}.") from e
    me = torch.cuda.current_device()
    mine = (node_name(), me)
    everyone = [None] * group_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    hosts = sorted({h for h, _ in everyone})
    if len(hosts) > 1:
        raise MoKConfigError(
            f"NVLink workspace: the group spans {len(hosts)} hosts ({', '.join(hosts)}); peer memory reaches "
            f"one NVLink domain only: {_FIX} (--mok-transport nvlink itself splits such an EP group: "
            "mok_megatron.transport.nvlink.hierarchical)."
        )
    no_peer = [d for _, d in everyone if d != me and not torch.cuda.can_device_access_peer(me, d)]
    verdicts = [None] * len(everyone)  # every rank must raise together (or all would hang later)
    dist.all_gather_object(verdicts, (me, no_peer), group=group)
    bad = [(d, n) for d, n in verdicts if n]
    if bad:
        pairs = "; ".join(f"GPU {d} cannot reach GPU(s) {n}" for d, n in bad)
        raise MoKConfigError(
            f"--mok-transport nvlink: {pairs}: the EP group is not one NVLink/P2P domain: {_FIX}."
        )


class NVLinkWorkspace:
    """Symmetric buffers of one EP group (one per row format), reused across layers and calls."""

    def __init__(self, group, device):
        check_nvlink_group(group)
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = group
        self.group_name = group.group_name if group is not None else dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.size = group_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device(device)
        self._bufs: dict = {}  # (word dtype, W, role) -> (PeerBuffers, handle, local buffer)
        self._hdl = None  # the handle of the newest buffer: its signal pad carries the barriers
        self._sig: Signals | None = None  # ready flags (--mok-nvlink-sync flags), created on first use
        self._retired: list = []  # grown-out buffers: kept until close() (frees need not be stream-ordered)

    def buffers(self, word: torch.dtype, W: int, rows: int, role=None) -> PeerBuffers:
        key = (word, W, role)
        have = self._bufs.get(key)
        if have is not None and have[0].bufs[0].shape[0] >= rows:
            return have[0]
        n = _grow(rows, have[0].bufs[0].shape[0] if have else 0)  # same on every rank: same decision
        if have is not None:
            self._retired.append(have)
        buf = self.symm_mem.empty((n, W), dtype=word, device=self.device)
        hdl = self.symm_mem.rendezvous(buf, self.group_name)
        bufs = tuple(
            buf if p == self.rank else hdl.get_buffer(p, (n, W), word, 0) for p in range(hdl.world_size)
        )
        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=self.device)
        self._bufs[key] = (PeerBuffers(bufs, table), hdl, buf)
        self._hdl = hdl
        return self._bufs[key][0]

    def barrier(self) -> None:
        """Every rank's queued work on this stream is done before any rank's next (device-side)."""
        self._hdl.barrier(channel=0)

    def signals(self, me: int) -> Signals:
        """This rank's ready flags: one int64 word per peer in symmetric memory (peers publish into it),
        zeroed on every rank before any rank can publish; the epoch counter on this device."""
        if me != self.rank:
            raise ValueError(
                f"signals(me={me}) on rank {self.rank}'s workspace: a rank has its own flags only"
            )
        if self._sig is None:
            n = self.size
            buf = self.symm_mem.empty((n,), dtype=torch.int64, device=self.device)
            buf.zero_()
            hdl = self.symm_mem.rendezvous(buf, self.group_name)
            flags = tuple(
                buf if p == self.rank else hdl.get_buffer(p, (n,), torch.int64, 0) for p in range(n)
            )
            table = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=self.device)
            hdl.barrier(channel=0)  # (stream-ordered after the zeroing, on every rank)
            epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._sig = Signals(PeerBuffers(flags, table), epoch, self.rank)
            self._retired.append((buf, hdl))
        return self._sig

    def close(self) -> None:
        """Free the buffers (call on every rank, after the last exchange) and forget this workspace."""
        if self._bufs:
            torch.cuda.synchronize(self.device)  # every stream: exchanges run on the comm stream
        self._bufs.clear()
        self._retired.clear()
        self._hdl = None
        self._sig = None
        for k, v in list(_cache.items()):
            if v is self:
                del _cache[k]


_cache: dict = {}


def workspace(group, device) -> NVLinkWorkspace:
    """The group's workspace on ``device``, created (collectively, with the checks) on first use."""
    name = group.group_name if group is not None else dist.group.WORLD.group_name
    key = (name, torch.device(device))
    ws = _cache.get(key)
    if ws is None:
        ws = _cache[key] = NVLinkWorkspace(group, device)
    return ws


def close_all() -> None:
    for ws in list(_cache.values()):
        ws.close()
