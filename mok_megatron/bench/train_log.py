"""Read Megatron's training log, line by line as it streams, and reduce it to what ``mok bench train`` reports.

Lines read (Megatron-Core 0.19's ``training_log`` / ``report_memory`` / ``print_args`` formats, with
``--log-interval 1 --log-throughput``):

    [2026-12-01 22:16:50.43] iteration        1/      12 | consumed samples: 4 | elapsed time per iteration
        (ms): 1650.2 | throughput per GPU (TFLOP/s/GPU): 123.4 | learning rate: ... | lm loss: 1.076260E+01 |
        ... | grad norm: 3.512 | ...
    [Rank 0] (after 12 iterations) memory (MB) | allocated: ... | max allocated: 51234.00 | reserved: ...
      seq_length ...................................... 4096           (the arguments dump of rank 0)
    > MoE layer: MoK (mok_megatron.MoKMoELayer), dispatcher alltoall   (mok_megatron.training.pretrain_gpt)
      successfully loaded checkpoint from DIR [ t 1/1, ... ] at iteration 0

Step statistics leave out the first ``warmup`` iterations. Tokens per second per GPU =
global batch x sequence length / step time / world size; TFLOP/s per GPU is Megatron's own number
(``num_floating_point_operations`` / step time / world size).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$")
_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \|.*?\bmax allocated: ([0-9.]+)")
_ARG = re.compile(r"^ {2}(\w+) \.{3,} (.*)$")
_LAYER = re.compile(r"> MoE layer: (.*)$")
_LOADED = re.compile(r"successfully loaded checkpoint from (\S+) .* at iteration (\d+)")
_ARGS_WANTED = (
    "world_size",
    "seq_length",
    "global_batch_size",
    "micro_batch_size",
    "expert_model_parallel_size",
)


def _fields(rest: str) -> dict[str, str]:
    out = {}
    for part in rest.split("|"):
        key, sep, value = part.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


@dataclass
class Step:
    iteration: int
    ms: float
    loss: float | None
    tflops: float | None
    grad_norm: float | None = None


@dataclass
class TrainLog:
    """What one run's log said. ``feed`` returns the ``Step`` a line completed, else None."""

    steps: list[Step] = field(default_factory=list)
    total_iters: int | None = None
    max_allocated_mib: float | None = None
    args: dict[str, str] = field(default_factory=dict)
    layer: str | None = None
    loaded_from: str | None = None
    loaded_iteration: int | None = None

    def feed(self, line: str) -> Step | None:
        m = _ITERATION.search(line)
        if m:
            f = _fields(m.group(3))
            loss = f.get("lm loss")
            tflops = f.get("throughput per GPU (TFLOP/s/GPU)")
            norm = f.get("grad norm")
            step = Step(
                int(m.group(1)),
                float(f["elapsed time per iteration (ms)"]),
                float(loss) if loss is not None else None,
                float(tflops) if tflops is not None else None,
                float(norm) if norm is not None else None,
            )
            self.total_iters = int(m.group(2))
            self.steps.append(step)
            return step
        m = _MEMORY.search(line)
        if m:
            self.max_allocated_mib = max(self.max_allocated_mib or 0.0, float(m.group(2)))
            return None
        m = _ARG.match(line)
        if m and m.group(1) in _ARGS_WANTED:
            self.args[m.group(1)] = m.group(2).strip()
            return None
        m = _LAYER.search(line)
        if m:
            self.layer = m.group(1).strip()
            return None
        m = _LOADED.search(line)
        if m:
            self.loaded_from, self.loaded_iteration = m.group(1), int(m.group(2))
        return None

    def int_arg(self, name: str) -> int | None:
        v = self.args.get(name)
        return int(v) if v is not None and v.isdigit() else None


def summarize(log: TrainLog, warmup: int, cpu: bool, untimed: tuple[int, ...] = ()) -> dict:
    """Per-run numbers: step time min/median/max, tokens/s/GPU and TFLOP/s/GPU (medians after ``warmup``,
    the ``untimed`` iterations left out: those the profiler slows), peak memory, final and mean loss, and the
    per-iteration curves."""
    timed = [s for s in log.steps if s.iteration > warmup and s.iteration not in untimed]
    if not timed:
        skipped = f" and iterations {', '.join(map(str, untimed))} untimed" if untimed else ""
        raise ValueError(
            f"the log has {len(log.steps)} iteration line(s), none after the {warmup} warm-up iteration(s)"
            f"{skipped}; run more iterations (--iters) or fewer warm-up ones (--warmup)."
        )
    ms = [s.ms for s in timed]
    median_ms = statistics.median(ms)
    world, seq, gbs = (log.int_arg(k) for k in ("world_size", "seq_length", "global_batch_size"))
    tokens = None if None in (world, seq, gbs) else gbs * seq / (median_ms / 1e3) / world
    tflops = [s.tflops for s in timed if s.tflops is not None]
    losses = [s.loss for s in log.steps if s.loss is not None]
    # CPU mode's torch.cuda memory queries report zeros (mok_megatron.training.cpu_training).
    peak = None if cpu or not log.max_allocated_mib else log.max_allocated_mib
    return {
        "iterations": [s.iteration for s in log.steps],
        "loss": [s.loss for s in log.steps],
        "step_ms": [s.ms for s in log.steps],
        "tflops": [s.tflops for s in log.steps],
        "grad_norm": [s.grad_norm for s in log.steps],
        "world_size": world,
        "seq_length": seq,
        "global_batch_size": gbs,
        "timed_iterations": len(timed),
        "untimed_iterations": sorted(i for i in untimed if any(s.iteration == i for s in log.steps)),
        "step_ms_min": min(ms),
        "step_ms_median": median_ms,
        "step_ms_max": max(ms),
        "tokens_per_s_per_gpu": tokens,
        "tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "peak_allocated_mib": peak,
        "final_loss": losses[-1] if losses else None,
        "mean_loss": statistics.fmean(losses) if losses else None,
        "layer": log.layer,
        "loaded_checkpoint": log.loaded_from,
        "loaded_iteration": log.loaded_iteration,
    }


# Loss agreement of two layers from identical weights, --moe-router-dtype fp32 (docs/bench-train.md).
LOSS_LIMITS = {"step1": 1e-3, "per_step": 2e-2, "mean": 5e-3}


def loss_agreement(run: dict, reference: dict, limits: dict = LOSS_LIMITS) -> dict:
    """Relative difference |loss - reference| / |reference| at every iteration both ``summarize`` results
    logged a loss: step 1, the largest and the mean, each against its limit."""
    ref = {i: v for i, v in zip(reference["iterations"], reference["loss"], strict=True) if v is not None}
    pairs = [
        (i, v, ref[i])
        for i, v in zip(run["iterations"], run["loss"], strict=True)
        if v is not None and i in ref
    ]
    if not pairs or pairs[0][0] != 1:
        problem = (
            "no common loss values" if not pairs else f"no step-1 loss (first common step {pairs[0][0]})"
        )
        return {"steps": len(pairs), "ok": False, "limits": dict(limits), "problems": [problem]}
    rel = [abs(a - b) / abs(b) for _, a, b in pairs]
    out = {
        "steps": len(rel),
        "step1_rel": rel[0],
        "max_rel": max(rel),
        "mean_rel": statistics.fmean(rel),
        "per_step_rel": rel,
        "limits": dict(limits),
    }
    problems = []
    if rel[0] > limits["step1"]:
        problems.append(f"step-1 losses differ by {rel[0]:.2e} relative (limit {limits['step1']:g})")
    if max(rel) > limits["per_step"]:
        worst = pairs[rel.index(max(rel))][0]
        problems.append(f"step {worst} differs by {max(rel):.2e} relative (limit {limits['per_step']:g})")
    if out["mean_rel"] > limits["mean"]:
        problems.append(f"the mean difference is {out['mean_rel']:.2e} relative (limit {limits['mean']:g})")
    out["problems"] = problems
    out["ok"] = not problems
    return out


_ERROR = re.compile(r"(?:^|\]: |\s)((?:[\w.]*(?:Error|Exception)|[\w-]+: error)\b.*)$")


def last_error(lines: list[str]) -> str | None:
    """The last line of a failed run's log that names an error (torchrun's own summary left out)."""
    for line in reversed(lines):
        if "ChildFailedError" in line or "elastic" in line:
            continue
        m = _ERROR.search(line.rstrip())
        if m:
            return m.group(1).strip()
    return None
