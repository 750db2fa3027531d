"""The overlap engine: dispatch -> experts -> combine, pipelined over minibatches, forward and backward.

Local rows never travel. Each minibatch's tokens are cut into regions (``LocalPlan``): the rows a
token sends to other ranks go through the transport; the rows it keeps on this rank are computed in
place, half (region A) while the dispatch flies and half (region B) while the combine returns, so
neither exchange waits on an idle GPU and no GEMM is cut finer than in halves:

    main stream   pack | A experts (c=0) | remote experts (c=0) | B experts (c=0) | A (c=1) ... | sums
    comm stream        | dispatch c=0, 1, ...  (launched at once) | combine c=0    | combine c=1 ...
    side stream   (optional, ``after_combines``: e.g. the shared expert's fc2)        | beside the last combines

With ``plan.fuse_local`` (``--mok-local-rows fused``, the default inside one NVLink domain) there is
no region B and region A's rows run in the same expert call as the received rows, after the dispatch
lands: one grouped GEMM per weight per minibatch, no weight-gradient sums. With ``fp8_dispatch`` the
dispatched rows travel packed as e4m3 + a rowwise scale (``transport.fp8_rows``) and are dequantized on
the communication stream on arrival; the combine and every backward exchange keep the rows' dtype.

Backward mirrors it. Autograd runs a node's backward on the stream its forward ran on and, among
ready nodes, the most recently created first; so every exchange is *launched* early (outside
autograd, on the communication stream) but its autograd node (``_Arrived``) is created late: the
combine nodes after every minibatch's experts, so backward starts by launching every
combine-backward exchange (last minibatch first, the order the expert backwards consume them) and
region B's dgrad/wgrad hide the first; the dispatch-backward node after region A's experts, so
A's backward hides it. (Combine nodes created per minibatch would serialise the link with the
compute: minibatch c-1's combine-backward would launch only after minibatch c's whole backward.)
Events order the streams; no host synchronisation happens inside (the plan read the counts once, or
not at all in sync-free mode).

Expert calls: with experts that take device counts (MoK's; ``routing_kernels``) each call plans its rows with
the routing kernels and moves them with the Triton permute / combine (``_experts_aligned``, padded to the
experts' alignment, 1 for bf16); native FP8 experts take the rows and the metadata themselves and fuse the
permute / combine into their FP8 operands (``token_rows_fn``). Other experts (Megatron's, reading host counts)
get a sort-based call (``_experts``). ``fp8_combine`` (opt-in) sends the expert output rows back as e4m3 too.

Reductions: each expert row is scaled by its probability inside the experts; a rank sums its local
experts' rows per received token, the source sums the ranks' partial rows per token (remote rows,
then region A/B rows, in that fixed order). Both sums are fixed-order gathers accumulated in fp32:
bitwise repeatable run to run (the Triton gather-sum is also faster on an H200 than ``index_add_``'s
atomics into an fp32 buffer).

Legend:
    T tokens   Tc tokens of one minibatch   H hidden   L local experts   W = 2L routing metadata
    N rows sent (one per token and other destination rank)   R rows received (or of a local region)
    M (token, local expert) rows
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mok_megatron.engine.pipeline_plan import MinibatchPolicy, PipelinePlan
from mok_megatron.engine.plan import RowLayout
from mok_megatron.ops.permute import combine_tokens, permute_tokens, permute_tokens_with_ranges
from mok_megatron.ops.routing import SlotMap, slot_map
from mok_megatron.transport.base import COMBINE, DISPATCH, ExpertPart, SendPlan, Transport
from mok_megatron.transport.fp8_rows import PackLayout, dequantize, pack, unpack

ExpertFn = Callable[[torch.Tensor, torch.Tensor, tuple | None, torch.Tensor], torch.Tensor]
# token_rows_fn(x_RH, probs_RK, meta, counts_L) -> y_RH: each row's experts' sum, permute / combine fused in
TokenRowsFn = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], torch.Tensor]
"""``expert_fn(x_MH, tokens_per_expert_L (device), tokens_per_expert (host tuple or None), probs_M)``
returns the probability-scaled expert output ``y_MH``."""


@dataclass(frozen=True)
class PipelineConfig:
    """What one layer's overlap pipeline runs with; built once, when the layer is built
    (``engine.select.select_engine``).

    ``rows``: how each expert call gets its rows (``RowLayout``): SORTED sorts them (``_experts``);
    ALIGNED plans them with the routing kernels and moves them with the Triton permute / combine, padded
    to ``row_alignment`` (1 included; experts that take device counts); FUSED gives the experts token rows
    and metadata (``token_rows_fn``: they fuse the permute / combine into their operands).
    ``fp8_dispatch``: the dispatched token rows travel as e4m3 with one fp32 scale per row, packed in
    one uint8 row (``transport.fp8_rows``: about half the bytes); the receiver dequantizes them. The
    combine and every backward exchange stay in the rows' own precision (straight-through gradient).
    ``fp8_combine`` (opt-in): the expert output rows travel back packed the same way and are dequantized on
    arrival; their gradient stays in the rows' precision (straight-through), so every gradient equals the
    bf16 combine's."""

    transport: Transport
    topk: int
    minibatches: MinibatchPolicy = field(default_factory=MinibatchPolicy)
    rows: RowLayout = RowLayout.SORTED
    row_alignment: int = 1
    fp8_dispatch: bool = False
    fp8_combine: bool = False

    def __post_init__(self):
        if self.rows is RowLayout.ALIGNED_EXACT:
            raise ValueError("PipelineConfig: rows=ALIGNED_EXACT is the plain engine's; use ALIGNED.")
        if self.row_alignment > 1 and not self.rows.routing_kernels:
            raise ValueError(
                f"PipelineConfig: row_alignment={self.row_alignment} needs rows planned by the routing "
                "kernels (RowLayout.ALIGNED or FUSED); the sorted layout has no padding."
            )


@dataclass
class PipelineStats:
    """Counters of one layer's overlap pipeline (``layer.token_dispatcher.stats``)."""

    calls: int = 0
    overflow_redos: int = 0  # sync-free calls whose buffers overflowed, redone with exact sizes


class PipelineRuntime:
    """What one layer's overlap pipeline keeps between calls, as DeepEP's ``Buffer`` does: its
    communication stream (CUDA, created on first use per device), the region labels of the call shapes
    it has seen (``engine.pipeline_plan``: read-only device tensors reused by every call, so a CUDA graph
    captured after the first call reads them and later calls launch nothing), and its counters."""

    def __init__(self):
        self._comm: dict = {}  # device index -> torch.cuda.Stream
        self.labels: dict = {}  # (T, size, emulated_ep, ..., device) -> [T] region labels
        self.stats = PipelineStats()

    def comm_stream(self, device: torch.device):
        if device.index not in self._comm:
            self._comm[device.index] = torch.cuda.Stream(device=device)
        return self._comm[device.index]


class _Streams:
    """The communication side stream on CUDA (the runtime's); a no-op pair on CPU."""

    def __init__(self, device: torch.device, runtime: PipelineRuntime):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.comm = runtime.comm_stream(device)

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


def _sum_rows(y_MH: torch.Tensor, slots: SlotMap) -> torch.Tensor:
    """``out[i] = sum of the y rows whose index is i``: a fixed-order gather accumulated in fp32."""
    return combine_tokens(y_MH, slots)


def _pack(x_c, meta_cPW, mb: SendPlan, ep: int):
    """The minibatch's sent rows and their routing metadata, and its local regions A and B (views of
    ``x_c``; one gradient buffer for all three: ``permute_tokens_with_ranges``)."""
    r, a, b = mb.local.regions
    x_NH, x_a, x_b = permute_tokens_with_ranges(
        x_c, mb.token_idx_N, mb.slots, ((r, r + a), (r + a, r + a + b))
    )
    meta_NW = meta_cPW.reshape(-1, meta_cPW.shape[-1]).index_select(0, mb.token_idx_N * ep + mb.dest_N)
    if mb.valid_N is not None:
        meta_NW = torch.where(mb.valid_N.unsqueeze(-1), meta_NW, 0)
    return x_NH, meta_NW, (x_a, x_b)


def _experts_aligned(
    x_RH,
    probs_RL,
    mask_RL,
    part: ExpertPart,
    topk: int,
    expert_fn: ExpertFn,
    alignment: int,
    token_rows_fn: TokenRowsFn | None = None,
):
    """``_experts`` for experts that want every expert's rows padded to ``alignment`` (native FP8): the
    rows are permuted straight into the padded layout (``kernels.routing`` metadata, padding rows zero,
    probability 0), the experts run on it as it is, and each row's experts are summed by the fixed-order
    combine. Counts stay on the device (static buffer: no host read).
    ``token_rows_fn``: experts that take the rows and the routing metadata themselves and fuse the
    permute / combine into their operands (``experts.fp8_mlp``); the same result, bitwise."""
    from mok_megatron.engine.plan import static_aligned_rows
    from mok_megatron.kernels.combine import combine
    from mok_megatron.kernels.permute import permute
    from mok_megatron.kernels.routing import routing_metadata
    from mok_megatron.kernels.topk import topk_indices

    R, L = mask_RL.shape
    kk = min(topk, L)
    # Each row's local experts, ascending (as 1/0 scores the top-k picks them first); the rest dropped.
    idx_RK = topk_indices(mask_RL.view(torch.uint8), kk)
    ids_RK = torch.where(mask_RL.gather(1, idx_RK), idx_RK, -1)
    meta, counts_L = static_aligned_rows(routing_metadata(ids_RK, L, alignment), min(part.rows_M, R * kk))
    if token_rows_fn is not None:
        return token_rows_fn(x_RH, probs_RL.gather(1, idx_RK), meta, counts_L)
    # Without alignment the rows past the last group are the static buffer's spare rows: no GEMM reads them
    # (and the fused activation skips them), so they are not zeroed.
    x_PH, probs_P = permute(x_RH, meta, probs_RL.gather(1, idx_RK), zero_spare_rows=alignment > 1)
    return combine(expert_fn(x_PH, counts_L, None, probs_P), meta)


def _experts(
    x_RH,
    meta_RW,
    part: ExpertPart,
    L: int,
    topk: int,
    expert_fn: ExpertFn,
    alignment: int = 1,
    token_rows_fn: TokenRowsFn | None = None,
    routing_kernels: bool = False,
    local=False,
):
    """Expand rows to (row, local expert), run the experts, sum each row's experts. A local region
    that routes nothing here skips the call; the received part always calls the experts (even with
    no rows: the weights then get zero gradients, as in Megatron, and the exchanges that delivered
    the rows stay in the backward graph, so every rank runs the same collectives)."""
    R = x_RH.shape[0]
    if local and (part.rows_M == 0 or R == 0):
        return x_RH.new_zeros((R, x_RH.shape[-1])) + 0 * meta_RW.sum()
    probs_RL, mask_RL = meta_RW[:, :L], meta_RW[:, L:] > 0.5
    if alignment > 1 or routing_kernels:
        return _experts_aligned(x_RH, probs_RL, mask_RL, part, topk, expert_fn, alignment, token_rows_fn)
    flat_mask = mask_RL.t().reshape(-1)
    rows = min(part.rows_M, flat_mask.numel())
    flat = flat_mask.argsort(descending=True, stable=True)[:rows]  # grouped by local expert
    row_M, l_M = flat % max(R, 1), flat // max(R, 1)
    valid_M = flat_mask[flat] if part.padded else None
    kk = min(topk, L)
    if valid_M is None and rows == R * kk:
        slots = slot_map(row_M, None, R, kk)  # every row's token uses every slot: no masking
    else:
        live = valid_M if valid_M is not None else torch.ones_like(row_M, dtype=torch.bool)
        slots = slot_map(row_M, live, R, kk)
    x_MH = permute_tokens(x_RH, row_M, slots)
    probs_M = probs_RL[row_M, l_M]
    if valid_M is not None:
        probs_M = torch.where(valid_M, probs_M, 0)
        tpe_L = mask_RL.sum(0, dtype=torch.int64)  # what actually arrived
    else:
        tpe_L = part.tokens_per_expert_L
    y_MH = expert_fn(x_MH, tpe_L, part.tokens_per_expert_host, probs_M)
    return _sum_rows(y_MH, slots)


def _merged(remote: ExpertPart, local: ExpertPart) -> ExpertPart:
    """One expert call over ``cat(received rows, region A rows)``: their per-expert counts add."""
    host = None
    if remote.tokens_per_expert_host is not None and local.tokens_per_expert_host is not None:
        host = tuple(
            a + b for a, b in zip(remote.tokens_per_expert_host, local.tokens_per_expert_host, strict=True)
        )
    tpe = (
        remote.tokens_per_expert_L
        if remote.padded
        else remote.tokens_per_expert_L + local.tokens_per_expert_L
    )
    return ExpertPart(remote.rows_M + local.rows_M, tpe, host, remote.padded or local.padded)


class _Arrived(torch.autograd.Function):
    """Rows moved earlier outside autograd, tied to the rows they were moved from.

    The move is launched as early as possible; this node is created where its *backward* should
    start (see the module docstring). Its backward moves the gradient the opposite way."""

    @staticmethod
    def forward(ctx, x_src, moved, transport, mb, direction):
        ctx.transport, ctx.mb, ctx.direction = transport, mb, direction
        return moved

    @staticmethod
    def backward(ctx, g):
        return ctx.transport.move(g.contiguous(), ctx.mb, ctx.direction.reverse, backward=True), None, None, None, None


def run_pipeline(
    x_TH: torch.Tensor,
    probs_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    plan: PipelinePlan,
    config: PipelineConfig,
    expert_fn: ExpertFn,
    *,
    token_rows_fn: TokenRowsFn | None = None,
    before_experts: Callable[[], None] | None = None,
    after_combines: Callable[[], None] | None = None,
    runtime: PipelineRuntime | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (probability-weighted sum over each token's experts).

    ``config``: the layer's ``PipelineConfig`` (transport, top-k, row layout, FP8 on the wire).
    ``runtime``: the layer's ``PipelineRuntime`` (its communication stream; None: a new one).
    ``token_rows_fn``: experts that permute / combine inside their own operands (``RowLayout.FUSED``;
    ignored for the other layouts). ``before_experts``: called once, after
    every minibatch is packed and before any expert call or dispatch-exchange autograd node is created
    (``experts.late_wgrad.LateWgrad.open``: its node then runs in backward after every dispatch-backward
    exchange is launched and before the packs' backward waits for them). ``after_combines``: called once,
    after every minibatch's expert calls are enqueued and its combine exchange launched, before the
    compute stream waits for any combine (work on a side stream that waits for the compute stream
    there, e.g. the shared expert's second GEMM, then runs while the combines fly)."""
    transport, topk = config.transport, config.topk
    row_alignment = config.row_alignment
    routing_kernels = config.rows.routing_kernels
    token_rows_fn = token_rows_fn if config.rows is RowLayout.FUSED else None
    T, H = x_TH.shape
    ep, L = plan.ep_size, plan.num_local_experts
    if T == 0:
        if after_combines is not None:
            after_combines()
        return x_TH.new_zeros((0, H)) + 0 * x_TH.sum()
    st = _Streams(x_TH.device, runtime if runtime is not None else PipelineRuntime())
    me = 0 if ep == 1 else torch.distributed.get_rank(plan.ep_group)
    C = len(plan.minibatches)
    probs_TPL = probs_TE.view(T, ep, L)
    mask_TPL = routing_map_TE.view(T, ep, L).to(probs_TE.dtype)
    if plan.expert_bounds is None:
        # Each (token, destination) row carries the destination's slice of probabilities and mask.
        meta_TPW = torch.cat([probs_TPL, mask_TPL], -1)
        # One split (its backward is one concatenation), not C slices (C full-size gradient adds).
        sizes = [mb.num_tokens for mb in plan.minibatches]
        x_parts = x_TH.split(sizes) if C > 1 else (x_TH,)
        meta_parts = meta_TPW.split(sizes) if C > 1 else (meta_TPW,)
        runs = [(L, topk, expert_fn, row_alignment, token_rows_fn, routing_kernels)] * C
    else:  # split by experts: every minibatch has every token, with its group's slice of the metadata
        x_parts = (x_TH,) * C
        meta_parts, runs = [], []
        for mb in plan.minibatches:
            lo, hi = mb.group.experts
            meta_parts.append(torch.cat([probs_TPL[:, :, lo:hi], mask_TPL[:, :, lo:hi]], -1))
            fn = functools.partial(expert_fn, group=mb.group)
            runs.append((hi - lo, topk, fn, row_alignment, None, routing_kernels))

    # 1. Pack every minibatch's remote rows and launch its dispatch on the communication stream.
    layout = PackLayout(H) if config.fp8_dispatch else None
    layout_c = PackLayout(H) if config.fp8_combine else None
    flights = []
    for c, mb in enumerate(plan.minibatches):
        tr = transport
        x_NH, meta_NW, x_ab = _pack(x_parts[c], meta_parts[c], mb, ep)
        ev = st.event("main")
        with torch.no_grad(), st.on("comm"):
            st.wait("comm", ev)
            st.hand_over("comm", x_NH, meta_NW)
            if layout:  # FP8 on the wire, dequantized on arrival (the _Arrived node passes the
                # gradient straight through to the rows they were quantized from)
                x_RH = tr.move(pack(x_NH.detach(), layout), mb, DISPATCH)
                x_RH = dequantize(*unpack(x_RH, layout), layout, x_NH.dtype)
            else:
                x_RH = tr.move(x_NH.detach(), mb, DISPATCH)
            moved = (x_RH, tr.move(meta_NW.detach(), mb, DISPATCH))
            flights.append((tr, x_NH, meta_NW, x_ab, moved, st.event("comm")))

    if before_experts is not None:
        before_experts()

    # 2. Per minibatch: region A's experts (the dispatch flies), the received rows' experts and
    #    their combine, region B's experts (the combine flies).
    pending = []
    for c, mb in enumerate(plan.minibatches):
        lp = mb.local
        tr, x_NH, meta_NW, (x_a, x_b), (x_raw, meta_raw), ev_recv = flights[c]
        meta_loc = meta_parts[c].select(1, me).split(list(lp.regions))
        run = runs[c]
        if not plan.fuse_local:
            z_a = _experts(x_a, meta_loc[1], lp.part_a, *run, local=True)
        with st.on("comm"):  # created after A: A's backward hides the dispatch-backward
            x_RH = _Arrived.apply(x_NH, x_raw, tr, mb, DISPATCH)
            meta_RW = _Arrived.apply(meta_NW, meta_raw, tr, mb, DISPATCH)
        st.wait("main", ev_recv)
        st.hand_over("main", x_RH, meta_RW)
        if plan.fuse_local:  # local rows join the received rows: one expert call
            R = x_RH.shape[0]
            both = _merged(lp.remote, lp.part_a)
            z_all = _experts(torch.cat([x_RH, x_a]), torch.cat([meta_RW, meta_loc[1]]), both, *run)
            # One split (its backward is one concatenation), not two slices (each slice's backward is a
            # zero-filled [R + A, H] gradient, then summed).
            z_RH, z_a = z_all.split([R, z_all.shape[0] - R])
        else:
            z_RH = _experts(x_RH, meta_RW, lp.remote, *run)
        ev = st.event("main")
        with torch.no_grad(), st.on("comm"):
            st.wait("comm", ev)
            st.hand_over("comm", z_RH)
            if layout_c:  # FP8 on the wire back too (opt-in), dequantized on arrival
                back_raw = tr.move(pack(z_RH.detach(), layout_c), mb, COMBINE)
                back_raw = dequantize(*unpack(back_raw, layout_c), layout_c, z_RH.dtype)
            else:
                back_raw = tr.move(z_RH.detach(), mb, COMBINE)
            ev_back = st.event("comm")
        z_b = _experts(x_b, meta_loc[2], lp.part_b, *runs[c], local=True)
        pending.append((z_RH, back_raw, tr, z_a, z_b, ev_back))

    if after_combines is not None:
        after_combines()

    # 3. The combines' autograd nodes, created after every expert call: backward then launches every
    #    combine-backward exchange before any expert backward, the last minibatch's first (the order
    #    the expert backwards need them), so the link never waits for a minibatch's compute.
    arrived = []
    for c, mb in enumerate(plan.minibatches):
        z_RH, back_raw, tr, z_a, z_b, ev_back = pending[c]
        with st.on("comm"):
            arrived.append((_Arrived.apply(z_RH, back_raw, tr, mb, COMBINE), z_a, z_b, ev_back))

    # 4. Each token's sum: its remote ranks' partial rows, then its local rows, in a fixed order.
    outs, rows_all = [], []
    for c, mb in enumerate(plan.minibatches):
        lp = mb.local
        back_NH, z_a, z_b, ev_back = arrived[c]
        st.wait("main", ev_back)
        st.hand_over("main", back_NH)
        rows = torch.cat([back_NH, z_a, z_b])
        if plan.expert_bounds is None:
            outs.append(_sum_rows(rows, lp.sum_slots))
        else:
            rows_all.append(rows)
    if plan.expert_bounds is not None:  # one fixed-order sum over every group's rows of each token
        maps = [mb.local.sum_slots for mb in plan.minibatches]
        return _sum_rows(torch.cat(rows_all), _concat_slots(maps, [r.shape[0] for r in rows_all]))
    return outs[0] if C == 1 else torch.cat(outs, 0)


def _concat_slots(maps: list[SlotMap], rows: list[int]) -> SlotMap:
    """The slot maps of several row blocks over the same tokens, as one map over ``cat(blocks)``."""
    row_TK, valid_TK, off = [], [], 0
    for m, n in zip(maps, rows, strict=True):
        row_TK.append(m.row_TK + off)
        valid_TK.append(m.valid_TK if m.valid_TK is not None else torch.ones_like(m.row_TK, dtype=torch.bool))
        off += n
    return SlotMap(torch.cat(row_TK, 1), torch.cat(valid_TK, 1))
