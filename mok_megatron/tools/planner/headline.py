"""The one headline ``mok plan`` prints (and ``--compare`` and docs/planner.md quote). It compares like
with like:

    fitted  MoK as recommended (the fitted layer model of the recommended option) against Megatron's
            alltoall layer (the EP=1 fit of Megatron+TE plus the all-to-all fully exposed, as every EP=2
            measurement showed)
    bound   MoK under Megatron's --overlap-moe-expert-parallel-comm (the combined 1F1B schedule runs
            MoK's plain engine: dispatch, experts and combine as separate nodes, one micro-batch's
            all-to-all behind another's compute) against Megatron's alltoall layer under the same flag:
            both modelled with the all-to-all entirely hidden and never measured here, so both are
            upper bounds; each keeps its own fitted EP>1 compute (Megatron+TE's EP=1 fit; MoK's EP=1 fit
            x (1 + P), its plain engine's measured EP>1 work)

A lead counts only where it exceeds the model's out-of-sample error: each comparison is recomputed with
its two rows moved against each other by the mean |held-out error| of the points that carry them
(``validate.TERMS``: leave-one-source-out), and the headline says whether the lead keeps its sign. It
also names the fitted input that moves the headline most when perturbed by its own held-out error.
"""

from __future__ import annotations

from dataclasses import dataclass

from mok_megatron.tools.planner import predict, validate
from mok_megatron.tools.planner.calibrate import Calibration
from mok_megatron.tools.planner.hardware import Cluster
from mok_megatron.tools.planner.recommend import Recommendation, recommend
from mok_megatron.tools.planner.shapes import Layout, Model

MEGATRON_OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"
KIND = {"megatron": "fitted", "megatron-1f1b": "bound", "mok": "fitted", "mok-1f1b": "bound"}
LABEL = {
    "megatron": "megatron alltoall",
    "megatron-1f1b": f"megatron alltoall {MEGATRON_OVERLAP_FLAG}",
    "mok-1f1b": "mok + megatron's 1F1B EP overlap (plain engine)",
}
PROSE = {
    "megatron": "Megatron's alltoall layer",
    "megatron-1f1b": f"Megatron's alltoall with {MEGATRON_OVERLAP_FLAG}",
    "mok": "MoK as recommended",
    "mok-1f1b": "MoK + Megatron's 1F1B EP overlap",
}
# the comparison each row is in, and the Perturbation field that moves the row by its held-out error
PAIRS = {"fitted": ("mok", "megatron"), "bound": ("mok-1f1b", "megatron-1f1b")}
ROW_INPUT = {
    "megatron": "megatron_ep",
    "megatron-1f1b": "megatron_ep1",
    "mok": "mok_ep",
    "mok-1f1b": "mok_plain",
}
# the fitted inputs perturbed for the sensitivity, in the order they are listed
INPUTS = ("megatron_ep1", "megatron_ep", "mok_ep1", "mok_ep", "mok_plain")


@dataclass(frozen=True)
class Comparison:
    kind: str  # fitted or bound
    ours: predict.StepPrediction  # MoK's row
    theirs: predict.StepPrediction  # Megatron's row
    band: tuple[float, float]  # the lead with the two rows moved against / for MoK by their held-out errors
    errors: tuple[validate.HeldOut, validate.HeldOut]  # (ours, theirs)

    @property
    def lead(self) -> float:
        return self.ours.tokens_per_s_gpu / self.theirs.tokens_per_s_gpu - 1

    @property
    def exceeds(self) -> bool:
        """The lead (or deficit) keeps its sign across the held-out error band."""
        lo, hi = self.band
        return lo > 0 or hi < 0

    def text(self) -> str:
        o, t = self.ours.layer.impl, self.theirs.layer.impl
        eo, et = self.errors
        lo, hi = self.band
        word = "lead" if self.lead >= 0 else "deficit"
        return (
            f"Headline: {PROSE[o]} ({self.kind}) {self.ours.tokens_per_s_gpu:.0f} tokens/s/GPU, {self.lead:+.1%} "
            f"vs {PROSE[t]} ({self.kind}, {self.theirs.tokens_per_s_gpu:.0f}"
            + ("; both with the all-to-all entirely hidden, never measured" if self.kind == "bound" else "")
            + f"): the {word} {'exceeds' if self.exceeds else 'is within'} the held-out error ({lo:+.1%} to "
            f"{hi:+.1%}; mean |held-out error| {_points(eo)}, {_points(et)})."
        )


def _points(e: validate.HeldOut) -> str:
    name = e.what.split(",")[0]
    return f"{name} {e.error:.1%}" if e.points else f"{name}: no points"


@dataclass(frozen=True)
class Sensitivity:
    term: str  # a predict.Perturbation field
    error: validate.HeldOut  # its held-out error
    moves: dict  # comparison kind -> the largest |lead change| when the input moves by +-error

    @property
    def most(self) -> tuple[str, float]:
        return max(self.moves.items(), key=lambda kv: kv[1])


@dataclass(frozen=True)
class Headline:
    options: tuple  # every predict.LayerPrediction of the layout
    rows: dict  # megatron / megatron-1f1b / mok / mok-1f1b -> StepPrediction
    recommendation: Recommendation
    comparisons: dict  # fitted / bound -> Comparison (bound absent without a plain-engine measurement)
    sensitivity: tuple  # Sensitivity per fitted input, the largest first

    @property
    def megatron(self) -> predict.StepPrediction:
        return self.rows["megatron"]

    @property
    def mok(self) -> predict.StepPrediction:
        return self.rows["mok"]

    @property
    def gain(self) -> float:
        """MoK as recommended / Megatron alltoall - 1 (tokens/s/GPU, both fitted)."""
        return self.mok.tokens_per_s_gpu / self.megatron.tokens_per_s_gpu - 1

    def text(self) -> str:
        lines = [c.text() for c in self.comparisons.values()]
        if self.sensitivity:
            s = self.sensitivity[0]
            kind, move = s.most
            ours, theirs = PAIRS[kind]
            lines.append(
                f"Headline: the most uncertain input is {s.error.what.split(':')[0]} ({s.error.what.split(': ')[1]}, "
                f"mean |error| {s.error.error:.1%}): moved by it, {PROSE[ours]} vs {PROSE[theirs]} moves up to "
                f"{100 * move:.1f} points."
            )
        return "\n".join(lines)

    def sensitivity_text(self) -> list[str]:
        """One line per fitted input: its held-out error and how far it moves each comparison."""
        return [
            f"- {s.error.what} {s.error.error:.1%} ({s.error.points} points): "
            + ", ".join(f"{k} lead +-{100 * v:.1f} points" for k, v in s.moves.items())
            for s in self.sensitivity
        ]


def _same(options, row: predict.LayerPrediction) -> predict.LayerPrediction:
    """The option of ``options`` that runs the configuration of ``row``."""
    return next(
        o
        for o in options
        if (o.impl, o.transport, o.chunks, o.mode) == (row.impl, row.transport, row.chunks, row.mode)
    )


def _rows(options, picks, model, layout, cluster) -> dict:
    return {k: predict.step(model, layout, cluster, _same(options, r)) for k, r in picks.items()}


def _leads(rows: dict) -> dict:
    return {
        k: rows[o].tokens_per_s_gpu / rows[t].tokens_per_s_gpu - 1
        for k, (o, t) in PAIRS.items()
        if o in rows and t in rows
    }


def headline(
    cal: Calibration,
    model: Model,
    layout: Layout,
    cluster: Cluster,
    a: predict.Assumptions | None = None,
    errors: dict | None = None,
) -> Headline:
    """The headline of a layout; ``errors``: validate.TERMS -> HeldOut (default: the package data's
    leave-one-source-out validation under the same host assumption)."""
    a = a or predict.Assumptions()
    errors = validate.package_errors(a.host) if errors is None else errors
    opts = predict.layer_options(cal, model, layout, cluster, a)
    rec = recommend(opts, model, layout, fast_link=layout.ep <= cluster.nvlink_domain)
    picks = {
        impl: predict.best(opts, impl)
        for impl in ("megatron", "megatron-1f1b", "mok-1f1b")
        if any(o.impl == impl for o in opts)
    }
    picks["mok"] = rec.layer
    rows = _rows(opts, picks, model, layout, cluster)

    def perturbed(**moves) -> dict:
        d = predict.Perturbation(**moves)
        return _leads(
            _rows(predict.layer_options(cal, model, layout, cluster, a, d), picks, model, layout, cluster)
        )

    comparisons = {}
    for kind, (ours, theirs) in PAIRS.items():
        if ours not in rows:
            continue
        eo, et = (errors.get(k) or validate.HeldOut(validate.TERMS[k].what, 0.0, 0) for k in (ours, theirs))
        fo, ft = ROW_INPUT[ours], ROW_INPUT[theirs]
        worse = perturbed(**{fo: eo.error, ft: -et.error})[kind]  # MoK slower, Megatron faster
        better = perturbed(**{fo: -eo.error, ft: et.error})[kind]
        comparisons[kind] = Comparison(kind, rows[ours], rows[theirs], (worse, better), (eo, et))
    base = _leads(rows)
    sens = []
    for term in INPUTS:
        if term not in errors:
            continue
        e = errors[term].error
        up, down = perturbed(**{term: e}), perturbed(**{term: -e})
        moves = {k: max(abs(up[k] - base[k]), abs(down[k] - base[k])) for k in comparisons}
        sens.append(Sensitivity(term, errors[term], moves))
    sens.sort(key=lambda s: -s.most[1])
    return Headline(tuple(opts), rows, rec, comparisons, tuple(sens))
