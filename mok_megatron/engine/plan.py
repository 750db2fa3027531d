"""The dispatch plan: everything combine needs to undo dispatch, computed once per layer call.

Legend:
    T  local tokens       E  global experts       L  local experts (E / EP)
    N  rows this rank sends (expert-major)        R  rows this rank's experts receive
    EP expert-parallel size                        TP expert-tensor-parallel size (ETP)

Host synchronisation: at most one small device-to-host copy per call, of the ``[EP, TP, E]`` token
counts, and only when the row counts are data-dependent and crossing ranks (EP*TP > 1 and not
drop-and-pad) or when the row count itself is data-dependent (capacity without padding, router
padding). Dropless with EP*TP == 1 and drop-and-pad never read the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from mok_megatron.config import MoKConfig
from mok_megatron.transport.comm import group_size
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.ops.routing import SlotMap, capacity_order, dropless_order, expert_counts, slot_map


class RowLayout(Enum):
    """How a layer's expert calls get their (token, local expert) rows; fixed when the layer is built
    (``engine.select.select_engine``, from what the experts take)."""

    SORTED = "sorted"  # a stable sort groups the rows by expert (Megatron's layout; any experts)
    ALIGNED = "aligned"  # the routing kernels plan the rows (no sort) into a static buffer, each expert's
    # rows padded to the row alignment by the permute (MoK's experts: they take device counts)
    ALIGNED_EXACT = "aligned_exact"  # plain engine: ALIGNED with the buffer sized exactly (experts that
    # read the per-expert counts on the host anyway: TE's m_splits)
    FUSED = "fused"  # the experts take token rows and routing metadata and fuse the permute / combine
    # into their operands (the native FP8 experts)

    @property
    def routing_kernels(self) -> bool:
        """The routing kernels plan the rows (no sort)."""
        return self is not RowLayout.SORTED


@dataclass(frozen=True)
class EPGroups:
    """Process groups of one MoE layer: expert-parallel, expert-tensor-parallel and both together.

    Rank ``ep * TP + tp`` of ``tp_ep`` is EP rank ``ep``, ETP rank ``tp`` (Megatron's ordering).
    """

    ep: object = None
    tp: object = None
    tp_ep: object = None

    @property
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep is None else dist.get_rank(self.ep)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    @classmethod
    def from_pg_collection(cls, pg_collection) -> "EPGroups":
        return cls(ep=pg_collection.ep, tp=pg_collection.expt_tp, tp_ep=pg_collection.tp_ep)


@dataclass(frozen=True)
class DispatchPlan:
    """Frozen result of routing on this rank; dispatch produces it and combine consumes it."""

    hidden_shape: torch.Size  # layer input shape, restored by combine
    num_tokens: int  # T
    token_idx_N: torch.Tensor  # [N] token of each sent row
    expert_idx_N: torch.Tensor  # [N] global expert of each sent row
    slots: SlotMap  # [T, K] each token's rows (combine / permute-backward)
    send_splits: tuple[int, ...]  # [EP] rows to each EP rank
    recv_splits: tuple[int, ...]  # [EP] rows from each EP rank (this ETP rank's share)
    tp_splits: tuple[int, ...]  # [TP] rows each ETP peer received (all-gather sizes)
    sort_idx_R: torch.Tensor | None  # [R] source-major -> expert-major gather; None if identity
    unsort_idx_R: torch.Tensor | None  # [R] inverse of sort_idx_R
    tokens_per_expert_L: torch.Tensor  # [L] int64 on device
    capacity: int | None  # rows per expert in drop-and-pad mode
    groups: EPGroups
    # Aligned layout (``build_aligned_plan``): every expert's rows padded to a multiple of the experts'
    # alignment, padding rows zero; dispatch / combine run on this metadata instead of the slot map.
    meta: RoutingMeta | None = None
    ids_TK: torch.Tensor | None = None  # [T, K] each token's experts, ascending (aligned layout only)

    @property
    def num_sent(self) -> int:
        return int(self.token_idx_N.shape[0])


def _chunk_sort_index(sizes_SL: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index turning chunks ordered (source s, local expert l) into (l, s) order, and its inverse."""
    device = sizes_SL.device
    flat_sl = sizes_SL.reshape(-1)
    start_sl = (torch.cumsum(flat_sl, 0) - flat_sl).view_as(sizes_SL)
    sizes_ls = sizes_SL.t().reshape(-1)
    start_ls = start_sl.t().reshape(-1)
    dst_start = torch.cumsum(sizes_ls, 0) - sizes_ls
    pos = torch.arange(total, device=device)
    src_base = torch.repeat_interleave(start_ls, sizes_ls, output_size=total)
    dst_base = torch.repeat_interleave(dst_start, sizes_ls, output_size=total)
    sort_idx = src_base + (pos - dst_base)
    unsort_idx = torch.empty_like(sort_idx)
    unsort_idx[sort_idx] = pos
    return sort_idx, unsort_idx


def _check_routing(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, cfg: MoKConfig) -> tuple[int, int]:
    """(T, E) of the routing, after checking it against the layer's config."""
    num_tokens, num_experts = routing_map_TE.shape
    if num_experts != cfg.num_experts:
        raise ValueError(
            f"routing map has {num_experts} experts, the MoK layer was built for {cfg.num_experts}"
        )
    if probs_TE.shape != routing_map_TE.shape:
        raise ValueError(
            f"probs {tuple(probs_TE.shape)} and routing_map {tuple(routing_map_TE.shape)} differ in shape"
        )
    return num_tokens, num_experts


def build_plan(
    hidden_shape: torch.Size,
    routing_map_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    cfg: MoKConfig,
    groups: EPGroups,
) -> DispatchPlan:
    """Route this rank's tokens: the plan dispatch and combine run on (one collective at most)."""
    num_tokens, num_experts = _check_routing(routing_map_TE, probs_TE, cfg)
    device = routing_map_TE.device
    ep, tp = groups.ep_size, groups.tp_size
    if ep != cfg.ep_size or tp != cfg.etp_size:
        raise ValueError(
            f"groups have EP={ep}, ETP={tp}; the config says EP={cfg.ep_size}, ETP={cfg.etp_size}"
        )
    ep_rank, tp_rank = groups.ep_rank, groups.tp_rank
    L = cfg.num_local_experts
    lo = ep_rank * L

    if cfg.router_pad_multiple:
        from megatron.core.transformer.moe.moe_utils import pad_routing_map

        routing_map_TE = pad_routing_map(routing_map_TE.clone(), cfg.router_pad_multiple)

    capacity = None
    sizes_SL = None  # [TP*EP, L] rows per (source, local expert) after the gather, on device
    if cfg.pad_to_capacity:
        capacity = cfg.capacity(num_tokens)
        token_idx, expert_idx = capacity_order(routing_map_TE, capacity)
        send = (capacity * L,) * ep
        recv = (capacity * L,) * ep
        tp_splits = (capacity * L * ep,) * tp
        tokens_per_expert = torch.full((L,), capacity * ep * tp, dtype=torch.int64, device=device)
        if L > 1 and ep * tp > 1:
            sizes_SL = torch.full((tp * ep, L), capacity, dtype=torch.int64, device=device)
        num_recv = capacity * L * ep * tp
    else:
        counts_E = expert_counts(routing_map_TE)
        if ep * tp > 1:
            all_counts = counts_E.new_empty((ep * tp * num_experts,))
            dist.all_gather_into_tensor(all_counts, counts_E, group=groups.tp_ep)
            all_counts = all_counts.view(ep, tp, num_experts)
            host = all_counts.cpu()  # the one host sync of this call
            mine = host[ep_rank, tp_rank]
            num_sent = int(mine.sum())
            send = tuple(int(v) for v in mine.view(ep, L).sum(1))
            local_host = host[:, :, lo : lo + L]  # [EP, TP, L]
            recv = tuple(int(v) for v in local_host[:, tp_rank].sum(1))
            tp_splits = tuple(int(v) for v in local_host.sum(dim=(0, 2)))
            num_recv = int(local_host.sum())
            local_dev = all_counts[:, :, lo : lo + L]
            tokens_per_expert = local_dev.sum(dim=(0, 1))
            if L > 1:
                # After the ETP all-gather rows are ordered (tp, ep, local expert).
                sizes_SL = local_dev.transpose(0, 1).reshape(tp * ep, L)
        else:
            if cfg.dropless and not cfg.router_pad_multiple:
                num_sent = num_tokens * cfg.topk  # static: no sync
            else:
                num_sent = int(counts_E.sum())  # data-dependent row count: one sync
            send = recv = (num_sent,)
            tp_splits = (num_sent,)
            tokens_per_expert = counts_E
            num_recv = num_sent
        token_idx, expert_idx = dropless_order(routing_map_TE, num_sent)

    if cfg.dropless and not cfg.router_pad_multiple:
        slots = slot_map(token_idx, None, num_tokens, cfg.topk)  # exactly top-k rows per token
    else:
        # Dropped routes have no row; capacity / router padding rows carry probability zero.
        slots = slot_map(token_idx, probs_TE[token_idx, expert_idx] != 0, num_tokens, cfg.topk)
    sort_idx = unsort_idx = None
    if sizes_SL is not None:
        sort_idx, unsort_idx = _chunk_sort_index(sizes_SL, num_recv)
    return DispatchPlan(
        hidden_shape=hidden_shape,
        num_tokens=num_tokens,
        token_idx_N=token_idx,
        expert_idx_N=expert_idx,
        slots=slots,
        send_splits=send,
        recv_splits=recv,
        tp_splits=tp_splits,
        sort_idx_R=sort_idx,
        unsort_idx_R=unsort_idx,
        tokens_per_expert_L=tokens_per_expert,
        capacity=capacity,
        groups=groups,
    )


def aligned_plan_applies(cfg: MoKConfig) -> bool:
    """Whether ``build_aligned_plan`` can serve this layer: one rank owns every expert (EP = ETP = 1) and
    routing is dropless without router padding (every token has exactly top-k rows)."""
    return (
        cfg.ep_size == 1
        and cfg.etp_size == 1
        and cfg.dropless
        and not cfg.router_pad_multiple
        and not cfg.pad_to_capacity
    )


def static_aligned_rows(meta: RoutingMeta, max_routes: int) -> tuple[RoutingMeta, torch.Tensor]:
    """``meta`` with its buffer sized to the static bound for at most ``max_routes`` live routes
    (``num_rows_bound`` rounded up to the alignment), and the per-expert row counts of that buffer: each
    expert's aligned count, the last expert also owning the spare rows (zero rows) so that every count
    is a multiple of the alignment and they sum to the buffer's rows. No host read."""
    import dataclasses

    from mok_megatron.kernels.routing import num_rows_bound

    a = meta.alignment
    rows = -(-num_rows_bound(max_routes, meta.num_experts, a) // a) * a
    if a == 1:  # no padding: the routes per expert fill the rows (dropless: exactly max_routes of them)
        return dataclasses.replace(meta, num_rows=rows), meta.counts_E.long()
    ends = meta.aligned_offsets_E.long()
    aligned_L = torch.diff(ends, prepend=ends.new_zeros(1))
    tail = rows - ends[-1:]  # device tensor: no host read
    counts_L = torch.cat([aligned_L[:-1], aligned_L[-1:] + tail])
    return dataclasses.replace(meta, num_rows=rows), counts_L


def build_aligned_plan(
    hidden_shape: torch.Size,
    routing_map_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    cfg: MoKConfig,
    groups: EPGroups,
    alignment: int,
    *,
    exact_rows: bool = False,
) -> DispatchPlan:
    """The EP = 1 plan for experts that need every expert's rows padded to ``alignment`` (the native FP8
    GEMMs: 16): the permute writes each row straight into its padded position and zeroes the padding
    rows, so the experts run on the buffer as it is (no pad / unpad copies of their input, output or
    gradients). Rows: the static bound ``num_rows_bound`` rounded up to ``alignment``; the last expert
    owns the spare rows past the real padded total (zero rows, probability 0), so every group of
    ``tokens_per_expert_L`` is a multiple of ``alignment`` and they sum to the buffer's rows. No host
    read (the row count is static); routing metadata from ``kernels.routing`` (no sort).
    ``exact_rows``: for experts that read the counts on the host anyway (TE's m_splits): one host read
    sizes the buffer to the real padded total (no spare rows; with alignment 128 the static bound
    would add up to 127 zero rows per expert to the last expert's GEMM) and ``tokens_per_expert_L`` is
    then a CPU tensor, as Megatron's alltoall dispatcher hands TEGroupedMLP (no second read)."""
    import dataclasses

    from mok_megatron.kernels.routing import routing_metadata
    from mok_megatron.kernels.topk import topk_indices

    if not aligned_plan_applies(cfg) or groups.ep_size * groups.tp_size != 1:
        raise ValueError(
            "build_aligned_plan: needs EP = ETP = 1 and dropless routing without router padding; "
            f"got EP={cfg.ep_size}, ETP={cfg.etp_size}, dropless={cfg.dropless}, "
            f"router_pad_multiple={cfg.router_pad_multiple}, pad_to_capacity={cfg.pad_to_capacity}"
        )
    if alignment < 1:
        raise ValueError(f"build_aligned_plan: alignment={alignment}, expected >= 1")
    num_tokens, num_experts = _check_routing(routing_map_TE, probs_TE, cfg)
    k = cfg.topk
    # Dropless: each row has exactly K experts; as scores 1/0 the top-k picks them in ascending order.
    ids_TK = topk_indices(routing_map_TE.view(torch.uint8), k)
    meta = routing_metadata(ids_TK, num_experts, alignment)
    if exact_rows:  # the one host read; the experts get host counts (TE's m_splits: no second read)
        aligned_L = torch.diff(
            meta.aligned_offsets_E.long(), prepend=meta.aligned_offsets_E.new_zeros(1).long()
        )
        tokens_per_expert = aligned_L.cpu()
        meta = dataclasses.replace(meta, num_rows=int(tokens_per_expert.sum()))
    else:
        meta, tokens_per_expert = static_aligned_rows(meta, num_tokens * k)
    empty = torch.empty(0, dtype=torch.int64, device=routing_map_TE.device)
    return DispatchPlan(
        hidden_shape=hidden_shape,
        num_tokens=num_tokens,
        token_idx_N=empty,
        expert_idx_N=empty,
        slots=SlotMap(row_TK=meta.row_TK.long()),
        send_splits=(meta.num_rows,),
        recv_splits=(meta.num_rows,),
        tp_splits=(meta.num_rows,),
        sort_idx_R=None,
        unsort_idx_R=None,
        tokens_per_expert_L=tokens_per_expert,
        capacity=None,
        groups=groups,
        meta=meta,
        ids_TK=ids_TK,
    )
