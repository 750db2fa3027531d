"""Where the overlapped shared expert's fc2 runs in the pipelined layer: beside the last combines (the
pipeline's ``after_combines``, session 12) or after the layer's combine (before). One H200, loopback.

python benchmarks/shared_fc2_probe.py [--gbps 900,0] [--bytes link,copy] [--rounds 7]
: DeepSeek's 4k slice with its shared expert (``dsv3-4k-shared``), one minibatch, sync-free, CUDA graphs;
per link rate and loopback bytes, the two placements timed in alternation (``rounds`` x median of 8
replays each), so clock drift hits both alike; prints each placement's median and the paired difference.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import probe_timing  # benchmarks/probe_timing.py (this script's directory is on sys.path)

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import _config, _init_single_process, build  # noqa: E402
from mok_megatron.bench.overlap import OVERLAP_SHAPES, _graphed, _inputs, loopback_options  # noqa: E402


def fc2_after_combine(layer) -> None:
    """Session 11's placement on one layer: fc2 launched by ``token_combine``, after the side stream
    waits for the whole pipeline (the combines' arrival included)."""
    disp = layer.token_dispatcher
    disp._shared_fc2_once = lambda: None
    shared = disp.shared_experts

    def token_combine(hidden_states):
        shared.wait_current_stream()
        shared.linear_fc2_forward(hidden_states)
        shared.post_forward_comm()
        return hidden_states

    disp.token_combine = token_combine


ap = argparse.ArgumentParser()
ap.add_argument("--gbps", default="900,0")
ap.add_argument("--bytes", default="link,copy")
ap.add_argument("--rounds", type=int, default=7)
args = ap.parse_args()
_init_single_process()
s = OVERLAP_SHAPES["dsv3-4k-shared"]
cfg = _config(s, torch.bfloat16)
x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"))
for gbps in (float(g) for g in args.gbps.split(",")):
    for nbytes in args.bytes.split(","):
        opts = loopback_options(
            s,
            1,
            gbps,
            local_rows="overlap",
            sync_free=True,
            loopback_bytes=nbytes,
        )
        replays = {}
        for label in ("beside combines", "after combine"):
            torch.manual_seed(0)
            layer = build("mok", cfg, options=opts).cuda()
            if label == "after combine":
                fc2_after_combine(layer)
            replays[label] = (layer, _graphed(layer, x, dout))
        ms = {k: [] for k in replays}
        for _ in range(args.rounds):
            for k, (_, replay) in replays.items():
                ms[k].append(probe_timing.median_ms(replay, 8))
        diff = [a - b for a, b in zip(ms["beside combines"], ms["after combine"], strict=True)]
        med = {k: statistics.median(v) for k, v in ms.items()}
        print(
            f"dsv3-4k-shared C=1 {gbps:g} GB/s bytes={nbytes}: fc2 beside the combines {med['beside combines']:.2f} ms, "
            f"after the combine {med['after combine']:.2f} ms; paired difference median {statistics.median(diff):+.3f} "
            f"ms (min {min(diff):+.3f}, max {max(diff):+.3f}; {args.rounds} rounds)",
            flush=True,
        )
        del replays
