import pytest

from marft_lg.training.config import ConfigError, MARFTConfig


def test_defaults_follow_paper_appendix_b():
    c = MARFTConfig()
    assert (c.learning_rate, c.critic_learning_rate, c.gamma, c.gae_lambda) == (1e-6, 1e-5, 0.99, 0.95)
    assert (c.clip_low, c.max_grad_norm, c.ppo_epochs, c.num_minibatches, c.value_head_hidden) == (0.2, 0.5, 1, 1, 64)
    assert c.max_context == 2048 and c.max_new_tokens == 512 and c.kl_cut == 0.02 and c.adam_eps == 1e-5


def test_yaml_roundtrip_and_section(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text("marft:\n  granularity: token\n  learning_rate: 0.001\n  agent_learning_rates: {actor: 0.01}\n")
    c = MARFTConfig.from_yaml(p, section="marft")
    assert c.granularity == "token" and c.lr_for("actor") == 0.01 and c.lr_for("reasoner") == 0.001


def test_unknown_key_names_file_and_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("learnig_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: learnig_rate: unknown MARFTConfig key; did you mean 'learning_rate'"):
        MARFTConfig.from_yaml(p)


@pytest.mark.parametrize("kw", [{"granularity": "step"}, {"logprob_norm": "mean"}, {"ppo_epochs": 0},
                                {"use_critic": False, "group_size": 1}])
def test_bad_values_are_rejected(kw):
    with pytest.raises(ConfigError):
        MARFTConfig(**kw)
