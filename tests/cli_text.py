"""What a CLI printed, as one line of words: rich's error panels drawn without their borders, so a test can look
for a message however the panel wrapped it (tests/conftest.py widens the terminal, so a long path is not folded)."""

from __future__ import annotations

import re


def flat(text: str) -> str:
    """`text` without panel borders and with every run of whitespace as one space."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())
