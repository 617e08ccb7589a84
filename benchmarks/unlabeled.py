"""Evidence without labels: the math team trained WITHOUT written answers, at equal training time, against the
same team trained with them. The held-out gain is always measured WITH the references (the demo's comparison:
untuned vs tuned, greedy, on the same held-out problems, paired 95% CI of the math team's reward, strict accuracy).

Arms (each per seed, each on a fresh untuned team, each given the same `--minutes` of training wall time):

- ``reference``: on-policy MARFT with the math team's reward as is (task_completion against the reference,
  format_compliance, goal_progress).
- ``judge_base``: on-policy MARFT with ``group_judge`` (one call per group of K episodes of a problem) served by the
  base model without adapters (engine: the training `Team` itself, agent None, as ``GroupJudge(engine=team)``
  does) with weight 1, plus the math reward's ``format_compliance`` (0.5), which needs no reference (it checks the
  actor's ``\\boxed{N}`` format). ``goal_progress`` is left out: its checkpoints are the problem's written
  intermediate results, i.e. labels. The training problems are given to the trainer with no reference and no
  checkpoints. The judge's calls run inside the training iterations, so they count against the arm's minutes.
- ``judge_sim_e10`` / ``judge_sim_e30``: the same reward, but the judge is a SIMULATED STRONG JUDGE
  (`SimulatedJudge`, an engine in this file): it reads the attempts out of the group_judge prompt ("### Attempt N"
  blocks), checks each attempt's final answer (the actor's last step: its ``\\boxed{}`` content, else its last
  number) against the problem's reference, which it is given out of band (by question text), scores 1 or 0 and
  flips each verdict with probability e = 0.1 / 0.3 (seeded by the seed and the attempt's content, so reruns flip
  the same verdicts). It costs no model time. The results say it is simulated.
- ``production_loop``: traffic with no references: the untuned team answers the first `n_traffic` training
  problems, each asked `traffic_repeats` times by different users, through ``wrap`` with a LangGraph thread id per
  conversation (no scenario id, no reference); a simulated user approves a right answer with probability 0.9 and a
  wrong one with 0.1 (`SimulatedUser`), recorded after the run through ``record_feedback(thread_id=...,
  name="thumbs", value=1/0)``. The traces are mined (the feedback joins its episode by thread id), the users'
  questions become the scenarios (``scenarios_from_dataset``: deduplicated inputs, no reference), and the team is
  trained offline on the mined traffic with the ``feedback`` reward (key ``thumbs``): a warm start first
  (``MARFTTrainer.fit_warm_start`` with ``WarmStartConfig(keep="feedback", feedback="thumbs")``), then offline MARFT
  iterations until the arm's minutes are spent. Serving the traffic is production's cost, not training's: it is
  timed and reported apart.
- ``production_loop_format``: the same loop with the thumbs beside the math reward's ``format_compliance`` (0.5, no
  reference needed), the label-free term the judge arms also carry: an answer the token cap cuts off before its
  ``\\boxed{}`` is then penalised directly, not only through the users' noisy thumbs.

``--app tools`` runs the arms other than the production loop on a tool-using app instead: examples/supervisor_tools
(a supervisor that hands off by a forced tool call to a researcher with ``lookup`` and a mathematician with add /
multiply / divide), with benchmarks/credit_tools.py's generated questions (a held-out set of 32, a training stream),
trainer settings (2 questions per iteration, K 4, 48-token replies, a LangGraph step limit of 8) and reward
(``reference``: the answer contains the reference, goal_progress on the hand-off and tool checkpoints, tool errors
and steps cost a little). Its judge arms use ``group_judge`` with the two label-free costs; the simulated judge
checks the last worker reply contains the reference. The held-out "strict" accuracy is the share of answers that
contain the reference, and the run keeps each component's mean per side (right hand-off and tool, answer, costs).
Its runs carry ``app: tools`` and their budget (``app_budget``); the summary's keys are ``tools:<arm>``.

For each judge arm, its agreement with the references is measured on the training episodes it scored: the share
of episodes whose judge score >= 0.5 equals the reference correctness (the reference reward's ``task_completion``
rule: the actor's boxed answer, else its last number, equals the reference). For the production loop the same is
reported for the users' thumbs.

Usage (do not run the full benchmark on a busy machine):

    python benchmarks/unlabeled.py                         # full: 6 arms x seeds 0,1,2
    python benchmarks/unlabeled.py --arms reference,judge_sim_e10 --seeds 0 --append
    python benchmarks/unlabeled.py --budget smoke --model DIR --out /tmp/u.json   # seconds, tiny model
    python benchmarks/unlabeled.py --app tools --seeds 0 --append   # the tool-using app: 4 arms

Expected time on 2 quiet CPU cores (full budget): about 15 min per arm and seed (8 min of training, the rest the
held-out comparison on 128 problems, serving, and for the loop its traffic), i.e. (4 arms + 2 loops) x 3 seeds x
~15 min, about 4 hours. ``--append`` keeps the runs already in the results file and skips (arm, seed) pairs it
holds, so an interrupted run resumes. Writes benchmarks/results/unlabeled.json (top-level ``commit``: the code
measured, ``marft_lg._provenance.code_state``) and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from marft_lg.demo import BUDGETS as DEMO_BUDGETS

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # credit_tools.py: the tool-using app's questions and reward
    sys.path.insert(0, str(ROOT / "benchmarks"))
DEMO_FULL = DEMO_BUDGETS["full"]
TRAINING_MINUTES = 8.0  # every arm's training wall time at full: the demo's on-policy minutes before its deadline
RESULTS = ROOT / "benchmarks" / "results" / "unlabeled.json"
APPS = ("math", "tools")
LOOP_ARMS = ("production_loop", "production_loop_format")
ARMS = ("reference", "judge_base", "judge_sim_e10", "judge_sim_e30", *LOOP_ARMS)
SIM_ERROR = {"judge_sim_e10": 0.1, "judge_sim_e30": 0.3}
JUDGE_ARMS = ("judge_base", *SIM_ERROR)
TOOLS_ARMS = ("reference", *JUDGE_ARMS)  # the production loops run on the math team only
TOOLS_LABEL_FREE = ("tool_error_rate", "step_count")  # the tool app reward's terms that need no reference
FEEDBACK_KEY = "thumbs"
SIMULATED_NOTE = ("judge_sim_* arms use a SIMULATED strong judge: it checks each attempt's final answer against the "
                  "reference (given to it out of band) and flips each verdict with probability e; no model judges")
REWARD_NOTE = ("judge arms: group_judge (weight 1) + format_compliance (weight 0.5, no reference needed); "
               "goal_progress left out (its checkpoints are written intermediate results); training problems given "
               "without reference or checkpoints. production_loop: feedback (key thumbs) only; production_loop_format: "
               "feedback 1 + format_compliance 0.5.")
TOOLS_NOTE = ("app tools: examples/supervisor_tools (a supervisor handing off by tool call to a researcher with lookup "
              "and a mathematician with add/multiply/divide), benchmarks/credit_tools.py's generated questions, "
              "trainer settings and reward (reference arm: task_completion contains the reference 1.0, goal_progress "
              "on the hand-off and tool checkpoints 0.5, tool_error_rate -0.2, step_count -0.02); judge arms: "
              "group_judge 1.0 with the two label-free costs; the simulated judge checks the last worker reply "
              "contains the reference; 'strict' accuracy is the share of held-out answers containing the reference")


@dataclass(frozen=True)
class Budget:
    """How much work each arm does. `minutes`: the training wall time every arm gets (`TRAINING_MINUTES` at full);
    on-policy arms stop at `online_iterations` or `minutes`, whichever comes first."""

    name: str
    minutes: float
    n_heldout: int
    online_iterations: int
    scenarios_per_iteration: int
    group_size: int
    max_tokens: int
    n_traffic: int  # production loop: training problems asked as traffic
    traffic_repeats: int  # ... each by this many users (the offline groups)
    judge_max_tokens: int

    @property
    def n_train(self) -> int:
        return max(self.online_iterations * self.scenarios_per_iteration, self.n_traffic)


TOOLS_BUDGETS = {  # credit_tools' shape: 2 questions per iteration, K 4, 48-token replies; the same training minutes
    "full": Budget("full", minutes=TRAINING_MINUTES, n_heldout=32, online_iterations=1000,
                   scenarios_per_iteration=2, group_size=4, max_tokens=48, n_traffic=0, traffic_repeats=0,
                   judge_max_tokens=256),
    "smoke": Budget("smoke", minutes=0.1, n_heldout=2, online_iterations=1, scenarios_per_iteration=1,
                    group_size=2, max_tokens=8, n_traffic=0, traffic_repeats=0, judge_max_tokens=96),
}
TOOLS_RECURSION_LIMIT = 8  # credit_tools' default: a worker's ReAct loop ends after at most 4 calls
TOOLS_STREAM = 400  # questions generated for the training stream (2 per iteration: far more than 8 minutes use)

BUDGETS = {
    # the demo's full budget: its held-out set, iterations, problems per iteration, K, reply cap; 8 training minutes
    "full": Budget("full", minutes=TRAINING_MINUTES, n_heldout=DEMO_FULL.n_heldout,
                   online_iterations=DEMO_FULL.online_iterations,
                   scenarios_per_iteration=DEMO_FULL.scenarios_per_iteration, group_size=DEMO_FULL.group_size,
                   max_tokens=DEMO_FULL.max_tokens, n_traffic=32, traffic_repeats=4, judge_max_tokens=256),
    "smoke": Budget("smoke", minutes=0.1, n_heldout=3, online_iterations=1, scenarios_per_iteration=1,
                    group_size=2, max_tokens=8, n_traffic=2, traffic_repeats=2, judge_max_tokens=96),
}


# ---- pure parts (unit-tested) -------------------------------------------------------------------------------------
_ATTEMPT = re.compile(r"^### Attempt (\d+)\n", re.M)
_STEP = re.compile(r"^step \d+ \[([^\]\n]*)\]: ?", re.M)


def parse_prompt(prompt: str) -> tuple[str, list[str]]:
    """A group_judge user message -> (the task text, the attempt blocks in shown order)."""
    head, sep, rest = prompt.partition("## Task (the same for every attempt)\n")
    if not sep:
        raise ValueError("not a group_judge prompt: no '## Task' section")
    body = rest.split("\n\n## Rubric\n", 1)[0]
    marks = list(_ATTEMPT.finditer(body))
    if not marks:
        raise ValueError("not a group_judge prompt: no '### Attempt' block")
    task = body[:marks[0].start()].strip()
    blocks = [body[m.end():(marks[i + 1].start() if i + 1 < len(marks) else len(body))].strip()
              for i, m in enumerate(marks)]
    if [int(m.group(1)) for m in marks] != list(range(1, len(marks) + 1)):
        raise ValueError("the attempts are not numbered 1..n")
    return task, blocks


def final_answer(block: str, agent: str | Sequence[str] = "actor") -> str:
    """The text of the last step of `agent` (or of any of several answer agents) in a rendered attempt ('' when
    none acted)."""
    agents = {agent} if isinstance(agent, str) else set(agent)
    marks = list(_STEP.finditer(block))
    texts = []
    for i, m in enumerate(marks):
        if m.group(1) not in agents:
            continue
        end = marks[i + 1].start() if i + 1 < len(marks) else len(block)
        text = block[m.end():end]
        text = re.split(r"\n(?:  tool |outcome: |status: )", text, maxsplit=1)[0]  # a reply may span lines
        texts.append(text.strip())
    return texts[-1] if texts else ""


def answer_correct(text: str | None, reference: Any, match: str = "math") -> bool:
    """The reference reward's rule. ``math``: the ``\\boxed{}`` content, else the last number, equals `reference`;
    ``contains`` (the tool-using app's `task_completion`): the normalised answer contains the normalised reference."""
    from marft_lg.rewards.answers import answers_match, extract_boxed, last_number, to_number

    if text is None or reference is None:
        return False
    if match == "contains":
        return answers_match(text, reference, mode="contains")
    boxed = extract_boxed(text)
    answer = boxed if boxed is not None else last_number(text)
    if answer is None:
        return False
    a, r = to_number(answer), to_number(str(reference))
    return a == r if a is not None and r is not None else answer.strip() == str(reference).strip()


def _unit(*parts: Any) -> float:
    """A uniform number in [0, 1) from `parts` (stable across runs and thread orders)."""
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()
    return int(digest[:16], 16) / 2**64


class SimulatedJudge:
    """A SIMULATED strong judge: an engine (``chat(list[ChatRequest]) -> list[Completion]``) for group_judge.

    `references` maps a question (as it appears in the prompt's task) to its reference answer, given out of band.
    Each attempt scores 1 when its final answer is right, else 0, and the verdict is flipped with probability
    `error` (decided by `seed` and the attempt's content). A prompt whose task holds no known question raises (the
    group stays unscored). Counts its calls, verdicts and flips."""

    model_name = "simulated-judge"

    def __init__(self, references: Mapping[str, Any], error: float, seed: int = 0,
                 agent: str | Sequence[str] = "actor", match: str = "math"):
        if not 0.0 <= float(error) <= 1.0:
            raise ValueError(f"error must be in [0, 1], got {error!r}")
        self.references = {str(q): r for q, r in references.items()}
        self.error, self.seed, self.agent, self.match = float(error), int(seed), agent, match
        self.calls = self.verdicts = self.flips = 0
        self._lock = threading.Lock()

    def reference_for(self, task: str) -> Any:
        hits = [q for q in self.references if q and q in task]
        if not hits:
            raise ValueError(f"simulated judge: no reference for the task {task[:120]!r}")
        return self.references[max(hits, key=len)]

    def judge(self, prompt: str) -> list[float]:
        task, blocks = parse_prompt(prompt)
        reference = self.reference_for(task)
        scores, flips = [], 0
        for i, block in enumerate(blocks, start=1):
            right = answer_correct(final_answer(block, self.agent), reference, self.match)
            flip = _unit(self.seed, task, block, i) < self.error
            flips += flip
            scores.append(float(right != flip))
        with self._lock:
            self.calls += 1
            self.verdicts += len(blocks)
            self.flips += flips
        return scores

    def chat(self, requests: Sequence[Any]) -> list[Any]:
        from marft_lg.serving.types import Completion

        out = []
        for req in requests:
            prompt = next(m["content"] for m in reversed(req.messages) if m.get("role") == "user")
            scores = self.judge(str(prompt))
            text = json.dumps({"scores": [{"attempt": i, "score": s, "blame": ""}
                                          for i, s in enumerate(scores, start=1)]})
            out.append(Completion(text=text, prompt_token_ids=[], completion_token_ids=[], logprobs=[],
                                  model=self.model_name))
        return out


class SimulatedUser:
    """Approves a right answer with probability `p_right`, a wrong one with `p_wrong` (seeded by `seed` and the
    conversation's key, so the same conversation always gets the same verdict)."""

    def __init__(self, p_right: float = 0.9, p_wrong: float = 0.1, seed: int = 0):
        self.p_right, self.p_wrong, self.seed = float(p_right), float(p_wrong), int(seed)

    def approves(self, correct: bool, key: str) -> bool:
        return _unit("user", self.seed, key) < (self.p_right if correct else self.p_wrong)


def agreement(pairs: Iterable[tuple[float | None, bool]]) -> dict[str, Any]:
    """(judge score, reference correctness) pairs -> ``{"n", "agree", "rate", "on_right", "on_wrong"}``: the share
    whose score >= 0.5 equals the correctness, overall and on the right and the wrong answers apart (where most
    answers are wrong, a judge calling everything wrong agrees often: the split shows it); unscored pairs (None /
    NaN) are left out."""
    counts = {True: [0, 0], False: [0, 0]}  # correctness -> [n, agree]
    for score, correct in pairs:
        if score is None or (isinstance(score, float) and math.isnan(score)):
            continue
        c = counts[bool(correct)]
        c[0] += 1
        c[1] += (float(score) >= 0.5) == bool(correct)

    def share(n: int, agree: int) -> dict[str, Any]:
        return {"n": n, "agree": agree, "rate": agree / n if n else None}

    total = share(counts[True][0] + counts[False][0], counts[True][1] + counts[False][1])
    return {**total, "on_right": share(*counts[True]), "on_wrong": share(*counts[False])}


def approval_rates(pairs: Iterable[tuple[bool, bool]]) -> dict[str, Any]:
    """(correct, approved) pairs -> ``{"right": {"n", "approved", "rate"}, "wrong": {...}}``."""
    pairs = list(pairs)
    out = {}
    for side, want in (("right", True), ("wrong", False)):
        got = [bool(a) for c, a in pairs if bool(c) == want]
        out[side] = {"n": len(got), "approved": sum(got), "rate": sum(got) / len(got) if got else None}
    return out


def app_of(run: Mapping[str, Any]) -> str:
    """The app a run trained (runs written before the tool-using app have no `app`: the math team)."""
    return run.get("app") or "math"


def run_key(run: Mapping[str, Any]) -> tuple[str, str, int]:
    return app_of(run), run["arm"], run["seed"]


def summary_key(app: str, arm: str) -> str:
    """The summary's key of an arm: the arm for the math team, ``tools:<arm>`` for the tool-using app."""
    return arm if app == "math" else f"{app}:{arm}"


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per app and arm: the seeds run, the mean held-out gain over seeds, how many seeds' CI is above 0, mean
    agreement."""
    out: dict[str, Any] = {}
    for app, arm in ((app, arm) for app in APPS for arm in ARMS):
        rows = sorted((r for r in runs if r["arm"] == arm and app_of(r) == app), key=lambda r: r["seed"])
        if not rows:
            continue
        gains = [r["heldout"]["gain"]["mean"] for r in rows if r["heldout"]["gain"].get("mean") is not None]
        rates = [r["agreement"]["rate"] for r in rows if (r.get("agreement") or {}).get("rate") is not None]
        out[summary_key(app, arm)] = {"seeds": [r["seed"] for r in rows], "gain_mean": statistics.fmean(gains) if gains else None,
                    "seeds_ci_above_zero": sum(1 for r in rows if (r["heldout"]["gain"].get("low") or 0) > 0),
                    "agreement_mean": statistics.fmean(rates) if rates else None,
                    "simulated_judge": arm in SIM_ERROR}
    return out


def results_doc(runs: Sequence[Mapping[str, Any]], budget: Budget, *, code: Mapping[str, Any],
                machine: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The results file: provenance, the budget, the notes, every run and the per-arm summary."""
    return {"commit": code.get("commit"), "dirty": code.get("dirty"), "machine": dict(machine),
            "benchmark": "unlabeled", "budget": {**asdict(budget), "n_train": budget.n_train}, "model": model,
            "notes": {"simulated": SIMULATED_NOTE, "rewards": REWARD_NOTE,
                      "heldout": "held-out gain always measured with the references (math_reward), greedy, "
                                 "untuned vs tuned, paired 95% CI; strict accuracy = boxed answer equals reference",
                      **({"tools": TOOLS_NOTE} if any(app_of(r) == "tools" for r in runs) else {})},
            "runs": sorted(runs, key=lambda r: (APPS.index(app_of(r)), ARMS.index(r["arm"]), r["seed"])),
            "summary": summarize(runs)}


def merge_runs(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`old` runs with each (app, arm, seed) that `new` holds replaced by the new one."""
    done = {run_key(r) for r in new}
    return [dict(r) for r in old if run_key(r) not in done] + [dict(r) for r in new]


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(doc: Mapping[str, Any]) -> str:
    lines = ["| arm | seed | train min | held-out gain, 95% CI | strict acc untuned -> tuned | judge agreement | "
             "judge calls |", "|---|---:|---:|---|---|---:|---:|"]
    for r in doc["runs"]:
        g, acc, ag = r["heldout"]["gain"], r["heldout"]["strict"], r.get("agreement") or {}
        label = (f"{app_of(r)}: " if app_of(r) != "math" else "") + r["arm"] + (
            " (SIMULATED judge)" if r["arm"] in SIM_ERROR else "")
        lines.append(f"| {label} | {r['seed']} | {_fmt(r['training_minutes'], '.1f')} | {_fmt(g.get('mean'), '+.3f')} "
                     f"[{_fmt(g.get('low'), '+.3f')}, {_fmt(g.get('high'), '+.3f')}] | {_fmt(acc.get('untuned'), '.2f')}"
                     f" -> {_fmt(acc.get('tuned'), '.2f')} | {_fmt(ag.get('rate'), '.2f')} | "
                     f"{r.get('judge_calls', 0)} |")
    return "\n".join(lines)


# ---- the runs (load the model) ------------------------------------------------------------------------------------
def check_candidate(row: Mapping[str, Any]) -> None:
    """A run that trained must compare a tuned team: the candidate's versions equal to the untuned ones would
    report the untuned team against itself as a zero gain."""
    versions = row.get("versions") or {}
    trained = bool(row.get("iterations")) or bool((row.get("traffic") or {}).get("warm_start_kept"))
    if trained and versions.get("tuned") == versions.get("untuned"):
        raise RuntimeError(f"{row.get('arm')} seed {row.get('seed')}: trained ({row.get('iterations')} iterations) "
                           f"but compared versions {versions.get('tuned')}, the untuned team's: nothing published")


def strip_labels(scenarios: Iterable[Any]) -> Any:
    """The scenarios without reference or checkpoints (what an arm without labels trains on)."""
    from marft_lg.trajectories.scenarios import ScenarioSet

    return ScenarioSet([replace(s, reference=None, checkpoints=[]) for s in scenarios])


def judge_reward(engine: Any, budget: Budget, seed: int, app: str = "math") -> tuple[Any, Any]:
    """(CompositeReward, its GroupJudge): group_judge 1.0 plus the app reward's terms that need no label: for the
    math team format_compliance 0.5; for the tool-using app its tool_error_rate and step_count costs."""
    from marft_lg.rewards.components.group_judge import GroupJudge
    from marft_lg.rewards.composite import CompositeReward

    judge = GroupJudge(engine=engine, max_tokens=budget.judge_max_tokens, seed=seed,
                       max_concurrency=max(1, budget.scenarios_per_iteration))
    if app == "tools":
        from credit_tools import REWARD as TOOLS_REWARD

        costs = {k: v for k, v in TOOLS_REWARD["weights"].items() if k in TOOLS_LABEL_FREE}
        reward = CompositeReward({"group_judge": 1.0, **costs}, {"group_judge": judge}, credit="terminal",
                                 answer_agents=TOOLS_REWARD["answer_agents"])
        return reward, judge
    return with_math_format("group_judge", judge), judge


def with_math_format(name: str, component: Any) -> Any:
    """A label-free signal `name` (its component or options) at weight 1 beside the math reward's ``format_compliance``
    (0.5): the one term of the math reward that needs no reference, shared by the judge arms and the format loop."""
    from marft_lg.examples.math_team.reward import REWARD_CONFIG
    from marft_lg.rewards.composite import CompositeReward

    return CompositeReward({name: 1.0, "format_compliance": 0.5},
                           {name: component, "format_compliance": REWARD_CONFIG["components"]["format_compliance"]},
                           credit="terminal", answer_agents=["actor"])


def loop_reward(arm: str) -> Any:
    """The production loop's reward: the users' thumbs, and for ``production_loop_format`` the math reward's
    ``format_compliance`` beside them (it needs no reference)."""
    from marft_lg.rewards.composite import CompositeReward

    if arm not in LOOP_ARMS:
        raise ValueError(f"{arm!r} is not a production loop arm; choose one of {list(LOOP_ARMS)}")
    if arm == "production_loop":
        return CompositeReward({"feedback": 1.0}, {"feedback": {"key": FEEDBACK_KEY}})
    return with_math_format("feedback", {"key": FEEDBACK_KEY})


def _final_answers(dataset: Any, agents: Sequence[str] = ("actor",)) -> dict[str, str]:
    """Episode id -> the completion of its last action by one of `agents` (the reference reward's answer)."""
    acts = dataset.actions
    if not len(acts):
        return {}
    acts = acts[acts["agent"].isin(list(agents))].sort_values(["episode_id", "order"], kind="stable")
    return {str(k): str(v) for k, v in acts.groupby("episode_id", sort=False)["completion"].last().items()}


def record_agreement(reward: Any, column: str, references: Mapping[str, Any], sink: list, *,
                     agents: Sequence[str] = ("actor",), match: str = "math") -> None:
    """Wrap `reward.score` so every scored batch adds (its `column` score, reference correctness) pairs to `sink`
    (references by scenario id, out of band: the reward never sees them)."""
    inner = reward.score

    def score(dataset: Any, scenarios: Any = None, **kw: Any) -> Any:
        result = inner(dataset, scenarios, **kw)
        answers = _final_answers(dataset, agents)
        sids = dict(zip(dataset.episodes["episode_id"], dataset.episodes["scenario_id"], strict=True))
        for eid, value in zip(result.episodes["episode_id"], result.episodes[column], strict=True):
            ref = references.get(str(sids.get(eid)))
            if ref is not None:
                sink.append((None if value is None else float(value), answer_correct(answers.get(eid), ref, match)))
        return result

    reward.score = score


class ArmRun:
    """One arm at one seed: a fresh untuned team, its training, then the held-out comparison with references. This
    class runs the math team; `ToolsArmRun` the tool-using app."""

    app_name = "math"
    answer_agents: tuple[str, ...] = ("actor",)
    match = "math"
    compare_options: Mapping[str, Any] = {}

    def __init__(self, arm: str, seed: int, budget: Budget, model: str, work: Path):
        import torch

        from marft_lg.demo import _examples
        from marft_lg.examples.math_team.problems import make_problems

        self.arm, self.seed, self.budget, self.model, self.work = arm, seed, budget, model, work
        self.math_team = _examples()
        self.roles = list(self.math_team.graph.ROLES)
        torch.manual_seed(seed)
        problems = make_problems(budget.n_train, budget.n_heldout, seed)
        self.train, self.heldout = problems.split("train"), problems.split("heldout")
        self.reference_reward = self.math_team.reward.math_reward()
        self.rollout_temperature = self.math_team.settings.ROLLOUT_TEMPERATURE
        self.apps: list[Any] = []
        self.team: Any = None

    def question(self, scenario: Any) -> str:
        """The text of a scenario's question, as the judge's prompt shows it."""
        return scenario.inputs["question"]

    def app(self, temperature: float, trace_dir: Path) -> Any:
        """The app on the run's team, tracing to `trace_dir` (closed when the run ends)."""
        app = self.app_spec(temperature).build_app(self.team, trace_dir)
        self.apps.append(app)
        return app

    def app_spec(self, temperature: float) -> Any:
        from functools import partial

        from marft_lg.graph.app_spec import AppSpec

        caps = {k: min(v, self.budget.max_tokens) for k, v in self.math_team.settings.REPLY_TOKENS.items()}
        return AppSpec(app=partial(self.math_team.graph.build_graph, **caps), node_roles={r: r for r in self.roles},
                       chat_model={"max_tokens": self.budget.max_tokens, "temperature": temperature})

    def trainer(self, reward: Any, **extra: Any) -> Any:
        from marft_lg.training.config import MARFTConfig
        from marft_lg.training.trainer import MARFTTrainer

        b = self.budget
        cfg = MARFTConfig(**{**self.math_team.settings.MARFT_SETTINGS, **extra}, group_size=b.group_size,
                          max_new_tokens=b.max_tokens, max_context=1024, seed=self.seed, offline_passes=1,
                          checkpoint_every=1000, rollout_concurrency=b.scenarios_per_iteration * b.group_size)
        return MARFTTrainer(self.team, reward, cfg, self.work / "train", run_id=f"unlabeled-{self.arm}",
                            progress=False)

    def run(self) -> dict[str, Any]:
        from marft_lg._provenance import code_state
        from marft_lg.serving.team_factory import TeamSpec

        t0 = time.perf_counter()
        self.team = TeamSpec(model=self.model, agents=self.roles, registry=str(self.work / "registry"),
                             versions=None, seed=self.seed).build_team()
        try:
            self.untuned = {r: self.team.save_version(r, run_id="untuned") for r in self.roles}
            self.team.registry.promote(self.untuned, reason="unlabeled bench: untuned is live")
            for r, v in self.untuned.items():
                self.team.load_version(r, v)
            row = self.train_loop() if self.arm in LOOP_ARMS else self.train_online()
            row.update(self.compare())
            check_candidate(row)
            if self.app_name != "math":
                row.update({"app": self.app_name, "app_budget": asdict(self.budget)})
            row.update({"arm": self.arm, "seed": self.seed, "minutes": round((time.perf_counter() - t0) / 60, 2),
                        "simulated_judge": self.arm in SIM_ERROR, "code": code_state(),
                        "budget": self.budget.name, "budget_minutes": self.budget.minutes})
            return row
        finally:
            for app in self.apps:
                app.close()
            self.team.close()

    def train_online(self) -> dict[str, Any]:
        from marft_lg.training.checks import TrainingDataError

        b, refs = self.budget, {s.scenario_id: s.reference for s in self.train}
        stream = list(self.train)[:b.online_iterations * b.scenarios_per_iteration]
        judge, sim, pairs = None, None, []
        if self.arm == "reference":
            reward, scenarios = self.reference_reward, stream
        else:
            scenarios = strip_labels(stream)
            if self.arm == "judge_base":
                engine = self.team
            else:
                sim = engine = SimulatedJudge({self.question(s): s.reference for s in stream}, SIM_ERROR[self.arm],
                                              seed=self.seed, agent=self.answer_agents, match=self.match)
            reward, judge = judge_reward(engine, b, self.seed, self.app_name)
            record_agreement(reward, "group_judge", refs, pairs, agents=self.answer_agents, match=self.match)
        trainer = self.trainer(reward)
        sampling = self.app(self.rollout_temperature, self.work / "traces")
        t0 = time.perf_counter()
        why = None
        try:
            trainer.fit_online(sampling, scenarios, b.online_iterations, scenarios_per_iteration=b.scenarios_per_iteration,
                               time_budget_s=b.minutes * 60)
        except TrainingDataError as exc:  # e.g. every group unscored: compare what there is
            why = str(exc)[:300]
        wall = time.perf_counter() - t0
        rows = [r for r in trainer.metrics.rows() if r.get("phase") == "online"]
        trainer.close()
        out = {"training_minutes": round(wall / 60, 2),
               "training_minutes_rows": round(sum((r.get("rollout_s") or 0) + (r.get("time_s") or 0)
                                                  for r in rows) / 60, 2),
               "iterations": len(rows), "train_reward_curve": [r.get("reward_mean") for r in rows],
               "trained_nothing": why, "judge_calls": 0, "agreement": None}
        if judge is not None:
            out.update({"judge_calls": judge.calls, "agreement": agreement(pairs),
                        "judge": "simulated" if sim is not None else "base model (no adapters)"})
        if sim is not None:
            out["simulated"] = {"error": sim.error, "verdicts": sim.verdicts, "flips": sim.flips}
        return out

    def train_loop(self) -> dict[str, Any]:
        """Production traffic (no references) -> users' thumbs by thread id -> mine -> warm start + offline."""
        from concurrent.futures import ThreadPoolExecutor

        from marft_lg.tracing.feedback import record_feedback
        from marft_lg.training.checks import TrainingDataError
        from marft_lg.training.warm_start import WarmStartConfig
        from marft_lg.trajectories.mining import mine
        from marft_lg.trajectories.scenario_sets import _outcome, scenarios_from_dataset

        b = self.budget
        traffic_dir = self.work / "traffic"
        asked = list(self.train)[:b.n_traffic]
        app = self.app(self.math_team.settings.ROLLOUT_TEMPERATURE, traffic_dir)
        user = SimulatedUser(seed=self.seed)
        convs = [(f"user-{self.seed}-{k}-{i}", s) for k in range(b.traffic_repeats) for i, s in enumerate(asked)]
        t0 = time.perf_counter()

        def converse(conv: tuple[str, Any]) -> tuple[str, Any, str | None]:
            tid, s = conv
            try:
                state = app.invoke(dict(s.inputs), config={"configurable": {"thread_id": tid}})
                return tid, s, str((state or {}).get("answer"))
            except Exception:  # a failed conversation gets no feedback (as in production)
                return tid, s, None

        with ThreadPoolExecutor(max_workers=min(32, len(convs))) as pool:
            answered = list(pool.map(converse, convs))
        app.flush()
        verdicts = []
        for tid, s, answer in answered:
            if answer is None:
                continue
            correct = answer_correct(answer, s.reference)  # the user knows; the training never sees it
            approved = user.approves(correct, tid)
            verdicts.append((correct, approved))
            record_feedback(thread_id=tid, name=FEEDBACK_KEY, value=1.0 if approved else 0.0, trace_dir=traffic_dir)
        traffic_s = time.perf_counter() - t0
        dataset = mine([traffic_dir], quarantine=self.work / "quarantine.jsonl")
        scenarios = scenarios_from_dataset(dataset, ["question"], split="train")
        by_question = {s.inputs["question"]: s.scenario_id for s in scenarios}
        dataset.episodes["scenario_id"] = [by_question.get((_outcome(o) or {}).get("question"))
                                           for o in dataset.episodes["outcome"]]
        fb = [(row.get("feedback") or {}).get(FEEDBACK_KEY) for row in dataset.episodes.to_dict("records")]
        reward = loop_reward(self.arm)
        trainer = self.trainer(reward, offline_episodes_per_iteration=max(8, b.scenarios_per_iteration * b.group_size))
        t1, why, warm = time.perf_counter(), None, None
        try:
            warm = trainer.fit_warm_start(dataset, scenarios, WarmStartConfig(keep="feedback", feedback=FEEDBACK_KEY))
        except TrainingDataError as exc:
            why = f"warm start: {exc}"[:300]
        try:
            while time.perf_counter() - t1 < b.minutes * 60:
                trainer.fit_offline(dataset, scenarios, iterations=trainer.offline_cursor + 1)
        except TrainingDataError as exc:
            why = f"offline: {exc}"[:300]
        wall = time.perf_counter() - t1
        rows = [r for r in trainer.metrics.rows() if r.get("phase") == "offline"]
        tuned = trainer.publish()  # offline training and the warm start publish nothing by themselves
        trainer.close()
        thumbs_vs_refs = [(1.0 if appr else 0.0, corr) for corr, appr in verdicts]
        self.team.registry.set_alias("candidate", {**self.team.versions(), **tuned}, reason="unlabeled bench: tuned")
        return {"training_minutes": round(wall / 60, 2), "traffic_minutes": round(traffic_s / 60, 2),
                "iterations": len(rows), "train_reward_curve": [r.get("reward_mean") for r in rows],
                "trained_nothing": why, "judge_calls": 0, "agreement": agreement(thumbs_vs_refs),
                "traffic": {"conversations": len(convs), "answered": len(verdicts), "mined": len(dataset),
                            "with_feedback": sum(v is not None for v in fb), "scenarios": len(scenarios),
                            "approval": approval_rates(verdicts),
                            "warm_start_kept": None if warm is None else warm.get("kept_episodes")}}

    def compare(self) -> dict[str, Any]:
        from marft_lg.evaluation.shadow import shadow_compare

        if self.arm not in LOOP_ARMS:
            self.team.registry.set_alias("candidate", self.team.versions(), reason="unlabeled bench: tuned")
        greedy = self.app(0.0, self.work / "compare")
        result = shadow_compare(greedy, "live", "candidate", self.heldout, self.reference_reward,
                                samples_per_scenario=1, seed=self.seed, run_id=f"unlabeled-{self.arm}-{self.seed}",
                                **{"concurrency": min(2 * len(self.heldout), 48), **self.compare_options})
        acc = self.accuracy(result)
        d = result.team.to_dict()
        heldout = {"n": result.n_pairs, "gain": {k: d.get(k) for k in ("mean", "low", "high", "n")},
                   "untuned_reward": result.side_mean("baseline", "reward"),
                   "tuned_reward": result.side_mean("candidate", "reward")}
        for key in ("strict", "lenient", "components"):
            if key in acc["baseline"]:
                heldout[key] = {"untuned": acc["baseline"][key], "tuned": acc["candidate"][key]}
        return {"heldout": heldout, "versions": {"untuned": self.untuned, "tuned": self.team.versions()}}

    def accuracy(self, result: Any) -> dict[str, dict[str, Any]]:
        """Strict and lenient answer accuracy per side of the held-out comparison."""
        from marft_lg.demo import _side_accuracy

        return _side_accuracy(result, self.heldout)


class ToolsArmRun(ArmRun):
    """The tool-using app (examples/supervisor_tools) with credit_tools' questions, reward and trainer settings."""

    app_name = "tools"
    answer_agents = ("researcher", "mathematician")
    match = "contains"
    compare_options = {"concurrency": 16, "drift": False}  # as credit_tools compares

    def __init__(self, arm: str, seed: int, budget: Budget, model: str, work: Path):  # the math team's is not run
        import random

        import torch
        from credit_tools import REWARD, ROLES, SETTINGS, questions

        from marft_lg.rewards.composite import CompositeReward

        self.arm, self.seed, self.budget, self.model, self.work = arm, seed, budget, model, work
        self.roles = list(ROLES)
        self.settings = dict(SETTINGS)
        torch.manual_seed(seed)
        rng, taken = random.Random(seed), set()
        self.heldout = questions(budget.n_heldout, rng, taken)  # credit_tools' order: the held-out set first
        self.train = questions(min(budget.n_train, TOOLS_STREAM), rng, taken)
        self.reference_reward = CompositeReward.from_yaml(REWARD)
        self.rollout_temperature = float(SETTINGS["temperature"])
        self.apps = []
        self.team = None

    def question(self, scenario: Any) -> str:
        return scenario.inputs["messages"][0]["content"]

    def app_spec(self, temperature: float) -> Any:
        from credit_tools import EXAMPLE

        from marft_lg.graph.app_spec import AppSpec

        return AppSpec(app="app:build_graph", base_dir=str(EXAMPLE), recursion_limit=TOOLS_RECURSION_LIMIT,
                       chat_model={"max_tokens": self.budget.max_tokens, "temperature": temperature})

    def trainer(self, reward: Any, **extra: Any) -> Any:
        from marft_lg.training.config import MARFTConfig
        from marft_lg.training.trainer import MARFTTrainer

        b = self.budget
        settings = {**self.settings, "max_new_tokens": b.max_tokens, **extra}
        cfg = MARFTConfig(**settings, credit="group", group_size=b.group_size, seed=self.seed,
                          rollout_concurrency=b.scenarios_per_iteration * b.group_size)
        return MARFTTrainer(self.team, reward, cfg, self.work / "train", run_id=f"unlabeled-tools-{self.arm}",
                            progress=False)

    def accuracy(self, result: Any) -> dict[str, dict[str, Any]]:
        """The share of held-out answers that contain the reference (the reward's `task_completion`), per side;
        the other components' means next to it (hand-off and tool checkpoints, tool errors, steps)."""
        comps = ("task_completion", "goal_progress", "tool_error_rate", "step_count")
        return {side: {"strict": result.side_mean(side, "task_completion"),
                       "components": {c: result.side_mean(side, c) for c in comps}}
                for side in ("baseline", "candidate")}


RUNS = {"math": ArmRun, "tools": ToolsArmRun}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--budget", default="full", choices=sorted(BUDGETS))
    ap.add_argument("--minutes", type=float, default=None, help="training minutes per arm (default: the budget's, "
                    "8 at full)")
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct", help="model spec or a local HF dir")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary one)")
    ap.add_argument("--append", action="store_true",
                    help="keep the runs in --out; skip (app, arm, seed) triples it holds")
    ap.add_argument("--app", default="math", choices=APPS,
                    help="math: the demo's math team; tools: examples/supervisor_tools (arms: " + ",".join(TOOLS_ARMS) + ")")
    args = ap.parse_args(argv)
    allowed = ARMS if args.app == "math" else TOOLS_ARMS
    arms = [a.strip() for a in (args.arms if args.arms != ",".join(ARMS) else ",".join(allowed)).split(",") if a.strip()]
    unknown = sorted(set(arms) - set(allowed))
    if unknown:
        ap.error(f"unknown arm(s) {unknown} for app {args.app}; choose from {list(allowed)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    budget = (BUDGETS if args.app == "math" else TOOLS_BUDGETS)[args.budget]
    if args.minutes is not None:
        budget = replace(budget, minutes=float(args.minutes))
    math_budget = budget if args.app == "math" else BUDGETS[args.budget]  # the file's `budget`: the math team's
    old = json.loads(args.out.read_text())["runs"] if args.append and args.out.exists() else []
    have = {run_key(r) for r in old}
    from marft_lg._provenance import code_state, machine

    work = args.work or Path(tempfile.mkdtemp(prefix="unlabeled-"))
    new: list[dict[str, Any]] = []
    for seed in seeds:
        for arm in arms:
            if (args.app, arm, seed) in have:
                print(f"{args.app} {arm} seed {seed}: already in {args.out}, skipped", file=sys.stderr)
                continue
            print(f"== {args.app} {arm} seed {seed} ({budget.name}, {budget.minutes:g} training min)", file=sys.stderr)
            run_dir = work / (f"{arm}-s{seed}" if args.app == "math" else f"{args.app}-{arm}-s{seed}")
            new.append(RUNS[args.app](arm, seed, budget, args.model, run_dir).run())
            doc = results_doc(merge_runs(old, new), math_budget, code=code_state(), machine=machine(),
                              model=args.model)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")  # after every run: resumable
    doc = results_doc(merge_runs(old, new), math_budget, code=code_state(), machine=machine(), model=args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(table(doc))
    print(f"\n{SIMULATED_NOTE}\nwrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
