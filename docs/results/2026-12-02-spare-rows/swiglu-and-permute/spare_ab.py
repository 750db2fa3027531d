"""Spare rows of sync-free expert buffers: zeroed by the permute and run through SwiGLU (before) or neither."""
import mok_megatron.engine.pipeline as pl
import mok_megatron.experts.torch_mlp as tm
import mok_megatron.kernels.permute as kp
import mok_megatron.ops.activation as act
from mok_megatron.bench.overlap import bench_overlap

real_act, real_perm = act.apply_activation, kp.permute
for skip in (False, True):
    tm.apply_activation = real_act if skip else (lambda h, s, p, live_rows=None: real_act(h, s, p, None))
    kp.permute = real_perm if skip else (lambda *a, zero_spare_rows=True, **k: real_perm(*a, **k))
    rows = bench_overlap(["qwen3-ep8", "dsv3-4k"], [0], [1, 2], 10, 3, profile_one=False,
                         modes=("sync-free+graph+link-only", "sync-free+graph+experts+link-only"))
    for r in rows:
        print(f"skip_spare={skip}", r["shape"], r.get("mode"), r["gbps"], r["chunks"], f"{r['ms']:.2f}")
