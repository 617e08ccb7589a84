"""`MARFTTrainer.publish`: what a warm start or an offline update changed becomes a served registry version, so the
team compared or promoted afterwards is the trained one, never the untuned team under its old versions."""

from __future__ import annotations

import pytest
import torch

from marft_lg.serving.team import Team
from marft_lg.training.config import MARFTConfig
from marft_lg.training.policy import adapter_parameters
from marft_lg.training.trainer import MARFTTrainer

ROLES = ["reasoner", "actor"]


def _reward(ep):
    a, b = ep.actions[0]["completion_token_ids"], ep.actions[1]["completion_token_ids"]
    return float(bool(a) and bool(b) and a[0] % 2 == b[0] % 2)


def _weights(team, role):
    return [p.detach().clone() for p in adapter_parameters(team.model, team.adapter_name(role))]


def test_offline_updates_are_published_for_the_roles_they_changed(chain_dataset, tiny_model_dir, tmp_path):
    ds, scenarios = chain_dataset
    team = Team(tiny_model_dir, ROLES, registry=tmp_path / "registry", versions=None, seed=0)
    cfg = MARFTConfig(learning_rate=1e-2, kl_cut=None, plots=False, offline_episodes_per_iteration=3, offline_passes=2,
                      entropy_surge=1e9, kl_blowup=1e9)  # sequential: the first iteration updates the reasoner
    trainer = MARFTTrainer(team, _reward, cfg, tmp_path / "run", progress=False)
    assert trainer.publish() == {}  # nothing trained yet: nothing pending
    before = team.versions()
    trainer.fit_offline(ds, scenarios, iterations=1)
    assert trainer.unpublished == {"reasoner"}
    trained = _weights(team, "reasoner")
    published = trainer.publish()
    assert set(published) == {"reasoner"} and published["reasoner"] != before.get("reasoner")
    assert team.versions() == {**before, **published} and trainer.unpublished == set()
    served = _weights(team, "reasoner")  # the new version is loaded and serves the trained weights
    assert all(torch.equal(a, b) for a, b in zip(trained, served, strict=True))
    manifest = team.registry.manifest(team.slot("reasoner"), published["reasoner"])
    assert manifest["run_id"] == trainer.run_id and manifest["metrics"]["iteration"] == 1.0
    assert trainer.publish() == {}  # published once
    trainer.fit_offline(ds, scenarios, iterations=3)  # the actor's turn, then the reasoner's again
    assert trainer.unpublished == {"reasoner", "actor"}
    # the reasoner's optimizer follows the newly loaded adapter: its next update changed the served weights
    assert not all(torch.equal(a, b) for a, b in zip(served, _weights(team, "reasoner"), strict=True))
    assert set(trainer.publish(["actor"])) == {"actor"} and trainer.unpublished == {"reasoner"}
    team.close()


def test_on_policy_training_publishes_pending_changes_before_its_first_rollout(chain_dataset, tiny_model_dir,
                                                                              tmp_path):
    """The trainer changes the served adapter in place, under the served version's name: until that change has a
    version of its own, a request for the old version (`live`, the untuned team) got the trained weights. On-policy
    training publishes first, so its spans name weights the registry holds and the old version is served from its
    files again."""
    ds, scenarios = chain_dataset
    team = Team(tiny_model_dir, ROLES, registry=tmp_path / "registry", versions=None, seed=0)
    untuned = {r: team.save_version(r, run_id="untuned") for r in ROLES}
    for role, version in untuned.items():
        team.load_version(role, version)
    saved = _weights(team, "reasoner")
    cfg = MARFTConfig(learning_rate=1e-2, kl_cut=None, plots=False, offline_episodes_per_iteration=3,
                      entropy_surge=1e9, kl_blowup=1e9)
    trainer = MARFTTrainer(team, _reward, cfg, tmp_path / "run", progress=False)
    trainer.fit_offline(ds, scenarios, iterations=1)
    assert team.versions() == untuned and not all(  # v1's name now holds what the update made of it
        torch.equal(a, b) for a, b in zip(saved, _weights(team, "reasoner"), strict=True))

    class Seen(Exception):
        pass

    class FirstRollout:
        def collect(self, scenarios, k, iteration, seed):
            v1 = adapter_parameters(team.model, team.adapter_name("reasoner", untuned["reasoner"]))
            raise Seen(team.versions(), [p.detach().clone() for p in v1])

    with pytest.raises(Seen) as got:
        trainer.fit_online(FirstRollout(), scenarios, iterations=1)
    versions, v1 = got.value.args
    assert versions["reasoner"] != untuned["reasoner"] and versions["actor"] == untuned["actor"]
    assert trainer.unpublished == set()
    assert all(torch.equal(a, b) for a, b in zip(saved, v1, strict=True))  # `live` from the registry again
    team.close()
