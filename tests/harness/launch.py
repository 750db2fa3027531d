"""Launch ``torchrun`` agents on this host as if each were a node: a multi-node job on one machine.

Each agent is ``torchrun --nnodes N --node-rank n --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:<free port>``; agent 0 hosts the rendezvous store (``is_host=1``). Agents
run with ``--max-restarts 0``: a failed worker fails its node, as in a production launch. On a GPU
host, agent n sees only GPUs [n*P, (n+1)*P) (``CUDA_VISIBLE_DEVICES``), so P = GPUs / N by default.

Timeouts (all bounded; see ``faults`` for what the workers do):
    join_timeout   rendezvous: an agent waits at most this long for the other nodes (60 s)
    --timeout-s    workers: a collective waits at most this long for a peer (train_tiny, 120 s)
    timeout_s      here: the whole launch; agents still running then are killed (process groups)

    python -m tests.harness.launch [--nnodes 2] [--nproc-per-node P] -- <train_tiny args>
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = "tests.harness.train_tiny"
JOIN_TIMEOUT_S = 60


@dataclass
class AgentResult:
    node: int
    returncode: int | None  # None: killed here at the launch timeout
    output: str  # the agent's stdout + stderr, which include its workers'
    seconds: float  # from launch to this agent's exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(node: int, nnodes: int, nproc: int, port: int, worker_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=mok-{port}",
        f"--rdzv-conf=is_host={int(node == 0)},join_timeout={JOIN_TIMEOUT_S}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        "-m",
        WORKER,
        *worker_args,
    ]


def agent_env(node: int, nproc: int, gpus: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.update(TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * nproc + i) for i in range(nproc))
    else:
        env["OMP_NUM_THREADS"] = "1"
    return env


def launch(
    worker_args: list[str],
    nnodes: int = 2,
    nproc_per_node: int | None = None,
    node_args: dict[int, list[str]] | None = None,
    timeout_s: float = 300.0,
) -> list[AgentResult]:
    """Run ``nnodes`` agents of ``nproc_per_node`` workers each; wait for all; return per agent."""
    gpus = _gpu_count()
    nproc = nproc_per_node or (gpus // nnodes if gpus else 2)
    if gpus and nproc * nnodes > gpus:
        raise ValueError(
            f"{nnodes} nodes x {nproc} workers need {nproc * nnodes} GPUs; this host has {gpus}."
        )
    port = free_port()
    logs, procs = [], []
    t0 = time.monotonic()
    for node in range(nnodes):
        log = tempfile.TemporaryFile(mode="w+")
        args = worker_args + (node_args or {}).get(node, [])
        procs.append(
            subprocess.Popen(
                agent_command(node, nnodes, nproc, port, args),
                env=agent_env(node, nproc, gpus),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killable with its workers
            )
        )
        logs.append(log)
    ended: dict[int, float] = {}
    deadline = t0 + timeout_s
    while len(ended) < nnodes and time.monotonic() < deadline:
        for node, p in enumerate(procs):
            if node not in ended and p.poll() is not None:
                ended[node] = time.monotonic() - t0
        time.sleep(0.1)
    results = []
    for node, p in enumerate(procs):
        if node not in ended:
            # torchrun puts each worker in a process group of its own (setsid): kill them, then the agent's.
            for pid in _descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        logs[node].seek(0)
        output = logs[node].read()
        logs[node].close()
        rc = p.returncode if node in ended else None
        results.append(AgentResult(node, rc, output, ended.get(node, timeout_s)))
    return results


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m tests.harness.launch", description=__doc__)
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: GPUs / nnodes, else 2")
    p.add_argument("--timeout-s", type=float, default=600.0, help="kill the launch after this long")
    a = p.parse_args(argv[:split])
    results = launch(argv[split + 1 :], a.nnodes, a.nproc_per_node, timeout_s=a.timeout_s)
    for r in results:
        print(f"===== agent {r.node}: exit {r.returncode} after {r.seconds:.1f} s =====")
        print(r.output)
    codes = [r.returncode for r in results]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
