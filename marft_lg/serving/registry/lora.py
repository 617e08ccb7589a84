"""LoRA settings shared by every agent adapter, and safe (safetensors-only) adapter directories."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from marft_lg.serving.errors import AdapterMismatchError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass
class LoraSettings:
    """LoRA hyper-parameters of a fresh agent adapter (defaults suit Llama-like models such as SmolLM2).

    r: rank of the update matrices; alpha: scaling numerator (scale = alpha / r);
    dropout: dropout on the LoRA input while training (off at inference);
    target_modules: names of the linear layers that get an adapter (attention projections by default:
    cheap to serve in mixed batches, enough capacity for RL fine-tuning of a small model).
    init: peft's `init_lora_weights` (True: B = 0, so a fresh adapter starts equal to the base model).
    """

    r: int = 8
    alpha: int | float = 16
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    bias: str = "none"
    init: bool | str = True

    def to_peft(self, *, inference_mode: bool = False):
        """The equivalent `peft.LoraConfig` (causal LM task)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules),
            bias=self.bias, init_lora_weights=self.init, task_type="CAUSAL_LM", inference_mode=inference_mode,
        )

    def __post_init__(self) -> None:
        """Types and ranges (`marft_lg._config.ConfigError` naming the key; the YAML loader adds file:line)."""
        from marft_lg._config import ConfigError, check_int, check_range

        check_int("r", self.r, low=1)
        if isinstance(self.alpha, bool):
            raise ConfigError(f"expected a number, got bool {self.alpha!r}", key="alpha")
        check_range("alpha", self.alpha, low=0, low_open=True)
        if isinstance(self.dropout, bool):
            raise ConfigError(f"expected a number, got bool {self.dropout!r}", key="dropout")
        check_range("dropout", self.dropout, low=0, high=1, high_open=True)
        t = self.target_modules
        if not ((isinstance(t, str) and t) or (isinstance(t, list) and t and all(isinstance(x, str) and x for x in t))):
            raise ConfigError("expected a non-empty list of layer names (e.g. [q_proj, v_proj]) or a regex / "
                              f"'all-linear' string, got {type(t).__name__} {t!r:.60}", key="target_modules")
        if self.bias not in _BIAS:
            raise ConfigError(f"expected one of {list(_BIAS)}, got {self.bias!r}", key="bias")
        if not (isinstance(self.init, bool) or (isinstance(self.init, str) and self.init)):
            raise ConfigError("expected true, false or a peft init_lora_weights name (e.g. gaussian), got "
                              f"{type(self.init).__name__} {self.init!r:.60}", key="init")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, source: str = "<dict>") -> LoraSettings:
        """Build from a YAML/JSON mapping. Unknown keys, wrong types and out-of-range values are
        `ConfigError`s (a `ValueError`) naming ``source: key``."""
        from marft_lg._config import YamlDoc

        return cls._from_doc(YamlDoc.of(data, source))

    @classmethod
    def from_yaml(cls, path: str | Path, *, section: str | None = None) -> LoraSettings:
        """Load a YAML file (or one `section` of it, e.g. ``lora``); errors name ``file:line: key``."""
        from marft_lg._config import load_yaml

        doc = load_yaml(path, what="LoRA settings file")
        if section is not None:
            if not isinstance(doc.data, dict) or section not in doc.data:
                return cls()
            doc = doc.at(section)
        return cls._from_doc(doc)

    @classmethod
    def _from_doc(cls, doc: Any) -> LoraSettings:
        from marft_lg._config import ConfigError, check_fields

        values = check_fields(cls, doc.data, doc, what="LoRA", skip=("target_modules", "alpha"))
        try:
            return cls(**values)
        except ConfigError as exc:
            raise doc.locate(exc) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BIAS = ("none", "all", "lora_only")


def check_adapter_dir(path: str | Path) -> Path:
    """Return `path` if it is a PEFT adapter directory with safetensors weights; never accept pickles."""
    p = Path(path)
    if not p.is_dir():
        raise AdapterMismatchError(f"adapter directory {p} does not exist")
    if not (p / ADAPTER_CONFIG).is_file():
        raise AdapterMismatchError(f"{p} is not a PEFT adapter: {ADAPTER_CONFIG} is missing")
    if not (p / ADAPTER_WEIGHTS).is_file():
        pickles = [f.name for f in p.iterdir() if f.suffix in _PICKLE_SUFFIXES]
        hint = f" (found pickle files {pickles}: convert them to safetensors; they are never unpickled)" if pickles else ""
        raise AdapterMismatchError(f"{p} has no {ADAPTER_WEIGHTS}{hint}")
    return p


def _jsonable(obj: Any) -> Any:
    return sorted(obj) if isinstance(obj, (set, frozenset)) else str(obj)


def save_adapter(peft_model, adapter_name: str, out_dir: str | Path) -> Path:
    """Write one adapter of a (multi-adapter) PeftModel as a plain PEFT directory (safetensors)."""
    import json

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    cfg = peft_model.peft_config[adapter_name].to_dict()
    cfg["inference_mode"] = True
    if not cfg.get("base_model_name_or_path"):  # peft leaves it unset on adapters added to a PeftModel
        cfg["base_model_name_or_path"] = getattr(peft_model.get_base_model(), "name_or_path", None) or None
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=_jsonable))
    return out


def write_fresh_adapter(model_dir: str | Path, settings: LoraSettings, out_dir: str | Path, *, seed: int = 0) -> Path:
    """A freshly initialised adapter on disk, for engines that only load adapters from files (vLLM)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, settings.to_peft(), adapter_name="fresh")
    return save_adapter(peft_model, "fresh", out_dir)
