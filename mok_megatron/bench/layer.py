"""``mok bench layer``: one MoE layer, forward / backward / both, MoK vs Megatron-Core and peers, one process.

The command runs ``bench_suite`` (shapes x routing patterns x implementations; markdown table, ``--json``,
``--png``); ``bench_layer`` below is the original fwd+bwd-only measurement, kept for its callers.

Every implementation gets the same weights (copied through ``load_state_dict``) and the same input;
outputs and input gradients are checked against the first implementation before anything is timed.
Times are CUDA-event (or wall-clock on CPU) medians over ``--iters`` runs after ``--warmup``: forward,
backward and forward+backward with a sync after every step, and forward+backward back to back (no sync
between steps, as in training: ``bench_timing``).
Expert TFLOP/s counts the routed-expert GEMMs only: 3 (fwd + 2 bwd) x 2 * T * K * (F1 + F) * H.

Named shapes (from the projects' published configs):
    qwen3-30b-a3b     H 2048, F 768, 128 experts, top-8, 16384 tokens
    qwen3-235b-a22b-ep32  H 4096, F 1536, 4 local experts (of 128), one EP=32 rank's slice: with 4096
                      tokens per rank at top-8 a rank's 4 experts receive 4096 x 8 rows on average, so the
                      slice is 8192 tokens at top-4 (top-k capped at the 4 local experts; rows T*K = 32768)
    deepseek-v3-ep32  H 7168, F 2048, 8 experts, top-8, 4096 tokens (one EP=32 rank's slice)
    mixtral-8x7b      H 4096, F 14336, 8 experts, top-2, 8192 tokens
    tiny              H 64, F 64, 8 experts, top-2, 256 tokens (CPU smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, topk=8, tokens=16384),
    "qwen3-235b-a22b-ep32": dict(hidden=4096, ffn=1536, experts=4, topk=4, tokens=8192),
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096),
    "mixtral-8x7b": dict(hidden=4096, ffn=14336, experts=8, topk=2, tokens=8192),
    "tiny": dict(hidden=64, ffn=64, experts=8, topk=2, tokens=256),
}


def time_steps(step, iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``step`` after ``warmup`` calls: CUDA events on a GPU, the wall clock on CPU."""
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def _init_single_process():
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=120),
        )
    if not torch.cuda.is_available():
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _config(shape: dict, dtype):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=8,
        num_moe_experts=shape["experts"],
        moe_ffn_hidden_size=shape["ffn"],
        moe_router_topk=shape["topk"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=0.02,
        # optional: a shared expert of this FFN width, run beside the routed experts (DeepSeek-V3: 2048)
        moe_shared_expert_intermediate_size=shape.get("shared"),
        moe_shared_expert_overlap=bool(shape.get("shared")),
    )


def build(impl: str, cfg, options=None, transport=None):
    """One MoE layer: 'mok', 'megatron' (SequentialMLP, no TE) or 'megatron-te' (TEGroupedMLP).
    ``transport``: given to the MoK layer (e.g. ``transport.loopback.LoopbackTransport``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    if impl == "mok":
        from mok_megatron.spec import get_gpt_layer_with_mok_spec

        mlp = get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp
    elif impl == "megatron":
        mlp = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts).mlp
    elif impl == "megatron-te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_submodules

        mlp = get_gpt_layer_with_transformer_engine_submodules(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=True
        ).mlp
    else:
        raise ValueError(f"unknown implementation {impl!r}: choose mok, megatron, megatron-te")
    layer = mlp(config=cfg, options=options, transport=transport) if impl == "mok" else mlp(config=cfg)
    layer.set_layer_number(1)
    return layer


def bench_layer(
    shape_name: str,
    impls: list[str],
    dtype_name: str = "bf16",
    iters: int = 10,
    warmup: int = 3,
    tokens: int | None = None,
) -> dict:
    import torch

    from mok_megatron.experts.checkpoint import convert_state_dict

    _init_single_process()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    shape = dict(SHAPES[shape_name])
    if tokens:
        shape["tokens"] = tokens
    cfg = _config(shape, dtype)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape["tokens"], 1, shape["hidden"], generator=g)).to(device, dtype)
    dout = (torch.randn(shape["tokens"], 1, shape["hidden"], generator=g) * 1e-2).to(device, dtype)
    flops = 3 * 2 * shape["tokens"] * shape["topk"] * 3 * shape["hidden"] * shape["ffn"]
    rows, ref_out, ref_sd = [], None, None
    for impl in impls:
        torch.manual_seed(0)
        layer = build(impl, cfg).to(device)
        if ref_sd is None:
            ref_sd = layer.state_dict()
        else:
            target = "mok" if impl == "mok" else ("te_grouped" if impl == "megatron-te" else "sequential")
            layer.load_state_dict(convert_state_dict(ref_sd, target), strict=True)

        def step(layer=layer):
            xi = x.detach().requires_grad_(True)
            out, _ = layer(xi)
            out.backward(dout)
            return out, xi.grad

        out, dx = step()
        if ref_out is None:
            ref_out = (out.detach().float(), dx.float())
            err = (0.0, 0.0)
        else:
            scale_o = ref_out[0].abs().max().item() or 1.0
            scale_d = ref_out[1].abs().max().item() or 1.0
            err = (
                (out.float() - ref_out[0]).abs().max().item() / scale_o,
                (dx.float() - ref_out[1]).abs().max().item() / scale_d,
            )
            tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
            if max(err) > tol:
                raise RuntimeError(
                    f"{impl} disagrees with {impls[0]}: relative error out {err[0]:.3e}, dx {err[1]:.3e}"
                )

        def timed_step(step=step, layer=layer):
            layer.zero_grad(set_to_none=True)
            step()

        times = time_steps(timed_step, iters, warmup)
        med = statistics.median(times)
        rows.append(
            {
                "impl": impl,
                "ms": 1e3 * med,
                "min_ms": 1e3 * min(times),
                "expert_tflops": flops / med / 1e12,
                "rel_err_out": err[0],
                "rel_err_dx": err[1],
            }
        )
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "shape": shape_name,
        **shape,
        "dtype": dtype_name,
        "iters": iters,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "rows": rows,
    }


def format_result(r: dict) -> str:
    lines = [
        f"{r['shape']}: H {r['hidden']}, F {r['ffn']}, {r['experts']} experts, top-{r['topk']}, "
        f"{r['tokens']} tokens, {r['dtype']}, {r['device']}, fwd+bwd, median of {r['iters']}"
    ]
    lines.append(
        f"  {'impl':<14}{'ms':>10}{'min ms':>10}{'expert TFLOP/s':>16}{'rel err out':>13}{'rel err dx':>12}"
    )
    for row in r["rows"]:
        lines.append(
            f"  {row['impl']:<14}{row['ms']:>10.2f}{row['min_ms']:>10.2f}{row['expert_tflops']:>16.1f}"
            f"{row['rel_err_out']:>13.2e}{row['rel_err_dx']:>12.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from mok_megatron.bench.routing import ROUTINGS
    from mok_megatron.bench.suite import FP8_IMPLS, IMPLS, MEGATRON_FP8_IMPLS

    p = argparse.ArgumentParser(
        prog="mok bench layer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["layer"])
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"comma list of {', '.join(SHAPES)}, or all")
    p.add_argument("--tokens", type=int, default=None, help="override every shape's token count")
    p.add_argument("--routing", default="uniform", help=f"comma list of {', '.join(ROUTINGS)}, or all")
    p.add_argument(
        "--impl",
        default=",".join(IMPLS),
        help=f"comma list of {', '.join(IMPLS)}; FP8 rows (opt-in): {', '.join((*FP8_IMPLS, *MEGATRON_FP8_IMPLS))} "
        "(errors are relative to the first of mok/megatron*)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per phase (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--router-fusion",
        action="store_true",
        help="moe_router_fusion=True for every Megatron-based layer (TE's fused top-k; needs TE)",
    )
    p.add_argument("--json", default=None, help="write every case (rows, skipped peers) to this JSON file")
    p.add_argument("--png", default=None, help="write a bar chart of fwd+bwd ms to this PNG (matplotlib)")
    ns = p.parse_args(argv)
    names = list(SHAPES) if ns.shape == "all" else ns.shape.split(",")
    bad = [n for n in names if n not in SHAPES]
    if bad:
        p.error(f"--shape {bad}: choose from {', '.join(SHAPES)} or all")
    routings = list(ROUTINGS) if ns.routing == "all" else ns.routing.split(",")
    if ns.tokens is not None and ns.tokens < 1:
        p.error(f"--tokens {ns.tokens}: must be >= 1")
    shapes = {n: dict(SHAPES[n], **({"tokens": ns.tokens} if ns.tokens else {})) for n in names}
    if ns.router_fusion:
        from mok_megatron.compat import have_te

        if not have_te():
            p.error("--router-fusion uses Transformer Engine's fused router, which is not installed here")
    import warnings

    warnings.filterwarnings("ignore")
    from mok_megatron.bench import report as bench_report
    from mok_megatron.bench.suite import bench_suite

    try:
        cases = bench_suite(
            shapes, routings, ns.impl.split(","), ns.dtype, ns.iters, ns.warmup, ns.router_fusion
        )
    except ValueError as e:
        p.error(str(e))
    print(bench_report.markdown(cases))
    if ns.json:
        import torch

        meta = {
            "command": "mok bench layer " + " ".join(argv if argv is not None else sys.argv[1:]),
            "torch": torch.__version__,
        }
        bench_report.write_json(ns.json, cases, meta)
        print(f"JSON written: {ns.json}")
    if ns.png:
        print(bench_report.write_png(ns.png, cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
