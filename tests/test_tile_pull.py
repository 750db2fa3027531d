"""kernels.tile_pull: the pull plan as pure functions (hand-worked and against brute force: layouts, expert-major
order, chunks across counter slots, empty experts and sources, releases equal to the GEMM's targets, counters
kept across steps); the reference feeding tile_gemm's tile-by-tile reference; the errors; the register budget
of the blocks in flight; the Triton kernel against the reference under the interpreter at every tuning of
``tile_pull_cases.TUNINGS`` (atomics with ``sem`` included: the interpreter runs them); compiled for sm_90
without a GPU: vector copies, the barrier before the release, the pipelined loads ahead of the stores, no
spills at the largest tunings the budget allows; the TMA copy (``copy="tma"``: bulk tensor copies, the bulk
stores' completion wait and the async-proxy fence before the barrier and the release), its budget and its
refusal of rows not a multiple of 16 bytes; the link-only path (``copy="none"``: interpreted, the receive
buffer untouched bit for bit, NaN rows included, and the counters at their targets; compiled, no row loaded or
stored but the barrier before the release and the pacing kept; no budget); the benchmark's arguments and
tuning combinations; and on an sm_90 GPU the kernel alone (several tunings), paced at the link time (every
copy path), then beside the waiting GEMM launched first, with and without random per-chunk delays, and the
link-only pull paced beside it (marked gpu; a watchdog subprocess turns a hang into a failure); on any CUDA
GPU the kernel reading its sources through symmetric-memory peer addresses (a single-rank NCCL group,
multicast off)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp
from tests.interpret import interpreted
from tests.tile_pull_cases import CPU_RUNS, GPU_CONCURRENT, ONE, SMALL, sources_for
from tests.harness.gpu import needs_sm90_quack
from tests.harness.gpu import watched as _watched

REPO = Path(__file__).resolve().parent.parent


def _c(rows):
    return torch.tensor(rows, dtype=torch.int64)


# ---- layouts and the plan, hand-worked ---------------------------------------------------------------------


def test_hand_worked_plan():
    # two sources, three experts: source 0 sends 3 rows of expert 0 and 5 of expert 2, source 1 sends 2 of
    # expert 0 and 7 of expert 1; chunks of 3 rows; tiles of 4 rows in clusters of 2 (slots: expert 0 -> 0,
    # 1; expert 1 -> 2, 3; expert 2 -> 4, 5)
    c = _c([[3, 0, 5], [2, 7, 0]])
    assert tp.receive_rows(c).tolist() == [[0, 5, 12], [3, 5, 17]]  # empty segments: where they would start
    assert tp.source_rows(c).tolist() == [[0, 3, 3], [0, 2, 9]]
    assert tp.source_rows(c, torch.tensor([10, 4])).tolist() == [[10, 13, 13], [4, 6, 13]]
    plan = tp.pull_plan(c, 20, SMALL, chunk_rows=3)
    assert plan.offs_G.tolist() == [5, 12, 17] and plan.slots == 10 and plan.sources == 2
    # (source, expert, source row, receive row, rows, first slot, its row within that slot's tile, 0)
    assert (
        plan.tasks_C8.tolist()
        == [
            [0, 0, 0, 0, 3, 0, 0, 0],
            [1, 0, 0, 3, 2, 0, 3, 0],  # rows 3, 4: one in slot 0, one in slot 1
            [1, 1, 2, 5, 3, 2, 0, 0],
            [1, 1, 5, 8, 3, 2, 3, 0],  # rows 8-10 of expert 1 (its rows 3-5): slot 2 then 3
            [1, 1, 8, 11, 1, 3, 2, 0],
            [0, 2, 3, 12, 3, 4, 0, 0],
            [0, 2, 6, 15, 2, 4, 3, 0],
        ]
        + [[0, 3, 0, 0, 0, 0, 0, 0]] * 5
    )  # 20 // 3 + 2 * 3 = 12 rows; past the last chunk: expert G, 0 rows
    assert tp.slot_releases(plan).tolist() == [4, 1, 4, 3, 4, 1, 0, 0, 0, 0]
    assert plan.tasks_C8.dtype == torch.int32 and plan.tasks_C8.is_contiguous()


def _random_counts(p, g, seed, zero_frac=0.3, most=23):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randint(0, most, (p, g), generator=gen)
    return torch.where(torch.rand(p, g, generator=gen) < zero_frac, 0, c)


COUNTS = [
    _c([[3, 0, 5], [2, 7, 0]]),
    _c([[0, 0, 0], [4, 0, 9], [0, 0, 0]]),  # empty sources, an empty expert
    _c([[0, 0], [0, 0]]),  # nothing at all
    torch.zeros(0, 3, dtype=torch.int64),  # no source
    _c([[40]]),  # one source, one expert
    _random_counts(5, 7, seed=1),
    _random_counts(8, 3, seed=2, zero_frac=0.0, most=70),
]


@pytest.mark.parametrize("c", COUNTS, ids=[f"counts{i}" for i in range(len(COUNTS))])
@pytest.mark.parametrize("chunk_rows", [1, 3, 4, 16, 1000])
@pytest.mark.parametrize("cfg", [SMALL, ONE], ids=["tile4-cluster2", "tile8-cluster1"])
def test_plan_covers_every_row_once_expert_major(c, chunk_rows, cfg):
    p_, g_ = c.shape
    rows = int(c.sum()) + 3
    src0 = torch.arange(p_) * 5
    plan = tp.pull_plan(c, rows, cfg, chunk_rows, src_row0_P=src0)
    tasks = plan.tasks_C8.tolist()
    assert len(tasks) == tp.chunk_capacity(rows, p_, g_, chunk_rows)
    live = [t for t in tasks if t[tp.ROWS] > 0]
    assert tasks[: len(live)] == live, "chunks that move rows come first"
    assert all(t == [0, g_, 0, 0, 0, 0, 0, 0] for t in tasks[len(live) :])
    assert all(t[tp.ROWS] <= chunk_rows for t in live)
    # expert-major, by source within an expert, each segment front to back
    assert [(t[1], t[0], t[2]) for t in live] == sorted((t[1], t[0], t[2]) for t in live)
    # brute force: every (source, source row) -> receive row, once
    want, row = {}, 0
    for g in range(g_):
        for p in range(p_):
            first = int(src0[p]) + int(c[p, :g].sum())
            for i in range(int(c[p, g])):
                want[(p, first + i)] = row
                row += 1
    got = {}
    for p, _, s0, d0, n, _, _, _ in live:
        for i in range(n):
            assert (p, s0 + i) not in got
            got[(p, s0 + i)] = d0 + i
    assert got == want
    # each chunk's first slot and place: the GEMM's row_slots of its first row
    slot_M = tg.row_slots(plan.offs_G, rows, cfg)
    starts = (plan.offs_G.long() - c.sum(0)).tolist()
    for _, g, _, d0, _, slot, at, _ in live:
        assert slot == int(slot_M[d0]) and at == (d0 - starts[g]) % cfg.tile_m
    # what the whole pull adds is what the GEMM waits for
    assert torch.equal(tp.slot_releases(plan), tg.counter_targets(plan.offs_G, rows, cfg))


def test_plan_is_sync_free_shapes_on_meta():
    c = torch.empty(32, 8, dtype=torch.int64, device="meta")
    plan = tp.pull_plan(c, 40_000, tg.DEEPSEEK, 64, src_row0_P=torch.empty(32, device="meta"))
    assert plan.tasks_C8.shape == (tp.chunk_capacity(40_000, 32, 8, 64), 8)
    assert plan.offs_G.shape == (8,) and plan.slots == tg.slot_capacity(40_000, 8, tg.DEEPSEEK)


# ---- the reference feeds the waiting GEMM's reference ------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [2, 5, 64])
def test_reference_pull_then_tile_gemm_reference(chunk_rows):
    c = _random_counts(4, 5, seed=3)
    rows, k, n = int(c.sum()) + 2, 12, 40
    plan = tp.pull_plan(c, rows, SMALL, chunk_rows)
    bufs = sources_for(c, k, torch.float32, "cpu")
    recv = torch.zeros(rows, k)
    counters = torch.zeros(plan.slots, dtype=torch.int32)
    tp.pull_reference(recv, bufs, plan, counters)
    gemm = tg.tile_plan(plan.offs_G, rows, n, SMALL)
    b = torch.randn(5, k, n, generator=torch.Generator().manual_seed(0))
    out = tg.tile_gemm_reference(recv, b, plan.offs_G, gemm, counters)
    # the received rows: expert by expert, each expert's rows source by source
    want_rows = torch.cat(
        [bufs[p][int(c[p, :g].sum()) : int(c[p, : g + 1].sum())] for g in range(5) for p in range(4)]
    )
    assert torch.equal(recv[: int(c.sum())], want_rows)
    want = tg.grouped_mm_reference(want_rows, b, plan.offs_G)
    torch.testing.assert_close(out[: int(c.sum())], want, rtol=1e-5, atol=1e-5)  # tiles: other sum order


def test_counters_kept_across_steps():
    # two steps of different counts into the same counters: the second GEMM plan, shifted by the counters'
    # value before its pull, waits for exactly the second pull's rows
    c1, c2 = _c([[5, 3], [2, 6]]), _c([[0, 9], [7, 1]])
    rows = 20
    counters = torch.zeros(tg.slot_capacity(rows, 2, SMALL), dtype=torch.int32)
    for c in (c1, c2):
        plan = tp.pull_plan(c, rows, SMALL, 3)
        gemm = tg.tile_plan(plan.offs_G, rows, 16, SMALL).shifted(counters.clone())
        recv = torch.zeros(rows, 8)
        before = counters.clone()
        tp.pull_reference(recv, sources_for(c, 8, torch.float32, "cpu"), plan, counters)
        assert torch.equal(counters - before, gemm.targets_S - torch.where(gemm.targets_S > 0, before, 0))
        real = gemm.targets_S > 0
        assert torch.equal(counters[real], gemm.targets_S[real])
        a, b = recv, torch.randn(2, 8, 16)
        tg.tile_gemm_reference(a, b, plan.offs_G, gemm, counters)  # raises if a tile would wait


# ---- errors ------------------------------------------------------------------------------------------------


def _small():
    c = _c([[3, 0, 5], [2, 7, 0]])
    plan = tp.pull_plan(c, 20, SMALL, 3)
    bufs = sources_for(c, 8, torch.bfloat16, "cpu")
    recv = torch.zeros(20, 8, dtype=torch.bfloat16)
    return plan, bufs, recv, torch.zeros(plan.slots, dtype=torch.int32)


def test_plan_errors_name_the_value_and_fix():
    with pytest.raises(ValueError, match=r"c_PG is torch.float32 \(2, 3\); it must be an integer \[P, G\]"):
        tp.pull_plan(torch.zeros(2, 3), 20, SMALL, 3)
    with pytest.raises(ValueError, match=r"c_PG is torch.int64 \(6,\); it must be an integer \[P, G\]"):
        tp.pull_plan(torch.zeros(6, dtype=torch.int64), 20, SMALL, 3)
    with pytest.raises(ValueError, match=r"chunk_rows=0; it must be >= 1"):
        tp.pull_plan(_c([[1]]), 20, SMALL, 0)
    with pytest.raises(
        ValueError, match=r"src_row0_P has shape \(3,\); it must be \(2,\), one first row per"
    ):
        tp.pull_plan(_c([[1], [2]]), 20, SMALL, 4, src_row0_P=torch.zeros(3))


def test_op_errors_name_the_value_and_fix():
    plan, bufs, recv, counters = _small()
    table = tp.source_table(bufs)
    with pytest.raises(ValueError, match=r"programs=0; it must be >= 1 \(K, the SMs that pull\)"):
        tp.tile_pull(recv, table, plan, counters, programs=0)
    with pytest.raises(ValueError, match=r"rate=-1.0; it must be >= 0 bytes/s"):
        tp.tile_pull(recv, table, plan, counters, programs=2, rate=-1.0)
    with pytest.raises(ValueError, match=r"recv has shape \(19, 8\), the plan 20 rows; .* must be \[20, H\]"):
        tp.tile_pull(recv[:19], table, plan, counters, programs=2)
    wide = torch.zeros(20, 16, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"recv has strides \(16, 2\); its rows must be contiguous and packed"
    ):
        tp.tile_pull(wide[:, ::2], table, plan, counters, programs=2)
    with pytest.raises(
        ValueError, match=r"recv has strides \(16, 1\); its rows must be contiguous and packed"
    ):
        tp.pull_reference(wide[:, :8], bufs, plan, counters)
    with pytest.raises(ValueError, match=r"counters are torch.int64 \(10,\); they must be int32 \(10,\)"):
        tp.tile_pull(recv, table, plan, counters.long(), programs=2)
    with pytest.raises(ValueError, match=r"counters are torch.int32 \(9,\); they must be int32 \(10,\)"):
        tp.pull_reference(recv, bufs, plan, counters[:9])
    with pytest.raises(ValueError, match=r"3 sources for a plan of 2; pass one per source rank"):
        tp.pull_reference(recv, bufs + bufs[:1], plan, counters)
    with pytest.raises(ValueError, match=r"table is torch.int32 \(2,\) on cpu; it must be int64 \[P\]"):
        tp.tile_pull(recv, table.int(), plan, counters, programs=2)
    with pytest.raises(
        ValueError, match=r"rate=9e\+11, delays none on cpu .* pass rate=0 and no delays on CPU"
    ):
        tp.tile_pull(recv, table, plan, counters, programs=2, rate=9e11)
    with pytest.raises(ValueError, match=r"delays are torch.int32 \(12,\); they must be int64 \(12,\)"):
        tp.tile_pull(recv, table, plan, counters, programs=2, delays_C=torch.zeros(12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sources \[1\] start at addresses not a multiple of 16 bytes"):
        tp.source_table([bufs[0], bufs[1].view(-1)[1:]])
    with pytest.raises(ValueError, match=r"no sources; pass one buffer per source rank"):
        tp.source_table([])


# ---- the Triton kernel on CPU, interpreted (one subprocess: the interpreter is chosen at import) ----------

INTERPRETED_RUN = ("-m", "tests.tile_pull_cases", "--json", "{json}")


@pytest.fixture(scope="module")
def interpreted_results():
    if not have_triton():
        pytest.skip("needs Triton")
    return interpreted(list(INTERPRETED_RUN))


@pytest.mark.parametrize("name", list(CPU_RUNS))
def test_triton_interpreted_pull_equals_reference(name, interpreted_results):
    assert interpreted_results[name] == "ok", interpreted_results[name]


# ---- the kernel compiles for sm_90 without a GPU ----------------------------------------------------------

needs_ptxas = pytest.mark.skipif(
    not have_triton() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"
)


def _ptxas() -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not path.exists():
        pytest.skip("this Triton has no bundled ptxas")
    return path


def _compile_sm90(aligned=True, paced=False, num_warps=4, **constexprs) -> str:
    """The kernel's PTX for sm_90 with every pointer and W 16-byte aligned as a launch specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _ptxas()
    fn = tp._pull_kernel
    constexprs = dict(
        dict(
            TILE_M=128,
            ELEM=8,
            ALIGNED=aligned,
            PACE=paced,
            DELAY=paced,
            BLOCK_R=2,
            BLOCK_W=1024,
            STAGES=1,
            MOVE=True,
            TMA=False,
            FENCE=False,
        ),  # fmt: skip
        **constexprs,
    )
    ptrs = dict(recv_ptr="*i64", table_ptr="*i64", tasks_ptr="*i32", counters_ptr="*i32", delays_ptr="*i64")
    sig = {
        n: "constexpr" if n in constexprs else ptrs.get(n, "fp32" if n == "ns_per_byte" else "i32")
        for n in fn.arg_names
    }
    div16 = [["tt.divisibility", 16]]  # what a launch specialises: 16-byte pointers, W % 16 == 0
    names = ("recv_ptr", "table_ptr", "tasks_ptr", "counters_ptr", "delays_ptr", "W")
    attrs = {(fn.arg_names.index(n),): div16 for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["ptx"]


@needs_ptxas
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("paced", [False, True])
def test_kernel_compiles_for_sm90_with_barrier_then_release(aligned, paced, stages):
    ptx = _compile_sm90(aligned, paced, STAGES=stages)
    # stores everywhere vectorized; the source loads only with the alignment hint
    assert "st.global.v2.b64" in ptx
    assert ("ld.global.L1::evict_first.L2::cache_hint.v2.b64" in ptx) == aligned
    # the CTA's stores, a barrier, then one thread's release at GPU scope for each slot
    release = ptx.index("atom.global.gpu.release.add.u32")
    assert "bar.sync" in ptx[:release]
    assert ptx.rindex("st.global.v2.b64") < release
    assert ("%globaltimer" in ptx) == paced


@needs_ptxas
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_pipelined_kernel_loads_the_next_blocks_before_a_store_sm90(stages):
    # a block of 2 x 1024 words over 4 warps: 8 vector loads and 8 vector stores per thread; with S stages the
    # code holds S blocks' loads (S - 1 before the loop, one in it), all ahead of the first store
    ptx = _compile_sm90(STAGES=stages)
    vector = "ld.global.L1::evict_first.L2::cache_hint.v2.b64"
    loads = [i for i in range(len(ptx)) if ptx.startswith(vector, i)]
    assert len(loads) == 8 * stages and ptx.count("st.global.v2.b64") == 8
    assert loads[-1] < ptx.index("st.global.v2.b64")


@needs_ptxas
@pytest.mark.parametrize("num_warps", [4, 8, 16, 32])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_largest_allowed_tuning_compiles_without_spills_sm90(num_warps, stages):
    # DeepSeek-V3's rows (7168 bf16: 1792 int64 words, blocks of 2048 words) at the largest block_bytes that
    # check_tuning allows for these warps and stages: ptxas keeps every block in registers; twice that block
    # is refused
    block_bytes = max(
        b
        for b in (2**i for i in range(10, 20))
        if tp.data_registers(b, num_warps, stages) <= tp.register_limit(num_warps)
    )
    tp.check_tuning(block_bytes, num_warps, stages)
    with pytest.raises(ValueError, match="registers of data per thread"):
        tp.check_tuning(2 * block_bytes, num_warps, stages)
    block_w = min(2048, block_bytes // 8)
    ptx = _compile_sm90(
        num_warps=num_warps, STAGES=stages, BLOCK_R=block_bytes // (8 * block_w), BLOCK_W=block_w
    )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pull.ptx"
        path.write_text(ptx)
        r = subprocess.run(
            [str(_ptxas()), "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
            capture_output=True,
            text=True,
        )
    assert r.returncode == 0, r.stderr[-2000:]
    spills = re.search(r"(\d+) bytes spill stores", r.stderr)
    assert spills and spills.group(1) == "0", r.stderr[-2000:]


@needs_ptxas
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("paced", [False, True])
def test_tma_kernel_compiles_for_sm90_with_wait_and_fence_before_release(stages, paced):
    # 64 KiB blocks (8 x 1024 words) over 16 warps, as the defaults: bulk tensor copies global -> shared and
    # shared -> global, no register-path global loads or stores of the data; before the first release the
    # full completion wait of the bulk stores (not only .read), the async-proxy fence, the CTA barrier
    ptx = _compile_sm90(
        paced=paced, num_warps=16, STAGES=stages, BLOCK_R=8, BLOCK_W=1024, TMA=True, FENCE=True
    )
    load = "cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes"
    store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
    assert load in ptx and store in ptx
    assert "ld.global.L1::evict_first" not in ptx and "st.global.v2.b64" not in ptx
    release = ptx.index("atom.global.gpu.release.add.u32")
    before = ptx[:release]
    wait = before.rindex("cp.async.bulk.wait_group 0;")
    fence = before.rindex("fence.proxy.async.global;")
    assert before.rindex(store) < wait < fence < before.rindex("bar.sync") < release
    assert ("%globaltimer" in ptx) == paced


@needs_ptxas
@pytest.mark.parametrize("paced", [False, True])
def test_link_only_kernel_moves_no_row_but_releases_after_the_barrier_sm90(paced):
    # copy="none" (MOVE off): no source address read, no row loaded or stored (neither the register path's
    # vector loads and stores nor TMA's bulk copies); the CTA barrier, then the release atomics, as when rows
    # move; the pacing spin kept
    ptx = _compile_sm90(paced=paced, num_warps=16, STAGES=2, MOVE=False)
    assert "ld.global.L1::evict_first" not in ptx and "st.global" not in ptx and "cp.async.bulk" not in ptx
    release = ptx.index("atom.global.gpu.release.add.u32")
    assert "bar.sync" in ptx[:release]
    assert ("%globaltimer" in ptx) == paced
    moving = _compile_sm90(paced=paced, num_warps=16, STAGES=2)
    assert "st.global.v2.b64" in moving  # the same arguments with MOVE on copy the rows


@needs_ptxas
def test_tma_kernel_without_fence_lacks_it_sm90():
    # the fence comes from the kernel's own inline assembly (Triton's descriptor store does not emit it):
    # compiled out (as under the interpreter), it is gone
    ptx = _compile_sm90(num_warps=16, BLOCK_R=8, BLOCK_W=1024, TMA=True, FENCE=False)
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx
    assert "fence.proxy.async.global" not in ptx


def test_tma_budget_hand_worked():
    # shared memory: stages blocks within 227 KiB per CTA (64 KiB: up to 3 stages; 128 KiB: 1); at stages > 1
    # one block passes through registers, within the register budget
    tp.check_tuning(65536, 16, 3, copy="tma")
    tp.check_tuning(131072, 16, 1, copy="tma")
    tp.check_tuning(131072, 4, 1, copy="tma")  # stays in shared memory: no registers of data
    with pytest.raises(ValueError, match=r"takes 262144 bytes of shared memory, more than 232448"):
        tp.check_tuning(65536, 16, 4, copy="tma")
    with pytest.raises(ValueError, match=r"passes 256 registers of data per thread .* more than 128"):
        tp.check_tuning(65536, 2, 2, copy="tma")
    tp.check_tuning(65536, 2, 1, copy="tma")
    with pytest.raises(ValueError, match=r"block_bytes=8 with copy='tma'; it must be >= 16"):
        tp.check_tuning(8, 16, 1, copy="tma")
    with pytest.raises(ValueError, match=r"copy='dma'; it must be one of 'registers', 'tma', 'none'"):
        tp.check_tuning(65536, 16, 1, copy="dma")


def test_link_only_has_no_budget_but_checks_the_form():
    # copy="none" keeps no block in flight: tunings over both budgets pass; the values' form is checked as for
    # every path (a sweep's values are refused alike), and the warps are the programs' warps
    tp.check_tuning(262144, 1, 4, copy="none")
    with pytest.raises(ValueError, match=r"keeps 8192 registers of data per thread"):
        tp.check_tuning(262144, 1, 4)
    with pytest.raises(ValueError, match=r"^tile_pull: block_bytes=3000; it must be a power of two"):
        tp.check_tuning(3000, 16, 1, copy="none")
    with pytest.raises(ValueError, match=r"^tile_pull: stages=5; it must be an integer in 1 \.\. 4"):
        tp.check_tuning(65536, 16, 5, copy="none")
    with pytest.raises(ValueError, match=r"^tile_pull: num_warps=3; it must be 1, 2, 4, 8, 16 or 32"):
        tp.check_tuning(65536, 3, 1, copy="none")


def test_tma_refuses_rows_not_a_multiple_of_16_bytes():
    c = torch.tensor([[3, 2], [1, 4]])
    plan = tp.pull_plan(c, 12, SMALL, 2)
    bufs = sources_for(c, 12, torch.bfloat16, "cpu")
    recv = torch.zeros(12, 12, dtype=torch.bfloat16)
    counters = torch.zeros(plan.slots, dtype=torch.int32)
    with pytest.raises(
        ValueError,
        match=r"^tile_pull: copy='tma' with rows of H=12 x 2 bytes = 24 bytes; TMA copies rows of a multiple "
        r"of 16 bytes: pad H to a multiple of 8, or use copy='registers'$",
    ):
        tp.tile_pull(recv, tp.source_table(bufs), plan, counters, programs=2, copy="tma")


@pytest.mark.skipif(not have_triton(), reason="needs Triton")
def test_scratch_launcher_sets_the_allocator_for_the_launch_alone():
    # what a launch sees: the op's allocator (torch bytes on the device asked for); the caller's context
    # keeps its own allocator afterwards
    import triton
    from triton.runtime import _allocation

    seen = []

    def kernel(x, *, flag):
        buf = _allocation._allocator.get()(256, 128, None)
        seen.append((x, flag, buf.dtype, buf.numel(), buf.device))
        return "launched"

    before = _allocation._allocator.get()
    assert tp.scratch_launcher(kernel, torch.device("cpu"))(3, flag=True) == "launched"
    assert seen == [(3, True, torch.int8, 256, torch.device("cpu"))]
    assert _allocation._allocator.get() is before
    assert hasattr(triton, "set_allocator")


def test_register_budget_hand_worked():
    # 64 KiB over 16 warps (512 threads): 128 bytes, 32 registers of data per thread; a thread's share of
    # the SM's 65536 registers is 128, half of it 64: at most 128 KiB in flight from 8 warps up (at most 128
    # registers of data), 64 KiB at 4 warps
    assert tp.data_registers(65536, 16, 1) == 32 and tp.data_registers(65536, 16, 2) == 64
    assert [tp.register_limit(w) for w in (1, 2, 4, 8, 16, 32)] == [128, 128, 128, 128, 64, 32]
    for warps, most in ((4, 65536), (8, 131072), (16, 131072), (32, 131072)):
        tp.check_tuning(most // 4, warps, 4)
        tp.check_tuning(most, warps, 1)
        with pytest.raises(ValueError):
            tp.check_tuning(most, warps, 2)
    tp.check_tuning(tp.BLOCK_BYTES, tp.NUM_WARPS, tp.STAGES)  # the defaults


def test_tuning_errors_name_the_value_and_fix():
    plan, bufs, recv, counters = _small()
    table = tp.source_table(bufs)
    with pytest.raises(ValueError, match=r"^tile_pull: stages=5; it must be an integer in 1 \.\. 4"):
        tp.tile_pull(recv, table, plan, counters, programs=2, stages=5)
    with pytest.raises(ValueError, match=r"^tile_pull: stages=0; it must be an integer in 1 \.\. 4"):
        tp.tile_pull(recv, table, plan, counters, programs=2, stages=0)
    with pytest.raises(ValueError, match=r"^tile_pull: block_bytes=49152; it must be a power of two"):
        tp.tile_pull(recv, table, plan, counters, programs=2, block_bytes=49152)
    with pytest.raises(ValueError, match=r"^tile_pull: num_warps=64; it must be 1, 2, 4, 8, 16 or 32"):
        tp.tile_pull(recv, table, plan, counters, programs=2, num_warps=64)
    with pytest.raises(
        ValueError,
        match=r"^tile_pull: stages=4 x block_bytes=65536 over num_warps=16 keeps 128 registers of data per "
        r"thread in flight, more than 64; keep stages \* block_bytes <= 131072 at num_warps=16 \(lower "
        r"stages or block_bytes\)$",
    ):
        tp.tile_pull(recv, table, plan, counters, programs=2, stages=4)
    # the budget can be left out (a sweep skips such combinations instead)
    tp.check_tuning(65536, 16, 4, budget=False)


# ---- GPU ---------------------------------------------------------------------------------------------------


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not have_triton() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled Triton",
)
needs_sm90 = needs_sm90_quack


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("programs", [1, 3, 8, 16])
@pytest.mark.parametrize("width,dtype", [(7168, torch.bfloat16), (2048, torch.bfloat16), (36, torch.float32)])
@pytest.mark.parametrize(
    "tuning",
    [
        {},
        dict(stages=2),
        dict(stages=4, block_bytes=32768),
        dict(stages=3, block_bytes=4096, num_warps=8),
        dict(copy="tma"),
        dict(copy="tma", stages=2),
        dict(copy="tma", stages=3, block_bytes=4096, num_warps=8),
        dict(copy="tma", block_bytes=131072),
    ],
    ids=[
        "default",
        "stages2",
        "stages4-block32k",
        "stages3-block4k-warps8",
        "tma",
        "tma-stages2",
        "tma-stages3-block4k-warps8",
        "tma-block128k",
    ],
)
def test_pull_alone_equals_reference_gpu(programs, width, dtype, tuning):
    c = _random_counts(8, 6, seed=programs, zero_frac=0.2, most=90)
    rows = int(c.sum()) + 5
    plan = tp.pull_plan(c.cuda(), rows, tg.DEEPSEEK, 48, src_row0_P=torch.arange(8, device="cuda") * 3)
    bufs = sources_for(c, width, dtype, "cuda", src_row0_P=torch.arange(8) * 3)
    recv = torch.full((rows, width), -1, dtype=dtype, device="cuda")
    counters = torch.full((plan.slots,), 5, dtype=torch.int32, device="cuda")
    want, want_counters = recv.clone(), counters.clone()
    tp.pull_reference(want, bufs, plan, want_counters)
    tp.tile_pull(recv, tp.source_table(bufs), plan, counters, programs=programs, **tuning)
    torch.cuda.synchronize()
    assert torch.equal(recv, want)
    assert torch.equal(counters, want_counters)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("copy", tp.COPIES)
def test_paced_pull_takes_the_link_time_gpu(copy):
    # every copy path paces alike: copy="none" (no row moved) takes the link time as the copying paths do
    c = _random_counts(4, 4, seed=9, zero_frac=0.0, most=200)
    rows, width = int(c.sum()), 2048
    plan = tp.pull_plan(c.cuda(), rows, tg.QWEN3, 32)
    bufs = sources_for(c, width, torch.bfloat16, "cuda")
    recv = torch.zeros(rows, width, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(plan.slots, dtype=torch.int32, device="cuda")
    table = tp.source_table(bufs)
    rate, programs = 5e9, 4  # bytes/s: slow enough (~1.3 ms) that launch and copy times are a small part
    tp.tile_pull(recv, table, plan, counters, programs=programs, rate=rate, copy=copy)  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before = counters.clone()
    start.record()
    tp.tile_pull(recv, table, plan, counters, programs=programs, rate=rate, copy=copy)
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(counters - before, tp.slot_releases(plan))
    # each program paces its own chunks (t, t + programs, ...) at rate / programs: the pull takes as long as
    # the program with the most bytes
    rows_C = plan.tasks_C8[:, tp.ROWS].cpu()
    most = max(int(rows_C[p::programs].sum()) for p in range(programs))
    paced_ms = most * width * 2 * programs / rate * 1e3
    took_ms = start.elapsed_time(end)
    assert 0.99 * paced_ms <= took_ms <= 1.1 * paced_ms + 0.05, (took_ms, paced_ms)


def _run_watched(name: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    _watched(["-m", "tests.tile_pull_cases", "--gpu-concurrent", name], env,
             f"{name}: pull + waiting GEMM still running (a hang)")  # fmt: skip


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("name", list(GPU_CONCURRENT))
def test_pull_beside_waiting_gemm_launched_first_gpu(name):
    # cases ending in -delays: a random spin (0-40 us) before each chunk, so chunks land out of order;
    # -none-paced: the link-only pull (no row moved, the rows in place), paced, the GEMM waiting on its
    # releases
    _run_watched(name)


# the pull's sources as symmetric-memory peer buffers (torch.distributed._symmetric_memory) at world size 1:
# the table holds peer addresses from the rendezvous handle, which here map this GPU's own buffers; a
# single-rank NCCL group in a subprocess, multicast off (no multicast objects are created)
_SYMMETRIC = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from mok_megatron.kernels import tile_gemm as tg
    from mok_megatron.kernels import tile_pull as tp
    from tests.tile_pull_cases import sources_for

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    c = torch.tensor([[70, 0, 1, 130], [200, 3, 0, 30], [30, 0, 17, 87]])
    width = 2048
    local = sources_for(c, width, torch.bfloat16, dev, src_row0_P=torch.tensor([0, 5, 2]))
    # the buffers and their handles live as long as the peer views: a view from get_buffer holds neither, and
    # a handle or buffer dropped unmaps the address the table holds
    bufs, handles, peers = [], [], []
    for src in local:
        buf = symm_mem.empty(tuple(src.shape), dtype=src.dtype, device=dev)
        handle = symm_mem.rendezvous(buf, group)
        assert handle.world_size == 1, handle.world_size
        buf.copy_(src)
        bufs.append(buf)
        handles.append(handle)
        peers.append(handle.get_buffer(0, tuple(src.shape), src.dtype, 0))
    rows = int(c.sum()) + 5
    plan = tp.pull_plan(c.to(dev), rows, tg.DEEPSEEK, 48, src_row0_P=torch.tensor([0, 5, 2], device=dev))
    recv = torch.full((rows, width), -1, dtype=torch.bfloat16, device=dev)
    counters = torch.zeros(plan.slots, dtype=torch.int32, device=dev)
    want, want_counters = recv.clone(), counters.clone()
    tp.pull_reference(want, local, plan, want_counters)
    torch.cuda.synchronize()
    tp.tile_pull(recv, tp.source_table(peers), plan, counters, programs=4)
    torch.cuda.synchronize()
    assert torch.equal(recv, want), "received rows differ from pull_reference"
    assert torch.equal(counters, want_counters), "counters differ from pull_reference"
    dist.destroy_process_group()
    print("ok", flush=True)
    """
)
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_nccl_available(), reason="needs NCCL"
)
def test_pull_from_symmetric_memory_peer_buffers_gpu():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        **MULTICAST_OFF,
    )
    _watched(["-c", _SYMMETRIC], env, "the pull from symmetric memory still ran")


# ---- the benchmark's arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--shapes", "gpt"], "--shapes gpt; known: deepseek-v3-ep32,deepseek-v3-ep32-16k,qwen3-ep8"),
        (["--k", "0,4"], "every K must be >= 1"),
        (["--k", "x"], "it must be a comma list of integers"),
        (["--gbps", "-1"], "every rate >= 0"),
        (["--stages", "1,x"], "--stages '1,x'; it must be a comma list of integers"),
        (
            ["--stages", "2,5"],
            "tile_pull: block 65536 warps 16 stages 5: stages=5; it must be an integer in 1",
        ),
        (
            ["--block-bytes", "3000"],
            "tile_pull: block 3000 warps 16 stages 1: block_bytes=3000; it must be a power",
        ),
        (
            ["--warps", "16,48"],
            "tile_pull: block 65536 warps 48 stages 1: num_warps=48; it must be 1, 2, 4, 8, 16",
        ),
        (["--block-bytes", "262144", "--stages", "2,4"], "every tuning is over the kernel's budget"),
        (["--copy", "registers,dma"], "copy='dma'; it must be one of 'registers', 'tma', 'none'"),
        (["--copy", "registers,none"], "tile_pull: --copy none; this benchmark times the pull's copy"),
        (["--copy", "tma", "--block-bytes", "8"], "block_bytes=8 with copy='tma'; it must be >= 16"),
    ],
)
def test_benchmark_refuses_bad_arguments_in_one_line(argv, says, capsys):
    from benchmarks import tile_pull as bench

    assert bench.main(argv) == 2
    assert says in capsys.readouterr().err


def test_benchmark_tunings_every_combination_labelled():
    from benchmarks import tile_pull as bench

    # no tuning option: the kernel's defaults, unlabelled (the lines as without a tuning)
    assert bench.tunings(None, None, None) == (
        [bench.Tuning(tp.BLOCK_BYTES, tp.NUM_WARPS, tp.STAGES, "")],
        [],
    )
    tunes, skipped = bench.tunings("32768,65536", None, "1,2,4,2")
    assert [(t.block_bytes, t.num_warps, t.stages) for t in tunes] == [
        (32768, 16, 1),
        (32768, 16, 2),
        (32768, 16, 4),
        (65536, 16, 1),
        (65536, 16, 2),
    ]
    assert [t.label for t in tunes][-1] == "block 65536 warps 16 stages 2"
    assert tunes[0].kwargs() == dict(block_bytes=32768, num_warps=16, stages=1, copy="registers")
    # over the register budget: skipped with the kernel's reason, the others kept
    assert skipped == [
        "skipped block 65536 warps 16 stages 4: stages=4 x block_bytes=65536 over num_warps=16 keeps 128 "
        "registers of data per thread in flight, more than 64; keep stages * block_bytes <= 131072 at "
        "num_warps=16 (lower stages or block_bytes)"
    ]
    assert [t.label for t in bench.tunings(None, "8", None)[0]] == ["block 65536 warps 8 stages 1"]
    # --copy: each path at every block, labelled; tma within its shared-memory budget (3 x 64 KiB fits, 4 not)
    tunes, skipped = bench.tunings(None, None, "3,4", "registers,tma")
    assert [(t.copy, t.stages) for t in tunes] == [("tma", 3)]
    assert tunes[0].label == "block 65536 warps 16 stages 3 copy tma"
    assert tunes[0].kwargs() == dict(block_bytes=65536, num_warps=16, stages=3, copy="tma")
    assert len(skipped) == 3 and "shared memory" in skipped[-1]


def test_benchmark_per_sm_skips_programs_that_cannot_share_an_sm():
    # N programs whose blocks in flight alone fill an SM's 256 KiB of registers (copy registers) or exceed a
    # CTA's shared memory (tma) cannot all be resident: skipped with the reason, the others kept and labelled
    from benchmarks import tile_pull as bench

    tunes, skipped = bench.tunings("32768,65536", "8", None, None, "1,2,4")
    assert [(t.block_bytes, t.per_sm) for t in tunes] == [
        (32768, 1),
        (65536, 1),
        (32768, 2),
        (65536, 2),
        (32768, 4),
    ]
    assert tunes[-1].label == "block 32768 warps 8 stages 1 per-sm 4"
    assert skipped == [
        "skipped block 65536 warps 8 stages 1 per-sm 4: 4 programs x stages=1 x block_bytes=65536 = 262144 bytes "
        "in flight on one SM, against its register file of 262144 bytes: they cannot all be resident at once "
        "(the later ones would start as the earlier end); lower --per-sm, --stages or --block-bytes"
    ]
    tunes, skipped = bench.tunings(None, None, "1", "tma", "3,4")
    assert [t.per_sm for t in tunes] == [3]
    assert len(skipped) == 1 and "against its shared memory of 232448 bytes" in skipped[0]
    with pytest.raises(
        ValueError, match=r"^every tuning is over the kernel's budget: skipped .* per-sm 8: 8 programs"
    ):
        bench.tunings(None, None, None, None, "8")
