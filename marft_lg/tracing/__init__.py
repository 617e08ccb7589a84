"""marft_lg.tracing: OpenTelemetry spans for agent episodes, their exporters, readers and feedback."""

from marft_lg.tracing.feedback import record_feedback
from marft_lg.tracing.reader import read_spans

__all__ = ["read_spans", "record_feedback"]
