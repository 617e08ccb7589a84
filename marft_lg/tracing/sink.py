"""Where a wrapped app's span records go: a queue drained in batches to the JSON-lines file and to SDK exporters.

The recorder only appends finished `SpanRecord`s to a queue (no OpenTelemetry SDK span per step).
A background thread drains the queue every `schedule_delay_s` (and `flush()` / interpreter exit
drain it at once): records are encoded straight to OTLP/JSON, up to `max_batch` spans per line,
and written by the guarded `JsonLinesSpanExporter`. An OTLP endpoint and user exporters get the
same spans as SDK `ReadableSpan`s through their own `BatchSpanProcessor` on a private
`TracerProvider` (that path costs more per span; it is only built when configured). Spans started
on `sink.tracer` directly also reach the file.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from marft_lg.tracing.exporters import GuardedExporter, JsonLinesSpanExporter, otlp_http_exporter
from marft_lg.tracing.otlp_json import dumps_records, encode_record, encode_span, request_frame
from marft_lg.tracing.records import SpanRecord, to_readable

INSTRUMENTATION_NAME = "marft_lg"
logger = logging.getLogger("marft_lg.tracing")


class _ToSink(SpanProcessor):
    """Hands spans made on the SDK tracer to the sink's file writer (the SDK exporters see them already)."""

    def __init__(self, sink: RecordSink):
        self._sink = weakref.ref(sink)

    def on_end(self, span: ReadableSpan) -> None:
        sink = self._sink()
        if sink is not None:
            if sink.file is not None:
                sink._queue.append(span)
            for tap in sink._taps:
                tap.append(span)


class RecordSink:
    """Queue + batch writer for span records; see the module docstring. Thread-safe.

    `schedule_delay_s`: how often the background thread drains the queue (None: no thread, the
    owner drains); `max_batch`: spans per written line (one ``ExportTraceServiceRequest``).
    """

    def __init__(self, file_exporter: JsonLinesSpanExporter | None = None, exporters: Sequence[SpanExporter] = (),
                 *, service_name: str = "marft_lg", schedule_delay_s: float | None = 0.5, max_batch: int = 512):
        self.resource = Resource.create({"service.name": service_name})
        limits = SpanLimits(max_span_attributes=256, max_span_attribute_length=SpanLimits.UNSET)
        self.provider = TracerProvider(resource=self.resource, span_limits=limits, shutdown_on_exit=False)
        self.tracer: Tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)
        self.scope = InstrumentationScope(INSTRUMENTATION_NAME)
        self.file = GuardedExporter(file_exporter) if file_exporter is not None else None
        self.sdk_exporters = [e if isinstance(e, GuardedExporter) else GuardedExporter(e) for e in exporters]
        self.exporters = ([self.file] if self.file else []) + self.sdk_exporters
        self._processors = [BatchSpanProcessor(e, schedule_delay_millis=500) for e in self.sdk_exporters]
        for processor in self._processors:
            self.provider.add_span_processor(processor)
        if self.file is not None:
            self.provider.add_span_processor(_ToSink(self))
        self._frame = request_frame(self.resource, INSTRUMENTATION_NAME, self.scope.version)
        self._queue: collections.deque[SpanRecord | ReadableSpan] = collections.deque()
        self._taps: list[list[SpanRecord | ReadableSpan]] = []  # `tap()`: lists that also receive every finished span
        self._drain_lock = threading.Lock()
        self.max_batch = max_batch
        self.schedule_delay_s = schedule_delay_s
        self._stop = threading.Event()
        self._closed = False
        if schedule_delay_s is not None:  # None: no writer thread; the owner calls drain()/flush() itself
            threading.Thread(target=_drain_loop, args=(weakref.ref(self), self._stop, schedule_delay_s),
                             name="marft-trace-writer", daemon=True).start()
        atexit.register(self.shutdown)  # flush on exit (a strong reference, as the SDK's provider keeps)

    @property
    def export_failures(self) -> int:
        return sum(e.failures for e in self.exporters)

    @property
    def pending(self) -> int:
        """Finished spans queued and not yet written."""
        return len(self._queue)

    def submit(self, record: SpanRecord) -> None:
        """Queue a finished span (cheap: one deque append); written at the next drain."""
        self._queue.append(record)
        for tap in self._taps:
            tap.append(record)

    @contextmanager
    def tap(self) -> Iterator[list[SpanRecord | ReadableSpan]]:
        """A list that receives every span finished while the block runs, as it finishes (besides the exporters):
        how an on-policy collector reads back the episodes it ran without reading files."""
        received: list[SpanRecord | ReadableSpan] = []
        self._taps = [*self._taps, received]
        try:
            yield received
        finally:
            self._taps = [t for t in self._taps if t is not received]

    def drain(self) -> None:
        """Encode and write everything queued so far (the background thread calls this every 0.5 s)."""
        with self._drain_lock:
            queue = self._queue
            while queue:
                batch: list[Any] = []
                try:
                    while len(batch) < self.max_batch:
                        batch.append(queue.popleft())
                except IndexError:
                    pass
                self._write(batch)

    def _write(self, batch: list[Any]) -> None:
        if self.file is not None:
            self.file.run(lambda: self.file.inner.write_line(self._line(batch)), len(batch))
        records = [r for r in batch if type(r) is SpanRecord]
        if self._processors and records:
            try:
                readable = [to_readable(r, self.resource, self.scope) for r in records]
            except Exception:  # noqa: BLE001 - a span that cannot be converted must not stop the writer
                logger.exception("marft_lg: %d spans could not be handed to the SDK exporters", len(records))
                return
            for processor in self._processors:
                for span in readable:
                    processor.on_end(span)

    def _line(self, batch: list[Any]) -> str:
        encoded = [encode_record(r) if type(r) is SpanRecord
                   else json.dumps(encode_span(r), ensure_ascii=False, separators=(",", ":")) for r in batch]
        return dumps_records(encoded, self._frame)

    def flush(self, timeout_millis: int = 30000) -> bool:
        """Write everything pending now, through every exporter."""
        self.drain()
        ok = self.file.force_flush(timeout_millis) if self.file is not None else True
        return bool(self.provider.force_flush(timeout_millis)) and ok

    def shutdown(self) -> None:
        """Flush, stop the writer thread and shut the exporters down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.drain()
        self.provider.shutdown()
        if self.file is not None:
            self.file.shutdown()


def _drain_loop(ref: weakref.ref, stop: threading.Event, delay_s: float) -> None:
    while not stop.wait(delay_s):
        sink = ref()
        if sink is None:
            return
        if sink._queue:
            sink.drain()
        del sink


def make_record_sink(
    trace_dir: str | os.PathLike | None = "traces",
    *,
    otlp_endpoint: str | None = None,
    exporters: Sequence[SpanExporter] = (),
    service_name: str = "marft_lg",
    max_file_bytes: int = 64 * 2**20,
    file_prefix: str = "spans",
) -> RecordSink:
    """The sink a wrapped app records into: the JSONL file (if `trace_dir`), an OTLP endpoint and extras."""
    file_exporter = (JsonLinesSpanExporter(trace_dir, prefix=file_prefix, max_bytes=max_file_bytes)
                     if trace_dir is not None else None)
    sdk: list[SpanExporter] = []
    if otlp_endpoint:
        sdk.append(otlp_http_exporter(otlp_endpoint))
    sdk.extend(exporters)
    return RecordSink(file_exporter, sdk, service_name=service_name)
