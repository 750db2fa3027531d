"""Megatron-LM's hook into MoK's command line: ``extra_args_provider`` adds ``--moe-token-dispatcher-type
mok`` and the ``--mok-*`` flags (implemented in ``mok_megatron.training.arguments``).

The patched ``megatron/training/arguments.py`` imports this module by this name; it stays here.
"""

from mok_megatron.training.arguments import (  # noqa: F401
    MoKArgumentError,
    add_mok_flags,
    extra_args_provider,
    install,
    options_from_args,
)
