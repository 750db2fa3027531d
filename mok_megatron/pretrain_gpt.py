"""``python -m mok_megatron.pretrain_gpt`` (or ``mok-pretrain-gpt``): Megatron's GPT pretraining loop with
MoK MoE layers under ``--moe-token-dispatcher-type mok`` (implemented in ``mok_megatron.training.pretrain_gpt``).

The patched Megatron-LM ``pretrain_gpt.py`` imports ``use_mok`` from this module by this name; it stays here.
"""

import sys

from mok_megatron.training.pretrain_gpt import main, use_mok  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
