"""CPU mode: run Megatron-Core's MoE path (and ours) on a machine without a GPU, over gloo.

Megatron-Core 0.19 assumes CUDA in a handful of places that have nothing to do with the math.
``enable()`` handles each of them here, in one module, so the same model code runs on a CPU box
(CI, laptops) exactly as it does on a GPU:

1. ``torch.cuda.Stream`` / ``Event`` / ``stream()`` / ``current_stream()`` / ``synchronize()``:
   the alltoall dispatcher and ``SharedExpertMLP`` create side streams in their constructors.
   On CPU every op is synchronous, so stream and event objects become inert stand-ins.
2. ``torch.cuda.current_device()``: used as ``device=`` for new tensors (router buffers,
   ``_AllToAll`` outputs, linear weights). It returns ``"cpu"``.
3. Collectives gloo rejects: split sizes given to ``all_to_all_single`` as tensors (gloo takes only
   lists of ints; converted here), and ``all_gather`` / ``reduce_scatter`` with pieces of unequal
   size (Megatron's expert-TP gather/scatter; gloo needs equal pieces, so they are padded).
4. ``device="cuda"`` written into Megatron code: the default causal attention mask
   (``transformer.utils.get_default_causal_mask``, also bound in ``fusions.fused_softmax``).
5. The CUDA RNG: ``model_parallel_cuda_manual_seed`` and Megatron's RNG tracker save, fork and
   restore CUDA generator states. In CPU mode they use the CPU generator instead, so tracked
   forks (expert-parallel init, dropout) keep their meaning.

Usage::

    import mok_megatron.training.cpu
    mok_megatron.training.cpu.enable()      # before building Megatron modules
    ...
    mok_megatron.training.cpu.disable()     # restores everything it replaced

``enable()`` refuses on a machine where CUDA is available (pass ``force=True`` to override):
there the real CUDA paths should run.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import torch.distributed as dist

_lock = threading.Lock()
_saved: list[tuple[object, str, object]] = []


class CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU, where every op completes in program order."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


class CpuEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT = CpuStream()


@contextlib.contextmanager
def _stream_ctx(stream=None):
    yield stream


def _split_list(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    if isinstance(sizes, torch.Tensor):
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]


def _make_all_to_all_single(orig):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **kw):
        return orig(output, input, _split_list(output_split_sizes), _split_list(input_split_sizes), *a, **kw)

    all_to_all_single.__wrapped__ = orig
    return all_to_all_single


def _pad0(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))], 0)


def _make_all_gather(orig):
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list}
        if len(shapes) == 1 or async_op:
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        # gloo only gathers equal shapes: pad every piece to the largest along dim 0.
        width = max(t.shape[0] for t in tensor_list)
        padded = [torch.empty((width,) + tuple(t.shape[1:]), dtype=t.dtype) for t in tensor_list]
        orig(padded, _pad0(tensor, width).contiguous(), group=group)
        for dst, src in zip(tensor_list, padded, strict=True):
            dst.copy_(src[: dst.shape[0]])

    all_gather.__wrapped__ = orig
    return all_gather


def _make_reduce_scatter(orig):
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in input_list}
        if len(shapes) == 1 or async_op:
            return orig(output, input_list, op=op, group=group, async_op=async_op)
        width = max(t.shape[0] for t in input_list)
        out = torch.empty((width,) + tuple(output.shape[1:]), dtype=output.dtype)
        orig(out, [_pad0(t, width).contiguous() for t in input_list], op=op, group=group)
        output.copy_(out[: output.shape[0]])

    reduce_scatter.__wrapped__ = orig
    return reduce_scatter


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


class _DropRngWarning:
    """Megatron's RNG tracker warns when the CPU RNG moves inside a forked CUDA RNG context; in CPU
    mode the tracked generator *is* the CPU one, so every fork would warn."""

    def filter(self, record) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_FILTER = _DropRngWarning()


def _replace(obj, name: str, value) -> None:
    _saved.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def is_enabled() -> bool:
    return bool(_saved)


def enable(force: bool = False) -> None:
    """Switch this process to CPU mode (idempotent). See the module docstring for what changes."""
    with _lock:
        if _saved:
            return
        if torch.cuda.is_available() and not force:
            raise RuntimeError(
                "mok_megatron.training.cpu.enable(): CUDA is available on this machine, so CPU mode would "
                "hide the GPU paths. Run on the GPU, or pass force=True to use the CPU anyway."
            )
        import megatron.core.fusions.fused_softmax as mfused_softmax
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.transformer.utils as mtutils

        cuda = torch.cuda
        _replace(cuda, "Stream", CpuStream)
        _replace(cuda, "Event", CpuEvent)
        _replace(cuda, "current_stream", lambda device=None: _CURRENT)
        _replace(cuda, "default_stream", lambda device=None: _CURRENT)
        _replace(cuda, "stream", _stream_ctx)
        _replace(cuda, "synchronize", lambda device=None: None)
        _replace(cuda, "current_device", lambda: "cpu")
        _replace(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        _replace(cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
        # Seed the CPU generator only: torch.manual_seed itself calls cuda.manual_seed_all.
        _replace(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        _replace(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
        _replace(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
        _replace(mtutils, "get_default_causal_mask", _cpu_causal_mask)
        _replace(mfused_softmax, "get_default_causal_mask", _cpu_causal_mask)
        _replace(dist, "all_to_all_single", _make_all_to_all_single(dist.all_to_all_single))
        _replace(dist, "all_gather", _make_all_gather(dist.all_gather))
        _replace(dist, "reduce_scatter", _make_reduce_scatter(dist.reduce_scatter))
        logging.getLogger(mrandom.__name__).addFilter(_RNG_FILTER)


def disable() -> None:
    """Undo ``enable()``."""
    with _lock:
        if _saved:
            logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_RNG_FILTER)
        while _saved:
            obj, name, old = _saved.pop()
            setattr(obj, name, old)


def device() -> torch.device:
    """The device MoK code should allocate on in this process."""
    if is_enabled() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
