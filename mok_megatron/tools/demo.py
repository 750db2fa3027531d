"""``mok demo``: pretrain a tiny MoE GPT (Megatron-Core GPTModel + the MoK spec) on mock data.

N worker processes, expert-parallel size N (each rank holds num_experts / N experts and its own data
shard). gloo in CPU mode when there is no GPU; NCCL, one GPU per rank, when there are GPUs.
Rank 0 prints a progress bar with the loss of every step and a summary: loss drop, tokens/s, and the
time the MoE layers spent in dispatch / experts / combine (forward and backward, mean over ranks).

``--layer megatron`` runs the same model with Megatron-Core's own MoE layer (alltoall dispatcher,
SequentialMLP experts), for an A/B comparison with the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta


@dataclass
class DemoArgs:
    nproc: int
    steps: int = 40
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 8
    topk: int = 2
    moe_ffn: int = 64
    shared_expert: int = 0  # shared-expert FFN width; 0 = none
    seq_length: int = 64
    micro_batch: int = 4
    vocab: int = 128
    lr: float = 3e-3
    seed: int = 1234
    layer: str = "mok"  # or "megatron"
    dropout: float = 0.0  # hidden and attention dropout
    json_path: str | None = None
    port: int = 0


def _parser(default_nproc: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = DemoArgs(nproc=default_nproc)
    p.add_argument(
        "--nproc",
        type=int,
        default=d.nproc,
        help="worker processes = expert-parallel size (default: GPUs, else 2)",
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--layers", type=int, default=d.layers, help="transformer layers (all MoE)")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--topk", type=int, default=d.topk)
    p.add_argument("--moe-ffn", type=int, default=d.moe_ffn)
    p.add_argument(
        "--shared-expert", type=int, default=d.shared_expert, help="shared-expert FFN width (0: none)"
    )
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per rank per step")
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layer", choices=("mok", "megatron"), default=d.layer, help="MoE layer implementation")
    p.add_argument("--json", dest="json_path", default=None, help="also write the summary as JSON here")
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bar(step: int, total: int, width: int = 24) -> str:
    done = int(width * step / total)
    return "[" + "#" * done + "." * (width - done) + "]"


def model_config(a: DemoArgs, ep: int, **config_overrides):
    """The demo model's TransformerConfig (expert-parallel size ``ep``)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden,
        num_moe_experts=a.experts,
        moe_ffn_hidden_size=a.moe_ffn,
        moe_shared_expert_intermediate_size=a.shared_expert or None,
        moe_router_topk=a.topk,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=ep,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=a.dropout,
        attention_dropout=a.dropout,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.float32,
        **config_overrides,
    )


def build_model(a: DemoArgs, ep: int, **config_overrides):
    """The demo's MoE GPTModel (MoK or Megatron MoE layers per ``a.layer``) and its config."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mok_megatron.spec import get_gpt_decoder_block_spec_with_mok

    cfg = model_config(a, ep, **config_overrides)
    spec_fn = get_gpt_decoder_block_spec_with_mok if a.layer == "mok" else get_gpt_decoder_block_spec
    block = spec_fn(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=a.vocab,
        max_sequence_length=a.seq_length,
        position_embedding_type="rope",
    )
    return cfg, model


def dataset(a: DemoArgs, num_samples: int):
    """Megatron-Core's mock GPT dataset (token i+1 follows token i within a document)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=a.seed,
        sequence_length=a.seq_length,
        split="1,0,0",
        tokenizer=NullTokenizer(vocab_size=a.vocab),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    import logging

    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    return train


def batch_at(data, step: int, dp_rank: int, dp_size: int, micro_batch: int, device) -> dict:
    """The micro-batch of data-parallel rank ``dp_rank`` at ``step``: a pure function of the step, so
    a resumed run reads exactly the samples the uninterrupted run would have read."""
    import torch

    first = (step * dp_size + dp_rank) * micro_batch
    items = [data[i] for i in range(first, first + micro_batch)]
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([b[k] for b in items]).to(device) for k in keys}


def train_step(model, opt, batch: dict, params: list, dp_group, expt_dp_group) -> float:
    """One optimizer step on one micro-batch; returns the loss averaged over data-parallel ranks."""
    import torch
    import torch.distributed as dist

    dp = dist.get_world_size(dp_group)
    opt.zero_grad(set_to_none=True)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_mask = batch["loss_mask"]
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    # Data-parallel gradient averaging, as Megatron's DDP does it: dense parameters over the
    # data-parallel group, expert parameters over the expert-data-parallel group; both scaled
    # by 1 / data-parallel size (expert gradients already sum over every rank's tokens).
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            group = dp_group if getattr(p, "allreduce", True) else expt_dp_group
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
    opt.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, group=dp_group)
    return float(global_loss) / dp


def _worker(rank: int, a: DemoArgs) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # torch.compile (Megatron's jit_fuser) only costs compile time for a model this small on CPU.
        import torch._dynamo

        torch._dynamo.config.disable = True
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.nproc))
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=a.nproc, timeout=timedelta(seconds=300)
    )
    if not cuda:
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mok_megatron.adapter import profiling

    ps.initialize_model_parallel(expert_model_parallel_size=a.nproc)
    torch.manual_seed(a.seed)
    model_parallel_cuda_manual_seed(a.seed)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg, model = build_model(a, a.nproc)
    model.to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    dp_group = ps.get_data_parallel_group()
    expt_dp_group = ps.get_expert_data_parallel_group()

    data = dataset(a, num_samples=a.steps * a.micro_batch * a.nproc)
    n_tokens = a.micro_batch * a.seq_length * a.nproc  # per step, all ranks
    losses, step_times = [], []
    prof_ctx = profiling.record(model)
    prof = prof_ctx.__enter__()
    warm = 1  # the first step pays for allocations and lazy initialisation
    t_start = None
    for step in range(a.steps):
        if step == warm:
            prof.spans.clear()
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        batch = batch_at(data, step, rank, a.nproc, a.micro_batch, device)
        global_loss = train_step(model, opt, batch, params, dp_group, expt_dp_group)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(global_loss)
        step_times.append(dt)
        if rank == 0:
            print(
                f"{_bar(step + 1, a.steps)} step {step + 1:>3}/{a.steps}  loss {global_loss:7.4f}  "
                f"{n_tokens / dt:9.0f} tok/s",
                flush=True,
            )
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_start if t_start is not None else sum(step_times)
    prof_ctx.__exit__(None, None, None)
    phases = prof.summary()
    # mean over ranks, per measured step
    measured = max(1, a.steps - warm)
    flat = torch.tensor(
        [phases[d][p] for d in ("forward", "backward") for p in profiling.PHASES], dtype=torch.float64
    )
    flat = flat.to(device) if cuda else flat
    dist.all_reduce(flat)
    flat = (flat / a.nproc / measured).cpu().tolist()
    if rank == 0:
        k = min(3, len(losses))
        first_loss, last_loss = sum(losses[:k]) / k, sum(losses[-k:]) / k
        summary = {
            "layer": a.layer,
            "nproc": a.nproc,
            "expert_parallel": a.nproc,
            "backend": "nccl" if cuda else "gloo",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "steps": a.steps,
            "losses": losses,
            "loss_first": first_loss,
            "loss_last": last_loss,
            "loss_drop_pct": 100.0 * (first_loss - last_loss) / first_loss,
            "tokens_per_s": n_tokens * measured / wall if wall > 0 else math.nan,
            "step_s": wall / measured,
            "moe_ms_per_step": {
                d: {p: 1e3 * flat[i * len(profiling.PHASES) + j] for j, p in enumerate(profiling.PHASES)}
                for i, d in enumerate(("forward", "backward"))
            },
            "args": asdict(a),
        }
        print(format_summary(summary), flush=True)
        if a.json_path:
            with open(a.json_path, "w") as f:
                json.dump(summary, f, indent=2)
    dist.destroy_process_group()


def format_summary(s: dict) -> str:
    lines = [
        "",
        f"MoE GPT demo: {s['args']['layers']} MoE layers, {s['args']['experts']} experts top-{s['args']['topk']}, "
        f"layer={s['layer']}, EP={s['expert_parallel']} over {s['nproc']} processes ({s['backend']}, {s['device']})",
        f"  loss        {s['loss_first']:.4f} -> {s['loss_last']:.4f}  ({s['loss_drop_pct']:.1f} % lower, "
        f"mean of first / last 3 of {s['steps']} steps)",
        f"  throughput  {s['tokens_per_s']:,.0f} tokens/s over all ranks, {1e3 * s['step_s']:.1f} ms per step (after step 1)",
    ]
    ms = s["moe_ms_per_step"]
    if s["layer"] == "mok":
        lines.append("  MoE layers, ms per step (all layers, mean over ranks):")
        lines.append(f"    {'':<10}{'forward':>10}{'backward':>10}")
        for p in profiling_phases():
            if ms["forward"][p] or ms["backward"][p]:  # pipeline: dispatch+experts+combine overlapped
                lines.append(f"    {p:<10}{ms['forward'][p]:>10.2f}{ms['backward'][p]:>10.2f}")
    return "\n".join(lines)


def profiling_phases():
    from mok_megatron.adapter import profiling

    return profiling.PHASES


def main(argv: list[str] | None = None) -> int:
    import torch

    default_nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    ns = _parser(default_nproc).parse_args(argv)
    a = DemoArgs(**{k: v for k, v in vars(ns).items()})
    if a.nproc < 1 or a.experts % a.nproc != 0:
        print(
            f"mok demo: --experts {a.experts} must be divisible by --nproc {a.nproc} (the expert-parallel size)",
            file=sys.stderr,
        )
        return 2
    if torch.cuda.is_available() and a.nproc > torch.cuda.device_count():
        print(
            f"mok demo: --nproc {a.nproc} exceeds the {torch.cuda.device_count()} GPUs here", file=sys.stderr
        )
        return 2
    a.port = _free_port()
    json_path = a.json_path
    if json_path is None:
        import tempfile

        fd, json_path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        a.json_path = json_path
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_worker, args=(a,), nprocs=a.nproc, join=True)
    with open(json_path) as f:
        summary = json.load(f)
    if ns.json_path is None:
        os.unlink(json_path)
    print(f"  wall time   {time.perf_counter() - t0:.1f} s including start-up")
    if not summary["loss_last"] < summary["loss_first"]:
        print("mok demo: the loss did not fall", file=sys.stderr)
        return 1
    return 0
