"""benchmarks/tile_gemm_gate.py as documented: the tile benchmarks' slices (the 16k-token DeepSeek-V3 slice
named by every tile benchmark, the defaults the two others), the rows each expert receives from each source
rank, the exchange steps that deliver them, the gate's arithmetic, and one line on a machine without an sm_90
GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_the_tile_benchmarks_slices():
    from benchmarks.tile_gemm_gate import DEFAULT_SHAPES, SHAPE_CONFIG, SHAPES
    from mok_megatron.kernels import tile_gemm as tg

    assert set(SHAPE_CONFIG) == set(SHAPES) and set(DEFAULT_SHAPES) <= set(SHAPES)
    assert DEFAULT_SHAPES == ("deepseek-v3-ep32", "qwen3-ep8")  # the 16k slice runs in its own call
    assert SHAPES["deepseek-v3-ep32-16k"] == dict(SHAPES["deepseek-v3-ep32"], tokens=16384)
    assert SHAPE_CONFIG["deepseek-v3-ep32-16k"] == SHAPE_CONFIG["deepseek-v3-ep32"] == "DEEPSEEK"
    assert all(hasattr(tg, c) for c in SHAPE_CONFIG.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the arguments on a machine without a GPU")
@pytest.mark.parametrize("bench", ["tile_gemm_gate", "tile_pull", "tile_layer"])
def test_every_tile_benchmark_takes_the_16k_slice(bench, capsys):
    # the slice passes the --shapes check; the run then stops at the missing GPU, in one line
    import importlib

    main = importlib.import_module(f"benchmarks.{bench}").main
    assert main(["--shapes", "deepseek-v3-ep32-16k", "--k", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{bench}: needs an sm_90 GPU (QuACK's sm_90 kernels); none here"], err
    assert main(["--shapes", "deepseek-v3-ep32-32k"]) == 2
    assert "known: deepseek-v3-ep32,deepseek-v3-ep32-16k,qwen3-ep8" in capsys.readouterr().err


def test_counts_are_the_routed_rows_of_the_local_experts():
    from benchmarks.tile_gemm_gate import SHAPES, counts

    shape = dict(SHAPES["qwen3-ep8"], tokens=64)
    c_L = counts(shape)
    assert c_L.shape == (shape["local"],)
    # every token picks top-k distinct experts; the local experts are the first `local` of `experts`
    assert 0 < int(c_L.sum()) <= shape["tokens"] * shape["ep"] * shape["topk"]
    assert torch.equal(c_L, counts(shape))  # seeded


def test_rows_by_source_and_their_arrival_steps():
    from benchmarks.tile_gemm_gate import SHAPES, arrival_steps, counts, counts_by_source

    shape = dict(SHAPES["deepseek-v3-ep32"], tokens=16, ep=4)
    c_SG = counts_by_source(shape)
    assert c_SG.shape == (4, shape["local"]) and torch.equal(c_SG.sum(0), counts(shape))
    # hand-worked: 2 experts, 3 sources; rank 1 pulls itself at step 0, then rank 2, then rank 0
    c = torch.tensor([[1, 0], [2, 1], [0, 3]])
    assert arrival_steps(c, rank=1).tolist() == [2, 0, 0, 0, 1, 1, 1]


def test_gate_sums_both_gemms_against_torch():
    from benchmarks.tile_gemm_gate import GATE, gate_rows

    def row(gemm, kind, k, ms):
        return dict(shape="s", gemm=gemm, kind=kind, impl=f"{kind} x", k=k, ms=ms)

    rows = [row("fc1", "torch", 0, 2.0), row("fc2_dgrad", "torch", 0, 1.0)]
    rows[0]["impl"] = rows[1]["impl"] = "torch._grouped_mm"
    rows += [row("fc1", "wait-arrival", 8, 2.05), row("fc2_dgrad", "wait-arrival", 8, 1.0)]
    rows += [row("fc1", "wait-arrival", 16, 2.2), row("fc2_dgrad", "wait-arrival", 16, 1.0)]
    rows += [row("fc1", "quack", 8, 2.0), row("fc2_dgrad", "quack", 8, 0.95)]
    rows += [row("fc1", "wait-quack-order", 16, 2.0), row("fc2_dgrad", "wait-quack-order", 16, 1.0)]
    gate = {g["k"]: g for g in gate_rows(rows, ["s"], [8, 16])}
    assert gate[8]["ratio"] == pytest.approx(3.05 / 3) and gate[8]["passes"] and GATE == 1.03
    assert gate[8]["quack_ratio"] == pytest.approx(2.95 / 3) and "quack_order_ratio" not in gate[8]
    assert not gate[16]["passes"] and gate[16]["quack_ms"] is None
    # the same waiting GEMM in QuACK's order (an expert-major pull) gets its own verdict
    assert gate[16]["quack_order_ratio"] == pytest.approx(1.0) and gate[16]["quack_order_passes"]


def test_table_and_summary_per_configuration():
    from benchmarks.tile_gemm_gate import summary_rows, table_rows

    def row(gemm, kind, config, k, ms):
        impl = "torch._grouped_mm" if kind == "torch" else f"{kind} {config}"
        return dict(shape="s", gemm=gemm, kind=kind, impl=impl, config=config, k=k, ms=ms)

    rows = [row("fc1", "torch", None, 0, 2.0), row("fc2_dgrad", "torch", None, 0, 1.0)]
    for config, quack, order, arrival in (("A", 2.9, 3.1, 3.3), ("B", 3.0, 3.05, 3.0)):
        for kind, ms in (("quack", quack), ("wait-quack-order", order), ("wait-arrival", arrival)):
            rows += [row("fc1", kind, config, 8, ms - 1.0), row("fc2_dgrad", kind, config, 8, 1.0)]
    rows.append(row("fc1", "wait-arrival", "C", 8, 2.0))  # fc2_dgrad refused at C: no total
    table = {e["config"]: e for e in table_rows(rows, ["s"], [8])}
    assert list(table) == ["A", "B", "C"]
    a, b = table["A"], table["B"]
    assert a["torch_ms"] == 3.0 and a["quack_ratio"] == pytest.approx(2.9 / 3) and a["quack_passes"]
    assert a["wait_quack_order_ratio"] == pytest.approx(3.1 / 3) and not a["wait_quack_order_passes"]
    assert b["wait_arrival_ms"] == pytest.approx(3.0) and b["wait_arrival_passes"]
    assert table["C"]["wait_arrival_ms"] is None and table["C"]["wait_arrival_passes"] is None
    # the smallest waiting ratio at K = 8, either order: B's ring order
    (summary,) = summary_rows(list(table.values()), ["s"], [8])
    best = summary["best"][8]
    assert (best["config"], best["order"], best["passes"]) == ("B", "arrival", True)
    assert best["ratio"] == pytest.approx(1.0) and best["quack_ratio"] == pytest.approx(1.0)


def test_k_list_and_its_range_per_configuration():
    from benchmarks.tile_gemm_gate import held_back_errors, parse_ks

    from mok_megatron.kernels import tile_gemm as tg

    assert parse_ks("0,2,4,6,8,16") == [0, 2, 4, 6, 8, 16] and parse_ks("8,8,0") == [8, 0]
    with pytest.raises(ValueError, match="comma list of integers"):
        parse_ks("0,eight")
    c1 = tg.TileConfig(tile_m=128, tile_n=128, cluster_m=1)
    # 132 SMs: clusters of 2 leave room up to K = 129, clusters of 1 up to K = 130
    assert held_back_errors([0, 129], [tg.QWEN3, c1], 132) == []
    assert held_back_errors([130, -1], [tg.QWEN3, c1], 132) == [
        "--k 130 at 128x192 pp c2: sms_held_back=130; it must be in [0, 130) (132 SMs, clusters of 2 along M); "
        "drop it from --k",
        "--k -1 at 128x192 pp c2: sms_held_back=-1; it must be in [0, 130) (132 SMs, clusters of 2 along M); "
        "drop it from --k",
        "--k -1 at 128x128 pp c1: sms_held_back=-1; it must be in [0, 131) (132 SMs, clusters of 1 along M); "
        "drop it from --k",
    ]


_HUNG = """
import sys, time
from benchmarks.tile_gemm_gate import CaseWatchdog
dog = CaseWatchdog(0.2, lambda case: f"wrote {case!r}")
with dog.case("fast"):
    pass
print("fast case done", flush=True)
with dog.case("s fc1 wait 128x256 coop c2 arrival k=8"):
    time.sleep(30)  # a kernel that never ends
print("not reached")
"""


def test_watchdog_writes_and_exits_when_a_case_hangs():
    r = subprocess.run([sys.executable, "-c", _HUNG], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 3 and r.stdout == "fast case done\n", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "tile_gemm_gate: s fc1 wait 128x256 coop c2 arrival k=8 did not finish within --case-timeout 0.2 s "
        "(a waiting kernel whose counters never reach their targets?); wrote "
        "'s fc1 wait 128x256 coop c2 arrival k=8'"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_an_sm90_gpu_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.tile_gemm_gate"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "tile_gemm_gate: needs an sm_90 GPU (QuACK's sm_90 kernels); none here"
    ]
