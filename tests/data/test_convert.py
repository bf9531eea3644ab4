"""tools.data converters end to end: source file -> `main([...])` -> parquet read back with pyarrow."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tools.data import synthetic
from tools.data.cli import main
from tools.data.gsm8k import final_number
from tools.data.schema import DEFAULT_INSTRUCTION


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def deepscaler_rows(n: int) -> list[dict]:
    return [{"problem": f"Problem {i}?", "answer": f"\\frac{{{i}}}{{2}}", "solution": f"Work {i}."} for i in range(n)]


def read_rows(dst: Path, split: str) -> list[dict]:
    return pq.read_table(dst / f"{split}.parquet").to_pylist()


def test_schema_names_and_types(tmp_path):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(5))
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "out")]) == 0
    schema = pq.read_schema(tmp_path / "out" / "train.parquet")
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("data_source").type == pa.string()
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("reward_model").type == pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    assert schema.field("extra_info").type == pa.struct(
        [("index", pa.int64()), ("split", pa.string()), ("solution", pa.string())])


def test_deepscaler_rows(tmp_path, capsys):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(10))
    dst = tmp_path / "out"
    assert main(["deepscaler", "--src", str(src), "--dst", str(dst), "--test-ratio", "0.2"]) == 0
    train, test = read_rows(dst, "train"), read_rows(dst, "test")
    assert (len(train), len(test)) == (8, 2)
    assert "10 rows in, 8 train, 2 test, 0 skipped" in capsys.readouterr().out
    by_index = {row["extra_info"]["index"]: row for row in train + test}
    assert sorted(by_index) == list(range(10))
    row = by_index[3]
    assert row == {
        "data_source": "deepscaler",
        "prompt": [{"role": "user", "content": f"Problem 3? {DEFAULT_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r"\frac{3}{2}"},
        "extra_info": {"index": 3, "split": row["extra_info"]["split"], "solution": "Work 3."},
    }
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert {r["extra_info"]["split"] for r in test} == {"test"}
    assert [r["extra_info"]["index"] for r in train] == sorted(r["extra_info"]["index"] for r in train)


def test_instruction_is_configurable(tmp_path):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(1))
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "o"), "--instruction", "Box it."]) == 0
    assert read_rows(tmp_path / "o", "train")[0]["prompt"][0]["content"] == "Problem 0? Box it."


def test_same_seed_gives_byte_identical_files(tmp_path):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(50))
    for name in ("a", "b"):
        assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / name), "--test-ratio", "0.3"]) == 0
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (tmp_path / "b" / f"{split}.parquet").read_bytes()


def test_another_seed_picks_other_test_rows(tmp_path):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(50))
    picks = []
    for seed in ("0", "1"):
        dst = tmp_path / seed
        assert main(["deepscaler", "--src", str(src), "--dst", str(dst), "--test-ratio", "0.3", "--seed", seed]) == 0
        picks.append({row["extra_info"]["index"] for row in read_rows(dst, "test")})
    assert len(picks[0]) == len(picks[1]) == 15
    assert picks[0] != picks[1]


def test_malformed_rows_stop_the_run_and_are_named(tmp_path, capsys):
    rows = [*deepscaler_rows(2), "not an object", {"problem": "P"}, {"problem": "", "answer": "1"},
            {"problem": "P", "answer": 3}, {"problem": "P", "answer": "1", "solution": ["x"]}]
    src = write_json(tmp_path / "ds.json", rows)
    dst = tmp_path / "out"
    assert main(["deepscaler", "--src", str(src), "--dst", str(dst)]) == 1
    err = capsys.readouterr().err
    assert "row 2: expected a JSON object, got str" in err
    assert "row 3: missing field 'answer'" in err
    assert "row 4: field 'problem' is empty" in err
    assert "row 5: field 'answer' must be a string, got int" in err
    assert "row 6: field 'solution' must be a string, got list" in err
    assert "5 malformed rows" in err and "--skip-bad" in err
    assert not dst.exists()


def test_skip_bad_converts_the_rest_and_counts(tmp_path, capsys):
    rows = [*deepscaler_rows(3), {"problem": "P"}]
    src = write_json(tmp_path / "ds.json", rows)
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "out"), "--test-ratio", "0"]) == 1
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "out"), "--test-ratio", "0",
                 "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "4 rows in, 3 train, 0 test, 1 skipped" in captured.out
    assert "skipped 1 malformed rows" in captured.err
    assert [r["extra_info"]["index"] for r in read_rows(tmp_path / "out", "train")] == [0, 1, 2]
    assert read_rows(tmp_path / "out", "test") == []


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path, capsys):
    src = write_json(tmp_path / "ds.json", [{"problem": "P"}])
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "o"), "--skip-bad"]) == 1
    assert "no usable rows" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    ("[{", "is not valid JSON"),
    (None, "cannot read"),
])
def test_unreadable_source(tmp_path, capsys, content, message):
    src = tmp_path / "ds.json"
    if content is not None:
        src.write_text(content)
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "o")]) == 1
    assert message in capsys.readouterr().err


def test_dry_run_writes_nothing(tmp_path, capsys):
    src = write_json(tmp_path / "ds.json", deepscaler_rows(4))
    assert main(["deepscaler", "--src", str(src), "--dst", str(tmp_path / "o"), "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_rewrite_replaces_files_and_leaves_no_temporaries(tmp_path):
    dst = tmp_path / "out"
    for n in (5, 3):
        src = write_json(tmp_path / "ds.json", deepscaler_rows(n))
        assert main(["deepscaler", "--src", str(src), "--dst", str(dst), "--test-ratio", "0"]) == 0
    assert len(read_rows(dst, "train")) == 3
    assert sorted(p.name for p in dst.iterdir()) == ["test.parquet", "train.parquet"]


GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Big sum?", "answer": "Add them.\n#### 1,234"},
    {"question": "No mark", "answer": "just 5"},
    {"question": "Empty final", "answer": "work ####  "},
    {"question": "Negative", "answer": "owes money\n#### -12"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_gsm8k(tmp_path, capsys, fmt):
    src = (write_jsonl if fmt == "jsonl" else write_json)(tmp_path / f"gsm8k.{fmt}", GSM8K)
    dst = tmp_path / "out"
    assert main(["gsm8k", "--src", str(src), "--dst", str(dst), "--test-ratio", "0"]) == 1
    err = capsys.readouterr().err
    assert "row 2: field 'answer' has no '####'" in err
    assert "row 3: field 'answer' has nothing after '####'" in err
    assert main(["gsm8k", "--src", str(src), "--dst", str(dst), "--test-ratio", "0", "--skip-bad"]) == 0
    rows = read_rows(dst, "train")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1234", "-12"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 4]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["extra_info"]["solution"] == "3 + 4 = <<3+4=7>>7"
    assert rows[0]["prompt"][0]["content"].startswith("Tom has 3 apples and buys 4. How many? Let's think")


def test_gsm8k_bad_json_line_is_reported_by_row_and_line(tmp_path, capsys):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps(GSM8K[0]) + "\n\n{broken\n")
    assert main(["gsm8k", "--src", str(src), "--dst", str(tmp_path / "o")]) == 1
    assert "row 1: line 3 is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [
    ("1,234", "1234"), ("1,234,567.5", "1234567.5"), ("-1,000", "-1000"), ("72", "72"),
    ("1,2", "1,2"), ("5 apples", "5 apples"),
])
def test_gsm8k_final_number(text, expected):
    assert final_number(text) == expected


def test_synthetic_arith(tmp_path):
    dst = tmp_path / "out"
    assert main(["synthetic-arith", "--dst", str(dst), "--n", "200", "--test-ratio", "0.1", "--max-operand", "20"]) == 0
    train, test = read_rows(dst, "train"), read_rows(dst, "test")
    assert (len(train), len(test)) == (180, 20)
    for row in train + test:
        assert row["data_source"] == "synthetic-arith"
        expression = row["extra_info"]["solution"].split(" = ")[0]
        assert row["prompt"][0]["content"].startswith(f"What is {expression}? ")
        operands = [int(token) for token in expression.split() if token.isdigit()]
        assert 2 <= len(operands) <= 3 and all(0 <= x <= 20 for x in operands)
        assert int(row["reward_model"]["ground_truth"]) == eval(expression)  # Python's precedence is the oracle


def test_synthetic_arith_is_seeded(tmp_path):
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        assert main(["synthetic-arith", "--dst", str(tmp_path / name), "--n", "30", "--seed", seed]) == 0
    train = {name: (tmp_path / name / "train.parquet").read_bytes() for name in "abc"}
    assert train["a"] == train["b"] != train["c"]


def test_synthetic_ops_restrict_the_operators():
    problems = synthetic.generate(100, seed=1, ops="+")
    assert all("-" not in p.problem and "*" not in p.problem for p in problems)
    assert all(int(p.answer) >= 0 for p in problems)


@pytest.mark.parametrize(("operands", "operators", "value"), [
    ([37, 58, 2], ["+", "*"], 153),
    ([2, 3, 4], ["*", "+"], 10),
    ([10, 3, 2], ["-", "-"], 5),
    ([10, 3, 2], ["-", "*"], 4),
    ([5, 6], ["*"], 30),
])
def test_synthetic_precedence(operands, operators, value):
    assert synthetic.evaluate(operands, operators) == value


def test_unique_problems_make_a_truly_held_out_split(tmp_path):
    # the smoke task: every sum of two numbers in 0..20, 15% of them held out
    dst = tmp_path / "sums"
    assert main(["synthetic-arith", "--dst", str(dst), "--n", "441", "--ops", "+", "--max-operand", "20",
                 "--max-terms", "2", "--unique", "--test-ratio", "0.15"]) == 0
    train, test = read_rows(dst, "train"), read_rows(dst, "test")
    problems = [r["prompt"][0]["content"] for r in train + test]
    assert len(set(problems)) == len(problems) == 441, "every possible problem once"
    assert not {r["prompt"][0]["content"] for r in test} & {r["prompt"][0]["content"] for r in train}
    assert len(test) == 66
    plain = synthetic.generate(441, ops="+", max_operand=20, max_terms=2)
    assert len({p.problem for p in plain}) < 441, "without --unique the draws repeat (what --unique is for)"


def test_unique_refuses_more_problems_than_exist(tmp_path, capsys):
    assert synthetic.distinct_problems(max_operand=9, n_ops=2, max_terms=3) == 100 * 2 + 1000 * 4
    assert main(["synthetic-arith", "--dst", str(tmp_path / "x"), "--n", "101", "--ops", "+", "--max-operand", "9",
                 "--max-terms", "2", "--unique"]) == 1
    err = capsys.readouterr().err
    assert "--n 101 unique problems asked, but only 100 exist" in err and "lower --n" in err
    assert not (tmp_path / "x").exists()
