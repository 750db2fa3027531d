"""SwiGLU over a sync-free buffer's spare rows or not (live_rows), same process: qwen3-ep8 / dsv3-4k loopback."""
import mok_megatron.ops.activation as act
from mok_megatron.bench.overlap import bench_overlap

real = act.apply_activation
for live in (False, True):
    act.apply_activation = real if live else (lambda h, spec, p, live_rows=None: real(h, spec, p, None))
    import mok_megatron.experts.torch_mlp as tm
    tm.apply_activation = act.apply_activation
    rows = bench_overlap(["qwen3-ep8", "dsv3-4k"], [0], [1, 2], 10, 3, profile_one=False,
                         modes=("sync-free+graph+link-only", "sync-free+graph+experts+link-only"))
    for r in rows:
        print(f"live={live}", r["shape"], r.get("mode"), r["gbps"], r["chunks"], f"{r['ms']:.2f}")
