"""The server-sent events of a streamed chat completion, written as its tokens are decoded (OpenAI's chunk format,
with vLLM's extra fields).

Per choice: a role chunk first; then a content chunk whenever decoded text is safe to show (`TextDeltas`), with
the log-probs (unless ``top_logprobs`` was asked: those come with the last chunk) and token ids of the tokens it
covers; when the choice finishes, the rest of its content and tokens, its tool calls as OpenAI streams them (id,
type and name, then the arguments) and a chunk with the finish_reason (and ``prompt_token_ids`` when token ids were
asked, as vLLM sends them). Then one chunk with ``usage`` (and marft's ``marft`` block), and ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from marft_lg.serving.engine.streaming import TextDeltas
from marft_lg.serving.http.chat_api import logprob_entries, tokenizer_of
from marft_lg.serving.http.transport import error_body
from marft_lg.serving.types import ChatRequest, ServedTeam

DONE = "data: [DONE]\n\n"


class ChunkStream:
    """The events of one streamed reply of `len(requests)` choices; the text of each comes from its tokens."""

    def __init__(self, team: ServedTeam, requests: list[ChatRequest], opts: dict[str, Any]):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self._base = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()),
                      "model": opts["model"]}
        self._opts = opts
        self._tok = tokenizer_of(team, opts.get("agent"), opts.get("base"))
        tools = opts.get("tool_names") is not None

        def decode(ids: list[int]) -> str:
            return self._tok.decode(ids, skip_special_tokens=True)

        self._texts = [TextDeltas(decode, stop=r.stop, tools=tools) for r in requests]
        self._sent = [0] * len(requests)  # tokens already sent per choice
        self._lps: list[list[float]] = [[] for _ in requests]
        self._live_logprobs = bool(opts["logprobs"]) and not any(r.top_logprobs for r in requests)

    def _event(self, choice: dict[str, Any] | None = None, **top: Any) -> str:
        return f"data: {json.dumps({**self._base, 'choices': [] if choice is None else [choice], **top})}\n\n"

    def start(self) -> list[str]:
        """Each choice's role chunk."""
        return [self._event({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                for i in range(len(self._texts))]

    def _tokens_part(self, index: int, ids: list[int], lps: list[float], top: Any = None) -> dict[str, Any]:
        part: dict[str, Any] = {}
        if self._opts["logprobs"]:
            part["logprobs"] = {"content": logprob_entries(self._tok, ids, lps, top, self._opts.get("tokens_as_ids"))}
        if self._opts["return_token_ids"]:
            part["token_ids"] = ids
        return part

    def tokens(self, index: int, ids: list[int], lps: list[float]) -> str | None:
        """The chunk for choice `index`'s newly decoded tokens, or None while there is nothing to show yet."""
        texts = self._texts[index]
        delta = texts.push(ids)
        self._lps[index].extend(lps)
        if not delta:
            return None
        start, end = self._sent[index], len(texts.ids)
        choice: dict[str, Any] = {"index": index, "delta": {"content": delta}, "finish_reason": None}
        if self._live_logprobs or self._opts["return_token_ids"]:
            part = self._tokens_part(index, texts.ids[start:end], self._lps[index][start:end])
            if not self._live_logprobs:
                part.pop("logprobs", None)
            choice.update(part)
            self._sent[index] = end
        return self._event(choice)

    def finish(self, response: dict[str, Any]) -> list[str]:
        """The closing chunks of every choice of the finished `response` (`completion_response`), usage, [DONE]."""
        out = []
        for ch in response["choices"]:
            i, message = ch["index"], ch["message"]
            calls, invalid = message.get("tool_calls") or [], message.get("invalid_tool_calls") or []
            ids = ch.get("token_ids") or []
            rest: dict[str, Any] = {"index": i, "delta": {"content": self._texts[i].finish(message.get("content"))},
                                    "finish_reason": None}
            if self._opts["logprobs"]:
                entries = ch["logprobs"]["content"]
                rest["logprobs"] = {"content": entries if not self._live_logprobs else entries[self._sent[i]:]}
            if self._opts["return_token_ids"]:
                rest["token_ids"] = ids[self._sent[i]:]
            out.append(self._event(rest))
            for k, call in enumerate(calls):
                head = {"index": k, "id": call["id"], "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""}}
                out.append(self._event({"index": i, "delta": {"tool_calls": [head]}, "finish_reason": None}))
                args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
                out.append(self._event({"index": i, "delta": {"tool_calls": [args]}, "finish_reason": None}))
            last = {"index": i, "delta": {"invalid_tool_calls": invalid} if invalid else {},
                    "finish_reason": ch["finish_reason"]}
            top = {"prompt_token_ids": response["prompt_token_ids"]} if "prompt_token_ids" in response else {}
            out.append(self._event(last, **top))
        out.append(self._event(usage=response["usage"], marft=response["marft"]))
        out.append(DONE)
        return out

    def error(self, status: int, message: str) -> list[str]:
        """A failure after the stream began: an error event (vLLM's shape), then [DONE]."""
        return [f"data: {json.dumps(error_body(status, message))}\n\n", DONE]


__all__ = ["ChunkStream", "DONE"]
