"""kernels.tile_gemm: the tile-to-expert map, counter targets and tile orders as pure functions (hand-worked
and against brute force); the GEMM's math with counters preset through the tile-by-tile reference (the
CuTe DSL has no interpreter); the kernel compiled for sm_90a without a GPU at each configuration the gate
sweeps (when QuACK and the CUTLASS DSL are installed); and on an sm_90 GPU the kernel against
torch._grouped_mm with counters preset at each of those configurations, in a random tile order, and with
counters released late from another stream (marked gpu). The epilogue's done-counter release: its targets
and completion ranks as pure functions, its variant compiled for sm_90a (the release after the TMA stores'
full wait and the async-proxy fence, in the PTX), and on the GPU the counters one launch leaves."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mok_megatron.kernels import tile_gemm as tg
from tests.harness.gpu import needs_sm90_quack

REPO = Path(__file__).resolve().parent.parent
SMALL = tg.TileConfig(tile_m=4, tile_n=16, cluster_m=2, max_swizzle=2)
# bf16 outputs of fp32 accumulations of the same products in another order
BF16 = dict(rtol=1.6e-2, atol=1e-2)


def _offs(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def _operands(rows, k, n, g, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(g, k, n, generator=gen).to(device=device, dtype=dtype)
    return a, b


def _expected_items(counts, n, cfg):
    """(expert, cluster row, column tile) of every work item, by brute force."""
    items = []
    for e, c in enumerate(counts):
        for cm in range(-(-c // cfg.block_m)):
            items += [(e, cm, cn) for cn in range(-(-n // cfg.tile_n))]
    return items


# ---- sizes, slots, targets ---------------------------------------------------------------------------------


def test_hand_worked_plan():
    # experts of 5, 0, 16, 9 rows; 32 rows in the buffer (2 past the last expert); tile 4 rows x 16 columns,
    # clusters of 2 row tiles, bands of 2 column tiles
    offs = _offs([5, 0, 16, 9])
    plan = tg.tile_plan(offs, 32, 40, SMALL)
    # slots: expert 0 (5 rows) 2, expert 1 none, expert 2 (16 rows) 4, expert 3 (9 rows, 3 tiles) 4
    assert tg.slot_base(offs, SMALL).tolist() == [0, 2, 2, 6]
    assert plan.targets_S.tolist() == [4, 1, 4, 4, 4, 4, 4, 4, 1, 0, 0, 0, 0, 0]
    assert tg.slot_capacity(32, 4, SMALL) == 14 and tg.work_capacity(32, 4, 40, SMALL) == 21
    # QuACK's order: per expert, bands of 2 column tiles, rows down the band, the next band upwards; the
    # fourth column: the slot of the cluster's first row tile (the expert's first slot + 2 per cluster row)
    assert plan.tiles_W4.tolist()[:15] == [
        [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0],
        [2, 0, 0, 2], [2, 0, 1, 2], [2, 1, 0, 4], [2, 1, 1, 4], [2, 1, 2, 4], [2, 0, 2, 2],
        [3, 0, 0, 6], [3, 0, 1, 6], [3, 1, 0, 8], [3, 1, 1, 8], [3, 1, 2, 8], [3, 0, 2, 6],
    ]  # fmt: skip
    assert plan.tiles_W4.tolist()[15:] == [[4, 0, 0, 0]] * 6  # past the last work item: expert G
    assert plan.tiles_W4.is_contiguous() and plan.tiles_W4.dtype == torch.int32
    assert tg.row_slots(offs, 32, SMALL).tolist() == (
        [0] * 4 + [1] + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4 + [7] * 4 + [8] + [-1] * 2
    )


@pytest.mark.parametrize(
    "counts,rows",
    [([5, 0, 16, 9], 32), ([0, 0, 0], 8), ([40], 40), ([1, 1, 1, 1, 1], 5), ([0, 33, 0, 7, 64, 2], 120)],
)
@pytest.mark.parametrize("cfg", [SMALL, tg.TileConfig(tile_m=8, tile_n=8, cluster_m=1, max_swizzle=3)])
def test_targets_count_the_rows_of_each_slot(counts, rows, cfg):
    offs = _offs(counts)
    slots = tg.row_slots(offs, rows, cfg)
    targets = tg.counter_targets(offs, rows, cfg)
    assert targets.shape == (tg.slot_capacity(rows, len(counts), cfg),)
    live = slots >= 0
    assert int(live.sum()) == sum(counts) and bool(torch.all(slots[sum(counts) :] == -1))
    assert torch.equal(torch.bincount(slots[live], minlength=targets.numel()).to(torch.int32), targets)
    base = tg.slot_base(offs, cfg)
    for e, c in enumerate(
        counts
    ):  # each expert's slots: full tiles, the rest, then zeros to the cluster edge
        n_slots = -(-c // cfg.block_m) * cfg.cluster_m
        want = [min(cfg.tile_m, max(0, c - t * cfg.tile_m)) for t in range(n_slots)]
        assert targets[int(base[e]) : int(base[e]) + n_slots].tolist() == want


def test_done_targets_and_completion_ranks_hand_worked():
    # the plan above: 3 column tiles; slots 0-9 belong to experts (expert 0: 0-1, expert 2: 2-5, expert 3:
    # 6-9, slot 9 its cluster's padding, released too), 10-13 past the last expert
    offs = _offs([5, 0, 16, 9])
    plan = tg.tile_plan(offs, 32, 40, SMALL)
    assert plan.base_G.tolist() == [0, 2, 2, 6]
    assert plan.done_targets_S.tolist() == [3] * 10 + [0] * 4
    # the last work item of each cluster row in QuACK's order (the table above): expert 0's row 0 at 2,
    # expert 2's row 0 at 8 (the serpentine band comes back up), its row 1 at 7, expert 3's rows at 14, 13
    assert tg.slot_done_rank(plan).tolist() == [2, 2, 8, 8, 7, 7, 14, 14, 13, 13, -1, -1, -1, -1]


@pytest.mark.parametrize(
    "counts,rows,n", [([5, 0, 16, 9], 32, 40), ([0, 200, 3], 210, 100), ([17] * 6, 102, 16), ([0, 0], 4, 8)]
)
@pytest.mark.parametrize("cfg", [SMALL, tg.TileConfig(tile_m=8, tile_n=8, cluster_m=1, max_swizzle=3)])
def test_done_counters_of_one_launch_reach_the_targets_in_any_order(counts, rows, n, cfg):
    offs = _offs(counts)
    ready = torch.randint(0, 7, (rows,), generator=torch.Generator().manual_seed(rows))
    quack = tg.tile_plan(offs, rows, n, cfg)
    for plan in (quack, tg.tile_plan(offs, rows, n, cfg, ready_M=ready), _shuffled(quack, len(counts), 3)):
        assert torch.equal(tg.done_counts_reference(plan), plan.done_targets_S)
        rank = tg.slot_done_rank(plan)
        valid = plan.tiles_W4[:, 0] < len(counts)
        for s in range(plan.targets_S.numel()):  # brute force: the last item covering the slot
            first = plan.tiles_W4[:, 3]
            cover = (valid & (first <= s) & (s < first + cfg.cluster_m)).nonzero().flatten()
            assert int(rank[s]) == (int(cover.max()) if cover.numel() else -1)
            assert (plan.done_targets_S[s] > 0) == (cover.numel() > 0)


# ---- tile orders -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counts,rows,n", [([5, 0, 16, 9], 32, 40), ([0, 200, 3], 210, 100), ([17] * 6, 102, 16)]
)
@pytest.mark.parametrize("cfg", [SMALL, tg.TileConfig(tile_m=8, tile_n=8, cluster_m=1, max_swizzle=8)])
def test_every_order_visits_every_work_item_once(counts, rows, n, cfg):
    offs = _offs(counts)
    want = sorted(_expected_items(counts, n, cfg))
    ready = torch.randint(0, 7, (rows,), generator=torch.Generator().manual_seed(rows))
    base = tg.slot_base(offs, cfg).tolist()
    for plan in (tg.tile_plan(offs, rows, n, cfg), tg.tile_plan(offs, rows, n, cfg, ready_M=ready)):
        tiles = plan.tiles_W4.tolist()
        assert len(tiles) == tg.work_capacity(rows, len(counts), n, cfg)
        valid = [tuple(t[:3]) for t in tiles if t[0] < len(counts)]
        assert sorted(valid) == want
        # each row carries its cluster's first counter slot, whatever the order
        assert all(f == base[e] + cm * cfg.cluster_m for e, cm, _, f in tiles[: len(valid)])
        assert all(
            t == [len(counts), 0, 0, 0] for t in tiles[len(valid) :]
        )  # end markers only after the last


def test_quack_order_keeps_a_band_of_columns_while_rows_stream():
    # one expert, 6 cluster rows, 5 column tiles, bands of 2: band 0 down, band 1 up, band 2 (tail) down
    cfg = tg.TileConfig(tile_m=4, tile_n=8, cluster_m=1, max_swizzle=2)
    tiles = tg.quack_tile_order(_offs([24]), 24, 40, cfg).tolist()
    bands = [[(m, n) for _, m, n, _ in tiles[i : i + 12]] for i in (0, 12)] + [
        [(m, n) for _, m, n, _ in tiles[24:]]
    ]
    assert bands[0] == [(m, n) for m in range(6) for n in (0, 1)]
    assert bands[1] == [(m, n) for m in reversed(range(6)) for n in (2, 3)]
    assert bands[2] == [(m, 4) for m in range(6)]


def test_arrival_order_sorts_by_the_latest_row_and_keeps_quack_order_in_ties():
    offs = _offs([5, 0, 16, 9])
    rows, n = 32, 40
    ready = torch.tensor(
        [3, 4, 4, 1, 2, 3, 3, 1, 4, 2, 0, 0, 0, 4, 3, 4, 0, 3, 2, 4, 0, 0, 4, 1, 2, 4, 0, 2, 0, 1]
    )
    ready = torch.cat([ready, torch.tensor([9, 9])])  # rows past the last expert do not count
    ready_S = tg.slot_ready(offs, ready, SMALL)
    assert ready_S.tolist()[:9] == [4, 2, 4, 2, 4, 4, 4, 4, 1]
    assert bool(torch.all(ready_S[9:] == torch.iinfo(torch.int64).min))  # padding: ready at once
    quack = tg.tile_plan(offs, rows, n, SMALL).tiles_W4.tolist()
    tiles = tg.tile_plan(offs, rows, n, SMALL, ready_M=ready).tiles_W4.tolist()
    # expert 3's second cluster row (slots 8, 9: ready 1) first, then the rest (ready 4) as QuACK has it
    assert tiles[:3] == [[3, 1, 0, 8], [3, 1, 1, 8], [3, 1, 2, 8]]
    assert tiles[3:15] == [t for t in quack[:15] if t[:2] != [3, 1]]


def test_plans_are_sync_free_shapes_on_meta():
    # every shape comes from host ints: the functions run on tensors without data
    offs = torch.empty(8, dtype=torch.int32, device="meta")
    plan = tg.tile_plan(
        offs, 4096, 768, tg.QWEN3, ready_M=torch.empty(4096, dtype=torch.int64, device="meta")
    )
    assert plan.tiles_W4.shape == (tg.work_capacity(4096, 8, 768, tg.QWEN3), 4)
    assert plan.targets_S.shape == (tg.slot_capacity(4096, 8, tg.QWEN3),)


# ---- the GEMM's math, tile by tile -------------------------------------------------------------------------


@pytest.mark.parametrize("counts,rows", [([5, 0, 16, 9], 32), ([0, 0, 70], 72), ([1, 2, 3, 4], 10), ([0], 3)])
@pytest.mark.parametrize("order", ["quack", "arrival", "random"])
def test_tile_reference_with_counters_preset_matches_grouped_mm(counts, rows, order):
    offs = _offs(counts)
    a, b = _operands(rows, 24, 40, len(counts), seed=rows)
    ready = torch.randint(0, 5, (rows,), generator=torch.Generator().manual_seed(1))
    plan = tg.tile_plan(offs, rows, 40, SMALL, ready_M=ready if order == "arrival" else None)
    if order == "random":
        plan = _shuffled(plan, len(counts), seed=rows)
    counters = torch.zeros_like(plan.targets_S)
    slots = tg.row_slots(offs, rows, SMALL)
    counters.index_add_(0, slots[slots >= 0], torch.ones(int((slots >= 0).sum()), dtype=torch.int32))
    out = tg.tile_gemm_reference(a, b, offs, plan, counters)
    want = tg.grouped_mm_reference(a, b, offs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_grouped_reference_is_torch_grouped_mm():
    from mok_megatron.compat import grouped_mm_fn

    offs = _offs([3, 0, 1, 12])
    a, b = _operands(16, 32, 24, 4, seed=5, dtype=torch.bfloat16)
    want = grouped_mm_fn()(a, b, offs=offs)
    torch.testing.assert_close(tg.grouped_mm_reference(a, b, offs), want, **BF16)


def test_tile_reference_names_the_tile_that_would_wait_forever():
    offs = _offs([5, 0, 16, 9])
    a, b = _operands(32, 8, 40, 4)
    plan = tg.tile_plan(offs, 32, 40, SMALL)
    counters = plan.targets_S.clone()
    counters[5] -= 1  # expert 2, row tile 3
    with pytest.raises(
        RuntimeError, match=r"expert 2, row tile 3\) waits for counter slot 5 to reach 4; it holds 3"
    ):
        tg.tile_gemm_reference(a, b, offs, plan, counters)
    # counters kept across steps: the shifted plan waits for one step more
    with pytest.raises(RuntimeError, match="waits for counter slot 0 to reach 8"):
        tg.tile_gemm_reference(a, b, offs, plan.shifted(plan.targets_S.max()), plan.targets_S)


def test_shifted_plan_waits_for_one_more_step_of_both_counters():
    offs = _offs([5, 0, 300])
    plan = tg.tile_plan(offs, 320, 200, tg.QWEN3)
    nxt = plan.shifted(plan.targets_S, plan.done_targets_S)
    real, done = plan.targets_S > 0, plan.done_targets_S > 0
    assert torch.equal(nxt.targets_S[real], 2 * plan.targets_S[real])
    assert torch.equal(nxt.done_targets_S[done], 2 * plan.done_targets_S[done])
    assert not nxt.targets_S[~real].any() and not nxt.done_targets_S[~done].any()
    assert torch.equal(plan.shifted(plan.targets_S).done_targets_S, plan.done_targets_S)


def test_tile_reference_rejects_a_table_that_misses_or_repeats_tiles():
    offs = _offs([9])
    a, b = _operands(9, 8, 16, 1)
    plan = tg.tile_plan(offs, 9, 16, SMALL)
    tiles = plan.tiles_W4.clone()
    tiles[1] = tiles[0]  # cluster row 0 twice, cluster row 1 (row 8) never
    with pytest.raises(ValueError, match=r"output element \[0, 0\] written 2 times"):
        tg.tile_gemm_reference(a, b, offs, dataclasses.replace(plan, tiles_W4=tiles), plan.targets_S)


def test_config_errors_name_the_constraint():
    with pytest.raises(ValueError, match="every size must be positive"):
        tg.TileConfig(tile_m=0)
    assert tg.QWEN3.kernel_error() is None and tg.DEEPSEEK.kernel_error() is None
    assert "tile_m must be 64, 128, 192 or 256" in SMALL.kernel_error()
    assert "pingpong takes" in tg.TileConfig(tile_m=128, tile_n=256, pingpong=True).kernel_error()


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="checks the message without QuACK")
def test_kernel_without_quack_names_the_fix():
    offs = _offs([4])
    a, b = _operands(4, 8, 16, 1)
    plan = tg.tile_plan(offs, 4, 16, tg.QWEN3)
    with pytest.raises(ImportError, match=r"quack-kernels >=0\.4\.1,<0\.5.*pip install"):
        tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone())


@pytest.mark.skipif(importlib.util.find_spec("quack") is None, reason="checked after QuACK's version check")
def test_kernel_refuses_a_table_it_cannot_read_in_16_byte_rows():
    offs = _offs([4])
    a, b = _operands(4, 8, 400, 1, dtype=torch.bfloat16)
    plan = tg.tile_plan(offs, 4, 400, tg.QWEN3)  # 3 column tiles: 3 work items
    wide = torch.zeros(plan.tiles_W4.shape[0], 5, dtype=torch.int32)
    wide[:, :4] = plan.tiles_W4
    for tiles in (wide[:, :4], wide.view(-1)[1:13].view(3, 4)):  # rows of 20 bytes; rows 4 bytes off
        with pytest.raises(ValueError, match=r"a contiguous \[W, 4\] int32 tensor on a 16-byte boundary"):
            tg.tile_grouped_mm(a, b, dataclasses.replace(plan, tiles_W4=tiles), plan.targets_S.clone())


@pytest.mark.skipif(importlib.util.find_spec("quack") is None, reason="checked after QuACK's version check")
def test_kernel_refuses_done_counters_of_another_size():
    offs = _offs([4])
    a, b = _operands(4, 8, 400, 1, dtype=torch.bfloat16)
    plan = tg.tile_plan(offs, 4, 400, tg.QWEN3)
    done = torch.zeros(plan.targets_S.numel() + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"done \(3,\), targets \(2,\); size the done counters like"):
        tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), done_S=done)
    with pytest.raises(ValueError, match=r"done is torch.int64 on cpu; it must be int32"):
        tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), done_S=done[:-1].long())


def _config_id(cfg) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n}-{'pp' if cfg.pingpong else 'coop'}-c{cfg.cluster_m}"


def _shuffled(plan, groups, seed):
    """The plan with its work items in a random order (the end markers stay last)."""
    tiles = plan.tiles_W4
    valid = int((tiles[:, 0] < groups).sum())
    perm = torch.randperm(valid, generator=torch.Generator().manual_seed(seed)).to(tiles.device)
    return dataclasses.replace(plan, tiles_W4=torch.cat([tiles[:valid][perm], tiles[valid:]]).contiguous())


# ---- the kernel compiles for sm_90a without a GPU ----------------------------------------------------------

# cute.compile runs the whole pipeline (PTX, then ptxas to a cubin) before it loads the module through the
# CUDA driver; the script stops it there.
_COMPILE = textwrap.dedent(
    """
    import os, pathlib, sys
    os.environ.update(QUACK_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", QUACK_CACHE_ENABLED="0",
                      CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=sys.argv[1])
    import torch
    from cutlass.base_dsl import compiler

    class Loaded:
        def __getattr__(self, name):
            raise RuntimeError("compiled without a GPU")

    compiler.Compiler.jit = lambda self, module, opt_level=2, shared_libs=(): Loaded()
    from mok_megatron.kernels import tile_gemm, tile_gemm_sm90
    config = tile_gemm.SM90_CONFIGS[int(sys.argv[2])]
    release_done = sys.argv[3] == "release"
    for major in sys.argv[4].split(","):
        try:
            tile_gemm_sm90.compile_for(torch.bfloat16, major, config, release_done=release_done)
        except RuntimeError as e:
            if "compiled without a GPU" not in str(e):
                raise
        print(config, major, "compiled", flush=True)
    """
)


def _compile(tmp_path, index: int, variant: str, majors: str) -> list[str]:
    """The PTX of the waiting GEMM compiled for sm_90a in a subprocess (one per dump name)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(tmp_path), str(index), variant, majors],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("compiled") == len(majors.split(",")), r.stdout
    # the dump names are cut short, so variants that differ late in their names share a file
    ptx = list(tmp_path.glob("*TileWaitGemmSm90*.ptx"))
    assert ptx and len(list(tmp_path.glob("*TileWaitGemmSm90*.cubin"))) == len(ptx)
    return [p.read_text(errors="replace") for p in ptx]


needs_cute_dsl = pytest.mark.skipif(
    importlib.util.find_spec("quack") is None or importlib.util.find_spec("cutlass") is None,
    reason="needs quack-kernels and nvidia-cutlass-dsl (no GPU)",
)


@needs_cute_dsl
@pytest.mark.parametrize("index", range(len(tg.SM90_CONFIGS)), ids=[_config_id(c) for c in tg.SM90_CONFIGS])
def test_kernel_compiles_for_sm90a_without_a_gpu(index, tmp_path):
    for text in _compile(tmp_path, index, "plain", "k,n"):
        # the work item's table row in one 16-byte load; the producer's wait: an acquire spin, then the
        # async-proxy fence before the TMA loads
        assert "ld.global.v4.u32" in text or "ld.global.v4.b32" in text or "ld.global.v4.s32" in text
        assert "ld.acquire.gpu.global" in text and "fence.proxy.async.global" in text
        # without done counters the epilogue is QuACK's: no full store wait, no release
        assert "cp.async.bulk.wait_group 0;" not in text and "release.add" not in text


@needs_cute_dsl
@pytest.mark.parametrize("index,major", [(0, "k"), (1, "n")], ids=["qwen3-pingpong", "deepseek-cooperative"])
def test_done_release_compiles_for_sm90a_without_a_gpu(index, major, tmp_path):
    (text,) = _compile(tmp_path, index, "release", major)
    # after the tile's last TMA store: the full wait (writes complete, not .read), the async-proxy fence,
    # then one lane's +1 with release semantics (atom's default scope is .gpu), then QuACK's own tail
    store = text.rindex("cp.async.bulk.tensor.3d.global.shared")
    wait = text.index("cp.async.bulk.wait_group 0;", store)
    fence = text.index("fence.proxy.async.global;", wait)
    release = re.search(r"(atom|red)(\.global)?\.release(\.gpu)?(\.global)?\.add\.[us]32", text[fence:])
    assert release, text[wait : wait + 2000]
    between = text[wait : fence + release.start()]
    assert "cp.async.bulk.tensor" not in between and "elect.sync" in between
    assert text.count("cp.async.bulk.wait_group 0;") == 1 and len(re.findall(r"\.release.*\.add", text)) == 1


# ---- GPU: the kernel against torch._grouped_mm -------------------------------------------------------------


needs_sm90 = needs_sm90_quack
# odd expert sizes, an empty expert, an expert of one row, rows past the last expert; K, N multiples of 8
GPU_COUNTS, GPU_ROWS, GPU_K, GPU_N = [300, 0, 1, 517, 129, 64], 1040, 256, 448


def _gpu_case(cfg, b_major, seed=0):
    offs = _offs(GPU_COUNTS).cuda()
    a, b = _operands(GPU_ROWS, GPU_K, GPU_N, len(GPU_COUNTS), seed=seed, dtype=torch.bfloat16, device="cuda")
    if b_major == "k":  # fc1's weights: w1 [G, N, K] used as w1.mT
        b = b.mT.contiguous().mT
    plan = tg.tile_plan(offs, GPU_ROWS, GPU_N, cfg)
    return offs, a, b, plan


def _held_back(cfg, held):
    """SMs held back: an int, or "few": all but two clusters, so each cluster runs several work items and
    every item after its first reaches it through the scheduler's shared-memory hand-off (the grid of an
    int K this small covers every work item of these cases at once)."""
    if held != "few":
        return held
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return sms - 2 * cfg.cluster_m


def _valid_items(plan) -> int:
    return int((plan.tiles_W4[:, 0] < plan.groups).sum())


def _check(out, a, b, offs):
    end = int(offs[-1])
    want = torch._grouped_mm(a, b, offs=offs)
    torch.testing.assert_close(out[:end].float(), want[:end].float(), **BF16)
    return want


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg,b_major", [(tg.QWEN3, "k"), (tg.DEEPSEEK, "n")], ids=["qwen3-fc1", "deepseek-dgrad"]
)
@pytest.mark.parametrize("held_back", [0, 8, "few"])
def test_counters_preset_match_grouped_mm_gpu(cfg, b_major, held_back):
    offs, a, b, plan = _gpu_case(cfg, b_major)
    held_back = _held_back(cfg, held_back)
    assert _valid_items(plan) > 2 * cfg.cluster_m  # "few" hands items over
    out = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=held_back)
    torch.cuda.synchronize()
    _check(out, a, b, offs)
    again = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=held_back)
    end = int(offs[-1])  # the spare rows past the last expert are not the GEMM's
    assert torch.equal(out[:end], again[:end])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg,b_major", [(tg.QWEN3, "k"), (tg.DEEPSEEK, "n")], ids=["qwen3-pingpong", "deepseek-cooperative"]
)
@pytest.mark.parametrize("held_back", [8, "few"])
def test_done_counters_released_once_per_stored_tile_gpu(cfg, b_major, held_back):
    # the release leaves the math alone (the same bits as without it); one launch from 0 adds each slot's
    # column-tile count (cluster padding slots included); a second launch adds it again
    offs, a, b, plan = _gpu_case(cfg, b_major, seed=6)
    held_back = _held_back(cfg, held_back)
    done = torch.zeros_like(plan.targets_S)
    out = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=held_back, done_S=done)
    torch.cuda.synchronize()
    _check(out, a, b, offs)
    assert torch.equal(done, plan.done_targets_S)
    assert torch.equal(done.cpu(), tg.done_counts_reference(plan))
    plain = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=held_back)
    tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=held_back, done_S=done)
    torch.cuda.synchronize()
    end = int(offs[-1])
    assert torch.equal(out[:end], plain[:end])
    assert torch.equal(done, 2 * plan.done_targets_S)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cfg", tg.SM90_CONFIGS, ids=[_config_id(c) for c in tg.SM90_CONFIGS])
@pytest.mark.parametrize("b_major", ["k", "n"])
@pytest.mark.parametrize("held_back", [8, "few"])
def test_every_swept_configuration_matches_grouped_mm_gpu(cfg, b_major, held_back):
    # the gate's five configurations (256-row tiles, a cluster of one), QuACK's order and an arrival order;
    # "few" clusters: the work items after each cluster's first come through the shared-memory hand-off
    offs, a, b, plan = _gpu_case(cfg, b_major, seed=4)
    ready = torch.randint(0, 5, (GPU_ROWS,), generator=torch.Generator().manual_seed(5)).cuda()
    arrival = tg.tile_plan(offs, GPU_ROWS, GPU_N, cfg, ready_M=ready)
    for p in (plan, arrival):
        out = tg.tile_grouped_mm(a, b, p, p.targets_S.clone(), sms_held_back=_held_back(cfg, held_back))
        torch.cuda.synchronize()
        _check(out, a, b, offs)


@pytest.mark.gpu
@needs_sm90
def test_counters_preset_equal_quack_without_waits_gpu():
    # the same tiles and the same math as QuACK's own varlen-M GEMM: the same bits
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_tuned

    cfg = tg.QWEN3
    offs, a, b, plan = _gpu_case(cfg, "k", seed=3)
    out = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone())
    quack = torch.empty_like(out)
    qcfg = GemmConfig(
        tile_m=cfg.tile_m, tile_n=cfg.tile_n, pingpong=cfg.pingpong, cluster_m=cfg.cluster_m, cluster_n=1,
        is_dynamic_persistent=False, device_capacity=9,
    )  # fmt: skip
    gemm_tuned.fn(a, b, quack, cu_seqlens_m=torch.nn.functional.pad(offs, (1, 0)), config=qcfg)
    torch.cuda.synchronize()
    end = int(offs[-1])
    assert torch.equal(out[:end], quack[:end])


@pytest.mark.gpu
@needs_sm90
def test_random_tile_order_matches_grouped_mm_gpu():
    offs, a, b, plan = _gpu_case(tg.QWEN3, "k", seed=1)
    plan = _shuffled(plan, len(GPU_COUNTS), seed=7)
    # two clusters: the shuffled items run one after another, so the order is really followed
    out = tg.tile_grouped_mm(a, b, plan, plan.targets_S.clone(), sms_held_back=_held_back(tg.QWEN3, "few"))
    torch.cuda.synchronize()
    _check(out, a, b, offs)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg,order",
    [
        (tg.QWEN3, "quack"),
        (tg.QWEN3, "reversed"),
        (tg.QWEN3, "even-first"),  # a cluster's first CTA's slot before its second's
        (tg.SM90_CONFIGS[3], "reversed"),  # 256x192 cooperative: a cluster's CTAs wait on different slots
        (tg.SM90_CONFIGS[3], "even-first"),
        (tg.SM90_CONFIGS[4], "quack"),  # 128x128 pingpong, clusters of one
    ],
    ids=lambda v: _config_id(v) if isinstance(v, tg.TileConfig) else v,
)
@pytest.mark.parametrize("held_back", [8, "few"])
def test_counters_released_late_from_another_stream_gpu(cfg, order, held_back):
    # The rows arrive one row tile at a time, in an order of their own, from a second stream: the buffer is
    # NaN until a tile's rows are copied in, then its counter goes up by its rows. A tile loaded before its
    # counter reached the target would carry NaN into the output.
    from mok_megatron.kernels.link_delay import spin_ns

    offs, a_src, b, plan = _gpu_case(cfg, "k", seed=2)
    tg.tile_grouped_mm(a_src, b, plan, plan.targets_S.clone(), sms_held_back=8)  # compiled before
    slot_M = tg.row_slots(offs, GPU_ROWS, cfg)
    slots = torch.unique(slot_M[slot_M >= 0]).tolist()
    slots = {
        "reversed": slots[::-1],
        "quack": slots[1::2] + slots[0::2],
        "even-first": slots[0::2] + slots[1::2],
    }[order]
    held_back = _held_back(cfg, held_back)
    rows_of = [(slot_M == s).nonzero().flatten() for s in slots]  # host syncs here, before anything is queued
    a = torch.full_like(a_src, float("nan"))
    counters = torch.zeros_like(plan.targets_S)
    ones = torch.ones(GPU_ROWS, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # the exchange: queued first, so it runs beside the GEMM
        spin_ns(2_000_000, a.device)  # the GEMM is queued and waiting before the first rows arrive
        for rows in rows_of:
            spin_ns(50_000, a.device)
            a.index_copy_(0, rows, a_src.index_select(0, rows))
            counters.index_add_(0, slot_M[rows], ones[: rows.numel()])
    out = tg.tile_grouped_mm(a, b, plan, counters, sms_held_back=held_back)
    torch.cuda.synchronize()
    assert torch.equal(counters, plan.targets_S)
    end = int(offs[-1])
    assert not torch.isnan(out[:end]).any(), "a tile was loaded before its rows arrived"
    _check(out, a_src, b, offs)
