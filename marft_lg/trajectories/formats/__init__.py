"""Source formats, auto-detected per span. Each module has `NAME`, `detect(attrs) -> bool` and
`parse(raw) -> SpanInfo`; the first format whose `detect` accepts a span parses it."""

from __future__ import annotations

from marft_lg.trajectories.formats import genai, openinference, openllmetry, own
from marft_lg.trajectories.formats.base import OTHER, SpanInfo, base_info, intern_strings
from marft_lg.trajectories.otlp import RawSpan

FORMATS = (own, openinference, openllmetry, genai)


def interpret(raw: RawSpan) -> SpanInfo:
    """Parse a span with the first format that recognises it; unknown spans stay in the tree as `other`.
    Short strings repeated on many spans share one copy each (`intern_strings`; the own and OpenInference formats do it themselves)."""
    attrs = raw.attributes
    if own.detect(attrs):
        return own.parse(raw)
    if openinference.detect(attrs):
        return openinference.parse(raw)
    for fmt in _OTHERS:
        if fmt.detect(attrs):
            info = fmt.parse(raw)
            break
    else:
        info = base_info(raw, "unknown")
        info.kind = OTHER
    return intern_strings(info)


_OTHERS = FORMATS[2:]  # own and openinference parse and intern themselves


__all__ = ["FORMATS", "SpanInfo", "interpret"]
