"""What the head's watch sees, on a real local Ray cluster (ray.cluster_utils): a killed rank, a removed node, a job
left hanging on a dead rank, a run's leftover processes, and a launcher killed under its `ray start`.

Workers are actors named and numbered as verl's RayWorkerGroup names them (<prefix>WorkerDict_<pg>:<local rank>,
RANK in their env), so `faults.scan` reads them as it reads verl's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import stack

ray = stack.require("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.gloo import free_port  # noqa: E402
from tools.launch import cluster, faults, run  # noqa: E402

NODE = {"num_cpus": 2, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}


@pytest.fixture(scope="module")
def two_nodes():
    dash = free_port()
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": True, "dashboard_host": "127.0.0.1",
                                                      "dashboard_port": dash, "resources": {"head": 4}})
    c.add_node(**NODE, resources={"second": 4})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c, f"http://127.0.0.1:{dash}"
    ray.shutdown()
    c.shutdown()


@ray.remote(num_cpus=0)
class WorkerDict:
    def pid(self) -> int:
        return os.getpid()

    def actor_rollout_ref_update_actor(self) -> None:
        time.sleep(600)


def workers(prefix: str, node_resource: str, first_rank: int, n: int = 2) -> list:
    return [WorkerDict.options(name=f"{prefix}WorkerDict_0:{i}", resources={node_resource: 0.1},
                               runtime_env={"env_vars": {"RANK": str(first_rank + i)}}).remote() for i in range(n)]


def wait_for_fault(dashboard: str, timeout_s: float = 60) -> tuple[faults.Fault, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        fault = faults.scan(dashboard)
        if fault is not None:
            return fault, time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"no fault seen in {timeout_s} s")


def test_a_killed_rank_is_named_with_its_node_and_phase(two_nodes):
    _, dashboard = two_nodes
    assert faults.scan(dashboard) is None
    ranks = workers("kill", "head", first_rank=0)
    pids = ray.get([w.pid.remote() for w in ranks])
    for w in ranks:
        w.actor_rollout_ref_update_actor.remote()
    time.sleep(1)
    os.kill(pids[1], signal.SIGKILL)
    fault, after = wait_for_fault(dashboard)
    print(f"killed rank seen after {after:.1f} s")
    assert (fault.ranks, fault.pids, fault.node, fault.node_died) == ((1,), (pids[1],), "127.0.0.1", False)
    assert fault.phase == "update_actor"
    assert fault.message() == f"rank 1 (pid {pids[1]} on 127.0.0.1) died during update_actor"
    os.kill(pids[0], signal.SIGKILL)  # as a peer whose collective failed: it died after rank 1
    time.sleep(2)
    fault = faults.scan(dashboard)
    assert (fault.ranks, fault.after) == ((1,), (0,)), "the rank that died first is the one named"
    assert fault.message().endswith("died during update_actor (then rank(s) 0)")


def test_actors_ended_on_purpose_are_not_faults(two_nodes):
    """A job's end kills its workers (ray.kill, or their owner exits): no rank died."""
    _, dashboard = two_nodes
    before = faults.scan(dashboard)
    ranks = workers("ended", "head", first_rank=0)
    ray.get([w.pid.remote() for w in ranks])
    for w in ranks:
        ray.kill(w)
    time.sleep(2)
    assert faults.scan(dashboard, ignore=_ids(before)) is None


def test_a_removed_node_is_named_with_its_ranks_within_the_health_check(two_nodes):
    c, dashboard = two_nodes
    before = faults.scan(dashboard)
    ranks = workers("node", "second", first_rank=2)
    pids = ray.get([w.pid.remote() for w in ranks])
    start = time.monotonic()
    c.remove_node(c.list_all_nodes()[1], allow_graceful=False)
    while (fault := faults.scan(dashboard, ignore=_ids(before))) is None:
        assert time.monotonic() - start < 60, "no fault seen in 60 s"
        time.sleep(0.5)
    after = time.monotonic() - start
    print(f"removed node seen after {after:.1f} s")
    assert (fault.ranks, set(fault.pids), fault.node_died) == ((2, 3), set(pids), True)
    assert fault.message() == "node 127.0.0.1 left the cluster with rank(s) 2, 3"
    assert after < 40, "Ray's health check (period 3 s x 5 misses) plus one poll"


def _ids(fault: faults.Fault | None) -> frozenset[str]:
    return fault.actor_ids if fault else frozenset()


def test_phase_is_the_unfinished_worker_method():
    assert faults.phase_of(["WorkerDict.__init__", "WorkerDict.actor_rollout_ref_generate_sequences"]) == \
        "generate_sequences"
    assert faults.phase_of(["WorkerDict.__init__"]) == ""


def test_leftover_processes_of_a_run_are_found_and_stopped(tmp_path):
    marker = f"TENSORBOARD_DIR={tmp_path}/tensorboard"
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM,"
                              " signal.SIG_IGN); time.sleep(600)"], env={**os.environ, "TENSORBOARD_DIR":
                                                                          f"{tmp_path}/tensorboard"})
    try:
        time.sleep(0.5)
        assert faults.run_processes(marker) == [child.pid]
        assert faults.stop_processes([child.pid], grace_s=1) == [child.pid], "SIGTERM ignored: killed"
        child.wait(5)
        assert faults.run_processes(marker) == []
    finally:
        child.kill()


def test_processes_that_exit_by_themselves_are_waited_for_not_killed(tmp_path):
    """Ray's workers leave a moment after their raylet: the launcher waits for them before it kills anything."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"],
                             env={**os.environ, "TENSORBOARD_DIR": f"{tmp_path}/tensorboard"})
    try:
        assert faults.wait_gone(f"TENSORBOARD_DIR={tmp_path}/tensorboard", timeout_s=20) == []
    finally:
        child.kill()
        child.wait()


def test_ray_start_stops_when_the_launcher_is_killed(tmp_path):
    """The launcher SIGKILLed once its head has started: the `ray start --block` it owns gets SIGTERM
    (PR_SET_PDEATHSIG) and takes its daemons down, so nothing runs on without an owner, and a worker node's watch
    sees the head go. It waits for the dashboard's agent, the last daemon up: killed as soon as its GCS answered,
    a CI run kept 13 processes past 60 s (Ray's SIGTERM handler may land before `ray start` knows its daemons)."""
    port, dash, agent, metrics = (free_port() for _ in range(4))
    launcher = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from tools.launch import cluster
        ray = Path(sys.executable).with_name("ray")
        cluster.RayProcess([str(ray), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                            "--port={port}", "--dashboard-port={dash}", "--num-cpus=1",
                            "--dashboard-agent-listen-port={agent}", "--metrics-export-port={metrics}"],
                           Path({str(tmp_path)!r}) / "head.log", {{"TENSORBOARD_DIR": {str(tmp_path)!r}}}).start()
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=str(stack.ROOT),
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        for answering in (port, dash, agent):
            cluster.wait_for_port("127.0.0.1", answering, attempts=60, backoff_s=1, max_backoff_s=2, say=lambda _: None)
        assert faults.run_processes(f"TENSORBOARD_DIR={tmp_path}"), "the head's daemons carry the run's env"
        proc.kill()
        start, why = time.monotonic(), []
        watcher = threading.Thread(target=lambda: why.append(cluster.watch_head("127.0.0.1", port, poll_s=1, misses=3)),
                                   daemon=True)
        watcher.start()
        watcher.join(timeout=30)
        noticed = time.monotonic() - start
        assert why, "the head's Ray still answers 30 s after its launcher was killed"
        left = faults.wait_gone(f"TENSORBOARD_DIR={tmp_path}", timeout_s=60)
        print(f"head gone: worker watch noticed after {noticed:.1f} s; {len(left)} processes left")
        assert "stopped answering" in why[0] and noticed < 30
        assert left == [], f"still running 60 s after the launcher was killed: {_commands(left)}"
    finally:
        proc.kill()
        faults.stop_processes(faults.run_processes(f"TENSORBOARD_DIR={tmp_path}"))


def _commands(pids: list[int]) -> list[str]:
    """Each PID's command line, cut short, for a failure message."""
    found = []
    for pid in pids:
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            continue
    return found


def test_a_job_waiting_on_a_dead_rank_is_stopped(two_nodes, tmp_path):
    """The trainer would wait in a collective until its timeout: the watch stops the job within a poll."""
    _, dashboard = two_nodes
    before = faults.scan(dashboard)
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent("""
        import os, time, ray
        ray.init()

        @ray.remote(num_cpus=0)
        class WorkerDict:
            def pid(self):
                return os.getpid()

        ranks = [WorkerDict.options(name=f"jobWorkerDict_0:{i}", runtime_env={"env_vars": {"RANK": str(i)}},
                                    lifetime=None).remote() for i in range(2)]
        print("pids", *ray.get([w.pid.remote() for w in ranks]), flush=True)
        time.sleep(600)  # as ranks blocked in a collective with a dead peer
    """))
    seen: list[faults.Fault] = []

    def watch():
        fault = faults.scan(dashboard, ignore=_ids(before))
        if fault:
            seen.append(fault)
        return fault

    def kill_a_rank(line: str) -> None:
        if line.startswith("pids "):
            os.kill(int(line.split()[2]), signal.SIGKILL)

    start = time.monotonic()
    status = cluster.run_job(dashboard, f"{sys.executable} {script}", "hung-job", {}, tmp_path / "trainer.log",
                             echo=kill_a_rank, timeout_s=120, watch=watch, watch_every_s=1.0)
    took = time.monotonic() - start
    print(f"hung job stopped after {took:.1f} s")
    assert status == "STOPPED" and seen and seen[0].ranks == (1,)
    assert took < 60


def test_a_failed_trainer_is_reported_by_its_last_error_line(tmp_path):
    """A full disk fails the save in a worker: the launcher's message carries the error, not just "failed"."""
    log = tmp_path / "trainer.log"
    log.write_text("Traceback (most recent call last):\n"
                   "ray.exceptions.RayTaskError(OSError): ray::WorkerDict.actor_rollout_ref_save_checkpoint()\n"
                   "(WorkerDict pid=7) OSError: [Errno 28] No space left on device\n")
    assert run.last_error(log) == "OSError: [Errno 28] No space left on device"
    assert run.last_error(tmp_path / "absent.log") is None


def test_a_full_checkpoint_disk_is_named_with_the_room_left(tmp_path, monkeypatch):
    """A save cut off by a full disk shows in a rank as "unexpected pos" or a crash: the launcher looks at the disk."""
    import shutil

    ckpt = tmp_path / "checkpoints" / "run"  # not made yet: the nearest existing parent's filesystem is asked
    free = shutil.disk_usage(tmp_path).free
    assert run.disk_full(ckpt, checkpoint_bytes=free // 2) is None
    message = run.disk_full(ckpt, checkpoint_bytes=free * 2)
    assert message.startswith(f"The checkpoint filesystem is full: {ckpt} has ") and "free space there" in message
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(40_000_000, 39_990_000, 10_000))
    assert run.disk_full(ckpt, 25_700_000) == (
        f"The checkpoint filesystem is full: {ckpt} has 0.0 MB free of 40.0 MB, one checkpoint takes 25.7 MB:"
        " free space there before continuing")


def test_a_rank_fault_becomes_its_nodes_once_ray_declares_the_node_dead():
    """A node's ranks are seen dead before the node (its health check needs 5 misses of 3 s): the final verdict
    waits for that, and a rank whose node lives stays a rank fault."""
    rank = faults.Fault((2,), "10.0.0.3", (4711,), "generate_sequences", False, after=(3,))
    node = faults.Fault((2, 3), "10.0.0.3", (4711, 4712), "generate_sequences", True)
    clock = iter(range(100)).__next__  # one second per call
    scans = iter([rank, None, node])
    assert faults.settle(lambda: next(scans), rank, timeout_s=20, sleep=lambda _: None, clock=clock) is node
    clock = iter(range(100)).__next__
    assert faults.settle(lambda: rank, rank, timeout_s=20, sleep=lambda _: None, clock=clock) is rank
    assert faults.settle(lambda: pytest.fail("a node fault is final"), node) is node


def test_the_wait_for_a_node_verdict_counts_from_when_its_ranks_were_seen_dead():
    """Stopping the job takes seconds of Ray's health-check window: they count, the window does not restart."""
    rank = faults.Fault((2,), "10.0.0.3", (4711,), "generate_sequences", False, seen_at=100.0)
    scans = []
    clock = iter(range(112, 200)).__next__  # the job stopped 12 s after the fault was seen
    assert faults.settle(lambda: scans.append(1), rank, timeout_s=20, sleep=lambda _: None, clock=clock) is rank
    assert len(scans) == 8


def test_a_lost_nodes_workers_recorded_as_owner_died_still_name_the_node(monkeypatch):
    """As Ray answered in the e2e node test: ranks 2, 3 crashed when their peers went (WORKER_DIED); ranks 0, 1, on
    the killed node, were recorded OWNER_DIED once the job was stopped, before the health check declared the node
    dead. Until then the fault is rank 2's; after it, the node's."""
    import ray.util.state as state

    def actor(rank, node, reason, pid):
        return SimpleNamespace(name=f"abcWorkerDict_{rank // 2}:{rank % 2}", actor_id=f"a{rank}", node_id=node,
                               pid=pid, serialized_runtime_env=json.dumps({"env_vars": {"RANK": str(rank)}}),
                               death_cause={"actor_died_error_context": {"reason": reason}})

    actors = [actor(0, "worker", "OWNER_DIED", 10), actor(1, "worker", "OWNER_DIED", 11),
              actor(2, "head", "WORKER_DIED", 12), actor(3, "head", "WORKER_DIED", 13)]
    nodes = {"head": SimpleNamespace(node_id="head", node_ip="10.0.0.2"),
             "worker": SimpleNamespace(node_id="worker", node_ip="10.0.0.3")}
    dead_nodes: list[str] = []

    def list_nodes(filters, **_):
        (key, _, value), = filters
        return [n for n in nodes.values() if (n.node_id in dead_nodes if key == "state" else n.node_id == value)]

    monkeypatch.setattr(state, "list_nodes", list_nodes)
    monkeypatch.setattr(state, "list_actors", lambda **_: actors)
    monkeypatch.setattr(state, "list_tasks", lambda **_: [])
    assert faults.scan("http://fake").message() == "rank 2 (pid 12 on 10.0.0.2) died (then rank(s) 3)"
    dead_nodes.append("worker")
    fault = faults.scan("http://fake")
    assert fault.message() == "node 10.0.0.3 left the cluster with rank(s) 0, 1 (then rank(s) 2, 3)"
    assert fault.node_died and fault.pids == (10, 11)
