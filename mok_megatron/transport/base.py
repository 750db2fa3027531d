"""What every transport is: how one minibatch's token rows move between EP ranks and back.

A transport implements ``move(x, mb, direction)``: the rows of ``x``, grouped by destination rank, go
to their ranks; the result holds the rows received, grouped by source rank. ``DISPATCH`` uses the
minibatch's send splits (``engine.pipeline_plan.SendPlan``), ``COMBINE`` the reverse. The backward of a
dispatch is a combine with the same plan and vice versa (an all-to-all is its own adjoint with the
splits swapped): the overlap engine builds its autograd nodes on that (``engine.pipeline._Arrived``).
``move`` runs on the current stream and never reads the device from the host; the engine puts it on
its communication stream.

    collective   ``transport.collective``: torch.distributed all-to-all (NCCL / gloo); across nodes
    copy_engine  ``transport.copy_engine``: symmetric-memory peer pulls on the copy engine (one NVLink domain)
    nvlink       ``transport.nvlink``: Triton kernels read / write peers' symmetric memory (one NVLink
                 domain; the hierarchical form across domains)
    loopback     ``transport.loopback``: one GPU emulating an EP rank's traffic (benchmarks)

Legend: N rows sent, R rows received, EP ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mok_megatron.engine.pipeline_plan import SendPlan

DISPATCH, COMBINE = 0, 1


class Transport(Protocol):
    name: str

    def move(self, x: torch.Tensor, mb: SendPlan, direction: int, backward: bool = False) -> torch.Tensor:
        """Rows of ``x`` grouped by destination -> rows received, grouped by source. ``backward``: the move
        is a gradient's, in the layer's backward (a transport may give it other resources: the NVLink
        transport's CTA budget, ``--mok-nvlink-programs-backward``)."""
        ...


def splits(mb: SendPlan, direction: int, ep: int):
    """(in_splits = rows I send per peer, out_splits = rows I receive per peer)."""
    if mb.capacity is not None:
        s = (mb.capacity,) * ep
        return s, s
    if direction == DISPATCH:
        return mb.send_splits, mb.recv_splits
    return mb.recv_splits, mb.send_splits
