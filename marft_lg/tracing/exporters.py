"""Span exporters as small swappable classes: an OTLP/JSON-lines file, an OTLP endpoint, and a guard
that keeps export failures away from the app (counted, reported once)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from marft_lg.tracing.otlp_json import dumps_request

logger = logging.getLogger("marft_lg.tracing")


class JsonLinesSpanExporter(SpanExporter):
    """Append each export batch as one OTLP/JSON ``ExportTraceServiceRequest`` line under `trace_dir`.

    Files are named ``<prefix>-<UTC time>-<pid>-<rand>.jsonl`` so several processes can share one
    directory; a file is closed and a new one started once it exceeds `max_bytes`. Every line is
    written whole and flushed, so a crash loses at most the batch being written.
    """

    def __init__(self, trace_dir: str | os.PathLike = "traces", *, prefix: str = "spans", max_bytes: int = 64 * 2**20):
        self.trace_dir = Path(trace_dir)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._file = None
        self._size = 0
        self.path: Path | None = None
        self.files: list[Path] = []

    def _open(self) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.path = self.trace_dir / f"{self.prefix}-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across batches
        self._size = 0
        self.files.append(self.path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        return self.write_line(dumps_request(spans))

    def write_line(self, line: str) -> SpanExportResult:
        """Append one already encoded ``ExportTraceServiceRequest`` (no trailing newline) as a line."""
        line += "\n"
        with self._lock:
            if self._file is None or self._size >= self.max_bytes:
                if self._file is not None:
                    self._file.close()
                self._open()
            self._file.write(line)
            self._file.flush()
            self._size += len(line.encode("utf-8"))
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if self._file is not None:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def otlp_http_exporter(endpoint: str, headers: dict[str, str] | None = None) -> SpanExporter:
    """An OTLP/HTTP exporter to a collector the user already runs (``pip install marft_lg[otlp]``)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError(
            "otlp_endpoint needs opentelemetry-exporter-otlp-proto-http; install it with `pip install 'marft_lg[otlp]'`"
        ) from exc
    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url, headers=headers)


class GuardedExporter(SpanExporter):
    """Wrap an exporter so that failures (raised or returned) are counted and logged once, never raised."""

    def __init__(self, inner: SpanExporter, name: str | None = None):
        self.inner = inner
        self.name = name or type(inner).__name__
        self.failures = 0
        self.exported = 0
        self.last_error: str | None = None
        self._reported = False

    def _fail(self, reason: str) -> SpanExportResult:
        self.failures += 1
        self.last_error = reason
        if not self._reported:
            self._reported = True
            logger.warning(
                "marft_lg: span export through %s failed (%s); the app keeps running and further failures "
                "are only counted (see WrappedGraph.export_failures).",
                self.name,
                reason,
            )
        return SpanExportResult.FAILURE

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.run(lambda: self.inner.export(spans), len(spans))

    def run(self, export: Callable[[], SpanExportResult], n_spans: int) -> SpanExportResult:
        """Run one export call of `n_spans` spans under the guard (e.g. the file writer's `write_line`)."""
        try:
            result = export()
        except Exception as exc:  # noqa: BLE001 - an exporter must never break the app
            return self._fail(f"{type(exc).__name__}: {exc}")
        if result is not SpanExportResult.SUCCESS:
            return self._fail(f"exporter returned {result.name}")
        self.exported += n_spans
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception as exc:  # noqa: BLE001
            self._fail(f"force_flush: {type(exc).__name__}: {exc}")
            return False

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"shutdown: {type(exc).__name__}: {exc}")
