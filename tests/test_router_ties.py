"""The router's tie rule (``mok_megatron.kernels.topk``), on the pure-torch selection the Triton kernel is
held to: equal scores in ascending expert index, and ``torch.topk``'s set wherever the K-th place has no
tie. The Triton kernel and the whole router against Megatron's run in ``tests/kernel_cases.py``
(``topk/tie-rule-*``, ``router/*``: interpreted on CPU by tests/test_kernels.py, and on CUDA)."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.kernels.topk import topk_indices, topk_indices_reference
from tests.kernel_cases import ties_at_k


def _set(idx_TK: torch.Tensor, e: int) -> torch.Tensor:
    return torch.zeros(idx_TK.shape[0], e, dtype=torch.bool).scatter_(1, idx_TK, True)


@pytest.mark.parametrize("E,K", [(2, 1), (8, 2), (64, 8), (128, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_equal_scores_pick_the_lowest_experts(E, K, dtype):
    s = torch.full((5, E), -1.5, dtype=dtype)
    assert topk_indices(s, K).tolist() == [list(range(K))] * 5


def test_hand_worked_ties():
    s = torch.tensor(
        [
            [3.0, 1.0, 2.0, 2.0, 2.0, 0.0],  # tie at the 3rd place: experts 2, 3 of {2, 3, 4}
            [2.0, 2.0, 1.0, 0.0, 5.0, 1.0],  # tie inside the top 3, none at the 3rd place
            [float("nan"), 0.0, float("-inf"), 1.0, -1.0, float("nan")],  # NaN above every number
            [float("nan"), 2.0, float("nan"), float("nan"), float("nan"), float("inf")],  # NaNs tie
        ]
    )
    assert topk_indices(s, 3).tolist() == [[0, 2, 3], [4, 0, 1], [0, 5, 3], [0, 2, 3]]
    assert ties_at_k(s, 3).tolist() == [True, False, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_scores_are_selected_first_as_torch_topk_selects_them(dtype):
    """``torch.topk`` (Megatron's selection) ranks NaN above +inf: a row with at most K NaN scores selects
    all of them, then the largest numbers, so the NaN reaches the probabilities as in Megatron."""
    g = torch.Generator().manual_seed(1)
    E, K = 64, 8
    # distinct numbers, exact in bf16 too: a permutation of -32..31 per row
    s = torch.stack([torch.randperm(E, generator=g) for _ in range(512)]).float() - E // 2
    nans = torch.rand(512, E, generator=g) < 0.05
    nans[::16, 10:22] = True  # more NaNs than K
    s[::7, 3] = float("inf")
    s[nans] = float("nan")
    s = s.to(dtype)
    few = nans.sum(1) <= K
    assert few.sum() > 400 and (~few).any() and (nans.sum(1) > 0).sum() > 400, "the draw must hold both kinds"
    assert not ties_at_k(s[few], K).any()
    got = topk_indices(s, K)
    assert torch.equal(_set(got[few], E), _set(torch.topk(s[few], K, dim=1).indices, E))
    # every selected score of a row with more NaNs than K is NaN: its lowest-index NaNs
    assert bool(s.gather(1, got)[~few].isnan().all())
    lowest = nans & (nans.cumsum(1) <= K)
    assert torch.equal(_set(got[~few], E), lowest[~few])
    # order: the NaNs first (ascending index), then the numbers as torch.topk orders them
    n = nans.sum(1).clamp(max=K)
    first = torch.arange(K).expand(512, K) < n[:, None]
    assert torch.equal(s.gather(1, got).isnan(), first)


@pytest.mark.parametrize("E,K", [(16, 4), (64, 8), (128, 8)])
def test_distinct_scores_select_exactly_torch_topk(E, K):
    g = torch.Generator().manual_seed(E + K)
    s = torch.randn(256, E, generator=g)
    assert not ties_at_k(s, K).any()
    assert torch.equal(topk_indices(s, K), torch.topk(s, K, dim=1).indices)


def test_without_a_tie_at_the_kth_place_the_set_is_torch_topks():
    """Rows with many ties (values from 6 levels) but none at the K-th place: the same experts as
    ``torch.topk`` whatever order it gives equal values; rows tied there: the lower-index set."""
    g = torch.Generator().manual_seed(0)
    E, K = 64, 8
    s = torch.randint(0, 6, (2048, E), generator=g).float() + torch.rand(2048, 1, generator=g)
    tied = ties_at_k(s, K)
    assert tied.any() and (~tied).sum() > 100, "the draw must hold both kinds of rows"
    mok, meg = _set(topk_indices(s, K), E), _set(torch.topk(s, K, dim=1).indices, E)
    assert torch.equal(mok[~tied], meg[~tied])
    # at a tie: every expert strictly above the K-th value, then the lowest indices among those equal to it
    kth = s.sort(dim=1, descending=True).values[:, K - 1 : K]
    above, at = s > kth, s == kth
    lowest_at = at & (at.cumsum(1) <= K - above.sum(1, keepdim=True))
    assert torch.equal(mok, above | lowest_at)


def test_bf16_scores_tie_and_fp32_scores_do_not():
    """The numbers behind the rule's documentation (kernels/topk.py): router logits at 64 experts / top-8
    from bf16 inputs and weights tie at the 8th place in bf16 for a few percent of tokens, in fp32 for
    none (the fp32 gap far above fp32 summation error)."""
    g = torch.Generator().manual_seed(0)
    E, K, H, T = 64, 8, 1024, 512
    w = (torch.randn(E, H, generator=g) * 0.02).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    bf16, fp32 = x @ w.t(), x.float() @ w.float().t()
    n = int(ties_at_k(bf16, K).sum())
    assert 0.005 * T < n < 0.1 * T, n
    s = fp32.sort(dim=1, descending=True).values
    gap = (s[:, K - 1] - s[:, K]).min().item()
    exact = x.double() @ w.double().t()
    assert gap > 10 * (fp32.double() - exact).abs().max().item() > 0
    assert torch.equal(topk_indices_reference(fp32, K), torch.topk(fp32, K, dim=1).indices)
