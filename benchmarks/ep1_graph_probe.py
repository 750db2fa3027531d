"""Session 10 probe: the two-H200 runs' same-work EP=1 layers (per-rank DeepSeek-V3 and Qwen3-30B-A3B slices
of `mok bench ep`) timed eagerly and replayed from a CUDA graph on one H200: the fair baseline for the
graphed EP=2 MoK rows of s7e.

    python benchmarks/ep1_graph_probe.py
"""

from __future__ import annotations

import torch

from mok_megatron.bench.layer import _config, _init_single_process, build
from mok_megatron.bench.overlap import EP_SHAPES, _graphed, _inputs, _stepper, _time


def main():
    _init_single_process()
    for name in ("dsv3", "qwen3"):
        s = EP_SHAPES[name]
        cfg = _config(
            dict(hidden=s["hidden"], ffn=s["ffn"], experts=s["local"], topk=s["topk"]), torch.bfloat16
        )
        x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))
        torch.manual_seed(0)
        layer = build("mok", cfg).cuda()
        eager = _time(_stepper(layer, x, dout), 10, 3)
        graph = _time(_graphed(layer, x, dout), 10, 3)
        print(
            f"{name} EP=1 same work ({s['local']} experts, {s['tokens']} tokens): eager {1e3 * eager:.2f} ms, "
            f"CUDA graph {1e3 * graph:.2f} ms",
            flush=True,
        )
        del layer


if __name__ == "__main__":
    main()
