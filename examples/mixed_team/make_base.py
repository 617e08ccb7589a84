"""Build the checker's base model: a small random Llama with a BPE tokenizer of its own (not SmolLM2's).

    python make_base.py bases/checker

A real team would name any local transformers directory here; this one is built in seconds, offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

from marft_lg.serving.engine.models import build_tiny_model, build_tiny_tokenizer


def main(out: str = "bases/checker") -> Path:
    root = Path(out)
    tokenizer = build_tiny_tokenizer(root.parent / f"{root.name}-tokenizer")
    return build_tiny_model(root, hidden_size=64, num_layers=2, num_heads=4, seed=1, tokenizer_dir=tokenizer)


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
