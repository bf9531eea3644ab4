"""Head/worker logic on a real local Ray cluster (ray.cluster_utils.Cluster): three fake nodes with NPU=2.

One module-scoped cluster (Ray start-up takes seconds here); its head runs the dashboard so the job goes
through the Ray Jobs API exactly as the real head submits the trainer. Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests import stack

ray = stack.require("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.gloo import free_port  # noqa: E402
from tests.launch.conftest import CONFIGS  # noqa: E402
from tools.launch import cluster, config, env, run  # noqa: E402

NODE = {"num_cpus": 1, "resources": {"NPU": 2}, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def three_nodes():
    # RAY_AUTH_MODE is the session's one mode (tests/conftest.py), for this cluster and its clients alike.
    dash = free_port()
    c = Cluster(initialize_head=True, head_node_args={**NODE, "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": True, "dashboard_host": "127.0.0.1",
                                                      "dashboard_port": dash})
    for _ in range(2):
        c.add_node(**NODE, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    yield c, f"http://127.0.0.1:{dash}"
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def test_wait_succeeds_when_all_nodes_joined(three_nodes):
    c, _ = three_nodes
    msg = cluster.wait_for_nodes(c.address, 3, "NPU", 2, timeout_s=30, say=lambda _: None)
    assert msg == "3 of 3 nodes joined"
    assert not ray.is_initialized(), "the wait leaves no driver connected"


def test_wait_times_out_naming_what_is_missing(three_nodes):
    c, _ = three_nodes
    start = time.monotonic()
    with pytest.raises(cluster.ClusterError) as exc:
        cluster.wait_for_nodes(c.address, 4, "NPU", 2, timeout_s=1.5, poll_s=0.5, say=lambda _: None,
                               expected_hosts=("127.0.0.1", "10.9.9.9"))
    text = str(exc.value)
    assert "3 of 4 nodes joined with NPU >= 2" in text and "missing 1 node(s): 10.9.9.9" in text
    assert time.monotonic() - start < 15
    with pytest.raises(cluster.ClusterError, match="too few devices on"):
        cluster.wait_for_nodes(c.address, 3, "NPU", 4, timeout_s=0.5, poll_s=0.5, say=lambda _: None)


def test_the_wait_retries_until_the_cluster_takes_a_client(three_nodes, monkeypatch):
    # A loaded machine answers on the head's GCS port before its raylet registers; ray.init then gives up.
    c, _ = three_nodes
    real_init, refusals = ray.init, [ConnectionError("no raylet yet")] * 2

    def init_after_refusals(**kwargs):
        if refusals:
            raise refusals.pop()
        return real_init(**kwargs)

    monkeypatch.setattr(ray, "init", init_after_refusals)
    said: list[str] = []
    msg = cluster.wait_for_nodes(c.address, 3, "NPU", 2, timeout_s=30, poll_s=0.1, say=said.append)
    assert msg == "3 of 3 nodes joined"
    assert [line for line in said if "takes no client yet (no raylet yet)" in line] and len(said) == 3


@pytest.mark.parametrize("said, error", [
    ("raylet: bind failed", cluster.ClusterError),
    (f"Exception: {cluster.SLOW_START}. This could happen because ...", cluster.SlowStart),
])
def test_a_dead_head_ends_the_wait_at_once_with_its_log(tmp_path, monkeypatch, said, error):
    head = cluster.RayProcess(["sh", "-c", f"echo '{said}'; exit 3"], tmp_path / "head.log").start()
    head.proc.wait(10)

    def refuse(**kwargs):
        raise ConnectionError("no raylet")

    monkeypatch.setattr(ray, "init", refuse)
    start = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=r"exited \(3\)(.|\n)*" + re.escape(said)) as raised:
        cluster.wait_for_nodes("127.0.0.1:1", 1, None, 1, timeout_s=60, poll_s=0.1, say=lambda _: None, head=head)
    assert type(raised.value) is error, "only Ray's own start timeout is worth a second start"
    with pytest.raises(error):  # before its port ever answered
        cluster.wait_for_port("127.0.0.1", free_port(), attempts=60, sleep=lambda _: None, say=lambda _: None,
                              head=head)
    assert time.monotonic() - start < 10


def test_a_dead_heads_error_ends_with_its_raylet_and_gcs_logs(tmp_path):
    """The session Ray names after the pid of `ray start`, as the fake head makes it here: the error says whether
    the raylet was slow or dead."""
    make_session = ('logs="$RAY_TMPDIR/ray/session_2026-12-06_10-00-00_000001_$$/logs"; mkdir -p "$logs";'
                    ' echo "raylet: waiting for the GCS" > "$logs/raylet.out";'
                    ' echo "gcs: overloaded" > "$logs/gcs_server.out"; echo "ray start: gave up"; exit 1')
    head = cluster.RayProcess(["sh", "-c", make_session], tmp_path / "head.log", {"RAY_TMPDIR": str(tmp_path)})
    head.start().proc.wait(10)
    assert cluster.session_logs(head).parent.name.endswith(f"_{head.proc.pid}")
    with pytest.raises(cluster.ClusterError) as raised:
        cluster.check_alive(head)
    said = str(raised.value)
    assert "ray start: gave up" in said
    assert "gcs_server.out:\n  gcs: overloaded" in said and "raylet.out:\n  raylet: waiting for the GCS" in said


def test_dummy_job_runs_through_the_jobs_api_and_its_log_is_collected(three_nodes, tmp_path):
    _, dashboard = three_nodes
    script = tmp_path / "trainer.py"
    script.write_text("import os, ray\nray.init()\n"
                      "print('dummy trainer on', len(ray.nodes()), 'nodes, NPU', ray.cluster_resources()['NPU'])\n"
                      "print('env', os.environ['RECIPE_MARK'])\n")
    lines: list[str] = []
    status = cluster.run_job(dashboard, f"{sys.executable} {script}", "dummy-ok", {"RECIPE_MARK": "a3"},
                             tmp_path / "trainer.log", echo=lines.append, timeout_s=90)
    log = (tmp_path / "trainer.log").read_text()
    assert status == "SUCCEEDED", log
    assert "dummy trainer on 3 nodes, NPU 6.0" in log and "env a3" in log
    assert any("dummy trainer" in line for line in lines)
    failing = cluster.run_job(dashboard, f"{sys.executable} -c 'raise SystemExit(3)'", "dummy-fail", {},
                              tmp_path / "fail.log", echo=None, timeout_s=90)
    assert failing == "FAILED"


def _prepared(tmp_path: Path, port: int) -> run.Prepared:
    """cpu-tiny's run on this machine, its head on `port`."""
    dash, agent, metrics = (free_port() for _ in range(3))
    # a second Ray on this machine: its agent and metrics need ports of their own
    extra = f"[--dashboard-agent-listen-port={agent},--metrics-export-port={metrics}]"
    recipe = config.load(CONFIGS / "cpu-tiny.yaml", ["launch.accelerator=a3", f"launch.ray.port={port}",
                                                    f"launch.ray.dashboard_port={dash}", "launch.ray.join_timeout_s=60",
                                                    f"launch.ray.extra_start_args={extra}"])
    facts = env.NodeFacts("127.0.0.1", "lo", "127.0.0.1", True, None)
    return run.prepare(recipe, facts, "dummy-run", tmp_path / "logs",
                       ray_bin=str(Path(sys.executable).with_name("ray")), device_gb=64.0)


@pytest.mark.parametrize("nodes, starts", [(1, run.HEAD_STARTS), (2, 1)])
def test_a_head_that_ray_gives_up_on_is_started_again_only_on_one_node(tmp_path, nodes, starts):
    """On more nodes the workers joined the failed head's GCS and leave with it: one start, and the error at once."""
    prepared = _prepared(tmp_path, free_port())
    started = tmp_path / "starts"
    always_slow = f'echo >> {started}; echo "Exception: {cluster.SLOW_START}."; exit 1'
    head = replace(prepared.plan.nodes[0], ray_command=("sh", "-c", always_slow))
    pl = replace(prepared.plan, nodes=(head,), layout=replace(prepared.plan.layout, nodes=nodes))
    said: list[str] = []
    with pytest.raises(cluster.SlowStart):
        run.start_head(pl, say=said.append)
    assert len(started.read_text().splitlines()) == starts
    assert sum("gave up on its own start" in line for line in said) == starts - 1


# the first start of the head fails as Ray's does when its raylet registers too late; the next runs the command
SLOW_FIRST_START = (f'if [ ! -e "$0" ]; then touch "$0"; echo "Exception: {cluster.SLOW_START}. This could happen'
                    ' because ..."; exit 1; fi; exec "$@"')


def test_head_runs_the_job_end_to_end_and_stops_only_its_own_ray(three_nodes, tmp_path):
    """run_head as the real run does it (ray start --head --block from the plan, wait, Jobs API, stop), with a
    dummy entrypoint in place of verl's trainer. The module's cluster, which it did not start, stays up. The head's
    first `ray start` gives up on itself as too slow (cluster.SlowStart): the launcher starts it again."""
    c, _ = three_nodes
    port = free_port()
    prepared = _prepared(tmp_path, port)
    script = tmp_path / "trainer.py"
    script.write_text("import ray\nray.init()\nprint('trainer saw NPU', ray.cluster_resources().get('NPU'))\n")
    head, *others = prepared.plan.nodes
    slow = replace(head, ray_command=("sh", "-c", SLOW_FIRST_START, str(tmp_path / "started-once"), *head.ray_command))
    prepared.plan = replace(prepared.plan, trainer_command=(sys.executable, str(script)), nodes=(slow, *others))
    said: list[str] = []
    assert run.run_head(prepared, say=said.append) == run.EXIT_OK, "\n".join(said)
    assert sum("the head's Ray gave up on its own start" in line for line in said) == 1, "\n".join(said)
    log = (prepared.plan.run_dir / "trainer.log").read_text()
    assert "trainer saw NPU 4.0" in log  # cpu-tiny: launch.devices_per_node 4
    assert "job dummy-run: SUCCEEDED" in said and "1 of 1 nodes joined" in said
    assert not cluster.port_open("127.0.0.1", port), "the head's Ray is stopped"
    assert len(_alive(c)) == 3 and all(n.remaining_processes_alive() for n in c.list_all_nodes())


def _alive(c) -> list:
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    try:
        return [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


def test_join_retries_with_backoff_then_names_the_head():
    port = free_port()
    slept: list[float] = []
    with pytest.raises(cluster.ClusterError, match=f"127.0.0.1:{port} did not answer after 4 attempts"):
        cluster.wait_for_port("127.0.0.1", port, attempts=4, backoff_s=1, max_backoff_s=3, sleep=slept.append,
                              say=lambda _: None)
    assert slept == [1, 2, 3]


def test_worker_leaves_when_the_head_stops_answering():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    threading.Timer(0.5, server.close).start()
    start = time.monotonic()
    why = cluster.watch_head("127.0.0.1", port, poll_s=0.2, misses=2)
    assert "stopped answering" in why and time.monotonic() - start < 10


def test_ray_auth_mode_is_one_mode_for_daemons_job_and_client(tmp_path):
    """Ray's `ray start` turns token auth on by itself when ~/.ray/auth_token exists; its clients do not."""
    assert cluster.ray_auth_mode({}, home=tmp_path) == "disabled"
    assert cluster.ray_auth_mode({"RAY_AUTH_TOKEN": "t"}, home=tmp_path) == "token"
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    assert cluster.ray_auth_mode({}, home=tmp_path) == "token"
    assert cluster.ray_auth_mode({"RAY_AUTH_MODE": "disabled"}, home=tmp_path) == "disabled", "the user's choice wins"
