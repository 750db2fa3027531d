"""Megatron-LM glue: the command line, the training entry point, CPU mode and the Megatron-LM patch set.

arguments.py        the ``--mok-*`` flags, checked right after parsing (``mok_megatron.arguments``)
pretrain_gpt.py     Megatron's GPT pretraining loop with MoK layers (``python -m mok_megatron.pretrain_gpt``)
cpu.py, cpu_training.py  Megatron-Core's model and training loop on a CPU (gloo)
patches.py          ``mok patches``: the Megatron-LM patch set (the repository's ``patches/``)
checkpoint_files.py checkpoints checked before they are loaded
consistency.py      every rank builds the same MoE model
megatron_hooks.py   every runtime patch of Megatron's code, with its reason
"""
