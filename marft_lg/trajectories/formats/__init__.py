"""Source formats, auto-detected per span. Each module has `NAME`, `detect(attrs) -> bool` and
`parse(raw) -> SpanInfo`; the first format whose `detect` accepts a span parses it."""

from __future__ import annotations

import sys

from marft_lg.trajectories.formats import genai, openinference, openllmetry, own
from marft_lg.trajectories.formats.base import OTHER, SpanInfo, base_info
from marft_lg.trajectories.otlp import RawSpan

FORMATS = (own, openinference, openllmetry, genai)


# short strings repeated on many spans: one shared copy each (a large share of memory on big inputs)
_SHARED_FIELDS = ("name", "agent", "episode_id", "session", "scenario_id", "task", "model", "adapter_version", "tool_name")


def interpret(raw: RawSpan) -> SpanInfo:
    """Parse a span with the first format that recognises it; unknown spans stay in the tree as `other`."""
    attrs = raw.attributes
    for fmt in FORMATS:
        if fmt.detect(attrs):
            info = fmt.parse(raw)
            break
    else:
        info = base_info(raw, "unknown")
        info.kind = OTHER
    for name in _SHARED_FIELDS:
        value = getattr(info, name)
        if type(value) is str:
            setattr(info, name, sys.intern(value))
    return info


__all__ = ["FORMATS", "SpanInfo", "interpret"]
