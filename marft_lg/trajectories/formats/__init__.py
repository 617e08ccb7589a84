"""Source formats, auto-detected per span. Each module has `NAME`, `detect(attrs) -> bool` and
`parse(raw) -> SpanInfo`; the first format whose `detect` accepts a span parses it."""

from __future__ import annotations

from marft_lg.trajectories.formats import genai, openinference, openllmetry, own
from marft_lg.trajectories.formats.base import OTHER, SpanInfo, base_info
from marft_lg.trajectories.otlp import RawSpan

FORMATS = (own, openinference, openllmetry, genai)


def interpret(raw: RawSpan) -> SpanInfo:
    """Parse a span with the first format that recognises it; unknown spans stay in the tree as `other`."""
    attrs = raw.attributes
    for fmt in FORMATS:
        if fmt.detect(attrs):
            return fmt.parse(raw)
    info = base_info(raw, "unknown")
    info.kind = OTHER
    return info


__all__ = ["FORMATS", "SpanInfo", "interpret"]
