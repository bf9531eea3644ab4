"""sync (git, mirror, dist folder, local index), apply and its refusals, status."""

from __future__ import annotations

import functools
import http.server
import threading

from tests.forks.conftest import PATCHES, V1_FILES, commit, git, make_project, make_sdist, sha256
from tools.forks.series import Series


def test_status_before_sync_reports_absent_and_check_fails(project, capsys):
    assert project.cli("status") == 0
    out = capsys.readouterr().out
    assert "demo" in out and "absent" in out and "run sync" in out
    assert project.cli("status", "--check") == 1


def test_sync_git_checks_out_the_pin_and_apply_builds_the_branch(project, capsys):
    assert project.cli("sync", "demo", "--source", "git") == 0
    assert git(project.fork, "rev-parse", "HEAD") == project.upstream.v1
    assert git(project.fork, "config", "recipe.source") == "git"
    assert project.cli("apply", "demo") == 0
    assert git(project.fork, "symbolic-ref", "--short", "HEAD") == "recipe/demo"
    assert project.cli("status", "demo", "--check") == 0


def test_sync_git_through_an_insteadof_mirror(tmp_path, upstream, isolated_git):
    project = make_project(tmp_path, upstream, url="https://git.example.invalid/demo.git")
    with isolated_git.open("a") as cfg:
        cfg.write(f'[url "{upstream.bare}"]\n\tinsteadOf = https://git.example.invalid/demo.git\n')
    assert project.cli("sync", "demo", "--source", "git") == 0
    assert git(project.fork, "rev-parse", "HEAD") == upstream.v1


def test_sync_git_failure_names_url_and_fix(tmp_path, upstream, capsys):
    project = make_project(tmp_path, upstream, url=str(tmp_path / "missing.git"))
    assert project.cli("sync", "demo", "--source", "git") == 2
    err = capsys.readouterr().err
    assert "missing.git" in err and "insteadOf" in err and "--source pypi" in err


def test_sync_auto_falls_back_to_pypi(tmp_path, upstream, capsys):
    project = make_project(tmp_path, upstream, url=str(tmp_path / "missing.git"))
    assert project.cli("sync", "demo", "--find-links", str(project.dist)) == 0
    assert "synced from PyPI" in capsys.readouterr().out
    assert git(project.fork, "config", "recipe.source") == "pypi"


def test_sync_pypi_from_dist_folder_is_a_marked_tagged_deterministic_repo(tmp_path, upstream):
    trees, archives = [], set()
    for name in ("a", "b"):
        project = make_project(tmp_path / name, upstream)
        archives.add(sha256(project.dist / "demo-1.0.tar.gz"))
        assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 0
        log = git(project.fork, "log", "--format=%B", "-1")
        assert "PyPI-derived" in log and f"Not upstream commit {upstream.v1}" in log
        assert git(project.fork, "rev-parse", "v1") == git(project.fork, "rev-parse", "HEAD")
        for file, text in V1_FILES.items():
            assert (project.fork / file).read_text() == text
        trees.append(git(project.fork, "rev-parse", "HEAD"))
    assert len(archives) == 1, "the two projects must be given byte-identical distributions"
    assert trees[0] == trees[1], "same distribution must give the same base commit"


def test_sync_pypi_from_a_local_simple_index(tmp_path, upstream):
    project = make_project(tmp_path, upstream)
    index = tmp_path / "index"
    (index / "simple" / "demo").mkdir(parents=True)
    (index / "files").mkdir()
    sdist = project.dist / "demo-1.0.tar.gz"
    (index / "files" / sdist.name).write_bytes(sdist.read_bytes())
    (index / "simple" / "demo" / "index.html").write_text(
        f'<html><body><a href="../../files/{sdist.name}#sha256={sha256(sdist)}">{sdist.name}</a></body></html>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(index))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/simple"
        assert project.cli("sync", "demo", "--source", "pypi", "--index-url", url) == 0
    finally:
        server.shutdown()
    assert (project.fork / "util.py").read_text() == V1_FILES["util.py"]


def test_sync_pypi_refuses_a_file_with_another_hash(tmp_path, upstream, capsys):
    project = make_project(tmp_path, upstream)
    make_sdist(project.dist, files={**V1_FILES, "README.md": "tampered\n"})
    assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 2
    assert "sha256" in capsys.readouterr().err
    assert not (project.fork / ".git").exists()


def test_sync_pypi_reports_git_only_forks(project, capsys):
    assert project.cli("sync", "gitonly", "--source", "pypi") == 0
    assert "git-only" in capsys.readouterr().out


def test_sync_leaves_present_tree_and_force_refuses_local_work(project, capsys):
    assert project.cli("sync", "demo", "--source", "git") == 0
    assert project.cli("sync", "demo") == 0
    assert "already present" in capsys.readouterr().out
    assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 2
    assert "--force" in capsys.readouterr().err
    (project.fork / "app.py").write_text("local edit\n")
    assert project.cli("sync", "demo", "--force", "--source", "pypi", "--find-links", str(project.dist)) == 2
    assert "uncommitted" in capsys.readouterr().err
    assert (project.fork / "app.py").read_text() == "local edit\n"


def test_apply_replays_the_series_as_commits(with_series):
    p = with_series
    git(p.fork, "checkout", "-q", "--detach", p.upstream.v1)
    git(p.fork, "branch", "-q", "-D", "recipe/demo")
    assert p.cli("apply", "demo") == 0
    subjects = git(p.fork, "log", "--reverse", "--format=%s", f"{p.upstream.v1}..recipe/demo").splitlines()
    assert subjects == [s for s, _, _ in PATCHES]
    assert (p.fork / "feature.py").read_text() == "ENABLED = True\n"


def test_apply_twice_is_a_noop(with_series, capsys):
    p = with_series
    tip = git(p.fork, "rev-parse", "recipe/demo")
    reflog = git(p.fork, "reflog", "--all")
    assert p.cli("apply", "demo") == 0
    assert "up to date" in capsys.readouterr().out
    assert git(p.fork, "rev-parse", "recipe/demo") == tip
    assert git(p.fork, "reflog", "--all") == reflog, "a no-op apply moves no ref"


def test_apply_gives_the_same_commit_ids_everywhere(tmp_path, upstream):
    tips = []
    for name in ("a", "b"):
        p = make_project(tmp_path / name, upstream)
        from tests.forks.conftest import commit_series

        commit_series(p)
        git(p.fork, "checkout", "-q", "--detach", upstream.v1)
        git(p.fork, "branch", "-q", "-D", "recipe/demo")
        assert p.cli("apply", "demo") == 0
        tips.append(git(p.fork, "rev-parse", "recipe/demo"))
    assert tips[0] == tips[1]


def test_apply_refuses_uncommitted_work(with_series, capsys):
    (with_series.fork / "app.py").write_text("changed\n")
    assert with_series.cli("apply", "demo") == 2
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "app.py" in err and "export" in err
    assert (with_series.fork / "app.py").read_text() == "changed\n"


def test_apply_refuses_commits_not_in_the_series(with_series, capsys):
    p = with_series
    extra = commit(p.fork, {"new.py": "x = 1\n"}, "Local experiment", "Trying something.")
    assert p.cli("apply", "demo") == 2
    err = capsys.readouterr().err
    assert "Local experiment" in err and "tools.forks export demo" in err and "reset --hard" in err
    assert git(p.fork, "rev-parse", "recipe/demo") == extra
    assert p.cli("status", "--check", "demo") == 1
    assert "not exported" in capsys.readouterr().out


def test_apply_rebuilds_when_the_series_on_disk_changes(with_series):
    p = with_series
    names = Series(p.patches).names()
    (p.patches / "series").write_text("\n".join(names[:2]) + "\n")
    (p.patches / names[2]).unlink()
    assert p.cli("apply", "demo") == 0
    assert git(p.fork, "rev-list", "--count", f"{p.upstream.v1}..recipe/demo") == "2"
    assert (p.fork / "config.py").read_text() == V1_FILES["config.py"]


def test_apply_failure_names_the_patch_and_keeps_the_branch(with_series, capsys):
    p = with_series
    names = Series(p.patches).names()
    broken = p.patches / names[2]
    broken.write_text(broken.read_text().replace("-batch = 8", "-batch = 9"))
    tip = git(p.fork, "rev-parse", "recipe/demo")
    assert p.cli("apply", "demo") == 2
    err = capsys.readouterr().err
    assert names[2] in err and "does not apply" in err
    assert git(p.fork, "rev-parse", "recipe/demo") == tip
    assert not (p.fork / git(p.fork, "rev-parse", "--git-path", "rebase-apply")).exists()


def test_git_add_all_in_the_superproject_never_stages_an_applied_fork(with_series):
    p = with_series
    assert git(p.fork, "rev-parse", "HEAD") != p.upstream.v1
    (p.root / "notes.txt").write_text("unrelated work\n")
    git(p.root, "add", "-A")
    assert git(p.root, "ls-files", "--stage", "third_party/demo").split()[1] == p.upstream.v1
    assert "third_party/demo" not in git(p.root, "diff", "--cached", "--name-only")


def test_git_add_all_never_stages_a_pypi_tree(project):
    assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 0
    git(project.root, "add", "-A")
    assert git(project.root, "ls-files", "--stage", "third_party/demo").split()[1] == project.upstream.v1
