"""The A3 checkpoint's size, write time and disk, the save cadence the profile states, where verl saves, and the
checks that refuse a device run saving without a shared dir or to a directory this node cannot write."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest

from tests.launch.conftest import CONFIGS
from tools.launch import config, env, inputs, preflight, run
from tools.model.dims import dims_from_config
from tools.perf import checkpoint_cost

A3 = CONFIGS / "a3-128-true-weight.yaml"
FACTS = env.NodeFacts("10.0.0.1", "enp189s0f0", "10.0.0.1", True, "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")
MTBF_S = 24 * 3600  # the 16-node job's MTBF a3-128-true-weight.yaml assumes for its save_freq


def _a3(*overrides: str):
    recipe = config.load(A3, list(overrides))
    return recipe.layout, dims_from_config(config.model_dims(recipe)[0])


def test_a3_checkpoint_is_every_parameter_in_bf16_and_fp32_adam():
    lay, dims = _a3()
    params = dims.total_params()
    assert params / 1e9 == pytest.approx(671.0, abs=0.1)  # DeepSeek-V3 without MTP
    expected_tb = params * (2 + 4 + 4 + 4) / 1e12  # bf16 weights; fp32 master weights, exp_avg, exp_avg_sq
    cost = checkpoint_cost.estimate(lay.checkpoints, dims)
    assert cost.nbytes / 1e12 == pytest.approx(expected_tb, rel=1e-4)  # the extras are under 0.1 GB
    assert round(cost.nbytes / 1e12, 2) == 9.39
    assert lay.checkpoints.write_gb_per_s == 10.0
    assert cost.write_s == pytest.approx(expected_tb * 1e12 / 10e9, rel=1e-4)  # ~939 s
    assert cost.disk_bytes / 1e12 == pytest.approx(3 * expected_tb, rel=1e-4)  # 2 kept + 1 being written
    assert cost.overhead == pytest.approx(expected_tb * 1e12 / 10e9 / (15 * 859.68), rel=1e-4)  # ~7.3%
    with_hf = checkpoint_cost.checkpoint_bytes(dims, ("model", "optimizer", "extra", "hf_model"))
    assert with_hf - cost.nbytes == pytest.approx(2 * params)


def test_unbounded_keep_and_no_saves_have_no_disk_or_overhead():
    assert checkpoint_cost.peak_disk_bytes(1e12, None) is None and checkpoint_cost.peak_disk_bytes(1e12, 0) is None
    assert checkpoint_cost.overhead(900.0, -1, 860.0) is None and checkpoint_cost.overhead(900.0, 15, None) is None


def test_the_profiles_save_freq_is_youngs_interval_at_the_assumed_mtbf():
    """sqrt(2 x write time x MTBF) in steps, rounded: the number a3-128-true-weight.yaml gives its reason for.
    A new write_gb_per_s or step_s needs a new save_freq (and its comment)."""
    lay, dims = _a3()
    ck = lay.checkpoints
    write_s = checkpoint_cost.estimate(ck, dims).write_s
    steps = checkpoint_cost.young_interval_s(write_s, MTBF_S) / ck.step_s
    assert steps == pytest.approx(14.8, abs=0.05)
    assert ck.save_freq == round(steps) == 15


def test_saving_on_a_device_profile_needs_a_shared_dir_and_a_bound():
    lay, _ = _a3()
    assert all(c.ok for c in preflight.checkpoint_checks(lay))
    no_dir = _failed(preflight.checkpoint_checks(_a3("recipe.checkpoints.dir=null")[0]))
    assert [c.field for c in no_dir] == ["recipe.checkpoints.dir"]
    assert no_dir[0].message().startswith("recipe.checkpoints.dir:") and "every node mounts" in no_dir[0].fix
    unbounded = _failed(preflight.checkpoint_checks(_a3("trainer.max_actor_ckpt_to_keep=null")[0]))
    assert [c.field for c in unbounded] == ["trainer.max_actor_ckpt_to_keep"]
    not_saving = _a3("recipe.checkpoints.dir=null", "trainer.max_actor_ckpt_to_keep=null", "trainer.save_freq=-1")
    assert all(c.ok for c in preflight.checkpoint_checks(not_saving[0]))
    one_node = dataclasses.replace(_a3("recipe.checkpoints.dir=null")[0], accelerator="cpu")
    assert preflight.checkpoint_checks(one_node) == []  # it saves under its run dir


def _failed(checks):
    return [c for c in checks if not c.ok]


def test_checkpoint_dir_check_wants_a_directory_here(tmp_path):
    good = inputs.checkpoint_dir_check(str(tmp_path))
    assert good.ok and list(tmp_path.iterdir()) == [], "the check leaves nothing behind"
    missing = inputs.checkpoint_dir_check(str(tmp_path / "nowhere"))
    assert not missing.ok and missing.field == "recipe.checkpoints.dir"
    assert "not found" in missing.fix and "mount the shared filesystem" in missing.fix and "mkdir -p" in missing.fix
    (tmp_path / "a-file").write_text("")
    under_a_file = inputs.checkpoint_dir_check(str(tmp_path / "a-file" / "checkpoints"))
    assert not under_a_file.ok and "not found" in under_a_file.fix
    a_file = inputs.checkpoint_dir_check(str(tmp_path / "a-file"))
    assert not a_file.ok and "not a directory" in a_file.fix


def _unwritable_dir(tmp_path: Path) -> Path | None:
    """A directory this process cannot create a file in: a chmod 555 one, or, where chmod does not bind (root),
    sysfs, which refuses new files to root too."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for candidate in (ro, Path("/sys")):
        try:
            fd, tmp = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(tmp)
    return None


def test_checkpoint_dir_check_wants_it_writable(tmp_path):
    where = _unwritable_dir(tmp_path)
    if where is None:
        pytest.skip("no directory here refuses this process a new file (chmod does not bind, no sysfs)")
    try:
        check = inputs.checkpoint_dir_check(str(where))
    finally:
        (tmp_path / "read-only").chmod(0o755)
    assert not check.ok and check.field == "recipe.checkpoints.dir", where
    assert "cannot create a file there" in check.fix and "read-write" in check.fix


def test_a_run_that_saves_needs_the_dir_and_one_that_does_not_is_not_held_up(tmp_path):
    def dir_checks(*overrides):
        recipe = config.load(A3, list(overrides))
        return [c for c in inputs.input_checks(recipe) if c.field == "recipe.checkpoints.dir"]

    assert [c.ok for c in dir_checks(f"recipe.checkpoints.dir={tmp_path / 'absent'}")] == [False]
    assert [c.ok for c in dir_checks(f"recipe.checkpoints.dir={tmp_path}")] == [True]
    assert dir_checks(f"recipe.checkpoints.dir={tmp_path / 'absent'}", "trainer.save_freq=-1") == []


def test_the_dry_run_prints_the_estimate_and_where_verl_saves(tmp_path):
    shared = tmp_path / "shared"
    p = run.prepare(config.load(A3, [f"recipe.checkpoints.dir={shared}"]), FACTS, "ckpt-run", tmp_path / "logs",
                    device_gb=64.0)
    report = run.report(p, dry_run=True)
    assert "checkpoint (estimate;" in report and "9.39 TB" in report and "939 s" in report
    assert "every 15 steps of 859.68 s: 7.3% of the run spent saving" in report
    assert f"where        {shared / 'ckpt-run'} (" in report


def test_cpu_profile_prints_no_checkpoint_estimate(tmp_path):
    p = run.prepare(config.load(CONFIGS / "cpu-tiny.yaml"), FACTS, "r", tmp_path / "logs")
    assert p.checkpoint is None and "checkpoint (estimate" not in run.report(p, dry_run=True)
