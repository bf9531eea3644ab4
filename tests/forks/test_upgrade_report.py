"""upgrade-report: which releases it picks, the report it renders from a recorded upgrade.json, and a run end to
end over the synthetic history of the rebase dry-run tests (no network: tags, a bare upstream and local sdists)."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from packaging.version import Version

from tests.forks.conftest import commit_series, git, make_project, make_sdist
from tests.forks.test_rebase_dry_run import BATCH, EXPECTED, LR, SERIES, TYPO, V1, V2, _upstream
from tools.forks import manifest as manifest_mod
from tools.forks import ops, rehearsal, upgrade
from tools.forks.series import Series

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parents[2]

# Tag lists as the upstream mirrors have them (2026).
VERL = "v0.1 v0.1rc v0.2 v0.2.0.post1 v0.2.0.post2 v0.3.0.post0 v0.3.0.post1 v0.3.0.rc0 v0.4.0 v0.4.1 v0.5.0 v0.6.0" \
       " v0.6.1 v0.7.0".split()
VLLM_ASCEND = "v0.7.3 v0.9.0rc2 v0.9.1 v0.9.1rc3 v0.9.2rc1 v0.10.0rc1 v0.10.1rc1 v0.10.2rc1 v0.11.0 v0.11.0rc0" \
              " v0.11.0rc3 v0.12.0rc1 v0.13.0 v0.13.0rc1".split()
MEGATRON = "core_r0.8.0 core_v0.12.1 core_v0.12.2 core_v0.12.3 core_v0.13.0 core_v0.13.0rc4 core_v0.13.1" \
           " core_v0.14.0 core_v0.14.0rc7 core_v0.15.0 core_v0.15.3 core_v0.16.0 v0.11.0 v0.15.3 v0.99.0".split()
MINDSPEED = "v2.1.0_core_r0.8.0 v2.1.0_core_r0.12.1 v2.2.0_core_r0.12.1 v2.3.0_core_r0.12.1 v26.0.0_core_r0.12.1" \
            " v9.0.0_core_r0.8.0 v2.2.1_core_r0.14.0".split()  # the last two: other Megatron lines


def _fork(name: str, ref: str, release_tags: str = "v{version}", release: str | None = None) -> manifest_mod.Fork:
    return manifest_mod.Fork(name, f"third_party/{name}", "https://example.invalid/x.git", ref, "0" * 40,
                             f"third_party/patches/{name}", name, ("cpu",), ("cpu",), None, None, None,
                             release_tags, release)


def _picked(fork: manifest_mod.Fork, tags: list[str], minors: int = 3) -> list[tuple[str, str]]:
    found = upgrade._tagged(fork, tags)
    return [(t.name, t.picked) for t in upgrade.pick(upgrade.pin_version(fork), found, minors)]


def test_the_rule_picks_the_next_patch_and_the_newest_of_each_next_minor_series():
    assert _picked(_fork("verl", "v0.4.0"), VERL) == [
        ("v0.4.1", "next patch of 0.4"), ("v0.5.0", "newest of 0.5"), ("v0.6.1", "newest of 0.6"),
        ("v0.7.0", "newest of 0.7")]
    megatron = _fork("megatron", "core_v0.12.1", "core_v{version}")
    assert _picked(megatron, MEGATRON) == [  # the next patch, not the newest; v0.x and core_r tags are other lines
        ("core_v0.12.2", "next patch of 0.12"), ("core_v0.13.1", "newest of 0.13"), ("core_v0.14.0", "newest of 0.14"),
        ("core_v0.15.3", "newest of 0.15")]
    assert [name for name, _ in _picked(megatron, MEGATRON, minors=1)] == ["core_v0.12.2", "core_v0.13.1"]
    assert [name for name, _ in _picked(megatron, MEGATRON, minors=0)] == ["core_v0.12.2"]


def test_finals_only_unless_a_series_has_only_pre_releases():
    assert _picked(_fork("vllm-ascend", "v0.9.1"), VLLM_ASCEND) == [
        ("v0.9.2rc1", "next patch of 0.9, pre-releases only"),
        ("v0.10.2rc1", "newest of 0.10, pre-releases only"),
        ("v0.11.0", "newest of 0.11"),  # its final, though rc3 sorts after rc0 and the tags list it first
        ("v0.12.0rc1", "newest of 0.12, pre-releases only")]
    # A pre-release newer than its series' final is skipped; a patch release with only pre-releases gives one.
    megatron = _fork("megatron", "core_v0.12.1", "core_v{version}")
    assert _picked(megatron, [*MEGATRON, "core_v0.12.2rc1", "core_v0.13.2rc1"], minors=1) == [
        ("core_v0.12.2", "next patch of 0.12"), ("core_v0.13.1", "newest of 0.13")]
    assert _picked(megatron, ["core_v0.12.3rc1", "core_v0.12.3rc2", "core_v0.12.4"], minors=1) == [
        ("core_v0.12.3rc2", "next patch of 0.12, pre-releases only")]
    # A pre-release pin moves to its own final first.
    rc = _fork("megatron", "core_v0.13.0rc4", "core_v{version}")
    assert _picked(rc, MEGATRON, minors=1) == [("core_v0.13.0", "next patch of 0.13"),
                                               ("core_v0.14.0", "newest of 0.14")]


def test_a_pin_that_is_no_release_tag_follows_its_declared_release():
    mindspeed = _fork("mindspeed", "master@2025-08-28", "v{version}_core_r0.12.1", release="2.1.0")
    assert [name for name, _ in _picked(mindspeed, MINDSPEED)] == [
        "v2.2.0_core_r0.12.1", "v2.3.0_core_r0.12.1", "v26.0.0_core_r0.12.1"]  # not the core_r0.8.0 line
    with pytest.raises(ops.ForkError, match=r"forks\.mindspeed\.ref 'master@2025-08-28' names no version.*"
                                            r"set release = \"X\.Y\.Z\""):
        upgrade.pin_version(replace(mindspeed, release=None))


def test_forks_toml_declares_release_tags_once_with_the_version_in_them(tmp_path):
    (tmp_path / "third_party").mkdir()
    text = (Path(__file__).parents[2] / "third_party/forks.toml").read_text()
    forks = manifest_mod.load(Path(__file__).parents[2]).forks
    assert forks["megatron"].release_tags == "core_v{version}" and forks["verl"].release_tags == "v{version}"
    assert {name: str(upgrade.pin_version(f)) for name, f in forks.items()} == {
        "verl": "0.6.1", "vllm": "0.11.0", "vllm-ascend": "0.11.0", "megatron": "0.12.3", "mindspeed": "2.2.0",
        "mindspeed-llm": "2.2.0"}
    (tmp_path / "third_party/forks.toml").write_text(
        text.replace('release_tags = "core_v{version}"', 'release_tags = "core_v"'))
    with pytest.raises(manifest_mod.ManifestError, match=r"forks\.megatron\.release_tags: 'core_v' must hold"):
        manifest_mod.load(tmp_path)


# ---------------------------------------------------------------- rendering a recorded upgrade.json

def test_the_report_renders_a_recorded_json_to_the_expected_tables():
    """data/UPGRADE.md is what the recorded data/upgrade.json must render to, byte for byte: read it as the
    spec (rows of a rehearsed, an unreachable and a nothing-to-carry target, a fork without targets)."""
    text = upgrade.render(json.loads((DATA / "upgrade.json").read_text()))
    assert text == (DATA / "UPGRADE.md").read_text()
    assert "| demo | v1 | v1.0.1 | 0 | 0 of 7 |\n| gitonly | v1 | v2 | 0 | 0 of 0 |\n" in text  # the cheapest
    assert "| 5 | lower-the-learning-rate | clean | **conflict** (needs 4) | upstream |\n" in text


def test_the_cheapest_target_is_the_newest_of_equal_cost():
    doc = json.loads((DATA / "upgrade.json").read_text())
    demo = doc["forks"]["demo"]["targets"]
    demo[2]["counts"] = dict(demo[0]["counts"])  # demo==3.0rc1 now as cheap as v1.0.1
    assert upgrade.cheapest(doc)[0] == ("demo", "v1", "demo==3.0rc1", "0", "0 of 7")


def test_render_only_needs_nothing_but_the_json(project, capsys):
    recorded = (DATA / "upgrade.json").read_text()
    assert project.cli("upgrade-report", "--render-only") == 2
    assert "upgrade.json not found; run `python -m tools.forks upgrade-report` first" in capsys.readouterr().err
    (project.root / upgrade.JSON_PATH).write_text(recorded)
    assert project.cli("upgrade-report", "--render-only") == 0
    assert (project.root / upgrade.REPORT_PATH).read_text() == upgrade.render(json.loads(recorded))
    (project.root / upgrade.JSON_PATH).write_text(recorded.replace('"schema": 1', '"schema": 0'))
    assert project.cli("upgrade-report", "--render-only") == 2
    assert "schema 0, not 1" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end over a synthetic history


def _paths(value, at: str = "") -> set[str]:
    """Every key path of a JSON document (".forks.*.targets[].counts.conflict"), fork names as *."""
    if isinstance(value, dict):
        found = set()
        for key, sub in value.items():
            path = f"{at}.{'*' if at == '.forks' else key}"
            found |= {path} | _paths(sub, path)
        return found
    if isinstance(value, list):
        return set().union(*(_paths(item, f"{at}[]") for item in value))
    return set()


@pytest.fixture
def released(tmp_path):
    """The dry-run tests' project (seven patches at v1, git tree), its upstream also tagged v1.0.1 (= v1) and
    v3.0rc1 (= v2) before the fork is cloned."""
    upstream = _upstream(tmp_path)
    git(upstream.bare, "tag", "v1.0.1", upstream.v1)
    git(upstream.bare, "tag", "v3.0rc1", upstream.v2)
    project = make_project(tmp_path, upstream, files=V1)
    commit_series(project, SERIES)
    return project


def test_a_run_writes_the_json_and_the_report_for_every_fork(released, capsys):
    assert released.cli("upgrade-report", "--targets", "demo=+v9") == 0
    out = capsys.readouterr().out
    doc = json.loads((released.root / upgrade.JSON_PATH).read_text())
    today = datetime.now(UTC).date().isoformat()

    demo = doc["forks"]["demo"]
    assert demo["pin"] == {"ref": "v1", "commit": released.upstream.v1, "version": "1"}
    assert (demo["patches"], demo["targets_from"]) == (7, "git tags of third_party/demo")
    assert [(t["target"], t["picked"], t["status"]) for t in demo["targets"]] == [
        ("v1.0.1", "next patch of 1.0", "rehearsed"), ("v2", "newest of 2.0", "rehearsed"),
        ("v3.0rc1", "newest of 3.0, pre-releases only", "rehearsed"), ("v9", "asked (--targets)", "unreachable")]
    v101, v2, v3, v9 = demo["targets"]
    assert v101["counts"] == {"clean": 7, "3-way merged": 0, "conflict": 0, "already upstream": 0,
                              "needs a left-out patch": 0}
    assert v2["counts"] == {"clean": 2, "3-way merged": 1, "conflict": 2, "already upstream": 2,
                            "needs a left-out patch": 1}
    assert v3["counts"] == v2["counts"] and v3["source"] == f"git v3.0rc1 @ {released.upstream.v2[:12]}"
    assert [p["patch"] for p in v2["patches"] if p["result"] == "conflict"] == [BATCH, LR]
    assert next(p for p in v2["patches"] if p["patch"] == LR)["needs"] == [BATCH]
    assert "'v9' is neither a commit in third_party/demo nor fetchable" in v9["why"]
    assert {t["date"] for t in demo["targets"]} == {today}

    gitonly = doc["forks"]["gitonly"]  # not synced, no PyPI source: the tags at its url; no patches
    assert gitonly["targets_from"] == f"git tags at {released.upstream.bare}"
    assert [(t["target"], t["status"], t["why"]) for t in gitonly["targets"]] == [
        (name, "nothing to carry", "0 patches: nothing to carry") for name in ("v1.0.1", "v2", "v3.0rc1")]

    report = (released.root / upgrade.REPORT_PATH).read_text()
    assert report == upgrade.render(doc)
    umask = os.umask(0)
    os.umask(umask)
    for path in (upgrade.REPORT_PATH, upgrade.JSON_PATH):  # as `open` makes files, not mkstemp's 0600
        assert stat.S_IMODE((released.root / path).stat().st_mode) == 0o666 & ~umask
    assert re.search(re.escape(f"| demo | v1 | v2 | newest of 2.0 | git v2 @ {released.upstream.v2[:12]} | 2 | 1 | 2"
                               f" | 2 | 1 | {BATCH.removesuffix('.patch')}, {LR.removesuffix('.patch')} | ")
                     + r"\d+ s | " + re.escape(f"{today} |"), report)
    assert re.search(re.escape("| gitonly | v1 | v2 | newest of 2.0 | git v2 | - | - | - | - | - | 0 patches: nothing"
                               " to carry | ") + r"\d+ s | " + re.escape(f"{today} |"), report)
    assert all(isinstance(t["seconds"], int) for f in doc["forks"].values() for t in f["targets"])
    assert re.search(r"demo\W+v1\W+v1\.0\.1\W+0\W+0 of 7", out)  # the cheapest-move table, printed
    assert _paths(doc) == _paths(json.loads((DATA / "upgrade.json").read_text())), \
        "the recorded upgrade.json the render tests read has the schema a run writes"

    # A run of one fork replaces its rows and keeps the others'.
    assert released.cli("upgrade-report", "gitonly", "--minors", "0") == 0
    again = json.loads((released.root / upgrade.JSON_PATH).read_text())
    assert [t["target"] for t in again["forks"]["gitonly"]["targets"]] == ["v1.0.1"]
    assert again["forks"]["demo"] == demo


def test_a_pypi_tree_takes_its_targets_from_the_sdists(tmp_path):
    project = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(project, SERIES, source="pypi")
    make_sdist(project.dist, "1.1", V2)
    make_sdist(project.dist, "1.2rc1", V2)  # 1.1 has a final: the rule skips its pre-release
    assert project.cli("upgrade-report", "demo", "--find-links", str(project.dist)) == 0
    demo = json.loads((project.root / upgrade.JSON_PATH).read_text())["forks"]["demo"]
    assert demo["targets_from"] == "PyPI sdists"
    assert [(t["target"], t["picked"], t["source"]) for t in demo["targets"]] == [
        ("demo==1.1", "newest of 1.1", "PyPI sdist demo-1.1.tar.gz"),
        ("demo==1.2rc1", "newest of 1.2, pre-releases only", "PyPI sdist demo-1.2rc1.tar.gz")]
    assert demo["targets"][0]["counts"][rehearsal.CONFLICT] == 2


def test_bad_targets_and_minors_name_the_argument(released, capsys):
    assert released.cli("upgrade-report", "--targets", "nope=v2") == 2
    assert "--targets 'nope=v2': FORK must be one of demo, gitonly" in capsys.readouterr().err
    assert released.cli("upgrade-report", "--targets", "demo=v2", "--targets", "demo=+v1.0.1") == 2
    assert "given twice" in capsys.readouterr().err
    assert released.cli("upgrade-report", "--minors", "-1") == 2
    assert "--minors -1: give 0 or more" in capsys.readouterr().err


def test_targets_given_replace_the_rule_in_the_order_given():
    fork = _fork("demo", "v1")
    asked = upgrade.plan(Path("/nonexistent"), fork, 3, (["v3", "abc123", "v2"], False), [], [])
    assert [(t.name, t.version) for t in asked.targets] == [("v3", "3"), ("abc123", ""), ("v2", "2")]
    assert Version(asked.pin) == Version("1")


def test_a_target_s_time_is_written_as_the_rebase_report_writes_times():
    assert [upgrade.took(s) for s in (None, 0, 59, 60, 1233)] == ["-", "0 s", "59 s", "1 min 0 s", "20 min 33 s"]


# ---------------------------------------------------------------- a PyPI target where the sdists lack a file


CHECK = "tests/check_feature.py"  # upstream's, in git, not in its sdists (as verl's tests/special_sanity/)
SDIST_LACKS = ("Check the feature", {"feature.py": "ON = 2\n", CHECK: "from feature import ON\nassert ON == 2\n"},
               "The upstream check follows the feature.")


def test_a_pypi_replay_leaves_out_the_files_the_sdists_lack_and_names_them(tmp_path):
    """verl's series changes tests/special_sanity/validate_structure.py, which verl's sdists do not ship: the
    replay onto verl==0.7.1 stopped at the pin ("does not exist in index"). It now replays the rest of that patch
    and names the file; a git target, where the file is, replays all of it."""
    project = make_project(tmp_path, _upstream(tmp_path, {CHECK: "assert True\n"}), files=V1)  # the sdists lack CHECK
    commit_series(project, [*SERIES, SDIST_LACKS])
    make_sdist(project.dist, "1.1", V2)
    fork = manifest_mod.load(project.root).forks["demo"]
    new = "check-the-feature.patch"

    r = rehearsal.rehearse(project.root, fork, "demo==1.1", [], [project.dist])
    assert {o.patch: o.result for o in r.outcomes} == {**EXPECTED, TYPO: rehearsal.UPSTREAM, new: rehearsal.CLEAN}
    by = {o.patch: o for o in r.outcomes}
    assert by[new].unjudged == [CHECK] and [o.patch for o in r.outcomes if o.unjudged] == [new]
    assert by[new].detail() == f"not in the sdists, not replayed: {CHECK}"
    assert by[LR].needs == [BATCH]  # the left-out file does not disturb the dependences

    from_git = rehearsal.rehearse(project.root, fork, "v2", [], [])
    assert {o.patch: (o.result, o.unjudged) for o in from_git.outcomes}[new] == (rehearsal.CLEAN, [])


def test_a_git_pin_still_refuses_a_series_that_does_not_apply(tmp_path):
    """Leaving files out is for sdists only: on a git pin a missing file is a broken series."""
    project = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(project, SERIES)
    (project.patches / "check-the-feature.patch").write_text(
        (project.patches / "add-a-feature-flag.patch").read_text().replace("feature.py", "tests/absent.py")
        .replace("new file mode 100644\n", "").replace("--- /dev/null", "--- a/tests/absent.py"))
    with (project.patches / "series").open("a") as series:
        series.write("check-the-feature.patch\n")
    fork = manifest_mod.load(project.root).forks["demo"]
    with pytest.raises(ops.ForkError, match=r"check-the-feature\.patch does not apply to the pin"):
        rehearsal.rehearse(project.root, fork, "v2", [], [])


# ---------------------------------------------------------------- a fork's notes: runbook and judgement column


def _notes_toml(patches: list[str], runbook: str = "**Runbook.** Rehearse, read, port, test.") -> str:
    entries = "".join(f'\n[patches.{name}]\nblocks = "judgement of {name}"\nbasis = "test"\n' for name in patches)
    return f'schema = 1\ncolumn = "what blocks it at 3+"\nrunbook = """\n{runbook}\n"""\n{entries}'


DEMO = ["add-a-feature-flag", "fix-typo-in-helper", "scale-layer-5", "raise-the-default-batch",
        "lower-the-learning-rate", "seed-the-run", "exclaim-in-the-readme"]


def _notes(tmp_path: Path, text: str) -> upgrade.Notes:
    path = tmp_path / "upgrade-notes.toml"
    path.write_text(text)
    return upgrade.read_notes(path, "third_party/patches/demo/upgrade-notes.toml")


def test_notes_add_the_runbook_and_a_judgement_column_deterministically(tmp_path):
    doc = json.loads((DATA / "upgrade.json").read_text())
    text = upgrade.render(doc, {"demo": _notes(tmp_path, _notes_toml(DEMO))})
    assert "## demo: each patch per target\n\n**Runbook.** Rehearse, read, port, test.\n\n" \
           "| # | patch | v1.0.1 | v2 | demo==3.0rc1 | what blocks it at 3+ |\n" in text
    assert "| 5 | lower-the-learning-rate | clean | **conflict** (needs 4) | upstream |" \
           " judgement of lower-the-learning-rate |\n" in text
    assert text.count("judgement of ") == len(DEMO)
    # The same files give the same bytes, whatever order the notes list the patches in.
    shuffled = _notes(tmp_path, _notes_toml(list(reversed(DEMO))))
    assert upgrade.render(doc, {"demo": shuffled}) == text == upgrade.render(json.loads(json.dumps(doc)),
                                                                            {"demo": shuffled})
    # Without notes the table is as before: no column, no runbook.
    assert upgrade.render(doc) == (DATA / "UPGRADE.md").read_text()


def test_a_patch_without_a_judgement_fails_the_render_naming_it(tmp_path):
    doc = json.loads((DATA / "upgrade.json").read_text())
    missing = _notes(tmp_path, _notes_toml([p for p in DEMO if p != "scale-layer-5"]))
    with pytest.raises(ops.ForkError, match=r"demo/upgrade-notes\.toml: no judgement for scale-layer-5\. Every patch"
                                            r" of demo's series"):
        upgrade.render(doc, {"demo": missing})
    stale = _notes(tmp_path, _notes_toml([*DEMO, "a-patch-since-renamed"]))
    with pytest.raises(ops.ForkError, match=r"judgements for patches not in the series: a-patch-since-renamed"):
        upgrade.render(doc, {"demo": stale})
    for broken, says in ((_notes_toml(DEMO).replace('blocks = "judgement of seed-the-run"\n', ""),
                          r"\[patches\.seed-the-run\] needs blocks ="),
                         (_notes_toml(DEMO).replace("schema = 1", "schema = 2"), "schema 2, not 1"),
                         (_notes_toml(DEMO).replace("column =", "colum ="), r"write schema = 1, column =")):
        with pytest.raises(ops.ForkError, match=says):
            _notes(tmp_path, broken)


def test_render_only_reads_the_fork_s_notes_beside_its_series(project, capsys):
    (project.root / upgrade.JSON_PATH).write_text((DATA / "upgrade.json").read_text())
    notes = project.root / "third_party/patches/demo" / upgrade.NOTES
    notes.write_text(_notes_toml(DEMO[1:]))
    assert project.cli("upgrade-report", "--render-only") == 2
    assert "third_party/patches/demo/upgrade-notes.toml: no judgement for add-a-feature-flag" \
           in capsys.readouterr().err
    assert not (project.root / upgrade.REPORT_PATH).exists()
    notes.write_text(_notes_toml(DEMO))
    assert project.cli("upgrade-report", "--render-only") == 0
    assert "| 1 | add-a-feature-flag | clean | clean | clean | judgement of add-a-feature-flag |" \
           in (project.root / upgrade.REPORT_PATH).read_text()


# ---------------------------------------------------------------- this repository's verl report


def test_every_verl_patch_has_its_row_and_judgement_in_upgrade_md():
    """UPGRADE.md as committed: upgrade.json ran on today's series, every patch has its judgement, and
    `--render-only` reproduces the file byte for byte."""
    manifest = manifest_mod.load(ROOT)
    series = [name.removesuffix(".patch") for name in Series(ROOT / manifest.forks["verl"].patches).names()]
    notes = upgrade.load_notes(manifest)["verl"]
    assert set(notes.texts) == set(series), "third_party/patches/verl/upgrade-notes.toml: one entry per patch"
    doc = upgrade.load(ROOT)
    for target in doc["forks"]["verl"]["targets"]:
        assert [p["patch"].removesuffix(".patch") for p in target["patches"]] == series, \
            f"upgrade.json's {target['target']} ran on another series: run `python -m tools.forks upgrade-report verl`"
    text = upgrade.render(doc, upgrade.load_notes(manifest))
    assert text == (ROOT / upgrade.REPORT_PATH).read_text(), "run `python -m tools.forks upgrade-report --render-only`"
    for i, name in enumerate(series, 1):
        assert re.search(rf"^\| {i} \| {re.escape(name)} \|.* \| {re.escape(notes.texts[name])} \|$", text, re.M), name


def test_the_verl_runbook_quotes_the_rebase_report():
    rebase = (ROOT / "third_party/patches/verl/REBASE-v0.4.0-v0.6.1.md").read_text()
    time, sessions = re.search(r"^- time: (.+) over (\d+) session", rebase, re.M).groups()
    counts = dict((k, int(v)) for v, k in
                  ((m.group(2), m.group(1)) for m in re.finditer(r"(ported|reworked|dropped|added) (\d+)",
                                                                   rebase.splitlines()[4])))
    replayed = len(re.findall(r"^\| \d+ \| [a-z0-9-]+\.patch \| ", rebase, re.M))
    runbook = " ".join(upgrade.load_notes(manifest_mod.load(ROOT))["verl"].runbook.split())
    assert f"{time} of tool time over {sessions} sessions" in runbook
    assert f"{replayed} patches replayed from the port, 0 conflicts at the final run" in runbook
    assert ", ".join(f"{counts[k]} {k}" for k in ("ported", "reworked", "dropped", "added")) in runbook
