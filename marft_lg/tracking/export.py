"""`export_version`: a registry version as a plain PEFT adapter folder (what `PeftModel.from_pretrained` and vLLM's
``--lora-modules name=path`` load as they are: its ``adapter_config.json`` names the base model's folder or id) or,
merged into its base model, a full transformers model; both with a model card (README.md) naming the base model and
its hash, the training run, the data window, the metrics and the gate decision that promoted it. A damaged version
is refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from marft_lg.tracking.lineage import read_lineage

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ExportError(ValueError):
    """An export that did not happen; the one-line message says why."""


def parse_target(target: str) -> tuple[str, str]:
    """``ROLE``, ``ROLE@v3``, ``ROLE@live`` -> (role, ref); a bare role means its `live` version."""
    role, _, ref = target.partition("@")
    if not role:
        raise ExportError(f"{target!r}: expected ROLE[@VERSION|ALIAS], e.g. actor@live or actor@v3")
    return role, ref or "live"


def _facts(registry: Any, role: str, version: str) -> dict[str, Any]:
    """What the card says: the version's lineage (its manifest, the run's published record) and the promotion
    that made it live, if any."""
    from marft_lg.tracking.lineage import adapter_lineage

    facts = adapter_lineage(registry, role, version)
    for rec in read_lineage(registry.root):
        if rec.get("role") != role or rec.get("version") != version:
            continue
        if rec.get("event") == "published":
            facts["iteration"], facts["data_window"] = rec.get("iteration"), rec.get("data_window")
        elif rec.get("event") == "promote":
            facts["promotion"] = rec
    return facts


def _decision_lines(promotion: dict[str, Any] | None) -> list[str]:
    if promotion is None:
        return ["No promotion of this version is recorded (it was exported without a gate decision)."]
    decision = promotion.get("decision")
    lines = [f"Made `{promotion.get('alias')}` at {promotion.get('at')} (was {promotion.get('previous')}): "
             f"{promotion.get('reason')}."]
    if not decision:
        return [*lines, "", "Promoted without a gate decision."]
    lines += ["", f"Gate decision: **{decision.get('decision')}**", "", "| check | passed | value | threshold |",
              "|---|---|---|---|"]
    for c in decision.get("checks") or []:
        lines.append(f"| {c.get('name')} | {c.get('passed')} | {c.get('value')} | {c.get('threshold')} |")
    report = (decision.get("context") or {}).get("run_dir")
    return [*lines, "", f"Comparison report: `{report}/report.md`" if report else ""]


def model_card(facts: dict[str, Any], *, merged: bool) -> str:
    """README.md of an exported version (Hugging Face model card front matter, then the facts)."""
    role, version, base = facts["role"], facts["version"], facts.get("base_model")
    rows = [("role", role), ("registry version", version), ("base model", base),
            ("base model path", facts.get("base_path")),
            ("base model weights (sha256, 16 hex)", facts.get("base_hash")),
            ("base model shape fingerprint", facts.get("base_fingerprint")),
            ("training run", facts.get("run_id")), ("iteration", facts.get("iteration")),
            ("parent version", facts.get("parent")),
            ("data window", json.dumps(facts.get("data_window")) if facts.get("data_window") else None),
            ("adapter weights sha256", facts.get("adapter_sha256")), ("created", facts.get("created")),
            ("registry", facts.get("registry"))]
    metrics = facts.get("metrics") or {}
    use = (["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "model = AutoModelForCausalLM.from_pretrained('.')  # this folder", "```"] if merged else
           ["```python", "from peft import PeftModel", f"model = PeftModel.from_pretrained(base_model, '.')  # {base}",
            "```", "", f"vLLM: `vllm serve {facts.get('base_path') or 'BASE'} --enable-lora --lora-modules "
            f"{role}=<this folder>`"])
    return "\n".join([
        "---", f"library_name: {'transformers' if merged else 'peft'}", f"base_model: {base}",
        "tags: [marft-lg, lora, multi-agent-rl]", "---", "",
        f"# {role}@{version}" + (" (merged into its base model)" if merged else " (LoRA adapter)"), "",
        f"The `{role}` agent's adapter, trained with MARFT (multi-agent PPO) by marft_lg.", "",
        "| | |", "|---|---|", *[f"| {k} | {'' if v is None else v} |" for k, v in rows], "",
        "## Metrics", "", *([f"- {k}: {v}" for k, v in sorted(metrics.items())] or ["(none recorded)"]), "",
        "## Gate decision", "", *_decision_lines(facts.get("promotion")), "", "## Use", "", *use, ""])


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; choose another --out")


def _base_dir(facts: dict[str, Any], base: str | None) -> Path:
    """The base model to merge into: `base` or the embedded model the manifest names, checked against the hash
    the version recorded."""
    from marft_lg.serving.engine.models import model_content_hash, resolve_model

    name = base or facts.get("base_model")
    if not name or (base is None and not str(name).startswith("embedded:")):
        raise ExportError(f"{facts['role']}@{facts['version']} was trained on base model {name!r}; pass --base DIR "
                          "(that model's transformers folder) to merge into it")
    try:
        path = resolve_model(name)
    except (OSError, ValueError) as exc:
        raise ExportError(f"--base {name}: {exc}") from None
    recorded = facts.get("base_hash")
    if recorded and model_content_hash(path) != recorded:
        raise ExportError(f"{path} has other weights ({model_content_hash(path)}) than the base model "
                          f"{facts['role']}@{facts['version']} was trained on ({recorded}); pass that model as --base")
    return path


def _base_path(facts: dict[str, Any], base: str | None, recorded: str | None) -> str:
    """What an exported adapter names as its base (PEFT's and vLLM's ``base_model_name_or_path``): `base` or the
    embedded model the manifest names, resolved to its folder, else the folder or id the adapter was saved on."""
    if base is not None or str(facts.get("base_model") or "").startswith("embedded:"):
        return str(_base_dir(facts, base).resolve())
    if recorded:
        return str(Path(recorded).resolve()) if Path(recorded).is_dir() else recorded
    raise ExportError(f"{facts['role']}@{facts['version']} records no base model folder (it was trained on "
                      f"{facts.get('base_model')!r}); pass --base DIR (that model's transformers folder)")


def _adapter_config(src: Path, facts: dict[str, Any], base: str | None) -> dict[str, Any]:
    """The adapter's config naming its base model, so PEFT and vLLM load the export as it is."""
    config = json.loads((src / ADAPTER_FILES[0]).read_text(encoding="utf-8"))
    facts["base_path"] = config["base_model_name_or_path"] = _base_path(
        facts, base, config.get("base_model_name_or_path"))
    return config


def _merge(adapter_dir: Path, base_dir: Path, out: Path) -> None:
    """The adapter merged into its base's weights, saved as safetensors with the base's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)


def export_version(registry_dir: str | Path, target: str, out: str | Path, *, merged: bool = False,
                   base: str | None = None) -> Path:
    """Export ``ROLE[@VERSION|ALIAS]`` of the registry at `registry_dir` into `out` (see the module doc); raises
    `ExportError` (one line) for an unknown or damaged version, a non-empty `out`, or the wrong base model."""
    from marft_lg.serving.errors import AdapterIntegrityError, ServingError
    from marft_lg.serving.registry.store import AdapterRegistry

    role, ref = parse_target(target)
    out = Path(out)
    try:
        registry = AdapterRegistry(registry_dir, create=False)
        version = registry.resolve(role, ref)
        registry.verify(role, version)
        src = registry.path(role, version)
    except AdapterIntegrityError as exc:
        raise ExportError(f"refusing to export damaged version {role}@{ref}: {exc}") from None
    except ServingError as exc:
        raise ExportError(str(exc)) from None
    _check_out(out)
    facts = _facts(registry, role, version)
    base_dir = _base_dir(facts, base) if merged else None
    config = None if merged else _adapter_config(src, facts, base)
    out.mkdir(parents=True, exist_ok=True)
    if base_dir is not None:
        _merge(src, base_dir, out)
    else:
        (out / ADAPTER_FILES[0]).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        shutil.copyfile(src / ADAPTER_FILES[1], out / ADAPTER_FILES[1])
    (out / "README.md").write_text(model_card(facts, merged=merged), encoding="utf-8")
    return out
