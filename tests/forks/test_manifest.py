"""The real forks.toml, .gitmodules and gitlinks agree; malformed manifests fail by field name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.forks import manifest as manifest_mod
from tools.forks import ops
from tools.forks.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]

# The pins of the foundation issue; changing one is a deliberate act (rebase) and shows up here.
PINS = {
    "verl": ("third_party/verl", "v0.6.1", "d62da4950573d7a4b7ef2362337952e7ab59e78d"),
    "vllm": ("third_party/vllm", "v0.11.0", "b8b302cde434df8c9289a2b465406b47ebab1c2d"),
    "vllm-ascend": ("third_party/vllm-ascend", "v0.11.0", "2f1aed98ccdb0fcbe1ff4fd0abab225bfd8d0367"),
    "megatron": ("third_party/Megatron-LM", "core_v0.12.3", "3ea68ad6042cc1204386ae9364358f7c4de1bc37"),
    "mindspeed": ("third_party/MindSpeed", "v2.2.0_core_r0.12.1", "f321067c6fd1e32ad74848416942bdb899cf9627"),
    "mindspeed-llm": ("third_party/MindSpeed-LLM", "v2.2.0", "53f3639c3da9c000a187c44cc0c08d55026ddded"),
}


def test_real_manifest_has_the_six_pins():
    m = manifest_mod.load(ROOT)
    assert {name: (f.path, f.ref, f.commit) for name, f in m.forks.items()} == PINS
    assert {f.name for f in m.forks.values() if f.pypi} == {"verl", "vllm", "vllm-ascend", "megatron"}
    assert {f.name for f in m.select(profile="cpu")} == {"verl", "vllm", "megatron"}
    # vLLM-Ascend is not installed on cpu, but its series' tests run there (from its source tree)
    assert {f.name for f in m.select(profile="cpu", tests=True)} == {"verl", "vllm", "vllm-ascend", "megatron"}
    assert m.forks["verl"].test_profiles == m.forks["verl"].profiles, "test_profiles defaults to profiles"
    assert m.stack["npu"]["torch_npu"] == "2.7.1" and m.stack["cpu"]["torch"] == "2.13.0"


def test_real_gitmodules_gitlinks_and_manifest_agree():
    m = manifest_mod.load(ROOT)
    assert ops.gitlink_problems(m) == []
    status = subprocess.run(["git", "submodule", "status"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    listed = {line.split()[1]: line.split()[0].lstrip("-+U ") for line in status.splitlines()}
    assert listed == {path: commit for path, _, commit in PINS.values()}


def test_every_real_series_exists_and_lints_clean():
    from tools.forks import series as series_mod

    m = manifest_mod.load(ROOT)
    for fork in m.forks.values():
        s = series_mod.Series(ROOT / fork.patches)
        assert s.series_file.is_file(), fork.name
        assert series_mod.lint(s, ROOT) == [], fork.name


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('commit = "', 'commit = "zz', 1), "forks.verl.commit"),
    (lambda t: t.replace('profiles = ["npu", "cuda", "cpu"]', 'profiles = ["tpu"]', 1), "forks.verl.profiles"),
    (lambda t: t.replace('test_profiles = ["npu", "cpu"]', 'test_profiles = ["cpu"]', 1),
     "forks.vllm-ascend.test_profiles"),  # must include the profiles that install the fork
    (lambda t: t.replace('test_profiles = ["npu", "cpu"]', 'test_profiles = ["npu", "tpu"]', 1),
     "forks.vllm-ascend.test_profiles"),
    (lambda t: t.replace('url = "https://github.com/volcengine/verl.git"\n', "", 1), "forks.verl.url"),
    (lambda t: t.replace('requirement = "verl==0.6.1", ', "", 1), "forks.verl.pypi"),
    (lambda t: t.replace('lacks = ["verl/', 'lacks = ["/verl/', 1), "forks.verl.pypi.lacks"),
    (lambda t: t + "[[[", "not valid TOML"),
])
def test_malformed_manifest_names_the_field(tmp_path, edit, message):
    (tmp_path / "third_party").mkdir()
    text = (ROOT / "third_party/forks.toml").read_text()
    (tmp_path / "third_party/forks.toml").write_text(edit(text))
    with pytest.raises(manifest_mod.ManifestError, match=message.replace(".", r"\.")):
        manifest_mod.load(tmp_path)


def test_set_keys_keeps_comments_and_other_tables(tmp_path):
    path = tmp_path / "forks.toml"
    path.write_text((ROOT / "third_party/forks.toml").read_text())
    before = path.read_text()
    manifest_mod.set_keys(path, "megatron", {"ref": "core_v0.13.0", "published_url": "file:///x"})
    after = path.read_text()
    assert 'ref = "core_v0.13.0"' in after and 'published_url = "file:///x"' in after
    changed = [line for line in after.splitlines() if line not in before.splitlines()]
    assert changed == ['ref = "core_v0.13.0"', 'published_url = "file:///x"']


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    proc = subprocess.run([sys.executable, "-m", "tools.forks", command, "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: python -m tools.forks" in proc.stdout


def test_readme_pins_table_equals_forks_toml():
    from tools.forks.cli import pins_table

    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- pins:begin", 1)[1].split("-->", 1)[1].split("<!-- pins:end -->", 1)[0]
    assert block.strip() == pins_table(manifest_mod.load(ROOT).forks.values()).strip()
