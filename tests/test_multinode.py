"""Two "nodes" on one host: two torchrun agents (c10d rendezvous), 2 workers each (gloo on CPU; on a
GPU host, GPUs / 2 workers each over NCCL), training the demo's tiny MoE GPT.

One launch (``first``, shared by the module) runs: Megatron's alltoall MoELayer then MoK for 10 steps
at EP=4 (spanning both nodes) and at DP=2 x EP=2, the MoK run with a checkpoint at step 5, and the
short skew soak. Further launches: the resume, and the three faults. See ``tests/harness``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import pytest

from tests.harness.launch import launch

STEPS = 10
SAVE_AT = 5
SKEW_STEPS_CI = 20
SKEW_STEPS_FULL = 200
# fp32, same initial weights and data: MoK reproduces Megatron's alltoall layer bitwise on this
# model (measured max relative difference 0.0); 1e-6 leaves room for a reordered sum.
LOSS_RTOL = 1e-6
# Collective timeout of the fault launches: a stalled peer is detected after this long. The launch is
# killed (and the test fails) after start-up (up to a minute on a loaded 2-core box) plus 4x as long.
FAULT_TIMEOUT_S = 15
FAULT_LAUNCH_S = 60 + 4 * FAULT_TIMEOUT_S
# Peak RSS may wobble by allocator pages; a per-step leak over the soak would exceed this.
MEMORY_GROWTH_BYTES = 8 << 20


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if 0 < _gpus() < 4:
    pytest.skip("two nodes with EP=4 need 4 GPUs (or none: CPU mode)", allow_module_level=True)


def _run(tmp, *args, node_args=None, timeout_s=240.0, nproc_per_node=None):
    t0 = time.monotonic()
    agents = launch(
        ["--out", str(tmp), *map(str, args)],
        nproc_per_node=nproc_per_node,
        node_args=node_args,
        timeout_s=timeout_s,
    )
    wall = time.monotonic() - t0
    output = "\n".join(a.output for a in agents)
    results = None
    if os.path.exists(tmp / "results.json"):
        with open(tmp / "results.json") as f:
            results = json.load(f)
    return agents, output, results, wall


def _ok(agents, output):
    assert all(a.returncode == 0 for a in agents), output[-6000:]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first")
    run = _run(
        tmp,
        "--steps", STEPS, "--compare-ep", 4, 2,
        "--ckpt-ep", 4, "--save-at", SAVE_AT, "--ckpt-dir", tmp / "ckpt",
        "--skew-steps", SKEW_STEPS_CI,
    )  # fmt: skip
    _ok(run[0], run[1])
    print(f"\nfirst launch: {run[3]:.1f} s")
    return tmp, run[2]


@pytest.mark.parametrize("ep", [4, 2], ids=["ep4", "dp2xep2"])
def test_mok_matches_megatron_losses_across_two_nodes(first, ep):
    _, res = first
    golden, mok = res[f"compare-ep{ep}-megatron"]["losses"], res[f"compare-ep{ep}-mok"]["losses"]
    assert sorted(map(int, golden)) == list(range(1, STEPS + 1)) == sorted(map(int, mok))
    layout = res[f"compare-ep{ep}-mok"]
    assert (layout["ep"], layout["ep"] * layout["expert_dp"]) == (ep, layout["world"])
    worst = max(abs(mok[s] - golden[s]) / abs(golden[s]) for s in golden)
    assert worst <= LOSS_RTOL, f"EP={ep}: max relative loss difference {worst:.3e} > {LOSS_RTOL}"
    assert golden[str(STEPS)] < golden["1"], "the golden run did not train"


def _tree_hash(path) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_resume_after_restarting_both_agents_is_exact(first, tmp_path):
    tmp, res = first
    ckpt = tmp / "ckpt" / f"step_{SAVE_AT}"
    assert not os.path.exists(str(ckpt) + ".partial"), "the save did not publish atomically"
    agents, output, resumed, wall = _run(
        tmp_path, "--steps", STEPS, "--ckpt-ep", 4, "--resume", ckpt
    )  # fmt: skip
    _ok(agents, output)
    print(f"\nresume launch: {wall:.1f} s")
    got, want = resumed["ckpt-resumed"]["losses"], res["ckpt"]["losses"]
    assert sorted(map(int, got)) == list(range(SAVE_AT + 1, STEPS + 1))
    # bitwise: model, Adam moments and step, RNG (the run has dropout) and data position restored
    assert {s: got[s] for s in got} == {s: want[s] for s in got}


def test_truncated_checkpoint_fails_clearly_and_writes_nothing(first, tmp_path):
    tmp, _ = first
    bad = tmp_path / "bad"
    shutil.copytree(tmp / "ckpt" / f"step_{SAVE_AT}", bad)
    victim = bad / "__1_0.distcp"
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    before = _tree_hash(bad)
    new_dir = tmp_path / "new"
    agents, output, _, wall = _run(
        tmp_path / "out", "--steps", 12, "--ckpt-ep", 4, "--resume", bad, "--save-at", 11, "--ckpt-dir", new_dir
    )  # fmt: skip
    print(f"\ntruncated-checkpoint launch: {wall:.1f} s")
    assert all(a.returncode not in (0, None) for a in agents), output[-4000:]
    msg = rf"checkpoint {re.escape(str(bad))} is truncated: __1_0.distcp has {size // 2} bytes, its index needs \d+"
    # Each rank checks before loading anything; torchrun's agents stop the others once one rank fails,
    # so not every rank always gets to print (3 of 4 seen once on the 2-core CI box).
    assert len(re.findall(msg, output)) >= 1, output[-4000:]
    assert _tree_hash(bad) == before, "the failed resume changed the checkpoint"
    assert not os.path.exists(new_dir), "a failed resume must not save anything"


# The start-up and fault launches need only one worker per node: EP=2 spans both nodes.
def test_mismatched_moe_config_is_caught_at_start_up(tmp_path):
    agents, output, _, wall = _run(
        tmp_path, "--steps", 2, "--ckpt-ep", 2, node_args={1: ["--experts", "16"]}, nproc_per_node=1
    )
    print(f"\nmismatch launch: {wall:.1f} s")
    assert all(a.returncode not in (0, None) for a in agents), output[-4000:]
    lines = [ln for ln in output.splitlines() if "MoEConfigMismatchError" in ln]
    assert len(lines) == 2, output[-4000:]
    detail = r"num_moe_experts: (8|16) on ranks \[\d\]; (16|8) on ranks \[\d\]"
    assert re.search(detail, output), output[-4000:]
    assert "job start-up, step 0" in lines[0]
    assert "loss at step" not in output


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_failed_worker_ends_the_job_with_clear_messages(tmp_path, fault):
    """kill: the peers see the sockets close at once. stall: the rank stops answering with its sockets
    open, so the peers wait out the collective timeout; its agent then stops it with SIGTERM."""
    agents, output, _, wall = _run(
        tmp_path, "--steps", 8, "--ckpt-ep", 2, "--timeout-s", FAULT_TIMEOUT_S,
        "--fault", fault, "--fault-rank", 1, "--fault-step", 3,
        timeout_s=FAULT_LAUNCH_S, nproc_per_node=1,
    )  # fmt: skip
    print(f"\n{fault} launch: {wall:.1f} s, agents exited after {[round(a.seconds, 1) for a in agents]} s")
    assert all(a.returncode not in (0, None) for a in agents), (
        "an agent hung or succeeded:\n" + output[-4000:]
    )
    assert re.search(r"rank 1 .*step 3: fault injection: (SIGKILL|stalling)", output)
    others = (0,) if fault == "kill" else (0, 1)
    for rank in others:
        pattern = rf"\[mok train_tiny\] rank {rank} \(node \d, local rank \d\), job ckpt, step 3: "
        assert re.search(pattern + r"(a collective failed|stopped by SIGTERM)", output), (
            f"rank {rank} left no message:\n" + output[-6000:]
        )
    if fault == "stall":  # the peers waited for the timeout, and not much longer
        assert FAULT_TIMEOUT_S <= max(a.seconds for a in agents), "a stalled peer cannot be detected sooner"
        assert re.search(rf"collective timeout {FAULT_TIMEOUT_S} s", output)


def test_a_launch_killed_at_its_timeout_leaves_no_worker(tmp_path):
    """torchrun puts each worker in a process group of its own (setsid); killing the agents' groups alone
    would orphan a stalled worker. The launch kills every process below its agents."""
    out = tmp_path / "killed"
    agents, _, _, wall = _run(
        out, "--steps", 8, "--ckpt-ep", 2, "--timeout-s", 600, "--fault", "stall", "--fault-rank", 1,
        "--fault-step", 1, timeout_s=15, nproc_per_node=1,
    )  # fmt: skip
    assert all(a.returncode is None for a in agents), "the launch ended before its timeout"
    time.sleep(0.5)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"processes of the killed launch still run: {left}"


def _check_skew(res, steps):
    tokens, memory = res["tokens"], res["memory"]
    # every token of every rank went to one expert per layer, and came back
    assert tokens["routed"] == tokens["in_rows"] == tokens["out_rows"]
    for per_expert, routed in zip(tokens["per_expert"], tokens["routed"], strict=True):
        assert sum(per_expert) == routed, "tokens lost between router and experts"
        assert max(per_expert) == routed, f"routing was not forced onto one expert: {per_expert}"
    report = []
    for rank, m in enumerate(memory):
        report.append(
            f"rank {rank}: {m['kind']} at warm-up {m['at_warmup'] / 2**20:.1f} MiB, peak {m['peak'] / 2**20:.1f} MiB, "
            f"growth over the run {m['growth'] / 2**10:.0f} KiB"
        )
        assert len(m["per_step"]) == steps
        assert m["growth"] <= MEMORY_GROWTH_BYTES, report[-1]
    print("\nskew soak, " + f"{steps} steps:\n  " + "\n  ".join(report))


def test_skew_soak_short(first):
    _check_skew(first[1]["skew"], SKEW_STEPS_CI)


@pytest.mark.slow
def test_skew_soak_full(tmp_path):
    agents, output, res, wall = _run(
        tmp_path, "--skew-steps", SKEW_STEPS_FULL, "--skew-warmup", 10, timeout_s=600
    )  # fmt: skip
    _ok(agents, output)
    print(f"\nskew soak launch: {wall:.1f} s")
    _check_skew(res["skew"], SKEW_STEPS_FULL)
