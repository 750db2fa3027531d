"""Case functions that run on every worker rank (see tests/pool.py), and their shared builders.

Each case builds Megatron-Core's own ``MoELayer`` (alltoall dispatcher, ``SequentialMLP`` experts) as the
reference and the MoK layer, copies the reference weights into MoK (through ``load_state_dict``, which
converts the expert layout), runs forward and backward on the same per-rank input and upstream
gradient, and returns the largest differences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PARALLEL = {"key": None}


def setup_parallel(tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1, seed: int = 1234) -> None:
    """(Re)initialise Megatron's parallel state for this layout, reusing it when unchanged."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    key = (tp, ep, etp, pp)
    if _PARALLEL["key"] != key:
        if ps.model_parallel_is_initialized():
            _destroy_groups(ps)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        _PARALLEL["key"] = key
    model_parallel_cuda_manual_seed(seed)
    # Megatron's global MoE metrics tracker sizes its entries by the first model's layer count.
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def _destroy_groups(ps) -> None:
    """destroy_model_parallel forgets Megatron's groups without freeing them; free them too (each
    gloo group holds threads and sockets, and layouts change many times in one worker)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    seen = set()
    for value in list(vars(ps).values()):
        groups = value if isinstance(value, (list, tuple)) else [value]
        for g in groups:
            if isinstance(g, dist.ProcessGroup) and g is not world and id(g) not in seen:
                seen.add(id(g))
                try:
                    dist.destroy_process_group(g)
                except Exception:
                    pass
    ps.destroy_model_parallel()


MODES = {
    # name: config overrides
    "dropless": {},
    "drop_probs": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs"),
    "drop_position": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
    "pad_probs": dict(
        moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=True
    ),
    "pad_position": dict(
        moe_expert_capacity_factor=0.75,
        moe_token_drop_policy="position",
        moe_pad_expert_input_to_capacity=True,
    ),
    "rpad16": {},  # router padding for quantization, alignment 16 (fp8 tensorwise)
    "rpad32": {},  # alignment 32 (mxfp8)
}

ACTIVATIONS = {
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "geglu": dict(gated_linear_unit=True, activation_func=F.gelu),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
    "relu": dict(gated_linear_unit=False, activation_func=F.relu),
    "squared_relu": dict(gated_linear_unit=False, activation_func="squared_relu"),
    "quick_geglu_clamp": dict(
        gated_linear_unit=True,
        activation_func="quick_gelu",
        activation_func_clamp_value=0.5,
        glu_linear_offset=1.0,
    ),
}


def make_config(
    tp=1,
    ep=1,
    etp=1,
    topk=2,
    score="softmax",
    shared=False,
    shared_overlap=False,
    mode="dropless",
    act="swiglu",
    num_experts=8,
    hidden=16,
    ffn=8,
    **extra,
):
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    act_kw = dict(ACTIVATIONS[act])
    act_kw["activation_func"] = {"squared_relu": squared_relu, "quick_gelu": quick_gelu}.get(
        act_kw["activation_func"], act_kw["activation_func"]
    )
    kw = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=topk,
        moe_router_score_function=score,
        moe_router_pre_softmax=(topk == 1 and score == "softmax"),
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        use_cpu_initialization=True,
        init_method_std=0.3,  # outputs of order one, so differences are meaningful
        add_bias_linear=False,
        params_dtype=torch.float32,
        **act_kw,
    )
    if shared:
        kw.update(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=shared_overlap)
    kw.update(MODES[mode])
    kw.update(extra)
    cfg = TransformerConfig(**kw)
    if mode in ("rpad16", "rpad32"):
        # TransformerConfig only accepts router padding with FP8, and FP8 needs Transformer Engine.
        # Without TE, set it after validation: both layers then pad the routing map to the FP8
        # alignment (Megatron's SequentialMLP also pads per-expert rows; the math stays in fp32).
        cfg.moe_router_padding_for_quantization = True
        cfg.fp8 = "e4m3"
        from megatron.core.enums import Fp8Recipe

        cfg.fp8_recipe = Fp8Recipe.tensorwise if mode == "rpad16" else Fp8Recipe.mxfp8
    return cfg


def layer_kwargs(cfg, opts: dict | None = None) -> dict:
    """The MoK layer's ``options`` (``opts``: MoKOptions fields) and ``transport``: ``opts["loopback"]``
    (``LoopbackLink`` fields) gives the layer a loopback transport emulating that link (one rank)."""
    from mok_megatron.options import MoKOptions
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    opts = dict(opts or {})
    link = opts.pop("loopback", None)
    transport = None
    if link is not None:
        link = link if isinstance(link, LoopbackLink) else LoopbackLink(**link)
        local = cfg.num_moe_experts // max(cfg.expert_model_parallel_size, 1)
        transport = LoopbackTransport(link, local, cfg.moe_router_topk)
    return dict(options=MoKOptions(**opts), transport=transport)


def build_layers(cfg, layer_number: int = 1, opts: dict | None = None):
    """(reference Megatron MoELayer, MoK layer) with identical weights; ``opts``: MoKOptions fields (and
    ``loopback``: ``layer_kwargs``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    from mok_megatron.spec import get_gpt_layer_with_mok_spec

    ref = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts).mlp(config=cfg)
    mok = get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp(config=cfg, **layer_kwargs(cfg, opts))
    for m in (ref, mok):
        m.set_layer_number(layer_number)
        m.train()
    missing = mok.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref, mok


def _aux_losses():
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    vals = {}
    for name, entry in getattr(tracker, "metrics", {}).items():
        v = entry.values if hasattr(entry, "values") else entry
        if torch.is_tensor(v) and bool((v != 0).any()):
            vals[name] = v.detach().clone()
    tracker.clear() if hasattr(tracker, "clear") else None
    return vals


def run_layer(layer, x, dout):
    x = x.clone().requires_grad_(True)
    _aux_losses()
    out, bias = layer(x)
    assert bias is None
    aux = _aux_losses()
    out.backward(dout)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads, aux


def _maxdiff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(ref_res, mok_res) -> dict:
    """Largest absolute differences (and the scale of the reference) between two run_layer results."""
    from mok_megatron.experts.checkpoint import convert_state_dict

    (o1, gx1, g1, a1), (o2, gx2, g2, a2) = ref_res, mok_res
    g1 = convert_state_dict(g1, "mok")
    assert set(g1) == set(g2), f"parameter sets differ: {sorted(set(g1) ^ set(g2))}"
    out = {
        "out": _maxdiff(o1, o2),
        "out_scale": float(o1.abs().max()) if o1.numel() else 0.0,
        "dx": _maxdiff(gx1, gx2),
        "dx_scale": float(gx1.abs().max()) if gx1.numel() else 0.0,
    }
    for k in g1:
        out[f"grad:{k}"] = _maxdiff(g1[k], g2[k])
        # fp32 sums in another order (split GEMMs) differ relative to the gradient's magnitude
        out[f"grad:{k}_scale"] = float(g1[k].abs().max()) if g1[k].numel() else 0.0
    assert set(a1) == set(a2), f"aux losses differ: {sorted(a1)} vs {sorted(a2)}"
    for k in a1:
        out[f"aux:{k}"] = _maxdiff(a1[k], a2[k])
    out["aux_names"] = sorted(a1)
    return out


def parity_case(
    rank,
    world,
    *,
    tp=1,
    ep=1,
    etp=1,
    seq=16,
    batch=2,
    seed=0,
    steps=1,
    router_bias=None,
    opts=None,
    **cfg_kw,
):
    """Reference vs MoK on this rank's input; ``steps`` forward/backward passes (router state such as
    the expert-bias token counts and the global-aux-loss window carries over between them).

    ``router_bias``: {expert: value} written into the router's expert bias to force routing (needs
    moe_router_enable_expert_bias)."""
    setup_parallel(tp=tp, ep=ep, etp=etp)
    cfg = make_config(tp=tp, ep=ep, etp=etp, **cfg_kw)
    torch.manual_seed(seed)
    ref, mok = build_layers(cfg, opts=opts)
    if router_bias:
        for layer in (ref, mok):
            with torch.no_grad():
                for e, v in router_bias.items():
                    layer.router.expert_bias[e] = v
    seen_counts = []  # rows each local MoK expert received, per forward

    def seen(module, args, kwargs):  # a call of one group of experts (split by experts) counts for its own
        counts = [int(v) for v in args[1].tolist()]
        if kwargs.get("group") is not None:
            groups, c = kwargs["group"]
            lo, hi = groups.experts(c)
            counts = [0] * lo + counts + [0] * (module.num_local_experts - hi)
        seen_counts.append(counts)

    mok.experts.register_forward_pre_hook(seen, with_kwargs=True)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    results = []
    for _ in range(steps):
        x = torch.randn(seq // tp, batch, cfg.hidden_size, generator=g)
        dout = torch.randn(seq // tp, batch, cfg.hidden_size, generator=g)
        seen_counts.clear()  # the pipelined layer calls its experts once per local region/received part
        results.append(compare(run_layer(ref, x, dout), run_layer(mok, x, dout)))
    worst = {k: max(r[k] for r in results) for k in results[0] if k != "aux_names"}
    worst["aux_names"] = results[0]["aux_names"]
    worst["tokens_per_expert"] = [sum(c) for c in zip(*seen_counts, strict=True)]
    return worst


def build_error_case(rank, world, *, ep=4, cfg_ep=1, opts=None, **cfg_kw):
    """Build a MoK layer from a bad config on every rank; return the error text (or None)."""
    from mok_megatron.config import MoKConfigError

    setup_parallel(ep=ep)
    cfg = make_config(ep=cfg_ep, **cfg_kw)  # the config may disagree with the live EP group on purpose
    try:
        build_mok_only(cfg, opts)
    except MoKConfigError as e:
        return str(e)
    return None


def build_mok_only(cfg, opts: dict | None = None):
    from mok_megatron.spec import get_gpt_layer_with_mok_spec

    return get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp(config=cfg, **layer_kwargs(cfg, opts))


def forward_error_case(rank, world, *, ep=2, **cfg_kw):
    """Build a valid layer whose forward must fail on every rank before any collective."""
    from mok_megatron.config import MoKConfigError

    setup_parallel(ep=ep)
    cfg = make_config(ep=ep, **cfg_kw)
    torch.manual_seed(0)
    layer = build_mok_only(cfg)
    layer.set_layer_number(1)
    try:
        layer(torch.randn(16, 2, cfg.hidden_size))
    except (MoKConfigError, ValueError) as e:
        return str(e)
    return None


def _gather_experts(layer, ep_group, tp_group, gated: bool = True) -> dict:
    """Full global expert weights of a MoK or Megatron layer, identical on every rank."""
    import torch.distributed as dist

    from mok_megatron.experts.checkpoint import convert_state_dict

    sd = convert_state_dict(
        {k: v.detach() for k, v in layer.state_dict().items() if torch.is_tensor(v)}, "mok"
    )
    out = {}
    for key, local in sd.items():
        if key.startswith("experts."):
            if key == "experts.fc1_weight" and dist.get_world_size(tp_group) > 1:
                # [L, 2F/TP, H] holds [gate_tp; up_tp] with a GLU: gather gates and ups separately.
                halves = []
                for half in local.chunk(2 if gated else 1, dim=1):
                    parts = [torch.empty_like(half) for _ in range(dist.get_world_size(tp_group))]
                    dist.all_gather(parts, half.contiguous(), group=tp_group)
                    halves.append(torch.cat(parts, 1))
                local = torch.cat(halves, 1)
            elif key == "experts.fc2_weight" and dist.get_world_size(tp_group) > 1:
                parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, local.contiguous(), group=tp_group)
                local = torch.cat(parts, 2)
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(parts, local.contiguous(), group=ep_group)
            out[key] = torch.cat(parts, 0)
        else:
            out[key] = local.clone()
    return out


def _build_one(kind: str, cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    if kind == "mok":
        layer = build_mok_only(cfg)
    else:
        layer = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts).mlp(config=cfg)
    layer.set_layer_number(1)
    return layer


def dist_ckpt_case(rank, world, *, path, save, load, act="swiglu", singleton=False):
    """Save a layer with dist_checkpointing in one (kind, tp, ep, etp) layout, load it into a freshly
    initialised layer in another; return whether every tensor came back bitwise."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state as ps

    def layer_for(spec, seed):
        kind, tp, ep, etp = spec
        setup_parallel(tp=tp, ep=ep, etp=etp, seed=seed)
        torch.manual_seed(seed)
        cfg = make_config(tp=tp, ep=ep, etp=etp, shared=True, act=act)
        return _build_one(kind, cfg)

    gated = ACTIVATIONS[act]["gated_linear_unit"]

    def gather(layer):
        return _gather_experts(
            layer, ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(), gated
        )

    saved = layer_for(save, seed=1)
    want = gather(saved)
    metadata = {"singleton_local_shards": True} if singleton else None
    dist_checkpointing.save(saved.sharded_state_dict(prefix="moe.", metadata=metadata), path)
    dist.barrier()

    fresh = layer_for(load, seed=2)
    before = gather(fresh)
    state = dist_checkpointing.load(fresh.sharded_state_dict(prefix="moe.", metadata=metadata), path)
    fresh.load_state_dict({k[len("moe.") :]: v for k, v in state.items()}, strict=True)
    got = gather(fresh)
    keys = sorted(k for k in want if k.startswith("experts."))
    return {
        "expert_keys": keys,
        "bitwise": {k: bool(torch.equal(want[k], got[k])) for k in keys},
        "changed_by_load": {k: not torch.equal(before[k], got[k]) for k in keys},
        "router_bitwise": bool(torch.equal(want["router.weight"], got["router.weight"]))
        if load[1:] == save[1:]
        else None,
    }


def tiny_gpt_config(tp=1, ep=1, etp=1, layers=3, moe_layer_freq=None, **extra):
    """A tiny MoE GPT config (dense + MoE layers, shared expert, aux loss)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=8,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_layer_freq=moe_layer_freq or [1, 0, 1][:layers],
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(extra)
    return TransformerConfig(**kw)


def build_gpt(cfg, mok: bool, vocab=64, seq=16, mtp=False, options=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mok_megatron.spec import get_gpt_decoder_block_spec_with_mok

    if mok:
        block = get_gpt_decoder_block_spec_with_mok(
            cfg, use_transformer_engine=False, options=options, normalization="RMSNorm"
        )
    else:
        block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(cfg, block, use_transformer_engine=False) if mtp else None
    return GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
        mtp_block_spec=mtp_spec,
    )


def gpt_parity_case(rank, world, *, tp=1, ep=1, etp=1, steps=2, mtp=False):
    """Megatron GPTModel with Megatron's MoE layers vs the same model with MoK's: loss and every
    parameter gradient over a few steps of plain SGD."""
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.adapter.layer import MoKMoELayer

    setup_parallel(tp=tp, ep=ep, etp=etp)
    extra = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1) if mtp else {}
    cfg = tiny_gpt_config(tp=tp, ep=ep, etp=etp, **extra)
    torch.manual_seed(0)
    ref = build_gpt(cfg, mok=False, mtp=mtp)
    mok = build_gpt(cfg, mok=True, mtp=mtp)
    n_mok = sum(isinstance(m, MoKMoELayer) for m in mok.modules())
    mok.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(rank // tp)  # TP peers see the same batch
    losses, worst = [], 0.0
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        labels = torch.roll(tokens, -1, 1)
        pos = torch.arange(16).expand(2, -1)
        step = []
        for model in (ref, mok):
            model.zero_grad(set_to_none=True)
            loss = model(tokens, pos, None, labels=labels).float().mean()
            loss.backward()
            step.append(
                (
                    loss.detach(),
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                )
            )
        (l1, g1), (l2, g2) = step
        g1 = convert_state_dict(g1, "mok")
        assert set(g1) == set(g2), sorted(set(g1) ^ set(g2))
        worst = max([worst, float((l1 - l2).abs())] + [float((g1[k] - g2[k]).abs().max()) for k in g1])
        losses.append((float(l1), float(l2)))
        with torch.no_grad():  # same SGD step on both
            for model in (ref, mok):
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    return {"losses": losses, "worst": worst, "mok_layers": n_mok}


def pipeline_case(rank, world, *, ep=2, repeat=False, **kw):
    """``parity_case`` through the overlap pipeline; also reports sync-free overflow redos and, with
    ``repeat``, whether a second identical run is bitwise equal to the first."""
    global build_layers
    real_build, built = build_layers, []

    def build(*a, **k):
        ref, mok = real_build(*a, **k)
        built.append(mok)
        return ref, mok

    build_layers = build
    try:
        res = parity_case(rank, world, ep=ep, **kw)
    finally:
        build_layers = real_build
    stats = [mok.token_dispatcher.stats for mok in built]
    res["overflow_redos"] = sum(s.overflow_redos for s in stats)
    res["pipeline_calls"] = sum(s.calls for s in stats)
    if repeat:
        setup_parallel(ep=ep)
        cfg = make_config(ep=ep, **{k: v for k, v in kw.items() if k not in ("opts", "seed")})
        outs = []
        for _ in range(2):
            torch.manual_seed(0)
            _, mok = build_layers(cfg, opts=kw.get("opts"))
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(16, 2, cfg.hidden_size, generator=g)
            outs.append(run_layer(mok, x, torch.randn(16, 2, cfg.hidden_size, generator=g)))
        (o1, dx1, g1, _), (o2, dx2, g2, _) = outs
        res["bitwise"] = bool(
            torch.equal(o1, o2) and torch.equal(dx1, dx2) and all(torch.equal(g1[k], g2[k]) for k in g1)
        )
    return res


def with_engine(layer, **changes) -> None:
    """Rebuild ``layer``'s engine choice with ``changes`` (``rows``, ``row_alignment``, ``transport``: tests
    forcing another row layout or transport than the one the layer chose); a pipelined layer's config gets
    them too (its minibatch policy from the new transport), and ``row_alignment`` also goes to the experts,
    as the layer's builder does."""
    import dataclasses

    from mok_megatron.engine.pipeline_plan import MinibatchPolicy

    d = layer.token_dispatcher
    engine, pipeline = d.engine, d.engine.pipeline
    if pipeline is not None:
        to_pipeline = {k: v for k, v in changes.items() if k in ("transport", "rows", "row_alignment")}
        if "transport" in changes:
            policy = MinibatchPolicy.of(d.options, changes["transport"], d.mok_config.ep_size)
            to_pipeline["minibatches"] = policy
        pipeline = dataclasses.replace(pipeline, **to_pipeline)
    elif "transport" in changes:
        raise ValueError("with_engine: transport= needs a pipelined layer")
    rest = {k: v for k, v in changes.items() if k != "transport"}
    d.engine = dataclasses.replace(engine, pipeline=pipeline, **rest)
    if "row_alignment" in changes and hasattr(layer.experts, "aligned_input"):
        layer.experts.aligned_input = changes["row_alignment"]
