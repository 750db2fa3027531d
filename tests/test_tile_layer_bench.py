"""benchmarks/tile_layer.py as documented, on CPU through the kernels' references: the tokens' routes, the pull
split into the local and the remote sources, the composed tiles forward equal to the plain forward (pulled or
preset, the combine beside fc2 or after it), the composed tiles backward equal to the plain backward (the
output gradient pulled or preset, the per-token sum beside fc1's input gradient or after it, the weight
gradients beside or after) and the plain backward equal to torch autograd of the plain forward, the link-only
pull (``copy="none"``: every row in place, the counters released, no row copied: remote rows left NaN stay
NaN), the sweep filling the rows before a link-only run and poisoning them before a copying one, skipping
the unpaced link-only rows, a forward or backward whose pull misses rows named instead of hanging, and
one-line refusals of bad arguments and of a machine without an sm_90 GPU.

Legend: P source ranks, G local experts, H hidden, F expert FFN width, M received rows, T tokens, K routes per
token, S counter slots."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import tile_layer as bench
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp

ROOT = Path(__file__).resolve().parent.parent
SMALL = tg.TileConfig(tile_m=4, tile_n=16, cluster_m=2, max_swizzle=2)
ONE = tg.TileConfig(tile_m=8, tile_n=8, cluster_m=1, max_swizzle=8)

# (c_PG, H, F, K, config, chunk_rows): rows each source sends each local expert, source 0 being this rank
CASES = {
    "three-sources": ([[3, 0, 5, 2], [2, 7, 0, 4], [6, 1, 3, 0]], 24, 16, 3, SMALL, 3),
    "nothing-local": ([[0, 0, 0], [4, 9, 2], [5, 0, 7]], 16, 8, 2, ONE, 4),
    "only-local": ([[5, 3], [0, 0]], 16, 8, 2, SMALL, 2),
    "empty-expert-chunks-across-tiles": ([[9, 0, 13], [1, 0, 6], [5, 0, 11], [2, 0, 3]], 32, 24, 4, SMALL, 5),
}


def _problem(name, dtype=torch.float32):
    c, h, f, k, cfg, chunk = CASES[name]
    c_PG = torch.tensor(c)
    plan = bench.layer_plan(c_PG, h, f, k, cfg, chunk, elem_bytes=dtype.itemsize)
    x = bench.layer_inputs(c_PG, h, f, dtype, "cpu", seed=1)
    return c_PG, plan, x


def test_strided_routes_hand_worked():
    # 10 rows, top-3: T = 4 tokens, token t reads rows t, t + 4, t + 8
    assert bench.strided_routes(10, 3).tolist() == [[0, 4, 8], [1, 5, 9], [2, 6, -1], [3, 7, -1]]
    assert bench.strided_routes(0, 2).shape == (0, 2)
    with pytest.raises(ValueError, match=r"rows=5, topk=0; rows must be >= 0 and topk >= 1"):
        bench.strided_routes(5, 0)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_splits_the_pull_into_local_and_remote_sources(name):
    c_PG, plan, _ = _problem(name)
    rows, slots = int(c_PG.sum()), plan.pull.slots
    full = tp.pull_plan(c_PG, rows, plan.pull.config, plan.pull.chunk_rows)
    live = {tuple(t) for t in full.tasks_C8.tolist() if t[tp.ROWS] > 0}
    for part, want in ((plan.local, lambda p: p == 0), (plan.pull, lambda p: p != 0)):
        tasks = part.tasks_C8.tolist()
        mine = [t for t in tasks if t[tp.ROWS] > 0]
        assert tasks[: len(mine)] == mine, "chunks that move rows first"
        assert all(t == [0, c_PG.shape[1], 0, 0, 0, 0, 0, 0] for t in tasks[len(mine) :])
        assert {tuple(t) for t in mine} == {t for t in live if want(t[tp.SOURCE])}
        assert [t[tp.DST_ROW] for t in mine] == sorted(t[tp.DST_ROW] for t in mine), "expert-major order kept"
    # the local rows' counts plus what the pull releases: what fc1 waits for
    assert plan.local_counts_S.shape == (slots,)
    assert torch.equal(plan.local_counts_S + tp.slot_releases(plan.pull), plan.fc1.targets_S)
    assert plan.remote_bytes == int(c_PG[1:].sum()) * plan.fc2.n * 4
    # every received row is read by exactly one route
    rows_read = plan.meta.row_TK[plan.meta.row_TK >= 0]
    assert sorted(rows_read.tolist()) == list(range(rows))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("combine", bench.COMBINES)
@pytest.mark.parametrize("pull", [True, False], ids=["pulled", "preset"])
def test_tiles_forward_equals_the_plain_forward(name, combine, pull):
    _, plan, x = _problem(name)
    recv = bench.received_rows(x, plan)
    want = bench.plain_forward(recv, x, plan, bench.REFERENCES)
    buf = bench.layer_buffers(x, plan)
    if pull:
        assert torch.isnan(buf.recv_MH).any() == bool(plan.remote_bytes), "remote rows start NaN"
    else:
        buf.recv_MH.copy_(recv)
    out = bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, pull=pull, combine=combine)
    # fp32: the tiles' matmuls cut the groups' by columns; the same products and sums up to the last bit
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(buf.recv_MH, recv)
    assert torch.equal(buf.counters_S, plan.fc1.targets_S)
    if combine == "beside":
        assert torch.equal(buf.done_S, plan.fc2.done_targets_S)


def test_tiles_forward_in_bf16_within_the_benchmarks_tolerance():
    _, plan, x = _problem("empty-expert-chunks-across-tiles", torch.bfloat16)
    want = bench.plain_forward(bench.received_rows(x, plan), x, plan, bench.REFERENCES)
    out = bench.tiles_forward(bench.layer_buffers(x, plan), x, plan, bench.REFERENCES, k=4)
    torch.testing.assert_close(out.float(), want.float(), **bench.MATCH)


@pytest.mark.parametrize("name", list(CASES))
def test_link_only_forward_and_backward_release_without_copying(name):
    # copy="none": the rows placed before the call (as ``ph.fill`` does) give the plain layer's results, the
    # counters reach their targets and the receive buffers are untouched; left NaN, the remote rows stay NaN
    # (nothing copied them) and the results carry NaN wherever those rows reach
    c_PG, plan, x, bx = _backward_problem(name)
    recv, dy = bench.received_rows(x, plan), bench.received_gradient(bx, plan)
    want = bench.plain_forward(recv, x, plan, bench.REFERENCES)
    want_grads = bench.plain_backward(dy, bx, x, plan, bench.REFERENCES)
    buf, bbuf = bench.layer_buffers(x, plan), bench.backward_buffers(bx, x, plan)
    buf.recv_MH.copy_(recv)
    bbuf.dy_MH.copy_(dy)
    out = bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, copy="none", combine="after")
    grads = bench.tiles_backward(bbuf, bx, x, plan, bench.REFERENCES, k=2, copy="none", combine="after")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for what, g, w in zip(
        ("dx", "dprobs", "dw1", "dw2"), grads.tensors().values(), want_grads.tensors().values(), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
    assert torch.equal(buf.recv_MH, recv) and torch.equal(bbuf.dy_MH, dy)
    assert torch.equal(buf.counters_S, plan.fc1.targets_S)
    assert torch.equal(bbuf.counters_S, plan.dgrad2.targets_S)
    # the same call with the remote rows NaN: nothing copies them in
    buf = bench.layer_buffers(x, plan)
    remote_M = bench.source_of_rows(c_PG) != 0
    out = bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, copy="none", combine="after")
    assert bool(torch.isnan(buf.recv_MH[remote_M]).all()) and not torch.isnan(buf.recv_MH[~remote_M]).any()
    assert bool(torch.isnan(out).any()) == bool(remote_M.any())
    assert torch.equal(buf.counters_S, plan.fc1.targets_S)


def test_link_only_reference_refuses_pacing_and_foreign_counters():
    _, plan, x = _problem("three-sources")
    buf = bench.layer_buffers(x, plan)
    with pytest.raises(ValueError, match=r"rate=9e\+11; the reference cannot pace: pass rate=0"):
        bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, rate=9e11, copy="none")
    with pytest.raises(
        ValueError, match=r"^pull_reference: counters \(3,\), the plan \d+ slots; pass the plan's"
    ):
        bench.REFERENCES.pull(buf.recv_MH, x, plan.pull, torch.zeros(3, dtype=torch.int32), 2, 0.0, "none")


def test_the_sweep_fills_the_rows_of_a_link_only_run_and_skips_it_unpaced(monkeypatch):
    # one phase's sweep with stand-ins for the GPU (no synchronize, a fixed time per timing): before each
    # pulled check, copy none has every row filled and the others the remote rows poisoned; copy none's
    # unpaced row is skipped, its paced ones carry copy none and link ms = remote bytes / rate
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "time_ms", lambda fn, iters, rounds: 2.0)
    state, before_pulled = {"rows": None}, []

    def run(v, k, rate, pull):
        if pull:
            before_pulled.append((v["copy"], rate, state["rows"]))
        return torch.ones(2)

    ph = bench._Phase(
        name="forward", plain_ms=1.0, variants=[dict(combine="after", copy=c) for c in ("registers", "none")],
        run=run, fill=lambda: state.update(rows="filled"), poison=lambda: state.update(rows="poisoned"),
        refuse=lambda out: None, err=lambda out: 0.0, same=torch.equal, clone=torch.clone, warm=[],
    )  # fmt: skip
    res = dict(rows=[], refused=[], skipped=[])
    a = dataclasses.make_dataclass("A", ["iters", "rounds"])(1, 1)
    watchdog = bench.CaseWatchdog(0, lambda case: "")
    bench._sweep_phase("s", a, 4, [900.0, 0.0], ph, watchdog, res, 9e8, {"registers": 0.5, "none": None})
    assert before_pulled == [
        ("registers", 900e9, "poisoned"),
        ("registers", 0.0, "poisoned"),
        ("none", 900e9, "filled"),
    ]
    pulled = [(r["copy"], r["gbps"], r["link_ms"]) for r in res["rows"] if r["kind"] == "pull"]
    assert pulled == [("registers", 900.0, 1.0), ("registers", 0.0, 0.5), ("none", 900.0, 1.0)]
    assert [r["copy"] for r in res["rows"] if r["kind"] == "preset"] == ["registers", "none"]
    none = next(r for r in res["rows"] if r["copy"] == "none" and r["kind"] == "pull")
    assert none["hidden"] == pytest.approx(0.0) and none["pull_ms"] is None  # exposed 1 ms of a 1 ms link


def test_link_only_copy_is_a_choice_and_bad_copies_are_named():
    assert bench._parse_copies("registers,none,none") == ["registers", "none"]
    with pytest.raises(ValueError, match=r"^--copy 'dma'; it must be a comma list of registers, tma, none$"):
        bench._parse_copies("dma")


def test_a_pull_that_misses_rows_names_the_slot_fc1_would_wait_on():
    _, plan, x = _problem("three-sources")
    short = dataclasses.replace(plan, pull=plan.local)  # the remote rows never arrive
    with pytest.raises(RuntimeError, match=r"waits for counter slot \d+ to reach \d+; it holds \d+"):
        bench.tiles_forward(bench.layer_buffers(x, plan), x, short, bench.REFERENCES, k=2)


def test_composition_errors_in_one_line():
    _, plan, x = _problem("three-sources")
    buf = bench.layer_buffers(x, plan)
    with pytest.raises(ValueError, match=r"combine='before'; it must be one of beside, after"):
        bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, combine="before")
    with pytest.raises(ValueError, match=r"rate=9e\+11; the reference cannot pace: pass rate=0"):
        bench.tiles_forward(buf, x, plan, bench.REFERENCES, k=2, rate=9e11)
    with pytest.raises(ValueError, match=r"concurrent kernels need a side stream"):
        bench.tiles_forward(buf, x, plan, bench.KERNELS, k=2)
    with pytest.raises(ValueError, match=r"c_PG \(4,\), local=0; c_PG must be \[P, G\]"):
        bench.layer_plan(torch.ones(4, dtype=torch.int64), 8, 8, 2, SMALL)


def _backward_problem(name, dtype=torch.float32):
    c_PG, plan, x = _problem(name, dtype)
    return c_PG, plan, x, bench.backward_inputs(c_PG, x, plan, bench.REFERENCES, seed=1)


@pytest.mark.parametrize("name", list(CASES))
def test_split_by_source_is_what_the_pull_gathers(name):
    c_PG, plan, x = _problem(name)
    parts = bench.split_by_source(bench.received_rows(x, plan), c_PG)
    assert len(parts) == len(x.sources)
    for got, want in zip(parts, x.sources, strict=True):
        assert torch.equal(got, want)


def test_route_rows_hand_worked():
    # 5 rows, top-2: T = 3 tokens; token t's routes read rows t and t + 3 (token 2's second route dropped)
    meta = bench.routing_of(torch.tensor([2, 3]), 2)
    assert meta.row_TK.tolist() == [[0, 3], [1, 4], [2, -1]]
    rows = bench.route_rows(torch.tensor([[1.0], [2.0], [3.0]]), meta)
    assert rows.flatten().tolist() == [1.0, 2.0, 3.0, 1.0, 2.0]


@pytest.mark.parametrize("name", list(CASES))
def test_plain_backward_is_autograd_of_the_plain_forward(name):
    # the forward from tokens: each token's row dispatched to its routes, the plain forward over them; the
    # gradient of the tokens' rows is the per-token sum over their routes (the dispatch's adjoint)
    c_PG, plan, x = _problem(name)
    gen = torch.Generator().manual_seed(3)
    x_TH = torch.randn(plan.meta.row_TK.shape[0], plan.fc2.n, generator=gen, requires_grad=True)
    probs = x.probs_M.clone().requires_grad_()
    w1, w2 = x.w1_G2FH.clone().requires_grad_(), x.w2_GHF.clone().requires_grad_()
    leaves = dataclasses.replace(x, probs_M=probs, w1_G2FH=w1, w2_GHF=w2)
    recv = bench.route_rows(x_TH, plan.meta)
    out = bench.plain_forward(recv, leaves, plan, bench.REFERENCES)
    dy_TH = torch.randn(out.shape, generator=gen)
    want = torch.autograd.grad(out, (x_TH, probs, w1, w2), dy_TH)

    offs = plan.fc1.cu_G1[1:]
    with torch.no_grad():
        h = bench.REFERENCES.grouped_mm(recv, x.w1_G2FH.mT, offs)
        saved = bench.BackwardInputs(
            dy_TH=dy_TH, sources=(), table_P=torch.zeros(0, dtype=torch.int64), x_MH=recv.detach(), h_M2F=h,
            a_MF=bench.REFERENCES.swiglu(h, x.probs_M),
        )  # fmt: skip
        got = bench.plain_backward(bench.route_rows(dy_TH, plan.meta), saved, x, plan, bench.REFERENCES)
    for what, g, w in zip(("dx", "dprobs", "dw1", "dw2"), got.tensors().values(), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("combine", bench.COMBINES)
@pytest.mark.parametrize("wgrad", bench.WGRADS)
@pytest.mark.parametrize("pull", [True, False], ids=["pulled", "preset"])
def test_tiles_backward_equals_the_plain_backward(name, combine, wgrad, pull):
    _, plan, x, bx = _backward_problem(name)
    dy = bench.received_gradient(bx, plan)
    assert torch.equal(dy, bench.route_rows(bx.dy_TH, plan.meta)), "the exchange delivers each route dy"
    want = bench.plain_backward(dy, bx, x, plan, bench.REFERENCES)
    buf = bench.backward_buffers(bx, x, plan)
    if pull:
        assert torch.isnan(buf.dy_MH).any() == bool(plan.remote_bytes), "remote rows start NaN"
    else:
        buf.dy_MH.copy_(dy)
    out = bench.tiles_backward(
        buf, bx, x, plan, bench.REFERENCES, k=2, pull=pull, combine=combine, wgrad=wgrad
    )
    for what, g, w in zip(
        ("dx", "dprobs", "dw1", "dw2"), out.tensors().values(), want.tensors().values(), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
    assert torch.equal(buf.dy_MH, dy)
    assert torch.equal(buf.counters_S, plan.dgrad2.targets_S)
    if combine == "beside":
        assert torch.equal(buf.done_S, plan.fc2.done_targets_S)


def test_tiles_backward_in_bf16_within_the_benchmarks_tolerance():
    _, plan, x, bx = _backward_problem("empty-expert-chunks-across-tiles", torch.bfloat16)
    want = bench.plain_backward(bench.received_gradient(bx, plan), bx, x, plan, bench.REFERENCES)
    out = bench.tiles_backward(bench.backward_buffers(bx, x, plan), bx, x, plan, bench.REFERENCES, k=4)
    assert bench.backward_errors(out, want) == [], bench.backward_errors(out, want)


def test_a_backward_pull_that_misses_rows_names_the_slot_fc2_dgrad_would_wait_on():
    _, plan, x, bx = _backward_problem("three-sources")
    short = dataclasses.replace(plan, pull=plan.local)  # the remote rows never arrive
    with pytest.raises(RuntimeError, match=r"waits for counter slot \d+ to reach \d+; it holds \d+"):
        bench.tiles_backward(bench.backward_buffers(bx, x, plan), bx, x, short, bench.REFERENCES, k=2)


def test_backward_composition_errors_in_one_line():
    _, plan, x, bx = _backward_problem("three-sources")
    buf = bench.backward_buffers(bx, x, plan)
    with pytest.raises(ValueError, match=r"combine='before'; it must be one of beside, after"):
        bench.tiles_backward(buf, bx, x, plan, bench.REFERENCES, k=2, combine="before")
    with pytest.raises(ValueError, match=r"wgrad='later'; it must be one of beside, after"):
        bench.tiles_backward(buf, bx, x, plan, bench.REFERENCES, k=2, wgrad="later")
    with pytest.raises(
        ValueError, match=r"need a side stream and, with wgrad='beside', a weight-gradient stream"
    ):
        bench.tiles_backward(buf, bx, x, plan, bench.KERNELS, k=2)


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--shapes", "gpt"],
            "tile_layer: --shapes gpt; known: deepseek-v3-ep32,deepseek-v3-ep32-16k,qwen3-ep8",
        ),
        (["--k", "0,4"], "tile_layer: --k 0,4; every K must be >= 1"),
        (["--k", "x"], "it must be a comma list of integers"),
        (["--gbps", "-1"], "tile_layer: --gbps '-1'; it must name at least one rate, every rate >= 0"),
        (["--gbps", "fast"], "tile_layer: --gbps 'fast'; it must be a comma list of GB/s"),
        (["--combine", "before"], "tile_layer: --combine 'before'; it must be a comma list of beside, after"),
        (["--phase", "fwd"], "tile_layer: --phase 'fwd'; it must be one of forward, backward, both"),
        (["--wgrad", "later"], "tile_layer: --wgrad 'later'; it must be a comma list of beside, after"),
        (["--iters", "0", "--chunk-rows", "0"], "tile_layer: --chunk-rows 0, --iters 0; each must be >= 1"),
    ],
)
def test_benchmark_refuses_bad_arguments_in_one_line(argv, says, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_an_sm90_gpu_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.tile_layer"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "tile_layer: needs an sm_90 GPU (QuACK's sm_90 kernels); none here"
    ]


def test_a_side_stream_that_is_the_current_one_is_refused(monkeypatch):
    # the pull launched on the waiting GEMM's own stream would queue behind it: refused before any launch
    _, plan, x, bx = _backward_problem("three-sources")
    current = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current)
    buf, bbuf = bench.layer_buffers(x, plan), bench.backward_buffers(bx, x, plan)
    counters = bbuf.counters_S.clone()
    with pytest.raises(
        ValueError, match=r"^tiles_forward: side is the current stream; .* pass a stream other"
    ):
        bench.tiles_forward(buf, x, plan, bench.KERNELS, k=2, side=current)
    with pytest.raises(ValueError, match=r"^tiles_backward: side is the current stream; "):
        bench.tiles_backward(bbuf, bx, x, plan, bench.KERNELS, k=2, side=current, wgrad_stream=object())
    assert torch.equal(bbuf.counters_S, counters)
