"""Late-wgrad gate with and without merging the expert calls' weight gradients, beside the default, one process."""
import mok_megatron.experts.late_wgrad as lw
from mok_megatron.bench.overlap import bench_overlap
orig = lw.WgradQueue
for merge in (True, False):
    class Q(orig):
        def __init__(self, merge_calls=False, merge=merge):
            super().__init__(merge_calls=merge)
    lw.WgradQueue = Q
    rows = bench_overlap(["dsv3-4k", "qwen3-ep8"], [0, 900], [2, 4], 10, 3, profile_one=False,
                         modes=("sync-free+graph", "sync-free+graph+late-wgrad"))
    for r in rows:
        print(f"merge={merge}", r["shape"], r.get("mode"), r["gbps"], r["chunks"], f"{r['ms']:.2f}")
