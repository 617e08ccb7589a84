"""Cutting trace files into line-aligned byte ranges of about equal size, one per mining worker."""


from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from marft_lg.trajectories.otlp import FileRange, skip_line

_BLOCK = 16 * 1024 * 1024


def default_workers() -> int:
    """Cores this process may use, at most 8 (mining is I/O- and memory-bound beyond that)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def plan_ranges(files: list[Path], workers: int, *, count_lines: bool = True) -> list[list[FileRange]]:
    """Cut `files` (in order) into at most `workers` contiguous groups of about equal bytes, splitting plain
    files at line boundaries (``.gz`` files stay whole); empty groups are dropped. With `count_lines` False a range
    that starts inside a file gets first_line 0, to be filled in by `number_lines` (the first group never needs it)."""
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    groups: list[list[FileRange]] = [[] for _ in range(max(1, workers))]
    g, assigned = 0, 0
    for path, size in zip(files, sizes, strict=True):
        start, line = 0, 1
        if size == 0:
            groups[g].append(FileRange(path))
            continue
        while start < size:
            room = int((g + 1) * total / len(groups)) - assigned
            last = g == len(groups) - 1
            if last or size - start <= room or path.name.endswith(".gz"):
                groups[g].append(FileRange(path, start, None, line))
                assigned += size - start
                if not last and assigned >= (g + 1) * total / len(groups):
                    g += 1
                break
            cut = _next_line_start(path, start + max(room, 1))
            cut_line = line + _count_newlines(path, start, cut) if count_lines else 0
            if cut >= size:
                groups[g].append(FileRange(path, start, None, line))
                assigned += size - start
                g += 1
                break
            groups[g].append(FileRange(path, start, cut, line))
            assigned += cut - start
            start, line = cut, cut_line
            g += 1
    return [grp for grp in groups if grp]


def number_lines(groups: list[list[FileRange]]) -> list[list[FileRange]]:
    """`groups` with the first line number of every range planned without counting (first_line 0) filled in,
    counting each file's newlines once, in order."""
    at: dict[Path, tuple[int, int]] = {}  # file -> (byte, line number) of the latest range start seen
    out = []
    for group in groups:
        numbered = []
        for r in group:
            if r.first_line == 0:
                pos, line = at.get(r.path, (0, 1))
                r = replace(r, first_line=line + _count_newlines(r.path, pos, r.start))
            at[r.path] = (r.start, r.first_line)
            numbered.append(r)
        out.append(numbered)
    return out


def _next_line_start(path: Path, pos: int) -> int:
    """The first line start after `pos`."""
    with path.open("rb") as fh:
        fh.seek(pos)
        skip_line(fh)  # in chunks: a line of any length costs no memory
        return fh.tell()


def _count_newlines(path: Path, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of `path`, read a block at a time into one buffer (a memory map would count
    the file's pages in this process's RSS)."""
    buf = bytearray(min(_BLOCK, max(end - start, 0)))
    newlines = 0
    with path.open("rb", buffering=0) as fh, memoryview(buf) as view:
        fh.seek(start)
        left = end - start
        while left > 0:
            n = fh.readinto(view[:min(_BLOCK, left)])
            if not n:
                break
            newlines += buf.count(b"\n", 0, n)
            left -= n
    return newlines
