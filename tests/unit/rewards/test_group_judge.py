"""group_judge: one judge call per group of episodes of one input; scores land on the right episodes and actions."""

from __future__ import annotations

import json
import re
import threading

import httpx
import numpy as np
import pytest
from rewards_factory import make_dataset, make_episode, tool

from marft_lg.rewards import CompositeReward, GroupJudge
from marft_lg.rewards.components.group_judge import (
    GroupJudgeError,
    blamed_orders,
    cut,
    judge_schema,
    parse_judgement,
    render_episode,
)
from marft_lg.serving.http.client import OpenAIEngineClient
from marft_lg.serving.types import ChatRequest, Completion

_QUALITY = re.compile(r"quality=([0-9.]+)")
_ATTEMPT = re.compile(r"### Attempt (\d+)\n(.*?)(?=\n### Attempt |\n## Rubric)", re.S)


def _reply(text: str) -> Completion:
    return Completion(text=text, prompt_token_ids=[], completion_token_ids=[], logprobs=[])


class FakeJudge:
    """Scores each attempt shown by the ``quality=X`` its text holds (so the shuffled order must be undone), blames
    the agent named by ``blame=NAME``; `fail` maps a substring of the prompt to what to do instead."""

    def __init__(self, fail: dict[str, str] | None = None, bias: float = 0.0):
        self.requests: list[ChatRequest] = []
        self.fail = fail or {}
        self.bias = bias  # added to the first attempt shown (a position bias)
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        return len(self.requests)

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        with self._lock:
            self.requests.extend(requests)
        prompt = requests[0].messages[-1]["content"]
        for marker, what in self.fail.items():
            if marker in prompt:
                if what == "garbage":
                    return [_reply("I think attempt 1 is better, really.")]
                if what == "timeout":
                    raise httpx.ReadTimeout("judge timed out")
                if what == "count":
                    return [_reply(json.dumps({"scores": [{"attempt": 1, "score": 0.5, "blame": ""}]}))]
                raise RuntimeError("judge crashed")
        entries = []
        for i, (number, block) in enumerate(_ATTEMPT.findall(prompt)):
            q = float(_QUALITY.search(block).group(1))
            if i == 0:
                q = min(1.0, q + self.bias)
            m = re.search(r"blame=(\w+)", block)
            entries.append({"attempt": int(number), "score": q, "blame": m.group(1) if m else ""})
        return [_reply("Here you go:\n```json\n" + json.dumps({"scores": entries[::-1]}) + "\n```")]


def _episodes(scenario_id: str, qualities: list[float], *, blame: str | None = None) -> list[dict]:
    out = []
    for i, q in enumerate(qualities):
        tail = f" blame={blame}" if blame and q < 1 else ""
        out.append({"episode_id": f"{scenario_id}-{i}", "scenario_id": scenario_id, "outcome": json.dumps({"q": q}),
                    "actions": [{"agent": "planner", "completion": f"plan for {scenario_id} #{i}"},
                                {"agent": "solver", "completion": f"answer quality={q}{tail}",
                                 "tool_calls": [tool("calc", result="42")]}]})
    return out


def _reward(judge: GroupJudge, credit: str = "shaped") -> CompositeReward:
    return CompositeReward({"group_judge": 1.0}, {"group_judge": judge}, credit=credit)


def test_scores_land_on_the_right_episodes_through_shuffling_and_reach_action_rewards():
    fake = FakeJudge()
    qualities = [0.1, 0.9, 0.4, 0.7, 0.25]
    ds = make_dataset(_episodes("s1", qualities) + _episodes("s2", [0.3, 0.6]))
    result = _reward(GroupJudge(engine=fake, seed=3)).score(ds)
    eps = result.episodes.set_index("episode_id")
    assert eps["scored"].all()
    for i, q in enumerate(qualities):
        assert eps.loc[f"s1-{i}", "reward"] == pytest.approx(q)
        assert result.action_rewards[f"s1-{i}"].sum() == pytest.approx(q)
    assert eps.loc["s2-1", "group_judge"] == pytest.approx(0.6)
    assert fake.calls == 2  # one call per group
    shown = [int(x) for r in fake.requests for x in re.findall(r"plan for s1 #(\d)", r.messages[-1]["content"])]
    assert sorted(shown) == list(range(len(qualities)))
    assert shown != sorted(shown)  # the order was shuffled (seeded: the same every run)
    request = fake.requests[0]
    assert request.constraint["type"] == "json_schema" and request.agent is None
    assert request.messages[-1]["content"].count("## Task") == 1  # the shared input once


def test_blame_puts_the_deficit_on_the_blamed_agents_actions():
    fake = FakeJudge()
    ds = make_dataset(_episodes("s1", [0.4, 1.0], blame="planner"))
    result = _reward(GroupJudge(engine=fake)).score(ds)
    bad = result.action_rewards["s1-0"]  # planner at order 0, solver (terminal) at order 1
    assert bad == pytest.approx(np.array([0.4 - 1.0, 1.0]))
    assert result.action_rewards["s1-1"] == pytest.approx(np.array([0.0, 1.0]))
    terminal = _reward(GroupJudge(engine=FakeJudge()), credit="terminal").score(ds)
    assert terminal.action_rewards["s1-0"] == pytest.approx(np.array([0.0, 0.4]))


def test_blamed_orders_reads_agents_and_steps():
    ep = make_episode([{"agent": "planner"}, {"agent": "solver"}, {"agent": "planner"}])
    assert blamed_orders(ep, "planner") == [0, 2]
    assert blamed_orders(ep, "step 1") == [1]
    assert blamed_orders(ep, 2) == [2]
    assert blamed_orders(ep, "the solver's step") == [1]
    assert blamed_orders(ep, "nobody") == [] and blamed_orders(ep, None) == []


@pytest.mark.parametrize("failure", ["garbage", "exception", "timeout", "count"])
def test_a_failed_group_is_unscored_and_the_others_are_scored(failure):
    fake = FakeJudge(fail={"plan for bad": failure})
    ds = make_dataset(_episodes("bad", [0.2, 0.8]) + _episodes("good", [0.3, 0.6]))
    result = _reward(GroupJudge(engine=fake, retries=1)).score(ds)
    eps = result.episodes.set_index("episode_id")
    assert not eps.loc["bad-0", "scored"] and not eps.loc["bad-1", "scored"]
    assert np.isnan(eps.loc["bad-0", "reward"]) and "GroupJudgeError" in eps.loc["bad-0", "error"]
    assert "bad-0" not in result.action_rewards  # the trainer leaves it out, never trains on a 0
    assert eps.loc["good-1", "scored"] and eps.loc["good-1", "reward"] == pytest.approx(0.6)
    bad_calls = sum("plan for bad" in r.messages[-1]["content"] for r in fake.requests)
    assert bad_calls == 2  # the first try and one retry


def test_cache_hit_avoids_a_second_call_across_instances(tmp_path):
    ds = make_dataset(_episodes("s1", [0.2, 0.9, 0.5]))
    first = FakeJudge()
    a = _reward(GroupJudge(engine=first, cache_dir=str(tmp_path / "cache"))).score(ds)
    assert first.calls == 1
    again = _reward(GroupJudge(engine=first, cache_dir=str(tmp_path / "cache")))
    judge = again.components["group_judge"]
    judge._memo.clear()
    b = again.score(ds)
    assert first.calls == 1  # read from disk: a resumed run pays nothing twice
    assert list(a.episodes["reward"]) == list(b.episodes["reward"])
    files = list((tmp_path / "cache").rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["scores"]
    memo = GroupJudge(engine=first)
    _reward(memo).score(ds)
    _reward(memo).score(ds)
    assert first.calls == 2  # without a cache_dir, the same instance remembers in memory


def test_judge_twice_averages_the_two_orders():
    fake = FakeJudge(bias=0.3)  # the first attempt shown gets +0.3
    ds = make_dataset(_episodes("s1", [0.2, 0.5, 0.6]))
    result = _reward(GroupJudge(engine=fake, judge_twice=True)).score(ds)
    assert fake.calls == 2
    first_shown = [re.search(r"### Attempt 1\n.*?#(\d)", r.messages[-1]["content"], re.S).group(1)
                   for r in fake.requests]
    assert first_shown[0] != first_shown[1]  # the second pass shows the reverse order
    rewards = result.episodes.set_index("episode_id")["reward"]
    for i, q in enumerate([0.2, 0.5, 0.6]):
        expected = q + sum(0.15 if first == str(i) else 0.0 for first in first_shown)
        assert rewards[f"s1-{i}"] == pytest.approx(min(expected, 1.0))


def test_a_group_of_one_is_judged_alone_and_score_group_takes_any_list():
    fake = FakeJudge()
    ds = make_dataset([{**e, "scenario_id": None} for e in _episodes("x", [0.3, 0.8])])
    result = _reward(GroupJudge(engine=fake)).score(ds)
    assert fake.calls == 2  # no scenario: each episode is a group of its own
    assert result.episodes["reward"].tolist() == pytest.approx([0.3, 0.8])
    episodes = list(make_dataset(_episodes("a", [0.1]) + _episodes("b", [0.7])).iter_episodes())
    scores = GroupJudge(engine=fake).score_group(episodes)
    assert {k: v.value for k, v in scores.items()} == pytest.approx({"a-0": 0.1, "b-0": 0.7})
    alone = GroupJudge(engine=fake)(episodes[1])  # scored without prepare: alone
    assert alone.value == pytest.approx(0.7)


def test_unfinished_episodes_are_not_sent_to_the_judge():
    fake = FakeJudge()
    eps = _episodes("s1", [0.2, 0.9])
    eps[1]["status"] = "error"
    result = _reward(GroupJudge(engine=fake)).score(make_dataset(eps))
    assert fake.calls == 1 and "s1-1" not in fake.requests[0].messages[-1]["content"]
    assert result.episodes["scored"].tolist() == [True, False]


def test_parse_judgement_is_robust_and_strict():
    text = 'Sure! {"scores": [{"attempt": 2, "score": 1.02, "blame": ""}, {"attempt": 1, "score": 0.3, "blame": "solver"}]} ok'
    assert parse_judgement(text, 2) == {"scores": [0.3, 1.0], "blames": ["solver", None]}
    assert parse_judgement('{"scores": [0.1, 0.2]}', 2)["scores"] == [0.1, 0.2]
    for bad in ['{"scores": [0.1]}', "no json", '{"scores": [{"score": "high"}, {"score": 1}]}',
                '{"scores": [{"score": 7}, {"score": 1}]}', '{"verdict": 1}']:
        with pytest.raises(GroupJudgeError):
            parse_judgement(bad, 2)


def test_rendering_is_compact():
    long = "x" * 5000
    ep = make_episode([{"agent": "solver", "completion": long, "tool_calls": [tool("search", error="boom")]}],
                      outcome=json.dumps({"answer": long}))
    text = render_episode(ep, 300)
    assert "step 0 [solver]" in text and "tool search" in text and "ERROR: boom" in text and "outcome:" in text
    assert len(text) < 1000 and "chars cut" in text
    assert cut("short", 100) == "short" and len(cut(long, 100)) <= 110


def test_yaml_round_trip_and_options(tmp_path):
    spec = {"weights": {"group_judge": 1.0}, "components": {"group_judge": {
        "base_url": "http://127.0.0.1:9/v1", "model": "base", "rubric": "Correct answers win.", "retries": 1,
        "cache_dir": str(tmp_path), "max_concurrency": 2, "seed": 7, "judge_twice": True}}}
    reward = CompositeReward.from_yaml(spec)
    opts = reward.to_dict()["components"]["group_judge"]
    assert opts["rubric"] == "Correct answers win." and opts["judge_twice"] is True and opts["seed"] == 7
    again = CompositeReward.from_yaml(reward.to_dict())
    assert again.to_dict() == reward.to_dict()
    with pytest.raises(ValueError, match="serialisable"):
        GroupJudge(engine=FakeJudge()).options()
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR"):
        GroupJudge(base_url="http://127.0.0.1:9/v1", api_key_env="NO_SUCH_KEY_VAR")


def test_http_sends_response_format_json_schema_and_the_key(monkeypatch, tmp_path):
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base-model"}]})
        body = json.loads(request.content)
        seen.append({"body": body, "auth": request.headers.get("authorization")})
        extra = sorted({"logprobs", "return_token_ids"} & set(body))
        if extra:  # a strict hosted endpoint refuses fields it does not know
            return httpx.Response(400, json={"error": {"message": f"Unrecognized request arguments: {extra}"}})
        n = len(re.findall(r"### Attempt \d", body["messages"][-1]["content"]))
        content = json.dumps({"scores": [{"attempt": i + 1, "score": 0.5, "blame": ""} for i in range(n)]})
        # an OpenAI-compatible server that returns neither token ids nor logprobs: the judge needs the text only
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})

    monkeypatch.setenv("JUDGE_KEY", "sekret")

    def judge() -> GroupJudge:
        out = GroupJudge(base_url="http://judge.test/v1", api_key_env="JUDGE_KEY", cache_dir=str(tmp_path),
                         max_concurrency=3)
        assert out._engine.client.api_key == "sekret" and out._engine.client.text_only  # a judge reads text only
        out._engine.client = OpenAIEngineClient("http://judge.test/v1", api_key="sekret", text_only=True,
                                                transport=httpx.MockTransport(handler))
        return out

    ds = make_dataset(_episodes("s1", [0.1, 0.9]) + _episodes("s2", [0.3]) + _episodes("s3", [0.3, 0.4, 0.5]))
    result = _reward(judge()).score(ds)
    assert result.episodes["reward"].tolist() == [0.5] * 6
    body = seen[0]["body"]
    assert body["model"] == "base-model" and seen[0]["auth"] == "Bearer sekret"
    fmt = body["response_format"]
    n = len(re.findall(r"### Attempt \d", body["messages"][-1]["content"]))
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == judge_schema(n)
    assert len(seen) == 3
    _reward(judge()).score(ds)  # a resumed run: the model is resolved before the cache keys, every group hits
    assert len(seen) == 3


@pytest.fixture(scope="module")
def team(tiny_model_dir):
    import torch

    from marft_lg.serving.team import Team

    torch.set_num_threads(1)
    with Team(tiny_model_dir, ["planner"], versions=None, model_name="tiny") as t:
        yield t


def test_real_marft_serve_decodes_the_judgement_under_the_json_schema(http_url):
    """`marft-lg serve` with the tiny random model: its scores are noise, but the grammar makes the reply parse."""
    judge = GroupJudge(base_url=http_url, retries=0, max_chars=80, max_tokens=400)
    result = _reward(judge).score(make_dataset(_episodes("s1", [0.2, 0.9])))
    assert judge._engine.model == "tiny"  # model: null took the served base model
    eps = result.episodes
    assert eps["scored"].all(), eps["error"].tolist()
    assert all(0.0 <= r <= 1.0 for r in eps["reward"])
    assert judge.calls == 1


def test_a_comparison_judges_each_units_live_and_candidate_episodes_in_one_call():
    """`compare_datasets` with a relative judge: one call per paired unit sees the baseline and the candidate
    episodes of the same input side by side; the paired delta is the judge's, in both positions (judge_twice)."""
    from marft_lg.evaluation.comparison import compare_datasets

    base = make_dataset([{**e, "episode_id": f"b-{e['episode_id']}"} for sid in ("s1", "s2", "s3")
                         for e in _episodes(sid, [0.25])])
    cand = make_dataset([{**e, "episode_id": f"c-{e['episode_id']}"} for sid in ("s1", "s2", "s3")
                         for e in _episodes(sid, [0.75])])
    judge = FakeJudge(bias=0.1)
    reward = CompositeReward({"group_judge": 1.0}, {"group_judge": GroupJudge(engine=judge, judge_twice=True)})
    result = compare_datasets(base, cand, reward, n_resamples=200)
    assert judge.calls == 6  # one group per unit holding both sides, judged in both orders
    for request in judge.requests:
        prompt = request.messages[-1]["content"]
        assert prompt.count("### Attempt") == 2 and "quality=0.25" in prompt and "quality=0.75" in prompt
    assert result.n_pairs == 3
    assert result.team.mean == pytest.approx(0.5)  # the first-position bias cancels out over both orders


def test_with_no_endpoint_the_judge_is_the_served_base_model_bound_by_the_trainer(team, tmp_path):
    """`group_judge` given neither engine nor base_url: unscored (saying so) until a trainer or a comparison binds
    the team it runs; then the team's base model without adapters judges."""
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    ds = make_dataset(_episodes("s1", [0.2, 0.9]))
    reward = _reward(GroupJudge(retries=0, max_chars=80, max_tokens=400))
    alone = reward.score(ds)
    assert not alone.episodes["scored"].any() and "has no engine" in alone.episodes["error"].iloc[0]
    MARFTTrainer(team, reward, MARFTConfig(plots=False), tmp_path / "run", progress=False)
    judge = reward.components["group_judge"]
    assert judge._engine is team
    scored = reward.score(ds)
    assert scored.episodes["scored"].all() and scored.episodes["reward"].between(0, 1).all()
    assert judge.calls == 2  # one failed try before the binding, one call after
