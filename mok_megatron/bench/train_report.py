"""``mok bench train`` outputs: the table on stdout, the JSON file (schema ``SCHEMA``) and the PNG (loss curves
overlaid, tokens/s/GPU bars).

JSON: {"schema", "date", "command", "machine": {device, gpus, torch, megatron_core, transformer_engine,
deep_ep}, "preset", "nproc_per_node", "expert_parallel", "iters", "warmup", "profile_step", "workdir", "init":
{rc, seconds, command}, "runs": {name: {label, rc, seconds, command, log, error, + train_log.summarize's
fields, + with --profile-step "profile": train_profile.summarize_trace's result or {"trace", "error"}}},
"speedup": {"<MoK run>/<Megatron run>": tokens/s ratio}, "loss_agreement": {"<MoK run>/<reference>" and
"<other Megatron run>/<reference>": train_log.loss_agreement; <reference> is the first Megatron run}, "ok"}.
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


def table(runs: dict) -> str:
    head = (
        f"{'run':<17} {'tokens/s/GPU':>13} {'TFLOP/s/GPU':>12} {'step ms min/median/max':>24} "
        f"{'peak MiB':>10} {'loss final':>11} {'loss mean':>10}  layer"
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
            f"{_num(r['mean_loss'], '.4f'):>10}  {r['label']}"
        )
    return "\n".join(lines)


def collect(plan, results: dict, machine, warmup: int) -> dict:
    """Per-run summaries, speed-ups and loss agreement from ``train.execute``'s results."""
    runs = {}
    for run in plan.runs:
        res = results.get(run.name)
        entry = {"label": run.label, "rc": res["rc"], "seconds": res["seconds"], "command": res["command"]}
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
    from mok_megatron.bench.train_presets import MOK_RUNS

    ok_runs = {n: r for n, r in runs.items() if r["rc"] == 0}
    speedup, agreement = {}, {}
    moks = [n for n in ok_runs if n in MOK_RUNS]
    for m in moks:
        for name, r in ok_runs.items():
            if name not in MOK_RUNS and ok_runs[m]["tokens_per_s_per_gpu"] and r["tokens_per_s_per_gpu"]:
                speedup[f"{m}/{name}"] = ok_runs[m]["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]
    reference = next((n for n in ok_runs if n not in MOK_RUNS), None)
    if reference is not None:
        for m in moks:
            agreement[f"{m}/{reference}"] = loss_agreement(ok_runs[m], ok_runs[reference])
        for name, r in ok_runs.items():  # Megatron against itself: the floor, not a MoK check
            if name not in MOK_RUNS and name != reference:
                agreement[f"{name}/{reference}"] = loss_agreement(r, ok_runs[reference])
    return {"runs": runs, "speedup": speedup, "loss_agreement": agreement}


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
        out.update(runs={}, speedup={}, loss_agreement={}, ok=False)
        _write(out, ns, None, machine, plan)
        return 1
    out.update(collect(plan, results, machine, plan.warmup))
    print()
    print(table(out["runs"]))
    for key, ratio in out["speedup"].items():
        print(f"{key}: {ratio:.2f}x tokens/s/GPU")
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
