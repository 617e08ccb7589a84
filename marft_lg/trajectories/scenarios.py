"""Scenarios: frozen inputs plus the checks a reward needs (reference answer, expected tools, checkpoints)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from marft_lg._durable import write_atomic


@dataclass
class Scenario:
    """One task the team is run on.

    `inputs` is what the graph is invoked with; `reference`, `expected_tools` and `checkpoints`
    are what reward components check against; `split` tells train from held-out.
    """

    scenario_id: str
    inputs: dict[str, Any]
    reference: Any = None
    expected_tools: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    split: str = "train"
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScenarioSet:
    """An ordered, frozen set of scenarios; JSONL or parquet on disk."""

    def __init__(self, scenarios: Iterable[Scenario]):
        self._items = list(scenarios)
        ids = [s.scenario_id for s in self._items]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate scenario ids: {sorted(dup)}")

    def __iter__(self) -> Iterator[Scenario]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Scenario:
        return self._items[i]

    def by_id(self) -> dict[str, dict[str, Any]]:
        """Scenario id -> plain dict, the shape reward components receive."""
        return {s.scenario_id: s.to_dict() for s in self._items}

    def split(self, name: str) -> ScenarioSet:
        return ScenarioSet(s for s in self._items if s.split == name)

    def save(self, path: str | Path) -> None:
        """Write JSONL (or parquet when the suffix is .parquet), atomically."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".parquet":
            import io

            import pandas as pd

            buf = io.BytesIO()
            pd.DataFrame([{**s.to_dict(), "inputs": json.dumps(s.inputs), "reference": json.dumps(s.reference),
                           "meta": json.dumps(s.meta)} for s in self._items]).to_parquet(buf, index=False)
            write_atomic(p, buf.getvalue())
        else:
            write_atomic(p, "".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in self._items))

    @classmethod
    def load(cls, path: str | Path) -> ScenarioSet:
        """Read JSONL or parquet; a bad line raises with file:line and what is wrong."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"scenario file {p} does not exist")
        items: list[Scenario] = []
        if p.suffix == ".parquet":
            import pandas as pd

            for row in pd.read_parquet(p).to_dict("records"):
                row["inputs"] = json.loads(row["inputs"])
                row["reference"] = json.loads(row["reference"])
                row["meta"] = json.loads(row["meta"])
                row["expected_tools"] = list(row.get("expected_tools") or [])
                row["checkpoints"] = list(row.get("checkpoints") or [])
                items.append(Scenario(**row))
            return cls(items)
        known = set(Scenario.__dataclass_fields__)
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not a scenario file: byte {exc.start} is not UTF-8 text (give JSONL, or parquet "
                             "named *.parquet)") from None
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(data, dict) or "scenario_id" not in data or "inputs" not in data:
                raise ValueError(f"{p}:{lineno}: a scenario needs 'scenario_id' and 'inputs'")
            unknown = set(data) - known
            if unknown:
                raise ValueError(f"{p}:{lineno}: unknown scenario fields {sorted(unknown)}; known: {sorted(known)}")
            items.append(Scenario(**data))
        return cls(items)
