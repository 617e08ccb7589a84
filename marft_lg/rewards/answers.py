r"""Answer extraction and equivalence: \boxed{} extraction, normalised text, numbers, sympy algebra.

`answers_match(prediction, reference)` (mode "auto") tries, in order, normalised string equality, numeric
equality (fractions, percents, thousands separators, \frac) and symbolic equality with sympy
(simple LaTeX is rewritten to sympy syntax first). Inputs longer than `MAX_SYMBOLIC_CHARS`
skip the symbolic step so a pathological answer cannot stall a scoring run. Mode "contains"
accepts an answer whose normalised text contains the normalised reference (free-text QA).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

MAX_SYMBOLIC_CHARS = 200
MATCH_MODES = ("auto", "exact", "normalised", "numeric", "symbolic", "contains")

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None when absent."""
    start = -1
    for key in ("\\boxed", "\\fbox"):
        start = max(start, text.rfind(key))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        tail = text[start:].split(maxsplit=1)
        return tail[1].split("$")[0].strip() if len(tail) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` (``1,234``, ``-0.5``, ``3/4``), or None."""
    found = _NUMBER_RE.findall(text)
    return found[-1].strip() if found else None


_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_PREFIXES = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", re.IGNORECASE)


def normalise(text: Any) -> str:
    """Lower-case, unwrap ``$``/``\\text{}``, drop 'the answer is' and trailing punctuation, squash spaces."""
    s = str(text).strip()
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", " ").replace("\\left", "").replace("\\right", "")
    s = _PREFIXES.sub("", s.strip())
    s = s.rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    s = re.sub(r"\s+", " ", s).lower()
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1].strip()
    return s


def to_number(text: Any) -> float | None:
    r"""A number from ``"1,234"``, ``"3/4"``, ``"\frac{3}{4}"``, ``"12%"``, ``"$5"``; None when not a plain number."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    s = normalise(text)
    s = re.sub(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$", r"\1/\2", s)
    s = s.replace("\\%", "%").replace("\\$", "").lstrip("$").strip()
    percent = s.endswith("%")
    s = s.rstrip("%").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?\s*/\s*-?\d+(\.\d+)?", s):
            num, den = (float(p) for p in s.split("/"))
            value = num / den if den else None
        else:
            value = float(Fraction(s)) if re.fullmatch(r"-?\d+", s) else float(s)
    except (ValueError, ZeroDivisionError):
        return None
    if value is None or not math.isfinite(value):
        return None
    return value / 100.0 if percent else value


def latex_to_sympy_text(text: str) -> str:
    r"""Rewrite simple LaTeX (``\frac``, ``\sqrt``, ``^``, ``\cdot``, ``\pi``) into sympy's input syntax."""
    s = normalise(text)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    for _ in range(8):
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\sqrt\[([^\]]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", new)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    s = re.sub(r"\\sqrt\s*(\w)", r"sqrt(\1)", s)
    replacements = {"\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": "pi", "\\infty": "oo",
                    "^": "**", "{": "(", "}": ")", "\\": ""}
    for old, new in replacements.items():
        s = s.replace(old, new)
    return s.strip()


def to_sympy(text: Any) -> Any | None:
    """A sympy expression parsed from plain or simple LaTeX math, or None when it does not parse."""
    s = latex_to_sympy_text(str(text))
    if "=" in s:
        s = s.rsplit("=", 1)[-1].strip()
    if not s or len(s) > MAX_SYMBOLIC_CHARS or not _is_safe_math(s):
        return None
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(s, transformations=transformations, evaluate=True)
    except Exception:  # sympy raises many types (SyntaxError, TokenError, TypeError...) on non-math text
        return None


_SAFE_CHARS = re.compile(r"^[0-9a-z+\-*/().,\s]*$")
_SAFE_NAMES = frozenset({"sqrt", "pi", "oo", "log", "ln", "exp", "sin", "cos", "tan", "abs"})


def _is_safe_math(s: str) -> bool:
    """Only arithmetic, single-letter symbols and a few functions: parse_expr evaluates its input."""
    if not _SAFE_CHARS.match(s) or re.search(r"[a-z)]\s*\.", s):
        return False
    return all(len(w) == 1 or w in _SAFE_NAMES for w in re.findall(r"[a-z]+", s))


def symbolic_equal(a: Any, b: Any) -> bool:
    """True when sympy can show ``a - b`` simplifies to 0 (or both are equal as sets/tuples)."""
    ea, eb = to_sympy(a), to_sympy(b)
    if ea is None or eb is None:
        return False
    try:
        import sympy

        if ea == eb:
            return True
        if not (ea.free_symbols or eb.free_symbols):
            return abs(complex(sympy.N(ea - eb))) < 1e-9
        diff = sympy.simplify(ea - eb)
        if diff == 0:
            return True
        value = complex(sympy.N(diff))
        return abs(value) < 1e-9
    except Exception:  # non-numeric symbols, tuples etc.: not provably equal
        return False


def answers_match(prediction: Any, reference: Any, *, mode: str = "auto", tolerance: float = 1e-6) -> bool:
    """Whether `prediction` answers `reference` under `mode` (see `MATCH_MODES`); a list reference means any of."""
    if mode not in MATCH_MODES:
        raise ValueError(f"unknown match mode {mode!r}; use one of {list(MATCH_MODES)}")
    refs: Iterable[Any] = reference if isinstance(reference, list | tuple) else [reference]
    return any(_match_one(prediction, r, mode, tolerance) for r in refs)


def _match_one(pred: Any, ref: Any, mode: str, tolerance: float) -> bool:
    if pred is None or ref is None:
        return False
    if mode == "exact":
        return str(pred).strip() == str(ref).strip()
    if mode == "contains":
        needle = normalise(ref)
        return bool(needle) and needle in normalise(pred)
    if mode in ("auto", "normalised") and normalise(pred) == normalise(ref):
        return True
    if mode in ("auto", "numeric"):
        p, r = to_number(pred), to_number(ref)
        if p is not None and r is not None:
            return math.isclose(p, r, rel_tol=tolerance, abs_tol=tolerance)
    if mode in ("auto", "symbolic"):
        return symbolic_equal(pred, ref)
    return False


def candidate_answers(text: str, *, boxed: bool = True, last_number_fallback: bool = True) -> list[str]:
    r"""What in a completion may be the answer: the ``\boxed{}`` content if any, else the text and its last number."""
    if boxed:
        b = extract_boxed(text)
        if b is not None:
            return [b]
    out = [text]
    if last_number_fallback:
        n = last_number(text)
        if n is not None:
            out.append(n)
    return out
