"""The pipeline plan: how one layer call's tokens flow through minibatches, computed once per call.

The overlap engine moves *tokens*, not (token, expert) rows: a token goes at most once to each EP
rank that holds one of its experts, with that rank's slice of its routing (probabilities + mask).
The receiving rank expands tokens to (token, local expert) rows, runs its experts, sums each token's
local expert outputs, and sends one row per token back (DeepEP's layout). With top-8 routing over
two ranks this moves ~4x fewer bytes than one row per (token, expert) and never moves a row whose
expert is local.

Legend:
    T  local tokens             C  minibatches           EP expert-parallel ranks
    E  global experts           L  local experts (E / EP)
    N  token rows this rank sends in one minibatch (dest-major, token order inside a dest)
    R  token rows this rank receives in one minibatch (source-major)
    M  (token, local expert) rows of one minibatch, grouped by local expert
    W  routing metadata width = 2L (probabilities of the L experts of the destination, then mask)

Counts: one all-gather of ``[EP(dest), C, L+1]`` per rank (rows per destination local expert, token
rows per destination) gives every rank every count. Exact mode then reads it on the host once per
layer call (split sizes, row counts); sync-free mode never does: buffers have a fixed capacity of
``ceil(capacity_multiplier * minibatch tokens)`` token rows per (source, destination), and the
overflow flag (identical on every rank) stays on the device until the caller decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok_megatron.functional.comm import group_size
from mok_megatron.ops.routing import SlotMap, slot_map

MAX_MINIBATCHES = 16  # bounds the counts exchange; larger splits only shrink the GEMMs further
_MIN_ROWS_PER_EXPERT = 512  # auto rule: keep each local expert's GEMM at least this tall on average
_AUTO_MAX_MINIBATCHES = 4


class PipelineError(ValueError):
    """Inputs the pipeline cannot run on (named value, constraint, fix)."""


def auto_minibatch_size(
    num_tokens: int, topk: int, num_local_experts: int, ep_size: int, slow_link: bool = True
) -> int:
    """Default minibatch size, from the H200 measurements in docs/benchmarks.md.

    Over fast links (every EP rank in one NVLink domain) splitting costs more than it hides: one
    minibatch. Over slow links (EP across nodes, ~50 GB/s per GPU) as many minibatches (at most 4)
    as keep every local expert's GEMM at least 512 rows tall on average (a rank receives ~T*K/L rows
    per local expert when routing is balanced). Without expert parallelism there is nothing to hide."""
    if ep_size == 1 or num_tokens == 0 or not slow_link:
        return max(num_tokens, 1)
    rows_per_expert = num_tokens * topk / num_local_experts
    chunks = max(1, min(_AUTO_MAX_MINIBATCHES, int(rows_per_expert // _MIN_ROWS_PER_EXPERT)))
    return math.ceil(num_tokens / chunks)


def minibatch_bounds(num_tokens: int, minibatch_size: int) -> tuple[int, ...]:
    """Token boundaries ``(0, b1, ..., T)``; the last minibatch may be shorter. Capped at 16 minibatches."""
    if minibatch_size < 1:
        raise PipelineError(f"minibatch_size={minibatch_size}: must be >= 1.")
    size = max(minibatch_size, math.ceil(num_tokens / MAX_MINIBATCHES))
    if num_tokens == 0:
        return (0, 0)
    return tuple(range(0, num_tokens, size)) + (num_tokens,)


@dataclass(frozen=True)
class SendPlan:
    """One minibatch, sending side. Sizes are Python ints in exact mode, capacities in sync-free mode."""

    start: int  # first token of the minibatch
    num_tokens: int  # Tc
    token_idx_N: torch.Tensor  # [N] token (within the minibatch) of each sent row
    dest_N: torch.Tensor  # [N] destination EP rank of each row
    valid_N: torch.Tensor | None  # [N] row carries a token (sync-free padding: False)
    slots: SlotMap  # [Tc, EP] each token's sent rows (gradient of the gather, final sum)
    send_splits: tuple[int, ...] | None  # [EP] rows per destination (None: capacity each)
    recv_splits: tuple[int, ...] | None  # [EP] rows per source
    split_matrix: tuple[tuple[int, ...], ...] | None  # [EP(src)][EP(dest)] rows, every rank's sends
    capacity: int | None  # sync-free: token rows per (source, destination)
    rows_M: int  # expanded rows this rank's experts compute (sync-free: an upper bound)
    tokens_per_expert_L: torch.Tensor  # [L] int64 on device
    tokens_per_expert_host: tuple[int, ...] | None  # exact mode: the same on the host


@dataclass(frozen=True)
class PipelinePlan:
    hidden_shape: torch.Size
    num_tokens: int
    minibatches: tuple[SendPlan, ...]
    num_local_experts: int
    ep_group: object
    sync_free: bool
    overflow: torch.Tensor | None  # sync-free: bool scalar on device, identical on every rank

    @property
    def ep_size(self) -> int:
        return group_size(self.ep_group)


def _counts(routing_map_TE, bounds, ep, L):
    """``[C, EP, L+1]``: rows per (minibatch, destination local expert) and token rows per destination."""
    T = routing_map_TE.shape[0]
    C = len(bounds) - 1
    size = bounds[1] - bounds[0] if C else 1  # equal minibatches but the last: no host tensors
    mb_T = torch.arange(T, device=routing_map_TE.device) // max(size, 1)
    rm = routing_map_TE.view(T, ep, L)
    per = torch.cat([rm, rm.any(-1, keepdim=True)], -1).to(torch.int64).view(T, -1)  # [T, EP*(L+1)]
    out = torch.zeros((C, ep * (L + 1)), dtype=torch.int64, device=routing_map_TE.device)
    out.index_add_(0, mb_T, per)  # integer sums: exact in any order
    return out.view(C, ep, L + 1)


def _send_order(to_rank_TcP: torch.Tensor, num_rows: int):
    """Dest-major order of the rows ``(token, dest)`` marked in ``to_rank``; first ``num_rows`` rows."""
    tc = to_rank_TcP.shape[0]
    flat = to_rank_TcP.t().reshape(-1).argsort(descending=True, stable=True)[:num_rows]
    return flat % tc, flat // tc


def build_pipeline_plan(
    hidden_shape: torch.Size,
    routing_map_TE: torch.Tensor,
    num_local_experts: int,
    topk: int,
    ep_group,
    minibatch_size: int,
    sync_free: bool = False,
    capacity_multiplier: float = 1.0,
) -> PipelinePlan:
    """Route this rank's tokens into minibatches: one all-gather of counts, at most one host read."""
    T, E = routing_map_TE.shape
    ep = group_size(ep_group)
    L = num_local_experts
    if E != ep * L:
        raise PipelineError(f"routing map has {E} experts; EP={ep} x {L} local experts = {ep * L}.")
    device = routing_map_TE.device
    bounds = minibatch_bounds(T, minibatch_size)
    C = len(bounds) - 1
    counts_CPW = _counts(routing_map_TE, bounds, ep, L)  # [C, EP(dest), L+1]
    # Every rank learns every count: [EP(src), EP(dest), C, L+1] (padded to MAX_MINIBATCHES so the
    # collective has the same size on every rank; T rides along to check that the ranks agree).
    payload = torch.zeros((ep, MAX_MINIBATCHES, L + 1), dtype=torch.int64, device=device)
    payload[:, :C] = counts_CPW.transpose(0, 1)
    payload = torch.cat([payload.view(-1), torch.full((1,), T, dtype=torch.int64, device=device)])
    if ep > 1:
        gathered = payload.new_empty((ep * payload.numel(),))  # flat: gloo wants it so
        dist.all_gather_into_tensor(gathered, payload, group=ep_group)
        gathered = gathered.view(ep, -1)
    else:
        gathered = payload.view(1, -1)
    me = 0 if ep == 1 else dist.get_rank(ep_group)
    all_SDCW = gathered[:, :-1].view(ep, ep, MAX_MINIBATCHES, L + 1)
    mine_SCW = all_SDCW[:, me, :C]  # what each source sends to me, per minibatch

    if sync_free:
        return _sync_free_plan(
            hidden_shape,
            routing_map_TE,
            bounds,
            counts_CPW,
            mine_SCW,
            all_SDCW,
            gathered[:, -1],
            L,
            topk,
            ep,
            ep_group,
            capacity_multiplier,
        )

    host = gathered.cpu()  # the one host read of this call
    tokens_host = host[:, -1].tolist()
    if len(set(tokens_host)) != 1:
        raise PipelineError(
            f"EP ranks hold different token counts {tokens_host} in one MoE layer call; the MoK "
            "pipeline needs the same number of tokens on every EP rank (Megatron's layout gives it)."
        )
    host_SDCW = host[:, :-1].view(ep, ep, MAX_MINIBATCHES, L + 1)
    mbs = []
    for c in range(C):
        start, stop = bounds[c], bounds[c + 1]
        tc = stop - start
        send = tuple(int(v) for v in host_SDCW[me, :, c, L])
        recv = tuple(int(v) for v in host_SDCW[:, me, c, L])
        tpe_host = tuple(int(v) for v in host_SDCW[:, me, c, :L].sum(0))
        to_rank = routing_map_TE[start:stop].view(tc, ep, L).any(-1)
        tok, dest = _send_order(to_rank, sum(send))
        mbs.append(
            SendPlan(
                start=start,
                num_tokens=tc,
                token_idx_N=tok,
                dest_N=dest,
                valid_N=None,
                slots=slot_map(tok, torch.ones_like(tok, dtype=torch.bool), tc, ep),
                send_splits=send,
                recv_splits=recv,
                split_matrix=tuple(tuple(int(v) for v in host_SDCW[s, :, c, L]) for s in range(ep)),
                capacity=None,
                rows_M=sum(tpe_host),
                tokens_per_expert_L=mine_SCW[:, c, :L].sum(0),
                tokens_per_expert_host=tpe_host,
            )
        )
    return PipelinePlan(hidden_shape, T, tuple(mbs), L, ep_group, False, None)


def _sync_free_plan(
    hidden_shape,
    routing_map_TE,
    bounds,
    counts_CPW,
    mine_SCW,
    all_SDCW,
    tokens_S,
    L,
    topk,
    ep,
    ep_group,
    multiplier,
):
    T = routing_map_TE.shape[0]
    C = len(bounds) - 1
    overflow = (tokens_S != T).any()  # ranks disagree on T: flagged like an overflow, never silent
    mbs = []
    for c in range(C):
        start, stop = bounds[c], bounds[c + 1]
        tc = stop - start
        cap = max(1, math.ceil(multiplier * tc))
        overflow = overflow | (all_SDCW[:, :, c, L] > cap).any()
        to_rank = routing_map_TE[start:stop].view(tc, ep, L).any(-1)  # [Tc, EP]
        # For each destination, its tokens in order, then the rest: take `cap` slots per destination.
        order_PT = (~to_rank).t().to(torch.int8).argsort(dim=1, stable=True)  # [EP, Tc]
        if cap > tc:
            order_PT = torch.cat([order_PT, order_PT[:, :1].expand(ep, cap - tc)], 1)
        tok_PC = order_PT[:, :cap]
        n_P = counts_CPW[c, :, L]  # my token rows per destination
        valid_PC = torch.arange(cap, device=tok_PC.device).view(1, -1) < n_P.view(-1, 1)
        tok = tok_PC.reshape(-1)
        valid = valid_PC.reshape(-1)
        dest = torch.arange(ep, device=tok.device).repeat_interleave(cap)
        mbs.append(
            SendPlan(
                start=start,
                num_tokens=tc,
                token_idx_N=tok,
                dest_N=dest,
                valid_N=valid,
                slots=slot_map(tok, valid, tc, ep),
                send_splits=None,
                recv_splits=None,
                split_matrix=None,
                capacity=cap,
                rows_M=ep * cap * min(topk, L),
                tokens_per_expert_L=mine_SCW[:, c, :L].sum(0),
                tokens_per_expert_host=None,
            )
        )
    return PipelinePlan(hidden_shape, T, tuple(mbs), L, ep_group, True, overflow)
