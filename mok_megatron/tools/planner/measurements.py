"""The repo's measured numbers as records: docs/benchmarks.md (EP=1 layer times, H200) and every
results directory docs/results/<date>/<run>/ (one machine start each; files anywhere below it):
ep.json (EP=2 on 2 x H200 and the EP=1 same-work baselines), overlap.json (single-H200 loopback
sweep), layer-*.json (``mok bench layer``: one-GPU layer, fwd+bwd, uniform routing rows) and
profile*.txt (kernel launches and host enqueue time). A new directory is picked up with no code change.

Shapes come from the benchmark definitions themselves (``mok_megatron.bench.overlap``), so a result
file and the planner never disagree on what was timed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mok_megatron.bench.overlap import EP_SHAPES, OVERLAP_SHAPES
from mok_megatron.tools.planner.shapes import MoEShape

DOCS = Path(__file__).resolve().parents[3] / "docs"


@dataclass(frozen=True)
class Layer1:
    """One EP=1 layer time (fwd+bwd, ms): per-rank work of one MoE layer on one H200."""

    source: str  # "benchmarks.md" or "run8" ...
    impl: str  # mok, megatron-te, megatron
    shape: str
    moe: MoEShape  # experts = local experts
    tokens: int
    ms: float


@dataclass(frozen=True)
class EPPoint:
    """One real EP=2 layer time on 2 x H200 (max over ranks)."""

    source: str
    impl: str  # megatron-te, megatron, mok
    transport: str  # nccl a2a, plain, collective, copy_engine
    mode: str  # exact, sync-free+graph ("" for Megatron)
    chunks: int
    shape: str
    moe: MoEShape  # experts = global experts
    tokens: int
    ep: int
    ms: float


@dataclass(frozen=True)
class LoopRow:
    """One loopback row: emulated link GB/s (0 = infinite), minibatch count, mode, layer ms."""

    source: str
    shape: str
    mode: str
    gbps: float
    chunks: int
    ms: float
    t0_ms: float
    link_ms: float
    bytes_per_step: float


_BENCH_SHAPES = {  # docs/benchmarks.md table rows (shape column prefix -> per-rank shape)
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", MoEShape(2048, 768, 128, 8), 16384),
    "DeepSeek-V3 slice": ("deepseek-v3-ep32", MoEShape(7168, 2048, 8, 8), 4096),
}
_BENCH_IMPLS = ("mok", "megatron-te", "megatron")


def benchmarks_md(path: Path | None = None) -> list[Layer1]:
    text = (path or DOCS / "benchmarks.md").read_text()
    out = []
    for line in text.splitlines():
        for prefix, (shape, moe, tokens) in _BENCH_SHAPES.items():
            # the session-1 layer table's rows only: "| Qwen3-30B-A3B (H 2048, ...) | ..." (other tables
            # name the same shapes, e.g. "| Qwen3-30B-A3B, zipf | ...")
            if line.startswith(f"| {prefix}") and "(H " in line.split("|")[1]:
                cells = [c.strip() for c in line.strip("|").split("|")][1:]
                for impl, cell in zip(_BENCH_IMPLS, cells, strict=True):
                    ms = float(re.search(r"([\d.]+) ms", cell).group(1))
                    out.append(Layer1("benchmarks.md", impl, shape, moe, tokens, ms))
    if len(out) != 6:
        raise ValueError(
            f"{path}: expected 2 shapes x 3 implementations in the layer table, found {len(out)}"
        )
    return out


def _run_key(p: Path) -> tuple:
    m = re.match(r"([A-Za-z_-]*)(\d*)(.*)", p.name)
    return (p.parent.name, m.group(1), int(m.group(2) or 0), m.group(3))


RESULT_FILES = ("ep.json", "overlap.json", "layer-*.json", "profile*.txt")


def run_dirs(root: Path | None = None) -> list[Path]:
    """Every docs/results/<date>/<run> directory holding a result file at any depth below it."""
    root = root or DOCS / "results"
    return sorted(
        (p for p in root.glob("*/*") if p.is_dir() and any(next(p.rglob(g), None) for g in RESULT_FILES)),
        key=_run_key,
    )


def _one(run: Path, name: str) -> Path | None:
    """The single file called ``name`` below ``run`` (a run has at most one ep.json / overlap.json)."""
    found = sorted(run.rglob(name))
    if len(found) > 1:
        raise ValueError(f"{run}: {len(found)} files named {name}; keep one per results directory")
    return found[0] if found else None


def _ep_moe(name: str, ep: int) -> tuple[MoEShape, int]:
    s = EP_SHAPES[name]
    return MoEShape(s["hidden"], s["ffn"], s["local"] * ep, s["topk"]), s["tokens"]


def _mok_label(label: str) -> tuple[str, str | None]:
    """ep.json MoK transport label -> (transport, mode): "collective exact" -> ("collective", "exact");
    with --local-rows (engine-5 on) "collective fused sync-free+graph" -> ("collective",
    "sync-free+graph fused"), the loopback sweep's spelling; "plain" -> ("plain", "exact"). The "no-B"
    variant (local rows in region A only) and FP8-dispatch modes ("...+fp8": fewer bytes per row, not
    modelled) are skipped: mode None."""
    words = label.split()
    rest = words[1:]
    if "no-B" in rest or any(w.endswith("+fp8") for w in rest):
        return words[0], None
    local = rest.pop(0) if rest and rest[0] in ("overlap", "fused") else ""
    mode = " ".join(rest) or "exact"
    return words[0], f"{mode} {local}" if local else mode


def _bf16_experts(row: dict) -> bool:
    """Rows timed with MoK's bf16 experts (``--expert-backend torch``, the default; rows from before the
    option carry no key). FP8 expert rows are not fitted: FP8 is modelled by the FP8 grouped-GEMM rate."""
    return row.get("expert_backend", "torch") == "torch"


def ep_results(run: Path) -> tuple[list[Layer1], list[EPPoint]]:
    ones, twos = [], []
    f = _one(run, "ep.json")
    if f is None:
        return ones, twos
    for r in json.loads(f.read_text()):
        if "ms" not in r or r["shape"] not in EP_SHAPES or r["shape"] == "tiny" or not _bf16_experts(r):
            continue
        if r.get("transport") == "plain+graph":  # a CUDA-graph replay of EP=1 (a baseline): not fitted
            continue
        moe, tokens = _ep_moe(r["shape"], r["ep"])
        if r["ep"] == 1:
            ones.append(Layer1(run.name, r["impl"], r["shape"], moe, tokens, r["ms"]))
            continue
        transport, mode = _mok_label(r["transport"]) if r["impl"] == "mok" else ("nccl a2a", "")
        if mode is None:
            continue
        twos.append(
            EPPoint(
                run.name, r["impl"], transport, mode, r["chunks"], r["shape"], moe, tokens, r["ep"], r["ms"]
            )
        )
    return ones, twos


def _unmodelled_mode(mode: str) -> bool:
    """Loopback modes the model leaves out: FP8 dispatch (a label ending "+fp8": fewer bytes per row) and
    the opt-in weight-gradient order A/B ("+late-wgrad" / "+early-wgrad", session 10) and the loopback's
    link time without its bytes ("+link-only", session 11)."""
    head = mode.split()[0] if mode else ""
    return mode.endswith("+fp8") or head.endswith("-wgrad") or head.endswith("+link-only")


def overlap_results(run: Path) -> tuple[list[Layer1], list[LoopRow]]:
    f = _one(run, "overlap.json")
    if f is None:
        return [], []
    rows = [
        r
        for r in json.loads(f.read_text())
        if "profile" not in r
        and r["shape"] in OVERLAP_SHAPES
        and not OVERLAP_SHAPES[r["shape"]].get("shared")  # the model has no shared expert
        and _bf16_experts(r)
    ]
    # the eager no-communication layer (a "graph" row is the same layer replayed from a CUDA graph)
    t0 = {r["shape"]: r["ms"] for r in rows if r["gbps"] is None and not r.get("graph")}
    ones = []
    for shape, ms in t0.items():
        s = OVERLAP_SHAPES[shape]
        ones.append(
            Layer1(
                run.name,
                "mok",
                shape,
                MoEShape(s["hidden"], s["ffn"], s["experts"], s["topk"]),
                s["tokens"],
                ms,
            )
        )
    loops = [
        LoopRow(
            run.name,
            r["shape"],
            r.get("mode", "exact"),
            r["gbps"] or 0.0,
            r["chunks"],
            r["ms"],
            t0[r["shape"]],
            r["comm_ms"],
            r["bytes_per_step"],
        )
        for r in rows
        if r["gbps"] is not None and not _unmodelled_mode(r.get("mode", ""))
    ]
    return ones, loops


def impl_variant(impl: str, note: str) -> str:
    """The implementation name a layer row is fitted under: a row timed eagerly and one timed under
    torch.compile are different programs (torchtitan: 15.99 vs 10.34 ms in s3b), so the bench's note
    ("torch.compile", "eager (...)") becomes a suffix; rows without such a note keep their name."""
    if note == "torch.compile":
        return f"{impl}-compiled"
    if note.startswith("eager"):
        return f"{impl}-eager"
    return impl


def layer_results(run: Path) -> list[Layer1]:
    """``mok bench layer`` JSON: the fwd+bwd time of each implementation (eager and compiled apart,
    impl_variant), uniform routing and bf16 only (the planner models uniform routing; FP8 layer timings,
    e.g. fp8_h200.json, are not read, nor the FP8 expert backends' rows of a bf16 case (``mok-torch-fp8``,
    ``mok-te-*``): FP8 is modelled by the measured FP8 grouped-GEMM rate); skipped implementations have
    no row."""
    from mok_megatron.bench.suite import FP8_IMPLS

    out = []
    for f in sorted(run.rglob("layer-*.json")):
        for case in json.loads(f.read_text()).get("cases", []):
            if case.get("routing", "uniform") != "uniform" or case.get("dtype", "bf16") != "bf16":
                continue
            moe = MoEShape(case["hidden"], case["ffn"], case["experts"], case["topk"])
            for r in case["rows"]:
                ms = r.get("fwd_bwd_ms", r.get("ms"))
                if ms and r["impl"] not in FP8_IMPLS:
                    impl = impl_variant(r["impl"], r.get("note", ""))
                    out.append(Layer1(run.name, impl, case["shape"], moe, case["tokens"], ms))
    return out


@dataclass(frozen=True)
class Profile:
    """One profiled configuration: wall ms, kernel launches, host enqueue ms (under the profiler)."""

    source: str
    what: str
    wall_ms: float
    launches: int
    host_ms: float
    unprofiled_ms: float | None = None  # the same configuration timed without the profiler (ep.json rows)

    @property
    def host_us_per_launch(self) -> float:
        return 1e3 * self.host_ms / self.launches


_PROFILE_LINE = re.compile(
    r"^== (?P<what>.+?): wall (?P<wall>[\d.]+) ms \|.*?(?:in (?P<n1>\d+) launches)?"
    r" ?\|? host enqueue (?P<host>[\d.]+) ms(?: \| (?P<n2>\d+) kernels)?"
)


def profile_results(run: Path) -> list[Profile]:
    """The header line of each configuration in profile*.txt (profile_layer.py / profile_ep.py)."""
    out = []
    for f in sorted(run.rglob("profile*.txt")):
        for line in f.read_text().splitlines():
            m = _PROFILE_LINE.match(line)
            if m and (m["n1"] or m["n2"]):
                n = int(m["n1"] or m["n2"])
                out.append(Profile(run.name, m["what"], float(m["wall"]), n, float(m["host"])))
    return out


@dataclass(frozen=True)
class Measurements:
    layer1: tuple[Layer1, ...]
    ep: tuple[EPPoint, ...]
    loop: tuple[LoopRow, ...]
    profiles: tuple[Profile, ...] = ()

    def without(self, source: str) -> Measurements:
        return Measurements(
            tuple(p for p in self.layer1 if p.source != source),
            tuple(p for p in self.ep if p.source != source),
            tuple(p for p in self.loop if p.source != source),
            tuple(p for p in self.profiles if p.source != source),
        )

    @property
    def sources(self) -> tuple[str, ...]:
        seen = dict.fromkeys(p.source for group in (self.layer1, self.ep, self.loop) for p in group)
        return tuple(seen)


def ep_profiles(run: Path) -> list[Profile]:
    """ep.json rows that carry one profiled step (``mok bench ep --profile``): GPU span (wall of the
    profiled step), GPU ops (kernels, copies, memsets), host time of the step call (enqueue and any host
    waits), next to the row's own unprofiled time."""
    f = _one(run, "ep.json")
    if f is None:
        return []
    out = []
    for r in json.loads(f.read_text()):
        prof = r.get("profile")
        if prof and prof.get("gpu_ops") and "ms" in r:
            what = f"{r['shape']} EP={r['ep']} {r['impl']} {r['transport']} x{r.get('chunks', 1)}"
            out.append(
                Profile(run.name, what, prof["gpu_span_ms"], prof["gpu_ops"], prof["host_ms"], r["ms"])
            )
    return out


def load(docs: Path | None = None) -> Measurements:
    docs = docs or DOCS
    layer1, ep, loop, prof = list(benchmarks_md(docs / "benchmarks.md")), [], [], []
    for run in run_dirs(docs / "results"):
        a, b = ep_results(run)
        c, d = overlap_results(run)
        layer1 += a + c + layer_results(run)
        ep += b
        loop += d
        prof += profile_results(run) + ep_profiles(run)
    if not ep or not loop:
        raise ValueError(f"{docs}/results: no ep.json / overlap.json rows found; the planner needs both")
    return Measurements(tuple(layer1), tuple(ep), tuple(loop), tuple(prof))
