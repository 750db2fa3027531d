"""The experts' GEMM backend (``--mok-expert-backend``): which one can run here, and its row alignment.

    torch      bf16 ``torch`` grouped GEMM (``ops.grouped_gemm``); no padding
    torch-fp8  native rowwise-scaled FP8 (``ops.fp8_grouped_gemm``); every expert's rows padded to 16
    te         Transformer Engine ``GroupedLinear`` (Megatron's ``TEGroupedLinear`` wrappers), run under
               Megatron's FP8 context when ``--fp8-format`` is given (every recipe Megatron exposes), bf16
               otherwise; rows padded to the recipe's alignment (``experts.recipes.alignment_for``; TE's
               grouped GEMM route: ``experts.te.grouped_alignment``)

``check_expert_backend`` runs once at layer build (before any GEMM), so a wrong GPU or a missing TE
fails at start-up with the value, the constraint and the fix.
"""

from __future__ import annotations

import torch

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.recipes import alignment_for
from mok_megatron.ops import fp8_grouped_gemm as native
from mok_megatron.options import ExpertBackend


def _fp8_recipe_name(config) -> str | None:
    """Megatron's active quantization recipe name ('delayed', ..., 'nvfp4'), or None for bf16."""
    if getattr(config, "fp4", None):
        return str(getattr(config.fp4_recipe, "value", config.fp4_recipe))
    if getattr(config, "fp8", None):
        return str(getattr(config.fp8_recipe, "value", config.fp8_recipe))
    return None


def _backend(value) -> ExpertBackend:
    try:
        return ExpertBackend(value)
    except ValueError:
        choices = ", ".join(e.value for e in ExpertBackend)
        raise MoKConfigError(f"--mok-expert-backend={value!r}: choose one of {choices}.") from None


def expert_alignment(backend: ExpertBackend, config) -> int:
    """Rows per expert the backend's grouped GEMM needs (1 = no padding)."""
    backend = _backend(backend)
    if backend is ExpertBackend.TORCH:
        return 1
    if backend is ExpertBackend.TORCH_FP8:
        return native.ALIGNMENT
    recipe = _fp8_recipe_name(config)
    if recipe is None:
        return 1
    return alignment_for(recipe, bool(getattr(config, "use_transformer_engine_op_fuser", False)))


def check_expert_backend(
    backend: ExpertBackend,
    config,
    device: torch.device | str,
    *,
    have_te: bool,
    sync_free: bool = False,
    recompute_activation: bool = False,
    delay_wgrad: bool = False,
    host_counts: bool = True,
    capability: tuple[int, int] | None = None,
) -> None:
    """Raise ``MoKConfigError`` unless ``backend`` can run the experts of ``config`` on ``device``.
    te: ``host_counts`` whether these experts read the per-expert counts on the host (TE's per-expert
    route; its grouped route with one call does not); ``capability`` the GPU's compute capability (None:
    not checked), against the recipe's (``experts.recipes``)."""
    backend = _backend(backend)
    if backend is ExpertBackend.TORCH:
        return
    if recompute_activation:
        raise MoKConfigError(
            f"--mok-expert-backend {backend.value} does not recompute the activation yet "
            "(--recompute-modules moe_act); drop moe_act from --recompute-modules or use the torch backend."
        )
    if backend is ExpertBackend.TORCH_FP8:
        native.check_native_fp8(device)
        if delay_wgrad:
            raise MoKConfigError(
                "--mok-expert-backend torch-fp8 does not defer weight gradients (--delay-wgrad-compute / "
                "--overlap-dispatch-backward-with-experts-wgrad); drop those flags or use --mok-expert-backend te."
            )
        return
    # te
    if not have_te:
        raise MoKConfigError(
            "--mok-expert-backend te needs Transformer Engine, which is not importable here. Install it "
            "(pip install 'mok-megatron[te]'), or use --mok-expert-backend torch-fp8 (Hopper+, no TE) or torch."
        )
    if sync_free and host_counts:
        raise MoKConfigError(
            "--mok-expert-backend te reads the per-expert row counts on the host here (TE's per-expert "
            "GEMMs take m_splits as a list), which --mok-sync-free forbids. Drop --mok-sync-free, load a "
            "cuBLASLt that runs TE's grouped GEMM (the te backend's warning above names it), or use "
            "--mok-expert-backend torch-fp8 (device-only)."
        )
    if torch.device(device).type != "cuda":
        raise MoKConfigError(
            f"--mok-expert-backend te runs Transformer Engine GEMMs on a CUDA GPU; this device is "
            f"{torch.device(device).type}. Use --mok-expert-backend torch on CPU."
        )
    recipe = _fp8_recipe_name(config)
    if recipe is not None and capability is not None:
        check_recipe_capability(recipe, tuple(capability))


def check_recipe_capability(recipe: str, capability: tuple[int, int]) -> None:
    """Raise ``MoKConfigError`` where this GPU cannot run the quantization recipe (MXFP8 and NVFP4 need
    Blackwell's hardware block scales), at build rather than at the first GEMM."""
    from mok_megatron.experts.recipes import RECIPES

    spec = RECIPES.get(recipe)
    if spec is None or capability >= spec.min_capability:
        return
    flag = "--fp4-recipe" if recipe == "nvfp4" else "--fp8-recipe"
    why = " (Blackwell's hardware block scales)" if spec.min_capability >= (10, 0) else ""
    here = [r.name for r in RECIPES.values() if r.name != "nvfp4" and capability >= r.min_capability]
    if here:
        fix = f"--fp8-recipe {' / '.join(here)} with --mok-expert-backend te"
    else:
        fix = "bf16 (drop --fp8-format) or a GPU that runs FP8"
    if capability >= (9, 0):
        fix += ", or --mok-expert-backend torch-fp8"
    raise MoKConfigError(
        f"{flag} {recipe} needs {spec.arch}+{why}; this GPU is sm_{capability[0]}{capability[1]}: use {fix}."
    )
