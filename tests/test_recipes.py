"""``mok recipe check``: every recipe in examples/ passes; broken variants fail naming the rule and the
fix; the parameter count agrees with Megatron's own estimator; the memory model moves the right way."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from mok_megatron.tools.recipe import check as recipes
from mok_megatron.tools.recipe.layout import Parallel, stages
from mok_megatron.tools.recipe.memory import GIB, chunk_params, in_flight, padded_vocab

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "examples").glob("*.sh"))
EX = ROOT / "examples"


@pytest.fixture(scope="module")
def dry():
    return {r.name: recipes.dry_run(r) for r in RECIPES}


def _with(recipe: recipes.Recipe, flag: str, *values: str, **cluster) -> recipes.Recipe:
    """The recipe with ``flag``'s values replaced (or the flag added), and cluster fields changed."""
    argv = list(recipe.argv)
    if flag in argv:
        i = argv.index(flag)
        j = next((k for k in range(i + 1, len(argv)) if argv[k].startswith("--")), len(argv))
        argv[i + 1 : j] = values
    else:
        argv += [flag, *values]
    return recipes.Recipe(recipe.path, dataclasses.replace(recipe.cluster, **cluster), argv)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_passes_the_check(recipe, capsys):
    assert recipes.main(["check", str(recipe)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert re.search(r"TP \d+\s+PP \d+\s+VPP \d+\s+CP \d+\s+DP \d+\s+EP \d+", out) and out.rstrip().endswith(
        "OK"
    )


def test_cli_on_the_cpu_recipe_prints_the_report_only():
    """``mok recipe check examples/tiny_moe.sh`` on a machine without a GPU: no Megatron import notes before
    the report, and the report says what the recipe runs on there (gloo processes), not a GPU."""
    r = subprocess.run(
        [sys.executable, "-m", "mok_megatron.cli", "recipe", "check", str(EX / "tiny_moe.sh")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), DEVICE="cpu", NPROC="2"),
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "tiny_moe.sh: 1 node x 2 CPU process(es) (gloo), no GPU", lines
    assert "EP 2" in lines[1] and "NVLink" not in lines[1] and lines[-1] == "  OK", lines


def test_gpu_line_names_the_gpu_checked_against(capsys, monkeypatch):
    monkeypatch.setenv("DEVICE", "gpu")
    recipe = recipes.dry_run(EX / "tiny_moe.sh")
    assert recipe.cluster.gpu == "H100"
    assert recipes.format_report(recipes.check(recipe)).splitlines()[0] == "tiny_moe.sh: 1 node x 1 H100 GPUs"
    first = recipes.format_report(recipes.check(recipe, "GB300")).splitlines()
    assert first[0] == "tiny_moe.sh: 1 node x 1 GB300 GPUs" and "vs 268 GiB HBM" in first[2], first


def test_cli_exits_1_and_names_the_problem_and_the_fix():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mok_megatron.cli",
            "recipe",
            "check",
            str(EX / "tiny_moe.sh"),
            "--gpu",
            "H100",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), NPROC="3"),  # 8 experts over EP 3
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--num-experts 8 is not divisible by --expert-model-parallel-size 3" in r.stderr
    assert "Use an EP size from [1, 2, 4, 8]" in r.stderr


@pytest.mark.parametrize(
    "recipe, change, message",
    [
        (
            "deepseek_v3_gb300.sh",
            dict(nodes=3),
            r"world size 12 \(3 nodes x 4 GPUs\) is not divisible by TP x PP x CP = 1 x 8 x 1 = 8.*Pick",
        ),
        (
            "qwen3_30b_a3b_h200_fp8.sh",
            ("--expert-model-parallel-size", "32"),
            r"EP x ETP = 32 x 1 = 32 does not divide the 16 non-expert ranks.*ETP x EP x PP = 64.*from \[1, 2",
        ),
        (
            "qwen3_30b_a3b_h200_fp8.sh",
            ("--expert-model-parallel-size", "16"),
            r"EP x ETP = 16 x 1 = 16 consecutive GPUs does not fit evenly in the 8-GPU NVLink domain.*\[1, 2, 4, 8\]",
        ),
        (
            "deepseek_v3_gb300.sh",
            ("--pipeline-model-parallel-layout", "Et|(tt|)*29mL"),
            r"layout 'Et\|\(tt\|\)\*29mL' with PP 8.*divisible by pipeline_model_parallel_size.*Fix the layout",
        ),
        (
            "kimi_k2_gb300.sh",
            ("--pipeline-model-parallel-layout", "E|(tt|)*30L"),
            r"--num-layers 61.*must match num_layers 61",
        ),
        (
            "qwen3_30b_a3b_h200_fp8.sh",
            ("--num-layers", "46"),
            r"--num-layers 46 does not split over PP x VPP = 2 x 2 = 4 model chunks",
        ),
        (
            "qwen3_30b_a3b_h200_fp8.sh",
            ("--global-batch-size", "500"),
            r"--global-batch-size 500 is not divisible by --micro-batch-size x DP = 1 x 16 = 16",
        ),
        ("qwen3_235b_a22b_gb300.sh", ("--tensor-model-parallel-size", "8"), r"--num-query-groups 4 .* TP 8"),
        (
            "qwen3_30b_a3b_gb300.sh",
            ("--num-virtual-stages-per-pipeline-rank", "2"),
            r"2 virtual pipeline stages with --pipeline-model-parallel-size 1.*raise PP",
        ),
        (
            "deepseek_v3_gb300.sh",
            ("--micro-batch-size", "4"),
            r"memory: pipeline rank \d needs ~\d+ GiB, above the GB300's 268 GiB\. Fix: add recompute",
        ),
    ],
)
def test_broken_variants_fail_with_the_rule_and_the_fix(dry, recipe, change, message):
    r = dry[recipe]
    r = (
        dataclasses.replace(r, cluster=dataclasses.replace(r.cluster, **change))
        if isinstance(change, dict)
        else _with(r, *change)
    )
    report = recipes.check(r)
    assert not report.ok
    assert re.search(message, "\n".join(report.problems)), report.problems


# Published totals (billions): DeepSeek-V3 671 + its MTP module, Qwen3 235B-A22B and 30B-A3B, Kimi K2 1.04T.
PUBLISHED = {"deepseek": 671 + 11.5, "kimi": 1040, "qwen3_235b": 235, "qwen3_30b": 30.5, "tiny": None}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_parameter_count_matches_megatrons_estimator_and_the_published_size(dry, recipe):
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    a = recipes.parse(dry[recipe.name])
    a.tensor_model_parallel_size = 1
    chunks = stages(a, a.pipeline_model_parallel_size)
    one = Parallel(tp=1, pp=1, vpp=1, cp=1, dp=1, ep=1, etp=1, edp=1, microbatches=1)
    ours = sum(chunk_params(a, one, c, with_embedding=True).total for c in chunks)
    # Megatron's estimator leaves out MTP's eh_proj (2h x h) and its two norms; we count them.
    mtp_extra = (a.mtp_num_layers or 0) * (2 * a.hidden_size**2 + 2 * a.hidden_size)
    a.padded_vocab_size, a.world_size, a.data_parallel_size = padded_vocab(a), 1, 1
    a.kv_channels = a.kv_channels or a.hidden_size // a.num_attention_heads  # what validate_args sets
    a.expert_model_parallel_size = a.expert_tensor_parallel_size = a.pipeline_model_parallel_size = 1
    buf = io.StringIO()
    with redirect_stdout(buf):
        compute_weight_and_optimizer_memory(a, verbose=True)
    theirs = (
        float(re.search(r"Total number of parameters in billions: ([0-9.]+)", buf.getvalue()).group(1)) * 1e9
    )
    assert abs(ours - mtp_extra - theirs) <= 0.006e9, (ours, mtp_extra, theirs)
    published = next(v for k, v in PUBLISHED.items() if recipe.name.startswith(k))
    if published:
        assert abs(ours / 1e9 - published) <= 0.015 * published, (recipe.name, ours / 1e9)


def test_in_flight_micro_batches_follow_megatrons_schedules():
    p = Parallel(tp=1, pp=8, vpp=4, cp=1, dp=64, ep=64, etp=1, edp=1, microbatches=64)
    # Interleaved: the penalty of Megatron's theoretical_memory_usage, pp*(1 + (pp-1)/(pp*vpp)) pipeline
    # chunks' worth on rank 0, i.e. vpp*pp + pp - 1 model-chunk forwards; then 2 fewer per later rank.
    assert [len(in_flight(p, r)) for r in range(8)] == [4 * 8 + 8 - 1 - 2 * r for r in range(8)]
    assert in_flight(p, 0)[:9] == [0] * 8 + [1]  # chunk 0 for PP micro-batches, then chunk 1
    one_f_one_b = dataclasses.replace(p, vpp=1)
    assert [len(in_flight(one_f_one_b, r)) for r in range(8)] == [8 - r for r in range(8)]
    few = dataclasses.replace(one_f_one_b, microbatches=3)
    assert len(in_flight(few, 0)) == 3  # never more than the step has


def test_memory_moves_the_right_way(dry):
    base = dry["qwen3_235b_a22b_gb300.sh"]

    def peak(r):
        return recipes.check(r).peak

    b = peak(base)
    no_recompute = peak(recipes.Recipe(base.path, base.cluster, [x for x in base.argv if x != "layernorm"]))
    assert no_recompute.activations > b.activations  # recomputing norms saves their outputs
    full = peak(_with(base, "--recompute-granularity", "full", "--recompute-method", "uniform"))
    assert full.activations < 0.5 * b.activations
    assert (
        peak(_with(base, "--micro-batch-size", "2", "--global-batch-size", "4096")).activations
        > 1.9 * b.activations
    )
    ep8 = peak(_with(base, "--expert-model-parallel-size", "8"))
    assert ep8.params > 2 * b.params and ep8.weights > 2 * b.weights  # 16 experts per GPU instead of 4
    argv = [x for x in base.argv if x != "--use-distributed-optimizer"]
    dist, no_dist = (
        recipes.check(base).estimates[0],
        recipes.check(recipes.Recipe(base.path, base.cluster, argv)).estimates[0],
    )
    # the recipe keeps BF16 Adam moments (--use-precision-aware-optimizer): fp32 master 4 + 2 + 2, unsharded
    assert no_dist.optimizer == 8 * no_dist.params
    assert dist.optimizer < no_dist.optimizer / 2 and no_dist.grads == dist.grads  # DP 32 / EDP 2 shards
    assert b.total < 100 * GIB  # GB300 headroom the recipe comments rely on


def _without(recipe: recipes.Recipe, *flags: str) -> recipes.Recipe:
    """The recipe without ``flags`` and their values."""
    argv, skip = [], False
    for a in recipe.argv:
        if a.startswith("--"):
            skip = a in flags
        if not skip:
            argv.append(a)
    return recipes.Recipe(recipe.path, recipe.cluster, argv)


def test_precision_aware_optimizer_states_set_the_optimizer_bytes(dry):
    base = dry["deepseek_v3_gb300.sh"]
    flags = (
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "--main-params-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
    )
    fp32 = _without(_without(base, *flags), "--use-distributed-optimizer")
    bf16 = _without(base, "--use-distributed-optimizer")
    e32, e16 = recipes.check(fp32).estimates[0], recipes.check(bf16).estimates[0]
    assert e32.optimizer == 12 * e32.params and e16.optimizer == 8 * e16.params  # fp32 master + 2 moments
    assert e16.grads == e32.grads == 4 * e16.params  # --main-grads-dtype fp32
    fp8 = _with(bf16, "--exp-avg-sq-dtype", "fp8")
    assert recipes.check(fp8).estimates[0].optimizer == 7 * e16.params
    bf16_grads = _with(bf16, "--main-grads-dtype", "bf16")
    assert recipes.check(bf16_grads).estimates[0].grads == 2 * e16.params


@pytest.mark.parametrize("recipe", [r.name for r in RECIPES if r.name != "tiny_moe.sh"])
def test_recipes_follow_megatrons_published_mxfp8_and_optimizer_settings(dry, recipe):
    """Megatron's own GB200/GB300 MoE recipes: MXFP8 parameter all-gather through the grad buffer and BF16
    Adam moments with fp32 master weights; Hopper blockwise FP8 keeps the optimizer part."""
    a = recipes.parse(dry[recipe])
    assert a.use_precision_aware_optimizer and (a.exp_avg_dtype, a.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert (a.main_params_dtype, a.main_grads_dtype) == ("fp32", "fp32")
    if a.fp8_recipe == "mxfp8":
        assert a.fp8_param_gather and a.reuse_grad_buf_for_mxfp8_param_ag
    assert a.attention_dropout == 0.0 and a.hidden_dropout == 0.0 and a.moe_router_fusion


@pytest.mark.parametrize(
    "change, message",
    [
        (
            ("--mok-capacity-multiplier", "0.5"),
            r"captures the whole MoE layer, but --mok-capacity-multiplier=0.5",
        ),
        (("--recompute-modules", "mla_up_proj", "moe_act"), r"torch-fp8 does not recompute the activation"),
        (("--mok-expert-backend", "te"), r"te reads the per-expert row counts on the host"),
    ],
)
def test_mok_layer_rules_are_checked_from_the_command_line(dry, change, message):
    """What the MoK layer would refuse when built: a whole-layer CUDA graph with a capacity multiplier below
    1.0, moe_act recompute on the FP8 expert backends, TE experts in sync-free mode."""
    report = recipes.check(_with(dry["deepseek_v3_gb300.sh"], *change))
    assert not report.ok and any(re.search(message, p) for p in report.problems), report.problems


def test_moe_act_recompute_is_fine_with_mok_bf16_experts(dry):
    r = _with(
        _with(dry["deepseek_v3_gb300.sh"], "--recompute-modules", "moe_act"), "--mok-expert-backend", "torch"
    )
    assert recipes.check(r).ok


def test_a_recipe_that_refuses_its_settings_or_is_missing_is_named_as_such(tmp_path):
    """A recipe's own refusal (a bad ITERS) is reported with its line, and a missing file as missing: neither
    gets the hint about sourcing examples/lib/common.sh, which points the wrong way there."""
    with pytest.raises(recipes.RecipeError) as e:
        recipes.dry_run(EX / "tiny_moe.sh", env={"ITERS": "abc"})
    assert str(e.value) == (
        f"{EX / 'tiny_moe.sh'}: DRY_RUN=1 exited 2: tiny_moe.sh: ITERS=abc: must be a whole number >= 1 "
        "(e.g. ITERS=20)."
    )
    with pytest.raises(
        recipes.RecipeError, match=r"nope\.sh: no such file \(the recipes are examples/\*\.sh\)$"
    ):
        recipes.dry_run(tmp_path / "nope.sh")
    silent = tmp_path / "silent.sh"
    silent.write_text("exit 0\n")
    with pytest.raises(recipes.RecipeError, match="must source examples/lib/common.sh and call mok_launch"):
        recipes.dry_run(silent)
