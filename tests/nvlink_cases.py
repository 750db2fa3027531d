"""Shared cases of tests/test_nvlink.py: loopback exchanges and a loopback MoE layer of N emulated ranks,
each checked against the all-to-all reference / the single-rank computation. Run on CPU (torch references,
or Triton under TRITON_INTERPRET=1) and on CUDA (Triton)."""

from __future__ import annotations

import os

import torch

from mok_megatron.transport.nvlink.exchange import all_to_all_reference, loopback_exchange
from mok_megatron.transport.nvlink.workspace import LoopbackWorkspace


def random_matrix(P: int, seed: int, most: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, most + 1, (P, P), generator=g)
    m[0, P - 1] = 0  # an empty pair
    return m.tolist()


# (dtype, row shape): bf16 rows of 16-byte multiples take the aligned kernel, the others the plain one.
ROW_FORMATS = [(torch.bfloat16, (24,)), (torch.float32, (3,)), (torch.float16, (1,)), (torch.float32, (2, 4))]


def check_exchanges(
    P: int, device: str, use_triton: bool, programs: int = 3, most: int = 5, sync: str = "barrier"
) -> None:
    """Pull and push on one workspace (buffers reused and grown) equal all_to_all for every rank; with
    ``sync='flags'`` every emulated rank's epoch advances once per exchange."""
    ws = LoopbackWorkspace(P, device)
    g = torch.Generator().manual_seed(P)
    for i, (dtype, row) in enumerate(ROW_FORMATS * 2):
        m = random_matrix(P, seed=10 * P + i, most=most * (1 + i // len(ROW_FORMATS)))
        xs = [torch.randn((sum(m[s]),) + row, generator=g).to(device, dtype) for s in range(P)]
        ref = all_to_all_reference(xs, m)
        for push in (False, True):
            outs = loopback_exchange(ws, xs, m, push, programs, use_triton, sync=sync)
            for d in range(P):
                assert torch.equal(outs[d], ref[d]), (P, dtype, row, push, d)
    if sync == "flags":  # every rank published every exchange to every rank
        n = 2 * len(ROW_FORMATS) * 2
        for d in range(P):
            sig = ws.signals(d)
            assert int(sig.epoch_1[0]) == n and sig.flags.bufs[d].tolist() == [n] * P, (d, sig)
    ws.close()


def loopback_moe(
    P: int, device: str, use_triton: bool, T: int = 12, H: int = 16, programs: int = 4, sync: str = "barrier"
):
    """N emulated EP ranks run one MoE step through the workspace: each rank routes its tokens to
    ranks (a token goes once to each rank that holds one of its experts), dispatch pulls the rows,
    each rank scales the rows by its expert vector (elementwise: bitwise independent of how many
    rows a batch has, unlike a GEMM), combine pushes the results back, each source sums its
    token's rows in rank order. Returns (per-rank outputs, the single-rank computation)."""
    g = torch.Generator().manual_seed(100 + P)
    dt = torch.bfloat16
    w_PH = torch.randn(P, H, generator=g).to(device, dt)
    x_PTH = torch.randn(P, T, H, generator=g).to(device, dt)
    to_PTP = torch.rand(P, T, P, generator=g) < 0.5  # [src, token, dest]
    to_PTP[:, 0, :] = False  # a token that goes nowhere
    ws = LoopbackWorkspace(P, device)
    # Dest-major rows of every source (the pipeline's send order): token order inside a destination.
    sends, toks = [], []
    for s in range(P):
        d_N, t_N = to_PTP[s].t().nonzero(as_tuple=True)
        sends.append(x_PTH[s][t_N.to(device)])
        toks.append((t_N, d_N))
    m = [[int(to_PTP[s, :, d].sum()) for d in range(P)] for s in range(P)]
    recv = loopback_exchange(ws, sends, m, push=False, programs=programs, use_triton=use_triton, sync=sync)
    y = [recv[d] * w_PH[d] for d in range(P)]  # rows grouped by source
    mt = [list(r) for r in zip(*m, strict=True)]
    back = loopback_exchange(ws, y, mt, push=True, programs=programs, use_triton=use_triton, sync=sync)
    outs, refs = [], []
    for s in range(P):
        t_N, d_N = toks[s]
        out = torch.zeros(T, H, dtype=torch.float32, device=device)
        ref = torch.zeros(T, H, dtype=torch.float32, device=device)
        for d in range(P):  # fixed rank order on both sides: bitwise comparable
            rows = (d_N == d).nonzero().flatten()
            out[t_N[rows].to(device)] += back[s][rows.to(device)].float()
            sel = to_PTP[s, :, d].to(device)
            ref += torch.where(sel.unsqueeze(1), (x_PTH[s] * w_PH[d]).float(), 0)
        outs.append(out)
        refs.append(ref)
    ws.close()
    return outs, refs


_generation = [0]


class SharedFileWorkspace:
    """A CPU stand-in for NVLinkWorkspace across gloo ranks: each rank's buffer is a file in /dev/shm
    that every rank of the group maps (so peers' rows are really read and written across processes);
    ``barrier`` is a gloo barrier. Same interface: ``buffers(word, W, rows, role)``, ``barrier()``."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cpu")
        members = dist.get_process_group_ranks(group)
        _generation[0] += 1
        tag = [f"{os.getppid()}-{'-'.join(map(str, members))}-{_generation[0]}"]
        dist.broadcast_object_list(tag, src=members[0], group=group)  # the group's first rank names the files
        self.tag = tag[0]
        self._bufs: dict = {}
        self._n = 0
        self._sig = None

    def buffers(self, word, W, rows, role=None):
        from mok_megatron.transport.nvlink.peers import PeerBuffers

        key = (word, W, role)
        have = self._bufs.get(key)
        if have is not None and have.bufs[0].shape[0] >= rows:
            return have
        n = max(rows, 2 * (have.bufs[0].shape[0] if have else 0), 64)
        self._n += 1
        paths = [f"/dev/shm/mok-nvl-{self.tag}-{self._n}-{p}" for p in range(self.size)]
        nbytes = n * W * word.itemsize

        def mapped(path):
            return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(word).view(n, W)

        mine = mapped(paths[self.rank])
        self.dist.barrier(group=self.group)
        bufs = tuple(mine if p == self.rank else mapped(paths[p]) for p in range(self.size))
        self.dist.barrier(group=self.group)
        os.unlink(paths[self.rank])  # every rank has mapped it
        self._bufs[key] = PeerBuffers(bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64))
        return self._bufs[key]

    def barrier(self):
        self.dist.barrier(group=self.group)

    def signals(self, me):
        """Every rank's flag words in shared files (peers publish into them), zeroed before any publish."""
        from mok_megatron.transport.nvlink.peers import PeerBuffers
        from mok_megatron.transport.nvlink.signals import Signals

        if self._sig is None:
            self._n += 1
            paths = [f"/dev/shm/mok-nvl-{self.tag}-{self._n}-{p}" for p in range(self.size)]

            def mapped(path):
                return torch.from_file(path, shared=True, size=self.size, dtype=torch.int64)

            mine = mapped(paths[self.rank])
            mine.zero_()
            self.dist.barrier(group=self.group)
            flags = tuple(mine if p == self.rank else mapped(paths[p]) for p in range(self.size))
            self.dist.barrier(group=self.group)
            os.unlink(paths[self.rank])
            table = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
            self._sig = Signals(PeerBuffers(flags, table), torch.zeros(1, dtype=torch.int64), self.rank)
        assert me == self.rank
        return self._sig


def _two_collective_layers(ep, topk, opts):
    """(config, two identical MoK layers on the collective transport, their EP group): the second one gets
    the transport under test."""
    from tests.cases import build_layers, make_config, setup_parallel

    setup_parallel(ep=ep)
    cfg = make_config(ep=ep, topk=topk)
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(build_layers(cfg, opts=dict(opts or {}, transport="collective"))[1])
    return cfg, layers[0], layers[1], layers[0].token_dispatcher.transport.group


def nvlink_layer_case(rank, world, *, ep=2, topk=2, opts=None, sync="barrier"):
    """The MoK layer through the overlap pipeline with NVLinkTransport (its exchanges on a shared-memory
    workspace across the gloo ranks, signalled by ``sync``) against the same layer with the collective
    transport."""
    from mok_megatron.transport.nvlink import transport as NT
    from tests.cases import run_layer, with_engine

    cfg, coll, nvl, group = _two_collective_layers(ep, topk, opts)
    ws = SharedFileWorkspace(group)
    with_engine(nvl, transport=NT.NVLinkTransport(group, programs=3, sync=sync))
    original = NT.workspace
    NT.workspace = lambda g, device: ws
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(16, 2, cfg.hidden_size, generator=g)
        dout = torch.randn(16, 2, cfg.hidden_size, generator=g)
        (o1, dx1, g1, _), (o2, dx2, g2, _) = run_layer(coll, x, dout), run_layer(nvl, x, dout)
        again = run_layer(nvl, x, dout)  # the workspace's buffers reused
    finally:
        NT.workspace = original
    return dict(
        bitwise=bool(
            torch.equal(o1, o2) and torch.equal(dx1, dx2) and all(torch.equal(g1[k], g2[k]) for k in g1)
        ),
        repeat=bool(torch.equal(o2, again[0]) and torch.equal(dx2, again[1])),
        nonzero=bool(o1.abs().sum() > 0),
        buffers=len(ws._bufs),
        epoch=int(ws._sig.epoch_1[0]) if ws._sig is not None else 0,
        flags=ws._sig.flags.bufs[ws.rank].tolist() if ws._sig is not None else [],
    )


def hierarchical_layer_case(rank, world, *, names, ep=4, topk=4, opts=None, sync="barrier"):
    """The MoK layer through the overlap pipeline with HierarchicalTransport (``names``: each EP rank's
    NVLink domain; inside a domain the rows move on a shared-memory workspace across the gloo ranks,
    between domains through the collective) against the same layer with the collective transport."""
    from mok_megatron.transport.nvlink import domains as D
    from mok_megatron.transport.nvlink import hierarchical as HT
    from mok_megatron.transport.nvlink import transport as NT
    from tests.cases import run_layer, with_engine

    cfg, coll, hier, group = _two_collective_layers(ep, topk, opts)
    os.environ[D.DOMAIN_ENV] = names[rank]  # this rank's NVLink domain
    try:
        D.init_nvlink_domains(group)  # every rank, before building the transport
        tr = HT.HierarchicalTransport(group, programs=3, sync=sync)
    finally:
        del os.environ[D.DOMAIN_ENV]
    with_engine(hier, transport=tr)
    spaces = {}
    original = NT.workspace
    NT.workspace = lambda g, device: (
        spaces[id(g)] if id(g) in spaces else spaces.setdefault(id(g), SharedFileWorkspace(g))
    )
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(16, 2, cfg.hidden_size, generator=g)
        dout = torch.randn(16, 2, cfg.hidden_size, generator=g)
        (o1, dx1, g1, _), (o2, dx2, g2, _) = run_layer(coll, x, dout), run_layer(hier, x, dout)
    finally:
        NT.workspace = original
    return dict(
        bitwise=bool(
            torch.equal(o1, o2) and torch.equal(dx1, dx2) and all(torch.equal(g1[k], g2[k]) for k in g1)
        ),
        nonzero=bool(o1.abs().sum() > 0),
        domain=tr.domain,
        domains=tr.domains,
        workspaces=len(spaces),
    )
