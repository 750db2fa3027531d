"""How token rows move between expert-parallel ranks: one protocol, several transports.

base.py         ``Transport`` (``move(x, mb, direction)``, ``peers``, ``link``), ``Direction``, ``SendPlan``
collective.py   torch.distributed all-to-all (NCCL / gloo), across nodes
copy_engine.py  symmetric-memory peer pulls on the copy engine (one NVLink domain)
nvlink/         Triton kernels reading / writing peers' symmetric memory; hierarchical across domains
loopback.py     one GPU emulating an EP rank's traffic at a chosen link bandwidth (benchmarks)
fp8_rows.py     dispatch rows as e4m3 + one fp32 scale, packed for any transport
comm.py         the plain engine's collectives with autograd (all-to-all-v, all-gather-v, reduce-scatter-v)
"""
