"""Running a plan on fake forks: order, stamps and skips, resume after a failure, stack.json, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace

import pytest

from tests.forks.conftest import commit, git
from tools.install import run as run_mod
from tools.install.plan import build_plan
from tools.install.run import InstallError, execute


def install(stack, **kw):
    ctx = stack.context(**kw)
    return ctx, execute(ctx, build_plan(ctx), say=lambda *a: None)


def test_first_run_installs_in_order_and_records_the_stack(fake_stack):
    ctx, outcome = install(fake_stack)
    assert set(outcome.values()) == {"ran"}
    assert fake_stack.order() == ["megatron", "vllm", "verl"]
    stack = json.loads((ctx.venv / "stack.json").read_text())
    assert stack["profile"] == "cpu"
    for name, fork in ctx.manifest.forks.items():
        assert stack["forks"][name]["commit"] == fork.commit
        assert stack["forks"][name]["source"] == "git"
        assert stack["forks"][name]["version"] == "1.0"
    assert stack["packages"]["torch"] == "9.9.9" and stack["packages"]["fakedep"] == "1.0"


def test_second_run_is_a_noop(fake_stack):
    install(fake_stack)
    fake_stack.log.unlink()
    _, outcome = install(fake_stack)
    assert set(outcome) >= {"venv", "torch", "megatron", "vllm", "verl", "requirements", "smoke"}
    assert all(v == "skipped" for k, v in outcome.items() if k not in ("preflight", "forks"))
    assert fake_stack.order() == []


def test_a_series_change_reinstalls_that_fork_and_what_follows(fake_stack):
    ctx, _ = install(fake_stack)
    fork = ctx.root / "third_party/vllm"
    commit(fork, {"vllm/patched.py": "X = 1\n"}, "Add a patched module", "Needed by the recipe.")
    from tools.forks.cli import main

    assert main(["--root", str(ctx.root), "export", "vllm"]) == 0
    fake_stack.log.unlink()
    _, outcome = install(fake_stack)
    assert outcome["megatron"] == "skipped" and outcome["torch"] == "skipped"
    assert outcome["vllm"] == "ran" and outcome["verl"] == "ran" and outcome["smoke"] == "ran"
    assert fake_stack.order() == ["vllm", "verl"]


def test_a_failed_step_is_named_with_its_log_and_the_rerun_resumes_there(fake_stack, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "vllm")
    with pytest.raises(InstallError) as err:
        install(fake_stack)
    message = str(err.value)
    assert "step vllm failed" in message and "vllm.log" in message and "rerun" in message
    assert "fake build failure of vllm" in (fake_stack.root / ".venv/.install/logs/vllm.log").read_text()
    monkeypatch.delenv("FAKE_FAIL")
    fake_stack.log.unlink()
    _, outcome = install(fake_stack)
    assert outcome["megatron"] == "skipped" and outcome["torch"] == "skipped"
    assert outcome["vllm"] == "ran"
    assert fake_stack.order() == ["vllm", "verl"]


def test_force_runs_every_step(fake_stack):
    install(fake_stack)
    ctx = fake_stack.context()
    outcome = execute(ctx, build_plan(ctx), force=True, say=lambda *a: None)
    assert set(outcome.values()) == {"ran"}


def test_smoke_names_a_module_that_does_not_import(fake_stack):
    ctx, _ = install(fake_stack)
    (ctx.root / "third_party/verl/verl/__init__.py").write_text("raise ImportError('broken on purpose')\n")
    with pytest.raises(InstallError, match="verl: ImportError: broken on purpose"):
        run_mod.smoke(ctx, lambda *a: None, "smoke")


def test_forks_step_refuses_local_work_before_installing_anything(fake_stack):
    ctx, _ = install(fake_stack)
    (ctx.root / "third_party/verl/verl/__init__.py").write_text("changed = True\n")
    with pytest.raises(InstallError, match="verl: uncommitted changes"):
        install(fake_stack)


# ---------------------------------------------------------------- preflight


def _checks(ctx, env):
    return {c.name: c for c in run_mod.preflight(ctx, env)}


def test_preflight_wrong_python_names_the_fix(fake_stack, tmp_path):
    ctx = fake_stack.context(python="python2.7-does-not-exist")
    check = _checks(ctx, {})["python"]
    assert not check.ok and "--python" in check.fix


def _free_gib(monkeypatch, gib: float) -> None:
    usage = shutil.disk_usage
    monkeypatch.setattr(run_mod.shutil, "disk_usage", lambda path: usage(path)._replace(free=gib * 2**30))


def test_preflight_disk_refuses_a_venv_that_will_not_fit_and_names_the_fix(fake_stack, monkeypatch):
    _free_gib(monkeypatch, 1.5)
    check = _checks(fake_stack.context(disk_gib=10), {})["disk"]
    assert not check.ok and "1.5 GiB free" in check.detail and "needs 10 GiB" in check.detail
    assert "--venv" in check.fix


def test_preflight_disk_counts_what_the_venv_holds(fake_stack, monkeypatch):
    """A rerun overwrites the venv in place: its own size counts towards the need."""
    ctx = fake_stack.context()
    execute(ctx, build_plan(ctx), say=lambda *a: None)
    held = sum(f.stat().st_size for f in ctx.venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30
    _free_gib(monkeypatch, 0.001)
    assert _checks(replace(ctx, disk_gib=held), {})["disk"].ok
    check = _checks(replace(ctx, disk_gib=held + 0.01), {})["disk"]
    assert not check.ok and f"in {ctx.venv}" in check.detail


def test_preflight_cann_missing_names_set_env(fake_stack, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(run_mod, "DEFAULT_CANN", fake_stack.root / "no-such-toolkit")
    ctx = replace(fake_stack.context(), device="npu")
    check = _checks(ctx, {})["CANN"]
    assert not check.ok and "set_env.sh" in check.fix


def _toolkit(tmp_path, monkeypatch, files: dict[str, str]):
    """A CANN toolkit home with these files (paths under latest/), the default location for the test."""
    home = tmp_path / "Ascend/ascend-toolkit/latest"
    for name, text in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(run_mod, "DEFAULT_CANN", home)
    return home


def _cann_check(fake_stack, home, want: str, sourced: bool = True):
    from dataclasses import replace

    manifest = fake_stack.context().manifest
    manifest.stack["npu"] = {"python": manifest.stack["cpu"]["python"], "cann": want}
    ctx = replace(fake_stack.context(), device="npu", manifest=manifest)
    return _checks(ctx, {"ASCEND_TOOLKIT_HOME": str(home)} if sourced else {})["CANN"]


@pytest.mark.parametrize("installed, sourced, ok, words", [
    ("8.3.RC2", True, True, "8.3.RC2, of the 8.3 line"),
    ("8.3.RC1", True, True, "8.3.RC1, of the 8.3 line"),  # vLLM-Ascend 0.11.0: CANN >= 8.3.rc1
    ("8.3.0", True, True, "8.3.0, of the 8.3 line"),
    ("8.2.RC1", True, False, "is 8.2.RC1, the stack needs CANN 8.3 (8.3.RC2, or another 8.3 release)"),
    ("8.30.RC1", True, False, "is 8.30.RC1, the stack needs CANN 8.3"),  # a line, not a prefix
    ("8.5.0", True, False, "is 8.5.0, the stack needs CANN 8.3"),
    ("8.3.RC2", False, False, "environment is not set"),
])
def test_preflight_cann_takes_any_release_of_the_stack_line(fake_stack, tmp_path, monkeypatch, installed, sourced,
                                                            ok, words):
    home = _toolkit(tmp_path, monkeypatch, {"aarch64-linux/ascend_toolkit_install.info":
                                            f"package_name=Ascend-cann-toolkit\nversion={installed}\n"
                                            "innerversion=V100R001C23SPC001B212\n"})
    check = _cann_check(fake_stack, home, "8.3.RC2", sourced)
    assert check.ok == ok and words in (check.detail if ok else check.detail + check.fix), check


def test_preflight_cann_refusal_names_the_found_and_the_needed_version(fake_stack, tmp_path, monkeypatch):
    home = _toolkit(tmp_path, monkeypatch, {"x86_64-linux/ascend_toolkit_install.info": "version=8.2.RC1\n"})
    check = _cann_check(fake_stack, home, "8.3.RC2")
    assert not check.ok
    assert check.detail == f"toolkit at {home} is 8.2.RC1, the stack needs CANN 8.3 (8.3.RC2, or another 8.3 release)"
    assert "install CANN 8.3.RC2" in check.fix and "set_env.sh" in check.fix


@pytest.mark.parametrize("files, found", [
    # version.cfg states the build number, then the CANN version: the CANN version counts
    ({"version.cfg": "runtime_running_version=[7.3.0.1.231:8.3.RC1]\ncompiler_running_version=[7.3.0.1.231:8.3.RC1]\n"},
     "8.3.RC1"),
    ({"version.cfg": "# version: 1.0\ntoolkit_running_version=[8.3.RC2]\n"}, "8.3.RC2"),
    # the install info comes first
    ({"version.cfg": "runtime_running_version=[7.3.0.1.231:8.2.RC1]\n",
      "aarch64-linux/ascend_toolkit_install.info": "package_name=Ascend-cann-toolkit\nversion=8.3.RC2\n"}, "8.3.RC2"),
    ({"aarch64-linux/ascend_toolkit_install.info": "innerversion=V100R001C23\n"}, None),
])
def test_cann_version_reads_the_install_info_then_version_cfg(tmp_path, monkeypatch, files, found):
    assert run_mod.cann_version(_toolkit(tmp_path, monkeypatch, files)) == found


@pytest.mark.parametrize("version, line", [("8.3.RC2", "8.3"), ("8.3.RC1", "8.3"), ("8.3.0", "8.3"), ("8.3", "8.3"),
                                           ("8.2.RC1", "8.2"), ("10.0.RC1", "10.0"), ("RC2", None), ("", None)])
def test_cann_line_is_major_minor(version, line):
    from tools.install.plan import cann_line

    assert cann_line(version) == line


def test_preflight_failure_stops_before_any_step(fake_stack):
    ctx = fake_stack.context(python="python2.7-does-not-exist")
    with pytest.raises(InstallError, match="preflight failed"):
        execute(ctx, build_plan(ctx), say=lambda *a: None)
    assert not ctx.venv.exists()


def test_git_status_of_the_forks_stays_clean_after_installing(fake_stack):
    ctx, _ = install(fake_stack)
    for fork in ctx.manifest.forks.values():
        assert git(ctx.root / fork.path, "status", "--porcelain") == ""


def test_a_change_in_an_included_requirements_file_reruns_the_requirements_step(fake_stack):
    reqs = fake_stack.root / "requirements"
    (reqs / "common.in").write_text("fakedep==1.0\n")
    (reqs / "cpu.in").write_text("-r common.in\n")
    install(fake_stack)
    (reqs / "common.in").write_text("fakedep==1.0  # a comment is a change too\n")
    _, outcome = install(fake_stack)
    assert outcome["requirements"] == "ran" and outcome["verl"] == "skipped"


# ---------------------------------------------------------------- the wheel cache (cpu vllm)


def test_cpu_vllm_is_installed_from_its_built_wheel_not_editable(fake_stack):
    ctx, _ = install(fake_stack)
    vllm = next(s for s in build_plan(ctx) if s.name == "vllm")
    assert [p.name for p in vllm.wheel.folder.glob("*.whl")] == ["vllm-1.0-py3-none-any.whl"]
    probe = ("import vllm, importlib.metadata as m; print(vllm.__file__);"
             "print(m.distribution('vllm').read_text('direct_url.json'))")
    out = subprocess.run([ctx.venv_python, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert str(ctx.venv) in out.splitlines()[0], "vllm imports from the venv, not from the fork tree"
    assert '"editable": true' not in out


def test_a_new_venv_takes_the_wheel_from_the_cache_and_builds_nothing(fake_stack, tmp_path):
    install(fake_stack)
    assert "vllm" in fake_stack.order()
    fake_stack.log.unlink()
    said = []
    ctx = fake_stack.context(venv=tmp_path / "second-venv")
    outcome = execute(ctx, build_plan(ctx), say=said.append)
    assert outcome["vllm"] == "ran"
    assert "vllm" not in fake_stack.order(), "the cached wheel is installed, not rebuilt"
    assert any("from the wheel cache" in line and "not built" in line for line in said)


def test_a_series_change_builds_a_new_wheel_under_a_new_key(fake_stack):
    ctx, _ = install(fake_stack)
    old = next(s for s in build_plan(ctx) if s.name == "vllm").wheel
    commit(ctx.root / "third_party/vllm", {"vllm/patched.py": "X = 1\n"}, "Add a patched module", "Needed.")
    from tools.forks.cli import main

    assert main(["--root", str(ctx.root), "export", "vllm"]) == 0
    fake_stack.log.unlink()
    said = []
    execute(ctx, build_plan(ctx), say=said.append)
    new = next(s for s in build_plan(ctx) if s.name == "vllm").wheel
    assert new.key != old.key and fake_stack.order() == ["vllm", "verl"]
    assert any("building vllm's wheel" in line for line in said)
    out = subprocess.run([ctx.venv_python, "-c", "import vllm.patched; print(vllm.patched.X)"],
                         capture_output=True, text=True, cwd=ctx.venv).stdout
    assert out.strip() == "1", "the rebuilt wheel (same version) replaced the installed one"
    assert old.folder.is_dir() and new.folder.is_dir()


def test_an_interrupted_build_leaves_no_wheel_in_the_cache(fake_stack, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "vllm")
    with pytest.raises(InstallError, match="building vllm failed"):
        install(fake_stack)
    assert list(fake_stack.wheel_cache.iterdir()) == [], "no finished folder, no temporary one"
    monkeypatch.delenv("FAKE_FAIL")
    _, outcome = install(fake_stack)
    assert outcome["vllm"] == "ran" and outcome["megatron"] == "skipped"
    assert [p.name for p in fake_stack.wheel_cache.iterdir()] == [
        next(s for s in build_plan(fake_stack.context()) if s.name == "vllm").wheel.folder.name]


def test_the_cache_location_follows_the_environment(tmp_path):
    from tools.install import wheels

    assert wheels.default_cache({"RL_RECIPE_WHEEL_CACHE": str(tmp_path)}) == tmp_path
    assert wheels.default_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "rl-recipe/wheels"


# ---------------------------------------------------------------- fetch (cuda's vLLM kernels)


def _fetch_step(pin):
    from tools.install.plan import Step

    return Step("vllm-kernels", "kernels", kind="fetch", fetch=pin)


def test_fetch_takes_the_pinned_file_and_checks_its_sha256(fake_stack, tmp_path, monkeypatch):
    import hashlib
    from dataclasses import replace

    from tools.forks.manifest import PyPISource

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    (folder / "vllm-1.0-cp38-abi3-manylinux1_x86_64.whl").write_bytes(b"kernels")
    pin = PyPISource("vllm==1.0", "vllm-1.0-cp38-abi3-manylinux1_x86_64.whl", hashlib.sha256(b"kernels").hexdigest())
    ctx = replace(fake_stack.context(), wheelhouse=folder)
    path = run_mod.fetch(ctx, _fetch_step(pin), lambda *a: None, "fetch")
    assert path == tmp_path / "xdg/rl-recipe/dists" / pin.file and path.read_bytes() == b"kernels"
    (path).unlink()
    with pytest.raises(InstallError, match="sha256"):
        run_mod.fetch(ctx, _fetch_step(replace(pin, sha256="0" * 64)), lambda *a: None, "fetch")
    assert not path.exists(), "a file with the wrong digest is not kept"
