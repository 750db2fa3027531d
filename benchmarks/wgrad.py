"""The experts' weight gradients of one layer call split into N calls, with and without accumulation into
one fp32 buffer, against one call over all rows.

    python -m benchmarks.wgrad --shape deepseek-v3-ep32,qwen3-30b-a3b --calls 4 --json wgrad.json

(from the repository root; needs a CUDA GPU, ``--allow-cpu`` runs it on a CPU: ``--shape tiny``).

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
    torch-one       one ``torch`` grouped GEMM per weight over all R rows (bf16 out)
    torch-one+add   the same, then added into an fp32 buffer (what Megatron's DDP hook does without fusion)
    torch-sum       N calls, bf16 outs summed per weight (autograd's sum)
    torch-sum+add   the same, then added into an fp32 buffer
    torch-acc       N calls, each bf16 out added to one fp32 buffer (``ops.wgrad_accumulate``'s portable path)
    torch-merged    the N calls' rows gathered group by group (``ops.grouped_gemm.concat_groups``), then one
                    grouped GEMM per weight: what the late-wgrad gate runs
    quack-one       one QuACK varlen-K GEMM per weight accumulating into fp32 (``kernels.quack_wgrad``; sm_90+,
                    ``quack-kernels``)
    quack-acc       N QuACK varlen-K GEMMs accumulating into one fp32 buffer per weight
Before timing, every N-call variant is checked against the fp32 sum of per-call reference products.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.cpu_cost import cpu_refusal

PROG = "python -m benchmarks.wgrad"
SHAPES = {
    # one EP=32 rank's slice of DeepSeek-V3 (as ``mok bench layer``): 4096 tokens x top-8 over 8 experts
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, experts=8, rows=4096 * 8),
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, rows=16384 * 8),
    "tiny": dict(hidden=64, ffn=32, experts=4, rows=256),
}
VARIANTS = (
    "torch-one",
    "torch-one+add",
    "torch-sum",
    "torch-sum+add",
    "torch-acc",
    "torch-merged",
    "quack-one",
    "quack-acc",
)
GOAL = 1.05  # N accumulating calls / one call over all rows


def _offsets(rows: int, experts: int, device) -> torch.Tensor:
    """Inclusive int32 offsets of ``rows`` spread evenly over ``experts`` (the last takes the rest)."""
    per = rows // experts
    counts = [per] * (experts - 1) + [rows - per * (experts - 1)]
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _quack_reason(bufs, one) -> str | None:
    """Why QuACK's variants cannot run on these tensors, or None."""
    from mok_megatron.compat import have_quack
    from mok_megatron.kernels import quack_wgrad

    if not have_quack():
        return "QuACK (quack-kernels >= 0.4.1) not installed: pip install 'mok-megatron[quack]'"
    if not all(quack_wgrad.supports(b, dy, x) for b, (dy, x) in zip(bufs, _pairs(one), strict=True)):
        return "QuACK's varlen-K GEMM does not take these tensors here (CUDA sm90+, bf16/fp16, aligned rows)"
    return None


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


def _variant(name: str, one: dict, pieces: list[dict], bufs):
    """A zero-argument step computing this variant's weight gradients; returns them (fc1's, fc2's)."""
    from mok_megatron.kernels import quack_wgrad
    from mok_megatron.ops.wgrad_accumulate import portable_accumulate_

    def summed(parts, add):
        sums = [None, None]
        for p in parts:
            for i, (dy, x) in enumerate(_pairs(p)):
                dw = _torch_wgrad(dy, x, p["offs"])
                sums[i] = dw if sums[i] is None else sums[i] + dw
        if add:  # what DDP's hook does with the gradient autograd leaves: main_grad += grad
            for b, dw in zip(bufs, sums, strict=True):
                b.add_(dw)
            return bufs
        return sums

    def accumulated(parts, accumulate):
        for p in parts:
            for b, (dy, x) in zip(bufs, _pairs(p), strict=True):
                accumulate(b, dy, x, p["offs"])
        return bufs

    def merged():  # the late-wgrad gate's way: the calls' rows gathered group by group, one GEMM
        from mok_megatron.ops.grouped_gemm import concat_groups

        out = []
        for i in range(2):
            (dy, x), offs = concat_groups([(list(_pairs(p)[i]), p["offs"]) for p in pieces])
            out.append(_torch_wgrad(dy, x, offs))
        return out

    return {
        "torch-one": lambda: summed([one], add=False),
        "torch-one+add": lambda: summed([one], add=True),
        "torch-sum": lambda: summed(pieces, add=False),
        "torch-sum+add": lambda: summed(pieces, add=True),
        "torch-acc": lambda: accumulated(pieces, portable_accumulate_),
        "torch-merged": lambda: merged(),
        "quack-one": lambda: accumulated([one], quack_wgrad.accumulate_),
        "quack-acc": lambda: accumulated(pieces, quack_wgrad.accumulate_),
    }[name]


def _reference(pieces: list[dict]) -> list[torch.Tensor]:
    """fp32 per-call products summed: what every N-call variant must give."""
    out = [None, None]
    for p in pieces:
        for i, (dy, x) in enumerate(_pairs(p)):
            dw = _torch_wgrad(dy.float(), x.float(), p["offs"])
            out[i] = dw if out[i] is None else out[i] + dw
    return out


def bench_wgrad(shape_name: str, calls: int, iters: int, warmup: int, variants=VARIANTS) -> dict:
    from mok_megatron.bench.timing import variant_row

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
    quack_reason = _quack_reason(bufs, one) if device.type == "cuda" else "QuACK runs on CUDA GPUs only"
    ref = _reference(pieces)
    rows_out, skipped = [], []
    flops = 2 * rows * h * 3 * f  # dW1: 2F x H, dW2: H x F, per row
    for name in variants:
        if name.startswith("quack") and quack_reason:
            skipped.append({"variant": name, "reason": quack_reason})
            continue
        step = _variant(name, one, pieces, bufs)
        if "one" not in name:  # N-call variants: checked first
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
        rows_out.append(variant_row(name, step, iters, warmup, flops, err))
    by = {r["variant"]: r["ms"] for r in rows_out}
    ratios = {}
    for a, b in (
        ("torch-sum", "torch-one"),
        ("torch-merged", "torch-one"),  # the gather's cost
        ("torch-merged", "torch-sum"),
        ("torch-acc", "torch-one+add"),
        ("quack-acc", "quack-one"),  # the goal: N accumulating calls against one call over all rows
        ("quack-one", "torch-one+add"),  # one call: fused against Megatron's unfused gradient + DDP add
        ("quack-acc", "torch-sum+add"),  # N calls: fused against bf16 sums + DDP add
    ):
        if a in by and b in by:
            ratios[f"{a}/{b}"] = by[a] / by[b]
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
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="deepseek-v3-ep32", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--calls", type=int, default=4, help="calls (minibatches) the layer call is split into")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA GPU")
    ns = p.parse_args(argv)
    names = ns.shape.split(",")
    if bad := [n for n in names if n not in SHAPES]:
        p.error(f"--shape {bad}: choose from {', '.join(SHAPES)}")
    if ns.calls < 1:
        p.error(f"--calls {ns.calls}: must be >= 1")
    if not torch.cuda.is_available() and not ns.allow_cpu:
        print(cpu_refusal(PROG, tiny="--shape tiny"), file=sys.stderr)
        return 2
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
