"""A decode step built for the GPU: keys and values preallocated per batch slot, one step function per bucket.

`HFEngine(decode="static")` (or ``"compiled"``) decodes through a `StaticDecoder` instead of the growing
`DynamicCache` of the eager loop. Prefill is unchanged (per adapter group, shared prefixes kept); each
prefilled row is then copied, without its padding, into a slot of a `SlotCache`: per layer one
``[capacity, kv_heads, max_len, head_dim]`` tensor allocated once. A decode step runs over the first B slots
(B: the smallest batch bucket holding the highest slot in use) and the first W cache columns (W: a power of two
holding the longest row): every tensor the step touches has a static shape and a fixed address, so the step is
one function that ``torch.compile`` traces once per (B, W) bucket and, on a GPU, is captured as one CUDA graph per
bucket (`StepGraphs`) and replayed: one launch per step instead of hundreds. The capture is our own
(``torch.cuda.CUDAGraph``), not inductor's ``mode="reduce-overhead"``, whose graph trees live in the thread that
first imported them and fail in the engine's scheduler thread of any later engine.

Inside the step each row writes its new key and value at its own position (a scatter, no padding hole) and
attends to its first ``length + 1`` columns (a 4D mask). Rows on different adapters decode together: every
loaded adapter's LoRA matrices are stacked (`RowAdapters`) and each slot's delta comes from a persistent
``[capacity]`` tensor of adapter indices, gathered inside the step, so the graph does not change with the mix.
Sampling, grammar masks, stop strings and log-probs stay in the scheduler (`Scheduler._step`), the same code
for every mode: ``"static"`` gives the eager engine's tokens up to float rounding (summation order).

Free slots are taken lowest first and a finished row only frees its slot (no copy); slots past the last one in
use cost nothing, holes below it cost a wasted row in the step.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any

from marft_lg.serving.engine.mixed_forward import BASE, RowAdapters

DECODE_MODES = ("eager", "static", "compiled")

log = logging.getLogger("marft_lg.serving.engine.hf")


def batch_buckets(capacity: int) -> list[int]:
    """Powers of two below `capacity`, then `capacity` itself: the batch sizes a step is traced for."""
    out, b = [], 1
    while b < capacity:
        out.append(b)
        b *= 2
    return [*out, capacity]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value (the last one when none is)."""
    return next((b for b in buckets if b >= value), buckets[-1])


def width_buckets(max_len: int, smallest: int = 64) -> list[int]:
    """Powers of two from `smallest` below `max_len`, then `max_len`: the cache widths a step attends to."""
    return batch_buckets(max_len)[max(0, smallest.bit_length() - 1):] if max_len > smallest else [max_len]


class SlotCache:
    """Keys and values of every running row, one preallocated slot per row (allocated on the first row)."""

    def __init__(self, capacity: int, max_len: int):
        self.capacity, self.max_len = capacity, max_len
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.lengths = [0] * capacity  # tokens cached in each slot
        self.names: list[str] = [BASE] * capacity  # each slot's adapter
        self._free = set(range(capacity))

    def allocate(self, like: list[tuple[Any, Any]]) -> None:
        """Per layer a zero ``[capacity, heads, max_len, dim]`` tensor of `like`'s layers' dtype and device."""
        import torch

        if self.keys and self.keys[0].dtype == like[0][0].dtype and self.keys[0].device == like[0][0].device:
            return
        self.keys = [torch.zeros((self.capacity, k.shape[1], self.max_len, k.shape[3]), dtype=k.dtype, device=k.device)
                     for k, _ in like]
        self.values = [torch.zeros((self.capacity, v.shape[1], self.max_len, v.shape[3]), dtype=v.dtype,
                                   device=v.device) for _, v in like]
        _static_addresses(*self.keys, *self.values)
        size = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        log.info("static decode cache: %d slots x %d columns, %.2f GiB", self.capacity, self.max_len, size / 2**30)

    def reset(self) -> None:
        self._free = set(range(self.capacity))

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free decode slot (capacity {self.capacity})")
        slot = min(self._free)
        self._free.discard(slot)
        return slot

    def release(self, slot: int) -> None:
        self._free.add(slot)
        self.lengths[slot] = 0


def _static_addresses(*tensors: Any) -> None:
    """Tell torch.compile these tensors keep their address (mutated in place: CUDA graphs may capture them),
    as transformers' `StaticCache` does."""
    import torch

    for t in tensors:
        try:
            torch._dynamo.mark_static_address(t)
        except Exception:  # noqa: BLE001 - an older torch: compiled steps still work, without CUDA graphs maybe
            return


class _SlotView:
    """The cache the model's attention layers see in one step of bucket (batch, width): `update` writes each
    row's new key and value at that row's position and returns the bucket's first `width` columns."""

    is_compileable = True
    is_sliding = [False]

    def __init__(self, store: SlotCache, batch: int, width: int, write_at: Any):
        self.store, self.batch, self.width, self.write_at = store, batch, width, write_at

    def update(self, key_states: Any, value_states: Any, layer_idx: int, cache_kwargs: Any = None) -> tuple[Any, Any]:
        k = self.store.keys[layer_idx][: self.batch]
        v = self.store.values[layer_idx][: self.batch]
        at = self.write_at[: self.batch].view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
        k.scatter_(2, at, key_states.to(k.dtype))
        v.scatter_(2, at, value_states.to(v.dtype))
        return k[:, :, : self.width], v[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always given; never asked in a step
        return 0


class SlotAdapters:
    """Each slot's LoRA delta inside the step, from the stacked matrices of every loaded adapter (`RowAdapters`).

    Forward hooks stay on the LoRA layers (between steps they pass outputs through) so a compiled step keeps
    its graph; `index[slot]` names the slot's adapter (the last index: none).
    """

    def __init__(self, model: Any, adapters: list[str], capacity: int, device: Any):
        import torch

        self.plan = RowAdapters(model, adapters)
        self.column = {name: i for i, name in enumerate(self.plan.adapters)}
        self.index = torch.full((capacity,), len(self.plan.adapters), dtype=torch.long, device=device)
        _static_addresses(self.index)
        self.on = False
        self.handles = [module.register_forward_hook(functools.partial(self._delta, a_all, b_all, ind))
                        for (module, a_all, b_all, _), ind in zip(self.plan.layers, self.plan._indicators, strict=True)]

    def _delta(self, a_all: Any, b_all: Any, ind: Any, _module: Any, args: Any, output: Any) -> Any:
        if not self.on:
            return output
        import torch.nn.functional as F

        x = args[0].to(a_all.dtype)
        mask = ind[self.index[: x.shape[0]]]
        xa = F.linear(x, a_all) * (mask[:, None, :] if x.dim() == 3 else mask)
        return output + F.linear(xa, b_all).to(output.dtype)

    def set(self, slot: int, name: str) -> None:
        self.index[slot] = self.column.get(name, len(self.plan.adapters))

    @contextmanager
    def active(self) -> Any:
        """peft's own adapters off and the slots' deltas on, for one step."""
        saved = [(m, m._disable_adapters) for m in self.plan.tuner_layers]
        try:
            for m, _ in saved:
                m._disable_adapters = True
            self.on = True
            yield
        finally:
            self.on = False
            for m, flag in saved:
                m._disable_adapters = flag

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class StepGraphs:
    """One CUDA graph of the decode step per (batch, width, adapters-on) bucket, captured on first use and replayed.

    Every input the step reads (token ids, positions, the slot cache, the adapter index and stacked LoRA matrices,
    the weights) keeps its address, so a replay after writing new values into them computes the new step. The
    graphs share one memory pool; a replay's logits live there until the next replay, so callers copy what they
    keep (`StaticDecoder.step` indexes them). A capture that fails (an op that syncs with the host, an old driver)
    is logged once and the step runs uncaptured from then on: slower, never wrong.
    """

    def __init__(self) -> None:
        self.graphs: dict[Any, tuple[Any, Any]] = {}
        self.pool: Any = None
        self.failed: str | None = None
        self.captures = 0

    def clear(self) -> None:
        """Forget every graph (the stacked adapter matrices they read were replaced)."""
        self.graphs = {}

    def run(self, key: Any, fn: Any, *args: Any) -> Any:
        if self.failed is not None:
            return fn(*args)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(fn, args)
            if entry is None:
                return fn(*args)
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, fn: Any, args: tuple) -> tuple[Any, Any] | None:
        """Warm `fn` up on a side stream (compilation, library workspaces), then record one call. A step writes
        each row's key and value at that row's position, the same values every time for the same inputs, so the
        warm-up calls leave the cache as one call would."""
        import torch

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(*args)
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured still decodes, uncaptured
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("static decode: the step could not be captured as a CUDA graph (%s); it runs uncaptured",
                        self.failed)
            torch.cuda.synchronize()
            return None
        self.captures += 1
        return graph, out


class StaticDecoder:
    """The engine's decode steps in ``"static"`` or ``"compiled"`` mode (see the module docstring).

    The scheduler prefills as before, then hands each group's rows to `join` (their keys and values go to free
    slots), calls `step` for one token's logits per running row and `leave` for rows that finished.
    """

    def __init__(self, engine: Any, *, mode: str, step_lock: Any, compile_mode: str | None = None):
        import torch

        if mode not in ("static", "compiled"):
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {mode!r}")
        self.engine, self.mode, self.step_lock = engine, mode, step_lock
        self.capacity = int(engine.max_batch_size)
        self.slots = SlotCache(self.capacity, int(engine.max_context()))
        self.batch_buckets = batch_buckets(self.capacity)
        self.width_buckets = width_buckets(self.slots.max_len)
        device = engine.device
        self.ids = torch.zeros((self.capacity,), dtype=torch.long, device=device)
        self.pos = torch.zeros((self.capacity,), dtype=torch.long, device=device)
        self.cols = torch.arange(self.slots.max_len, device=device)
        _static_addresses(self.ids, self.pos, self.cols)
        self._views: dict[tuple[int, int], _SlotView] = {}
        self._adapters: SlotAdapters | None = None
        self._adapters_key: Any = None
        self._weights: Any = None  # the adapters' weight versions the stacked matrices must match
        self._fallback = False  # adapters RowAdapters cannot stack (DoRA...): peft's per-row path, not compiled
        self._compiled: Any = None
        self.compile_mode = compile_mode or "default"
        # on a GPU each bucket's step is one CUDA graph (ours, see the module docstring); None on the CPU
        self.graphs = StepGraphs() if str(device).startswith("cuda") else None
        self.steps = 0
        self.traced: set[tuple[int, int]] = set()  # the (batch, width) buckets a step ran in

    # ---- sessions ----------------------------------------------------------------------------------
    def begin(self) -> None:
        """A new session: every slot is free."""
        self.slots.reset()

    def use_weights(self, weights: Any) -> None:
        """The adapters' weight versions now: a change (an optimizer step outside `exclusive()`) makes the stacked
        adapter matrices anew at the next step, the slots keeping their adapters."""
        self._weights = weights

    def drop_hooks(self) -> None:
        """Take the adapter hooks off the model (before a trainer or an adapter change uses it)."""
        if self._adapters is not None:
            self._adapters.remove()
        self._adapters, self._adapters_key, self._compiled = None, None, None
        if self.graphs is not None:
            self.graphs.clear()

    def _plan(self, epoch: int) -> SlotAdapters | None:
        model = self.engine.model
        if not hasattr(model, "peft_config"):
            self._fallback = False
            return None
        loaded = list(self.engine.loaded_adapters())
        key = (epoch, id(model), tuple(loaded), self._weights)
        if key != self._adapters_key:
            self.drop_hooks()
            self._adapters_key = key
            self._fallback = not RowAdapters.supported(model, loaded)
            if self._fallback:
                log.warning("static decode: adapters that are not plain LoRA run on peft's per-row path, uncompiled")
            else:
                self._adapters = SlotAdapters(model, loaded, self.capacity, self.ids.device)
                for slot, name in enumerate(self.slots.names):
                    self._adapters.set(slot, name)
        return self._adapters

    # ---- rows ------------------------------------------------------------------------------------
    def join(self, rows: list[Any], cache: Any, mask: Any, epoch: int) -> list[int]:
        """Copy prefilled rows (a left-padded `DynamicCache` and its mask) into free slots; returns their slots."""
        if not rows:
            return []
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        self.slots.allocate(layers)
        with self.step_lock:
            adapters = self._plan(epoch)
        out = []
        for i, row in enumerate(rows):
            slot = self.slots.take()
            valid = mask[i].nonzero()[:, 0]
            n = int(valid.numel())
            if n + 1 > self.slots.max_len:
                raise RuntimeError(f"a row of {n} tokens does not fit the static cache ({self.slots.max_len})")
            for (k, v), sk, sv in zip(layers, self.slots.keys, self.slots.values, strict=True):
                sk[slot, :, :n] = k[i][:, valid]
                sv[slot, :, :n] = v[i][:, valid]
            self.slots.lengths[slot] = n
            self.slots.names[slot] = row.name
            if adapters is not None:
                adapters.set(slot, row.name)
            out.append(slot)
        return out

    def leave(self, slots: list[int]) -> None:
        for slot in slots:
            self.slots.release(slot)

    # ---- the step --------------------------------------------------------------------------------
    def step(self, slots: list[int], last: Any, names: list[str], epoch: int, forward: Any) -> Any:
        """Next-token logits ``[rows, vocab]`` of the rows in `slots` whose last tokens are `last`."""
        import torch

        lengths = [self.slots.lengths[s] for s in slots]
        need = max(lengths) + 1
        if need > self.slots.max_len:
            raise RuntimeError(f"a row reached the static cache's length ({self.slots.max_len})")
        batch = bucket(max(slots) + 1, self.batch_buckets)
        width = bucket(need, self.width_buckets)
        at = torch.tensor(slots, device=self.ids.device)
        self.ids[:batch] = self.engine.pad_token_id
        self.pos[:batch] = 0
        self.ids[at] = last.to(self.ids.device)
        self.pos[at] = torch.tensor(lengths, device=self.ids.device)
        view = self._views.get((batch, width))
        if view is None:
            view = self._views[(batch, width)] = _SlotView(self.slots, batch, width, self.pos)
        with self.step_lock:
            adapters = self._plan(epoch)
            if self._fallback:  # peft's adapter_names path: the rows' names, the first row's for unused slots
                per_slot = [names[0]] * batch
                for s, name in zip(slots, names, strict=True):
                    per_slot[s] = name
                logits = forward(per_slot, view, self._mask(batch, width))
            elif adapters is not None:
                with adapters.active():
                    logits = self._run(view)
            else:
                logits = self._run(view)
        for s in slots:
            self.slots.lengths[s] += 1
        self.steps += 1
        self.traced.add((batch, width))
        return logits[at]

    def _mask(self, batch: int, width: int) -> Any:
        """``[batch, 1, 1, width]``: each row sees its first ``length + 1`` columns (additive for eager attention)."""
        import torch

        see = (self.cols[:width][None, :] <= self.pos[:batch, None])[:, None, None, :]
        if getattr(self.engine.config, "_attn_implementation", "sdpa") == "eager":
            dtype = self.slots.keys[0].dtype
            return torch.zeros(see.shape, dtype=dtype, device=see.device).masked_fill(~see, torch.finfo(dtype).min)
        return see

    def _forward_step(self, view: _SlotView) -> Any:
        """One decode step of bucket (view.batch, view.width): the function ``"compiled"`` hands to torch.compile."""
        batch = view.batch
        out = self.engine.model(input_ids=self.ids[:batch, None], attention_mask=self._mask(batch, view.width),
                                position_ids=self.pos[:batch, None], past_key_values=view, use_cache=True)
        return out.logits[:, -1, :]

    def _run(self, view: _SlotView) -> Any:
        fn = self._step_function()
        if self.graphs is None:
            return fn(view)
        return self.graphs.run((view.batch, view.width, self._adapters is not None), fn, view)

    def _step_function(self) -> Any:
        """The eager step (``"static"``) or its ``torch.compile`` (``"compiled"``; CUDA graphs are ours, not
        inductor's: `compile_mode` defaults to ``"default"``)."""
        if self.mode != "compiled":
            return self._forward_step
        if self._compiled is None:
            import torch
            import torch._dynamo.config as dynamo_config

            # one graph per (batch, width) bucket: more than dynamo's default 8 recompilations of one function,
            # past which it would run the step uncompiled without saying so
            buckets = len(self.batch_buckets) * len(self.width_buckets) + 8
            for name in ("recompile_limit", "cache_size_limit"):
                if isinstance(getattr(dynamo_config, name, None), int):
                    setattr(dynamo_config, name, max(getattr(dynamo_config, name), buckets))
                    break
            self._compiled = torch.compile(self._forward_step, dynamic=False, mode=self.compile_mode)
        return self._compiled
