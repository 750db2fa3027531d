"""``mok bench train --profile-step``'s trace reading: the kernel-name categories (names as CUDA's profiler
reports them for cuBLAS, CUTLASS, QuACK, Transformer Engine, torch, NCCL and MoK's Triton kernels), MoK's
kernel table against the kernels the package defines, and the summary of a small chrome trace written here."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from mok_megatron.bench.train_profile import (
    CATEGORIES,
    CATEGORY_NAMES,
    MOK_KERNELS,
    kernel_category,
    profile_table,
    summarize_trace,
    trace_path,
    valid_profile_steps,
)

PACKAGE = Path(__file__).resolve().parent.parent / "mok_megatron"

NAMES = [
    # GEMMs: cuBLAS(Lt), nvjet, CUTLASS, QuACK (CuTe DSL); FP8 GEMMs name their operand types
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false, __nv_bfloat16, "
     "__nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
     "__nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*)", "gemm"),
    ("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultEpiMixin_object_at__tensorptrbf16gmemalign16o"
     "1048576409640961_0", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
     "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, float_e4m3_t>>>", "gemm"),
    # attention: cuDNN's fused attention (its name says wgmma too), flash, Megatron's fused softmax, RoPE
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>"
     ", false, true, false>(flash::Flash_fwd_params)", "attention"),
    ("void fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t"
     ", cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("void scaled_upper_triang_masked_softmax_warp_forward<__nv_bfloat16, __nv_bfloat16, float, 12>"
     "(__nv_bfloat16*, __nv_bfloat16 const*, float, int, int, int)", "attention"),
    ("void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16>(__nv_bfloat16 const*, float const*, "
     "__nv_bfloat16*, bool, int, int, int, int, int, int, int, int, int, int, int, int)", "attention"),
    # MoE: routing, top-k, sort, permute / unpermute (Transformer Engine's, torch's, MoK's)
    ("void transformer_engine::fused_topk_with_score_function_forward_kernel<float>(float const*, int, int, "
     "int, bool, int, int, int, float, float const*, float*, bool*, float*)", "moe"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float "
     "const, unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int)", "moe"),
    ("void transformer_engine::moe_unpermute_kernel<__nv_bfloat16, float, true>(__nv_bfloat16 const*, "
     "__nv_bfloat16*, int const*, float const*, int, int, int)", "moe"),
    ("void transformer_engine::moe_permute_kernel<__nv_fp8_e4m3, float, false>(__nv_fp8_e4m3 const*, "
     "__nv_fp8_e4m3*, int const*, float const*, int, int, int)", "moe"),
    ("_row_id_map_pass_1_kernel", "moe"),
    ("_sort_chunks_by_map_kernel", "moe"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, "
     "long, unsigned int>::Policy900, false, long, long, unsigned int, int, int>(int*, int*, unsigned int*)",
     "moe"),
    ("_topk_kernel", "moe"),
    ("_scatter_kernel", "moe"),
    ("_gather_sum_kernel", "moe"),
    # FP8: Transformer Engine's quantize / cast-transpose / amax / scale, torch's cast to e4m3, MoK's kernels
    ("void transformer_engine::(anonymous namespace)::cast_transpose_kernel<8, false, __nv_bfloat16, "
     "__nv_fp8_e4m3>(__nv_bfloat16 const*, __nv_fp8_e4m3*, __nv_fp8_e4m3*, float const*, float*, float*, "
     "unsigned long, unsigned long)", "fp8"),
    ("void transformer_engine::detail::block_scaled_1d_cast_transpose_kernel<false, float, __nv_bfloat16, "
     "__nv_fp8_e4m3>(__nv_bfloat16 const*, __nv_fp8_e4m3*, __nv_fp8_e4m3*, float*, float*, unsigned long, "
     "unsigned long, unsigned long, unsigned long, float, bool, bool)", "fp8"),
    ("void transformer_engine::(anonymous namespace)::amax_kernel<8, true, __nv_bfloat16>(__nv_bfloat16 const*, "
     "float*, float*, unsigned long, unsigned long, float const*)", "fp8"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<3>, transformer_engine::multi_tensor_compute_scale::"
     "ComputeScaleAndScaleInvFunctor, float, float, bool>(long, int volatile*, TensorListMetadata<3>, "
     "transformer_engine::multi_tensor_compute_scale::ComputeScaleAndScaleInvFunctor, float, float, bool)",
     "fp8"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#14}::operator()() const::"
     "{lambda(c10::Float8_e4m3fn)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#14}::"
     "operator()() const::{lambda(c10::Float8_e4m3fn)#1}, std::array<char*, 2ul>)", "fp8"),
    ("_rowwise_kernel", "fp8"),
    ("_segment_amax_kernel", "fp8"),
    ("_quantize_permute_kernel", "fp8"),
    # optimizer: Adam, the gradient norm and the clip
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, float, int>, float, "
     "float, float, float, float, float, adamMode_t, float>(long, int volatile*, TensorListMetadata<4>, "
     "AdamFunctor<float, float, float, int>, float, float, float, float, float, float, adamMode_t, float)",
     "optimizer"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float, 512, 8>, float*, float*, "
     "bool, int>(long, int volatile*, TensorListMetadata<1>, L2NormFunctor<float, 512, 8>, float*, float*, "
     "bool, int)", "optimizer"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<2>, ScaleFunctor<float, float>, float*, float>(long, "
     "int volatile*, TensorListMetadata<2>, ScaleFunctor<float, float>, float*, float)", "optimizer"),
    # communication
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("_rows_kernel", "communication"),
    # the rest: elementwise (a mixed-dtype op's "LoadWithCast" is no FP8 cast), norms, reductions, copies
    ("void at::native::unrolled_elementwise_kernel<at::native::BUnaryFunctor<float, float, float, at::native::"
     "binary_internal::MulFunctor<float> >, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned "
     "int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory"
     "::StoreWithCast<1> >(int, at::native::BUnaryFunctor<float, float, float, at::native::binary_internal::"
     "MulFunctor<float> >, std::array<char*, 2ul>, TrivialOffsetCalculator<1, unsigned int>)", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::MaxNanFunctor<float> >, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native"
     "::func_wrapper_t<float, at::native::MaxNanFunctor<float> >, unsigned int, float, 4, 4>)", "other"),
    ("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<transformer_engine::normalization::"
     "Kernel_traits<float, __nv_bfloat16, __nv_bfloat16, float, unsigned int, 2048u, 1u, 1u, 4u, 16u, "
     "transformer_engine::normalization::Kernel_traits_base<2048u, float, __nv_bfloat16, __nv_bfloat16, "
     "float, unsigned int, 128u> > >(transformer_engine::normalization::FwdParams)", "other"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, "
     "-2, true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>)", "other"),
    ("_swiglu_fwd_kernel", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("Memset (Device)", "other"),
]  # fmt: skip


@pytest.mark.parametrize("name, category", NAMES, ids=[f"{c}-{i}" for i, (_, c) in enumerate(NAMES)])
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_docs_table_is_the_categories():
    """docs/bench-train.md's category table is ``CATEGORIES``' (name, what it holds), in order."""
    doc = (PACKAGE.parent / "docs" / "bench-train.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", doc.split("## One step profiled", 1)[1], re.MULTILINE)
    assert rows == [(name, what) for name, what, _ in CATEGORIES]


def test_every_category_is_reached():
    assert {c for _, c in NAMES} == set(CATEGORY_NAMES)


def test_mok_kernel_table_is_the_packages_triton_kernels():
    """Every Triton kernel MoK launches (a ``@jit`` function called as ``name[grid](...)``) has a category,
    and the table names no kernel the package does not launch (a renamed kernel would fall into "other"
    unseen). ``@jit`` helpers called from kernels are inlined and never reach the profiler."""
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    jitted = set(re.findall(r"^@\w*jit\w*[^\n]*\ndef (\w+)\(", text, re.MULTILINE))
    launched = {name for name in jitted if re.search(rf"\b{name}\[", text)}
    table = set(MOK_KERNELS)
    assert launched == table, (sorted(launched - table), sorted(table - launched))
    assert set(MOK_KERNELS.values()) <= set(CATEGORY_NAMES)


def test_valid_steps_leave_a_timed_step():
    assert valid_profile_steps(12, 2) == list(range(3, 12))
    assert valid_profile_steps(4, 1) == [2]  # iteration 4 is timed; N = 3 would leave none
    assert valid_profile_steps(3, 1) == []
    assert valid_profile_steps(5, 0) == [1, 2, 3, 4]


def test_trace_path_is_megatrons():
    """``megatron/training/training.py``: ``f"{args.tensorboard_dir}/../torch_profile"`` / rank-R.json.gz."""
    assert trace_path("/w/profile/mok/tensorboard") == "/w/profile/mok/torch_profile/rank-0.json.gz"
    assert trace_path("/w/tb/", rank=3) == "/w/torch_profile/rank-3.json.gz"


# ---- the summary of one trace ----------------------------------------------------------------------

GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"
CAST = (
    "void transformer_engine::(anonymous namespace)::cast_transpose_kernel<8, false, __nv_bfloat16, "
    "__nv_fp8_e4m3>"
)
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _kernel(name, ts, dur, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}


def _trace(step=3):
    """Step ``step``: host span 10 ms; on the GPU a GEMM 4 ms + 2 ms, a cast 1 ms, NCCL 3 ms on a second
    stream overlapping the first GEMM by 2 ms, a 0.5 ms memcpy; host ops are not device time."""
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": 0, "dur": 10_000},
            # the marker's device-side copy spans first to last kernel: not the step's host time
            {
                "ph": "X",
                "cat": "gpu_user_annotation",
                "name": f"ProfilerStep#{step}",
                "ts": 100,
                "dur": 12_000,
            },
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 50, "dur": 5_000},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 8},
            _kernel(GEMM, 1_000, 4_000),
            _kernel(NCCL, 3_000, 3_000, stream=20),
            _kernel(CAST, 6_000, 1_000),
            _kernel(GEMM, 7_000, 2_000),
            _kernel("Memcpy DtoD (Device -> Device)", 9_000, 500, cat="gpu_memcpy"),
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 1_000, "id": 1},
        ],
    }


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_summarize_trace(tmp_path, suffix):
    path = tmp_path / f"rank-0{suffix}"
    data = json.dumps(_trace()).encode()
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    s = summarize_trace(str(path), step=3)
    assert (s["step"], s["rank"], s["trace"]) == (3, 0, str(path))
    assert s["step_ms"] == 10.0 and s["kernels"] == 5
    assert s["kernel_ms"] == pytest.approx(10.5) and s["gpu_busy_ms"] == pytest.approx(8.5)
    cats = s["categories"]
    assert list(cats) == list(CATEGORY_NAMES)
    assert (cats["gemm"]["ms"], cats["gemm"]["count"]) == (pytest.approx(6.0), 2)
    assert cats["communication"]["ms"] == pytest.approx(3.0) and cats["fp8"]["ms"] == pytest.approx(1.0)
    assert cats["other"]["ms"] == pytest.approx(0.5)
    assert cats["attention"] == {"ms": 0.0, "count": 0, "share": 0.0}
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert cats["gemm"]["share"] == pytest.approx(6.0 / 10.5)
    assert [(k["name"], k["category"], k["count"]) for k in s["top"]] == [
        (GEMM, "gemm", 2), (NCCL, "communication", 1), (CAST, "fp8", 1),
        ("Memcpy DtoD (Device -> Device)", "other", 1),
    ]  # fmt: skip
    assert summarize_trace(str(path), step=3, top=1)["top"] == [
        {"name": GEMM, "category": "gemm", "ms": pytest.approx(6.0), "count": 2}
    ]
    text = profile_table({"mok": s, "alltoall": s})
    assert re.search(r"^gemm +6\.00 \( 57 %\) +6\.00 \( 57 %\)$", text, re.MULTILINE), text
    assert "mok: top 4 kernels of step 3 (rank 0)" in text and "x2     gemm" in text


def test_a_cpu_trace_has_no_device_time(tmp_path):
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in {"kernel", "gpu_memcpy"}]
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps(trace))
    s = summarize_trace(str(path), step=3)
    assert s["kernels"] == 0 and s["kernel_ms"] == 0.0 and s["top"] == [] and s["step_ms"] == 10.0
    assert "mok: no GPU kernels in" in profile_table({"mok": s})


def test_a_trace_of_another_step_or_no_trace_is_one_line(tmp_path):
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps(_trace(step=4)))
    with pytest.raises(ValueError) as e:
        summarize_trace(str(path), step=3)
    assert str(e.value) == f"{path}: no ProfilerStep#3 span (the trace holds ProfilerStep#4)"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"rank-0\.json: not a readable chrome trace \("):
        summarize_trace(str(path), step=3)
    path.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match=r"no traceEvents list; not a chrome trace$"):
        summarize_trace(str(path), step=3)
