"""Single-flight run lock: a lock file naming its holder (pid, hostname, process start time, run id).

The file is created with O_EXCL, so exactly one runner holds it. A holder killed with SIGKILL
leaves the file behind; the next runner detects that it is stale and takes over:
- same host: the pid is gone, or the pid now belongs to a process started at another time (reuse);
- other host (e.g. another Kubernetes pod): its heartbeat (the file's mtime, touched every
  `heartbeat_s` while held) is older than `stale_after_s`.
Checking and breaking happen under a short `flock` on a guard file, so two runners never both
break the same stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil

from marft_lg._durable import fsync_dir, write_atomic


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) the lock."""

    pid: int
    hostname: str
    process_start: float
    """The holder process' start time (epoch seconds, from psutil): tells a reused pid apart."""
    acquired_at: str
    run_id: str | None = None
    token: str = ""

    def describe(self) -> str:
        run = f", run {self.run_id}" if self.run_id else ""
        return f"pid {self.pid} on host {self.hostname} (since {self.acquired_at}{run})"


class LockHeld(RuntimeError):
    """Another live runner holds the lock."""

    def __init__(self, path: Path, holder: LockHolder):
        self.path = path
        self.holder = holder
        super().__init__(
            f"another retrain run holds the lock {path}: {holder.describe()}. "
            "Wait for it to finish; if that process is really gone, delete the lock file."
        )


def _process_start(pid: int) -> float:
    return psutil.Process(pid).create_time()


class RunLock:
    """`acquire()` / `release()` (or `with`) a lock file; `broken` names a stale holder that was replaced."""

    def __init__(self, path: str | Path, *, stale_after_s: float = 600.0, heartbeat_s: float = 30.0,
                 run_id: str | None = None):
        self.path = Path(path)
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.run_id = run_id
        self.holder: LockHolder | None = None
        self.broken: LockHolder | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def read(self) -> LockHolder | None:
        """The current holder as written in the file, or None when unlocked."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
            return LockHolder(**data)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(
                f"lock file {self.path} is not a marft-lg lock ({exc}); remove it if no run is in progress"
            ) from exc

    def is_stale(self, holder: LockHolder) -> bool:
        """True when the holder cannot still be running (see module docstring)."""
        if holder.hostname == socket.gethostname():
            if not psutil.pid_exists(holder.pid):
                return True
            try:
                return abs(_process_start(holder.pid) - holder.process_start) > 1.0
            except psutil.NoSuchProcess:
                return True
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True
        return age > self.stale_after_s

    def acquire(self) -> LockHolder:
        """Take the lock or raise `LockHeld`; a stale lock is replaced and remembered in `self.broken`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockHolder(
            pid=os.getpid(),
            hostname=socket.gethostname(),
            process_start=_process_start(os.getpid()),
            acquired_at=datetime.now(UTC).isoformat(timespec="seconds"),
            run_id=self.run_id,
            token=uuid.uuid4().hex,
        )
        with self._guard():
            current = self.read()
            if current is not None:
                if not self.is_stale(current):
                    raise LockHeld(self.path, current)
                self.broken = current
                self.path.unlink(missing_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{me.token}")
            write_atomic(tmp, json.dumps(asdict(me)))  # fsynced before it becomes the lock
            try:
                os.link(tmp, self.path)  # atomic create-if-absent with the full content in place
            except FileExistsError:
                holder = self.read()
                raise LockHeld(self.path, holder) from None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
        self.holder = me
        self._start_heartbeat()
        return me

    def release(self) -> None:
        """Remove the lock if it is still ours (never someone else's)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self.holder is None:
            return
        with self._guard():
            current = None
            with contextlib.suppress(ValueError):
                current = self.read()
            if current is not None and current.token == self.holder.token:
                self.path.unlink(missing_ok=True)
        self.holder = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def _guard(self):
        guard = self.path.with_name(self.path.name + ".guard")
        with guard.open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                with contextlib.suppress(FileNotFoundError):
                    os.utime(self.path)

        self._beat = threading.Thread(target=beat, name="marft-lock-heartbeat", daemon=True)
        self._beat.start()
