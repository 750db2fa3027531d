"""Checkpoints checked before anything loads them: a missing, truncated or unreadable checkpoint stops the
run at start-up with one line naming the file, instead of a torch error from deep inside the load.

``check_checkpoint_files(path)``: one ``torch_dist`` checkpoint directory against its own index.
``check_load(args)``: what Megatron's ``--load`` would read (``latest_checkpointed_iteration.txt`` ->
``iter_NNNNNNN``, or ``--ckpt-step``), checked the same way; ``mok-pretrain-gpt`` runs it right after
parsing. ``naming_load_errors``: Megatron's own loader wrapped so that a file that passes those checks but
still cannot be read (corrupted bytes) is reported with its checkpoint's path, an intact checkpoint whose
learning-rate schedule differs from the run's (another ``--train-iters``) is named as such with Megatron's
two flags that resume it, and the iteration loaded is logged and kept (``LoadRecord``), so that a resumed
run with nothing left to train can say so instead of exiting 0.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the path and the fix."""


def check_checkpoint_files(path: str) -> None:
    """Raise ``CheckpointError`` if ``path`` is not a complete torch_dist checkpoint: a missing
    metadata file, an unreadable index, or a data file shorter than the index says."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory).")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(
            f"checkpoint {path} has no metadata.json: it is not a dist_checkpointing checkpoint, or "
            "its save did not finish. Resume from an earlier checkpoint."
        )
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: its index (.metadata) cannot be read ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Resume from an earlier checkpoint."
        ) from e
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            have = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"checkpoint {path} is truncated: {name} {have}, its index needs {end} bytes. The save "
                "was probably interrupted or the copy is incomplete; nothing was loaded. Resume from an "
                "earlier checkpoint."
            )


def _iteration_dir(load: str, step: int | None) -> str | None:
    """The directory Megatron's ``--load`` reads, or None where it starts from scratch (no tracker file)."""
    if step is None:
        tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(tracker):
            return None
        text = open(tracker).read().strip()
        if text == "release":
            return os.path.join(load, "release")
        try:
            step = int(text)
        except ValueError:
            raise CheckpointError(
                f"checkpoint tracker {tracker} holds {text!r}, not an iteration number or 'release'. "
                "Fix or delete the file (Megatron rewrites it at the next save)."
            ) from None
    return os.path.join(load, f"iter_{step:07d}")


def check_load(args) -> None:
    """Check the checkpoint ``--load`` points at before Megatron reads it (torch_dist format)."""
    load = getattr(args, "load", None)
    if not load:
        return
    if not os.path.isdir(load):
        raise CheckpointError(f"--load {load}: no such directory. Point --load at a checkpoint directory.")
    path = _iteration_dir(load, getattr(args, "ckpt_step", None))
    if path is None:
        return  # Megatron starts from scratch and says so
    if getattr(args, "ckpt_format", "torch_dist") == "torch_dist":
        check_checkpoint_files(path)
    elif not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory).")


# Megatron's OptimizerParamScheduler._check_and_set, when a saved schedule value differs from the run's.
_SCHEDULE_MISMATCH = re.compile(
    r"OptimizerParamScheduler: class input value (\S+) and checkpoint ?value (\S+) for (.+?) do not match"
)


def _schedule_mismatch(load: str | None, e: AssertionError) -> CheckpointError | None:
    m = _SCHEDULE_MISMATCH.search(str(e))
    if m is None:
        return None
    here, saved, name = m.groups()
    unit = " (in samples: iterations x --global-batch-size)" if "iterations" in name else ""
    return CheckpointError(
        f"checkpoint under --load {load} is intact, but its learning-rate schedule differs from this run's: "
        f"{name} is {saved} in the checkpoint and {here} here{unit}; --train-iters, --lr-decay-iters, "
        "--lr-warmup-iters and the learning rates set it. Add --override-opt_param-scheduler to continue "
        "with this run's schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's."
    )


@dataclass
class LoadRecord:
    """What ``naming_load_errors`` saw Megatron load: the checkpoint's iteration (None: nothing loaded)."""

    load: str | None
    iteration: int | None = None

    def nothing_trained(self, train_iters: int | None) -> CheckpointError | None:
        """The error for a resumed run that had no iteration left to train, else None."""
        if not self.iteration or train_iters is None or self.iteration < train_iters:
            return None
        return CheckpointError(
            f"the checkpoint under --load {self.load} is at iteration {self.iteration} and --train-iters is "
            f"{train_iters}: nothing was trained. Raise --train-iters above {self.iteration} to continue "
            "(with --override-opt_param-scheduler to use the new learning-rate schedule)."
        )


@contextlib.contextmanager
def naming_load_errors(load: str | None):
    """Inside: Megatron's ``load_checkpoint`` logs the iteration it loaded into the yielded ``LoadRecord``,
    and its failures become one ``CheckpointError`` naming ``load`` and the fix: an exception, or the bare
    ``sys.exit()`` (status 0) of Megatron's torch-format loader when ``torch.load`` fails."""
    import megatron.training.training as mtrain

    real = mtrain.load_checkpoint
    record = LoadRecord(load)

    def load_checkpoint(*args, **kwargs):
        try:
            result = real(*args, **kwargs)
        except CheckpointError:
            raise
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
            raise CheckpointError(
                f"checkpoint under --load {load} could not be read (Megatron's loader printed why above and "
                "stopped). A file of it is damaged, or it was saved by another version or settings; nothing "
                "was changed on disk. Resume from an earlier checkpoint."
            ) from e
        except AssertionError as e:
            mismatch = _schedule_mismatch(load, e)
            if mismatch is None:
                raise _damaged(load, e) from e
            raise mismatch from e
        except Exception as e:
            raise _damaged(load, e) from e
        iteration = result[0] if isinstance(result, tuple) else None
        if iteration:
            from megatron.training import get_args, print_rank_0

            record.iteration = int(iteration)
            last = get_args().train_iters
            left = f"training continues from iteration {iteration + 1} to {last}"
            if last is not None and iteration >= last:
                left = f"--train-iters {last} leaves nothing to train"
            print_rank_0(f"> resumed from --load {load} at iteration {iteration}; {left}")
        return result

    mtrain.load_checkpoint = load_checkpoint
    try:
        yield record
    finally:
        mtrain.load_checkpoint = real


def _damaged(load: str | None, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint under --load {load} could not be loaded ({type(e).__name__}: {e}). A file of it "
        "is damaged, or it was saved by another model or settings; nothing was changed on disk. "
        "Resume from an earlier checkpoint."
    )
