"""One exchange of token rows between EP ranks through a workspace: pull dispatch, push combine.

``matrix[s][d]`` = rows rank s sends to rank d in this exchange. Rank s's rows are grouped by
destination (dest-major); rank d receives them grouped by source (source-major), exactly like
``all_to_all_single`` with those splits, so the result is bitwise the collective transport's.

    pull (dispatch)  [barrier] | stage my rows in my buffer | barrier | read my rows from every
                     peer's buffer straight into the output
    push (combine)   [barrier] | write my rows into every destination's buffer, source-major |
                     barrier (all rows landed) | copy my buffer's rows out

Signalling: ``hdl.barrier()`` of symmetric memory, on the device (no host synchronisation). The
barrier in brackets protects a buffer's readers of the previous exchange on it from its next writer;
any later barrier on the same stream already does that (every rank runs the same sequence of
exchanges, so the barrier counts agree), and buffers are kept per row format and direction, so in
the pipeline (x dispatch, routing dispatch, combine, ...) each exchange pays one barrier, not two.
A change of stream waits for the previous one and takes the bracketed barrier. The reduction that
follows a combine is the pipeline's fixed-order gather (deterministic).

``sync="flags"`` (``--mok-nvlink-sync flags``) signals per peer instead (``transport.nvlink.signals``): no barrier;
each format alternates between two buffers, so no rank overwrites rows a peer may still read:

    pull (dispatch)  stage my rows in buffer[n % 2] | publish | read each peer's rows once its flag
                     says they are staged (the pull kernel waits per peer)
    push (combine)   write my rows into every destination's buffer[n % 2] | publish | wait for every
                     peer's flag | copy my buffer's rows out

Legend: P ranks, N rows sent, R rows received, W words per row.
"""

from __future__ import annotations

import math

import torch

from mok_megatron.transport.nvlink import kernels as K
from mok_megatron.transport.nvlink import signals as S

SYNCS = ("barrier", "flags")


def row_offsets(matrix) -> tuple[list[list[int]], list[list[int]]]:
    """``send0[s][d]``: first row s sends to d in s's rows; ``recv0[d][s]``: where they land in d's."""
    P = len(matrix)
    send0 = [[sum(matrix[s][:d]) for d in range(P)] for s in range(P)]
    recv0 = [[sum(matrix[s2][d] for s2 in range(s)) for s in range(P)] for d in range(P)]
    return send0, recv0


def pull_segments(matrix, me: int) -> list[list[int]]:
    """``[P, 3]`` (src_row0 in peer p's rows, dst_row0 in my output, n) for rank ``me`` pulling."""
    send0, recv0 = row_offsets(matrix)
    return [[send0[p][me], recv0[me][p], matrix[p][me]] for p in range(len(matrix))]


def push_segments(matrix, me: int) -> list[list[int]]:
    """``[P, 3]`` (src_row0 in my rows, dst_row0 in peer p's buffer, n) for rank ``me`` pushing."""
    send0, recv0 = row_offsets(matrix)
    return [[send0[me][p], recv0[p][me], matrix[me][p]] for p in range(len(matrix))]


def buffer_rows(matrix) -> int:
    """Rows every rank's buffer needs: its own sends (pull) and its receives (push)."""
    P = len(matrix)
    return max([sum(r) for r in matrix] + [sum(matrix[s][d] for s in range(P)) for d in range(P)] + [1])


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without a stream synchronisation (a blocking copy would wait
    for everything queued on the stream, i.e. stall the pipeline): pinned, non-blocking."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_seg_cache: dict = {}  # (matrix, me, push, device) -> [P, 3] on the device; sync-free plans repeat


def _segment_table(matrix, me: int, push: bool, device) -> torch.Tensor:
    """The segment table on the device, cached: a repeated plan (sync-free capacities, or a CUDA graph
    replay) needs no host-to-device copy."""
    key = (tuple(map(tuple, matrix)), me, push, torch.device(device))
    seg = _seg_cache.get(key)
    if seg is None:
        if len(_seg_cache) > 1024:
            _seg_cache.clear()
        rows = push_segments(matrix, me) if push else pull_segments(matrix, me)
        seg = _seg_cache[key] = to_device(torch.tensor(rows, dtype=torch.int64), device)
    return seg


def _impl(use_triton: bool):
    if use_triton:
        return K.pull_rows, K.push_rows
    return K.pull_rows_reference, K.push_rows_reference


def _signal_impl(use_triton: bool):
    return (S.publish, S.wait) if use_triton else (S.publish_reference, S.wait_reference)


def _words(x: torch.Tensor):
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    word = K.word_dtype(row_bytes)
    return word, row_bytes // word.itemsize


class _Fences:
    """One rank's barrier bookkeeping on a workspace (identical on every rank: same exchanges)."""

    def __init__(self):
        self.count = 0  # barriers so far
        self.last: dict = {}  # buffer key -> barrier count when its readers last read it
        self.uses: dict = {}  # flags: buffer key -> exchanges so far (the buffer of this one: uses % 2)
        self.stream = None


def _fences(ws) -> _Fences:
    f = getattr(ws, "_fences", None)
    if f is None:
        f = ws._fences = _Fences()
    return f


def _barrier(ws, f: _Fences) -> None:
    ws.barrier()
    f.count += 1


def exchange_rows(
    ws,
    x: torch.Tensor,
    matrix,
    me: int,
    push: bool,
    programs: int,
    use_triton: bool = True,
    sync: str = "barrier",
):
    """This rank's part of one exchange on ``ws`` (an NVLinkWorkspace): the rows it receives.
    ``sync``: 'barrier' (symmetric memory's barrier) or 'flags' (per-peer ready flags)."""
    if sync not in SYNCS:
        raise ValueError(f"sync={sync!r}: choose one of {', '.join(SYNCS)}.")
    pull, push_fn = _impl(use_triton)
    x = x.contiguous()
    word, W = _words(x)
    R = sum(matrix[s][me] for s in range(len(matrix)))
    out = x.new_empty((R,) + tuple(x.shape[1:]))
    f = _fences(ws)  # (the modes may mix on one workspace: their buffers differ, and each is safe alone)
    key = (word, W, push)
    stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
    moved = f.stream is not None and stream != f.stream
    if moved:
        stream.wait_stream(f.stream)
    if sync == "flags":
        _exchange_flags(ws, f, x, out, matrix, me, push, programs, use_triton, key)
        f.stream = stream
        return out
    if moved or f.last.get(key) == f.count:
        _barrier(ws, f)  # before the buffer is written (or regrown) again
    peers = ws.buffers(word, W, buffer_rows(matrix), push)
    x_NW, out_RW = K.as_words(x, word), K.as_words(out, word)
    seg = _segment_table(matrix, me, push, x.device)
    if not push:
        peers.bufs[me][: x_NW.shape[0]].copy_(x_NW)
        _barrier(ws, f)
        pull(out_RW, peers, seg, programs)
    else:
        push_fn(x_NW, peers, seg, programs)
        _barrier(ws, f)
        out_RW.copy_(peers.bufs[me][:R])
    f.last[key] = f.count
    f.stream = stream
    return out


def _exchange_flags(ws, f: _Fences, x, out, matrix, me: int, push: bool, programs: int, use_triton, key):
    """``exchange_rows`` signalled by per-peer ready flags (see the module docstring)."""
    pull, push_fn = _impl(use_triton)
    publish, wait = _signal_impl(use_triton)
    n = f.uses.get(key, 0)
    f.uses[key] = n + 1
    word, W = key[0], key[1]
    peers = ws.buffers(word, W, buffer_rows(matrix), (push, n % 2))
    sig = ws.signals(me)
    x_NW, out_RW = K.as_words(x, word), K.as_words(out, word)
    seg = _segment_table(matrix, me, push, x.device)
    if not push:
        peers.bufs[me][: x_NW.shape[0]].copy_(x_NW)
        publish(sig)
        pull(out_RW, peers, seg, programs, signals=sig)
    else:
        push_fn(x_NW, peers, seg, programs)
        publish(sig)
        wait(sig)
        out_RW.copy_(peers.bufs[me][: out.shape[0]])


def loopback_exchange(
    ws,
    xs: list[torch.Tensor],
    matrix,
    push: bool,
    programs: int,
    use_triton: bool = True,
    sync: str = "barrier",
):
    """All N emulated ranks' parts of one exchange on a LoopbackWorkspace (same kernels and tables).
    ``sync='flags'``: every emulated rank publishes and waits on its ready flags (``transport.nvlink.signals``)."""
    if sync not in SYNCS:
        raise ValueError(f"sync={sync!r}: choose one of {', '.join(SYNCS)}.")
    pull, push_fn = _impl(use_triton)
    publish, wait = _signal_impl(use_triton)
    flags = sync == "flags"
    P = len(matrix)
    xs = [x.contiguous() for x in xs]
    word, W = _words(xs[0])
    peers = ws.buffers(word, W, buffer_rows(matrix), push)
    outs = []
    for d in range(P):
        R = sum(matrix[s][d] for s in range(P))
        outs.append(xs[0].new_empty((R,) + tuple(xs[0].shape[1:])))
    if not push:
        for s in range(P):
            peers.bufs[s][: xs[s].shape[0]].copy_(K.as_words(xs[s], word))
            if flags:
                publish(ws.signals(s))
        if not flags:
            ws.barrier()
        for d in range(P):
            seg = _segment_table(matrix, d, False, ws.device)
            sig = ws.signals(d) if flags else None
            pull(K.as_words(outs[d], word), peers, seg, programs, signals=sig)
    else:
        for s in range(P):
            seg = _segment_table(matrix, s, True, ws.device)
            push_fn(K.as_words(xs[s], word), peers, seg, programs)
            if flags:
                publish(ws.signals(s))
        if not flags:
            ws.barrier()
        for d in range(P):
            if flags:
                wait(ws.signals(d))
            K.as_words(outs[d], word).copy_(peers.bufs[d][: outs[d].shape[0]])
    return outs


def all_to_all_reference(xs: list[torch.Tensor], matrix) -> list[torch.Tensor]:
    """What ``all_to_all_single`` gives every rank (rows of each source, grouped by source)."""
    P = len(matrix)
    parts = [list(x.split(list(matrix[s]))) for s, x in enumerate(xs)]
    return [torch.cat([parts[s][d] for s in range(P)]) for d in range(P)]
