"""Where the host spends one MoK layer step (EP=1) on a GPU: per-phase host milliseconds while the GPU is
kept busy (so the host never waits), and the Python functions with the most own time (cProfile).

A synced step's wall time exceeds its GPU-busy time where the host launches kernels slower than the GPU
runs them; ``mok bench layer`` shows this as the gap between its 'fwd+bwd' and 'back to back' columns.

    python benchmarks/host_probe.py [--router] [shape ...]   (--router: the router alone, by cumulative time)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import SHAPES, _config, _init_single_process, build  # noqa: E402


def phases(layer, x, dout, reps=10):
    """Median host ms per phase: first kernel-free work up to the router, router, dispatch+experts+combine
    (forward rest), backward. The GPU is held busy by a sleep kernel so no call blocks."""
    marks = {}

    def pre(name):
        def hook(*_):  # returns None: a pre-hook's return value would replace the module's input
            marks.setdefault(name, time.perf_counter())

        return hook

    hooks = [
        layer.router.register_forward_pre_hook(pre("router")),
        layer.router.register_forward_hook(pre("router done")),
        layer.experts.register_forward_pre_hook(pre("experts")),
        layer.experts.register_forward_hook(pre("experts done")),
    ]
    rows = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every launch below only enqueues
        marks.clear()
        t0 = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x.detach().requires_grad_(True))
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        rows.append(
            {
                "start -> router": marks["router"] - t0,
                "router": marks["router done"] - marks["router"],
                "router -> experts (dispatch)": marks["experts"] - marks["router done"],
                "experts": marks["experts done"] - marks["experts"],
                "experts -> end of forward (combine)": t1 - marks["experts done"],
                "backward": t2 - t1,
                "total": t2 - t0,
            }
        )
    for h in hooks:
        h.remove()
    torch.cuda.synchronize()
    return {k: 1e3 * sorted(r[k] for r in rows)[reps // 2] for k in rows[0]}


def router_parts(router, x, reps=20):
    """Median host ms of each step of ``router.forward`` (methods wrapped with a timer; GPU kept busy)."""
    import mok_megatron.adapter.router as mok_router

    names = [
        "gating",
        "apply_z_loss",
        "_selection_scores",
        "_aux_scores",
        "_apply_aux_loss",
        "_apply_seq_aux_loss",
        "_apply_global_aux_loss",
        "_apply_expert_bias",
        "routing",
    ]
    times = {n: [] for n in names + ["topk_indices", "topk_routing_with_score_function", "forward"]}

    def timer(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            times[name].append(time.perf_counter() - t0)
            return out

        return wrapped

    for n in names:
        setattr(router, n, timer(n, getattr(router, n)))
    saved = mok_router.topk_routing_with_score_function
    mok_router.topk_routing_with_score_function = timer("topk_routing_with_score_function", saved)
    torch.cuda._sleep(400_000_000)
    for _ in range(reps):
        t0 = time.perf_counter()
        router(x)
        times["forward"].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    mok_router.topk_routing_with_score_function = saved
    for n in names:
        delattr(router, n)
    return "   router host ms (median): " + ", ".join(
        f"{n} {1e3 * sorted(v)[len(v) // 2]:.3f}" for n, v in times.items() if v
    )


def main():
    _init_single_process()
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    for name in [a for a in sys.argv[1:] if not a.startswith("--")] or ["qwen3-30b-a3b", "deepseek-v3-ep32"]:
        s = SHAPES[name]
        for backend in ("torch", "torch-fp8"):
            torch.manual_seed(0)
            cfg = _config(s, torch.bfloat16)
            if backend == "torch":
                layer = build("mok", cfg).cuda()
            else:
                from mok_megatron.bench.fp8_layers import build_mok_layer

                layer = build_mok_layer(backend, cfg).cuda()
            x = torch.randn(s["tokens"], 1, s["hidden"], device="cuda", dtype=torch.bfloat16)
            dout = torch.randn_like(x)
            for _ in range(3):
                layer.zero_grad(set_to_none=True)
                layer(x.detach().requires_grad_(True))[0].backward(dout)
            print(f"== {name} [{backend}] host ms per phase (GPU kept busy):")
            for k, v in phases(layer, x, dout).items():
                print(f"   {k:<38s} {v:7.3f}")
            torch.cuda._sleep(400_000_000)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                layer.zero_grad(set_to_none=True)
                layer(x.detach().requires_grad_(True))[0].backward(dout)
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
            print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
            if "--router" in flags:
                print(router_parts(layer.router, x))
            if "--router" in flags:  # the router alone, by cumulative time
                torch.cuda._sleep(400_000_000)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    layer.router(x)
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
                print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:9000])
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
