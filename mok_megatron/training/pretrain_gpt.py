"""Pretrain a GPT (MoE) model with Megatron's training loop; ``--moe-token-dispatcher-type mok`` makes
its MoE layers MoK layers, any other type keeps Megatron's own, so one command A/B-compares them.

    torchrun --nproc-per-node 8 -m mok_megatron.pretrain_gpt <Megatron-LM flags> \\
        --moe-token-dispatcher-type mok [--mok-* flags]      # or the console script mok-pretrain-gpt

The flow is Megatron-LM's ``pretrain_gpt.py`` at the commit pinned in ``patches/manifest.json`` (this
package's own code, written from that file; the megatron-core wheel ships ``megatron.training`` but not the
script): ``parse_and_validate_args`` (with ``mok_megatron.training.arguments.extra_args_provider``) ->
``gpt_config_from_args`` -> ``pretrain_cfg_container_from_args`` -> ``pretrain``. Data:
``--mock-data`` or Megatron's indexed datasets (``--data-path``, ``--split``, blends).

What changes with ``mok``:
- the layer spec: Megatron's default spec for the run (TE or local, dense/MoE pattern from
  ``--moe-layer-freq``, MLA, MTP) passed through ``mok_megatron.spec.mokify`` with the ``MoKOptions``
  of the ``--mok-*`` flags; a ``--spec`` module is mokified the same way;
- the model config is checked by ``MoKConfig`` before ``torch.distributed`` starts, so a setting
  MoK cannot run fails in seconds with the value and the fix.

Not supported here (stock Megatron-LM's script has them): SFT / packed sequences, FIM data,
ModelOpt, cached-logit distillation and in-process restart.

Without a GPU the run uses CPU mode (``mok_megatron.training.cpu`` + ``mok_megatron.training.cpu_training``): gloo,
fp32, local (non-TE) modules; see ``cpu_training`` for what it changes in ``megatron.training``.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import os  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402


PROG = "mok-pretrain-gpt"  # the name every error line of this entry point begins with


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# ---- model ----------------------------------------------------------------------------------------


def _nvlink_domains(options) -> None:
    """With ``--mok-transport nvlink``: create the NVLink-domain groups on every rank (the layer spec is
    built on every rank, once per model chunk, after Megatron's process groups: the one place where all
    ranks meet before the MoE layers are built; the first chunk's call creates them)."""
    import torch.distributed as dist

    from mok_megatron.options import TransportKind

    if options.transport is not TransportKind.NVLINK or not dist.is_initialized():
        return
    from mok_megatron.transport.nvlink.domains import domains_ready, init_nvlink_domains

    if not domains_ready():
        init_nvlink_domains()


def mok_layer_spec(model_config, vp_stage=None, options=None):
    """Megatron's default layer spec for this model config, with MoK MoE layers built with ``options``."""
    from megatron.training.models.gpt import default_layer_spec

    from megatron.training import print_rank_0

    from mok_megatron.adapter.layer import MoKMoELayer
    from mok_megatron.options import MoKOptions
    from mok_megatron.spec import mokify

    options = options or MoKOptions()
    _nvlink_domains(options)
    spec = mokify(default_layer_spec(model_config, vp_stage), options)
    layers = getattr(spec, "layer_specs", [spec])
    n = sum(1 for s in layers if getattr(getattr(s.submodules, "mlp", None), "func", None) is MoKMoELayer)
    print_rank_0(f"> MoK MoE layers in the layer spec: {n} of {len(layers)}")
    return spec


def _mokified(spec, options):
    """A ``--spec`` module's spec (or a spec function) with MoK MoE layers built with ``options``."""
    from mok_megatron.spec import mokify

    if callable(spec) and not hasattr(spec, "submodules") and not hasattr(spec, "layer_specs"):

        def fn(model_config, vp_stage=None):
            import inspect

            kw = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(spec).parameters else {}
            _nvlink_domains(options)
            return mokify(spec(model_config, **kw), options)

        return fn
    return mokify(spec, options)


def use_mok(args, model_cfg) -> None:
    """With ``args.mok``: give ``model_cfg`` (a ``GPTModelConfig``) MoK MoE layers built with the ``--mok-*``
    flags' options, and check the model against MoK's constraints (before any process group exists).
    Without it, nothing changes. The patched Megatron-LM ``pretrain_gpt.py`` calls this too."""
    if not getattr(args, "mok", False):
        return
    from mok_megatron.training.arguments import options_from_args

    options = options_from_args(args)
    if model_cfg.transformer_layer_spec is None:
        model_cfg.transformer_layer_spec = partial(mok_layer_spec, options=options)
    else:
        model_cfg.transformer_layer_spec = _mokified(model_cfg.transformer_layer_spec, options)
    check_mok_config(args, model_cfg.transformer)


def model_config_from_args(args):
    """Megatron's ``GPTModelConfig`` for these args; with ``args.mok`` its MoE layers are MoK's."""
    from megatron.training.argument_utils import gpt_config_from_args

    model_cfg = gpt_config_from_args(args)
    use_mok(args, model_cfg)
    return model_cfg


def check_mok_config(args, transformer_config) -> None:
    """Validate the MoK layer's constraints from the config alone (no process groups needed)."""
    if not getattr(args, "mok", False):
        return
    from mok_megatron.config import MoKConfig

    MoKConfig.from_megatron(
        transformer_config,
        ep_size=args.expert_model_parallel_size,
        etp_size=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
    )


# ---- data -----------------------------------------------------------------------------------------

# Keys of a GPT batch, in the order ``get_batch`` returns them.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def dataset_config_from_args(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def _mtp_here(vp_stage=None) -> bool:
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(get_args())
    return mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def _needs_data(vp_stage=None) -> bool:
    """Pipeline stages that read batches: the first, the last, and those holding MTP layers."""
    from megatron.training.utils.common_utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_here(vp_stage)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train / validation / test datasets: mock data or Megatron's indexed (blended) datasets."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {kind.__name__} train/validation/test splits")

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and _needs_data(vp_stage)

    return BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, built_here, dataset_config_from_args(args)
    ).build()


datasets_provider.is_distributed = True  # every rank calls it; built_here decides


def get_batch(data_iterator, vp_stage=None):
    """One micro-batch on this rank: read on TP rank 0, broadcast over TP, sliced for CP."""
    from megatron.core import mpu
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    if not _needs_data(vp_stage):
        return {k: None for k in BATCH_KEYS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        from mok_megatron.training.cpu import device

        raw = next(data_iterator)
        dev = device()
        batch = {k: raw[k].to(dev, non_blocking=True) if raw.get(k) is not None else None for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=_mtp_here(vp_stage),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())


def loss_func(loss_mask, output_tensor):
    """Masked token-sum loss, the token count, and the ``lm loss`` report Megatron logs."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        for bad, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(
                result=loss,
                rejection_func=bad,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    b = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm (EP A2A overlap schedule)
        plan = model.build_schedule_plan(
            b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"]
        )
        return plan, partial(loss_func, b["loss_mask"])
    out = model(
        b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"]
    )
    return out, partial(loss_func, b["loss_mask"])


# ---- entry ----------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None):
    """Megatron's parse + validate with the MoK flags (``argv`` stands in for ``sys.argv[1:]``)."""
    from megatron.training.arguments import parse_and_validate_args

    from mok_megatron.training.arguments import extra_args_provider, install

    install()  # Megatron parses sys.argv again inside pretrain()
    saved = sys.argv
    # argparse names the program after sys.argv[0] (pretrain_gpt.py under `python -m` or torchrun): every
    # error of this entry point begins `mok-pretrain-gpt: error:`, however it was started.
    sys.argv = [PROG, *(saved[1:] if argv is None else argv)]
    try:
        return parse_and_validate_args(
            extra_args_provider=extra_args_provider, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
        )
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        from mok_megatron.training import cpu_training

        cpu_training.enable()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from mok_megatron.compat import use_prebuilt_dataset_helpers

    from mok_megatron.errors import MoKConfigError
    from mok_megatron.options import MoKOptionsError
    from mok_megatron.training.arguments import MoKArgumentError, check_environment, tell_launcher
    from mok_megatron.training.checkpoint_files import CheckpointError, check_load, naming_load_errors

    main_entry = time.time()
    use_prebuilt_dataset_helpers()

    def fail(e: BaseException | str) -> int:
        tell_launcher(f"{PROG}: error: {e}")
        if _is_rank0():
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    try:
        args = parse(argv)
    except AssertionError as e:  # Megatron's validate_args
        return fail(_megatron_refuses(e))
    # Everything that can be checked before Megatron starts its process groups: this machine, the MoK
    # layer's constraints on the model config, the checkpoint to load. One line each, once per job.
    try:
        check_environment(args)
        model_cfg = model_config_from_args(args)
        check_load(args)
        check_launcher(args)
    except (MoKArgumentError, MoKOptionsError, MoKConfigError, CheckpointError) as e:
        return fail(e)
    except AssertionError as e:  # Megatron's TransformerConfig checks
        return fail(_megatron_refuses(e))
    if _is_rank0():
        layer = "MoK (mok_megatron.MoKMoELayer)" if args.mok else "Megatron-Core MoELayer"
        print(f"> MoE layer: {layer}, dispatcher {args.moe_token_dispatcher_type}", flush=True)
    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=main_entry)
    try:
        with naming_load_errors(args.load) as loaded:
            pretrain(
                pretrain_cfg_container_from_args(args, model_cfg),
                datasets_provider,
                ModelType.encoder_or_decoder,
                forward_step,
            )
    except CheckpointError as e:
        return fail(e)
    if not args.skip_train:
        from megatron.training import get_args

        nothing = loaded.nothing_trained(get_args().train_iters)
        if nothing is not None:
            return fail(nothing)
    return 0


def check_launcher(args) -> None:
    """Megatron starts ``torch.distributed`` from the environment torchrun sets (``env://``); started any
    other way, its rendezvous raises a traceback that asks for ``MASTER_ADDR``. One line names the launcher
    instead (nothing to check where the caller started ``torch.distributed`` or Megatron fakes it)."""
    import torch

    from mok_megatron.training.arguments import MoKArgumentError

    if getattr(args, "fake_process_group", False) or torch.distributed.is_initialized():
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise MoKArgumentError(
            f"{' and '.join(missing)} not set: start it under torchrun (torchrun --nproc-per-node N -m "
            f"mok_megatron.pretrain_gpt ..., or torchrun ... $(command -v {PROG}) ...), or set "
            "MASTER_ADDR and MASTER_PORT for the launcher you use."
        )


def _megatron_refuses(e: AssertionError) -> str:
    """One line for an assertion of Megatron's argument or config checks (the last frame names the check
    where Megatron gave no message)."""
    import traceback

    text = " ".join(str(e).split())
    if not text:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        text = f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"
    return f"Megatron refuses this command line: {text}. Change the flags it names."

if __name__ == "__main__":
    sys.exit(main())
