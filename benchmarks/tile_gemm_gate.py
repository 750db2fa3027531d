"""The tile engine's GEMM gate: can a grouped GEMM that leaves K SMs to communication match torch's?

A tile-level overlap engine runs the expert GEMMs that wait on exchanged rows (fc1 forward, and fc2's input
gradient, which consumes the exchanged output gradient) as one persistent launch on ``132 - K`` SMs while K
SMs pull rows. Its gate: those two GEMMs, with every arrival counter already set and K SMs held back, take at
most 3 % more than ``torch._grouped_mm`` on all SMs for the same GEMMs, in the same process.

Timed, per slice and GEMM, in one process:
    torch._grouped_mm                  CUTLASS, all SMs
    quack <config>                     QuACK's persistent varlen-M grouped GEMM (CuTe DSL, sm_90; the kernels
                                       SonicMoE is built on), no waits, its grid limited to ``132 - K`` SMs
    wait <config> quack-order          the waiting GEMM (``kernels.tile_gemm``: QuACK's kernel whose producer
                                       spins on a per-(expert, row tile) counter before a tile's loads), every
                                       counter preset, tiles in QuACK's own order (rows in expert order:
                                       what a pull that fetches expert by expert delivers)
    wait <config> arrival              the same, tiles in the order a ring pull delivers their rows
Each slice and K gets a verdict for each of the two orders (``passes`` the ring order's,
``quack_order_passes`` QuACK's).
One tile configuration per slice (the best of the no-wait sweep at K = 8, ``tile_gemm.DEEPSEEK`` /
``tile_gemm.QWEN3``); ``--all-configs`` adds QuACK's no-wait GEMM at the five configurations of that sweep.

The plausible exchange (``arrival_steps``): the rank's own rows are there at step 0 and the K SMs pull the
other ranks' rows one source rank per step, ring order (rank r+1, r+2, ...); each expert's rows are ordered by
source rank, so a row tile is complete at the step of its last source.

Legend: M rows received (expert-major), G local experts, H hidden, F expert FFN width, S source ranks.

    python -m benchmarks.tile_gemm_gate --json gate.json     # sm_90 (QuACK needed: pip install quack-kernels)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

SHAPES = {
    # one EP rank's received rows: an EP=32 rank of DeepSeek-V3 (4,096 tokens per rank, top-8 of 256 experts,
    # 8 local) and an EP=8 rank of Qwen3-30B-A3B (16,384 tokens per rank, top-8 of 128 experts, 16 local)
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, local=8, experts=256, tokens=4096, topk=8, ep=32),
    "qwen3-ep8": dict(hidden=2048, ffn=768, local=16, experts=128, tokens=16384, topk=8, ep=8),
}
GATE = 1.03
# the waiting GEMM's configuration per slice (QuACK's no-wait sweep, docs/results/2026-12-03-tile-gemm-gate:
# the best of the five at K = 8 for both GEMMs of the slice)
SHAPE_CONFIG = {"deepseek-v3-ep32": "DEEPSEEK", "qwen3-ep8": "QWEN3"}
# QuACK sm_90 tile configurations: (tile_m, tile_n, pingpong, cluster_m); the first is QuACK's default
CONFIGS = (
    (128, 192, True, 2),
    (128, 256, False, 2),
    (256, 128, False, 2),
    (256, 192, False, 2),
    (128, 128, True, 1),
)


def counts_by_source(shape: dict, seed: int = 0) -> torch.Tensor:
    """Rows each local expert receives from each source rank, [S, G]: every rank's tokens pick top-k
    distinct experts uniformly."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, e = shape["tokens"] * shape["ep"], shape["experts"]
    pick = torch.rand(n, e, generator=g).argsort(1)[:, : shape["topk"]]
    source = torch.arange(n).repeat_interleave(shape["topk"]) // shape["tokens"]
    c_SE = torch.bincount(source * e + pick.flatten(), minlength=shape["ep"] * e).view(shape["ep"], e)
    return c_SE[:, : shape["local"]]


def counts(shape: dict, seed: int = 0) -> torch.Tensor:
    """Rows each local expert receives, [G]."""
    return counts_by_source(shape, seed).sum(0)


def arrival_steps(c_SG: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """The exchange step that delivers each received row, [M] in expert-major order (each expert's rows by
    source rank): the rank's own rows at step 0, then source ``rank + i`` at step i (ring order)."""
    s, g = c_SG.shape
    step_S = (torch.arange(s) - rank) % s
    return step_S.repeat(g).repeat_interleave(c_SG.t().flatten())


def problems(shape: dict, device) -> dict:
    c_SG = counts_by_source(shape)
    c_G = c_SG.sum(0)
    m, h, f, g = int(c_G.sum()), shape["hidden"], shape["ffn"], shape["local"]
    offs_G = torch.cumsum(c_G, 0).to(device=device, dtype=torch.int32)
    bf = torch.bfloat16
    return {
        "rows": m,
        "offs": offs_G,
        "ready": arrival_steps(c_SG).to(device),
        "cu": torch.nn.functional.pad(offs_G, (1, 0)),
        # fc1: y_M2F = x_MH @ w1_G2FH[g].T
        "fc1": (
            torch.randn(m, h, device=device, dtype=bf),
            torch.randn(g, 2 * f, h, device=device, dtype=bf).mT,
        ),
        # fc2 input gradient: dh_MF = dy_MH @ w2_GHF[g]
        "fc2_dgrad": (
            torch.randn(m, h, device=device, dtype=bf),
            torch.randn(g, h, f, device=device, dtype=bf),
        ),
    }


class HeldBack:
    """Limits QuACK's persistent grid to the clusters that fit on ``sms - k`` SMs (the rest communicate)."""

    def __init__(self, quack_gemm_module, k: int):
        self.mod, self.k = quack_gemm_module, k
        self.orig = quack_gemm_module.get_max_active_clusters

    def __enter__(self):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        orig, k = self.orig, self.k

        def limited(cluster_size, device_capacity=None, device_id=0):
            return min(orig(cluster_size, device_capacity=device_capacity), (sms - k) // cluster_size)

        self.mod.get_max_active_clusters = limited
        return self

    def __exit__(self, *exc):
        self.mod.get_max_active_clusters = self.orig


def time_ms(fn, iters: int, rounds: int) -> float:
    """Median over rounds of the mean time of ``iters`` back-to-back calls."""
    per = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / iters)
    return statistics.median(per)


def _gemm_config(tm, tn, pp, cm):
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=tm,
        tile_n=tn,
        pingpong=pp,
        cluster_m=cm,
        cluster_n=1,
        is_dynamic_persistent=False,
        device_capacity=9,
    )


def _label(cfg) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n}{' pp' if cfg.pingpong else ' coop'} c{cfg.cluster_m}"


def _rel_err(out, ref, rows) -> float:
    return ((out[:rows].float() - ref[:rows].float()).abs().max() / ref[:rows].float().abs().max()).item()


def gate_rows(rows: list[dict], shapes: list[str], ks: list[int]) -> list[dict]:
    """Per slice and K: fc1 + fc2_dgrad of the waiting GEMM (arrival order) and of QuACK without waits (its
    best configuration), each over torch._grouped_mm's fc1 + fc2_dgrad on all SMs."""
    gate = []
    for name in shapes:
        base = sum(r["ms"] for r in rows if r["shape"] == name and r["impl"] == "torch._grouped_mm")
        for k in ks:
            best = {}
            for kind in ("quack", "wait-arrival", "wait-quack-order"):
                per = {}
                for gemm in ("fc1", "fc2_dgrad"):
                    cand = [
                        r for r in rows if r["shape"] == name and r["gemm"] == gemm and r["k"] == k
                        and r["kind"] == kind
                    ]  # fmt: skip
                    if cand:
                        per[gemm] = min(cand, key=lambda r: r["ms"])
                if len(per) == 2:
                    best[kind] = per
            if "wait-arrival" not in best:
                continue
            tot = {kind: per["fc1"]["ms"] + per["fc2_dgrad"]["ms"] for kind, per in best.items()}
            wait = tot["wait-arrival"]
            entry = dict(
                shape=name,
                k=k,
                torch_ms=base,
                wait_ms=wait,
                ratio=wait / base,
                passes=wait / base <= GATE,
                wait_quack_order_ms=tot.get("wait-quack-order"),
                quack_ms=tot.get("quack"),
                quack_ratio=tot["quack"] / base if "quack" in tot else None,
                configs={g: r["impl"] for g, r in best["wait-arrival"].items()},
            )
            gate.append(entry)
            quack = f", QuACK without waits {entry['quack_ms']:.3f} ms" if entry["quack_ms"] else ""
            expert_major = entry["wait_quack_order_ms"]
            if expert_major is not None:
                entry["quack_order_ratio"] = expert_major / base
                entry["quack_order_passes"] = expert_major / base <= GATE
                quack += (
                    f"; in QuACK's order (an expert-major pull) {expert_major:.3f} ms = "
                    f"{expert_major / base:.3f}x ({'meets' if entry['quack_order_passes'] else 'misses'})"
                )
            print(
                f"gate {name:18s} k={k:2d}: torch {base:.3f} ms, waiting GEMM in ring arrival order "
                f"{wait:.3f} ms = {wait / base:.3f}x "
                f"({'meets' if entry['passes'] else 'misses'} <= {GATE:.2f}x){quack}",
                flush=True,
            )
    return gate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--k", default="0,8,16,32", help="SMs held back for communication")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--all-configs", action="store_true", help="QuACK without waits at all five configurations"
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("tile_gemm_gate: needs an sm_90 GPU (QuACK's sm_90 kernels); none here", file=sys.stderr)
        return 2
    import quack.gemm as qg
    from quack.gemm_interface import gemm_tuned

    from mok_megatron.kernels import tile_gemm as tg

    dev = torch.device("cuda")
    ks = [int(k) for k in a.k.split(",")]
    shapes = a.shapes.split(",")
    rows = []

    def record(name, gemm, kind, label, k, t, prob, **extra):
        rows.append(dict(shape=name, gemm=gemm, kind=kind, impl=label, k=k, ms=t, rows=prob["rows"], **extra))
        err = f"  (err {extra['rel_err']:.1e})" if "rel_err" in extra else ""
        print(f"{name:18s} {gemm:10s} {label:32s} k={k:2d} {t:8.3f} ms{err}", flush=True)

    for name in shapes:
        prob = problems(SHAPES[name], dev)
        m, offs = prob["rows"], prob["offs"]
        cfg = getattr(tg, SHAPE_CONFIG[name])
        configs = CONFIGS if a.all_configs else ((cfg.tile_m, cfg.tile_n, cfg.pingpong, cfg.cluster_m),)
        for gemm in ("fc1", "fc2_dgrad"):
            x, w = prob[gemm]
            n = w.shape[2]
            ref = torch._grouped_mm(x, w, offs=offs)
            t = time_ms(lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w, offs=offs), a.iters, a.rounds)
            record(name, gemm, "torch", "torch._grouped_mm", 0, t, prob)
            quack_out = {}
            for tm, tn, pp, cm in configs:
                label = f"quack {tm}x{tn}{' pp' if pp else ' coop'} c{cm}"
                out = torch.empty_like(ref)

                qcfg = _gemm_config(tm, tn, pp, cm)

                def run(x=x, w=w, out=out, qcfg=qcfg, cu=prob["cu"]):
                    gemm_tuned.fn(x, w, out, cu_seqlens_m=cu, config=qcfg)

                try:
                    run()
                    torch.cuda.synchronize()
                except Exception as e:  # a tile shape this problem's layout does not take
                    print(
                        f"{name:18s} {gemm:10s} {label:32s} skipped: {type(e).__name__}: {e}"[:200],
                        flush=True,
                    )
                    continue
                quack_out[(tm, tn, pp, cm)] = out.clone()
                err = _rel_err(out, ref, m)
                for k in ks:
                    with HeldBack(qg, k):
                        t = time_ms(run, a.iters, a.rounds)
                    record(name, gemm, "quack", label, k, t, prob, rel_err=err)
            # the waiting GEMM: counters preset, QuACK's order and the exchange's arrival order
            same = quack_out.get((cfg.tile_m, cfg.tile_n, cfg.pingpong, cfg.cluster_m))
            for order, ready in (("quack-order", None), ("arrival", prob["ready"])):
                plan = tg.tile_plan(offs, m, n, cfg, ready_M=ready)
                counters = plan.targets_S.clone()
                out = torch.empty_like(ref)
                label = f"wait {_label(cfg)} {order}"

                def run_wait(x=x, w=w, out=out, plan=plan, counters=counters, k=0):
                    tg.tile_grouped_mm(x, w, plan, counters, sms_held_back=k, out=out)

                run_wait()
                torch.cuda.synchronize()
                extra = dict(rel_err=_rel_err(out, ref, m), order=order)
                if same is not None:
                    extra["equals_quack"] = bool(torch.equal(out[:m], same[:m]))
                for k in ks:
                    t = time_ms(lambda run_wait=run_wait, k=k: run_wait(k=k), a.iters, a.rounds)
                    record(name, gemm, f"wait-{order}", label, k, t, prob, **extra)
    gate = gate_rows(rows, shapes, ks)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows, gate=gate), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
