"""Every place MoK changes Megatron's code at run time, with the reason each exists.

Megatron is hooked two ways:

- the patch files (``mok patches``, ``training/patches.py``): edits to a Megatron-LM checkout, so that
  Megatron-LM's own ``pretrain_gpt.py`` knows ``--moe-token-dispatcher-type mok`` and the ``--mok-*`` flags;
- the runtime patches below: ``mok-pretrain-gpt`` (``python -m mok_megatron.pretrain_gpt``) runs the
  megatron-core wheel's ``megatron.training`` unmodified on disk and replaces these attributes in the running
  process. Each is installed by the function named in ``by`` and, where that is a context manager or has a
  ``disable()``, restored on exit. Besides these, ``training.arguments.extra_args_provider`` changes the
  one parser instance Megatron's ``parse_args`` builds (no module attribute): ``--moe-token-dispatcher-type``
  takes ``mok`` (stored as ``alltoall`` plus ``args.mok``), the ``--mok-*`` flags are added, and its
  ``parse_args`` / ``parse_known_args`` / ``error`` check MoK's rules right after parsing and exit in one
  line.

``RUNTIME_PATCHES`` is the list; ``tests/test_training.py`` checks that every target exists in the installed
Megatron-Core and that installing the hooks changes no Megatron attribute it does not name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimePatch:
    target: str  # dotted path of the replaced attribute (a module attribute, or a class attribute)
    by: str  # the function that installs it (mok_megatron.<module>.<function>)
    when: str  # in which processes / for how long
    reason: str  # why Megatron cannot be used as it is there


_CPU = "CPU mode only (no GPU), for the process: mok_megatron.training.cpu.enable / cpu_training.enable"

RUNTIME_PATCHES: tuple[RuntimePatch, ...] = (
    RuntimePatch(
        "megatron.training.arguments.add_megatron_arguments",
        "mok_megatron.training.arguments.install",
        "mok-pretrain-gpt, for the process",
        "Megatron re-parses sys.argv inside pretrain() (ft_integration.setup, in-process restart) without "
        "the entry point's extra_args_provider; the value `mok` of --moe-token-dispatcher-type must parse "
        "there.",
    ),
    RuntimePatch(
        "megatron.training.training.load_checkpoint",
        "mok_megatron.training.checkpoint_files.naming_load_errors",
        "mok-pretrain-gpt, around pretrain()",
        "a damaged checkpoint fails deep inside the load (and the torch-format loader calls sys.exit() with "
        "status 0); an intact one with another learning-rate schedule fails on a bare assertion: one line "
        "naming the path and the fix instead; the iteration loaded is logged and kept.",
    ),
    RuntimePatch(
        "megatron.training.training.setup_model_and_optimizer",
        "mok_megatron.training.initial_checkpoint.main",
        "python -m mok_megatron.training.initial_checkpoint, around pretrain()",
        "saves the weights as built (iteration 0) and stops before data or a step: two layers start from "
        "one checkpoint (mok bench train).",
    ),
    RuntimePatch(
        "megatron.training.training.initialize_megatron",
        "mok_megatron.training.cpu_training.enable",
        _CPU,
        "pretrain() asserts CUDA unless allow_no_cuda; CPU mode handles everything that assertion guards.",
    ),
    RuntimePatch(
        "megatron.training.training.build_pretraining_data_loader",
        "mok_megatron.training.cpu_training.enable",
        _CPU,
        "a data iterator draws its workers' base seed from the default CPU generator, which in CPU mode is "
        "also dropout's: a resumed run (iterator made after the RNG states are restored) would drop other "
        "units than the uninterrupted run. Its loaders get their own generator, seeded with --seed.",
    ),
    RuntimePatch(
        "megatron.training.initialize._initialize_distributed",
        "mok_megatron.training.cpu_training.enable",
        _CPU,
        "it creates the model-parallel groups only when torch.cuda.device_count() > 0; runs as if one "
        "device were present.",
    ),
    RuntimePatch(
        "megatron.training.initialize._set_random_seed",
        "mok_megatron.training.cpu_training.enable",
        _CPU,
        "it seeds the model-parallel RNG tracker only when a GPU exists; without the seeds every tracked "
        "fork (expert init, dropout) fails.",
    ),
    RuntimePatch(
        "megatron.core.tensor_parallel.random._get_cuda_rng_state",
        "mok_megatron.training.cpu.enable",
        _CPU,
        "the RNG tracker saves CUDA generator states; on CPU the tracked generator is the CPU one.",
    ),
    RuntimePatch(
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
        "mok_megatron.training.cpu.enable",
        _CPU,
        "the RNG tracker restores CUDA generator states; on CPU the tracked generator is the CPU one.",
    ),
    RuntimePatch(
        "megatron.core.transformer.utils.get_default_causal_mask",
        "mok_megatron.training.cpu.enable",
        _CPU,
        'the default causal mask is built with device="cuda".',
    ),
    RuntimePatch(
        "megatron.core.fusions.fused_softmax.get_default_causal_mask",
        "mok_megatron.training.cpu.enable",
        _CPU,
        "the same mask function, bound by name in fused_softmax.",
    ),
    RuntimePatch(
        "megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale",
        "mok_megatron.training.cpu_training.megatron_schedule",
        "a with block around Megatron's no-pipelining schedules run outside pretrain() (benchmarks, tests)",
        "the aux-loss scale is process-global; the schedule copy_()s into whatever an earlier backward left "
        "there, which a schedule-less backward leaves 0-d: cleared on entry, restored on exit.",
    ),
)

# Not Megatron's code, changed for it in CPU mode (restored by disable()): torch.cuda's streams, events,
# device, RNG and memory queries (Megatron calls them unconditionally), torch.distributed's
# all_to_all_single / all_gather / reduce_scatter (gloo takes neither tensor split sizes nor unequal
# pieces), Tensor.record_stream inside megatron_schedule, and a logging filter on
# megatron.core.tensor_parallel.random (its CPU-RNG warning would fire on every fork).
# ``mok_megatron.training.cpu`` and ``cpu_training`` list each with its reason.
