"""Regenerate the planner's measurement data from the repo's result files. Run in a checkout:

    python -m mok_megatron.tools.planner.extract docs      # writes data/measurements.json

It reads docs/results/2026-11-30-layer-foundation/layer_table.md (the EP=1 layer table: MoK, Megatron+TE, Megatron without TE on the
Qwen3-30B-A3B and DeepSeek-V3 slices) and every results folder below docs/results, laid out either as
``<date>-<topic>/`` or ``<date>/<topic>/`` (one machine start each; result files anywhere below it):
ep.json (EP=2 on 2 x H200 and the EP=1 same-work baselines), overlap.json (one-H200 loopback sweep),
layer-*.json (``mok bench layer``: one-GPU layer, fwd+bwd) and profile*.txt (kernel launches and host
enqueue time). Each record keeps its shape, machine, date and the folder it came from (its *source*:
the folder's path below docs/results with '/' as '-'). A new measurement is added by data only: drop
its folder under docs/results, regenerate, and declare its code state in data/calibration.json.

``mok plan`` never reads docs/: it reads only the package data this writes (``measurements.load``).
Shapes come from the benchmark definitions (``mok_megatron.bench.shapes``), so a result file and the
planner never disagree on what was timed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from mok_megatron.tools.planner.measurements import DATA_DIR, MEASUREMENTS_FILE

ONE_GPU, TWO_GPU = "H200", "2 x H200 (NVLink)"
BENCHMARKS_SOURCE = "2026-11-30-layer-foundation"  # the results folder holding the EP=1 layer table
BENCHMARKS_DATE = "2026-11-30"
LAYER_TABLE = "layer_table.md"

_BENCH_SHAPES = {  # layer-table rows (shape column prefix -> per-rank shape)
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", dict(hidden=2048, ffn=768, experts=128, topk=8), 16384),
    "DeepSeek-V3 slice": ("deepseek-v3-ep32", dict(hidden=7168, ffn=2048, experts=8, topk=8), 4096),
}
_BENCH_IMPLS = ("mok", "megatron-te", "megatron")
RESULT_FILES = ("ep.json", "overlap.json", "layer-*.json", "profile*.txt")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


def _rec(source: str, date: str, machine: str, **kw) -> dict:
    return dict(source=source, date=date, machine=machine, **kw)


def benchmarks_md(path: Path) -> list[dict]:
    """The EP=1 layer table (``layer_table.md``): rows "| Qwen3-30B-A3B (H 2048, ...) | ..."."""
    out = []
    for line in path.read_text().splitlines():
        for prefix, (shape, moe, tokens) in _BENCH_SHAPES.items():
            if line.startswith(f"| {prefix}") and "(H " in line.split("|")[1]:
                cells = [c.strip() for c in line.strip("|").split("|")][1:]
                for impl, cell in zip(_BENCH_IMPLS, cells, strict=True):
                    ms = float(re.search(r"([\d.]+) ms", cell).group(1))
                    out.append(
                        _rec(BENCHMARKS_SOURCE, BENCHMARKS_DATE, ONE_GPU, impl=impl, shape=shape,
                             **moe, tokens=tokens, ms=ms)
                    )  # fmt: skip
    if len(out) != 6:
        raise ValueError(
            f"{path}: expected 2 shapes x 3 implementations in the layer table, found {len(out)}"
        )
    return out


def _has_results(p: Path) -> bool:
    return any(next(p.rglob(g), None) for g in RESULT_FILES)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def results_folders(root: Path) -> list[Path]:
    """Every results folder below ``root`` holding a result file: ``<date>-<topic>/`` directly, or
    ``<topic>/`` inside a ``<date>/`` folder."""
    out = []
    for p in sorted(root.iterdir()):
        if not p.is_dir() or not _DATE.match(p.name):
            continue
        if len(p.name) > 10:
            out += [p] if _has_results(p) else []
        else:
            out += sorted(
                (c for c in p.iterdir() if c.is_dir() and _has_results(c)), key=lambda c: _natural(c.name)
            )
    return out


def source_name(folder: Path, root: Path) -> str:
    """A results folder's source name: its path below ``root`` with '/' as '-' (``<date>-<topic>``)."""
    return folder.relative_to(root).as_posix().replace("/", "-")


def _one(folder: Path, name: str) -> Path | None:
    """The single file called ``name`` below ``folder`` (a folder has at most one ep.json / overlap.json)."""
    found = sorted(folder.rglob(name))
    if len(found) > 1:
        raise ValueError(f"{folder}: {len(found)} files named {name}; keep one per results folder")
    return found[0] if found else None


def _mok_label(label: str) -> tuple[str, str | None]:
    """ep.json MoK transport label -> (transport, mode): "collective exact" -> ("collective", "exact");
    with local rows "collective fused sync-free+graph" -> ("collective", "sync-free+graph fused"), the
    loopback sweep's spelling; "plain" -> ("plain", "exact"). The "no-B" variant (local rows in region
    A only) and FP8-dispatch modes ("...+fp8": fewer bytes per row, not modelled) are skipped: mode None."""
    words = label.split()
    rest = words[1:]
    if "no-B" in rest or any(w.endswith("+fp8") for w in rest):
        return words[0], None
    local = rest.pop(0) if rest and rest[0] in ("overlap", "fused") else ""
    mode = " ".join(rest) or "exact"
    return words[0], f"{mode} {local}" if local else mode


def _bf16_experts(row: dict) -> bool:
    """Rows timed with MoK's bf16 experts (``--expert-backend torch``, the default; rows without the key
    predate the option). FP8 expert rows are not fitted: FP8 is modelled by the FP8 grouped-GEMM rate."""
    return row.get("expert_backend", "torch") == "torch"


def ep_results(folder: Path, source: str = "", date: str = "") -> tuple[list[dict], list[dict]]:
    from mok_megatron.bench.shapes import EP_SHAPES

    ones, twos = [], []
    f = _one(folder, "ep.json")
    if f is None:
        return ones, twos
    for r in json.loads(f.read_text()):
        if "ms" not in r or r["shape"] not in EP_SHAPES or r["shape"] == "tiny" or not _bf16_experts(r):
            continue
        if r.get("transport") == "plain+graph":  # a CUDA-graph replay of EP=1 (a baseline): not fitted
            continue
        s = EP_SHAPES[r["shape"]]
        moe = dict(hidden=s["hidden"], ffn=s["ffn"], experts=s["local"] * r["ep"], topk=s["topk"])
        if r["ep"] == 1:
            ones.append(
                _rec(
                    source,
                    date,
                    ONE_GPU,
                    impl=r["impl"],
                    shape=r["shape"],
                    **moe,
                    tokens=s["tokens"],
                    ms=r["ms"],
                )
            )
            continue
        transport, mode = _mok_label(r["transport"]) if r["impl"] == "mok" else ("nccl a2a", "")
        if mode is None:
            continue
        twos.append(
            _rec(source, date, TWO_GPU, impl=r["impl"], transport=transport, mode=mode, chunks=r["chunks"],
                 shape=r["shape"], **moe, tokens=s["tokens"], ep=r["ep"], ms=r["ms"])
        )  # fmt: skip
    return ones, twos


def _unmodelled_mode(mode: str) -> bool:
    """Loopback modes the model leaves out: FP8 dispatch (a label ending "+fp8": fewer bytes per row), the
    opt-in weight-gradient order A/B ("+late-wgrad" / "+early-wgrad") and the loopback's link time
    without its bytes ("+link-only")."""
    head = mode.split()[0] if mode else ""
    return mode.endswith("+fp8") or head.endswith("-wgrad") or head.endswith("+link-only")


def overlap_results(folder: Path, source: str = "", date: str = "") -> tuple[list[dict], list[dict]]:
    from mok_megatron.bench.shapes import OVERLAP_SHAPES

    f = _one(folder, "overlap.json")
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
            _rec(source, date, ONE_GPU, impl="mok", shape=shape, hidden=s["hidden"], ffn=s["ffn"],
                 experts=s["experts"], topk=s["topk"], tokens=s["tokens"], ms=ms)
        )  # fmt: skip
    loops = [
        _rec(source, date, ONE_GPU, shape=r["shape"], mode=r.get("mode", "exact"), gbps=r["gbps"] or 0.0,
             chunks=r["chunks"], ms=r["ms"], t0_ms=t0[r["shape"]], link_ms=r["comm_ms"],
             bytes_per_step=r["bytes_per_step"])
        for r in rows
        if r["gbps"] is not None and not _unmodelled_mode(r.get("mode", ""))
    ]  # fmt: skip
    return ones, loops


def impl_variant(impl: str, note: str) -> str:
    """The implementation name a layer row is fitted under: a row timed eagerly and one timed under
    torch.compile are different programs (torchtitan: 15.99 vs 10.34 ms on the DeepSeek slice), so the
    bench's note ("torch.compile", "eager (...)") becomes a suffix; rows without such a note keep their name."""
    if note == "torch.compile":
        return f"{impl}-compiled"
    if note.startswith("eager"):
        return f"{impl}-eager"
    return impl


def layer_results(folder: Path, source: str = "", date: str = "") -> list[dict]:
    """``mok bench layer`` JSON: the fwd+bwd time of each implementation (eager and compiled apart,
    impl_variant), uniform routing and bf16 only (the planner models uniform routing; FP8 layer timings
    and the FP8 expert backends' rows of a bf16 case are not read: FP8 is modelled by the measured FP8
    grouped-GEMM rate); skipped implementations have no row."""
    from mok_megatron.bench.suite import FP8_IMPLS

    out = []
    for f in sorted(folder.rglob("layer-*.json")):
        for case in json.loads(f.read_text()).get("cases", []):
            if case.get("routing", "uniform") != "uniform" or case.get("dtype", "bf16") != "bf16":
                continue
            moe = dict(hidden=case["hidden"], ffn=case["ffn"], experts=case["experts"], topk=case["topk"])
            for r in case["rows"]:
                ms = r.get("fwd_bwd_ms", r.get("ms"))
                if ms and r["impl"] not in FP8_IMPLS:
                    impl = impl_variant(r["impl"], r.get("note", ""))
                    out.append(
                        _rec(
                            source,
                            date,
                            ONE_GPU,
                            impl=impl,
                            shape=case["shape"],
                            **moe,
                            tokens=case["tokens"],
                            ms=ms,
                        )
                    )
    return out


_PROFILE_LINE = re.compile(
    r"^== (?P<what>.+?): wall (?P<wall>[\d.]+) ms \|.*?(?:in (?P<n1>\d+) launches)?"
    r" ?\|? host enqueue (?P<host>[\d.]+) ms(?: \| (?P<n2>\d+) kernels)?"
)


def _profile_machine(what: str) -> str:
    return TWO_GPU if "EP=2" in what else ONE_GPU


def profile_results(folder: Path, source: str = "", date: str = "") -> list[dict]:
    """The header line of each configuration in profile*.txt (profile_layer.py / profile_ep.py)."""
    out = []
    for f in sorted(folder.rglob("profile*.txt")):
        for line in f.read_text().splitlines():
            m = _PROFILE_LINE.match(line)
            if m and (m["n1"] or m["n2"]):
                out.append(
                    _rec(source, date, _profile_machine(m["what"]), what=m["what"], wall_ms=float(m["wall"]),
                         launches=int(m["n1"] or m["n2"]), host_ms=float(m["host"]), unprofiled_ms=None)
                )  # fmt: skip
    return out


def ep_profiles(folder: Path, source: str = "", date: str = "") -> list[dict]:
    """ep.json rows that carry one profiled step (``mok bench ep --profile``): GPU span (wall of the
    profiled step), GPU ops (kernels, copies, memsets), host time of the step call (enqueue and any host
    waits), next to the row's own unprofiled time."""
    f = _one(folder, "ep.json")
    if f is None:
        return []
    out = []
    for r in json.loads(f.read_text()):
        prof = r.get("profile")
        if prof and prof.get("gpu_ops") and "ms" in r:
            what = f"{r['shape']} EP={r['ep']} {r['impl']} {r['transport']} x{r.get('chunks', 1)}"
            out.append(
                _rec(source, date, TWO_GPU if r["ep"] > 1 else ONE_GPU, what=what, wall_ms=prof["gpu_span_ms"],
                     launches=prof["gpu_ops"], host_ms=prof["host_ms"], unprofiled_ms=r["ms"])
            )  # fmt: skip
    return out


def loopback_shapes() -> dict:
    """The loopback sweep's shapes the model fits (no shared expert, not the tiny test shape)."""
    from mok_megatron.bench.shapes import OVERLAP_SHAPES

    return {
        n: {k: s[k] for k in ("hidden", "ffn", "experts", "topk", "tokens", "ep")}
        for n, s in OVERLAP_SHAPES.items()
        if not n.startswith("tiny") and not s.get("shared")
    }


def extract(docs: Path, names: dict[str, str] | None = None) -> dict:
    """Every record below ``docs`` (results/, the layer table included); ``names`` maps a folder's path below
    docs/results (e.g. "2026-12-01/ep2") to the source name it is recorded under (default: source_name)."""
    root = docs / "results"
    table = docs / "results" / BENCHMARKS_SOURCE / LAYER_TABLE
    data = {"layer1": benchmarks_md(table), "ep": [], "loop": [], "profiles": []}
    for folder in results_folders(root):
        rel = folder.relative_to(root).as_posix()
        src, date = (names or {}).get(rel, source_name(folder, root)), rel[:10]
        a, b = ep_results(folder, src, date)
        c, d = overlap_results(folder, src, date)
        data["layer1"] += a + c + layer_results(folder, src, date)
        data["ep"] += b
        data["loop"] += d
        data["profiles"] += profile_results(folder, src, date) + ep_profiles(folder, src, date)
    if not data["ep"] or not data["loop"]:
        raise ValueError(f"{root}: no ep.json / overlap.json rows found; the planner needs both")
    return {"loopback_shapes": loopback_shapes(), **data}


def dumps(data: dict) -> str:
    """Compact JSON: one record per line, so a new measurement is a readable diff."""
    doc = (
        "Measured records mok plan fits; generated by `python -m mok_megatron.tools.planner.extract docs` "
        "from docs/results (do not edit by hand). source: the results folder (docs/results/<source>)."
    )
    parts = [f'{{"_doc": {json.dumps(doc)},\n"loopback_shapes": {json.dumps(data["loopback_shapes"])}']
    for key in ("layer1", "ep", "loop", "profiles"):
        rows = ",\n".join(json.dumps(r) for r in data[key])
        parts.append(f'"{key}": [\n{rows}\n]')
    return ",\n".join(parts) + "}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_megatron.tools.planner.extract", description=__doc__)
    p.add_argument("docs", type=Path, help="the checkout's docs/ folder (its results/)")
    p.add_argument("--out", type=Path, default=DATA_DIR / MEASUREMENTS_FILE)
    p.add_argument("--names", type=Path, help="JSON {folder path below docs/results: source name}")
    ns = p.parse_args(argv)
    names = json.loads(ns.names.read_text()) if ns.names else None
    data = extract(ns.docs, names)
    ns.out.write_text(dumps(data))
    counts = ", ".join(f"{len(data[k])} {k}" for k in ("layer1", "ep", "loop", "profiles"))
    print(f"wrote {ns.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
