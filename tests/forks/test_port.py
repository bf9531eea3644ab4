"""A port across sessions and machines: rebase writes each patch that gets through into a committable port
directory, picks the port up elsewhere, drops patches with a why, remembers resolutions (rerere), says where
it stands, and check lints the port.

The seven-patch series and upstream v2 of the dry-run tests: onto v2 the feature flag applies clean, the typo
fix is upstream, the layer patch needs a 3-way merge (its context moved, its change did not), the batch patch
conflicts, the learning-rate patch (whose context is our batch line) conflicts after it, the seed patch applies
clean and the README patch is emptied (upstream has its change inside a larger commit).
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from tests.forks.conftest import commit_series, git, make_project
from tests.forks.test_rebase_dry_run import CONFIG, SERIES, V1, _edit, _upstream
from tools.forks import git as git_mod
from tools.forks import manifest as manifest_mod
from tools.forks import port as port_mod

FLAG, TYPO, LAYER, BATCH, LR, SEED, README = (
    "add-a-feature-flag", "fix-typo-in-helper", "scale-layer-5", "raise-the-default-batch",
    "lower-the-learning-rate", "seed-the-run", "exclaim-in-the-readme")
BATCH_64 = _edit(CONFIG, batch="64")
BATCH_64_LR = _edit(CONFIG, batch="64", lr="0.05")


@pytest.fixture
def proj(tmp_path):
    project = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(project, SERIES)
    return project


def _port_dir(p) -> Path:
    return p.root / "third_party/patches/ports/demo-v2"


def _toml(p) -> dict:
    return tomllib.loads((_port_dir(p) / "port.toml").read_text())


def _verdicts(p) -> dict[str, str]:
    return {t["name"]: t["verdict"] for t in _toml(p)["patch"]}


def _resolve(p, text: str) -> None:
    (p.fork / "config.py").write_text(text)
    git(p.fork, "add", "config.py")


def test_each_patch_that_gets_through_is_in_the_port_at_once(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    out = capsys.readouterr().out
    for line in (f"[1/7] {FLAG}: clean", f"[2/7] {TYPO}: dropped (already upstream as", f"[3/7] {LAYER}: 3-way",
                 f"[4/7] {BATCH}: conflict"):
        assert line in out
    data = _toml(p)
    assert (data["fork"], data["from_ref"], data["from"], data["to_ref"], data["to"]) == (
        "demo", "v1", p.upstream.v1, "v2", p.upstream.v2)
    assert [t["name"] for t in data["patch"]] == [FLAG, TYPO, LAYER, BATCH, LR, SEED, README], "old series order"
    assert _verdicts(p) == {FLAG: "ported", TYPO: "dropped", LAYER: "ported", BATCH: "pending", LR: "pending",
                            SEED: "pending", README: "pending"}, "a 3-way merge that moved only context is ported"
    typo_why = data["patch"][1]["why"]
    assert typo_why.startswith("already upstream as ") and typo_why.endswith("(Fix typo in helper)")
    # Each ported patch is what `export` writes for its commit on the scratch branch: same bytes.
    scratch = git(p.fork, "rev-list", "--reverse", f"{p.upstream.v2}..HEAD").split()
    for name, sha in zip((FLAG, LAYER), scratch, strict=True):
        assert (_port_dir(p) / f"{name}.patch").read_text() == git_mod.format_patch(p.fork, sha)
    assert (_port_dir(p) / "series").read_text().splitlines()[1:] == [f"{FLAG}.patch", f"{LAYER}.patch"]
    assert not (_port_dir(p) / f"{TYPO}.patch").exists()
    session = data["session"][0]
    assert session["started"].endswith("Z") and session["elapsed"] >= 0 and session["patches"] == 3


def test_a_port_survives_the_machine_and_finishes_elsewhere(proj, tmp_path, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    _resolve(p, BATCH_64)
    assert p.cli("rebase", "demo", "--continue", "--why", "v2 raised the batch to 32; we go to 64") == 3  # LR
    assert _verdicts(p)[BATCH] == "reworked"
    assert "+batch = 64" in (_port_dir(p) / f"{BATCH}.patch").read_text()

    # The machine is lost; what was committed (the port directory) is all the next one gets.
    other = make_project(tmp_path / "elsewhere", p.upstream)
    commit_series(other, SERIES)
    shutil.copytree(_port_dir(p), _port_dir(other))
    capsys.readouterr()
    assert other.cli("rebase", "demo", "--onto", "v2") == 3
    out = capsys.readouterr().out
    assert f"[1/7] {FLAG}: clean, ported (from the port)" in out
    assert f"[2/7] {TYPO}: dropped" in out
    assert f"[4/7] {BATCH}: clean, reworked (from the port)" in out, "the resolution came with the port"
    assert f"[5/7] {LR}: conflict" in out
    _resolve(other, BATCH_64_LR)
    assert other.cli("rebase", "demo", "--continue", "--why", "context is our batch 64 now") == 0
    out = capsys.readouterr().out
    assert f"[6/7] {SEED}: clean" in out and f"[7/7] {README}: 3-way -> dropped (emptied by the replay)" in out
    assert f"[5/7] {LR}: resolved, ported" in out, "its changed lines are the old ones; only context moved"
    assert "kept 5, dropped 2, changed 1" in out

    report = (other.patches / "REBASE-v1-v2.md").read_text()
    assert f"| 7 | {README}.patch | dropped | emptied by the replay: upstream's tree already has its change to" \
           " README.md |" in report
    assert f"| 5 | {LR}.patch | ported | context is our batch 64 now |" in report
    assert "over 2 session(s)" in report
    assert not _port_dir(other).exists()
    manifest = tomllib.loads((other.root / "third_party/forks.toml").read_text())["forks"]["demo"]
    assert (manifest["ref"], manifest["commit"]) == ("v2", p.upstream.v2)
    assert other.cli("check", "demo") == 0 and other.cli("status", "--check", "demo") == 0


def test_the_series_is_written_from_the_port(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2", "--drop", BATCH, "--why", "v2's batch 32 is enough") == 3
    carried = {name: (_port_dir(p) / f"{name}.patch").read_bytes() for name in (FLAG, LAYER)}
    assert p.cli("rebase", "demo", "--drop", LR, "--obsolete", "--why", "the lr followed our batch") == 0
    assert sorted(f.name for f in p.patches.glob("*.patch")) == [f"{n}.patch" for n in sorted((FLAG, LAYER, SEED))]
    for name, text in carried.items():
        assert (p.patches / f"{name}.patch").read_bytes() == text


def test_the_new_pins_pypi_source_is_written_at_the_finish(proj, capsys):
    """A [pypi] table in port.toml is the new pin's distribution: the finish writes it into forks.toml, so the
    commit that moves the pin also moves the fallback source."""
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2", "--drop", BATCH, "--why", "v2's batch 32 is enough") == 3
    port_toml = _port_dir(p) / "port.toml"
    text = port_toml.read_text()
    port_toml.write_text(text.replace("\n[[patch]]", '\n[pypi]\nrequirement = "demo==2.0"\nfile = "demo-2.0.tar.gz"\n'
                                      f'sha256 = "{"ab" * 32}"\nnote = "no docs"\nlacks = ["docs"]\n\n[[patch]]', 1))
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--drop", LR, "--obsolete", "--why", "the lr followed our batch") == 0
    assert "note:" not in capsys.readouterr().out
    pypi = tomllib.loads((p.root / "third_party/forks.toml").read_text())["forks"]["demo"]["pypi"]
    assert pypi == {"requirement": "demo==2.0", "file": "demo-2.0.tar.gz", "sha256": "ab" * 32, "note": "no docs",
                    "lacks": ["docs"]}
    assert manifest_mod.load(p.root).forks["demo"].pypi.lacks == ("docs",)


def test_a_patch_the_new_base_needs_is_added_to_the_port(proj, capsys):
    """A fix only the new base needs has no patch in the old series: verdict `added`, placed after the entry it
    follows, carried by every replay and written into the new series at the finish."""
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    git(p.fork, "checkout", "-q", "--detach", p.upstream.v2)
    for name in (FLAG, LAYER):
        git(p.fork, "am", "-q", str(_port_dir(p) / f"{name}.patch"))
    (p.fork / "extra.py").write_text("EXTRA = 2\n")
    git(p.fork, "add", "extra.py")
    git(p.fork, "commit", "-q", "-m", "Add an extra module\n\nv2 needs it.\n\nReason: v2\nUpstream-Status: Pending\n"
        "Signed-off-by: Dev <dev@example.invalid>")
    extra = "add-an-extra-module"
    (_port_dir(p) / f"{extra}.patch").write_text(git_mod.format_patch(p.fork, "HEAD"))
    git(p.fork, "checkout", "-q", "-")
    port_toml = _port_dir(p) / "port.toml"
    at = port_toml.read_text().index(f'name = "{BATCH}"')
    entry = f'name = "{extra}"\nverdict = "added"\nwhy = "v2 needs it"\n\n[[patch]]\n'
    port_toml.write_text(port_toml.read_text()[:at] + entry + port_toml.read_text()[at:])
    series = _port_dir(p) / "series"
    series.write_text(series.read_text() + f"{extra}.patch\n")
    assert p.cli("check", "demo") == 0, "the added patch is linted and replayed with the port"
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--onto", "v2", "--drop", BATCH, "--why", "v2's batch 32 is enough") == 3
    assert f"[4/8] {extra}: clean, added (from the port)" in capsys.readouterr().out
    assert p.cli("rebase", "demo", "--drop", LR, "--obsolete", "--why", "the lr followed our batch") == 0
    assert "kept 3, dropped 4, changed 0, added 1" in capsys.readouterr().out
    assert (p.patches / "series").read_text().splitlines()[-2:] == [f"{extra}.patch", f"{SEED}.patch"]
    report = (p.patches / "REBASE-v1-v2.md").read_text()
    assert f"| 4 | {extra}.patch | added | v2 needs it |" in report
    assert "- kept: 3, dropped: 4, changed: 0, added: 1 (" in report, "the report counts as the summary does"


def test_a_bad_pypi_table_is_named(proj, tmp_path):
    port_dir = tmp_path / "port"
    port_dir.mkdir()
    sha = "0" * 40
    top = f'fork = "demo"\nfrom_ref = "v1"\nfrom = "{sha}"\nto_ref = "v2"\nto = "{sha}"\n'
    (port_dir / "port.toml").write_text(top + '[pypi]\nrequirement = "demo-2.0"\nfile = "f"\nsha256 = "x"\n')
    with pytest.raises(port_mod.PortError, match=r"pypi needs requirement = \"name==version\""):
        port_mod.load(port_dir)
    (port_dir / "port.toml").write_text(top + '[pypi]\nrequirement = "demo==2.0"\nfiel = "f"\n')
    with pytest.raises(port_mod.PortError, match=r"pypi\.fiel: unknown key"):
        port_mod.load(port_dir)
    pypi = f'[pypi]\nrequirement = "demo==2.0"\nfile = "f"\nsha256 = "{"ab" * 32}"\n'
    (port_dir / "port.toml").write_text(top + pypi + 'lacks = ["/docs"]\n')
    with pytest.raises(port_mod.PortError, match=r"pypi\.lacks: '/docs' is not a plain relative path"):
        port_mod.load(port_dir)
    (port_dir / "port.toml").write_text(top + pypi + 'lacks = ["docs", "src/gen"]\n')
    port = port_mod.load(port_dir)
    assert port.pypi["lacks"] == ["docs", "src/gen"]
    port_mod.save(port)
    assert port_mod.load(port_dir).pypi == port.pypi, "save writes lacks as a TOML array"


def test_drop_the_stopped_patch_a_later_one_or_one_up_front(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2", "--drop", LR, "--obsolete", "--why", "lr follows the batch") == 3
    assert _verdicts(p)[LR] == "obsolete"
    assert p.cli("rebase", "demo", "--drop", FLAG, "--why", "x") == 2
    assert f"{FLAG} is ported and already replayed" in capsys.readouterr().err
    assert p.cli("rebase", "demo", "--drop", README, "--why", "upstream's README says it") == 0
    assert "recorded; still stopped at raise-the-default-batch" in capsys.readouterr().out
    assert p.cli("rebase", "demo", "--drop", BATCH) == 2
    assert "needs --why" in capsys.readouterr().err
    assert p.cli("rebase", "demo", "--drop", BATCH, "--why", "config.py: v2 sets batch = 32 (commit Default"
                 " batch 32)") == 0
    out = capsys.readouterr().out
    assert f"[4/7] {BATCH}: dropped" in out and f"[5/7] {LR}: obsolete" in out and "kept 3, dropped 4" in out
    report = (p.patches / "REBASE-v1-v2.md").read_text()
    assert f"| {BATCH}.patch | dropped | config.py: v2 sets batch = 32 (commit Default batch 32) |" in report
    assert f"| {LR}.patch | obsolete | lr follows the batch |" in report
    assert f"| {README}.patch | dropped | upstream's README says it |" in report


def test_a_reworked_patch_needs_its_why_before_the_rebase_finishes(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2", "--drop", LR, "--obsolete", "--why", "lr follows the batch") == 3
    _resolve(p, BATCH_64)
    assert p.cli("rebase", "demo", "--continue") == 3
    assert f"have no why yet: {BATCH}" in capsys.readouterr().err
    assert _toml(p)["patch"][3]["why"] == port_mod.PLACEHOLDER
    assert p.cli("check", "demo") == 1
    assert f"{BATCH}: verdict reworked has no why yet" in capsys.readouterr().out
    assert p.cli("rebase", "demo", "--status") == 0
    assert f"whys missing: {BATCH}" in capsys.readouterr().out
    path = _port_dir(p) / "port.toml"
    path.write_text(path.read_text().replace(port_mod.PLACEHOLDER, "batch 64 over v2's 32"))  # by hand
    assert p.cli("rebase", "demo", "--continue") == 0
    assert f"| {BATCH}.patch | reworked | batch 64 over v2's 32 |" in (p.patches / "REBASE-v1-v2.md").read_text()


def test_rerere_replays_a_resolution_after_abort_and_keeps_it_in_the_fork(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert git(p.fork, "config", "--local", "rerere.enabled") == "true"
    assert git(p.fork, "config", "--local", "rerere.autoupdate") == "true"
    (p.fork / "config.py").write_text(BATCH_64)  # resolved, not even added
    assert p.cli("rebase", "demo", "--abort") == 0
    assert "the port third_party/patches/ports/demo-v2 keeps 3 verdicts" in capsys.readouterr().out
    assert git(p.fork, "rev-parse", "--abbrev-ref", "HEAD") == "recipe/demo"

    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    err = capsys.readouterr().err
    assert "rerere replayed the resolution" in err
    assert (p.fork / "config.py").read_text() == BATCH_64 and git(p.fork, "diff", "--cached", "--name-only") == \
        "config.py"
    assert p.cli("rebase", "demo", "--continue", "--why", "batch 64") == 3  # on to the LR conflict
    assert "+batch = 64" in (_port_dir(p) / f"{BATCH}.patch").read_text()
    # rerere's records (upstream's lines among them) stay in the fork's git dir, out of the superproject.
    assert (Path(git(p.fork, "rev-parse", "--absolute-git-dir")) / "rr-cache").is_dir()
    assert "rr-cache" not in git(p.root, "status", "--porcelain", "--untracked-files=all")
    assert not list(_port_dir(p).rglob("*rr-cache*"))


def test_status_tells_where_the_port_stands(proj, capsys, monkeypatch):
    for name in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)  # the plain table, whether rich is installed or not
    p = proj
    assert p.cli("rebase", "demo", "--status") == 2
    assert "0 ports (none); name one with --onto REF" in capsys.readouterr().err
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--status") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:7]}
    assert rows == {"pending": "4", "ported": "2", "reworked": "0", "dropped": "1", "obsolete": "0"}
    assert f"stopped at [4/7] {BATCH}; conflicted: config.py" in out
    assert f"left: 4 pending, next {BATCH}" in out
    assert p.cli("rebase", "demo", "--abort") == 0
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--status") == 0
    out = capsys.readouterr().out
    assert "no replay under way here; `python -m tools.forks rebase demo --onto v2`" in out
    assert "over 1 session(s)" in out


def test_a_port_follows_the_running_series(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    # Meanwhile main's series lost the typo fix (upstream has it) while the port still lists it.
    names = (p.patches / "series").read_text().replace(f"{TYPO}.patch\n", "")
    (p.patches / "series").write_text(names)
    (p.patches / f"{TYPO}.patch").unlink()
    assert p.cli("apply", "demo") == 0
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--onto", "v2") == 2
    assert f"{TYPO} no longer in the demo series; restore them there, or delete their [[patch]]" in \
        capsys.readouterr().err
    # Deleting its [[patch]] table by hand lets the port go on.
    data = (_port_dir(p) / "port.toml").read_text().split("\n\n")
    (_port_dir(p) / "port.toml").write_text("\n\n".join(t for t in data if f'"{TYPO}"' not in t))
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert f"[3/6] {BATCH}: conflict" in capsys.readouterr().out


def test_a_carried_patch_that_no_longer_applies_stops_like_a_conflict(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    flag = _port_dir(p) / f"{FLAG}.patch"
    flag.write_text(flag.read_text().replace("-    print('hello')", "-    print('bonjour')"))  # broken by hand
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert f"git am could not apply {FLAG}.patch (the port's copy)" in capsys.readouterr().err
    subject, files, _body = SERIES[0]
    for name, text in files.items():  # applied by hand, as the message says
        (p.fork / name).write_text(text)
    git(p.fork, "add", *files)
    assert p.cli("rebase", "demo", "--continue") == 3  # on to the batch conflict
    assert _verdicts(p)[FLAG] == "ported", "the same change as the old series' patch"
    assert "-    print('hello')" in flag.read_text()


def test_a_carried_patch_applied_by_a_3way_merge_is_written_anew(proj, capsys):
    """A patch reworked after later ones were carried moves their context; the replay still merges them, and the
    port then keeps the copy that applies as it stands, so that `check` can replay the port."""
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    layer = _port_dir(p) / f"{LAYER}.patch"
    layer.write_text((p.patches / f"{LAYER}.patch").read_text())  # the old series' copy: v1's context
    assert p.cli("check", "demo") == 1, "the stale copy does not apply onto v2 as it stands"
    capsys.readouterr()
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert f"[3/7] {LAYER}: 3-way, ported (from the port)" in capsys.readouterr().out
    scratch = git(p.fork, "rev-list", "--reverse", f"{p.upstream.v2}..HEAD").split()
    assert layer.read_text() == git_mod.format_patch(p.fork, scratch[1])
    assert p.cli("rebase", "demo", "--abort") == 0
    assert p.cli("check", "demo") == 0


def test_port_toml_is_checked_on_read(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    path = _port_dir(p) / "port.toml"
    good = path.read_text()
    breaks = {
        'verdict = "ported"': ('verdict = "done"', "patch[0] (add-a-feature-flag).verdict: 'done' is not one of"),
        f'from = "{p.upstream.v1}"': ('from = "abc"', "from = 'abc' is not a 40-hex commit id"),
        'fork = "demo"\n': ("", "fork: missing or not a string"),
        f'name = "{FLAG}"': (f'name = "{FLAG}.patch"', "patch[0].name: 'add-a-feature-flag.patch' must be the old"),
        'verdict = "dropped"\nwhy =': ('verdict = "dropped"\nwho =', "patch[1]: who: unknown key(s)"),
    }
    for old, (new, message) in breaks.items():
        assert old in good, old
        path.write_text(good.replace(old, new, 1))
        assert p.cli("rebase", "demo", "--onto", "v2") == 2
        assert message in capsys.readouterr().err
        assert p.cli("check", "demo") == 1
        assert message in capsys.readouterr().out
    path.write_text(good.replace('verdict = "ported"', 'verdict = "dropped"', 1))
    assert p.cli("check", "demo") == 1
    assert "patch[0] (add-a-feature-flag).why: required for verdict dropped; name upstream's equivalent" in \
        capsys.readouterr().out


def test_check_lints_every_port_and_replays_it_onto_to(proj, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    capsys.readouterr()
    assert p.cli("check", "demo") == 0
    assert "port third_party/patches/ports/demo-v2: ok (lint + the port's patches apply onto v2)" in \
        capsys.readouterr().out
    assert p.cli("export", "--check", "demo") == 0, "the port's patches are not the series"

    layer = _port_dir(p) / f"{LAYER}.patch"
    text = layer.read_text()
    layer.write_text(text.replace("-layer_5 = 5", "-layer_5 = 6"))
    assert p.cli("check", "demo") == 1
    assert f"{LAYER}.patch: does not apply onto v2 after the port's patches before it" in capsys.readouterr().out
    layer.unlink()
    (_port_dir(p) / "stray.patch").write_text(text)
    assert p.cli("check", "demo") == 1
    out = capsys.readouterr().out
    assert f"{LAYER}.patch: missing; verdict ported needs the ported patch" in out
    assert "stray.patch: no [[patch]] with verdict ported, reworked or added names it" in out
    (_port_dir(p) / "stray.patch").rename(_port_dir(p) / f"{LAYER}.patch")
    (_port_dir(p) / "series").write_text(f"{FLAG}.patch\n{LAYER}.patch\n")  # a plain list does
    assert p.cli("check", "demo") == 0
    capsys.readouterr()
    (_port_dir(p) / "series").write_text(f"{LAYER}.patch\n{FLAG}.patch\n")
    assert p.cli("check", "demo") == 1
    assert (f"series: lists ['{LAYER}.patch', '{FLAG}.patch'], but the ported, reworked and added patches are"
            f" ['{FLAG}.patch', '{LAYER}.patch'] in this order") in capsys.readouterr().out


def test_check_of_a_port_without_the_to_commit_lints_only(proj, tmp_path, capsys):
    p = proj
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    pypi = make_project(tmp_path / "pypi", p.upstream, files=V1)
    assert pypi.cli("sync", "demo", "--source", "pypi", "--find-links", str(pypi.dist)) == 0
    shutil.copytree(_port_dir(p), _port_dir(pypi))
    capsys.readouterr()
    # On a PyPI tree check lays out the release v2 names (demo==2) to replay onto; there is none.
    assert pypi.cli("check", "demo", "--find-links", str(pypi.dist), "--index-url", "http://127.0.0.1:9/simple") == 0
    assert "ok (lint only: v2 (" in capsys.readouterr().out
    shutil.rmtree(pypi.fork)
    assert pypi.cli("check", "demo") == 0
    assert "ok (lint only (source absent))" in capsys.readouterr().out


def test_port_toml_round_trips_any_why(tmp_path):
    port = port_mod.Port(tmp_path / "demo-v2", "demo", "v1", "a" * 40, "v2", "b" * 40, [
        port_mod.Entry("one", "dropped", 'upstream "does" it\\ in a.py:f\n(PR #7)\ttab \x7f é'),
        port_mod.Entry("two")], [port_mod.Session("2026-12-04T22:30:00Z", 61, 2)])
    port_mod.save(port)
    assert port_mod.load(port.dir) == port


def test_a_to_that_is_no_upstream_commit_says_what_it_is(tmp_path):
    """A fork with only PyPI sources ports onto the sdist's derived commit; `to_note` says so and survives."""
    port = port_mod.Port(tmp_path / "demo-v2", "demo", "v1", "a" * 40, "demo==2", "b" * 40, [port_mod.Entry("one")],
                         to_note="the PyPI-derived commit of demo-2.tar.gz")
    port_mod.save(port)
    assert port_mod.load(port.dir) == port
    text = (port.dir / "port.toml").read_text(encoding="utf-8")
    (port.dir / "port.toml").write_text(text.replace("to_note = ", "to_notes = "), encoding="utf-8")
    with pytest.raises(port_mod.PortError, match="to_notes: unknown key"):
        port_mod.load(port.dir)


@pytest.mark.parametrize(("old", "new", "same"), [
    ("@@ -1,3 +1,3 @@\n a\n-b\n+c\n d\n", "@@ -10,3 +10,3 @@\n x\n-b\n+c\n y\n", True),  # context moved
    ("@@ -1,3 +1,3 @@\n a\n-b\n+c\n d\n", "@@ -1,3 +1,3 @@\n a\n-b\n+C\n d\n", False),
    ("@@ -1 +1 @@\n-b\n+c\n", "@@ -1 +1 @@\n-b\n+c\n\\ No newline at end of file\n", False),
    ("@@ -1,2 +1,2 @@\n--- x\n+++ y\n z\n", "@@ -1,2 +1,2 @@\n--- x\n+++ w\n z\n", False),  # lines like headers
])
def test_changed_lines_ignore_context_and_line_numbers(old, new, same):
    head = "Subject: x\n\n---\ndiff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n"
    assert (git_mod.changed_lines(head + old) == git_mod.changed_lines(head + new)) is same
