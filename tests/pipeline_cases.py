"""Worker-side cases for tests/test_pipeline_schedule.py: the overlap engine driven directly (no
Megatron layer), with a transport that records every move and experts that record their backward.

Legend: T tokens, H hidden, E experts, L local experts, M (token, local expert) rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import mok_megatron.engine.pipeline_plan as plan_module
from mok_megatron.engine.pipeline import PipelineConfig, run_pipeline
from mok_megatron.engine.pipeline_plan import build_pipeline_plan
from mok_megatron.engine.plan import RowLayout
from mok_megatron.transport.base import DISPATCH
from mok_megatron.transport.collective import CollectiveTransport
from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

H, L, TOPK = 16, 4, 4


class Recording:
    """Wraps a transport; logs ("move", direction, rows) in call order into a shared log."""

    def __init__(self, inner, log: list):
        self.inner, self.log, self.name = inner, log, inner.name

    def __getattr__(self, name):  # the inner transport's own attributes (peers, link, ...)
        return getattr(self.inner, name)

    def move(self, x, mb, direction, backward=False):
        self.log.append(("move", direction, x.shape[0]))
        return self.inner.move(x, mb, direction, backward=backward)


class GroupedExperts(torch.nn.Module):
    """``y = probs * (x @ w[l])`` per local expert ``l`` (rows grouped by expert, exact-mode counts,
    checked against the device counts); logs each call's forward and the start of its backward."""

    def __init__(self, log: list):
        super().__init__()
        self.w_LHH = torch.nn.Parameter(torch.randn(L, H, H, generator=torch.Generator().manual_seed(7)) / H)
        self.log = log
        self.calls = 0

    def forward(self, x_MH, tpe_L, tpe_host, probs_M):
        if tpe_host is not None:  # exact mode: host and device counts agree and cover every row
            assert sum(tpe_host) == x_MH.shape[0] and tpe_L.tolist() == list(tpe_host), (tpe_L, tpe_host)
        # Sync-free: rows past the counts are padding (probability 0); they map to the last expert.
        row_M = torch.arange(x_MH.shape[0])
        l_M = torch.searchsorted(tpe_L.cumsum(0), row_M, right=True).clamp(max=L - 1)
        y_MH = torch.bmm(x_MH.unsqueeze(1), self.w_LHH[l_M]).squeeze(1) * probs_M.unsqueeze(-1)
        k = self.calls
        self.calls += 1
        self.log.append(("fwd", k))
        y_MH.register_hook(lambda g: self.log.append(("bwd", k)))
        return y_MH


def _inputs(rank, T, E, only_rank=None):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    logits = torch.randn(T, E, generator=g)
    if only_rank is not None:  # every token picks experts of one EP rank only
        logits[:, only_rank * L : (only_rank + 1) * L] += 100.0
    top = logits.topk(TOPK, dim=-1).indices
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = (logits.softmax(-1) * routing).requires_grad_(True)
    return x, probs, routing


# Ops that only make a view or metadata: no kernel on a GPU, negligible host time.
_VIEWS = {
    "view",
    "_unsafe_view",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "t",
    "transpose",
    "expand",
    "split",
    "split_with_sizes",
    "detach",
    "alias",
    "lift_fresh",
    "as_strided",
    "permute",
    "reshape",
}


class _Count(TorchDispatchMode):
    """Counts the aten ops that do work (a kernel launch or more on a GPU), views excluded."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in _VIEWS:
            self.n += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _HostData(TorchFunctionMode):
    """Records where the package's code moves host data into (or out of) device work: a host read
    (``tolist``/``item``/``cpu``), a tensor built from Python values, or an index given as a Python
    list. On a GPU each is a host sync or a pageable host-to-device copy, which CUDA graph capture
    rejects ("Cannot copy between CPU and CUDA tensors during CUDA graph capture")."""

    READS = {"tolist", "item", "cpu", "__bool__", "__int__", "__index__", "numpy"}
    BUILDS = {"tensor", "as_tensor", "from_numpy"}
    INDEX = {"__getitem__", "__setitem__", "index_put", "index_put_"}

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bad = name in self.READS or name in self.BUILDS
        if name in self.INDEX and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            bad = any(isinstance(i, list) for i in idx)
            # t[int] = number: the element is a 0-dim view, so torch copies a CPU scalar tensor into it
            # (a synchronising pageable copy on CUDA; t[slice] = number is a fill, no copy)
            number = len(args) > 2 and isinstance(args[2], (bool, int, float))
            bad = bad or (name == "__setitem__" and number and all(isinstance(i, int) for i in idx))
        if bad:
            import traceback

            frames = [f for f in traceback.extract_stack()[:-1] if "/mok_megatron/" in f.filename]
            if frames:
                f = frames[-1]
                self.hits.append(f"{name} at {f.filename.split('/mok_megatron/')[-1]}:{f.lineno}: {f.line}")
        return func(*args, **(kwargs or {}))


def _remote_pairs(routing_TE, ep, me):
    to_rank = routing_TE.view(routing_TE.shape[0], ep, L).any(-1)
    return to_rank.sum() - to_rank[:, me].sum()


class _MinLocalHalf:
    """Sets ``pipeline_plan.MIN_LOCAL_HALF`` for one case (test shapes are far below the default)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old = plan_module.MIN_LOCAL_HALF
        plan_module.MIN_LOCAL_HALF = self.value

    def __exit__(self, *exc):
        plan_module.MIN_LOCAL_HALF = self.old


def megatron_case(rank, world, *, min_local_half=4, **kw):
    """``tests.cases.pipeline_case`` (MoK layer vs Megatron's MoELayer) with regions A/B split."""
    from tests.cases import pipeline_case

    with _MinLocalHalf(min_local_half):
        return pipeline_case(rank, world, **kw)


def schedule_case(rank, world, *, min_local_half=4, **kw):
    with _MinLocalHalf(min_local_half):
        return _schedule_case(rank, world, **kw)


def _schedule_case(
    rank,
    world,
    *,
    chunks=1,
    emulated_ep=1,
    tokens=64,
    sync_free=False,
    capacity=1.0,
    to=None,
    fuse=False,
    fp8=False,
    align=1,
):
    """One pipeline call forward+backward; returns the event log and aten op counts.
    ``align`` > 1: expert rows padded by the permute (``row_alignment``).

    ``emulated_ep`` > 1: one process per "group" (each rank alone, EP=1) with a loopback transport."""
    log: list = []
    if emulated_ep > 1:
        group, ep = None, 1
        transport = Recording(LoopbackTransport(LoopbackLink(ep=emulated_ep), L, TOPK), log)
    else:
        group, ep = dist.group.WORLD, world
        transport = Recording(CollectiveTransport(group), log)
    experts = GroupedExperts(log)
    only = {None: None, "own": rank, "rank0": 0}[to]
    x, probs, routing = _inputs(rank, tokens, ep * L, only)
    size = -(-tokens // chunks)
    # Steady state: a first call fills the per-shape caches (as every training step after the first).
    kw = dict(emulated_ep=emulated_ep, sync_free=sync_free, capacity_multiplier=capacity, fuse_local=fuse)
    kw["labels"] = {}  # the region-label cache a layer's PipelineRuntime keeps
    build_pipeline_plan(x.shape, routing, L, TOPK, group, size, **kw)
    rows = RowLayout.ALIGNED if align > 1 else RowLayout.SORTED
    config = PipelineConfig(transport, TOPK, rows=rows, row_alignment=align, fp8_dispatch=fp8)
    fwd, bwd, plan_ops, host = _Count(), _Count(), _Count(), _HostData()
    with host:
        with plan_ops:
            plan = build_pipeline_plan(x.shape, routing, L, TOPK, group, size, **kw)
        with fwd:
            out = run_pipeline(
                x,
                probs,
                routing,
                plan,
                config,
                experts,
                after_combines=lambda: log.append(("after_combines",)),
            )
        log.append(("forward_done",))
        with bwd:
            out.backward(torch.ones_like(out))
    # Reference: every token's experts computed here from the gathered weights (EP=1 math).
    with torch.no_grad():
        ws = [torch.empty_like(experts.w_LHH) for _ in range(ep)] if ep > 1 else [experts.w_LHH]
        if ep > 1:
            dist.all_gather(ws, experts.w_LHH.detach().contiguous())
        w_EHH = torch.cat(ws)
        ref = torch.einsum("th,teho,te->to", x, w_EHH[None].expand(tokens, -1, -1, -1), probs)
    return {
        "log": log,
        "plan_ops": plan_ops.n,
        "fwd_ops": fwd.n,
        "ops_by_name": {"plan": plan_ops.by_op, "fwd": fwd.by_op, "bwd": bwd.by_op},
        "bwd_ops": bwd.n,
        "max_err": float((out.detach() - ref).abs().max()),
        "host_data": host.hits,
        "x_grad": x.grad is not None and bool(torch.isfinite(x.grad).all()),
        "w_grad": experts.w_LHH.grad is not None,
        "minibatches": len(plan.minibatches),
        "overflow": None if plan.overflow is None else bool(plan.overflow),
        "remote_rows": [mb.token_idx_N.shape[0] for mb in plan.minibatches],
        "local_here": [int(mb.local.here_T.sum()) for mb in plan.minibatches],
        # (token, other rank) pairs: what must travel when local rows never do
        "remote_pairs": int(_remote_pairs(routing, ep, rank if ep > 1 else 0)),
        "bytes_moved": getattr(transport.inner, "bytes_moved", None),
        "factor": getattr(transport.inner, "factor", None),
    }


def aligned_case(rank, world, *, align=16, **kw):
    """``megatron_case`` with the MoK layer's dispatcher padding every expert call's rows to ``align`` (what
    the native FP8 experts get); MoK's torch experts take any layout, so parity with Megatron must hold.
    Reports how many expert calls ran on the padded layout (``aligned_calls``)."""
    import mok_megatron.engine.pipeline as P
    import tests.cases as C

    real_build, real_aligned = C.build_layers, P._experts_aligned
    calls = []

    def build(cfg, *a, **k):
        ref, mok = real_build(cfg, *a, **k)
        C.with_engine(mok, row_alignment=align)
        return ref, mok

    def aligned(*a, **k):
        calls.append(1)
        return real_aligned(*a, **k)

    C.build_layers, P._experts_aligned = build, aligned
    try:
        res = megatron_case(rank, world, **kw)
    finally:
        C.build_layers, P._experts_aligned = real_build, real_aligned
    res["aligned_calls"] = len(calls)
    return res


def fp8_token_rows_case(rank, world, *, ep=2, topk=4, wgrad="fp8", opts=None, **cfg_kw):
    """The pipeline with native FP8 experts (``torch._scaled_grouped_mm`` emulated in fp32: CPU has none):
    every expert call with the permute / combine fused into the experts' FP8 operands
    (``MoKFP8GroupedMLP.token_rows_forward``) against the same calls unfused (permute into the padded
    layout, experts, combine). Returns whether the two runs are bitwise equal, how many fused calls ran, and the
    largest relative (Frobenius) error of either against Megatron's layer."""
    import dataclasses

    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.experts.fp8_mlp import MoKFP8GroupedMLP
    from mok_megatron.ops import fp8_grouped_gemm as native
    from tests.cases import build_layers, make_config, run_layer, setup_parallel
    from tests.test_fp8 import _fake_scaled_grouped_mm

    opts = dict(opts or {}, expert_backend="torch-fp8")
    saved = (native._gemm, native.check_native_fp8, native.WGRAD_FP8_MIN_ROWS)
    real_rows = MoKFP8GroupedMLP.token_rows_forward
    calls = []
    native._gemm = _fake_scaled_grouped_mm([])
    native.check_native_fp8 = lambda device: None
    native.WGRAD_FP8_MIN_ROWS = 1 if wgrad == "fp8" else 10**9
    MoKFP8GroupedMLP.token_rows_forward = lambda self, *a: calls.append(1) or real_rows(self, *a)
    try:
        setup_parallel(ep=ep)
        cfg = make_config(ep=ep, topk=topk, ffn=16, **cfg_kw)
        torch.manual_seed(0)
        ref, mok = build_layers(cfg, opts=opts)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(16, 2, cfg.hidden_size, generator=g)
        dout = torch.randn(16, 2, cfg.hidden_size, generator=g)
        fused = run_layer(mok, x, dout)
        n_fused = len(calls)
        mok.zero_grad(set_to_none=True)
        mok.experts_contract = dataclasses.replace(mok.experts_contract, fuses_permute=False)
        unfused = run_layer(mok, x, dout)
        want = run_layer(ref, x, dout)
    finally:
        native._gemm, native.check_native_fp8, native.WGRAD_FP8_MIN_ROWS = saved
        MoKFP8GroupedMLP.token_rows_forward = real_rows
    (o1, dx1, g1, _), (o2, dx2, g2, _) = fused, unfused
    bitwise = torch.equal(o1, o2) and torch.equal(dx1, dx2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    ref_g = convert_state_dict(want[2], "mok")

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    errs = [rel(o1, want[0]), rel(dx1, want[1])] + [rel(g1[k], ref_g[k]) for k in g1 if "experts" in k]
    return {
        "bitwise": bool(bitwise),
        "fused_calls": n_fused,
        "unfused_calls": len(calls) - n_fused,
        "max_rel_err": max(errs),
        "min_rel_err": min(errs),
    }


class _LogBackward(torch.autograd.Function):
    """Identity that logs ``event`` when its backward runs."""

    @staticmethod
    def forward(ctx, x, log, event):
        ctx.log, ctx.event = log, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.event)
        return g, None, None


def late_wgrad_case(rank, world, *, ep=2, opts=None, steps=2, **cfg_kw):
    """The MoK layer through the pipeline with late weight gradients (``experts.late_wgrad``) against the
    same layer without (``late_wgrad=False``): output and input gradients bitwise equal, weight gradients
    bitwise equal (``bitwise``) or, where the late layer's one GEMM per weight sums the expert calls' rows
    in another order, equal to fp32 rounding (``close``), over ``steps`` backward passes accumulating into
    ``.grad``; the weight-gradient GEMMs each layer ran (``wgrad_gemms``); each weight's post-accumulate
    hook fires once per backward; and in the late layer's backward every queued weight gradient is
    computed after the last dispatch-backward exchange is launched and before the packs' backward (which
    waits for it)."""
    from mok_megatron.engine import pipeline as pipeline_module
    from mok_megatron.experts import torch_mlp as expert_schedule
    from mok_megatron.ops import grouped_gemm
    from tests.cases import build_mok_only, make_config, setup_parallel, with_engine

    setup_parallel(ep=ep)
    cfg = make_config(ep=ep, **cfg_kw)
    base = dict(engine="pipeline", **(opts or {}))
    if ep == 1:
        base.update(loopback=dict(ep=4))
    layers = []
    for late in (True, False):
        torch.manual_seed(0)
        layer = build_mok_only(cfg, dict(base, late_wgrad=late))
        if layers:
            layer.load_state_dict(layers[0][0].state_dict())
        layer.train()
        log: list = []
        with_engine(layer, transport=Recording(layer.token_dispatcher.transport, log))
        hooks = {}
        for name, p in layer.experts.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=name, h=hooks: h.__setitem__(n, h.get(n, 0) + 1))
        layers.append((layer, log, hooks))
    sums, pack, wgrad_gemm = expert_schedule.WgradQueue.drain, pipeline_module._pack, grouped_gemm._wgrad
    # The merge itself under test: at these tiny weights the gathered rows outweigh the sums they save
    # (``_merge_pays`` declines; tested on its own in tests/test_ops.py)
    merge_pays = expert_schedule._merge_pays
    expert_schedule._merge_pays = lambda group: True

    res = {"steps": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * rank + step)
        x0 = torch.randn(16, 2, cfg.hidden_size, generator=g)
        dout = torch.randn(16, 2, cfg.hidden_size, generator=g)
        outs = []
        for layer, log, hooks in layers:
            log.clear()
            hooks.clear()

            def logged_drain(queue, log=log):
                log.append(("wgrad", len(queue)))
                return sums(queue)

            def logged_pack(*args, log=log):
                x_NH, meta_NW, x_ab = pack(*args)
                return _LogBackward.apply(x_NH, log, ("pack_bwd",)), meta_NW, x_ab

            def counted_wgrad(*args, log=log):
                log.append(("wgrad_gemm",))
                return wgrad_gemm(*args)

            expert_schedule.WgradQueue.drain = logged_drain
            pipeline_module._pack = logged_pack
            grouped_gemm._wgrad = counted_wgrad
            try:
                x = x0.clone().requires_grad_(True)
                out, _ = layer(x)
                x.register_hook(lambda gx, log=log: log.append(("x_grad",)))
                log.append(("forward_done",))
                out.backward(dout)
            finally:
                expert_schedule.WgradQueue.drain = sums
                pipeline_module._pack = pack
                grouped_gemm._wgrad = wgrad_gemm
            grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            outs.append((out.detach(), x.grad.clone(), grads, dict(hooks), list(log)))
        (o1, dx1, g1, h1, log1), (o2, dx2, g2, h2, log2) = outs
        bwd = log1[log1.index(("forward_done",)) + 1 :]
        moves = [i for i, e in enumerate(bwd) if e[0] == "move" and e[1] is DISPATCH]  # dispatch-backward
        wg = [i for i, e in enumerate(bwd) if e[0] == "wgrad"]
        res["steps"].append(
            dict(
                bitwise=bool(
                    torch.equal(o1, o2)
                    and torch.equal(dx1, dx2)
                    and g1.keys() == g2.keys()
                    and all(torch.equal(g1[k], g2[k]) for k in g1)
                ),
                close=bool(
                    torch.equal(o1, o2)
                    and torch.equal(dx1, dx2)
                    and g1.keys() == g2.keys()
                    and all(torch.allclose(g1[k], g2[k], rtol=1e-5, atol=1e-6) for k in g1)
                ),
                wgrad_gemms=[sum(1 for e in lg if e == ("wgrad_gemm",)) for lg in (log1, log2)],
                expert_grads=sorted(k for k in g1 if "experts" in k),
                hooks_late=h1,
                hooks_plain=h2,
                late_wgrad_runs=len(wg),
                queued=[bwd[i][1] for i in wg],
                after_last_dispatch_back=bool(wg and moves and wg[0] > moves[-1]),
                before_x_grad=bool(wg and ("x_grad",) in bwd and wg[-1] < bwd.index(("x_grad",))),
                # the packs' backward waits for the dispatch-backward exchanges: the queue runs before it
                before_pack_backward=bool(wg and ("pack_bwd",) in bwd and wg[-1] < bwd.index(("pack_bwd",))),
                plain_wgrad_runs=sum(1 for e in log2 if e[0] == "wgrad"),
            )
        )
    expert_schedule._merge_pays = merge_pays
    return res
