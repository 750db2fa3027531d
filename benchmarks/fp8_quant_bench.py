"""Native FP8 (``--mok-expert-backend torch-fp8``) on one H200 (issue 5): quantization kernels, layer time.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/fp8_quant_bench.py --out $OUT          (about 60 s)

Per shape, layers (2) run before kernels (1); the files are rewritten after each, so a run cut short keeps
what finished.

1. Kernels (``kernels.fp8_quant``) on the operands of the DeepSeek-V3 slice and Qwen3-30B-A3B layers (P
   padded rows = routed rows + 15 per expert): each checked bitwise against its torch reference on the
   timed input first, then timed (CUDA events, median of 20). GB/s counts the minimum traffic (input read
   once + q and scales written); the segment kernels read their input twice (amax pass, cast pass), the
   two-pass rowwise kernel (rows wider than 8192) too. ``ref_ms`` is the torch reference (the path before
   the kernels; 2 runs).
2. Layer fwd+bwd medians (10 after 3 warm-up), same weights and input: ``bf16`` (MoK's torch backend),
   ``torch-fp8`` (weights quantized once and reused: gradient accumulation / steady state without an
   optimizer), ``torch-fp8-requant`` (the weight cache dropped every step: one micro-batch per optimizer
   step, what a training step pays). Expert TFLOP/s = 3 GEMMs x fwd+dgrad+wgrad.
3. Profile: the top CUDA kernels of two torch-fp8 fwd+bwd steps per shape (``fp8_profile_<shape>.txt``).
Writes fp8_quant_bench.json / .txt to --out and prints the text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
SHAPE_NAMES = ("deepseek-v3-ep32", "qwen3-30b-a3b")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: --smoke (TRITON_INTERPRET=1)


def _median_ms(fn, iters: int, warmup: int = 2) -> float:
    from mok_megatron.bench.layer import time_steps

    return 1e3 * statistics.median(time_steps(fn, iters, warmup))


def _offsets(rows: int, groups: int, device) -> torch.Tensor:
    """Even split of ``rows`` (a multiple of 16) into ``groups`` segments of multiples of 16."""
    base = rows // groups // 16 * 16
    counts = [base] * groups
    counts[-1] += rows - base * groups
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def kernel_cases(shape: dict) -> list[tuple[str, str, tuple, int]]:
    """(name, kind, shape, groups): the quantizations one torch-fp8 layer step runs."""
    h, f, e, rows = shape["hidden"], shape["ffn"], shape["experts"], shape["tokens"] * shape["topk"]
    p = (rows + 15 * e + 15) // 16 * 16
    return [
        ("x / dy_fc2 rowwise [P,H]", "rowwise", (p, h), 0),
        ("a rowwise [P,F]", "rowwise", (p, f), 0),
        ("dh rowwise [P,2F]", "rowwise", (p, 2 * f), 0),
        ("x segments^T [P,H]", "segments", (p, h), e),
        ("dh segments^T [P,2F]", "segments", (p, 2 * f), e),
        ("a segments^T [P,F]", "segments", (p, f), e),
        ("w1 rowwise [E,2F,H]", "rowwise", (e, 2 * f, h), 0),
        ("w1 transposed [E,2F,H]", "weight_t", (e, 2 * f, h), 0),
        ("w2 transposed [E,H,F]", "weight_t", (e, h, f), 0),
    ]


def bench_kernels(shape: dict, device) -> dict:
    from mok_megatron.kernels import Impl
    from mok_megatron.kernels import fp8_quant as Q

    rows = {}
    for name, kind, dims, groups in kernel_cases(shape):
        try:
            x = torch.randn(*dims, device=device, dtype=torch.bfloat16)
            if kind == "rowwise":
                fn = lambda impl, x=x: Q.quantize_rowwise(x, impl)  # noqa: E731
            elif kind == "segments":
                offs = _offsets(dims[0], groups, device)
                fn = lambda impl, x=x, offs=offs: Q.quantize_segments_t(x, offs, impl)  # noqa: E731
            else:
                fn = lambda impl, x=x: Q.quantize_weight_t(x, impl)  # noqa: E731
            (q, s), (q_ref, s_ref) = fn(Impl.TRITON), fn(Impl.TORCH)
            bitwise = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
            del q_ref, s_ref
            ms = _median_ms(lambda fn=fn: fn(Impl.TRITON), 20)
            ref_ms = _median_ms(lambda fn=fn: fn(Impl.TORCH), 2, 1)
            nbytes = x.numel() * (x.element_size() + 1) + s.numel() * 4
            rows[name] = dict(bitwise=bitwise, ms=ms, gbs=nbytes / ms / 1e6, ref_ms=ref_ms)
            del x, q, s
        except Exception as e:
            rows[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1200:]}
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_layers(shape_name: str) -> dict:
    from fp8_h200 import build_layer_sharing_weights, fwd_bwd, layer_config

    from mok_megatron.bench.layer import SHAPES
    from mok_megatron.ops import fp8_grouped_gemm as native

    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g).to(DEV, torch.bfloat16)
    dout = (torch.randn(shape["tokens"], 1, shape["hidden"], generator=g) * 1e-2).to(DEV, torch.bfloat16)
    flops = 3 * 2 * shape["tokens"] * shape["topk"] * 3 * shape["hidden"] * shape["ffn"]
    rows, state = {}, None
    for name, backend, requant in (
        ("bf16", "torch", False),
        ("torch-fp8", "torch-fp8", False),
        ("torch-fp8-requant", "torch-fp8", True),
    ):
        try:
            cfg = layer_config(shape, None)
            layer, state = build_layer_sharing_weights(backend, cfg, state)

            def step(layer=layer, cfg=cfg, requant=requant):
                if requant:
                    native.invalidate_weight_cache()
                layer.zero_grad(set_to_none=True)
                return fwd_bwd(layer, cfg, x, dout)

            ms = _median_ms(step, 10, 3)
            out, dx = step()
            rows[name] = dict(ms=ms, tflops=flops / ms / 1e9, out=out.detach().float(), dx=dx.float())
            if name == "torch-fp8":
                rows["profile"] = profile(step, shape_name)
            del layer
        except Exception as e:
            rows[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    ref = rows.get("bf16", {})
    for r in rows.values():
        if isinstance(r, dict) and "out" in r:
            if "out" in ref:
                r["rel_out"] = _rel(r["out"], ref["out"])
                r["rel_dx"] = _rel(r["dx"], ref["dx"])
            del r["out"], r["dx"]
    return rows


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def profile(step, shape_name: str) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = DEV.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=70)
    path = os.path.join(ARGS.out, f"fp8_profile_{shape_name}.txt")
    with open(path, "w") as f:
        f.write(table)
    return path


def summary(rep: dict) -> str:
    lines = [f"device: {rep['device']}  torch {rep['torch']}"]
    for shape_name, r in rep["shapes"].items():
        lines.append(f"{shape_name}: quantization kernels (min-traffic GB/s; bitwise vs torch reference)")
        for name, k in r["kernels"].items():
            if "ms" in k:
                lines.append(
                    f"  {name:<26} {k['ms']:7.3f} ms {k['gbs']:7.0f} GB/s  bitwise={k['bitwise']}  "
                    f"torch ref {k['ref_ms']:8.2f} ms"
                )
            else:
                lines.append(f"  {name:<26} {k['error']}")
        lines.append(f"{shape_name}: layer fwd+bwd")
        for name, k in r["layer"].items():
            if name == "profile":
                lines.append(f"  profile of torch-fp8: {k}")
            elif "ms" in k:
                err = (
                    f"  rel err vs bf16 out {k['rel_out']:.4f} dx {k['rel_dx']:.4f}" if "rel_out" in k else ""
                )
                lines.append(f"  {name:<18} {k['ms']:8.2f} ms {k['tflops']:7.1f} TFLOP/s{err}")
            else:
                lines.append(f"  {name:<18} {k['error']}")
    return "\n".join(lines)


ARGS = None


def write(rep: dict) -> str:
    text = summary(rep)
    with open(os.path.join(ARGS.out, "fp8_quant_bench.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    with open(os.path.join(ARGS.out, "fp8_quant_bench.txt"), "w") as f:
        f.write(text + "\n")
    return text


def main(argv=None) -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/mok-fp8-quant"))
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    p.add_argument("--no-layers", action="store_true")
    p.add_argument("--smoke", action="store_true", help="the tiny shape (CPU check of the script)")
    ARGS = p.parse_args(argv)
    os.makedirs(ARGS.out, exist_ok=True)
    if ARGS.smoke:
        ARGS.shapes = "tiny"
    from mok_megatron.bench.layer import SHAPES, _init_single_process

    t0 = time.time()
    _init_single_process()
    device = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu"
    rep = {"device": device, "torch": torch.__version__, "shapes": {}}
    for shape_name in ARGS.shapes.split(","):  # layers first (the numbers); files after each step
        r = rep["shapes"][shape_name] = {"layer": {}, "kernels": {}}
        r["layer"] = {} if ARGS.no_layers else bench_layers(shape_name)
        text = write(rep)
        r["kernels"] = bench_kernels(SHAPES[shape_name], DEV)
        text = write(rep)
    print(text)
    print(f"wall {time.time() - t0:.0f} s; files in {ARGS.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
