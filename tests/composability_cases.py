"""Pool cases (see tests/pool.py) for MoK under Megatron's schedule features: delayed weight gradients,
activation / whole-layer recompute, the start-up rules for Megatron's EP overlap and CUDA graphs, and
Megatron's combined 1F1B EP-overlap schedule driving MoK layers."""

from __future__ import annotations

import torch

from mok_megatron.training.cpu_training import megatron_schedule
from tests.cases import build_gpt, build_layers, build_mok_only, make_config, setup_parallel, tiny_gpt_config


def _mok_pair(ep, opts, after: dict, **cfg_kw):
    """Two MoK layers with identical weights: one on the plain config, one with ``after`` set on its
    config after Megatron's validation (Megatron ties delay_wgrad_compute to its GPU-only EP overlap)."""
    setup_parallel(ep=ep)
    base_cfg = make_config(ep=ep, **cfg_kw)
    torch.manual_seed(0)
    _, base = build_layers(base_cfg, opts=opts)
    cfg = make_config(ep=ep, **cfg_kw)
    for k, v in after.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    _, other = build_layers(cfg, opts=opts)
    other.load_state_dict(base.state_dict())
    return base, other


def _step(layer, x, dout):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dout)
    return out.detach(), x.grad.detach()


def _grads(layer) -> dict:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def delayed_wgrad_case(rank, world, *, ep, opts, microbatches=2, **cfg_kw):
    """Backward + backward_dw on a delayed-wgrad MoK layer vs plain backward, ``microbatches`` times
    (gradients accumulate). Reports bitwise equality and what backward left for backward_dw."""
    base, delayed = _mok_pair(ep, opts, {"delay_wgrad_compute": True}, **cfg_kw)
    hook_calls = []
    delayed.experts.register_wgrad_accumulation_and_reduce_hooks(lambda: hook_calls.append(1))
    g = torch.Generator().manual_seed(rank)
    res = {"pipelined": delayed.token_dispatcher.pipelined, "outputs_equal": True, "deferred": []}
    expert_params = ("experts.fc1_weight", "experts.fc2_weight")
    for _ in range(microbatches):
        x = torch.randn(16, 2, base.config.hidden_size, generator=g)
        dout = torch.randn(16, 2, base.config.hidden_size, generator=g)
        o1, dx1 = _step(base, x, dout)
        before = {k: v for k, v in _grads(delayed).items() if k in expert_params}
        o2, dx2 = _step(delayed, x, dout)
        after = {k: v for k, v in _grads(delayed).items() if k in expert_params}
        # backward must not have touched the expert weight gradients, only queued them
        res["deferred"].append(_same(before, after) and len(delayed.experts.wgrad_queue) > 0)
        delayed.backward_dw()
        res["outputs_equal"] &= bool(torch.equal(o1, o2) and torch.equal(dx1, dx2))
    res["grads_bitwise"] = _same(_grads(base), _grads(delayed))
    res["hook_calls"] = len(hook_calls)
    res["queue_empty"] = len(delayed.experts.wgrad_queue) == 0
    res["skip_backward_post_hook"] = all(
        getattr(p, "skip_backward_post_hook", False) for p in delayed.experts.parameters()
    )
    return res


def saved_bytes(fn, module) -> int:
    """Bytes of distinct storages autograd saves for backward while ``fn`` runs, ``module``'s parameters
    excluded (the pack hook may see them as other tensor objects: match by storage)."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(v for k, v in seen.items() if k not in params), out


def recompute_act_case(rank, world, *, ep, opts, delay=False, tokens=256, **cfg_kw):
    """moe_act recompute vs none: outputs and all gradients bitwise; saved-for-backward bytes of the
    layer and of its experts alone."""
    after = dict(recompute_granularity="selective", recompute_modules=["moe_act"])
    if delay:
        after["delay_wgrad_compute"] = True
    base, rec = _mok_pair(ep, opts, after, hidden=64, ffn=128, **cfg_kw)
    assert rec.experts.mok_config.recompute_activation
    g = torch.Generator().manual_seed(rank)
    H = base.config.hidden_size
    x = torch.randn(tokens // 2, 2, H, generator=g)
    dout = torch.randn(tokens // 2, 2, H, generator=g)
    sizes, results = [], []
    for layer in (base, rec):
        xi = x.clone().requires_grad_(True)
        nbytes, (out, _) = saved_bytes(lambda layer=layer, xi=xi: layer(xi), layer)
        out.backward(dout)
        if delay and layer is rec:
            layer.backward_dw()
        sizes.append(nbytes)
        results.append((out.detach(), xi.grad.detach(), _grads(layer)))
    (o1, dx1, g1), (o2, dx2, g2) = results
    # The experts alone, on the rows one call receives (same routing in both layers).
    rows = tokens * base.config.moe_router_topk  # what one rank receives on average
    xe = torch.randn(rows, H, generator=g)
    pe = torch.rand(rows, generator=g)
    tpe = torch.full((base.experts.num_local_experts,), rows // base.experts.num_local_experts)
    tpe[-1] += rows - int(tpe.sum())
    expert_sizes = [saved_bytes(lambda m=m: m.experts(xe, tpe, pe), m)[0] for m in (base, rec)]
    return {
        "pipelined": rec.token_dispatcher.pipelined,
        "bitwise": bool(torch.equal(o1, o2) and torch.equal(dx1, dx2) and _same(g1, g2)),
        "layer_saved_bytes": sizes,
        "experts_saved_bytes": expert_sizes,
    }


def gpt_recompute_case(rank, world, *, ep=2, modules=("moe",), steps=3, opts=None):
    """A tiny MoK GPT with ``--recompute-granularity selective --recompute-modules <modules>`` vs the
    same model without recompute: losses and every gradient over ``steps`` SGD steps, and the bytes
    saved for backward by one forward."""
    from mok_megatron.options import MoKOptions

    setup_parallel(ep=ep)
    options = MoKOptions(**(opts or {}))
    models = []
    for rec in (False, True):
        extra = dict(recompute_granularity="selective", recompute_modules=list(modules)) if rec else {}
        if rec and "moe_act" in modules:
            extra["moe_grouped_gemm"] = True  # Megatron's rule; MoK's experts are grouped anyway
        cfg = tiny_gpt_config(ep=ep, **extra)
        torch.manual_seed(0)
        models.append(build_gpt(cfg, mok=True, options=options))
    models[1].load_state_dict(models[0].state_dict(), strict=True)
    g = torch.Generator().manual_seed(rank)
    losses, grads_equal, saved = [], True, []
    for step in range(steps):
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        labels = torch.roll(tokens, -1, 1)
        pos = torch.arange(16).expand(2, -1)
        out = []
        for model in models:
            model.zero_grad(set_to_none=True)
            nbytes, loss = saved_bytes(
                lambda model=model, t=tokens, pos=pos, y=labels: model(t, pos, None, labels=y).float().mean(),
                model,
            )
            loss.backward()
            if step == 0:
                saved.append(nbytes)
            out.append((loss.detach(), _grads(model)))
        (l1, g1), (l2, g2) = out
        losses.append((float(l1), float(l2)))
        grads_equal &= bool(torch.equal(l1, l2)) and _same(g1, g2)
        with torch.no_grad():
            for model in models:
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    pipelined = [m.token_dispatcher.pipelined for m in models[1].modules() if hasattr(m, "token_dispatcher")]
    return {"losses": losses, "bitwise": grads_equal, "saved_bytes": saved, "pipelined": pipelined}


def build_with_case(rank, world, *, ep=2, opts=None, after=None, **cfg_kw):
    """Build a MoK layer whose config gets ``after`` set past Megatron's validation (flags Megatron
    only accepts with GPUs / TE); return the MoKConfigError text, or the engine it picked."""
    from mok_megatron.config import MoKConfigError

    setup_parallel(ep=ep)
    cfg = make_config(ep=ep, **cfg_kw)
    for k, v in (after or {}).items():
        if k == "cuda_graph_modules":
            from megatron.core.transformer.enums import CudaGraphModule

            v = [CudaGraphModule[m] for m in v]
        setattr(cfg, k, v)
    try:
        mok = build_mok_only(cfg, opts)
    except MoKConfigError as e:
        return str(e)
    return "pipelined" if mok.token_dispatcher.pipelined else "plain"


# ---- Megatron's combined 1F1B EP-overlap schedule -----------------------------------------------------

# --overlap-moe-expert-parallel-comm --delay-wgrad-compute
OVERLAP_FLAGS = dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)


def schedule_config(ep: int, overlap: bool, dtype: str = "bf16", **extra):
    """``tiny_gpt_config`` in ``dtype`` ("bf16" / "fp32"), with Megatron's EP-overlap flags if ``overlap``.
    Megatron accepts the overlap only for bf16 / fp16 models (transformer/transformer_config.py); nothing
    in the schedule depends on the dtype, so an fp32 config gets the flags after validation."""
    if dtype == "bf16":
        flags = OVERLAP_FLAGS if overlap else {}
        return tiny_gpt_config(ep=ep, bf16=True, params_dtype=torch.bfloat16, **flags, **extra)
    cfg = tiny_gpt_config(ep=ep, **extra)
    if overlap:
        for k, v in OVERLAP_FLAGS.items():
            setattr(cfg, k, v)
    return cfg


class _Steps:
    """Training steps of one GPT model through Megatron's ``forward_backward_no_pipelining``, which runs
    the combined 1F1B schedule when the model's config has the EP overlap on; counts the schedule plans
    built (one per micro-batch under the combined schedule, none otherwise)."""

    def __init__(self, model):
        self.model = model
        self.schedule_plans = 0

    @staticmethod
    def _loss(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach()}

    def _forward_step(self, data_iterator, model, return_schedule_plan=False):
        tokens, labels = next(data_iterator)
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        if return_schedule_plan:
            self.schedule_plans += 1
            return model.build_schedule_plan(tokens, pos, None, labels=labels), self._loss
        return model(tokens, pos, None, labels=labels), self._loss

    def forward_backward(self, batches) -> list[float]:
        """The micro-batches' losses; the gradients (of loss / micro-batches) are in ``param.grad``."""
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

        self.model.zero_grad(set_to_none=True)
        with megatron_schedule():
            out = forward_backward_no_pipelining(
                forward_step_func=self._forward_step,
                data_iterator=iter(batches),
                model=[self.model],
                num_microbatches=len(batches),
                seq_length=batches[0][0].shape[1],
                micro_batch_size=batches[0][0].shape[0],
                forward_only=False,
            )
        return [float(d["loss"]) for d in out]

    def sgd(self, lr: float = 0.1) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad


def _batches(g, microbatches: int, device) -> list:
    out = []
    for _ in range(microbatches):
        tokens = torch.randint(0, 64, (2, 16), generator=g).to(device)
        out.append((tokens, torch.roll(tokens, -1, 1)))
    return out


def _engines(model) -> list[str]:
    from mok_megatron.adapter.layer import MoKMoELayer

    return [
        "pipelined" if m.token_dispatcher.pipelined else "plain"
        for m in model.modules()
        if isinstance(m, MoKMoELayer)
    ]


def combined_1f1b_case(rank, world, *, ep=2, microbatches=2, steps=3, dtype="bf16", **cfg_kw):
    """A tiny MoK GPT trained ``steps`` SGD steps through Megatron's no-pipelining schedule twice from
    the same weights and data: plainly, and with Megatron's combined 1F1B EP overlap (``OVERLAP_FLAGS``:
    the layer's phases as separate schedule nodes on a compute and a communication stream, one
    micro-batch's forward interleaved layer by layer with another's backward, node inputs freed after
    the node, expert weight gradients from ``backward_dw``). Both models run MoK's plain engine (the one
    the overlap selects), so only the schedule differs. Returns both runs' losses, whether every step's
    gradients and every final parameter are bitwise equal, the engines and the schedule plans built."""
    from mok_megatron.options import MoKOptions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    setup_parallel(ep=ep)
    runs = []
    for overlap in (False, True):
        cfg = schedule_config(ep, overlap, dtype, **cfg_kw)
        torch.manual_seed(0)
        model = build_gpt(cfg, mok=True, options=MoKOptions(engine="plain")).to(device)
        model.config.finalize_model_grads_func = None
        runs.append(_Steps(model))
    runs[1].model.load_state_dict(runs[0].model.state_dict(), strict=True)
    g = torch.Generator().manual_seed(rank)
    losses, grads_bitwise = ([], []), True
    for _ in range(steps):
        batches = _batches(g, microbatches, device)
        grads = []
        for run, log in zip(runs, losses, strict=True):
            log.append(run.forward_backward(batches))
            grads.append(_grads(run.model))
            run.sgd()
        grads_bitwise &= _same(*grads)
    p0, p1 = (dict(r.model.named_parameters()) for r in runs)
    return {
        "losses": losses,
        "grads_bitwise": grads_bitwise,
        "params_bitwise": set(p0) == set(p1) and all(torch.equal(p0[k], p1[k]) for k in p0),
        "engines": [_engines(r.model) for r in runs],
        "schedule_plans": [r.schedule_plans for r in runs],
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |a| (the difference itself where a is zero)."""
    a, b = a.double(), b.double()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(a.abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def combined_1f1b_parity_case(rank, world, *, ep=2, microbatches=2, steps=2, **cfg_kw):
    """Megatron's GPT with its own alltoall ``MoELayer`` (``SequentialMLP`` experts) vs the same model
    with MoK's layers, from the same weights (MoK loads the reference state dict), both trained through
    Megatron's combined 1F1B EP-overlap schedule: per step, every micro-batch's loss and every gradient,
    then the same SGD step on both. fp32 (``schedule_config``: the flags set after validation), so the
    comparison is at fp32 rounding. Returns the losses and the largest relative differences."""
    from mok_megatron.adapter.layer import MoKMoELayer
    from mok_megatron.experts.checkpoint import convert_state_dict

    device = "cuda" if torch.cuda.is_available() else "cpu"
    setup_parallel(ep=ep)
    cfg = schedule_config(ep, True, "fp32", **cfg_kw)
    torch.manual_seed(0)
    models = [build_gpt(cfg, mok=False).to(device), build_gpt(cfg, mok=True).to(device)]
    models[1].load_state_dict(models[0].state_dict(), strict=True)
    for m in models:
        m.config.finalize_model_grads_func = None
    runs = [_Steps(m) for m in models]
    g = torch.Generator().manual_seed(rank)
    losses, worst_loss, worst_grad = [], 0.0, (0.0, "")
    for _ in range(steps):
        batches = _batches(g, microbatches, device)
        (l_ref, g_ref), (l_mok, g_mok) = [(r.forward_backward(batches), _grads(r.model)) for r in runs]
        g_ref = convert_state_dict(g_ref, "mok")
        assert set(g_ref) == set(g_mok), sorted(set(g_ref) ^ set(g_mok))
        losses.append((l_ref, l_mok))
        worst_loss = max([worst_loss] + [abs(a - b) / abs(a) for a, b in zip(l_ref, l_mok, strict=True)])
        worst_grad = max([worst_grad] + [(_rel(g_ref[k], g_mok[k]), k) for k in g_ref])
        for r in runs:
            r.sgd()
    return {
        "losses": losses,
        "worst_loss_rel": worst_loss,
        "worst_grad_rel": worst_grad,
        "mok_layers": sum(isinstance(m, MoKMoELayer) for m in models[1].modules()),
        "plain_engine": [e == "plain" for e in _engines(models[1])],
        "schedule_plans": [r.schedule_plans for r in runs],
    }


def combined_1f1b_freed_input_case(rank, world, *, ep=2):
    """The CPU harness keeps the scheduler's freeing: MoK's plain engine with a ``dispatch_postprocess``
    that hands the experts the dispatched rows themselves (no sorting copy, as at one local expert,
    where Megatron keeps the experts node's input) under the combined 1F1B schedule. The scheduler frees
    the experts node's input after its forward while the expert GEMMs saved it for backward, so the
    backward must fail. Returns the error text, or None if the run went through."""
    from mok_megatron.engine import plain

    def unsorted(x, probs, plan):
        return x, plan.tokens_per_expert_L, probs

    sort = plain.dispatch_postprocess
    plain.dispatch_postprocess = unsorted
    try:
        combined_1f1b_case(rank, world, ep=ep, microbatches=2, steps=1)
    except RuntimeError as e:
        return str(e)
    finally:
        plain.dispatch_postprocess = sort
    return None
