"""End to end on real parts (tiny random Llama, Team + registry, wrap + traces, mine, CompositeReward):
a writer adapter SFT-trained to follow the required format is promoted, one trained to emit garbage
is rejected for the right reasons, and rollback restores exactly the earlier live versions."""

from __future__ import annotations

import json
from typing import TypedDict

import pytest
import torch

ROLES = ["planner", "writer"]
FORMAT = r"ANSWER: \d+"
REWARD = {"weights": {"format_compliance": 1.0},
          "components": {"format_compliance": {"agents": {"writer": {"regex": FORMAT, "fullmatch": True}}}}}


def _settings():
    from marft_lg.serving.registry.lora import LoraSettings

    # lm_head is adapted too: the tiny random model's own head is too flat to ever be confident.
    return LoraSettings(r=4, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])


def build_graph(llm):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        question: str
        plan: str
        answer: str

    def planner(state: State) -> dict:
        return {"plan": llm.invoke([SystemMessage("Plan the answer."), HumanMessage(state["question"])]).content}

    def writer(state: State) -> dict:
        msg = HumanMessage(f"Question: {state['question']}\nPlan: {state['plan']}")
        return {"answer": llm.invoke([SystemMessage("Reply exactly as 'ANSWER: <number>'."), msg]).content}

    g = StateGraph(State)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()


def sft_adapter(model_dir: str, init_dir, prompts: list[list[int]], target: list[int], out_dir, max_steps: int = 80):
    """Full-batch SFT steps until greedy decoding gives `target` after every prompt; returns
    (adapter dir, whether it got there)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(init_dir), is_trainable=True)
    width = max(len(p) for p in prompts) + len(target)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    labels = torch.full((len(prompts), width), -100, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        seq = p + target
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p):len(seq)] = torch.tensor(target)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    inner = model.base_model.model  # the causal LM with LoRA layers injected
    select = labels[:, 1:] != -100  # positions whose next token is a target token
    wanted = labels[:, 1:][select]
    learned = False
    for _ in range(max_steps):
        # the head runs on the target positions only: full-vocabulary logits everywhere would dominate the cost
        hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][select]
        logits = inner.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits, wanted)
        learned = bool((logits.argmax(-1) == wanted).all()) and float(loss) < 1.0
        if learned:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir, save_embedding_layers=False)
    return out_dir, learned


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from marft_lg.graph.chat_model import TeamChatModel
    from marft_lg.graph.wrap import wrap
    from marft_lg.serving.engine.models import model_fingerprint
    from marft_lg.serving.registry.lora import write_fresh_adapter
    from marft_lg.serving.registry.store import AdapterRegistry
    from marft_lg.serving.team import Team
    from marft_lg.trajectories.mining import mine
    from marft_lg.trajectories.scenarios import Scenario, ScenarioSet

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("compare_gate")
    reg = AdapterRegistry(root / "registry")
    fp = model_fingerprint(tiny_model_dir)
    fresh = write_fresh_adapter(tiny_model_dir, _settings(), root / "fresh", seed=0)
    for role in ROLES:
        reg.save(role, fresh, base_fingerprint=fp)  # v1
    reg.promote({"planner": "v1", "writer": "v1"}, reason="first deploy")
    scenarios = ScenarioSet(Scenario(f"sum-{i}", {"question": f"What is {i} plus {i}?"}, reference=str(2 * i))
                            for i in range(8))

    team = Team(tiny_model_dir, ROLES, registry=reg)
    llm = TeamChatModel(team=team, temperature=0.0, max_tokens=8)
    app = wrap(build_graph(llm), team=team, trace_dir=root / "traces")
    # the writer prompts the live team produces: the SFT data of the candidates
    for s in scenarios:
        app.invoke(s.inputs, episode_id=f"collect-{s.scenario_id}", scenario_id=s.scenario_id, seed=1)
    app.flush()
    acts = mine(app.trace_files).actions
    prompts = [list(p) for p in acts[acts["agent"] == "writer"]["prompt_token_ids"]]
    assert len(prompts) == 8 and all(prompts)
    tok = team.tokenizer
    eos = [tok.eos_token_id]
    good, good_ok = sft_adapter(tiny_model_dir, fresh, prompts, tok.encode("ANSWER: 42", add_special_tokens=False) + eos,
                                  root / "good")
    bad, bad_ok = sft_adapter(tiny_model_dir, fresh, prompts, tok.encode("zz qq zz", add_special_tokens=False) + eos,
                                root / "bad")
    assert good_ok and bad_ok, "SFT did not teach the adapters their outputs"
    reg.save("writer", good, base_fingerprint=fp)  # v2
    reg.save("writer", bad, base_fingerprint=fp)  # v3
    yield {"reg": reg, "team": team, "app": app, "scenarios": scenarios, "root": root}
    app.close()
    team.close()


def _compare(setup, candidate):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.rewards.composite import CompositeReward

    return shadow_compare(setup["app"], "live", candidate, setup["scenarios"], CompositeReward.from_yaml(REWARD),
                          samples_per_scenario=1, seed=3, formats={"writer": FORMAT}, progress=False)


def test_better_is_promoted_worse_is_rejected_and_rollback_restores(setup, tmp_path):
    from marft_lg.evaluation.gate import PromotionGate
    from marft_lg.evaluation.promotion import promote, rollback
    from marft_lg.evaluation.report import write_report

    reg, gate = setup["reg"], PromotionGate()
    first_live = reg.alias("live")

    better = _compare(setup, {"writer": "v2"})
    assert better.n_pairs == 8
    assert better.team.mean == pytest.approx(1.0) and better.team.low > 0
    assert better.drift["writer"]["kl"] > 0.1 and better.drift["planner"]["kl"] == pytest.approx(0.0, abs=1e-6)
    decision = gate.evaluate(better)
    assert decision.promote, decision.reasons
    decision.write(tmp_path / "better")
    paths = write_report(better, tmp_path / "better", decision)
    assert "gate decision: PROMOTE" in paths["markdown"].read_text()
    rec = promote(reg, better.meta["candidate"], decision=decision, run_dir=tmp_path / "better")
    assert reg.alias("live") == {"planner": "v1", "writer": "v2"} and rec.before == first_live

    worse = _compare(setup, {"writer": "v3"})
    assert worse.meta["baseline"] == {"planner": "v1", "writer": "v2"}
    decision = gate.evaluate(worse)
    assert not decision.promote
    failed = {c.name for c in decision.checks if not c.passed}
    assert {"team_reward_gain", "team_reward_ci_lower_above_zero", "component:format_compliance",
            "agent:writer:format_compliance", "agent:writer:reward"} <= failed
    assert not any(name.startswith("agent:planner") for name in failed)
    path = decision.write(tmp_path / "worse")
    assert json.loads(path.read_text())["decision"] == "reject"

    assert rollback(reg).after == first_live
    assert reg.alias("live") == first_live
