"""``mok bench``: measurements of the layer and its parts.

layer.py / suite.py    ``mok bench layer``: one MoE layer, MoK vs Megatron and peers, checked then timed
train.py               ``mok bench train``: Megatron's training loop, MoK vs Megatron from one initial checkpoint
                       (train_presets.py, train_log.py, train_report.py)
overlap.py             ``mok bench overlap`` (one GPU, emulated link) and ``mok bench ep`` (real EP)
kernels.py, nvlink.py  Triton kernels vs references; NVLink transport bandwidth vs NCCL
peers.py, torchtitan.py, sonic.py   the peer layers; routing.py: the same routing for every layer
timing.py, report.py, clocks.py, kernel_profile.py, bound.py, fp8_layers.py, cpu_cost.py   shared pieces
"""
