"""``mok bench train`` outputs: the table on stdout, the JSON file (schema ``SCHEMA``) and the PNG (loss curves
overlaid, tokens/s/GPU bars).

JSON: {"schema", "date", "command", "machine": {device, gpus, torch, megatron_core, transformer_engine,
deep_ep}, "preset", "nproc_per_node", "expert_parallel", "iters", "warmup", "profile_step", "workdir", "init":
{rc, seconds, command}, "runs": {name: {label, fp8, rc, seconds, command, log, error, + train_log.summarize's
fields, vs_megatron (a MoK run: tokens/s over its reference), step_vs_bf16 (an FP8 run: median step over its
layer's bf16 run's), + with --profile-step "profile": train_profile.summarize_trace's result or {"trace",
"error"}}}, "speedup": {"<MoK run>/<Megatron run>": tokens/s ratio, same precision}, "fp8_vs_bf16": {"<FP8
run>/<bf16 run>": median step ratio}, "loss_agreement": {"<MoK run>/<reference>" and "<other Megatron
run>/<reference>": train_log.loss_agreement}, "ok"}. A run's <reference> is the first Megatron run of its
precision (FP8 runs: the first Megatron FP8 run; the bf16 runs of an FP8 comparison: the first Megatron bf16
run); a run whose precision has no Megatron run has none.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from mok_megatron.bench.train_log import last_error, loss_agreement, summarize
from mok_megatron.bench.train_profile import profile_table, summarize_trace

SCHEMA = "mok-bench-train/1"


def _versions(machine) -> dict:
    import torch

    from mok_megatron.compat import dist_version, te_version

    return {
        "device": machine.name,
        "gpus": machine.gpus,
        "torch": torch.__version__,
        "megatron_core": dist_version("megatron-core"),
        "transformer_engine": te_version() if machine.te else None,
        "deep_ep": machine.deepep,
    }


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _ratio(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def table(runs: dict) -> str:
    """One line per run; ``vs Megatron``: a MoK run's tokens/s over its reference Megatron run's, ``step/bf16``:
    an FP8 run's median step over its layer's bf16 run's (``collect``)."""
    head = (
        f"{'run':<17} {'tokens/s/GPU':>13} {'TFLOP/s/GPU':>12} {'step ms min/median/max':>24} "
        f"{'peak MiB':>10} {'loss final':>11} {'loss mean':>10} {'vs Megatron':>11} {'step/bf16':>9}  layer"
    )
    lines = [head, "-" * len(head)]
    for name, r in runs.items():
        if r.get("tokens_per_s_per_gpu") is None and r.get("step_ms_median") is None:
            lines.append(f"{name:<17} failed (exit {r['rc']}): {r.get('error') or 'see ' + r['log']}")
            continue
        steps = f"{r['step_ms_min']:.1f}/{r['step_ms_median']:.1f}/{r['step_ms_max']:.1f}"
        lines.append(
            f"{name:<17} {_num(r['tokens_per_s_per_gpu'], ',.0f'):>13} {_num(r['tflops_per_gpu'], '.1f'):>12} "
            f"{steps:>24} {_num(r['peak_allocated_mib'], ',.0f'):>10} {_num(r['final_loss'], '.4f'):>11} "
            f"{_num(r['mean_loss'], '.4f'):>10} {_ratio(r.get('vs_megatron')):>11} "
            f"{_ratio(r.get('step_vs_bf16')):>9}  {r['label']}"
        )
    return "\n".join(lines)


def collect(plan, results: dict, machine, warmup: int) -> dict:
    """Per-run summaries, speed-ups and loss agreement from ``train.execute``'s results."""
    runs = {}
    for run in plan.runs:
        res = results.get(run.name)
        entry = {"label": run.label, "fp8": run.fp8, "rc": res["rc"], "seconds": res["seconds"]}
        entry["command"] = res["command"]
        entry["log"] = res["log_path"]
        if res["rc"] == 0:
            try:
                entry.update(summarize(res["log"], warmup, cpu=not machine.cuda, untimed=plan.untimed))
            except ValueError as e:
                entry["rc"], entry["error"] = -1, str(e)
            else:
                if (entry["loaded_checkpoint"], entry["loaded_iteration"]) != (plan.init_dir, 0):
                    entry["rc"] = -1
                    entry["error"] = f"the log does not show {plan.init_dir} loaded at iteration 0"
        else:
            entry["error"] = last_error(res["tail"])
        if run.trace and res["rc"] == 0:
            entry["profile"] = _profile(run.trace, plan.profile_step)
        runs[run.name] = entry
    speedup, fp8_vs_bf16, agreement = compare({n: r for n, r in runs.items() if r["rc"] == 0})
    return {"runs": runs, "speedup": speedup, "fp8_vs_bf16": fp8_vs_bf16, "loss_agreement": agreement}


def compare(ok_runs: dict) -> tuple[dict, dict, dict]:
    """(speed-ups, FP8 / bf16 step ratios, loss agreements) of the runs that finished; sets each run's
    ``vs_megatron`` and ``step_vs_bf16``. Runs are compared within one precision: a MoK FP8 run against
    Megatron's FP8 runs, a bf16 run of an FP8 comparison against Megatron's bf16 runs."""
    from mok_megatron.bench.train_presets import BF16_OF, MOK_RUNS

    speedup, fp8_vs_bf16, agreement = {}, {}, {}
    references = {}  # precision (fp8: bool) -> its first Megatron run
    for name, r in ok_runs.items():
        if name not in MOK_RUNS:
            references.setdefault(r["fp8"], name)
    for m, r in ok_runs.items():
        if m not in MOK_RUNS:
            continue
        for name, ref in ok_runs.items():
            same = name not in MOK_RUNS and ref["fp8"] == r["fp8"]
            if same and r["tokens_per_s_per_gpu"] and ref["tokens_per_s_per_gpu"]:
                speedup[f"{m}/{name}"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
        reference = references.get(r["fp8"])
        r["vs_megatron"] = speedup.get(f"{m}/{reference}")
    for name, r in ok_runs.items():
        bf16 = ok_runs.get(BF16_OF.get(name, ""))
        if (
            r["fp8"]
            and bf16 is not None
            and not bf16["fp8"]
            and r["step_ms_median"]
            and bf16["step_ms_median"]
        ):
            r["step_vs_bf16"] = fp8_vs_bf16[f"{name}/{BF16_OF[name]}"] = (
                r["step_ms_median"] / bf16["step_ms_median"]
            )
    for fp8, reference in references.items():
        same = {n: r for n, r in ok_runs.items() if r["fp8"] == fp8}
        for m in (n for n in same if n in MOK_RUNS):
            agreement[f"{m}/{reference}"] = loss_agreement(same[m], same[reference])
        for name, r in same.items():  # Megatron against itself: the floor, not a MoK check
            if name not in MOK_RUNS and name != reference:
                agreement[f"{name}/{reference}"] = loss_agreement(r, same[reference])
    return speedup, fp8_vs_bf16, agreement


def _profile(trace: str, step: int) -> dict:
    if not os.path.isfile(trace):
        error = f"no trace at {trace} (Megatron writes it as step {step + 1} begins)"
        return {"trace": trace, "error": error}
    try:
        return summarize_trace(trace, step)
    except ValueError as e:
        return {"trace": trace, "error": str(e)}


def write_png(path: str, runs: dict, title: str) -> str:
    """Loss per iteration of every run overlaid (left) and tokens/s/GPU bars (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"PNG not written: matplotlib is not installed ({e}); pip install matplotlib for --png"
    done = {n: r for n, r in runs.items() if r["rc"] == 0}
    colors = {n: f"C{i}" for i, n in enumerate(done)}
    fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, r) in enumerate(done.items()):
        pts = [(i, v) for i, v in zip(r["iterations"], r["loss"], strict=True) if v is not None]
        ax_loss.plot(
            [i for i, _ in pts],
            [v for _, v in pts],
            color=colors[name],
            linestyle=("-", "--", ":", "-.")[k % 4],  # curves that coincide stay visible
            linewidth=1.5,
            label=name,
        )
    ax_loss.xaxis.get_major_locator().set_params(integer=True)
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("lm loss")
    ax_loss.set_title("loss, identical initial weights")
    ax_loss.legend(fontsize=8)
    names = [n for n in done if done[n]["tokens_per_s_per_gpu"]]
    bars = ax_tok.bar(
        names, [done[n]["tokens_per_s_per_gpu"] for n in names], color=[colors[n] for n in names]
    )
    ax_tok.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    ax_tok.set_ylabel("tokens / s / GPU (higher is better)")
    ax_tok.set_title("throughput, median step after warm-up")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"PNG written: {path}"


def report(plan, results: dict, machine, ns, workdir: str) -> int:
    """Print the table and verdicts, write JSON / PNG; the exit status (see ``mok_megatron.bench.train``)."""
    for name, res in results.items():
        res["log_path"] = os.path.join(workdir, f"{name}.log")
    init = results.get("init")
    out = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "mok bench train " + " ".join(ns.original_argv),
        "machine": _versions(machine),
        "preset": plan.preset,
        "nproc_per_node": plan.nproc,
        "expert_parallel": plan.ep,
        "iters": plan.iters,
        "warmup": plan.warmup,
        "profile_step": plan.profile_step,
        "workdir": workdir,
        "init": {k: init[k] for k in ("rc", "seconds", "command")} if init else None,
    }
    if init is None or init["rc"] != 0:
        err = last_error(init["tail"]) if init else None
        print(
            f"mok bench train: the initial checkpoint failed (exit {init['rc'] if init else '?'}): "
            f"{err or 'see its log'}; log: {init['log_path'] if init else workdir}; no run was started",
            file=sys.stderr,
        )
        out.update(runs={}, speedup={}, fp8_vs_bf16={}, loss_agreement={}, ok=False)
        _write(out, ns, None, machine, plan)
        return 1
    out.update(collect(plan, results, machine, plan.warmup))
    print()
    print(table(out["runs"]))
    for key, ratio in out["speedup"].items():
        print(f"{key}: {ratio:.2f}x tokens/s/GPU")
    for key, ratio in out["fp8_vs_bf16"].items():
        fp8, bf16 = (out["runs"][n]["step_ms_median"] for n in key.split("/"))
        print(f"{key}: FP8 step {ratio:.2f}x the bf16 step ({fp8:.1f} vs {bf16:.1f} ms median)")
    status = 0
    for key, a in out["loss_agreement"].items():
        floor = "" if key.startswith("mok") else " (Megatron against itself; not a MoK check)"
        if a["ok"]:
            print(
                f"loss agreement {key}: step 1 {a['step1_rel']:.1e}, max {a['max_rel']:.1e}, mean "
                f"{a['mean_rel']:.1e} relative over {a['steps']} steps: within the limits{floor}"
            )
        else:
            print(f"loss agreement {key}: OUTSIDE the limits: {'; '.join(a['problems'])}{floor}")
            status = 3 if not floor else status
    profiles = {n: r["profile"] for n, r in out["runs"].items() if "profile" in r}
    traced = {n: p for n, p in profiles.items() if "error" not in p}
    if traced:
        print()
        print(profile_table(traced))
    for name, p in profiles.items():
        if "error" in p:
            print(f"mok bench train: the {name} run's profile: {p['error']}")
            status = 1
    failed = [n for n, r in out["runs"].items() if r["rc"] != 0]
    for name in failed:
        r = out["runs"][name]
        print(
            f"mok bench train: the {name} run failed: {r.get('error') or 'see its log'}; log: {r.get('log')}"
        )
    if failed:
        status = 1
    out["ok"] = status == 0
    _write(out, ns, out["runs"], machine, plan)
    return status


def _write(out: dict, ns, runs: dict | None, machine, plan) -> None:
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"JSON written: {ns.json}")
    if ns.png and runs:
        title = f"mok bench train --preset {plan.preset}: {machine.name} x {plan.nproc}, {plan.iters} steps"
        print(write_png(ns.png, runs, title))
