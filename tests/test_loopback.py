"""The loopback transport as the tiles engine's pull source (``transport.base.PullSource``): each local
expert's rows split evenly over the emulated EP ranks (hand-worked and its invariants), the emulated peers'
send buffers that a pull of that split turns back into the rows (``kernels.tile_pull``'s reference), the rank's
own rows where ``tile_compose.local_rows`` places them, the bytes counted, the link's rate and whether the
pull moves the rows (``bytes="copy"``) or only paces and releases them (``bytes="link"``).

Legend: P sources (emulated EP ranks, source 0 this rank), G local experts, M received rows, T tokens, H
hidden."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.engine import tile_compose as tcomp
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp
from mok_megatron.transport.base import PullSource
from mok_megatron.transport.loopback import (
    LoopbackLink,
    LoopbackTransport,
    even_split,
    source_major_rows,
)


def test_even_split_by_hand():
    c_PG = even_split(torch.tensor([0, 1, 5, 7, 8]), 4)
    assert c_PG.dtype == torch.int64
    assert c_PG.tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 2], [0, 0, 1, 2, 2], [0, 0, 1, 1, 2]]
    assert even_split(torch.tensor([3, 0, 9]), 1).tolist() == [[3, 0, 9]]


@pytest.mark.parametrize("sources", [2, 3, 8])
def test_even_split_keeps_every_row_and_balances_the_sources(sources):
    counts_G = torch.randint(0, 40, (17,), generator=torch.Generator().manual_seed(sources))
    c_PG = even_split(counts_G, sources)
    assert c_PG.shape == (sources, 17)
    assert torch.equal(c_PG.sum(0), counts_G)
    assert int((c_PG.max(0).values - c_PG.min(0).values).max()) <= 1  # as even as possible
    assert bool((c_PG[:-1] >= c_PG[1:]).all())  # the extra rows go to the first sources (this rank first)
    assert torch.equal(c_PG, even_split(counts_G.clone(), sources))


def test_even_split_refuses_no_sources():
    with pytest.raises(ValueError, match=r"^even_split: sources=0; it must be >= 1"):
        even_split(torch.tensor([1, 2]), 0)


def test_source_major_rows_by_hand():
    # expert-major receive rows: expert 0 = [s0 x2, s1 x1], expert 1 = [s0 x1, s1 x0], expert 2 = [s0 x1, s1 x2]
    c_PG = torch.tensor([[2, 1, 1], [1, 0, 2]])
    assert source_major_rows(c_PG, 7).tolist() == [0, 1, 3, 4, 2, 5, 6]


@pytest.mark.parametrize("ep", [2, 4])
def test_pulling_the_sources_gives_back_the_rows(ep):
    gen = torch.Generator().manual_seed(ep)
    counts_G = torch.tensor([9, 0, 30, 1, 70])
    tr = LoopbackTransport(LoopbackLink(ep=ep), num_local_experts=5, topk=2)
    assert isinstance(tr, PullSource) and tr.pull_rate == 0.0
    c_PG = tr.pull_split(counts_G)
    assert torch.equal(c_PG, even_split(counts_G, ep))
    rows, h = int(counts_G.sum()), 24
    rows_TH = torch.randn(60, h, generator=gen)
    token_M = torch.randint(0, 60, (rows,), generator=gen)
    sources = tr.pull_sources(rows_TH, token_M, c_PG)
    assert [s.shape[0] for s in sources] == c_PG.sum(1).tolist()
    assert all(s.is_contiguous() and s.dtype == rows_TH.dtype for s in sources)
    want_MH = rows_TH[token_M]
    plan = tp.pull_plan(c_PG, rows, tg.QWEN3, 8)
    counters = torch.zeros(plan.slots, dtype=torch.int32)
    got_MH = tp.pull_reference(torch.full_like(want_MH, float("nan")), sources, plan, counters)
    assert torch.equal(got_MH, want_MH)
    # the rank's own rows: source 0's, where local_rows places them
    placed = torch.full_like(want_MH, float("nan"))
    mine = tcomp.local_rows(c_PG, sources[0].shape[0])
    placed[mine] = sources[0]
    assert torch.equal(placed[mine], want_MH[mine])
    assert int(torch.isnan(placed[:, 0]).sum()) == rows - int(c_PG[0].sum())
    assert tr.bytes_moved == (rows - int(c_PG[0].sum())) * h * 4  # the pulled rows only


def test_pull_rate_is_the_links():
    assert LoopbackTransport(LoopbackLink(ep=8, gbps=900.0), 4, 2).pull_rate == 900e9
    assert LoopbackTransport(LoopbackLink(ep=8), 4, 2).pull_rate == 0.0


def test_the_pull_moves_rows_only_with_copies():
    copying = LoopbackTransport(LoopbackLink(ep=4, gbps=450.0), 4, 2)
    link = LoopbackTransport(LoopbackLink(ep=4, gbps=450.0, bytes="link"), 4, 2)
    assert isinstance(link, PullSource) and isinstance(copying, PullSource)
    assert copying.pull_moves_rows and not link.pull_moves_rows
    assert link.pull_rate == copying.pull_rate == 450e9  # the same pace either way
