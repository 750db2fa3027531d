"""Save and resume a whole training state with Megatron's ``dist_checkpointing``.

A train state is: the model's sharded state dict (MoK experts write the same ShardedTensors as
Megatron's ``SequentialMLP``), the ``torch.optim`` optimizer's per-parameter state sharded like the
parameters (Megatron's ``optim_state_to_sharding_state``), every rank's RNG states (CPU, CUDA and
Megatron's tracker; one ``ShardedObject`` per rank) and the step. The data position is a function of
the step (``demo.batch_at``), so a resumed run continues bitwise where the uninterrupted one was.

Safety:
- ``save_train_state`` writes into ``<path>.partial`` and renames it to ``<path>`` only after every
  rank finished, so a crash mid-save never leaves a half-written checkpoint under the final name; it
  refuses to overwrite an existing checkpoint.
- ``load_train_state`` first checks the checkpoint's files against its own index
  (``training.checkpoint_files.check_checkpoint_files``) and raises ``CheckpointError`` naming the bad file; it never writes.
"""

from __future__ import annotations

import os
import shutil
from itertools import chain

import torch
import torch.distributed as dist

from mok_megatron.training.checkpoint_files import CheckpointError, check_checkpoint_files


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_train_state(model, opt, step: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict()
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    opt_sd = opt.state_dict()
    # AdamW's per-parameter `step` is a scalar (not shaped like the parameter): kept as the common step.
    optim_state_to_sharding_state(opt_sd, get_param_id_to_sharded_param_map(model_sd, params), ("step",))
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return {"model": model_sd, "optimizer": opt_sd, "rng_state": rng, "step": step}


def save_train_state(path: str, model, opt, step: int) -> None:
    """Collective: write model + optimizer + RNG + step to ``path`` (a new directory)."""
    from megatron.core import dist_checkpointing

    if os.path.exists(path):
        raise CheckpointError(
            f"checkpoint {path} already exists; refusing to overwrite it. Save to a new directory or "
            "delete the old checkpoint first."
        )
    partial = path + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        os.makedirs(partial)  # dist_checkpointing.save needs an existing directory
    dist.barrier()
    dist_checkpointing.save(_sharded_train_state(model, opt, step), partial)
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(partial, path)
    dist.barrier()


def _init_adam_state(opt) -> None:
    """Give every parameter an (empty) Adam state, so the sharded template has every key to load."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state.get(p):
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def load_train_state(path: str, model, opt) -> int:
    """Collective: restore model, optimizer, RNG states from ``path``; return the saved step."""
    from megatron.core import dist_checkpointing

    check_checkpoint_files(path)
    _init_adam_state(opt)
    try:
        state = dist_checkpointing.load(_sharded_train_state(model, opt, step=-1), path)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} could not be loaded ({type(e).__name__}: {e}). Check that it was saved "
            "by this model with the same settings; nothing was changed on disk."
        ) from e
    model.load_state_dict(state["model"], strict=True)
    step = int(state["step"])
    opt_sd = state["optimizer"]
    for param_state in opt_sd["state"].values():
        param_state["step"] = torch.tensor(float(step))
    opt.load_state_dict(opt_sd)
    _set_rng_state(state["rng_state"])
    return step
