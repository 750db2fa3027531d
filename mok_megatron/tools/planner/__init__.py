"""``mok plan``: predict one MoE layer and one training step for Megatron's alltoall layer and MoK,
from the repo's own H200 measurements scaled to other GPUs and clusters.

One idea per module: ``hardware`` (GPU/cluster table with sources), ``shapes`` (model and parallel
layout, validated), ``flops`` (FLOP and byte arithmetic), ``links`` (EP all-to-all time),
``measurements`` (reads the package data ``data/*.json``, extracted from docs/results/*), ``calibrate`` (fits the layer model to
them), ``predict`` (layer and step times), ``validate`` (each measured point vs the model),
``recipe`` (layouts from examples/*.sh), ``timeline`` (PNG/SVG picture), ``main`` (the command).
Nothing here imports torch or megatron.
"""
