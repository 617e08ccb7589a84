"""Every measured figure in README.md and docs/*.md says where it comes from.

A figure with a unit of time or speed, or a ratio (``1.5 minutes``, ``0.18 ms``, ``86.1k spans/s``, ``1.06x``)
is a measurement unless it is a setting or a goal. Its section (heading to heading) must name the results file it is read from
(``serving.json``, any file in benchmarks/results), or the commit it was measured at, or say it is a goal
(target / goal / aim); a setting names itself (default, every, timeout, limit, budget) on its line. So a figure that
nobody can trace back to a run cannot sit in the docs, and tests/unit/test_results_fresh.py then checks that the
results file it names is not older than the code it measures.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FIGURE = re.compile(
    r"(?<![\w.-])(?:~|about )?\d[\d,]*(?:\.\d+)?k?\s?"
    r"(?:ms|s|sec|seconds|min|minutes|h|hours|tok/s|tokens/s|spans/s|episodes/s|requests/s)(?![\w/])"
    r"|(?<![\w.])\d+\.\d+\s?[x×](?![\w])"
)
SOURCE = re.compile(r"\b[\w-]+\.json\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
GOAL = re.compile(r"\b(target|goal|aim|budget)s?\b", re.I)
SETTING = re.compile(r"\b(default|every|timeout|limit|at most|at least|up to|within|after|older than|longer than|per-call|--[a-z-]+)\b", re.I)
CODE = re.compile(r"`[^`]*`")


def sections(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each section (from one heading to the next), fenced code left out."""
    out: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start, fenced = 1, False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            current.append("")
            continue
        if line.startswith("#") and not fenced:
            out.append((start, current))
            current, start = [], n + 1
            continue
        current.append("" if fenced else line)
    out.append((start, current))
    return out


def unsourced(path: Path) -> list[str]:
    """`path:line: figure` for each measured figure whose section names no results file, commit or goal."""
    problems = []
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for start, lines in sections(path.read_text()):
        block = "\n".join(lines)
        named = [m.group(0) for m in SOURCE.finditer(block)]
        if any(n in RESULTS or not n.endswith(".json") for n in named) or GOAL.search(block):
            continue
        for k, line in enumerate(lines):
            plain = CODE.sub("", line)
            if SETTING.search(plain):
                continue
            for m in FIGURE.finditer(plain):
                problems.append(f"{name}:{start + k}: {m.group(0).strip()!r} in {plain.strip()[:90]!r}")
    return problems


def test_every_measured_figure_in_the_docs_names_its_source():
    problems = [p for doc in DOCS for p in unsourced(doc)]
    assert not problems, ("figures with no results file, commit or goal beside them (name the results file, e.g. "
                          "`serving.json`, or the commit it was measured at):\n" + "\n".join(problems))


def test_a_planted_unsourced_figure_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Speed\n\nThe engine serves 123.4 tok/s on this box.\n\n## Measured\n\nFrom `serving.json`: "
                   "1.77x.\n\n## Wanted\n\nThe target is 2.0x.\n")
    found = unsourced(doc)
    assert len(found) == 1 and "123.4 tok/s" in found[0]
