"""concat_groups: row scatter (index_copy_ / index_put_) vs cat + one row gather, DeepSeek / Qwen3 wgrad operands."""
import torch, statistics
from mok_megatron.ops.grouped_gemm import concat_groups

def concat_groups_old(
    parts: list[tuple[list[torch.Tensor], torch.Tensor]],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Several grouped operand sets as one, grouped across the parts: no host synchronisation.

    ``parts``: ``[(tensors, offs_G), ...]``, each part's tensors ``[M_p, *]`` sharing its rows, grouped by
    ``offs_G`` (inclusive int offsets, the same G in every part; rows past ``offs_G[-1]``, as in a sync-free
    receive buffer, belong to no group). Returns one tensor per position, ``[sum M_p, *]``, whose group
    ``g`` holds every part's rows of ``g`` (part order, then row order) and whose rows past the last group
    are the parts' group-less rows, and the int32 inclusive offsets of those groups. One grouped GEMM over
    the result equals the sum of the parts' grouped GEMMs up to the order of the additions."""
    if not parts:
        raise ValueError("concat_groups: no parts")
    num_groups = parts[0][1].shape[0]
    if any(offs.shape != (num_groups,) for _, offs in parts):
        raise ValueError(
            f"concat_groups: offsets of shapes {[tuple(o.shape) for _, o in parts]}; every part needs "
            f"({num_groups},) (one inclusive offset per group)."
        )
    device = parts[0][0][0].device
    ends_PG = torch.stack([offs.to(device=device, dtype=torch.int64) for _, offs in parts])
    counts_PG = torch.diff(ends_PG, dim=1, prepend=ends_PG.new_zeros(len(parts), 1))
    totals_G = counts_PG.sum(0)
    new_ends_G = torch.cumsum(totals_G, 0)
    earlier_PG = torch.cumsum(counts_PG, 0) - counts_PG  # rows of each group in the parts before
    # destination row of part p's group-g rows: new start of g + rows of g in earlier parts - g's start in p
    shift_PG = (new_ends_G - totals_G) + earlier_PG - (ends_PG - counts_PG)
    # group-less rows (past a part's last offset) go after every group, part after part
    sizes_P = torch.stack([ends_PG.new_full((), ts[0].shape[0]) for ts, _ in parts])  # no host-to-device copy
    spare_P = sizes_P - ends_PG[:, -1]
    tail_P = new_ends_G[-1] + torch.cumsum(spare_P, 0) - spare_P
    shift_PG = torch.cat([shift_PG, (tail_P - ends_PG[:, -1])[:, None]], 1)  # column G: group-less rows
    rows = sum(ts[0].shape[0] for ts, _ in parts)
    outs = [parts[0][0][i].new_empty((rows, *t.shape[1:])) for i, t in enumerate(parts[0][0])]
    for p, (tensors, _) in enumerate(parts):
        m = tensors[0].shape[0]
        if m == 0:
            continue
        r = torch.arange(m, device=device)
        g = torch.searchsorted(ends_PG[p], r, right=True)
        dest = r + shift_PG[p][g]
        for out, t in zip(outs, tensors, strict=True):
            out.index_copy_(0, dest, t)
    return outs, new_ends_G.to(torch.int32)


def old(parts, ends, shift, how):
    rows = sum(ts[0].shape[0] for ts, _ in parts)
    outs = [parts[0][0][i].new_empty((rows, *t.shape[1:])) for i, t in enumerate(parts[0][0])]
    for p, (tensors, _) in enumerate(parts):
        for out, t, d in zip(outs, tensors, [shift[p]] * len(tensors), strict=True):
            if how == "index_copy": out.index_copy_(0, d, t)
            else: out[d] = t
    return outs

def t(fn, n=10):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

for name, H, N, E, R in (("deepseek", 7168, 4096, 8, 32768), ("qwen3", 2048, 1536, 128, 131072)):
    C = 4; m = R // C
    parts = []
    for _c in range(C):
        counts = torch.full((E,), m // E, dtype=torch.int64)
        parts.append(([torch.randn(m, N, device="cuda", dtype=torch.bfloat16), torch.randn(m, H, device="cuda", dtype=torch.bfloat16)], counts.cumsum(0).cuda().int()))
    a = concat_groups(parts); b = concat_groups_old(parts)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and torch.equal(a[1], b[1])
    new_ms = t(lambda parts=parts: concat_groups(parts))
    ic = t(lambda parts=parts: concat_groups_old(parts))
    ip = float("nan")
    gb = 2 * R * (N + H) * 2 / 1e9
    print(f"{name}: concat_groups (cat + gather) {new_ms:.3f} ms; index_copy_ scatter {ic:.3f}; index_put_ {ip:.3f}; bytes moved once {gb:.2f} GB")
