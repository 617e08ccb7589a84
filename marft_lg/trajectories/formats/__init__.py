"""Trace formats, each a declared mapping (`engine.Format`) that one engine runs. Detected per span: the first format
whose `detect` accepts a span's attributes interprets it; a span no format knows stays in the tree as `other`."""

from __future__ import annotations

from marft_lg.trajectories.formats import genai, openinference, openllmetry, own
from marft_lg.trajectories.formats.base import SpanInfo, base_info
from marft_lg.trajectories.formats.engine import Format
from marft_lg.trajectories.raw_span import RawSpan

FORMATS: tuple[Format, ...] = (own.FORMAT, openinference.FORMAT, openllmetry.FORMAT, genai.FORMAT)


def interpret(raw: RawSpan, formats: tuple[Format, ...] = FORMATS) -> SpanInfo:
    """The span as mining understands it, under the first format of `formats` that recognises it."""
    attrs = raw.attributes
    for fmt in formats:
        if fmt.detect(attrs):
            return fmt.interpret(raw)
    return base_info(raw, "unknown")


__all__ = ["FORMATS", "Format", "SpanInfo", "interpret"]
