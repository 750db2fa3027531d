"""Every version difference of torch / Megatron-Core / Transformer Engine / apex in one place.

Other modules import the names below instead of writing their own ``try/except ImportError``.
Nothing here imports Transformer Engine eagerly: TE is optional and is only detected.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch
from packaging.version import Version

# Megatron-Core releases this package is tested against: [min, max).
MCORE_MIN = Version("0.19.0")
MCORE_MAX = Version("0.20.0")
TESTED_MCORE = "0.19.2"


def dist_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def mcore_version() -> Version | None:
    v = dist_version("megatron-core")
    return Version(v) if v else None


def check_mcore_version() -> None:
    """Raise if the installed megatron-core is outside the range we support."""
    v = mcore_version()
    if v is None:
        raise ImportError(
            "megatron-core is not installed; mok_megatron needs megatron-core "
            f">={MCORE_MIN},<{MCORE_MAX} (pip install 'megatron-core~={TESTED_MCORE}')."
        )
    if not (MCORE_MIN <= Version(v.base_version) < MCORE_MAX):
        raise ImportError(
            f"megatron-core {v} is installed; mok_megatron supports >={MCORE_MIN},<{MCORE_MAX} "
            f"(tested with {TESTED_MCORE}). Install a supported version."
        )


@cache
def have_te() -> bool:
    """Transformer Engine for PyTorch importable (as Megatron-Core itself decides)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def te_version() -> str | None:
    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        v = dist_version(name)
        if v:
            return v
    return None


@cache
def have_apex() -> bool:
    """NVIDIA apex (not the unrelated PyPI project named ``apex``)."""
    try:
        return importlib.util.find_spec("apex.normalization") is not None
    except ModuleNotFoundError:
        return False


@cache
def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def fix_triton_interpreter_index() -> bool:
    """Triton's interpreter holds a scalar as a 1-element array and, before Triton 3.7, turns it into a
    Python int (a ``range`` bound) with ``int(array)``, which NumPy >= 2.4 rejects ("only 0-dimensional
    arrays can be converted to Python scalars"): every kernel looping to a runtime bound fails
    interpreted. Where the installed interpreter's conversion fails so, wrap its tensor patching to use
    the 0-d conversion newer Triton uses. Only the interpreter changes; compiled kernels do not. Returns
    True when wrapped."""
    import numpy as np
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return False
    # Triton >= 3.6 patches through a scope that restores the attributes after each launch.
    scope = getattr(interpreter, "_LangPatchScope", None)
    probe_scope = (scope(),) if scope else ()

    class _Probe:
        handle = type("_Handle", (), {"data": np.zeros(1, dtype=np.int32)})()

    try:
        patch(_Probe, *probe_scope)
        _Probe().__index__()
        return False
    except TypeError:
        pass
    finally:
        if probe_scope:
            probe_scope[0].restore()

    def index(self):
        return int(self.handle.data.squeeze())

    def patch_lang_tensor(tensor, *scope):
        patch(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


QUACK_MIN = Version("0.4.1")


@cache
def have_quack() -> bool:
    """QuACK (``quack-kernels`` >= 0.4.1, the ``quack`` extra) installed: its varlen-K GEMM accumulates the
    experts' weight gradients into ``main_grad`` on Hopper (``kernels.quack_wgrad``). Only detected here;
    importing it loads the CuTe DSL, so ``quack_gemm_add_inplace`` imports it on first use."""
    v = dist_version("quack-kernels")
    return v is not None and Version(v) >= QUACK_MIN and importlib.util.find_spec("quack") is not None


@cache
def quack_gemm_add_inplace():
    """QuACK's ``gemm_add_inplace`` (``out = alpha * A @ B + beta * out``, varlen-K through ``cu_seqlens_k``).
    Raises ImportError naming the fix when QuACK is missing or older than 0.4.1."""
    _require_quack()
    from quack.gemm_interface import gemm_add_inplace

    return gemm_add_inplace


@cache
def quack_gemm():
    """QuACK's ``gemm`` (``out = A @ B``, varlen-M through ``cu_seqlens_m`` or varlen-K through
    ``cu_seqlens_k``; ``A_idx``, int32, reads A's rows (varlen-M) or columns (varlen-K) through an index
    instead of a gathered copy). These keywords are the same from quack-kernels 0.4.1 on.
    Raises ImportError naming the fix when QuACK is missing or older than 0.4.1."""
    _require_quack()
    from quack.gemm_interface import gemm

    return gemm


# The tile-waiting GEMM (kernels.tile_gemm_sm90) subclasses QuACK's sm_90 GEMM and its varlen-M tile scheduler,
# internals that change between QuACK minor releases: it runs on the releases it was compiled against.
QUACK_TILE_GEMM = (Version("0.4.1"), Version("0.5.0"))


def require_quack_tile_gemm() -> None:
    """Raise ImportError naming the fix unless the installed QuACK is one whose sm_90 GEMM internals
    ``kernels.tile_gemm_sm90`` builds on (>= 0.4.1, < 0.5)."""
    lo, hi = QUACK_TILE_GEMM
    v = dist_version("quack-kernels")
    if v is None or importlib.util.find_spec("quack") is None or not lo <= Version(v) < hi:
        raise ImportError(
            f"the tile-waiting grouped GEMM needs quack-kernels >={lo},<{hi} (its sm_90 GEMM and tile scheduler "
            f"are subclassed); found {v}: pip install 'quack-kernels>={lo},<{hi}'"
        )


def _require_quack() -> None:
    if not have_quack():
        raise ImportError(
            f"QuACK is not installed (or older than {QUACK_MIN}; found {dist_version('quack-kernels')}): "
            "pip install 'mok-megatron[quack]'"
        )


def grouped_mm_fn():
    """The grouped GEMM entry point of this torch: ``F.grouped_mm`` (>= 2.10) or ``torch._grouped_mm``."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise ImportError(
            f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor "
            "torch._grouped_mm; mok_megatron needs torch>=2.9."
        )
    return fn


def current_graph_task_id() -> int:
    """The id of the autograd backward pass running now (-1 outside one; unique per pass), or -1 on a
    torch without ``torch._C._current_graph_task_id``."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn() if fn is not None else -1


def cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def use_prebuilt_dataset_helpers() -> bool:
    """megatron-core wheels ship ``megatron/core/datasets/helpers_cpp*.so`` but not the Makefile that
    ``initialize_megatron`` runs (``compile_helpers``: ``make -C .../datasets``), so stock
    ``pretrain`` exits with "Failed to compile the C++ dataset helper functions" on every machine.
    When the prebuilt module imports, compiling is unnecessary: make ``compile_helpers`` a no-op.
    A source checkout (Makefile present) keeps Megatron's behaviour. Returns True when replaced."""
    import os

    import megatron.core.datasets.utils as dutils

    if os.path.exists(os.path.join(os.path.dirname(dutils.__file__), "Makefile")):
        return False
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    dutils.compile_helpers = lambda: None
    return True


# ---- Transformer Engine expert GEMMs (mok_megatron.experts.te) ---------------------------


def te_grouped_linear_classes():
    """Megatron's TE ``GroupedLinear`` wrappers for fc1 / fc2 (what ``TEGroupedMLP``'s spec builds):
    ``(TEColumnParallelGroupedLinear, TERowParallelGroupedLinear)``. Raises ImportError without TE."""
    if not have_te():
        raise ImportError(
            "Transformer Engine is not importable: --mok-expert-backend te needs it "
            "(pip install 'mok-megatron[te]')."
        )
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )

    return TEColumnParallelGroupedLinear, TERowParallelGroupedLinear


def te_m_splits(counts_G: torch.Tensor) -> list[int]:
    """Per-GEMM row counts in the form TE's per-expert ``GroupedLinear`` path takes: a host ``List[int]``
    (``torch.split`` inside): one device-to-host read of a device tensor, as ``TEGroupedMLP`` does with
    ``tolist()``."""
    return [int(c) for c in counts_G.tolist()]


#: Per-expert weight tensors TE's cuBLASLt grouped GEMM takes in one call (``kMaxGroups`` in TE's
#: ``common/gemm/cublaslt_grouped_gemm.cu``: a fixed-size kernel-argument array; more raise in every
#: precision, measured with 128 on an H200, TE 2.20.2).
TE_GROUPED_GEMM_MAX_WEIGHTS = 64


def te_m_splits_device(counts_G: torch.Tensor, device) -> torch.Tensor:
    """Per-GEMM row counts for TE's grouped-tensor path: a CUDA int64 tensor (that path refuses a host
    list; int32 costs it one more cast). A device tensor is converted in place on its stream, never read
    on the host; a host tensor is copied from pinned memory without blocking the host."""
    if counts_G.device.type == "cpu" and torch.device(device).type == "cuda":
        return counts_G.to(torch.int64).pin_memory().to(device, non_blocking=True)
    return counts_G.to(device=device, dtype=torch.int64)


def te_cublaslt_version() -> int | None:
    """The cuBLASLt version Transformer Engine loaded (e.g. 131000 for 13.10; the ``nvidia-cublas`` wheel
    preloaded with ``LD_PRELOAD`` replaces the CUDA toolkit's), None without TE."""
    if not have_te():
        return None
    import transformer_engine_torch as tex

    return int(tex.get_cublasLt_version())


#: The CUDA 13 cuBLAS wheel on PyPI and where it puts its libraries under site-packages.
CUBLAS_WHEEL = "nvidia-cublas"
CUBLAS_WHEEL_LIB = ("nvidia", "cu13", "lib")


@dataclass(frozen=True)
class CublasWheel:
    """The ``nvidia-cublas`` wheel (CUDA 13) of this environment.

    version  the installed version ("13.10.0.20"); None: not installed
    lib_dir  the folder holding (or, not installed, where pip puts) ``libcublasLt.so.13``
    """

    version: str | None
    lib_dir: str


@cache
def cublas_wheel() -> CublasWheel:
    """The ``nvidia-cublas`` wheel: its version and its ``nvidia/cu13/lib`` folder, read from the wheel's
    file list (``nvidia.cu13`` is a namespace the CUDA runtime and NVRTC wheels share); not installed, the
    folder pip would install it to in this environment's site-packages."""
    import os
    import sysconfig

    version = dist_version(CUBLAS_WHEEL)
    for f in (importlib.metadata.files(CUBLAS_WHEEL) or ()) if version else ():
        if f.name == "libcublasLt.so.13":
            return CublasWheel(version, os.path.dirname(os.path.abspath(str(f.locate()))))
    return CublasWheel(version, os.path.join(sysconfig.get_paths()["purelib"], *CUBLAS_WHEEL_LIB))


def te_grouped_tensor_predicate():
    """TE's own test of its device-driven grouped GEMM path (``GroupedLinear(use_grouped_tensor=True)``,
    TE >= 2.20): ``is_module_grouped_tensor_path_supported(recipe, dtype) -> bool``, which reads this
    GPU and the cuBLASLt loaded. None where TE lacks the path (or is missing)."""
    if not have_te():
        return None
    try:
        from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported
    except ImportError:
        return None
    return is_module_grouped_tensor_path_supported


#: TE's gate on ``GroupedLinear(single_grouped_weight=True)`` (``resolve_grouped_linear_single_param_flags``
#: in ``transformer_engine/pytorch/utils.py``, read in ``GroupedLinear.__init__`` only): unset, TE warns
#: and falls back to one Parameter per GEMM.
TE_SINGLE_PARAM_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"


@cache
def te_single_grouped_weight_supported() -> bool:
    """Whether this TE's ``GroupedLinear`` holds its GEMMs' weights as one grouped Parameter on its
    device-driven grouped GEMM (the ``single_grouped_weight`` and ``use_grouped_tensor`` constructor
    arguments, TE >= 2.20). False without TE."""
    if not have_te():
        return False
    import inspect

    from transformer_engine.pytorch import GroupedLinear

    params = inspect.signature(GroupedLinear.__init__).parameters
    return "single_grouped_weight" in params and "use_grouped_tensor" in params


@contextmanager
def te_single_param_env():
    """``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1`` while TE GroupedLinear modules are constructed (the only place
    TE reads it), the previous value (or its absence) restored after."""
    import os

    before = os.environ.get(TE_SINGLE_PARAM_ENV)
    os.environ[TE_SINGLE_PARAM_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TE_SINGLE_PARAM_ENV, None)
        else:
            os.environ[TE_SINGLE_PARAM_ENV] = before


def te_grouped_weight_members(weight) -> list:
    """The per-GEMM tensors of a TE ``GroupedLinear``'s single grouped weight (a ``GroupedTensor``
    Parameter, shape ``[G, N, K]``): views of its storage, no copy (quantized storages stay quantized). A
    plain ``[G, N, K]`` tensor (a stacked checkpoint entry) gives its ``unbind(0)``."""
    members = getattr(weight, "quantized_tensors", None)
    if members is None and hasattr(weight, "split_into_quantized_tensors"):
        members = weight.split_into_quantized_tensors()
    return list(members if members is not None else weight.unbind(0))


def quantization_recipe(config):
    """The Transformer Engine recipe object Megatron builds for ``config`` (``fp8_utils.get_fp8_recipe`` /
    ``fp4_utils.get_fp4_recipe``), None in bf16."""
    if getattr(config, "fp4", None):
        from megatron.core.fp4_utils import get_fp4_recipe

        return get_fp4_recipe(config)
    if getattr(config, "fp8", None):
        from megatron.core.fp8_utils import get_fp8_recipe

        return get_fp8_recipe(config)
    return None


def quantization_context(config):
    """Megatron's FP8 / FP4 autocast for ``config`` (``fp8_utils.get_fp8_context`` /
    ``fp4_utils.get_fp4_context``), a null context in bf16. Megatron's ``TransformerBlock`` enters it
    around every layer; standalone layers (tests, benchmarks) enter it themselves."""
    from contextlib import nullcontext

    if getattr(config, "fp4", None):
        from megatron.core.fp4_utils import get_fp4_context

        return get_fp4_context(config)
    if getattr(config, "fp8", None):
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(config)
    return nullcontext()
