"""tools.reward.math_score: box extraction, strict equivalence through math-verify, the lax rule,
and the time bound on adversarial answers. Expectations were checked against math-verify 0.9."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.reward import math_score
from tools.reward.math_score import last_boxed, normalize

# The equivalence cases get a budget no loaded CI machine reaches: at the default 5 s, math-verify's own 2 s parse
# timeout once cut `(1, 2]` short under the full suite and scored it 0. The bound itself has its own tests below.
EQUIVALENCE_BUDGET_S = 120.0


def compute_score(response, truth, *, timeout_s=EQUIVALENCE_BUDGET_S, **kwargs):
    return math_score.compute_score(response, truth, timeout_s=timeout_s, **kwargs)


def boxed(answer: str) -> str:
    return f"Let me work through it. So the final answer is \\boxed{{{answer}}}."


@pytest.mark.parametrize(("text", "expected"), [
    (r"\boxed{42}", "42"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count as nesting
    (r"\boxed {7}", "7"),
    (r"\boxed 7", "7"),
    (r"$\boxed 7$ done", "7"),
    (r"\fbox{x+1}", "x+1"),
    (r"\boxed{\boxed{3}}", "3"),  # the last command is the inner one
    (r"\boxed{}", ""),
    ("no box at all: 42", None),
    (r"\boxed{3", None),
    (r"\boxed{1} and later \boxed{2", None),  # an unfinished last box does not fall back to an earlier one
    (r"\boxed", None),
    (r"\boxedfoo{3}", None),
    (r"\boxed7", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@given(st.text(alphabet=st.characters(blacklist_characters="{}\\"), max_size=50), st.text(max_size=50))
def test_last_boxed_returns_the_content_after_any_prefix(content, prefix):
    assert last_boxed(prefix + r" \boxed{" + content + "}") == content


@given(st.text(alphabet="{}\\boxedfx $7", max_size=200))
def test_last_boxed_never_raises(text):
    result = last_boxed(text)
    assert result is None or isinstance(result, str)


@pytest.mark.parametrize(("raw", "expected"), [
    ("  42 ", "42"),
    ("$42$", "42"),
    ("42.", "42"),
    (r"1\,234\,567", "1234567"),
    (r"0.5\,x", r"0.5\,x"),  # a thin space that is not digit grouping stays
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


# (response, ground truth, strict score). Where math-verify's verdict is a choice, the comment says so.
STRICT = [
    # fractions, in every spelling
    (boxed(r"\frac{1}{2}"), "0.5", 1.0),
    (boxed("0.5"), r"\frac{1}{2}", 1.0),
    (boxed("1/2"), r"\frac{1}{2}", 1.0),
    (boxed(r"\dfrac{1}{2}"), "0.5", 1.0),
    (boxed(r"\tfrac12"), "1/2", 1.0),
    (boxed(r"\frac{1}{3}"), "0.33", 0.0),
    # units and text are ignored on either side
    (boxed(r"5\text{ cm}"), "5", 1.0),
    (boxed("5"), r"5\text{ cm}", 1.0),
    (boxed(r"90^\circ"), "90", 1.0),
    (boxed(r"\$12"), "12", 1.0),
    (boxed("12 dollars"), "12", 0.0),  # decided: a bare word that is no known unit makes the answer wrong
    # nested braces, radicals
    (boxed(r"\frac{\sqrt{2}}{2}"), r"\frac{1}{\sqrt{2}}", 1.0),
    (boxed(r"\sqrt{8}"), r"2\sqrt{2}", 1.0),
    # the last box is the answer
    (r"maybe \boxed{3}, no: \boxed{4}", "4", 1.0),
    (r"maybe \boxed{4}, no: \boxed{3}", "4", 0.0),
    # huge numbers are exact
    (boxed("1" + "0" * 50), "10^{50}", 1.0),
    (boxed("1" + "0" * 49 + "1"), "10^{50}", 0.0),
    (boxed("2^{100}"), str(2**100), 1.0),
    (boxed(str(2**100 + 1)), "2^{100}", 0.0),
    # signs
    (boxed("-7"), "-7", 1.0),
    (boxed("-7"), "7", 0.0),
    (boxed("7"), "-7", 0.0),
    # percent: math-verify drops the sign, so 50\% is 50, not 0.5 (decided: keep its reading)
    (boxed(r"50\%"), "50", 1.0),
    (boxed("50"), r"50\%", 1.0),
    (boxed(r"50\%"), "0.5", 0.0),
    # intervals and sets
    (boxed("(1, 2]"), "(1,2]", 1.0),
    (boxed("[1, 2]"), "(1,2)", 0.0),
    (boxed(r"(-\infty, 3)"), r"(-\infty,3)", 1.0),
    (boxed(r"\{1, 2\}"), r"\{2,1\}", 1.0),
    (boxed("2, 3"), "3, 2", 1.0),
    # formatting the reader ignores
    (boxed("1,234"), "1234", 1.0),
    (boxed(r"1\,234"), "1234", 1.0),
    (boxed("x = 3"), "3", 1.0),
    (boxed(r"\left( 1, 2 \right)"), "(1,2)", 1.0),
    (boxed("3.0"), "3", 1.0),
    (boxed("3.01"), "3", 0.0),
    (boxed(r"\pi"), "3.14159", 0.0),  # decided: a decimal approximation is not the exact answer
    (r"\boxed 7.", "7", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (boxed("(B)"), "B", 1.0),
    # a ground truth stored boxed is compared by its content
    (boxed("7"), r"\boxed{7}", 1.0),
    # numbers in the reasoning never score
    ("2 + 2 = 4, so the answer is 4.", "4", 0.0),
    (r"We get 4 along the way. \boxed{5}", "4", 0.0),
    (r"\boxed{}", "4", 0.0),
    (r"the answer is \boxed{4", "4", 0.0),
    (r"\boxed{4} hmm, actually \boxed{4", "4", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "score"), STRICT)
def test_strict(response, truth, score):
    assert compute_score(response, truth) == score


def test_integer_ground_truth_is_accepted():
    assert compute_score(boxed("12"), 12) == 1.0


@pytest.mark.parametrize("truth", ["", "   ", None, 1.5])
def test_missing_ground_truth_is_an_error(truth):
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score(boxed("1"), truth)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="mode"):
        compute_score(boxed("1"), "1", mode="fuzzy")


@pytest.mark.parametrize(("response", "truth", "lax", "strict"), [
    # the reference rule's false positive: "2" is a substring of "2024"
    (r"In the year 2024 we found \boxed{5}.", "2", 1.0, 0.0),
    ("The answer is 2 (no box).", "2", 1.0, 0.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 0.0, 1.0),  # and its false negative: no equivalence
    (r"\boxed{7}", "7", 1.0, 1.0),
    (r"\boxed{8}", "7", 0.0, 0.0),
])
def test_lax_reproduces_the_substring_rule(response, truth, lax, strict):
    assert compute_score(response, truth, mode="lax") == lax
    assert compute_score(response, truth, mode="strict") == strict


ADVERSARIAL = {
    "braces": "{" * 100_000 + "}" * 100_000,
    "open boxes": r"\boxed{" * 10_000,
    "deep nesting inside a box": r"\boxed{" + "{" * 5_000 + "1" + "}" * 5_000 + "}",
    "deep fractions": r"\boxed{" + r"\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "power tower": r"\boxed{10^{10^{10}}}",
    "long sum": r"\boxed{" + "+".join(["1"] * 20_000) + "}",
    "closing braces before the box": "}" * 100_000 + r"\boxed{2}",
}


@pytest.mark.parametrize("response", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_answers_return_within_the_bound(response):
    timeout_s = 1.0
    compute_score(boxed("1"), "1")  # start the worker outside the timed call
    start = time.monotonic()
    score = compute_score(response, "2", timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert score == (1.0 if response.endswith(r"\boxed{2}") else 0.0)
    assert elapsed < timeout_s + 0.75, f"took {elapsed:.2f}s"


def test_scoring_recovers_after_a_timeout():
    assert compute_score(ADVERSARIAL["deep nesting inside a box"], "1", timeout_s=0.5) == 0.0
    assert compute_score(boxed(r"\frac{3}{4}"), "0.75") == 1.0


def test_scores_from_threads():
    # math-verify's own timeouts need the main thread; the worker process makes threads safe.
    cases = [(boxed(str(n)), str(n if n % 2 else n + 1)) for n in range(8)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda case: compute_score(*case), cases))
    assert scores == [0.0, 1.0] * 4
