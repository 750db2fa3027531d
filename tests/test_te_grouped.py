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

from mok_megatron import compat
from mok_megatron.errors import MoKConfigError
from mok_megatron.experts import te
from mok_megatron.ops.activation import Activation, ActivationSpec
from mok_megatron.ops.grouped_gemm import grouped_linear_reference

HOPPER, BLACKWELL = (9, 0), (10, 0)
_TOLIST = torch.Tensor.tolist  # the fakes read their splits (TE reads them on the device)
ACT = ActivationSpec(kind=Activation.SILU, gated=True)


def _route(recipe, cublaslt, capability=HOPPER, supports=False, env=None, wheel=None):
    return te.grouped_route(
        env=env, te_supports=supports, capability=capability, cublaslt=cublaslt, recipe=recipe, wheel=wheel
    )


LIB = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib"


def test_grouped_route_follows_te_and_says_why_not():
    assert _route("blockwise", 131000, supports=True) == te.GroupedRoute(True)
    assert _route("blockwise", 131000, supports=True, env="0") == te.GroupedRoute(
        False, reason="NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=0"
    )  # the user said no
    no_route = _route(None, 131000, supports=None)  # a TE without the route
    assert not no_route.grouped and no_route.note is None and "TE >= 2.20" in no_route.reason
    # nothing a cuBLAS wheel would change: no note, a reason
    for recipe, capability, reason in (
        ("delayed", HOPPER, "TE's grouped GEMM does not take delayed on sm_90"),
        ("mxfp8", HOPPER, "TE's grouped GEMM does not take mxfp8 on sm_90"),
        ("blockwise", BLACKWELL, "TE's grouped GEMM does not take blockwise on sm_100"),
    ):
        assert _route(recipe, 130100, capability=capability) == te.GroupedRoute(False, reason=reason)
    new_enough = _route("blockwise", 130600)  # TE says no for another reason
    assert new_enough.note is None and "is_module_grouped_tensor_path_supported refuses" in new_enough.reason
    assert te.required_cublaslt(BLACKWELL, "mxfp8") == 130300 and te.required_cublaslt((8, 9), None) is None


@pytest.mark.parametrize(
    "recipe, capability, need",
    [
        (None, HOPPER, "13.4"),
        ("tensorwise", HOPPER, "13.5"),
        ("blockwise", HOPPER, "13.6"),
        ("mxfp8", BLACKWELL, "13.3"),
    ],
)
def test_cublas_note_pins_the_version_the_recipe_needs_in_one_line(recipe, capability, need):
    route = _route(recipe, 130100, capability=capability, wheel=compat.CublasWheel(None, LIB))
    note, arch = route.note, f"sm_{capability[0]}{capability[1]}"
    assert note is not None and "\n" not in note
    assert note.startswith(f"--mok-expert-backend te runs {recipe or 'bf16'} on TE's per-expert GEMMs: ")
    assert f"cuBLASLt >= {need} on {arch}, this process loaded 13.1;" in note
    assert f"pip install 'nvidia-cublas>={need}' and start with " in note and note.count("nvidia-cublas") == 1
    assert f'LD_PRELOAD="{LIB}/libcublasLt.so.13 {LIB}/libcublas.so.13"' in note
    assert route.reason.startswith(
        f"needs cuBLASLt >= {need} on {arch}, this process loaded 13.1; pip install"
    )
    assert route.note.endswith(f"its grouped GEMM {route.reason}.")


def test_cublas_note_names_the_installed_wheel_at_its_path():
    old = _route("blockwise", 130100, wheel=compat.CublasWheel("13.1.1.3", LIB)).note
    assert "nvidia-cublas 13.1.1.3 is installed: pip install -U 'nvidia-cublas>=13.6' and start with" in old
    new = _route("tensorwise", 130100, wheel=compat.CublasWheel("13.10.0.20", LIB)).note
    assert new.endswith(
        f"cuBLASLt >= 13.5 on sm_90, this process loaded 13.1; nvidia-cublas 13.10.0.20 is installed but not "
        f'loaded: start with LD_PRELOAD="{LIB}/libcublasLt.so.13 {LIB}/libcublas.so.13".'
    )
    assert "pip" not in new and "<site-packages>" not in old + new


def test_cublas_note_in_a_cuda_12_process_asks_for_cuda_13_builds():
    note = _route(None, 120905, wheel=compat.CublasWheel("13.10.0.20", LIB)).note
    assert "cuBLASLt >= 13.4 on sm_90, this process loaded 12.9; this is a CUDA 12 build of torch" in note
    assert "no CUDA 13 cuBLASLt can be preloaded; install CUDA 13 builds of both" in note
    assert "core_cu13" in note and "LD_PRELOAD" not in note and "nvidia-cublas" not in note
    assert "\n" not in note


def test_cublas_wheel_is_read_from_the_wheels_file_list(tmp_path, monkeypatch):
    import importlib.metadata
    import pathlib

    lib = tmp_path / "nvidia" / "cu13" / "lib"

    class _File(pathlib.PurePosixPath):
        def locate(self):
            return tmp_path / self

    files = [_File("nvidia/cu13/include/cublasLt.h"), _File("nvidia/cu13/lib/libcublasLt.so.13")]
    monkeypatch.setattr(
        compat, "dist_version", lambda name: "13.10.0.20" if name == "nvidia-cublas" else None
    )
    monkeypatch.setattr(importlib.metadata, "files", lambda name: files if name == "nvidia-cublas" else None)
    compat.cublas_wheel.cache_clear()
    try:
        assert compat.cublas_wheel() == compat.CublasWheel("13.10.0.20", str(lib))
        monkeypatch.setattr(compat, "dist_version", lambda name: None)  # not installed: where pip puts it
        compat.cublas_wheel.cache_clear()
        absent = compat.cublas_wheel()
        assert absent.version is None and absent.lib_dir.endswith("site-packages/nvidia/cu13/lib")
    finally:
        compat.cublas_wheel.cache_clear()


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
        lambda x, p: te.te_expert_mlp(x, p, counts, None, None, ACT, alignment, grouped=True, calls=calls()),
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
        ((sizes, rows),) = f1.seen
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


# ---- --mok-te-single-weight: one TE grouped weight per projection ---------------------------------


class FakeTELinear(torch.nn.Module):
    """Megatron's TE GroupedLinear wrapper as ``MoKTEGroupedMLP`` builds it, on CPU: a single grouped
    weight (``weight [G, N, K]`` whose members are views of it) only where the config asks for
    ``moe_single_grouped_weight`` AND ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` is set at construction (TE falls
    back to ``weight{i}`` otherwise); its forward is TE's grouped route (int64 splits, rows past their
    total NaN; one entry in ``calls`` per call); loading stacks / splits the per-expert and grouped keys
    as Megatron's ``_normalize_grouped_parameter_keys`` pre-hook does."""

    def __init__(self, num_gemms, in_size, out_size, *, config, pg_collection=None, name=None, **kwargs):
        import os

        super().__init__()
        self.config, self.num_gemms, self.calls = config, num_gemms, []
        self.env_at_build = os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM")
        self.single_grouped_weight = (
            bool(getattr(config, "moe_single_grouped_weight", False)) and int(self.env_at_build or 0) > 0
        )
        self.use_grouped_tensor = False
        g = torch.Generator().manual_seed(31 * out_size + in_size)
        w = torch.randn(num_gemms, out_size, in_size, generator=g, dtype=torch.float64) / 4
        if self.single_grouped_weight:
            self.weight = torch.nn.Parameter(w)
            self.weight.quantized_tensors = list(self.weight.data.unbind(0))
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(w[i].clone()))
        for i in range(num_gemms):
            setattr(self, f"bias{i}", torch.empty(0))  # TE's bias=False
        self._register_load_state_dict_pre_hook(self._remap)

    def _remap(self, sd, prefix, *args):
        keys = [f"{prefix}weight{i}" for i in range(self.num_gemms)]
        if self.single_grouped_weight and all(k in sd for k in keys):
            sd[f"{prefix}weight"] = torch.stack([sd.pop(k) for k in keys])
        elif not self.single_grouped_weight and f"{prefix}weight" in sd:
            for k, w in zip(keys, sd.pop(f"{prefix}weight").unbind(0), strict=True):
                sd[k] = w

    def forward(self, x, m_splits):
        if not isinstance(m_splits, torch.Tensor) or m_splits.dtype != torch.int64:
            raise ValueError("The native grouped_tensor path requires CUDA m_splits")
        assert m_splits.shape == (self.num_gemms,)
        sizes = _TOLIST(m_splits)
        self.calls.append(len(sizes))
        if self.single_grouped_weight:
            w = self.weight
        else:
            w = torch.stack([getattr(self, f"weight{i}") for i in range(self.num_gemms)])
        total = sum(sizes)
        y = grouped_linear_reference(x[:total], w, sizes)
        return torch.cat([y, y.new_full((x.shape[0] - total, y.shape[1]), float("nan"))]), None

    def backward_dw(self):
        return None


def _te_experts(monkeypatch, experts, single, sync_free=False):
    """``MoKTEGroupedMLP`` of a one-layer fp32 config on CPU, TE faked (``FakeTELinear``) and its grouped
    route taken."""
    from mok_megatron import compat
    from mok_megatron.bench.build import layer_config
    from mok_megatron.options import MoKOptions

    monkeypatch.setattr(compat, "have_te", lambda: True)
    monkeypatch.setattr(compat, "te_grouped_linear_classes", lambda: (FakeTELinear, FakeTELinear))
    monkeypatch.setattr(compat, "te_single_grouped_weight_supported", lambda: True)
    monkeypatch.setattr(compat, "te_version", lambda: "2.20.2")
    monkeypatch.setattr(te, "route_for", lambda config: te.GroupedRoute(True))
    real = te.check_expert_backend  # its checks, as on a GPU
    monkeypatch.setattr(te, "check_expert_backend", lambda b, c, device, **k: real(b, c, "cuda", **k))
    cfg = layer_config(dict(hidden=16, ffn=8, experts=experts, topk=2), torch.float64)
    opts = MoKOptions(expert_backend="te", te_single_weight=single, sync_free=sync_free)
    return te.MoKTEGroupedMLP(experts, cfg, options=opts)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("alignment", [1, 16])
def test_single_weight_one_call_for_128_experts_without_host_reads(alignment, monkeypatch):
    """--mok-te-single-weight with 128 local experts and --mok-sync-free: the layer builds (no 64-expert
    refusal), holds one grouped weight per projection, and its forward and backward make ONE TE call per
    projection over all 128 experts with nothing read on the host; results the per-expert reference's."""
    from mok_megatron.experts.torch_mlp import expert_mlp

    experts = _te_experts(monkeypatch, 128, single=True, sync_free=True)
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    assert experts._views is None and experts.route.grouped
    assert fc1.single_grouped_weight and fc2.single_grouped_weight
    assert [n for n, _ in experts.named_parameters()] == ["linear_fc1.weight", "linear_fc2.weight"]
    assert not experts.contract(experts.config, experts.mok_config, experts.options).host_counts
    experts.expert_alignment = alignment
    g = torch.Generator().manual_seed(7)
    counts = torch.randint(0, 3, (128,), generator=g)
    counts[100] = 5
    R = int(counts.sum())
    x0 = torch.randn(R, 16, generator=g, dtype=torch.float64)
    p0 = torch.rand(R, generator=g, dtype=torch.float64)
    dy = torch.randn(R, 16, generator=g, dtype=torch.float64)
    w1, w2 = fc1.weight, fc2.weight
    want = _run(lambda x, p: expert_mlp(x, p, counts, w1, w2, ACT), x0, p0, w1, w2, dy)

    def layer(x, p):
        with NoHostRead(monkeypatch):
            return experts(x, counts, p)[0]

    _check(_run(layer, x0, p0, w1, w2, dy), want)
    assert fc1.calls == [128] and fc2.calls == [128]


@pytest.mark.usefixtures("single_rank")
def test_single_weight_off_keeps_per_expert_weights_and_calls_of_64(monkeypatch):
    """Without the option: per-expert Parameters, the layer's config unchanged, TE's environment gate
    closed at construction, calls of at most 64 experts, and --mok-sync-free refused at 128 experts."""
    experts = _te_experts(monkeypatch, 128, single=False)
    fc1 = experts.linear_fc1
    assert not fc1.single_grouped_weight and fc1.env_at_build is None and fc1.config is experts.config
    assert not getattr(experts.config, "moe_single_grouped_weight", False)
    assert [v.num_gemms for v in experts._views[0].views] == [64, 64]
    assert experts.stacked_fc1_weight.shape == (128, 16, 16)
    with pytest.raises(MoKConfigError, match="at most 64 experts per call"):
        _te_experts(monkeypatch, 128, single=False, sync_free=True)


@pytest.mark.usefixtures("single_rank")
def test_single_weight_opens_te_gate_only_while_building_and_leaves_the_config(monkeypatch):
    """TE reads NVTE_GROUPED_LINEAR_SINGLE_PARAM in GroupedLinear.__init__ only: it is 1 while the linears
    are built and as it was after (unset, or a user's value); the layer's config is not modified."""
    import os

    from mok_megatron.compat import TE_SINGLE_PARAM_ENV

    for before in (None, "0"):
        if before is None:
            monkeypatch.delenv(TE_SINGLE_PARAM_ENV, raising=False)
        else:
            monkeypatch.setenv(TE_SINGLE_PARAM_ENV, before)
        experts = _te_experts(monkeypatch, 8, single=True)
        assert experts.linear_fc1.env_at_build == "1" and experts.linear_fc2.env_at_build == "1"
        assert os.environ.get(TE_SINGLE_PARAM_ENV) == before
        assert experts.linear_fc1.config.moe_single_grouped_weight
        assert not experts.config.moe_single_grouped_weight


@pytest.mark.usefixtures("single_rank")
def test_single_weight_state_dict_is_the_per_expert_layout_both_ways(monkeypatch):
    """A state dict of the single-weight layer has exactly the per-expert layer's keys and shapes
    (``linear_fc{1,2}.weight{i}``); each loads into the other (strict) with the same weights; a stacked
    ``linear_fc1.weight`` entry (TE's own single-weight state dict) loads too; ``stacked_fc*_weight`` are
    ``[L, N, K]`` copies of the grouped weight."""
    from mok_megatron.experts.checkpoint import convert_state_dict, detect_layout

    on, off = _te_experts(monkeypatch, 8, single=True), _te_experts(monkeypatch, 8, single=False)
    with torch.no_grad():
        off.linear_fc1.weight3.mul_(-2)
        off.linear_fc2.weight7.add_(1)
    sd_on, sd_off = on.state_dict(), off.state_dict()
    assert {k: tuple(v.shape) for k, v in sd_on.items()} == {k: tuple(v.shape) for k, v in sd_off.items()}
    assert detect_layout(sd_on, "") == "te_grouped"
    assert set(convert_state_dict(sd_on, "mok")) == {"fc1_weight", "fc2_weight"}
    for i in range(8):  # views of the grouped storage, no copy
        assert sd_on[f"linear_fc1.weight{i}"].data_ptr() == on.linear_fc1.weight[i].data_ptr()

    on.load_state_dict(sd_off, strict=True)
    torch.testing.assert_close(on.stacked_fc1_weight, off.stacked_fc1_weight, rtol=0, atol=0)
    torch.testing.assert_close(on.stacked_fc2_weight, off.stacked_fc2_weight, rtol=0, atol=0)
    assert on.stacked_fc1_weight.shape == (8, 16, 16)
    assert on.stacked_fc1_weight.data_ptr() != on.linear_fc1.weight.data_ptr()  # read-only copy

    fresh = _te_experts(monkeypatch, 8, single=False)
    fresh.load_state_dict(on.state_dict(), strict=True)
    torch.testing.assert_close(fresh.stacked_fc1_weight, off.stacked_fc1_weight, rtol=0, atol=0)

    grouped = {
        "linear_fc1.weight": off.stacked_fc1_weight,
        "linear_fc2.weight": off.stacked_fc2_weight,
        "linear_fc1._extra_state": None,
        "linear_fc2._extra_state": None,
    }
    for target in (_te_experts(monkeypatch, 8, single=True), _te_experts(monkeypatch, 8, single=False)):
        target.load_state_dict({k: v for k, v in grouped.items() if v is not None}, strict=False)
        torch.testing.assert_close(target.stacked_fc2_weight, off.stacked_fc2_weight, rtol=0, atol=0)


def _single_check(**over):
    kw = dict(
        supported=True,
        route=te.GroupedRoute(True),
        recipe="tensorwise",
        env=None,
        fp8_param=False,
        te_version="2.20.2",
    )
    kw.update(over)
    te.check_single_weight(**kw)


def test_single_weight_refusals_name_the_value_and_the_fix_in_one_line():
    from megatron.core.enums import Fp8Recipe

    from mok_megatron.options import MoKOptions, MoKOptionsError

    _single_check()
    _single_check(recipe="mxfp8", fp8_param=True)
    off = te.GroupedRoute(False)
    cases = [
        (
            dict(supported=False, te_version="2.19.0"),
            r"Transformer Engine 2\.19\.0 has no single grouped weight.*>=2\.20.*drop --mok-te-single-weight",
        ),
        (
            dict(route=off, env="0"),
            r"not run tensorwise here: NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=0.*unset",
        ),
        (
            dict(route=_route("blockwise", 130100), recipe="blockwise"),
            r"not run blockwise here: .*cuBLASLt >= 13\.6 on sm_90.*nvidia-cublas.*or drop --mok-te-single-weight",
        ),
        (
            dict(route=off, recipe="delayed"),
            r"not run delayed here: TE's is_module_grouped_tensor_path_supported",
        ),
        (
            dict(fp8_param=True, recipe="blockwise"),
            r"--fp8-param-gather and --fp8-recipe blockwise.*mxfp8 / nvfp4",
        ),
    ]
    for over, pattern in cases:
        with pytest.raises(MoKConfigError, match=pattern) as err:
            _single_check(**over)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("--mok-te-single-weight"), msg
    with pytest.raises(MoKOptionsError, match=r"--mok-te-single-weight with --mok-expert-backend torch-fp8"):
        MoKOptions(expert_backend="torch-fp8", te_single_weight=True)
    assert MoKOptions(expert_backend="te", te_single_weight=True).te_single_weight
    # a TE that dropped single_grouped_weight (its env gate closed, an older TE) is caught at build
    cfg = SimpleNamespace(init_model_with_meta_device=False, fp8_recipe=Fp8Recipe.tensorwise)
    per_expert = SimpleNamespace(single_grouped_weight=False)
    with pytest.raises(MoKConfigError, match=r"built SimpleNamespace with one weight per expert"):
        te.check_grouped_weight_built(per_expert, cfg)
    te.check_grouped_weight_built(SimpleNamespace(single_grouped_weight=True, weight=torch.zeros(1)), cfg)


def test_single_weight_contract_takes_device_counts_at_any_expert_count(monkeypatch):
    from megatron.core.enums import Fp8Recipe

    from mok_megatron.options import MoKOptions

    cfg = _cfg(Fp8Recipe.blockwise)
    monkeypatch.setattr(te, "route_for", lambda config: te.GroupedRoute(True))
    opts = MoKOptions(expert_backend="te", te_single_weight=True)
    for n in (8, 128, 256):
        c = te.MoKTEGroupedMLP.contract(cfg, SimpleNamespace(num_local_experts=n), opts)
        assert c.alignment == 128 and c.device_counts and not c.host_counts, n


def test_bench_layer_has_single_weight_rows():
    from mok_megatron.bench.suite import FP8_IMPLS, check_impls
    from mok_megatron.options import MoKOptions

    check_impls(["mok", "mok-te-tensorwise-single", "mok-te-blockwise-single", "mok-torch-fp8"])
    for name in ("mok-te-tensorwise-single", "mok-te-blockwise-single"):
        backend, recipe, options = FP8_IMPLS[name]
        assert MoKOptions(expert_backend=backend, **options).te_single_weight and recipe in name
    assert not any(o for _, _, o in (FP8_IMPLS[n] for n in ("mok-te-tensorwise", "mok-torch-fp8")))


def test_recipe_refusal_on_a_gpu_without_fp8_names_bf16():
    from mok_megatron.errors import MoKConfigError
    from mok_megatron.experts.backend import check_recipe_capability

    with pytest.raises(MoKConfigError) as e:
        check_recipe_capability("blockwise", (8, 0))
    msg = str(e.value)
    assert "sm_80" in msg and "drop --fp8-format" in msg and "--fp8-recipe  " not in msg, msg
