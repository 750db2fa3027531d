"""``mok patches check|apply|revert DIR``: the Megatron-LM patch set (``training/megatron_lm_patches/``, shipped in the wheel) for a Megatron-LM tree.

The patches make stock Megatron-LM (at ``PINNED_COMMIT``) accept ``--moe-token-dispatcher-type mok``
and the ``--mok-*`` flags:

    megatron/training/arguments.py  every parser Megatron builds gets mok_megatron.training.arguments'
                                    flags (also shipped by the megatron-core wheel: the same patch
                                    applies to an installed ``site-packages`` tree)
    pretrain_gpt.py                 ``use_mok(args, model_cfg)``: MoK layer spec, config check, options
    gpt_builders.py                 ``gpt_builder`` (RL / legacy builders) mokifies the layer and MTP specs

Every file is recognised by content, not by git: its SHA-256 is that of the pinned original
(``pristine``), of the patched file (``applied``), of a file patched by an earlier mok-megatron
(``superseded``: ``apply`` updates it, ``check`` says so), or none of them (``unknown``). ``apply`` and
``revert`` refuse a tree with any unknown file, change nothing until every file checks, are idempotent,
and verify each result's hash. ``files`` restricts the set (e.g. the wheel ships only arguments.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent / "megatron_lm_patches"
PRISTINE, APPLIED, SUPERSEDED, UNKNOWN, MISSING = "pristine", "applied", "superseded", "unknown", "missing"


class PatchError(RuntimeError):
    """A tree the patch set cannot be applied to or reverted from; the message says why and what to do."""


@dataclass(frozen=True)
class Superseded:
    """A patch an earlier mok-megatron applied to the same file, and the hash of that patched file."""

    patch: str
    sha256_patched: str


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the Megatron-LM root
    patch: str  # file name in PATCH_DIR
    sha256_original: str
    sha256_patched: str
    superseded: tuple[Superseded, ...] = ()

    def superseded_by_hash(self, sha: str) -> Superseded | None:
        return next((o for o in self.superseded if o.sha256_patched == sha), None)


@dataclass(frozen=True)
class Manifest:
    upstream: str
    commit: str
    files: tuple[FilePatch, ...]

    @staticmethod
    def load(patch_dir: Path = PATCH_DIR) -> Manifest:
        raw = json.loads((patch_dir / "manifest.json").read_text())
        files = tuple(
            FilePatch(**{**f, "superseded": tuple(Superseded(**o) for o in f.get("superseded", ()))})
            for f in raw["files"]
        )
        return Manifest(raw["upstream"], raw["commit"], files)

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


def _state(f: FilePatch, sha: str) -> str:
    if sha == f.sha256_original:
        return PRISTINE
    if sha == f.sha256_patched:
        return APPLIED
    return SUPERSEDED if f.superseded_by_hash(sha) else UNKNOWN


def status(root: str | Path, files: list[str] | None = None, manifest: Manifest | None = None) -> dict:
    """{path: pristine | applied | superseded | unknown | missing} for the selected files under ``root``."""
    m = manifest or Manifest.load()
    root = Path(root)
    if not root.is_dir():
        raise PatchError(
            f"{root} does not exist or is not a directory. Pass the Megatron-LM checkout's root (the "
            "directory holding pretrain_gpt.py), or --files megatron/training/arguments.py with the "
            "site-packages directory of an installed megatron-core."
        )
    out = {}
    for f in m.select(files):
        p = root / f.path
        out[f.path] = _state(f, _sha(p.read_bytes())) if p.is_file() else MISSING
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
        + f"\nThe patches are for {m.upstream} at commit {m.commit}. 'unknown' = the file's content is "
        "neither that commit's nor the patched one (files are recognised by content, so local edits or "
        f"another Megatron-LM commit): restore the pinned file (git -C {root} checkout {m.commit[:12]} -- "
        f"<file>), or make the change by hand from the patch files in {PATCH_DIR}. 'missing' = not a "
        "Megatron-LM root; pass the directory holding pretrain_gpt.py, or --files for a partial tree "
        "(e.g. an installed megatron-core)."
    )


def _to_pristine(f: FilePatch, text: str, state: str) -> str:
    """The pinned original of a patched (or superseded-patched) file's text, hash-checked."""
    if state == PRISTINE:
        return text
    patch = f.patch if state == APPLIED else f.superseded_by_hash(_sha(text.encode())).patch
    out = apply_diff(text, (PATCH_DIR / patch).read_text(), reverse=True)
    if _sha(out.encode()) != f.sha256_original:
        raise PatchError(f"{f.path}: reverting it does not give the pinned original; nothing changed.")
    return out


def _transition(root, files, to: str, manifest: Manifest | None) -> list[str]:
    m = manifest or Manifest.load()
    root = Path(root)
    st = status(root, files, m)
    _refuse_bad(root, st, m)
    results = {}
    for f in m.select(files):  # compute everything first: change nothing unless every file works
        if st[f.path] == to:
            continue
        text = _to_pristine(f, (root / f.path).read_text(), st[f.path])
        if to == APPLIED:
            text = apply_diff(text, (PATCH_DIR / f.patch).read_text())
            if _sha(text.encode()) != f.sha256_patched:
                raise PatchError(
                    f"{f.path}: the result does not match the expected patched file; nothing changed."
                )
        results[f.path] = text
    for path, text in results.items():
        (root / path).write_text(text)
    return sorted(results)


def apply(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Patch the pristine files and update those an earlier mok-megatron patched; applied ones are left
    alone. Returns the files changed."""
    return _transition(root, files, APPLIED, manifest)


def revert(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Restore the patched files (this patch set's or an earlier one's) to the pinned originals. Returns
    the files changed."""
    return _transition(root, files, PRISTINE, manifest)


def main(argv: list[str]) -> int:
    import argparse

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
                print(f"{s:>10}  {path}")
            _refuse_bad(Path(ns.megatron_lm_dir), st, m)
            old = [path for path, s in st.items() if s == SUPERSEDED]
            if old:
                print(
                    f"mok patches check: {', '.join(old)} carry an earlier mok-megatron's patch; run "
                    f"'mok patches apply {ns.megatron_lm_dir}' to update them.",
                    file=sys.stderr,
                )
                return 1
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
