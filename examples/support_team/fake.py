"""A scripted, deterministic chat model that plays every support-team role (for tests and sample traces).

It reads the system prompt to know which agent is asking and answers the way a competent model
would: the planner picks topics by keyword, researchers call `lookup` then report, the writer
quotes the findings, and the critic asks for a polite sign-off (or, for questions marked
"urgent", keeps asking so the revision cap is exercised).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

# keyword in the question -> topic the planner asks for ("gift" has no knowledge-base entry: a tool error)
TOPIC_KEYWORDS: dict[str, str] = {
    "refund": "refund_policy",
    "shipping": "shipping_time",
    "deliver": "shipping_time",
    "warranty": "warranty",
    "password": "password_reset",
    "abroad": "international_shipping",
    "countries": "international_shipping",
    "cancel": "order_cancellation",
    "gift": "gift_cards",
}


class FakeSupportModel(BaseChatModel):
    """Deterministic stand-in for an LLM in the support team; supports `bind_tools`."""

    model_name: str = "fake-support-model"

    @property
    def _llm_type(self) -> str:
        return "fake-support"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name}

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        message = self._respond(messages)
        prompt_words = sum(len(str(m.content).split()) for m in messages)
        out_words = max(1, len(str(message.content).split()))
        message.usage_metadata = {"input_tokens": prompt_words, "output_tokens": out_words,
                                  "total_tokens": prompt_words + out_words}
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": self.model_name,
                                      "token_usage": {"prompt_tokens": prompt_words, "completion_tokens": out_words,
                                                      "total_tokens": prompt_words + out_words}})

    def _respond(self, messages: list[BaseMessage]) -> AIMessage:
        system = next((str(m.content) for m in messages if isinstance(m, SystemMessage)), "")
        user = next((str(m.content) for m in messages if m.type == "human"), "")
        if "planner" in system:
            topics = []
            for word, topic in TOPIC_KEYWORDS.items():
                if word in user.lower() and topic not in topics:
                    topics.append(topic)
            return AIMessage(content="TOPICS: " + ", ".join(topics or ["refund_policy"]))
        if "researcher" in system:
            topic = _field(user, "Your topic")
            results = [m for m in messages if isinstance(m, ToolMessage)]
            if not results:
                call_id = "call_" + hashlib.sha256(user.encode()).hexdigest()[:12]
                return AIMessage(content="", tool_calls=[{"name": "lookup", "args": {"topic": topic}, "id": call_id}])
            fact = str(results[-1].content)
            if getattr(results[-1], "status", "success") == "error" or fact.startswith("Error"):
                return AIMessage(content=f"FINDING [{topic}]: nothing in the knowledge base.")
            return AIMessage(content=f"FINDING [{topic}]: {fact}")
        if "writer" in system:
            findings = [ln.split(":", 1)[1].strip() for ln in user.splitlines() if ln.startswith("FINDING")]
            body = " ".join(findings) or "We could not find that information."
            if "Previous draft:" not in user:
                return AIMessage(content=f"ANSWER: {body}")
            n = 1 + len(re.findall(r"revision \d", _field(user, "Previous draft", multiline=True)))
            return AIMessage(content=f"ANSWER (revision {n}): {body} Thank you.")
        if "critic" in system:
            question = _field(user, "Question")
            draft = user.split("Draft:\n", 1)[-1]
            if "urgent" in question.lower():
                return AIMessage(content=f"REVISE: the customer is in a hurry; put the key number first (draft of {len(draft)} chars).")
            if draft.rstrip().endswith("Thank you."):
                return AIMessage(content="APPROVE: the draft quotes the findings and ends politely.")
            return AIMessage(content="REVISE: end the answer with 'Thank you.'")
        return AIMessage(content="I am not sure which role I play.")


def _field(text: str, name: str, *, multiline: bool = False) -> str:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(name + ":"):
            rest = line.split(":", 1)[1].strip()
            if rest or not multiline:
                return rest
            return lines[i + 1] if i + 1 < len(lines) else ""
    return ""
