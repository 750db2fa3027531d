"""``mok bench train``: the command lines it builds, the Megatron log it reads, its bad-input lines, and the
whole comparison on the tiny preset through Megatron's real training loop on a CPU (identical initial weights
-> equal losses; one iteration traced by Megatron's profiler), plus the Qwen3-30B-A3B 100-step loss agreement
on a GPU against Megatron's own drift (its limits as pure functions, tested on a CPU)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from mok_megatron.bench import train
from mok_megatron.bench.train import BenchTrainError, Machine, make_plan, split_mok_flags
from mok_megatron.bench.train_log import LOSS_LIMITS, TrainLog, last_error, loss_agreement, summarize
from mok_megatron.bench.train_presets import DEEPSEEK_V3_EXPERTS, PRESETS
from mok_megatron.bench.train_report import report

ROOT = Path(__file__).resolve().parent.parent
H200 = Machine(cuda=True, gpus=8, te=True, deepep=False, name="NVIDIA H200")
CPU = Machine(cuda=False, gpus=0, te=False, deepep=False, name="cpu")

# The measured one-H200 command of the Qwen3-30B-A3B comparison (MoK side).
QWEN3_COMMAND = (
    "--num-layers 4 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 4 --kv-channels 128 --qk-layernorm --normalization RMSNorm --swiglu --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --seq-length 4096 "
    "--max-position-embeddings 4096 --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 --bf16 "
    "--no-gradient-accumulation-fusion --micro-batch-size 4 --global-batch-size 4 --train-iters 12 --lr 3e-4 "
    "--min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --seed 1234 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --split 1,0,0 --log-interval 1 --eval-iters 0 "
    "--log-throughput --moe-token-dispatcher-type mok"
).split()


def _plan(
    preset="qwen3-30b-a3b",
    machine=H200,
    nproc=1,
    forwarded=(),
    runs="auto",
    iters=12,
    warmup=2,
    fusion=False,
    profile_step=None,
):
    return make_plan(
        preset, runs, iters, warmup, nproc, list(forwarded), machine, "/w/ckpt", fusion, profile_step
    )


def _flag_values(argv) -> dict:
    """{flag: value or True}, the last occurrence winning (argparse's rule)."""
    out, argv = {}, list(argv)
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[tok] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


# ---- command lines ----------------------------------------------------------------------------------


def test_qwen3_preset_is_the_measured_command():
    plan = _plan()
    mok = _flag_values(next(r for r in plan.runs if r.name == "mok").argv)
    want = _flag_values(QWEN3_COMMAND)
    assert {k: mok.get(k) for k in want} == want
    # what the bench adds: the loop length it reads, and the checkpoint every run loads
    assert mok["--eval-interval"] == "12" and mok["--load"] == "/w/ckpt" and mok["--no-load-optim"] is True
    assert set(mok) - set(want) == {
        "--expert-model-parallel-size",
        "--eval-interval",
        "--log-memory-interval",
        "--load",
        "--no-load-optim",
        "--exit-on-missing-checkpoint",
    }


def test_runs_share_every_flag_but_the_layer():
    plan = _plan(
        forwarded=["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--mok-expert-backend", "torch-fp8"]
    )
    runs = {r.name: _flag_values(r.argv) for r in plan.runs}
    assert set(runs) == {"mok", "alltoall"}
    mok, ref = runs["mok"], runs["alltoall"]
    assert ref["--moe-token-dispatcher-type"] == "alltoall" and mok["--moe-token-dispatcher-type"] == "mok"
    # TE here: Megatron's layer with its grouped GEMM and fused permute; FP8 padding for its experts only
    layer_only = {"--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-padding-for-quantization"}
    assert layer_only <= set(ref) and not layer_only & set(mok)
    assert mok["--mok-expert-backend"] == "torch-fp8" and "--mok-expert-backend" not in ref
    drop = {"--moe-token-dispatcher-type", "--mok-expert-backend"} | layer_only
    assert {k: v for k, v in mok.items() if k not in drop} == {k: v for k, v in ref.items() if k not in drop}
    init = _flag_values(plan.init.argv)
    assert plan.init.module == "mok_megatron.training.initial_checkpoint"
    assert init["--save"] == "/w/ckpt" and init["--no-save-optim"] is True and init["--skip-train"] is True
    assert init["--moe-token-dispatcher-type"] == "alltoall" and init["--moe-grouped-gemm"] is True


def test_several_gpus_scale_the_batch_and_expert_parallelism():
    plan = _plan(nproc=8, runs="mok,alltoall,alltoall-overlap")
    mok = _flag_values(plan.runs[0].argv)
    assert mok["--global-batch-size"] == "32" and mok["--expert-model-parallel-size"] == "8" and plan.ep == 8
    assert "--overlap-moe-expert-parallel-comm" in plan.runs[2].argv
    both = {r.name: _flag_values(r.argv) for r in _plan(nproc=8, runs="mok,mok-overlap,alltoall").runs}
    assert both["mok-overlap"]["--moe-token-dispatcher-type"] == "mok"
    assert both["mok-overlap"]["--overlap-moe-expert-parallel-comm"] is True
    assert "--overlap-moe-expert-parallel-comm" not in both["mok"]
    tp2 = _flag_values(_plan(nproc=8, forwarded=["--tensor-model-parallel-size", "2"]).runs[0].argv)
    assert tp2["--global-batch-size"] == "16" and tp2["--expert-model-parallel-size"] == "4"
    mine = _flag_values(_plan(nproc=8, forwarded=["--global-batch-size", "64"]).runs[0].argv)
    assert mine["--global-batch-size"] == "64"
    deepep = Machine(cuda=True, gpus=8, te=True, deepep=True)
    assert [r.name for r in _plan(nproc=8, machine=deepep).runs] == ["mok", "alltoall", "flex"]
    assert [r.name for r in _plan(nproc=1, machine=deepep).runs] == ["mok", "alltoall"]  # flex: TP x EP > 1


def test_cpu_runs_use_the_cpu_flags_and_the_local_layer():
    plan = _plan("tiny", machine=CPU)
    ref = _flag_values(plan.runs[1].argv)
    assert ref["--distributed-backend"] == "gloo" and ref["--transformer-impl"] == "local"
    assert "--bf16" not in ref and "--moe-grouped-gemm" not in ref and "--moe-permute-fusion" not in ref
    assert plan.runs[1].label == "Megatron alltoall + local SequentialMLP"


def test_mok_flags_are_routed_to_the_mok_run_only():
    common, mok = split_mok_flags(
        ["--lr", "1e-4", "--mok-minibatch-size", "256", "--mok-sync-free", "--bf16"]
    )
    assert common == ["--lr", "1e-4", "--bf16"] and mok == ["--mok-minibatch-size", "256", "--mok-sync-free"]


def test_profile_step_gives_every_run_megatrons_profiler_flags():
    """One traced iteration N per run (Megatron's --profile-step-start N --profile-step-end N+1 on rank 0),
    each run its own --tensorboard-dir, so each trace lands in its own torch_profile/ beside it."""
    plan = _plan(nproc=8, runs="mok,alltoall,alltoall-unfused", profile_step=6)
    assert plan.profile_step == 6 and plan.untimed == (5, 6, 7)
    assert plan.init.trace is None and "--profile" not in plan.init.argv  # the init run trains no step
    for run in plan.runs:
        f = _flag_values(run.argv)
        assert f["--profile"] is True and f["--use-pytorch-profiler"] is True, run.name
        assert (f["--profile-step-start"], f["--profile-step-end"], f["--profile-ranks"]) == ("6", "7", "0")
        assert f["--tensorboard-dir"] == f"/w/profile/{run.name}/tensorboard"
        assert run.trace == f"/w/profile/{run.name}/torch_profile/rank-0.json.gz"
    # everything else is the unprofiled comparison's
    plain = _plan(nproc=8, runs="mok,alltoall,alltoall-unfused")
    assert plain.untimed == () and all(r.trace is None for r in plain.runs)
    for a, b in zip(plain.runs, plan.runs, strict=True):
        assert list(b.argv[: len(a.argv)]) == list(a.argv) and "--profile" not in a.argv


def test_profile_step_through_the_cli(capsys, tmp_path):
    argv = "--preset tiny --iters 4 --warmup 1 --profile-step 2 --dry-run --workdir".split() + [str(tmp_path)]
    rc = train.main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, lines
    # "# NAME: label" then the command line
    pairs = zip(lines[:-1], lines[1:], strict=True)
    commands = {a[2:].split(":")[0]: shlex.split(b) for a, b in pairs if a.startswith("# ")}
    assert set(commands) == {"init", "mok", "alltoall"} and "--profile" not in commands["init"]
    for name in ("mok", "alltoall"):
        f = _flag_values(commands[name])
        assert (f["--profile-step-start"], f["--profile-step-end"]) == ("2", "3")
        assert f["--tensorboard-dir"] == str(tmp_path / "profile" / name / "tensorboard")
    rc = train.main("--preset tiny --iters 4 --warmup 1 --profile-step 3 --dry-run".split())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("mok bench train: error: --profile-step 3: needs")


def test_profiled_report_holds_each_runs_kernel_time(tmp_path, capsys):
    """The profiled iterations leave the step times; a run's trace becomes its "profile"; a run that wrote no
    trace is named and the exit status is 1."""
    import types

    from tests.test_bench_train_profile import _trace

    init_dir = str(tmp_path / "initial-checkpoint")
    plan = make_plan("qwen3-30b-a3b", "auto", 12, 0, 1, [], H200, init_dir, profile_step=1)
    mok = next(r for r in plan.runs if r.name == "mok")
    os.makedirs(os.path.dirname(mok.trace))
    with open(mok.trace, "w") as f:  # read by content: a plain JSON under the .json.gz name also reads
        json.dump(_trace(step=1), f)
    text = LOG.replace("/w/initial-checkpoint", plan.init_dir)
    res = {"rc": 0, "seconds": 1.0, "command": [], "log": None, "tail": []}
    results = {"init": dict(res), "mok": dict(res, log=_log(text)), "alltoall": dict(res, log=_log(text))}
    ns = types.SimpleNamespace(original_argv=[], json=str(tmp_path / "r.json"), png=None)
    rc = report(plan, results, H200, ns, str(tmp_path))
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and d["profile_step"] == 1
    runs = d["runs"]
    assert runs["mok"]["untimed_iterations"] == [1, 2] and runs["mok"]["timed_iterations"] == 1
    assert runs["mok"]["step_ms_median"] == 100.0  # iteration 3 only
    p = runs["mok"]["profile"]
    assert p["step"] == 1 and p["trace"] == mok.trace and p["categories"]["gemm"]["ms"] == pytest.approx(6.0)
    assert runs["alltoall"]["profile"]["error"].startswith("no trace at ")
    assert re.search(r"^gemm +6\.00 \( 57 %\)$", out, re.MULTILINE), out
    assert "mok bench train: the alltoall run's profile: no trace at " in out


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(preset="llama"), r"--preset llama: unknown; choose from qwen3-30b-a3b, deepseek-v3"),
        (dict(machine=CPU), r"--preset qwen3-30b-a3b needs CUDA GPUs .* use --preset tiny"),
        (dict(nproc=9), r"--nproc-per-node 9: this machine has 8 GPU\(s\)"),
        (
            dict(runs="mok,deepep"),
            r"--runs deepep: unknown; choose from mok, mok-overlap, alltoall, alltoall-unfused, flex",
        ),
        (dict(runs="mok,flex", nproc=8), r"--runs flex: DeepEP \(deep_ep\) is not importable"),
        (dict(runs="mok,alltoall-overlap"), r"--overlap-moe-expert-parallel-comm needs expert parallelism"),
        (dict(runs="mok-overlap,alltoall"), r"--runs mok-overlap: --overlap-moe-expert-parallel-comm needs"),
        (dict(runs="mok,mok-overlap", nproc=2), r"no Megatron run to compare with; add alltoall"),
        (
            dict(runs="mok,alltoall-unfused", machine=Machine(True, 8, False, False)),
            r"alltoall-unfused: .* needs Transformer",
        ),
        (dict(iters=4, warmup=4), r"--iters 4 --warmup 4: need iters >= 1 and 0 <= warmup < iters"),
        (dict(forwarded=["--train-iters", "5"]), r"--train-iters: the bench sets it itself \(set the number"),
        (dict(forwarded=["--load=/x"]), r"--load: the bench sets it itself"),
        (dict(nproc=6, forwarded=["--tensor-model-parallel-size", "4"]), r"6 process\(es\) do not split"),
        (
            dict(fusion=True, machine=Machine(True, 8, False, False)),
            r"--gradient-accumulation-fusion: .* no Transformer",
        ),
        (
            dict(profile_step=2),
            r"^--profile-step 2: needs --warmup 2 < N < --iters 12 and a timed step outside "
            r"N-1\.\.N\+1 \(the profiler's warm-up, trace and export steps leave the timing\); choose N in 3\.\.11\.$",
        ),
        (dict(profile_step=12), r"^--profile-step 12: .*; choose N in 3\.\.11\.$"),
        (dict(iters=4, warmup=1, profile_step=3), r"^--profile-step 3: .*; choose N in 2\.\.2\.$"),
        (dict(iters=3, warmup=1, profile_step=2), r"^--profile-step 2: .*; raise --iters to 4 or more\.$"),
        (
            dict(profile_step=5, forwarded=["--tensorboard-dir", "/tb"]),
            r"^--tensorboard-dir: --profile-step sets Megatron's profiler flags per run \(--profile .*\); drop it",
        ),
        (
            dict(profile_step=5, forwarded=["--profile-step-start=4"]),
            r"^--profile-step-start: --profile-step sets",
        ),
    ],
)
def test_bad_input_is_one_line(kwargs, message):
    with pytest.raises(BenchTrainError) as e:
        _plan(**kwargs)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_cli_bad_input_prints_one_line_and_starts_nothing(capsys, tmp_path):
    from mok_megatron.cli import main as mok

    assert mok(["bench", "train", "--preset", "nope", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mok bench train: error: --preset nope: unknown; choose from " + ", ".join(PRESETS) + "."]
    assert mok(["bench", "train", "--preset", "tiny", "--torchrun", str(tmp_path / "torchrun")]) == 2
    assert capsys.readouterr().err.strip().endswith("torchrun: no such executable.")
    assert not (tmp_path / "w").exists()


def test_megatron_refusing_a_flag_is_one_line_before_any_launch(capsys, tmp_path):
    rc = train.main(["--preset", "tiny", "--workdir", str(tmp_path), "--", "--moe-router-topk", "two"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert (
        "the init run's flags are refused by their argument parser (Megatron's and MoK's): argument "
        "--moe-router-topk: invalid int value: 'two'" in err[0]
    )
    assert not any(tmp_path.iterdir())  # nothing was started


def test_presets_are_pinned_in_the_docs():
    doc = (ROOT / "docs" / "bench-train.md").read_text()
    for p in PRESETS.values():
        assert shlex.join(p.flags) in doc, p.name


def test_deepseek_v3_expert_count_is_the_most_that_fits_an_h200():
    """The preset's expert count: the largest multiple of the 8 routing groups whose memory estimate
    (weights, fp32 gradients, Adam, activations, overhead) fits 141 GB; 29 experts would, 30 would not."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from mok_megatron.tools.recipe.layout import Cluster, parallel
    from mok_megatron.tools.recipe.memory import HBM_BYTES, estimate
    from mok_megatron.training.arguments import extra_args_provider

    parser = extra_args_provider(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))

    def total(experts: int) -> float:
        flags = list(PRESETS["deepseek-v3"].flags)
        flags[flags.index("--num-experts") + 1] = str(experts)
        a = parser.parse_args(flags + ["--global-batch-size", "1", "--moe-token-dispatcher-type", "mok"])
        return estimate(a, parallel(a, Cluster(1, 1, 1, "H200")))[0].total

    hbm = HBM_BYTES["H200"]
    assert DEEPSEEK_V3_EXPERTS % 8 == 0
    assert total(DEEPSEEK_V3_EXPERTS) <= hbm < total(DEEPSEEK_V3_EXPERTS + 8)
    assert total(29) <= hbm < total(30)


# ---- the log --------------------------------------------------------------------------------------

LOG = """\
  global_batch_size ............................... 8
  seq_length ...................................... 64
  world_size ...................................... 2
> MoE layer: MoK (mok_megatron.MoKMoELayer), dispatcher alltoall
  successfully loaded checkpoint from /w/initial-checkpoint [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 0
 [2026-12-01 22:16:50.432345] iteration        1/       3 | consumed samples:            8 | elapsed time per iteration (ms): 1650.2 | throughput per GPU (TFLOP/s/GPU): 1.5 | learning rate: 1.500000E-03 | global batch size:     8 | lm loss: 4.872801E+00 | load_balancing_loss: 1.008168E+00 | loss scale: 1.0 | grad norm: 1.080 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 10.00 | max allocated: 120.50 | reserved: 0.00 | max reserved: 0.00
 [2026-12-01 22:16:52.120505] iteration        2/       3 | consumed samples:           16 | elapsed time per iteration (ms): 200.0 | throughput per GPU (TFLOP/s/GPU): 2.5 | learning rate: 3.000000E-03 | global batch size:     8 | lm loss: 4.880916E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-12-01 22:16:54.629119] iteration        3/       3 | consumed samples:           24 | elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): 3.5 | learning rate: 1.650000E-03 | global batch size:     8 | lm loss: 4.707510E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 3 iterations) memory (MB) | allocated: 10.00 | max allocated: 130.25 | reserved: 0.00 | max reserved: 0.00
"""


def _log(text=LOG) -> TrainLog:
    log = TrainLog()
    steps = [s for s in (log.feed(line) for line in text.splitlines(keepends=True)) if s is not None]
    assert [s.iteration for s in steps] == [1, 2, 3]  # the progress bar gets one step per iteration line
    return log


def test_log_summary():
    s = summarize(_log(), warmup=1, cpu=False)
    assert s["iterations"] == [1, 2, 3] and s["loss"] == [4.872801, 4.880916, 4.70751]
    assert s["grad_norm"] == [1.08, None, None]
    assert (s["step_ms_min"], s["step_ms_median"], s["step_ms_max"]) == (100.0, 150.0, 200.0)
    # 8 sequences x 64 tokens per 0.150 s, over 2 GPUs
    assert s["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / 0.150 / 2)
    assert s["tflops_per_gpu"] == 3.0 and s["peak_allocated_mib"] == 130.25
    assert s["final_loss"] == 4.70751 and s["mean_loss"] == pytest.approx((4.872801 + 4.880916 + 4.70751) / 3)
    assert s["layer"].startswith("MoK") and s["loaded_checkpoint"] == "/w/initial-checkpoint"
    assert s["loaded_iteration"] == 0
    assert summarize(_log(), warmup=1, cpu=True)["peak_allocated_mib"] is None  # CPU mode reports zeros
    profiled = summarize(_log(), warmup=0, cpu=False, untimed=(1, 2))  # a profiled iteration 1
    assert (profiled["step_ms_min"], profiled["step_ms_max"]) == (100.0, 100.0)
    assert profiled["timed_iterations"] == 1 and profiled["untimed_iterations"] == [1, 2]
    assert profiled["loss"] == s["loss"]
    untimed = r"none after the 1 warm-up iteration\(s\) and iterations 2, 3, 4 untimed"
    with pytest.raises(ValueError, match=untimed):
        summarize(_log(), warmup=1, cpu=False, untimed=(2, 3, 4))
    with pytest.raises(ValueError, match=r"none after the 3 warm-up iteration\(s\)"):
        summarize(_log(), warmup=3, cpu=False)


def test_loss_agreement_limits():
    ref = {"iterations": [1, 2, 3, 4], "loss": [10.0, 9.0, 8.0, 7.0]}

    def run(*loss):
        return {"iterations": [1, 2, 3, 4], "loss": list(loss)}

    ok = loss_agreement(run(10.005, 9.0, 8.0, 7.0), ref)
    assert ok["ok"] and ok["step1_rel"] == pytest.approx(5e-4) and ok["steps"] == 4
    step1 = loss_agreement(run(10.02, 9.0, 8.0, 7.0), ref)
    assert not step1["ok"] and "step-1 losses differ by 2.00e-03" in step1["problems"][0]
    spike = loss_agreement(run(10.0, 9.0, 8.0, 7.2), ref)
    assert not spike["ok"] and any("step 4 differs by 2.86e-02" in p for p in spike["problems"])
    drift = loss_agreement(run(10.0, 9.09, 8.08, 7.07), ref)  # 1 % on 3 of 4 steps: mean 0.75 %
    assert not drift["ok"] and drift["problems"] == [
        f"the mean difference is {drift['mean_rel']:.2e} relative (limit {LOSS_LIMITS['mean']:g})"
    ]
    shifted = loss_agreement({"iterations": [2, 3], "loss": [9.0, 8.0]}, ref)
    assert not shifted["ok"] and shifted["problems"] == ["no step-1 loss (first common step 2)"]


def test_megatron_against_itself_is_reported_not_checked(tmp_path, capsys):
    """alltoall-unfused: TE's grouped GEMM without the fused permute. Its agreement with the first Megatron run
    is printed and written as Megatron's own floor; only MoK's agreement sets exit status 3."""
    import types

    plan = _plan(runs="mok,alltoall,alltoall-unfused")
    unfused = _flag_values(plan.runs[2].argv)
    assert unfused["--moe-token-dispatcher-type"] == "alltoall" and unfused["--moe-grouped-gemm"] is True
    assert "--moe-permute-fusion" not in unfused and plan.runs[2].label.endswith("+ TE grouped GEMM")

    def result(losses):
        text = LOG.replace("/w/initial-checkpoint", "/w/ckpt").replace("4.707510E+00", f"{losses:E}")
        return {"rc": 0, "seconds": 1.0, "command": [], "log": _log(text), "tail": []}

    init = {"rc": 0, "seconds": 1.0, "command": [], "tail": []}
    ns = types.SimpleNamespace(original_argv=[], json=str(tmp_path / "r.json"), png=None)

    def run(mok_last, unfused_last):
        results = {"init": init, "mok": result(mok_last), "alltoall": result(4.70751)}
        results["alltoall-unfused"] = result(unfused_last)
        rc = report(plan, results, H200, ns, str(tmp_path))
        return rc, json.loads((tmp_path / "r.json").read_text())["loss_agreement"], capsys.readouterr().out

    rc, agreement, out = run(4.70751, 5.0)  # Megatron drifts from itself by 6 %; MoK does not
    assert rc == 0 and set(agreement) == {"mok/alltoall", "alltoall-unfused/alltoall"}
    assert agreement["mok/alltoall"]["ok"] and not agreement["alltoall-unfused/alltoall"]["ok"]
    assert "loss agreement alltoall-unfused/alltoall: OUTSIDE the limits" in out
    assert "(Megatron against itself; not a MoK check)" in out
    rc, agreement, out = run(5.0, 4.70751)
    assert rc == 3 and "loss agreement mok/alltoall: OUTSIDE the limits: step 3 differs" in out


@pytest.mark.parametrize(
    "total, shown", [(12, list(range(1, 13))), (3, [1, 2, 3]), (100, [1, *range(10, 101, 10)])]
)
def test_progress_lines_skip_no_step_of_a_short_run(total, shown):
    """Not a terminal: a line per iteration up to 20 iterations (the default --iters 12 included), a line
    per tenth of a longer run."""
    import io
    import types

    stream = io.StringIO()
    progress = train.Progress("mok", total, stream)
    for i in range(1, total + 1):
        progress.step(types.SimpleNamespace(iteration=i, ms=10.0, loss=1.0))
    lines = stream.getvalue().splitlines()
    assert [int(ln.split("| ")[1].split("/")[0]) for ln in lines] == shown, lines


def test_last_error_names_the_failure_not_torchrun():
    tail = [
        '[rank0]:   File "x.py", line 3, in f\n',
        "[rank0]: AssertionError: --attention-backend local is only supported with --spec local\n",
        "E1201 22:10:17 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)\n",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
        "============================================================\n",
    ]
    assert last_error(tail) == "AssertionError: --attention-backend local is only supported with --spec local"
    assert last_error(["mok-pretrain-gpt: error: --load /x: no such directory.\n"]).startswith(
        "mok-pretrain-gpt: error: --load /x"
    )


# ---- the whole comparison on a CPU --------------------------------------------------------------


def test_tiny_comparison_on_cpu_from_identical_weights(tmp_path, capsys):
    """init checkpoint -> MoK and Megatron's alltoall layer through Megatron's real loop (one gloo process,
    fp32): both load it, their losses agree within the bench's limits, and the JSON holds every number.
    Iteration 2 of each run is traced by Megatron's PyTorch profiler (--profile-step 2): the trace is read
    back as that step's (a CPU trace has host ops only, so no kernel time), and iterations 1-3 leave the
    step times."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU path (a GPU machine runs the Qwen3 100-step tests)")
    out = tmp_path / "bench.json"
    argv = "--preset tiny --iters 4 --warmup 1 --profile-step 2".split() + ["--workdir", str(tmp_path / "w")]
    rc = train.main(argv + ["--json", str(out), "--png", str(tmp_path / "bench.png")])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    d = json.loads(out.read_text())
    assert d["schema"] == "mok-bench-train/1" and d["ok"] is True and d["preset"] == "tiny"
    assert {"date", "command", "machine", "nproc_per_node", "iters", "warmup", "init", "speedup"} <= set(d)
    assert set(d["runs"]) == {"mok", "alltoall"} and d["init"]["rc"] == 0
    ckpt = str(tmp_path / "w" / "initial-checkpoint")
    for name, r in d["runs"].items():
        assert r["rc"] == 0 and r["iterations"] == [1, 2, 3, 4] and r["timed_iterations"] == 1
        assert r["untimed_iterations"] == [1, 2, 3] and r["step_ms_median"] == r["step_ms"][3]
        p = r["profile"]
        assert p["trace"] == str(tmp_path / "w" / "profile" / name / "torch_profile" / "rank-0.json.gz")
        assert os.path.isfile(p["trace"]) and p["step"] == 2 and p["rank"] == 0 and p["step_ms"] > 0
        assert p["kernels"] == 0 and p["top"] == []
        assert (r["loaded_checkpoint"], r["loaded_iteration"]) == (ckpt, 0), name
        assert r["tokens_per_s_per_gpu"] > 0 and r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["peak_allocated_mib"] is None and r["world_size"] == 1 and r["seq_length"] == 64
        assert r["final_loss"] == r["loss"][-1] and r["loss"][-1] < r["loss"][0]  # it learns
        assert os.path.isfile(r["log"])
    assert d["runs"]["mok"]["layer"].startswith("MoK") and d["runs"]["alltoall"]["layer"].startswith(
        "Megatron"
    )
    a = d["loss_agreement"]["mok/alltoall"]
    assert a["ok"] and a["steps"] == 4
    assert a["step1_rel"] <= 1e-3 and a["max_rel"] <= 2e-2 and a["mean_rel"] <= 5e-3
    assert d["speedup"]["mok/alltoall"] == pytest.approx(
        d["runs"]["mok"]["tokens_per_s_per_gpu"] / d["runs"]["alltoall"]["tokens_per_s_per_gpu"]
    )
    assert not os.path.exists(ckpt)  # removed afterwards (--keep-checkpoint keeps it)
    assert "loss agreement mok/alltoall: step 1" in printed.out and "within the limits" in printed.out
    assert "[mok] |########################| 4/4" in printed.err  # the progress bar, per iteration
    assert "mok: no GPU kernels in " in printed.out and d["profile_step"] == 2
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "bench.png").stat().st_size > 0
    except ImportError:
        assert "PNG not written: matplotlib is not installed" in printed.out


# ---- the H200 check -------------------------------------------------------------------------------
#
# Qwen3-30B-A3B preset, 100 steps, one GPU, from one initial checkpoint, three runs in one comparison: MoK,
# Megatron's alltoall (TE grouped GEMM + fused permute) and Megatron's alltoall-unfused (the same math with
# torch's permute). Two regimes, each with limits the reference meets in the same invocation
# (docs/results/2026-12-03-loss-100-steps, one H200):
#
# * the preset's regime (--lr 3e-4, 2 warm-up steps) is chaotic in bf16: every run has grad-norm spikes
#   (21-84 against a median of ~2) at steps that differ from run to run, and the largest single-step difference is
#   wherever one of the two runs spikes (measured 10.4 % MoK/alltoall, 10.0 % alltoall-unfused/alltoall,
#   10.2 % MoK/alltoall-unfused: each pair as far apart as the others). The test holds MoK's mean relative
#   difference from alltoall over the 100 steps no larger than alltoall-unfused's (measured 2.73 % vs
#   2.76 %), and step 1 within the bench's 1e-3; the largest step is reported beside it;
# * a stable regime, STABLE_FLAGS (lower learning rate, longer warm-up): premises checked, not assumed --
#   the step-100 loss at least 15 % below step 1's and alltoall-unfused within the bench's limits of
#   alltoall -- then MoK within the same limits: step 1 within 1e-3, every step within 2 %, the mean
#   within 0.5 %. Measured at lr 3e-5: the loss falls 10.76 -> 6.02 (44 %); alltoall-unfused within
#   0.12 % of alltoall at every step, MoK within 0.073 %. At lr 1e-4 the runs turn chaotic after ~30 steps
#   (Megatron against itself 26.7 % at the worst step), so that is not a stable regime.

GPU_ITERS = 100
THREE_RUNS = "mok,alltoall,alltoall-unfused"
STABLE_FLAGS = ("--lr", "3e-5", "--min-lr", "3e-6", "--lr-warmup-iters", "10")
MIN_LOSS_DROP = 0.15
FLOOR = "alltoall-unfused/alltoall"


def _runs_problems(d: dict, iters: int) -> list[str]:
    problems = [f"run {n} exited {r['rc']}" for n, r in d["runs"].items() if r["rc"] != 0]
    problems += [
        f"run {n} loaded iteration {r['loaded_iteration']}, not 0"
        for n, r in d["runs"].items()
        if r["rc"] == 0 and r["loaded_iteration"] != 0
    ]
    for key in ("mok/alltoall", FLOOR):
        steps = d["loss_agreement"].get(key, {}).get("steps")
        if steps != iters:
            problems.append(f"{key}: {steps} common steps, not {iters}")
    return problems


def drift_problems(d: dict, iters: int = GPU_ITERS) -> list[str]:
    """The preset's regime: MoK's mean drift from Megatron no larger than Megatron's from itself."""
    problems = _runs_problems(d, iters)
    if problems:
        return problems
    mok, floor = d["loss_agreement"]["mok/alltoall"], d["loss_agreement"][FLOOR]
    if mok["step1_rel"] > LOSS_LIMITS["step1"]:
        limit = LOSS_LIMITS["step1"]
        problems.append(f"mok/alltoall step 1 differs by {mok['step1_rel']:.2e} (limit {limit:g})")
    if mok["mean_rel"] > floor["mean_rel"]:
        problems.append(
            f"mok/alltoall mean_rel {mok['mean_rel']:.2e} > Megatron against itself ({FLOOR}) "
            f"{floor['mean_rel']:.2e} (largest step: {mok['max_rel']:.2e} vs {floor['max_rel']:.2e})"
        )
    return problems


def stable_premise_problems(d: dict, iters: int = GPU_ITERS) -> list[str]:
    """Whether the stable regime is one: it learns, and Megatron meets the limits against itself."""
    problems = _runs_problems(d, iters)
    if problems:
        return problems
    loss = d["runs"]["alltoall"]["loss"]
    drop = 1 - loss[-1] / loss[0]
    if drop < MIN_LOSS_DROP:
        problems.append(
            f"alltoall's step-{iters} loss {loss[-1]:.4f} is {100 * drop:.1f} % below step 1's {loss[0]:.4f} "
            f"(need {100 * MIN_LOSS_DROP:.0f} %)"
        )
    floor = d["loss_agreement"][FLOOR]
    if not floor["ok"]:
        problems.append(f"{FLOOR} outside the limits: {'; '.join(floor['problems'])}")
    return problems


def stable_problems(d: dict) -> list[str]:
    """In the stable regime MoK meets the bench's limits against alltoall."""
    a = d["loss_agreement"]["mok/alltoall"]
    return [] if a["ok"] else [f"mok/alltoall outside the limits: {'; '.join(a['problems'])}"]


def _result(losses: dict, rc: dict | None = None) -> dict:
    """A bench JSON's runs and loss agreement from {run: losses} (alltoall the reference)."""
    runs = {
        n: {
            "rc": (rc or {}).get(n, 0),
            "loaded_iteration": 0,
            "iterations": list(range(1, len(v) + 1)),
            "loss": list(v),
        }
        for n, v in losses.items()
    }
    agreement = {f"{n}/alltoall": loss_agreement(runs[n], runs["alltoall"]) for n in runs if n != "alltoall"}
    return {"runs": runs, "loss_agreement": agreement}


def test_gpu_comparison_plans_three_runs_and_the_stable_regime():
    chaotic = _plan(runs=THREE_RUNS, iters=GPU_ITERS)
    stable = _plan(runs=THREE_RUNS, iters=GPU_ITERS, forwarded=STABLE_FLAGS)
    assert [r.name for r in chaotic.runs] == [r.name for r in stable.runs] == THREE_RUNS.split(",")
    for plan, lr, warm in ((chaotic, "3e-4", "2"), (stable, "3e-5", "10")):
        for run in (plan.init, *plan.runs):
            f = _flag_values(run.argv)
            assert (f["--lr"], f["--lr-warmup-iters"], f["--train-iters"]) == (lr, warm, "100"), run.name
    # the stable regime changes only the schedule: every other flag is the preset's
    drop = {"--lr", "--min-lr", "--lr-warmup-iters"}
    for a, b in zip(chaotic.runs, stable.runs, strict=True):
        fa, fb = _flag_values(a.argv), _flag_values(b.argv)
        assert {k: v for k, v in fa.items() if k not in drop} == {
            k: v for k, v in fb.items() if k not in drop
        }


def test_drift_limits_are_megatrons_own_drift():
    ref = [10.0 - 0.05 * i for i in range(GPU_ITERS)]
    off = [v * (1.2 if i > 50 else 1.0) for i, v in enumerate(ref)]  # 20 % apart after step 51
    less = [v * (1.1 if i > 50 else 1.0) for i, v in enumerate(ref)]
    # Megatron drifts 20 % from itself and MoK 10 %: within; the other way round: outside
    assert drift_problems(_result({"mok": less, "alltoall": ref, "alltoall-unfused": off})) == []
    bad = drift_problems(_result({"mok": off, "alltoall": ref, "alltoall-unfused": less}))
    assert len(bad) == 1 and bad[0].startswith("mok/alltoall mean_rel 9.80e-02 > Megatron against itself")
    assert bad[0].endswith("(largest step: 2.00e-01 vs 1.00e-01)")
    # one spike of MoK's larger than any of Megatron's, the mean smaller: a chaotic run's largest step is
    # where a spike falls, so only the mean is held
    spike = [v * (1.3 if i == 70 else 1.0) for i, v in enumerate(ref)]
    assert drift_problems(_result({"mok": spike, "alltoall": ref, "alltoall-unfused": less})) == []
    # step 1 keeps the bench's limit whatever Megatron's drift
    first = [ref[0] * 1.01] + less[1:]
    bad = drift_problems(_result({"mok": first, "alltoall": ref, "alltoall-unfused": off}))
    assert bad == ["mok/alltoall step 1 differs by 1.00e-02 (limit 0.001)"]
    # a failed run or a short log is named, not compared
    d = _result({"mok": less, "alltoall": ref, "alltoall-unfused": off}, rc={"alltoall-unfused": 1})
    assert "run alltoall-unfused exited 1" in drift_problems(d)
    assert drift_problems(_result({"mok": less[:40], "alltoall": ref, "alltoall-unfused": off})) == [
        "mok/alltoall: 40 common steps, not 100"
    ]


def test_stable_regime_premises_and_limits():
    learns = [10.0 * (1 - 0.3 * i / (GPU_ITERS - 1)) for i in range(GPU_ITERS)]  # 30 % below step 1
    near = [v * 1.001 for v in learns]
    d = _result({"mok": near, "alltoall": learns, "alltoall-unfused": near})
    assert stable_premise_problems(d) == [] and stable_problems(d) == []
    flat = [10.0 - 0.001 * i for i in range(GPU_ITERS)]
    d = _result({"mok": flat, "alltoall": flat, "alltoall-unfused": flat})
    assert stable_premise_problems(d) == [
        "alltoall's step-100 loss 9.9010 is 1.0 % below step 1's 10.0000 (need 15 %)"
    ]
    spiky = [v * (1.03 if i == 70 else 1.0) for i, v in enumerate(learns)]
    d = _result({"mok": near, "alltoall": learns, "alltoall-unfused": spiky})
    spike = "step 71 differs by 3.00e-02 relative (limit 0.02)"
    assert stable_premise_problems(d) == [f"{FLOOR} outside the limits: {spike}"]
    d = _result({"mok": spiky, "alltoall": learns, "alltoall-unfused": near})
    assert stable_premise_problems(d) == []
    assert stable_problems(d) == [f"mok/alltoall outside the limits: {spike}"]
    drift = [v * 1.008 for v in learns]  # every step within 2 %, the mean 0.8 %
    d = _result({"mok": [learns[0]] + drift[1:], "alltoall": learns, "alltoall-unfused": near})
    want = "mok/alltoall outside the limits: the mean difference is 7.92e-03"
    assert stable_problems(d)[0].startswith(want)


def _qwen3_bench(tmp_path, name: str, flags=()) -> dict:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / f"{name}.json"
    argv = ["--preset", "qwen3-30b-a3b", "--iters", str(GPU_ITERS), "--runs", THREE_RUNS]
    rc = train.main(argv + ["--workdir", str(tmp_path / name), "--json", str(out), "--", *flags])
    assert rc in (0, 3), f"mok bench train exited {rc}"  # 3: MoK outside the bench's fixed limits
    return json.loads(out.read_text())


@pytest.mark.gpu
def test_qwen3_loss_drift_within_megatrons_own_over_100_steps(tmp_path):
    d = _qwen3_bench(tmp_path, "preset")
    assert drift_problems(d) == [], (d["loss_agreement"]["mok/alltoall"], d["loss_agreement"][FLOOR])


@pytest.mark.gpu
def test_qwen3_loss_agreement_over_100_steps_in_a_stable_regime(tmp_path):
    d = _qwen3_bench(tmp_path, "stable", STABLE_FLAGS)
    assert stable_premise_problems(d) == [], "the stable regime is not one here; lower --lr in STABLE_FLAGS"
    assert stable_problems(d) == []


def test_gradient_accumulation_fusion_restores_megatrons_default_for_every_run():
    plan = _plan(fusion=True)
    for run in (plan.init, *plan.runs):
        assert "--no-gradient-accumulation-fusion" not in run.argv, run.name
    assert all("--no-gradient-accumulation-fusion" in run.argv for run in _plan().runs)


# ---- an FP8 comparison: both MoK FP8 expert backends, the bf16 steps ---------------------------------

FP8_FLAGS = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
FP8_RUNS = "mok-torch-fp8,mok-te,mok-bf16,alltoall,alltoall-bf16"


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
def test_fp8_comparison_runs_both_mok_backends_and_the_bf16_steps(preset):
    """One command: MoK's torch-fp8 and te experts and Megatron's layer in FP8, MoK's and Megatron's layers in
    bf16 (the FP8 flags dropped), every run loading the one initial checkpoint."""
    plan = _plan(preset, runs=FP8_RUNS, forwarded=FP8_FLAGS + ["--mok-fp8-dispatch", "--fp8-param-gather"])
    runs = {r.name: _flag_values(r.argv) for r in plan.runs}
    assert list(runs) == FP8_RUNS.split(",")
    assert {r.name: r.fp8 for r in plan.runs} == {
        "mok-torch-fp8": True, "mok-te": True, "mok-bf16": False, "alltoall": True, "alltoall-bf16": False
    }  # fmt: skip
    for name, backend in (("mok-torch-fp8", "torch-fp8"), ("mok-te", "te"), ("mok-bf16", "torch")):
        f = runs[name]
        assert f["--moe-token-dispatcher-type"] == "mok" and f["--mok-expert-backend"] == backend, name
        assert "--moe-router-padding-for-quantization" not in f and "--moe-grouped-gemm" not in f, name
    for name in ("mok-torch-fp8", "mok-te", "alltoall"):
        f = runs[name]
        assert (f["--fp8-format"], f["--fp8-recipe"], f["--fp8-param-gather"]) == ("e4m3", "blockwise", True)
    assert runs["mok-te"]["--mok-fp8-dispatch"] is True and "--mok-fp8-dispatch" not in runs["alltoall"]
    # the bf16 runs: not one FP8 flag (nor their values), Megatron's router padding for FP8 gone too
    for name in ("mok-bf16", "alltoall-bf16"):
        run = next(r for r in plan.runs if r.name == name)
        assert not [t for t in run.argv if "fp8" in t or t in ("e4m3", "blockwise")], name
        assert "--moe-router-padding-for-quantization" not in run.argv and runs[name]["--bf16"] is True
    a2a, a2a_bf16 = runs["alltoall"], runs["alltoall-bf16"]
    assert a2a["--moe-router-padding-for-quantization"] is True
    assert a2a["--moe-token-dispatcher-type"] == a2a_bf16["--moe-token-dispatcher-type"] == "alltoall"
    assert a2a_bf16["--moe-grouped-gemm"] is True and a2a_bf16["--moe-permute-fusion"] is True
    assert plan.runs[-1].label.endswith(", bf16") and "te experts" in plan.runs[1].label
    # every other flag is shared by all five runs and the checkpoint they load
    layer = {
        "--moe-token-dispatcher-type", "--mok-expert-backend", "--mok-fp8-dispatch", "--moe-grouped-gemm",
        "--moe-permute-fusion", "--moe-router-padding-for-quantization", "--fp8-format", "--fp8-recipe",
        "--fp8-param-gather",
    }  # fmt: skip
    common = [{k: v for k, v in f.items() if k not in layer} for f in runs.values()]
    assert all(c == common[0] for c in common) and common[0]["--load"] == "/w/ckpt"


def test_fp8_comparison_through_the_cli(capsys, monkeypatch):
    """``--runs mok-torch-fp8,mok-te,alltoall -- FP8 flags``: the commands of both MoK FP8 backends and
    Megatron's FP8 run, printed by --dry-run."""
    monkeypatch.setattr(train.Machine, "detect", staticmethod(lambda: H200))
    argv = "--preset deepseek-v3 --runs mok-torch-fp8,mok-te,alltoall --dry-run --".split() + FP8_FLAGS
    assert train.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    pairs = zip(lines[:-1], lines[1:], strict=True)
    commands = {a[2:].split(":")[0]: _flag_values(shlex.split(b)) for a, b in pairs if a.startswith("# ")}
    assert list(commands) == ["init", "mok-torch-fp8", "mok-te", "alltoall"]
    assert commands["mok-torch-fp8"]["--mok-expert-backend"] == "torch-fp8"
    assert commands["mok-te"]["--mok-expert-backend"] == "te"
    assert all(f["--fp8-recipe"] == "blockwise" for f in commands.values())


def test_drop_fp8_flags_keeps_everything_else():
    flags = [
        "--bf16", "--fp8-format=hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
        "--no-fp8-wgrad", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1", "--lr", "1e-4",
        "--moe-router-padding-for-quantization", "--mok-fp8-dispatch", "--mok-expert-backend", "te",
        "--mok-minibatch-size", "256",
    ]  # fmt: skip
    assert train.drop_fp8_flags(flags) == ["--bf16", "--lr", "1e-4", "--mok-minibatch-size", "256"]


_FP8_NEEDED = (
    r"needs --fp8-format; add -- --fp8-format e4m3 --fp8-recipe blockwise, or use mok for the bf16 layer\.$"
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(runs="mok-torch-fp8,alltoall"),
            r"^--runs mok-torch-fp8: runs MoK's torch-fp8 experts in FP8 and " + _FP8_NEEDED,
        ),
        (dict(runs="mok-te,alltoall"), r"^--runs mok-te: runs MoK's te experts in FP8 and " + _FP8_NEEDED),
        (
            dict(runs="mok,mok-bf16,alltoall"),
            r"^--runs mok-bf16: the bf16 run of an FP8 comparison drops the FP8 flags, and none is given; add "
            r"-- --fp8-format e4m3 --fp8-recipe blockwise, or use mok\.$",
        ),
        (dict(runs="mok,alltoall-bf16"), r"^--runs alltoall-bf16: .* or use alltoall\.$"),
        (
            dict(runs="mok-te,alltoall", forwarded=FP8_FLAGS, machine=Machine(True, 8, False, False)),
            r"^--runs mok-te: MoK's te expert backend runs Transformer Engine's GroupedLinear, which is not "
            r"importable here; install it \(pip install 'mok-megatron\[te\]'\) or drop mok-te\.$",
        ),
        (
            dict(runs="mok-torch-fp8,mok-te,alltoall", forwarded=FP8_FLAGS + ["--mok-expert-backend=te"]),
            r"^--mok-expert-backend te: --runs mok-torch-fp8,mok-te set their own expert backend; drop the "
            r"flag \(the mok run takes it: --runs mok,\.\.\. with --mok-expert-backend te\)\.$",
        ),
        (
            dict(runs="mok-torch-fp8,mok-bf16,alltoall-bf16", forwarded=FP8_FLAGS),
            r"^--runs mok-torch-fp8,mok-bf16,alltoall-bf16: no Megatron FP8 run to compare the FP8 runs with; "
            r"add alltoall\.$",
        ),
        (
            dict(preset="tiny", machine=CPU, runs="mok-bf16,alltoall", forwarded=FP8_FLAGS),
            r"^--runs mok-bf16: FP8 comparisons run on GPUs; this machine runs in CPU mode \(use --runs "
            r"mok,alltoall here\)\.$",
        ),
        (  # the CPU is named before the missing --fp8-format
            dict(preset="tiny", machine=CPU, runs="mok-te,alltoall", forwarded=[]),
            r"^--runs mok-te: FP8 comparisons run on GPUs",
        ),
        (  # mok-bf16 sets its own backend too
            dict(runs="mok-bf16,alltoall", forwarded=FP8_FLAGS + ["--mok-expert-backend", "te"]),
            r"^--mok-expert-backend te: --runs mok-bf16 sets its own expert backend",
        ),
    ],
)
def test_fp8_comparison_bad_input_is_one_line(kwargs, message):
    with pytest.raises(BenchTrainError) as e:
        _plan(**kwargs)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_fp8_report_reads_each_fp8_run_against_megatrons_fp8_run_and_its_bf16_step(tmp_path, capsys):
    """Speed-ups within a precision, each FP8 step over its layer's bf16 step, and every FP8 run's loss
    against Megatron's FP8 run (the bf16 runs against Megatron's bf16 run), as columns, lines and JSON."""
    import types

    plan = _plan(runs=FP8_RUNS, forwarded=FP8_FLAGS)

    def result(ms: float, last_loss: float = 4.70751):
        text = LOG.replace("/w/initial-checkpoint", "/w/ckpt").replace("4.707510E+00", f"{last_loss:E}")
        text = text.replace("(ms): 100.0 |", f"(ms): {ms} |")  # iteration 3: the one timed step
        return {"rc": 0, "seconds": 1.0, "command": [], "log": _log(text), "tail": []}

    results = {
        "init": {"rc": 0, "seconds": 1.0, "command": [], "tail": []},
        "mok-torch-fp8": result(80.0),
        "mok-te": result(120.0),
        "mok-bf16": result(100.0, last_loss=4.75),  # bf16 vs FP8: never held against the FP8 reference
        "alltoall": result(240.0),
        "alltoall-bf16": result(300.0, last_loss=4.75),
    }
    ns = types.SimpleNamespace(original_argv=[], json=str(tmp_path / "r.json"), png=None)
    rc = report(plan, results, H200, ns, str(tmp_path))
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, out
    assert d["speedup"] == pytest.approx(
        {"mok-torch-fp8/alltoall": 3.0, "mok-te/alltoall": 2.0, "mok-bf16/alltoall-bf16": 3.0}
    )
    assert d["fp8_vs_bf16"] == pytest.approx(
        {"mok-torch-fp8/mok-bf16": 0.8, "mok-te/mok-bf16": 1.2, "alltoall/alltoall-bf16": 0.8}
    )
    assert set(d["loss_agreement"]) == {"mok-torch-fp8/alltoall", "mok-te/alltoall", "mok-bf16/alltoall-bf16"}
    runs = d["runs"]
    assert [runs[n]["fp8"] for n in FP8_RUNS.split(",")] == [True, True, False, True, False]
    assert runs["mok-te"]["vs_megatron"] == pytest.approx(2.0) and "vs_megatron" not in runs["alltoall"]
    assert (
        runs["mok-torch-fp8"]["step_vs_bf16"] == pytest.approx(0.8) and "step_vs_bf16" not in runs["mok-bf16"]
    )
    head = out.splitlines()[1]
    assert "vs Megatron" in head and "step/bf16" in head
    assert re.search(r"^mok-torch-fp8 .* 3\.00x +0\.80x  MoK, torch-fp8 experts", out, re.MULTILINE), out
    assert re.search(r"^mok-te .* 2\.00x +1\.20x  MoK, te experts", out, re.MULTILINE), out
    assert re.search(r"^alltoall .* 0\.80x  Megatron alltoall", out, re.MULTILINE), out
    assert "mok-torch-fp8/mok-bf16: FP8 step 0.80x the bf16 step (80.0 vs 100.0 ms median)" in out
    assert "mok-te/alltoall: 2.00x tokens/s/GPU" in out and "mok-te/alltoall-bf16" not in out
    assert "loss agreement mok-te/alltoall: step 1" in out


def test_te_only_flags_reach_only_the_te_run():
    # --mok-te-single-weight belongs to the te backend: the runs that set another backend drop it, so one
    # comparison can hold both MoK FP8 backends
    plan = _plan(
        runs="mok-torch-fp8,mok-te,mok-bf16,alltoall", forwarded=FP8_FLAGS + ["--mok-te-single-weight"]
    )
    has = {r.name: "--mok-te-single-weight" in r.argv for r in plan.runs}
    assert has == {"mok-torch-fp8": False, "mok-te": True, "mok-bf16": False, "alltoall": False}
