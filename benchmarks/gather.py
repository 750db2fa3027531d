"""The experts' fc1 grouped GEMM on rows gathered from token order (QuACK's gather-A GEMM,
``ops.gather_gemm``) against the permuted copy followed by torch's grouped GEMM.

    python -m benchmarks.gather --shape deepseek-v3-ep32,qwen3-30b-a3b --json gather.json

(from the repository root; needs a CUDA GPU, ``--allow-cpu`` runs it on a CPU: ``--shape tiny``).

Legend: T tokens, k top-k, M = T*k rows (expert-major), E local experts, H hidden, F FFN width (fc1 is
2F wide: gate and up).

Why: the permuted copy ``x_MH = x_TH[idx_M]`` is written in forward (M*H elements: 448 MiB bf16 on the
DeepSeek-V3 EP slice, 512 MiB on Qwen3-30B-A3B), read by the GEMM and kept for the weight gradient. Reading
the rows through the index inside the GEMM writes none of it; the question is what the gather costs the GEMM.

Variants, CUDA events over back-to-back steps, median (min..max):
    torch-fwd        ``x_TH.index_select(0, idx)`` then torch's grouped GEMM (``ops.grouped_gemm``)
    quack-fwd        QuACK's varlen-M GEMM reading the rows through ``A_idx`` (``kernels.quack_gather``)
    torch-fwdbwd     ``ops.permute.permute_tokens`` (the engine's copy; its backward is the slot-map gather-sum)
                     then ``grouped_linear``, forward and both gradients
    portable-fwdbwd  ``gathered_grouped_linear(use_quack=False)``: the same work through the op
    quack-fwdbwd     ``gathered_grouped_linear(use_quack=True)``: no copy; dW from QuACK's varlen-K GEMM
                     reading the rows through the index, dx from torch's grouped GEMM then the gather-sum
Before timing, every variant's outputs are checked against an fp32 per-expert reference. On CPU the QuACK
variants are skipped (with the reason) and the tiny shape runs in fp32.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.cpu_cost import cpu_refusal

PROG = "python -m benchmarks.gather"
SHAPES = {
    # one EP=32 rank's slice of DeepSeek-V3 (as benchmarks.wgrad): 4096 tokens x top-8 over 8 local experts
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, experts=8, tokens=4096, topk=8),
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, tokens=16384, topk=8),
    "tiny": dict(hidden=64, ffn=32, experts=4, tokens=32, topk=2),
}
VARIANTS = ("torch-fwd", "quack-fwd", "torch-fwdbwd", "portable-fwdbwd", "quack-fwdbwd")
RATIOS = (
    ("quack-fwd", "torch-fwd"),
    ("quack-fwdbwd", "torch-fwdbwd"),
    ("portable-fwdbwd", "torch-fwdbwd"),
)


def _problem(shape: dict, device, dtype, seed=0) -> dict:
    """Random distinct top-k experts per token, the expert-major layout, its slot map and fc1's operands."""
    from mok_megatron.ops.routing import dropless_order, expert_counts, slot_map

    g = torch.Generator(device="cpu").manual_seed(seed)
    t, k, e, h, f = (shape[n] for n in ("tokens", "topk", "experts", "hidden", "ffn"))
    pick_TK = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    routing_TE = torch.zeros(t, e, dtype=torch.bool).scatter_(1, pick_TK, True).to(device)
    idx_M, _ = dropless_order(routing_TE, t * k)
    offs_E = torch.cumsum(expert_counts(routing_TE), 0).to(torch.int32)
    return {
        "x": torch.randn(t, h, generator=g).to(device, dtype),
        "w": (torch.randn(e, 2 * f, h, generator=g) / h**0.5).to(device, dtype),
        "dy": torch.randn(t * k, 2 * f, generator=g).to(device, dtype),
        "idx": idx_M,
        "offs": offs_E,
        "slots": slot_map(idx_M, None, t, k),
    }


def _reference(p: dict) -> tuple[torch.Tensor, ...]:
    """fp32 per-expert products: (y, dx, dW)."""
    from mok_megatron.ops.gather_gemm import gathered_grouped_linear_reference

    x, w = (p[n].to(torch.float32, copy=True).requires_grad_() for n in ("x", "w"))
    counts = torch.diff(p["offs"].long(), prepend=p["offs"].new_zeros(1).long()).tolist()
    y = gathered_grouped_linear_reference(x, p["idx"], w, counts)
    dx, dw = torch.autograd.grad(y, (x, w), p["dy"].float())
    return y.detach(), dx, dw


def _variant(name: str, p: dict):
    """A zero-argument step; returns (y,) or (y, dx, dW)."""
    from mok_megatron.kernels import quack_gather
    from mok_megatron.ops import grouped_gemm as gg
    from mok_megatron.ops.gather_gemm import gathered_grouped_linear
    from mok_megatron.ops.permute import permute_tokens

    x, w, dy, idx, offs, slots = (p[n] for n in ("x", "w", "dy", "idx", "offs", "slots"))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    idx32, cu = quack_gather.index32(idx), quack_gather.cu_seqlens(offs)

    def fwdbwd(fn):
        y = fn()
        return (y.detach(), *torch.autograd.grad(y, (xg, wg), dy))

    return {
        "torch-fwd": lambda: (gg._fwd(x.index_select(0, idx), w, offs),),
        "quack-fwd": lambda: (quack_gather.forward(x, idx32, w, cu),),
        "torch-fwdbwd": lambda: fwdbwd(lambda: gg.grouped_linear(permute_tokens(xg, idx, slots), wg, offs)),
        "portable-fwdbwd": lambda: fwdbwd(
            lambda: gathered_grouped_linear(xg, idx, wg, offs, slots, use_quack=False)
        ),
        "quack-fwdbwd": lambda: fwdbwd(
            lambda: gathered_grouped_linear(xg, idx, wg, offs, slots, use_quack=True)
        ),
    }[name]


def _quack_reason(p: dict) -> str | None:
    from mok_megatron.compat import have_quack
    from mok_megatron.kernels import quack_gather

    if p["x"].device.type != "cuda":
        return "QuACK runs on CUDA GPUs only"
    if not have_quack():
        return "QuACK (quack-kernels >= 0.4.1) not installed: pip install 'mok-megatron[quack]'"
    if not quack_gather.supports(p["x"], p["w"]):
        return "QuACK's gather-A GEMM does not take these tensors here (CUDA sm90+, bf16/fp16, aligned rows)"
    return None


def bench_gather(shape_name: str, iters: int, warmup: int, variants=VARIANTS) -> dict:
    from mok_megatron.bench.timing import variant_row

    shape = SHAPES[shape_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p = _problem(shape, device, dtype)
    quack_reason = _quack_reason(p)
    ref = _reference(p)
    bound = 1e-2 if dtype == torch.bfloat16 else 1e-5
    rows = p["idx"].shape[0]
    flops_fwd = 2 * rows * shape["hidden"] * 2 * shape["ffn"]
    out, skipped = [], []
    for name in variants:
        if name.startswith("quack") and quack_reason:
            skipped.append({"variant": name, "reason": quack_reason})
            continue
        step = _variant(name, p)
        got = step()
        err = max(
            float((a.float() - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref, strict=False)
        )
        if err > bound:
            raise RuntimeError(f"{name}: relative error {err:.2e} against the fp32 reference > {bound}")
        del got
        flops = flops_fwd * (3 if name.endswith("fwdbwd") else 1)
        out.append(variant_row(name, step, iters, warmup, flops, err))
    by = {r["variant"]: r["ms"] for r in out}
    return {
        "shape": shape_name,
        **shape,
        "rows": rows,
        "copy_mib": rows * shape["hidden"] * p["x"].element_size() / 2**20,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "results": out,
        "skipped": skipped,
        "ratios": {f"{a}/{b}": by[a] / by[b] for a, b in RATIOS if a in by and b in by},
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['shape']} (H {result['hidden']}, F {result['ffn']}, {result['experts']} experts, "
        f"{result['tokens']} tokens top-{result['topk']}: {result['rows']} rows), {result['dtype']}, "
        f"{result['device']}; the permuted copy is {result['copy_mib']:.1f} MiB",
        "",
        "| variant | ms median [min..max] | TFLOP/s | rel. error vs fp32 |",
        "|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['variant']} | {r['ms']:.3f} [{r['min_ms']:.3f}..{r['max_ms']:.3f}] | {r['tflops']:.0f} "
            f"| {r['rel_err']:.1e} |"
        )
    for s in result["skipped"]:
        lines.append(f"| {s['variant']} | skipped: {s['reason']} | | |")
    lines += [f"{k}: {v:.3f}" for k, v in result["ratios"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape", default="deepseek-v3-ep32,qwen3-30b-a3b", help=f"comma list of {', '.join(SHAPES)}"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="run without a CUDA GPU")
    ns = p.parse_args(argv)
    names = ns.shape.split(",")
    if bad := [n for n in names if n not in SHAPES]:
        p.error(f"--shape {bad}: choose from {', '.join(SHAPES)}")
    if ns.iters < 1 or ns.warmup < 0:
        p.error(f"--iters {ns.iters} / --warmup {ns.warmup}: need iters >= 1 and warmup >= 0")
    if not torch.cuda.is_available() and not ns.allow_cpu:
        print(cpu_refusal(PROG, tiny="--shape tiny"), file=sys.stderr)
        return 2
    results = []
    for n in names:
        results.append(bench_gather(n, ns.iters, ns.warmup))
        print(markdown(results[-1]), flush=True)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
