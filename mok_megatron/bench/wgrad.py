"""``mok bench wgrad``: the experts' weight gradients of one layer call split into N calls, with and without
accumulation into one fp32 buffer, against one call over all rows.

Legend: R rows of the layer call (tokens x top-k, expert-major), N calls (minibatches), E local experts,
H hidden, F FFN width (fc1 is 2F wide: gate and up).

Why: the overlap engine runs the experts once per minibatch, so a layer's weight gradients arrive in N
pieces. Computed into fresh bf16 tensors and summed (``torch-sum``, what autograd does), N calls pay
N - 1 full-size sums on top of GEMMs that shrank; accumulated in the GEMM's epilogue into one fp32
buffer per weight (``quack-acc``: QuACK's varlen-K grouped GEMM with ``beta = 1``; ``torch-acc``: the
portable path, torch's grouped GEMM then an add into fp32), they cost what their GEMMs cost. The goal:
N = 4 calls accumulated within 5 % of one call over all rows (``one``).

Variants, each timing fc1's and fc2's weight gradients (``dW1 = dy1^T x``, ``dW2 = dy2^T a``) per step,
CUDA events over back-to-back steps, median (min..max):
    torch-one   one ``torch`` grouped GEMM per weight over all R rows (bf16 out)
    torch-sum   N calls, bf16 outs summed per weight
    torch-acc   N calls, each bf16 out added to one fp32 buffer per weight
    quack-one   one QuACK varlen-K GEMM per weight into fp32 (where QuACK runs: sm_90+, ``quack-kernels``)
    quack-acc   N QuACK varlen-K GEMMs accumulating into one fp32 buffer per weight
Before timing, every N-call variant is checked against the fp32 sum of per-call reference products.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

SHAPES = {
    # one EP=32 rank's slice of DeepSeek-V3 (as ``mok bench layer``): 4096 tokens x top-8 over 8 experts
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, experts=8, rows=4096 * 8),
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, rows=16384 * 8),
    "tiny": dict(hidden=64, ffn=32, experts=4, rows=256),
}
VARIANTS = ("torch-one", "torch-sum", "torch-acc", "quack-one", "quack-acc")
GOAL = 1.05  # N accumulating calls / one call over all rows


def _offsets(rows: int, experts: int, device) -> torch.Tensor:
    """Inclusive int32 offsets of ``rows`` spread evenly over ``experts`` (the last takes the rest)."""
    per = rows // experts
    counts = [per] * (experts - 1) + [rows - per * (experts - 1)]
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _quack():
    """QuACK's accumulating GEMM, or the reason it cannot run here."""
    try:
        from quack.gemm_interface import gemm_add_inplace
    except Exception as e:  # ImportError, or the CUTLASS DSL's own load errors
        return None, f"QuACK not importable ({type(e).__name__}: {e}); pip install 'mok-megatron[quack]'"
    if torch.cuda.get_device_capability()[0] < 9:
        return None, "QuACK's grouped GEMMs need sm_90+"
    return gemm_add_inplace, None


def _calls(tensors: dict, calls: int, experts: int, device) -> list[dict]:
    """The layer call's rows cut into ``calls`` contiguous pieces, each expert-major with its own offsets."""
    rows = tensors["x"].shape[0]
    if rows % calls:
        raise ValueError(f"--calls {calls}: must divide the {rows} rows of the shape")
    step = rows // calls
    out = []
    for c in range(calls):
        sl = slice(c * step, (c + 1) * step)
        out.append({k: v[sl] for k, v in tensors.items()} | {"offs": _offsets(step, experts, device)})
    return out


def _torch_wgrad(dy_MN, x_MK, offs_G):
    from mok_megatron.ops.grouped_gemm import _wgrad

    return _wgrad(dy_MN, x_MK, offs_G)


def _pairs(piece: dict):
    """(dy, x) of fc1's and fc2's weight gradients."""
    return ((piece["dy1"], piece["x"]), (piece["dy2"], piece["a"]))


def _variant(name: str, one: dict, pieces: list[dict], bufs, gemm_add):
    """A zero-argument step computing this variant's weight gradients."""
    if name == "torch-one":
        return lambda: [_torch_wgrad(dy, x, one["offs"]) for dy, x in _pairs(one)]
    if name == "torch-sum":

        def step():
            sums = [None, None]
            for p in pieces:
                for i, (dy, x) in enumerate(_pairs(p)):
                    dw = _torch_wgrad(dy, x, p["offs"])
                    sums[i] = dw if sums[i] is None else sums[i] + dw
            return sums

        return step
    if name == "torch-acc":

        def step():
            for p in pieces:
                for i, (dy, x) in enumerate(_pairs(p)):
                    bufs[i].add_(_torch_wgrad(dy, x, p["offs"]))
            return bufs

        return step

    def quack_into(piece):
        cu = torch.cat([piece["offs"].new_zeros(1), piece["offs"]])
        for i, (dy, x) in enumerate(_pairs(piece)):
            gemm_add(dy.t(), x, bufs[i], cu_seqlens_k=cu, tuned=False)

    if name == "quack-one":
        return lambda: quack_into(one) or bufs

    def quack_calls():
        for p in pieces:
            quack_into(p)
        return bufs

    return quack_calls


def _reference(pieces: list[dict]) -> list[torch.Tensor]:
    """fp32 per-call products summed: what every N-call variant must give."""
    out = [None, None]
    for p in pieces:
        for i, (dy, x) in enumerate(_pairs(p)):
            dw = _torch_wgrad(dy.float(), x.float(), p["offs"])
            out[i] = dw if out[i] is None else out[i] + dw
    return out


def bench_wgrad(shape_name: str, calls: int, iters: int, warmup: int, variants=VARIANTS) -> dict:
    from mok_megatron.bench.timing import _timed_back_to_back

    shape = SHAPES[shape_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, h, f, e = shape["rows"], shape["hidden"], shape["ffn"], shape["experts"]

    def rnd(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    tensors = {"x": rnd(rows, h), "dy1": rnd(rows, 2 * f), "a": rnd(rows, f), "dy2": rnd(rows, h)}
    one = tensors | {"offs": _offsets(rows, e, device)}
    pieces = _calls(tensors, calls, e, device)
    bufs = [torch.zeros(e, 2 * f, h, device=device), torch.zeros(e, h, f, device=device)]
    gemm_add, quack_reason = _quack() if device.type == "cuda" else (None, "QuACK runs on CUDA GPUs only")
    ref = _reference(pieces)
    rows_out, skipped = [], []
    flops = 2 * rows * h * 3 * f  # dW1: 2F x H, dW2: H x F, per row
    for name in variants:
        if name.startswith("quack") and gemm_add is None:
            skipped.append({"variant": name, "reason": quack_reason})
            continue
        step = _variant(name, one, pieces, bufs, gemm_add)
        if name != "torch-one" and name != "quack-one":  # N-call variants: checked first
            for b in bufs:
                b.zero_()
            got = step()
            err = max(
                float((gi.float() - ri).norm() / ri.norm().clamp_min(1e-30))
                for gi, ri in zip(got, ref, strict=True)
            )
            bound = 1e-2 if dtype == torch.bfloat16 else 1e-5
            if err > bound:
                raise RuntimeError(f"{name}: relative error {err:.2e} against the fp32 reference > {bound}")
        else:
            err = None
        times = [t * 1e3 for t in _timed_back_to_back(step, iters, warmup)]
        ms = statistics.median(times)
        rows_out.append(
            {
                "variant": name,
                "ms": ms,
                "min_ms": min(times),
                "max_ms": max(times),
                "tflops": flops / (ms / 1e3) / 1e12,
                "rel_err": err,
            }
        )
    by = {r["variant"]: r["ms"] for r in rows_out}
    ratios = {}
    for lib in ("torch", "quack"):
        for n_call in ("sum", "acc"):
            if f"{lib}-{n_call}" in by and f"{lib}-one" in by:
                ratios[f"{lib}-{n_call}/{lib}-one"] = by[f"{lib}-{n_call}"] / by[f"{lib}-one"]
        if f"{lib}-acc" in by and "torch-one" in by:
            ratios[f"{lib}-acc/torch-one"] = by[f"{lib}-acc"] / by["torch-one"]
    return {
        "shape": shape_name,
        **shape,
        "calls": calls,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "rows": rows_out,
        "skipped": skipped,
        "ratios": ratios,
        "goal": GOAL,
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['shape']} (H {result['hidden']}, F {result['ffn']}, {result['experts']} experts), "
        f"{result['calls']} calls, {result['dtype']}, {result['device']}",
        "",
        "| variant | ms median [min..max] | TFLOP/s | rel. error vs fp32 |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        lines.append(
            f"| {r['variant']} | {r['ms']:.3f} [{r['min_ms']:.3f}..{r['max_ms']:.3f}] | {r['tflops']:.0f} | {err} |"
        )
    for s in result["skipped"]:
        lines.append(f"| {s['variant']} | skipped: {s['reason']} | | |")
    for k, v in result["ratios"].items():
        lines.append(
            f"{k}: {v:.3f}" + (f" (goal <= {result['goal']})" if k.endswith("acc/quack-one") else "")
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="mok bench wgrad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["wgrad"])
    p.add_argument("--shape", default="deepseek-v3-ep32", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--calls", type=int, default=4, help="calls (minibatches) the layer call is split into")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    names = ns.shape.split(",")
    if bad := [n for n in names if n not in SHAPES]:
        p.error(f"--shape {bad}: choose from {', '.join(SHAPES)}")
    if ns.calls < 1:
        p.error(f"--calls {ns.calls}: must be >= 1")
    results = []
    for n in names:
        try:
            results.append(bench_wgrad(n, ns.calls, ns.iters, ns.warmup))
        except ValueError as e:
            p.error(str(e))
        print(markdown(results[-1]), flush=True)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
