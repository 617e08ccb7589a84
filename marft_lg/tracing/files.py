"""Which files a trace path names: the one expansion used by `mine`, `marft-lg mine`, retraining jobs, the span reader
and `compare --from-traces`."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

TRACE_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_trace_file(path: Path) -> bool:
    """An OTLP/JSON-lines file, plain or gzipped, by its name."""
    return path.name.endswith(TRACE_SUFFIXES)


def trace_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Files, directories (their `*.jsonl` and `*.jsonl.gz`, in subfolders too) and globs (`**` allowed) -> the
    sorted unique files. A named file is taken whatever its suffix; a path that does not exist raises
    `FileNotFoundError`; a glob that matches nothing gives nothing."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    found: set[Path] = set()
    for item in paths:
        text = os.fspath(item)
        magic = glob.has_magic(text)
        candidates = [Path(p) for p in glob.glob(text, recursive=True)] if magic else [Path(text)]
        for p in candidates:
            if p.is_dir():
                found.update(q for q in p.rglob("*") if q.is_file() and is_trace_file(q))
            elif p.is_file():
                found.add(p)
            elif not magic:
                raise FileNotFoundError(f"trace path {p} does not exist (give files, directories or globs of "
                                        ".jsonl/.jsonl.gz)")
    return sorted(found)
