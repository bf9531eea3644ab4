"""Topic headers in `series`: parsed by every reader, kept by export (and so by rebase), checked by lint."""

from __future__ import annotations

from pathlib import Path

from tests.forks.conftest import PATCHES, commit, git
from tools.forks.series import SERIES_HEADER, Series, arrange, format_layout, parse_layout

A, B, C = "add-a-feature-flag.patch", "fix-typo-in-helper.patch", "raise-the-default-batch.patch"
TOPICS = (SERIES_HEADER
          + f"\n# == Features ==\n# what the recipe switches on\n{A}\n"
          + f"\n# == Fixes ==\n{B}\n"
          + f"\n# == Defaults ==\n{C}\n")


def _with_topics(p) -> None:
    (p.patches / "series").write_text(TOPICS)


def _snapshot(directory):
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


def test_parse_groups_patches_under_their_headers_and_never_reads_a_comment_as_a_patch():
    text = (SERIES_HEADER + "\n# == CPU ==\n# runs on hosts\n# without CUDA\na.patch\nb.patch\n"
            "\n# == NPU ==\nc.patch\n\n# == CPU ==\nd.patch\n")
    layout = parse_layout(text)
    assert layout.names == ["a.patch", "b.patch", "c.patch", "d.patch"]
    assert [(g.topic, g.patches) for g in layout.groups] == [
        ("CPU", ("a.patch", "b.patch")), ("NPU", ("c.patch",)), ("CPU", ("d.patch",))]
    assert layout.groups[0].why == "runs on hosts without CUDA"
    assert layout.lost == ()
    assert format_layout(layout) == text, "export writes back exactly what it parsed"


def test_parse_reports_what_export_would_drop_with_its_line():
    text = SERIES_HEADER + "a.patch\n# a stray note\nb.patch  # inline\n\n# == Empty ==\n\n# == Kept ==\nc.patch\n"
    layout = parse_layout(text)
    assert layout.names == ["a.patch", "b.patch", "c.patch"]
    assert [problem.split(";")[0] for problem in layout.lost] == [
        "line 3: comment '# a stray note' is not under a `# == topic ==` header",
        "line 4: comment after 'b.patch'",
        "line 6: topic '# == Empty ==' has no patches",
    ]


def test_arrange_moves_a_header_to_its_first_surviving_patch_and_drops_an_emptied_one():
    old = parse_layout(SERIES_HEADER + "\n# == X ==\nx1.patch\nx2.patch\n\n# == Y ==\ny1.patch\n"
                       "\n# == Z ==\nz1.patch\n")
    new = arrange(old, ["new-first.patch", "x2.patch", "new-after-x2.patch", "z1.patch", "y1.patch"])
    assert [(g.topic, g.patches) for g in new.groups] == [
        ("", ("new-first.patch",)), ("X", ("x2.patch", "new-after-x2.patch")), ("Z", ("z1.patch",)),
        ("Y", ("y1.patch",))], "a header follows its patch, wherever the new order puts it"
    assert arrange(old, ["x1.patch", "z1.patch"]).groups[-1].topic == "Z"
    assert "Y" not in [g.topic for g in arrange(old, ["x1.patch", "z1.patch"]).groups]


def test_export_keeps_headers_with_a_changed_an_added_and_a_removed_patch(with_series):
    p = with_series
    _with_topics(p)
    git(p.fork, "reset", "-q", "--hard", p.upstream.v1)
    subject, files, body = PATCHES[0]
    commit(p.fork, {**files, "feature.py": "ENABLED = False\n"}, subject, body)  # A, changed
    commit(p.fork, PATCHES[2][1], PATCHES[2][0], PATCHES[2][2])  # C; B (the only Fixes patch) is gone
    commit(p.fork, {"extra.py": "y = 2\n"}, "Add extra module", "Needed by the launcher.")  # new, after C
    before = (p.patches / A).read_text()
    assert p.cli("export", "demo") == 0
    assert (p.patches / "series").read_text() == (
        SERIES_HEADER
        + f"\n# == Features ==\n# what the recipe switches on\n{A}\n"
        + f"\n# == Defaults ==\n{C}\nadd-extra-module.patch\n")
    assert (p.patches / A).read_text() != before and "+ENABLED = False" in (p.patches / A).read_text()
    assert not (p.patches / B).exists()


def test_re_exporting_with_headers_changes_no_byte(with_series):
    p = with_series
    _with_topics(p)
    before = _snapshot(p.patches)
    assert p.cli("export", "--check", "demo") == 0, "headers alone are no difference from the branch"
    assert p.cli("export", "demo") == 0
    assert _snapshot(p.patches) == before
    assert p.cli("export", "demo") == 0
    assert _snapshot(p.patches) == before


def test_apply_check_and_status_read_past_the_headers(with_series, capsys):
    p = with_series
    _with_topics(p)
    assert p.cli("apply", "demo") == 0
    assert "up to date (3 patches)" in capsys.readouterr().out, "editing headers only does not force a rebuild"
    git(p.fork, "checkout", "-q", "--detach", p.upstream.v1)
    git(p.fork, "branch", "-q", "-D", "recipe/demo")
    assert p.cli("apply", "demo") == 0
    assert "applied 3 patches" in capsys.readouterr().out
    assert git(p.fork, "log", "--format=%s", f"{p.upstream.v1}..recipe/demo").splitlines() == [
        subject for subject, _, _ in reversed(PATCHES)]
    assert p.cli("check", "demo") == 0
    assert "ok, 3 patches (lint + applies to the pin)" in capsys.readouterr().out
    assert p.cli("status", "--check", "demo") == 0
    assert p.cli("rebase", "demo", "--onto", "v2", "--dry-run") == 1  # one patch conflicts at v2 (next test)
    assert "demo: clean 1, 3-way merged 0, conflict 1, already upstream 1;" in capsys.readouterr().out


def test_rebase_keeps_the_headers_of_what_it_keeps(with_series, capsys):
    p = with_series
    _with_topics(p)
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    port_series = p.root / "third_party/patches/ports/demo-v2/series"
    assert port_series.read_text() == SERIES_HEADER + f"\n# == Features ==\n# what the recipe switches on\n{A}\n"
    (p.fork / "config.py").write_text("batch = 64\nlr = 0.1\n")
    git(p.fork, "add", "config.py")
    assert p.cli("rebase", "demo", "--continue", "--why", "v2 set 32; we keep 64") == 0
    assert (p.patches / "series").read_text() == (
        SERIES_HEADER + f"\n# == Features ==\n# what the recipe switches on\n{A}\n\n# == Defaults ==\n{C}\n")


def test_check_names_a_comment_export_would_drop_and_a_layout_it_would_rewrite(with_series, capsys):
    p = with_series
    series = p.patches / "series"
    series.write_text(TOPICS.replace(f"{B}\n", f"{B}\n# note\n"))
    assert p.cli("check", "demo") == 1
    assert "series: line 9: comment '# note' is not under a `# == topic ==` header" in capsys.readouterr().out
    series.write_text(TOPICS.replace("\n\n# == Fixes", "\n# == Fixes"))
    assert p.cli("check", "demo") == 1
    assert "series: line 6 is '# == Fixes ==', export writes ''" in capsys.readouterr().out
    series.write_text(TOPICS)
    assert p.cli("check", "demo") == 0


def test_the_series_view_counts_patches_per_topic(with_series, capsys):
    p = with_series
    (p.patches / "series").write_text(TOPICS.replace("# == Defaults ==", "# == Features =="))
    assert p.cli("series", "demo") == 0
    assert capsys.readouterr().out == (
        "demo: 3 patches, 2 topics\n"
        "    2  Features (in 2 places)\n       what the recipe switches on\n"
        "    1  Fixes\n")


def test_every_real_series_parses_with_topics_and_nothing_export_would_drop():
    from tools.forks.manifest import find_root, load

    manifest = load(find_root(Path(__file__).parent))
    for fork in manifest.forks.values():
        series = Series(manifest.root / fork.patches)
        layout = series.layout()
        assert layout.lost == (), fork.name
        assert format_layout(arrange(layout, layout.names)) == series.series_file.read_text(), fork.name
        assert all(g.topic for g in layout.groups), f"{fork.name}: every patch is under a topic"


def test_every_patch_has_its_row_in_the_upstream_overlap_tables():
    """patches/CHANGES.md says, per patch, which upstream release has an equivalent; a patch added without its row
    (the once-per-DP advantages went in so) leaves a rebase's reader without that answer."""
    import re

    from tools.forks.manifest import find_root, load

    manifest = load(find_root(Path(__file__).parent))
    changes = (manifest.root / "third_party/patches/CHANGES.md").read_text()
    rows = set(re.findall(r"^\| (?:[\w-]+ )?\d+ \| ([\w-]+) \|", changes, re.M))
    for fork in manifest.forks.values():
        names = Series(manifest.root / fork.patches).layout().names
        missing = [n.removesuffix(".patch") for n in names if n.removesuffix(".patch") not in rows]
        assert not missing, f"{fork.name}: no row in third_party/patches/CHANGES.md for {missing}"


def test_rebase_keeps_the_header_of_a_patch_whose_subject_the_port_changed(with_series, capsys):
    p = with_series
    _with_topics(p)
    assert p.cli("rebase", "demo", "--onto", "v2") == 3  # A is carried into the port, C conflicts
    assert p.cli("rebase", "demo", "--abort") == 0
    carried = p.root / "third_party/patches/ports/demo-v2" / A
    subject = PATCHES[0][0]
    carried.write_text(carried.read_text().replace(f"Subject: {subject}", "Subject: Add a switch"))
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    (p.fork / "config.py").write_text("batch = 64\nlr = 0.1\n")
    git(p.fork, "add", "config.py")
    assert p.cli("rebase", "demo", "--continue", "--why", "v2 set 32; we keep 64") == 0
    assert (p.patches / "series").read_text() == (
        SERIES_HEADER + "\n# == Features ==\n# what the recipe switches on\nadd-a-switch.patch\n"
        f"\n# == Defaults ==\n{C}\n"), "the renamed patch stays under its topic"
