import io
import math

import pytest
from eval_factory import FormatAndAnswerReward, team_run
from rich.console import Console

from marft_lg.evaluation.comparison import compare_datasets
from marft_lg.evaluation.gate import PromotionGate
from marft_lg.evaluation.report import _header, print_summary, write_report

SIDS = [f"s{i}" for i in range(6)]
SCEN = {s: {"scenario_id": s, "reference": "1"} for s in SIDS}


def _result():
    base = team_run("b", SIDS, {s: "ANSWER: 1" for s in SIDS})
    cand = team_run("c", SIDS, {s: "no format" for s in SIDS}, loops=2)
    res = compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN,
                           meta={"baseline": {"writer": "v1"}, "candidate": {"writer": "v2"}})
    res.drift = {"writer": {"kl": 0.25, "n_tokens": 40, "n_prompts": 4}}
    return res


def test_report_files_plots_and_reasons(tmp_path):
    res = _result()
    decision = PromotionGate().evaluate(res)
    paths = write_report(res, tmp_path, decision)
    for key in ("components", "agents", "steps"):
        data = paths[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    md = paths["markdown"].read_text()
    assert "gate decision: REJECT" in md and "## Why the gate rejected" in md
    assert "| format |" in md and "plots/component_deltas.png" in md
    assert "| writer | 0.25 | 40 | 4 |" in md
    for reason in decision.reasons:
        assert reason in md
    page = paths["html"].read_text()
    assert "<table>" in page and 'src="plots/agent_deltas.png"' in page
    assert page.count("<li>") >= len(decision.reasons) + 3


def test_terminal_summary_lists_decision():
    res = _result()
    buf = io.StringIO()
    print_summary(res, PromotionGate().evaluate(res), console=Console(file=buf, width=80))
    out = buf.getvalue()
    assert "REJECT" in out and "team reward" in out and "Per-agent deltas" in out
    # readable at 80 columns: no line is wider, and a gate check's detail stays on its own line, not in columns
    assert max(len(line) for line in out.splitlines()) <= 80
    assert any(line.lstrip().startswith(("ok   ", "FAIL ")) for line in out.splitlines())


def test_reports_show_the_minimum_detectable_gain_from_the_paired_differences(tmp_path):
    base = team_run("b", SIDS, {s: "ANSWER: 1" if i % 2 else "nope" for i, s in enumerate(SIDS)})
    cand = team_run("c", SIDS, {s: "ANSWER: 1" for s in SIDS})
    res = compare_datasets(base, cand, FormatAndAnswerReward(), scenarios=SCEN)
    # deltas: 1 on s0, s2, s4 (nope -> right), 0 elsewhere: SD = sqrt(0.3), n = 6
    mde = (1.959964 + 0.841621) * math.sqrt(0.3) / math.sqrt(6)
    effect = res.team_detectable_effect()
    assert effect.n == 6 and effect.sd == pytest.approx(math.sqrt(0.3)) and effect.mde == pytest.approx(mde, rel=1e-5)
    assert res.to_dict()["team_reward_mde"]["mde"] == pytest.approx(mde, rel=1e-5)
    line = f"minimum detectable gain: {mde:.3f} (80% power, 5% two-sided; n=6, SD {math.sqrt(0.3):.3f})"
    assert len(line) + 2 <= 80
    assert f"- {line}" in write_report(res, tmp_path)["markdown"].read_text()
    buf = io.StringIO()
    print_summary(res, console=Console(file=buf, width=80))
    assert line in buf.getvalue()
    # every pair tied: no spread, so the report says n/a rather than "any gain is detectable"
    tied = compare_datasets(cand, cand, FormatAndAnswerReward(), scenarios=SCEN)
    assert "minimum detectable gain: n/a" in " ".join(_header(tied, None))
