"""The embedded engine: ONE transformers base model with N peft LoRA adapters, in-process.

A background thread gathers concurrent requests into one left-padded batch (mixed adapters go
through peft's ``adapter_names=``), then runs its own KV-cached sampling loop. Owning the loop is
what gives exact per-request seeds (each request draws from its own generator, whatever the batch),
stop strings, finished rows dropped from the cache, and the log-prob of every sampled token under
the unprocessed model distribution — the numbers the trainer needs.

Two speed-ups matter on CPU, where a decode step is bound by reading the weights: a batch on one
adapter runs it as peft's active adapter instead of the mixed-batch path, and the prompt prefix all
rows of such a batch share (system prompt, few-shot turns) is prefilled once (`min_shared_prefix`).
That prefill changes float summation order, so a seeded request is reproducible whatever the batch
up to rounding; set `min_shared_prefix` very high where token-exact replays across batch shapes matter.
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
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.serving.errors import ContextLengthError, UnknownAgentError
from marft_lg.serving.integrity import base_shapes_from_model, verify_adapter
from marft_lg.serving.lora import LoraSettings
from marft_lg.serving.mixed_forward import mixed_adapter_forward
from marft_lg.serving.prefix import common_prefix_length
from marft_lg.serving.types import ChatRequest, Completion

log = logging.getLogger(__name__)
BASE = "__base__"  # peft's name for "no adapter" inside a mixed batch


@dataclass
class _Item:
    request: ChatRequest
    adapter: str | None
    prompt_ids: list[int]
    future: Future
    submitted: float = field(default_factory=time.perf_counter)


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
        self._lock = threading.RLock()  # held for a whole batch, and by exclusive()
        self._step_lock = threading.RLock()  # held for one forward pass, and while adapters change
        self._exclusive_owner: int | None = None
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        self.min_shared_prefix = min_shared_prefix
        self.stats = {"batches": 0, "requests": 0, "largest_batch": 0, "generated_tokens": 0, "shared_prefix_tokens": 0,
                      "split_batches": 0}

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
        if self.is_peft:
            with self._step_lock:
                yield
        else:
            with self._lock, self._step_lock:
                yield

    def max_context(self) -> int:
        return self._max_context

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """Pause serving (after the running batch) while the caller updates the model in this thread."""
        with self._lock:
            self._exclusive_owner = threading.get_ident()
            try:
                yield self.model
            finally:
                self._exclusive_owner = None

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
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.perf_counter() + self.batch_wait_s
            stop = False
            while len(batch) < self.max_batch_size:
                try:
                    it = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if it is None:
                    stop = True
                    break
                batch.append(it)
            live = [it for it in batch if it.future.set_running_or_notify_cancel()]
            if live:
                try:
                    with self._lock:
                        results = self._run_batch(live)
                    for it, res in zip(live, results, strict=True):
                        it.future.set_result(res)
                except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
                    log.exception("batch of %d requests failed", len(live))
                    for it in live:
                        if not it.future.done():
                            it.future.set_exception(e)
            if stop:
                return

    def _run_batch(self, items: list[_Item]) -> list[Completion]:
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                groups = self._adapter_groups(items)
                if groups is None:
                    return self._sample(items)
                self.stats["split_batches"] += 1
                out: list[Completion | None] = [None] * len(items)
                for idx in groups:
                    for i, done in zip(idx, self._sample([items[i] for i in idx]), strict=True):
                        out[i] = done
                return out  # type: ignore[return-value]
        finally:
            self.model.train(was_training)

    def _adapter_groups(self, items: list[_Item]) -> list[list[int]] | None:
        """Row indices per adapter when a mixed batch is better run as one-adapter batches, else None.

        A mixed batch cannot share a prompt prefix (each adapter has its own keys and values), so two
        teams answering the same prompts (a shadow comparison) prefill every few-shot prompt in full.
        Split when the prefix tokens saved outweigh the extra decode passes (~8 prefill tokens a step).
        """
        by_adapter: dict[str | None, list[int]] = {}
        for i, it in enumerate(items):
            by_adapter.setdefault(it.adapter, []).append(i)
        if len(by_adapter) < 2:
            return None
        saved = sum(self._shared_prefix([items[i] for i in idx]) * (len(idx) - 1) for idx in by_adapter.values())
        extra_steps = (len(by_adapter) - 1) * max(int(it.request.max_tokens) for it in items)
        return list(by_adapter.values()) if saved > 8 * extra_steps else None

    def _forward(self, names: list[str], **kwargs: Any) -> Any:
        """One model call for rows using adapters `names`, between two adapter changes.

        A batch on one adapter runs it as peft's active adapter: the mixed-batch path
        (``adapter_names=``) gathers and scatters every row at every LoRA layer, ~30% slower.
        """
        with self._step_lock:
            if self.is_peft:
                if len(set(names)) == 1 and names[0] != BASE:
                    if self.model.active_adapter != names[0]:
                        self.model.set_adapter(names[0], inference_mode=True)
                else:
                    return mixed_adapter_forward(self.model, names, **kwargs)
            return self.model(**kwargs)

    def _shared_prefix(self, items: list[_Item]) -> int:
        """Prompt tokens every row of a one-adapter batch shares (system prompt, few-shot turns), or 0.

        That prefix is prefilled once and its KV cache repeated over the batch; at least one token of
        each prompt stays in the per-row part so every row gets its own next-token logits.
        """
        if len(items) < 2 or len({it.adapter for it in items}) != 1:
            return 0
        n = common_prefix_length([it.prompt_ids for it in items])
        return n if n >= self.min_shared_prefix else 0

    def _prefill(self, items: list[_Item], names: list[str], cache: Any) -> tuple[Any, Any, Any]:
        """Run the prompts into `cache`; returns (output, attention mask, position ids) of the batch.

        Rows are left-padded; a shared prefix sits before the padding, so the mask may have a hole.
        """
        import torch

        n = len(items)
        shared = self._shared_prefix(items)
        if shared:
            self._forward(names[:1], input_ids=torch.tensor([items[0].prompt_ids[:shared]], device=self.device),
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(n)
            self.stats["shared_prefix_tokens"] += shared * (n - 1)
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
        return out, mask, positions

    def _sample(self, items: list[_Item]) -> list[Completion]:
        import torch
        from transformers import DynamicCache

        n = len(items)
        gens = []
        for it in items:
            g = torch.Generator()
            g.manual_seed(it.request.seed if it.request.seed is not None else self._seeds.getrandbits(63))
            gens.append(g)
        temps = torch.tensor([float(it.request.temperature) for it in items], device=self.device)
        top_ps = torch.tensor([float(it.request.top_p) for it in items], device=self.device)
        tokens: list[list[int]] = [[] for _ in items]
        lps: list[list[float]] = [[] for _ in items]
        tops: list[list[dict[int, float]]] = [[] for _ in items]
        finish = ["length"] * n
        stop_at: list[int | None] = [None] * n
        names = [it.adapter or BASE for it in items]

        cache = DynamicCache(config=self.config)
        out, mask, positions = self._prefill(items, names, cache)
        rows = list(range(n))  # batch row -> item index
        last_pos = positions[:, -1]
        while True:
            logits = out.logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = self._choose(logits, temps[rows], top_ps[rows], [gens[r] for r in rows])
            chosen_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()  # one device->host copy per step
            keep = []
            for j, (r, tok) in enumerate(zip(rows, chosen.tolist(), strict=True)):
                it = items[r]
                tokens[r].append(tok)
                lps[r].append(chosen_lp[j])
                if it.request.top_logprobs:
                    v, ix = logp[j].topk(int(it.request.top_logprobs))
                    tops[r].append(dict(zip(ix.tolist(), v.tolist(), strict=True)))
                if tok in self.eos_token_ids and not it.request.ignore_eos:
                    finish[r] = "stop"
                elif it.request.stop and (cut := self._stop_index(tokens[r], it.request.stop)) is not None:
                    finish[r], stop_at[r] = "stop", cut
                elif len(tokens[r]) >= it.request.max_tokens:
                    finish[r] = "length"
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                mask, last_pos, chosen = mask[idx], last_pos[idx], chosen[idx]
                rows = [rows[j] for j in keep]
                names = [names[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            last_pos = last_pos + 1
            out = self._forward(names, input_ids=chosen[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                                past_key_values=cache, use_cache=True)

        self.stats["batches"] += 1
        self.stats["requests"] += n
        self.stats["largest_batch"] = max(self.stats["largest_batch"], n)
        self.stats["generated_tokens"] += sum(len(t) for t in tokens)
        now = time.perf_counter()
        results = []
        for i, it in enumerate(items):
            text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            if stop_at[i] is not None:
                text = text[: stop_at[i]]
            extra: dict[str, Any] = {}
            if it.request.top_logprobs:
                extra["top_logprobs"] = tops[i]
            results.append(Completion(
                text=text, prompt_token_ids=list(it.prompt_ids), completion_token_ids=tokens[i], logprobs=lps[i],
                finish_reason=finish[i], agent=it.request.agent, model=self.model_name,
                latency_s=now - it.submitted, extra=extra,
            ))
        return results

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
