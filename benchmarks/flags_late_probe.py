"""Diagnose the per-peer flags on one GPU: a consumer that waits (pull kernel or wait kernel) while a "late"
rank publishes from another stream. Each variant runs in its own process (a trap kills the context):
cold (first launches on the late stream while the consumer spins), late-first, warm (every kernel
launched once before), eager (CUDA_MODULE_LOADING=EAGER).

    python benchmarks/flags_late_probe.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = [
    "pull-sleep",
    "pull-nosleep",
    "late-first",
    "wait-kernel",
    "pull-sleep-1ms",
    "warm-pull-sleep",
    "eager-pull-sleep",
]

CHILD = r"""
import json, sys, time, torch
from mok_megatron.transport.nvlink import signals as S
S.SPIN_LIMIT = 1 << 21
from mok_megatron.transport.nvlink import kernels as K
from mok_megatron.transport.nvlink.exchange import _segment_table, buffer_rows, all_to_all_reference
from mok_megatron.transport.nvlink.workspace import LoopbackWorkspace
v = sys.argv[1]
P, H = 2, 7168
m = [[300, 500], [700, 200]]
ws = LoopbackWorkspace(P, "cuda")
xs = [torch.randn(sum(m[s]), H, device="cuda").bfloat16() for s in range(P)]
word = K.word_dtype(H * 2)
peers = ws.buffers(word, H * 2 // word.itemsize, buffer_rows(m), "t")
for b in peers.bufs:
    b.fill_(-1)
out = torch.empty(sum(m[s][0] for s in range(P)), H, device="cuda", dtype=torch.bfloat16)
seg = _segment_table(m, 0, False, "cuda")
s0, s1 = ws.signals(0), ws.signals(1)
torch.cuda.synchronize()
late, puller = torch.cuda.Stream(), torch.cuda.Stream()
def consumer():
    with torch.cuda.stream(puller):
        peers.bufs[0][: xs[0].shape[0]].copy_(K.as_words(xs[0], word))
        S.publish(s0)
        if v == "wait-kernel":
            S.wait(s0)
            K.pull_rows(K.as_words(out, word), peers, seg, programs=8)
        else:
            K.pull_rows(K.as_words(out, word), peers, seg, programs=8, signals=s0)
def producer():
    with torch.cuda.stream(late):
        if v != "pull-nosleep":
            torch.cuda._sleep(2_000_000 if v == "pull-sleep-1ms" else 50_000_000)
        peers.bufs[1][: xs[1].shape[0]].copy_(K.as_words(xs[1], word))
        S.publish(s1)
if v.startswith("warm"):  # every kernel launched once (rank 1 first), then the real round
    producer(); consumer(); torch.cuda.synchronize()
    for b in peers.bufs:
        b.fill_(-1)
    torch.cuda.synchronize()
t = time.time()
if v == "late-first":
    producer(); consumer()
else:
    consumer(); producer()
err = None
try:
    torch.cuda.synchronize()
except Exception as e:
    err = repr(e)[:200]
ok = err is None and torch.equal(out, all_to_all_reference(xs, m)[0])
print(json.dumps(dict(variant=v, ok=bool(ok), err=err, s=round(time.time() - t, 3))))
"""


def main():
    res = []
    for v in VARIANTS:
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER") if v.startswith("eager") else None
        p = subprocess.run(
            [sys.executable, "-c", CHILD, v], capture_output=True, text=True, timeout=120, env=env
        )
        line = (
            p.stdout.strip().splitlines()
            or [json.dumps(dict(variant=v, rc=p.returncode, stderr=p.stderr[-300:]))]
        )[-1]
        print(line, flush=True)
        res.append(line)


if __name__ == "__main__":
    main()
