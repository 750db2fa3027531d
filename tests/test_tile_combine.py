"""kernels.tile_combine: the per-route slots and the completion visiting order (hand-worked and against
brute force), the reference's wait check, one-line errors; the kernel under Triton's interpreter with every
done counter preset (one subprocess running this module's ``__main__`` over ``CASES``), bitwise
``kernels.combine``; on an sm_90 GPU (marked gpu) the same cases, and the kernel launched first on K
programs beside the waiting GEMM that releases its counters (``sms_held_back=K``, counters from 0), in a
subprocess with a timeout so a hang fails.

Legend: T tokens, K routes per token, E experts, H hidden, F the experts' FFN width, S counter slots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

from mok_megatron.compat import have_triton
from mok_megatron.kernels import INTERPRETED, Impl
from mok_megatron.kernels import tile_combine as tc
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels.combine import combine, combine_reference
from mok_megatron.kernels.routing import routing_metadata_reference
from tests.interpret import interpreted
from tests.harness.gpu import needs_sm90_quack

REPO = Path(__file__).resolve().parent.parent
SMALL = tg.TileConfig(tile_m=4, tile_n=16, cluster_m=2, max_swizzle=2)
# bf16 GEMM outputs of fp32 accumulations in another order (QuACK's tiles against cuBLAS), summed over K routes
BF16_SUM = dict(rtol=1.6e-2, atol=3e-2)


def _case(T, K, E, H, *, alignment=1, seed=0, drop=(), expert=None, device="cpu", cfg=SMALL):
    """Routing of T tokens to K of E experts (``expert``: every route to that one; ``drop``: routes (t, k)
    dropped), fc2's output y in the aligned layout, the plan over it and fp32 probabilities."""
    gen = torch.Generator().manual_seed(seed)
    if expert is None:
        ids = (
            torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K)
        )
    else:
        ids = torch.full((T, K), expert)
    ids = ids.long()
    for t, k in drop:
        ids[t, k] = -1
    meta = routing_metadata_reference(ids.to(device), E, alignment)
    plan = tg.tile_plan(meta.aligned_offsets_E, meta.num_rows, H, cfg)
    y = torch.randn(meta.num_rows, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    probs = torch.rand(T, K, generator=gen).to(device)
    return meta, plan, y, probs


# ---- pure functions ----------------------------------------------------------------------------------------


def test_token_slots_hand_worked():
    # 3 tokens, 2 routes, 2 experts; rows of expert 0: routes (0,0) (1,1) (2,0); expert 1: (0,1) (2,1)
    # tile_m 2, clusters of 1: expert 0's rows 0-2 are slots 0 (rows 0, 1) and 1 (row 2); expert 1's rows
    # 3-4 slot 2; route (1,0) dropped
    cfg = tg.TileConfig(tile_m=2, tile_n=8, cluster_m=1)
    meta = routing_metadata_reference(torch.tensor([[0, 1], [-1, 0], [0, 1]]), 2)
    assert meta.row_TK.tolist() == [[0, 3], [-1, 1], [2, 4]]
    plan = tg.tile_plan(meta.offsets_E, meta.num_rows, 8, cfg)
    assert tc.token_slots(meta, plan).tolist() == [[0, 2], [-1, 0], [1, 2]]


@pytest.mark.parametrize("alignment", [1, 4])
def test_token_slots_are_the_row_slots_of_each_route(alignment):
    meta, plan, _, _ = _case(29, 3, 6, 40, alignment=alignment, drop=[(2, 1), (7, 0)])
    slot_TK = tc.token_slots(meta, plan)
    slot_M = tg.row_slots(meta.aligned_offsets_E, meta.num_rows, SMALL)
    for t in range(29):
        for k in range(3):
            row = int(meta.row_TK[t, k])
            assert int(slot_TK[t, k]) == (-1 if row < 0 else int(slot_M[row]))
    assert slot_TK.dtype == torch.int32


def test_token_order_follows_the_latest_slot_of_each_token():
    # slots complete at table positions 5, 1, 9, -1 (slot 3 covered by no work item)
    done_rank_S = torch.tensor([5, 1, 9, -1])
    slot_TK = torch.tensor([[0, 1], [1, 1], [2, 0], [-1, -1], [1, -1], [0, 0]], dtype=torch.int32)
    # latest per token: 5, 1, 9, none, 1, 5 -> the token with no live route, then 1, 4 (tie: token order),
    # then 0, 5, then 2
    assert tc.token_order(slot_TK, done_rank_S).tolist() == [3, 1, 4, 0, 5, 2]


def test_token_order_of_a_plan_is_a_permutation_in_completion_order():
    meta, plan, _, _ = _case(41, 2, 5, 40, alignment=2)
    slot_TK = tc.token_slots(meta, plan)
    rank_S = tg.slot_done_rank(plan)
    order = tc.token_order(slot_TK, rank_S)
    assert sorted(order.tolist()) == list(range(41))
    latest = rank_S[slot_TK.long()].amax(1)[order.long()]
    assert bool(torch.all(latest[1:] >= latest[:-1]))


# ---- the reference -----------------------------------------------------------------------------------------


def test_reference_is_the_combine_once_every_slot_is_complete():
    meta, plan, y, probs = _case(23, 3, 4, 40, alignment=4, drop=[(5, 2)])
    slot_TK = tc.token_slots(meta, plan)
    done = tg.done_counts_reference(plan)
    for p in (None, probs):
        out = tc.tile_combine(y, meta, slot_TK, done, plan.done_targets_S, p, torch.float32, impl=Impl.TORCH)
        assert torch.equal(out, combine_reference(y, meta, p, torch.float32))


def test_reference_names_the_route_that_would_wait_forever():
    meta, plan, y, probs = _case(6, 2, 3, 40)
    slot_TK = tc.token_slots(meta, plan)
    done = plan.done_targets_S.clone()
    t, k = 4, 1
    s = int(slot_TK[t, k])
    done[s] -= 1
    first = (slot_TK == s).nonzero()[0].tolist()  # the first route on that slot, token order
    with pytest.raises(RuntimeError, match=rf"token {first[0]}, route {first[1]} waits for done slot {s} to "
                       rf"reach 3; it holds 2"):  # fmt: skip
        tc.tile_combine(y, meta, slot_TK, done, plan.done_targets_S, probs, impl=Impl.TORCH)


def test_errors_name_the_bad_value():
    meta, plan, y, probs = _case(6, 2, 3, 40)
    slot_TK = tc.token_slots(meta, plan)
    done, target = plan.done_targets_S.clone(), plan.done_targets_S
    args = (meta, slot_TK, done, target)
    cases = [
        (lambda: tc.tile_combine(y[:-1], *args), r"tile_combine: y has shape \(11, 40\), expected \[R, H\] with R"),
        (lambda: tc.tile_combine(y, meta, slot_TK.long(), done, target), r"slot_TK is torch.int64 \(6, 2\), "
         r"expected int32 \(6, 2\) \(token_slots\(meta, plan\)\)"),
        (lambda: tc.tile_combine(y, meta, slot_TK, done[:-1], target), r"done \(7,\), targets \(8,\); both"),
        (lambda: tc.tile_combine(y, meta, slot_TK, done.long(), target.long()), r"done is torch.int64; it must"),
        (lambda: tc.tile_combine(y, *args, probs[:, :1]), r"probs has shape \(6, 1\), expected \(6, 2\)"),
        (lambda: tc.tile_combine(y, *args, order_T=torch.arange(5, dtype=torch.int32)), r"order is torch.int32 "
         r"\(5,\), expected int32 \(6,\): a permutation"),
        (lambda: tc.tile_combine(y, *args, programs=0), r"programs=0; it must be >= 1"),
        (lambda: tc.token_slots(meta, dataclasses.replace(plan, rows=11)), r"the plan has 11 rows, the "
         r"routing 12; build the plan over"),
    ]  # fmt: skip
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()


# ---- the kernel: cases run interpreted (CPU) and on the GPU ------------------------------------------------


def combine_case(
    T, K, E, H, *, device, programs, order, weighted=True, out_dtype=torch.float32, ahead=0, **kw
):
    """The kernel with every done counter preset (``ahead``: counters kept across that many earlier steps,
    the targets moved up alike) against the combine's Triton kernel and, in fp32 on CPU, its reference,
    bitwise."""
    meta, plan, y, probs = _case(T, K, E, H, device=device, **kw)
    probs = probs if weighted else None
    slot_TK = tc.token_slots(meta, plan)
    ncol = -(-H // plan.config.tile_n)
    target = plan.done_targets_S + torch.where(plan.done_targets_S > 0, ahead * ncol, 0).to(torch.int32)
    done = target.clone()
    order_T = tc.token_order(slot_TK, tg.slot_done_rank(plan)) if order == "completion" else None
    short = torch.zeros_like(target)  # a preload sums no token: it neither waits on these nor writes them
    tc.tile_combine(y, meta, slot_TK, short, target, probs, out_dtype, order_T=order_T, programs=programs,
                    impl=Impl.TRITON, preload=True)  # fmt: skip
    assert not short.any()
    out = tc.tile_combine(
        y, meta, slot_TK, done, target, probs, out_dtype, order_T=order_T, programs=programs, impl=Impl.TRITON
    )
    assert torch.equal(out, combine(y, meta, probs, out_dtype, impl=Impl.TRITON))
    if device == "cpu" and out_dtype == torch.float32:
        # the interpreter's fp32 sums are the reference's; its cast to bf16 rounds otherwise (the combine's
        # kernel, interpreted, differs from the reference alike), and on the GPU the compiler may fuse the
        # weight's multiply into the add (the combine's kernel alike)
        want = combine_reference(y, meta, probs, out_dtype)
        assert torch.equal(out, want), (out - want).abs().max()
    assert torch.equal(done, target)  # the acquire adds 0


def test_preload_on_the_torch_path_returns_without_waiting():
    """``preload=True`` where the reference runs (no Triton kernel to load): no check of the not yet complete
    counters, an output of the combine's shape, the counters untouched."""
    meta, plan, y, probs = _case(9, 2, 3, 16, device="cpu")
    slot_TK = tc.token_slots(meta, plan)
    done = torch.zeros_like(plan.done_targets_S)
    out = tc.tile_combine(y, meta, slot_TK, done, plan.done_targets_S, probs, torch.float32, programs=2,
                          impl=Impl.TORCH, preload=True)  # fmt: skip
    assert out.shape == (9, 16) and out.dtype == torch.float32 and not done.any()
    with pytest.raises(RuntimeError, match="waits for done slot"):
        tc.tile_combine(y, meta, slot_TK, done, plan.done_targets_S, probs, torch.float32, programs=2,
                        impl=Impl.TORCH)  # fmt: skip


CASES = {
    "weighted_dropped_completion_order": lambda **kw: combine_case(
        37, 3, 5, 40, alignment=4, drop=[(3, 1), (36, 0)], programs=3, order="completion", **kw
    ),
    "unweighted_bf16_token_order": lambda **kw: combine_case(
        19, 2, 4, 48, programs=1, order="token", weighted=False, out_dtype=torch.bfloat16, **kw
    ),
    "wide_hidden_more_programs_than_blocks": lambda **kw: combine_case(
        9, 2, 3, 600, programs=8, order="completion", **kw
    ),
    "every_route_to_one_expert": lambda **kw: combine_case(
        21, 1, 4, 40, expert=2, programs=2, order="completion", **kw
    ),
    "counters_kept_across_steps": lambda **kw: combine_case(
        17, 2, 6, 32, alignment=2, programs=4, order="token", ahead=3, **kw
    ),
    "no_tokens": lambda **kw: combine_case(0, 2, 3, 16, programs=2, order="token", **kw),
}


def run_cases(cases: dict, device: str) -> dict:
    out = {}
    for name, case in cases.items():
        try:
            case(device=device)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()[-2000:]
    return out


INTERPRETED_RUN = ("-m", "tests.test_tile_combine", "--json", "{json}")


@pytest.fixture(scope="module")
def interpreted_results():
    if not have_triton():
        pytest.skip("Triton is not installed")
    return interpreted(list(INTERPRETED_RUN))


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_bitwise_equals_the_combine(case, interpreted_results):
    assert interpreted_results[case] == "ok", interpreted_results[case]


@pytest.mark.skipif(not have_triton() or INTERPRETED, reason="needs Triton, not in interpreter mode")
def test_kernel_compiles_for_sm90_with_the_combines_arithmetic():
    """What bitwise equality with the combine on the GPU rests on: the compiler treats both sums alike (each
    weighted route one fused multiply-add into the fp32 accumulator, no separately rounded product); and the
    wait: an acquire atomic at GPU scope, then a CTA barrier before the loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_megatron.kernels.permute import _gather_sum_kernel

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")

    def ptx(fn, pointers, constexprs):
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    rows = dict(row_ptr="*i32", weight_ptr="*fp32", out_ptr="*fp32")
    tile = ptx(
        tc._tile_combine_kernel,
        dict(rows, y_ptr="*bf16", slot_ptr="*i32", done_ptr="*i32", target_ptr="*i32", order_ptr="*i32"),
        dict(K=4, K_P2=4, BLOCK_T=tc.BLOCK_T, BLOCK_H=tc.BLOCK_H_MAX, HAS_WEIGHT=True, HAS_ORDER=True),
    )
    gather = ptx(
        _gather_sum_kernel,
        dict(rows, src_ptr="*bf16", psrc_ptr="*fp32", pdst_ptr="*fp32"),
        dict(K=4, K_P2=4, BLOCK_H=1024, HAS_WEIGHT=True, HAS_PROBS=False),
    )
    for text in (tile, gather):
        assert "fma.rn.f32" in text and not re.search(r"\b(mul|add)(\.rn)?\.f32\b", text)
    assert re.search(r"atom\.global\.gpu\.acquire\.add\.u32|atom\.acquire\.gpu\.global\.add\.u32", tile)
    wait = tile.index("acquire")
    assert "bar.sync" in tile[wait:]


# ---- GPU ---------------------------------------------------------------------------------------------------


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and have_triton()), reason="needs CUDA, Triton"
)
needs_sm90 = needs_sm90_quack


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_bitwise_equals_the_combine_gpu(case):
    CASES[case](device="cuda")


def beside_gemm_case(cfg_name: str, programs: int, order: str, seed: int = 0) -> None:
    """fc2 on the waiting GEMM releasing done counters (from 0) and the combine launched before it on a
    second stream, on ``programs`` programs (the GEMM holds back as many SMs). fc2's output buffer starts
    NaN: a row read before its tile was stored carries NaN into the output."""
    from mok_megatron.kernels.link_delay import spin_ns
    from mok_megatron.kernels.routing import routing_metadata

    cfg = {"qwen3": tg.QWEN3, "deepseek": tg.DEEPSEEK}[cfg_name]
    T, K, E, F, H = 1500, 4, 7, 256, 448
    gen = torch.Generator().manual_seed(seed)
    # expert 6 gets no token; one token's routes all dropped
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(T)])
    ids[11] = -1
    meta = routing_metadata(ids.cuda(), E)
    offs, rows = meta.offsets_E, meta.num_rows
    h = torch.randn(rows, F, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(E, F, H, generator=gen) / F**0.5).to(device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(T, K, generator=gen).cuda()
    plan = tg.tile_plan(offs, rows, H, cfg)
    slot_TK = tc.token_slots(meta, plan)
    order_T = tc.token_order(slot_TK, tg.slot_done_rank(plan)) if order == "completion" else None
    arrived = plan.targets_S.clone()  # fc2's input is all there: the GEMM never waits
    # compiled before (the combine's first launch compiles on the host before it is queued)
    tg.tile_grouped_mm(h, w2, plan, arrived, sms_held_back=programs, done_S=torch.zeros_like(arrived))
    y = torch.full((rows, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    done = torch.zeros_like(plan.targets_S)
    # both kernels queued while another spins are loaded first: CUDA loads a kernel at its first launch, and
    # that load may wait for the device to go idle, which a spinning kernel never lets it
    spin_ns(1, y.device)
    tc.tile_combine(y, meta, slot_TK, done, plan.done_targets_S, probs, torch.float32, order_T=order_T,
                    programs=programs, preload=True)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isnan(y).all() and not done.any(), "the preload wrote rows or counters"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # queued first: it spins until the GEMM's tiles are stored
        out = tc.tile_combine(
            y,
            meta,
            slot_TK,
            done,
            plan.done_targets_S,
            probs,
            torch.float32,
            order_T=order_T,
            programs=programs,
        )
    spin_ns(1_000_000, y.device)  # the combine is running and waiting before the GEMM starts
    tg.tile_grouped_mm(h, w2, plan, arrived, sms_held_back=programs, out=y, done_S=done)
    torch.cuda.synchronize()
    assert torch.equal(done, plan.done_targets_S), "done counters"
    assert not torch.isnan(out).any(), "a row was read before its tile was stored"
    assert torch.equal(out, combine(y, meta, probs, torch.float32)), "not bitwise the combine"
    want = combine(torch._grouped_mm(h, w2, offs=offs), meta, probs, torch.float32)
    torch.testing.assert_close(out, want, **BF16_SUM)


_BESIDE = textwrap.dedent(
    """
    import sys
    from tests.test_tile_combine import beside_gemm_case
    beside_gemm_case(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print("ok", flush=True)
    """
)
WATCHDOG_S = 300  # compiling both kernels takes about a minute; a lost release spins forever


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cfg_name", ["qwen3", "deepseek"])
@pytest.mark.parametrize("programs,order", [(8, "completion"), (8, "token"), (2, "completion")])
def test_combine_beside_the_releasing_gemm_gpu(cfg_name, programs, order):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", _BESIDE, cfg_name, str(programs), order],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WATCHDOG_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the combine beside the GEMM still ran after {WATCHDOG_S} s: a done counter never arrived"
        )
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-4000:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="run the tile combine kernel cases")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    Path(a.json).write_text(json.dumps(run_cases(CASES, a.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
