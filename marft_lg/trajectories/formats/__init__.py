"""Source formats, auto-detected per span. Each module has `NAME`, `detect(attrs) -> bool` and
`parse(raw) -> SpanInfo`; the first format whose `detect` accepts a span parses it."""

from __future__ import annotations

import sys

from marft_lg.trajectories.formats import genai, openinference, openllmetry, own
from marft_lg.trajectories.formats.base import OTHER, SpanInfo, base_info
from marft_lg.trajectories.otlp import RawSpan

FORMATS = (own, openinference, openllmetry, genai)


def interpret(raw: RawSpan) -> SpanInfo:
    """Parse a span with the first format that recognises it; unknown spans stay in the tree as `other`.
    Short strings repeated on many spans (names, agents, ids of episodes and tasks) share one copy each."""
    attrs = raw.attributes
    for fmt in FORMATS:
        if fmt.detect(attrs):
            info = fmt.parse(raw)
            break
    else:
        info = base_info(raw, "unknown")
        info.kind = OTHER
    intern = sys.intern
    info.name = intern(info.name)
    if type(info.agent) is str:
        info.agent = intern(info.agent)
    if type(info.episode_id) is str:
        info.episode_id = intern(info.episode_id)
    if type(info.session) is str:
        info.session = intern(info.session)
    if type(info.scenario_id) is str:
        info.scenario_id = intern(info.scenario_id)
    if type(info.task) is str:
        info.task = intern(info.task)
    if type(info.model) is str:
        info.model = intern(info.model)
    if type(info.adapter_version) is str:
        info.adapter_version = intern(info.adapter_version)
    if type(info.tool_name) is str:
        info.tool_name = intern(info.tool_name)
    return info


__all__ = ["FORMATS", "SpanInfo", "interpret"]
