"""The reports' HTML is rendered from their Markdown: headings, lists, tables, images and links survive, text is escaped."""

from __future__ import annotations

from marft_lg.evaluation.report import markdown_to_html


def test_the_report_markdown_subset_becomes_html():
    md = "\n".join([
        "# Title <x>", "", "> a note", "", "- **gate**: reject", "  - CI [-0.1, +0.2] < 0", "- second", "",
        "| a | b \\| c |", "|---|---|", "| 1 | `x` |", "", "![plot](plots/p.png)", "",
        "See [compare/report.md](compare/report.md).",
    ])
    page = markdown_to_html(md, title="T & U")
    assert "<title>T &amp; U</title>" in page
    assert "<h1>Title &lt;x&gt;</h1>" in page and "<blockquote>a note</blockquote>" in page
    assert "<li><strong>gate</strong>: reject<ul><li>CI [-0.1, +0.2] &lt; 0</li></ul></li><li>second</li>" in page
    assert "<tr><th>a</th><th>b | c</th></tr><tr><td>1</td><td><code>x</code></td></tr>" in page
    assert '<img src="plots/p.png" alt="plot">' in page
    assert '<a href="compare/report.md">compare/report.md</a>' in page
    assert "---" not in page


def test_agent_panels_leave_out_metrics_no_agent_moved():
    from types import SimpleNamespace

    from marft_lg.evaluation.agent_metrics import AGENT_METRICS
    from marft_lg.evaluation.report import agent_panel_metrics
    from marft_lg.evaluation.stats import PairedCI

    flat, nan = PairedCI(0.0, 0.0, 0.0, 10, 0.95), PairedCI(float("nan"), float("nan"), float("nan"), 0, 0.95)
    moved = PairedCI(0.2, 0.05, 0.35, 10, 0.95)
    agents = {a: {m: flat for m in AGENT_METRICS} for a in ("reasoner", "actor")}
    agents["actor"] = {**agents["actor"], AGENT_METRICS[0]: moved, AGENT_METRICS[-1]: nan}
    agents["reasoner"] = {**agents["reasoner"], AGENT_METRICS[1]: PairedCI(0.0, -0.1, 0.1, 10, 0.95)}
    shown, left_out = agent_panel_metrics(SimpleNamespace(agents=agents))
    assert shown == [AGENT_METRICS[0], AGENT_METRICS[1]]
    assert left_out == list(AGENT_METRICS[2:])
