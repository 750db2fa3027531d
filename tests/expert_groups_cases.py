"""Cases for ``tests/test_expert_groups.py``: the MoK layer's pipeline split by experts (``--mok-minibatch-split
experts``) against the same layer split by tokens, run in gloo worker processes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _WeightSums(TorchDispatchMode):
    """Counts the additions of two tensors shaped like (a slice of) an expert weight: ``[*, F1, H]`` or
    ``[*, H, F]`` with three dimensions, i.e. weight-gradient sums (activations are two-dimensional).
    Additions into ``sinks`` (``main_grad`` buffers: gradient accumulation fusion's own accumulate, which
    a Hopper GEMM does in its epilogue) are not sums between gradients and are not counted."""

    def __init__(self, trailing: list[tuple[int, int]], sinks: list[torch.Tensor]):
        super().__init__()
        self.trailing = trailing
        self.sinks = {t.untyped_storage().data_ptr() for t in sinks}
        self.n = 0
        self.sink_elems = 0  # elements added into the sinks (one pass over main_grad = its numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and all(
            isinstance(a, torch.Tensor) for a in args[:2]
        ):
            into_sink = out.untyped_storage().data_ptr() in self.sinks
            if out.dim() == 3 and tuple(out.shape[1:]) in self.trailing and not into_sink:
                self.n += 1
            elif into_sink:
                self.sink_elems += out.numel()
        return out


def split_case(rank, world, *, ep=2, chunks=2, opts=None, fusion=False, **cfg_kw):
    """One layer (weights from seed 0) with the pipeline split by tokens and by experts, ``chunks``
    minibatches each, forward + backward on this rank's input. Returns the largest differences of the
    output, input gradient and weight gradients (``main_grad`` with ``fusion``: the contract's fp32
    buffers, filled by each group's GEMMs), the weight-gradient sums counted in each backward, the
    groups' local-expert bounds, and whether a second expert-split run is bitwise the first."""
    from tests.cases import build_mok_only, make_config, setup_parallel

    setup_parallel(ep=ep)
    cfg = make_config(ep=ep, **cfg_kw)
    tokens = 32
    base = dict(engine="pipeline", **(opts or {}))
    if chunks is not None:  # None: the automatic count
        base["minibatch_size"] = -(-tokens // chunks)
    if ep == 1:
        base.update(loopback=dict(ep=4))
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(16, 2, cfg.hidden_size, generator=g)
    dout = torch.randn(16, 2, cfg.hidden_size, generator=g)
    runs, state = {}, None
    for name, split in (("tokens", "tokens"), ("experts", "experts"), ("experts2", "experts")):
        torch.manual_seed(0)
        layer = build_mok_only(cfg, dict(base, minibatch_split=split))
        if state is None:
            state = layer.state_dict()
        layer.load_state_dict(state)
        experts = layer.experts
        weights = (experts.fc1_weight, experts.fc2_weight)
        if fusion:  # Megatron DDP's view of the contract: an fp32 main_grad per weight
            experts.gradient_accumulation_fusion = True
            for p in weights:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.grad_added_to_main_grad = False
        seen = set()
        experts.register_forward_pre_hook(
            lambda m, a, kw, seen=seen: seen.add(kw["group"][0].bounds if kw.get("group") else None),
            with_kwargs=True,
        )
        x = x0.clone().requires_grad_(True)
        out, _ = layer(x)
        sinks = [p.main_grad for p in weights] if fusion else []
        counter = _WeightSums([tuple(p.shape[1:]) for p in weights], sinks)
        with counter:
            out.backward(dout)
        grads = [p.main_grad.clone() if fusion else p.grad.clone() for p in weights]
        runs[name] = dict(
            out=out.detach(),
            dx=x.grad.clone(),
            grads=grads,
            sums=counter.n,
            main_grad_passes=counter.sink_elems / sum(p.numel() for p in weights),
            added=[bool(getattr(p, "grad_added_to_main_grad", False)) for p in weights],
            bounds=sorted(seen, key=str),
        )

    def diff(a, b):
        return float((a.float() - b.float()).abs().max())

    t, e, e2 = runs["tokens"], runs["experts"], runs["experts2"]
    return dict(
        out=diff(t["out"], e["out"]),
        out_scale=float(t["out"].abs().max()),
        dx=diff(t["dx"], e["dx"]),
        dx_scale=float(t["dx"].abs().max()),
        grads=max(diff(a, b) for a, b in zip(t["grads"], e["grads"], strict=True)),
        grad_scale=max(float(a.abs().max()) for a in t["grads"]),
        sums_tokens=t["sums"],
        sums_experts=e["sums"],
        passes_tokens=t["main_grad_passes"],
        passes_experts=e["main_grad_passes"],
        added=e["added"],
        bounds=e["bounds"],
        bitwise=bool(
            torch.equal(e["out"], e2["out"])
            and torch.equal(e["dx"], e2["dx"])
            and all(torch.equal(a, b) for a, b in zip(e["grads"], e2["grads"], strict=True))
        ),
    )


def host_data_case(
    rank, world, *, ep=2, local_experts=3, topk=2, groups=2, sync_free=True, align=1, fuse=False
):
    """The pipeline split by experts driven directly (``groups`` groups of ``local_experts``, uneven when
    they do not divide): the host data its plan, forward and backward move (``tests.pipeline_cases._HostData``:
    none may in sync-free mode, where a CUDA graph must capture them), the largest error against every
    token's experts computed here, and the groups' experts each expert call got."""
    import torch.distributed as dist

    from mok_megatron.engine.pipeline import PipelineConfig, run_pipeline
    from mok_megatron.engine.pipeline_plan import build_pipeline_plan
    from mok_megatron.engine.plan import RowLayout
    from mok_megatron.transport.collective import CollectiveTransport
    from tests.pipeline_cases import _HostData

    group = dist.new_group(list(range(ep)))  # every rank must call new_group
    if rank >= ep:
        return None
    T, H, L = 32, 8, local_experts
    g = torch.Generator().manual_seed(100 + rank)
    w_LHH = torch.nn.Parameter(torch.randn(L, H, H, generator=torch.Generator().manual_seed(7 + rank)) / H)
    x_TH = torch.randn(T, H, generator=g, requires_grad=True)
    logits_TE = torch.randn(T, ep * L, generator=g)
    routing_TE = torch.zeros(T, ep * L, dtype=torch.bool).scatter_(
        1, logits_TE.topk(topk, dim=-1).indices, True
    )
    probs_TE = (logits_TE.softmax(-1) * routing_TE).requires_grad_(True)
    calls = set()

    def expert_fn(x_MH, tpe_L, tpe_host, probs_M, group=None):
        lo, hi = group.experts
        calls.add((lo, hi))
        # rows past the counts are sync-free padding (probability 0): they map to the group's last expert
        l_M = torch.searchsorted(tpe_L.cumsum(0), torch.arange(x_MH.shape[0]), right=True).clamp(
            max=hi - lo - 1
        )
        return torch.bmm(x_MH.unsqueeze(1), w_LHH[lo:hi][l_M]).squeeze(1) * probs_M.unsqueeze(-1)

    kw = dict(sync_free=sync_free, fuse_local=fuse, split_experts=True, labels={})
    size = -(-T // groups)
    build_pipeline_plan(x_TH.shape, routing_TE, L, topk, group, size, **kw)  # fill the per-shape caches
    host = _HostData()
    with host:
        plan = build_pipeline_plan(x_TH.shape, routing_TE, L, topk, group, size, **kw)
        rows = RowLayout.ALIGNED if align > 1 else RowLayout.SORTED
        config = PipelineConfig(CollectiveTransport(group), topk, rows=rows, row_alignment=align)
        out = run_pipeline(x_TH, probs_TE, routing_TE, plan, config, expert_fn)
        out.backward(torch.ones_like(out))
    with torch.no_grad():
        ws = [torch.empty_like(w_LHH) for _ in range(ep)]
        dist.all_gather(ws, w_LHH.detach().contiguous(), group=group)
        w_EHH = torch.cat(ws)
        ref = torch.einsum("th,teho,te->to", x_TH, w_EHH[None].expand(T, -1, -1, -1), probs_TE)
    return dict(
        host_data=host.hits,
        max_err=float((out.detach() - ref).abs().max()),
        bounds=plan.expert_bounds,
        calls=sorted(calls),
        grads=x_TH.grad is not None and w_LHH.grad is not None,
    )
