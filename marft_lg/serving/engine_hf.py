"""The embedded engine: ONE transformers base model with N peft LoRA adapters, in-process.

A background thread runs its own KV-cached sampling loop with continuous batching: requests that
arrive while rows are decoding are prefilled and join the batch at the next step, and a finished
row is answered at once and leaves the cache. Owning the loop is what gives exact per-request seeds
(each request draws from its own generator, whatever the batch), stop strings, and the log-prob of
every sampled token under the unprocessed model distribution: the numbers the trainer needs.

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
import logging
import queue
import random
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.serving.errors import ContextLengthError, UnknownAgentError
from marft_lg.serving.integrity import base_shapes_from_model, verify_adapter
from marft_lg.serving.lora import LoraSettings
from marft_lg.serving.mixed_forward import BASE, RowAdapters, mixed_adapter_forward
from marft_lg.serving.prefix import common_prefix_length
from marft_lg.serving.types import ChatRequest, Completion

log = logging.getLogger(__name__)


@dataclass
class _Item:
    request: ChatRequest
    adapter: str | None
    prompt_ids: list[int]
    future: Future
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Row:
    """One request being decoded: its sampling state and what it has produced so far."""

    item: _Item
    name: str  # adapter, or BASE
    gen: Any  # its own torch.Generator: a seeded request samples the same tokens whatever the batch
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    finish: str = "length"
    stop_at: int | None = None


@dataclass
class _Running:
    """Rows decoding together: one KV cache, the left-padded attention mask, each row's last position and token."""

    rows: list[_Row]
    cache: Any
    mask: Any  # [rows, cached columns]
    positions: Any  # [rows]
    last: Any  # [rows], None right after the prefill


class _PrefixStore:
    """Keys and values of recent prompt prefixes per adapter weights (least recently used dropped first)."""

    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[Any, tuple[int, ...]], list[tuple[Any, Any]]] = OrderedDict()

    def find(self, key: Any, prompt: list[int], limit: int) -> tuple[int, list[tuple[Any, Any]]]:
        """The longest stored prefix (under `key`) the prompt starts with, cut to `limit` tokens: (length, layers)."""
        best, layers, hit = 0, [], None
        for entry in self._entries:
            if entry[0] != key:
                continue
            tokens, n = entry[1], 0
            end = min(len(tokens), len(prompt))
            while n < end and tokens[n] == prompt[n]:
                n += 1
            if min(n, limit) > best:
                best, layers, hit = min(n, limit), self._entries[entry], entry
        if hit is not None:
            self._entries.move_to_end(hit)
        return best, layers

    def add(self, key: Any, tokens: list[int], layers: list[tuple[Any, Any]]) -> None:
        self._entries[(key, tuple(tokens))] = layers
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


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
    """

    def __init__(self, model_dir: str | Path, *, model_name: str | None = None, max_batch_size: int = 32,
                 batch_wait_s: float = 0.005, max_context: int | None = None, seed: int = 0,
                 min_shared_prefix: int = 16, device: str | None = "auto", dtype: str | None = "auto"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from marft_lg.serving.device import resolve_device, resolve_dtype

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
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {int(t) for t in [*eos, self.tokenizer.eos_token_id] if t is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids))
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._seeds = random.Random(seed)
        self._lock = threading.RLock()  # held for a whole serving session, and by exclusive()
        self._step_lock = threading.RLock()  # held for one forward pass, and while adapters change
        self._exclusive_owner: int | None = None
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        self.min_shared_prefix = min_shared_prefix
        self.stats = {"batches": 0, "requests": 0, "largest_batch": 0, "generated_tokens": 0, "shared_prefix_tokens": 0,
                      "prefix_cache_hits": 0, "joined_running": 0}
        self._pausing = 0  # exclusive() callers waiting: a session stops admitting requests so it can end
        self._adapters_epoch = 0  # bumped whenever adapters or weights may have changed
        self._adapter_params: dict[str, list[Any]] = {}
        self._plans: dict[Any, RowAdapters | None] = {}
        self._prefixes = _PrefixStore()
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        # rows join a running batch by left-padding caches: plain growing layers only (not sliding windows)
        self._joinable = all(type(layer) is DynamicLayer for layer in DynamicCache(config=self.config).layers)

    # ---- adapters ------------------------------------------------------------------------------
    @property
    def is_peft(self) -> bool:
        return hasattr(self.model, "peft_config")

    def loaded_adapters(self) -> list[str]:
        return sorted(self.model.peft_config) if self.is_peft else []

    def add_adapter(self, name: str, settings: LoraSettings | None = None, *, seed: int = 0) -> None:
        """A freshly initialised, trainable adapter named `name` (no-op if it exists)."""
        import torch
        from peft import get_peft_model

        cfg = (settings or LoraSettings()).to_peft()
        with self._adapter_lock():
            if name in self.loaded_adapters():
                return
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                if self.is_peft:
                    self.model.add_adapter(name, cfg)
                else:
                    self.model = get_peft_model(self.model, cfg, adapter_name=name)
            self.model.eval()

    def load_adapter(self, name: str, path: str | Path, *, trainable: bool = True) -> None:
        """Load a PEFT directory (safetensors only) as adapter `name`; loading a loaded name is a no-op.

        The files are verified first (safetensors header, LoRA ranks, every matrix fits this base model,
        every targeted layer has weights; `marft_lg.serving.integrity`): a damaged adapter raises
        `AdapterIntegrityError` before peft is called. peft registers an adapter before it reads the
        weights, so should it still fail, the half-made adapter is removed again: a failed load leaves
        the engine exactly as it was.
        """
        from peft import PeftModel

        path = Path(path)
        verify_adapter(path, base_shapes=self.module_shapes, require_lora=True)
        with self._adapter_lock():
            if name in self.loaded_adapters():
                return
            was_peft = self.is_peft
            try:
                if was_peft:
                    self.model.load_adapter(str(path), adapter_name=name, is_trainable=trainable)
                else:
                    self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name,
                                                           is_trainable=trainable)
            except BaseException:
                self._discard_failed_load(name, was_peft)
                raise
            self.model.eval()

    def _discard_failed_load(self, name: str, was_peft: bool) -> None:
        """Undo what a failed peft load left behind (the adapter, or the LoRA layers injected into the base)."""
        if was_peft:
            if name in getattr(self.model, "peft_config", {}):
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                    self.model.delete_adapter(name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        model = self.model  # the plain base model, which PeftModel.from_pretrained changed in place
        injected = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
        for module_name, module in injected:
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            if attr in vars(model):
                delattr(model, attr)
        log.warning("a failed load of adapter %r was undone (%d injected layers removed)", name, len(injected))

    def unload_adapter(self, name: str) -> None:
        """Delete an adapter's weights between two decode steps; the caller ensures no request uses it."""
        with self._adapter_lock():
            if name not in self.loaded_adapters():
                raise UnknownAgentError(name, self.loaded_adapters(), what="adapter")
            with warnings.catch_warnings():  # peft re-points its "active adapter", which serving never uses
                warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                self.model.delete_adapter(name)

    @contextmanager
    def _adapter_lock(self) -> Iterator[None]:
        """Adapters change between two decode steps of a running batch (its rows keep their adapters).

        Wrapping the plain base model into a PeftModel changes what a running batch calls, so that
        first adapter waits for the batch to end.
        """
        with self._step_lock if self.is_peft else self._paused(), self._step_lock:
            try:
                yield
            finally:
                self._adapters_changed()

    def _adapters_changed(self) -> None:
        """Forget what was derived from adapter weights (stacked matrices, parameter lists, cached prefixes)."""
        self._adapters_epoch += 1
        self._adapter_params = {}
        self._prefixes.clear()

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """Hold the serving lock: a running session stops admitting requests, ends, and lets the caller in."""
        self._pausing += 1
        try:
            with self._lock:
                yield
        finally:
            self._pausing -= 1

    def max_context(self) -> int:
        return self._max_context

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """Pause serving while the caller updates the model in this thread.

        The running rows finish first (requests arriving meanwhile wait), so no answer mixes weights.
        """
        with self._paused():
            self._exclusive_owner = threading.get_ident()
            try:
                yield self.model
            finally:
                self._exclusive_owner = None
                self._adapters_changed()

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, req: ChatRequest) -> list[int]:
        """The prompt token ids of a request (chat template with the generation prompt, and its tools)."""
        ids = self.tokenizer.apply_chat_template(
            normalise_messages(req.messages), add_generation_prompt=True, tokenize=True, return_dict=False,
            **({"tools": req.tools} if req.tools else {}),
        )
        return [int(t) for t in ids]

    def submit(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Future]:
        """Queue requests for the batching loop; each future resolves to a `Completion`.

        Validation (unknown adapter, bad parameters, prompt too long) raises here, before anything is queued.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._exclusive_owner == threading.get_ident():
            raise RuntimeError("cannot generate inside exclusive(): serving is paused by this very thread")
        if len(requests) != len(adapter_names):
            raise ValueError(f"{len(requests)} requests but {len(adapter_names)} adapter names")
        loaded = set(self.loaded_adapters())
        items = []
        for req, name in zip(requests, adapter_names, strict=True):
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
            items.append(_Item(req, name, ids, Future()))
        self._ensure_thread()
        for it in items:
            self._queue.put(it)
        return [it.future for it in items]

    def generate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        return [f.result() for f in self.submit(requests, adapter_names)]

    async def agenerate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        if self._exclusive_owner == threading.get_ident():
            raise RuntimeError("cannot generate inside exclusive(): serving is paused by this very thread")
        # validation and tokenizing (chat template) run in a worker thread: a long prompt never stalls the event loop
        futures = await asyncio.to_thread(self.submit, requests, adapter_names)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
        while True:
            try:
                it = self._queue.get_nowait()
            except queue.Empty:
                break
            if it is not None and not it.future.done():
                it.future.set_exception(RuntimeError("engine closed before the request ran"))

    # ---- batching loop -------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="marft-hf-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        """Sessions of continuous batching: a session starts with the queued requests and ends when its
        last row finishes; requests that arrive meanwhile join it at the next decode step."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            arrivals, closing = self._gather([first], wait_s=self.batch_wait_s, room=self.max_batch_size)
            with self._lock:
                closing = self._session(arrivals, closing)
            if closing:
                return

    def _gather(self, items: list[_Item], *, wait_s: float, room: int) -> tuple[list[_Item], bool]:
        """Queued requests appended to `items` (waiting up to `wait_s` for more), at most `room` in all;
        True when close() was asked for."""
        deadline = time.perf_counter() + wait_s
        while len(items) < room:
            try:
                it = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if it is None:
                return items, True
            items.append(it)
        return items, False

    def _session(self, arrivals: list[_Item], closing: bool) -> bool:
        """Decode until no row is left, admitting queued requests between steps (unless exclusive() or
        close() waits); returns whether close() was asked for."""
        import torch

        was_training = self.model.training
        self.model.eval()
        running: _Running | None = None
        self._plans = {}
        self.stats["batches"] += 1  # counted as it starts: its first answers may be read before it ends
        try:
            with torch.inference_mode():
                while True:
                    if arrivals:
                        running = self._admit(arrivals, running)
                        arrivals = []
                    if running is not None and running.rows:
                        running = self._decode(running)
                    can_join = self._joinable or running is None or not running.rows
                    if closing or self._pausing or not can_join:
                        if running is None or not running.rows:
                            break
                        continue
                    busy = len(running.rows) if running is not None else 0
                    arrivals, closing = self._gather([], wait_s=0.0, room=self.max_batch_size - busy)
                    if not arrivals and not busy:
                        break
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            waiting = [row.item for row in running.rows] if running is not None else []
            log.exception("a batch of %d requests failed", len(waiting) + len(arrivals))
            for it in [*waiting, *arrivals]:
                if not it.future.done():
                    it.future.set_exception(e)
        finally:
            self.model.train(was_training)
            self._plans = {}
        return closing

    def _admit(self, items: list[_Item], running: _Running | None) -> _Running | None:
        """Prefill new requests (one group per adapter, each group's shared prefix once), sample their
        first tokens and merge them into the running rows."""
        live = [it for it in items if it.future.set_running_or_notify_cancel()]
        if running is not None and running.rows:
            self.stats["joined_running"] += len(live)
        groups: dict[str, list[_Item]] = {}
        for it in live:
            groups.setdefault(it.adapter or BASE if self._joinable else "", []).append(it)
        for group in groups.values():
            part, logits = self._prefill(group)
            part = self._step(part, logits)
            if running is None or not running.rows:
                running = part
            elif part.rows:
                running = self._merge(running, part)
        if running is not None:
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(running.rows))
        return running

    def _forward(self, names: list[str], **kwargs: Any) -> Any:
        """One model call for rows using adapters `names`, between two adapter changes.

        A batch on one adapter runs it as peft's active adapter; a mixed batch runs the base once and
        adds each row's LoRA delta (`RowAdapters`), or peft's per-row path for LoRA variants.
        """
        with self._step_lock:
            if not self.is_peft:
                return self.model(**kwargs)
            unique = sorted(set(names))
            if len(unique) == 1 and unique[0] != BASE:
                if self.model.active_adapter != unique[0]:
                    self.model.set_adapter(unique[0], inference_mode=True)
                return self.model(**kwargs)
            key = (self._adapters_epoch, tuple(unique))
            if key not in self._plans:
                self._plans[key] = RowAdapters(self.model, unique) if RowAdapters.supported(self.model, unique) else None
            plan = self._plans[key]
            if plan is None:
                return mixed_adapter_forward(self.model, names, **kwargs)
            return plan.forward(plan.masks(names), **kwargs)

    def _prefill(self, items: list[_Item]) -> tuple[_Running, Any]:
        """Run the prompts of rows on one adapter into a new cache; returns the rows and their next-token logits.

        Rows are left-padded; a shared prefix sits before the padding, so the mask may have a hole.
        """
        import torch
        from transformers import DynamicCache

        n = len(items)
        names = [it.adapter or BASE for it in items]
        rows = [_Row(it, name, self._generator(it)) for it, name in zip(items, names, strict=True)]
        cache, shared = self._prefix_cache(items, names)
        cache = cache if cache is not None else DynamicCache(config=self.config)
        width = max(len(it.prompt_ids) for it in items) - shared
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, it in enumerate(items):
            rest = it.prompt_ids[shared:]
            input_ids[i, width - len(rest):] = torch.tensor(rest)
            mask[i, shared + width - len(rest):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        out = self._forward(names, input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
        return _Running(rows, cache, mask, positions[:, -1], None), out.logits[:, -1, :]

    def _prefix_cache(self, items: list[_Item], names: list[str]) -> tuple[Any, int]:
        """A cache holding the prompt prefix the rows share (system prompt, few-shot turns), or (None, 0).

        Rows on one adapter only (each adapter has its own keys and values). The prefix comes from
        the prefix store when an earlier request on the same adapter weights began the same way, and
        is added to it otherwise; at least one token of each prompt stays in the per-row part, so every
        row gets its own next-token logits.
        """

        if len(set(names)) != 1:
            return None, 0
        with self._step_lock:  # the store changes with the adapters
            return self._shared_prefix(items, names[0])

    def _shared_prefix(self, items: list[_Item], name: str) -> tuple[Any, int]:
        import torch
        from transformers import DynamicCache

        prompts = [it.prompt_ids for it in items]
        limit = common_prefix_length(prompts) if len(items) > 1 else len(prompts[0]) - 1
        if limit < self.min_shared_prefix:
            return None, 0
        if not self._joinable:  # layers that are not plain growing caches: share within this batch only
            if len(items) < 2:
                return None, 0
            cache = DynamicCache(config=self.config)
            self._forward([name], input_ids=torch.tensor([prompts[0][:limit]], device=self.device),
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(len(items))
            self.stats["shared_prefix_tokens"] += limit * (len(items) - 1)
            return cache, limit
        key = (name, self._weights_version(name))
        shared, layers = self._prefixes.find(key, prompts[0], limit)
        if shared >= self.min_shared_prefix:
            self.stats["prefix_cache_hits"] += 1
            self.stats["shared_prefix_tokens"] += shared * len(items)
        else:
            cache = DynamicCache(config=self.config)
            self._forward([name], input_ids=torch.tensor([prompts[0][:limit]], device=self.device),
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            self._prefixes.add(key, prompts[0][:limit], layers)
            shared = limit
            self.stats["shared_prefix_tokens"] += shared * (len(items) - 1)
        n = len(items)
        return DynamicCache(ddp_cache_data=[(k[:, :, :shared].expand(n, -1, -1, -1), v[:, :, :shared].expand(n, -1, -1, -1))
                                            for k, v in layers], config=self.config), shared

    def _weights_version(self, name: str) -> tuple[int, ...]:
        """Changes whenever adapter `name`'s weights do (loaded anew, or updated in place by an optimizer)."""
        if name == BASE:
            return ()
        params = self._adapter_params.get(name)
        if params is None:
            params = [p for n, p in self.model.named_parameters() if f".{name}." in n]
            self._adapter_params[name] = params
        return (self._adapters_epoch, *(p._version for p in params))

    def _decode(self, running: _Running) -> _Running:
        """One decode step for every running row."""
        import torch

        mask = torch.cat([running.mask, running.mask.new_ones((len(running.rows), 1))], dim=1)
        positions = running.positions + 1
        out = self._forward([r.name for r in running.rows], input_ids=running.last[:, None], attention_mask=mask,
                            position_ids=positions[:, None], past_key_values=running.cache, use_cache=True)
        running.mask, running.positions = mask, positions
        return self._step(running, out.logits[:, -1, :])

    def _step(self, running: _Running, logits: Any) -> _Running:
        """Sample one token per row, answer the rows that finished, and keep the others."""
        import torch

        rows = running.rows
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        temps = torch.tensor([float(r.item.request.temperature) for r in rows], device=logits.device)
        top_ps = torch.tensor([float(r.item.request.top_p) for r in rows], device=logits.device)
        chosen = self._choose(logits, temps, top_ps, [r.gen for r in rows])
        chosen_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()  # one device->host copy per step
        keep = []
        for j, (row, tok) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            req = row.item.request
            row.tokens.append(tok)
            row.lps.append(chosen_lp[j])
            if req.top_logprobs:
                v, ix = logp[j].topk(int(req.top_logprobs))
                row.tops.append(dict(zip(ix.tolist(), v.tolist(), strict=True)))
            if tok in self.eos_token_ids and not req.ignore_eos:
                row.finish = "stop"
            elif req.stop and (cut := self._stop_index(row.tokens, req.stop)) is not None:
                row.finish, row.stop_at = "stop", cut
            elif len(row.tokens) >= req.max_tokens:
                row.finish = "length"
            else:
                keep.append(j)
                continue
            self._answer(row)
        running.last = chosen
        if len(keep) < len(rows):
            running = self._select(running, keep)
        return running

    def _select(self, running: _Running, keep: list[int]) -> _Running:
        """The running rows `keep` (indices); cache columns no remaining row attends to are dropped."""
        import torch

        rows = [running.rows[j] for j in keep]
        if not rows:
            return _Running([], None, None, None, None)
        idx = torch.tensor(keep, device=self.device)
        running.cache.batch_select_indices(idx)
        mask, positions, last = running.mask[idx], running.positions[idx], running.last[idx]
        first = int(mask.any(dim=0).int().argmax())
        if first and self._joinable:
            mask = mask[:, first:]
            for layer in running.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        return _Running(rows, running.cache, mask, positions, last)

    def _merge(self, a: _Running, b: _Running) -> _Running:
        """One batch of two: the shorter cache is left-padded (masked) to the other's length."""
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache

        la, lb = a.mask.shape[1], b.mask.shape[1]
        width = max(la, lb)

        def pad(t: Any, length: int) -> Any:
            return F.pad(t, (0, 0, width - length, 0)) if length < width else t

        layers = [(torch.cat([pad(x.keys, la), pad(y.keys, lb)]), torch.cat([pad(x.values, la), pad(y.values, lb)]))
                  for x, y in zip(a.cache.layers, b.cache.layers, strict=True)]
        mask = torch.cat([F.pad(a.mask, (width - la, 0)), F.pad(b.mask, (width - lb, 0))])
        return _Running(a.rows + b.rows, DynamicCache(ddp_cache_data=layers, config=self.config), mask,
                        torch.cat([a.positions, b.positions]), torch.cat([a.last, b.last]))

    def _generator(self, it: _Item) -> Any:
        import torch

        g = torch.Generator()
        g.manual_seed(it.request.seed if it.request.seed is not None else self._seeds.getrandbits(63))
        return g

    def _answer(self, row: _Row) -> None:
        """Resolve a finished row's future now, whatever the rows still decoding."""
        it = row.item
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        if row.stop_at is not None:
            text = text[: row.stop_at]
        extra: dict[str, Any] = {"top_logprobs": row.tops} if it.request.top_logprobs else {}
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(row.tokens)
        it.future.set_result(Completion(
            text=text, prompt_token_ids=list(it.prompt_ids), completion_token_ids=row.tokens, logprobs=row.lps,
            finish_reason=row.finish, agent=it.request.agent, model=self.model_name,
            latency_s=time.perf_counter() - it.submitted, extra=extra,
        ))

    def _stop_index(self, tokens: list[int], stops: list[str]) -> int | None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _choose(logits, temps, top_ps, gens):
        """One token per row: greedy where temperature is 0, else top-p sampling by inverse CDF.

        Each row draws one uniform number from its own generator, so a seeded request samples the
        same tokens whatever else shares its batch.
        """
        import torch

        greedy = temps <= 0
        chosen = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return chosen
        u = torch.cat([torch.rand(1, generator=g) for g in gens]).to(logits.device)  # CPU draws: same tokens on any device
        probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
        if bool((top_ps < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            sorted_p = sorted_p.masked_fill((cum - sorted_p) >= top_ps[:, None], 0.0)
            cdf = sorted_p.cumsum(dim=-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
            sampled = order.gather(1, pick)[:, 0]
        else:
            cdf = probs.cumsum(dim=-1)
            sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp(max=cdf.shape[-1] - 1)
        return torch.where(greedy, chosen, sampled)
