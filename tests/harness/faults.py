"""Fault injection and clean failure for the multi-node harness.

What happens when one worker dies mid-step (``--fault kill --fault-rank R --fault-step S`` kills rank R
with SIGKILL inside the first MoE layer, after the dispatch all-to-all and before the combine; ``--fault
stall`` makes it stop answering instead, with its sockets open):

- gloo: the peers blocked in the combine all-to-all see the dead rank's sockets close and raise at
  once ("Connection closed by peer"); a peer that is not talking to the dead rank raises when the
  collective timeout runs out (``init_process_group(timeout=...)``, ``--timeout-s``); so do all peers
  of a stalled rank.
- NCCL: a collective whose peer died does not return; the NCCL watchdog aborts the process when the
  same timeout runs out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default).
- The torchrun agent of the dead worker's node sees it exit, stops its other workers with SIGTERM
  (``--max-restarts 0``) and exits non-zero.

Every worker that fails goes through ``fail``: one line on stderr naming the rank, the step and the
cause, then ``os._exit`` with a non-zero code, without ``destroy_process_group`` (which can block
on a dead peer). So no worker outlives ``timeout`` after a peer dies.
"""

from __future__ import annotations

import os
import signal
import sys
import time

EXIT_COLLECTIVE = 3  # a collective failed or timed out (a peer died / hangs)
EXIT_CONFIG = 4  # ranks disagree on the MoE settings, or a bad checkpoint
EXIT_TERMINATED = 5  # stopped by SIGTERM (the torchrun agent stopping a failed node)
EXIT_ERROR = 6  # any other exception on this rank (its traceback is printed)

PREFIX = "[mok train_tiny]"


class StepClock:
    """Where this worker is (job, step), for messages and for the kill hook."""

    def __init__(self):
        self.job = "start-up"
        self.step = 0


def where(rank: int, clock: StepClock) -> str:
    node = os.environ.get("GROUP_RANK", "?")
    local = os.environ.get("LOCAL_RANK", "?")
    return f"rank {rank} (node {node}, local rank {local}), job {clock.job}, step {clock.step}"


# Text of the errors gloo / NCCL / c10d raise when a peer is gone or silent.
PEER_MARKERS = (
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
    "nccl",
    "gloo",
)


def fail(code: int, rank: int, clock: StepClock, message: str) -> None:
    sys.stdout.flush()
    # One write per line: the workers of a node share the agent's stderr.
    os.write(2, f"{PREFIX} {where(rank, clock)}: {message}\n".encode())
    os._exit(code)


def is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, (dist.DistError, TimeoutError)):
        return True
    return any(m in str(exc).lower() for m in PEER_MARKERS)


def fail_on_exception(rank: int, clock: StepClock, exc: BaseException, timeout_s: float) -> None:
    """Exit for an unexpected exception: a dead / silent peer gets its own explanation."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if is_peer_failure(exc):
        fail(
            EXIT_COLLECTIVE,
            rank,
            clock,
            f"a collective failed ({type(exc).__name__}: {first}). A peer process died or stopped "
            f"answering (collective timeout {timeout_s:g} s); exiting so that the job ends instead of "
            "hanging. The first failed rank is named in the torchrun agents' output.",
        )
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    fail(EXIT_ERROR, rank, clock, f"training failed on this rank: {type(exc).__name__}: {first}")


def exit_on_sigterm(rank: int, clock: StepClock) -> None:
    """SIGTERM (sent by the torchrun agent when another worker of its node failed) exits with a line."""

    def handler(signum, frame):
        fail(
            EXIT_TERMINATED,
            rank,
            clock,
            "stopped by SIGTERM: the torchrun agent is shutting this node down, usually because "
            "another worker failed.",
        )

    signal.signal(signal.SIGTERM, handler)


FAULTS = ("kill", "stall")


def install_fault(
    moe_layer, kind: str, rank: int, fault_rank: int, fault_step: int, clock: StepClock
) -> None:
    """Inside ``moe_layer`` (after dispatch, before combine) at ``fault_step``, rank ``fault_rank``
    either dies (``kill``: SIGKILL, its sockets close) or stops answering (``stall``: sleeps, its
    sockets stay open, so only the peers' collective timeout can end their wait)."""
    if kind not in FAULTS:
        raise ValueError(f"fault {kind!r}: choose one of {FAULTS}")
    if rank != fault_rank:
        return

    def hook(module, args):
        if clock.step != fault_step:
            return
        what = "SIGKILL" if kind == "kill" else "stalling (sleep)"
        os.write(
            2,
            f"{PREFIX} {where(rank, clock)}: fault injection: {what} inside the MoE experts, "
            "between dispatch and combine\n".encode(),
        )
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(1)

    moe_layer.experts.register_forward_pre_hook(hook)
