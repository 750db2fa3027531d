"""``mok patches check|apply|revert DIR``: the Megatron-LM patch set for a Megatron-LM tree. Its one source
is the repository's ``patches/``; the wheel ships it as ``mok_megatron/patches/`` (pyproject's package-dir).

The patches make stock Megatron-LM (at the commit pinned in ``manifest.json``) accept
``--moe-token-dispatcher-type mok`` and the ``--mok-*`` flags:

    megatron/training/arguments.py  every parser Megatron builds gets mok_megatron.training.arguments'
                                    flags (also shipped by the megatron-core wheel: the same patch
                                    applies to an installed ``site-packages`` tree)
    pretrain_gpt.py                 ``use_mok(args, model_cfg)``: MoK layer spec, config check, options
    gpt_builders.py                 ``gpt_builder`` (RL / legacy builders) mokifies the layer and MTP specs

Every file is recognised by content, not by git: its SHA-256 is that of the pinned original
(``pristine``), of the patched file (``applied``), of a file patched by an earlier mok-megatron
(``earlier``: restore the pinned file, then apply), or none of them (``unknown``). ``apply`` and
``revert`` refuse a tree with any earlier, unknown or missing file, change nothing until every file checks,
are idempotent, and verify each result's hash. ``files`` restricts the set (e.g. the wheel ships only
arguments.py). Messages describe the target tree only; git advice is given only where the target is
itself a git checkout.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


def _find_patch_dir() -> Path:
    """The wheel's copy (``mok_megatron/patches/``), else the checkout's ``patches/`` beside the package."""
    package = Path(__file__).resolve().parent.parent
    for d in (package / "patches", package.parent / "patches"):
        if (d / "manifest.json").is_file():
            return d
    return package / "patches"


PATCH_DIR = _find_patch_dir()
PRISTINE, APPLIED, EARLIER, UNKNOWN, MISSING = "pristine", "applied", "earlier", "unknown", "missing"


class PatchError(RuntimeError):
    """A tree the patch set cannot be applied to or reverted from; the message says why and what to do."""


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the Megatron-LM root
    patch: str  # file name in the patch directory
    sha256_original: str
    sha256_patched: str
    earlier_sha256_patched: tuple[str, ...] = ()  # the file as an earlier mok-megatron patched it


@dataclass(frozen=True)
class Manifest:
    upstream: str
    commit: str
    files: tuple[FilePatch, ...]
    patch_dir: Path = field(default=PATCH_DIR)

    @staticmethod
    def load(patch_dir: Path = PATCH_DIR) -> Manifest:
        path = patch_dir / "manifest.json"
        if not path.is_file():
            raise PatchError(
                f"{path} not found: the patch set ships in the wheel (mok_megatron/patches/) and lives in "
                "the repository's patches/; reinstall mok-megatron."
            )
        raw = json.loads(path.read_text())
        files = tuple(
            FilePatch(**{**f, "earlier_sha256_patched": tuple(f.get("earlier_sha256_patched", ()))})
            for f in raw["files"]
        )
        return Manifest(raw["upstream"], raw["commit"], files, patch_dir)

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
    return EARLIER if sha in f.earlier_sha256_patched else UNKNOWN


def status(root: str | Path, files: list[str] | None = None, manifest: Manifest | None = None) -> dict:
    """{path: pristine | applied | earlier | unknown | missing} for the selected files under ``root``."""
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


def git_head(root: Path) -> str | None:
    """HEAD of the git checkout whose top level is ``root``; None where ``root`` is not one (a site-packages
    directory, or any folder inside another repository: that repository's state is not the tree's)."""
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.split()
    if r.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return None
    return lines[1]


def _restore_hint(root: Path, path: str, m: Manifest, head: str | None) -> str:
    if head:
        return f"git -C {root} checkout {m.commit[:12]} -- {path}"
    return f"replace it with {m.upstream}/blob/{m.commit}/{path} (or reinstall the package that holds it)"


def _refuse_bad(root: Path, st: dict, m: Manifest) -> None:
    bad = {p: s for p, s in st.items() if s in (EARLIER, UNKNOWN, MISSING)}
    if not bad:
        return
    head = git_head(root)
    earlier = [
        f"{p}: patched by an earlier mok-megatron; restore it ({_restore_hint(root, p, m, head)}), then run "
        f"'mok patches apply {root}'."
        for p, s in bad.items()
        if s == EARLIER
    ]
    other = {p: s for p, s in bad.items() if s != EARLIER}
    if not other:
        raise PatchError("\n".join(earlier))
    where = f" (git HEAD {head[:12]})" if head else " (not a git checkout)"
    lines = [f"  {p}: {s}" for p, s in other.items()]
    restore = (
        f"restore the pinned file (git -C {root} checkout {m.commit[:12]} -- <file>)"
        if head
        else f"replace it with that commit's copy ({m.upstream}/blob/{m.commit}/<file>) or reinstall the "
        "package that holds it"
    )
    raise PatchError(
        f"{root}{where} is not a Megatron-LM tree this patch set knows:\n"
        + "\n".join([f"  {e}" for e in earlier] + lines)
        + f"\nThe patches are for {m.upstream} at commit {m.commit}. 'unknown' = the file's content is "
        "neither that commit's nor the patched one (files are recognised by content, so local edits or "
        f"another Megatron-LM commit): {restore}, or make the change by hand from the patch files in "
        f"{m.patch_dir}. 'missing' = not a Megatron-LM root; pass the directory holding pretrain_gpt.py, or "
        "--files for a partial tree (e.g. an installed megatron-core)."
    )


def _to_pristine(f: FilePatch, text: str, state: str, m: Manifest) -> str:
    """The pinned original of a patched file's text, hash-checked."""
    if state == PRISTINE:
        return text
    out = apply_diff(text, (m.patch_dir / f.patch).read_text(), reverse=True)
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
        text = _to_pristine(f, (root / f.path).read_text(), st[f.path], m)
        if to == APPLIED:
            text = apply_diff(text, (m.patch_dir / f.patch).read_text())
            if _sha(text.encode()) != f.sha256_patched:
                raise PatchError(
                    f"{f.path}: the result does not match the expected patched file; nothing changed."
                )
        results[f.path] = text
    for path, text in results.items():
        (root / path).write_text(text)
    return sorted(results)


def apply(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Patch the pristine files; applied ones are left alone. Returns the files changed."""
    return _transition(root, files, APPLIED, manifest)


def revert(root, files: list[str] | None = None, manifest: Manifest | None = None) -> list[str]:
    """Restore the patched files to the pinned originals. Returns the files changed."""
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
    try:
        m = Manifest.load()
        if ns.action == "check":
            st = status(ns.megatron_lm_dir, ns.files, m)
            for path, s in st.items():
                print(f"{s:>10}  {path}")
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
