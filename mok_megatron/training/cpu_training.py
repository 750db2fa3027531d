"""CPU mode for Megatron's training loop (``megatron.training.pretrain``), on top of ``mok_megatron.training.cpu``.

``mok_megatron.training.cpu.enable()`` makes Megatron-Core's *model* code run on a CPU. The training loop
assumes a GPU in more places; ``enable()`` here adds, each seen failing without it (0.19.2):

1. ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` all over ``megatron.training`` and the DDP /
   optimizer buffers (timestamps all-reduced as CUDA tensors, loss reductions, grad buffers):
   a ``TorchFunctionMode`` (``CudaToCpu``) rewrites CUDA devices to the CPU for every torch call,
   and ``Tensor.cuda`` returns the CPU tensor; ``Tensor.type()`` names CPU tensors as CUDA ones
   (``clip_grads`` asserts ``grad.type() == "torch.cuda.FloatTensor"``). It is a per-thread mode: ``enable()`` pushes it on
   the calling thread, which must be the thread that trains.
2. ``torch.cuda`` memory statistics and device queries used for logging (``memory_allocated``,
   ``max_memory_allocated``, ``memory_stats``, ``empty_cache``, ``set_device``, ...) report zeros /
   do nothing.
3. ``initialize_megatron`` calls ``torch.cuda.set_device(local_rank)`` only when GPUs exist; the
   backend comes from ``--distributed-backend`` (use ``gloo``).
4. Each ``torch.utils.data.DataLoader`` iterator draws its workers' base seed from the loader's generator,
   else from torch's default (CPU) generator. On a GPU that draw leaves dropout's generator (CUDA) alone; in
   CPU mode the CPU generator is also the "CUDA" one dropout draws from. A resumed run creates its data
   iterator after the checkpoint's RNG states are restored, an uninterrupted one before its first step, so
   with the shared generator every dropout mask after a resume comes one draw later than in the
   uninterrupted run, and the resumed losses differ from the uninterrupted ones (either layer). Megatron's loaders get their own generator, seeded with ``--seed``: a resumed run
   trains bitwise as the uninterrupted one (docs/design.md, Megatron glue).

What the command line must say on CPU (``CPU_FLAGS``; the tiny recipe passes them): gloo, no fused
kernels (apex / TE are GPU-only), fp32, local transformer implementation, no gradient-accumulation
fusion, and ``--no-check-for-nan-in-loss-and-grad`` is *not* needed. ``check_cpu_args`` names any
flag that cannot work here.

``megatron_schedule()`` is the narrower glue for Megatron-Core's no-pipelining schedules alone (plain and
combined 1F1B EP overlap) without the training loop: scoped to a ``with`` block, restored on exit, and
needed on GPUs too (the aux-loss scale it resets is process-global).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

# Flags a CPU run needs (the tiny recipe adds them when DEVICE=cpu).
CPU_FLAGS = (
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class CudaToCpu(TorchFunctionMode):
    """Every torch call: a CUDA ``device`` argument becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts e.g. grad.type() == "torch.cuda.FloatTensor" (clip_grads.py).
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _stub(name: str, result):
    """A CPU stand-in for ``torch.cuda.<name>`` returning ``result()``. One function object per name:
    torch.compile keeps a trace rule per ``torch.cuda`` function and refuses one object under two names
    with different rules ("Duplicate torch object ... with different rules")."""

    def stub(*args, **kwargs):
        return result()

    stub.__name__ = stub.__qualname__ = name
    return stub


# ``torch.cuda`` memory queries used for logging, and device calls: zeros / no-ops on CPU.
_CUDA_STUBS = {
    **{
        n: _stub(n, int)
        for n in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
    },
    "memory_stats": _stub("memory_stats", dict),
    **{
        n: _stub(n, lambda: None)
        for n in (
            "reset_peak_memory_stats",
            "reset_max_memory_allocated",
            "empty_cache",
            "set_device",
            "ipc_collect",
        )
    },
}


def _patch_megatron_training(saved: list) -> None:
    import megatron.training.initialize as minit
    import megatron.training.training as mtrain

    def replace(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    init = minit.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        # pretrain() asserts CUDA unless allow_no_cuda; everything it guards is handled above.
        kwargs["allow_no_cuda"] = True
        return init(*args, **kwargs)

    replace(mtrain, "initialize_megatron", initialize_megatron)

    build_loader = mtrain.build_pretraining_data_loader

    def build_pretraining_data_loader(dataset, consumed_samples):
        # the base-seed draw of each data iterator stays off the CPU generator dropout uses (item 4 above)
        loader = build_loader(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            from megatron.training import get_args

            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    replace(mtrain, "build_pretraining_data_loader", build_pretraining_data_loader)
    # _initialize_distributed creates Megatron's model-parallel groups, and _set_random_seed seeds
    # the model-parallel RNG tracker, only `if torch.cuda.device_count() > 0`. Without the groups
    # nothing runs; without the seeds every tracked fork (expert init, dropout) fails. In CPU mode the
    # tracker's "CUDA" states are CPU generator states (mok_megatron.training.cpu), so both run as if one
    # device were present (set_device is a no-op here; the device id is only used for NCCL).
    for name in ("_initialize_distributed", "_set_random_seed"):
        replace(minit, name, _as_if_one_device(getattr(minit, name)))


def _as_if_one_device(fn):
    def wrapper(*args, **kwargs):
        count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.device_count = count

    wrapper.__wrapped__ = fn
    return wrapper


def enable() -> None:
    """Switch this process (and this thread's torch calls) to CPU training. Idempotent."""
    import mok_megatron.training.cpu as cpu

    with _lock:
        if _state:
            return
        cpu.enable()
        saved = {name: getattr(torch.cuda, name) for name in _CUDA_STUBS}
        for name, fn in _CUDA_STUBS.items():
            setattr(torch.cuda, name, fn)
        patched: list = []
        _patch_megatron_training(patched)
        mode = CudaToCpu()
        mode.__enter__()
        _state.update(saved=saved, patched=patched, mode=mode)


def disable() -> None:
    """Undo ``enable()`` (call from the thread that enabled it)."""
    import mok_megatron.training.cpu as cpu

    with _lock:
        if not _state:
            return
        _state["mode"].__exit__(None, None, None)
        for name, fn in _state["saved"].items():
            setattr(torch.cuda, name, fn)
        for obj, name, old in reversed(_state["patched"]):
            setattr(obj, name, old)
        _state.clear()
        cpu.disable()


def is_enabled() -> bool:
    return bool(_state)


@contextlib.contextmanager
def megatron_schedule():
    """Megatron's no-pipelining schedules (``forward_backward_no_pipelining``, plain and combined 1F1B)
    in this process, for this block.

    Always: ``MoEAuxLossAutoScaler.main_loss_backward_scale`` (transformer/moe/moe_utils.py) is
    process-global, and the schedule ``copy_``s its ``[1]``-shaped scale into whatever an earlier
    backward left there (a schedule-less backward leaves a 0-d tensor, which cannot take it): cleared
    on entry, restored on exit.

    In CPU mode (``mok_megatron.training.cpu``) two CUDA-only spots of Megatron's schedule are bridged,
    both restored on exit:

    - pipeline_parallel/schedules.py (``forward_backward_no_pipelining``) allocates its token counter
      with ``device="cuda"``: the block runs under ``CudaToCpu``, which turns a CUDA ``device`` argument
      into the CPU.
    - pipeline_parallel/utils.py (``ScheduleNode`` forward and backward) and
      models/gpt/fine_grained_callables.py (the combine node) call ``Tensor.record_stream``, the CUDA
      caching allocator's cross-stream bookkeeping, which CPU tensors reject: a no-op for CPU tensors
      (on CPU every op completes in program order). The nodes still free their inputs
      (``untyped_storage().resize_(0)``), so a phase whose output shares storage with a freed input,
      or whose backward needs one, fails here as it would on a GPU.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import mok_megatron.training.cpu as cpu_mode

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    record_stream = torch.Tensor.record_stream
    with contextlib.ExitStack() as stack:
        if cpu_mode.is_enabled():

            def cpu_record_stream(tensor, stream):
                if tensor.is_cuda:
                    record_stream(tensor, stream)

            torch.Tensor.record_stream = cpu_record_stream
            stack.callback(setattr, torch.Tensor, "record_stream", record_stream)
            stack.enter_context(CudaToCpu())
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
