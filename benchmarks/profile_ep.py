"""Where does an EP=N MoE layer step go? torchrun --nproc-per-node N benchmarks/profile_ep.py [shape]

For Megatron (TEGroupedMLP when TE is importable) and MoK's engines: wall ms, GPU busy ms (union of
kernel intervals on all streams), kernel ms by category (GEMM, NCCL, copies, other), host enqueue ms
and the top kernels, on rank 0.
"""

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import build  # noqa: E402
from mok_megatron.bench.overlap import EP_SHAPES, _ep_config, _inputs, _reinit, _stepper, _time  # noqa: E402
from mok_megatron.experts.checkpoint import convert_state_dict  # noqa: E402
from mok_megatron.compat import have_te  # noqa: E402
from mok_megatron.options import MoKOptions  # noqa: E402

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
name = sys.argv[1] if len(sys.argv) > 1 else "dsv3"
s = EP_SHAPES[name]
_reinit(world)
cfg = _ep_config(s, world, world, torch.bfloat16)
x, dout = _inputs(s["tokens"], s["hidden"], torch.bfloat16, torch.device("cuda"), seed=rank)
meg = "megatron-te" if have_te() else "megatron"
torch.manual_seed(0)
ref = build(meg, cfg).cuda()
sd = convert_state_dict(ref.state_dict(), "mok")
layers = {meg: ref}
for label, opts in {
    "mok plain": MoKOptions(engine="plain"),
    "mok pipeline C=1": MoKOptions(engine="pipeline"),
}.items():
    m = build("mok", cfg, options=opts).cuda()
    m.load_state_dict(sd)
    layers[label] = m


def cat(k):
    n = k.lower()
    if "nccl" in n:
        return "nccl"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "xmma" in n:
        return "gemm"
    if "memcpy" in n or "copy" in n:
        return "copy"
    return "other"


for label, layer in layers.items():
    step = _stepper(layer, x, dout)
    ms = 1e3 * _time(step, 10, 3)
    torch.cuda.synchronize()
    dist.barrier()
    h0 = time.perf_counter()
    step()
    host = 1e3 * (time.perf_counter() - h0)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    iv = sorted((e.time_range.start, e.time_range.end) for e in evs)
    busy, cur = 0.0, None
    for a, b in iv:
        if cur and a <= cur[1]:
            cur[1] = max(cur[1], b)
        else:
            if cur:
                busy += cur[1] - cur[0]
            cur = [a, b]
    busy += (cur[1] - cur[0]) if cur else 0
    by = {}
    for e in evs:
        by[cat(e.name)] = by.get(cat(e.name), 0.0) + e.time_range.elapsed_us() / 1e3
    ka = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    if rank == 0:
        print(
            f"\n== {name} EP={world} {label}: wall {ms:.2f} ms | GPU busy {busy / 1e3:.2f} ms | "
            + " ".join(f"{k} {v:.2f}" for k, v in sorted(by.items()))
            + f" | host enqueue {host:.2f} ms | {sum(k.count for k in ka)} kernels",
            flush=True,
        )
        for k in sorted(ka, key=lambda k: -k.self_device_time_total)[:10]:
            print(f"   {k.self_device_time_total / 1e3:8.2f} ms x{k.count:4d}  {k.key[:100]}", flush=True)
dist.destroy_process_group()
