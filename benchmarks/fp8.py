"""FP8 expert backends on one GPU (sm_90+): accuracy vs bf16, fwd+bwd time, tiny-model loss.

    python benchmarks/fp8.py --out $OUT [--with-tests] [--no-timing] [--no-tiny]      (about 2 minutes)

Paths ("variants"): bf16 = MoK's torch backend; torch-fp8 = native rowwise FP8; te-bf16 = TE GroupedLinear
without FP8; te-<recipe> = TE GroupedLinear under Megatron's FP8 context (``compat.quantization_context``,
what Megatron's TransformerBlock enters) with ``--fp8-format e4m3 --fp8-recipe <recipe>``. mxfp8 / nvfp4
need sm_100 and are reported as such on Hopper.

1. Accuracy (H 1024, F 512, 16 experts, top-4, 2048 tokens, bf16 weights): layer output, input gradient and
   expert weight gradients of each variant vs the bf16 layer with the same weights and input, relative
   Frobenius error ||a - b|| / ||b||, after 2 warm-up steps (delayed scaling needs an amax history).
   Bound ``REL_BOUND`` = 0.1: e4m3 rounds each operand with relative error <= 2^-4
   (``kernels.fp8_quant_reference``), ~2^-4/sqrt(3) = 0.036 RMS; two chained GEMMs plus the activation give ~0.05-0.07.
2. Time: fwd+bwd medians (CUDA events, 10 iterations after 3) on the DeepSeek-V3 slice and Qwen3-30B-A3B.
3. Tiny-model loss: examples/tiny_moe.sh (launch command from DRY_RUN=1, widened to H 128 / F 128 so every
   GEMM dimension suits the 1x128 blockwise recipe) for 100 steps: bf16, TE blockwise, TE tensorwise,
   torch-fp8; the four runs share the GPU and run in parallel with step 1. Criterion: the mean loss over all
   steps within ``LOSS_BOUND`` = 2 % of bf16's (the mean of the last ``LOSS_WINDOW`` = 50 steps is reported
   too; the recipe memorises its mock data, so late-step losses of ~0.02 compare noise).
Writes fp8_h200.json and fp8_h200.txt (and the training logs) to --out; prints the text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback

import torch

REL_BOUND = 0.1
LOSS_BOUND = 0.02
LOSS_WINDOW = 50  # steps averaged at the end of the tiny-model runs (reported)
# The bound applies to the mean over ALL steps (the loss curve): the tiny recipe memorises its mock data
# (loss 4.9 -> ~0.02 within 100 steps), so late-step relative differences compare noise at ~0.02 (H200,
# 2026-12-01: last-50 means 0.017-0.020 for bf16 and every FP8 path, -12.6 % to +3.7 %, while the 100-step
# means agree within 0.42 %).
TE_RECIPES = ("tensorwise", "blockwise", "delayed", "mxfp8", "nvfp4")
ACC_SHAPE = dict(hidden=1024, ffn=512, experts=16, topk=4, tokens=2048)
SMOKE_SHAPE = dict(hidden=64, ffn=64, experts=8, topk=2, tokens=256)
TIME_SHAPES = ("deepseek-v3-ep32", "qwen3-30b-a3b")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: --smoke only (bf16 rows)
TINY_RUNS = {
    "bf16": [],
    "te-blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--mok-expert-backend", "te"],
    "te-tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--mok-expert-backend", "te"],
    "torch-fp8": ["--mok-expert-backend", "torch-fp8"],
}
TINY_WIDEN = ["--hidden-size", "128", "--moe-ffn-hidden-size", "128", "--ffn-hidden-size", "256"]


def variants() -> list[tuple[str, str, str | None]]:
    """(name, expert backend, fp8 recipe or None)."""
    out = [("bf16", "torch", None), ("torch-fp8", "torch-fp8", None), ("te-bf16", "te", None)]
    return out + [(f"te-{r}", "te", r) for r in TE_RECIPES]


def skip_reason(backend: str, recipe: str | None) -> str | None:
    from mok_megatron.bench.fp8_layers import unavailable

    return unavailable(backend, recipe)


def layer_config(shape: dict, recipe: str | None):
    from mok_megatron.bench.build import layer_config
    from mok_megatron.bench.fp8_layers import fp8_config

    return fp8_config(layer_config(shape, torch.bfloat16), recipe)


def build_layer(backend: str, cfg, state: dict | None):
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.bench.fp8_layers import build_mok_layer

    torch.manual_seed(0)
    layer = build_mok_layer(backend, cfg).to(DEV)
    if state is not None:
        layer.load_state_dict(convert_state_dict(state, "mok"), strict=True)
    return layer


def build_layer_sharing_weights(backend: str, cfg, state: dict | None):
    """``build_layer``; the first call's weights (a detached copy) become ``state`` for every later
    call, so all backends compare on the same weights. Returns (layer, state)."""
    layer = build_layer(backend, cfg, state)
    if state is None:
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    return layer, state


def fwd_bwd(layer, cfg, x, dout):
    from mok_megatron.compat import quantization_context

    xi = x.detach().requires_grad_(True)
    with quantization_context(cfg):
        out, _ = layer(xi)
    out.backward(dout)
    return out, xi.grad


def expert_grads(layer) -> dict:
    from mok_megatron.experts.checkpoint import convert_state_dict

    g = {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None and "experts" in n}
    return convert_state_dict(g, "mok")


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def accuracy(results: dict, shape: dict = ACC_SHAPE) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g).to(DEV, torch.bfloat16)
    dout = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g).to(DEV, torch.bfloat16)
    ref, state = None, None
    for name, backend, recipe in variants():
        why = skip_reason(backend, recipe)
        if why:
            results[name] = {"skipped": why}
            continue
        try:
            cfg = layer_config(shape, recipe)
            layer, state = build_layer_sharing_weights(backend, cfg, state)
            for _ in range(3):  # 2 warm-up steps, then the measured one
                layer.zero_grad(set_to_none=True)
                out, dx = fwd_bwd(layer, cfg, x, dout)
            got = (out.detach().float(), dx.float(), expert_grads(layer))
            if ref is None:
                ref = got
            err = {"out": rel(got[0], ref[0]), "dx": rel(got[1], ref[1])}
            err.update({f"d{k.split('.')[-1]}": rel(got[2][k], ref[2][k]) for k in ref[2]})
            results[name] = {"rel_err": err, "ok": max(err.values()) < REL_BOUND, "bound": REL_BOUND}
            if backend == "torch-fp8" or recipe is not None:  # bf16 vs bf16 differ by ~1e-3 only
                results[name]["fp8_ran"] = err["out"] > 5e-3
                results[name]["ok"] &= results[name]["fp8_ran"]
            del layer
        except Exception as e:  # report and go on: one recipe's failure must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


def timing(results: dict, shapes=TIME_SHAPES, iters: int = 10, warmup: int = 3) -> None:
    from mok_megatron.bench.layer import SHAPES
    from mok_megatron.bench.timing import time_steps

    for shape_name in shapes:
        shape = SHAPES[shape_name]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape["tokens"], 1, shape["hidden"], generator=g).to(DEV, torch.bfloat16)
        dout = (torch.randn(shape["tokens"], 1, shape["hidden"], generator=g) * 1e-2).to(DEV, torch.bfloat16)
        flops = 3 * 2 * shape["tokens"] * shape["topk"] * 3 * shape["hidden"] * shape["ffn"]
        rows = results.setdefault(shape_name, {})
        for name, backend, recipe in variants():
            why = skip_reason(backend, recipe)
            if why:
                rows[name] = {"skipped": why}
                continue
            try:
                cfg = layer_config(shape, recipe)
                layer = build_layer(backend, cfg, None)

                def step(layer=layer, cfg=cfg, x=x, dout=dout):
                    layer.zero_grad(set_to_none=True)
                    fwd_bwd(layer, cfg, x, dout)

                t = time_steps(step, iters, warmup)
                med = statistics.median(t)
                rows[name] = {"ms": 1e3 * med, "min_ms": 1e3 * min(t), "expert_tflops": flops / med / 1e12}
                del layer
            except Exception as e:
                rows[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            if DEV.type == "cuda":
                torch.cuda.empty_cache()


def start_tiny_runs(out: str, iters: int) -> dict:
    env = dict(os.environ, DEVICE="gpu", ITERS=str(iters), NPROC="1", DRY_RUN="1", PYTHON=sys.executable)
    dry = subprocess.run(
        ["bash", "examples/tiny_moe.sh"], env=env, capture_output=True, text=True, check=True
    )
    base = shlex.split(dry.stdout.strip().splitlines()[-1])
    procs = {}
    for i, (name, extra) in enumerate(TINY_RUNS.items()):
        port = 29611 + 7 * i  # one rendezvous per run: they share the machine
        cmd = [f"localhost:{port}" if c.startswith("localhost:") else c for c in base] + TINY_WIDEN + extra
        if cmd[0] == "torchrun":  # this interpreter's torchrun, whatever PATH holds
            cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
        log = open(os.path.join(out, f"tiny_{name}.log"), "w")
        procs[name] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)),
            log,
            cmd,
        )
    return procs


def finish_tiny_runs(procs: dict, out: str, timeout: float) -> dict:
    res = {}
    deadline = time.time() + timeout
    for name, (p, log, cmd) in procs.items():
        try:
            rc = p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        log.close()
        text = open(os.path.join(out, f"tiny_{name}.log")).read()
        losses = [float(v) for v in re.findall(r"lm loss: ([0-9.eE+-]+)", text)]
        res[name] = {"rc": rc, "steps": len(losses), "cmd": " ".join(cmd)}
        errors = [ln for ln in text.splitlines() if re.search(r"\w+Error\b|Exception", ln)]
        if rc != 0 and errors:
            res[name]["error"] = errors[-1][-300:]
        if losses:
            res[name].update(
                first=losses[0],
                final=losses[-1],
                mean_last=statistics.mean(losses[-LOSS_WINDOW:]),
                mean_all=statistics.mean(losses),
            )
    base = res.get("bf16", {})
    for r in res.values():
        if base.get("mean_all") and "mean_all" in r:
            r["rel_to_bf16"] = r["mean_all"] / base["mean_all"] - 1
            r["rel_last_to_bf16"] = r["mean_last"] / base["mean_last"] - 1
            r["ok"] = abs(r["rel_to_bf16"]) <= LOSS_BOUND
    return res


def start_gpu_tests(out: str):
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-m",
        "gpu",
        "tests/test_fp8_gpu.py",
        "-p",
        "no:cacheprovider",
    ]
    log = open(os.path.join(out, "gpu_tests.txt"), "w")
    return subprocess.Popen(cmd + ["-o", "addopts="], stdout=log, stderr=subprocess.STDOUT), log


def finish_gpu_tests(tests, out: str, timeout: float) -> dict:
    p, log = tests
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "timeout"
    log.close()
    lines = open(os.path.join(out, "gpu_tests.txt")).read().strip().splitlines()
    return {"rc": rc, "tail": lines[-12:]}


def summary(rep: dict) -> str:
    lines = [f"device: {rep['device']}  torch {rep['torch']}  TE {rep['te']}"]
    lines.append(f"accuracy vs bf16 (rel. Frobenius error, bound {REL_BOUND}), shape {rep['acc_shape']}:")
    for name, r in rep["accuracy"].items():
        if "rel_err" in r:
            errs = " ".join(f"{k} {v:.4f}" for k, v in r["rel_err"].items())
            lines.append(f"  {name:<14} {'OK  ' if r['ok'] else 'FAIL'} {errs}")
        else:
            lines.append(f"  {name:<14} {r.get('skipped') or r.get('error')}")
    for shape_name, rows in rep["timing"].items():
        lines.append(f"fwd+bwd {shape_name}:")
        for name, r in rows.items():
            if "ms" in r:
                lines.append(f"  {name:<14} {r['ms']:8.2f} ms  {r['expert_tflops']:7.1f} TFLOP/s")
            else:
                lines.append(f"  {name:<14} {r.get('skipped') or r.get('error')}")
    lines.append(
        f"tiny model, 100 steps (mean loss over all steps, bound {LOSS_BOUND:.0%} of bf16; last {LOSS_WINDOW} shown):"
    )
    for name, r in rep.get("tiny", {}).items():
        if "mean_last" in r:
            d, dl = r.get("rel_to_bf16", 0.0), r.get("rel_last_to_bf16", 0.0)
            lines.append(
                f"  {name:<14} rc={r['rc']} steps={r['steps']} first {r['first']:.4f} final {r['final']:.4f} "
                f"mean {r['mean_all']:.5f} ({d:+.2%}) last{LOSS_WINDOW} mean {r['mean_last']:.4f} ({dl:+.2%}) "
                f"{'OK' if r.get('ok', True) else 'FAIL'}"
            )
        else:
            lines.append(
                f"  {name:<14} rc={r['rc']} no loss lines (see tiny_{name}.log) {r.get('error', '')}"
            )
    if "gpu_tests" in rep:
        lines.append(f"tests/test_fp8_gpu.py rc={rep['gpu_tests']['rc']}:")
        lines += ["  " + t for t in rep["gpu_tests"]["tail"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/mok-fp8"))
    p.add_argument("--tiny-iters", type=int, default=100)
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, no training runs (CPU check of the script)"
    )
    p.add_argument("--budget-s", type=float, default=140, help="wall budget; timing gets the last 35 s")
    p.add_argument("--with-tests", action="store_true", help="also run tests/test_fp8_gpu.py (before timing)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from mok_megatron.bench.build import init_single_process
    from mok_megatron.compat import te_version

    t0 = time.time()
    device = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu"
    rep = {"device": device, "torch": torch.__version__, "te": te_version()}
    procs = {} if (a.no_tiny or a.smoke) else start_tiny_runs(a.out, a.tiny_iters)
    tests = start_gpu_tests(a.out) if a.with_tests else None
    init_single_process()
    rep["accuracy"], rep["timing"] = {}, {}
    rep["acc_shape"] = SMOKE_SHAPE if a.smoke else ACC_SHAPE
    accuracy(rep["accuracy"], rep["acc_shape"])
    if procs:
        rep["tiny"] = finish_tiny_runs(procs, a.out, timeout=max(5.0, a.budget_s - 35 - (time.time() - t0)))
    if tests is not None:
        rep["gpu_tests"] = finish_gpu_tests(
            tests, a.out, timeout=max(5.0, a.budget_s - 35 - (time.time() - t0))
        )
    if not a.no_timing:
        timing(rep["timing"], ("tiny",) if a.smoke else TIME_SHAPES, *((2, 1) if a.smoke else ()))
    text = summary(rep)
    with open(os.path.join(a.out, "fp8_h200.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    with open(os.path.join(a.out, "fp8_h200.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wall {time.time() - t0:.0f} s; files in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
