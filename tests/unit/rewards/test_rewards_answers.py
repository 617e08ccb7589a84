"""Answer extraction and equivalence used by TaskCompletion."""

from __future__ import annotations

import pytest

from marft_lg.rewards.answers import (
    answers_match,
    candidate_answers,
    extract_boxed,
    last_number,
    normalise,
    to_number,
    to_sympy,
)


def test_extract_boxed_takes_the_last_and_balances_braces():
    text = r"first \boxed{1} then \boxed{\frac{1}{2}} done"
    assert extract_boxed(text) == r"\frac{1}{2}"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{unclosed") is None


def test_last_number_and_normalise():
    assert last_number("we get 12 apples, then 1,234.5 pears") == "1,234.5"
    assert last_number("no digits") is None
    assert normalise(r"  The answer is $\text{Paris}$. ") == "paris"


@pytest.mark.parametrize(("text", "value"), [
    ("1,234", 1234.0), ("3/4", 0.75), (r"\frac{3}{4}", 0.75), ("50%", 0.5), ("-0.5", -0.5), ("abc", None),
])
def test_to_number(text, value):
    assert to_number(text) == value


@pytest.mark.parametrize(("pred", "ref", "mode", "ok"), [
    ("Paris", "paris", "normalised", True),
    ("Paris", "paris", "exact", False),
    ("0.5", r"\frac{1}{2}", "numeric", True),
    ("1,000", "1000", "auto", True),
    (r"\frac{\sqrt{2}}{2}", "1/sqrt(2)", "symbolic", True),
    ("2x + x", "3x", "symbolic", True),
    ("x^2 - 1", "(x-1)(x+1)", "auto", True),
    ("x^2 + 1", "(x-1)(x+1)", "auto", False),
    ("41", "42", "auto", False),
    ("7", ["6", "7"], "auto", True),
    ("ANSWER: Refunds are accepted within 30 Days.", "30 days", "contains", True),
    ("ANSWER: within 3 days", "30 days", "contains", False),
    ("anything", "", "contains", False),
])
def test_answers_match(pred, ref, mode, ok):
    assert answers_match(pred, ref, mode=mode) is ok


def test_symbolic_parsing_refuses_code():
    assert to_sympy("__import__('os').system('true')") is None
    assert to_sympy("x.__class__") is None
    assert to_sympy("2 + 3") == 5


def test_candidates_prefer_boxed_then_text_and_last_number():
    assert candidate_answers(r"so \boxed{4}, not 5") == ["4"]
    assert candidate_answers("it is 4 or maybe 5") == ["it is 4 or maybe 5", "5"]
    assert candidate_answers("it is 5", last_number_fallback=False) == ["it is 5"]
