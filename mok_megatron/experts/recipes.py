"""The FP8 (and FP4) recipes Megatron-Core 0.19 exposes, what each needs, and which can run here.

Row alignment: the grouped GEMM needs every expert's row count to be a multiple of it; MoK pads each
expert's rows (``ops.align``). The values are Megatron's ``get_align_size_for_quantization``
(``megatron/core/fp8_utils.py:get_fp8_align_size``: 32 for mxfp8, else 16;
``fp4_utils.py:get_fp4_align_size``: 128 for nvfp4 -- 64 is the hardware minimum, 128 keeps TE's grouped
NVFP4 quantize + Hadamard transform sync-free). Megatron uses 256 for every recipe with
``use_transformer_engine_op_fuser`` (CUTLASS grouped GEMM); ``alignment_for`` takes that flag too.

Capability (Transformer Engine's own checks): FP8 GEMMs need sm_89+ (Ada; per-tensor scaling), 1x128 /
128x128 block scaling (``Float8BlockScaling``) sm_90+, MXFP8 and NVFP4 (hardware block scales) sm_100+
(Blackwell). TE versions are the ones Megatron 0.19 gates each recipe on (``fp8_utils.get_fp8_recipe``).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version


@dataclass(frozen=True)
class FP8Recipe:
    """One ``--fp8-recipe`` (``--fp4-recipe`` for nvfp4) value.

    name            Megatron's recipe name
    te_class        Transformer Engine recipe class Megatron builds for it
    alignment       rows per expert must be a multiple of this (grouped GEMM)
    min_capability  lowest CUDA compute capability TE runs it on
    min_te          lowest TE version Megatron 0.19 accepts for it
    scale_block     elements sharing one scale along a row (0 = one scale per tensor)
    """

    name: str
    te_class: str
    alignment: int
    min_capability: tuple[int, int]
    min_te: str
    scale_block: int

    def __post_init__(self):
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"FP8Recipe {self.name}: alignment={self.alignment}, expected a power of two")
        if len(self.min_capability) != 2:
            raise ValueError(
                f"FP8Recipe {self.name}: min_capability={self.min_capability}, expected (major, minor)"
            )
        Version(self.min_te)  # raises on a malformed version

    @property
    def arch(self) -> str:
        return f"sm_{self.min_capability[0]}{self.min_capability[1]}"


RECIPES: dict[str, FP8Recipe] = {
    r.name: r
    for r in (
        FP8Recipe("delayed", "DelayedScaling", 16, (8, 9), "1.0", 0),
        FP8Recipe("tensorwise", "Float8CurrentScaling", 16, (8, 9), "2.2.0.dev0", 0),
        FP8Recipe("blockwise", "Float8BlockScaling", 16, (9, 0), "2.3.0.dev0", 128),
        FP8Recipe("mxfp8", "MXFP8BlockScaling", 32, (10, 0), "2.1.0", 32),
        FP8Recipe("nvfp4", "NVFP4BlockScaling", 128, (10, 0), "2.7.0.dev0", 16),
    )
}

# Megatron: with the TE op fuser the CUTLASS grouped GEMM wants 256 rows per expert, for every recipe.
OP_FUSER_ALIGNMENT = 256


def get_recipe(name: str) -> FP8Recipe:
    if name not in RECIPES:
        raise ValueError(f"FP8 recipe {name!r} is unknown; expected one of {', '.join(RECIPES)}")
    return RECIPES[name]


def alignment_for(name: str, op_fuser: bool = False) -> int:
    """Rows per expert the grouped GEMM needs under recipe ``name`` (Megatron's rule)."""
    recipe = get_recipe(name)
    return OP_FUSER_ALIGNMENT if op_fuser else recipe.alignment


@dataclass(frozen=True)
class Availability:
    recipe: str
    available: bool
    reason: str  # "" when available


def _te_ok(te_version: str | None, need: str) -> bool:
    if te_version is None:  # present but version unknown: trust it
        return True
    try:
        return Version(te_version) >= Version(need)
    except Exception:
        return True


def available_recipes(
    device_capability: tuple[int, int] | None, have_te: bool, te_version: str | None = None
) -> dict[str, Availability]:
    """Each recipe: can it run with this GPU (``None`` = no CUDA GPU) and TE, and if not, why."""
    out = {}
    for name, r in RECIPES.items():
        if not have_te:
            reason = "needs Transformer Engine (pip install 'mok-megatron[te]')"
        elif not _te_ok(te_version, r.min_te):
            reason = f"needs Transformer Engine >= {r.min_te}, this is {te_version}"
        elif device_capability is None:
            reason = f"needs a CUDA GPU, {r.arch}+"
        elif tuple(device_capability) < r.min_capability:
            cap = device_capability
            reason = f"needs {r.arch}+, this GPU is sm_{cap[0]}{cap[1]}"
        else:
            reason = ""
        out[name] = Availability(name, not reason, reason)
    return out
