"""The `marft-lg ...` command lines in README.md and docs/*.md match the real CLI.

Every command line (in code blocks and in inline code) must name an existing command and only flags that
command has; every command must have a row in README's CLI table, and each row must show all the required
options of the commands it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from marft_lg.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROG = "marft-lg"
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_STRIP = "[](){}<>`'\",.;:!?"


@dataclass
class CommandLine:
    where: str  # file:line
    text: str  # from `marft-lg` on


def _commands() -> dict[tuple[str, ...], object]:
    """Leaf commands by their path, e.g. ("jobs", "list")."""
    out: dict[tuple[str, ...], object] = {}

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, (*path, name))
        else:
            out[path] = cmd

    walk(typer.main.get_command(app), ())
    return out


COMMANDS = _commands()


def _options(cmd) -> tuple[set[str], set[str]]:
    """(every flag of the command, the flags of its required options: one name each, the long one)."""
    flags, required = {"--help"}, set()
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        names = [*p.opts, *p.secondary_opts]
        flags.update(names)
        if p.required:
            required.add(max(p.opts, key=len))
    return flags, required


def _segments(text: str) -> list[str]:
    """The command lines in `text`: each starts at `marft-lg` and ends at the next one, `&&`, `;` or a comment."""
    out = []
    for m in re.finditer(rf"(?<![\w/.-]){re.escape(PROG)}(?![\w-])", text):
        rest = text[m.start():]
        nxt = re.search(rf"\s{re.escape(PROG)}(?![\w-])|&&|;|\s#|\s/\s", rest[len(PROG):])
        seg = (rest[: len(PROG) + nxt.start()] if nxt else rest).strip()
        words = seg.split()
        # `marft-lg` named in prose or as a placeholder (`<marft-lg serve>/v1`) is no command line
        if len(words) == 1 or re.fullmatch(r"[a-z][a-z|-]*", words[1].strip(_STRIP)):
            out.append(seg)
    return out


def command_lines(path: Path) -> list[CommandLine]:
    """Command lines from fenced code blocks (with `\\` continuations joined) and from inline code."""
    lines = path.read_text().splitlines()
    found: list[CommandLine] = []
    in_code, i = False, 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if _FENCE.match(line):
            in_code = not in_code
            i += 1
            continue
        if in_code:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            found += [CommandLine(f"{path.name}:{start}", seg) for seg in _segments(line)]
        else:
            for m in _INLINE.finditer(line):
                code = m.group(1).replace("\\|", "|")
                found += [CommandLine(f"{path.name}:{start}", seg) for seg in _segments(code)]
        i += 1
    return found


def resolve(text: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """[(command path, the flags named)]; `jobs list|show` gives one entry per alternative."""
    words = [w.strip(_STRIP) for w in text.split()[1:]]
    paths: list[tuple[str, ...]] = [()]
    k = 0
    while k < len(words):
        word = words[k]
        options = word.split("|")
        nexts = [(*p, o) for p in paths for o in options
                 if any(c[: len(p) + 1] == (*p, o) for c in COMMANDS)]
        if not nexts or word.startswith("-"):
            break
        paths, k = nexts, k + 1
    flags = []
    for w in words[k:]:
        for part in w.split("|"):
            part = part.strip(_STRIP)
            if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", part):
                flags.append(part.split("=", 1)[0])
    return [(p, flags) for p in paths]


def _all_lines() -> list[CommandLine]:
    return [c for doc in DOCS for c in command_lines(doc)]


def test_the_parser_sees_the_command_lines():
    lines = _all_lines()
    assert len(lines) > 20
    assert resolve("marft-lg jobs list|show --job J") == [(("jobs", "list"), ["--job"]), (("jobs", "show"), ["--job"])]
    assert resolve("marft-lg compare --app x.py:f [--node-roles a=b] (--from-traces DIR)") == [
        (("compare",), ["--app", "--node-roles", "--from-traces"])]
    assert _segments("marft-lg retrain --job j.yaml; marft-lg jobs list  # list") == [
        "marft-lg retrain --job j.yaml", "marft-lg jobs list"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_line_names_a_command_and_only_its_flags(doc):
    problems = []
    for line in command_lines(doc):
        if line.text.split() == [PROG]:
            continue  # the program itself, e.g. "the `marft-lg` command"
        for path, flags in resolve(line.text):
            if path not in COMMANDS:
                problems.append(f"{line.where}: {line.text!r}: no such command {' '.join((PROG, *path))!r}")
                continue
            known, _ = _options(COMMANDS[path])
            for flag in flags:
                if flag not in known:
                    problems.append(f"{line.where}: {line.text!r}: {' '.join((PROG, *path))} has no option {flag}")
    assert not problems, "\n".join(problems)


def readme_cli_rows() -> list[tuple[str, str]]:
    """(where, first cell) of each row of the table under README's `## CLI` heading."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## CLI")
    rows = []
    for n, line in enumerate(lines[start + 1:], start=start + 2):
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"^\|\s*(command|-+)\s*\|", line):
            cells = re.split(r"(?<!\\)\|", line)
            rows.append((f"README.md:{n}", cells[1]))
    return rows


def test_readme_cli_table_shows_every_command_with_its_required_options():
    rows = readme_cli_rows()
    assert rows
    covered: set[tuple[str, ...]] = set()
    problems = []
    for where, cell in rows:
        # a row's cell may hold several commands (`a` / `b`); a code span without `marft-lg` continues the last one
        per_command: list[tuple[tuple[str, ...], set[str]]] = []
        for m in _INLINE.finditer(cell):
            code = m.group(1).replace("\\|", "|")
            segments = _segments(code)
            if not segments and per_command:
                per_command[-1][1].update(f for _, fl in resolve(f"{PROG} {' '.join(per_command[-1][0])} {code}")
                                          for f in fl)
            for seg in segments:
                for path, flags in resolve(seg):
                    per_command.append((path, set(flags)))
        for path, flags in per_command:
            if path not in COMMANDS:
                problems.append(f"{where}: unknown command {' '.join((PROG, *path))!r}")
                continue
            covered.add(path)
            _, required = _options(COMMANDS[path])
            missing = sorted(required - flags)
            if missing:
                problems.append(f"{where}: {' '.join((PROG, *path))} requires {missing}, not shown in the row")
    for path in sorted(set(COMMANDS) - covered):
        problems.append(f"README.md CLI table: no row for {' '.join((PROG, *path))}")
    assert not problems, "\n".join(problems)


# Options that are optional one by one but of which a command needs one: each entry is proved against the real
# command below (it fails without them), and every README row naming the command must show one of them (a compare of
# mirrored traffic, `--from-traces`, replays nothing and needs no team).
UNLESS = {("compare",): "--from-traces"}
NEEDS_ONE_OF: dict[tuple[str, ...], tuple[set[str], list[str]]] = {
    ("jobs", "list"): ({"--job", "--store"}, []),
    ("jobs", "show"): ({"--job", "--store"}, ["RUN-1"]),
    ("compare",): ({"--registry", "--agents"}, ["--reward", "{reward}", "--scenarios", "{scenarios}",
                                              "--app", "app.py:build", "--out", "{out}"]),
    ("score",): ({"--out"}, ["{dataset}", "--reward", "{reward}"]),
}


@pytest.mark.parametrize("path", sorted(NEEDS_ONE_OF), ids=" ".join)
def test_needed_options_are_needed_by_the_real_command(path, tmp_path):
    from typer.testing import CliRunner

    flags, args = NEEDS_ONE_OF[path]
    (tmp_path / "d").mkdir()
    values = {"reward": str(ROOT / "examples" / "mixed_team" / "reward.yaml"),
              "scenarios": str(ROOT / "examples" / "mixed_team" / "scenarios.jsonl"),
              "out": str(tmp_path / "out"), "dataset": str(tmp_path / "d")}
    result = CliRunner().invoke(app, [*path, *[a.format(**values) for a in args]])
    assert result.exit_code != 0, f"{' '.join(path)} ran without any of {sorted(flags)}"
    said = result.output + str(result.exception or "")
    assert any(f in said for f in flags), said


def test_readme_rows_show_the_options_a_command_needs():
    problems = []
    for where, cell in readme_cli_rows():
        for m in _INLINE.finditer(cell):
            for seg in _segments(m.group(1).replace("\\|", "|")):
                for path, named in resolve(seg):
                    need = NEEDS_ONE_OF.get(path, (set(), []))[0]
                    if need and not need & set(named) and UNLESS.get(path) not in named:
                        problems.append(f"{where}: {' '.join((PROG, *path))} needs one of {sorted(need)}")
    assert not problems, "\n".join(problems)
