"""The plan of a run: per node, its role, environment, Ray command and (head) the trainer job. Pure.

Every node runs the same launcher command; the node that owns MASTER_ADDR (or is given --head) becomes the
head. The plan is what `--dry-run` prints and what `run` executes.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tools.launch.layout import RAY_RESOURCE, Layout

VERL_CONFIG_NAME = "verl"  # <run dir>/verl.yaml, the config verl's hydra main reads


@dataclass(frozen=True)
class NodePlan:
    index: int
    role: str  # head | worker
    ray_command: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    recipe: str
    run_id: str
    run_dir: Path
    layout: Layout
    master_addr: str
    env: dict[str, str]
    notes: tuple[str, ...]
    left_out: dict[str, str]
    nodes: tuple[NodePlan, ...]
    trainer_command: tuple[str, ...]
    dashboard_url: str
    ray_address: str
    join_timeout_s: float
    derived: list[tuple[str, str]] = field(default_factory=list)

    @property
    def resource(self) -> str | None:
        return RAY_RESOURCE.get(self.layout.accelerator)


def resources_arg(lay: Layout) -> tuple[str, ...]:
    name = RAY_RESOURCE.get(lay.accelerator)
    return ("--resources", json.dumps({name: lay.devices_per_node})) if name else ()


def cpus_arg(lay: Layout) -> tuple[str, ...]:
    """On CPU the ranks are Ray CPU bundles (verl's pools with trainer.device=cpu), next to verl's driver task: ask
    for that many logical CPUs even on a machine with fewer cores (they share them; OMP_NUM_THREADS=1)."""
    if RAY_RESOURCE.get(lay.accelerator):
        return ()
    return ("--num-cpus", str(lay.devices_per_node + CPU_RANK_HEADROOM))


CPU_RANK_HEADROOM = 2  # verl's TaskRunner and one spare for Ray's own tasks


def head_command(lay: Layout, master_addr: str, port: int, dashboard_port: int, ray_bin: str = "ray",
                 extra: tuple[str, ...] = ()) -> tuple:
    # --block: the daemons live as long as this child of the launcher, which stops exactly them.
    # The dashboard (Jobs API) listens on loopback only: the launcher on the head is its one client.
    return (ray_bin, "start", "--head", "--block", "--node-ip-address", master_addr, "--port", str(port),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--num-gpus", "0",
            *cpus_arg(lay), *resources_arg(lay), "--disable-usage-stats", *extra)


def worker_command(lay: Layout, master_addr: str, port: int, ray_bin: str = "ray",
                   extra: tuple[str, ...] = ()) -> tuple:
    return (ray_bin, "start", "--block", "--address", f"{master_addr}:{port}", "--num-gpus", "0",
            *cpus_arg(lay), *resources_arg(lay), "--disable-usage-stats", *extra)


def trainer_command(python: str, run_dir: Path) -> tuple[str, ...]:
    # hydra.run.dir: verl's hydra main runs (and writes its outputs/ folder) in the run's folder, not the job's cwd
    return (python, "-m", "verl.trainer.main_ppo", "--config-path", str(run_dir), "--config-name", VERL_CONFIG_NAME,
            f"hydra.run.dir={run_dir}")


def build(recipe: str, run_id: str, run_dir: Path, lay: Layout, ray_cfg: dict, env: dict[str, str],
          notes: list[str], left_out: dict[str, str], python: str, derived: list[tuple[str, str]],
          ray_bin: str = "ray") -> Plan:
    master = env["MASTER_ADDR"]
    port, dash = int(ray_cfg["port"]), int(ray_cfg["dashboard_port"])
    extra = tuple(str(a) for a in ray_cfg.get("extra_start_args") or ())  # e.g. fixed ports a firewall needs
    nodes = [NodePlan(0, "head", head_command(lay, master, port, dash, ray_bin, extra))]
    nodes += [NodePlan(i, "worker", worker_command(lay, master, port, ray_bin, extra)) for i in range(1, lay.nodes)]
    return Plan(recipe, run_id, run_dir, lay, master, env, tuple(notes), left_out, tuple(nodes),
                trainer_command(python, run_dir), f"http://127.0.0.1:{dash}", f"{master}:{port}",
                float(ray_cfg.get("join_timeout_s", 600)), derived)


def render(plan: Plan) -> str:
    lay = plan.layout
    devices = f"{lay.devices_per_node} {plan.resource}" if plan.resource else f"{lay.devices_per_node} CPU ranks"
    out = [f"plan: {plan.recipe}, run {plan.run_id}, {lay.nodes} node(s) x {devices} ({lay.accelerator})",
           f"logs: {plan.run_dir}/ (<host>.log per node, trainer.log, config.yaml, verl.yaml, stack.json)", "",
           "sizes:"]
    width = max(len(k) for k, _ in plan.derived) if plan.derived else 0
    out += [f"  {k:<{width}}  {v}" for k, v in plan.derived]
    out += ["", "environment (every node; interfaces are detected on each node from `ip route get MASTER_ADDR`):"]
    out += [f"  {k}={v}" for k, v in plan.env.items()]
    out += [f"  note: {n}" for n in plan.notes]
    out += [f"  left out: {k} ({why})" for k, why in plan.left_out.items()]
    for node in plan.nodes:
        out += ["", _node_title(plan, node), f"  ray: {shlex.join(node.ray_command)}"]
        if node.role == "head":
            want = f"{plan.resource} >= {lay.devices_per_node} each" if plan.resource else "any resources"
            out += [f"  wait: {lay.nodes} node(s) alive with {want} (ray.nodes(), timeout {plan.join_timeout_s:g} s)",
                    f"  job: {shlex.join(plan.trainer_command)}",
                    f"       submitted as {plan.run_id} through the Ray Jobs API at {plan.dashboard_url},"
                    " log streamed to trainer.log",
                    "  end: stops the Ray head it started (its own process only)"]
        else:
            out += [f"  join: waits for {plan.ray_address} with backoff, then joins; leaves when the head's Ray"
                    " stops (job ended)"]
    return "\n".join(out) + "\n"


def _node_title(plan: Plan, node: NodePlan) -> str:
    if node.role == "head":
        return f"node 0: head (owns MASTER_ADDR {plan.master_addr}, or --head)"
    return f"node {node.index}: worker"
