"""``mok env``: what this machine has, and what each missing piece disables."""

from __future__ import annotations

import platform
import sys

from mok_megatron import __version__
from mok_megatron.ops.fp8_grouped_gemm import ALIGNMENT as NATIVE_ALIGNMENT
from mok_megatron.experts.recipes import RECIPES, available_recipes
from mok_megatron.compat import (
    MCORE_MAX,
    MCORE_MIN,
    cuda_capability,
    dist_version,
    have_apex,
    have_te,
    have_triton,
    mcore_version,
    te_cublaslt_version,
    te_single_grouped_weight_supported,
    te_version,
)


def _native_fp8_status() -> str:
    """Whether the native ``torch._scaled_grouped_mm`` FP8 expert path could run on GPU 0."""
    import torch

    from mok_megatron.ops.fp8_grouped_gemm import unavailable_reason

    reason = unavailable_reason("cuda:0" if torch.cuda.is_available() else "cpu")
    return "yes" if reason is None else f"no: {reason}"


def _te_backend(cap, te: bool, fp8: dict) -> dict | None:
    """What ``--mok-expert-backend te`` does here: the cuBLASLt TE loaded, the GEMM route of bf16 and of each
    FP8 recipe TE runs on this GPU ("grouped", or "per-expert: " and why), and whether TE holds the experts
    as one grouped weight (``--mok-te-single-weight``). None without TE or a GPU (``missing`` says so)."""
    if not te or cap is None:
        return None
    from mok_megatron.experts.te import recipe_routes

    recipes = [None] + [name for name, status in fp8.items() if status == "yes"]
    cublaslt = te_cublaslt_version()
    out = {
        "cublaslt": f"{cublaslt // 10000}.{cublaslt % 10000 // 100}" if cublaslt else None,
        "routes": {},
        "single_grouped_weight": te_single_grouped_weight_supported(),
    }
    try:
        for name, r in recipe_routes(recipes).items():
            out["routes"][name] = "grouped" if r.grouped else f"per-expert: {r.reason}"
    except Exception as e:  # a report, not a build: say what TE raised and print the rest
        out["error"] = f"asking TE for the routes raised {type(e).__name__}: {e}"
    return out


def report() -> dict:
    """Everything ``mok env`` prints, as data."""
    import torch

    cap = cuda_capability()
    gpus = []
    if cap is not None:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": p.name,
                    "arch": f"sm_{p.major}{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
    mcore = mcore_version()
    te = have_te() if mcore is not None else False
    fp8 = {
        name: "yes" if a.available else f"no: {a.reason}"
        for name, a in available_recipes(cap, te, te_version() if te else None).items()
    }
    missing = []
    if mcore is None:
        missing.append(
            "megatron-core: not installed -- mok_megatron cannot run (pip install 'megatron-core~=0.19.2')"
        )
    elif not (MCORE_MIN <= mcore < MCORE_MAX):
        missing.append(f"megatron-core {mcore}: outside the supported range >={MCORE_MIN},<{MCORE_MAX}")
    if not te:
        missing.append(
            "transformer-engine: TE layer specs (gpt_layer_te*, use_te=True), --mok-expert-backend te and "
            "every FP8 recipe are unavailable; the Megatron-Core (local) specs work"
        )
    if not have_apex():
        missing.append(
            "apex: optional; Megatron falls back to torch norms (which cannot run sequence parallelism "
            "without TE) and torch optimizers"
        )
    if not have_triton():
        missing.append("triton: megatron-core itself imports it; Triton kernels are unavailable")
    if cap is None:
        missing.append(
            "CUDA GPU: none -- use CPU mode (mok_megatron.training.cpu.enable(), gloo); no NCCL, no FP8, "
            "no --mok-expert-backend te"
        )
    elif cap < (9, 0):
        missing.append(
            f"sm_90+: this GPU is sm_{cap[0]}{cap[1]}; torch grouped GEMMs fall back to a per-expert loop"
        )
    return {
        "mok_megatron": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "megatron_core": str(mcore) if mcore else None,
        "transformer_engine": te_version() if te else None,
        "apex": "yes" if have_apex() else None,
        "triton": dist_version("triton") or dist_version("pytorch-triton"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cap is not None else None,
        "gpus": gpus,
        "fp8_recipes": fp8,
        "fp8_native": _native_fp8_status(),
        "te_backend": _te_backend(cap, te, fp8),
        "missing": missing,
    }


def format_report(r: dict) -> str:
    lines = ["mok_megatron environment", ""]
    for key in (
        "mok_megatron",
        "python",
        "platform",
        "torch",
        "torch_cuda",
        "megatron_core",
        "transformer_engine",
        "apex",
        "triton",
        "nccl",
    ):
        lines.append(
            f"  {key:<20} {r[key] if r[key] is not None else 'not installed' if key not in ('torch_cuda', 'nccl') else '-'}"
        )
    lines.append("")
    if r["gpus"]:
        for i, g in enumerate(r["gpus"]):
            lines.append(f"  gpu {i:<16} {g['name']} ({g['arch']}, {g['memory_gib']} GiB)")
    else:
        lines.append("  gpu                  none (CPU only)")
    lines.append("")
    lines.append("  FP8 recipes (--fp8-recipe; nvfp4: --fp4-recipe), rows per expert padded to:")
    for recipe, status in r["fp8_recipes"].items():
        lines.append(f"    {recipe:<12} {RECIPES[recipe].alignment:>4}  {status}")
    lines.append(
        f"    {'torch-fp8':<12} {NATIVE_ALIGNMENT:>4}  {r['fp8_native']}  (--mok-expert-backend torch-fp8, no TE)"
    )
    lines.append("")
    if r["te_backend"]:
        lines.extend(_format_te_backend(r["te_backend"]))
        lines.append("")
    if r["missing"]:
        lines.append("  missing, and what that disables:")
        lines.extend(f"    - {m}" for m in r["missing"])
    else:
        lines.append("  nothing missing")
    return "\n".join(lines)


def _format_te_backend(t: dict) -> list[str]:
    """The te backend's lines: one head, then the recipes on each route (per-expert grouped by reason)."""
    single = "yes" if t["single_grouped_weight"] else "no (TE >= 2.20)"
    lines = [
        f"  --mok-expert-backend te: cuBLASLt {t['cublaslt'] or '-'}, "
        f"one grouped weight (--mok-te-single-weight): {single}"
    ]
    grouped = [n for n, route in t["routes"].items() if route == "grouped"]
    if grouped:
        lines.append(f"    {'grouped GEMM':<16} {', '.join(grouped)}")
    reasons: dict[str, list[str]] = {}
    for name, route in t["routes"].items():
        if route != "grouped":
            reasons.setdefault(route.removeprefix("per-expert: "), []).append(name)
    lines.extend(f"    {'per-expert GEMMs':<16} {', '.join(names)}: {why}" for why, names in reasons.items())
    if t.get("error"):
        lines.append(f"    {'routes':<16} {t['error']}")
    return lines
