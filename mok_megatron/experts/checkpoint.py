"""Move expert weights between MoK's layout and Megatron's ``SequentialMLP`` / ``TEGroupedMLP`` layouts.

For one MoE layer whose experts live under ``prefix`` (e.g. ``decoder.layers.3.mlp.experts.``):

    mok         {prefix}fc1_weight [L, F1, H]          {prefix}fc2_weight [L, H, F]
    sequential  {prefix}local_experts.{i}.linear_fc1.weight [F1, H]   ... .linear_fc2.weight [H, F]
                (+ ...linear_fc{1,2}._extra_state, None for Megatron's local linears)
    te_grouped  {prefix}linear_fc1.weight{i} [F1, H]   {prefix}linear_fc2.weight{i} [H, F]
                (+ {prefix}linear_fc{1,2}._extra_state, TE's FP8 metadata)

The tensors are the same numbers in every layout (expert i of MoK is slice i), so conversions are
exact in both directions. ``dist_checkpointing`` checkpoints need no conversion at all: all three
modules write identical ShardedTensors.

Plain ``state_dict`` files (``torch.save(model.state_dict())``) convert with ``convert_state_dict``;
``MoKGroupedMLP.load_state_dict`` converts Megatron layouts on the fly.
"""

from __future__ import annotations

import re

import torch

LAYOUTS = ("mok", "sequential", "te_grouped")

_SEQ = re.compile(r"^(?P<p>.*)local_experts\.(?P<i>\d+)\.linear_fc(?P<fc>[12])\.weight$")
_TE = re.compile(r"^(?P<p>.*)linear_fc(?P<fc>[12])\.weight(?P<i>\d+)$")
_MOK = re.compile(r"^(?P<p>.*)fc(?P<fc>[12])_weight$")


def _layout_keys(sd: dict, prefix: str):
    """{layout: {(fc, expert or None): key}} for the expert keys directly under ``prefix``."""
    found: dict[str, dict] = {name: {} for name in LAYOUTS}
    for key in sd:
        if not key.startswith(prefix):
            continue
        for name, rx in (("sequential", _SEQ), ("te_grouped", _TE), ("mok", _MOK)):
            m = rx.match(key)
            if m and m.group("p") == prefix:
                idx = m.groupdict().get("i")
                found[name][(int(m.group("fc")), None if idx is None else int(idx))] = key
    return found


def detect_layout(sd: dict, prefix: str) -> str | None:
    """Which layout the experts under ``prefix`` are in, or None if there are none."""
    found = _layout_keys(sd, prefix)
    present = [name for name in LAYOUTS if found[name]]
    if len(present) > 1:
        raise ValueError(f"experts under {prefix!r} are in several layouts at once: {present}")
    return present[0] if present else None


def expert_prefixes(sd: dict) -> list[str]:
    """Every prefix under which a layer's routed experts live, in any layout."""
    out = set()
    for key in sd:
        for rx in (_SEQ, _TE, _MOK):
            m = rx.match(key)
            if m and (rx is not _MOK or m.group("p").endswith("experts.")):
                out.add(m.group("p"))
    return sorted(out)


def _experts_in(found: dict, layout: str) -> int:
    idx = sorted({i for (_, i) in found[layout]})
    if idx != list(range(len(idx))):
        raise ValueError(f"{layout} expert indices are not 0..n-1: {idx}")
    return len(idx)


def to_mok_layout(sd: dict, prefix: str, num_local_experts: int | None = None) -> None:
    """In place: rewrite Megatron-layout expert weights under ``prefix`` into MoK's stacked layout."""
    layout = detect_layout(sd, prefix)
    if layout in (None, "mok"):
        return
    found = _layout_keys(sd, prefix)[layout]
    n = _experts_in({layout: found}, layout)
    if num_local_experts is not None and n != num_local_experts:
        raise ValueError(
            f"{prefix}: the state dict has {n} experts in the {layout} layout, this MoK layer holds "
            f"{num_local_experts}. Convert a checkpoint saved with the same expert-parallel size, or "
            "use dist_checkpointing, which reshards."
        )
    for fc in (1, 2):
        sd[f"{prefix}fc{fc}_weight"] = torch.stack([sd.pop(found[(fc, i)]) for i in range(n)], 0)
        # Megatron's linears carry an `_extra_state` entry (None for local linears, TE's FP8
        # metadata for TE ones); MoK keeps none.
        if layout == "te_grouped":
            sd.pop(f"{prefix}linear_fc{fc}._extra_state", None)
        else:
            for i in range(n):
                sd.pop(f"{prefix}local_experts.{i}.linear_fc{fc}._extra_state", None)


def from_mok_layout(sd: dict, prefix: str, target: str) -> None:
    """In place: rewrite MoK expert weights under ``prefix`` into ``target`` (sequential/te_grouped)."""
    if target not in ("sequential", "te_grouped"):
        raise ValueError(f"target layout {target!r}: choose 'sequential' or 'te_grouped'")
    for fc in (1, 2):
        stacked = sd.pop(f"{prefix}fc{fc}_weight")
        for i in range(stacked.shape[0]):
            key = (
                f"{prefix}local_experts.{i}.linear_fc{fc}.weight"
                if target == "sequential"
                else f"{prefix}linear_fc{fc}.weight{i}"
            )
            sd[key] = stacked[i].clone()
            if target == "sequential":
                sd[f"{prefix}local_experts.{i}.linear_fc{fc}._extra_state"] = None
        if target == "te_grouped":
            # TE treats an empty extra state as "no FP8 metadata".
            sd[f"{prefix}linear_fc{fc}._extra_state"] = torch.empty(0, dtype=torch.uint8)


def convert_state_dict(sd: dict, target: str) -> dict:
    """Return a copy of a whole-model state dict with every MoE layer's experts in ``target`` layout."""
    if target not in LAYOUTS:
        raise ValueError(f"target layout {target!r}: choose one of {LAYOUTS}")
    out = dict(sd)
    for prefix in expert_prefixes(out):
        layout = detect_layout(out, prefix)
        if layout == target:
            continue
        to_mok_layout(out, prefix)
        if target != "mok":
            from_mok_layout(out, prefix, target)
    return out
