"""`python -m tools.launch`: the command line over tools.launch (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tools.launch import cluster, config, env, run

DESCRIPTION = """\
Launch a recipe config on a Ray cluster: the same command on every node.

  python -m tools.launch CONFIG [key=value ...] --dry-run    # resolve, preflight, print the plan
  python -m tools.launch CONFIG [key=value ...]              # run this node's part

CONFIG is a verl config with a `launch:` block (nodes, devices, env profile, Ray ports), e.g.
recipes/deepseek_r1/configs/a3-128-true-weight.yaml. Overrides use OmegaConf's dotted keys:
  data.train_files=/data/deepscaler/train.parquet actor_rollout_ref.model.path=/models/DeepSeek-V3
  recipe.weights.mcore_checkpoint=/ckpt/dsv3-tp4pp8ep8 trainer.total_training_steps=5

What a run does:
  - preflight: layout and batch arithmetic and a per-die memory estimate, as a table (check, value,
    rule, ok); any failure names the config field and stops the run (exit 1).
  - the node that owns MASTER_ADDR (or --head) starts Ray's head with the device resource, waits until
    launch.nodes nodes have joined with their devices, submits the trainer as a Ray job
    (verl.trainer.main_ppo on <logs>/<run-id>/verl.yaml) and streams its log; then stops its Ray.
  - every other node joins with retry and backoff and leaves when the head's Ray stops.
  - logs/<run-id>/ holds each node's log, trainer.log, config.yaml, verl.yaml, env.json, stack.json.

Exit codes: 0 ok, 1 a preflight check failed, 2 bad config or the run failed.
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    # Ray reads RAY_AUTH_MODE once, when it is first imported, and the series check imports it through verl:
    # this process must hold the run's mode before then, or its ray.init is refused (InvalidAuthToken).
    os.environ["RAY_AUTH_MODE"] = cluster.ray_auth_mode()
    try:
        recipe = config.load(args.config, args.overrides)
        nodes = int(recipe.cfg.launch.nodes)
        master = args.master_addr or ("127.0.0.1" if nodes == 1 or args.dry_run else None)
        if not master:
            raise config.ConfigError(f"launch.nodes is {nodes}: set MASTER_ADDR (or --master-addr) to the head's"
                                     " address on every node")
        if not args.master_addr and nodes > 1:
            print("note: MASTER_ADDR is not set: planned as if this node were the head (127.0.0.1)")
        facts = env.gather_facts(master)
        if args.ifname:
            facts = env.NodeFacts(master, args.ifname, facts.node_ip, facts.master_is_local, facts.jemalloc)
        run_id = args.run_id or f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        ray_bin = Path(sys.executable).with_name("ray")
        prepared = run.prepare(recipe, facts, run_id, args.logs.resolve(),
                               ray_bin=str(ray_bin) if ray_bin.exists() else "ray")
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
    for note in run.save_run_files(prepared, args.venv):
        print(f"note: {note}")
    is_head = args.head or facts.master_is_local
    try:
        return run.run_head(prepared) if is_head else run.run_worker(prepared)
    except cluster.ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return run.EXIT_ERROR
