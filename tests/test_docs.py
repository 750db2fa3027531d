"""The user-facing docs stay true to the code: README size, its flags table against argparse, relative links,
and no development history in product text.

Legend: ROOT the repository root; DOCS the Markdown files checked (README.md, docs/*.md and the README of
every results folder and measurement below it, docs/results/**/README.md; raw result data is not product
text).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 10_240
DOCS = sorted([README, *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "results").rglob("README.md")])

# Words that tell the project's own history (work periods, run ids, issue numbers, engine generations).
# The first alternative is spelled in two pieces so that this file does not match its own pattern.
HISTORY = re.compile(
    "sess" + r"ion|\bs[0-9]{1,2}[a-z]\b|\brun[0-9]+\b|engine-[0-9]|issue #?[0-9]", re.IGNORECASE
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"--(?:no-)?mok-[a-z0-9-]+")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _mok_actions() -> dict[str, argparse.Action]:
    """Every option string ``add_mok_flags`` defines -> its argparse action."""
    from mok_megatron.training.arguments import add_mok_flags

    parser = argparse.ArgumentParser()
    add_mok_flags(parser)
    return {s: a for a in parser._actions for s in a.option_strings if FLAG.fullmatch(s)}


def _flags_table() -> list[list[str]]:
    """The rows (cells) of the first table under README's '## Flags' heading, header excluded."""
    text = README.read_text()
    m = re.search(r"^## Flags\s*$(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert m, "README.md has no '## Flags' section"
    rows = [line for line in m.group(1).splitlines() if line.startswith("|")]
    assert len(rows) > 2, "README.md '## Flags' has no table"
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def _default_text(default) -> str:
    """How the README's flags table writes an argparse default."""
    if default is None:
        return "automatic"
    if default is False:
        return "off"
    if default is True:
        return "on"
    return str(default)


def test_readme_fits_its_budget():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over the {README_MAX_BYTES}-byte budget: move detail to docs/design.md "
        "or docs/performance.md and link it."
    )


def test_readme_flags_table_is_the_generated_one():
    """The table is what ``python -m mok_megatron.training.arguments --markdown`` prints from the
    ``MoKOptions`` fields; regenerate it there when a field's flag changes."""
    import subprocess
    import sys

    printed = subprocess.run(
        [sys.executable, "-m", "mok_megatron.training.arguments", "--markdown"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    section = re.search(r"^## Flags\s*$(.*?)(?=^## )", README.read_text(), re.MULTILINE | re.DOTALL).group(1)
    table = "\n".join(line for line in section.splitlines() if line.startswith("|")) + "\n"
    assert table == printed, (
        "README.md's flags table differs from the generated one; replace it with the output of "
        "`python -m mok_megatron.training.arguments --markdown`"
    )


def test_license_is_the_apache_2_0_text_pyproject_declares():
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    head = [ln.strip() for ln in text.splitlines() if ln.strip()][:3]
    assert head == ["Apache License", "Version 2.0, January 2004", "http://www.apache.org/licenses/"], head
    for clause in ("1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                   "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert clause in text, clause


def test_readme_flags_table_matches_argparse():
    from mok_megatron.options import flag_fields, flag_name

    written = {flag_name(f.name): flag.default_text for f, flag in flag_fields()}
    actions = _mok_actions()
    named: dict[str, list[str]] = {}
    for cells in _flags_table():
        for flag in FLAG.findall(cells[0]):
            named[flag] = cells
    missing = sorted(set(actions) - set(named))
    unknown = sorted(set(named) - set(actions))
    assert not missing, f"README.md flags table lacks {missing}, defined by training/arguments.add_mok_flags"
    assert not unknown, f"README.md flags table names {unknown}, which add_mok_flags does not define"
    for flag, cells in named.items():
        action = actions[flag]
        want = _default_text(action.default)
        if action.default is None and written.get(flag):
            want = written[flag]  # a default computed at run time, as its Flag words it
        assert cells[-1] == want, (
            f"README.md flags table: {flag} default is {cells[-1]!r}, argparse says {want!r}; "
            "fix the field's Flag in options.py (the source of argparse and the table)"
        )
        listed = re.search(r"\{([^}]*)\}", cells[0])
        if action.choices is not None:
            choices = [str(c) for c in action.choices]
            assert listed and listed.group(1).split(",") == choices, (
                f"README.md flags table: {flag} lists {listed.group(0) if listed else 'no choices'}, "
                f"argparse's are {{{','.join(choices)}}}"
            )


# A mok command to type: a shell line of a code block, or a row of a table of commands.
MOK_COMMAND = re.compile(r"^(?:mok|\| `mok) (?:env|demo|bench|convert|patches|recipe|plan)\b", re.MULTILINE)


GUIDES = [d for d in (README, *sorted((ROOT / "docs").glob("*.md"))) if MOK_COMMAND.search(d.read_text())]


@pytest.mark.parametrize("doc", GUIDES, ids=_rel)
def test_mok_commands_say_how_a_run_checkout_reaches_them(doc):
    """``./run`` installs ``mok`` into ``.venv`` without activating it, so a bare ``mok ...`` there is
    ``command not found``: before its first ``mok`` command to type, a guide says ``./run mok`` and how to
    activate."""
    text = doc.read_text()
    first = MOK_COMMAND.search(text)
    before = text[: first.start()]
    assert "./run mok" in before and "source .venv/bin/activate" in before, (
        f"{_rel(doc)}: the first bare command {first.group(0)!r} comes before any `./run mok` / "
        "`source .venv/bin/activate`"
    )


def test_readme_names_every_spec():
    """Every module-level spec ``--spec mok_megatron.spec <name>`` loads is named in the README."""
    import ast

    tree = ast.parse((ROOT / "mok_megatron" / "spec.py").read_text())
    names = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SPEC_NAMES" for t in node.targets)
    )
    text = README.read_text()
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"README.md does not name the specs {missing} (mok_megatron/spec.py SPEC_NAMES)"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", md.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=_rel)
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading with anchor #{anchor} in {_rel(dest)})")
    assert not bad, f"{_rel(doc)}: broken relative links: " + ", ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_history_in_product_text(doc):
    hits = [
        f"{_rel(doc)}:{n}: {line.strip()[:100]}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, (
        "Product text tells the project's history (work periods, run ids, issue numbers, engine "
        "generations); say what the design is and the measured reason instead:\n" + "\n".join(hits[:20])
    )


def _perf_table_row(first_cell: str, second_starts: str = "") -> list[str]:
    """The cells after the first of docs/performance.md's table row whose first cell is ``first_cell`` (and
    whose second starts with ``second_starts``)."""
    for line in (ROOT / "docs" / "performance.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell and cells[1].startswith(second_starts):
            return cells[1:]
    raise AssertionError(f"docs/performance.md has no table row {first_cell!r} | {second_starts!r}")


def _gbps(rows: list[str]) -> str:
    """'lo-hi' GB/s over the 'dispatch / combine' cells of performance.md's NVLink table rows."""
    vals = [float(v) for r in rows for cell in _perf_table_row(r) for v in cell.split(" / ")]
    return f"{round(min(vals))}-{round(max(vals))}"


def test_readme_headline_numbers_are_performance_md_s():
    """README's NVLink row and its loopback hiding figure are computed from docs/performance.md's tables."""
    readme = README.read_text()
    barriers = _gbps(
        [
            "nvlink, 64 programs (default), with the device barriers",
            "nvlink, 128 programs, with the device barriers",
        ]
    )
    kernels = _gbps(["nvlink kernels alone, 64 programs"])
    nccl = _gbps(["NCCL `all_to_all_single`"])
    row = next(line for line in readme.splitlines() if line.startswith("| NVLink"))
    assert f"{barriers} GB/s" in row, row
    assert f"kernels alone {kernels} GB/s at the default 64 programs" in row, row
    assert f"NCCL all-to-all {nccl} GB/s" in row, row
    exposed = _perf_table_row("DeepSeek 4k", "900 GB/s")[1:3]  # "ms, exposed %": copies, link time only
    copies, ideal = (int(c.split(", ")[1].rstrip(" %")) for c in exposed)
    hidden = re.search(r"hides (\d+) %\s+\(with the emulated copies\) to (\d+) % \(link time only\)", readme)
    assert hidden and (int(hidden[1]), int(hidden[2])) == (100 - copies, 100 - ideal), hidden
