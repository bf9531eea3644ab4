"""Prepare a run (config -> checks -> plan) and execute one node's part of it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from tools.launch import (
    cluster,
    config,
    env,
    faults,
    inputs,
    layout,
    plan,
    preflight,
    resume,
)
from tools.model.dims import dims_from_config
from tools.perf import checkpoint_cost, reference_runs, timing
from tools.perf.memory import Estimate
from tools.report import curves, summary

EXIT_OK, EXIT_CHECK, EXIT_ERROR = 0, 1, 2
TENSORBOARD = "tensorboard"  # <run dir>/tensorboard
CHECKPOINTS = "checkpoints"  # <run dir>/checkpoints, where a run saves without recipe.checkpoints.dir
# starts of a one-node run's head that Ray itself gave up on as too slow (cluster.SlowStart). A run of more nodes
# starts it once: its workers joined the failed head's GCS and leave with it, so a second head would wait for them.
HEAD_STARTS = 3
# verl's trainer keys that the launcher writes into verl.yaml (save_run_files), and what to use instead
LAUNCHER_KEYS = {
    "trainer.default_local_dir": "set recipe.checkpoints.dir (runs save to <it>/<run id>, or <run dir>/checkpoints)",
    "trainer.resume_mode": "continue a run with --resume RUN_DIR (a new run never loads a checkpoint)",
    "trainer.resume_from_path": "continue a run with --resume RUN_DIR (from its last complete checkpoint)",
}


@dataclass
class Prepared:
    recipe: config.Recipe
    plan: plan.Plan
    checks: list[preflight.Check]
    estimate: Estimate
    dims_source: str
    inputs: list[preflight.Check]  # paths and required settings: a dry run reports them, a run needs them
    checkpoint: checkpoint_cost.Cost | None = None  # a device profile's checkpoint size and write time

    resume: resume.Checkpoint | None = None  # --resume: the checkpoint the run continues from
    timing: timing.Prediction | str | None = None  # the step-time prediction, or why there is none
    what_if: tuple[tuple[str, ...], timing.Prediction | str] | None = None  # --what-if overrides, their prediction

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
            python: str = sys.executable, ray_bin: str = "ray", device_gb: float | None = None,
            what_if: tuple[str, ...] = ()) -> Prepared:
    cfg = recipe.cfg
    config.check_series(cfg, config.verl_base_for(cfg))  # verl's settings, by our verl series' own validators
    for key in LAUNCHER_KEYS:
        if config.value(cfg, key) is not None:
            raise config.ConfigError(f"{key} is set by the launcher: {LAUNCHER_KEYS[key]}")
    lay = recipe.layout
    raw, dims_source = config.model_dims(recipe)
    dims = dims_from_config(raw, dims_source)
    gb = device_gb if device_gb is not None else device_memory_gb(lay.accelerator, lay.devices_per_node)
    checks, est = preflight.run(lay, dims, gb)
    cost = checkpoint_cost.estimate(lay.checkpoints, dims) if lay.accelerator != "cpu" else None
    input_checks = inputs.input_checks(recipe)
    profile = env.load_profile(recipe.path.parent.parent, recipe.launch.env_profile)
    node_env, notes = env.node_env(profile, facts)
    run_dir = Path(logs_root) / run_id
    node_env["RAY_AUTH_MODE"] = cluster.ray_auth_mode()  # one mode for the daemons, the job and this client
    node_env["TENSORBOARD_DIR"] = str(run_dir / TENSORBOARD)  # verl's tensorboard logger writes, the summary reads
    the_plan = plan.build(recipe.name, run_id, run_dir, lay, dataclasses.asdict(recipe.launch.ray), node_env, notes,
                          profile.left_out, python, preflight.derived(lay, dims), ray_bin)
    prepared = Prepared(recipe, the_plan, checks, est, dims_source, input_checks, cost)
    prepared.timing = predict_step(prepared, dims)
    if what_if and isinstance(prepared.timing, timing.Prediction):
        prepared.what_if = (tuple(what_if), predict_variant(recipe, tuple(what_if), dims, gb))
    return prepared


def predict_step(p: Prepared, dims) -> timing.Prediction | str:
    """The step-time prediction of a device run whose arithmetic holds, else the reason there is none."""
    accelerator = p.plan.layout.accelerator
    if accelerator != "a3":
        return (f"no step-time prediction for launch.accelerator {accelerator}: the model's constants and fit are"
                " Atlas A3's (tools/perf/timing.py)")
    if not p.ok:
        return "no step-time prediction: a preflight check failed"
    return timing.predict(timing.run_from_config(p.recipe), dims, reference_runs.fit())


def predict_variant(recipe: config.Recipe, what_if: tuple[str, ...], dims, device_gb: float) -> timing.Prediction | str:
    """The prediction with the --what-if overrides on top, when that variant passes preflight's arithmetic."""
    variant = config.load(recipe.path, (*recipe.overrides, *what_if))
    checks, _ = preflight.run(variant.layout, dims, device_gb)
    failed = next((c for c in checks if not c.ok), None)
    if failed is not None:
        return f"no prediction, the variant fails preflight: {failed.message()}"
    return timing.predict(timing.run_from_config(variant), dims, reference_runs.fit())


def checkpoint_dir(p: Prepared) -> Path:
    """Where verl saves (trainer.default_local_dir): <recipe.checkpoints.dir>/<run id>, a directory every node
    mounts (each rank writes its own shards), else <run dir>/checkpoints. Only --resume continues from it."""
    root = p.recipe.settings.checkpoints.dir
    if root:
        return Path(str(root)).expanduser().absolute() / p.plan.run_id
    return p.plan.run_dir / CHECKPOINTS


def find_resume(p: Prepared) -> list[Path]:
    """--resume: set p.resume to the last complete checkpoint of the run in p's run dir and return the cut-off
    saves beside it; ConfigError (naming the field and the fix) when it cannot continue."""
    saved_to, now = resume.checkpoint_dir(p.plan.run_dir), checkpoint_dir(p)
    if saved_to != now:
        raise config.ConfigError(f"recipe.checkpoints.dir: the run saved to {saved_to}, this config would save to"
                                 f" {now}: set recipe.checkpoints.dir={saved_to.parent}")
    p.resume, cut = resume.find(p.plan.run_dir, p.recipe, config.model_dims(p.recipe)[0])
    return cut


def refuse_saved_run(p: Prepared) -> None:
    """A new run must not start over a run dir or checkpoint dir that holds checkpoints: it would mix two runs."""
    where = checkpoint_dir(p)
    found = resume.latest(where)
    if found is not None:
        raise config.ConfigError(f"{p.plan.run_dir} is a run with checkpoints ({found.describe()}): continue it with"
                                 f" --resume {p.plan.run_dir}, or choose another --run-id")


def resume_command(p: Prepared) -> str:
    """The command that continues this run from its last complete checkpoint (the launcher's own arguments); with
    more than one node it names the head, so that it also serves, unchanged, on every other node."""
    head = ["--master-addr", p.plan.master_addr] if p.plan.layout.nodes > 1 else []
    return shlex.join([sys.executable, "-m", "tools.launch", str(p.recipe.path), *p.recipe.overrides, *head,
                       "--resume", str(p.plan.run_dir)])


def report(p: Prepared, dry_run: bool = False) -> str:
    failed = [c for c in p.checks if not c.ok]
    missing = [c for c in p.inputs if not c.ok]
    lines = [f"preflight ({p.recipe.path.name}; model dims from {p.dims_source}):", preflight.render(p.checks), "",
             preflight.render_memory(p.estimate), ""]
    if p.checkpoint is not None:
        lines += [checkpoint_cost.render(p.checkpoint, str(checkpoint_dir(p))), ""]
    lines += [render_timing(p), ""]
    if p.resume is not None:
        lines += [f"resume: continues {p.plan.run_id} from {p.resume.describe()}", ""]
    lines += [f"error: {c.message()}" for c in failed]
    lines.append(f"preflight: {len(p.checks) - len(failed)} of {len(p.checks)} checks ok")
    if p.inputs:
        lines += ["", "inputs (a dry run reports them; a run needs them):", preflight.render(p.inputs)]
        word = "needed before a run" if dry_run else "error"
        lines += [f"{word}: {c.message()}" for c in missing]
    return "\n".join(lines) + "\n"


def render_timing(p: Prepared) -> str:
    if not isinstance(p.timing, timing.Prediction):
        return p.timing or ""
    out = timing.render(p.timing, "step time (prediction, fitted on the reference's true-weight step;"
                                  " tools/perf/timing.py):")
    if p.what_if:
        overrides, other = p.what_if
        title = f"what-if {' '.join(overrides)}:"
        out += "\n\n" + (timing.render_delta(p.timing, other, title) if isinstance(other, timing.Prediction)
                          else f"{title} {other}")
    return out


def save_run_files(p: Prepared, venv: Path | None) -> list[str]:
    """config.yaml (as resolved), verl.yaml (what verl reads), stack.json; notes for what was skipped."""
    run_dir = p.plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _write(run_dir / "config.yaml", OmegaConf.to_yaml(p.recipe.cfg))
    verl_cfg = config.verl_config(p.recipe.cfg, config.verl_base_for(p.recipe.cfg))
    verl_cfg.trainer.default_local_dir = str(checkpoint_dir(p))
    verl_cfg.trainer.resume_mode = "auto" if p.resume else "disable"
    if p.resume:  # its validation, if any, ran before the checkpoint; again, it would draw from the restored RNG
        verl_cfg.trainer.val_before_train = False
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
    head = None
    try:
        head = start_head(pl, say)
        _wait_for_dashboard(pl.dashboard_url)
        seen: list[faults.Fault] = []
        status = cluster.run_job(pl.dashboard_url, shlex.join(pl.trainer_command), pl.run_id, pl.env,
                                 pl.run_dir / "trainer.log", echo=say, watch=lambda: _watch(pl, seen, say))
        say(f"job {pl.run_id}: {status}")
        if status != "SUCCEEDED":
            _watch(pl, seen, say)  # the trainer may have failed on the dead rank before the watch saw it
            if seen and (settled := faults.settle(lambda: _scan(pl, say), seen[0])) is not seen[0]:
                say(f"fault: {settled.message()} (Ray declared the node dead after its ranks)")
                seen[0] = settled
            say(failure(p, seen[0] if seen else None))
        return EXIT_OK if status == "SUCCEEDED" else EXIT_ERROR
    finally:
        if head is not None:
            head.stop()
        stop_leftovers(pl, say)
        summarize(p, say)


def start_head(pl: plan.Plan, say=print) -> cluster.RayProcess:
    """Start the head's Ray and wait, within launch.ray.join_timeout_s, for every node to join. On one node, a
    start that Ray gave up on as too slow is made again on the same port, up to HEAD_STARTS; any other failure
    ends the run."""
    deadline = time.monotonic() + pl.join_timeout_s
    starts = HEAD_STARTS if pl.layout.nodes == 1 else 1
    host, port = pl.ray_address.rsplit(":", 1)
    attempt = 1
    while True:
        head = cluster.RayProcess(pl.nodes[0].ray_command, pl.run_dir / f"{socket.gethostname()}.log", pl.env).start()
        try:
            cluster.wait_for_port(host, int(port), attempts=20, backoff_s=0.5, max_backoff_s=5, say=say, head=head)
            cluster.wait_for_nodes(pl.ray_address, pl.layout.nodes, pl.resource, pl.layout.devices_per_node,
                                   max(deadline - time.monotonic(), 1.0), say=say, head=head)
            return head
        except cluster.SlowStart:
            head.stop()
            if attempt == starts or time.monotonic() >= deadline:
                raise
            say(f"the head's Ray gave up on its own start ({cluster.SLOW_START}; start {attempt} of {starts},"
                f" its log: {head.log_path}); starting it again")
            _wait_port_closed(host, int(port))
            attempt += 1
        except BaseException:
            head.stop()
            raise


def _wait_port_closed(host: str, port: int, timeout_s: float = 30.0) -> None:
    """The failed head's GCS dies with its `ray start` (Ray's fate sharing); a new start must find the port free."""
    deadline = time.monotonic() + timeout_s
    while cluster.port_open(host, port):
        if time.monotonic() >= deadline:
            raise cluster.ClusterError(f"port {port} still answers {timeout_s:g} s after the head's Ray exited:"
                                       " stop the Ray that holds it (`ray stop`), then rerun")
        time.sleep(0.5)


def _scan(pl: plan.Plan, say) -> faults.Fault | None:
    try:
        return faults.scan(pl.dashboard_url)
    except Exception as exc:  # noqa: BLE001 - a state-API hiccup must not end the run; the next poll retries
        say(f"watch: Ray's state API did not answer ({type(exc).__name__}: {exc})")
        return None


def _watch(pl: plan.Plan, seen: list, say) -> faults.Fault | None:
    if not seen:
        fault = _scan(pl, say)
        if fault is not None:
            seen.append(fault)
            say(f"fault: {fault.message()}: stopping the job")
    return seen[0] if seen else None


def failure(p: Prepared, fault: faults.Fault | None) -> str:
    """What failed (the dead rank, the trainer's last error, a full checkpoint disk), the checkpoint a resume
    would continue from, and the command."""
    log = p.plan.run_dir / "trainer.log"
    error = last_error(log)
    what = (fault.message() + (f"; the trainer's last error: {error}" if error else "") if fault
            else f"the trainer failed: {error or 'no error line'} (see {log})")
    ckpt = checkpoint_dir(p)
    found = resume.latest(ckpt)
    full = disk_full(ckpt, found.nbytes if found else 0)
    if full:
        what += f". {full}"
    if found is None:
        return (f"error: {what}. No complete checkpoint was saved (trainer.save_freq"
                f" {p.plan.layout.checkpoints.save_freq}): rerun from the start")
    return (f"error: {what}. Last complete checkpoint: {found.describe()}. Continue the run with:\n"
            f"  {resume_command(p)}")


def disk_full(ckpt_dir: Path, checkpoint_bytes: int) -> str | None:
    """A sentence when the checkpoint directory's filesystem has less room than one more checkpoint (a save cut
    off by a full disk surfaces in a rank as a write error or a crash, seldom as ENOSPC itself)."""
    where = next((d for d in (ckpt_dir, *ckpt_dir.parents) if d.exists()), None)
    if where is None or checkpoint_bytes <= 0:
        return None
    usage = shutil.disk_usage(where)
    if usage.free >= checkpoint_bytes:
        return None
    return (f"The checkpoint filesystem is full: {ckpt_dir} has {usage.free / 1e6:.1f} MB free of"
            f" {usage.total / 1e6:.1f} MB, one checkpoint takes {checkpoint_bytes / 1e6:.1f} MB: free space there"
            " before continuing")


LEFTOVER_GRACE_S = 20.0  # Ray's workers exit by themselves within seconds of their raylet
ERROR_LINE = re.compile(r"(?:^|\) )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)(?:\([^)]*\))?: .+)$")


def last_error(log: Path) -> str | None:
    """The last exception line of a trainer log ("OSError: [Errno 28] No space left on device"), Ray's prefixes
    dropped."""
    if not log.is_file():
        return None
    found = [m.group(1) for line in log.read_text(errors="replace").splitlines() if (m := ERROR_LINE.search(line))]
    return found[-1].strip() if found else None


def stop_leftovers(pl: plan.Plan, say) -> None:
    """Processes of this run that outlived its Ray by more than LEFTOVER_GRACE_S (found by the run's environment)
    are stopped and reported."""
    left = faults.wait_gone(f"TENSORBOARD_DIR={pl.env['TENSORBOARD_DIR']}", LEFTOVER_GRACE_S)
    killed = faults.stop_processes(left) if left else []
    say(f"processes of the run left after Ray stopped: {len(left)}"
        + (f" (stopped: {', '.join(map(str, left))}; killed after the grace: {len(killed)})" if left else ""))


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
        stop_leftovers(pl, say)


def _wait_for_dashboard(url: str, timeout_s: float = 120) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    attempts = max(1, int(timeout_s // 2))
    cluster.wait_for_port(host, int(port), attempts=attempts, backoff_s=2, max_backoff_s=2, say=lambda _: None)
