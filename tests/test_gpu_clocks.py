"""``gpu_clocks``: nvidia-smi lines parsed, slowdown reasons named, the background sampler's window summary
(driven by a stand-in command that prints nvidia-smi's format), and ``bench_bound``'s floor on CPU."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from mok_megatron.bench.bound import gemm_bound
from mok_megatron.bench.clocks import ClockSampler, decode_reasons, format_summary, parse_line


def _stamp(t: float) -> str:  # nvidia-smi's timestamp format, local time
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


NOW = time.time()
LINES = [
    f"{_stamp(NOW + 0.1)}, 1980, 1980, 150.10, 700.00, 0x0000000000000000",
    f"{_stamp(NOW + 0.2)}, 1545, 1980, 612.40, 700.00, 0x0000000000000004",
    f"{_stamp(NOW + 0.3)}, 1425, 1980, 696.00, 700.00, 0x0000000000000004",
]


def _fake_smi(lines: list[str], delay: float = 0.05) -> list[str]:
    script = f"import time\nfor l in {lines!r}:\n    print(l, flush=True)\n    time.sleep({delay})\ntime.sleep(30)\n"
    return [sys.executable, "-c", script]


def test_parse_line_and_reasons():
    when, *rest = parse_line(LINES[1])
    assert when == pytest.approx(NOW + 0.2, abs=2e-3) and rest == [1545.0, 1980.0, 612.4, 700.0, 4]
    assert parse_line("2026/12/01 09:30:12, 1980, 1980, 1.0, 700, 0x0")[1:] == (1980.0, 1980.0, 1.0, 700.0, 0)
    for bad in (
        "timestamp, clocks.sm [MHz], clocks.max.sm [MHz], power.draw [W], power.limit [W], x",
        f"{_stamp(NOW)}, [N/A], 1980, 1.0, 700, 0x0",
        "No devices were found",
    ):
        assert parse_line(bad) is None
    assert decode_reasons(0x1 | 0x4 | 0x40) == ["software power cap", "hardware thermal slowdown"]
    assert decode_reasons(0x1) == []  # idle is not a slowdown


def test_sampler_summarises_its_window():
    with ClockSampler(command=_fake_smi(LINES)) as clocks:
        deadline = time.time() + 20
        while len(clocks.samples) < 3 and time.time() < deadline:
            time.sleep(0.02)
    s = clocks.summary(NOW, NOW + 1)  # by nvidia-smi's timestamps, not by when the lines were read
    assert s == {
        "sm_mhz": 1545.0,
        "sm_max_mhz": 1980.0,
        "power_w": 612.4,
        "power_limit_w": 700.0,
        "events": ["software power cap"],
        "samples": 3,
    }
    assert format_summary(s) == "1,545 / 1,980 MHz, 612 W of 700, software power cap"
    assert clocks.summary(NOW + 0.15, NOW + 0.25)["samples"] == 1
    assert clocks.summary(0.0, NOW) is None and format_summary(None) == "n/a"


def test_sampler_reports_nvidia_smi_errors():
    with ClockSampler(
        command=_fake_smi(['Field "clocks_event_reasons.active" is not a valid field to query.'])
    ) as c:
        deadline = time.time() + 20
        while c.error is None and time.time() < deadline:
            time.sleep(0.02)
    assert c.error.startswith("nvidia-smi: Field") and c.summary(0, time.time()) is None
    missing = ClockSampler(command=["/nonexistent/nvidia-smi"])
    with missing:
        pass
    assert not missing.available and "did not start" in missing.error


def test_gemm_bound_on_cpu():
    shape = {"experts": 4, "hidden": 32, "ffn": 16}
    t = gemm_bound(shape, [5, 0, 11, 8], torch.float32, torch.device("cpu"), iters=2, warmup=1)
    assert set(t) == {"fwd", "bwd", "fwd_bwd", "steady"} and all(v["ms"] > 0 for v in t.values())
    with pytest.raises(ValueError, match="3 row counts for 4 experts"):
        gemm_bound(shape, [5, 0, 11], torch.float32, torch.device("cpu"), iters=1, warmup=0)
