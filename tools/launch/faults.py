"""What the head launcher watches while the trainer runs: a rank or a node that died, and what a run left behind.

verl's trainer notices a dead worker only when it next waits on it, and its other ranks may then sit in a
collective until gloo's or HCCL's timeout (30 min by default). So the launcher asks Ray itself, every few seconds,
through the dashboard's state API: a worker actor (verl names them <prefix>WorkerDict_<node>:<local rank> and gives
each its global RANK in its env) that is DEAD, or a node that is DEAD, is a fault. It then stops the job and names
the ranks, the node and the phase (the worker method the dead rank was running).

Every process a run starts (the Ray daemons, verl's workers, vLLM's) inherits the run's environment, which holds
its own TENSORBOARD_DIR; `run_processes` finds what is left of a run by it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = re.compile(r"WorkerDict_\d+:\d+$")  # verl's RayWorkerGroup: f"{prefix}{class}_{pg_idx}:{local_rank}"
# Ray's ActorDiedErrorContext.reason for a death nobody asked for (ray.kill and an exiting owner end workers on purpose)
FAULT_REASONS = ("WORKER_DIED", "NODE_DIED", "OUT_OF_MEMORY")
ROLE_PREFIX = re.compile(r"^(actor_rollout_ref|actor_rollout|actor|rollout|ref|critic|rm)_")  # fused method names


@dataclass(frozen=True)
class Fault:
    ranks: tuple[int, ...]
    node: str  # the node's IP
    pids: tuple[int, ...]
    phase: str  # the worker method the first dead rank was running, "" when Ray recorded none
    node_died: bool
    actor_ids: frozenset[str] = frozenset()  # every dead worker seen, to ignore in a later scan
    after: tuple[int, ...] = ()  # ranks that died after these (their collectives failed)
    seen_at: float = 0.0  # time.monotonic() of the scan that found it

    def message(self) -> str:
        who = (f"node {self.node} left the cluster with rank(s) {_ranks(self.ranks)}" if self.node_died
               else f"rank {_ranks(self.ranks)} (pid {', '.join(map(str, self.pids))} on {self.node}) died")
        return (who + (f" during {self.phase}" if self.phase else "")
                + (f" (then rank(s) {_ranks(self.after)})" if self.after else ""))


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "?"


def _rank(actor) -> int | None:
    env = json.loads(getattr(actor, "serialized_runtime_env", None) or "{}").get("env_vars", {})
    return int(env["RANK"]) if "RANK" in env else None


def phase_of(task_names: list[str]) -> str:
    """The worker method among Ray's task names of an actor ("WorkerDict.actor_rollout_ref_update_actor" ->
    "update_actor"): the last one not finished."""
    methods = [n.rsplit(".", 1)[-1] for n in task_names if not n.endswith("__init__")]
    return ROLE_PREFIX.sub("", methods[-1]) if methods else ""


def _reason(actor) -> str:
    return ((actor.death_cause or {}).get("actor_died_error_context") or {}).get("reason", "")


def _unfinished_tasks(address: str, actor_id: str) -> list:
    """The tasks of an actor that did not finish, oldest first (a dead rank's is the call it died in)."""
    from ray.util.state import list_tasks

    tasks = list_tasks(address=address, filters=[("actor_id", "=", actor_id)], detail=True, limit=10000,
                       raise_on_missing_output=False)
    return sorted((t for t in tasks if t.state != "FINISHED" and t.name), key=lambda t: t.creation_time_ms or 0)


def _died_at(tasks: list) -> float:
    """When Ray failed the actor's last call (ms), infinity when it recorded none."""
    ends = [t.end_time_ms for t in tasks if t.end_time_ms]
    return max(ends) if ends else math.inf


def scan(address: str, ignore: frozenset[str] = frozenset()) -> Fault | None:
    """A verl worker that died unasked (its process or its node) in the cluster whose dashboard is at `address`
    (http://host:port); actors whose id is in `ignore` do not count. A rank's death takes its peers down with it
    within moments (their collectives fail): the one whose last call failed first is named, the others after it.
    A worker on a dead node counts whatever reason Ray recorded: once the job is stopped for its peers, Ray may
    record a lost node's workers as OWNER_DIED (the driver went first) before it declares the node dead."""
    from ray.util.state import list_actors, list_nodes

    dead_nodes = {n.node_id: n.node_ip for n in list_nodes(address=address, filters=[("state", "=", "DEAD")],
                                                                 raise_on_missing_output=False)}
    dead = [a for a in list_actors(address=address, filters=[("state", "=", "DEAD")], detail=True, limit=10000,
                                    raise_on_missing_output=False)
            if a.name and WORKER.search(a.name) and a.actor_id not in ignore
            and (_reason(a) in FAULT_REASONS or a.node_id in dead_nodes)]
    if not dead:
        return None
    tasks = {a.actor_id: _unfinished_tasks(address, a.actor_id) for a in dead}
    on_dead_node = [a for a in dead if a.node_id in dead_nodes]
    order = sorted(dead, key=lambda a: (_died_at(tasks[a.actor_id]), _rank(a) is None, _rank(a) or 0))
    chosen = on_dead_node or order[:1]
    first = chosen[0]
    node = dead_nodes.get(first.node_id) or _node_ip(address, first.node_id)
    ranks = tuple(sorted(r for a in chosen if (r := _rank(a)) is not None))
    after = tuple(sorted(r for a in dead if a not in chosen and (r := _rank(a)) is not None))
    return Fault(ranks, node, tuple(a.pid for a in chosen if a.pid), phase_of([t.name for t in tasks[first.actor_id]]),
                 bool(on_dead_node), frozenset(a.actor_id for a in dead), after, time.monotonic())


# Ray's raylet health check misses 5 checks 3 s apart before the GCS declares a node dead: 16.8 s from SIGKILL to
# DEAD measured on an idle 2-core machine; the rest is margin for a GCS on a busy head.
NODE_DEATH_S = 30.0


def settle(scan_once, fault: Fault, timeout_s: float = NODE_DEATH_S, poll_s: float = 1.0,
           sleep=time.sleep, clock=time.monotonic) -> Fault:
    """The fault as Ray states it once it had time to declare a lost node. The ranks of a node that went away are
    seen dead seconds before the node is (their owner notices the broken connection first, the health check needs
    its misses), so a rank fault is scanned again until its node is declared dead or `timeout_s` has passed since
    the fault was first seen."""
    deadline = fault.seen_at + timeout_s
    while not fault.node_died and clock() < deadline:
        again = scan_once()
        if again is not None and again.node_died:
            return again
        sleep(poll_s)
    return fault


def _node_ip(address: str, node_id: str) -> str:
    from ray.util.state import list_nodes

    ips = [n.node_ip for n in list_nodes(address=address, filters=[("node_id", "=", node_id)],
                                        raise_on_missing_output=False)]
    return ips[0] if ips else node_id[:8]


def run_processes(marker: str) -> list[int]:
    """PIDs of this machine's processes whose environment holds `marker` (e.g. TENSORBOARD_DIR=<run dir>/...)."""
    needle = marker.encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ + b"\0":
            found.append(int(proc.name))
    return sorted(found)


def wait_gone(marker: str, timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for the processes holding `marker` to exit; the PIDs still there. Ray's workers
    leave by themselves once their raylet is gone, a moment after `ray start` returns."""
    deadline = time.monotonic() + timeout_s
    while (left := run_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop_processes(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL what is still there after `grace_s`; the PIDs that had to be killed."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    killed = [p for p in pids if _alive(p)]
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    return killed


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; its parent has not reaped it yet
