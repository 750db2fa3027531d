"""The profile summary shared by benchmarks/profile_*.py: header format (parsed by the planner) and content."""

import re

import torch

from mok_megatron.bench.kernel_profile import kernel_summary


def test_kernel_summary_header_and_host_ops():
    a = torch.randn(64, 64)
    calls = []

    def step():
        calls.append(1)
        (a @ a).relu_()

    text = kernel_summary(step, "tiny-shape", wall_ms=1.5, host_ops=5)
    assert len(calls) == 2  # one timed enqueue, one profiled
    header = text.strip().splitlines()[0]
    m = re.match(
        r"== (\S+): wall ([\d.]+) ms \| GPU kernels ([\d.]+) ms in (\d+) launches \| host enqueue ([\d.]+) ms",
        header,
    )
    assert m and m.group(1) == "tiny-shape" and float(m.group(2)) == 1.5, header
    if not torch.cuda.is_available():
        assert float(m.group(3)) == 0.0 and int(m.group(4)) == 0
    assert "aten::mm" in text and "top host ops" in text
