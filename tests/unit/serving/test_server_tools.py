"""`marft-lg serve` speaks OpenAI tools: prompt rendering, tool-call responses, streaming deltas, ChatOpenAI.

A scripted engine (the tiny model's tokenizer and the embedded engine's own prompt encoding, canned
completion text) controls what the "model" writes; one test runs the real tiny model to compare the
server's prompt with `TeamChatModel`'s.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

from marft_lg.graph import TeamChatModel
from marft_lg.serving.engine.hf import HFEngine
from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest, Completion
from marft_lg.tool_calls import (
    OPEN,
    example_arguments,
    example_call,
    example_value,
    parse_tool_calls,
    render_messages,
    tools_instruction,
)

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
HANDOFF = {"type": "function", "function": {"name": "transfer_to_writer", "description": "Hand over to the writer.",
                                            "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Add 2 and 3."}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ScriptedEngine:
    """An `Engine` whose completions are canned text; prompts are encoded exactly as `HFEngine` encodes them."""

    model_name = "tiny"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.script: dict[str | None, list[str]] = {}
        self.requests: list[ChatRequest] = []
        self._adapters: set[str] = set()

    def add_adapter(self, name, settings=None, *, seed=0):
        self._adapters.add(name)

    def load_adapter(self, name, path):
        self._adapters.add(name)

    def unload_adapter(self, name):
        self._adapters.discard(name)

    def loaded_adapters(self):
        return sorted(self._adapters)

    def max_context(self):
        return 8192

    def encode(self, req: ChatRequest) -> list[int]:
        return HFEngine.encode(self, req)  # type: ignore[arg-type]  # only uses self.tokenizer

    def generate(self, requests, adapter_names):
        out = []
        for req in requests:
            self.requests.append(req)
            answers = self.script.get(req.agent) or self.script.get(None) or ["Hello."]
            text = answers.pop(0) if len(answers) > 1 else answers[0]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(text=text, prompt_token_ids=self.encode(req), completion_token_ids=ids,
                                  logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out

    async def agenerate(self, requests, adapter_names):
        return self.generate(requests, adapter_names)

    def close(self):
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, tokenizer):
    engine = ScriptedEngine(tokenizer)
    team = Team(tiny_model_dir, ["planner", "writer"], engine=engine, versions=None, model_name="tiny")
    with TestClient(create_app(team)) as client:
        yield client, engine
    team.close()


def _post(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "planner", "messages": USER, "max_tokens": 8,
                                                  "return_token_ids": True, "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt(client, tokenizer, **body) -> str:
    return tokenizer.decode(_post(client, **body)["prompt_token_ids"])


# ---- the prompt -----------------------------------------------------------------------------------
def test_tools_change_the_prompt(scripted, tokenizer):
    client, _ = scripted
    plain, with_tools = _post(client), _post(client, tools=[ADD])
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    text = tokenizer.decode(with_tools["prompt_token_ids"])
    assert '"name": "add"' in text and f'Example: {OPEN}{{"name": "add", "arguments": {{"a": 1, "b": 1}}}}' in text


def test_tool_choice_none_required_and_named_change_the_prompt(scripted, tokenizer):
    client, _ = scripted
    plain = _prompt(client, tokenizer)
    auto = _prompt(client, tokenizer, tools=[ADD, HANDOFF])
    assert _prompt(client, tokenizer, tools=[ADD, HANDOFF], tool_choice="auto") == auto
    assert _prompt(client, tokenizer, tools=[ADD, HANDOFF], tool_choice="none") == plain
    required = _prompt(client, tokenizer, tools=[ADD, HANDOFF], tool_choice="required")
    named = _prompt(client, tokenizer, tools=[ADD, HANDOFF],
                    tool_choice={"type": "function", "function": {"name": "transfer_to_writer"}})
    assert len({plain, auto, required, named}) == 4
    assert "You must call at least one tool." in required and "You must call the tool 'transfer_to_writer'." in named
    single = _prompt(client, tokenizer, tools=[ADD], parallel_tool_calls=False)
    assert "Call at most one tool per answer." in single


def test_history_with_tool_calls_and_tool_results_is_rendered(scripted, tokenizer):
    client, _ = scripted
    history = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "3"},
        {"role": "user", "content": "And 2 and 3?"},
    ]
    for tools in (None, [ADD]):
        text = _prompt(client, tokenizer, messages=history, **({"tools": tools} if tools else {}))
        assert ('<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>'
                in text), text
        assert "<|im_start|>tool\n3<|im_end|>" in text
        assert text.startswith("<|im_start|>system\nYou add numbers.")


def test_bad_tool_fields_are_400(scripted):
    client, _ = scripted
    for bad in ({"tools": "add"}, {"tools": [{"type": "function"}]}, {"tools": [ADD], "tool_choice": "always"},
                {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
                {"tool_choice": "required"}, {"tools": [ADD], "parallel_tool_calls": "yes"}):
        r = client.post("/v1/chat/completions", json={"model": "planner", "messages": USER, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] in ("tools", "tool_choice", "parallel_tool_calls")


# ---- the completion -------------------------------------------------------------------------------
def test_a_valid_block_comes_back_as_tool_calls(scripted):
    client, engine = scripted
    engine.script = {"planner": [f"Let me add.\n{CALL}", CALL]}
    body = _post(client, tools=[ADD])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me add."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert "invalid_tool_calls" not in message
    # token ids and log-probs still cover the whole completion, blocks included
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 10
    only_call = _post(client, tools=[ADD])["choices"][0]["message"]
    assert only_call["content"] is None and only_call["tool_calls"][0]["id"] == call["id"]  # ids are stable


def test_malformed_blocks_stay_in_content_and_are_reported(scripted):
    client, engine = scripted
    bad_json, unknown, unclosed = ('<tool_call>{"name": "add", "arguments": {...}}</tool_call>',
                                   '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "add", "arguments": {"a": 2')
    engine.script = {"planner": [f"Sure. {bad_json} {unknown} {unclosed}"]}
    choice = _post(client, tools=[ADD])["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in message
    assert message["content"] == f"Sure. {bad_json} {unknown} {unclosed}"
    invalid = message["invalid_tool_calls"]
    assert [set(entry) for entry in invalid] == [{"id", "name", "args", "error"}] * 3
    assert "not valid JSON" in invalid[0]["error"] and invalid[0]["args"] == '{"name": "add", "arguments": {...}}'
    assert invalid[1]["name"] == "mul" and "unknown tool 'mul'" in invalid[1]["error"]
    assert "not closed" in invalid[2]["error"]


def test_parallel_tool_calls_false_and_tool_choice_none(scripted):
    client, engine = scripted
    two = CALL + '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}</tool_call>'
    engine.script = {"planner": [two]}
    both = _post(client, tools=[ADD])["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in both["tool_calls"]] == [{"a": 2, "b": 3}, {"a": 5, "b": 6}]
    one = _post(client, tools=[ADD], parallel_tool_calls=False)["choices"][0]["message"]
    assert len(one["tool_calls"]) == 1 and "parallel_tool_calls is false" in one["invalid_tool_calls"][0]["error"]
    assert one["content"] == '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}</tool_call>'
    none = _post(client, tools=[ADD], tool_choice="none")["choices"][0]
    assert none["message"] == {"role": "assistant", "content": two} and none["finish_reason"] == "stop"
    plain = _post(client)["choices"][0]  # no tools: the text is not parsed
    assert plain["message"] == {"role": "assistant", "content": two}


def test_streaming_carries_tool_call_deltas(scripted):
    client, engine = scripted
    engine.script = {"planner": [f"Adding. {CALL}"]}
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "planner", "messages": USER, "tools": [ADD], "stream": True, "return_token_ids": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("content") or "" for d in deltas) == "Adding."
    parts = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert parts[0]["index"] == 0 and parts[0]["id"].startswith("call_") and parts[0]["type"] == "function"
    assert parts[0]["function"]["name"] == "add"
    assert json.loads("".join(p["function"]["arguments"] for p in parts)) == {"a": 2, "b": 3}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    assert choices[-1]["finish_reason"] == "tool_calls" and choices[-1]["delta"] == {}

    engine.script = {"planner": ["<tool_call>{oops}</tool_call>"]}
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "planner", "messages": USER, "tools": [ADD], "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    last = [e["choices"][0] for e in events if e["choices"]][-1]
    assert last["finish_reason"] == "stop" and "not valid JSON" in last["delta"]["invalid_tool_calls"][0]["error"]


def test_a_template_that_renders_tools_is_used(tiny_model_dir, tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.a }}]{% endfor %}"
        "</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    engine = ScriptedEngine(tok)
    team = Team(tiny_model_dir, ["planner"], engine=engine, versions=None, model_name="tiny")
    client = TestClient(create_app(team))
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "10"}]
    text = tok.decode(_post(client, messages=history, tools=[ADD], tool_choice="required")["prompt_token_ids"])
    assert text.startswith("<tools>add;</tools>") and "[call add 7]" in text and "<tool>10</tool>" in text
    assert "You must call at least one tool." in text and engine.requests[-1].tools == [ADD]
    text_format = TestClient(create_app(team, tool_format="text"))
    text = tok.decode(_post(text_format, messages=history, tools=[ADD])["prompt_token_ids"])
    assert "<tools>" not in text and '{"name": "add", "arguments": {"a": 7, "b": 3}}' in text
    with pytest.raises(ValueError, match="tool_format"):
        create_app(team, tool_format="xml")
    team.close()


# ---- the instruction --------------------------------------------------------------------------------
def test_instruction_examples_are_valid_calls_built_from_the_schemas():
    assert example_call(HANDOFF) == '<tool_call>{"name": "transfer_to_writer", "arguments": {}}</tool_call>'
    text = tools_instruction([ADD, HANDOFF])
    examples = re.findall(r"^Example: <tool_call>(.*)</tool_call>$", text, re.M)
    assert [json.loads(e) for e in examples] == [{"name": "add", "arguments": {"a": 1, "b": 1}},
                                                 {"name": "transfer_to_writer", "arguments": {}}]
    assert "{...}" not in text and "<tool name>" not in text
    assert parse_tool_calls(text, ["add", "transfer_to_writer"])[1] == []  # every block in it parses
    schema = {"type": "object", "required": ["s", "i", "n", "b", "l", "o", "e", "opt", "ref"], "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "l": {"type": "array", "items": {"type": "string"}}, "o": {"type": "object"},
        "e": {"type": "string", "enum": ["fast", "slow"]}, "opt": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
        "ref": {"$ref": "#/$defs/Mode"}, "extra": {"type": "string"}}, "$defs": {"Mode": {"enum": ["x", "y"]}}}
    assert example_arguments(schema) == {"s": "...", "i": 1, "n": 1.0, "b": True, "l": [], "o": {}, "e": "fast",
                                         "opt": 1, "ref": "x"}
    assert example_value({"type": ["null", "integer"]}) == 1 and example_value(None) == "..."


# ---- one format for the server and TeamChatModel ------------------------------------------------------
@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


LC_HISTORY = [SystemMessage("You add numbers."), HumanMessage("Add 1 and 2."),
              AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_1"}]),
              ToolMessage("3", tool_call_id="call_1"), HumanMessage("And 2 and 3?")]


def test_server_and_team_chat_model_render_the_same_prompt(tiny_model_dir):
    from langchain_openai.chat_models.base import _convert_message_to_dict

    torch.set_num_threads(1)
    with Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4), versions=None, model_name="tiny") as team:
        client = TestClient(create_app(team))
        for kwargs, choice in (({}, None), ({"tool_choice": "any"}, "required"),
                               ({"tool_choice": "add"}, {"type": "function", "function": {"name": "add"}})):
            llm = TeamChatModel(team=team, max_tokens=1, temperature=0).bind_tools([add], **kwargs)
            ours = llm.invoke(LC_HISTORY).response_metadata["marft"]["prompt_token_ids"]
            body = {"messages": [_convert_message_to_dict(m) for m in LC_HISTORY], "max_tokens": 1,
                    "tools": [convert_to_openai_tool(add)], "temperature": 0, "model": "tiny", "return_token_ids": True}
            if choice:
                body["tool_choice"] = choice
            served = client.post("/v1/chat/completions", json=body).json()["prompt_token_ids"]
            assert served == ours, (team.tokenizer.decode(served), team.tokenizer.decode(ours))
    # and the message lists themselves agree, tool-call history included
    as_openai = [_convert_message_to_dict(m) for m in LC_HISTORY]
    tools = [convert_to_openai_tool(add)]
    assert render_messages(as_openai, tools) == TeamChatModel._chat_messages(LC_HISTORY, {"tools": tools})


# ---- langchain_openai.ChatOpenAI against a real HTTP server ------------------------------------------------
@pytest.fixture(scope="module")
def http_server(scripted):
    import uvicorn

    client, engine = scripted
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1", engine
    server.should_exit = True
    thread.join(timeout=10)


def test_chat_openai_bind_tools_gets_tool_calls(http_server):
    from langchain_openai import ChatOpenAI

    base_url, engine = http_server
    llm = ChatOpenAI(base_url=base_url, api_key="none", model="planner", temperature=0, max_retries=0).bind_tools([add])
    engine.script = {"planner": [f"Let me add. {CALL}"]}
    msg = llm.invoke("Add 2 and 3.")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert msg.content == "Let me add." and msg.response_metadata["finish_reason"] == "tool_calls"
    prompt = engine.requests[-1].messages[0]["content"]
    assert '"name": "add"' in prompt and "Example: <tool_call>" in prompt

    chunks = list(llm.stream("Add 2 and 3."))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 2, "b": 3})]

    # the next turn: the tool result goes back and the server renders the call in the history
    engine.script = {"planner": ["It is 5."]}
    answer = llm.invoke([HumanMessage("Add 2 and 3."), msg, ToolMessage("5", tool_call_id=msg.tool_calls[0]["id"])])
    assert answer.content == "It is 5." and answer.tool_calls == []
    history = engine.requests[-1].messages
    assert history[-2] == {"role": "assistant", "content": f"Let me add.\n{CALL}"}
    assert history[-1] == {"role": "tool", "content": "5", "tool_call_id": msg.tool_calls[0]["id"]}


def test_chat_openai_sees_a_malformed_call_in_content(http_server):
    from langchain_openai import ChatOpenAI

    base_url, engine = http_server
    llm = ChatOpenAI(base_url=base_url, api_key="none", model="planner", max_retries=0).bind_tools([add])
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }}</tool_call>'
    engine.script = {"planner": [f"{bad}\n{CALL}"]}
    msg = llm.invoke("Add 2 and 3.")
    # ChatOpenAI drops unknown message fields (our `invalid_tool_calls`): the raw block stays in content
    assert [c["args"] for c in msg.tool_calls] == [{"a": 2, "b": 3}] and msg.content == bad
    assert "not valid JSON" in parse_tool_calls(msg.content, ["add"])[1][0]["error"]


def test_create_supervisor_hands_off_through_the_server(http_server):
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from langgraph_supervisor import create_supervisor

    base_url, engine = http_server

    def model(role):
        return ChatOpenAI(base_url=base_url, api_key="none", model=role, temperature=0, max_retries=0)

    writer = create_agent(model("writer"), tools=[], name="writer", system_prompt="You write.")
    app = create_supervisor([writer], model=model("planner"), prompt="Hand writing tasks to the writer.").compile()
    engine.script = {"planner": ['<tool_call>{"name": "transfer_to_writer", "arguments": {}}</tool_call>', "Done."],
                     "writer": ["A poem about tools."]}
    out = app.invoke({"messages": [HumanMessage("Write a poem.")]})
    texts = [m.content for m in out["messages"]]
    assert "A poem about tools." in texts and texts[-1] == "Done."
    handoff = next(m for m in out["messages"] if isinstance(m, AIMessage) and m.tool_calls)
    assert handoff.tool_calls[0]["name"] == "transfer_to_writer"


def test_team_chat_model_tool_choice_none_and_parallel_false(scripted):
    client, engine = scripted
    team = client.app.state.team
    engine.script = {None: [CALL]}
    msg = TeamChatModel(team=team).bind_tools([add], tool_choice="none").invoke([HumanMessage("Add 2 and 3.")])
    assert msg.tool_calls == [] and msg.invalid_tool_calls == [] and msg.content == CALL
    assert [m["role"] for m in engine.requests[-1].messages] == ["user"]  # no tool instruction
    msg = TeamChatModel(team=team).bind_tools([add], parallel_tool_calls=False).invoke([HumanMessage("Add 2 and 3.")])
    assert [c["args"] for c in msg.tool_calls] == [{"a": 2, "b": 3}]
    assert "Call at most one tool per answer." in engine.requests[-1].messages[0]["content"]
