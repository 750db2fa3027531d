"""Worker script for the multi-node tests: train the demo's tiny MoE GPT under ``torchrun``.

Run by every worker of a ``torchrun`` launch (one or many nodes; gloo in CPU mode without GPUs, NCCL
with one GPU per worker). One launch runs several jobs in turn in the same processes, to pay the
start-up once; each job re-creates Megatron's parallel state for its expert-parallel size (the
data-parallel size is world / EP):

    compare-EP      Megatron's alltoall MoELayer for --steps (the golden losses), then the MoK layer
                    from the same initial weights and the same data; both loss curves are recorded
    ckpt            the MoK model with dropout (so the RNG state matters), --steps steps; with
                    --save-at N it saves the whole train state after step N and keeps going; with
                    --resume DIR it starts from a saved state instead
    skew            --skew-steps steps where every token goes to one expert (one EP rank), counting
                    tokens in and out and the peak memory of every step

Before the first job every rank's MoE settings are compared (``mok_megatron.training.consistency``): ranks
started with different flags stop at once with the differing settings named. Any failure afterwards
(a dead peer, a collective timeout, a bad checkpoint) prints one line naming the rank and the step
and exits non-zero (``faults``). Rank 0 writes the results of all jobs to ``--out``/results.json.

    torchrun --nnodes 2 --nproc-per-node 2 ... -m tests.harness.train_tiny \\
        --out /tmp/run --compare-ep 4 2 --ckpt-ep 4 --save-at 10 --ckpt-dir /tmp/run/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from mok_megatron.config import MoKConfigError
from mok_megatron.training.consistency import MoEConfigMismatchError
from tests.harness import faults
from mok_megatron.training.checkpoint_files import CheckpointError


@dataclass
class Job:
    name: str
    layer: str  # "mok" or "megatron"
    ep: int
    steps: int
    dropout: float = 0.0
    save_at: int | None = None
    resume: str | None = None
    skew: bool = False
    init_from_megatron: bool = True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_tiny", description=__doc__)
    p.add_argument("--out", required=True, help="results directory (rank 0 writes results.json)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compare-ep", type=int, nargs="*", default=[], help="EP sizes for Megatron-vs-MoK runs")
    p.add_argument("--ckpt-ep", type=int, default=0, help="EP size of the checkpoint job (0: none)")
    p.add_argument("--save-at", type=int, default=None, help="save the train state after this step")
    p.add_argument("--ckpt-dir", default=None, help="where --save-at writes (a step_N directory)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume the ckpt job from")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout of the ckpt job")
    p.add_argument("--skew-steps", type=int, default=0, help="steps of the skew soak (0: none)")
    p.add_argument("--skew-warmup", type=int, default=5)
    p.add_argument("--fault", choices=faults.FAULTS, default=None, help="fault injection: kill or stall")
    p.add_argument("--fault-rank", type=int, default=-1, help="the rank that fails")
    p.add_argument("--fault-step", type=int, default=-1, help="... in this step (1-based), mid MoE layer")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout (gloo and NCCL)")
    # model (the demo's, smaller defaults)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    return p


def jobs_from(a) -> list[Job]:
    jobs = [
        Job(f"compare-ep{ep}-{layer}", layer, ep, a.steps)
        for ep in a.compare_ep
        for layer in ("megatron", "mok")
    ]
    if a.ckpt_ep:
        name = "ckpt-resumed" if a.resume else "ckpt"
        jobs.append(Job(name, "mok", a.ckpt_ep, a.steps, a.dropout, a.save_at, a.resume))
    if a.skew_steps:
        jobs.append(Job("skew", "mok", int(os.environ["WORLD_SIZE"]), a.skew_steps, skew=True))
    return jobs


def demo_args(a, job: Job):
    from mok_megatron.tools.demo import DemoArgs

    return DemoArgs(
        nproc=int(os.environ["WORLD_SIZE"]),
        steps=job.steps,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        experts=a.experts,
        topk=1 if job.skew else a.topk,
        moe_ffn=a.moe_ffn,
        seq_length=a.seq_length,
        micro_batch=a.micro_batch,
        vocab=a.vocab,
        lr=a.lr,
        seed=a.seed,
        layer=job.layer,
        dropout=job.dropout,
    )


def config_overrides(job: Job) -> dict:
    from tests.harness.skew import FORCE_BIAS_STD

    # top-1 routing (every token to one expert) needs Megatron's softmax before top-k
    return {"moe_router_force_biased": FORCE_BIAS_STD, "moe_router_pre_softmax": True} if job.skew else {}


def setup_parallel(ep: int, seed: int, timeout_s: float) -> None:
    """(Re)create Megatron's parallel state for expert-parallel size ``ep``, freeing old groups.

    Megatron gives its process groups their own timeout (``distributed_timeout_minutes``, default 30
    minutes), not the one of ``init_process_group``: without passing it, a stalled peer would hold
    the EP all-to-all for half an hour."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if ps.model_parallel_is_initialized():
        if ps.get_expert_model_parallel_world_size() == ep:
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
            destroy_moe_metrics_tracker()
            return
        seen = set()
        for value in list(vars(ps).values()):
            for g in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD and id(g) not in seen:
                    seen.add(id(g))
                    dist.destroy_process_group(g)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_s / 60)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    destroy_moe_metrics_tracker()


def build(a, job: Job, device):
    """The job's model and optimizer. Compare jobs start from the weights of the Megatron model built
    from the seed (MoK loads them, converting the expert layout), so both layers start equal."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mok_megatron.tools.demo import build_model

    da = demo_args(a, job)
    setup_parallel(job.ep, a.seed, a.timeout_s)
    ref_args = demo_args(a, job)
    ref_args.layer = "megatron"
    _, model = build_model(ref_args, job.ep, **config_overrides(job))
    if job.layer == "mok":
        ref = model
        _, model = build_model(da, job.ep, **config_overrides(job))
        model.load_state_dict(ref.state_dict(), strict=True)
        del ref
    torch.manual_seed(a.seed + 1)  # the training RNG (dropout) starts the same for every job
    model_parallel_cuda_manual_seed(a.seed + 1)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return model, opt


def moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def run_job(a, job: Job, rank: int, device, clock) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mok_megatron.tools.demo import batch_at, dataset, train_step
    from tests.harness.skew import MemoryProbe, TokenCounter
    from tests.harness.train_state import load_train_state, save_train_state

    clock.job, clock.step = job.name, 0
    model, opt = build(a, job, device)
    layers = moe_layers(model)
    if a.fault:
        faults.install_fault(layers[0], a.fault, rank, a.fault_rank, a.fault_step, clock)
    counter = TokenCounter(layers) if job.skew else None
    probe = MemoryProbe() if job.skew else None
    start = load_train_state(job.resume, model, opt) if job.resume else 0
    dp_group, expt_dp_group = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), dist.get_world_size(dp_group)
    data = dataset(demo_args(a, job), num_samples=job.steps * a.micro_batch * dp_size)
    params = list(model.parameters())
    losses, t0 = {}, time.perf_counter()
    for step in range(start, job.steps):
        clock.step = step + 1
        if probe:
            probe.start_step()
        batch = batch_at(data, step, dp_rank, dp_size, a.micro_batch, device)
        losses[step + 1] = train_step(model, opt, batch, params, dp_group, expt_dp_group)
        if probe:
            probe.end_step()
        if job.save_at == step + 1:
            save_train_state(os.path.join(a.ckpt_dir, f"step_{step + 1}"), model, opt, step + 1)
    out = {
        "losses": losses,
        "ep": job.ep,
        "dp": dp_size,
        "expert_dp": dist.get_world_size(expt_dp_group),
        "world": dist.get_world_size(),
        "seconds": time.perf_counter() - t0,
    }
    if job.skew:
        out["tokens"] = counter.totals()
        mem = [None] * dist.get_world_size()
        dist.all_gather_object(mem, probe.summary(a.skew_warmup))
        out["memory"] = mem
    return out


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    rank = int(os.environ["RANK"])
    clock = faults.StepClock()
    faults.exit_on_sigterm(rank, clock)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    timeout = timedelta(seconds=a.timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    if not cuda:
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    jobs = jobs_from(a)
    results = {}
    try:
        check_settings(a, jobs)
        for job in jobs:
            results[job.name] = run_job(a, job, rank, device, clock)
    except (MoEConfigMismatchError, MoKConfigError, CheckpointError) as e:
        faults.fail(faults.EXIT_CONFIG, rank, clock, f"{type(e).__name__}: {e}")
    except Exception as e:  # a dead peer, a timeout, anything else: never hang, never linger
        faults.fail_on_exception(rank, clock, e, a.timeout_s)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f)
        for name, res in results.items():
            last = max(res["losses"])
            print(
                f"{faults.PREFIX} {name}: EP={res['ep']} DP={res['dp']} loss at step {last} "
                f"{res['losses'][last]:.6f} ({res['seconds']:.1f} s)",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def check_settings(a, jobs: list[Job]) -> None:
    """Compare the settings of every job on every rank before any parallel state is built."""
    from mok_megatron.training.consistency import check_moe_config_consistent
    from mok_megatron.tools.demo import model_config

    for job in jobs:
        cfg = model_config(demo_args(a, job), job.ep, **config_overrides(job))
        check_moe_config_consistent(cfg, extra={"job": job.name, "layer": job.layer, "steps": job.steps})


if __name__ == "__main__":
    sys.exit(main())
