"""Only production data is production data, on an app on plain ChatOpenAI against a recording server: the server's
records of another run (in the same server folder) are not turned into episodes, only counted and named; with
`server_records_only` (`--server-records-only`) the server's folder alone is mined into episodes as before."""

from __future__ import annotations

import logging

import typer
from chatopenai_apps import HANDOFF, scripted, swarm
from test_chatopenai_served import QUESTION, served, team  # noqa: F401 - the fixtures: a tiny team, its server
from typer.testing import CliRunner

from marft_lg.distributed.commands import mine as mine_command
from marft_lg.graph.wrap import wrap
from marft_lg.trajectories.dataset import TrajectoryDataset
from marft_lg.trajectories.mining import mine_with_report


def test_another_runs_server_records_are_counted_not_mined(team, served, tmp_path, caplog):  # noqa: F811
    server, sink = served
    scripted(team, {"alice": [HANDOFF], "bob": ["Sunny."]})
    ours = wrap(swarm(server.base_url), trace_dir=tmp_path / "app")
    theirs = wrap(swarm(server.base_url), trace_dir=tmp_path / "elsewhere")  # another run: its spans are not mined
    ours.invoke(QUESTION, {"configurable": {"thread_id": "ours"}})
    for i in range(2):
        theirs.invoke(QUESTION, {"configurable": {"thread_id": f"theirs-{i}"}})
    for app in (ours, theirs):
        app.flush()
    sink.flush()
    [served_file] = (tmp_path / "server").glob("*.jsonl")

    with caplog.at_level(logging.WARNING, logger="marft_lg.mining"):
        ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    assert len(ds) == 1 and report.episodes == 1 and report.served_merged == 2
    assert set(ds.actions["agent"]) == {"alice", "bob"} and report.actions_without_token_ids == {}
    assert report.server_records_unjoined == 4 and report.server_records_unjoined_in == {str(served_file): 4}
    assert "4 server record(s) joined no app span" in caplog.text and served_file.name in caplog.text

    alone, alone_report = mine_with_report([tmp_path / "server"], server_records_only=True)
    assert len(alone) == 3 and alone_report.server_records_unjoined == 0  # every run's requests, as before
    eps = alone.episodes
    assert set(ds.episode_ids) < set(alone.episode_ids)  # keyed by the episode id the requests' baggage carried
    assert eps["scenario_id"].isna().all() and set(eps["status"]) == {"ok"} and list(eps["n_actions"]) == [2, 2, 2]
    assert alone.actions["step"].isna().all() and set(alone.actions["adapter_version"]) == {"v1"}

    cli = typer.Typer()
    cli.command("mine")(mine_command)
    cli.command("noop")(lambda: None)
    refused = CliRunner().invoke(cli, ["mine", str(tmp_path / "server"), "--out", str(tmp_path / "none")])
    assert refused.exit_code == 1 and "6 server record(s) joined no app span" in refused.output
    kept = CliRunner().invoke(cli, ["mine", str(tmp_path / "server"), "--out", str(tmp_path / "out"),
                                    "--server-records-only"])
    assert kept.exit_code == 0, kept.output
    assert sorted(TrajectoryDataset.from_parquet(tmp_path / "out").episode_ids) == sorted(alone.episode_ids)
    ours.close()
    theirs.close()
