"""Prepare a run (config -> checks -> plan) and execute one node's part of it."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from tools.launch import checkpoint_cost, cluster, config, curves, env, inputs, layout, plan, preflight, summary
from tools.launch.memory import Estimate
from tools.model.dims import dims_from_config

EXIT_OK, EXIT_CHECK, EXIT_ERROR = 0, 1, 2
TENSORBOARD = "tensorboard"  # <run dir>/tensorboard
CHECKPOINTS = "checkpoints"  # <run dir>/checkpoints, where a run saves without recipe.checkpoints.dir


@dataclass
class Prepared:
    recipe: config.Recipe
    plan: plan.Plan
    checks: list[preflight.Check]
    estimate: Estimate
    dims_source: str
    inputs: list[preflight.Check]  # paths and required settings: a dry run reports them, a run needs them
    checkpoint: checkpoint_cost.Cost | None = None  # a device profile's checkpoint size and write time

    @property
    def ok(self) -> bool:
        """The layout, batch and memory arithmetic holds."""
        return all(c.ok for c in self.checks)

    @property
    def ready(self) -> bool:
        """ok, and every input is set and present: the run can start."""
        return self.ok and all(c.ok for c in self.inputs)


def device_memory_gb(accelerator: str, devices_per_node: int) -> float:
    if accelerator in layout.DEVICE_MEMORY_GB:
        return layout.DEVICE_MEMORY_GB[accelerator]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return ram / max(1, devices_per_node)


def prepare(recipe: config.Recipe, facts: env.NodeFacts, run_id: str, logs_root: Path,
            python: str = sys.executable, ray_bin: str = "ray", device_gb: float | None = None) -> Prepared:
    cfg = recipe.cfg
    base = config.verl_base_for(cfg)
    config.refuse_unknown_keys(cfg, base)
    config.check_series(cfg, base)  # verl's settings, by our verl series' own validators
    if config.value(cfg, "trainer.default_local_dir") is not None:
        raise config.ConfigError("trainer.default_local_dir is set by the launcher (<recipe.checkpoints.dir>/<run id>,"
                                 " or <run dir>/checkpoints): set recipe.checkpoints.dir instead")
    lay = layout.from_config(cfg)
    raw, dims_source = config.model_dims(recipe)
    dims = dims_from_config(raw, dims_source)
    gb = device_gb if device_gb is not None else device_memory_gb(lay.accelerator, lay.devices_per_node)
    checks, est = preflight.run(lay, dims, gb)
    cost = checkpoint_cost.estimate(lay.checkpoints, dims) if lay.accelerator != "cpu" else None
    input_checks = inputs.input_checks(cfg, lay)
    profile = env.load_profile(recipe.path.parent.parent, str(config.value(cfg, "launch.env_profile")))
    node_env, notes = env.node_env(profile, facts)
    run_dir = Path(logs_root) / run_id
    node_env["RAY_AUTH_MODE"] = cluster.ray_auth_mode()  # one mode for the daemons, the job and this client
    node_env["TENSORBOARD_DIR"] = str(run_dir / TENSORBOARD)  # verl's tensorboard logger writes, the summary reads
    the_plan = plan.build(recipe.name, run_id, run_dir, lay, config.value(cfg, "launch.ray"), node_env, notes,
                          profile.left_out, python, preflight.derived(lay, dims), ray_bin)
    return Prepared(recipe, the_plan, checks, est, dims_source, input_checks, cost)


def checkpoint_dir(p: Prepared) -> Path:
    """Where verl saves (trainer.default_local_dir): <recipe.checkpoints.dir>/<run id>, a directory every node
    mounts (each rank writes its own shards), else <run dir>/checkpoints. A rerun with the same run id resumes
    from the newest complete checkpoint there (verl's trainer.resume_mode auto)."""
    root = config.recipe_settings(p.recipe.cfg).checkpoints.dir
    if root:
        return Path(str(root)).expanduser().absolute() / p.plan.run_id
    return p.plan.run_dir / CHECKPOINTS


def report(p: Prepared, dry_run: bool = False) -> str:
    failed = [c for c in p.checks if not c.ok]
    missing = [c for c in p.inputs if not c.ok]
    lines = [f"preflight ({p.recipe.path.name}; model dims from {p.dims_source}):", preflight.render(p.checks), "",
             preflight.render_memory(p.estimate), ""]
    if p.checkpoint is not None:
        lines += [checkpoint_cost.render(p.checkpoint, str(checkpoint_dir(p))), ""]
    lines += [f"error: {c.message()}" for c in failed]
    lines.append(f"preflight: {len(p.checks) - len(failed)} of {len(p.checks)} checks ok")
    if p.inputs:
        lines += ["", "inputs (a dry run reports them; a run needs them):", preflight.render(p.inputs)]
        word = "needed before a run" if dry_run else "error"
        lines += [f"{word}: {c.message()}" for c in missing]
    return "\n".join(lines) + "\n"


def save_run_files(p: Prepared, venv: Path | None) -> list[str]:
    """config.yaml (as resolved), verl.yaml (what verl reads), stack.json; notes for what was skipped."""
    run_dir = p.plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _write(run_dir / "config.yaml", OmegaConf.to_yaml(p.recipe.cfg))
    verl_cfg = config.verl_config(p.recipe.cfg, config.verl_base_for(p.recipe.cfg))
    verl_cfg.trainer.default_local_dir = str(checkpoint_dir(p))
    _write(run_dir / "verl.yaml", OmegaConf.to_yaml(verl_cfg))
    _write(run_dir / "env.json", json.dumps(p.plan.env, indent=2, sort_keys=True) + "\n")
    stack = (venv or Path(sys.prefix)) / "stack.json"
    if stack.is_file():
        shutil.copyfile(stack, run_dir / "stack.json")
        return []
    return [f"{stack} not found (written by `python -m tools.install`): stack.json not saved with the run"]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@contextlib.contextmanager
def ray_client_env(pl: plan.Plan):
    """This process is a Ray client of the run's cluster: the run's auth mode while it talks to it, restored after."""
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = pl.env["RAY_AUTH_MODE"]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before


def run_head(p: Prepared, say=print) -> int:
    with ray_client_env(p.plan):
        return _run_head(p, say)


def _run_head(p: Prepared, say=print) -> int:
    pl = p.plan
    lay = pl.layout
    host_log = pl.run_dir / f"{socket.gethostname()}.log"
    head = cluster.RayProcess(pl.nodes[0].ray_command, host_log, pl.env).start()
    try:
        host, port = pl.ray_address.rsplit(":", 1)
        cluster.wait_for_port(host, int(port), attempts=20, backoff_s=0.5, max_backoff_s=5, say=say)
        cluster.wait_for_nodes(pl.ray_address, lay.nodes, pl.resource, lay.devices_per_node, pl.join_timeout_s,
                               say=say)
        _wait_for_dashboard(pl.dashboard_url)
        status = cluster.run_job(pl.dashboard_url, shlex.join(pl.trainer_command), pl.run_id, pl.env,
                                 pl.run_dir / "trainer.log", echo=say)
        say(f"job {pl.run_id}: {status}")
        return EXIT_OK if status == "SUCCEEDED" else EXIT_ERROR
    finally:
        head.stop()
        summarize(p, say)


def summarize(p: Prepared, say=print) -> None:
    """Print the per-step table from the run's TensorBoard events and save it as summary.json (also after a
    failed run: the steps that finished are worth seeing)."""
    tb_dir = p.plan.run_dir / TENSORBOARD
    steps = summary.read_steps(tb_dir) if tb_dir.is_dir() else []
    if not steps:
        say(f"summary: no step metrics in {tb_dir} (add tensorboard to trainer.logger to get them)")
        return
    lay = p.plan.layout
    rows = summary.table(steps, lay.sequences, lay.cards, layout.DIES_PER_CARD.get(lay.accelerator, 1))
    summary.write(rows, p.plan.run_dir / "summary.json")
    say(summary.render(rows, p.plan.run_dir, tb_dir))
    say(f"curves: {curves.plot({p.plan.run_id: rows}, p.plan.run_dir / 'curves.png')}")


def run_worker(p: Prepared, say=print) -> int:
    with ray_client_env(p.plan):
        return _run_worker(p, say)


def _run_worker(p: Prepared, say=print) -> int:
    pl = p.plan
    host, port = pl.ray_address.rsplit(":", 1)
    cluster.wait_for_port(host, int(port), attempts=60, backoff_s=1, max_backoff_s=30, say=say)
    me = cluster.RayProcess(pl.nodes[1].ray_command, pl.run_dir / f"{socket.gethostname()}.log", pl.env).start()
    try:
        why = cluster.watch_head(host, int(port), me)
        say(f"leaving: {why}")
        return EXIT_OK
    finally:
        me.stop()


def _wait_for_dashboard(url: str, timeout_s: float = 120) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    attempts = max(1, int(timeout_s // 2))
    cluster.wait_for_port(host, int(port), attempts=attempts, backoff_s=2, max_backoff_s=2, say=lambda _: None)
