"""Case functions of tests/test_tiles_engine.py that run on every worker rank (tests/pool.py), and the GPU
case that its watchdog runs in a subprocess (``python -m tests.tiles_cases --gpu-loopback TOPK [--bytes
link]``)."""

from __future__ import annotations

import argparse


def parity_case(rank, world, loopback=None, **kw):
    """``tests.cases.parity_case`` with ``--mok-engine tiles``; also how many layer calls ran the tiles
    engine's autograd node (``calls``) and how many of its forwards and backwards pulled rows (``pulls``).
    ``loopback``: ``LoopbackLink`` fields of a loopback transport given to the layer (the rows pulled from
    its emulated peers)."""
    from mok_megatron.engine import tile_compose, tiles
    from tests import cases

    real = tiles._TileExperts.apply
    composed = {n: getattr(tile_compose, n) for n in ("tiles_forward", "tiles_backward")}
    calls, pulls = [], []

    def counted(*args):
        calls.append(1)
        return real(*args)

    def pulled(run):
        def call(*args, **kw):
            pulls.append(kw["pull"])
            return run(*args, **kw)

        return call

    tiles._TileExperts.apply = counted
    for name, run in composed.items():
        setattr(tile_compose, name, pulled(run))
    opts = dict(engine="tiles") if loopback is None else dict(engine="tiles", loopback=loopback)
    try:
        res = cases.parity_case(rank, world, opts=opts, **kw)
    finally:
        tiles._TileExperts.apply = real
        for name, run in composed.items():
            setattr(tile_compose, name, run)
    res["calls"] = len(calls)
    res["pulls"] = sum(pulls)
    return res


def gpu_loopback(topk: int, nbytes: str = "copy") -> None:
    """bf16, EP = 1, one sm_90 GPU: the tiles layer whose rows are pulled from a loopback transport emulating
    4 EP ranks at 900 GB/s, against the same layer without a transport (every row placed, nothing pulled):
    output, input gradient and every parameter's gradient bitwise, two steps each; the pull moved bytes.
    ``nbytes="link"``: the loopback's link time only, every row placed and the pull (``copy="none"``) pacing
    and releasing the waiting GEMM's counters alone; no source buffer built."""
    import torch

    from mok_megatron.bench.build import init_single_process
    from tests.cases import build_mok_only, make_config

    init_single_process()
    cfg = make_config(topk=topk, num_experts=16, hidden=512, ffn=256, params_dtype=torch.bfloat16, bf16=True)
    layers = {}
    for name, opts in (
        ("placed", dict(engine="tiles")),
        ("pulled", dict(engine="tiles", loopback=dict(ep=4, gbps=900.0, bytes=nbytes))),
    ):
        torch.manual_seed(0)
        layers[name] = build_mok_only(cfg, opts).cuda()
        layers[name].set_layer_number(1)
    layers["pulled"].load_state_dict(layers["placed"].state_dict())
    engine = layers["pulled"].token_dispatcher.engine
    assert engine.tiles.kernels and engine.pull is not None and engine.pull.pull_rate == 900e9, engine
    assert engine.pull.pull_moves_rows == (nbytes == "copy"), engine.pull
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, 2, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = {}
    for name, layer in layers.items():
        for step in range(2):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi)
            out.backward(dout)
            grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            got = {"out": out, "dx": xi.grad, **grads}
            got = {n: t.detach().clone() for n, t in got.items()}
            if step:
                assert all(torch.equal(t, res[name][n]) for n, t in got.items()), f"{name}: steps differ"
            res[name] = got
    torch.cuda.synchronize()
    moved = layers["pulled"].token_dispatcher.transport.bytes_moved
    assert moved > 0 if nbytes == "copy" else moved == 0, f"{moved} bytes of source rows with bytes={nbytes}"
    assert res["pulled"].keys() == res["placed"].keys() and "experts.fc1_weight" in res["pulled"]
    for n, t in res["pulled"].items():
        assert not torch.isnan(t).any(), f"{n} has NaN"
        assert torch.equal(t, res["placed"][n]), f"{n}: the pulled layer differs from the placed one"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu-loopback", type=int, required=True, metavar="TOPK")
    p.add_argument("--bytes", default="copy", choices=("copy", "link"))
    a = p.parse_args(argv)
    gpu_loopback(a.gpu_loopback, a.bytes)
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
