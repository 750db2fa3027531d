"""Which GPU kernels the overlap pipeline adds over the plain layer, one H200 standing in for EP=2 (loopback
transport, infinite link, the DeepSeek-V3 per-rank slice of the two-H200 runs: 8 local experts, top-8, 4096
tokens). Per configuration: wall ms, GPU kernel ms, launches, host enqueue, top kernels; for some, one CUDA
graph per step (sync-free). The sort-based expert calls are the pipeline before session 8 (A/B in one process).

    python benchmarks/pipeline_ep2_probe.py [--top 22]
"""

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")
from mok_megatron.bench.layer import _config, _init_single_process, build  # noqa: E402
from mok_megatron.bench.overlap import _graphed, _inputs, _stepper, _time  # noqa: E402
from mok_megatron.bench.kernel_profile import kernel_summary  # noqa: E402
from mok_megatron.options import MoKOptions  # noqa: E402

SHAPE = dict(hidden=7168, ffn=2048, experts=8, topk=8, tokens=4096)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=22)
    ns = p.parse_args()
    _init_single_process()
    cfg = _config(SHAPE, torch.bfloat16)
    x, dout = _inputs(SHAPE["tokens"], SHAPE["hidden"], torch.bfloat16, torch.device("cuda"))
    lb = dict(transport="loopback", loopback_ep=2, loopback_gbps=0.0, minibatch_size=SHAPE["tokens"])
    sf = MoKOptions(**lb, local_rows="fused", sync_free=True)
    # (label, options, the pipeline's expert calls on the routing kernels' plan, also time a CUDA graph)
    configs = [
        ("plain", None, True, True),
        ("pipeline exact, fused local rows", MoKOptions(**lb, local_rows="fused"), True, False),
        ("pipeline sync-free, fused local rows", sf, True, True),
        ("pipeline sync-free, fused local rows, sort-based expert calls", sf, False, True),
        ("pipeline sync-free, fused local rows (again)", sf, True, True),
        (
            "pipeline sync-free, local rows overlapped",
            MoKOptions(**lb, local_rows="overlap", sync_free=True),
            True,
            False,
        ),
    ]
    for label, opts, routing_kernels, graph in configs:
        torch.manual_seed(0)
        layer = build("mok", cfg, options=opts).cuda()
        if opts is not None:
            layer.token_dispatcher.routing_kernel_calls = routing_kernels
        step = _stepper(layer, x, dout)
        ms = 1e3 * _time(step, 10, 3)
        print(kernel_summary(step, f"dsv3 EP=2 loopback: {label}", ms, top=ns.top, width=110), flush=True)
        if graph:
            replay = _graphed(layer, x, dout)
            print(f"   one CUDA graph per step: {1e3 * _time(replay, 20, 3):.2f} ms", flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
