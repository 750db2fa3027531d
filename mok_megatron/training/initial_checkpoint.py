"""Write a model's weights as built, before any training step, as a torch_dist checkpoint, and stop.

    torchrun --nproc-per-node N -m mok_megatron.training.initial_checkpoint <mok-pretrain-gpt flags> \\
        --save DIR --save-interval 1 --no-save-optim --skip-train

Runs ``mok_megatron.training.pretrain_gpt.main`` (Megatron's ``pretrain``) up to the end of
``setup_model_and_optimizer``, then saves iteration 0 to ``--save`` with Megatron's own
``save_checkpoint`` (model weights and the RNG states right after the model was built; no optimizer state
with ``--no-save-optim``) and returns before any data is built or any step runs. ``--skip-train`` spares the
optimizer and the gradient buffers; the weights and RNG states are those of a training run with the same flags.

Why: MoK's experts and Megatron's ``SequentialMLP`` / ``TEGroupedMLP`` write the same ShardedTensors, so
this one checkpoint loads into either layer (``--load DIR --no-load-optim``): two runs that load it start
from identical weights and identical RNG states (dropout masks), whichever layer drew the initial numbers.
``mok bench train`` builds it once per comparison.
"""

from __future__ import annotations

import sys


class _Saved(Exception):
    """Raised on every rank once the iteration-0 checkpoint is on disk: ends ``pretrain`` there."""


def _save_after_setup(setup):
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        from megatron.training import get_args, print_rank_0
        from megatron.training.checkpointing import save_checkpoint

        save_checkpoint(
            0,
            model,
            optimizer,
            scheduler,
            num_floating_point_operations_so_far=0,
            checkpointing_context=kwargs.get("checkpointing_context"),
        )
        print_rank_0(f"> initial weights (iteration 0) saved to {get_args().save}")
        raise _Saved

    setup_model_and_optimizer.__wrapped__ = setup
    return setup_model_and_optimizer


def main(argv: list[str] | None = None) -> int:
    import megatron.training.training as mtrain

    from mok_megatron.training import pretrain_gpt

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--save" not in argv:
        print(
            "initial_checkpoint: error: --save DIR is required (where iteration 0 is written)",
            file=sys.stderr,
        )
        return 2
    real = mtrain.setup_model_and_optimizer
    mtrain.setup_model_and_optimizer = _save_after_setup(real)
    try:
        return pretrain_gpt.main(argv)
    except _Saved:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    finally:
        mtrain.setup_model_and_optimizer = real


if __name__ == "__main__":
    sys.exit(main())
