"""Synthetic arithmetic: "What is 37 + 58 * 2?" with exact integer answers, generated from a seed.

Small enough for a tiny model to learn in a few hundred steps, so a pipeline can be checked end to
end without downloading anything. Each problem has 2..max_terms operands in [0, max_operand];
`*` binds tighter than `+` and `-`, which evaluate left to right, as in ordinary arithmetic.
"""

from __future__ import annotations

import random

from tools.data.schema import Example

DATA_SOURCE = "synthetic-arith"
OPERATORS = "+-*"


def generate(n: int, seed: int = 0, max_operand: int = 99, ops: str = OPERATORS, max_terms: int = 3,
             unique: bool = False) -> list[Example]:
    """`n` problems; with `unique`, no two alike, so that a held-out split shares no problem with the train split."""
    # random.Random's integer draws have been stable across Python versions since 3.2.
    rng = random.Random(seed)
    if not unique:
        return [_problem(index, rng, max_operand, ops, max_terms) for index in range(n)]
    available = distinct_problems(max_operand, len(ops), max_terms)
    if n > available:
        raise ValueError(f"--n {n} unique problems asked, but only {available} exist with --max-operand "
                         f"{max_operand}, {len(ops)} operator(s) and up to {max_terms} terms; lower --n or widen them")
    seen: dict[str, Example] = {}
    while len(seen) < n:
        ex = _problem(len(seen), rng, max_operand, ops, max_terms)
        seen.setdefault(ex.problem, ex)
    return list(seen.values())


def distinct_problems(max_operand: int, n_ops: int, max_terms: int) -> int:
    """How many different problems the generator can draw."""
    return sum((max_operand + 1) ** k * n_ops ** (k - 1) for k in range(2, max_terms + 1))


def _problem(index: int, rng: random.Random, max_operand: int, ops: str, max_terms: int) -> Example:
    count = rng.randint(2, max_terms)
    operands = [rng.randint(0, max_operand) for _ in range(count)]
    operators = [rng.choice(ops) for _ in range(count - 1)]
    expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(operators, operands[1:], strict=True))
    value = evaluate(operands, operators)
    return Example(index=index, problem=f"What is {expression}?", answer=str(value),
                   solution=f"{expression} = {value}")


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `operands[0] operators[0] operands[1] ...` with products before sums."""
    # Fold each run of `*` into one term, then add the terms with their signs.
    terms, signs = [operands[0]], [1]
    for op, x in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        elif op in "+-":
            terms.append(x)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}; use some of {OPERATORS!r}")
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))
