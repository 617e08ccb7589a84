"""The `marft-lg` command. Each sub-command lives beside the code it drives (`<area>/commands.py`);
this module only assembles them, so `marft-lg --help` stays fast (heavy imports happen inside commands)."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="marft-lg",
    help="Multi-Agent Reinforcement Fine-Tuning for LangGraph apps: serve, trace, mine, reward, train, compare, promote.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# (command name, module, function) — one line per command.
_COMMANDS: list[tuple[str, str, str]] = [
    ("serve", "marft_lg.serving.commands", "serve"),
    ("adapters", "marft_lg.serving.commands", "adapters"),
    ("run", "marft_lg.graph.commands", "run"),
    ("mine", "marft_lg.distributed.commands", "mine"),
    ("feedback", "marft_lg.tracing.commands", "feedback"),
    ("score", "marft_lg.rewards.commands", "score"),
    ("train", "marft_lg.training.commands", "train"),
    ("compare", "marft_lg.evaluation.commands", "compare"),
    ("attribute", "marft_lg.evaluation.blame", "attribute"),
    ("promote", "marft_lg.evaluation.commands", "promote"),
    ("rollback", "marft_lg.evaluation.commands", "rollback"),
    ("export", "marft_lg.tracking.commands", "export"),
    ("retrain", "marft_lg.jobs.commands", "retrain"),
    ("schedule", "marft_lg.jobs.commands", "schedule"),
    ("demo", "marft_lg.demo", "demo"),
    ("demo-curve", "marft_lg.demo", "demo_curve"),
]
# (group name, module, typer app attribute)
_GROUPS: list[tuple[str, str, str]] = [
    ("jobs", "marft_lg.jobs.commands", "jobs_app"),
]

for _name, _module, _attr in _COMMANDS:
    app.command(_name)(getattr(importlib.import_module(_module), _attr))
for _name, _module, _attr in _GROUPS:
    app.add_typer(getattr(importlib.import_module(_module), _attr), name=_name)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
