"""The embedded engine's LoRA adapters: add, verify-then-load and unload them between two decode steps.

A failed load leaves the model exactly as it was, and every change tells the scheduler to forget what it
derived from adapter weights (stacked matrices, parameter lists, stored prefixes).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marft_lg.serving.errors import UnknownAgentError
from marft_lg.serving.registry.integrity import verify_adapter
from marft_lg.serving.registry.lora import LoraSettings

if TYPE_CHECKING:
    from marft_lg.serving.engine.hf import HFEngine

log = logging.getLogger("marft_lg.serving.engine.hf")  # the engine's messages keep the engine's logger


class Adapters:
    """The adapters of one engine's model: `engine.model` is the base model until the first adapter is
    added, then the one `peft.PeftModel` (this class replaces it).

    `step_lock` is held for one forward pass; `paused` holds serving until the running batch ends;
    `on_change` runs after every change, also a failed one.
    """

    def __init__(self, engine: HFEngine, *, step_lock: AbstractContextManager[Any],
                 paused: Callable[[], AbstractContextManager[Any]], on_change: Callable[[], None]):
        self._engine = engine
        self._step_lock = step_lock
        self._paused = paused
        self._on_change = on_change

    @property
    def is_peft(self) -> bool:
        return hasattr(self._engine.model, "peft_config")

    def names(self) -> list[str]:
        return sorted(self._engine.model.peft_config) if self.is_peft else []

    def add(self, name: str, settings: LoraSettings | None = None, *, seed: int = 0) -> None:
        """A freshly initialised, trainable adapter named `name` (no-op if it exists)."""
        import torch
        from peft import get_peft_model

        cfg = (settings or LoraSettings()).to_peft()
        with self._changing():
            if name in self.names():
                return
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                if self.is_peft:
                    self._engine.model.add_adapter(name, cfg)
                else:
                    self._engine.model = get_peft_model(self._engine.model, cfg, adapter_name=name)
            self._engine.model.eval()

    def load(self, name: str, path: str | Path, *, trainable: bool = True,
             verify: Callable[..., Any] = verify_adapter) -> None:
        """Load a PEFT directory as adapter `name` once `verify` (`integrity.verify_adapter`) passed its files;
        loading a loaded name is a no-op. Should peft still fail, the half-made adapter is removed again."""
        from peft import PeftModel

        path = Path(path)
        verify(path, base_shapes=self._engine.module_shapes, require_lora=True)
        with self._changing():
            if name in self.names():
                return
            was_peft = self.is_peft
            try:
                if was_peft:
                    self._engine.model.load_adapter(str(path), adapter_name=name, is_trainable=trainable)
                else:
                    self._engine.model = PeftModel.from_pretrained(self._engine.model, str(path), adapter_name=name,
                                                                   is_trainable=trainable)
            except BaseException:
                self._discard_failed_load(name, was_peft)
                raise
            self._engine.model.eval()

    def _discard_failed_load(self, name: str, was_peft: bool) -> None:
        """Undo what a failed peft load left behind (the adapter, or the LoRA layers injected into the base)."""
        if was_peft:
            if name in getattr(self._engine.model, "peft_config", {}):
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                    self._engine.model.delete_adapter(name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        model = self._engine.model  # the plain base model, which PeftModel.from_pretrained changed in place
        injected = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
        for module_name, module in injected:
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            if attr in vars(model):
                delattr(model, attr)
        log.warning("a failed load of adapter %r was undone (%d injected layers removed)", name, len(injected))

    def unload(self, name: str) -> None:
        """Delete an adapter's weights between two decode steps; the caller ensures no request uses it."""
        with self._changing():
            if name not in self.names():
                raise UnknownAgentError(name, self.names(), what="adapter")
            with warnings.catch_warnings():  # peft re-points its "active adapter", which serving never uses
                warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                self._engine.model.delete_adapter(name)

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Adapters change between two decode steps of a running batch (its rows keep their adapters).

        Wrapping the plain base model into a PeftModel changes what a running batch calls, so that
        first adapter waits for the batch to end.
        """
        with self._step_lock if self.is_peft else self._paused(), self._step_lock:
            try:
                yield
            finally:
                self._on_change()
