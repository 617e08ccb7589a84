"""TeamChatModel._should_stream: LangChain's decision, without its per-call runtime-Protocol check for plain handlers."""

from __future__ import annotations

from graph_fakes import FakeEngine
from langchain_core.callbacks import BaseCallbackHandler, CallbackManager
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models import chat_models as lc_chat_models
from langchain_core.messages import HumanMessage

from marft_lg.graph import TeamChatModel


class Plain(BaseCallbackHandler):
    run_inline = True


class Tapping(BaseCallbackHandler):
    """Structurally a LangChain streaming handler (what astream_events / stream_mode="messages" attach)."""

    def tap_output_iter(self, run_id, output):
        return output

    def tap_output_aiter(self, run_id, output):
        return output


class TapsInInit(BaseCallbackHandler):
    """The protocol's methods assigned per instance, not on the class."""

    def __init__(self):
        self.tap_output_iter = lambda run_id, output: output
        self.tap_output_aiter = lambda run_id, output: output


def _llm_run(handlers):
    return CallbackManager(handlers=handlers).on_chat_model_start({}, [[HumanMessage("hi")]])[0]


def test_same_decision_as_langchain_for_every_kind_of_handler():
    model = TeamChatModel(team=FakeEngine())
    for handlers in ([], [Plain()], [Tapping()], [TapsInInit()], [Plain(), Tapping()]):
        run = _llm_run(handlers)
        for async_api in (False, True):
            for kwargs in ({}, {"stream": True}, {"stream": False}):
                ours = model._should_stream(async_api=async_api, run_manager=run, **kwargs)
                theirs = BaseChatModel._should_stream(model, async_api=async_api, run_manager=run, **kwargs)
                assert ours == theirs, (handlers, async_api, kwargs)
    assert model._should_stream(async_api=False, run_manager=_llm_run([Tapping()])) is True
    assert model._should_stream(async_api=False, run_manager=_llm_run([Plain()])) is False


def test_plain_handlers_skip_the_protocol_isinstance(monkeypatch):
    checked = []

    class CountingMeta(type):
        def __instancecheck__(cls, instance):
            checked.append(type(instance).__name__)
            return False

    monkeypatch.setattr(lc_chat_models, "_StreamingCallbackHandler", CountingMeta("Counting", (), {}))
    model = TeamChatModel(team=FakeEngine())
    model.invoke("hi", config={"callbacks": [Plain()]})
    assert checked == []
    model._should_stream(async_api=False, run_manager=_llm_run([Tapping()]))
    assert checked == ["Tapping"]
