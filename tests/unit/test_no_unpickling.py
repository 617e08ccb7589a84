"""No module of marft_lg unpickles anything: every file it reads is data, never code (a scan of the source)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "marft_lg"

# Calls that can run code from what they read, unless told not to (`torch.load` without weights_only=True,
# numpy.load with allow_pickle=True).
_LOADERS = re.compile(r"\b(?:c?pickle|dill|cloudpickle|joblib|shelve)\.(?:loads?|open)\s*\(|\bUnpickler\s*\(|"
                      r"\bread_pickle\s*\(|\btorch\.load\s*\(|\b(?:np|numpy)\.load\s*\(")

# (path relative to marft_lg, call) pairs that read nothing from disk, with the reason; empty today.
ALLOWED: dict[tuple[str, str], str] = {}


def _call_text(text: str, start: int) -> str:
    """The call starting at `start`, up to its closing parenthesis (bounded)."""
    depth, i = 0, text.index("(", start)
    for j in range(i, min(len(text), i + 2000)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    return text[start:i + 2000]


def unsafe_loads(root: Path = PACKAGE) -> list[str]:
    """`file:line: call` for each load in `root` that could unpickle what it reads."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for m in _LOADERS.finditer(text):
            call = _call_text(text, m.start())
            name = call.split("(", 1)[0].strip()
            if name == "torch.load" and re.search(r"weights_only\s*=\s*True", call):
                continue
            if name in ("np.load", "numpy.load") and not re.search(r"allow_pickle\s*=\s*True", call):
                continue
            if (str(path.relative_to(root)), name) in ALLOWED:
                continue
            found.append(f"{path.relative_to(root.parent)}:{text.count(chr(10), 0, m.start()) + 1}: {call[:120]}")
    return found


def test_the_package_never_loads_a_pickle():
    assert unsafe_loads() == []


def test_the_scan_finds_what_it_looks_for(tmp_path):
    (tmp_path / "bad.py").write_text("import pickle, torch, numpy as np\n"
                                     "a = pickle.loads(b)\nb = pickle.load(fh)\nc = torch.load(p)\n"
                                     "d = torch.load(p,\n    map_location='cpu')\ne = np.load(p, allow_pickle=True)\n")
    (tmp_path / "good.py").write_text("import torch, numpy as np, marshal\n"
                                      "c = torch.load(p, map_location='cpu',\n    weights_only=True)\n"
                                      "e = np.load(p)\nf = marshal.loads(b)\n")
    found = unsafe_loads(tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "3", "4", "5", "7"], found
