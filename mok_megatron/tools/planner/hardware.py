"""GPUs and clusters as data, each number with its source.

Peak FLOP/s are dense (no 2:4 sparsity). Datasheets that quote sparse figures were halved; the source
string says so. Link bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s).
These are vendor peak numbers, not measurements; the planner scales measured H200 times by them.
"""

from __future__ import annotations

from dataclasses import dataclass


class HardwareError(ValueError):
    """An unknown or inconsistent GPU/cluster; the message names the value and the fix."""


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    mxfp8_tflops: float | None  # None: no MX block-scaled FP8 in hardware (Hopper)
    hbm_tbps: float
    hbm_gb: float
    nvlink_gbps: float  # per direction
    source: str

    def __post_init__(self):
        for f in ("bf16_tflops", "fp8_tflops", "hbm_tbps", "hbm_gb", "nvlink_gbps"):
            if getattr(self, f) <= 0:
                raise HardwareError(f"GPU {self.name}: {f}={getattr(self, f)} must be > 0")

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for the GEMM precision: bf16, fp8 (per-tensor/blockwise/rowwise) or mxfp8."""
        if precision == "bf16":
            return self.bf16_tflops
        if precision == "fp8":
            return self.fp8_tflops
        if precision == "mxfp8":
            if self.mxfp8_tflops is None:
                raise HardwareError(
                    f"precision mxfp8 on {self.name}: MXFP8 needs Blackwell (sm_100+); use fp8 (blockwise) or bf16"
                )
            return self.mxfp8_tflops
        raise HardwareError(f"precision {precision!r}: must be one of bf16, fp8, mxfp8")


_NV = "NVIDIA datasheet"
GPUS = {
    "H100": GPU(
        "H100", 989.4, 1978.9, None, 3.35, 80, 450, f"{_NV}: H100 SXM5 (NVLink 4, 900 GB/s bidirectional)"
    ),
    "H200": GPU(
        "H200", 989.4, 1978.9, None, 4.8, 141, 450, f"{_NV}: H200 SXM (NVLink 4, 900 GB/s bidirectional)"
    ),
    "B200": GPU(
        "B200",
        2250,
        4500,
        4500,
        8.0,
        180,
        900,
        f"{_NV}: HGX/DGX B200 (sparse FP8 9 PF halved; NVLink 5 1.8 TB/s bidir.)",
    ),
    "GB200": GPU(
        "GB200",
        2500,
        5000,
        5000,
        8.0,
        186,
        900,
        f"{_NV}: GB200 NVL72, per GPU = rack / 72, sparse figures halved",
    ),
    "GB300": GPU(
        "GB300",
        2500,
        5000,
        5000,
        8.0,
        288,
        900,
        f"{_NV}: GB300 NVL72, per GPU = rack / 72, sparse figures halved",
    ),
}


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    nvlink_domain: int  # GPUs that reach each other over NVLink
    nic_gbps: float  # scale-out bandwidth per GPU per direction
    source: str

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nvlink_domain < 1 or self.nic_gbps <= 0:
            raise HardwareError(
                f"cluster {self.name}: gpus_per_node, nvlink_domain and nic_gbps must be positive"
            )
        if self.nvlink_domain % self.gpus_per_node and self.gpus_per_node % self.nvlink_domain:
            raise HardwareError(
                f"cluster {self.name}: NVLink domain {self.nvlink_domain} and {self.gpus_per_node} GPUs per node "
                "must divide one another"
            )


_CX7 = "ConnectX-7 400 Gb/s per GPU = 50 GB/s"
CLUSTERS = {
    "h100-ib": Cluster("h100-ib", GPUS["H100"], 8, 8, 50, f"HGX H100 8-GPU NVLink node, {_CX7}"),
    "h200-nvl8": Cluster("h200-nvl8", GPUS["H200"], 8, 8, 50, f"HGX H200 8-GPU NVLink node, {_CX7}"),
    "h200-x2": Cluster("h200-x2", GPUS["H200"], 2, 2, 50, "the 2 x H200 of docs/results (NVLink, 18 links)"),
    "b200-nvl8": Cluster("b200-nvl8", GPUS["B200"], 8, 8, 50, f"HGX B200 8-GPU NVLink node, {_CX7}"),
    "gb200-nvl72": Cluster(
        "gb200-nvl72", GPUS["GB200"], 4, 72, 50, f"GB200 NVL72 rack (4 GPUs per tray), {_CX7}"
    ),
    "gb300-nvl72": Cluster(
        "gb300-nvl72",
        GPUS["GB300"],
        4,
        72,
        100,
        "GB300 NVL72 rack (4 GPUs per tray), ConnectX-8 800 Gb/s = 100 GB/s",
    ),
}


def cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise HardwareError(f"cluster {name!r}: unknown; choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


# The cluster a recipe's GPU= line stands for (``mok recipe check`` reads the same line for its HBM).
GPU_CLUSTERS = {
    "GB300": "gb300-nvl72",
    "GB200": "gb200-nvl72",
    "B200": "b200-nvl8",
    "H200": "h200-nvl8",
    "H100": "h100-ib",
}


def cluster_for_gpu(gpu: str) -> Cluster:
    """The cluster of a recipe's ``GPU=`` value (GB300, H200, ...)."""
    if gpu not in GPU_CLUSTERS:
        raise HardwareError(
            f"GPU {gpu!r}: unknown; set GPU= in the recipe to one of {', '.join(GPU_CLUSTERS)}"
        )
    return cluster(GPU_CLUSTERS[gpu])
