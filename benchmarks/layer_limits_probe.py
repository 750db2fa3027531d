"""What bounds one MoK layer (EP=1) on this GPU: GPU idle gaps in a synced step, the grouped GEMMs alone
back to back, and the SM clock / power / throttle reasons while each runs.

For each shape and expert backend (bf16 ``torch``, native FP8 ``torch-fp8``):
- ``synced`` / ``back to back``: as ``mok bench layer`` (median of 20 after 3 warm-up);
- ``gemms only``: the layer's six expert GEMMs alone (same shapes, uniform rows per expert), back to back,
  median of 20: a lower bound for the layer at the clocks it runs at;
- ``timeline``: one synced step under the profiler: GPU busy ms, idle ms inside the step, the largest idle
  gaps and the kernel that ends each (the host was launching it);
- clocks (``mok_megatron.bench.clocks``, printed at the end): per phase the median SM clock, power draw and
  the clock-event reasons (throttling) seen. (s7a/s7b ran an earlier reader that placed samples by the
  time their piped output arrived: indicative only.)

    python benchmarks/layer_limits_probe.py [shape ...]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import SHAPES, _config, _init_single_process, build, time_steps  # noqa: E402
from mok_megatron.bench.bound import gemm_steps  # noqa: E402
from mok_megatron.bench.clocks import ClockSampler, format_summary  # noqa: E402

DGRAD_DEFAULT = 2048
WINDOWS: list[tuple[str, float, float]] = []  # (label, t0, t1) of each timed phase, for the clock summary


def timed(label, step, iters=20, warmup=3):
    t0 = time.time()
    ms = 1e3 * statistics.median(time_steps(step, iters, warmup))
    WINDOWS.append((label, t0, time.time()))
    print(f"   {label:<28s} {ms:8.3f} ms")
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
    e, rows = s["experts"], s["tokens"] * s["topk"]
    if not fp8:  # the same six calls as `mok bench layer`'s floor row
        forward, backward = gemm_steps(s, [rows // e] * e, torch.bfloat16, torch.device("cuda"))
        return lambda: backward(forward())
    dev = "cuda"
    h, f = s["hidden"], s["ffn"]
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (rows // e)
    bf = torch.bfloat16
    x, w1, w2 = (
        torch.randn(rows, h, device=dev, dtype=bf),
        torch.randn(e, 2 * f, h, device=dev, dtype=bf),
        torch.randn(e, h, f, device=dev, dtype=bf),
    )
    a, dy = torch.randn(rows, f, device=dev, dtype=bf), torch.randn(rows, h, device=dev, dtype=bf)
    dh = torch.randn(rows, 2 * f, device=dev, dtype=bf)
    from mok_megatron.ops import fp8_grouped_gemm as native

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
    with ClockSampler() as clocks:
        _run(sys.argv[1:] or ["qwen3-30b-a3b", "deepseek-v3-ep32"])
    print("== GPU while timed (median SM clock / max, power of limit, slowdown reasons):")
    for label, t0, t1 in WINDOWS:
        print(f"   {label:<60s} {format_summary(clocks.summary(t0, t1))}")


def _run(names):
    for name in names:
        s = SHAPES[name]
        flops = 3 * 2 * s["tokens"] * s["topk"] * 3 * s["hidden"] * s["ffn"]
        ref = {}
        # "unfused": the EP=1 FP8 layer without the permute / combine fused into the experts' FP8 operands
        # (the path before session 8); the fused one runs before and after it (clock drift shows).
        for backend in ("torch", "torch-fp8", "torch-fp8 unfused", "torch-fp8 again"):
            from mok_megatron.ops import fp8_grouped_gemm as native

            native.DGRAD_FAST_ACCUM_MAX_N = (1 << 30) if backend.endswith("dgrad-fast") else DGRAD_DEFAULT
            torch.manual_seed(0)
            cfg = _config(s, torch.bfloat16)
            if backend == "torch":
                layer = build("mok", cfg).cuda()
                state = {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
            else:
                from mok_megatron.bench.fp8_layers import build_mok_layer

                layer = build_mok_layer("torch-fp8", cfg).cuda()
                layer.load_state_dict(
                    state, strict=False
                )  # the bf16 layer's weights: errors compare like with like
                layer.token_dispatcher.fused_experts = not backend.endswith("unfused")
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
            tag = f"{name} [{backend}]"
            ms = timed(f"{tag} layer synced", step)
            t0 = time.time()
            b2b = back_to_back(step)
            WINDOWS.append((f"{tag} layer back to back", t0, time.time()))
            print(f"   {'layer back to back':<28s} {b2b:8.3f} ms")
            gem = gemms_only(s, backend != "torch")
            t0 = time.time()
            g_ms = back_to_back(gem)
            WINDOWS.append((f"{tag} gemms only back to back", t0, time.time()))
            print(f"   {'gemms only back to back':<28s} {g_ms:8.3f} ms ({flops / g_ms / 1e9:.0f} TFLOP/s)")
            g_sy = timed(f"{tag} gemms only synced", gem)
            print(
                f"   layer synced {ms:.3f} ms = gemms {g_sy:.3f} + rest {ms - g_sy:.3f}; "
                f"back to back {b2b:.3f} = gemms {g_ms:.3f} + rest {b2b - g_ms:.3f}"
            )
            print(timeline(step))
            del layer, gem
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
