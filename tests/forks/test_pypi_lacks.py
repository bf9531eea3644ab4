"""forks.toml's pypi.lacks: the trees a fork's PyPI distribution lacks compared with its tag.

Parsed and checked by field name; `sync` names them when it lays the distribution out; `check` fails a patch of the
series that touches a path under them or imports them. The real sdist-to-tag difference is held to the list by
tests/forks/test_real_sources.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.forks.conftest import SENDABLE_TRAILERS, git
from tools.forks import manifest as manifest_mod
from tools.forks import ops
from tools.forks.series import SERIES_HEADER

ROOT = Path(__file__).resolve().parents[2]
LACKS = ["plugins/remote", "docs/guide.md"]


def _declare_lacks(project, lacks: str = '["plugins/remote", "docs/guide.md"]') -> None:
    toml = project.root / "third_party/forks.toml"
    text = toml.read_text()
    line = next(line for line in text.splitlines() if line.startswith("pypi = { requirement = \"demo==1.0\""))
    toml.write_text(text.replace(line, line.removesuffix(" }") + f", lacks = {lacks} }}"))


def test_the_real_verl_source_declares_what_its_sdist_lacks():
    verl = manifest_mod.load(ROOT).forks["verl"]
    assert verl.pypi.lacks == ("verl/experimental/reward/router", "verl/tools/utils/mcp_clients")
    assert manifest_mod.lacked(verl, "verl/tools/utils/mcp_clients/session.py") == "verl/tools/utils/mcp_clients"
    assert manifest_mod.lacked(verl, "verl/tools/utils/mcp_clients_other.py") is None
    assert manifest_mod.load(ROOT).forks["vllm"].pypi.lacks == ()


@pytest.mark.parametrize("lacks, message", [
    ('"plugins/remote"', "must be a list of paths"),
    ('["/plugins/remote"]', "not a plain relative path"),
    ('["plugins/../remote"]', "not a plain relative path"),
    ('["plugins/remote/"]', "not a plain relative path"),
    ('["plugins/remote", "plugins/remote"]', "listed twice"),
    ('["plugins", "plugins/remote"]', "lies under another entry"),
    ("[1]", "must be a list of paths"),
])
def test_a_bad_lacks_list_is_named(project, lacks, message):
    _declare_lacks(project, lacks)
    with pytest.raises(manifest_mod.ManifestError, match=rf"forks\.demo\.pypi\.lacks: .*{message}"):
        manifest_mod.load(project.root)


def test_an_unknown_pypi_key_is_named(project):
    toml = project.root / "third_party/forks.toml"
    toml.write_text(toml.read_text().replace('file = "demo-1.0.tar.gz"', 'file = "demo-1.0.tar.gz", lack = []'))
    with pytest.raises(manifest_mod.ManifestError, match=r"forks\.demo\.pypi: unknown key\(s\) lack"):
        manifest_mod.load(project.root)


def test_set_keys_writes_lacks_as_a_toml_array(tmp_path):
    import tomllib

    path = tmp_path / "forks.toml"
    path.write_text((ROOT / "third_party/forks.toml").read_text())
    pypi = {"requirement": "verl==0.7.0", "file": "verl-0.7.0.tar.gz", "sha256": "ab" * 32, "lacks": ["a/b", "c"]}
    manifest_mod.set_keys(path, "verl", {"pypi": pypi})
    assert tomllib.loads(path.read_text())["forks"]["verl"]["pypi"] == pypi


def test_sync_from_pypi_names_what_the_distribution_lacks(project, capsys):
    _declare_lacks(project)
    assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 0
    out = capsys.readouterr().out
    assert "demo: synced from PyPI (demo-1.0.tar.gz)" in out
    assert "demo-1.0.tar.gz lacks, compared with v1: plugins/remote, docs/guide.md" in out
    assert "demo-1.0.tar.gz lacks, compared with v1: plugins/remote, docs/guide.md" in git(project.fork, "log", "-1",
                                                                                          "--format=%B")
    assert project.cli("sync", "demo", "--find-links", str(project.dist)) == 0
    out = capsys.readouterr().out
    assert "already present (pypi)" in out and "lacks, compared with v1" in out, "a present PyPI tree says it too"


def test_sync_from_git_says_nothing_of_lacks(project, capsys):
    _declare_lacks(project)
    assert project.cli("sync", "demo", "--source", "git") == 0
    assert "lacks" not in capsys.readouterr().out


def _patch(subject: str, diff: str) -> str:
    return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: Test User <test@example.invalid>\nDate: Wed, 1 Jan 2025 00:00:00 +0000\n"
            f"Subject: {subject}\n\nThe recipe needs it.\n\n{SENDABLE_TRAILERS}\n---\n{diff}")


def _edit(path: str, old: str, new: str) -> str:
    return (f"diff --git a/{path} b/{path}\nindex 1111111..2222222 100644\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -1 +1 @@\n-{old}\n+{new}\n")


def _new(path: str, line: str) -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..2222222\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1 @@\n+{line}\n")


def _rename(old: str, new: str) -> str:
    return f"diff --git a/{old} b/{new}\nsimilarity index 100%\nrename from {old}\nrename to {new}\n"


def _series(project, patches: dict[str, str]) -> None:
    for name, text in patches.items():
        (project.patches / name).write_text(text)
    (project.patches / "series").write_text(SERIES_HEADER + "".join(f"{name}\n" for name in patches))


CLEAN = {"flag.patch": _patch("Add a flag", _edit("app.py", "x = 1", "x = 2")),
         "plugin.patch": _patch("Add a local plugin", _new("plugins/local/a.py", "from plugins.remote_ok import x"))}


def test_check_passes_a_series_that_keeps_off_the_lacked_trees(project, capsys):
    _declare_lacks(project)
    _series(project, CLEAN)
    assert project.cli("check", "demo") == 0, capsys.readouterr().out
    assert "demo: ok, 2 patches (lint only (source absent))" in capsys.readouterr().out


@pytest.mark.parametrize("diff, said", [
    (_edit("plugins/remote/client.py", "x = 1", "x = 2"), "touches plugins/remote/client.py, under plugins/remote"),
    (_new("plugins/remote/new.py", "x = 1"), "touches plugins/remote/new.py, under plugins/remote"),
    (_edit("docs/guide.md", "a", "b"), "touches docs/guide.md, under docs/guide.md"),
    (_rename("plugins/remote/a.py", "plugins/moved.py"), "touches plugins/remote/a.py, under plugins/remote"),
    (_new("app_remote.py", "from plugins.remote.client import connect"),
     "adds 'from plugins.remote.client import connect', which needs plugins/remote"),
])
def test_check_fails_a_patch_that_needs_a_lacked_tree_naming_patch_and_path(project, capsys, diff, said):
    _declare_lacks(project)
    _series(project, {**CLEAN, "remote.patch": _patch("Reach the remote plugin", diff)})
    assert project.cli("check", "demo") == 1
    out = capsys.readouterr().out
    assert f"{project.patches / 'remote.patch'}: {said}, which demo-1.0.tar.gz lacks (forks.demo.pypi.lacks)" in out
    assert "flag.patch" not in out and "plugin.patch" not in out


def test_without_lacks_the_same_series_passes(project):
    _series(project, {**CLEAN, "remote.patch": _patch("Reach the remote plugin",
                                                      _edit("plugins/remote/client.py", "x = 1", "x = 2"))})
    assert project.cli("check", "demo") == 0


def test_patch_paths_reads_diff_headers_renames_and_deletions():
    text = (_edit("a/x.py", "1", "2") + _rename("old/y.py", "new/y.py")
            + "diff --git a/gone.py b/gone.py\ndeleted file mode 100644\n--- a/gone.py\n+++ /dev/null\n")
    assert ops.patch_paths(text) == {"a/x.py", "old/y.py", "new/y.py", "gone.py"}


def test_no_real_series_needs_a_lacked_tree():
    m = manifest_mod.load(ROOT)
    from tools.forks.series import Series

    for fork in m.forks.values():
        assert ops.lacks_problems(fork, Series(ROOT / fork.patches).paths()) == [], fork.name


def test_no_test_of_ours_imports_a_lacked_tree():
    """Our own tests run against the tree CI syncs from PyPI, so none may import what it lacks."""
    m = manifest_mod.load(ROOT)
    modules = {t.replace("/", "."): f.name for f in m.forks.values() if f.pypi for t in f.pypi.lacks
               if "." not in t.rsplit("/", 1)[-1]}
    assert modules, "verl declares two lacked Python trees"
    here = Path(__file__).resolve()
    hits = [f"{path.relative_to(ROOT)}: {module} ({fork})" for path in sorted((ROOT / "tests").rglob("*.py"))
            if path != here for module, fork in modules.items() if module in path.read_text(encoding="utf-8")]
    assert hits == []
