"""Case functions of tests/test_tiles_engine.py that run on every worker rank (tests/pool.py)."""

from __future__ import annotations


def parity_case(rank, world, **kw):
    """``tests.cases.parity_case`` with ``--mok-engine tiles``; also how many layer calls ran the tiles
    engine's autograd node (``calls``)."""
    from mok_megatron.engine import tiles
    from tests import cases

    real = tiles._TileExperts.apply
    calls = []

    def counted(*args):
        calls.append(1)
        return real(*args)

    tiles._TileExperts.apply = counted
    try:
        res = cases.parity_case(rank, world, opts=dict(engine="tiles"), **kw)
    finally:
        tiles._TileExperts.apply = real
    res["calls"] = len(calls)
    return res
