"""``PeerBuffers``: every peer's buffer of one shape and the table of their base addresses, what the row
movers (``kernels``) and the ready flags (``signals``) reach the peers through.

Legend: P peers (EP ranks of one NVLink domain, or emulated ranks of one device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeerBuffers:
    """Every peer's buffer of one shape ``[rows, W]`` (words), and their base addresses for the kernels."""

    bufs: tuple[torch.Tensor, ...]  # bufs[p]: peer p's buffer as seen from this process (loopback: real)
    table_P: torch.Tensor  # [P] int64 base addresses, on the device
