"""The overlap engine: dispatch -> experts -> combine, pipelined over minibatches, forward and backward.

Schedule (GPU; on CPU the same steps run in order on one stream):

    main stream   pack 0 | pack 1 | ... | experts 0 | experts 1 | ... | unpack 0 | unpack 1 ...
    comm stream          | send 0 | send 1 | ...   | back 0    | back 1 | ...

Every minibatch's dispatch is queued on the communication stream as soon as its rows are packed,
so minibatch i+1 (and later) is in flight while the experts of minibatch i run, and the combine of
minibatch i-1 returns meanwhile. Events order the two streams; no host synchronisation happens
inside (the plan read the counts once, or not at all in sync-free mode).

Backward overlaps the same way without extra code: autograd runs each op's backward on the stream
its forward ran on, so the combine-backward exchanges (dispatch direction) run on the
communication stream while the expert dgrad/wgrad of an earlier minibatch run on the main stream,
and the dispatch-backward of minibatch i overlaps the expert backward of minibatch i-1.

Reductions: each expert row is scaled by its probability inside the experts; a rank sums its local
experts' rows per received token, the source sums the ranks' partial rows per token. With
``deterministic`` both sums are fixed-order gathers accumulated in fp32 (bitwise repeatable);
without, they are ``index_add_`` into an fp32 buffer (atomics on GPUs).

Legend:
    T tokens   Tc tokens of one minibatch   H hidden   L local experts   W = 2L routing metadata
    N rows sent (one per token and destination rank)   R rows received   M (token, local expert) rows
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mok_megatron.functional.pipeline_plan import PipelinePlan, SendPlan
from mok_megatron.functional.transport import COMBINE, DISPATCH, exchange
from mok_megatron.ops.permute import combine_tokens, permute_tokens
from mok_megatron.ops.routing import SlotMap, slot_map

ExpertFn = Callable[[torch.Tensor, torch.Tensor, tuple | None, torch.Tensor], torch.Tensor]
"""``expert_fn(x_MH, tokens_per_expert_L (device), tokens_per_expert (host tuple or None), probs_M)``
returns the probability-scaled expert output ``y_MH``."""


class _Streams:
    """The communication side stream on CUDA; a no-op pair on CPU."""

    _comm: dict = {}

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            key = device.index
            if key not in _Streams._comm:
                _Streams._comm[key] = torch.cuda.Stream(device=device)
            self.comm = _Streams._comm[key]

    def event(self, stream_name: str):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(getattr(self, stream_name))
        return ev

    def wait(self, stream_name: str, ev) -> None:
        if ev is not None:
            getattr(self, stream_name).wait_event(ev)

    def on(self, stream_name: str):
        if not self.cuda:
            import contextlib

            return contextlib.nullcontext()
        return torch.cuda.stream(getattr(self, stream_name))

    def hand_over(self, stream_name: str, *tensors) -> None:
        """Tensors made on one stream and used on ``stream_name``: keep their memory until it is done."""
        if self.cuda:
            for t in tensors:
                t.record_stream(getattr(self, stream_name))


def _sum_rows(
    y_MH: torch.Tensor, index_M: torch.Tensor, slots: SlotMap, num_out: int, valid_M, deterministic
):
    """``out[i] = sum of y rows whose index is i``: a fixed-order gather, or index_add_ (atomics)."""
    if deterministic:
        return combine_tokens(y_MH, slots)
    if valid_M is not None:
        y_MH = torch.where(valid_M.unsqueeze(-1), y_MH, 0)
    out = torch.zeros((num_out, y_MH.shape[-1]), dtype=torch.float32, device=y_MH.device)
    return out.index_add(0, index_M, y_MH.float()).to(y_MH.dtype)


def _pack(x_c, meta_cPW, mb: SendPlan, ep: int):
    x_NH = permute_tokens(x_c, mb.token_idx_N, mb.slots)
    meta_NW = meta_cPW.reshape(-1, meta_cPW.shape[-1]).index_select(0, mb.token_idx_N * ep + mb.dest_N)
    if mb.valid_N is not None:
        meta_NW = torch.where(mb.valid_N.unsqueeze(-1), meta_NW, 0)
    return x_NH, meta_NW


def _experts(x_RH, meta_RW, mb: SendPlan, L: int, topk: int, expert_fn: ExpertFn, deterministic: bool):
    R = x_RH.shape[0]
    probs_RL, mask_RL = meta_RW[:, :L], meta_RW[:, L:] > 0.5
    flat_mask = mask_RL.t().reshape(-1)
    rows = min(mb.rows_M, flat_mask.numel())
    flat = flat_mask.argsort(descending=True, stable=True)[:rows]  # grouped by local expert
    row_M, l_M = flat % max(R, 1), flat // max(R, 1)
    valid_M = flat_mask[flat] if mb.capacity is not None else None
    kk = min(topk, L)
    if valid_M is None and rows == R * kk:
        slots = slot_map(row_M, None, R, kk)  # every received token uses every slot: no masking
    else:
        live = valid_M if valid_M is not None else torch.ones_like(row_M, dtype=torch.bool)
        slots = slot_map(row_M, live, R, kk)
    x_MH = permute_tokens(x_RH, row_M, slots)
    probs_M = probs_RL[row_M, l_M]
    if valid_M is not None:
        probs_M = torch.where(valid_M, probs_M, 0)
        tpe_L = mask_RL.sum(0, dtype=torch.int64)  # what actually arrived
    else:
        tpe_L = mb.tokens_per_expert_L
    y_MH = expert_fn(x_MH, tpe_L, mb.tokens_per_expert_host, probs_M)
    return _sum_rows(y_MH, row_M, slots, R, valid_M, deterministic)


def run_pipeline(
    x_TH: torch.Tensor,
    probs_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    plan: PipelinePlan,
    expert_fn: ExpertFn,
    transport,
    topk: int,
    deterministic: bool = False,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (probability-weighted sum over each token's experts)."""
    T, H = x_TH.shape
    ep, L = plan.ep_size, plan.num_local_experts
    if T == 0:
        return x_TH.new_zeros((0, H)) + 0 * x_TH.sum()
    st = _Streams(x_TH.device)
    # Each (token, destination) row carries the destination's slice of probabilities and mask.
    meta_TPW = torch.cat([probs_TE.view(T, ep, L), routing_map_TE.view(T, ep, L).to(probs_TE.dtype)], -1)
    C = len(plan.minibatches)
    # One split (its backward is one concatenation), not C slices (C full-size gradient adds).
    sizes = [mb.num_tokens for mb in plan.minibatches]
    x_parts = x_TH.split(sizes) if C > 1 else (x_TH,)
    meta_parts = meta_TPW.split(sizes) if C > 1 else (meta_TPW,)

    packed, ev_packed = [], []
    for c, mb in enumerate(plan.minibatches):
        packed.append(_pack(x_parts[c], meta_parts[c], mb, ep))
        ev_packed.append(st.event("main"))

    received, ev_recv = [], []
    with st.on("comm"):
        for c, mb in enumerate(plan.minibatches):
            st.wait("comm", ev_packed[c])
            st.hand_over("comm", *packed[c])
            x_RH = exchange(packed[c][0], transport, mb, DISPATCH)
            meta_RW = exchange(packed[c][1], transport, mb, DISPATCH)
            received.append((x_RH, meta_RW))
            ev_recv.append(st.event("comm"))

    back, ev_back = [], []
    for c, mb in enumerate(plan.minibatches):
        st.wait("main", ev_recv[c])
        st.hand_over("main", *received[c])
        z_RH = _experts(*received[c], mb, L, topk, expert_fn, deterministic)
        ev = st.event("main")
        with st.on("comm"):
            st.wait("comm", ev)
            st.hand_over("comm", z_RH)
            back.append(exchange(z_RH, transport, mb, COMBINE))
            ev_back.append(st.event("comm"))

    outs = []
    for c, mb in enumerate(plan.minibatches):
        st.wait("main", ev_back[c])
        st.hand_over("main", back[c])
        outs.append(_sum_rows(back[c], mb.token_idx_N, mb.slots, mb.num_tokens, mb.valid_N, deterministic))
    return outs[0] if C == 1 else torch.cat(outs, 0)
