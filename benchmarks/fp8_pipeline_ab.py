"""A/B in one process: the overlap pipeline with native FP8 experts, each expert call's permute / combine
fused into the experts' FP8 operands (``experts.fp8_mlp``, session 8) vs the unfused call (permute into
the padded layout, experts, combine), on the loopback transport (one GPU standing in for EP ranks).
Fused, unfused, fused again (clock drift shows). Same table as ``mok bench overlap``.

    python benchmarks/fp8_pipeline_ab.py [--shapes dsv3-4k] [--gbps 0,450] [--modes sync-free+graph,exact]
"""

from __future__ import annotations

import argparse
import warnings


def main() -> None:
    warnings.filterwarnings("ignore")
    from mok_megatron.bench.overlap import bench_overlap, format_overlap
    from mok_megatron.experts.grouped_mlp import MoKGroupedMLP

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3-4k")
    p.add_argument("--gbps", default="0,450")
    p.add_argument("--modes", default="sync-free+graph,exact")
    p.add_argument("--iters", type=int, default=10)
    ns = p.parse_args()
    real = MoKGroupedMLP.fuses_permute
    for label in ("fused", "unfused", "fused again"):
        MoKGroupedMLP.fuses_permute = real if label != "unfused" else (lambda self: False)
        rows = bench_overlap(
            ns.shapes.split(","),
            [float(g) for g in ns.gbps.split(",")],
            [1],
            ns.iters,
            3,
            profile_one=False,
            modes=ns.modes.split(","),
            expert_backend="torch-fp8",
        )
        print(f"== torch-fp8 experts, {label}\n{format_overlap(rows)}", flush=True)
    MoKGroupedMLP.fuses_permute = real


if __name__ == "__main__":
    main()
