"""Refresh the planner's measurement data (data/measurements.json) from one results folder. Run in a checkout:

    python -m mok_megatron.tools.planner.extract docs/results/<date>-<topic>

It reads the result files anywhere below the folder: ep.json (EP=2 on 2 x H200 and the EP=1 same-work
baselines), overlap.json (one-H200 loopback sweep), layer-*.json (``mok bench layer``: one-GPU layer,
fwd+bwd), profile*.txt (kernel launches and host enqueue time), layer_table.md (the EP=1 layer table of
MoK, Megatron+TE and Megatron without TE on the Qwen3-30B-A3B and DeepSeek-V3 slices) and any other *.json
that ``mok bench train --json`` wrote (whole training steps per run, GPU comparisons only). Its records replace
those of the same source in the data file; every other record stays. Each record keeps its shape, machine,
date, its *source* (the folder's name) and the *commit* that holds the folder (``git show
<commit>:docs/results/<source>/...``), so the data outlives the folder: a re-measurement replaces its
folder, and git keeps the past. A new measurement is added by data only: commit its folder, refresh, and
declare its code state in data/calibration.json (docs/planner.md, 'Adding a measurement').

``mok plan`` never reads docs/: it reads only the package data this writes (``measurements.load``).
Shapes come from the benchmark definitions (``mok_megatron.bench.shapes``), so a result file and the
planner never disagree on what was timed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from mok_megatron.tools.planner.measurements import DATA_DIR, MEASUREMENTS_FILE

ONE_GPU, TWO_GPU = "H200", "2 x H200 (NVLink)"
BENCHMARKS_SOURCE = "2026-11-30-layer-foundation"  # the results folder holding the EP=1 layer table
LAYER_TABLE = "layer_table.md"
KINDS = ("layer1", "ep", "loop", "profiles", "train")

_BENCH_SHAPES = {  # layer-table rows (shape column prefix -> per-rank shape)
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", dict(hidden=2048, ffn=768, experts=128, topk=8), 16384),
    "DeepSeek-V3 slice": ("deepseek-v3-ep32", dict(hidden=7168, ffn=2048, experts=8, topk=8), 4096),
}
_BENCH_IMPLS = ("mok", "megatron-te", "megatron")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


def _rec(source: str, date: str, machine: str, **kw) -> dict:
    return dict(source=source, date=date, machine=machine, **kw)


def benchmarks_md(path: Path, source: str = BENCHMARKS_SOURCE, date: str = "") -> list[dict]:
    """The EP=1 layer table (``layer_table.md``): rows "| Qwen3-30B-A3B (H 2048, ...) | ..."."""
    out = []
    for line in path.read_text().splitlines():
        for prefix, (shape, moe, tokens) in _BENCH_SHAPES.items():
            if line.startswith(f"| {prefix}") and "(H " in line.split("|")[1]:
                cells = [c.strip() for c in line.strip("|").split("|")][1:]
                for impl, cell in zip(_BENCH_IMPLS, cells, strict=True):
                    ms = float(re.search(r"([\d.]+) ms", cell).group(1))
                    out.append(
                        _rec(source, date or source[:10], ONE_GPU, impl=impl, shape=shape, **moe,
                             tokens=tokens, ms=ms)
                    )  # fmt: skip
    if len(out) != 6:
        raise ValueError(
            f"{path}: expected 2 shapes x 3 implementations in the layer table, found {len(out)}"
        )
    return out


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


def _flag_value(argv: list[str], name: str) -> str | None:
    """The last ``name VALUE`` / ``name=VALUE`` of a command line (argparse keeps the last one)."""
    value = None
    for i, tok in enumerate(argv):
        if tok == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(name + "="):
            value = tok.split("=", 1)[1]
    return value


def train_results(folder: Path, source: str = "", date: str = "") -> list[dict]:
    """Every finished run of every ``mok bench train`` JSON below ``folder`` (schema mok-bench-train/1) on
    GPUs: its precision, layer and MoK expert backend read off the run's own command line, its speed-up and
    FP8 / bf16 step ratio by the bench's own rule (``train_report``: within a precision, against the first
    Megatron run of it; each FP8 run against its layer's bf16 run). CPU-mode comparisons (fp32, gloo) time
    a CPU and are not read."""
    from mok_megatron.bench.train_report import SCHEMA, compare

    out = []
    for f in sorted(folder.rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(d, dict) or d.get("schema") != SCHEMA or d["machine"]["device"] == "cpu":
            continue
        ok = {}
        for name, r in d["runs"].items():
            if r["rc"] == 0 and r.get("tokens_per_s_per_gpu") and r.get("step_ms_median"):
                ok[name] = dict(r, fp8=r.get("fp8", _flag_value(r["command"], "--fp8-format") is not None))
        compare(ok)
        nproc = d["nproc_per_node"]
        machine = d["machine"]["device"] if nproc == 1 else f"{nproc} x {d['machine']['device']}"
        for name, r in ok.items():
            argv = r["command"]
            mok = _flag_value(argv, "--moe-token-dispatcher-type") == "mok"
            recipe = (_flag_value(argv, "--fp8-recipe") or "delayed") if r["fp8"] else ""
            out.append(
                _rec(source, date, machine, comparison=str(f.relative_to(folder)), preset=d["preset"], run=name,
                     layer="mok" if mok else "megatron",
                     expert_backend=(_flag_value(argv, "--mok-expert-backend") or "torch") if mok else "",
                     fp8_recipe=recipe, nproc=nproc, tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                     step_ms=r["step_ms_median"], vs_megatron=r.get("vs_megatron"),
                     step_vs_bf16=r.get("step_vs_bf16"))
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


def extract(folder: Path, source: str | None = None) -> dict:
    """Every record below one results folder, recorded under ``source`` (default: the folder's name,
    ``<date>-<topic>``) and that name's date."""
    source = source or folder.name
    if not _DATE.match(source):
        raise ValueError(f"source {source!r}: a results folder is named <date>-<topic> (e.g. 2026-12-02-ep2)")
    date = source[:10]
    data: dict[str, list] = {k: [] for k in KINDS}
    table = folder / LAYER_TABLE
    if table.is_file():
        data["layer1"] += benchmarks_md(table, source, date)
    a, b = ep_results(folder, source, date)
    c, d = overlap_results(folder, source, date)
    data["layer1"] += a + c + layer_results(folder, source, date)
    data["ep"] += b
    data["loop"] += d
    data["profiles"] += profile_results(folder, source, date) + ep_profiles(folder, source, date)
    data["train"] += train_results(folder, source, date)
    if not any(data.values()):
        raise ValueError(
            f"{folder}: no result files (ep.json, overlap.json, layer-*.json, profile*.txt, {LAYER_TABLE}, "
            "mok bench train JSON) below it"
        )
    return data


def folder_commit(folder: Path) -> str:
    """The last commit that changed ``folder`` (its measurement as recorded); the folder must be committed."""
    r = subprocess.run(
        ["git", "-C", str(folder), "log", "-1", "--format=%H", "--", "."], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True, text=True
    )
    if r.returncode != 0 or not r.stdout.strip() or dirty.stdout.strip():
        raise ValueError(
            f"{folder}: not committed in a git checkout; commit the folder first, or pass --commit"
        )
    return r.stdout.strip()


def refresh(data: dict, fresh: dict, source: str, commit: str) -> dict:
    """The data file's records with ``source``'s replaced by ``fresh`` (each naming ``commit``)."""
    out = {"loopback_shapes": loopback_shapes()}
    for kind in KINDS:
        kept = [r for r in data.get(kind, []) if r["source"] != source]
        out[kind] = kept + [{"source": r["source"], "commit": commit, **r} for r in fresh[kind]]
    if not out["ep"] or not out["loop"]:
        raise ValueError("no ep.json / overlap.json rows in the data; the planner needs both")
    return out


def dumps(data: dict) -> str:
    """Compact JSON: one record per line, so a new measurement is a readable diff."""
    doc = (
        "Measured records mok plan fits; refreshed one results folder at a time by "
        "`python -m mok_megatron.tools.planner.extract docs/results/<source>` (do not edit by hand). source: "
        "the results folder, commit: the commit holding it (git show <commit>:docs/results/<source>)."
    )
    parts = [f'{{"_doc": {json.dumps(doc)},\n"loopback_shapes": {json.dumps(data["loopback_shapes"])}']
    for key in KINDS:
        rows = ",\n".join(json.dumps(r) for r in data[key])
        parts.append(f'"{key}": [\n{rows}\n]')
    return ",\n".join(parts) + "}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_megatron.tools.planner.extract", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("folder", type=Path, help="a results folder, docs/results/<date>-<topic>")
    p.add_argument("--source", help="the source name its records get (default: the folder's name)")
    p.add_argument(
        "--commit", help="the commit holding the folder (default: the last commit that changed it)"
    )
    p.add_argument("--out", type=Path, default=DATA_DIR / MEASUREMENTS_FILE)
    ns = p.parse_args(argv)
    if not ns.folder.is_dir():
        p.error(f"{ns.folder} is not a folder; pass a results folder such as docs/results/<date>-<topic>")
    source = ns.source or ns.folder.resolve().name
    try:
        fresh = extract(ns.folder, source)
        commit = ns.commit or folder_commit(ns.folder)
        old = json.loads(ns.out.read_text()) if ns.out.is_file() else {}
        data = refresh(old, fresh, source, commit)
    except ValueError as e:
        print(f"extract: {e}", file=sys.stderr)
        return 1
    ns.out.write_text(dumps(data))
    counts = ", ".join(f"{len(fresh[k])} {k}" for k in KINDS)
    print(f"wrote {ns.out}: {source} @ {commit[:12]}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
