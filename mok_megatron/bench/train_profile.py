"""``mok bench train --profile-step N``: one training step of every run under Megatron's own PyTorch profiler,
and where its GPU kernel time goes.

Megatron-Core 0.19's training loop (``megatron/training/training.py``) with ``--profile --use-pytorch-profiler
--profile-step-start N --profile-step-end N+1`` builds ``torch.profiler.profile(schedule(wait=N-1, warmup=1,
active=1))`` and steps it at the top of every iteration, so the recorded profiler step is logged iteration N
(the trace names it ``ProfilerStep#N``). The trace is exported when iteration N+1 begins, by
``export_chrome_trace`` to ``<--tensorboard-dir>/../torch_profile/rank-<global rank>.json.gz``, on the ranks
``--profile-ranks`` names (all when empty; the bench names rank 0). Iteration N-1 runs under the profiler's
warm-up and iteration N+1 carries the export, so the bench leaves N-1..N+1 out of the step-time statistics.

``summarize_trace`` reads one such trace (chrome-trace JSON, plain or gzipped) and sums the device events --
kernels, memcpy, memset -- by ``kernel_category``: the first category in ``CATEGORIES`` whose pattern the
lower-cased kernel name matches; MoK's own Triton kernels by exact name (``MOK_KERNELS``) before any pattern.
"""

from __future__ import annotations

import gzip
import json
import os
import re

# The Megatron flags the bench sets on every profiled run (``megatron_profile_flags``); refused as
# pass-through together with --profile-step.
PROFILER_FLAGS = (
    "--profile",
    "--use-pytorch-profiler",
    "--profile-step-start",
    "--profile-step-end",
    "--profile-ranks",
    "--tensorboard-dir",
)
PROFILED_RANK = 0
TOP_KERNELS = 15

# MoK's Triton kernels (mok_megatron/kernels, mok_megatron/transport/nvlink): the profiler names a Triton
# kernel after its Python function.
MOK_KERNELS = {
    "_rowwise_kernel": "fp8",  # kernels/fp8_quant.py: rowwise quantization
    "_rowwise_partial_kernel": "fp8",  # ... keeping per-block amaxes for the weight-gradient operand
    "_segment_amax_kernel": "fp8",  # ... per-expert column amax
    "_segment_cast_kernel": "fp8",  # ... per-expert column cast
    "_weight_t_kernel": "fp8",  # ... the experts' weights for dgrad: column amax and transposed cast
    "_quantize_permute_kernel": "fp8",  # kernels/fp8_permute.py: quantize fused into the permute
    "_topk_kernel": "moe",  # kernels/topk.py
    "_rank_in_block_kernel": "moe",  # kernels/routing.py
    "_scan_kernel": "moe",
    "_place_kernel": "moe",
    "_scatter_kernel": "moe",  # kernels/permute.py
    "_gather_sum_kernel": "moe",  # ... the combine
    "_swiglu_fwd_kernel": "other",  # kernels/swiglu.py
    "_swiglu_bwd_kernel": "other",
    "_spin_ns_kernel": "other",  # kernels/link_delay.py
    "_rows_kernel": "communication",  # transport/nvlink: the rows moved between GPUs
    "_publish_kernel": "communication",
    "_wait_kernel": "communication",
    "_pull_kernel": "communication",  # kernels/tile_pull.py: rows pulled into the expert-sorted buffer
    "_tile_combine_kernel": "moe",  # kernels/tile_combine.py: the combine driven by completion
}

# (category, what it holds (docs/bench-train.md's table), pattern on the lower-cased kernel name). The
# first match wins, so the order settles names that fit two: cuDNN's fused attention names "wgmma" and FP8
# GEMMs name "e4m3" (attention and GEMM come before FP8), Transformer Engine's FP8 permute names "fp8" (MoE
# before FP8), its FP8 scale update runs through "multi_tensor_apply" (FP8 before the optimizer).
CATEGORIES = (
    (
        "communication",
        "NCCL, DeepEP / NVSHMEM; MoK's NVLink transport kernels",
        r"nccl|nvshmem|deep_?ep|all_?to_?all|allreduce|allgather",
    ),
    (
        "attention",
        "flash / cuDNN fused attention, Megatron's fused attention softmax, RoPE",
        r"flash|fmha|sdpa|attn|attention|scaled_(?:upper_triang_)?(?:masked_)?softmax|rotary|_rope|rope_",
    ),
    (
        "gemm",
        "cuBLAS(Lt), nvjet, CUTLASS and QuACK GEMMs, grouped or not, bf16 or FP8",
        r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|quack|splitkreduce|matmul",
    ),
    (
        "moe",
        "routing, top-k, sorting, permute / unpermute / combine (Transformer Engine's, torch's, MoK's)",
        r"permut|topk|top_k|router|aux_loss|moe|row_id_map|sort_chunks|radixsort|histogram",
    ),
    (
        "fp8",
        "quantize, cast-transpose, amax, scale, transpose (Transformer Engine's; MoK's Triton quantization "
        "kernels; torch's casts to float8)",
        r"fp8|float8|e4m3|e5m2|fp4|quantiz|amax|compute_scale|scale_inv|cast_transpose|transpose",
    ),
    (
        "optimizer",
        "Adam, the gradient norm and its clip (`multi_tensor_*`)",
        r"adam|lamb|sgd|l2_?norm|multi_tensor",
    ),
    ("other", "elementwise, normalization, reductions, copies, memcpy / memset", r""),
)
CATEGORY_NAMES = tuple(c[0] for c in CATEGORIES)
_PATTERNS = tuple((name, re.compile(pattern)) for name, _, pattern in CATEGORIES)
_DEVICE_EVENTS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kernel_category(name: str) -> str:
    """The category of one device event's name (one of ``CATEGORY_NAMES``)."""
    if name in MOK_KERNELS:
        return MOK_KERNELS[name]
    low = name.lower()
    return next(cat for cat, pattern in _PATTERNS if pattern.search(low))


def megatron_profile_flags(step: int, tensorboard_dir: str) -> list[str]:
    """Megatron's flags that trace iteration ``step`` of rank ``PROFILED_RANK`` beside ``tensorboard_dir``."""
    return [
        "--profile", "--use-pytorch-profiler", "--profile-step-start", str(step),
        "--profile-step-end", str(step + 1), "--profile-ranks", str(PROFILED_RANK),
        "--tensorboard-dir", tensorboard_dir,
    ]  # fmt: skip


def trace_path(tensorboard_dir: str, rank: int = PROFILED_RANK) -> str:
    """Where Megatron's trace handler writes ``rank``'s trace for ``--tensorboard-dir tensorboard_dir``."""
    parent = os.path.dirname(os.path.normpath(tensorboard_dir))
    return os.path.join(parent, "torch_profile", f"rank-{rank}.json.gz")


def untimed_iterations(step: int | None) -> tuple[int, ...]:
    """The iterations the profiler slows: its warm-up, the traced step, the export at the next one."""
    return () if step is None else (step - 1, step, step + 1)


def valid_profile_steps(iters: int, warmup: int) -> list[int]:
    """Steps N with warmup < N < iters that leave a timed iteration outside ``untimed_iterations(N)``."""
    timed = range(warmup + 1, iters + 1)
    return [n for n in range(warmup + 1, iters) if any(t not in untimed_iterations(n) for t in timed)]


def _load(path: str) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: device time with something running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize_trace(path: str, step: int, top: int = TOP_KERNELS) -> dict:
    """Device time of the traced step by category, and its ``top`` kernels by time.

    Returns {"trace", "rank", "step", "step_ms" (the host's ``ProfilerStep#step`` span), "kernel_ms" (the
    sum over device events), "gpu_busy_ms" (their union: less than the sum where streams overlap),
    "kernels" (device events), "categories": {category: {"ms", "count", "share" of kernel_ms}} for every
    category, "top": [{"name", "category", "ms", "count"}]}. A CPU run's trace has no device events: zeros.
    Raises ValueError naming the file when it is not a trace of ``step``."""
    try:
        trace = _load(path)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: not a readable chrome trace ({e})") from e
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list; not a chrome trace")
    marker = f"ProfilerStep#{step}"
    spans = [e for e in events if e.get("name") == marker and e.get("cat") != "gpu_user_annotation"]
    if not spans:
        found = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})
        raise ValueError(f"{path}: no {marker} span (the trace holds {', '.join(found) or 'none'})")
    cats = {c: {"ms": 0.0, "count": 0} for c in CATEGORY_NAMES}
    by_name: dict[str, list] = {}
    intervals = []
    for e in events:
        if str(e.get("cat", "")).lower() not in _DEVICE_EVENTS or e.get("ph") != "X":
            continue
        name, ts, dur = str(e.get("name", "")), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        intervals.append((ts, ts + dur))
        entry = by_name.setdefault(name, [kernel_category(name), 0.0, 0])
        entry[1] += dur / 1e3
        entry[2] += 1
    for cat, ms, count in by_name.values():
        cats[cat]["ms"] += ms
        cats[cat]["count"] += count
    total = sum(c["ms"] for c in cats.values())
    for c in cats.values():
        c["share"] = c["ms"] / total if total else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    rank = (trace.get("distributedInfo") or {}).get("rank", PROFILED_RANK)
    return {
        "trace": path,
        "rank": rank,
        "step": step,
        "step_ms": max(float(s.get("dur", 0.0)) for s in spans) / 1e3,
        "kernel_ms": total,
        "gpu_busy_ms": _busy_us(intervals) / 1e3,
        "kernels": len(intervals),
        "categories": cats,
        "top": [{"name": n, "category": c, "ms": ms, "count": k} for n, (c, ms, k) in ranked],
    }


def profile_table(profiles: dict, width: int = 110) -> str:
    """{run: summarize_trace result} as text: ms (and share) by category with a column per run, then each
    run's top kernels."""
    names = list(profiles)
    step = next(iter(profiles.values()))["step"]
    head = f"{'step ' + str(step) + ', GPU ms':<22}" + "".join(f"{n:>20}" for n in names)
    lines = [head, "-" * len(head)]
    for cat in CATEGORY_NAMES if any(profiles[n]["kernels"] for n in names) else ():
        cells = [profiles[n]["categories"][cat] for n in names]
        row = "".join(f"{c['ms']:>12.2f} ({100 * c['share']:>3.0f} %)" for c in cells)
        lines.append(f"{cat:<22}{row}")
    totals = (("kernel_ms", "kernels (sum)"), ("gpu_busy_ms", "GPU busy"), ("step_ms", "step (host)"))
    for key, label in totals:
        lines.append(f"{label:<22}" + "".join(f"{profiles[n][key]:>20.2f}" for n in names))
    for n in names:
        p = profiles[n]
        if not p["top"]:
            lines.append(f"{n}: no GPU kernels in {p['trace']} (a CPU run traces host ops only)")
            continue
        lines.append(f"{n}: top {len(p['top'])} kernels of step {step} (rank {p['rank']}), {p['trace']}")
        for k in p["top"]:
            lines.append(f"  {k['ms']:9.3f} ms x{k['count']:<5d} {k['category']:<13} {k['name'][:width]}")
    return "\n".join(lines)
