"""What the docs say about a recipe profile's scale and layout is held to the profile's YAML, so it cannot drift.

The docs (README.md, docs/, recipes/*/README.md) state these facts in profile tables: a Markdown table whose first
column is `profile`. Every cell of such a table is read and compared with the config of that name:

- profile, `cpu-tiny`: recipes/deepseek_r1/configs/cpu-tiny.yaml exists;
- device, A3 / CPU / H200: launch.accelerator;
- nodes x ranks, `16 x 16`: launch.nodes x launch.devices_per_node;
- train, `Megatron TP4 PP8 EP8 DP8` or `FSDP DP2`: the actor's and the ref's strategy and Megatron layout, with
  DP = world / (TP x PP);
- rollout, `vLLM 2 x DP64 TP2 EP128` or `HF DP2`: rollout.name, recipe.rollout.instances, data_parallel_size and
  expert_parallel_size, and the rollout's tensor_model_parallel_size.

In the rollout column an omitted instance count, TP or EP means 1. A column the test does not know fails: a fact
in such a table must be checked. Outside them, a sentence that names exactly one profile, or a table row whose first
cell names one, is checked for what it says of the rollout engine (vLLM or HF), the ranks and the nodes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools.launch import config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "deepseek_r1" / "configs"
PROFILES = sorted((p.stem for p in CONFIGS.glob("*.yaml")), key=len, reverse=True)  # cpu-tiny-fsdp before cpu-tiny
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("recipes/**/README.md")])
COLUMNS = ("profile", "device", "nodes x ranks", "train", "rollout")
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
TRAIN = re.compile(r"^(Megatron|FSDP)((?: (?:TP|PP|EP|DP)\d+)+)$")
ROLLOUT = re.compile(r"^(vLLM|HF)(?: (\d+) x)?((?: (?:DP|TP|EP)\d+)+)$")
NODES_RANKS = re.compile(r"^(\d+) x (\d+)$")
ENGINES = {"vLLM": "vllm", "HF": "hf"}


@dataclass(frozen=True)
class Facts:
    """A profile's scale and layout, read from its YAML as the launcher reads it (interpolations resolved)."""

    accelerator: str
    nodes: int
    ranks: int
    strategy: str
    train: dict  # TP, PP, EP, DP (Megatron) or DP (FSDP)
    engine: str
    rollout: dict  # instances, DP, TP, EP

    @property
    def world(self) -> int:
        return self.nodes * self.ranks


@functools.cache
def facts(name: str) -> Facts:
    cfg = config.load(CONFIGS / f"{name}.yaml").cfg

    def v(key):
        return config.value(cfg, key)

    nodes, ranks = int(v("launch.nodes")), int(v("launch.devices_per_node"))
    strategy = v("actor_rollout_ref.actor.strategy")
    assert v("actor_rollout_ref.ref.strategy") == strategy, f"{name}: the train column describes actor and ref alike"
    if strategy == "megatron":
        layout = {}
        for dim, key in (("TP", "tensor"), ("PP", "pipeline"), ("EP", "expert")):
            actor = v(f"actor_rollout_ref.actor.megatron.{key}_model_parallel_size")
            assert v(f"actor_rollout_ref.ref.megatron.{key}_model_parallel_size") == actor, f"{name}: ref {dim}"
            layout[dim] = int(actor)
        layout["DP"] = nodes * ranks // (layout["TP"] * layout["PP"])
    else:
        layout = {"DP": nodes * ranks}
    rollout = {"instances": int(v("recipe.rollout.instances")), "DP": int(v("recipe.rollout.data_parallel_size")),
               "TP": int(v("actor_rollout_ref.rollout.tensor_model_parallel_size")),
               "EP": int(v("recipe.rollout.expert_parallel_size"))}
    return Facts(v("launch.accelerator"), nodes, ranks, strategy, layout, v("actor_rollout_ref.rollout.name"), rollout)


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


@dataclass(frozen=True)
class Row:
    where: str  # path:line
    columns: dict[str, str]


def profile_tables(path: Path) -> list[list[Row]]:
    lines = path.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines[:-1]):
        if not line.startswith("|") or not SEPARATOR.match(lines[i + 1]) or cells(line)[0] != "profile":
            continue
        header = cells(line)
        rows = []
        for j in range(i + 2, len(lines)):
            if not lines[j].startswith("|"):
                break
            rows.append(Row(f"{path.relative_to(ROOT)}:{j + 1}", dict(zip(header, cells(lines[j]), strict=True))))
        tables.append(rows)
    return tables


ROWS = [row for path in DOCS for table in profile_tables(path) for row in table]


def row_errors(row: Row) -> list[str]:
    """What the row says that its profile's YAML does not; an unreadable cell is an error too, naming the form."""
    unknown = sorted(set(row.columns) - set(COLUMNS))
    if unknown:
        return [f"column(s) {unknown} are not checked; a profile table has only {list(COLUMNS)}"]
    name = row.columns["profile"].strip("`")
    if name not in PROFILES:
        return [f"profile {row.columns['profile']!r} is no config under {CONFIGS.relative_to(ROOT)}"]
    f, errors = facts(name), []

    def differ(what, stated, actual):
        if stated != actual:
            errors.append(f"{name}: the docs say {what} {stated}, the YAML has {actual}")

    if "device" in row.columns:
        differ("device", row.columns["device"].lower(), f.accelerator)
    if "nodes x ranks" in row.columns:
        m = NODES_RANKS.match(row.columns["nodes x ranks"])
        if not m:
            return errors + [f"nodes x ranks {row.columns['nodes x ranks']!r}: write it as '16 x 16'"]
        differ("nodes x ranks", (int(m[1]), int(m[2])), (f.nodes, f.ranks))
    if "train" in row.columns:
        m = TRAIN.match(row.columns["train"])
        if not m:
            return errors + [f"train {row.columns['train']!r}: write it as 'Megatron TP4 PP8 EP8 DP8' or 'FSDP DP2'"]
        differ("train strategy", m[1].lower(), f.strategy)
        differ("train layout", dict(re.findall(r"(TP|PP|EP|DP)(\d+)", m[2])), {k: str(n) for k, n in f.train.items()})
    if "rollout" in row.columns:
        m = ROLLOUT.match(row.columns["rollout"])
        if not m:
            return errors + [f"rollout {row.columns['rollout']!r}: write it as 'vLLM 2 x DP64 TP2 EP128' or 'HF DP2'"]
        differ("rollout engine", ENGINES[m[1]], f.engine)
        stated = {"instances": 1, "TP": 1, "EP": 1, **{k: int(n) for k, n in re.findall(r"(DP|TP|EP)(\d+)", m[3])}}
        stated["instances"] = int(m[2] or 1)
        differ("rollout layout", stated, f.rollout)
    return errors


PROFILE_NAME = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, PROFILES)) + r")(?![\w-])")


def sentences(path: Path):
    """(where, text) of every sentence outside code blocks; a table row counts as one (prose_errors leaves the profile
    tables' rows to row_errors)."""
    rel, block, fenced = path.relative_to(ROOT), [], False

    def flush():
        if block:
            for s in re.split(r"(?<=[.;!?])\s+", " ".join(text for _, text in block)):
                yield f"{rel}:{block[0][0]}", s
            block.clear()

    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            yield from flush()
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("|"):
            yield from flush()
            if cells(line)[0] != "profile" and not SEPARATOR.match(line):
                yield f"{rel}:{i}", line
        elif not line.strip() or line.startswith("#") or re.match(r"\s*(- |\d+\. )", line):
            yield from flush()
            if line.strip() and not line.startswith("#"):
                block.append((i, line.strip()))
        else:
            block.append((i, line.strip()))
    yield from flush()


def prose_errors(path: Path) -> list[str]:
    table_rows = {row.where for row in ROWS}
    errors = []
    for where, s in sentences(path):
        if where in table_rows:
            continue
        # a table row is about the profile its first cell names, a sentence about the one profile it names
        names = set(PROFILE_NAME.findall(cells(s)[0] if s.startswith("|") else s))
        if len(names) != 1:
            continue
        f = facts(names.pop())
        said = {ENGINES[e] for e in ("vLLM", "HF") if re.search(rf"\b{e}\b", s)}
        if said and f.engine not in said:
            errors.append(f"{where}: says {sorted(said)} rollout, the YAML's rollout.name is {f.engine}: {s!r}")
        for n in re.findall(r"\b(\d+) (?:CPU )?ranks\b", s):
            if int(n) != f.world:
                errors.append(f"{where}: says {n} ranks, the YAML has {f.world}: {s!r}")
        for n in re.findall(r"\b(\d+) nodes?\b", s):
            if int(n) != f.nodes:
                errors.append(f"{where}: says {n} nodes, the YAML has {f.nodes}: {s!r}")
    return errors


def test_the_docs_have_profile_tables_and_the_readme_lists_every_profile():
    assert len(ROWS) >= len(PROFILES), [r.where for r in ROWS]
    in_readme = {r.columns["profile"].strip("`") for r in ROWS if r.where.startswith("README.md:")}
    assert in_readme == set(PROFILES), f"README.md's profile table lacks {sorted(set(PROFILES) - in_readme)}"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.where)
def test_profile_table_row_matches_the_yaml(row):
    errors = row_errors(row)
    assert not errors, f"{row.where}: " + "; ".join(errors)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_sentences_about_one_profile_match_the_yaml(path):
    errors = prose_errors(path)
    assert not errors, "\n".join(errors)


def test_the_checks_catch_a_wrong_statement():
    """Each kind of wrong statement is caught: a layout, an engine, a count of ranks, an unknown column."""
    good = Row("x:1", {"profile": "`cpu-tiny`", "device": "CPU", "nodes x ranks": "1 x 4",
                       "train": "Megatron TP2 PP2 EP1 DP1", "rollout": "vLLM 2 x DP2 TP1 EP2"})
    assert row_errors(good) == []
    for column, wrong in (("device", "A3"), ("nodes x ranks", "1 x 8"), ("train", "Megatron TP4 PP1 EP1 DP1"),
                          ("train", "FSDP DP4"), ("rollout", "HF DP2 EP2"), ("rollout", "vLLM DP2 TP1 EP2"),
                          ("rollout", "vLLM 2 x DP2, TP1")):
        assert row_errors(Row("x:1", {**good.columns, column: wrong})), (column, wrong)
    assert row_errors(Row("x:1", {**good.columns, "world": "4"}))
