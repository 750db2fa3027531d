"""The measured records the planner fits, read from package data only (data/measurements.json, refreshed
by ``extract`` from one results folder at a time in a checkout), so ``mok plan`` runs from an installed wheel.

Record kinds (every record names its source folder, the commit holding it, date and machine):
    Layer1   one EP=1 layer time (fwd+bwd, ms): per-rank work of one MoE layer on one H200
    EPPoint  one real EP=2 layer time on 2 x H200 (max over ranks)
    LoopRow  one loopback row (one H200 emulating an EP rank's link): link GB/s (0 = infinite),
             minibatches, mode, layer ms, the same layer without communication, link ms, bytes
    Profile  one profiled configuration: wall ms, kernel launches, host enqueue ms
    TrainRun one run of a ``mok bench train`` comparison: whole training steps of a preset in Megatron's
             loop, its precision and MoK expert backend, against the comparison's Megatron run of the same
             precision and its own layer's bf16 run (read and printed, not fitted: the model fits MoE layers)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from mok_megatron.tools.planner.shapes import MoEShape

DATA_DIR = Path(__file__).with_name("data")
MEASUREMENTS_FILE = "measurements.json"


@dataclass(frozen=True)
class Layer1:
    """One EP=1 layer time (fwd+bwd, ms): per-rank work of one MoE layer on one H200."""

    source: str  # the results folder (docs/results/<source> at the record's commit)
    impl: str  # mok, megatron-te, megatron, torchtitan-compiled, ...
    shape: str
    moe: MoEShape  # experts = local experts
    tokens: int
    ms: float
    date: str = ""
    machine: str = ""


@dataclass(frozen=True)
class EPPoint:
    """One real EP=2 layer time on 2 x H200 (max over ranks)."""

    source: str
    impl: str  # megatron-te, megatron, mok
    transport: str  # nccl a2a, plain, collective, copy_engine, nvlink
    mode: str  # exact, sync-free+graph fused, ... ("" for Megatron)
    chunks: int
    shape: str
    moe: MoEShape  # experts = global experts
    tokens: int
    ep: int
    ms: float
    date: str = ""
    machine: str = ""


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
    date: str = ""
    machine: str = ""


@dataclass(frozen=True)
class Profile:
    """One profiled configuration: wall ms, kernel launches, host enqueue ms (under the profiler)."""

    source: str
    what: str
    wall_ms: float
    launches: int
    host_ms: float
    unprofiled_ms: float | None = None  # the same configuration timed without the profiler (ep.json rows)
    date: str = ""
    machine: str = ""

    @property
    def host_us_per_launch(self) -> float:
        return 1e3 * self.host_ms / self.launches


@dataclass(frozen=True)
class TrainRun:
    """One run of a ``mok bench train`` comparison (one JSON file): Megatron's training loop on a preset."""

    source: str
    comparison: str  # the JSON file, relative to the results folder
    preset: str
    run: str  # the bench's run name: mok, mok-torch-fp8, mok-te, mok-bf16, alltoall, alltoall-bf16, ...
    layer: str  # mok or megatron
    expert_backend: str  # MoK's --mok-expert-backend (torch, torch-fp8, te); "" for Megatron's layer
    fp8_recipe: str  # Megatron's --fp8-recipe of an FP8 run; "" in bf16
    nproc: int
    tokens_per_s_per_gpu: float
    step_ms: float  # median step after the warm-up
    vs_megatron: float | None  # a MoK run: tokens/s over the first Megatron run of the same precision
    step_vs_bf16: float | None  # an FP8 run: median step over its layer's bf16 run's in the same comparison
    date: str = ""
    machine: str = ""


@dataclass(frozen=True)
class Measurements:
    layer1: tuple[Layer1, ...]
    ep: tuple[EPPoint, ...]
    loop: tuple[LoopRow, ...]
    profiles: tuple[Profile, ...] = ()
    train: tuple[TrainRun, ...] = ()

    def without(self, source: str) -> Measurements:
        return Measurements(
            tuple(p for p in self.layer1 if p.source != source),
            tuple(p for p in self.ep if p.source != source),
            tuple(p for p in self.loop if p.source != source),
            tuple(p for p in self.profiles if p.source != source),
            tuple(p for p in self.train if p.source != source),
        )

    @property
    def sources(self) -> tuple[str, ...]:
        seen = dict.fromkeys(p.source for group in (self.layer1, self.ep, self.loop) for p in group)
        return tuple(seen)


def _moe(r: dict) -> MoEShape:
    return MoEShape(r["hidden"], r["ffn"], r["experts"], r["topk"])


def from_records(data: dict) -> Measurements:
    """Measurements from the JSON form (``extract.refresh`` output or data/measurements.json)."""
    meta = ("date", "machine")
    return Measurements(
        tuple(
            Layer1(r["source"], r["impl"], r["shape"], _moe(r), r["tokens"], r["ms"], *(r[k] for k in meta))
            for r in data["layer1"]
        ),
        tuple(
            EPPoint(
                r["source"],
                r["impl"],
                r["transport"],
                r["mode"],
                r["chunks"],
                r["shape"],
                _moe(r),
                r["tokens"],
                r["ep"],
                r["ms"],
                *(r[k] for k in meta),
            )
            for r in data["ep"]
        ),  # fmt: skip
        tuple(
            LoopRow(
                r["source"],
                r["shape"],
                r["mode"],
                r["gbps"],
                r["chunks"],
                r["ms"],
                r["t0_ms"],
                r["link_ms"],
                r["bytes_per_step"],
                *(r[k] for k in meta),
            )
            for r in data["loop"]
        ),  # fmt: skip
        tuple(
            Profile(
                r["source"],
                r["what"],
                r["wall_ms"],
                r["launches"],
                r["host_ms"],
                r["unprofiled_ms"],
                *(r[k] for k in meta),
            )
            for r in data["profiles"]
        ),  # fmt: skip
        tuple(TrainRun(**{f.name: r[f.name] for f in fields(TrainRun)}) for r in data.get("train", ())),
    )


def read_data(name: str = MEASUREMENTS_FILE) -> dict:
    """One package data file (data/<name>) as JSON."""
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the planner's package data is missing; reinstall mok-megatron (the wheel ships "
            "mok_megatron/tools/planner/data/*.json), or in a checkout restore it with "
            "`git checkout -- mok_megatron/tools/planner/data`."
        )
    return json.loads(path.read_text())


def load() -> Measurements:
    """The packaged measurements."""
    return from_records(read_data())
