"""``mok bench``: measurements of the layer that ship with it.

layer.py / suite.py    ``mok bench layer``: one MoE layer, MoK vs Megatron and peers, checked then timed
train.py               ``mok bench train``: Megatron's training loop, MoK vs Megatron from one initial
                       checkpoint (train_presets.py, train_log.py, train_report.py; train_profile.py: one
                       step under Megatron's profiler, its GPU time by category)
ep.py / schedules.py   ``mok bench ep`` (torchrun): the layer at real EP; ``--schedules``: Megatron's 1F1B
                       EP overlap
build.py, steps.py, shapes.py   the layers built, the steps timed, the shapes shared (the planner reads them)
peers.py, torchtitan.py, sonic.py   the peer layers; routing.py: the same routing for every layer
timing.py, report.py, clocks.py, kernel_profile.py, bound.py, fp8_layers.py   shared pieces

The research sweeps (loopback overlap, wgrad, gather, NVLink bandwidth, kernels) are the repository's
``benchmarks/``, which imports this package and is never imported by it.
"""
