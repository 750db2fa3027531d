"""The Megatron-Core adapter: what Megatron builds and calls.

    layer.py        ``MoKMoELayer``: Megatron's ``MoELayer`` with MoK's dispatcher; decides config, experts
                    class and engine once, at construction
    dispatcher.py   ``MoKTokenDispatcher``: Megatron's six dispatcher phases over MoK's engines
    router.py       ``MoKTopKRouter``: Megatron's router with a faster gating GEMM and top-k selection
    cuda_graphs.py  which of Megatron's CUDA-graph scopes a MoK layer can be captured in
    profiling.py    per-phase timing (dispatch / experts / combine) for ``mok demo``

Importing it checks the megatron-core version.
"""

from mok_megatron.compat import check_mcore_version

check_mcore_version()
