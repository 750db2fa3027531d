import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.pool import WorkerPool  # noqa: E402

WORLD = 4


class _PoolHandle:
    """One worker pool for the whole test run; restarted after a failed case."""

    def __init__(self):
        self._pool: WorkerPool | None = None

    def run(self, target: str, timeout: float = 180.0, **kwargs):
        if self._pool is None or not self._pool.alive:
            self._pool = WorkerPool(WORLD)
        return self._pool.run(target, timeout=timeout, **kwargs)

    def close(self):
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="session")
def pool():
    handle = _PoolHandle()
    yield handle
    handle.close()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the selected modules' runs start
def pytest_collection_modifyitems(config, items):
    """The Triton interpreter runs start now, in the background (tests/interpret.py); slow tests skip
    unless MOK_SLOW=1."""
    from tests import interpret

    interpret.start_selected(items)
    if os.environ.get("MOK_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set MOK_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_rank():
    """This process as a one-rank world with Megatron's parallel state: NCCL on a GPU, else gloo in
    CPU mode."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests.pool import free_port

    own = not dist.is_initialized()
    if own:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=60))
    import mok_megatron.training.cpu

    if not torch.cuda.is_available():
        mok_megatron.training.cpu.enable()
    from tests.cases import setup_parallel

    setup_parallel()
    yield
    if own:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
        from tests import cases

        cases._PARALLEL["key"] = None


def pytest_unconfigure(config):
    from tests import interpret

    interpret.stop_all()
