"""mok_megatron.kernels: references against the ops they replace (hand-worked and exact), the Triton kernels
against the references on CPU under Triton's interpreter (one subprocess with TRITON_INTERPRET=1, since
Triton picks the interpreter when a kernel is defined), every kernel compiled for sm_90 without a GPU, and
the same cases plus real sizes on CUDA (marked gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton
from mok_megatron.kernels import INTERPRETED, Impl
from mok_megatron.kernels.combine import combine, combine_reference
from mok_megatron.kernels.permute import permute, permute_reference
from mok_megatron.kernels.routing import RoutingMeta, routing_metadata, routing_metadata_reference
from mok_megatron.kernels.swiglu import swiglu, swiglu_backward, swiglu_backward_reference, swiglu_reference
from mok_megatron.ops.activation import Activation, ActivationSpec, apply_activation
from mok_megatron.ops.permute import combine_tokens_reference, permute_tokens_reference
from mok_megatron.ops.routing import dropless_order, slot_map
from tests.interpret import interpreted
from tests.kernel_cases import CPU_CASES, GPU_CASES, TOL, topk_ids

REPO = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _routing_map(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    live = ids_TK >= 0
    rm = torch.zeros(ids_TK.shape[0], num_experts + 1, dtype=torch.bool)
    rm.scatter_(1, torch.where(live, ids_TK, num_experts), True)
    return rm[:, :num_experts]


# ---- references: hand-worked and against the ops they replace -----------------------------------------------


def test_routing_reference_hand_worked():
    # expert 0: tokens 0, 2 -> rows 0, 1 (+2 pad); expert 1: token 2 -> row 4 (+3 pad); expert 2: tokens 0, 1 -> 8, 9.
    ids = torch.tensor([[0, 2], [2, -1], [1, 0]])
    meta = routing_metadata_reference(ids, num_experts=3, alignment=4)
    assert meta.counts_E.tolist() == [2, 1, 2]
    assert meta.offsets_E.tolist() == [2, 3, 5]
    assert meta.aligned_offsets_E.tolist() == [4, 8, 12]
    assert meta.row_TK.tolist() == [[0, 8], [9, -1], [4, 1]]
    assert meta.num_rows == 6 + 3 * 3


@pytest.mark.parametrize("T,K,E", [(13, 2, 5), (1, 1, 1), (40, 8, 9), (64, 8, 128)])
def test_routing_reference_matches_dropless_order_and_slot_map(T, K, E):
    ids = topk_ids(T, K, E, "none", seed=T)
    meta = routing_metadata_reference(ids, E)
    token_idx_N, expert_idx_N = dropless_order(_routing_map(ids, E), T * K)
    rows = meta.row_TK.long()
    assert torch.equal(token_idx_N[rows], torch.arange(T).view(-1, 1).expand(T, K))
    assert torch.equal(expert_idx_N[rows], ids)
    # slot_map lists each token's rows in ascending expert order, i.e. ascending row order.
    assert torch.equal(rows.sort(dim=1).values, slot_map(token_idx_N, None, T, K).row_TK)
    assert torch.equal(meta.counts_E.long(), _routing_map(ids, E).sum(0))


@pytest.mark.parametrize("alignment", [16, 32, 128])
def test_routing_reference_alignment(alignment):
    ids = topk_ids(100, 4, 7, "some", seed=alignment)
    plain = routing_metadata_reference(ids, 7)
    meta = routing_metadata_reference(ids, 7, alignment)
    sizes = torch.diff(meta.aligned_offsets_E, prepend=meta.aligned_offsets_E.new_zeros(1))
    assert torch.all(sizes % alignment == 0) and torch.all(sizes >= meta.counts_E)
    assert torch.all(sizes - meta.counts_E < alignment)
    assert torch.equal(meta.counts_E, plain.counts_E) and torch.equal(meta.offsets_E, plain.offsets_E)
    # Same order inside each expert, shifted by the padding of the experts before it.
    live = plain.row_TK >= 0
    e = ids.clamp(min=0)
    shift = (meta.aligned_offsets_E - sizes - (plain.offsets_E - plain.counts_E))[e]
    assert torch.equal(meta.row_TK[live], (plain.row_TK + shift)[live])
    assert torch.all(meta.row_TK[~live] == -1)
    assert int(meta.aligned_offsets_E[-1]) <= meta.num_rows


def test_permute_reference_matches_ops_permute():
    T, K, E, H = 11, 3, 6, 8
    ids = topk_ids(T, K, E, "none")
    x = torch.randn(T, H)
    probs_TK = torch.rand(T, K)
    meta = routing_metadata_reference(ids, E)
    x_RH, probs_R = permute_reference(x, meta, probs_TK)
    token_idx_N, expert_idx_N = dropless_order(_routing_map(ids, E), T * K)
    probs_TE = torch.zeros(T, E).scatter(1, ids, probs_TK)
    assert torch.equal(x_RH, permute_tokens_reference(x, token_idx_N))
    assert torch.equal(probs_R, probs_TE[token_idx_N, expert_idx_N])


def test_permute_reference_zero_fills_padding():
    ids = torch.tensor([[0, 2], [2, -1], [1, 0]])
    meta = routing_metadata_reference(ids, 3, alignment=4)
    x = torch.arange(1.0, 4.0).view(3, 1)
    x_RH, probs_R = permute_reference(x, meta, torch.full((3, 2), 0.5))
    want = [1, 3, 0, 0, 3, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0]
    assert x_RH.view(-1).tolist() == want
    assert probs_R.tolist() == [0.5 if v else 0.0 for v in want]


def test_combine_reference_matches_ops_combine():
    T, K, E, H = 11, 3, 6, 8
    ids = topk_ids(T, K, E, "none")
    meta = routing_metadata_reference(ids, E)
    token_idx_N, _ = dropless_order(_routing_map(ids, E), T * K)
    y = torch.randn(T * K, H)
    torch.testing.assert_close(combine_reference(y, meta), combine_tokens_reference(y, token_idx_N, T))
    probs = torch.rand(T, K)
    weighted = combine_reference(y, meta, probs)
    by_hand = sum(probs[:, k : k + 1] * y[meta.row_TK[:, k].long()] for k in range(K))
    torch.testing.assert_close(weighted, by_hand)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_reference_matches_ops_activation(dtype):
    h = torch.randn(37, 2 * 24).to(dtype)
    probs = torch.rand(37)
    spec = ActivationSpec(Activation.SILU, gated=True)
    want = apply_activation(h, spec, probs)
    got = swiglu_reference(h, probs)
    # ops rounds silu(gate) * up to bf16 before the probability multiply; the kernels round once.
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(swiglu_reference(h), apply_activation(h, spec, None), **TOL[dtype])


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_swiglu_backward_reference_is_the_forwards_autograd(with_probs):
    h = torch.randn(29, 2 * 12)
    probs = torch.rand(29) if with_probs else None
    da = torch.randn(29, 12)
    leaves = [h.requires_grad_()] + ([probs.requires_grad_()] if with_probs else [])
    want = torch.autograd.grad(swiglu_reference(h, probs), leaves, da)
    dh, dp = swiglu_backward_reference(h.detach(), None if probs is None else probs.detach(), da)
    torch.testing.assert_close(dh, want[0])
    if with_probs:
        torch.testing.assert_close(dp, want[1])
    else:
        assert dp is None
    with pytest.raises(ValueError, match=r"swiglu_backward: da has shape \(29, 11\), expected \(29, 12\)"):
        swiglu_backward(h.detach(), None, da[:, :11])


# ---- errors ----------------------------------------------------------------------------------------------------


def test_errors_name_the_bad_value():
    ids = topk_ids(4, 2, 3, "none")
    meta = routing_metadata_reference(ids, 3)
    with pytest.raises(ValueError, match=r"topk_idx has shape \(8,\), expected \[T, K\]"):
        routing_metadata(ids.view(-1), 3)
    with pytest.raises(TypeError, match="topk_idx has dtype torch.float32"):
        routing_metadata(ids.float(), 3)
    with pytest.raises(ValueError, match="alignment=0"):
        routing_metadata(ids, 3, alignment=0)
    with pytest.raises(ValueError, match="num_experts=0"):
        routing_metadata(ids, 0)
    with pytest.raises(TypeError, match="impl='triton' is not a mok_megatron.kernels.Impl"):
        routing_metadata(ids, 3, impl="triton")
    with pytest.raises(ValueError, match=r"permute: x has shape \(5, 8\), expected \[T, H\] with T = 4"):
        permute(torch.randn(5, 8), meta)
    with pytest.raises(ValueError, match=r"combine: y has shape \(7, 8\), expected \[R, H\] with R = .* = 8"):
        combine(torch.randn(7, 8), meta)
    with pytest.raises(ValueError, match=r"combine: probs has shape \(4, 3\), expected \(4, 2\)"):
        combine(torch.randn(8, 8), meta, torch.rand(4, 3))
    with pytest.raises(ValueError, match="permute: x is on meta but the routing metadata is on cpu"):
        permute(torch.empty(4, 8, device="meta"), meta)
    with pytest.raises(ValueError, match=r"swiglu: h has shape \(3, 5\)"):
        swiglu(torch.randn(3, 5))


@pytest.mark.skipif(not have_triton() or INTERPRETED, reason="needs Triton, not in interpreter mode")
def test_triton_on_cpu_without_interpreter_says_how():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        swiglu(torch.randn(3, 4), impl=Impl.TRITON)


def test_bench_fp8_weights_are_the_models_and_plans_parse():
    """benchmarks.kernels' FP8 weight table: the Qwen3-30B-A3B and DeepSeek-V3 slice expert weights
    [G, N, K], and ``--weight-plans`` items PxK[wW] (a bad one named)."""
    from benchmarks.kernels import SHAPES, parse_weight_plans, weight_shapes

    dims = [d for name in ("qwen3-30b-a3b", "deepseek-v3-slice") for _, d in weight_shapes(SHAPES[name])]
    assert dims == [(128, 1536, 2048), (128, 2048, 768), (8, 4096, 7168), (8, 7168, 2048)]
    assert parse_weight_plans("1x16, 2x32w4,") == [(1, 16, None), (2, 32, 4)]
    assert parse_weight_plans("") == []
    for bad in ("2x48", "0x16", "x16", "2x16w0", "2by16", "2x16w"):
        with pytest.raises(ValueError, match=f"'{bad}' is not PxK"):
            parse_weight_plans(bad)


def test_auto_on_cpu_is_the_reference():
    if INTERPRETED:
        pytest.skip("in interpreter mode AUTO runs Triton on CPU")
    h = torch.randn(5, 6)
    assert torch.equal(swiglu(h), swiglu_reference(h))
    meta = routing_metadata(topk_ids(5, 2, 3, "some"), 3, 4)
    want = routing_metadata_reference(topk_ids(5, 2, 3, "some"), 3, 4)
    assert isinstance(meta, RoutingMeta) and torch.equal(meta.row_TK, want.row_TK)


# ---- the Triton kernels on CPU, interpreted ---------------------------------------------------------------------


INTERPRETED_RUN = ("-m", "tests.kernel_cases", "--device", "cpu", "--json", "{json}")


@pytest.fixture(scope="module")
def interpreted_results():
    if not have_triton():
        pytest.skip("Triton is not installed")
    return interpreted(list(INTERPRETED_RUN))


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_triton_interpreted_matches_reference(case, interpreted_results):
    assert interpreted_results[case] == "ok", interpreted_results[case]


# ---- every kernel compiles for Hopper (sm_90), no GPU needed ----------------------------------------------------


def _sm90_specializations():
    from mok_megatron.kernels import permute as P
    from mok_megatron.kernels import routing as R
    from mok_megatron.kernels import swiglu as S
    from mok_megatron.kernels import topk as K

    i32, bf, fp = "*i32", "*bf16", "*fp32"
    return {
        "rank_in_block": (
            R._rank_in_block_kernel,
            dict(ids_ptr="*i64", rank_ptr=i32, hist_ptr=i32),
            dict(BLOCK=64, E_P2=128),
        ),
        "scan": (
            R._scan_kernel,
            dict(
                hist_ptr=i32, counts_ptr=i32, offsets_ptr=i32, aligned_offsets_ptr=i32, aligned_start_ptr=i32
            ),
            dict(CHUNK=64, E_P2=128),
        ),
        "place": (
            R._place_kernel,
            dict(ids_ptr="*i64", rank_ptr=i32, base_ptr=i32, aligned_start_ptr=i32, row_ptr=i32),
            dict(BLOCK=64),
        ),
        "scatter": (
            P._scatter_kernel,
            dict(
                src_ptr=bf,
                row_ptr=i32,
                scale_ptr=fp,
                dst_ptr=bf,
                other_ptr=bf,
                dot_ptr=fp,
                psrc_ptr=fp,
                pdst_ptr=fp,
            )
            | dict(offsets_ptr=i32, aligned_offsets_ptr=i32),
            dict(
                K=8, K_P2=8, E_P2=128, BLOCK_H=2048, FILL_ROWS=8, HAS_SCALE=True, HAS_DOT=True, HAS_PROBS=True
            ),
        ),
        "gather_sum": (
            P._gather_sum_kernel,
            dict(src_ptr=bf, row_ptr=i32, weight_ptr=fp, out_ptr=bf, psrc_ptr=fp, pdst_ptr=fp),
            dict(K=8, K_P2=8, BLOCK_H=1024, HAS_WEIGHT=True, HAS_PROBS=True),
        ),
        "swiglu_fwd": (
            S._swiglu_fwd_kernel,
            dict(h_ptr=bf, p_ptr=fp, a_ptr=bf, live_ptr=i32),
            dict(BLOCK_M=2, BLOCK_F=1024, HAS_PROBS=True, HAS_LIVE=True),
        ),
        "swiglu_bwd": (
            S._swiglu_bwd_kernel,
            dict(h_ptr=bf, p_ptr=fp, da_ptr=bf, dh_ptr=bf, dp_ptr=fp, live_ptr=i32),
            dict(BLOCK_M=2, BLOCK_F=1024, HAS_PROBS=True, HAS_LIVE=True),
        ),
        "topk": (K._topk_kernel, dict(s_ptr=fp, idx_ptr="*i64"), dict(K=8, BLOCK_T=64, BLOCK_E=128)),
    }


@pytest.mark.skipif(not have_triton() or INTERPRETED, reason="needs Triton, not in interpreter mode")
@pytest.mark.parametrize(
    "kernel", ["rank_in_block", "scan", "place", "scatter", "gather_sum", "swiglu_fwd", "swiglu_bwd", "topk"]
)
def test_kernel_compiles_for_sm90(kernel):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    fn, pointers, constexprs = _sm90_specializations()[kernel]
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    assert "cubin" in compiled.asm


# ---- on the GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_triton_on_gpu_matches_reference(case):
    GPU_CASES[case](device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernels_fwd_bwd_need_no_host_sync():
    ids = topk_ids(4096, 8, 128, "some").cuda()
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)
    probs = torch.rand(4096, 8, device="cuda", requires_grad=True)

    def step():
        meta = routing_metadata(ids, 128, 128, impl=Impl.TRITON)
        x_RH, probs_R = permute(x, meta, probs, impl=Impl.TRITON)
        a = swiglu(torch.cat([x_RH, x_RH], dim=1), probs_R, impl=Impl.TRITON)
        combine(a, meta, probs, impl=Impl.TRITON).sum().backward()

    step()  # compile the kernels first
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_link_delay_needs_a_gpu_and_says_so():
    from mok_megatron.kernels.link_delay import spin_ns

    with pytest.raises(ValueError, match="CUDA device.*got cpu"):
        spin_ns(1000, torch.device("cpu"))


def test_permute_keeps_zeroing_padding_inside_aligned_groups():
    meta = routing_metadata(topk_ids(5, 2, 3, "none"), 3, 16, impl=Impl.TORCH)
    with pytest.raises(ValueError, match="zero_spare_rows=False with alignment 16"):
        permute(torch.randn(5, 8), meta, zero_spare_rows=False)
