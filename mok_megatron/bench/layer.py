"""``mok bench layer``: one MoE layer, forward / backward / both, MoK vs Megatron-Core and peers, one process.

The command runs ``bench_suite`` (shapes x routing patterns x implementations; markdown table, ``--json``,
``--png``). The layers are built by ``bench.build``.

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
import sys

SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, topk=8, tokens=16384),
    "qwen3-235b-a22b-ep32": dict(hidden=4096, ffn=1536, experts=4, topk=4, tokens=8192),
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096),
    "mixtral-8x7b": dict(hidden=4096, ffn=14336, experts=8, topk=2, tokens=8192),
    "tiny": dict(hidden=64, ffn=64, experts=8, topk=2, tokens=256),
}


def main(argv: list[str] | None = None) -> int:
    from mok_megatron.bench.routing import ROUTINGS
    from mok_megatron.bench.suite import ENGINE_IMPLS, FP8_IMPLS, IMPLS, MEGATRON_FP8_IMPLS

    p = argparse.ArgumentParser(
        prog="mok bench layer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"comma list of {', '.join(SHAPES)}, or all")
    p.add_argument("--tokens", type=int, default=None, help="override every shape's token count")
    p.add_argument("--routing", default="uniform", help=f"comma list of {', '.join(ROUTINGS)}, or all")
    p.add_argument(
        "--impl",
        default=",".join(IMPLS),
        help=f"comma list of {', '.join(IMPLS)}; FP8 rows (opt-in): {', '.join((*FP8_IMPLS, *MEGATRON_FP8_IMPLS))}; "
        f"engine rows (opt-in): {', '.join(ENGINE_IMPLS)} (errors are relative to the first of mok/megatron*)",
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
