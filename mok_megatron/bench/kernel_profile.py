"""One training step under the torch profiler, summarised: GPU-busy ms, kernel launches, host enqueue ms
and the top kernels (on a CPU: no kernels, host ops only). ``mok bench ep --profile --kernels`` prints it;
the header line's format is what ``mok_megatron.tools.planner.measurements`` parses from such outputs.

    print(kernel_summary(step, "qwen3-30b-a3b", wall_ms=9.7))
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_summary(
    step, label: str, wall_ms: float, top: int = 25, width: int = 120, host_ops: int = 0
) -> str:
    """Run ``step`` once to time the host enqueue, once under the profiler; return the summary text
    (``host_ops`` > 0 adds the most frequent aten ops on the host)."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    h0 = time.perf_counter()
    step()
    host_ms = 1e3 * (time.perf_counter() - h0)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    kernels = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    busy_ms = sum(k.self_device_time_total for k in kernels) / 1e3
    launches = sum(k.count for k in kernels)
    lines = [
        f"\n== {label}: wall {wall_ms:.2f} ms | GPU kernels {busy_ms:.2f} ms in {launches} launches"
        f" | host enqueue {host_ms:.2f} ms"
    ]
    for k in sorted(kernels, key=lambda k: -k.self_device_time_total)[:top]:
        lines.append(f"   {k.self_device_time_total / 1e3:8.3f} ms x{k.count:4d}  {k.key[:width]}")
    if host_ops:
        cpu = [k for k in prof.key_averages() if k.device_type.name == "CPU" and k.key.startswith("aten::")]
        lines.append("   top host ops (count, self CPU ms):")
        for k in sorted(cpu, key=lambda k: -k.count)[:host_ops]:
            lines.append(f"   x{k.count:4d} {k.self_cpu_time_total / 1e3:7.2f} ms  {k.key}")
    return "\n".join(lines)
