"""Adapter integrity: what an adapter directory must be before an engine is allowed to touch it.

peft registers an adapter before it reads the weights, so a damaged file would leave a zero-weight
"ghost" adapter behind that answers with the base model's distribution. Everything here runs
BEFORE the engine is asked to load anything:

- the safetensors header is parsed by hand (length prefix, JSON, dtypes, shapes, data offsets that
  cover the data exactly: a truncated file is caught without reading the tensors);
- the LoRA layout is checked: every module has both matrices, their rank matches
  ``adapter_config.json``, and, given the base model's layer shapes, every matrix fits its layer
  and every layer the config targets has weights;
- the content hash (sha256 of the weights and the config) is compared with the one the registry
  recorded at save time (`record_adapter`); versions saved before records existed are "unrecorded":
  everything else is still verified.

A problem raises `AdapterIntegrityError` naming the file and the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marft_lg._durable import sha256_file
from marft_lg.serving.errors import AdapterIntegrityError
from marft_lg.serving.registry.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir

RECORDED_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
_LORA_EMBEDDING_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_embedding_(?P<which>A|B)(?:\.[^.]+)?$")
# config keys that change which layers an adapter covers or their rank in ways the coverage check does not model
_COMPLEX_TARGETING = ("layers_to_transform", "layers_pattern", "exclude_modules", "target_parameters", "rank_pattern")

BaseShapes = Mapping[str, "tuple[int, int] | None"]
"""Module path of the base model (``model.layers.0.self_attn.q_proj``) -> (out_features, in_features)."""


@dataclass
class AdapterCheck:
    """The outcome of a successful verification."""

    path: Path
    hash: str  # "ok" (matches the record) | "unrecorded" (an old version without a record)
    base: str  # "ok" (shapes checked against the base model) | "unchecked"
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict, repr=False)

    @property
    def status(self) -> str:
        return "ok" if self.hash == "ok" else "ok (hash unrecorded)"


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """``{tensor: (dtype, shape)}`` of a safetensors file, after checking that the header describes
    exactly the bytes the file holds. Reads only the header; raises `AdapterIntegrityError`."""
    p = Path(path)

    def bad(reason: str) -> AdapterIntegrityError:
        return AdapterIntegrityError(p, reason)

    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"truncated: {size} bytes, not even the 8-byte header length of a safetensors file")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise bad(f"truncated or not safetensors: the header length says {n} bytes but the file has "
                          f"{size - 8} after the length prefix")
            raw = f.read(n)
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the safetensors header is not a JSON object")
    data_len = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("__metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        need = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != need:
            raise bad(f"tensor {name!r}: {dtype}{shape} needs {need} bytes but its offsets span "
                      f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
        tensors[name] = (dtype, list(shape))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise bad(f"tensor {name!r}: data starts at byte {begin}, expected {pos} (overlapping or gapped tensors)")
        pos = end
    if pos > data_len:
        raise bad(f"truncated: the header describes {pos} bytes of tensor data but the file holds {data_len} "
                  f"({size} bytes in all)")
    if pos < data_len:
        raise bad(f"{data_len - pos} unexpected bytes after the tensor data")
    return tensors


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise AdapterIntegrityError(p, f"cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise AdapterIntegrityError(p, f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterIntegrityError(p, "not a JSON object")
    return cfg


def _lora_modules(tensors: Mapping[str, tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    """``{module path: {"A": shape, "B": shape, "embedding": bool}}`` of the LoRA tensors in a state dict."""
    out: dict[str, dict[str, Any]] = {}
    for key, (_, shape) in tensors.items():
        m = _LORA_KEY.match(key) or _LORA_EMBEDDING_KEY.match(key)
        if m is None:
            continue
        entry = out.setdefault(m["module"], {"embedding": m.re is _LORA_EMBEDDING_KEY})
        entry[m["which"]] = list(shape)
        entry.setdefault("keys", []).append(key)
    return out


def _targets(cfg: Mapping[str, Any]) -> list[str] | None:
    t = cfg.get("target_modules")
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    return None  # a regex, "all-linear" or missing: not modelled


def check_lora_layout(weights: Path, cfg_path: Path, cfg: Mapping[str, Any],
                      tensors: Mapping[str, tuple[str, list[int]]], *, base_shapes: BaseShapes | None = None,
                      require_lora: bool = False) -> None:
    """Rank, pairs, and (with `base_shapes`) fit to the base model and coverage of the targeted layers."""
    peft_type = cfg.get("peft_type")
    if peft_type is not None and peft_type != "LORA":
        raise AdapterIntegrityError(cfg_path, f"peft_type is {peft_type!r}; only LORA adapters are served")
    r = cfg.get("r")
    if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
        raise AdapterIntegrityError(cfg_path, f"r must be a positive integer, got {r!r}")
    modules = _lora_modules(tensors)
    if require_lora and not modules:
        raise AdapterIntegrityError(weights, "holds no LoRA weights (no *.lora_A / *.lora_B tensors)")
    fixed_rank = r if isinstance(r, int) and not cfg.get("rank_pattern") else None
    for module, entry in sorted(modules.items()):
        a, b = entry.get("A"), entry.get("B")
        if a is None or b is None:
            raise AdapterIntegrityError(weights, f"module {module}: lora_{'A' if a is None else 'B'} is missing")
        if len(a) != 2 or len(b) != 2:
            raise AdapterIntegrityError(weights, f"module {module}: LoRA matrices must be 2-D, got {a} and {b}")
        rank, rank_b = a[0], b[1]  # A: [r, in], B: [out, r] (peft's embedding LoRA too)
        if rank != rank_b:
            raise AdapterIntegrityError(weights, f"module {module}: lora_A {a} and lora_B {b} disagree on the rank")
        if fixed_rank is not None and rank != fixed_rank:
            raise AdapterIntegrityError(weights, f"module {module}: rank {rank}, but {ADAPTER_CONFIG} says r={fixed_rank}")
        if base_shapes is None or entry["embedding"]:
            continue
        if module not in base_shapes:
            raise AdapterIntegrityError(weights, f"LoRA weights for module {module}, which the base model does not have "
                                                 "(an adapter for another model?)")
        shape = base_shapes[module]
        if shape is not None and (a[1] != shape[1] or b[0] != shape[0]):
            raise AdapterIntegrityError(
                weights, f"module {module}: lora_A {a} / lora_B {b} do not fit the base layer "
                         f"({shape[1]} inputs, {shape[0]} outputs): an adapter for another model?")
    targets = _targets(cfg)
    if base_shapes is None or targets is None or any(cfg.get(k) for k in _COMPLEX_TARGETING) or not modules:
        return
    expected = {p for p, s in base_shapes.items() if s is not None
                and any(p == t or p.endswith("." + t) for t in targets)}
    missing = sorted(expected - set(modules))
    if missing:
        raise AdapterIntegrityError(
            weights, f"no LoRA weights for {len(missing)} of the {len(expected)} layers {ADAPTER_CONFIG} targets "
                     f"(first: {missing[0]}); the file is incomplete")


def _adapter_files(path: Path) -> tuple[Path, Path]:
    try:
        p = check_adapter_dir(path)
    except AdapterIntegrityError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing file is damage too, named as such
        raise AdapterIntegrityError(Path(path), str(e)) from None
    return p / ADAPTER_WEIGHTS, p / ADAPTER_CONFIG


def record_adapter(path: str | os.PathLike) -> dict[str, Any]:
    """What the registry stores at save time: content hashes and the LoRA shape.

    ``{"files": {name: {"sha256", "bytes"}}, "lora": {"r", "lora_alpha", "target_modules", "tensors": {key: [dtype, shape]}}}``.
    Raises `AdapterIntegrityError` when the directory is not a readable adapter.
    """
    weights, cfg_path = _adapter_files(Path(path))
    tensors = read_safetensors_header(weights)
    cfg = read_adapter_config(cfg_path)
    check_lora_layout(weights, cfg_path, cfg, tensors)
    files = {}
    for name in RECORDED_FILES:
        f = weights.parent / name
        files[name] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return {"files": files, "lora": {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"),
                                     "target_modules": cfg.get("target_modules"),
                                     "tensors": {k: [d, s] for k, (d, s) in sorted(tensors.items())}}}


def verify_adapter(path: str | os.PathLike, *, record: Mapping[str, Any] | None = None,
                   base_shapes: BaseShapes | None = None, require_lora: bool = False) -> AdapterCheck:
    """Verify an adapter directory; `record` is what `record_adapter` returned at save time (None for
    versions saved before records existed). Raises `AdapterIntegrityError` naming the file and reason."""
    weights, cfg_path = _adapter_files(Path(path))
    tensors = read_safetensors_header(weights)
    cfg = read_adapter_config(cfg_path)
    check_lora_layout(weights, cfg_path, cfg, tensors, base_shapes=base_shapes, require_lora=require_lora)
    hash_status = "unrecorded"
    files = record.get("files") if isinstance(record, Mapping) else None
    if isinstance(files, Mapping) and files:
        for name, want in sorted(files.items()):
            f = weights.parent / name
            if not isinstance(want, Mapping) or not isinstance(want.get("sha256"), str):
                raise AdapterIntegrityError(f, "the manifest's integrity record for this file is malformed")
            try:
                size = f.stat().st_size
            except OSError as e:
                raise AdapterIntegrityError(f, f"cannot be read ({e.strerror or e})") from None
            if isinstance(want.get("bytes"), int) and size != want["bytes"]:
                raise AdapterIntegrityError(f, f"{size} bytes, but {want['bytes']} were recorded at save time")
            got = sha256_file(f)
            if got != want["sha256"]:
                raise AdapterIntegrityError(f, f"content hash sha256:{got[:12]}... differs from sha256:"
                                               f"{want['sha256'][:12]}... recorded at save time (the file was changed)")
        hash_status = "ok"
    return AdapterCheck(Path(path), hash_status, "ok" if base_shapes is not None else "unchecked", dict(tensors))


def base_shapes_from_weights(model_dir: str | os.PathLike) -> dict[str, tuple[int, int] | None]:
    """Base layer shapes read from a transformers directory's safetensors headers (no weights loaded):
    ``model.layers.0.self_attn.q_proj.weight [out, in]`` -> ``{"model.layers.0.self_attn.q_proj": (out, in)}``."""
    out: dict[str, tuple[int, int] | None] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for key, (_, shape) in read_safetensors_header(f).items():
            if key.endswith(".weight") and len(shape) == 2:
                out[key[: -len(".weight")]] = (int(shape[0]), int(shape[1]))
    return out


def base_shapes_from_model(model: Any) -> dict[str, tuple[int, int] | None]:
    """Base layer shapes of an in-memory transformers model (peft's LoRA layers report their base layer's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out: dict[str, tuple[int, int] | None] = {}
    for name, module in base.named_modules():
        if not name or ".lora_" in name or name.endswith(".base_layer") or ".base_layer." in name:
            continue
        fin, fout = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(fin, int) and isinstance(fout, int):
            out[name] = (fout, fin)
    return out
