"""What bounds one MoK layer (EP=1) on this GPU: GPU idle gaps in a synced step, the grouped GEMMs alone
back to back, and the SM clock / power / throttle reasons while each runs.

For each shape and expert backend (bf16 ``torch``, native FP8 ``torch-fp8``):
- ``synced`` / ``back to back``: as ``mok bench layer`` (median of 20 after 3 warm-up);
- ``gemms only``: the layer's six expert GEMMs alone (same shapes, uniform rows per expert), back to back,
  median of 20: a lower bound for the layer at the clocks it runs at;
- ``timeline``: one synced step under the profiler: GPU busy ms, idle ms inside the step, the largest idle
  gaps and the kernel that ends each (the host was launching it);
- clocks: ``nvidia-smi`` sampled every 100 ms in the background; per phase the median SM clock, power draw
  and the active clock-event reasons (throttling) seen.

    python benchmarks/layer_limits_probe.py [shape ...]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench import SHAPES, _config, _init_single_process, build, time_steps  # noqa: E402

DGRAD_DEFAULT = 2048
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Clocks:
    """nvidia-smi samples (wall time, sm MHz, W, C, reasons bitmask) gathered by a background reader."""

    def __init__(self):
        self.samples: list[tuple[float, float, float, float, int]] = []
        cmd = [
            "nvidia-smi",
            f"--query-gpu={QUERY}",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
            "-i",
            os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        ]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            print(f"nvidia-smi not started: {e}")
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                reasons = int(parts[3], 16) if parts[3].startswith("0x") else 0
                self.samples.append((time.time(), float(parts[0]), float(parts[1]), float(parts[2]), reasons))
            except (ValueError, IndexError):
                if len(self.samples) == 0:
                    print(f"nvidia-smi: {line.strip()}")

    def window(self, t0: float, t1: float) -> str:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return "no clock samples"
        reasons = 0
        for x in s:
            reasons |= x[4]
        return (
            f"sm {statistics.median(x[1] for x in s):.0f} MHz (min {min(x[1] for x in s):.0f}), "
            f"{statistics.median(x[2] for x in s):.0f} W (max {max(x[2] for x in s):.0f}), "
            f"{max(x[3] for x in s):.0f} C, reasons {reasons:#x} over {len(s)} samples"
        )

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()


def timed(clocks, label, step, iters=20, warmup=3):
    t0 = time.time()
    ms = 1e3 * statistics.median(time_steps(step, iters, warmup))
    print(f"   {label:<28s} {ms:8.3f} ms | {clocks.window(t0, time.time())}")
    return ms


def back_to_back(step, iters=20, warmup=3):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def timeline(step, top=8):
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("STEP"):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    cpu_step = [e for e in events if e.name == "STEP" and e.device_type.name == "CPU"][0]
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t_start = cpu_step.time_range.start
    busy = 0.0
    gaps = []
    last_end = t_start
    for k in kernels:
        s, e = k.time_range.start, k.time_range.end
        if s > last_end:
            gaps.append((s - last_end, last_end - t_start, k.name))
        busy += max(0.0, e - max(s, last_end))
        last_end = max(last_end, e)
    span = last_end - t_start
    idle = sum(g[0] for g in gaps)
    lines = [
        f"   timeline: step {span / 1e3:.3f} ms = GPU busy {busy / 1e3:.3f} + idle {idle / 1e3:.3f} ms "
        f"({len(kernels)} kernels, host step {cpu_step.time_range.elapsed_us() / 1e3:.3f} ms)"
    ]
    for g, at, name in sorted(gaps, reverse=True)[:top]:
        lines.append(f"      idle {g:7.1f} us at {at / 1e3:6.3f} ms, then {name[:90]}")
    return "\n".join(lines)


def gemms_only(s, fp8: bool):
    """The six expert GEMMs of the layer alone (uniform rows per expert)."""
    dev = "cuda"
    e, h, f, rows = s["experts"], s["hidden"], s["ffn"], s["tokens"] * s["topk"]
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (rows // e)
    bf = torch.bfloat16
    x, w1, w2 = (
        torch.randn(rows, h, device=dev, dtype=bf),
        torch.randn(e, 2 * f, h, device=dev, dtype=bf),
        torch.randn(e, h, f, device=dev, dtype=bf),
    )
    a, dy = torch.randn(rows, f, device=dev, dtype=bf), torch.randn(rows, h, device=dev, dtype=bf)
    dh = torch.randn(rows, 2 * f, device=dev, dtype=bf)
    if not fp8:

        def step():
            torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
            torch._grouped_mm(dy, w2, offs=offs)
            torch._grouped_mm(dh, w1, offs=offs)
            torch._grouped_mm(dy.t(), a, offs=offs)
            torch._grouped_mm(dh.t(), x, offs=offs)

        return step
    from mok_megatron.fp8 import native

    q = {k: native.quantize_rowwise(v) for k, v in dict(x=x, a=a, dy=dy, dh=dh).items()}
    qt = {k: native.quantize_segments_t(v, offs) for k, v in dict(x=x, a=a, dy=dy, dh=dh).items()}
    w1f, w2f = native.quantized_weight(w1, "fwd"), native.quantized_weight(w2, "fwd")
    w1d, w2d = native.quantized_weight(w1, "dgrad"), native.quantized_weight(w2, "dgrad")
    fast_d1, fast_d2 = native._dgrad_fast(w1), native._dgrad_fast(w2)
    wgrad_fp8 = native._wgrad_fp8(rows, w1)
    g = native._gemm

    def step():
        g(q["x"][0], w1f[0].transpose(-2, -1), q["x"][1], w1f[1], offs, True)
        g(q["a"][0], w2f[0].transpose(-2, -1), q["a"][1], w2f[1], offs, True)
        g(q["dy"][0], w2d[0].transpose(-2, -1), q["dy"][1], w2d[1], offs, fast_d2)
        g(q["dh"][0], w1d[0].transpose(-2, -1), q["dh"][1], w1d[1], offs, fast_d1)
        if wgrad_fp8:
            g(qt["dy"][0], qt["a"][0].t(), qt["dy"][1].reshape(-1), qt["a"][1].reshape(-1), offs, False)
            g(qt["dh"][0], qt["x"][0].t(), qt["dh"][1].reshape(-1), qt["x"][1].reshape(-1), offs, False)
        else:
            torch._grouped_mm(dy.t(), a, offs=offs)
            torch._grouped_mm(dh.t(), x, offs=offs)

    return step


def main():
    _init_single_process()
    clocks = Clocks()
    time.sleep(0.5)
    names = sys.argv[1:] or ["qwen3-30b-a3b", "deepseek-v3-ep32"]
    for name in names:
        s = SHAPES[name]
        flops = 3 * 2 * s["tokens"] * s["topk"] * 3 * s["hidden"] * s["ffn"]
        ref = {}
        for backend in ("torch", "torch-fp8", "torch-fp8 dgrad-fast"):
            from mok_megatron.fp8 import native

            native.DGRAD_FAST_ACCUM_MAX_N = (1 << 30) if backend.endswith("dgrad-fast") else DGRAD_DEFAULT
            torch.manual_seed(0)
            cfg = _config(s, torch.bfloat16)
            if backend == "torch":
                layer = build("mok", cfg).cuda()
                state = {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
            else:
                from mok_megatron.fp8.layers import build_mok_layer

                layer = build_mok_layer("torch-fp8", cfg).cuda()
                layer.load_state_dict(
                    state, strict=False
                )  # the bf16 layer's weights: errors compare like with like
            gen = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(s["tokens"], 1, s["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
            dout = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            xin = x.detach().requires_grad_(True)
            out, _ = layer(xin)
            out.backward(dout)
            got = {
                "out": out.detach().float(),
                "dx": xin.grad.float(),
                "dw1": layer.experts.fc1_weight.grad.float(),
            }
            if backend == "torch":
                ref = got
            err = ", ".join(f"{k} {((got[k] - ref[k]).norm() / ref[k].norm()).item():.2e}" for k in got)

            def step(layer=layer, x=x, dout=dout):
                layer.zero_grad(set_to_none=True)
                out, _ = layer(x.detach().requires_grad_(True))
                out.backward(dout)

            print(f"== {name} [{backend}] (expert FLOPs {flops / 1e12:.2f} T) rel err vs bf16: {err}")
            ms = timed(clocks, "layer synced", step)
            t0 = time.time()
            b2b = back_to_back(step)
            print(f"   {'layer back to back':<28s} {b2b:8.3f} ms | {clocks.window(t0, time.time())}")
            t0 = time.time()
            gem = gemms_only(s, backend != "torch")
            g_ms = back_to_back(gem)
            print(
                f"   {'gemms only back to back':<28s} {g_ms:8.3f} ms ({flops / g_ms / 1e9:.0f} TFLOP/s) | "
                f"{clocks.window(t0, time.time())}"
            )
            t0 = time.time()
            g_sy = 1e3 * statistics.median(time_steps(gem, 20, 3))
            print(f"   {'gemms only synced':<28s} {g_sy:8.3f} ms | {clocks.window(t0, time.time())}")
            print(
                f"   layer synced {ms:.3f} ms = gemms {g_sy:.3f} + rest {ms - g_sy:.3f}; "
                f"back to back {b2b:.3f} = gemms {g_ms:.3f} + rest {b2b - g_ms:.3f}"
            )
            print(timeline(step))
            del layer, gem
            torch.cuda.empty_cache()
    clocks.stop()


if __name__ == "__main__":
    main()
