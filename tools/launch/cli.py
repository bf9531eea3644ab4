"""`python -m tools.launch`: the command line over tools.launch (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tools.launch import cluster, config, env, resume, run

DESCRIPTION = """\
Launch a recipe config on a Ray cluster: the same command on every node.

  python -m tools.launch CONFIG [key=value ...] --dry-run    # resolve, preflight, print the plan
  python -m tools.launch CONFIG [key=value ...]              # run this node's part
  python -m tools.launch CONFIG [key=value ...] --resume logs/<run id>   # continue a run that stopped

CONFIG is a verl config with a `launch:` block (nodes, devices, env profile, Ray ports), e.g.
recipes/deepseek_r1/configs/a3-128-true-weight.yaml. Overrides use OmegaConf's dotted keys:
  data.train_files=/data/deepscaler/train.parquet actor_rollout_ref.model.path=/models/DeepSeek-V3
  recipe.weights.mcore_checkpoint=/ckpt/dsv3-tp4pp8ep8 trainer.total_training_steps=5

What a run does:
  - preflight: layout and batch arithmetic and a per-die memory estimate, as a table (check, value,
    rule, ok); any failure names the config field and stops the run (exit 1). On A3 it also predicts
    the step time per phase (rollout, ref, update, reshard, ...) next to each phase's physical limit,
    with TPS per card; --what-if key=value shows what an override would change.
  - the node that owns MASTER_ADDR (or --head) starts Ray's head with the device resource, waits until
    launch.nodes nodes have joined with their devices, submits the trainer as a Ray job
    (verl.trainer.main_ppo on <logs>/<run-id>/verl.yaml) and streams its log; then stops its Ray.
  - every other node joins with retry and backoff and leaves when the head's Ray stops.
  - logs/<run-id>/ holds each node's log, trainer.log, config.yaml, verl.yaml, env.json, stack.json.

Checkpoints, faults and resume:
  - verl saves every trainer.save_freq steps to <recipe.checkpoints.dir>/<run id> (a directory every node
    mounts; without it <run dir>/checkpoints) and keeps the newest trainer.max_actor_ckpt_to_keep. A checkpoint
    counts once latest_checkpointed_iteration.txt names it, written after every rank finished its save.
  - while the trainer runs, the head asks Ray every few seconds for a dead rank or node; on one it stops the
    job, names the rank(s), node and phase, stops every process of the run and prints the --resume command.
  - --resume RUN_DIR continues that run (same run dir, TensorBoard appended) from its last complete checkpoint:
    step counter, weights, optimizer, RNG and data order. Saves a fault cut off are renamed global_step_N.partial
    and kept. Refused, naming the field: no complete checkpoint, a changed layout, a changed model.
    With --dry-run it names the checkpoint it would continue from (step, time, size).

Exit codes: 0 ok, 1 a preflight check failed, 2 bad config, the run failed or a rank or node died.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.launch", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="recipe config (recipes/<recipe>/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="OmegaConf dotted overrides")
    p.add_argument("--dry-run", action="store_true", help="preflight and print the plan; start nothing")
    p.add_argument("--head", action="store_true", help="this node is the head, whatever MASTER_ADDR says")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                   help="the head's address (default $MASTER_ADDR; 127.0.0.1 for a one-node run)")
    p.add_argument("--ifname", help="network interface to use instead of the one `ip route get` finds")
    p.add_argument("--run-id", default=os.environ.get("RUN_ID"),
                   help="name of the run and its log folder (default $RUN_ID, else <config>-<UTC time>)")
    p.add_argument("--logs", type=Path, default=Path("logs"), help="where run folders go (default logs/)")
    p.add_argument("--venv", type=Path, default=None, help="environment whose stack.json is saved (default: this one)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (logs/<run id>) from its last complete checkpoint")
    p.add_argument("--what-if", action="append", default=[], metavar="key=value",
                   help="also predict the step time with this override on top and print the change per phase"
                        " (repeatable; e.g. --what-if actor_rollout_ref.tensor_cache.enable=false)")
    return p


def run_location(args, recipe: config.Recipe, is_head: bool) -> tuple[str, Path]:
    """The run id and the folder of run dirs: --resume's run dir, else --run-id (or the config and the time)
    under --logs. Only the head reads the resumed run's files; another node only joins."""
    if args.resume is None:
        return args.run_id or f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}", args.logs.resolve()
    run_dir = args.resume.resolve()
    if args.run_id and args.run_id != run_dir.name:
        raise config.ConfigError(f"--run-id {args.run_id} and --resume {args.resume} name two runs: drop --run-id")
    if is_head and not run_dir.is_dir():
        raise config.ConfigError(f"--resume {args.resume}: no such run directory (runs are under --logs, e.g."
                                 " logs/<run id>)")
    return run_dir.name, run_dir.parent


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    # Ray reads RAY_AUTH_MODE once, when it is first imported, and the series check imports it through verl:
    # this process must hold the run's mode before then, or its ray.init is refused (InvalidAuthToken).
    os.environ["RAY_AUTH_MODE"] = cluster.ray_auth_mode()
    try:
        recipe = config.load(args.config, args.overrides)
        nodes = recipe.launch.nodes
        master = args.master_addr or ("127.0.0.1" if nodes == 1 or args.dry_run else None)
        if not master:
            raise config.ConfigError(f"launch.nodes is {nodes}: set MASTER_ADDR (or --master-addr) to the head's"
                                     " address on every node")
        if not args.master_addr and nodes > 1:
            print("note: MASTER_ADDR is not set: planned as if this node were the head (127.0.0.1)")
        facts = env.gather_facts(master)
        if args.ifname:
            facts = env.NodeFacts(master, args.ifname, facts.node_ip, facts.master_is_local, facts.jemalloc)
        is_head = args.head or facts.master_is_local
        run_id, logs = run_location(args, recipe, is_head)
        ray_bin = Path(sys.executable).with_name("ray")
        prepared = run.prepare(recipe, facts, run_id, logs, ray_bin=str(ray_bin) if ray_bin.exists() else "ray",
                               what_if=tuple(args.what_if))
        cut = run.find_resume(prepared) if args.resume and is_head else []
        if not args.resume and is_head:
            run.refuse_saved_run(prepared)
    except config.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return run.EXIT_ERROR
    from tools.launch import plan as plan_mod

    print(run.report(prepared, dry_run=args.dry_run), end="")
    print(plan_mod.render(prepared.plan), end="")
    if not prepared.ok:
        return run.EXIT_CHECK
    if args.dry_run:
        return run.EXIT_OK
    if not prepared.ready:
        return run.EXIT_CHECK
    for moved in resume.set_aside(cut):
        print(f"note: {moved.name}: a save that did not complete, set aside for inspection ({moved})")
    for note in run.save_run_files(prepared, args.venv):
        print(f"note: {note}")
    try:
        return run.run_head(prepared) if is_head else run.run_worker(prepared)
    except cluster.ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return run.EXIT_ERROR
