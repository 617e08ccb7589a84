"""Flex-MG assembly: spans -> episodes -> ordered agent actions with tools and dependencies.

- episode: all traces sharing marft_lg's episode id, else a conversation/thread/session id, else one trace;
- action: one LLM call; its agent is the LangGraph node / `gen_ai.agent.name` on the call or on the
  nearest enclosing span that names one;
- steps: an action's *step chain* is the super-step of each graph level it runs in, outermost first
  (a worker subgraph's step 3 inside the outer graph's step 2 is ``(2, 3)``), read from the task
  spans around the call. `step` is the outermost super-step, so it grows along the run; actions are
  ordered by their step chains (then start time) when every action has one, else by start time;
- tools: a tool span is attached to the latest earlier action of the same node run (task) that
  requested it (matched by call id, then by name); a tool call the model wrote malformed keeps its
  error and counts in `tool_errors`;
- `depends_on` (the paper's dependency function D): earlier actions of the same node run; the final
  action of each node run in the previous super-step of the action's own graph level (a subgraph's
  first action: of the enclosing level, i.e. the action that routed to it); and every earlier
  action whose completion text appears in this action's prompt.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import defaultdict
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from marft_lg.trajectories.columns import ACTION_COLUMNS
from marft_lg.trajectories.formats.base import AGENT, FEEDBACK, LLM, TOOL, WORKFLOW, SpanInfo, messages_text
from marft_lg.trajectories.formats.genai import materialise
from marft_lg.trajectories.formats.own import NAME as OWN
from marft_lg.trajectories.quarantine import Quarantine

MIN_QUOTED_COMPLETION_CHARS = 8  # shorter completions ("OK", "yes") appear in prompts by chance
_START, _END = attrgetter("start_ns"), attrgetter("end_ns")
_TRACE, _SPAN, _PARENT, _FMT = attrgetter("trace_id"), attrgetter("span_id"), attrgetter("parent_id"), attrgetter("fmt")
# the action rows' fields, in order: the dataset's columns, then two optional ones (older datasets lack them)
ACTION_FIELDS: tuple[str, ...] = (*ACTION_COLUMNS, "constraint", "trace_id")
_AGENT, _MESSAGES, _COMPLETION, _DEPENDS_ON, _TOOL_CALLS, _TOOL_ERRORS, _PROMPT_IDS, _COMPLETION_IDS = map(
    ACTION_FIELDS.index, ("agent", "messages", "completion", "depends_on", "tool_calls", "tool_errors",
                          "prompt_token_ids", "completion_token_ids"))
_BY_START, _BY_START_END, _BY_END = (attrgetter("start_ns", "span_id"), attrgetter("start_ns", "end_ns", "span_id"),
                                     attrgetter("end_ns", "span_id"))


def episode_key(spans: list[SpanInfo]) -> str:
    """The episode a trace (its non-feedback spans) belongs to: the own episode id of its earliest span naming one >
    the conversation/session id of its earliest span naming one > its trace id."""
    named = list(filter(_EPISODE_ID, spans))
    if named:
        return min(named, key=_BY_START).episode_id
    named = list(filter(_SESSION, spans))
    if named:
        return str(min(named, key=_BY_START).session)
    return spans[0].trace_id


_EPISODE_ID, _SESSION = attrgetter("episode_id"), attrgetter("session")


def group_episodes(spans: Iterable[SpanInfo]) -> tuple[dict[str, list[SpanInfo]], list[SpanInfo]]:
    """Split into {episode key: spans} and the feedback spans (joined to episodes later)."""
    traces: dict[str, list[SpanInfo]] = defaultdict(list)
    feedback: list[SpanInfo] = []
    for s in spans:
        (feedback if s.kind == FEEDBACK else traces[s.trace_id]).append(s)
    answered = _answered_elsewhere(traces)
    episodes: dict[str, list[SpanInfo]] = defaultdict(list)
    for trace_id in sorted(traces):
        owner = answered.get(trace_id, trace_id)
        episodes[episode_key(traces[owner])].extend(traces[trace_id])
    return episodes, feedback


def _answered_elsewhere(traces: dict[str, list[SpanInfo]]) -> dict[str, str]:
    """Traces of server records alone (no episode id of their own: the request carried another tracer's context)
    -> the trace of the app call that recorded the same response id, whose episode they belong to."""
    lonely = {t: members for t, members in traces.items()
              if all(s.served for s in members) and not any(s.episode_id for s in members)}
    if not lonely:
        return {}
    by_response = {s.response_id: t for t, members in traces.items() if t not in lonely
                   for s in members if s.kind == LLM and s.response_id}
    out = {}
    for t, members in lonely.items():
        owner = next((by_response[s.response_id] for s in members if s.response_id in by_response), None)
        if owner is not None:
            out[t] = owner
    return out


def repair_parents(spans: list[SpanInfo], stats: dict[str, int], trace_ids: set[str] | None = None) -> None:
    """Re-attach spans whose parent never arrived to their trace's root (or make them roots). `trace_ids`: the
    spans' trace ids, when the caller has them."""
    if trace_ids is None:
        trace_ids = set(map(_TRACE, spans))
    if len(trace_ids) == 1:  # the usual episode: one trace, nothing to repair (checked in C)
        parents = set(map(_PARENT, spans))
        parents.discard(None)
        if parents.issubset(map(_SPAN, spans)):
            return
    by_trace: dict[str, dict[str, SpanInfo]] = defaultdict(dict)
    for s in spans:
        by_trace[s.trace_id][s.span_id] = s
    for members in by_trace.values():
        roots = sorted((s for s in members.values() if s.parent_id is None), key=_BY_START)
        root = roots[0] if roots else None
        for s in members.values():
            if s.parent_id is not None and s.parent_id not in members:
                stats["repaired_parents"] = stats.get("repaired_parents", 0) + 1
                s.parent_id = root.span_id if root is not None and root is not s else None


class _Tree:
    def __init__(self, spans: list[SpanInfo]):
        self._spans = spans
        self._by_id: dict[tuple[str, str], SpanInfo] | None = None

    @property
    def by_id(self) -> dict[tuple[str, str], SpanInfo]:  # built on first use: own spans rarely need their ancestors
        if self._by_id is None:
            self._by_id = {(s.trace_id, s.span_id): s for s in self._spans}
        return self._by_id

    def ancestors(self, s: SpanInfo) -> Iterable[SpanInfo]:
        seen = 0
        cur = self.by_id.get((s.trace_id, s.parent_id)) if s.parent_id else None
        while cur is not None and seen < 256:  # guard against parent cycles in damaged input
            yield cur
            seen += 1
            cur = self.by_id.get((cur.trace_id, cur.parent_id)) if cur.parent_id else None

    def agent_of(self, s: SpanInfo) -> str | None:
        if s.agent:
            return s.agent
        for a in self.ancestors(s):
            if a.agent and a.kind in (AGENT, LLM, TOOL):
                return a.agent
        return None

    def task_of(self, s: SpanInfo) -> str:
        if s.task:
            return s.task
        for a in self.ancestors(s):
            if a.task:
                return a.task
            if a.kind == AGENT:
                return a.span_id
        return s.parent_id or s.span_id

    def step_of(self, s: SpanInfo) -> int | None:
        if s.step is not None:
            return s.step
        for a in self.ancestors(s):
            if a.step is not None:
                return a.step
        return None

    def step_chain(self, s: SpanInfo, task: str) -> tuple[tuple[str, int], ...]:
        """((task, super-step), ...) of each graph level the call runs in, outermost first; () without steps."""
        step = s.step if s.step is not None else self.step_of(s)
        if step is None:
            return ()
        chain = [(task, step)]
        for a in self.ancestors(s):
            if a.step is not None and a.task and a.task != chain[-1][0]:
                chain.append((a.task, a.step))
        chain.reverse()
        return tuple(chain)


def assemble_episode(key: str, spans: list[SpanInfo], quarantine: Quarantine,
                     stats: dict[str, int]) -> tuple[dict[str, Any], list[list[Any]]] | None:
    """One episode's row and its action rows (lists in `ACTION_FIELDS` order: no dict per action; token columns
    still encoded); None when it holds no LLM call. The row's `settled` is False when the episode talked to a
    recording server (it holds a server record) and a call of it has neither token ids of its own nor its record
    (still in the server's sink, or lost), and when a run of it is `rootless`: its status is then "incomplete"."""
    trace_ids = set(map(_TRACE, spans))
    missing_root = rootless(spans)
    repair_parents(spans, stats, trace_ids)
    tree = _Tree(spans)
    calls = [s for s in spans if s.kind == LLM]
    for c in calls:
        if c.raw_io is not None:
            materialise(c)
    served = any(c.served for c in calls)
    calls = sorted(merge_served(calls, stats), key=_BY_START_END)
    if not calls:
        stats["spans_without_actions"] = stats.get("spans_without_actions", 0) + len(spans)
        return None
    chains = [tree.step_chain(c, c.task or tree.task_of(c)) for c in calls]
    if all(chains):  # order by the step chains (outer super-step first), then start time
        by_chain = sorted(range(len(calls)), key=lambda i: tuple(step for _, step in chains[i]))
        calls, chains = [calls[i] for i in by_chain], [chains[i] for i in by_chain]
    tasks = [chain[-1][0] if chain else (c.task or tree.task_of(c)) for c, chain in zip(calls, chains, strict=True)]
    steps = [chain[0][1] if chain else None for chain in chains]
    actions: list[list[Any]] = []
    for order, c in enumerate(calls):  # a row in `ACTION_FIELDS` order (transposed into columns per batch)
        latency = c.latency_s
        actions.append([
            key, order, steps[order], c.agent or tree.agent_of(c) or "unknown", c.span_id, c.messages or [],
            c.completion or "",
            # as the span carried them ("i32:<base64>", a list, ...): decoded a column at a time (TokenColumn)
            c.prompt_token_ids, c.completion_token_ids, c.completion_logprobs,
            [],  # depends_on
            [dict(tc, result=None, error=tc.get("error") or None) for tc in c.tool_calls] if c.tool_calls else [],
            sum(1 for tc in c.tool_calls if tc.get("error")) if c.tool_calls else 0,  # tool_errors: malformed calls
            c.input_tokens, c.output_tokens, latency if latency is not None else (c.end_ns - c.start_ns) / 1e9,
            c.model, c.adapter_version, c.constraint, c.trace_id,
        ])
    for row in actions:  # no exact prompt or completion ids: the trainer re-tokenises these actions
        if row[_PROMPT_IDS] is None or row[_COMPLETION_IDS] is None:
            key_ = NO_TOKEN_IDS + row[_AGENT]
            stats[key_] = stats.get(key_, 0) + 1
    tools = [s for s in spans if s.kind == TOOL]
    if tools:
        _attach_tools(tools, calls, tasks, actions, tree, quarantine)
    _dependencies(chains, tasks, actions)

    workflows = sorted([s for s in spans if s.kind == WORKFLOW], key=_BY_END)
    metadata: dict[str, Any] = {}
    for w in workflows:
        metadata.update(w.metadata or {})
    outcome = next((w.outcome for w in reversed(workflows) if w.outcome is not None), None)
    named = [s for s in spans if s.scenario_id]  # the first in (workflow first, start, span id) order wins
    scenario = min(named, key=lambda s: (s.kind != WORKFLOW, s.start_ns, s.span_id)).scenario_id if named else None
    failed = any(s.error for s in workflows) or any(c.error for c in calls)
    episode = {
        "episode_id": key,
        "scenario_id": scenario,
        "start_time": min(map(_START, spans)),
        "end_time": max(map(_END, spans)),
        "n_actions": len(actions),
        "agents": list(dict.fromkeys([a[_AGENT] for a in actions])),
        "status": INCOMPLETE if missing_root else "error" if failed else "paused" if metadata.get("paused") else "ok",
        "outcome": outcome,
        "feedback": {},
        "metadata": metadata,
        "source_format": min(map(_FMT, calls)),
        "trace_ids": sorted(trace_ids),
        "settled": not missing_root and (
            not served or all(a[_PROMPT_IDS] is not None and a[_COMPLETION_IDS] is not None for a in actions)),
    }
    return episode, actions


INCOMPLETE = "incomplete"  # status of an episode a run of which has no root span (yet): its result is unknown


def rootless(spans: list[SpanInfo]) -> list[str]:
    """The traces of an episode that hold marft_lg's recorder spans (own format, not a server's record) but not the
    run's ``invoke_workflow`` root: it ends last and carries the run's status, scenario, metadata (replay or shadow
    marks included) and outcome, so until it is exported (or when the process died first) the run is unknown.
    Third-party formats may have no root and are never rootless."""
    recorded: set[str] = set()
    rooted: set[str] = set()
    for s in spans:
        if s.kind == WORKFLOW:
            rooted.add(s.trace_id)
        elif s.fmt == OWN and s.episode_id and not s.served:
            recorded.add(s.trace_id)
    return sorted(recorded - rooted)


NO_TOKEN_IDS = "no_token_ids:"  # stats key prefix: actions per agent whose trace holds no exact token ids


def merge_served(calls: list[SpanInfo], stats: dict[str, int]) -> list[SpanInfo]:
    """Fold every server span (`served`: what a marft_lg server sampled) into the app's LLM call it answered: its
    parent span, else the call that recorded the same response id. The server's record of what was sampled wins
    (rendered prompt ids, completion ids and text, log-probs, adapter version, tool calls with their errors, the
    role whose adapter answered); the app keeps its place in the graph and its view of the prompt. A server span
    that answered no recorded call (a raw client's, or server traces mined alone) is an action of its own; a
    request's further choices (``n > 1``) are not actions."""
    served = [c for c in calls if c.served]
    if not served:
        return calls
    apps = [c for c in calls if not c.served]
    by_id = {(c.trace_id, c.span_id): c for c in apps}
    by_response = {c.response_id: c for c in apps if c.response_id}
    alone: list[SpanInfo] = []
    for srv in sorted(served, key=attrgetter("end_ns")):  # a retried request: its latest answer wins
        app = by_id.get((srv.trace_id, srv.parent_id)) if srv.parent_id else None
        if app is None and srv.response_id:
            app = by_response.get(srv.response_id)
        if srv.choice:
            stats["served_extra_choices"] = stats.get("served_extra_choices", 0) + 1
            continue
        if app is None:
            alone.append(srv)
            continue
        stats["served_merged"] = stats.get("served_merged", 0) + 1
        _absorb(app, srv)
    return apps + alone


def _absorb(app: SpanInfo, srv: SpanInfo) -> None:
    app.prompt_token_ids, app.completion_token_ids = srv.prompt_token_ids, srv.completion_token_ids
    app.completion_logprobs, app.adapter_version = srv.completion_logprobs, srv.adapter_version
    if srv.completion is not None:
        app.completion = srv.completion
    if srv.tool_calls:
        app.tool_calls = srv.tool_calls
    if srv.agent:
        app.agent = srv.agent
    if not app.messages and srv.messages:
        app.messages = srv.messages
    app.model = srv.model or app.model
    app.input_tokens, app.output_tokens = srv.input_tokens, srv.output_tokens
    app.response_id = app.response_id or srv.response_id
    app.constraint = srv.constraint or app.constraint


def _attach_tools(tools: list[SpanInfo], calls: list[SpanInfo], tasks: list[str], actions: list[list[Any]],
                  tree: _Tree, quarantine: Quarantine) -> None:
    """Each tool span fills (or adds) an entry of the latest call before it of its node run, else of the latest
    earlier call that requested it, else of the latest earlier call."""
    starts = [c.start_ns for c in calls]  # `calls` are in start order: the calls before a tool are a prefix
    done: set[int] = set()  # ids of the entries a tool span has filled
    touched: set[int] = set()
    for t in sorted(tools, key=_BY_START):
        task = t.task or tree.task_of(t)
        k = bisect_right(starts, t.start_ns)
        if not k:
            quarantine.add("tool_without_action", t.source, trace_id=t.trace_id, span_id=t.span_id,
                           detail=f"tool {t.tool_name!r} ran before any LLM call of its episode")
            continue
        idx = next((i for i in range(k - 1, -1, -1) if tasks[i] == task), -1)
        if idx < 0:
            name, call_id = t.tool_name, t.tool_call_id
            idx = next((i for i in range(k - 1, -1, -1)
                        if any(tc.get("name") == name or (call_id and tc.get("id") == call_id)
                               for tc in actions[i][_TOOL_CALLS])), k - 1)
        entries = actions[idx][_TOOL_CALLS]
        entry = next((e for e in entries if t.tool_call_id and e.get("id") == t.tool_call_id), None)
        if entry is None:
            entry = next((e for e in entries if e.get("name") == t.tool_name and id(e) not in done
                          and e.get("error") is None), None)
        if entry is None:
            entry = {"name": t.tool_name, "args": t.tool_args, "id": t.tool_call_id, "result": None, "error": None}
            entries.append(entry)
        done.add(id(entry))
        touched.add(idx)
        if entry.get("args") is None:
            entry["args"] = t.tool_args
        entry["result"] = None if t.error else _plain(t.tool_result)
        entry["error"] = (t.error_message or "error") if t.error else None
    for idx in touched:  # the other actions keep the count of their malformed calls
        actions[idx][_TOOL_ERRORS] = sum(1 for e in actions[idx][_TOOL_CALLS] if e.get("error"))


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    import json

    return json.dumps(value, ensure_ascii=False, default=str)


def _dependencies(chains: list[tuple[tuple[str, int], ...]], tasks: list[str], actions: list[list[Any]]) -> None:
    """Fill each action's `depends_on` (see the module docstring).

    For an action whose step chain is ``((t1, s1), ..., (tk, sk))`` the "previous step" is looked up
    innermost level first: among earlier actions inside the same enclosing node runs ``t1..t(L-1)``,
    the latest level-L super-step below ``sL``; the final action of each level-L node run in it is a
    dependency. A subgraph's first action finds nothing at its own level and takes the enclosing
    level's previous step: the action that routed to it.
    """
    quoted = [(j, text) for j, a in enumerate(actions)
              if len(text := (a[_COMPLETION] or "").strip()) >= MIN_QUOTED_COMPLETION_CHARS]
    first_quoted = quoted[0][0] if quoted else len(actions)
    of_task: dict[str, list[int]] = {}  # earlier actions per node run
    # enclosing node runs -> step at that level -> node run at that level -> its latest earlier action
    levels: dict[tuple[str, ...], dict[int, dict[str, int]]] = {}
    level_steps: dict[tuple[str, ...], list[int]] = {}  # the keys of each `levels` entry, sorted
    for i, action in enumerate(actions):
        task, chain = tasks[i], chains[i]
        same = of_task.get(task)
        deps: set[int] = set(same) if same else set()
        scopes = [tuple(t for t, _ in chain[:level]) for level in range(len(chain))]
        for level in range(len(chain) - 1, -1, -1):
            keys = level_steps.get(scopes[level])
            below = bisect_left(keys, chain[level][1]) if keys else 0
            if below:
                deps.update(levels[scopes[level]][keys[below - 1]].values())
                break
        if first_quoted < i:
            prompt = messages_text(action[_MESSAGES])
            for j, text in quoted:
                if j >= i:
                    break
                if text in prompt:
                    deps.add(j)
        action[_DEPENDS_ON] = sorted(deps)
        if same is None:
            of_task[task] = [i]
        else:
            same.append(i)
        for level, (level_task, step) in enumerate(chain):
            of_step = levels.setdefault(scopes[level], {}).get(step)
            if of_step is None:
                of_step = levels[scopes[level]][step] = {}
                insort(level_steps.setdefault(scopes[level], []), step)
            of_step[level_task] = i
