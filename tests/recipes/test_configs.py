"""Every config under recipes/ loads, has only verl's keys (plus launch/recipe/megatron extensions), passes
preflight and dry-runs through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import stack
from tests.launch.conftest import LEGACY_LAYOUT, write_dist_manifest, write_manifest
from tools.launch import cli, config, env, run

ROOT = Path(__file__).resolve().parents[2]
ALL_CONFIGS = sorted(ROOT.glob("recipes/*/configs/*.yaml"))
FACTS = env.NodeFacts("10.0.0.1", "eth0", "10.0.0.1", True, "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


@pytest.fixture
def paths(tmp_path):
    """The inputs of a run, for a given config: the checkpoint is the kind its verl loader reads (torch_dist with
    use_dist_checkpointing, else the legacy rank files of the A3 layout)."""
    (tmp_path / "model").mkdir()
    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_bytes(b"")
    legacy, dist = write_manifest(tmp_path / "ckpt", LEGACY_LAYOUT), write_dist_manifest(tmp_path / "dist_ckpt")
    (tmp_path / "shared").mkdir()  # stands for the A3 profiles' shared checkpoint dir

    def for_config(path: Path) -> list[str]:
        uses_dist = config.value(config.load(path).cfg, "actor_rollout_ref.actor.megatron.use_dist_checkpointing")
        return [f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.train_files={tmp_path / 'train.parquet'}",
                f"data.val_files={tmp_path / 'val.parquet'}",
                f"recipe.weights.mcore_checkpoint={dist if uses_dist else legacy}",
                f"recipe.checkpoints.dir={tmp_path / 'shared'}"]
    return for_config


def test_there_are_configs():
    names = {p.name for p in ALL_CONFIGS}
    assert {"a3-128-true-weight.yaml", "a3-128-random-init.yaml", "cpu-tiny.yaml", "cpu-tiny-fsdp.yaml"} <= names


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_config_loads_with_verl_keys_only(path):
    recipe = config.load(path)
    assert config.unknown_keys(recipe.cfg, config.verl_base_for(recipe.cfg)) == []
    verl_cfg = config.verl_config(recipe.cfg, config.verl_base_for(recipe.cfg))
    assert "launch" not in verl_cfg and verl_cfg.trainer.nnodes == recipe.cfg.launch.nodes


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_config_passes_preflight(path, paths, tmp_path):
    prepared = run.prepare(config.load(path, paths(path)), FACTS, "test", tmp_path / "logs", device_gb=None
                           if "cpu" in path.stem else 64.0)
    failed = [c.message() for c in prepared.checks + prepared.inputs if not c.ok]
    assert not failed, "\n".join(failed)
    assert prepared.ready


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_config_dry_runs(path, paths, tmp_path, capsys):
    rc = cli.main([str(path), "--dry-run", "--master-addr", "127.0.0.1", "--run-id", "t",
                   "--logs", str(tmp_path / "logs"), *paths(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "preflight:" in out and "node 0: head" in out and "verl.trainer.main_ppo" in out
    assert not (tmp_path / "logs").exists(), "a dry run writes nothing"


def test_a3_profiles_carry_the_reference_values():
    for name, rollout_dp, instances in (("a3-128-true-weight", 64, 2), ("a3-128-random-init", 128, 1)):
        cfg = config.load(ROOT / f"recipes/deepseek_r1/configs/{name}.yaml").cfg
        v = lambda k, cfg=cfg: config.value(cfg, k)  # noqa: E731
        assert (v("launch.nodes"), v("launch.devices_per_node")) == (16, 16)
        assert v("algorithm.adv_estimator") == "grpo" and v("algorithm.use_kl_in_reward") is False
        assert (v("data.train_batch_size"), v("actor_rollout_ref.rollout.n")) == (512, 16)
        assert (v("data.max_prompt_length"), v("data.max_response_length")) == (1024, 3072)
        m = "actor_rollout_ref.actor.megatron."
        assert (v(m + "tensor_model_parallel_size"), v(m + "pipeline_model_parallel_size"),
                v(m + "expert_model_parallel_size")) == (4, 8, 8)
        assert v(m + "num_layer_list") == [7, 7, 8, 8, 8, 8, 8, 7]
        assert v(m + "moe_tp_extend_ep") and v(m + "swap_optimizer") and not v(m + "optimizer_offload")
        assert v("actor_rollout_ref.ref.megatron.num_layer_list") == [7, 7, 8, 8, 8, 8, 8, 7]
        a = "actor_rollout_ref.actor."
        assert (v(a + "optim.lr"), v(a + "optim.clip_grad"), v(a + "ppo_mini_batch_size"),
                v(a + "ppo_micro_batch_size_per_gpu")) == (1e-6, 1.0, 512, 1)
        assert (v(a + "use_kl_loss"), v(a + "kl_loss_type"), v(a + "kl_loss_coef")) == (True, "low_var_kl", 0.001)
        r = "actor_rollout_ref.rollout."
        assert (v(r + "tensor_model_parallel_size"), v(r + "gpu_memory_utilization"), v(r + "enforce_eager"),
                v(r + "max_num_batched_tokens"), v(r + "enable_chunked_prefill")) == (2, 0.8, False, 4096, True)
        assert (v(r + "temperature"), v(r + "top_k"), v(r + "top_p")) == (0.9, 50, 0.9)
        assert v("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu") == 8
        assert v(r + "log_prob_micro_batch_size_per_gpu") == 4
        assert (v("recipe.rollout.data_parallel_size"), v("recipe.rollout.instances")) == (rollout_dp, instances)
        assert v("trainer.logger") == ["console", "tensorboard"] and v("trainer.balance_batch") is False
        assert (v("trainer.test_freq"), v("trainer.total_epochs")) == (-1, 1)
        assert v("recipe.checkpoints.dir") and v("trainer.max_actor_ckpt_to_keep") == 2
    true_cfg = config.load(ROOT / "recipes/deepseek_r1/configs/a3-128-true-weight.yaml").cfg
    random_cfg = config.load(ROOT / "recipes/deepseek_r1/configs/a3-128-random-init.yaml").cfg
    assert config.value(true_cfg, "actor_rollout_ref.actor.megatron.override_transformer_config") == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 8}
    assert config.value(random_cfg, "actor_rollout_ref.rollout.ignore_eos") is True
    assert config.value(random_cfg, "recipe.weights.load") is False
    # the true-weight run saves (every 15 steps: the yaml says why); the random-init measurement run does not
    assert (config.value(true_cfg, "trainer.save_freq"), config.value(random_cfg, "trainer.save_freq")) == (15, -1)


def test_a3_env_profile_has_a_reason_for_every_variable():
    text = (ROOT / "recipes/deepseek_r1/env/a3.yaml").read_text()
    profile = env.load_profile(ROOT / "recipes/deepseek_r1", "a3")
    for var in (*profile.variables, *profile.computed):
        line = next(line for line in text.splitlines() if line.strip().startswith(f"{var}:"))
        assert "#" in line, f"{var} has no comment saying why"
    assert profile.variables["HCCL_CONNECT_TIMEOUT"] == profile.variables["HCCL_EXEC_TIMEOUT"] == "600"
    assert profile.computed["LD_PRELOAD"] == "jemalloc"
    assert {"HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"} <= set(profile.computed)
    assert {"VLLM_ENABLE_MC2", "VLLM_ENABLE_FIX_ROUTE", "VLLM_ASCEND_ACL_OP_INIT_MODE"} <= set(profile.left_out)


def test_bare_a3_dry_run_passes_preflight_and_lists_what_a_run_needs(tmp_path, capsys, monkeypatch):
    """The acceptance command: no MASTER_ADDR, no paths: the layout checks pass, the inputs are listed."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    path = next(p for p in ALL_CONFIGS if p.stem == "a3-128-true-weight")
    rc = cli.main([str(path), "--dry-run", "--run-id", "t", "--logs", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == 0, out
    import re

    done = re.search(r"preflight: (\d+) of (\d+) checks ok", out)
    assert done and done.group(1) == done.group(2)
    assert "needed before a run: actor_rollout_ref.model.path" in out
    assert "needed before a run: recipe.weights.mcore_checkpoint" in out
    assert out.count("node ") >= 16 and "planned as if this node were the head" in out


def test_a_run_with_missing_inputs_stops_before_starting_anything(tmp_path, capsys):
    path = next(p for p in ALL_CONFIGS if p.stem == "a3-128-true-weight")
    rc = cli.main([str(path), "--master-addr", "127.0.0.1", "--run-id", "t", "--logs", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == run.EXIT_CHECK and "error: data.train_files" in out
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_every_profile_scores_with_the_strict_reward_through_verls_loader(path, tmp_path):
    """verl.trainer.ppo.reward.get_custom_reward_fn on the config the trainer gets, in a fresh process
    whose working directory is not ours (as under a Ray job)."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    cfg = config.load(path).cfg
    verl_cfg = config.verl_config(cfg, config.verl_base_for(cfg))
    assert Path(verl_cfg.custom_reward_function.path).is_absolute()
    OmegaConf.save(verl_cfg, tmp_path / "verl.yaml")
    script = (
        "import sys\nfrom omegaconf import OmegaConf\nfrom verl.trainer.ppo.reward import get_custom_reward_fn\n"
        "fn = get_custom_reward_fn(OmegaConf.load(sys.argv[1]))\n"
        # a budget no loaded CI machine reaches: this checks the loader and the rule, not the time bound
        "print(fn('deepscaler', r'so \\boxed{\\dfrac{1}{2}}', '0.5', {}, timeout_s=60),"
        " fn('deepscaler', 'year 2024, 7', '2', {}, timeout_s=60))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "verl.yaml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1.0 0.0"


# train DP: 256 / (TP4 x PP8) on A3, 4 / (TP2 x PP2) for cpu-tiny
@pytest.mark.parametrize("name, train_dp", [("a3-128-true-weight", 8), ("a3-128-random-init", 8), ("cpu-tiny", 1)])
def test_megatron_profiles_pass_the_trainer_checks_of_our_verl_series(name, train_dp):
    """What verl's trainer checks at init with our series (on-policy skip, shared ref worker, batch divisions,
    TensorCache limits), run on the verl config the launcher writes for each Megatron profile."""
    cfg = config.load(ROOT / f"recipes/deepseek_r1/configs/{name}.yaml").cfg
    verl_cfg = config.verl_config(cfg, config.verl_base_for(cfg))
    on_policy = stack.require("verl.trainer.ppo.on_policy")
    colocated = stack.require("verl.trainer.ppo.colocated_ref")
    batch_sizes = stack.require("verl.trainer.ppo.batch_sizes")
    flow = stack.require("verl.trainer.ppo.tensor_cache_flow")
    assert on_policy.skip_old_log_prob(verl_cfg) is True
    assert colocated.shares_actor_worker(verl_cfg) is True
    assert batch_sizes.check_config(verl_cfg, use_reference_policy=True) == train_dp
    assert flow.enabled(verl_cfg)
    assert flow.limit_problems(verl_cfg, use_critic=False, use_rm=False, use_reference_policy=True,
                               ref_in_actor=False) == []
