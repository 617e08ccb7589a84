"""Comparison report: Markdown + HTML with PNG plots in the run directory, and a rich terminal summary."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any

from marft_lg._durable import write_atomic
from marft_lg.evaluation.agent_metrics import AGENT_METRICS, HIGHER_IS_BETTER
from marft_lg.evaluation.comparison import ComparisonResult
from marft_lg.evaluation.gate import GateDecision
from marft_lg.evaluation.stats import PairedCI, format_ci


def _f(v: Any, spec: str = "+.3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def _ci(ci: PairedCI) -> str:
    return format_ci(ci.mean, ci.low, ci.high)


def _rows(result: ComparisonResult) -> list[tuple[str, float, PairedCI]]:
    """(name, baseline mean, CI) for the team reward and each component."""
    rows = [("team reward", result.side_mean("baseline", "reward"), result.team)]
    rows += [(name, result.side_mean("baseline", name), ci) for name, ci in result.components.items()]
    return rows


def plot_component_deltas(result: ComparisonResult, path: Path) -> Path:
    """Horizontal error bars: mean paired delta and CI for the team reward and each component."""
    import matplotlib.pyplot as plt

    rows = _rows(result)
    fig, ax = plt.subplots(figsize=(6.5, 0.5 * len(rows) + 1.2))
    for i, (name, _, ci) in enumerate(rows):
        mean = 0.0 if math.isnan(ci.mean) else ci.mean
        lo, hi = (mean, mean) if not ci.defined else (ci.low, ci.high)
        sign = result.component_signs.get(name, 1)  # cost components: a rise is bad
        better, worse = (lo > 0, hi < 0) if sign > 0 else (hi < 0, lo > 0)
        color = "tab:green" if ci.defined and better else ("tab:red" if ci.defined and worse else "tab:gray")
        ax.errorbar(mean, i, xerr=[[mean - lo], [hi - mean]], fmt="o", color=color, capsize=4)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"candidate - baseline ({result.team.confidence:.0%} bootstrap CI)")
    ax.set_title("Reward deltas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def agent_panel_metrics(result: ComparisonResult) -> tuple[list[str], list[str]]:
    """(metrics to plot, metrics left out): a metric no agent moved (every delta and CI exactly 0, or undefined) is
    one this app does not have, e.g. tool accuracy in a team without tools; a flat panel would say nothing."""

    def flat(metric: str) -> bool:
        return all((not ci.defined or (ci.low == 0 and ci.high == 0)) and (math.isnan(ci.mean) or ci.mean == 0)
                   for ci in (per_agent[metric] for per_agent in result.agents.values()))

    shown = [m for m in AGENT_METRICS if not flat(m)] or [AGENT_METRICS[0]]
    return shown, [m for m in AGENT_METRICS if m not in shown]


def plot_agent_deltas(result: ComparisonResult, path: Path) -> Path:
    """One panel per metric, one bar per agent: mean paired delta with its CI."""
    import matplotlib.pyplot as plt

    agents = sorted(result.agents)
    metrics, skipped = agent_panel_metrics(result)
    ncols = min(4, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows + 0.4), squeeze=False)
    for k, metric in enumerate(metrics):
        ax = axes[k // ncols][k % ncols]
        means, errs, colors = [], [[], []], []
        for a in agents:
            ci = result.agents[a][metric]
            m = 0.0 if math.isnan(ci.mean) else ci.mean
            lo, hi = (m, m) if not ci.defined else (ci.low, ci.high)
            means.append(m)
            errs[0].append(m - lo)
            errs[1].append(hi - m)
            good = m >= 0 if metric in HIGHER_IS_BETTER else m <= 0
            colors.append("tab:green" if good else "tab:red")
        ax.bar(range(len(agents)), means, yerr=errs, color=colors, capsize=3)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(agents)), agents, rotation=30, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
    for k in range(len(metrics), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    fig.suptitle("Per-agent deltas (candidate - baseline)")
    if skipped:
        fig.text(0.5, 0.005, "no change in any agent (not shown): " + ", ".join(skipped), ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.03 if skipped else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_distributions(result: ComparisonResult, path: Path) -> Path:
    """Histogram of steps per episode, baseline against candidate."""
    import matplotlib.pyplot as plt

    b = result.baseline.episodes["steps"].astype(int).tolist()
    c = result.candidate.episodes["steps"].astype(int).tolist()
    top = max(b + c + [1])
    bins = [x - 0.5 for x in range(0, top + 2)]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(b, bins=bins, alpha=0.6, label="baseline")
    ax.hist(c, bins=bins, alpha=0.6, label="candidate")
    ax.set_xlabel("agent steps per episode")
    ax.set_ylabel("episodes")
    ax.legend()
    ax.set_title("Step-count distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tables(result: ComparisonResult, decision: GateDecision | None) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table the report shows; shared by Markdown, HTML and terminal."""
    out = []
    rows = [[name, _f(base, ".3f"), _ci(ci), str(ci.n)] for name, base, ci in _rows(result)]
    out.append(("Team reward and components", ["quantity", "baseline mean", "delta [CI]", "pairs"], rows))
    shown, _ = agent_panel_metrics(result)
    agent_rows = [[agent, m, _ci(result.agents[agent][m])] for agent in sorted(result.agents) for m in shown]
    out.append(("Per-agent deltas (metrics some agent moved)", ["agent", "metric", "delta [CI]"], agent_rows))
    epi = [[m, _f(result.side_mean("baseline", m), ".3f"), _f(result.side_mean("candidate", m), ".3f"), _ci(ci)]
           for m, ci in result.episode_metrics.items()]
    epi.append(["cost ratio (tokens)", "", "", _f(result.cost_ratio(), ".3f")])
    out.append(("Episode metrics", ["metric", "baseline", "candidate", "delta [CI]"], epi))
    bases, frozen = result.meta.get("agent_bases") or {}, result.meta.get("frozen_agents") or []
    if bases or frozen:
        base_map, cand_map = result.meta.get("baseline") or {}, result.meta.get("candidate") or {}
        out.append(("Agents and their base models", ["agent", "base model", "baseline", "candidate"],
                    [[a, b, str(base_map.get(a, "")), str(cand_map.get(a, ""))] for a, b in bases.items()]
                    + [[a, "frozen (not served by the team)", "", ""] for a in frozen]))
    if result.drift:
        out.append(("Policy drift (mean per-token KL, baseline || candidate)", ["agent", "KL", "tokens", "prompts"],
                    [[a, _f(d.get("kl"), ".4g"), str(d.get("n_tokens")), str(d.get("n_prompts"))]
                     for a, d in sorted(result.drift.items())]))
    if decision is not None:
        out.append(("Gate checks", ["check", "passed", "value", "threshold", "detail"],
                    [[c.name, "yes" if c.passed else "NO", _f(c.value, ".4g"), _f(c.threshold, ".4g"), c.detail]
                     for c in decision.checks]))
    return out


def _header(result: ComparisonResult, decision: GateDecision | None) -> list[str]:
    meta = result.meta
    lines = [f"baseline: {meta.get('baseline', 'baseline')}", f"candidate: {meta.get('candidate', 'candidate')}",
             f"paired units: {result.n_pairs}", _mde_line(result)]
    if any(result.unmatched.values()):
        lines.append(f"unmatched units: {result.unmatched}")
    if decision is not None:
        verdict = "PROMOTE" if decision.promote else "REJECT"
        lines.append(f"gate decision: {verdict}" + ("" if decision.promote else f" ({len(decision.reasons)} failed checks)"))
    return lines


def _mde_line(result: ComparisonResult) -> str:
    """One line: the smallest team-reward gain this many pairs detects (80% power, two-sided 5%), from the
    SD of the paired differences, so a CI spanning 0 reads as "no gain" or "too few pairs to tell"."""
    e = result.team_detectable_effect()
    return (f"minimum detectable gain: {_f(e.mde, '.3f')} (80% power, 5% two-sided; "
            f"n={e.n}, SD {_f(e.sd, '.3f')})")


def write_report(result: ComparisonResult, run_dir: str | Path, decision: GateDecision | None = None,
                 sections: list[str] | None = None) -> dict[str, Path]:
    """Write report.md, report.html and plots/*.png into `run_dir`; returns their paths by name. `sections`: more
    Markdown sections (the blame report of `compare --attribute`), after the tables."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    out = Path(run_dir)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    images = {
        "components": plot_component_deltas(result, plots / "component_deltas.png"),
        "agents": plot_agent_deltas(result, plots / "agent_deltas.png"),
        "steps": plot_step_distributions(result, plots / "step_distribution.png"),
    }
    tables = _tables(result, decision)
    header = _header(result, decision)

    md = ["# Shadow comparison", "", *[f"- {line}" for line in header], ""]
    if decision is not None and decision.reasons:
        md += ["## Why the gate rejected", "", *[f"- {r}" for r in decision.reasons], ""]
    for title, cols, rows in tables:
        md += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        md.append("")
    md += [s.rstrip() + "\n" for s in sections or []]
    md += ["## Plots", ""] + [f"![{k}](plots/{p.name})" for k, p in images.items()] + [""]
    md_path = write_atomic(out / "report.md", "\n".join(md))
    html_path = write_atomic(out / "report.html", markdown_to_html("\n".join(md), title="Shadow comparison"))
    return {"markdown": md_path, "html": html_path, **images}


_STYLE = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:.2em .5em;font-size:.9em}th{background:#f3f3f3}img{max-width:100%}")
_INLINE = re.compile(r"!\[([^\]]*)\]\(([^)]+)\)|\[([^\]]+)\]\(([^)]+)\)|\*\*([^*]+)\*\*|`([^`]+)`")


def _inline(text: str) -> str:
    """Images, links, bold and code of one Markdown line as HTML; everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        img_alt, img_src, link_text, link_href, bold, code = m.groups()
        if img_src is not None:
            out.append(f'<img src="{html.escape(img_src)}" alt="{html.escape(img_alt)}">')
        elif link_href is not None:
            out.append(f'<a href="{html.escape(link_href)}">{html.escape(link_text)}</a>')
        elif bold is not None:
            out.append(f"<strong>{html.escape(bold)}</strong>")
        else:
            out.append(f"<code>{html.escape(code)}</code>")
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def markdown_to_html(markdown: str, *, title: str) -> str:
    """The Markdown the reports write (headings, lists, tables, quotes, images, links) as one HTML page."""
    body: list[str] = []
    table: list[list[str]] = []
    items: list[str] = []

    def flush() -> None:
        if table:
            head, *rows = table
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
                        + "</table>")
            table.clear()
        if items:
            body.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
            items.clear()

    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", stripped.strip("|"))]
            if not all(set(c) <= set("-: ") for c in cells):
                table.append(cells)
            continue
        if stripped.startswith("- "):
            if table:
                flush()
            text = _inline(stripped[2:])
            if line.startswith("  ") and items:
                items[-1] += f"<ul><li>{text}</li></ul>"
            else:
                items.append(text)
            continue
        flush()
        if not stripped:
            continue
        level = len(stripped) - len(stripped.lstrip("#"))
        if 0 < level <= 6 and stripped[level:level + 1] == " ":
            body.append(f"<h{level}>{_inline(stripped[level + 1:])}</h{level}>")
        elif stripped.startswith(">"):
            body.append(f"<blockquote>{_inline(stripped.lstrip('> '))}</blockquote>")
        else:
            body.append(f"<p>{_inline(stripped)}</p>")
    flush()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")


def print_summary(result: ComparisonResult, decision: GateDecision | None = None, console: Any = None) -> None:
    """Print the report's tables (without per-check details) to the terminal with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for line in _header(result, decision):
        console.print(line)
    for title, cols, rows in _tables(result, decision):
        if title == "Gate checks":  # one line per check: its detail is prose, which columns would shred at 80 wide
            console.print(title)
            for name, passed, _value, _threshold, detail in rows:
                console.print(f"  {'ok  ' if passed == 'yes' else 'FAIL'} {name}: {detail}")
            continue
        table = Table(title=title, show_lines=False)
        for c in cols:
            table.add_column(c, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if decision is not None:
        verdict = "[bold green]PROMOTE[/]" if decision.promote else "[bold red]REJECT[/]"
        console.print(f"gate: {verdict}")
        for r in decision.reasons:
            console.print(f"  - {r}")


def log_comparison(tracker: Any, result: ComparisonResult, decision: GateDecision, out: str | Path, *,
                   finish: bool = False) -> None:
    """A comparison into a run's trackers: the compared versions as params, every CI and the gate's checks as
    metrics (``gate/passed`` 1 or 0), the report (Markdown, HTML, plots), comparison.json and decision.json;
    `finish` ends the run after."""
    from marft_lg.tracking.base import flat_metrics

    data = result.to_dict()
    tracker.log_params({"baseline": data["meta"].get("baseline"), "candidate": data["meta"].get("candidate"),
                        "gate": decision.gate})
    numbers = flat_metrics({k: v for k, v in data.items() if k not in ("meta", "unmatched")})
    numbers["gate/passed"] = 1.0 if decision.promote else 0.0
    for check in decision.checks:
        numbers[f"gate/checks/{check.name}/passed"] = 1.0 if check.passed else 0.0
        if check.value is not None and math.isfinite(check.value):
            numbers[f"gate/checks/{check.name}/value"] = float(check.value)
    tracker.log_metrics(numbers, 0)
    text = "\n".join([f"decision: {'promote' if decision.promote else 'reject'}", *decision.reasons])
    tracker.log_text(text, "gate_decision.txt")
    root = Path(out)
    for name in ("report.md", "report.html", "decision.json", "comparison.json"):
        if (root / name).is_file():
            tracker.log_file(root / name, "comparison")
    for plot in sorted((root / "plots").glob("*.png")):
        tracker.log_file(plot, "comparison/plots")
    if finish:
        tracker.finish()
