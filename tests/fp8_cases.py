"""Multi-process FP8 cases for the gloo worker pool (``tests/pool.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

HIDDEN = 256
# rows rank `src` sends to rank `dst` (2-rank subgroup); includes an empty split
SPLITS = ((3, 5), (0, 4))


def _rows(src: int, dst: int) -> torch.Tensor:
    """The bf16 rows src sends to dst: wide dynamic range across rows (scales must stay with their row)."""
    g = torch.Generator().manual_seed(100 * src + dst)
    n = SPLITS[src][dst]
    mag = torch.logspace(-3, 3, max(n, 1))[:n, None]
    return (torch.randn(n, HIDDEN, generator=g) * mag).to(torch.bfloat16)


def _grads(src: int, dst: int) -> torch.Tensor:
    """Gradient rank dst holds for the rows it received from src."""
    g = torch.Generator().manual_seed(7000 + 100 * src + dst)
    return (torch.randn(SPLITS[src][dst], HIDDEN, generator=g) * 1e-4).to(torch.bfloat16)


class _Recording:
    """CollectiveTransport that records what crossed the wire (dtype, bytes) per call."""

    def __init__(self, group):
        from mok_megatron.transport.collective import CollectiveTransport

        self.inner = CollectiveTransport(group)
        self.calls = []

    def move(self, x, mb, direction, backward=False):
        self.calls.append((str(x.dtype), x.numel() * x.element_size(), direction))
        return self.inner.move(x, mb, direction, backward=backward)


def fp8_exchange_case(rank, world, *, block=0):
    from mok_megatron.transport.fp8_rows import PackLayout, dequantize, fp8_dispatch, pack, unpack
    from mok_megatron.transport.base import SendPlan
    from mok_megatron.ops.routing import SlotMap

    group = dist.new_group([0, 1])  # every rank must call new_group
    if rank >= 2:
        return None
    peer_ranks = (0, 1)
    x_NH = torch.cat([_rows(rank, d) for d in peer_ranks]).requires_grad_(True)
    n = x_NH.shape[0]
    send = tuple(SPLITS[rank][d] for d in peer_ranks)
    recv = tuple(SPLITS[s][rank] for s in peer_ranks)
    mb = SendPlan(
        start=0,
        num_tokens=n,
        token_idx_N=torch.arange(n),
        dest_N=torch.repeat_interleave(torch.arange(2), torch.tensor(send)),
        valid_N=None,
        slots=SlotMap(torch.arange(n).view(n, 1)),
        send_splits=send,
        recv_splits=recv,
        split_matrix=SPLITS,
        capacity=None,
        rows_M=sum(recv),
        tokens_per_expert_L=torch.tensor([sum(recv)]),
        tokens_per_expert_host=(sum(recv),),
    )
    transport = _Recording(group)
    y_RH, q_RH, scale_RS = fp8_dispatch(x_NH, transport, mb, block=block)
    layout = PackLayout(HIDDEN, block)
    expect_RH = torch.cat([_rows(s, rank) for s in peer_ranks])
    # What arrived is exactly what the sender quantized, scales paired with their rows.
    q_ref, s_ref = unpack(pack(expect_RH, layout), layout)
    g_RH = torch.cat([_grads(s, rank) for s in peer_ranks])
    y_RH.backward(g_RH)
    grad_ref = torch.cat([_grads(rank, d) for d in peer_ranks])
    return {
        "q_equal": torch.equal(q_RH.view(torch.uint8), q_ref.view(torch.uint8)),
        "scale_equal": torch.equal(scale_RS, s_ref),
        "y_equal": torch.equal(y_RH, dequantize(q_ref, s_ref, layout, torch.bfloat16)),
        "y_dtype": str(y_RH.dtype),
        "x": expect_RH.float(),
        "y": y_RH.detach().float(),
        "grad_equal": torch.equal(x_NH.grad, grad_ref),
        "calls": transport.calls,
        "rows_sent": n,
        "rows_recv": y_RH.shape[0],
    }
