"""Per-peer ready flags: the NVLink exchanges' signalling without a barrier (``--mok-nvlink-sync flags``).

Each rank owns one flag word per peer in symmetric memory (``flags[d][s]``: the newest exchange epoch
rank s has published to rank d) and a private epoch counter ``epoch_1`` on its device. One exchange:

    publish   e = ++epoch; for every peer d: flags[d][me] = e      (release store, system scope)
    wait      for every peer s: spin until flags[me][s] >= e         (acquire load, system scope)

The pull kernel (dispatch) waits per peer itself, each program just before it reads that peer's rows,
so a destination starts on whichever sources are ready and no rank waits for the slowest rank of the
group before reading the others; the push direction (combine) waits in a one-program kernel and then
copies its landed rows out. The epoch lives on the device and only grows, so the same launches replay
correctly in a CUDA graph; nothing waits on the host.

Why no "consumed" acknowledgements are needed: every exchange waits for every peer's flag (peers that
send no rows too), and a rank publishes an epoch only after it has finished reading every buffer of its
previous exchanges (stream order). Each row format keeps two buffers used alternately
(``exchange._exchange_flags``), so the writer of a buffer at a format's exchange n+2 has already waited
for every peer's flag of exchange n+1 on that format, which each peer published after reading
exchange n's rows.

A spinning kernel blocks CUDA's lazy module loading in its process: the first launch of any other kernel
there (on any stream) waits until the spin ends. The exchange orders each rank's own publish before its
own waits, so no rank's progress depends on a load in a process that is spinning; one process that makes
two of its streams wait on each other (the loopback probes and tests) must launch every kernel once
before, or it traps (measured on one H200), ``CUDA_MODULE_LOADING=EAGER`` included (Triton loads each
newly compiled kernel itself). In the pipeline a first load while the communication stream spins only stalls
the host until the peer publishes (the peer does not wait for it).

A wait that sees no progress for ``SPIN_LIMIT`` polls (~27 s on an H200) traps: CUDA reports
"unspecified launch failure" instead of hanging (a peer died, or ranks ran different exchange sequences). The torch references (CPU, tests) raise ``RuntimeError`` naming the late ranks.

Legend: P peers (EP ranks of one NVLink domain).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mok_megatron.kernels import INTERPRETED, jit, tl
from mok_megatron.transport.nvlink.peers import PeerBuffers

SPIN_LIMIT = 1 << 26  # polls of one flag before a wait traps
WAIT_TIMEOUT_S = 60.0  # the torch reference's bound (the gloo collectives' timeout in the tests)


@dataclass(frozen=True)
class Signals:
    """One rank's flags: every rank's flag words ``flags.bufs[p]`` ([P] int64) and their addresses, this
    rank's epoch counter ``epoch_1`` ([1] int64, on the device), and this rank's index ``me``."""

    flags: PeerBuffers
    epoch_1: torch.Tensor
    me: int


TRAP = not INTERPRETED  # the interpreter has no inline assembly (and runs the ranks in order: no waits)


@jit
def spin_until(flag_ptr, e, SPIN_LIMIT: tl.constexpr, TRAP: tl.constexpr):
    """Return once ``*flag_ptr >= e`` (acquire, system scope: the peer's rows are visible after it)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    polls = 0
    while seen < e:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        polls += 1
        if TRAP:
            if polls > SPIN_LIMIT:
                tl.inline_asm_elementwise(
                    "trap; mov.u32 $0, $1;", "=r,r", [polls], dtype=tl.int32, is_pure=False, pack=1
                )


@jit
def _publish_kernel(table_ptr, epoch_ptr, me, P):
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    for p in range(0, P):
        flags = tl.load(table_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags + me, e, sem="release", scope="sys")


@jit
def _wait_kernel(flags_ptr, epoch_ptr, P, SPIN_LIMIT: tl.constexpr, TRAP: tl.constexpr):
    e = tl.load(epoch_ptr)
    for p in range(0, P):
        spin_until(flags_ptr + p, e, SPIN_LIMIT, TRAP)


def publish(sig: Signals) -> None:
    """Advance my epoch and tell every peer (Triton, one program, on the current stream)."""
    P = sig.flags.table_P.numel()
    _publish_kernel[(1,)](sig.flags.table_P, sig.epoch_1, sig.me, P, num_warps=1)


def wait(sig: Signals) -> None:
    """Block the current stream until every peer has published my current epoch (Triton)."""
    P = sig.flags.table_P.numel()
    mine = sig.flags.bufs[sig.me]
    _wait_kernel[(1,)](mine, sig.epoch_1, P, SPIN_LIMIT, TRAP, num_warps=1)


def wait_args(sig: Signals | None):
    """The pull kernel's (flags, epoch, spin limit, trap) arguments; without signals, dummies."""
    if sig is None:
        return None, None, 1, False
    return sig.flags.bufs[sig.me], sig.epoch_1, SPIN_LIMIT, TRAP


def publish_reference(sig: Signals) -> None:
    """``publish`` in torch (CPU workspaces: plain or shared-memory tensors)."""
    sig.epoch_1.add_(1)
    e = int(sig.epoch_1[0])
    for p in range(sig.flags.table_P.numel()):
        sig.flags.bufs[p][sig.me] = e


def wait_reference(sig: Signals, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """``wait`` in torch: poll my flag words; after ``timeout_s`` raise naming the ranks that are late."""
    e = int(sig.epoch_1[0])
    mine = sig.flags.bufs[sig.me]
    start = time.monotonic()
    while True:
        late = (mine < e).nonzero().flatten().tolist()
        if not late:
            return
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"NVLink exchange, rank {sig.me}: rank(s) {late} did not publish exchange {e} within "
                f"{timeout_s:.0f} s (flags {mine.tolist()}): a peer stopped, or the ranks ran different "
                "sequences of exchanges (every rank of the EP group must run the same layers)."
            )
        time.sleep(0.0002)
