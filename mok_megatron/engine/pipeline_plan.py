"""The pipeline plan: how one layer call's tokens flow through minibatches, computed once per call.

The overlap engine moves *tokens*, not (token, expert) rows: a token goes at most once to each EP
rank that holds one of its experts, with that rank's slice of its routing (probabilities + mask).
The receiving rank expands tokens to (token, local expert) rows, runs its experts, sums each token's
local expert outputs, and sends one row per token back (DeepEP's layout). With top-8 routing over
two ranks this moves ~4x fewer bytes than one row per (token, expert) and never moves a row whose
expert is local.

Local rows never travel: each minibatch's tokens are cut into regions ``R | A | B``. The rows a
token sends to *other* ranks (and, under the loopback stand-in for larger EP, the rows of region R,
the emulated peers' share) form the remote exchange; the rows a token keeps on this rank are
computed in place, region A while the dispatch flies and region B while the combine returns. The
local regions are dense (every token of the region, masked by whether it routes here): they need no
sort, no gather and no communication. With ``fuse_local`` (fast links: what is left to hide is
smaller than what splitting costs) there is no region B and region A's rows join the received rows
in one expert call after the dispatch lands (one grouped GEMM per weight, no weight-gradient sum).

Two ways to cut a call into minibatches (``MinibatchSplit``): by *tokens* (minibatch c is a run of
tokens through every local expert; each extra minibatch shrinks every expert's GEMMs and adds a
weight-gradient sum) or by *experts* (minibatch c is every token through one group of local experts,
the same group on every rank: each expert's weights are used by exactly one minibatch, so there is no
weight-gradient sum and no GEMM shrinks; a token travels once per group it uses, so the exchanges carry
more rows). Everything below holds for both; with experts, ``Tc`` = T and the routing map, counts and
metadata of minibatch c are those of its group's experts (``ExpertGroup``).

Legend:
    T  local tokens             C  minibatches           EP expert-parallel ranks
    E  global experts           L  local experts (E / EP)
    N  token rows this rank sends in one minibatch (dest-major, token order inside a dest)
    R  token rows this rank receives in one minibatch (source-major)
    M  (token, local expert) rows of one minibatch, grouped by local expert
    W  routing metadata width = 2L (probabilities of the L experts of the destination, then mask)

Counts: one all-gather of ``[EP(dest), 3C, L+1]`` per rank (per region R, A, B) (rows per destination local expert, token
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

from mok_megatron.ops.routing import SlotMap, slot_map
from mok_megatron.options import LocalRows, MinibatchSplit
from mok_megatron.transport.base import ExpertGroup, ExpertPart, Link, LocalPlan, SendPlan
from mok_megatron.transport.comm import group_size

MAX_MINIBATCHES = 16  # bounds the counts exchange; larger splits only shrink the GEMMs further
_MIN_ROWS_PER_EXPERT = 512  # auto rule: keep each local expert's GEMM at least this tall on average
_AUTO_MAX_MINIBATCHES = 4
# --mok-minibatch-split experts without --mok-minibatch-size: 4 groups (at most one per local expert), the
# count at which the split beat as many token minibatches on an H200 (DeepSeek-V3's 4k slice, 900 GB/s)
AUTO_EXPERT_GROUPS = 4
MIN_LOCAL_HALF = 256  # tokens: a minibatch's local rows are split in halves A/B only above 2x this


class PipelineError(ValueError):
    """Inputs the pipeline cannot run on (named value, constraint, fix)."""


def auto_minibatch_size(
    num_tokens: int, topk: int, num_local_experts: int, ep_size: int, slow_link: bool = True
) -> int:
    """Default minibatch size, from the H200 measurements (docs/performance.md).

    Over fast links (every EP rank in one NVLink domain) splitting costs more than it hides: one
    minibatch. Over slow links (EP across nodes, ~50 GB/s per GPU) as many minibatches (at most 4)
    as keep every local expert's GEMM at least 512 rows tall on average (a rank receives ~T*K/L rows
    per local expert when routing is balanced). Without expert parallelism there is nothing to hide."""
    if ep_size == 1 or num_tokens == 0 or not slow_link:
        return max(num_tokens, 1)
    rows_per_expert = num_tokens * topk / num_local_experts
    chunks = max(1, min(_AUTO_MAX_MINIBATCHES, int(rows_per_expert // _MIN_ROWS_PER_EXPERT)))
    return math.ceil(num_tokens / chunks)


def fuse_local_rows(local_rows: LocalRows, slow_link: bool) -> bool:
    """``--mok-local-rows`` -> whether a rank's local rows join the received rows' expert call.

    'auto': fused over fast links (every EP rank in one NVLink domain), where the exchanges are short
    and splitting the local rows into two more expert calls costs more (smaller GEMMs, a weight-
    gradient sum per call, launches) than it hides; overlapped over slow links."""
    local_rows = LocalRows(local_rows)
    if local_rows is LocalRows.AUTO:
        return not slow_link
    return local_rows is LocalRows.FUSED


@dataclass(frozen=True)
class MinibatchPolicy:
    """How the overlap pipeline cuts one layer's calls into minibatches and where their local rows run;
    fixed when the layer is built (``engine.select``), from the options and the transport's peers and
    link. ``plan`` builds each call's ``PipelinePlan``."""

    size: int | None = None  # tokens per minibatch (None: ``auto_minibatch_size`` / AUTO_EXPERT_GROUPS)
    split: MinibatchSplit = MinibatchSplit.TOKENS
    link: Link = Link.FAST  # the transport's link: the automatic size follows it
    peers: int = 1  # the EP ranks the exchanges span (the transport's peers)
    emulated_ep: int = 1  # > 1: one rank stands for that many (region R travels, ``build_pipeline_plan``)
    fuse_local: bool = False  # region A's rows join the received rows' expert call (``fuse_local_rows``)
    sync_free: bool = False
    capacity_multiplier: float = 1.0

    @classmethod
    def of(cls, options, transport, ep_size: int) -> MinibatchPolicy:
        """The policy of a layer with ``options`` (``MoKOptions``) whose exchanges go through
        ``transport`` over an EP group of ``ep_size`` ranks."""
        return cls(
            size=options.minibatch_size,
            split=options.minibatch_split,
            link=transport.link,
            peers=transport.peers,
            emulated_ep=transport.peers if ep_size == 1 else 1,
            fuse_local=fuse_local_rows(options.local_rows, transport.link is Link.SLOW),
            sync_free=options.sync_free,
            capacity_multiplier=options.capacity_multiplier,
        )

    def minibatch_size(self, num_tokens: int, topk: int, num_local_experts: int) -> int:
        """Tokens per minibatch of a call of ``num_tokens``."""
        if self.size:
            return self.size
        if self.split is MinibatchSplit.EXPERTS:  # groups of experts: AUTO_EXPERT_GROUPS of them
            return math.ceil(max(num_tokens, 1) / AUTO_EXPERT_GROUPS)
        return auto_minibatch_size(
            num_tokens, topk, num_local_experts, self.peers, slow_link=self.link is Link.SLOW
        )

    def plan(
        self,
        hidden_shape: torch.Size,
        routing_map_TE: torch.Tensor,
        num_local_experts: int,
        topk: int,
        ep_group,
        sync_free: bool | None = None,
        labels: dict | None = None,
    ) -> PipelinePlan:
        """One call's plan (``build_pipeline_plan``); ``sync_free`` overrides the policy's (an overflow's
        exact redo); ``labels``: the layer's region-label cache."""
        T = routing_map_TE.shape[0]
        return build_pipeline_plan(
            hidden_shape,
            routing_map_TE,
            num_local_experts,
            topk,
            ep_group,
            self.minibatch_size(T, topk, num_local_experts),
            sync_free=self.sync_free if sync_free is None else sync_free,
            capacity_multiplier=self.capacity_multiplier,
            emulated_ep=self.emulated_ep,
            fuse_local=self.fuse_local,
            split_experts=self.split is MinibatchSplit.EXPERTS,
            labels=labels,
        )


def minibatch_bounds(num_tokens: int, minibatch_size: int) -> tuple[int, ...]:
    """Token boundaries ``(0, b1, ..., T)``; the last minibatch may be shorter. Capped at 16 minibatches."""
    if minibatch_size < 1:
        raise PipelineError(f"minibatch_size={minibatch_size}: must be >= 1.")
    size = max(minibatch_size, math.ceil(num_tokens / MAX_MINIBATCHES))
    if num_tokens == 0:
        return (0, 0)
    return tuple(range(0, num_tokens, size)) + (num_tokens,)


def expert_bounds(num_local_experts: int, groups: int) -> tuple[int, ...]:
    """``(0, e1, ..., L)``: ``groups`` (capped at L) groups of consecutive local experts, sizes differing
    by at most one (the larger first)."""
    g = max(1, min(groups, num_local_experts))
    per, extra = divmod(num_local_experts, g)
    out = [0]
    for i in range(g):
        out.append(out[-1] + per + (1 if i < extra else 0))
    return tuple(out)


@dataclass(frozen=True)
class PipelinePlan:
    hidden_shape: torch.Size
    num_tokens: int
    minibatches: tuple[SendPlan, ...]
    num_local_experts: int
    ep_group: object
    sync_free: bool
    overflow: torch.Tensor | None  # sync-free: bool scalar on device, identical on every rank
    emulated_ep: int = 1  # loopback: region R holds the emulated peers' share of the tokens
    fuse_local: bool = False  # region A's rows join the received rows' expert call (no region B)
    expert_bounds: tuple[int, ...] | None = None  # split by experts: the groups' bounds (None: by tokens)

    @property
    def ep_size(self) -> int:
        return group_size(self.ep_group)


def regions(num_tokens: int, emulated_ep: int, split_local: bool = True) -> tuple[int, int, int]:
    """``(r, a, b)`` of a minibatch of ``num_tokens``: R is the emulated peers' share (``1 - 1/EP``)
    of the tokens (0 without emulation; all of them when the emulated local share is under
    ``MIN_LOCAL_HALF`` tokens: too small to hide anything, it would only add an expert call); the
    local rest is halved into A and B when it holds at least ``2 * MIN_LOCAL_HALF`` tokens, else it
    is all A (halves that small would only add launches and a weight-gradient sum; ``split_local``
    False: always all A)."""
    r = num_tokens - (num_tokens + emulated_ep - 1) // emulated_ep
    if emulated_ep > 1 and num_tokens - r < MIN_LOCAL_HALF:
        r = num_tokens  # emulated local share too small to hide anything: it travels too
    rest = num_tokens - r
    a = (rest + 1) // 2 if split_local and rest >= 2 * MIN_LOCAL_HALF else rest
    return r, a, rest - a


MAX_CACHED_LABELS = 64  # call shapes a labels cache keeps; more (shapes that keep changing) start it over


def _region_labels(
    T: int, size: int, emulated_ep: int, device, split_local: bool = True, cache: dict | None = None
) -> torch.Tensor:
    """``[T]`` region id ``3c + {0: R, 1: A, 2: B}`` of every token, by device arithmetic (the same
    rule as ``regions``; no host tensors, so a CUDA graph can capture it). ``cache`` (the layer's
    ``engine.pipeline.PipelineRuntime.labels``) keeps them per shape: later calls launch nothing (a graph
    captured after the first call reads the cached tensor)."""
    if cache is None:
        return _labels(T, size, emulated_ep, device, split_local)
    key = (T, size, emulated_ep, MIN_LOCAL_HALF, split_local, str(device))
    if key not in cache:
        if len(cache) > MAX_CACHED_LABELS:
            cache.clear()
        cache[key] = _labels(T, size, emulated_ep, device, split_local)
    return cache[key]


def _labels(T: int, size: int, emulated_ep: int, device, split_local: bool = True) -> torch.Tensor:
    t = torch.arange(T, device=device)
    c = t // size
    o = t - c * size
    tc = (T - c * size).clamp(max=size)
    r = tc - (tc + emulated_ep - 1) // emulated_ep
    if emulated_ep > 1:
        r = torch.where(tc - r < MIN_LOCAL_HALF, tc, r)
    rest = tc - r
    half = 2 * MIN_LOCAL_HALF if split_local else T + 1
    a = torch.where(rest >= half, (rest + 1) // 2, rest)
    return 3 * c + (o >= r).to(torch.int64) + (o >= r + a).to(torch.int64)


def _counts(routing_map_TE, bounds, ep, L, emulated_ep, split_local=True, cache=None):
    """``[3C, EP, L+1]``: rows per (region, destination local expert) and token rows per destination."""
    T = routing_map_TE.shape[0]
    C = len(bounds) - 1
    size = bounds[1] - bounds[0] if C else 1  # equal minibatches but the last
    label_T = _region_labels(T, max(size, 1), emulated_ep, routing_map_TE.device, split_local, cache)
    rm = routing_map_TE.view(T, ep, L)
    per = torch.cat([rm, rm.any(-1, keepdim=True)], -1).to(torch.int64).view(T, -1)  # [T, EP*(L+1)]
    out = torch.zeros((3 * C, ep * (L + 1)), dtype=torch.int64, device=routing_map_TE.device)
    # Integer sums: exact in any order (segment sums of a running sum measured no faster on an H200).
    out.index_add_(0, label_T, per)
    return out.view(3 * C, ep, L + 1)


def _group_of_expert(L: int, bounds: tuple[int, ...], device) -> torch.Tensor:
    """``[L]`` the group of each local expert, by device arithmetic (capturable: no host tensor)."""
    l_L = torch.arange(L, device=device)
    g_L = torch.zeros_like(l_L)
    for b in bounds[1:-1]:
        g_L += (l_L >= b).to(g_L.dtype)
    return g_L


def _counts_by_experts(routing_map_TE, bounds, ep, L, emulated_ep, split_local=True, cache=None):
    """``_counts`` for a call split by experts: minibatch c is every token with only group c's experts,
    so rows per (region, destination local expert) land in the expert's group, and a token row to a
    destination counts in every group it uses there."""
    T = routing_map_TE.shape[0]
    C = len(bounds) - 1
    dev = routing_map_TE.device
    label_T = _region_labels(T, max(T, 1), emulated_ep, dev, split_local, cache)  # one minibatch of T: 0..2
    rm_TPL = routing_map_TE.view(T, ep, L)
    group_L = _group_of_expert(L, bounds, dev)
    onehot_LC = (group_L.unsqueeze(1) == torch.arange(C, device=dev)).to(torch.int64)  # [L, C]
    # [T, EP, C] the token uses group c on that destination
    uses_TPC = torch.stack(
        [rm_TPL[:, :, lo:hi].any(-1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)], -1
    )
    per = torch.cat([rm_TPL, uses_TPC], -1).to(torch.int64).view(T, -1)  # [T, EP*(L+C)]
    sums = torch.zeros((3, ep * (L + C)), dtype=torch.int64, device=dev)
    sums.index_add_(0, label_T, per)
    sums = sums.view(3, ep, L + C)
    rows_CGPL = sums[:, :, :L].unsqueeze(0) * onehot_LC.t().view(C, 1, 1, L)  # [C, 3, EP, L]
    tokens_CGP = sums[:, :, L:].permute(2, 0, 1)  # [C, 3, EP]
    return torch.cat([rows_CGPL, tokens_CGP.unsqueeze(-1)], -1).view(3 * C, ep, L + 1)


def build_pipeline_plan(
    hidden_shape: torch.Size,
    routing_map_TE: torch.Tensor,
    num_local_experts: int,
    topk: int,
    ep_group,
    minibatch_size: int,
    sync_free: bool = False,
    capacity_multiplier: float = 1.0,
    emulated_ep: int = 1,
    fuse_local: bool = False,
    split_experts: bool = False,
    labels: dict | None = None,
) -> PipelinePlan:
    """Route this rank's tokens into minibatches: one all-gather of counts, at most one host read.

    ``split_experts``: the minibatches are groups of local experts (as many as ``minibatch_size`` gives
    token minibatches, at most L), each over every token (see the module docstring).

    ``emulated_ep`` > 1 (loopback benchmarks, EP=1 only): region R of each minibatch, the share of
    rows an EP rank would receive from its peers, goes through the transport as if remote.
    ``fuse_local``: no region B; the local rows run in the received rows' expert call (see the
    module docstring). ``labels``: the layer's cache of region labels per call shape (``_region_labels``;
    None: computed every call)."""
    T, E = routing_map_TE.shape
    ep = group_size(ep_group)
    L = num_local_experts
    if E != ep * L:
        raise PipelineError(f"routing map has {E} experts; EP={ep} x {L} local experts = {ep * L}.")
    if emulated_ep < 1 or (emulated_ep > 1 and ep > 1):
        raise PipelineError(
            f"emulated_ep={emulated_ep} with EP={ep}: emulation needs EP=1 and emulated_ep >= 1; "
            "pass emulated_ep=1 for real expert parallelism."
        )
    device = routing_map_TE.device
    bounds = minibatch_bounds(T, minibatch_size)
    C = len(bounds) - 1
    groups = None
    if split_experts:
        groups = expert_bounds(L, C)
        C = len(groups) - 1
        bounds = (0, T)  # every minibatch spans every token
        counts_GPW = _counts_by_experts(routing_map_TE, groups, ep, L, emulated_ep, not fuse_local, labels)
    else:
        counts_GPW = _counts(
            routing_map_TE, bounds, ep, L, emulated_ep, not fuse_local, labels
        )  # [3C, EP(dest), L+1]
    # Every rank learns every count: [EP(src), EP(dest), 3C, L+1] (padded to 3*MAX_MINIBATCHES so
    # the collective has the same size on every rank; T rides along to check that the ranks agree).
    payload = torch.zeros((ep, 3 * MAX_MINIBATCHES, L + 1), dtype=torch.int64, device=device)
    payload[:, : 3 * C] = counts_GPW.transpose(0, 1)
    payload = torch.cat([payload.view(-1), torch.full((1,), T, dtype=torch.int64, device=device)])
    if ep > 1:
        gathered = payload.new_empty((ep * payload.numel(),))  # flat: gloo wants it so
        dist.all_gather_into_tensor(gathered, payload, group=ep_group)
        gathered = gathered.view(ep, -1)
    else:
        gathered = payload.view(1, -1)
    me = 0 if ep == 1 else dist.get_rank(ep_group)
    all_SDGW = gathered[:, :-1].view(ep, ep, 3 * MAX_MINIBATCHES, L + 1)
    ctx = _Ctx(routing_map_TE, bounds, me, ep, L, topk, emulated_ep, all_SDGW, not fuse_local, groups)
    if sync_free:
        tokens_S = gathered[:, -1]
        overflow = (tokens_S != T).any()  # ranks disagree on T: flagged like an overflow, never silent
        mbs = []
        for c in range(C):
            mb, over = _sync_free_minibatch(ctx, c, capacity_multiplier)
            overflow = overflow | over
            mbs.append(mb)
        return PipelinePlan(
            hidden_shape, T, tuple(mbs), L, ep_group, True, overflow, emulated_ep, fuse_local, groups
        )

    host = gathered.cpu()  # the one host read of this call
    tokens_host = host[:, -1].tolist()
    if len(set(tokens_host)) != 1:
        raise PipelineError(
            f"EP ranks hold different token counts {tokens_host} in one MoE layer call; the MoK "
            "pipeline needs the same number of tokens on every EP rank (Megatron's layout gives it)."
        )
    host_SDGW = host[:, :-1].view(ep, ep, 3 * MAX_MINIBATCHES, L + 1).tolist()
    tpe = ctx.device_tpe(C)
    mbs = tuple(_exact_minibatch(ctx, c, host_SDGW, [t[c] for t in tpe]) for c in range(C))
    return PipelinePlan(hidden_shape, T, mbs, L, ep_group, False, None, emulated_ep, fuse_local, groups)


@dataclass(frozen=True)
class _Ctx:
    routing_map_TE: torch.Tensor
    bounds: tuple[int, ...]
    me: int
    ep: int
    L: int
    topk: int
    emulated_ep: int
    all_SDGW: torch.Tensor  # device counts [EP(src), EP(dest), 3*MAX, L+1]
    split_local: bool = True  # local rows in halves A/B (False: all A, fused with the received rows)
    groups: tuple[int, ...] | None = None  # split by experts: the groups' bounds

    def group(self, c) -> ExpertGroup | None:
        return None if self.groups is None else ExpertGroup(self.groups, c)

    def experts(self, c) -> tuple[int, int]:
        """Local experts ``[lo, hi)`` of minibatch c."""
        return (0, self.L) if self.groups is None else (self.groups[c], self.groups[c + 1])

    def minibatch(self, c):
        if self.groups is None:
            start, stop = self.bounds[c], self.bounds[c + 1]
            rm_TPL = self.routing_map_TE[start:stop].view(stop - start, self.ep, self.L)
        else:
            start, stop = 0, self.bounds[-1]
            lo, hi = self.experts(c)
            rm_TPL = self.routing_map_TE.view(stop, self.ep, self.L)[:, :, lo:hi]
        tc = stop - start
        to_rank_TP = rm_TPL.any(-1)  # [Tc, EP]
        return start, tc, to_rank_TP, regions(tc, self.emulated_ep, self.split_local)

    def device_tpe(self, C):
        """``[C, 3, L]`` rows per local expert arriving here per minibatch: (remote, A, B), device.
        Views of two reductions for the whole call, not small ops per minibatch."""
        mine_SGL = self.all_SDGW[:, self.me, : 3 * C, : self.L]
        own_CRL = mine_SGL[self.me].view(C, 3, self.L)
        if self.emulated_ep > 1:
            remote_CL = own_CRL[:, 0]
        else:
            remote_CL = (mine_SGL.sum(0) - mine_SGL[self.me]).view(C, 3, self.L).sum(1)
        return remote_CL, own_CRL[:, 1], own_CRL[:, 2]


def _sum_map(tc, tok_N, here_T, r, remote: SlotMap) -> SlotMap:
    """The final per-token sum over ``cat(remote rows, region A and B rows)``: each token's remote
    rows in destination order (the remote slot map), then its local row (a column appended)."""
    dev = tok_N.device
    n = tok_N.shape[0]
    local_T = torch.arange(n - r, n - r + tc, device=dev)  # row of token t >= r: n + t - r
    local_T = local_T * (local_T >= n)  # tokens of region R own no local row: 0, masked
    row_TK = torch.cat([remote.row_TK, local_T.unsqueeze(1)], 1)
    valid_rem = (
        remote.valid_TK if remote.valid_TK is not None else torch.ones_like(remote.row_TK, dtype=torch.bool)
    )
    valid_TK = torch.cat([valid_rem, here_T.unsqueeze(1)], 1)
    return SlotMap(row_TK, valid_TK)


def _remote_sources(ctx):
    """The ranks whose rows reach this rank through the transport (emulated: this rank itself)."""
    return [s for s in range(ctx.ep) if s != ctx.me] or [ctx.me]


def _here_T(ctx, to_rank_TP, r):
    here = to_rank_TP[:, ctx.me]
    if r:  # emulated: region R travels, so it is not "here"
        here = here.clone()
        here[:r] = False
    return here


def _exact_minibatch(ctx: _Ctx, c: int, host_SDGW, tpe_dev) -> SendPlan:
    ep, me, L = ctx.ep, ctx.me, ctx.L
    start, tc, to_rank_TP, (r, a, b) = ctx.minibatch(c)
    G = (3 * c, 3 * c + 1, 3 * c + 2)

    def rows(s, d, gs):  # token rows s sends d over regions gs
        return sum(host_SDGW[s][d][g][L] for g in gs)

    lo, hi = ctx.experts(c)

    def tpe(s_list, d, gs):
        return tuple(sum(host_SDGW[s][d][g][l] for s in s_list for g in gs) for l in range(lo, hi))

    emulated = ctx.emulated_ep > 1
    if emulated:  # one rank: region R is the exchange, all of its tokens (dense)
        split = ((r,),)
        src_gs = G[:1]
    else:
        split = tuple(tuple(0 if s == d else rows(s, d, G) for d in range(ep)) for s in range(ep))
        src_gs = G
    send = split[me]
    recv = tuple(split[s][me] for s in range(ep))
    # Remote rows, dest-major (token order inside a destination); emulated: region R, dense.
    if emulated:
        tok = torch.arange(r, device=to_rank_TP.device)
        dest = torch.zeros_like(tok)
    else:
        remote_TP = to_rank_TP.clone()
        remote_TP[:, me] = False
        flat = remote_TP.t().reshape(-1).argsort(descending=True, stable=True)[: sum(send)]
        tok, dest = flat % tc, flat // tc
    sources = _remote_sources(ctx)
    tpe_remote = tpe(sources, me, src_gs)
    here_T = _here_T(ctx, to_rank_TP, r)
    slots = slot_map(tok, torch.ones_like(tok, dtype=torch.bool), tc, max(ep - 1, 1))
    sum_slots = _sum_map(tc, tok, here_T, r, slots)

    def part(i, host):
        return ExpertPart(sum(host), tpe_dev[i][lo:hi], host, False)

    local = LocalPlan(
        regions=(r, a, b),
        here_T=here_T,
        remote=part(0, tpe_remote),
        part_a=part(1, tpe([me], me, G[1:2])),
        part_b=part(2, tpe([me], me, G[2:3])),
        sum_slots=sum_slots,
    )
    return SendPlan(
        start=start,
        num_tokens=tc,
        token_idx_N=tok,
        dest_N=dest,
        valid_N=None,
        slots=slots,
        send_splits=send,
        recv_splits=recv,
        split_matrix=split,
        capacity=None,
        rows_M=local.remote.rows_M,
        tokens_per_expert_L=local.remote.tokens_per_expert_L,
        tokens_per_expert_host=tpe_remote,
        local=local,
        group=ctx.group(c),
    )


def _sync_free_minibatch(ctx: _Ctx, c: int, multiplier: float):
    ep, me, L = ctx.ep, ctx.me, ctx.L
    start, tc, to_rank_TP, (r, a, b) = ctx.minibatch(c)
    lo, hi = ctx.experts(c)
    kk = min(ctx.topk, hi - lo)
    dev = to_rank_TP.device
    G = slice(3 * c, 3 * c + 3)
    emulated = ctx.emulated_ep > 1
    if emulated:
        cap = r
        tok = torch.arange(r, device=dev)
        dest = torch.zeros_like(tok)
        valid = to_rank_TP[:r, 0]
        split = ((r,),)
        over = torch.zeros((), dtype=torch.bool, device=dev)
    else:
        cap = max(1, math.ceil(multiplier * tc))
        rows_SD = ctx.all_SDGW[:, :, G, L].sum(-1)  # [EP, EP] token rows per (source, dest)
        off_diag = ~torch.eye(ep, dtype=torch.bool, device=dev)
        over = ((rows_SD > cap) & off_diag).any()
        # Peers = every rank but me, indexed on the device: a host index list would be a pageable
        # host-to-device copy, which CUDA graph capture rejects.
        p_idx = torch.arange(ep - 1, device=dev)
        peer_idx = p_idx + (p_idx >= me).to(p_idx.dtype)
        to_peer = to_rank_TP.index_select(1, peer_idx)  # [Tc, EP-1]
        # For each peer, its tokens in order, then the rest: take `cap` slots per peer.
        order_PT = (~to_peer).t().to(torch.int8).argsort(dim=1, stable=True)  # [EP-1, Tc]
        if cap > tc:
            order_PT = torch.cat([order_PT, order_PT[:, :1].expand(ep - 1, cap - tc)], 1)
        tok_PC = order_PT[:, :cap]
        n_P = to_peer.sum(0)
        valid = (torch.arange(cap, device=dev).view(1, -1) < n_P.view(-1, 1)).reshape(-1)
        tok = tok_PC.reshape(-1)
        dest = peer_idx.repeat_interleave(cap)
        split = tuple(tuple(0 if s == d else cap for d in range(ep)) for s in range(ep))
    send = split[me]
    recv = tuple(split[s][me] for s in range(len(split)))
    here_T = _here_T(ctx, to_rank_TP, r)
    slots = slot_map(tok, valid, tc, max(ep - 1, 1))
    sum_slots = _sum_map(tc, tok, here_T, r, slots)
    nrecv = sum(recv)
    zero = torch.zeros(hi - lo, dtype=torch.int64, device=dev)
    local = LocalPlan(
        regions=(r, a, b),
        here_T=here_T,
        remote=ExpertPart(nrecv * kk, zero, None, True),
        part_a=ExpertPart(a * kk, zero, None, True),
        part_b=ExpertPart(b * kk, zero, None, True),
        sum_slots=sum_slots,
    )
    mb = SendPlan(
        start=start,
        num_tokens=tc,
        token_idx_N=tok,
        dest_N=dest,
        valid_N=valid,
        slots=slots,
        send_splits=send,
        recv_splits=recv,
        split_matrix=split,
        capacity=None,
        rows_M=nrecv * kk,
        tokens_per_expert_L=zero,
        tokens_per_expert_host=None,
        local=local,
        group=ctx.group(c),
    )
    return mb, over
