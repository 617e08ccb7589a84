"""The embedded engine's continuous-batching loop: a background thread prefills, decodes and answers rows.

Requests that arrive while rows are decoding are prefilled and join the batch at the next step, and a
finished row is answered at once and leaves the cache. Rows on different adapters decode together (one
base pass plus each row's LoRA delta, `RowAdapters`); a batch on one adapter runs it as peft's active
adapter. Prompts are prefilled per adapter, and the prefix they share is computed once and kept in a
`PrefixStore` for later requests on the same adapter weights.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from marft_lg.serving.engine.mixed_forward import BASE, RowAdapters, mixed_adapter_forward
from marft_lg.serving.engine.prefix import PrefixStore, common_prefix_length
from marft_lg.serving.engine.sampling import sample, stop_index, top_logprobs
from marft_lg.serving.engine.static_decode import StaticDecoder
from marft_lg.serving.types import ChatRequest, Completion, TokenListener

if TYPE_CHECKING:
    from marft_lg.serving.engine.hf import HFEngine

log = logging.getLogger("marft_lg.serving.engine.hf")  # the engine's messages keep the engine's logger


@dataclass
class Item:
    """One validated request waiting for the loop: its prompt ids and the future its caller waits on."""

    request: ChatRequest
    adapter: str | None
    prompt_ids: list[int]
    future: Future
    submitted: float = field(default_factory=time.perf_counter)
    matcher: Any = None  # a `RowMatcher` when the request is constrained
    listener: TokenListener | None = None  # told each new token (streaming)
    cancelled: bool = False  # set by the caller that gave up: the row leaves the batch at the next step


@dataclass
class _Row:
    """One request being decoded: its sampling state and what it has produced so far."""

    item: Item
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
    slots: list[int] | None = None  # static decode: each row's slot in the `StaticDecoder` (cache, mask unused)


class Scheduler:
    """Runs an engine's queued requests in sessions of continuous batching on one background thread.

    It reads the engine's `model` (replaced when the first adapter arrives), `tokenizer`, `config`,
    `device`, `eos_token_ids`, `pad_token_id`, `min_shared_prefix`, `max_batch_size`, `batch_wait_s`
    at every use and counts into `engine.stats`. `lock` is held for a whole session and by `paused()`;
    `step_lock` for one forward pass, and while adapters change.
    """

    def __init__(self, engine: HFEngine, *, seed: int = 0):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.engine = engine
        self.lock = threading.RLock()
        self.step_lock = threading.RLock()
        self._pausing = 0  # paused() callers waiting: a session stops admitting requests so it can end
        self._seeds = random.Random(seed)
        self._queue: queue.Queue[Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._epoch = 0  # bumped whenever adapters or weights may have changed
        self._adapter_params: dict[str, list[Any]] = {}
        self._plans: dict[Any, RowAdapters | None] = {}
        self._weights_seen: Any = None  # the adapters' weight versions the plans were made from
        self._prefixes = PrefixStore()
        # rows join a running batch by left-padding caches: plain growing layers only (not sliding windows)
        self._joinable = all(type(layer) is DynamicLayer for layer in DynamicCache(config=engine.config).layers)
        self._static: StaticDecoder | None = None
        mode = getattr(engine, "decode", "eager")
        if mode != "eager":
            if self._joinable:
                self._static = StaticDecoder(engine, mode=mode, step_lock=self.step_lock,
                                             compile_mode=getattr(engine, "compile_mode", None))
            else:
                log.warning("decode=%r needs plain growing cache layers (no sliding window): decoding eagerly", mode)

    # ---- the engine's side -----------------------------------------------------------------------
    def put(self, items: list[Item]) -> None:
        """Queue validated requests, starting the loop thread on first use."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="marft-hf-engine", daemon=True)
                self._thread.start()
        for it in items:
            self._queue.put(it)

    def close(self) -> None:
        """Stop the loop once its session ends; requests still queued fail."""
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

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the serving lock: a running session stops admitting requests, ends, and lets the caller in."""
        self._pausing += 1
        try:
            with self.lock:
                if self._static is not None:  # the model is the caller's now: no serving hooks on it
                    with self.step_lock:
                        self._static.drop_hooks()
                yield
        finally:
            self._pausing -= 1

    def weights_changed(self) -> None:
        """Forget what was derived from adapter weights (stacked matrices, parameter lists, cached prefixes)."""
        self._epoch += 1
        self._adapter_params = {}
        self._prefixes.clear()

    # ---- sessions --------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Sessions of continuous batching: a session starts with the queued requests and ends when its
        last row finishes; requests that arrive meanwhile join it at the next decode step."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            arrivals, closing = self._gather([first], wait_s=self.engine.batch_wait_s, room=self.engine.max_batch_size)
            with self.lock:
                closing = self._session(arrivals, closing)
            if closing:
                return

    def _gather(self, items: list[Item], *, wait_s: float, room: int) -> tuple[list[Item], bool]:
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

    def _session(self, arrivals: list[Item], closing: bool) -> bool:
        """Decode until no row is left, admitting queued requests between steps (unless paused() or
        close() waits); returns whether close() was asked for."""
        import torch

        eng = self.engine
        was_training = eng.model.training
        eng.model.eval()
        running: _Running | None = None
        self._plans = {}
        self._weights_seen = None
        if self._static is not None:
            with self.step_lock:
                self._static.begin()
        eng.stats["batches"] += 1  # counted as it starts: its first answers may be read before it ends
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
                    arrivals, closing = self._gather([], wait_s=0.0, room=eng.max_batch_size - busy)
                    if not arrivals and not busy:
                        break
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear about it
            waiting = [row.item for row in running.rows] if running is not None else []
            log.exception("a batch of %d requests failed", len(waiting) + len(arrivals))
            for it in [*waiting, *arrivals]:
                if not it.future.done():
                    it.future.set_exception(e)
        finally:
            eng.model.train(was_training)
            self._plans = {}
        return closing

    def _admit(self, items: list[Item], running: _Running | None) -> _Running | None:
        """Prefill new requests (one group per adapter, each group's shared prefix once), sample their
        first tokens and merge them into the running rows."""
        stats = self.engine.stats
        self._check_weights()
        live = [it for it in items if not self._dropped(it) and it.future.set_running_or_notify_cancel()]
        if running is not None and running.rows:
            stats["joined_running"] += len(live)
        groups: dict[str, list[Item]] = {}
        for it in live:
            groups.setdefault(it.adapter or BASE if self._joinable else "", []).append(it)
        for group in groups.values():
            part, logits = self._prefill(group)
            part = self._step(part, logits)
            if self._static is not None:
                running = self._join_static(running, part)
            elif running is None or not running.rows:
                running = part
            elif part.rows:
                running = self._merge(running, part)
        if running is not None:
            stats["largest_batch"] = max(stats["largest_batch"], len(running.rows))
        return running

    # ---- model calls -----------------------------------------------------------------------------
    def _forward(self, names: list[str], **kwargs: Any) -> Any:
        """One model call for rows using adapters `names`, between two adapter changes.

        A batch on one adapter runs it as peft's active adapter; a mixed batch runs the base once and
        adds each row's LoRA delta (`RowAdapters`), or peft's per-row path for LoRA variants.
        """
        with self.step_lock:
            model = self.engine.model
            if not hasattr(model, "peft_config"):
                return model(**kwargs)
            unique = sorted(set(names))
            if len(unique) == 1 and unique[0] != BASE:
                if model.active_adapter != unique[0]:
                    model.set_adapter(unique[0], inference_mode=True)
                return model(**kwargs)
            key = (self._epoch, tuple(unique))
            if key not in self._plans:
                self._plans[key] = RowAdapters(model, unique) if RowAdapters.supported(model, unique) else None
            plan = self._plans[key]
            if plan is None:
                return mixed_adapter_forward(model, names, **kwargs)
            return plan.forward(plan.masks(names), **kwargs)

    def _prefill(self, items: list[Item]) -> tuple[_Running, Any]:
        """Run the prompts of rows on one adapter into a new cache; returns the rows and their next-token logits.

        Rows are left-padded; a shared prefix sits before the padding, so the mask may have a hole.
        """
        import torch
        from transformers import DynamicCache

        eng = self.engine
        n = len(items)
        names = [it.adapter or BASE for it in items]
        rows = [_Row(it, name, self._generator(it)) for it, name in zip(items, names, strict=True)]
        cache, shared = self._prefix_cache(items, names)
        cache = cache if cache is not None else DynamicCache(config=eng.config)
        width = max(len(it.prompt_ids) for it in items) - shared
        input_ids = torch.full((n, width), eng.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, it in enumerate(items):
            rest = it.prompt_ids[shared:]
            input_ids[i, width - len(rest):] = torch.tensor(rest)
            mask[i, shared + width - len(rest):] = 1
        input_ids, mask = input_ids.to(eng.device), mask.to(eng.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        out = self._forward(names, input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
        return _Running(rows, cache, mask, positions[:, -1], None), out.logits[:, -1, :]

    def _prefix_cache(self, items: list[Item], names: list[str]) -> tuple[Any, int]:
        """A cache holding the prompt prefix the rows share (system prompt, few-shot turns), or (None, 0).

        Rows on one adapter only (each adapter has its own keys and values). The prefix comes from
        the prefix store when an earlier request on the same adapter weights began the same way, and
        is added to it otherwise; at least one token of each prompt stays in the per-row part, so every
        row gets its own next-token logits.
        """
        if len(set(names)) != 1:
            return None, 0
        with self.step_lock:  # the store changes with the adapters
            return self._shared_prefix(items, names[0])

    def _shared_prefix(self, items: list[Item], name: str) -> tuple[Any, int]:
        import torch
        from transformers import DynamicCache

        eng = self.engine
        prompts = [it.prompt_ids for it in items]
        limit = common_prefix_length(prompts) if len(items) > 1 else len(prompts[0]) - 1
        if limit < eng.min_shared_prefix:
            return None, 0
        if not self._joinable:  # layers that are not plain growing caches: share within this batch only
            if len(items) < 2:
                return None, 0
            cache = DynamicCache(config=eng.config)
            self._forward([name], input_ids=torch.tensor([prompts[0][:limit]], device=eng.device),
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(len(items))
            eng.stats["shared_prefix_tokens"] += limit * (len(items) - 1)
            return cache, limit
        key = (name, self._weights_version(name))
        shared, layers = self._prefixes.find(key, prompts[0], limit)
        if shared >= eng.min_shared_prefix:
            eng.stats["prefix_cache_hits"] += 1
            eng.stats["shared_prefix_tokens"] += shared * len(items)
        else:
            cache = DynamicCache(config=eng.config)
            self._forward([name], input_ids=torch.tensor([prompts[0][:limit]], device=eng.device),
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            self._prefixes.add(key, prompts[0][:limit], layers)
            shared = limit
            eng.stats["shared_prefix_tokens"] += shared * (len(items) - 1)
        n = len(items)
        return DynamicCache(ddp_cache_data=[(k[:, :, :shared].expand(n, -1, -1, -1), v[:, :, :shared].expand(n, -1, -1, -1))
                                            for k, v in layers], config=eng.config), shared

    def _check_weights(self) -> None:
        """Adapter weights changed in place since the last admission (an optimizer step between two calls, which can
        land while a session still runs): the stacked matrices of mixed batches are made anew, so every request
        admitted from now on, and the rows still running, decode with the weights as they are (as peft's own
        single-adapter path does)."""
        versions = tuple(self._weights_version(n) for n in self.engine.loaded_adapters())
        if versions == self._weights_seen:
            return
        self._weights_seen = versions
        self._plans = {}
        if self._static is not None:
            with self.step_lock:
                self._static.use_weights(versions)

    def _weights_version(self, name: str) -> tuple[int, ...]:
        """Changes whenever adapter `name`'s weights do (loaded anew, or updated in place by an optimizer)."""
        if name == BASE:
            return ()
        params = self._adapter_params.get(name)
        if params is None:
            params = [p for n, p in self.engine.model.named_parameters() if f".{name}." in n]
            self._adapter_params[name] = params
        return (self._epoch, *(p._version for p in params))

    def _dropped(self, it: Item) -> bool:
        """True (and the item's future failed) when its caller gave up: its row is not decoded any further."""
        if not it.cancelled:
            return False
        self.engine.stats["cancelled"] += 1
        if not it.future.done():
            it.future.set_exception(CancelledError())
        return True

    def _decode(self, running: _Running) -> _Running:
        """One decode step for every running row (rows whose caller gave up leave first)."""
        import torch

        if any(r.item.cancelled for r in running.rows):
            running = self._select(running, [j for j, r in enumerate(running.rows) if not self._dropped(r.item)])
            if not running.rows:
                return running
        if running.slots is not None:
            names = [r.name for r in running.rows]
            logits = self._static.step(running.slots, running.last, names, self._epoch, self._static_forward)
            return self._step(running, logits)
        mask = torch.cat([running.mask, running.mask.new_ones((len(running.rows), 1))], dim=1)
        positions = running.positions + 1
        out = self._forward([r.name for r in running.rows], input_ids=running.last[:, None], attention_mask=mask,
                            position_ids=positions[:, None], past_key_values=running.cache, use_cache=True)
        running.mask, running.positions = mask, positions
        return self._step(running, out.logits[:, -1, :])

    # ---- rows ------------------------------------------------------------------------------------
    def _step(self, running: _Running, logits: Any) -> _Running:
        """Sample one token per row, answer the rows that finished, and keep the others."""
        import torch

        rows = running.rows
        constrained = [j for j, r in enumerate(rows) if r.item.matcher is not None]
        if constrained:
            logits = self._constrain(logits, rows, constrained)
        temps = torch.tensor([float(r.item.request.temperature) for r in rows], device=logits.device)
        top_ps = torch.tensor([float(r.item.request.top_p) for r in rows], device=logits.device)
        chosen, logp, chosen_lp = sample(logits, temps, top_ps, [r.gen for r in rows])
        keep = []
        for j, (row, tok) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            req = row.item.request
            row.tokens.append(tok)
            row.lps.append(chosen_lp[j])
            if req.top_logprobs:
                row.tops.append(top_logprobs(logp[j], int(req.top_logprobs)))
            if row.item.listener is not None:
                self._tell(row.item, tok, chosen_lp[j])
            matcher = row.item.matcher
            if matcher is None:
                ended = tok in self.engine.eos_token_ids and not req.ignore_eos
            elif matcher.accept(tok):
                ended = matcher.done
            else:  # cannot happen with a masked sampler; should it, this row ends, the batch goes on
                log.error("token %d was sampled outside the grammar of %s; the row ends here", tok, req.constraint)
                ended = True
            if ended:
                row.finish = "stop"
            elif req.stop and (cut := stop_index(row.tokens, req.stop, self._text)) is not None:
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

    @staticmethod
    def _tell(it: Item, tok: int, lp: float) -> None:
        """Stream a token to the request's listener; a listener that fails is dropped, never the batch."""
        try:
            it.listener([tok], [lp])
        except Exception:  # noqa: BLE001 - the caller's callback must not end other rows
            log.exception("a token listener failed; the request goes on without it")
            it.listener = None

    def _constrain(self, logits: Any, rows: list[_Row], constrained: list[int]) -> Any:
        """`logits` (float32) with the tokens each constrained row's grammar forbids at this step set to -inf."""
        import xgrammar as xgr

        logits = logits.float().contiguous()
        bits = rows[constrained[0]].item.matcher.new_bitmask(len(rows))
        for j in constrained:
            rows[j].item.matcher.fill(bits, j)
        xgr.apply_token_bitmask_inplace(logits, bits.to(logits.device), indices=constrained)
        self.engine.stats["constrained_tokens"] += len(constrained)
        return logits

    def _select(self, running: _Running, keep: list[int]) -> _Running:
        """The running rows `keep` (indices); cache columns no remaining row attends to are dropped."""
        import torch

        rows = [running.rows[j] for j in keep]
        if running.slots is not None:
            kept = set(keep)
            self._static.leave([s for j, s in enumerate(running.slots) if j not in kept])
            if not rows:
                return _Running([], None, None, None, None, slots=[])
            idx = torch.tensor(keep, device=running.last.device)
            return _Running(rows, None, None, None, running.last[idx], slots=[running.slots[j] for j in keep])
        if not rows:
            return _Running([], None, None, None, None)
        idx = torch.tensor(keep, device=self.engine.device)
        running.cache.batch_select_indices(idx)
        mask, positions, last = running.mask[idx], running.positions[idx], running.last[idx]
        first = int(mask.any(dim=0).int().argmax())
        if first and self._joinable:
            mask = mask[:, first:]
            for layer in running.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        return _Running(rows, running.cache, mask, positions, last)

    def _join_static(self, running: _Running | None, part: _Running) -> _Running:
        """The running rows plus a prefilled group's, whose keys and values move into free slots."""
        import torch

        slots = self._static.join(part.rows, part.cache, part.mask, self._epoch) if part.rows else []
        if running is None or running.slots is None or not running.rows:
            return _Running(part.rows, None, None, None, part.last, slots=slots)
        if not part.rows:
            return running
        return _Running(running.rows + part.rows, None, None, None, torch.cat([running.last, part.last]),
                        slots=running.slots + slots)

    def _static_forward(self, names: list[str], view: Any, mask: Any) -> Any:
        """A static step through `_forward` (peft's per-row path, for adapters `StaticDecoder` cannot stack)."""
        st = self._static
        out = self._forward(names, input_ids=st.ids[:view.batch, None], attention_mask=mask,
                            position_ids=st.pos[:view.batch, None], past_key_values=view, use_cache=True)
        return out.logits[:, -1, :]

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
        return _Running(a.rows + b.rows, DynamicCache(ddp_cache_data=layers, config=self.engine.config), mask,
                        torch.cat([a.positions, b.positions]), torch.cat([a.last, b.last]))

    def _generator(self, it: Item) -> Any:
        import torch

        g = torch.Generator()
        g.manual_seed(it.request.seed if it.request.seed is not None else self._seeds.getrandbits(63))
        return g

    def _text(self, tokens: list[int]) -> str:
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=True)

    def _answer(self, row: _Row) -> None:
        """Resolve a finished row's future now, whatever the rows still decoding."""
        it = row.item
        text = self._text(row.tokens)
        if row.stop_at is not None:
            text = text[: row.stop_at]
        extra: dict[str, Any] = {"top_logprobs": row.tops} if it.request.top_logprobs else {}
        if it.matcher is not None:
            extra["logprobs_masked"] = True
        stats = self.engine.stats
        stats["requests"] += 1
        stats["generated_tokens"] += len(row.tokens)
        it.future.set_result(Completion(
            text=text, prompt_token_ids=list(it.prompt_ids), completion_token_ids=row.tokens, logprobs=row.lps,
            finish_reason=row.finish, agent=it.request.agent, model=self.engine.model_name,
            latency_s=time.perf_counter() - it.submitted, extra=extra,
        ))
