"""The NVLink path: device-initiated dispatch/combine over PyTorch symmetric memory (one NVLink domain).

    peers      ``PeerBuffers``: every peer's buffer of one shape and their address table
    kernels    Triton row movers (pull = dispatch, push = combine) through a peer pointer table,
               each beside its torch reference
    workspace  symmetric buffers per EP group and row format, cached, with ``close()``; the loopback
               workspace (N emulated ranks on one device) has the same interface
    signals    per-peer ready flags (publish / wait, device epochs): the exchanges without a barrier
    exchange   one exchange: segment tables from the split matrix, staging, a barrier or ready flags
    transport  ``NVLinkTransport``: the overlap pipeline's ``--mok-transport nvlink``
    domains    NVLink domains (host name or ``MOK_NVLINK_DOMAIN``) and their process groups
    hierarchical  NVLink inside each domain, the collective between domains (``--mok-transport nvlink``)

Bandwidth against NCCL: ``benchmarks.nvlink`` (torchrun --nproc-per-node 2 -m benchmarks.nvlink, in the repository).

Legend: P ranks/peers, N rows sent, R rows received, W words per row.
"""
