"""``mok patches check|apply|revert DIR``: the Megatron-LM patch set (``training/megatron_lm_patches/``, shipped in the wheel) for a Megatron-LM tree.

The patches make stock Megatron-LM (at ``PINNED_COMMIT``) accept ``--moe-token-dispatcher-type mok``
and the ``--mok-*`` flags:

    megatron/training/arguments.py  every parser Megatron builds gets mok_megatron.training.arguments'
                                    flags (also shipped by the megatron-core wheel: the same patch
                                    applies to an installed ``site-packages`` tree)
    pretrain_gpt.py                 ``use_mok(args, model_cfg)``: MoK layer spec, config check, options
    gpt_builders.py                 ``gpt_builder`` (RL / legacy builders) mokifies the layer and MTP specs

Every file is recognised by content, not by git: its SHA-256 is that of the pinned original
(``pristine``), of the patched file (``applied``), or neither (``unknown``). ``apply`` and ``revert``
refuse a tree with any unknown file, change nothing until every file checks, are idempotent, and
verify each result's hash. ``files`` restricts the set (e.g. the wheel ships only arguments.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent / "megatron_lm_patches"
PRISTINE, APPLIED, UNKNOWN, MISSING = "pristine", "applied", "unknown", "missing"


class PatchError(RuntimeError):
    """A tree the patch set cannot be applied to or reverted from; the message says why and what to do."""


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the Megatron-LM root
    patch: str  # file name in PATCH_DIR
    sha256_original: str
    sha256_patched: str


@dataclass(frozen=True)
class Manifest:
    upstream: str
    commit: str
    files: tuple[FilePatch, ...]

    @staticmethod
    def load(patch_dir: Path = PATCH_DIR) -> Manifest:
        raw = json.loads((patch_dir / "manifest.json").read_text())
        return Manifest(raw["upstream"], raw["commit"], tuple(FilePatch(**f) for f in raw["files"]))

    def select(self, files: list[str] | None) -> tuple[FilePatch, ...]:
        if not files:
            return self.files
        known = {f.path: f for f in self.files}
        bad = [f for f in files if f not in known]
        if bad:
            raise PatchError(f"no patch for {bad}; the patch set covers {sorted(known)}.")
        return tuple(known[f] for f in files)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- unified diffs --------------------------------------------------------------------------------

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _hunks(diff_text: str) -> list[tuple[int, list[str]]]:
    """(old start line, body lines with their ' '/'-'/'+' prefix) for each hunk."""
    hunks: list[tuple[int, list[str]]] = []
    for line in diff_text.splitlines(keepends=True):
        m = _HUNK.match(line)
        if m:
            hunks.append((int(m.group(1)), []))
        elif hunks and line[:1] in (" ", "-", "+"):
            hunks[-1][1].append(line)
        elif hunks and line.startswith("\\"):
            continue  # "\ No newline at end of file"
    return hunks


def apply_diff(text: str, diff_text: str, reverse: bool = False) -> str:
    """Apply a unified diff (``reverse``: undo it). Hunks are placed by exact context, in order; the
    caller has checked the base by hash and checks the result by hash."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for _start, body in _hunks(diff_text):
        if reverse:
            body = [{"+": "-", "-": "+"}.get(b[0], " ") + b[1:] for b in body]
        old = [b[1:] for b in body if b[0] in (" ", "-")]
        new = [b[1:] for b in body if b[0] in (" ", "+")]
        at = _find(lines, old, pos)
        out.extend(lines[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(lines[pos:])
    return "".join(out)


def _find(lines: list[str], block: list[str], start: int) -> int:
    for i in range(start, len(lines) - len(block) + 1):
        if lines[i : i + len(block)] == block:
            return i
    raise PatchError("a hunk's context does not match the file (the patch set is corrupt).")


# ---- trees ----------------------------------------------------------------------------------------


def status(root: str | Path, files: list[str] | None = None, manifest: Manifest | None = None) -> dict:
    """{path: pristine | applied | unknown | missing} for the selected files under ``root``."""
    m = manifest or Manifest.load()
    root = Path(root)
    out = {}
    for f in m.select(files):
        p = root / f.path
        if not p.is_file():
            out[f.path] = MISSING
            continue
        h = _sha(p.read_bytes())
        out[f.path] = {f.sha256_original: PRISTINE, f.sha256_patched: APPLIED}.get(h, UNKNOWN)
    return out


def _git_head(root: Path) -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _refuse_bad(root: Path, st: dict, m: Manifest) -> None:
    bad = {p: s for p, s in st.items() if s in (UNKNOWN, MISSING)}
    if not bad:
        return
    head = _git_head(root)
    where = f" (git HEAD {head[:12]})" if head else ""
    lines = [f"  {p}: {s}" for p, s in bad.items()]
    raise PatchError(
        f"{root}{where} is not a Megatron-LM tree this patch set knows:\n"
        + "\n".join(lines)
        + f"\nThe patches are for {m.upstream} at commit {m.commit}. 'unknown' = the file differs from "
        "both that commit and the patched version (local edits or another commit): commit or stash "
        f"them, or check out {m.commit[:12]} (git -C {root} checkout {m.commit[:12]} -- <file>). "
        "'missing' = not a Megatron-LM root; pass the directory holding pretrain_gpt.py, or "
        "--files for a partial tree (e.g. an installed megatron-core)."
    )


def _transition(root, files, frm: str, to: str, reverse: bool, manifest: Manifest | None) -> list[str]:
    m = manifest or Manifest.load()
    root = Path(root)
    st = status(root, files, m)
    _refuse_bad(root, st, m)
    todo = [f for f in m.select(files) if st[f.path] == frm]
    results = {}
    for f in todo:  # compute everything first: change nothing unless every file works
        diff = (PATCH_DIR / f.patch).read_text()
        new = apply_diff((root / f.path).read_text(), diff, reverse=reverse)
        want = f.sha256_original if reverse else f.sha256_patched
        if _sha(new.encode()) != want:
            raise PatchError(f"{f.path}: the result does not match the expected {to} file; nothing changed.")
        results[f.path] = new
    for path, text in results.items():
        (root / path).write_text(text)
    return sorted(results)


def apply(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Patch the pristine files; already-applied ones are left alone. Returns the files changed."""
    return _transition(root, files, PRISTINE, APPLIED, reverse=False, manifest=manifest)


def revert(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Restore the patched files to the pinned originals. Returns the files changed."""
    return _transition(root, files, APPLIED, PRISTINE, reverse=True, manifest=manifest)


def main(argv: list[str]) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="mok patches",
        description="Make a Megatron-LM checkout accept --moe-token-dispatcher-type mok and --mok-* flags.",
    )
    p.add_argument("action", choices=("check", "apply", "revert"))
    p.add_argument("megatron_lm_dir")
    p.add_argument(
        "--files",
        nargs="+",
        default=None,
        help="only these files (relative paths), e.g. megatron/training/arguments.py for an installed "
        "megatron-core (site-packages)",
    )
    ns = p.parse_args(argv)
    m = Manifest.load()
    try:
        if ns.action == "check":
            st = status(ns.megatron_lm_dir, ns.files, m)
            for path, s in st.items():
                print(f"{s:>9}  {path}")
            _refuse_bad(Path(ns.megatron_lm_dir), st, m)
            print(f"patch set for {m.upstream} @ {m.commit[:12]}: ok")
            return 0
        fn = apply if ns.action == "apply" else revert
        changed = fn(ns.megatron_lm_dir, ns.files, m)
        verb = "patched" if ns.action == "apply" else "reverted"
        print(f"{verb}: {', '.join(changed)}" if changed else f"nothing to do: already {verb}")
        return 0
    except PatchError as e:
        print(f"mok patches {ns.action}: {e}", file=sys.stderr)
        return 1
