"""The loopback transport's link time: a one-thread kernel that spins on the GPU's wall clock.

    spin_ns(ns, device)   on the current stream: busy for ``ns`` nanoseconds of ``%globaltimer`` (wall
                          time, independent of the SM clock), on one warp of one SM

No torch reference: on CPU the loopback moves its rows without a link delay (nothing to emulate there).

Why not ``torch.cuda._sleep(cycles)``: it counts SM clock cycles, converted from a link time by one
calibration, and the H200's SM clock moves between ~345 MHz (idle), 1.98 GHz (boost) and 1.47-1.75 GHz
(power-capped under GEMMs), so the emulated link would run faster or slower than asked. The wall clock
does not move: measured 460 us per 0.46 ms exchange inside the layer on one H200. A CUDA graph captures
the kernel with its duration as an argument. Beside GEMMs on another stream (30 back to back, 48 ms) a
5 ms spin takes 5.13-5.16 ms, launched before or while they run (the loopback's 400 MB copy there:
0.30 ms alone, 0.23-0.45 ms beside them).
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import INTERPRETED, jit, tl, triton


def _jit_unspecialized(fn):
    # one compiled kernel for every duration (Triton would specialise an int argument on 1 and on
    # divisibility by 16: a first launch of another duration would compile for ~1 s)
    return triton.jit(do_not_specialize=["ns"])(fn) if triton is not None else jit(fn)


@_jit_unspecialized
def _spin_ns_kernel(ns):
    t0 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = t0
    while now - t0 < ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


def spin_ns(ns: int, device: torch.device) -> None:
    """Occupy the current CUDA stream of ``device`` for ``ns`` nanoseconds of wall time."""
    if device.type != "cuda" or INTERPRETED or triton is None:
        raise ValueError(
            f"spin_ns: a CUDA device with compiled Triton kernels is needed (got {device}, interpreted="
            f"{INTERPRETED}); the loopback adds no link delay on CPU"
        )
    if ns > 0:
        with torch.cuda.device(device):
            _spin_ns_kernel[(1,)](int(ns), num_warps=1)
