"""Tile-level consumption (mok_megatron.nvlink.tile_gemm): the tile table, the grouped GEMM and the chunk mover
interpreted on CPU against their references (flags set as a finished mover leaves them), both kernels
compiled for sm_90 (wgmma, system/GPU-scope flag ordering, %globaltimer pacing), and on a GPU the GEMM at
real sizes against torch._grouped_mm and run concurrently with a paced mover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton
from mok_megatron.nvlink.tile_gemm import grouped_mm_reference, tile_table

REPO = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_tile_table_hand_worked():
    # experts of 5, 0 and 9 rows, blocks of 4: expert 0 -> rows 0, 4; expert 2 -> rows 5, 9, 13
    e, m0 = tile_table(torch.tensor([5, 5, 14]), rows=14, bm=4)
    assert e.tolist() == [0, 0, 2, 2, 2, -1, -1] and m0.tolist() == [0, 4, 5, 9, 13, 0, 0]
    e, _ = tile_table(torch.tensor([0, 0]), rows=0, bm=4)
    assert e.tolist() == [-1, -1]


def run_cases(device: str = "cpu") -> dict:
    """The kernels against the references on ``device`` (CPU: needs TRITON_INTERPRET=1)."""
    from mok_megatron.nvlink.tile_gemm import grouped_mm_landed, land_rows

    res = {}
    g = torch.Generator().manual_seed(0)
    tol = 1e-4 if device == "cpu" else 3e-2  # fp32 operands: TF32 tensor cores on a GPU
    for name, counts, K, N, tile in (
        ("uneven", [5, 0, 23, 9], 32, 40, (16, 16, 16, 4, 1)),
        ("one-expert", [17], 16, 16, (16, 16, 16, 4, 1)),
    ):
        R, E = sum(counts), len(counts)
        x = torch.randn(R, K, generator=g).to(device)
        w = torch.randn(E, N, K, generator=g).to(device)
        ends = torch.tensor(counts).cumsum(0).to(device, torch.int32)
        ref = grouped_mm_reference(x, w, ends)
        plain = grouped_mm_landed(x, w, ends, programs=3, tile=tile)
        # a finished mover: every chunk landed at this epoch
        epoch = torch.tensor([3], dtype=torch.int64, device=device)
        landed = torch.zeros((R + 7) // 8, dtype=torch.int64, device=device)
        src = torch.randn(R, K, generator=g).to(device)
        moved = land_rows(torch.zeros_like(src), src, landed, epoch, chunk=8, programs=2)
        waited = grouped_mm_landed(moved, w, ends, landed, epoch, chunk=8, programs=3, tile=tile)
        res[name] = dict(
            plain=bool(torch.allclose(plain, ref, rtol=tol, atol=tol)),
            moved=bool(torch.equal(moved, src)),
            landed=landed.tolist() == [3] * landed.numel(),
            waited=bool(torch.allclose(waited, grouped_mm_reference(src, w, ends), rtol=tol, atol=tol)),
        )
    return res


_INTERPRETED = """
import json
from tests.test_tile_gemm import run_cases
print(json.dumps(run_cases()))
"""


@pytest.mark.skipif(not have_triton(), reason="needs Triton")
def test_kernels_interpreted_equal_references():
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res and all(all(v.values()) for v in res.values()), res


def test_bad_shapes_are_named():
    from mok_megatron.nvlink.tile_gemm import grouped_mm_landed

    x, w = torch.zeros(4, 24), torch.zeros(2, 8, 24)
    with pytest.raises(ValueError, match="K=24 must be a multiple of the tile's BK=64"):
        grouped_mm_landed(x, w, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="3 row ends for 2 experts"):
        grouped_mm_landed(x, w, torch.tensor([1, 2, 4]))


@pytest.mark.skipif(
    not have_triton() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"
)
def test_kernels_compile_for_sm90():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_megatron.nvlink import tile_gemm as G

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")

    def ptx(fn, constexprs, types):
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    bf16 = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", landed_ptr="*i64", epoch_ptr="*i64")
    types = dict(bf16, tile_e_ptr="*i32", tile_m0_ptr="*i32", ends_ptr="*i32")
    for wait in (False, True):
        p = ptx(
            G._grouped_mm_kernel,
            dict(WAIT=wait, SPIN_LIMIT=1 << 26, TRAP=True, BM=128, BN=256, BK=64, TMA=False),
            types,
        )
        assert "wgmma.mma_async" in p  # Hopper tensor cores
        assert ("ld.global.sys.acquire" in p) == wait
    types = dict(dst_ptr="*i64", src_ptr="*i64", landed_ptr="*i64", epoch_ptr="*i64", NS_PER_CHUNK="i64")
    for paced in (False, True):
        p = ptx(G._land_kernel, dict(PACED=paced, BLOCK_R=4, BLOCK_W=1024), types)
        assert "atom.global.gpu.release.exch.b64" in p and ("%globaltimer" in p) == paced


@pytest.mark.gpu
@needs_cuda
def test_gpu_cases_and_real_sizes_against_grouped_mm():
    """Small cases as on CPU; then DeepSeek-V3's fc1 (8 experts, 2048 x 2 wide, hidden 7168) in bf16 against
    torch._grouped_mm (fp32 accumulation both: close, not bitwise), and the GEMM waiting on a paced mover
    (two streams) bitwise equal to the same GEMM without flags."""
    from mok_megatron.nvlink.tile_gemm import grouped_mm_landed, land_rows

    res = run_cases("cuda")
    assert all(all(v.values()) for v in res.values()), res
    g = torch.Generator(device="cuda").manual_seed(1)
    counts = [4096 + 37 * i - 150 for i in range(8)]
    R, K, N = sum(counts), 7168, 4096
    x = (torch.randn(R, K, device="cuda", generator=g) * 0.1).bfloat16()
    w = (torch.randn(8, N, K, device="cuda", generator=g) * 0.1).bfloat16()
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    plain = grouped_mm_landed(x, w, ends)  # TMA operands on sm_90+
    for y in (plain, grouped_mm_landed(x, w, ends, tma=False)):
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    landed = torch.zeros((R + 127) // 128, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    dst = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        land_rows(dst, x, landed, epoch, chunk=128, programs=16, gbps=900)
    y = grouped_mm_landed(dst, w, ends, landed, epoch, chunk=128, programs=sms - 16)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, plain) and torch.equal(dst, x)
