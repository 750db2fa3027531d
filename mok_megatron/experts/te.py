"""``MoKTEGroupedMLP``: MoK's experts with Transformer Engine GEMMs (``--mok-expert-backend te``).

Legend: L local experts, R rows (expert-major), F1 fc1 rows (2F with a GLU), F FFN width, H hidden.

The GEMMs are Megatron's own TE wrappers, built exactly as ``TEGroupedMLP`` builds them
(``TEColumnParallelGroupedLinear`` for fc1, ``TERowParallelGroupedLinear`` for fc2, same constructor
arguments), so parameters, ``state_dict`` keys (``linear_fc1.weight{i}``, ``linear_fc1._extra_state``),
TE's FP8 metadata, delayed weight gradients (TE's ``delay_wgrad_compute``) and the distributed-checkpoint
``sharded_state_dict`` (``TEGroupedMLP``'s method, the same keys as ``SequentialMLP``) are Megatron's. FP8
comes from the context Megatron's ``TransformerBlock`` enters around every layer
(``fp8_utils.get_fp8_context``: delayed, tensorwise, blockwise, mxfp8; ``fp4_utils`` for nvfp4); without
``--fp8-format`` TE runs bf16.

What MoK changes (``te_expert_mlp``): per-expert padding to the recipe's alignment
is one device scatter of the rows by ``ops.align``'s plan (Megatron's ``Fp8Padding`` splits and
concatenates per expert on the host's counts), the activation is MoK's (``ops.activation``), and plain
(non-distributed) state dicts in MoK's stacked layout load too (``to_te_layout``).

Two GEMM routes, chosen once at build (``grouped_route``):
- grouped: TE's device-driven grouped GEMM (``GroupedLinear.use_grouped_tensor``, TE >= 2.20: one
  cuBLASLt grouped GEMM per projection and pass, the weights quantized by TE's recipe every step as
  on the per-expert route). MoK takes it wherever TE's own predicate
  (``is_module_grouped_tensor_path_supported``: sm_90 with cuBLASLt >= 13.4 for bf16, 13.5 for
  tensorwise, 13.6 for blockwise; sm_100 for bf16 / tensorwise / MXFP8 / NVFP4) accepts the recipe and the
  cuBLASLt loaded, unless ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=0`` says no. Splits are a CUDA
  int64 tensor never read on the host, so ``--mok-sync-free`` runs here. Every expert's rows are
  padded to 128 for FP8 blocks (TE's grouped block quantization works in whole 128-row tiles and stops
  on a device assertion otherwise; MXFP8 gets the same, the tile of its swizzled scales), to Megatron's
  16 for tensorwise, not at all in bf16 (bitwise TE's per-expert results on an H200, TE 2.20.2,
  cuBLASLt 13.10: ``benchmarks/te_grouped_repro.py``). Rows past the splits' total are never handed to
  TE: TE neither reads nor writes them (its outputs there are uninitialised memory), so wherever the
  buffer has spare rows and the GEMMs need aligned groups, the last expert owns them (zero rows,
  probability 0, a multiple of the alignment), as for the native FP8 path; in bf16 the spare rows stay
  outside the splits and nothing reads them (the fused activation skips them, combine gathers routed
  rows only).
  TE's grouped GEMM takes at most 64 per-expert weight tensors per call
  (``compat.TE_GROUPED_GEMM_MAX_WEIGHTS``); TE 2.20's single grouped weight has no such limit but is
  experimental (opt-in below). So by default more local experts run as calls of at most 64 experts
  over contiguous expert and row ranges (``TECallViews``: TE modules whose ``weight{i}`` are the
  layer's own Parameters, outside the module tree, so parameters, state dicts, checkpoints and DDP
  hooks stay ``TEGroupedMLP``'s). The
  row boundaries between calls are host values: those layers read the counts on the host once per
  call (the contract's ``host_counts``: the plain engine then sizes the buffer exactly, no spare rows),
  which ``--mok-sync-free`` forbids (``check_grouped_calls``).
  With ``--mok-te-single-weight`` (opt-in; TE labels ``single_grouped_weight`` experimental) fc1 and fc2
  each hold their local experts as ONE TE grouped Parameter (``linear_fc1.weight``, ``[L, F1, H]``): TE
  quantizes it in one ``group_quantize`` launch per pass (per-expert scales, the same numbers as one
  quantization per expert, where per-expert weights cost ~4 launches each: ~1,000 per forward of a
  128-expert Qwen3-30B-A3B layer, read off TE's source), and one grouped GEMM call takes every local
  expert, so there is no 64-expert cap, no call views, no host read (``--mok-sync-free`` runs at any
  expert count) and one weight gradient (with gradient accumulation fusion, one ``main_grad``) per
  projection. Plain state dicts keep the per-expert
  keys (``linear_fc1.weight{i}``, views of the grouped storage) and Megatron's wrapper splits the weight
  into the same per-expert dist-checkpoint ShardedTensors and stacks per-expert keys on load, so
  checkpoints move between the two layouts both ways. Megatron 0.19's own config refuses the mode outside
  its op fuser and for tensorwise / blockwise weights (FP8 primary weights need a grouped partial cast);
  MoK builds the linears with a copy of the config that asks for it, refuses FP8 primary weights
  (``--fp8-param-gather``) except MXFP8 / NVFP4, and refuses the option where TE's grouped GEMM does not
  run (``check_single_weight``).
- per-expert: TE's default route (host ``m_splits`` list, one GEMM and quantization per expert), taken
  where the grouped one cannot run. When only the cuBLASLt loaded stands in the way, the build says so
  once, in one line: the version the recipe needs and how to load it here (the ``nvidia-cublas`` wheel
  at its path; in a CUDA 12 build, CUDA 13 builds of torch and TE). ``mok env`` lists each recipe's route.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.backend import _fp8_recipe_name, check_expert_backend, expert_alignment
from mok_megatron.experts.common import pad_probs, padded_expert_mlp, scale_input
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP, read_only
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.ops.activation import apply_activation
from mok_megatron.ops.align import pad_plan, pad_rows, unpad_rows
from mok_megatron.options import ExpertBackend, MoKOptions

# cuBLASLt each quantization needs for TE's grouped GEMM (TE 2.20's is_module_grouped_tensor_path_supported;
# None: bf16). A recipe missing from an architecture's table never takes that route there.
GROUPED_CUBLASLT = {
    "sm_90": {None: 130400, "tensorwise": 130500, "blockwise": 130600},
    "sm_100": {None: 130300, "tensorwise": 130300, "mxfp8": 130300, "nvfp4": 130300},
}
GROUPED_ENV = "NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM"


def _arch(capability: tuple[int, int] | None) -> str | None:
    if capability is None:
        return None
    if tuple(capability) >= (10, 0) and tuple(capability) <= (11, 0):
        return "sm_100"
    return "sm_90" if tuple(capability)[0] == 9 else None


def _cublas(version: int) -> str:
    return f"{version // 10000}.{version % 10000 // 100}"


def required_cublaslt(capability: tuple[int, int] | None, recipe: str | None) -> int | None:
    """The cuBLASLt version TE's grouped GEMM needs for ``recipe`` (None: bf16) on this GPU; None where
    that route never runs the recipe (delayed scaling, blocks on Blackwell, MXFP8 on Hopper, ...)."""
    table = GROUPED_CUBLASLT.get(_arch(capability))
    return None if table is None else table.get(recipe)


@dataclass(frozen=True)
class GroupedRoute:
    """How the TE backend calls TE, decided once at build.

    grouped  TE's device-driven grouped GEMM (device splits); False: TE's per-expert route
    note     the one line said at build when only the cuBLASLt loaded keeps the grouped route off
    reason   why the per-expert route ("" on the grouped route), with the fix where a cuBLASLt is the reason
    """

    grouped: bool
    note: str | None = None
    reason: str = ""


def _cublas_fix(need: int, cublaslt: int, wheel) -> str:
    """How to load a cuBLASLt >= ``need`` into this process, which loaded ``cublaslt``; ``wheel``: this
    environment's ``compat.CublasWheel`` (None: unknown)."""
    from packaging.version import Version

    major = cublaslt // 10000
    if major < 13:  # the wheel's libcublasLt.so.13 is another soname, which a CUDA 12 build never loads
        return (
            f"this is a CUDA {major} build of torch / Transformer Engine, into which no CUDA 13 cuBLASLt "
            "can be preloaded; install CUDA 13 builds of both (torch from "
            "https://download.pytorch.org/whl/cu130, pip install 'transformer_engine[pytorch,core_cu13]')"
        )
    lib = wheel.lib_dir if wheel is not None else "<site-packages>/nvidia/cu13/lib"
    preload = f'start with LD_PRELOAD="{lib}/libcublasLt.so.13 {lib}/libcublas.so.13"'
    pin = f"'nvidia-cublas>={_cublas(need)}'"
    if wheel is None or wheel.version is None:
        return f"pip install {pin} and {preload}"
    if Version(wheel.version) < Version(_cublas(need)):
        return f"nvidia-cublas {wheel.version} is installed: pip install -U {pin} and {preload}"
    return f"nvidia-cublas {wheel.version} is installed but not loaded: {preload}"


def grouped_route(
    *,
    env: str | None,
    te_supports: bool | None,
    capability: tuple[int, int] | None,
    cublaslt: int | None,
    recipe: str | None,
    wheel=None,
) -> GroupedRoute:
    """The route for this GPU, cuBLASLt and recipe (None: bf16). ``env``: the value of
    ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM`` ("0" keeps the per-expert route); ``te_supports``: TE's
    own predicate for this recipe here (None: this TE has no grouped route); ``wheel``: this environment's
    ``compat.CublasWheel``, named in the note's fix (None: unknown)."""
    name = recipe or "bf16"
    if env == "0":
        return GroupedRoute(False, reason=f"{GROUPED_ENV}=0")
    if te_supports is None:
        return GroupedRoute(False, reason="this Transformer Engine has no grouped GEMM route (TE >= 2.20)")
    if te_supports:
        return GroupedRoute(True)
    cap = f"sm_{capability[0]}{capability[1]}" if capability is not None else "this GPU"
    need = required_cublaslt(capability, recipe)
    if need is None:
        return GroupedRoute(False, reason=f"TE's grouped GEMM does not take {name} on {cap}")
    if cublaslt is None or cublaslt >= need:  # nothing a newer cuBLASLt would change
        return GroupedRoute(False, reason=f"TE's is_module_grouped_tensor_path_supported refuses {name} here")
    why = (
        f"needs cuBLASLt >= {_cublas(need)} on {cap}, this process loaded {_cublas(cublaslt)}; "
        + _cublas_fix(need, cublaslt, wheel)
    )
    return GroupedRoute(
        False, f"--mok-expert-backend te runs {name} on TE's per-expert GEMMs: its grouped GEMM {why}.", why
    )


def route_for(config) -> GroupedRoute:
    """``grouped_route`` for ``config`` on this process's GPU, TE and cuBLASLt."""
    from mok_megatron.compat import (
        cublas_wheel,
        cuda_capability,
        quantization_recipe,
        te_cublaslt_version,
        te_grouped_tensor_predicate,
    )

    predicate = te_grouped_tensor_predicate()
    capability = cuda_capability()
    if capability is None:
        return GroupedRoute(False, reason="no CUDA GPU")
    if predicate is None:
        return grouped_route(env=None, te_supports=None, capability=capability, cublaslt=None, recipe=None)
    dtype = torch.float32
    if getattr(config, "bf16", False) or getattr(config, "fp16", False):
        dtype = torch.bfloat16 if getattr(config, "bf16", False) else torch.float16
    return grouped_route(
        env=os.environ.get(GROUPED_ENV),
        te_supports=bool(predicate(quantization_recipe(config), dtype)),
        capability=capability,
        cublaslt=te_cublaslt_version(),
        recipe=_fp8_recipe_name(config),
        wheel=cublas_wheel(),
    )


def _recipe_config(recipe: str | None):
    """A bf16 ``TransformerConfig`` under Megatron's ``recipe`` (None: bf16 alone), for ``route_for``."""
    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.transformer import TransformerConfig

    quant = {}
    if recipe == "nvfp4":
        quant = dict(fp4="e2m1", fp4_recipe=Fp4Recipe.nvfp4)
    elif recipe is not None:
        quant = dict(fp8="e4m3", fp8_recipe=Fp8Recipe(recipe))
    with warnings.catch_warnings():  # Megatron's notes on options a one-layer config leaves at their defaults
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=1,
            bf16=True,
            params_dtype=torch.bfloat16,
            **quant,
        )


def recipe_routes(recipes) -> dict[str, GroupedRoute]:
    """``route_for`` each of ``recipes`` (Megatron's names; None: bf16) on this process's GPU, TE and
    cuBLASLt, keyed by name ("bf16" for None): the routes ``mok env`` lists."""
    return {recipe or "bf16": route_for(_recipe_config(recipe)) for recipe in recipes}


def grouped_alignment(config) -> int:
    """Rows per expert TE's grouped route needs: FP8 blocks (and MXFP8) whole 128-row tiles, the other
    recipes Megatron's alignment (``experts.backend.expert_alignment``)."""
    base = expert_alignment(ExpertBackend.TE, config)
    return max(base, 128) if _fp8_recipe_name(config) in ("blockwise", "mxfp8") else base


def expert_calls(num_local_experts: int) -> tuple[tuple[int, int], ...]:
    """Contiguous expert ranges ``[lo, hi)`` of at most ``compat.TE_GROUPED_GEMM_MAX_WEIGHTS`` experts,
    one TE grouped GEMM call each."""
    from mok_megatron.compat import TE_GROUPED_GEMM_MAX_WEIGHTS as cap

    return tuple((lo, min(lo + cap, num_local_experts)) for lo in range(0, num_local_experts, cap))


def check_grouped_calls(num_local_experts: int, sync_free: bool) -> None:
    """Raise ``MoKConfigError`` where the grouped route would need a host read that ``--mok-sync-free``
    forbids: more local experts than one TE grouped GEMM call takes."""
    from mok_megatron.compat import TE_GROUPED_GEMM_MAX_WEIGHTS as cap

    if sync_free and num_local_experts > cap:
        raise MoKConfigError(
            f"--mok-sync-free with --mok-expert-backend te and {num_local_experts} local experts: TE's "
            f"grouped GEMM takes at most {cap} experts per call, and splitting the rows between calls "
            f"reads their boundary on the host. Raise --expert-model-parallel-size until each rank holds "
            f"<= {cap} experts, add --mok-te-single-weight (one call at any expert count), or drop "
            "--mok-sync-free."
        )


def check_single_weight(
    *,
    supported: bool,
    route: GroupedRoute,
    recipe: str | None,
    env: str | None,
    fp8_param: bool,
    te_version: str | None,
) -> None:
    """Raise ``MoKConfigError`` (one line: the value, the constraint, the fix) where
    ``--mok-te-single-weight`` cannot run: a TE without ``GroupedLinear(single_grouped_weight=...)`` on
    its grouped GEMM (``supported`` False), a process where TE's grouped GEMM does not run ``recipe``
    (None: bf16; ``env``: ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM``), or FP8 primary weights
    (``fp8_param``) other than MXFP8 / NVFP4."""
    flag = "--mok-te-single-weight"
    if not supported:
        raise MoKConfigError(
            f"{flag}: Transformer Engine {te_version or '(not installed)'} has no single grouped weight on "
            "its grouped GEMM (GroupedLinear's single_grouped_weight with use_grouped_tensor, TE >= 2.20); "
            f"pip install 'transformer-engine[pytorch]>=2.20' or drop {flag}."
        )
    name = recipe or "bf16"
    if not route.grouped:
        if env == "0":
            why = f"{GROUPED_ENV}=0 turns it off; unset it or drop {flag}"
        elif route.note:
            why = route.note.rstrip(".") + f"; or drop {flag}"
        else:
            why = (
                f"TE's is_module_grouped_tensor_path_supported refuses {name} on this GPU (sm_90: bf16, "
                f"tensorwise, blockwise; sm_100: bf16, tensorwise, mxfp8, nvfp4); drop {flag}"
            )
        raise MoKConfigError(f"{flag} needs TE's grouped GEMM, which does not run {name} here: {why}.")
    if fp8_param and recipe not in ("mxfp8", "nvfp4"):
        raise MoKConfigError(
            f"{flag} with --fp8-param-gather and --fp8-recipe {name}: TE's single grouped weight keeps FP8 "
            "primary weights only for mxfp8 / nvfp4 (the distributed optimizer's cast into a grouped FP8 "
            f"weight exists for those alone); drop --fp8-param-gather or {flag}."
        )


def padded_counts_host(counts_L: torch.Tensor, alignment: int) -> list[int]:
    """Per-expert padded row counts on the host (TE's ``m_splits``): one device-to-host read."""
    from mok_megatron.compat import te_m_splits

    counts_L = counts_L.long()
    return te_m_splits((counts_L + alignment - 1) // alignment * alignment)


def static_padded_rows(real_rows: int, num_experts: int, alignment: int) -> int:
    """Rows of the padded buffer without a host read: the worst case (each non-empty expert padded by
    ``alignment - 1``) rounded up to ``alignment``, so that the spare rows form whole groups."""
    from mok_megatron.kernels.routing import num_rows_bound

    bound = num_rows_bound(real_rows, num_experts, alignment)
    return (bound + alignment - 1) // alignment * alignment


def splits_owning_tail(padded_L: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``padded_L`` with the last expert extended to ``num_rows``: the splits cover the whole buffer, so
    TE leaves no row unwritten (device ops only, no host read)."""
    if padded_L.numel() == 0:
        return padded_L
    last = padded_L.new_full((1,), num_rows) - padded_L[:-1].sum(0, keepdim=True)
    return torch.cat([padded_L[:-1], last])


def _mlp(x_PH, probs_P, splits, fc1, fc2, act, live=None):
    """``fc2(act(fc1(x)) * probs)`` on rows TE's calls cover (``splits``); ``live``: rows at and past it
    are a static buffer's spare rows, skipped by the fused activation."""
    return fc2(apply_activation(fc1(x_PH, splits)[0], act, probs_P, live), splits)[0]


def te_expert_mlp(
    x_RH,
    probs_R,
    counts_L,
    linear_fc1,
    linear_fc2,
    act,
    alignment,
    *,
    apply_probs_on_input=False,
    grouped=False,
    calls=None,
):
    """The MLP through TE GroupedLinear modules (``module(x, m_splits) -> (y, bias)``, Megatron's
    wrapper contract). Runs under whatever FP8 context the caller entered (Megatron's block does).

    ``alignment``: rows per expert TE needs that the rows do not have yet (1: the dispatcher padded them,
    or none needed). Routes (see the module docstring):
    - per-expert (``grouped`` False): host ``m_splits`` (one read of the counts).
    - grouped, one call: CUDA int64 splits, no host read; the padded buffer has the static row bound,
      its spare rows owned by the last expert.
    - grouped, several calls (``calls``: ``((lo, hi, fc1, fc2), ...)``, ``linear_fc1`` / ``linear_fc2``
      unused): the counts read on the host once; the padded buffer sized exactly and cut at the calls'
      row boundaries, each call's splits on the device; the outputs concatenated."""
    from mok_megatron.compat import te_m_splits_device

    if apply_probs_on_input:
        x_RH, probs_R = scale_input(x_RH, probs_R)
    if calls is not None:
        return _te_calls_mlp(x_RH, probs_R, counts_L, calls, act, alignment)
    if grouped:
        padded_L = (counts_L.to(x_RH.device).long() + alignment - 1) // alignment * alignment
        if alignment == 1:  # the rows as they are; spare rows (if any) outside the splits
            splits = te_m_splits_device(padded_L, x_RH.device)
            live = splits.sum(0, keepdim=True)
            return _mlp(x_RH, probs_R, splits, linear_fc1, linear_fc2, act, live)
        num_rows = static_padded_rows(x_RH.shape[0], padded_L.numel(), alignment)
        splits = te_m_splits_device(splits_owning_tail(padded_L, num_rows), x_RH.device)
        m_splits = splits
    else:
        m_splits = padded_counts_host(counts_L, alignment)
        if alignment == 1:  # nothing to pad (TE bf16): skip the scatter / gather
            return _mlp(x_RH, probs_R, m_splits, linear_fc1, linear_fc2, act)
        num_rows = sum(m_splits)

    def fc1(x_PH, plan):
        return linear_fc1(x_PH, m_splits)[0]

    def fc2(a_PF, plan):
        return linear_fc2(a_PF, m_splits)[0]

    return padded_expert_mlp(x_RH, probs_R, counts_L, fc1, fc2, act, alignment, num_rows=num_rows)


def _te_calls_mlp(x_RH, probs_R, counts_L, calls, act, alignment):
    """``te_expert_mlp`` over several TE calls (each at most 64 experts); see there."""
    from mok_megatron.compat import te_m_splits_device

    counts_host = counts_L.cpu().long()  # the one host read (none for the exact plan's host counts)
    padded_host = (counts_host + alignment - 1) // alignment * alignment
    num_rows = int(padded_host.sum())
    plan = None
    if alignment > 1:
        plan = pad_plan(counts_L.to(x_RH.device).long(), alignment, x_RH.shape[0], num_rows)
        x_PH, probs_P = pad_rows(x_RH.contiguous(), plan), pad_probs(probs_R, plan)
    else:
        x_PH, probs_P = x_RH, probs_R
    rows = [int(padded_host[lo:hi].sum()) for lo, hi, _, _ in calls]
    spare = x_PH.shape[0] - num_rows  # rows nothing is routed to (a static buffer's): not computed
    pieces = rows + [spare] if spare else rows
    outs = []
    for (lo, hi, fc1, fc2), x_c, p_c in zip(calls, x_PH.split(pieces), probs_P.split(pieces), strict=False):
        splits = te_m_splits_device(padded_host[lo:hi], x_RH.device)
        outs.append(_mlp(x_c, p_c, splits, fc1, fc2, act))
    if spare:
        outs.append(outs[-1].new_zeros(spare, outs[-1].shape[1]))
    y_PH = torch.cat(outs) if len(outs) > 1 else outs[0]
    return y_PH if plan is None else unpad_rows(y_PH, plan)


def single_config(config):
    """A copy of ``config`` asking Megatron's TE wrapper for a single grouped weight
    (``moe_single_grouped_weight``); no ``__post_init__``: ``config`` was validated when built, and
    Megatron's rule against the mode outside its op fuser does not apply to MoK's own GEMM calls."""
    import copy

    out = copy.copy(config)
    out.moe_single_grouped_weight = True
    return out


def check_grouped_weight_built(linear, config) -> None:
    """Raise ``MoKConfigError`` unless TE built ``linear`` with its single grouped weight (a TE that drops
    ``single_grouped_weight`` warns and falls back to per-expert weights). Weights on the meta device
    are grouped when materialised (``reset_parameters``): only the flag is checked then."""
    grouped = getattr(linear, "single_grouped_weight", False)
    if grouped and not getattr(config, "init_model_with_meta_device", False):
        grouped = getattr(linear, "weight", None) is not None
    if not grouped:
        raise MoKConfigError(
            f"--mok-te-single-weight: Transformer Engine built {type(linear).__name__} with one weight per "
            "expert (its single_grouped_weight was dropped; TE's warning above says why); drop "
            "--mok-te-single-weight or use a TE whose GroupedLinear keeps it (>= 2.20)."
        )


def expert_weights(linear, num_local_experts: int) -> list[torch.Tensor]:
    """The experts' weights of one TE GroupedLinear, expert order: its single grouped weight's members
    (views of its storage) or its ``weight{i}`` Parameters."""
    from mok_megatron.compat import te_grouped_weight_members

    grouped = getattr(linear, "weight", None)
    if grouped is not None and getattr(linear, "single_grouped_weight", False):
        return te_grouped_weight_members(grouped)
    return [getattr(linear, f"weight{i}") for i in range(num_local_experts)]


def _per_expert_state_dict_keys(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: each single grouped weight (``linear_fc{1,2}.weight``) written as the
    per-expert keys the per-expert layout has (``linear_fc{1,2}.weight{i}``, views of its storage), so a
    state dict is the same whichever way the layer holds its weights (TE and Megatron's wrapper stack
    the keys again on load)."""
    from mok_megatron.compat import te_grouped_weight_members

    for name in ("linear_fc1", "linear_fc2"):
        value = state_dict.pop(f"{prefix}{name}.weight", None)
        if value is None:
            continue
        for i, member in enumerate(te_grouped_weight_members(value)):
            state_dict[f"{prefix}{name}.weight{i}"] = member


def to_te_layout(sd: dict, prefix: str, num_local_experts: int) -> None:
    """In place: rewrite expert weights under ``prefix`` (MoK stacked or SequentialMLP layout) into TE
    GroupedLinear's (``linear_fc{1,2}.weight{i}``, one ``_extra_state`` per linear). TE-layout dicts are
    left as they are."""
    from mok_megatron.experts.checkpoint import detect_layout, from_mok_layout, to_mok_layout

    layout = detect_layout(sd, prefix)
    if layout in (None, "te_grouped"):
        return
    to_mok_layout(sd, prefix, num_local_experts)
    from_mok_layout(sd, prefix, "te_grouped")


def _per_gemm_names(index: int) -> tuple[str, str]:
    return f"weight{index}", f"bias{index}"


def _has_pending_wgrad(module) -> bool:
    """Whether a TE module holds a deferred weight gradient (``delay_wgrad_compute``) not yet computed."""
    store = getattr(module, "wgrad_store", None)
    if store is None or not module.need_backward_dw():
        return False
    context = getattr(store, "context", None)
    return context is not None and not context.empty()


class TECallViews:
    """TE GroupedLinear modules over contiguous expert ranges of one TE GroupedLinear (``linear``): view
    ``c`` has ``hi - lo`` GEMMs whose ``weight{i}`` / ``bias{i}`` are ``linear``'s ``weight{lo+i}`` /
    ``bias{lo+i}`` themselves, so their gradients (and ``main_grad`` with gradient accumulation fusion)
    land on ``linear``'s Parameters. The views are not submodules: ``linear`` alone owns the Parameters,
    the state dict, the checkpoint and Megatron DDP's hooks. Each view keeps its own TE state (quantizers,
    FP8 weight workspaces, deferred weight gradients); ``begin`` copies ``linear``'s training mode and
    ``is_first_microbatch`` (Megatron resets the latter on ``linear`` every step) before a forward.

    ``make(num_gemms)``: a module of ``linear``'s class and settings with that many GEMMs, built without
    allocating or initialising weights (they are replaced here)."""

    def __init__(self, linear, ranges: tuple[tuple[int, int], ...], make):
        self.linear = linear
        self.ranges = ranges
        self.views = []
        for lo, hi in ranges:
            view = make(hi - lo)
            for i in range(hi - lo):
                for name, src in zip(_per_gemm_names(i), _per_gemm_names(lo + i), strict=True):
                    value = getattr(linear, src)
                    if name in view._parameters:
                        view._parameters[name] = value
                    else:
                        setattr(view, name, value)
            view.use_grouped_tensor = getattr(linear, "use_grouped_tensor", False)
            self.views.append(view)

    def begin(self) -> None:
        """Before a forward: the views follow ``linear``'s mode and first-microbatch flag."""
        first = getattr(self.linear, "is_first_microbatch", None)
        for view in self.views:
            view.train(self.linear.training)
            if first is not None:
                view.is_first_microbatch = first

    def end(self) -> None:
        """After a forward: ``linear`` saw its microbatch, as after its own forward."""
        if hasattr(self.linear, "is_first_microbatch"):
            self.linear.is_first_microbatch = False

    def backward_dw(self) -> None:
        """The views' deferred weight gradients, then ``linear``'s wgrad hooks once (Megatron DDP registers
        them on ``linear``, one per Parameter; a view has none)."""
        pending = [v for v in self.views if _has_pending_wgrad(v)]
        for view in pending:
            view.backward_dw()
        if pending:
            trigger = getattr(self.linear, "_trigger_wgrad_accumulation_and_reduce_hooks", None)
            if trigger is not None:
                trigger()


def _view_factory(cls, config, in_size: int, out_size: int, pg, **kwargs):
    """``make(num_gemms)`` for ``TECallViews``: Megatron's wrapper ``cls`` with ``config``'s settings, its
    weights on the meta device (no allocation, no initialisation: no RNG draw)."""
    import copy

    meta_config = copy.copy(config)  # no __post_init__: the config was validated when built
    meta_config.use_cpu_initialization = False
    meta_config.init_model_with_meta_device = True
    meta_config.perform_initialization = False

    def make(num_gemms: int):
        return cls(num_gemms, in_size, out_size, config=meta_config, pg_collection=pg, name=None, **kwargs)

    return make


class MoKTEGroupedMLP(MoKGroupedMLP):
    """Routed experts on TE GroupedLinear: ``forward(x, tokens_per_expert, permuted_probs) -> (out, None)``.

    ``MoKMoELayer`` builds it in place of ``MoKGroupedMLP`` when the options ask for ``expert_backend='te'``
    (``experts.protocol.experts_class``). TE keeps one Parameter per expert (``linear_fc1.weight{i}``), or
    with ``--mok-te-single-weight`` one grouped Parameter per projection (``linear_fc1.weight``);
    ``stacked_fc1_weight`` / ``stacked_fc2_weight`` stack them read-only as the other backends do."""

    backend = ExpertBackend.TE

    @classmethod
    def contract(cls, config, mok_config: MoKConfig, options) -> ExpertsContract:
        """TE's per-expert route reads the counts on the host (``m_splits``) and wants the recipe's row
        alignment; the grouped route takes them on the device (one call: no host read) padded to its own
        alignment (``grouped_alignment``: 128 for FP8 blocks); so does a single grouped weight at any
        expert count."""
        route = route_for(config)
        if not route.grouped:
            alignment = expert_alignment(ExpertBackend.TE, config)
            return ExpertsContract(mok=True, alignment=alignment, host_counts=True)
        single = bool(getattr(options, "te_single_weight", False))
        several = not single and len(expert_calls(mok_config.num_local_experts)) > 1
        return ExpertsContract(mok=True, alignment=grouped_alignment(config), host_counts=several)

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        name: str | None = None,
        mok_config: MoKConfig | None = None,
        options: MoKOptions | None = None,
        aligned_input: int = 1,
    ):
        from mok_megatron.compat import (
            cuda_capability,
            have_te,
            te_grouped_linear_classes,
            te_single_grouped_weight_supported,
            te_single_param_env,
            te_version,
        )

        MegatronModule.__init__(self, config=config)
        options = options if options is not None else MoKOptions(expert_backend=ExpertBackend.TE)
        cfg = self._setup(num_local_experts, config, pg_collection, mok_config, options, aligned_input)
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        contract = self.contract(config, cfg, self.options)
        route = route_for(config)
        single = self.options.te_single_weight
        if route.grouped and not single:  # its own reason first: more experts than one grouped call takes
            check_grouped_calls(num_local_experts, self.options.sync_free)
        if not route.grouped and route.note:  # before the checks whose fixes point at it
            warnings.warn(route.note, stacklevel=2)
        check_expert_backend(  # the recipe against this GPU before the single weight's own conditions
            ExpertBackend.TE,
            config,
            device,
            have_te=have_te(),
            sync_free=self.options.sync_free,
            host_counts=contract.host_counts,
            recompute_activation=cfg.recompute_activation,
            capability=cuda_capability(),
        )
        if single:
            check_single_weight(
                supported=te_single_grouped_weight_supported(),
                route=route,
                recipe=_fp8_recipe_name(config),
                env=os.environ.get(GROUPED_ENV),
                fp8_param=bool(getattr(config, "fp8_param", False) or getattr(config, "fp4_param", False)),
                te_version=te_version(),
            )
        self.route = route
        self.expert_backend = ExpertBackend.TE
        self.expert_alignment = contract.alignment
        self.input_size = config.hidden_size
        fc1_cls, fc2_cls = te_grouped_linear_classes()
        fc1_in = self.input_size if config.moe_latent_size is None else config.moe_latent_size
        fc1_out = cfg.activation.fc1_multiplier() * config.moe_ffn_hidden_size
        fc2_out = config.hidden_size if config.moe_latent_size is None else config.moe_latent_size
        fc1_kwargs = dict(
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            is_expert=True,
            tp_comm_buffer_name="fc1",
        )
        fc2_kwargs = dict(
            init_method=config.output_layer_init_method,
            bias=False,
            skip_bias_add=True,
            is_expert=True,
            tp_comm_buffer_name="fc2",
        )
        # Exactly TEGroupedMLP.__init__'s calls (megatron/core/transformer/moe/experts.py, 0.19); a single
        # grouped weight through the config field Megatron's wrapper reads (``single_config``), with TE's
        # environment gate open while TE constructs.
        linear_config = single_config(config) if single else config
        with te_single_param_env() if single else contextlib.nullcontext():
            self.linear_fc1 = fc1_cls(
                num_local_experts,
                fc1_in,
                fc1_out,
                config=linear_config,
                pg_collection=pg,
                name=(name + ".linear_fc1") if name is not None else None,
                **fc1_kwargs,
            )
            self.linear_fc2 = fc2_cls(
                num_local_experts,
                config.moe_ffn_hidden_size,
                fc2_out,
                config=linear_config,
                pg_collection=pg,
                name=(name + ".linear_fc2") if name is not None else None,
                **fc2_kwargs,
            )
        self.single_weight = single
        if single:
            for linear in (self.linear_fc1, self.linear_fc2):
                check_grouped_weight_built(linear, config)
            self.register_state_dict_post_hook(_per_expert_state_dict_keys)
        # The route is MoK's decision (Megatron's wrappers leave TE to read NVTE_GROUPED_LINEAR_USE_FUSED_
        # GROUPED_GEMM at construction; TE reads the attribute at every forward).
        for linear in (self.linear_fc1, self.linear_fc2):
            if hasattr(linear, "use_grouped_tensor"):
                linear.use_grouped_tensor = route.grouped
        self._views = None  # (fc1 views, fc2 views): more local experts than one TE call takes
        ranges = expert_calls(num_local_experts)
        if route.grouped and not single and len(ranges) > 1:
            self._views = (
                TECallViews(
                    self.linear_fc1,
                    ranges,
                    _view_factory(fc1_cls, config, fc1_in, fc1_out, pg, **fc1_kwargs),
                ),
                TECallViews(
                    self.linear_fc2,
                    ranges,
                    _view_factory(fc2_cls, config, config.moe_ffn_hidden_size, fc2_out, pg, **fc2_kwargs),
                ),
            )
        self.wgrad_queue = None  # TE defers weight gradients itself (delay_wgrad_compute)
        self._wgrad_hooks = []

    def reset_parameters(self) -> None:  # TE initialises its weights (config.init_method)
        return None

    @property
    def stacked_fc1_weight(self) -> torch.Tensor:
        """fc1's weights ``[L, F1, H]`` (``linear_fc1.weight{l}``, or the single grouped weight's member l,
        at slice l), read-only (``read_only``)."""
        return read_only(expert_weights(self.linear_fc1, self.num_local_experts))

    @property
    def stacked_fc2_weight(self) -> torch.Tensor:
        """fc2's weights ``[L, H, F]`` (as ``stacked_fc1_weight``), read-only (``read_only``)."""
        return read_only(expert_weights(self.linear_fc2, self.num_local_experts))

    def late_wgrad(self):
        return None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        cfg = self.mok_config
        # Rows the dispatcher already padded (aligned plan) go straight to TE's GEMMs.
        alignment = 1 if self.aligned_input >= self.expert_alignment else self.expert_alignment
        calls = None
        if self._views is not None:
            fc1_views, fc2_views = self._views
            fc1_views.begin()
            fc2_views.begin()
            calls = tuple(
                (lo, hi, f1, f2)
                for (lo, hi), f1, f2 in zip(fc1_views.ranges, fc1_views.views, fc2_views.views, strict=True)
            )
        out = te_expert_mlp(
            permuted_local_hidden_states,
            permuted_probs,
            tokens_per_expert,
            self.linear_fc1,
            self.linear_fc2,
            cfg.activation,
            alignment,
            apply_probs_on_input=cfg.apply_probs_on_input,
            grouped=self.route.grouped,
            calls=calls,
        )
        if self._views is not None:
            self._views[0].end()
            self._views[1].end()
        return out, None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Nothing here: Megatron's DDP visits every module holding the parameter, so it registers the
        hook on the TE linears themselves (which fire it in their backward_dw, or ``TECallViews`` for
        them), as for TEGroupedMLP (which has no such method). Registering here as well would reduce
        the gradient twice."""
        return None

    def backward_dw(self) -> None:
        """TE's deferred weight gradients (``delay_wgrad_compute``), fc2 then fc1 as ``TEGroupedMLP``."""
        if self._views is not None:
            self._views[1].backward_dw()
            self._views[0].backward_dw()
            return
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        to_te_layout(state_dict, prefix, self.num_local_experts)
        MegatronModule._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``TEGroupedMLP``'s own mapping (its keys are ``SequentialMLP``'s, so MoK's too)."""
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        return TEGroupedMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata)
