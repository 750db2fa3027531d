"""The NVLink transport (mok_megatron.transport.nvlink): segment tables, the loopback workspace of N emulated ranks
with the torch references and (under TRITON_INTERPRET=1, in a subprocess) the Triton kernels, options and
transport selection, the kernels compiled for sm_90 without a GPU; on CUDA the loopback N=2,4,8 and real
sizes, and on two GPUs the MoK layer with --mok-transport nvlink bitwise equal to the collective transport."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton
from mok_megatron.transport.nvlink.exchange import (
    all_to_all_reference,
    exchange_rows,
    pull_segments,
    push_segments,
)
from mok_megatron.transport.nvlink.workspace import LoopbackWorkspace
from tests.interpret import interpreted
from tests.nvlink_cases import check_exchanges, loopback_moe, random_matrix

REPO = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.update(MULTICAST_OFF)


def test_segments_hand_worked():
    # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 sends 3 to rank 0, 0 to itself.
    m = [[1, 2], [3, 0]]
    assert pull_segments(m, 0) == [[0, 0, 1], [0, 1, 3]]  # rank 0 reads 1 row of its own, then 3 of rank 1
    assert pull_segments(m, 1) == [[1, 0, 2], [3, 2, 0]]
    assert push_segments(m, 1) == [[0, 1, 3], [3, 2, 0]]  # rank 1's rows land after rank 0's in rank 0


@pytest.mark.parametrize("sync", ["barrier", "flags"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_loopback_references_equal_all_to_all(P, sync):
    check_exchanges(P, "cpu", use_triton=False, sync=sync)


@pytest.mark.parametrize("sync", ["barrier", "flags"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_loopback_moe_references_equal_single_rank(P, sync):
    outs, refs = loopback_moe(P, "cpu", use_triton=False, sync=sync)
    for o, r in zip(outs, refs, strict=True):
        assert torch.equal(o, r)


def test_flag_wait_names_the_late_rank_instead_of_hanging():
    """A rank whose peer never publishes: the wait gives up with an error naming that peer."""
    from mok_megatron.transport.nvlink.signals import publish_reference, wait_reference

    ws = LoopbackWorkspace(3, "cpu")
    for r in (0, 1):  # rank 2 never publishes
        publish_reference(ws.signals(r))
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not publish exchange 1"):
        wait_reference(ws.signals(0), timeout_s=0.05)
    publish_reference(ws.signals(2))
    wait_reference(ws.signals(0), timeout_s=0.05)  # now everyone has
    with pytest.raises(ValueError, match="sync='fence'"):
        check_exchanges(2, "cpu", use_triton=False, sync="fence")


class _ThreadRankWorkspace:
    """One emulated rank's view of a shared LoopbackWorkspace; ``barrier`` waits for the other threads."""

    def __init__(self, shared: LoopbackWorkspace, bar: threading.Barrier, lock: threading.Lock):
        self.shared, self.bar, self.lock, self.device = shared, bar, lock, shared.device

    def buffers(self, word, W, rows, role=None):
        have = self.shared._bufs.get((word, W, role))
        if have is not None and have.bufs[0].shape[0] >= rows:
            return have  # no synchronisation, like NVLinkWorkspace
        self.bar.wait()  # growing: collective, every rank asks for the same size
        with self.lock:
            peers = self.shared.buffers(word, W, rows, role)
        self.bar.wait()
        return peers

    def barrier(self):
        self.bar.wait()

    def signals(self, me):
        with self.lock:  # the first call creates every rank's flags: once
            return self.shared.signals(me)


@pytest.mark.parametrize("sync", ["barrier", "flags"])
@pytest.mark.parametrize("P", [2, 4])
def test_exchange_rows_per_rank_threads_equal_all_to_all(P, sync, monkeypatch):
    """The real transport's per-rank path (staging, barriers or ready flags, copy-out), ranks as threads.
    Each step uses one buffer twice in a row with different rows, and rank 0 reads slowly: a write that
    skipped its barrier (or, with flags, reused a buffer a peer may still read) would overwrite rows that
    rank has not read yet."""
    from mok_megatron.transport.nvlink import kernels as K

    shared = LoopbackWorkspace(P, "cpu")
    lock = threading.Lock()
    bar = threading.Barrier(P)
    who = threading.local()
    slow_pull = K.pull_rows_reference

    def pull_rows_reference(*args, **kw):
        if who.me == 0:  # (random_matrix leaves the pair 0 -> P-1 empty)
            time.sleep(0.02)
        return slow_pull(*args, **kw)

    monkeypatch.setattr(K, "pull_rows_reference", pull_rows_reference)
    g = torch.Generator().manual_seed(P)
    steps = []
    for i, (dtype, H) in enumerate([(torch.bfloat16, 8), (torch.float32, 3), (torch.bfloat16, 8)]):
        m = random_matrix(P, seed=i, most=4 + 20 * i)  # the last one grows the first format's buffer
        xa, xb = ([torch.randn(sum(m[s]), H, generator=g).to(dtype) for s in range(P)] for _ in range(2))
        steps.append((m, [(xa, False), (xb, False), (xa, True), (xb, True)]))
    results = [[] for _ in range(P)]
    errors = []

    def rank(me):
        who.me = me
        try:
            ws = _ThreadRankWorkspace(shared, bar, lock)
            for m, seq in steps:
                for xs, push in seq:
                    out = exchange_rows(ws, xs[me], m, me, push, 2, use_triton=False, sync=sync)
                    results[me].append(out)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    i = 0
    for m, seq in steps:
        for xs, _ in seq:
            ref = all_to_all_reference(xs, m)
            for me in range(P):
                assert torch.equal(results[me][i], ref[me]), (i, me)
            i += 1


# ---- the Triton kernels on CPU, interpreted (one subprocess: the interpreter is chosen at import) --------


_INTERPRETED = """
import json, sys, torch
from tests.nvlink_cases import check_exchanges, loopback_moe
res = {}
for P in (2, 4, 8):
    try:
        for sync in ("barrier", "flags"):
            check_exchanges(P, "cpu", use_triton=True, programs=3, most=3, sync=sync)
            outs, refs = loopback_moe(P, "cpu", use_triton=True, T=6, H=8, programs=2, sync=sync)
            assert all(torch.equal(o, r) for o, r in zip(outs, refs))
        res[P] = "ok"
    except Exception as e:
        res[P] = repr(e)
with open(sys.argv[1], "w") as f:
    json.dump(res, f)
"""
INTERPRETED_RUN = ("-c", _INTERPRETED, "{json}")


@pytest.fixture(scope="module")
def interpreted_results():
    if not have_triton():
        pytest.skip("needs Triton")
    return {int(k): v for k, v in interpreted(list(INTERPRETED_RUN)).items()}


@pytest.mark.parametrize("P", [2, 4, 8])
def test_triton_interpreted_loopback_equals_reference(P, interpreted_results):
    assert interpreted_results[P] == "ok", interpreted_results[P]


@pytest.mark.skipif(
    not have_triton() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"
)
@pytest.mark.parametrize("aligned", [True, False])
def test_rows_kernel_compiles_for_sm90_and_vectorizes_when_aligned(aligned):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_megatron.transport.nvlink.kernels import _rows_kernel as fn

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    for push, wait in ((False, False), (True, False), (False, True)):
        constexprs = dict(PUSH=push, ALIGNED=aligned, ELEM=8, BLOCK_R=2, BLOCK_W=1024)
        constexprs.update(SPIN_LIMIT=1 << 26, TRAP=True, WAIT=wait)
        ptrs = dict(local_ptr="*i64", table_ptr="*i64", seg_ptr="*i64", flags_ptr="*i64", epoch_ptr="*i64")
        sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
        div16 = [["tt.divisibility", 16]]  # what a launch specialises: 16-byte pointers, W % 16 == 0
        names = ("local_ptr", "table_ptr", "seg_ptr", "flags_ptr", "epoch_ptr", "W")
        attrs = {(fn.arg_names.index(n),): div16 for n in names}
        ptx = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
        ).asm["ptx"]
        # The local side is always vectorized (16-byte loads/stores); the peer side (the load of a
        # pull, the store of a push) only with the alignment hint.
        peer_vec = "ld.global.v2.b64" if not push else "st.global.v2.b64"
        local_vec = "st.global.v2.b64" if not push else "ld.global.v2.b64"
        assert local_vec in ptx, (push, aligned)
        assert (peer_vec in ptx) == aligned, (push, aligned)
        # waiting on a peer's flag: a system-scope acquire poll, and a trap instead of a hang
        assert ("ld.global.sys.acquire" in ptx and "trap;" in ptx) == wait, (push, wait)


@pytest.mark.skipif(
    not have_triton() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"
)
def test_signal_kernels_compile_for_sm90_with_system_scope_ordering():
    """publish: a system-scope release exchange into each peer's flag word; wait: system-scope acquire
    polls (Triton turns the atomic add of 0 into an acquire load) and a trap instead of a hang."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_megatron.transport.nvlink import signals as S

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")

    def ptx(fn, constexprs):
        sig = {
            n: "constexpr" if n in constexprs else ("*i64" if n.endswith("_ptr") else "i32")
            for n in fn.arg_names
        }
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    pub = ptx(S._publish_kernel, {})
    assert "atom.global.sys.release.exch.b64" in pub
    wt = ptx(S._wait_kernel, dict(SPIN_LIMIT=1 << 26, TRAP=True))
    assert "ld.global.sys.acquire.b64" in wt and "trap;" in wt


# ---- options and selection ---------------------------------------------------------------------------------


def test_options_and_flags_accept_nvlink():
    import argparse

    from mok_megatron.training.arguments import add_mok_flags, options_from_args
    from mok_megatron.options import MoKOptions, MoKOptionsError

    assert MoKOptions(transport="nvlink", nvlink_programs=16).nvlink_programs == 16
    with pytest.raises(MoKOptionsError, match="nvlink-programs=0"):
        MoKOptions(nvlink_programs=0)
    with pytest.raises(MoKOptionsError, match="nvlink-sync='fence'.*barrier, flags"):
        MoKOptions(nvlink_sync="fence")
    p = argparse.ArgumentParser()
    add_mok_flags(p)
    argv = ["--mok-transport", "nvlink", "--mok-nvlink-programs", "24", "--mok-nvlink-sync", "flags"]
    opts = options_from_args(p.parse_args(argv))
    assert (opts.transport, opts.nvlink_programs, opts.nvlink_sync) == ("nvlink", 24, "flags")
    assert opts.nvlink_programs_backward is None
    opts = options_from_args(p.parse_args([*argv, "--mok-nvlink-programs-backward", "8"]))
    assert (opts.nvlink_programs, opts.nvlink_programs_backward) == (24, 8)
    with pytest.raises(MoKOptionsError, match="nvlink-programs-backward=0"):
        MoKOptions(nvlink_programs_backward=0)
    assert MoKOptions().transport == "auto"


def test_backward_moves_take_the_backward_cta_budget(monkeypatch):
    """The pipeline's gradient moves ask for the backward budget (``backward=True``); the NVLink
    transport launches its kernels with --mok-nvlink-programs there and --mok-nvlink-programs-backward
    here, the same count for both when it is not given."""
    from mok_megatron.engine import pipeline
    from mok_megatron.transport.base import COMBINE, DISPATCH
    from mok_megatron.transport.nvlink import transport as NT

    launched = []
    monkeypatch.setattr(NT, "workspace", lambda group, device: None)
    monkeypatch.setattr(
        NT, "exchange_rows", lambda ws, x, m, me, push, programs, **kw: launched.append(programs) or x
    )

    class _Plan:
        capacity, split_matrix = 2, [[1, 1], [1, 1]]

    x = torch.zeros(4, 2)
    for backward_budget, want in ((8, [32, 8]), (None, [32, 32])):
        t = NT.NVLinkTransport(None, 32, "barrier", backward_budget)
        t.ep = 2  # as a rank of an EP=2 group (no process group here: the launch is recorded, not run)
        launched.clear()
        t.move(x, _Plan(), DISPATCH)
        t.move(x, _Plan(), COMBINE, backward=True)
        assert launched == want
    # the pipeline's autograd node moves the gradient with backward=True
    seen = []

    class _Recorder:
        def move(self, g, mb, direction, backward=False):
            seen.append((direction, backward))
            return g

    src = torch.zeros(3, 2, requires_grad=True)
    out = pipeline._Arrived.apply(src, torch.zeros(3, 2), _Recorder(), None, DISPATCH)
    out.sum().backward()
    assert seen == [(COMBINE, True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nvlink_without_cuda_is_a_config_error():
    from mok_megatron.config import MoKConfigError
    from mok_megatron.transport.nvlink.workspace import check_nvlink_group

    with pytest.raises(MoKConfigError, match="collective"):
        check_nvlink_group(None)


# ---- on the GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sync", ["barrier", "flags"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_loopback_on_gpu_equals_reference(P, sync):
    check_exchanges(P, "cuda", use_triton=True, programs=5, most=300, sync=sync)
    outs, refs = loopback_moe(P, "cuda", use_triton=True, T=512, H=256, programs=8, sync=sync)
    for o, r in zip(outs, refs, strict=True):
        assert torch.equal(o, r)


@pytest.mark.gpu
@needs_cuda
def test_flags_make_a_running_pull_wait_for_a_late_peer():
    """The flags on real hardware, not just in program order: rank 0's pull kernel is already running on one
    stream when rank 1, on another stream, sleeps, then stages its rows and publishes. The pull must spin
    until then and read the rows rank 1 staged after the kernel started (acquire/release across streams).
    Round 0 runs rank 1 first and loads every kernel: a spinning kernel blocks CUDA's lazy module loading in
    its process (``transport.nvlink.signals``), so a first launch on the late stream would wait for the spin forever."""
    from mok_megatron.transport.nvlink import kernels as K
    from mok_megatron.transport.nvlink.exchange import _segment_table, buffer_rows
    from mok_megatron.transport.nvlink.signals import publish

    P, H = 2, 7168
    m = [[300, 500], [700, 200]]
    ws = LoopbackWorkspace(P, "cuda")
    word = K.word_dtype(H * 2)
    peers = ws.buffers(word, H * 2 // word.itemsize, buffer_rows(m), "test")
    seg = _segment_table(m, 0, False, "cuda")
    late, puller = torch.cuda.Stream(), torch.cuda.Stream()
    s0, s1 = ws.signals(0), ws.signals(1)

    def rank0(xs, out):
        with torch.cuda.stream(puller):
            peers.bufs[0][: xs[0].shape[0]].copy_(K.as_words(xs[0], word))
            publish(s0)
            K.pull_rows(K.as_words(out, word), peers, seg, programs=8, signals=s0)

    def rank1(xs):
        with torch.cuda.stream(late):
            torch.cuda._sleep(50_000_000)  # ~25 ms: rank 0's pull is spinning by then
            peers.bufs[1][: xs[1].shape[0]].copy_(K.as_words(xs[1], word))
            publish(s1)

    for rnd in range(3):
        xs = [torch.randn(sum(m[s]), H, device="cuda").bfloat16() for s in range(P)]
        out = torch.empty(sum(m[s][0] for s in range(P)), H, device="cuda", dtype=torch.bfloat16)
        for b in peers.bufs:
            b.fill_(-1)  # stale rows (NaN): what a pull that did not wait would read
        torch.cuda.synchronize()
        if rnd == 0:
            rank1(xs)
            rank0(xs, out)
        else:
            rank0(xs, out)
            rank1(xs)
        torch.cuda.synchronize()
        assert torch.equal(out, all_to_all_reference(xs, m)[0]), rnd
        assert s0.flags.bufs[0].tolist() == [rnd + 1, rnd + 1]


@pytest.mark.gpu
@needs_cuda
def test_loopback_on_gpu_real_rows():
    """DeepSeek-V3 rows (H 7168 bf16) and the routing metadata rows (fp32, 2L wide), 8 emulated ranks."""
    P = 8
    ws = LoopbackWorkspace(P, "cuda")
    from mok_megatron.transport.nvlink.exchange import loopback_exchange

    for dtype, H in ((torch.bfloat16, 7168), (torch.float32, 32)):
        m = random_matrix(P, seed=H, most=700)
        xs = [torch.randn(sum(m[s]), H, device="cuda").to(dtype) for s in range(P)]
        ref = all_to_all_reference(xs, m)
        for push in (False, True):
            outs = loopback_exchange(ws, xs, m, push, programs=64)
            assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True)), (dtype, push)


def _no_host_sync(layer, x, dout):
    """True when a forward + backward runs with no device-to-host synchronisation, else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = layer(x.clone().requires_grad_())
        out.backward(dout)
        return True
    except Exception as e:
        return repr(e)[:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def _nvlink_worker(rank, port, out_path):
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **MULTICAST_OFF)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mok_megatron.bench.build import layer_config, build
    from mok_megatron.options import MoKOptions
    from tests.test_gpu import _run_both

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(7)
    dtype = torch.bfloat16
    cfg = layer_config(dict(hidden=512, ffn=256, experts=16, topk=4, tokens=2048), dtype)
    cfg.expert_model_parallel_size = 2
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2048, 1, 512, generator=g).to("cuda", dtype)
    dout = torch.randn(2048, 1, 512, generator=g).to("cuda", dtype)
    report = {}
    for name, extra in {
        "exact-3": dict(minibatch_size=700),
        "syncfree-2": dict(minibatch_size=1024, sync_free=True),
        "flags-exact-3": dict(minibatch_size=700, nvlink_sync="flags"),
        "flags-syncfree-2": dict(minibatch_size=1024, sync_free=True, nvlink_sync="flags"),
    }.items():
        torch.manual_seed(0)
        coll = build("mok", cfg, options=MoKOptions(transport="collective", **extra)).cuda()
        nvl = build(
            "mok",
            cfg,
            options=MoKOptions(transport="nvlink", nvlink_programs=16, **extra),
        ).cuda()
        nvl.load_state_dict(coll.state_dict())
        (o1, d1, g1), (o2, d2, g2) = _run_both(coll, nvl, x, dout)
        (o3, d3, g3), _ = _run_both(nvl, nvl, x, dout)  # again: the workspace is reused
        report[name] = {
            "transport": type(nvl.token_dispatcher.transport).__name__,
            "bitwise": bool(
                torch.equal(o1, o2) and torch.equal(d1, d2) and all(torch.equal(g1[k], g2[k]) for k in g1)
            ),
            "repeat_bitwise": bool(torch.equal(o2, o3) and torch.equal(d2, d3)),
            "max_abs_out": (o1 - o2).abs().max().item(),
        }
        with open(f"{out_path}.{rank}", "w") as f:  # the bitwise evidence first
            json.dump(report, f)
        if extra.get("sync_free"):  # warm now: the nvlink transport adds no host sync to the layer
            report[name]["no_host_sync"] = {
                "collective": _no_host_sync(coll, x, dout),
                "nvlink": _no_host_sync(nvl, x, dout),
            }
    from mok_megatron.transport.nvlink.workspace import close_all

    close_all()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nvlink_layer_bitwise_equals_collective_ep2(tmp_path):
    import torch.multiprocessing as mp

    from tests.pool import free_port

    out = str(tmp_path / "nvl")
    mp.spawn(_nvlink_worker, args=(free_port(), out), nprocs=2, join=True)
    for rank in (0, 1):
        report = json.loads(open(f"{out}.{rank}").read())
        for name, entry in report.items():
            assert entry["transport"] == "NVLinkTransport", (rank, name, entry)
            assert entry["bitwise"] and entry["repeat_bitwise"], (rank, name, entry)
            sync = entry.get("no_host_sync")
            if sync is not None and sync["collective"] is True:
                assert sync["nvlink"] is True, (rank, name, sync)


class _FakeDist:
    """torch.distributed as check_nvlink_group sees it: every rank's (host, GPU) given."""

    def __init__(self, ranks, backend="nccl", peer_ok=True):
        self.ranks, self.backend, self.peer_ok = ranks, backend, peer_ok

    def is_initialized(self):
        return True

    def get_backend(self, group):
        return self.backend

    def get_world_size(self, group):
        return len(self.ranks)

    def all_gather_object(self, out, obj, group=None):
        if isinstance(obj[0], str):  # (host, device)
            out[:] = self.ranks
        else:  # (device, unreachable devices)
            out[:] = [
                (d, [] if self.peer_ok else [x for _, x in self.ranks if x != d]) for _, d in self.ranks
            ]


@pytest.mark.parametrize(
    "fake,match",
    [
        (_FakeDist([("a", 0), ("a", 1)], backend="gloo"), "NCCL EP group; this one is 'gloo'"),
        (_FakeDist([("a", 0), ("b", 0)]), r"spans 2 hosts \(a, b\)"),
        (_FakeDist([("a", 0), ("a", 1)], peer_ok=False), "GPU 0 cannot reach GPU\\(s\\) \\[1\\]"),
    ],
)
def test_nvlink_group_checks_name_the_problem_and_the_fix(monkeypatch, fake, match):
    from mok_megatron.config import MoKConfigError
    from mok_megatron.transport.nvlink import workspace as W

    monkeypatch.setattr(W, "dist", fake)
    monkeypatch.setattr(W, "group_size", lambda g: len(fake.ranks))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: fake.peer_ok)
    with pytest.raises(MoKConfigError, match=match) as e:
        W.check_nvlink_group(object())
    assert "--mok-transport collective" in str(e.value)


def test_nvlink_group_check_passes_one_host_with_peer_access(monkeypatch):
    from mok_megatron.transport.nvlink import workspace as W

    fake = _FakeDist([("a", 0), ("a", 1)])
    monkeypatch.setattr(W, "dist", fake)
    monkeypatch.setattr(W, "group_size", lambda g: 2)
    monkeypatch.setenv("MOK_NVLINK_DOMAIN", "a")  # this rank's domain name (else the host name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    W.check_nvlink_group(object())


@pytest.mark.parametrize(
    "ep,topk,opts,sync",
    [
        (2, 2, dict(minibatch_size=11), "barrier"),  # 3 minibatches, exact splits
        (4, 4, dict(minibatch_size=16, sync_free=True), "barrier"),  # fixed capacities
        (2, 2, dict(minibatch_size=11), "flags"),
        (4, 4, dict(minibatch_size=16, sync_free=True, local_rows="overlap"), "flags"),
    ],
)
def test_nvlink_transport_in_the_pipeline_bitwise_equals_collective(pool, ep, topk, opts, sync):
    """NVLinkTransport's dispatch (pull) and combine (push), forward and backward, inside the real
    pipeline across gloo ranks (peer buffers in shared memory, torch references for the kernels), with
    the barrier or with per-peer ready flags (then two buffers per format and direction, and every rank's
    flag words end at the same epoch: every exchange published to every peer)."""
    for r in pool.run("tests.nvlink_cases:nvlink_layer_case", ep=ep, topk=topk, opts=opts, sync=sync):
        assert r["nonzero"] and r["bitwise"] and r["repeat"], r
        # token rows and routing rows, each per direction (with flags: two of each, used alternately)
        assert r["buffers"] == (4 if sync == "barrier" else 8), r
        if sync == "flags":
            assert r["epoch"] > 0 and r["flags"] == [r["epoch"]] * ep, r


@pytest.mark.parametrize(
    "names,opts",
    [
        (["a", "a", "b", "b"], dict(minibatch_size=16)),  # two domains of two
        (["a", "a", "a", "b"], dict(minibatch_size=11, sync_free=True)),  # uneven, fixed capacities
        (["a", "a", "b", "b"], dict(minibatch_size=11, sync="flags")),  # per-peer flags inside domains
        (["a", "b", "c", "d"], dict(local_rows="overlap")),  # every rank alone: all through the collective
    ],
)
def test_hierarchical_transport_bitwise_equals_collective(pool, names, opts):
    """An EP group across NVLink domains (--mok-transport nvlink over hosts): rows inside a domain move on
    the NVLink workspace (shared memory across the gloo ranks here), the others through the collective;
    the layer's output and every gradient equal the collective transport's bitwise, forward and backward."""
    opts = dict(opts)
    sync = opts.pop("sync", "barrier")
    runs = pool.run("tests.nvlink_cases:hierarchical_layer_case", names=names, opts=opts, sync=sync)
    for rank, r in enumerate(runs):
        assert r["nonzero"] and r["bitwise"], (rank, r)
        assert r["domains"] == len(set(names)) and r["domain"] == [
            i for i, n in enumerate(names) if n == names[rank]
        ]
        assert r["workspaces"] == (1 if names.count(names[rank]) > 1 else 0), (rank, r)


def test_nvlink_transport_choice_follows_the_domains(monkeypatch):
    """--mok-transport nvlink: one domain -> NVLinkTransport; several -> HierarchicalTransport; the domain
    name is the host name unless MOK_NVLINK_DOMAIN is set."""
    from mok_megatron.transport.nvlink import domains as D
    from mok_megatron.transport.nvlink import hierarchical as HT

    monkeypatch.setenv(D.DOMAIN_ENV, "rack7")
    assert D.node_name() == "rack7"
    monkeypatch.delenv(D.DOMAIN_ENV)
    import socket

    assert D.node_name() == socket.gethostname()
    made = []
    monkeypatch.setattr(HT.NT, "NVLinkTransport", lambda g, p, s, pb: made.append(("flat", p)) or "flat")
    monkeypatch.setattr(HT, "HierarchicalTransport", lambda g, p, n, s, pb: made.append(("hier", n)) or "hier")
    monkeypatch.setattr(HT, "domains_of", lambda g: ["h0", "h0"])
    assert HT.nvlink_transport(None, 8) == "flat"
    monkeypatch.setattr(HT, "domains_of", lambda g: ["h0", "h1"])
    assert HT.nvlink_transport(None, 8) == "hier"
    assert made == [("flat", 8), ("hier", ["h0", "h1"])]


def test_hierarchical_transport_without_domain_groups_says_how(monkeypatch):
    """An EP group across domains whose domain groups were not created on every rank: a clear error naming
    the call that creates them (torch requires every rank to take part in every group creation)."""
    from mok_megatron.config import MoKConfigError
    from mok_megatron.transport.nvlink import domains as D

    monkeypatch.setattr(D.dist, "get_process_group_ranks", lambda g: [5, 6, 7, 8])
    with pytest.raises(
        MoKConfigError, match=r"EP group \[5, 6, 7, 8\] spans NVLink domains.*init_nvlink_domains"
    ):
        D.domain_group(object())
