"""The tiles engine (``--mok-engine tiles``, ``engine.tiles``): Megatron's alltoall layer's output, input gradient
and weight gradients at EP 1, 2 and 4 (CPU, gloo, fp32: the kernels' references), the torch backend's
gradient-accumulation-fusion contract, the one-line refusals (before any collective), and on an sm_90 GPU
with QuACK the kernels against the plain engine.

The pull: with a loopback transport given to the layer (emulating 2 and 4 EP ranks) the received rows come
from its emulated peers' buffers, the rank's own placed and the rest pulled; the results are bitwise the
pull-less engine's (output, input, probability and weight gradients, on CPU through the references; on an
sm_90 GPU through the kernels at 900 GB/s, in a watched subprocess: a pull that never comes leaves the waiting
GEMM spinning) and Megatron's within the parity tolerances; the pull's SMs, rate, stream and copy path reach
the composition from the options and the transport; the loopback's link time only (``bytes="link"``: every
row placed, the pull pacing and releasing without a copy, ``copy="none"``) bitwise the copying loopback's and
the pull-less engine's results (CPU, and through the kernels on an sm_90 GPU); transports without peer buffers
are refused in one line.

Legend: T tokens, K routes per token, G local experts, H hidden, F expert FFN width."""

from __future__ import annotations

import os

import pytest
import torch

from mok_megatron.errors import MoKConfigError
from mok_megatron.options import MoKOptions, MoKOptionsError
from tests.harness.gpu import MULTICAST_OFF, REPO, needs_sm90_quack, watched
from tests.test_parity import check


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("topk", [1, 2, 8])
def test_tiles_engine_matches_megatron(pool, ep, topk):
    results = pool.run(
        "tests.tiles_cases:parity_case", ep=ep, topk=topk, score="sigmoid" if topk == 8 else "softmax"
    )
    for rank, res in enumerate(results):
        assert res.pop("calls") == 1, "the layer call ran the tiles engine's node once"
        assert res.pop("pulls") == 0, "no transport: every row placed"
        check(res, f"rank {rank}")
        assert res["out_scale"] > 0.1


@pytest.mark.parametrize("ep,topk", [(2, 2), (4, 8)])
def test_pulled_rows_match_megatron(pool, ep, topk):
    score = "sigmoid" if topk == 8 else "softmax"
    results = pool.run("tests.tiles_cases:parity_case", topk=topk, score=score, loopback=dict(ep=ep))
    for rank, res in enumerate(results):
        assert res.pop("calls") == 1
        assert res.pop("pulls") == 2, "the forward and the backward each pulled rows"
        check(res, f"rank {rank}")
        assert res["out_scale"] > 0.1


def test_tiles_engine_with_shared_experts_and_two_steps(pool):
    results = pool.run("tests.tiles_cases:parity_case", ep=2, topk=2, shared=True, steps=2)
    for rank, res in enumerate(results):
        assert res.pop("calls") == 2
        assert res.pop("pulls") == 0, "no transport: every row placed"
        check(res, f"rank {rank}")


@pytest.mark.parametrize(
    "opts,says",
    [
        (dict(tile_sms=0), r"--mok-tile-sms=0: must be in \[1, 32\]"),
        (dict(tile_sms=33), r"--mok-tile-sms=33: must be in \[1, 32\] .*keep the rest\)\.$"),
        (dict(tile_sms_backward=-2), r"--mok-tile-sms-backward=-2: must be in \[1, 32\] .*or omitted"),
        (dict(engine="tiles", fp8_dispatch=True), r"--mok-engine tiles with --mok-fp8-dispatch: .*Drop them"),
        (dict(engine="tiles", minibatch_size=64), r"--mok-engine tiles with --mok-minibatch-size"),
        (dict(engine="tiles", transport="nvlink"), r"--mok-engine tiles with --mok-transport nvlink"),
    ],
)
def test_option_refusals_in_one_line(opts, says):
    with pytest.raises(MoKOptionsError, match=says) as e:
        MoKOptions(**opts)
    assert "\n" not in str(e.value)


def test_backward_sms_default_to_the_forwards():
    assert MoKOptions(engine="tiles", tile_sms=6).tile_sms_bwd == 6
    assert MoKOptions(engine="tiles", tile_sms=6, tile_sms_backward=2).tile_sms_bwd == 2
    assert MoKOptions().engine.value == "auto" and MoKOptions().tile_sms == 4


@pytest.mark.parametrize(
    "cfg_kw,says",
    [
        (dict(mode="drop_probs"), r"moe_expert_capacity_factor=0.75 \(token dropping\)"),
        (dict(mode="pad_probs"), r"moe_pad_expert_input_to_capacity=True"),
        (dict(mode="rpad16"), r"moe_router_padding_for_quantization=True"),
        (dict(act="geglu"), r"an activation other than SwiGLU"),
        (dict(act="quick_geglu_clamp"), r"an activation other than SwiGLU"),
        (dict(act="relu"), r"an activation other than SwiGLU"),
        (dict(topk=1, moe_apply_probs_on_input=True), r"moe_apply_probs_on_input=True"),
    ],
)
def test_layer_refusals_in_one_line_before_any_collective(single_rank, cfg_kw, says):
    from tests.cases import build_mok_only, make_config

    with pytest.raises(MoKConfigError, match=says) as e:
        build_mok_only(make_config(**cfg_kw), dict(engine="tiles"))
    text = str(e.value)
    assert "\n" not in text and text.startswith("--mok-engine tiles runs dropless SwiGLU layers")
    assert text.endswith("Change those settings, or use --mok-engine auto.")


def test_expert_tp_is_refused():
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine.select import tiles_blockers
    from mok_megatron.experts_contract import ExpertsContract
    from tests.cases import make_config

    cfg = MoKConfig.from_megatron(make_config(tp=2, etp=2), ep_size=1, etp_size=2)
    assert tiles_blockers(cfg, MoKOptions(engine="tiles"), ExpertsContract(mok=True)) == [
        "expert_tensor_parallel_size=2"
    ]


def test_other_expert_backends_and_megatron_overlap_are_refused():
    from mok_megatron.engine.select import check_options, tiles_blockers
    from mok_megatron.experts_contract import ExpertsContract
    from tests.cases import make_config
    from mok_megatron.config import MoKConfig

    cfg = MoKConfig.from_megatron(make_config(), ep_size=1, etp_size=1)
    te = ExpertsContract(mok=True, host_counts=True)
    assert tiles_blockers(cfg, MoKOptions(engine="tiles", expert_backend="te"), te) == [
        "--mok-expert-backend te"
    ]
    fp8 = ExpertsContract(mok=True, alignment=16, fuses_permute=True)
    opts = MoKOptions(engine="tiles", expert_backend="torch-fp8")
    assert tiles_blockers(cfg, opts, fp8) == ["--mok-expert-backend torch-fp8"]
    flag = "--overlap-moe-expert-parallel-comm"
    with pytest.raises(MoKConfigError, match=rf"^--mok-engine tiles with {flag}: .*Drop one of them\.$"):
        check_options(MoKOptions(engine="tiles"), ep_size=2, blockers=[], megatron_overlap_flags=(flag,))


def test_auto_never_picks_tiles(single_rank):
    from tests.cases import build_mok_only, make_config

    layer = build_mok_only(make_config(), None)
    assert layer.token_dispatcher.engine.tiles is None
    tiles = build_mok_only(make_config(), dict(engine="tiles", tile_sms=3)).token_dispatcher.engine.tiles
    assert (tiles.sms, tiles.sms_backward, tiles.kernels) == (3, 3, False)  # CPU: the references


def test_the_combine_runs_after_the_gemm_and_nothing_pulls(monkeypatch):
    """With the kernels (their references standing in, on CPU) a layer call runs fc2 and fc1's input gradient
    on all SMs, then the full-device combine: beside the GEMM on K SMs the combine measured slower at every
    K. No pull, so no side stream."""
    from mok_megatron.engine import tile_compose as tcomp
    from mok_megatron.engine import tiles as te

    seen = []

    def spy(run):
        def call(*args, **kw):  # args end with the ops: the kernels' references run in their place, on CPU
            seen.append({k: kw.get(k) for k in ("pull", "combine", "side")})
            return run(*args[:-1], tcomp.REFERENCES, **kw)

        return call

    for name in ("tiles_forward", "tiles_backward"):
        monkeypatch.setattr(tcomp, name, spy(getattr(tcomp, name)))
    counts = torch.tensor([2, 3])
    x = torch.randn(5, 8, requires_grad=True)
    out = te.tile_experts(
        x, torch.rand(5, 1), te.row_routes(counts), counts, torch.randn(2, 8, 8), torch.randn(2, 8, 4),
        te.TilesConfig(sms=3, sms_backward=2, kernels=True),
    )  # fmt: skip
    out.sum().backward()
    assert seen == [dict(pull=False, combine="after", side=None)] * 2


def _routed(tokens: int, topk: int, experts: int, seed: int):
    """Routing metadata of ``tokens`` tokens, each to ``topk`` distinct experts of the first ``experts - 1``
    (the last expert gets no rows)."""
    from mok_megatron.kernels.routing import routing_metadata_reference

    gen = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(experts - 1, generator=gen)[:topk] for _ in range(tokens)])
    return routing_metadata_reference(ids_TK, experts)


def _experts_call(meta, source, config, seed=0, streams=None):
    """(out, dx, dprobs, dw1, dw2) of ``tile_experts`` over ``meta``'s routes, fp32, H 16, F 8."""
    from mok_megatron.engine import tiles as te

    gen = torch.Generator().manual_seed(seed)
    t, k = meta.row_TK.shape
    g = meta.counts_E.numel()
    x = torch.randn(t, 16, generator=gen).requires_grad_(True)
    probs = torch.rand(t, k, generator=gen).requires_grad_(True)
    w1 = (torch.randn(g, 16, 16, generator=gen) / 4).requires_grad_(True)
    w2 = (torch.randn(g, 16, 8, generator=gen) / 3).requires_grad_(True)
    dout = torch.randn(t, 16, generator=gen)
    out = te.tile_experts(
        x, probs, meta, meta.counts_E.long(), w1, w2, config, streams=streams, source=source
    )
    out.backward(dout)
    return [out.detach(), x.grad, probs.grad, w1.grad, w2.grad]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("topk", [1, 3])
def test_pulled_rows_give_the_pull_less_results_bitwise(ep, topk):
    """On the references: the output and the gradients of x, the probabilities and both weights equal the
    engine's without a transport bit for bit; the rows the pull must bring start as NaN, so one it missed
    would show."""
    from mok_megatron.engine import tiles as te
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    meta = _routed(40, topk, 6, seed=ep * topk)
    config = te.TilesConfig(sms=2, sms_backward=2, kernels=False)
    source = LoopbackTransport(LoopbackLink(ep=ep), num_local_experts=6, topk=topk)
    placed = _experts_call(meta, None, config)
    pulled = _experts_call(meta, source, config)
    assert source.bytes_moved > 0
    for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), pulled, placed, strict=True):
        assert torch.equal(a, b), name


def _spy_on_compositions(monkeypatch, record):
    """Replaces ``tiles_forward`` / ``tiles_backward`` with versions that append ``record(args, kw)`` and then
    run the references on CPU (unpaced, one stream): what the engine hands the composition, with the kernels'
    config standing in on a machine without them."""
    from mok_megatron.engine import tile_compose as tcomp

    seen = []

    def spy(run):
        def call(*args, **kw):
            seen.append(record(args, kw))
            kw.update(rate=0.0, side=None, **({"wgrad_stream": None} if "wgrad_stream" in kw else {}))
            return run(*args[:-1], tcomp.REFERENCES, **kw)

        return call

    for name in ("tiles_forward", "tiles_backward"):
        monkeypatch.setattr(tcomp, name, spy(getattr(tcomp, name)))
    return seen


def test_the_pull_gets_its_sms_rate_and_stream_from_the_options_and_the_transport(monkeypatch):
    """With the kernels (their references standing in, on CPU) and a loopback at 900 GB/s: the forward pulls
    beside fc1 on ``sms`` SMs, the backward beside fc2's input gradient on ``sms_backward``, both at the
    link's rate on the layer's side stream; the weight gradients beside on the layer's stream."""
    from types import SimpleNamespace

    from mok_megatron.engine import tiles as te
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    meta = _routed(30, 2, 6, seed=1)
    want = _experts_call(meta, None, te.TilesConfig(sms=3, sms_backward=2, kernels=False))
    keys = ("pull", "k", "rate", "side", "wgrad", "wgrad_stream")
    seen = _spy_on_compositions(monkeypatch, lambda args, kw: {k: kw.get(k) for k in keys})
    streams = SimpleNamespace(side="side stream", wgrad="wgrad stream", delay="delay stream")
    source = LoopbackTransport(LoopbackLink(ep=4, gbps=900.0), num_local_experts=6, topk=2)
    config = te.TilesConfig(sms=3, sms_backward=2, kernels=True)
    got = _experts_call(meta, source, config, streams=streams)
    assert seen == [
        dict(pull=True, k=3, rate=900e9, side="side stream", wgrad=None, wgrad_stream=None),
        dict(pull=True, k=2, rate=900e9, side="side stream", wgrad="beside", wgrad_stream="wgrad stream"),
    ]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("topk", [1, 3])
def test_a_link_only_loopback_gives_the_copying_and_the_pull_less_results_bitwise(ep, topk):
    """On the references: the loopback's link time only (every row placed, the pull releasing without a
    copy) gives the output and the gradients of x, the probabilities and both weights bit for bit as the
    copying loopback and as no transport; it builds no source buffer (nothing counted)."""
    from mok_megatron.engine import tiles as te
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    meta = _routed(40, topk, 6, seed=ep + topk)
    config = te.TilesConfig(sms=2, sms_backward=2, kernels=False)
    link = LoopbackTransport(LoopbackLink(ep=ep, bytes="link"), num_local_experts=6, topk=topk)
    copying = LoopbackTransport(LoopbackLink(ep=ep), num_local_experts=6, topk=topk)
    assert not link.pull_moves_rows and copying.pull_moves_rows
    placed = _experts_call(meta, None, config)
    pulled = _experts_call(meta, copying, config)
    linked = _experts_call(meta, link, config)
    assert link.bytes_moved == 0 and copying.bytes_moved > 0
    for name, a, b, c in zip(("out", "dx", "dprobs", "dw1", "dw2"), linked, pulled, placed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_a_link_only_loopback_places_every_row_and_pulls_without_copying(monkeypatch):
    """With the kernels (their references standing in, on CPU) and a link-only loopback at 900 GB/s: both
    directions pull (pace and release) with copy="none" at the link's rate, every row placed before the call,
    the pull's table P zeros (no source read); at an infinite rate nothing is pulled; the copying loopback
    pulls with the register copy."""
    from types import SimpleNamespace

    from mok_megatron.engine import tiles as te
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    def record(args, kw):
        buf, inputs = args[0], args[1]
        rows = buf.recv_MH if hasattr(buf, "recv_MH") else buf.dy_MH
        return dict({k: kw.get(k) for k in ("pull", "rate", "copy")}, nan=bool(torch.isnan(rows).any()),
                    table=inputs.table_P.tolist(), sources=len(inputs.sources))  # fmt: skip

    meta = _routed(30, 2, 6, seed=2)
    want = _experts_call(meta, None, te.TilesConfig(sms=3, sms_backward=2, kernels=False))
    seen = _spy_on_compositions(monkeypatch, record)
    streams = SimpleNamespace(side="side stream", wgrad="wgrad stream", delay="delay stream")
    config = te.TilesConfig(sms=3, sms_backward=2, kernels=True)
    link = LoopbackTransport(LoopbackLink(ep=4, gbps=900.0, bytes="link"), num_local_experts=6, topk=2)
    got = _experts_call(meta, link, config, streams=streams)
    linked = dict(pull=True, rate=900e9, copy="none", nan=False, table=[0, 0, 0, 0], sources=0)
    assert seen == [linked, linked]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    seen.clear()
    infinite = LoopbackTransport(LoopbackLink(ep=4, gbps=0.0, bytes="link"), num_local_experts=6, topk=2)
    got = _experts_call(meta, infinite, config, streams=streams)
    placed = dict(pull=False, rate=0.0, copy="none", nan=False, table=[0, 0, 0, 0], sources=0)
    assert seen == [placed, placed]  # no pace, no rows moved: nothing to pull, no SMs held back
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    seen.clear()
    copying = LoopbackTransport(LoopbackLink(ep=4, gbps=900.0), num_local_experts=6, topk=2)
    _experts_call(meta, copying, te.TilesConfig(sms=3, sms_backward=2, kernels=False))
    assert [(s["pull"], s["copy"], s["nan"], s["sources"]) for s in seen] == [
        (True, "registers", True, 4)
    ] * 2


@pytest.mark.parametrize("ep", [2, 4])
def test_a_link_only_loopback_layer_matches_the_copying_and_the_pull_less_layers_bitwise(single_rank, ep):
    """The layer built with a loopback of the link time only (``bytes="link"``, EP = 1) is accepted by the
    tiles engine and gives the output, the input gradient and every parameter's gradient bit for bit as the
    copying loopback's layer and the layer without a transport."""
    from tests.cases import build_mok_only, make_config, run_layer

    cfg = make_config(topk=2)
    torch.manual_seed(0)
    layers = {"placed": build_mok_only(cfg, dict(engine="tiles"))}
    for name, nbytes in (("copied", "copy"), ("linked", "link")):
        layers[name] = build_mok_only(cfg, dict(engine="tiles", loopback=dict(ep=ep, bytes=nbytes)))
        layers[name].load_state_dict(layers["placed"].state_dict())
    assert layers["linked"].token_dispatcher.engine.pull is layers["linked"].token_dispatcher.transport
    assert not layers["linked"].token_dispatcher.transport.pull_moves_rows
    gen = torch.Generator().manual_seed(ep)
    x = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    dout = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    res = {}
    for name, layer in layers.items():
        layer.set_layer_number(1)
        res[name] = run_layer(layer, x, dout)[:3]
    (out, dx, grads) = res["linked"]
    for other in ("copied", "placed"):
        out0, dx0, grads0 = res[other]
        assert torch.equal(out, out0) and torch.equal(dx, dx0), other
        assert grads.keys() == grads0.keys() and "router.weight" in grads
        for n, g in grads.items():
            assert torch.equal(g, grads0[n]), (other, n)


def test_a_pull_on_the_kernels_without_streams_is_refused():
    from mok_megatron.engine import tiles as te
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    meta = _routed(8, 2, 4, seed=0)
    source = LoopbackTransport(LoopbackLink(ep=2), num_local_experts=4, topk=2)
    with pytest.raises(ValueError, match=r"^tile_experts: a pull source with the kernels .* pass streams="):
        _experts_call(meta, source, te.TilesConfig(sms=2, sms_backward=2, kernels=True))


@pytest.mark.parametrize("ep", [2, 4])
def test_a_loopback_layer_pulls_and_matches_the_pull_less_layer_bitwise(single_rank, ep):
    """The layer built with a loopback transport (EP = 1, the loopback emulating ``ep`` ranks): the engine
    pulls from it, and the output, the input gradient and every parameter's gradient (the router's carries the
    probability gradient) equal the layer's without a transport bit for bit."""
    from mok_megatron.transport.loopback import LoopbackTransport
    from tests.cases import build_mok_only, make_config, run_layer

    cfg = make_config(topk=2)
    torch.manual_seed(0)
    placed = build_mok_only(cfg, dict(engine="tiles"))
    pulled = build_mok_only(cfg, dict(engine="tiles", loopback=dict(ep=ep)))
    pulled.load_state_dict(placed.state_dict())
    transport = pulled.token_dispatcher.transport
    assert isinstance(transport, LoopbackTransport) and pulled.token_dispatcher.engine.pull is transport
    assert placed.token_dispatcher.transport is None and not pulled.token_dispatcher.pipelined
    gen = torch.Generator().manual_seed(ep)
    x = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    dout = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    res = {}
    for name, layer in (("placed", placed), ("pulled", pulled)):
        layer.set_layer_number(1)
        res[name] = run_layer(layer, x, dout)[:3]
    assert transport.bytes_moved > 0
    (out, dx, grads), (out0, dx0, grads0) = res["pulled"], res["placed"]
    assert torch.equal(out, out0) and torch.equal(dx, dx0)
    assert grads.keys() == grads0.keys() and "router.weight" in grads
    for n, g in grads.items():
        assert torch.equal(g, grads0[n]), n


def test_a_transport_without_peer_buffers_is_refused_in_one_line(single_rank):
    import torch.distributed as dist

    from mok_megatron.spec import get_gpt_layer_with_mok_spec
    from mok_megatron.transport.collective import CollectiveTransport
    from tests.cases import make_config

    mlp = get_gpt_layer_with_mok_spec(use_te=False).submodules.mlp
    with pytest.raises(MoKConfigError) as e:
        mlp(
            config=make_config(),
            options=MoKOptions(engine="tiles"),
            transport=CollectiveTransport(dist.group.WORLD),
        )
    text = str(e.value)
    assert "\n" not in text and text.startswith("--mok-engine tiles runs dropless SwiGLU layers")
    assert (
        "this layer has a collective transport given to the layer (it exposes no peer buffers to the pull)"
        in text
    )


def test_a_loopback_beside_expert_parallelism_is_refused():
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine.select import tiles_blockers
    from mok_megatron.experts_contract import ExpertsContract
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport
    from tests.cases import make_config

    cfg = MoKConfig.from_megatron(make_config(ep=2), ep_size=2, etp_size=1)
    loopback = LoopbackTransport(LoopbackLink(ep=4), num_local_experts=4, topk=2)
    assert tiles_blockers(cfg, MoKOptions(engine="tiles"), ExpertsContract(mok=True), loopback) == [
        "a loopback transport at EP=2 (it stands in for an EP group on one rank: --expert-model-parallel-size 1)"
    ]


@pytest.mark.gpu
@needs_sm90_quack
@pytest.mark.parametrize("topk", [2, 8])
@pytest.mark.parametrize("nbytes", ["copy", "link"])
def test_kernels_pull_from_the_loopback_bitwise_the_pull_less_layer_on_gpu(topk, nbytes):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        **MULTICAST_OFF,
    )
    hang = f"topk {topk} bytes {nbytes}: the tiles layer pulling from the loopback still running (a hang)"
    watched(["-m", "tests.tiles_cases", "--gpu-loopback", str(topk), "--bytes", nbytes], env, hang)


def test_weight_gradients_into_main_grad_as_the_torch_backend(single_rank):
    """Gradient accumulation fusion: the weight gradients are added into ``main_grad`` (on top of what it
    holds) and autograd gets Megatron's dummy, as the torch experts do."""
    from tests.cases import build_mok_only, make_config

    cfg = make_config(gradient_accumulation_fusion=True)
    plain = build_mok_only(cfg, dict(engine="plain"))
    tiles = build_mok_only(cfg, dict(engine="tiles"))
    tiles.load_state_dict(plain.state_dict())
    for layer in (plain, tiles):
        layer.set_layer_number(1)
    x = torch.randn(16, 2, cfg.hidden_size)
    dout = torch.randn_like(x)
    got = {}
    for name, layer in (("plain", plain), ("tiles", tiles)):
        for p in (layer.experts.fc1_weight, layer.experts.fc2_weight):
            p.main_grad = torch.full(p.shape, 0.5)
            p.grad_added_to_main_grad = False
        out, _ = layer(x.clone().requires_grad_(True))
        out.backward(dout)
        got[name] = [
            (p.main_grad.clone(), p.grad_added_to_main_grad)
            for p in (layer.experts.fc1_weight, layer.experts.fc2_weight)
        ]
    for (mg_t, added_t), (mg_p, added_p) in zip(got["tiles"], got["plain"], strict=True):
        assert added_t and added_p
        torch.testing.assert_close(mg_t, mg_p, rtol=1e-5, atol=1e-6)
        assert not torch.equal(mg_t, torch.full_like(mg_t, 0.5))


@pytest.mark.gpu
@needs_sm90_quack
@pytest.mark.parametrize("topk", [2, 8])
def test_kernels_match_the_plain_engine_on_gpu(single_rank, topk):
    """bf16, EP = 1: the tile kernels against the plain engine (cuBLAS), QuACK's accumulation order within the
    tile layer benchmark's tolerances; repeated calls bitwise equal; no NaN."""
    from benchmarks.tile_layer import GRAD_REL, MATCH
    from tests.cases import build_layers, make_config

    cfg = make_config(topk=topk, num_experts=16, hidden=512, ffn=256, params_dtype=torch.bfloat16, bf16=True)
    layers = {}
    for engine in ("plain", "tiles"):
        torch.manual_seed(0)
        layers[engine] = build_layers(cfg, opts=dict(engine=engine))[1].cuda()
    assert layers["tiles"].token_dispatcher.engine.tiles.kernels
    x = torch.randn(256, 2, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    res = {}
    for engine, layer in layers.items():
        for rep in range(2):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi)
            out.backward(dout)
            got = [out, xi.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad]
            if rep:
                assert all(torch.equal(a, b) for a, b in zip(got, res[engine], strict=True)), engine
            res[engine] = [t.detach().clone() for t in got]
    for t in res["tiles"]:
        assert not torch.isnan(t).any()
    (o_t, dx_t, *w_t), (o_p, dx_p, *w_p) = res["tiles"], res["plain"]
    torch.testing.assert_close(o_t.float(), o_p.float(), **MATCH)
    torch.testing.assert_close(dx_t.float(), dx_p.float(), **MATCH)
    for a, b in zip(w_t, w_p, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < GRAD_REL


def test_a_gpu_without_the_kernels_is_refused_not_run_on_the_references(monkeypatch):
    # on a GPU the references would be a silently slow layer: one line naming why the kernels cannot run
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine import select
    from mok_megatron.experts_contract import ExpertsContract
    from tests.cases import make_config

    monkeypatch.setattr(select.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(select.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(select, "kernels_unavailable", lambda *a: "EP=2: no pull yet")
    cfg = MoKConfig.from_megatron(make_config(), ep_size=1, etp_size=1)
    with pytest.raises(MoKConfigError) as e:
        select.select_tiles(cfg, MoKOptions(engine="tiles"), ExpertsContract(mok=True))
    text = str(e.value)
    assert (
        "\n" not in text
        and "here EP=2: no pull yet" in text
        and text.endswith("--mok-engine auto on this machine.")
    )


def test_tile_streams_are_never_the_current_stream(monkeypatch):
    """torch hands out pool streams in turn, so a new one may be the stream the layer runs on: ``TileStreams``
    takes three distinct others (a pull on the waiting GEMM's own stream would never run), and the layer takes
    a new set when the stream it runs on is one of its set's."""
    from mok_megatron.engine import tiles as te

    pool = iter(["s1", "s0", "s2", "s2", "s3", "s4"])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: next(pool))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "s0")
    streams = te.TileStreams.on(torch.device("cuda", 0))
    assert (streams.side, streams.wgrad, streams.delay) == ("s1", "s2", "s3")
    assert streams.holds("s2") and not streams.holds("s0")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "s0")
    with pytest.raises(RuntimeError, match=r"^TileStreams.on: 64 streams of cuda:0 gave 0 distinct ones"):
        te.TileStreams.on(torch.device("cuda", 0))


def test_the_layer_takes_new_streams_when_it_runs_on_one_of_its_own(monkeypatch):
    from types import SimpleNamespace

    from mok_megatron.adapter.dispatcher import MoKTokenDispatcher
    from mok_megatron.engine import tiles as te

    made, current = [], {"stream": "main"}

    def on(device):
        n = len(made)
        made.append(SimpleNamespace(holds=lambda s: s == f"side{n}", n=n))
        return made[-1]

    monkeypatch.setattr(te.TileStreams, "on", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    seen = []
    monkeypatch.setattr(te, "tile_experts", lambda *a: seen.append(a[8].n))
    d = MoKTokenDispatcher.__new__(MoKTokenDispatcher)
    plan = SimpleNamespace(meta="meta", ids_TK=torch.zeros(2, 1, dtype=torch.long), tokens_per_expert_L=None)
    d.__dict__.update(_tile_streams={}, profile=None, _plan=plan)
    d.engine = SimpleNamespace(tiles=SimpleNamespace(kernels=True), pull=None)
    monkeypatch.setattr(MoKTokenDispatcher, "plan", property(lambda self: self._plan))
    experts = SimpleNamespace(fc1_weight=None, fc2_weight=None, main_grad_owners=lambda: (None, None))
    x = SimpleNamespace(device=torch.device("cuda", 0))
    probs = torch.zeros(2, 1)
    d.run_tiles(x, probs, experts)
    d.run_tiles(x, probs, experts)  # the same set
    current["stream"] = "side0"  # the layer now runs on the set's side stream: a new set
    d.run_tiles(x, probs, experts)
    assert seen == [0, 0, 1]
