"""A private OpenTelemetry `TracerProvider` with SDK span processors: never touches the user's global provider.

Used for `record_feedback` and by code that makes SDK spans itself; wrapped apps record through the
cheaper `marft_lg.tracing.sink.RecordSink` (same files, same bytes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from marft_lg.tracing.exporters import GuardedExporter, JsonLinesSpanExporter, otlp_http_exporter

INSTRUMENTATION_NAME = "marft_lg"


@dataclass
class TraceSink:
    """The provider, its tracer and its guarded exporters; `flush()` writes everything pending."""

    provider: TracerProvider
    tracer: Tracer
    exporters: list[GuardedExporter] = field(default_factory=list)

    @property
    def export_failures(self) -> int:
        return sum(e.failures for e in self.exporters)

    def flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.provider.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.provider.shutdown()


def make_sink(
    trace_dir: str | os.PathLike | None = "traces",
    *,
    otlp_endpoint: str | None = None,
    exporters: Sequence[SpanExporter] = (),
    service_name: str = "marft_lg",
    batch: bool = True,
    max_file_bytes: int = 64 * 2**20,
    file_prefix: str = "spans",
) -> TraceSink:
    """Build a private provider exporting to the JSONL file (if `trace_dir`), an OTLP endpoint and extras.

    `batch=False` exports each span as it ends (used for feedback spans, which are rare and must
    land on disk at once).
    """
    inner: list[SpanExporter] = []
    if trace_dir is not None:
        inner.append(JsonLinesSpanExporter(trace_dir, prefix=file_prefix, max_bytes=max_file_bytes))
    if otlp_endpoint:
        inner.append(otlp_http_exporter(otlp_endpoint))
    inner.extend(exporters)
    limits = SpanLimits(max_span_attributes=256, max_span_attribute_length=SpanLimits.UNSET)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), span_limits=limits)
    guarded = [e if isinstance(e, GuardedExporter) else GuardedExporter(e) for e in inner]
    for exporter in guarded:
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=500) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return TraceSink(provider=provider, tracer=provider.get_tracer(INSTRUMENTATION_NAME), exporters=guarded)
