"""docs/ARCHITECTURE.md is the map of marft_lg's layers; these tests keep it in step with the code.

- every top-level subpackage and module of `marft_lg/` is named on the page;
- every path it names exists (modules the trace-miner rewrite is creating are let through until they land),
  and so does every class it names in backticks;
- its layer table lists the layers of the import-linter contract in pyproject.toml, in the same order;
- `lint-imports` keeps that contract (skipped where import-linter is not installed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "marft_lg"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# Names the page puts in backticks that are not classes of marft_lg (LangChain types, the OTLP message).
EXTERNAL_CLASSES = {"AIMessage", "Runnable", "ExportTraceServiceRequest"}


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)


def test_the_page_names_every_top_level_module_of_the_package():
    text = _text()
    missing = []
    for entry in sorted(PACKAGE.iterdir()):
        if entry.is_dir() and (entry / "__init__.py").exists():
            if not re.search(rf"(?<![\w.]){re.escape(entry.name)}/", text):
                missing.append(f"{entry.name}/")
        elif (entry.suffix == ".py" and entry.name != "__init__.py"
              and not re.search(rf"(?<![\w.]){re.escape(entry.name)}", text)):
            missing.append(entry.name)
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}: give each its layer on the page"


def test_every_marft_lg_path_on_the_page_exists():
    paths = {m.rstrip(".") for m in re.findall(r"(?<![\w/])marft_lg/[\w./-]*", _text())}
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_file_and_class_named_in_code_spans_exists():
    """Short paths (`graph/remote.py`, `types.py`) must end the path of some module of the package."""
    modules = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")]
    sources = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py"))
    missing = []
    for span in _code_spans(_text()):
        for token in re.findall(r"[\w./-]+\.py\b", span):
            if "<" in span or (ROOT / token).exists() or any(m == token or m.endswith("/" + token) for m in modules):
                continue
            missing.append(token)
        name = span.split("(")[0]
        if (re.fullmatch(r"[A-Z][a-z]+(?:[A-Z][A-Za-z]*)*", name) and name not in EXTERNAL_CLASSES
                and not re.search(rf"^\s*class {name}\b", sources, re.MULTILINE)):
            missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md names modules or classes that do not exist: {sorted(set(missing))}"


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    assert config["root_package"] == "marft_lg"
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers


def test_the_layer_table_matches_the_import_linter_contract():
    contract = _contract()
    assert contract["containers"] == ["marft_lg"] and contract["exhaustive"] is True
    in_contract = [name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer)]
    lines = _text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer | modules |"))
    in_doc = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        in_doc += re.findall(r"`(\w+)`", re.split(r"(?<!\\)\|", line)[2])
    assert in_doc == in_contract
    # every ignored import is a known break: the comment just above it starts "# TODO layer:" and says the fix
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for ignored in contract.get("ignore_imports", []):
        above = pyproject[: pyproject.index(f'"{ignored}"')].rstrip().splitlines()
        comment = []
        while above and above[-1].lstrip().startswith("#"):
            comment.insert(0, above.pop().strip())
        assert comment and comment[0].startswith("# TODO layer:"), f"ignored import without a TODO: {ignored}"


def test_lint_imports_keeps_the_layer_contract():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (it is in the dev extra)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
