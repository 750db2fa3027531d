"""What the GPU's clocks did while something ran: ``nvidia-smi`` sampled in the background.

A benchmark on a power-capped GPU measures the power cap as much as the code: on the H200 (700 W) the
DeepSeek-V3 expert GEMMs run at 1,100-1,550 MHz SM clock with the software power cap active, against a
1,980 MHz maximum (``docs/results/2026-12-01-layer/clocks``). ``mok bench layer`` records, per
implementation, the median SM clock, the power draw and the clock-event reasons seen while it was timed,
so a table says which rows ran throttled.

    with ClockSampler() as clocks:        # no nvidia-smi (CPU, other vendors): clocks.available is False
        t0 = time.time(); run(); t1 = time.time()
    clocks.summary(t0, t1)                # after the block: {"sm_mhz", "power_w", "events", "samples", ...} or None

Samples are placed by nvidia-smi's own timestamps, so a window's summary is complete once the sampler
has closed (it waits one sampling period before stopping nvidia-smi).
"""

from __future__ import annotations

import os
import pty
import shutil
import statistics
import subprocess
import threading
import time

# nvidia-smi's own timestamp: its output to a pipe arrives in bursts, so the time a line is read is not
# the time it was sampled
QUERY = "timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
# NVML clock-event (throttle) reason bits; GpuIdle (0x1) is left out: it is not a slowdown of running work
EVENT_REASONS = {
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}


def decode_reasons(mask: int) -> list[str]:
    """Names of the slowdown reasons set in an NVML clock-event bitmask (idle left out)."""
    return [name for bit, name in EVENT_REASONS.items() if mask & bit]


def parse_line(line: str) -> tuple | None:
    """(epoch seconds, sm MHz, max sm MHz, W, W limit, reasons mask) from one ``--format=csv,noheader,nounits``
    line (its timestamp is this machine's local time), or None for a line that is not a sample (a header,
    an error message, '[N/A]' fields)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 6:
        return None
    try:
        stamp, frac = (parts[0].split(".") + ["0"])[:2]
        when = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        sm, sm_max, watts, limit = (float(p) for p in parts[1:5])
        mask = int(parts[5], 16)
    except ValueError:
        return None
    return (when, sm, sm_max, watts, limit, mask)


class ClockSampler:
    """Runs ``nvidia-smi --query-gpu=... -lms <period>`` for one GPU while the context is open."""

    def __init__(self, device_index: int = 0, period_ms: int = 100, command: list[str] | None = None):
        self.samples: list[tuple] = []
        self.error: str | None = None
        self.period_ms = period_ms
        self._proc = None
        exe = shutil.which("nvidia-smi") if command is None else command[0]
        if exe is None:
            self.error = "nvidia-smi not found"
            return
        self._cmd = command or [
            exe,
            f"--query-gpu={QUERY}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(period_ms),
            "-i",
            str(device_index),
        ]

    @property
    def available(self) -> bool:
        return self.error is None

    def __enter__(self) -> ClockSampler:
        if self.error is None:
            # a pseudo-terminal for its stdout: nvidia-smi then writes each sample as a line; into a pipe its
            # output is block-buffered and arrives seconds late, in bursts
            master, slave = pty.openpty()
            try:
                self._proc = subprocess.Popen(self._cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
            except OSError as e:
                os.close(master)
                self.error = f"nvidia-smi did not start: {e}"
                return self
            finally:
                os.close(slave)
            self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
            self._reader.start()
        return self

    def _read(self, fd: int) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the other end closed (EIO on Linux)
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                sample = parse_line(line)
                if sample is not None:
                    self.samples.append(sample)
                elif not self.samples and self.error is None and line:
                    self.error = f"nvidia-smi: {line[:200]}"
        os.close(fd)

    def __exit__(self, *exc) -> None:
        """Waits one more sampling period (the last window's samples), then stops nvidia-smi; read the
        summaries after this."""
        if self._proc is not None:
            time.sleep(2 * self.period_ms / 1e3)
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)

    def summary(self, t0: float, t1: float) -> dict | None:
        """Median SM clock and power, the slowdown reasons seen, between wall times t0 and t1; None
        without samples there (no nvidia-smi, or a window shorter than the sampling period)."""
        window = [s for s in self.samples if t0 <= s[0] <= t1]
        if not window:
            return None
        mask = 0
        for s in window:
            mask |= s[5]
        return {
            "sm_mhz": statistics.median(s[1] for s in window),
            "sm_max_mhz": max(s[2] for s in window),
            "power_w": statistics.median(s[3] for s in window),
            "power_limit_w": max(s[4] for s in window),
            "events": decode_reasons(mask),
            "samples": len(window),
        }


def format_summary(s: dict | None) -> str:
    """'1,545 / 1,980 MHz, 412 W of 700, software power cap' (or 'n/a')."""
    if s is None:
        return "n/a"
    events = ", ".join(s["events"]) or "no slowdown"
    return (
        f"{s['sm_mhz']:,.0f} / {s['sm_max_mhz']:,.0f} MHz, {s['power_w']:,.0f} W of "
        f"{s['power_limit_w']:,.0f}, {events}"
    )
