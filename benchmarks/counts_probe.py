"""The pipeline plan's region counts on one GPU: ``pipeline_plan._counts`` (an index_add_ of every token's
row into its region's row) vs segment sums of a running sum (regions are consecutive token ranges).

python benchmarks/counts_probe.py: per shape (tokens, EP, local experts, emulated EP, minibatches), the
CUDA-graph-replayed microseconds of each (20 calls per replay) and that both give the same counts.
Session 12: the segment sums were no faster (18-158 us vs 29-178 us), so the index_add_ stays; a first
segment-sum version scanned along dim 0 of ``[T, few]`` (CUDA scans each column serially there: ~3 ms at
16k tokens, seen in a layer sweep, s12a).
"""

import torch

from probe_timing import graphed, median_ms
from mok_megatron.engine import pipeline_plan as pp


def segment_counts(routing_map_TE, bounds, ep, L, emulated_ep, split_local=True):
    """The same counts as segment sums: a running sum along the innermost dimension, read at each
    region's first token (found on the device with searchsorted over the labels)."""
    T = routing_map_TE.shape[0]
    C = len(bounds) - 1
    size = bounds[1] - bounds[0] if C else 1
    label_T = pp._region_labels(T, max(size, 1), emulated_ep, routing_map_TE.device, split_local)
    starts_G = torch.searchsorted(label_T, torch.arange(3 * C + 1, device=label_T.device))
    rm = routing_map_TE.view(T, ep, L)
    per_XT = torch.cat([rm, rm.any(-1, keepdim=True)], -1).to(torch.int64).view(T, -1).t().contiguous()
    cs_XT = torch.cat([per_XT.new_zeros((per_XT.shape[0], 1)), per_XT.cumsum(1)], 1)
    ends_XG = cs_XT.index_select(1, starts_G)
    return (ends_XG[:, 1:] - ends_XG[:, :-1]).t().reshape(3 * C, ep, L + 1)


for T, ep, L, emu, C in [
    (16384, 1, 16, 8, 1),
    (16384, 1, 16, 8, 4),
    (4096, 1, 8, 32, 1),
    (4096, 32, 8, 1, 2),
    (16384, 8, 16, 1, 1),
]:
    rm = torch.rand(T, ep * L, device="cuda") < 0.3
    b = pp.minibatch_bounds(T, -(-T // C))
    assert torch.equal(segment_counts(rm, b, ep, L, emu), pp._counts(rm, b, ep, L, emu))
    res = []
    for name, f in (("index_add", pp._counts), ("segments", segment_counts)):
        args = (rm, b, ep, L, emu)
        replay = graphed(lambda f=f, args=args: [f(*args) for _ in range(20)])
        res.append(f"{name} {1000 * median_ms(replay) / 20:.1f} us")
    print(f"T={T} EP={ep} L={L} emulated EP={emu} C={C}: " + ", ".join(res) + " (same counts)")
