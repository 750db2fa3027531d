"""A persistent group of gloo worker processes for multi-process tests on CPU.

Importing torch + Megatron-Core costs seconds per process on a small machine, so the workers start
once (per test run, see ``conftest.py``) and run many cases. A case is a module-level function
``fn(rank, world_size, **kwargs)`` named by ``"module:function"``; every rank runs it and the pool
returns the per-rank results. Any exception on any rank fails the call with that rank's traceback.

No call hangs: collectives time out after ``COLLECTIVE_TIMEOUT_S`` (gloo), and a call whose ranks do
not all answer within its timeout kills the pool (the next call starts a fresh one).
"""

from __future__ import annotations

import atexit
import importlib
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    # torch.compile (Megatron's jit_fuser) would recompile tiny CPU kernels for every new shape.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"
    )
    sys.path.insert(0, ROOT)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        import mok_megatron.training.cpu

        mok_megatron.training.cpu.enable()
        import megatron.core  # noqa: F401  (warm the import once)
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        item = tasks.get()
        if item is None:
            break
        call_id, target, kwargs = item
        try:
            mod, fn = target.split(":")
            out = getattr(importlib.import_module(mod), fn)(rank, world, **kwargs)
            results.put((rank, ("ok", call_id), out))
        except BaseException:
            results.put((rank, ("error", call_id), f"[rank {rank}] " + traceback.format_exc()))
    dist.destroy_process_group()


class CaseFailed(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world_size: int = 4, start_timeout: float = 300.0):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            # Not daemons: dist_checkpointing's writer starts helper processes of its own.
            ctx.Process(
                target=_worker, args=(r, world_size, port, self._tasks[r], self._results), daemon=False
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.close)
        self._calls = 0
        self.alive = True
        ready = 0
        deadline = time.monotonic() + start_timeout
        while ready < world_size:
            rank, status, payload = self._get(deadline)
            if status != "ready":
                self.close()
                raise RuntimeError(f"worker {rank} failed to start:\n{payload}")
            ready += 1

    def _get(self, deadline: float):
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                return self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.pid for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker processes {dead} died") from None

    def run(self, target: str, timeout: float = 180.0, **kwargs) -> list:
        """Run ``target`` on every rank; return its results ordered by rank."""
        if not self.alive:
            raise RuntimeError("worker pool is closed")
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, target, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < self.world_size:
                rank, (status, cid), payload = self._get(deadline)
                if cid != call_id:
                    continue
                (out if status == "ok" else errors)[rank] = payload
        except (TimeoutError, RuntimeError) as e:
            self.close()
            raise CaseFailed(
                f"{target}{kwargs}: ranks {sorted(set(range(self.world_size)) - set(out) - set(errors))} "
                f"did not finish ({type(e).__name__}: {e}); pool restarted"
            ) from None
        if errors:
            # A failed case may leave collectives half-done: start clean next time.
            self.close()
            raise CaseFailed(f"{target}{kwargs} failed:\n" + "\n".join(errors[r] for r in sorted(errors)))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
