"""The embedded engine: ONE transformers base model with N peft LoRA adapters, in-process.

`HFEngine` loads the model and tokenizer, validates and tokenizes requests, and hands them to its
`Scheduler` (`scheduler.py`: continuous batching on a background thread, shared prompt prefixes kept in
a `PrefixStore`, `prefix.py`); its `Adapters` (`adapters.py`) add, verify-then-load and unload LoRA
adapters between two decode steps, and `sampling.py` picks each token. Owning the loop is what gives
exact per-request seeds (each request draws from its own generator, whatever the batch), stop strings,
and the log-prob of every sampled token under the unprocessed model distribution: the numbers the
trainer needs. A constrained request (`ChatRequest.constraint`) decodes under its grammar's token mask
(`marft_lg.constraints`), row by row, so constrained and free rows share a batch.

On CPU a decode step is bound by reading the weights, so rows on different adapters decode together:
one base pass plus each row's LoRA delta (`RowAdapters`); a batch on one adapter runs it as peft's
active adapter. Prompts are prefilled per adapter, and the prefix they share (system prompt,
few-shot turns) is computed once and kept for later requests on the same adapter weights
(`min_shared_prefix`). Both change float summation order, so a seeded request is reproducible
whatever the batch up to rounding; set `min_shared_prefix` very high where token-exact replays
across batch shapes matter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from marft_lg.serving.engine.adapters import Adapters
from marft_lg.serving.engine.scheduler import Item, Scheduler
from marft_lg.serving.errors import ContextLengthError, UnknownAgentError
from marft_lg.serving.registry.integrity import base_shapes_from_model, verify_adapter
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.types import ChatRequest, Completion, TokenListener


def _message_text(content: Any) -> str:
    """OpenAI content (a string or a list of parts) -> plain text for the chat template."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"unsupported message content part {part!r}: only text parts are served")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and flatten text parts; a ValueError names the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role', got {m!r:.200}")
        try:
            msg = {**m, "content": _message_text(m.get("content"))}
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
        out.append(msg)
    return out


def prompt_chars(req: ChatRequest) -> int:
    """Characters of a request's messages and tools: with `max_token_chars` a bound on its token count
    that needs no tokenizing (no token covers more characters than the longest vocabulary entry)."""
    n = 0
    for m in req.messages if isinstance(req.messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p.get("text", "")) if isinstance(p, dict) and isinstance(p.get("text"), str)
                     else len(p) if isinstance(p, str) else 0 for p in content)
    if req.tools:
        import json

        n += len(json.dumps(req.tools, ensure_ascii=False))
    return n


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters: an upper bound on the characters one token covers
    (byte-level BPE stores one character per byte; added tokens count with their full text)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(8, max((len(t) for t in vocab), default=8))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: a generous bound
        return 1024


def _check_request(req: ChatRequest) -> None:
    if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
    if not 0.0 <= float(req.temperature) <= 100.0:
        raise ValueError(f"temperature must be in [0, 100], got {req.temperature!r}")
    if not 0.0 < float(req.top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {req.top_p!r}")
    if not 0 <= int(req.top_logprobs) <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {req.top_logprobs!r}")
    if req.stop is not None and not all(isinstance(s, str) and s for s in req.stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {req.stop!r}")


class HFEngine:
    """transformers + peft engine: one base model in memory whatever the number of adapters.

    `model` is the base model until the first adapter is added, then the one `peft.PeftModel`.
    `exclusive()` pauses serving so a trainer can update that same model in-process. `device`:
    ``"auto"`` (a CUDA GPU when present), ``"cpu"``, ``"cuda:1"``...; `dtype` of the base weights:
    ``"auto"`` (float32 on CPU, bfloat16 on a GPU; adapters stay float32) or a name.
    `decode`: ``"eager"`` (the default: a growing `DynamicCache`), ``"static"`` (keys and values preallocated per
    batch slot, one step function per batch/width bucket, `static_decode.py`; on a GPU each bucket's step is captured
    as a CUDA graph) or ``"compiled"`` (that step through ``torch.compile``, `compile_mode` its mode). In the
    static modes the cache holds `max_batch_size` rows of `static_max_len` tokens (default: the context length),
    allocated on the first request, and the context length is at most `static_max_len`.
    """

    def __init__(self, model_dir: str | Path, *, model_name: str | None = None, max_batch_size: int = 32,
                 batch_wait_s: float = 0.005, max_context: int | None = None, seed: int = 0,
                 min_shared_prefix: int = 16, device: str | None = "auto", dtype: str | None = "auto",
                 decode: str = "eager", compile_mode: str | None = None, static_max_len: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from marft_lg.serving.engine.device import resolve_device, resolve_dtype
        from marft_lg.serving.engine.static_decode import DECODE_MODES

        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {list(DECODE_MODES)}, got {decode!r}")
        self.decode = decode
        self.compile_mode = compile_mode
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=resolve_dtype(dtype, self.device))
        self.model = self.model.to(self.device).eval()
        self.config = self.model.config
        self.module_shapes = base_shapes_from_model(self.model)  # what a loaded adapter must fit
        self.max_token_chars = max_token_chars(self.tokenizer)
        self._max_context = int(max_context or getattr(self.config, "max_position_embeddings", 2048))
        if decode != "eager" and static_max_len:  # the static cache's columns bound prompt + completion
            self._max_context = min(self._max_context, int(static_max_len))
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {int(t) for t in [*eos, self.tokenizer.eos_token_id] if t is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids))
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.min_shared_prefix = min_shared_prefix
        self.stats = {"batches": 0, "requests": 0, "largest_batch": 0, "generated_tokens": 0, "shared_prefix_tokens": 0,
                      "prefix_cache_hits": 0, "joined_running": 0, "constrained_tokens": 0,
                      "cancelled": 0}
        self._exclusive_owner: int | None = None
        self._grammars: Any = None
        self._closed = False
        self._scheduler = Scheduler(self, seed=seed)
        self._adapters = Adapters(self, step_lock=self._scheduler.step_lock, paused=self._scheduler.paused,
                                  on_change=self._scheduler.weights_changed)

    # ---- adapters ------------------------------------------------------------------------------
    @property
    def is_peft(self) -> bool:
        return self._adapters.is_peft

    def loaded_adapters(self) -> list[str]:
        return self._adapters.names()

    def add_adapter(self, name: str, settings: LoraSettings | None = None, *, seed: int = 0) -> None:
        """A freshly initialised, trainable adapter named `name` (no-op if it exists)."""
        self._adapters.add(name, settings, seed=seed)

    def load_adapter(self, name: str, path: str | Path, *, trainable: bool = True) -> None:
        """Load a PEFT directory (safetensors only) as adapter `name`; loading a loaded name is a no-op.

        The files are verified first (safetensors header, LoRA ranks, every matrix fits this base model,
        every targeted layer has weights; `marft_lg.serving.registry.integrity`): a damaged adapter raises
        `AdapterIntegrityError` before peft is called. peft registers an adapter before it reads the
        weights, so should it still fail, the half-made adapter is removed again: a failed load leaves
        the engine exactly as it was.
        """
        self._adapters.load(name, path, trainable=trainable, verify=verify_adapter)

    def unload_adapter(self, name: str) -> None:
        """Delete an adapter's weights between two decode steps; the caller ensures no request uses it."""
        self._adapters.unload(name)

    def max_context(self) -> int:
        return self._max_context

    @property
    def grammars(self) -> Any:
        """Compiled grammars of constrained requests for this tokenizer and logits width (made on first use)."""
        if self._grammars is None:
            from marft_lg.constraints import Grammars

            self._grammars = Grammars.for_model(self.model, self.tokenizer)  # the trainer's very rule: same masks
        return self._grammars

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """Pause serving while the caller updates the model in this thread.

        The running rows finish first (requests arriving meanwhile wait), so no answer mixes weights.
        """
        with self._scheduler.paused():
            self._exclusive_owner = threading.get_ident()
            try:
                yield self.model
            finally:
                self._exclusive_owner = None
                self._scheduler.weights_changed()

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, req: ChatRequest) -> list[int]:
        """The prompt token ids of a request (chat template with the generation prompt, and its tools)."""
        ids = self.tokenizer.apply_chat_template(
            normalise_messages(req.messages), add_generation_prompt=True, tokenize=True, return_dict=False,
            **({"tools": req.tools} if req.tools else {}),
        )
        return [int(t) for t in ids]

    def submit(self, requests: list[ChatRequest], adapter_names: list[str | None],
               listeners: list[TokenListener | None] | None = None) -> list[Future]:
        """Queue requests for the batching loop; each future resolves to a `Completion`.

        Validation (unknown adapter, bad parameters, prompt too long) raises here, before anything is queued.
        `listeners[i]` is told request i's tokens as they are decoded (streaming).
        """
        return [it.future for it in self._enqueue(requests, adapter_names, listeners)]

    def _enqueue(self, requests: list[ChatRequest], adapter_names: list[str | None],
                 listeners: list[TokenListener | None] | None) -> list[Item]:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._exclusive_owner == threading.get_ident():
            raise RuntimeError("cannot generate inside exclusive(): serving is paused by this very thread")
        if len(requests) != len(adapter_names):
            raise ValueError(f"{len(requests)} requests but {len(adapter_names)} adapter names")
        listeners = listeners or [None] * len(requests)
        if len(listeners) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(listeners)} listeners")
        loaded = set(self.loaded_adapters())
        items = []
        for req, name, listener in zip(requests, adapter_names, listeners, strict=True):
            if isinstance(req.stop, str):
                req = dataclasses.replace(req, stop=[req.stop])
            if name is not None and name not in loaded:
                raise UnknownAgentError(name, sorted(loaded), what="adapter")
            _check_request(req)
            budget = self._max_context - req.max_tokens
            chars = prompt_chars(req)
            if chars > max(budget, 0) * self.max_token_chars:  # cannot fit: refuse without tokenizing
                raise ContextLengthError(None, req.max_tokens, self._max_context, req.agent, prompt_chars=chars,
                                         chars_per_token=self.max_token_chars)
            ids = self.encode(req)
            if len(ids) + req.max_tokens > self._max_context:
                raise ContextLengthError(len(ids), req.max_tokens, self._max_context, req.agent)
            matcher = self.grammars.matcher(req.constraint) if req.constraint else None
            items.append(Item(req, name, ids, Future(), matcher=matcher, listener=listener))
        self._scheduler.put(items)
        return items

    def generate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        return [f.result() for f in self.submit(requests, adapter_names)]

    async def agenerate(self, requests: list[ChatRequest], adapter_names: list[str | None],
                        listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        """Async `generate`; cancelling the awaiting task takes its rows out of the batch at the next step."""
        if self._exclusive_owner == threading.get_ident():
            raise RuntimeError("cannot generate inside exclusive(): serving is paused by this very thread")
        # validation and tokenizing (chat template) run in a worker thread: a long prompt never stalls the event loop
        queueing = _Queueing()
        try:
            items = await asyncio.to_thread(queueing.run, self._enqueue, requests, adapter_names, listeners)
        except BaseException:  # the caller gave up while its requests were being queued: drop them once queued
            queueing.give_up()
            raise
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(it.future) for it in items)))
        except BaseException:
            for it in items:  # the caller gave up (or one row failed): the others stop decoding too
                it.cancelled = True
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._scheduler.close()


class _Queueing:
    """Requests being queued from a worker thread for a caller who may give up meanwhile: whichever comes second,
    the queued items or the giving up, marks the items cancelled (the scheduler drops them at its next step). The
    worker thread outlives a cancelled `to_thread` and even the caller's event loop, so no loop callback would do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Item] | None = None
        self._gave_up = False

    def run(self, enqueue: Any, *args: Any) -> list[Item]:
        items = enqueue(*args)
        with self._lock:
            self._items = items
            if self._gave_up:
                self._cancel()
        return items

    def give_up(self) -> None:
        with self._lock:
            self._gave_up = True
            if self._items is not None:
                self._cancel()

    def _cancel(self) -> None:
        for it in self._items or []:
            it.cancelled = True
