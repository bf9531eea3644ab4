"""A3-only settings are refused at launch when launch.accelerator is cpu, each named with why (config.CPU_REFUSED),
through the real command line: `python -m tools.launch CONFIG key=true --dry-run` exits 2 before any preflight."""

from __future__ import annotations

import pytest

from tests.launch.conftest import CONFIGS
from tools.launch import cli, config, run

TINY = CONFIGS / "cpu-tiny.yaml"
EXTRA = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config"


def dry_run(path, *overrides: str, tmp_path) -> int:
    return cli.main([str(path), *overrides, "--dry-run", "--run-id", "t", "--logs", str(tmp_path / "logs")])


@pytest.mark.parametrize("key, why", config.CPU_REFUSED, ids=[k.rsplit(".", 1)[-1] for k, _ in config.CPU_REFUSED])
def test_each_refused_setting_is_a_key_the_a3_path_accepts(key, why):
    """A refusal of a key nothing knows would never fire: each one passes the A3 profile's key checks."""
    cfg = config.load(CONFIGS / "a3-128-true-weight.yaml", [f"{key}=true"]).cfg
    assert config.unknown_keys(cfg, config.verl_base_for(cfg)) == [], key
    assert len(why) > 20, f"{key}: say why a CPU cannot run it"


@pytest.mark.parametrize("key, why", config.CPU_REFUSED, ids=[k.rsplit(".", 1)[-1] for k, _ in config.CPU_REFUSED])
def test_each_a3_only_setting_is_refused_on_cpu_naming_it(key, why, tmp_path, capsys):
    rc = dry_run(TINY, f"{key}=true", tmp_path=tmp_path)
    out = capsys.readouterr()
    assert rc == run.EXIT_ERROR, out.out
    assert f"{key}: true ({why})" in out.err and f"set {key}=false" in out.err
    assert "launch.accelerator is cpu" in out.err and "preflight" not in out.out


def test_the_a3_profile_planned_on_cpu_is_refused_naming_every_key(tmp_path, capsys):
    rc = dry_run(CONFIGS / "a3-128-true-weight.yaml", "launch.accelerator=cpu", tmp_path=tmp_path)
    err = capsys.readouterr().err
    assert rc == run.EXIT_ERROR
    assert [key for key, _ in config.CPU_REFUSED if f"{key}: true" in err] == [k for k, _ in config.CPU_REFUSED]


def test_off_is_fine_on_cpu_and_on_is_fine_on_a3(tmp_path, capsys):
    assert dry_run(TINY, *(f"{k}=false" for k, _ in config.CPU_REFUSED), tmp_path=tmp_path) == run.EXIT_OK
    config.load(TINY, ["launch.accelerator=a3", "actor_rollout_ref.actor.megatron.swap_optimizer=true"])
