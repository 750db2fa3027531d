"""The tile engine's GEMM gate: can a grouped GEMM that leaves K SMs to communication match torch's?

A tile-level overlap engine runs the expert GEMMs that wait on exchanged rows (fc1 forward, and fc2's input
gradient, which consumes the exchanged output gradient) as one persistent launch on ``132 - K`` SMs while K
SMs pull rows. Its gate: those two GEMMs, with every arrival counter already set and K SMs held back, take at
most 3 % more than ``torch._grouped_mm`` on all SMs for the same GEMMs, in the same process.

Timed, per slice, GEMM, tile configuration and K, in one process:
    torch._grouped_mm                  CUTLASS, all SMs
    quack <config>                     QuACK's persistent varlen-M grouped GEMM (CuTe DSL, sm_90; the kernels
                                       SonicMoE is built on), no waits, its grid limited to ``132 - K`` SMs
    wait <config> quack-order          the waiting GEMM (``kernels.tile_gemm``: QuACK's kernel whose producer
                                       spins on a per-(expert, row tile) counter before a tile's loads), every
                                       counter preset, tiles in QuACK's own order (rows in expert order:
                                       what a pull that fetches expert by expert delivers)
    wait <config> arrival              the same, tiles in the order a ring pull delivers their rows
One tile configuration per slice by default (the best of QuACK's no-wait sweep at K = 8:
``tile_gemm.DEEPSEEK`` and ``tile_gemm.QWEN3``); ``--all-configs`` times all three at each of the five
configurations in ``CONFIGS``.
Every output is checked against ``torch._grouped_mm`` once per configuration (``MATCH``) before it is timed; a
mismatch is reported and not timed.

Verdicts (``GATE``: fc1 + fc2 dgrad together over torch's fc1 + fc2 dgrad):
    table    per slice, K and configuration: each of the three at that one configuration
    gate     per slice and K: the best configuration of each GEMM on its own (``passes`` the ring order's,
             ``quack_order_passes`` QuACK's order's)
    summary  per slice: for each K, the configuration with the smallest waiting-GEMM ratio

A waiting kernel whose counters never reach their targets never ends and cannot be stopped from Python:
``--case-timeout`` ends the process (status 3) when one check or timing runs longer, after writing the JSON
gathered so far and a line naming the case. A CUDA error that leaves the context unusable ends the sweep the
same way (status 4).

The plausible exchange (``arrival_steps``): the rank's own rows are there at step 0 and the K SMs pull the
other ranks' rows one source rank per step, ring order (rank r+1, r+2, ...); each expert's rows are ordered by
source rank, so a row tile is complete at the step of its last source.

Legend: M rows received (expert-major), G local experts, H hidden, F expert FFN width, S source ranks.

    python -m benchmarks.tile_gemm_gate --json gate.json     # sm_90 (QuACK needed: pip install quack-kernels)
    python -m benchmarks.tile_gemm_gate --all-configs --k 0,2,4,6,8,16 --json gate.json
    python -m benchmarks.tile_gemm_gate --shapes deepseek-v3-ep32-16k --k 0,8,16 --json gate-16k.json

Slices (``SHAPES``): DeepSeek-V3's EP=32 rank at 4,096 and at 16,384 tokens, Qwen3-30B-A3B's EP=8 rank; a run
without ``--shapes`` takes ``DEFAULT_SHAPES`` (the 4,096-token DeepSeek-V3 slice and Qwen3's), and the
16k-token slice, 4x the DeepSeek-V3 rows, is named on its own (``--shapes deepseek-v3-ep32-16k``) in a call of
its own. This module's ``SHAPES``, ``SHAPE_CONFIG`` and ``DEFAULT_SHAPES`` are the tile benchmarks' slices
(``benchmarks.tile_pull``, ``benchmarks.tile_layer``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import threading
import time

import torch

from mok_megatron.kernels.tile_gemm import SM90_CONFIGS

SHAPES = {
    # one EP rank's received rows: an EP=32 rank of DeepSeek-V3 (4,096 tokens per rank, top-8 of 256 experts,
    # 8 local), the same rank at 16,384 tokens (4x the rows: ~131k received, 1.9 GB of bf16 rows), and an
    # EP=8 rank of Qwen3-30B-A3B (16,384 tokens per rank, top-8 of 128 experts, 16 local)
    "deepseek-v3-ep32": dict(hidden=7168, ffn=2048, local=8, experts=256, tokens=4096, topk=8, ep=32),
    "deepseek-v3-ep32-16k": dict(hidden=7168, ffn=2048, local=8, experts=256, tokens=16384, topk=8, ep=32),
    "qwen3-ep8": dict(hidden=2048, ffn=768, local=16, experts=128, tokens=16384, topk=8, ep=8),
}
# the slices a run takes without --shapes (each tile benchmark's sweep of them fits one 10-minute GPU call);
# the 16k slice is asked for by name (--shapes deepseek-v3-ep32-16k), in a call of its own
DEFAULT_SHAPES = ("deepseek-v3-ep32", "qwen3-ep8")
GATE = 1.03
# an output is timed only if it is this close to torch._grouped_mm's (bf16 outputs of fp32 accumulations of
# the same products, possibly in another order; the tile GEMM tests' BF16 tolerance)
MATCH = dict(rtol=1.6e-2, atol=1e-2)
# the waiting GEMM's configuration per slice (QuACK's no-wait sweep, docs/results/2026-12-03-tile-gemm-gate:
# the best of the five at K = 8 for both GEMMs of the slice)
SHAPE_CONFIG = {"deepseek-v3-ep32": "DEEPSEEK", "deepseek-v3-ep32-16k": "DEEPSEEK", "qwen3-ep8": "QWEN3"}
# QuACK sm_90 tile configurations (``tile_gemm.TileConfig``); the first is QuACK's default
CONFIGS = SM90_CONFIGS


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


class CaseWatchdog:
    """Ends the process when one case (a check or a timing) runs past ``seconds``.

    A waiting kernel whose counters never reach their targets spins forever; it cannot be stopped from
    Python, and the main thread waits for it inside a CUDA synchronize (which releases the GIL). This thread
    then calls ``on_timeout(case)`` (which writes the results gathered so far), prints one line naming the
    case and exits with status 3 without running Python's shutdown, which would wait on the GPU too.
    ``seconds`` <= 0: no watchdog."""

    def __init__(self, seconds: float, on_timeout):
        self.seconds, self.on_timeout = seconds, on_timeout
        self._lock = threading.Lock()
        self._case: str | None = None
        self._deadline = 0.0
        if seconds > 0:
            threading.Thread(target=self._watch, name="case-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def case(self, name: str):
        with self._lock:
            self._case, self._deadline = name, time.monotonic() + self.seconds
        try:
            yield
        finally:
            with self._lock:
                self._case = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            with self._lock:
                case, late = self._case, self._case is not None and time.monotonic() > self._deadline
            if late:
                where = self.on_timeout(case)
                print(
                    f"tile_gemm_gate: {case} did not finish within --case-timeout {self.seconds:g} s "
                    f"(a waiting kernel whose counters never reach their targets?); {where}",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(3)


class ContextLost(Exception):
    """A CUDA error left the context unusable: nothing more can run in this process."""

    def __init__(self, case: str, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}".splitlines()[0][:300])
        self.case = case


def _context_error() -> BaseException | None:
    """The error a synchronize raises once a kernel faulted (sticky: the context is lost), or None."""
    try:
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError / RuntimeError, by torch version
        return e
    return None


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


def _gemm_config(cfg):
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        pingpong=cfg.pingpong,
        cluster_m=cfg.cluster_m,
        cluster_n=1,
        is_dynamic_persistent=False,
        device_capacity=9,
    )


def _label(cfg) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n}{' pp' if cfg.pingpong else ' coop'} c{cfg.cluster_m}"


def _rel_err(out, ref, rows) -> float:
    return ((out[:rows].float() - ref[:rows].float()).abs().max() / ref[:rows].float().abs().max()).item()


def parse_ks(text: str) -> list[int]:
    """``--k``: a comma list of SMs held back, e.g. ``0,2,4,6,8,16``."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--k {text!r}; it must be a comma list of integers, e.g. 0,2,4,6,8,16") from None
    if not ks:
        raise ValueError(f"--k {text!r}; it must name at least one K, e.g. 0,8")
    return list(dict.fromkeys(ks))


def held_back_errors(ks: list[int], configs, sms: int) -> list[str]:
    """One line per (K, configuration) the kernel's grid cannot take (``tile_gemm.grid_clusters``' rule)."""
    from mok_megatron.kernels.tile_gemm import sms_held_back_error

    lines = []
    for cfg in configs:
        for k in ks:
            why = sms_held_back_error(k, sms, cfg)
            if why is not None:
                lines.append(f"--k {k} at {_label(cfg)}: {why}; drop it from --k")
    return lines


# ---- verdicts ----------------------------------------------------------------------------------------------

KINDS = (("quack", "quack"), ("wait-quack-order", "wait_quack_order"), ("wait-arrival", "wait_arrival"))


def _torch_ms(rows: list[dict], name: str) -> float | None:
    per = {r["gemm"]: r["ms"] for r in rows if r["shape"] == name and r["impl"] == "torch._grouped_mm"}
    return per["fc1"] + per["fc2_dgrad"] if len(per) == 2 else None


def table_rows(rows: list[dict], shapes: list[str], ks: list[int]) -> list[dict]:
    """Per slice, K and configuration: fc1 + fc2_dgrad of QuACK without waits and of the waiting GEMM in
    both orders, all at that one configuration, each over torch's fc1 + fc2_dgrad (None where a GEMM was
    not timed: skipped or refused)."""
    table = []
    for name in shapes:
        base = _torch_ms(rows, name)
        if base is None:
            continue
        configs = list(dict.fromkeys(r["config"] for r in rows if r["shape"] == name and r.get("config")))
        for k in ks:
            for config in configs:
                entry = dict(shape=name, k=k, config=config, torch_ms=base)
                for kind, key in KINDS:
                    per = {
                        r["gemm"]: r["ms"] for r in rows
                        if (r["shape"], r["k"], r.get("config"), r["kind"]) == (name, k, config, kind)
                    }  # fmt: skip
                    ms = per["fc1"] + per["fc2_dgrad"] if len(per) == 2 else None
                    entry[f"{key}_ms"] = ms
                    entry[f"{key}_ratio"] = None if ms is None else ms / base
                    entry[f"{key}_passes"] = None if ms is None else ms / base <= GATE
                table.append(entry)
    return table


def gate_rows(rows: list[dict], shapes: list[str], ks: list[int], echo: bool = True) -> list[dict]:
    """Per slice and K: fc1 + fc2_dgrad of the waiting GEMM (arrival order; QuACK's order beside it) and of
    QuACK without waits, each GEMM at its best configuration, over torch._grouped_mm's fc1 + fc2_dgrad on
    all SMs."""
    gate = []
    for name in shapes:
        base = _torch_ms(rows, name)
        if base is None:
            continue
        for k in ks:
            best = {}
            for kind, _ in KINDS:
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
                entry["quack_order_configs"] = {g: r["impl"] for g, r in best["wait-quack-order"].items()}
                quack += (
                    f"; in QuACK's order (an expert-major pull) {expert_major:.3f} ms = "
                    f"{expert_major / base:.3f}x ({'meets' if entry['quack_order_passes'] else 'misses'})"
                )
            if echo:
                print(
                    f"gate {name:18s} k={k:2d}: torch {base:.3f} ms, waiting GEMM in ring arrival order "
                    f"{wait:.3f} ms = {wait / base:.3f}x "
                    f"({'meets' if entry['passes'] else 'misses'} <= {GATE:.2f}x){quack}",
                    flush=True,
                )
    return gate


def summary_rows(table: list[dict], shapes: list[str], ks: list[int]) -> list[dict]:
    """Per slice: for each K, the configuration whose waiting GEMM (either order) has the smallest ratio,
    with both orders' ratios and QuACK's without waits at that configuration."""
    summary = []
    for name in shapes:
        best = {}
        for k in ks:
            cand = [
                (min(r for r in (e["wait_quack_order_ratio"], e["wait_arrival_ratio"]) if r is not None), e)
                for e in table
                if e["shape"] == name and e["k"] == k
                and (e["wait_quack_order_ratio"] is not None or e["wait_arrival_ratio"] is not None)
            ]  # fmt: skip
            if not cand:
                continue
            ratio, e = min(cand, key=lambda c: c[0])
            order = "quack-order" if e["wait_quack_order_ratio"] == ratio else "arrival"
            best[k] = dict(
                config=e["config"],
                order=order,
                ratio=ratio,
                passes=ratio <= GATE,
                wait_quack_order_ratio=e["wait_quack_order_ratio"],
                wait_arrival_ratio=e["wait_arrival_ratio"],
                quack_ratio=e["quack_ratio"],
            )
        if best:
            summary.append(dict(shape=name, best=best))
    return summary


def _ratio_text(ms, ratio) -> str:
    if ms is None:
        return f"{'-':>7s} {'-':>7s} {'':6s}"
    return f"{ms:7.3f} {ratio:6.3f}x {'meets' if ratio <= GATE else 'misses':6s}"


def print_table(table: list[dict], summary: list[dict]) -> None:
    """The table (fc1 + fc2_dgrad ms, ratio to torch, verdict) and one summary line per slice."""
    print(
        f"\n{'slice':18s} {'k':>3s} {'config':16s} {'torch':>7s} | {'quack (no wait)':22s} | "
        f"{'wait quack-order':22s} | {'wait arrival':22s}"
    )
    for e in table:
        cells = " | ".join(_ratio_text(e[f"{key}_ms"], e[f"{key}_ratio"]) for _, key in KINDS)
        print(f"{e['shape']:18s} {e['k']:3d} {e['config']:16s} {e['torch_ms']:7.3f} | {cells}")
    for s in summary:
        parts = [
            f"k={k} {b['config']} {b['order']} {b['ratio']:.3f}x ({'meets' if b['passes'] else 'misses'})"
            for k, b in s["best"].items()
        ]
        print(f"summary {s['shape']}: best waiting GEMM per K: " + "; ".join(parts), flush=True)


# ---- the sweep ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"a comma list of {', '.join(SHAPES)}")
    p.add_argument(
        "--k",
        default="0,8,16,32",
        help="SMs held back for communication, a comma list (e.g. 0,2,4,6,8,16), each in [0, SMs - "
        "cluster_m)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--all-configs",
        action="store_true",
        help="QuACK without waits and the waiting GEMM (both orders) at all five configurations in CONFIGS",
    )
    p.add_argument(
        "--case-timeout",
        type=float,
        default=120.0,
        help="seconds one check or timing may take (compilation not counted); past it the JSON gathered so "
        "far is written and the process exits with status 3; 0: no limit",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        ks = parse_ks(a.k)
    except ValueError as e:
        print(f"tile_gemm_gate: {e}", file=sys.stderr)
        return 2
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"tile_gemm_gate: --shapes {','.join(unknown)}; known: {','.join(SHAPES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("tile_gemm_gate: needs an sm_90 GPU (QuACK's sm_90 kernels); none here", file=sys.stderr)
        return 2
    import quack.gemm as qg
    from quack.gemm_interface import gemm_tuned

    from mok_megatron.kernels import tile_gemm as tg

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs_of = {
        name: list(CONFIGS) if a.all_configs else [getattr(tg, SHAPE_CONFIG[name])] for name in shapes
    }
    errors = held_back_errors(ks, list(dict.fromkeys(c for cs in configs_of.values() for c in cs)), sms)
    if errors:
        for line in errors:
            print(f"tile_gemm_gate: {line}", file=sys.stderr)
        return 2

    rows, refused, skipped = [], [], []
    result = dict(
        device=torch.cuda.get_device_name(dev), sms=sms, argv=sys.argv[1:] if argv is None else argv
    )

    def results(incomplete=None, echo=False) -> dict:
        done = list(rows)
        table = table_rows(done, shapes, ks)
        return dict(
            result,
            incomplete=incomplete,
            rows=done,
            refused=list(refused),
            skipped=list(skipped),
            table=table,
            gate=gate_rows(done, shapes, ks, echo=echo),
            summary=summary_rows(table, shapes, ks),
        )

    def write(res: dict) -> str:
        if not a.json:
            return "no --json: nothing written"
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
        return f"results so far in {a.json}"

    watchdog = CaseWatchdog(a.case_timeout, lambda case: write(results(incomplete=f"timed out: {case}")))

    def record(name, gemm, kind, label, config, k, t, prob, **extra):
        rows.append(
            dict(
                shape=name,
                gemm=gemm,
                kind=kind,
                impl=label,
                config=config,
                k=k,
                ms=t,
                rows=prob["rows"],
                **extra,
            )
        )
        err = f"  (err {extra['rel_err']:.1e})" if "rel_err" in extra else ""
        print(f"{name:18s} {gemm:10s} {label:32s} k={k:2d} {t:8.3f} ms{err}", flush=True)

    def sweep(case, name, gemm, kind, label, config, prob, ref, out, launch, held, extra=None, same=None):
        """Checks one implementation at one configuration against torch (at the largest K), then times it at
        every K; ``same``: an output it should equal bit for bit (QuACK's at this configuration). Returns its
        output, or None when skipped or refused."""
        m = prob["rows"]
        try:
            with held(max(ks)):
                launch(max(ks))  # compiles on first use: host work, not watched
            with watchdog.case(f"{case} check"):
                torch.cuda.synchronize()
                err = _rel_err(out, ref, m)
                ok = bool(torch.allclose(out[:m].float(), ref[:m].float(), **MATCH))
                extra = dict(extra or {}, rel_err=err)
                if same is not None:
                    extra["equals_quack"] = bool(torch.equal(out[:m], same[:m]))
            if not ok:
                refused.append(dict(shape=name, gemm=gemm, kind=kind, impl=label, config=config, rel_err=err))
                print(
                    f"{name:18s} {gemm:10s} {label:32s} refused: differs from torch._grouped_mm (max error "
                    f"{err:.1e} of the largest output; tolerance {MATCH}), not timed",
                    flush=True,
                )
                return None
            for k in ks:
                with held(k):
                    launch(k)  # a new grid size may compile or tune once: outside the timing
                    with watchdog.case(f"{case} k={k}"):
                        t = time_ms(functools.partial(launch, k), a.iters, a.rounds)
                record(name, gemm, kind, label, config, k, t, prob, **extra)
            return out
        except Exception as e:
            lost = _context_error()
            if lost is not None:
                raise ContextLost(case, e) from e
            skipped.append(
                dict(shape=name, gemm=gemm, kind=kind, impl=label, config=config, error=str(e)[:300])
            )
            print(f"{name:18s} {gemm:10s} {label:32s} skipped: {type(e).__name__}: {e}"[:200], flush=True)
            return None

    def no_hold(k):  # the waiting GEMM takes K as an argument
        return contextlib.nullcontext()

    try:
        for name in shapes:
            prob = problems(SHAPES[name], dev)
            m, offs = prob["rows"], prob["offs"]
            for gemm in ("fc1", "fc2_dgrad"):
                x, w = prob[gemm]
                n = w.shape[2]
                ref = torch._grouped_mm(x, w, offs=offs)
                with watchdog.case(f"{name} {gemm} torch._grouped_mm"):
                    t = time_ms(
                        lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w, offs=offs), a.iters, a.rounds
                    )
                record(name, gemm, "torch", "torch._grouped_mm", None, 0, t, prob)
                for cfg in configs_of[name]:
                    config = _label(cfg)
                    out = torch.empty_like(ref)

                    qcfg = _gemm_config(cfg)

                    def run_quack(k, x=x, w=w, out=out, qcfg=qcfg, cu=prob["cu"]):
                        gemm_tuned.fn(x, w, out, cu_seqlens_m=cu, config=qcfg)

                    label = f"quack {config}"
                    same = sweep(
                        f"{name} {gemm} {label}", name, gemm, "quack", label, config, prob, ref, out,
                        run_quack, lambda k: HeldBack(qg, k),
                    )  # fmt: skip
                    for order, ready in (("quack-order", None), ("arrival", prob["ready"])):
                        plan = tg.tile_plan(offs, m, n, cfg, ready_M=ready)
                        counters = plan.targets_S.clone()
                        out = torch.empty_like(ref)

                        def run_wait(k, x=x, w=w, out=out, plan=plan, counters=counters):
                            tg.tile_grouped_mm(x, w, plan, counters, sms_held_back=k, out=out)

                        label = f"wait {config} {order}"
                        sweep(
                            f"{name} {gemm} {label}", name, gemm, f"wait-{order}", label, config, prob, ref,
                            out, run_wait, no_hold, dict(order=order), same,
                        )  # fmt: skip
    except ContextLost as e:
        where = write(results(incomplete=f"CUDA context lost at {e.case}: {e}"))
        print(f"tile_gemm_gate: CUDA error at {e.case}, the context is lost ({e}); {where}", file=sys.stderr)
        return 4
    res = results(echo=True)
    print_table(res["table"], res["summary"])
    write(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
