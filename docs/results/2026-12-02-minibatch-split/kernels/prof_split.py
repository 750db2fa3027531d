"""Kernel time of one fwd+bwd: pipeline split by tokens vs experts (loopback link-only, infinite link)."""
import sys, collections, torch
from torch.profiler import profile, ProfilerActivity
from mok_megatron.bench.overlap import OVERLAP_SHAPES, loopback_options, _inputs, _stepper
from mok_megatron.bench.layer import _config, _init_single_process, build

_init_single_process()
shape = sys.argv[1]; chunks = int(sys.argv[2])
s = OVERLAP_SHAPES[shape]
dev = torch.device("cuda"); dtype = torch.bfloat16
cfg = _config(s, dtype)
x, dout = _inputs(s["tokens"], s["hidden"], dtype, dev)
res = {}
for split in ("tokens", "experts"):
    torch.manual_seed(0)
    opts = loopback_options(s, chunks, 0, "link", sync_free=True, minibatch_split=split)
    layer = build("mok", cfg, options=opts).to(dev)
    step = _stepper(layer, x, dout)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): step()
        torch.cuda.synchronize()
    k = collections.Counter(); n = collections.Counter()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", 0) / 3e3
            if t > 0:
                k[e.key[:90]] += t; n[e.key[:90]] += e.count / 3
    res[split] = (k, n)
    print(f"== {shape} C={chunks} {split}: GPU kernel ms per step {sum(k.values()):.2f}")
kt, nt = res["tokens"]; ke, ne = res["experts"]
keys = sorted(set(kt) | set(ke), key=lambda q: -(abs(ke[q] - kt[q])))
print("| kernel | tokens ms (calls) | experts ms (calls) | diff |")
for q in keys[:30]:
    print(f"| {q} | {kt[q]:.3f} ({nt[q]:.0f}) | {ke[q]:.3f} ({ne[q]:.0f}) | {ke[q]-kt[q]:+.3f} |")
