"""EP all-to-all time from a link model: the share of a rank's traffic that stays in the NVLink
domain and the share that crosses the NIC, each at its bandwidth x a measured efficiency."""

from __future__ import annotations

from dataclasses import dataclass

from mok_megatron.tools.planner.hardware import Cluster


class LinkError(ValueError):
    """A transport that cannot run on this placement; the message names the fix."""


@dataclass(frozen=True)
class LinkModel:
    efficiency: float  # achieved / peak for all-to-all, from the NCCL measurement (calibrate.py)

    def __post_init__(self):
        if not 0 < self.efficiency <= 1:
            raise LinkError(f"link efficiency {self.efficiency}: must be in (0, 1]")

    def inter_share(self, cluster: Cluster, ep: int) -> float:
        """Fraction of a rank's remote peers outside its NVLink domain (EP groups placed on consecutive
        GPUs; traffic spread evenly over peers)."""
        if ep <= 1:
            return 0.0
        inside = min(ep, cluster.nvlink_domain)
        return (ep - inside) / (ep - 1)

    def seconds(self, nbytes: float, cluster: Cluster, ep: int, transport: str = "collective") -> float:
        share = self.inter_share(cluster, ep)
        if transport == "copy_engine" and share > 0:
            raise LinkError(
                f"transport copy_engine with EP={ep} > NVLink domain {cluster.nvlink_domain} on {cluster.name}: "
                "symmetric-memory pulls need every EP peer on NVLink; use transport collective or EP <= domain"
            )
        intra = nbytes * (1 - share) / (cluster.gpu.nvlink_gbps * 1e9 * self.efficiency)
        inter = nbytes * share / (cluster.nic_gbps * 1e9 * self.efficiency)
        return max(intra, inter)  # both paths run at once
