"""The layer shapes the EP and overlap measurements share, so that a result and the planner that reads it
name the same shapes.

``OVERLAP_SHAPES``: one EP rank's slice (``experts`` local experts, ``tokens`` per rank) and the EP size a
one-GPU loopback run stands in for (``ep``); ``shared``: a shared expert of that FFN width beside the
routed ones. ``EP_SHAPES``: per rank at real expert parallelism (``mok bench ep``): ``local`` experts,
``tokens``, and the attention of the one-layer GPT of ``--schedules`` (``bench.schedules``).
"""

from __future__ import annotations

OVERLAP_SHAPES = {
    # name: per-rank slice (L local experts), emulated EP size
    "dsv3-4k": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096, ep=32),
    "dsv3-16k": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=16384, ep=32),
    # the same slice with DeepSeek-V3's shared expert (ffn 2048), overlapped as Megatron's
    # --moe-shared-expert-overlap does: its GEMMs run on a side stream beside the exchanges
    "dsv3-4k-shared": dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096, ep=32, shared=2048),
    "qwen3-ep8": dict(hidden=2048, ffn=768, experts=16, topk=8, tokens=16384, ep=8),
    "tiny": dict(hidden=64, ffn=64, experts=4, topk=2, tokens=256, ep=4),
    "tiny-shared": dict(hidden=64, ffn=64, experts=4, topk=2, tokens=256, ep=4, shared=64),
}
EP_SHAPES = {
    # per-rank: local experts, tokens; attention (heads, KV groups, head size) of --schedules' model
    # (bench.schedules): DeepSeek-V3's MLA stood in for by 56 heads of 128 (205M parameters against
    # MLA's 187M), Qwen3-30B-A3B's GQA as published (32 heads of 128, 4 KV groups)
    "dsv3": dict(hidden=7168, ffn=2048, local=8, topk=8, tokens=4096, heads=56),
    "qwen3": dict(hidden=2048, ffn=768, local=64, topk=8, tokens=16384, heads=32, groups=4, kv_channels=128),
    "tiny": dict(hidden=64, ffn=64, local=4, topk=2, tokens=256, heads=4),
}

