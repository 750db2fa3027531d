"""The TE expert backend's routes on CPU, with Transformer Engine stood in for by fakes: which route a GPU,
cuBLASLt and recipe get (``experts.te.grouped_route``), the grouped route's row alignment, the calls of at
most 64 experts, and ``te_expert_mlp`` against the torch per-expert reference with fake TE linears that
behave as TE's grouped GEMM does (device splits only; output rows past the splits' total left unwritten:
NaN here; a per-tensor scale over the whole input, as a tensorwise quantization would take it).
The GPU runs the real thing: tests/test_te_grouped_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts import te
from mok_megatron.ops.activation import Activation, ActivationSpec
from mok_megatron.ops.grouped_gemm import grouped_linear_reference

HOPPER, BLACKWELL = (9, 0), (10, 0)
_TOLIST = torch.Tensor.tolist  # the fakes read their splits (TE reads them on the device)
ACT = ActivationSpec(kind=Activation.SILU, gated=True)


def _route(recipe, cublaslt, capability=HOPPER, supports=False, env=None):
    return te.grouped_route(
        env=env, te_supports=supports, capability=capability, cublaslt=cublaslt, recipe=recipe
    )


def test_grouped_route_follows_te_and_names_the_wheel_once_in_one_line():
    assert _route("blockwise", 131000, supports=True) == te.GroupedRoute(True)
    assert _route("blockwise", 131000, supports=True, env="0") == te.GroupedRoute(False)  # the user said no
    assert _route(None, 131000, supports=None) == te.GroupedRoute(False)  # a TE without the route
    for recipe, need in ((None, "13.4"), ("tensorwise", "13.5"), ("blockwise", "13.6")):
        note = _route(recipe, 130100).note
        assert note is not None and "\n" not in note, recipe
        assert f"cuBLASLt >= {need} on sm_90, this process loaded 13.1" in note
        assert "pip install 'nvidia-cublas>=13.6'" in note and "LD_PRELOAD" in note
        assert "libcublasLt.so.13" in note
    # nothing a cuBLAS wheel would change: no note
    assert _route("delayed", 130100) == te.GroupedRoute(False)
    assert _route("mxfp8", 130100) == te.GroupedRoute(False)
    assert _route("blockwise", 130100, capability=BLACKWELL) == te.GroupedRoute(False)
    assert _route("blockwise", 130600) == te.GroupedRoute(False)  # new enough; TE says no for another reason
    assert te.required_cublaslt(BLACKWELL, "mxfp8") == 130300 and te.required_cublaslt((8, 9), None) is None


def _cfg(recipe=None, op_fuser=False):
    fp8 = dict(fp8="e4m3", fp8_recipe=recipe) if recipe else dict(fp8=None)
    return SimpleNamespace(fp4=None, use_transformer_engine_op_fuser=op_fuser, **fp8)


def test_grouped_alignment_is_128_rows_for_blocks():
    from megatron.core.enums import Fp8Recipe

    assert te.grouped_alignment(_cfg()) == 1
    assert te.grouped_alignment(_cfg(Fp8Recipe.tensorwise)) == 16
    assert te.grouped_alignment(_cfg(Fp8Recipe.blockwise)) == 128
    assert te.grouped_alignment(_cfg(Fp8Recipe.mxfp8)) == 128
    assert te.grouped_alignment(_cfg(Fp8Recipe.tensorwise, op_fuser=True)) == 256


def test_contract_device_counts_for_one_call_host_counts_for_several(monkeypatch):
    from megatron.core.enums import Fp8Recipe

    cfg = _cfg(Fp8Recipe.blockwise)
    monkeypatch.setattr(te, "route_for", lambda config: te.GroupedRoute(True))
    one = te.MoKTEGroupedMLP.contract(cfg, SimpleNamespace(num_local_experts=64), None)
    assert one.alignment == 128 and one.device_counts
    several = te.MoKTEGroupedMLP.contract(cfg, SimpleNamespace(num_local_experts=128), None)
    assert several.alignment == 128 and several.host_counts
    monkeypatch.setattr(te, "route_for", lambda config: te.GroupedRoute(False))
    per_expert = te.MoKTEGroupedMLP.contract(cfg, SimpleNamespace(num_local_experts=8), None)
    assert per_expert.alignment == 16 and per_expert.host_counts


def test_expert_calls_of_at_most_64_and_sync_free_refusal():
    assert te.expert_calls(8) == ((0, 8),)
    assert te.expert_calls(128) == ((0, 64), (64, 128))
    assert te.expert_calls(130) == ((0, 64), (64, 128), (128, 130))
    te.check_grouped_calls(64, sync_free=True)
    te.check_grouped_calls(128, sync_free=False)
    with pytest.raises(MoKConfigError, match=r"128 local experts.*at most 64.*--expert-model-parallel-size"):
        te.check_grouped_calls(128, sync_free=True)


def test_te_backend_checks_recipe_capability_and_allows_sync_free_on_device_counts():
    from megatron.core.enums import Fp8Recipe

    from mok_megatron.experts.backend import check_expert_backend

    with pytest.raises(MoKConfigError) as err:
        check_expert_backend("te", _cfg(Fp8Recipe.mxfp8), "cuda", have_te=True, capability=HOPPER)
    msg = str(err.value)
    assert "\n" not in msg and "--fp8-recipe mxfp8 needs sm_100+" in msg and "sm_90" in msg
    assert "blockwise" in msg and "--mok-expert-backend te" in msg
    check_expert_backend("te", _cfg(Fp8Recipe.mxfp8), "cuda", have_te=True, capability=BLACKWELL)
    check_expert_backend("te", _cfg(Fp8Recipe.blockwise), "cuda", have_te=True, capability=HOPPER)
    check_expert_backend("te", _cfg(), "cuda", have_te=True, sync_free=True, host_counts=False)
    with pytest.raises(MoKConfigError, match="--mok-sync-free"):
        check_expert_backend("te", _cfg(), "cuda", have_te=True, sync_free=True, host_counts=True)


class FakeGroupedTE:
    """TE's grouped-tensor GroupedLinear as the experts see it: ``(x, m_splits) -> (y, None)``; splits a
    tensor (a list raises, as TE's grouped route does), rows past their total left unwritten (NaN), and
    the input scaled by its whole-buffer absmax and back (a per-tensor quantization's amax: a NaN row
    anywhere in the input poisons every output row)."""

    def __init__(self, w_GNK):
        self.w, self.seen = w_GNK, []

    def __call__(self, x, m_splits):
        if not isinstance(m_splits, torch.Tensor) or m_splits.dtype != torch.int64:
            raise ValueError("The native grouped_tensor path requires CUDA m_splits")
        assert m_splits.shape == (self.w.shape[0],), "one split per GEMM of this call"
        sizes = _TOLIST(m_splits)
        self.seen.append((sizes, x.shape[0]))
        amax = x.detach().abs().amax().clamp_min(1e-30) if x.numel() else x.new_ones(())
        total = sum(sizes)
        y = grouped_linear_reference((x[:total] / amax) * amax, self.w, sizes)
        return torch.cat([y, y.new_full((x.shape[0] - total, y.shape[1]), float("nan"))]), None


def _weights(L, H, F, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(L, 2 * F, H, generator=g, dtype=torch.float64) / 4).requires_grad_()
    w2 = (torch.randn(L, H, F, generator=g, dtype=torch.float64) / 4).requires_grad_()
    return w1, w2


def _run(fn, x0, p0, w1, w2, dy):
    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    for w in (w1, w2):
        w.grad = None
    y = fn(x, p)
    y.backward(dy)
    return [y.detach(), x.grad, p.grad, w1.grad.clone(), w2.grad.clone()]


def _check(got, want, rows=None):
    for name, a, b in zip(("y", "dx", "dprobs", "dw1", "dw2"), got, want, strict=True):
        if rows is not None and name in ("y", "dx", "dprobs"):
            a, b = a[:rows], b[:rows]
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


class NoHostRead:
    """Within: any read of a tensor's values on the host raises (what a CUDA sync would be)."""

    NAMES = ("tolist", "item", "__int__", "__index__", "__bool__", "__float__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        def refuse(*a, **k):
            raise AssertionError("host read on the grouped route")

        for n in self.NAMES:
            self.mp.setattr(torch.Tensor, n, refuse)

    def __exit__(self, *exc):
        self.mp.undo()


@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_grouped_route_one_call_covers_the_buffer_without_host_reads(alignment, monkeypatch):
    """One TE call (<= 64 experts): int64 splits never read on the host; with padding the splits cover
    the whole static buffer (the last expert owns its spare rows, every split a multiple of the
    alignment), so no row TE leaves unwritten reaches the output or any gradient."""
    from mok_megatron.experts.torch_mlp import expert_mlp

    counts = torch.tensor([5, 0, 17, 1, 0, 40])
    L, H, F, R = len(counts), 16, 8, int(counts.sum())
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(R, H, generator=g, dtype=torch.float64)
    p0 = torch.rand(R, generator=g, dtype=torch.float64)
    dy = torch.randn(R, H, generator=g, dtype=torch.float64)
    w1, w2 = _weights(L, H, F)
    fc1, fc2 = FakeGroupedTE(w1), FakeGroupedTE(w2)
    want = _run(lambda x, p: expert_mlp(x, p, counts, w1, w2, ACT), x0, p0, w1, w2, dy)

    def grouped(x, p):
        with NoHostRead(monkeypatch):
            return te.te_expert_mlp(x, p, counts, fc1, fc2, ACT, alignment, grouped=True)

    _check(_run(grouped, x0, p0, w1, w2, dy), want)
    for sizes, rows in fc1.seen + fc2.seen:
        if alignment > 1:
            assert sum(sizes) == rows and all(s % alignment == 0 for s in sizes), (sizes, rows)
        else:
            assert sizes == counts.tolist() and rows == R


def test_grouped_route_bf16_spare_rows_stay_outside_the_splits(monkeypatch):
    """bf16 on a static buffer (the pipeline's sync-free expert calls): rows past the counts' total are
    not TE's; the routed rows' results and every gradient are exact and finite."""
    from mok_megatron.experts.torch_mlp import expert_mlp

    counts = torch.tensor([3, 0, 9, 4])
    L, H, F, R, spare = len(counts), 16, 8, int(counts.sum()), 7
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(R + spare, H, generator=g, dtype=torch.float64)
    x0[R:] = float("nan")  # a static buffer's spare rows: never written by the permute
    p0 = torch.rand(R + spare, generator=g, dtype=torch.float64)
    dy = torch.randn(R + spare, H, generator=g, dtype=torch.float64)
    dy[R:] = 0  # combine's backward: rows no route reads get zeros
    w1, w2 = _weights(L, H, F)
    want = _run(lambda x, p: expert_mlp(x[:R], p[:R], counts, w1, w2, ACT), x0, p0, w1, w2, dy[:R])

    def grouped(x, p):
        with NoHostRead(monkeypatch):
            return te.te_expert_mlp(x, p, counts, _NoAmax(w1), _NoAmax(w2), ACT, 1, grouped=True)

    _check(_run(grouped, x0, p0, w1, w2, dy), want, rows=R)


class _NoAmax(FakeGroupedTE):
    """bf16: no quantization, so no whole-buffer scale."""

    def __call__(self, x, m_splits):
        sizes = _TOLIST(m_splits)
        total = sum(sizes)
        y = grouped_linear_reference(x[:total], self.w, sizes)
        return torch.cat([y, y.new_full((x.shape[0] - total, y.shape[1]), float("nan"))]), None


@pytest.mark.parametrize("alignment", [1, 16, 128])
@pytest.mark.parametrize("layout", ["spread", "first-call-only", "one-expert"])
def test_grouped_route_more_than_64_experts_runs_calls_of_at_most_64(alignment, layout):
    """130 local experts: three TE calls (64, 64, 2 experts) over contiguous row ranges, each with its own
    experts' weights and int64 splits; an empty call included; results the per-expert reference's."""
    from mok_megatron.experts.torch_mlp import expert_mlp

    L, H, F = 130, 8, 4
    g = torch.Generator().manual_seed(3)
    if layout == "spread":
        counts = torch.randint(0, 4, (L,), generator=g)
    elif layout == "first-call-only":
        counts = torch.zeros(L, dtype=torch.long)
        counts[:64] = torch.randint(0, 4, (64,), generator=g)
        counts[5] = 3
    else:
        counts = torch.zeros(L, dtype=torch.long)
        counts[129] = 6
    R = int(counts.sum())
    x0 = torch.randn(R, H, generator=g, dtype=torch.float64)
    p0 = torch.rand(R, generator=g, dtype=torch.float64)
    dy = torch.randn(R, H, generator=g, dtype=torch.float64)
    w1, w2 = _weights(L, H, F)
    want = _run(lambda x, p: expert_mlp(x, p, counts, w1, w2, ACT), x0, p0, w1, w2, dy)
    fakes = []

    def calls():
        out = []
        for lo, hi in te.expert_calls(L):
            f1, f2 = FakeGroupedTE(w1[lo:hi]), FakeGroupedTE(w2[lo:hi])
            fakes.append((lo, hi, f1, f2))
            out.append((lo, hi, f1, f2))
        return tuple(out)

    got = _run(
        lambda x, p: te.te_expert_mlp(
            x, p, counts, None, None, ACT, alignment, grouped=True, calls=calls()
        ),
        x0,
        p0,
        w1,
        w2,
        dy,
    )
    _check(got, want)
    assert [hi - lo for lo, hi, _, _ in fakes] == [64, 64, 2]
    padded = ((counts + alignment - 1) // alignment * alignment).tolist()
    for lo, hi, f1, _ in fakes:
        (sizes, rows), = f1.seen
        assert sizes == padded[lo:hi] and rows == sum(sizes)  # exact rows: nothing TE leaves unwritten


class FakeLinear(torch.nn.Module):
    """A TE GroupedLinear's per-GEMM attributes and the hooks ``TECallViews`` uses."""

    def __init__(self, num_gemms, pending=False):
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.full((2, 3), float(i))))
            setattr(self, f"bias{i}", torch.empty(0))
        self.is_first_microbatch = True
        self.use_grouped_tensor = True
        self.pending, self.dw_calls, self.hooks_fired = pending, 0, 0
        self.wgrad_store = SimpleNamespace(context=SimpleNamespace(empty=lambda: not self.pending))

    def need_backward_dw(self):
        return True

    def backward_dw(self):
        self.dw_calls += 1
        self.pending = False

    def _trigger_wgrad_accumulation_and_reduce_hooks(self):
        self.hooks_fired += 1


def test_call_views_share_the_layers_parameters_and_fire_its_hooks_once():
    parent = FakeLinear(130)
    made = []

    def make(n):
        made.append(FakeLinear(n, pending=True))
        return made[-1]

    keys = set(parent.state_dict())
    views = te.TECallViews(parent, te.expert_calls(130), make)
    assert [v.num_gemms for v in views.views] == [64, 64, 2]
    for (lo, hi), view in zip(views.ranges, views.views, strict=True):
        for i in range(hi - lo):
            assert getattr(view, f"weight{i}") is getattr(parent, f"weight{lo + i}")
            assert getattr(view, f"bias{i}") is getattr(parent, f"bias{lo + i}")
        assert view.use_grouped_tensor
    assert set(parent.state_dict()) == keys and len(list(parent.parameters())) == 130  # views: no submodules
    parent.eval()
    views.begin()
    assert all(not v.training and v.is_first_microbatch for v in views.views)
    views.end()
    assert parent.is_first_microbatch is False
    views.backward_dw()
    assert [v.dw_calls for v in views.views] == [1, 1, 1] and parent.hooks_fired == 1
    views.backward_dw()  # nothing pending: no second reduction
    assert [v.dw_calls for v in views.views] == [1, 1, 1] and parent.hooks_fired == 1
