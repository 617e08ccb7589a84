"""Durable file writes: what is written here survives a crash or a power cut once the call returns.

One helper for every module that must not lose or half-write a file (checkpoints, their `latest`
pointer, metrics lines, job records, lock files):

- `write_atomic(path, data)`: a whole file, written under a temporary name in the same folder,
  fsynced, renamed over `path`, then the folder fsynced (so the rename itself is on disk). A reader
  sees the old file or the new one, never a mix.
- `append_durable(path, text)` / `append_line(path, line)`: appended and fsynced (the folder too when the
  file is new). A crash can leave at most the last line half-written; readers drop such a line (metrics.py).
- `rename_durable(src, dst)`: rename a file or folder and fsync the destination folder.
- `fsync_file`, `fsync_dir`, `fsync_tree`: the building blocks.
- `sha256_file(path)`: the one file hash that checks what was written (adapter and checkpoint records, the
  embedded model's stamp), streamed so a file of any size costs no memory.

Stdlib only, so every layer (training, jobs, serving) can use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["append_durable", "append_line", "fsync_dir", "fsync_file", "fsync_tree", "rename_durable", "sha256_file",
           "write_atomic"]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (creations, renames, deletions) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows: folders cannot be opened; renames there are durable enough
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and folder under `root` (files first, then each folder, `root` last)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None) -> Path:
    """Replace `path` with `data` atomically and durably (temporary file + fsync + rename + fsync of the folder).

    The temporary name is unique per call (concurrent writers never share it); the file keeps the permissions
    of the file it replaces (0o644 for a new one) unless `mode` is given.
    """
    p = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if mode is None:
        try:
            mode = p.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
    fd, name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            with contextlib.suppress(OSError):  # filesystems without permissions
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(name, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    fsync_dir(p.parent)
    return p


def append_durable(path: str | os.PathLike, text: str) -> None:
    """Append `text` as it is (created if missing) and fsync before returning; a new file's folder is fsynced."""
    p = Path(path)
    new = not p.exists()
    with open(p, "ab") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(p.parent)


def append_line(path: str | os.PathLike, line: str) -> None:
    """`append_durable` of one line (a newline is added when missing)."""
    append_durable(path, line if line.endswith("\n") else line + "\n")


def rename_durable(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` (a file or a folder; `dst` must not be a non-empty folder) and fsync both folders."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)


def sha256_file(path: str | os.PathLike, into: Any = None, *, chunk: int = 1 << 22) -> str:
    """The sha256 hex digest of a file's bytes, read in chunks; with `into` (a hashlib object) the bytes are added
    to it instead (a hash over several files) and its digest so far is returned."""
    h = into if into is not None else hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
