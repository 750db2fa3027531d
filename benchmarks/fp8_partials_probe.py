"""The one-pass rowwise quantization that also keeps 16-row block column amaxes
(``kernels.fp8_quant.quantize_rowwise_partials``) against the plain rowwise pass plus the separate amax
pass it replaces, on the DeepSeek-V3 slice's four wgrad operands (bf16, one GPU, median of 30 calls).

    python benchmarks/fp8_partials_probe.py
"""

from __future__ import annotations

import statistics

import torch

import mok_megatron.kernels.fp8_quant as Q
from mok_megatron.bench.layer import time_steps


def _ms(fn):
    return statistics.median(time_steps(fn, 30, 3)) * 1e3


for name, (m, k) in {
    "x": (32768, 7168),
    "dy2": (32768, 7168),
    "dh": (32768, 4096),
    "act": (32768, 2048),
}.items():
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, 9, device="cuda", dtype=torch.int32) * (m // 8)
    _, _, p = Q.quantize_rowwise_partials(x)
    rowwise = _ms(lambda x=x: Q.quantize_rowwise(x))
    partials = _ms(lambda x=x: Q.quantize_rowwise_partials(x))
    seg = _ms(lambda x=x, offs=offs: Q.quantize_segments_t(x, offs))
    seg_p = _ms(lambda x=x, offs=offs, p=p: Q.quantize_segments_t(x, offs, partials=p))
    print(
        f"{name} [{m}, {k}]: rowwise {rowwise:.3f} + segments {seg:.3f} = {rowwise + seg:.3f} ms | "
        f"rowwise+partials {partials:.3f} + segments from partials {seg_p:.3f} = {partials + seg_p:.3f} ms"
    )
