"""`python -m tools.data`: the command line over the converters (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.data import deepscaler, gsm8k, synthetic, writer
from tools.data.records import InputError
from tools.data.schema import DEFAULT_INSTRUCTION, BadRow, Example

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE = 0, 1, 2
SHOW_BAD_ROWS = 20  # listed one by one; the rest are counted

DESCRIPTION = """\
Convert math problem sets into verl's RLHF parquet schema: DST/train.parquet and DST/test.parquet.

Each row holds data_source, prompt (one user message: problem + " " + instruction), ability
"math", reward_model {"style": "rule", "ground_truth": answer} and extra_info {index (position in
the source), split, solution}. The default instruction asks for \\boxed{} because the reward
(tools/reward) reads only the last \\boxed{} of a response. Typical use:

  python -m tools.data deepscaler --src deepscaler.json --dst data/deepscaler
  python -m tools.data gsm8k --src gsm8k/train.jsonl --dst data/gsm8k --test-ratio 0.05
  python -m tools.data synthetic-arith --dst data/arith --n 5000

The test rows are a seeded random pick (--seed): the same input and seed give byte-identical files.
Malformed source rows are listed by index with the reason and stop the run before anything is
written; --skip-bad converts the rest and prints how many were left out.

Exit codes: 0 ok, 1 bad input (unreadable source, malformed rows), 2 usage error.
"""


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction such as 0.01") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside 0.0..1.0; it is the fraction of rows held out for test")
    return value


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {minimum}")
        return value
    return parse


def _operators(text: str) -> str:
    ops = "".join(dict.fromkeys(text))  # keep order, drop repeats
    if not ops or set(ops) - set(synthetic.OPERATORS):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {synthetic.OPERATORS!r}, e.g. \"+-\"")
    return ops


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m tools.data", description=DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, epilog: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help + "\n\n" + epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--dst", type=Path, required=True, metavar="DIR",
                       help="output folder for train.parquet and test.parquet (created if missing)")
        p.add_argument("--test-ratio", type=_ratio, default=0.01, metavar="R",
                       help="fraction of rows held out for test, 0.0..1.0 (default 0.01); with 2+ rows a "
                            "ratio above 0 keeps at least one test row, below 1 at least one train row")
        p.add_argument("--seed", type=int, default=0, help="seed of the train/test pick (default 0)")
        p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, metavar="TEXT",
                       help="appended to every problem after a space (default: \"%(default)s\")")
        p.add_argument("--dry-run", action="store_true", help="check and count only; write nothing")
        return p

    def source(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--src", type=Path, required=True, metavar="FILE", help=what)
        p.add_argument("--skip-bad", action="store_true",
                       help="leave malformed rows out (each is still reported) instead of stopping")

    p = add("deepscaler", "Convert DeepScaleR-Preview (a JSON list of {problem, answer, solution}).",
            "data_source is \"deepscaler\". answer becomes the ground truth as it is (LaTeX such as\n"
            "\\frac{1}{2}); solution is optional. A row that is not an object, or whose problem or\n"
            "answer is missing, empty or not a string, is malformed.")
    source(p, "the DeepScaleR JSON file (a list of objects; JSON Lines also accepted)")

    p = add("gsm8k", "Convert GSM8K ({question, answer} rows, the answer ending in '#### 42').",
            "data_source is \"openai/gsm8k\". The text after the last #### is the ground truth, with\n"
            "thousands separators dropped (1,234 -> 1234); the text before it becomes\n"
            "extra_info.solution. A row without #### (or with nothing after it) is malformed.")
    source(p, "GSM8K as JSON Lines (the Hugging Face export) or as a JSON list")

    p = add("synthetic-arith", "Generate easy arithmetic problems with exact integer answers (no download).",
            "data_source is \"synthetic-arith\". Problems read \"What is 37 + 58 * 2?\": 2..--max-terms\n"
            "operands in 0..--max-operand, usual precedence (* before + and -). Meant for checking a\n"
            "pipeline end to end with a tiny model.")
    p.add_argument("--n", type=_at_least(1), default=1000, help="number of problems (default 1000)")
    p.add_argument("--max-operand", type=_at_least(1), default=99, help="largest operand (default 99)")
    p.add_argument("--max-terms", type=_at_least(2), default=3, help="most operands in a problem (default 3)")
    p.add_argument("--ops", type=_operators, default=synthetic.OPERATORS,
                   help=f"operators to draw from (default {synthetic.OPERATORS!r})")
    p.add_argument("--unique", action="store_true",
                   help="no problem twice, so the test split is truly held out (--n must not exceed what exists)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        examples, bad, data_source = _load(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if bad:
        _report_bad(bad, args.src, skipping=args.skip_bad)
        if not args.skip_bad:
            return EXIT_BAD_INPUT
    if not examples:
        print(f"error: {args.src} has no usable rows; nothing to write", file=sys.stderr)
        return EXIT_BAD_INPUT
    splits = writer.split(examples, args.test_ratio, args.seed)
    print(f"{data_source}: {len(examples) + len(bad)} rows in, {len(splits['train'])} train, "
          f"{len(splits['test'])} test, {len(bad)} skipped")
    if args.dry_run:
        print("dry run: nothing written")
        return EXIT_OK
    tables = {name: writer.to_table(splits[name], data_source, name, args.instruction) for name in writer.SPLITS}
    try:
        paths = writer.write_atomically(tables, args.dst)
    except OSError as exc:
        print(f"error: cannot write to {args.dst}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("wrote " + ", ".join(str(path) for path in paths.values()))
    return EXIT_OK


def _load(args: argparse.Namespace) -> tuple[list[Example], list[BadRow], str]:
    if args.command == "synthetic-arith":
        try:
            examples = synthetic.generate(args.n, args.seed, args.max_operand, args.ops, args.max_terms, args.unique)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        return examples, [], synthetic.DATA_SOURCE
    module = {"deepscaler": deepscaler, "gsm8k": gsm8k}[args.command]
    examples, bad = module.read(args.src)
    return examples, bad, module.DATA_SOURCE


def _report_bad(bad: list[BadRow], src: Path, skipping: bool) -> None:
    label = "warning: skipped" if skipping else "error:"
    for row in bad[:SHOW_BAD_ROWS]:
        print(f"{label} {src} row {row.index}: {row.reason}", file=sys.stderr)
    if len(bad) > SHOW_BAD_ROWS:
        print(f"{label} ... and {len(bad) - SHOW_BAD_ROWS} more malformed rows", file=sys.stderr)
    if skipping:
        print(f"warning: skipped {len(bad)} malformed rows of {src}", file=sys.stderr)
    else:
        print(f"error: {len(bad)} malformed rows in {src} (rows are numbered from 0); fix them, or pass "
              "--skip-bad to convert the rest without them", file=sys.stderr)
