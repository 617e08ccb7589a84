"""GroupJudge (`group_judge`): one judge call sees all the episodes of one input and scores each against the others.

The K episodes the trainer samples per scenario are what its advantage compares; a judge that sees them side by side
ranks them far more consistently than one that rates each alone. One prompt holds the shared input once and, per
episode ("attempt"), each agent's turns, its tool calls and their results, and the outcome, every long text cut in
the middle; the rubric says what is good. The judge answers JSON under a ``response_format`` json_schema (`marft-lg
serve` decodes under the grammar exactly, vLLM takes it too) with a score in [0, 1] per attempt and, optionally, the
agent or step that went wrong (`blame`); a reply that is not that JSON is still read when its first JSON object is.

Position bias: the attempts are shown in an order shuffled per group (seeded by `seed` and the group's content, so a
rerun shows the same order and hits the cache); with `judge_twice` a second call shows them in the reverse order and
the two scores are averaged. A group the judge fails (exception, timeout, unreadable reply, wrong count) after
`retries` more tries is left unscored: `__call__` raises for its episodes, so `CompositeReward` leaves them out of
training, never scoring them 0. A group of one episode is judged alone: its score is absolute, not relative.

Replies are cached by the sha256 of the prompt, model, rubric and schema, in memory and, with `cache_dir`, on disk
(one JSON file per key, written atomically), so a resumed run pays for no group twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marft_lg._durable import write_atomic
from marft_lg.rewards.base import ComponentScore, RewardComponent, action_list
from marft_lg.rewards.components.judge import ClientEngine, JudgeError, _task_text, judge_engine
from marft_lg.rewards.registry import register_component
from marft_lg.serving.types import ChatRequest
from marft_lg.trajectories.dataset import Episode

DEFAULT_RUBRIC = (
    "Judge whether each attempt solves the task: a correct, complete final answer matters most; then sound steps "
    "(right tools with sensible arguments, tool errors handled, no loops or wasted turns, agents using each other's "
    "work). Score each attempt from 0 (wrong or no answer) to 1 (correct and well done), relative to the others: "
    "better attempts score higher, equally good ones equal."
)
SYSTEM_PROMPT = (
    "You compare several attempts by a team of AI agents at the same task and score each one. "
    "Answer with JSON only."
)
_CUT = " [... {n} chars cut ...] "


class GroupJudgeError(JudgeError):
    """The judge gave no usable scores for a group (after its retries); its episodes stay unscored."""


@register_component("group_judge")
@dataclass
class GroupJudge(RewardComponent):
    """A relative judge: one call per group of episodes of the same input; each episode's score in [0, 1].

    Engine: `engine` (a `Team` or anything with ``chat(list[ChatRequest])``, or an import path), else `base_url`
    (any OpenAI-compatible server; `model` names the served model, None: the first it lists, i.e. the base model
    without adapters; `api_key_env` names the environment variable holding the key). `rubric` says what is good;
    `max_chars` bounds each text in the prompt (cut in the middle); `retries` more tries after a failed call;
    `max_concurrency` groups judged at once (the engine must take calls from several threads: HTTP clients do);
    `cache_dir` keeps replies on disk; `seed` seeds the shuffled order; `judge_twice` judges again in reverse order
    and averages. `blame`: put the episode's deficit ``score - 1`` on the blamed agent's actions (shaped credit),
    the rest (1) on the terminal action, so the actions still sum to the score.
    """

    name = "group_judge"
    range = (0.0, 1.0)

    engine: Any = None
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    rubric: str = DEFAULT_RUBRIC
    max_chars: int = 600
    max_tokens: int = 512
    temperature: float = 0.0
    retries: int = 2
    timeout_s: float = 300.0
    max_concurrency: int = 8
    cache_dir: str | None = None
    seed: int = 0
    judge_twice: bool = False
    blame: bool = True

    def __post_init__(self) -> None:
        api_key = None
        if self.api_key_env:
            api_key = os.environ.get(self.api_key_env)
            if api_key is None:
                raise ValueError(f"group_judge: api_key_env names {self.api_key_env!r}, which is not set")
        # with neither an engine nor a base_url: the served base model, bound by whoever runs the reward with a team
        # (the trainer, a comparison: `bind_default_engine`)
        self._engine = None if self.engine is None and not self.base_url else judge_engine(
            self.engine, self.base_url, self.model, api_key=api_key, timeout_s=self.timeout_s, what="group_judge")
        if int(self.retries) < 0 or int(self.max_concurrency) < 1 or int(self.max_chars) < 40:
            raise ValueError("group_judge: retries must be >= 0, max_concurrency >= 1 and max_chars >= 40")
        self._results: dict[str, ComponentScore | Exception] = {}
        self._memo: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.calls = 0  # judge calls made (cache hits are not calls)

    def options(self) -> dict[str, Any]:
        """The YAML form: everything but a live engine object (give `base_url` or an import path instead)."""
        if self.engine is not None and not isinstance(self.engine, str):
            raise ValueError("a group_judge built from an engine object cannot be written to YAML; build it with "
                             "base_url= (or engine='pkg.mod:factory') to make it serialisable")
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def bind_default_engine(self, team: Any) -> None:
        """Judge with `team`'s base model without adapters (``agent: None``) when no engine or base_url was given
        (the latest team bound wins: a retraining job trains and compares on two teams)."""
        if self.engine is None and not self.base_url and callable(getattr(team, "chat", None)):
            self._engine = team

    # ---- the component -------------------------------------------------------------------------
    def prepare(self, groups: Sequence[Sequence[Episode]]) -> None:
        """Judge every group (at most `max_concurrency` at once); keep each episode's score or its group's error."""
        results: dict[str, ComponentScore | Exception] = {}
        groups = [list(g) for g in groups if g]

        def one(group: list[Episode]) -> None:
            try:
                scores: Mapping[str, ComponentScore | Exception] = self.score_group(group)
            except Exception as exc:  # a failed group is unscored, never 0
                scores = dict.fromkeys((ep.episode_id for ep in group), exc)
            with self._lock:
                results.update(scores)

        if len(groups) <= 1 or int(self.max_concurrency) == 1:
            for g in groups:
                one(g)
        else:
            with ThreadPoolExecutor(max_workers=min(int(self.max_concurrency), len(groups))) as pool:
                list(pool.map(one, groups))
        self._results = results

    def __call__(self, episode: Episode) -> ComponentScore:
        got = self._results.get(episode.episode_id)
        if got is None:  # not prepared (scored episode by episode): judged alone, an absolute score
            got = self.score_group([episode])[episode.episode_id]
        if isinstance(got, Exception):
            raise got
        return got

    # ---- one group -----------------------------------------------------------------------------
    def score_group(self, episodes: Sequence[Episode]) -> dict[str, ComponentScore]:
        """Judge `episodes` (any list, usually the episodes of one input) in one call (two with `judge_twice`):
        ``{episode_id: ComponentScore}``. Raises `GroupJudgeError` when the judge gives no usable scores."""
        episodes = list(episodes)
        if not episodes:
            return {}
        if len({ep.episode_id for ep in episodes}) != len(episodes):
            raise ValueError("group_judge: an episode is in the group twice")
        blocks = [render_episode(ep, self.max_chars) for ep in episodes]
        order = self._order(blocks)
        passes = [order, order[::-1]] if self.judge_twice and len(episodes) > 1 else [order]
        scores = [[0.0] * len(episodes) for _ in passes]
        blames: list[Any] = [None] * len(episodes)
        for p, shown in enumerate(passes):
            reply = self._judged(episodes, blocks, shown)
            for position, index in enumerate(shown):
                scores[p][index] = reply["scores"][position]
                if blames[index] is None:
                    blames[index] = reply["blames"][position]
        out = {}
        for i, ep in enumerate(episodes):
            value = sum(s[i] for s in scores) / len(scores)
            out[ep.episode_id] = ComponentScore(value, self._attribution(ep, value, blames[i]) if self.blame else {})
        return out

    def _order(self, blocks: list[str]) -> list[int]:
        """The shown order: a permutation seeded by `seed` and the group's content (not its order)."""
        digest = hashlib.sha256(json.dumps([self.seed, sorted(blocks)]).encode()).hexdigest()
        order = list(range(len(blocks)))
        random.Random(int(digest[:16], 16)).shuffle(order)
        return order

    def _judged(self, episodes: list[Episode], blocks: list[str], shown: list[int]) -> dict[str, Any]:
        """``{"scores": [...], "blames": [...]}`` in shown order: from the cache, else from the judge (retried)."""
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": self.prompt(_task_text(episodes[0]), [blocks[i] for i in shown])}]
        schema = judge_schema(len(shown))
        key = hashlib.sha256(json.dumps({"messages": messages, "model": self._model_label(), "rubric": self.rubric,
                                         "schema": schema}, sort_keys=True).encode()).hexdigest()
        cached = self._cached(key)
        if cached is not None:
            return cached
        request = ChatRequest(messages=messages, agent=None, max_tokens=int(self.max_tokens),
                              temperature=float(self.temperature),
                              constraint={"type": "json_schema", "name": "group_judgement", "schema": schema})
        problems = []
        for _ in range(int(self.retries) + 1):
            try:
                with self._lock:
                    self.calls += 1
                if self._engine is None:
                    raise GroupJudgeError("group_judge has no engine: give base_url (or engine), or score where a "
                                          "served team is bound (training, compare, a retraining job)")
                replies = self._engine.chat([request])
                if len(replies) != 1:
                    raise GroupJudgeError(f"the engine answered {len(replies)} replies to 1 request")
                parsed = parse_judgement(replies[0].text, len(shown))
            except Exception as exc:  # any failure of the call or the reply: try again, then give up on the group
                problems.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            self._store(key, parsed)
            return parsed
        ids = [ep.episode_id for ep in episodes]
        raise GroupJudgeError(f"group_judge: no usable judgement for the group {ids} after {len(problems)} "
                              f"tries: {problems[-1]}")

    def prompt(self, task: str, blocks: list[str]) -> str:
        """The user message: the shared input once, the attempts in shown order, the rubric and the answer's form."""
        task = cut(task, 4 * int(self.max_chars))
        attempts = "\n\n".join(f"### Attempt {i}\n{b}" for i, b in enumerate(blocks, start=1))
        return (f"## Task (the same for every attempt)\n{task}\n\n{attempts}\n\n## Rubric\n{self.rubric}\n\n"
                f"## Answer\nJSON: {{\"scores\": [{{\"attempt\": 1, \"score\": 0.0 to 1.0, \"blame\": \"the agent "
                f"or step (e.g. 'step 2') that went wrong, or empty\"}}, ...]}} with one entry per attempt, "
                f"{len(blocks)} in all, in attempt order.")

    def _attribution(self, episode: Episode, value: float, blame: Any) -> dict[int, float]:
        """The deficit ``value - 1`` spread over the blamed actions (an agent's actions, or one step)."""
        if value >= 1.0 or not episode.actions:
            return {}
        orders = blamed_orders(episode, blame)
        return {o: (value - 1.0) / len(orders) for o in orders} if orders else {}

    # ---- the cache -----------------------------------------------------------------------------
    def _model_label(self) -> str:
        if isinstance(self._engine, ClientEngine) and self._engine.model is None:
            with self._lock:  # the served model's name is part of the cache key: resolve it before the first key
                if self._engine.model is None:
                    served = self._engine.client.models()
                    if not served:
                        raise GroupJudgeError(f"group_judge: the server at {self.base_url} serves no model")
                    self._engine.model = served[0]
        return str(self.model or getattr(self._engine, "model", None) or getattr(self._engine, "model_name", None)
                   or self.base_url or "engine")

    def _cache_path(self, key: str) -> Path | None:
        return None if not self.cache_dir else Path(self.cache_dir) / key[:2] / f"{key}.json"

    def _cached(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        path = self._cache_path(key)
        if path is None or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            got = {"scores": [float(s) for s in data["scores"]], "blames": list(data["blames"])}
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a damaged entry is judged again and rewritten
        with self._lock:
            self._memo[key] = got
        return got

    def _store(self, key: str, parsed: dict[str, Any]) -> None:
        with self._lock:
            self._memo[key] = parsed
        path = self._cache_path(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"key": key, "model": self._model_label(), **parsed}))


def judge_schema(n: int) -> dict[str, Any]:
    """The JSON schema of a judgement of `n` attempts (the grammar `marft-lg serve` decodes under)."""
    item = {"type": "object", "additionalProperties": False,
            "properties": {"attempt": {"type": "integer", "minimum": 1, "maximum": n},
                           "score": {"type": "number", "minimum": 0, "maximum": 1},
                           "blame": {"type": "string", "maxLength": 80}},
            "required": ["attempt", "score", "blame"]}
    return {"type": "object", "additionalProperties": False,
            "properties": {"scores": {"type": "array", "items": item, "minItems": n, "maxItems": n}},
            "required": ["scores"]}


_DECODER = json.JSONDecoder()


def first_json_object(text: str) -> Any:
    """The first JSON object in `text` (a reply may wrap it in prose or a code fence); raises `GroupJudgeError`."""
    for m in re.finditer(r"\{", text or ""):
        try:
            obj, _ = _DECODER.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise GroupJudgeError(f"no JSON object in the judge's reply {str(text)[:200]!r}")


def parse_judgement(text: str, n: int) -> dict[str, Any]:
    """A reply -> ``{"scores": [n floats in [0, 1]], "blames": [n str | None]}`` in attempt order.

    Entries are placed by their `attempt` number when every entry has a distinct one in 1..n, else by position;
    a score a little outside [0, 1] is clipped, one on a 0-10 or 0-100 scale is not guessed at: the reply fails,
    as does a count other than `n`, a missing or non-numeric score."""
    obj = first_json_object(text)
    entries = obj.get("scores")
    if not isinstance(entries, list) or len(entries) != n:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise GroupJudgeError(f"the judge scored {got} attempts, not {n}: {str(text)[:200]!r}")
    if not all(isinstance(e, dict) for e in entries):
        entries = [{"score": e} for e in entries]  # a bare list of numbers, in attempt order
    numbers = [e.get("attempt") for e in entries]
    if sorted(x for x in numbers if isinstance(x, int) and not isinstance(x, bool)) == list(range(1, n + 1)):
        entries = sorted(entries, key=lambda e: e["attempt"])
    scores, blames = [], []
    for e in entries:
        s = e.get("score")
        if isinstance(s, bool) or not isinstance(s, int | float) or s != s:
            raise GroupJudgeError(f"the judge gave score {s!r}, not a number: {str(text)[:200]!r}")
        if not -0.05 <= s <= 1.05:
            raise GroupJudgeError(f"the judge gave score {s}, outside [0, 1]: {str(text)[:200]!r}")
        scores.append(min(1.0, max(0.0, float(s))))
        b = e.get("blame")
        blames.append(b if isinstance(b, int | str) and not isinstance(b, bool) and str(b).strip() else None)
    return {"scores": scores, "blames": blames}


def blamed_orders(episode: Episode, blame: Any) -> list[int]:
    """The action orders `blame` names: an agent's name (all its actions), or a step (``2``, ``"step 2"``) as the
    prompt numbers them (the action's `order`); [] when it names nothing in the episode."""
    if blame is None:
        return []
    orders = [int(a["order"]) for a in episode.actions]
    text = str(blame).strip()
    by_agent = [int(a["order"]) for a in episode.actions if str(a.get("agent")) == text]
    if by_agent:
        return by_agent
    m = re.fullmatch(r"(?:step\s*)?#?(\d+)", text, re.I)
    if m and int(m.group(1)) in orders:
        return [int(m.group(1))]
    lowered = text.lower()  # "the solver", "solver's second step": an agent named inside
    named = [a for a in dict.fromkeys(str(x.get("agent")) for x in episode.actions) if a.lower() in lowered]
    if len(named) == 1:
        return [int(a["order"]) for a in episode.actions if str(a.get("agent")) == named[0]]
    return []


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters: its head and tail kept, the middle cut and counted."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(limit - len(_CUT.format(n=len(text))), 10)
    head, tail = keep - keep // 3, keep // 3
    return text[:head] + _CUT.format(n=len(text) - head - tail) + text[len(text) - tail:]


def render_episode(episode: Episode, max_chars: int = 600) -> str:
    """One attempt, compactly: each step (its `order`) with the agent, its reply, its tool calls and their results
    or errors; then the outcome and, when the run failed, its status."""
    lines = []
    for a in episode.actions:
        lines.append(f"step {int(a['order'])} [{a.get('agent')}]: {cut(str(a.get('completion') or '').strip(), max_chars)}")
        for tc in action_list(a.get("tool_calls")):
            if not isinstance(tc, dict):
                continue
            args = tc.get("args", tc.get("arguments"))
            args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, default=str)
            call = f"  tool {tc.get('name')}({cut(args_text, max_chars // 3)})"
            if tc.get("error"):
                lines.append(f"{call} -> ERROR: {cut(str(tc['error']), max_chars // 2)}")
            else:
                lines.append(f"{call} -> {cut(str(tc.get('result', '')), max_chars // 2)}")
    if not episode.actions:
        lines.append("(no steps)")
    outcome = episode.info.get("outcome")
    if outcome is not None and not (isinstance(outcome, float) and outcome != outcome):
        text = outcome if isinstance(outcome, str) else json.dumps(outcome, ensure_ascii=False, default=str)
        lines.append(f"outcome: {cut(text, max_chars)}")
    if episode.info.get("status") not in (None, "ok"):
        lines.append(f"status: {episode.info.get('status')}")
    return "\n".join(lines)
