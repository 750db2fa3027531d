"""Checkpoints checked before anything loads them: a missing, truncated or unreadable checkpoint stops the
run at start-up with one line naming the file, instead of a torch error from deep inside the load.

``check_checkpoint_files(path)``: one ``torch_dist`` checkpoint directory against its own index.
``check_load(args)``: what Megatron's ``--load`` would read (``latest_checkpointed_iteration.txt`` ->
``iter_NNNNNNN``, or ``--ckpt-step``), checked the same way; ``mok-pretrain-gpt`` runs it right after
parsing. ``naming_load_errors``: Megatron's own loader wrapped so that a file that passes those checks but
still cannot be read (corrupted bytes) is reported with its checkpoint's path.
"""

from __future__ import annotations

import contextlib
import os


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


@contextlib.contextmanager
def naming_load_errors(load: str | None):
    """Inside: an exception from Megatron's ``load_checkpoint`` becomes a ``CheckpointError`` naming ``load``."""
    import megatron.training.training as mtrain

    real = mtrain.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"checkpoint under --load {load} could not be loaded ({type(e).__name__}: {e}). A file of it "
                "is damaged, or it was saved by another model or settings; nothing was changed on disk. "
                "Resume from an earlier checkpoint."
            ) from e

    mtrain.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        mtrain.load_checkpoint = real
