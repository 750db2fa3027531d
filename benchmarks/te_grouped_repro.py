"""Transformer Engine's device-driven grouped GEMM (``GroupedLinear(use_grouped_tensor=True)``) against
per-expert references, under the split layouts an MoE expert call hands it.

The path (TE 2.20: the module's grouped-tensor forward / backward on cuBLASLt's grouped GEMM, cuBLASLt 13.4+
on Hopper for bf16, 13.5+ for FP8 current scaling, 13.6+ for FP8 blocks) takes the per-expert row counts
(``m_splits``) as a CUDA tensor and never reads them on the host. Each variant below builds one
``GroupedLinear`` on that path and one on TE's per-expert path (host ``m_splits``, the same weights), runs
forward and backward, and reports NaNs and relative errors of the output, the input gradient and the weight
gradients against an fp32 per-expert reference (``x_e @ W_e^T``) and against TE's per-expert path.

Variants (rows per expert = the counts, padded up to ``align`` with zero rows):
  te-test        TE's own test layout (3 experts, 128/256/384 rows, 128 x 128 weights)
  counts         arbitrary counts (no padding), int64 splits on the device
  counts-int32   the same with int32 device splits (TE casts them to int64)
  pad16          counts padded to 16 rows (Megatron's alignment for tensorwise / blockwise FP8)
  zero-experts   two experts with no rows
  spare-tail     64 rows after the last expert's rows (a static buffer's unused rows)
  host-list      a Python list (the per-expert path's form): the grouped path refuses it
  qwen           Qwen3-30B-A3B's fc1 (128 experts, 2048 -> 1536, 32768 rows, skewed counts, some empty)
and the FP8 recipes Float8CurrentScaling (``cs``) and Float8BlockScaling (``block``) at paddings 16 / 128.

Measured: docs/performance.md (FP8 expert backends) and docs/results/2026-12-03-te-grouped-gemm.

Each variant runs in its own process (a device-side assertion ends the CUDA context), 8 at a time. Run on
one Hopper GPU with TE 2.20 and a cuBLASLt that has the grouped GEMM:
    python3 benchmarks/te_grouped_repro.py            # all variants, one table
    python3 benchmarks/te_grouped_repro.py --only bf16-zero-experts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    # name: (recipe, experts, in, out, counts kind, align, splits form, spare tail rows)
    "bf16-te-test": (None, 3, 128, 128, "te-test", 1, "cuda64", 0),
    "bf16-counts": (None, 8, 512, 512, "random", 1, "cuda64", 0),
    "bf16-counts-int32": (None, 8, 512, 512, "random", 1, "cuda32", 0),
    "bf16-pad16": (None, 8, 512, 512, "random", 16, "cuda64", 0),
    "bf16-zero-experts": (None, 8, 512, 512, "random-zeros", 1, "cuda64", 0),
    "bf16-zero-experts-pad16": (None, 8, 512, 512, "random-zeros", 16, "cuda64", 0),
    "bf16-spare-tail": (None, 8, 512, 512, "random", 1, "cuda64", 64),
    "bf16-host-list": (None, 8, 512, 512, "random", 1, "list", 0),
    "bf16-qwen": (None, 128, 2048, 1536, "skewed", 1, "cuda64", 0),
    "cs-pad16": ("cs", 8, 512, 512, "random", 16, "cuda64", 0),
    "cs-zero-experts-pad16": ("cs", 8, 512, 512, "random-zeros", 16, "cuda64", 0),
    "cs-qwen-pad16": ("cs", 128, 2048, 1536, "skewed", 16, "cuda64", 0),
    "block-te-test": ("block", 3, 128, 128, "te-test", 1, "cuda64", 0),
    "block-pad16": ("block", 8, 512, 512, "random", 16, "cuda64", 0),
    "block-pad128": ("block", 8, 512, 512, "random", 128, "cuda64", 0),
    "block-zero-experts-pad128": ("block", 8, 512, 512, "random-zeros", 128, "cuda64", 0),
    "block-qwen-pad128": ("block", 128, 2048, 1536, "skewed", 128, "cuda64", 0),
}


def _counts(kind: str, experts: int, gen):
    import torch

    if kind == "te-test":
        return [128, 256, 384]
    if kind == "skewed":  # 4096 tokens x top-8 over 128 experts, a few hot and a few empty experts
        w = torch.rand(experts, generator=gen) ** 4
        w[torch.randperm(experts, generator=gen)[:6]] = 0.0
        c = torch.multinomial(w / w.sum(), 32768, replacement=True, generator=gen)
        return torch.bincount(c, minlength=experts).tolist()
    c = torch.randint(150, 400, (experts,), generator=gen)
    if kind == "random-zeros":
        c[1] = 0
        c[5] = 0
    return c.tolist()


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_variant(name: str) -> dict:
    import torch
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.module.grouped_linear as gl
    from transformer_engine.common import recipe as te_recipe

    recipe_name, experts, k_in, n_out, kind, align, form, tail = VARIANTS[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    calls = {"grouped": 0, "per_expert": 0}
    grouped_gemm, per_expert_gemm = gl.general_grouped_gemm_for_grouped_tensor, gl.general_grouped_gemm

    def count_grouped(*a, **kw):
        calls["grouped"] += 1
        return grouped_gemm(*a, **kw)

    def count_per_expert(*a, **kw):
        calls["per_expert"] += 1
        return per_expert_gemm(*a, **kw)

    gl.general_grouped_gemm_for_grouped_tensor = count_grouped
    gl.general_grouped_gemm = count_per_expert

    recipe = {None: None, "cs": te_recipe.Float8CurrentScaling(), "block": te_recipe.Float8BlockScaling()}[
        recipe_name
    ]
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    gen = torch.Generator().manual_seed(0)
    counts = _counts(kind, experts, gen)
    padded = [(c + align - 1) // align * align for c in counts]
    rows = sum(padded)
    dev = "cuda"
    x = torch.zeros(rows + tail, k_in)
    dy = torch.zeros(rows + tail, n_out)
    off = 0
    for c, p in zip(
        counts, padded, strict=True
    ):  # real rows random, padding rows zero (as a padding scatter leaves them)
        x[off : off + c] = torch.randn(c, k_in, generator=gen)
        dy[off : off + c] = torch.randn(c, n_out, generator=gen)
        off += p
    x[rows:] = torch.randn(tail, k_in, generator=gen)
    dy[rows:] = torch.randn(tail, n_out, generator=gen)
    x, dy = x.to(dev, torch.bfloat16), dy.to(dev, torch.bfloat16)
    w = (0.02 * torch.randn(experts, n_out, k_in, generator=gen)).to(dev, torch.bfloat16)

    # fp32 per-expert reference over the rows the splits cover
    y_ref = torch.zeros(rows, n_out, device=dev)
    dx_ref = torch.zeros(rows, k_in, device=dev)
    dw_ref = torch.zeros(experts, n_out, k_in, device=dev)
    off = 0
    for e, p in enumerate(padded):
        xe, dye, we = x[off : off + p].float(), dy[off : off + p].float(), w[e].float()
        y_ref[off : off + p] = xe @ we.t()
        dx_ref[off : off + p] = dye @ we
        dw_ref[e] = dye.t() @ xe
        off += p

    def build(grouped: bool):
        m = te.GroupedLinear(
            experts,
            k_in,
            n_out,
            bias=False,
            params_dtype=torch.bfloat16,
            device=dev,
            use_grouped_tensor=grouped,
        )
        with torch.no_grad():
            for e in range(experts):
                getattr(m, f"weight{e}").copy_(w[e])
        return m

    def run(m, splits, xin, dyin):
        xi = xin.detach().clone().requires_grad_(True)
        with autocast(enabled=recipe is not None, recipe=recipe):
            y = m(xi, splits)
        torch.cuda.synchronize()
        y.backward(dyin)
        torch.cuda.synchronize()
        dw = torch.stack([getattr(m, f"weight{e}").grad for e in range(experts)])
        return y.detach(), xi.grad.detach(), dw

    out = {
        "variant": name,
        "recipe": recipe_name or "bf16",
        "experts": experts,
        "shape": f"{k_in}->{n_out}",
        "align": align,
        "splits": form,
        "rows": rows,
        "tail": tail,
        "zero_experts": sum(1 for c in counts if c == 0),
        "counts_multiple_of_16": all(c % 16 == 0 for c in padded),
        "counts_multiple_of_128": all(c % 128 == 0 for c in padded),
        "path_supported": bool(gl.is_module_grouped_tensor_path_supported(recipe, torch.bfloat16)),
    }

    # TE's per-expert path: host list, tight rows
    legacy = run(build(False), padded, x[:rows], dy[:rows])
    calls_legacy = dict(calls)
    calls.update(grouped=0, per_expert=0)

    splits = {
        "cuda64": torch.tensor(padded, dtype=torch.int64, device=dev),
        "cuda32": torch.tensor(padded, dtype=torch.int32, device=dev),
        "list": list(padded),
    }[form]
    t0 = time.perf_counter()
    try:
        y, dx, dw = run(build(True), splits, x, dy)
    except Exception as exc:  # the grouped path refusing the input is a result too
        out.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}")
        return out
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["calls"] = dict(calls)
    out["calls_per_expert_path"] = calls_legacy
    nz = [e for e, c in enumerate(counts) if c > 0]
    z = [e for e, c in enumerate(counts) if c == 0]
    out.update(
        nan_out=int(torch.isnan(y[:rows]).sum()),
        nan_dx=int(torch.isnan(dx[:rows]).sum()),
        nan_dw=int(torch.isnan(dw).sum()),
        nonfinite_dw=int((~torch.isfinite(dw)).sum()),
        rel_out=_rel(y[:rows], y_ref),
        rel_dx=_rel(dx[:rows], dx_ref),
        rel_dw=_rel(dw[nz], dw_ref[nz]),
        rel_out_vs_te=_rel(y[:rows], legacy[0]),
        rel_dx_vs_te=_rel(dx[:rows], legacy[1]),
        rel_dw_vs_te=_rel(dw[nz], legacy[2][nz]),
        te_rel_out=_rel(legacy[0], y_ref),
        te_rel_dw=_rel(legacy[2][nz], dw_ref[nz]),
    )
    if z:  # an expert without rows has a zero weight gradient
        out["zero_expert_dw_absmax"] = float(dw[z].float().abs().nan_to_num(float("inf")).max())
        out["zero_expert_dw_absmax_te"] = float(legacy[2][z].float().abs().max())
    if tail:  # rows after the splits' total: the grouped path leaves them unwritten
        out["tail_out_nonfinite"] = int((~torch.isfinite(y[rows:])).sum())
        out["tail_dx_nonfinite"] = int((~torch.isfinite(dx[rows:])).sum())
    return out


def environment() -> dict:
    import torch
    import transformer_engine
    import transformer_engine_torch as tex

    libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "libcublas" in ln})
    return {
        "torch": torch.__version__,
        "te": getattr(transformer_engine, "__version__", "?"),
        "cublasLt": tex.get_cublasLt_version(),
        "gpu": torch.cuda.get_device_name(),
        "libcublas": libs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant)), flush=True)
        return
    print("ENV " + json.dumps(environment()), flush=True)
    names = args.only or list(VARIANTS)
    pending = list(names)
    running: list[tuple[str, subprocess.Popen, float]] = []
    results = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            n = pending.pop(0)
            p = subprocess.Popen(
                [sys.executable, __file__, "--variant", n],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ),
            )
            running.append((n, p, time.time()))
        time.sleep(0.2)
        for item in list(running):
            n, p, t0 = item
            if p.poll() is None and time.time() - t0 < args.timeout:
                continue
            killed = p.poll() is None
            if killed:
                p.kill()
            so, se = p.communicate()
            line = [ln for ln in so.splitlines() if ln.startswith("RESULT ")]
            if line:
                results[n] = json.loads(line[-1][7:])
            else:
                # a device-side error prints from the kernel (stdout) and ends the process or hangs it
                keep = [ln for ln in (so + "\n" + se).splitlines() if ln.strip() and "warn" not in ln.lower()]
                how = f"rc={p.returncode}" + (f" (killed after {args.timeout:.0f} s)" if killed else "")
                results[n] = {"variant": n, "crashed": how, "stderr": " | ".join(keep[-6:])[-800:]}
            print("RESULT " + json.dumps(results[n]), flush=True)
            running.remove(item)
    print(
        "\nvariant                      nan out/dx/dw   rel out   rel dx    rel dw    vs TE per-expert out/dw  note"
    )
    for n in names:
        r = results[n]
        if "crashed" in r or "error" in r:
            print(f"{n:28s} {r.get('error') or (r['crashed'] + ' ' + r['stderr'][-300:])}")
            continue
        note = []
        if "zero_expert_dw_absmax" in r:
            note.append(
                f"empty-expert dW max {r['zero_expert_dw_absmax']:.3g} (TE per-expert "
                f"{r['zero_expert_dw_absmax_te']:.3g})"
            )
        if "tail_out_nonfinite" in r:
            note.append(f"tail nonfinite out/dx {r['tail_out_nonfinite']}/{r['tail_dx_nonfinite']}")
        if not r["calls"]["grouped"]:
            note.append("grouped path NOT taken")
        print(
            f"{n:28s} {r['nan_out']}/{r['nan_dx']}/{r['nan_dw']:<10} {r['rel_out']:.2e}  {r['rel_dx']:.2e}  "
            f"{r['rel_dw']:.2e}  {r['rel_out_vs_te']:.2e}/{r['rel_dw_vs_te']:.2e}       {'; '.join(note)}"
        )


if __name__ == "__main__":
    main()
