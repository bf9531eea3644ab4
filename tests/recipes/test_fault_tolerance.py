"""Faults on the A3 path at small scale (cpu-tiny.yaml, 4 ranks), made by killing things, and the resume after each.

In CI, one run is cut and finished by resuming, and compared with the same run made straight through:
1. a rank is stopped (SIGSTOP) once the checkpoint of step 2 has begun, then killed: the save never completes;
2. the printed --resume command continues from step 1, sets the cut save aside, and finishes steps 2 and 3.
The launcher must name the dead rank and the phase, exit 2, leave no process of the run, and print the command that
continues it. The finished run must equal the straight one step by step.

More runs, marked `long` (beyond CI's time; `pytest -m long` runs them), are cut and finished the same way:
- "mid": a rank killed mid-step 2, in the rollout, and the run resumed from step 1;
- "disk": checkpoints on a tmpfs that holds one checkpoint: the save of step 2 fills it; after the disk is made
  larger the resume is cut by SIGKILL to the head's launcher itself mid-step 3 (every process of the run must exit
  by itself), and a second resume finishes (or, when the headless run still saved step 3 before it exited, ends
  at once with nothing left to train);
- "node": two Ray nodes on this machine (the launcher's head and a worker node started as a worker launcher starts
  it); the worker node is killed mid-step 2, and a resume with a new worker node finishes.
Without the model, a rank killed mid-step, a lost node and a killed launcher are also tested in
tests/launch/test_faults.py, on a real Ray cluster.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.recipes.conftest import CHECKPOINTED, MEGATRON_STEPS
from tests.recipes.smoke_run import ROOT, smoke_command
from tools.launch import faults, resume
from tools.report import summary

pytestmark = pytest.mark.slow
STEPS = MEGATRON_STEPS
# the straight run's sizes (conftest.megatron_run): no validation, a checkpoint after every step; the config's own
# reward, which scores as the straight run's counting one does
OVERRIDES = CHECKPOINTED
# every logged loss, reward, advantage, length and KL of a step; timings, memory and sync byte counts vary
COMPARED = ("actor/", "critic/", "response_length/", "prompt_length/", "rollout_corr/")
PEERS = r"( \(then rank\(s\) [\d, ]+\))?: stopping the job"  # the ranks whose collectives failed after it
RESUME = re.compile(r"^  (\S+ -m tools\.launch .* --resume \S+)$", re.M)


def rank_pids(dashboard: str) -> dict[int, int]:
    """RANK -> pid of the alive verl workers (the state API, as the launcher's watch reads them)."""
    from ray.util.state import list_actors

    alive = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000,
                        raise_on_missing_output=False)
    return {faults._rank(a): a.pid for a in alive if a.name and faults.WORKER.search(a.name)}


def _ranks_up(dashboard: str) -> dict[int, int]:
    try:
        return rank_pids(dashboard)
    except Exception:  # noqa: BLE001 - the dashboard is not up yet
        return {}


def dashboard_of(cmd: list[str]) -> str:
    return "http://127.0.0.1:" + next(a for a in cmd if a.startswith("launch.ray.dashboard_port=")).split("=")[1]


def run_with_fault(cmd: list[str], dashboard: str, when, fault, timeout_s: float = 1500, on_start=None) -> dict:
    """Start `cmd` (on_start(proc) after), call fault(pids) once when() holds, and wait for the launcher to exit."""
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if on_start is not None:
        on_start(proc)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stdout), daemon=True)
    reader.start()
    injected, pids = None, {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if len(pids) < 4:  # the state API takes a second: ask it before the moment to strike, not at it
            pids = _ranks_up(dashboard)
            time.sleep(1)
        elif injected is None and when():
            injected = fault(pids)
        else:
            time.sleep(0.01)
    ran_past = proc.poll() is None
    if ran_past:
        proc.kill()
    reader.join(10)
    faulted = [t for t, line in lines if line.startswith("fault: ")]
    run_dir = (Path(cmd[cmd.index("--resume") + 1]) if "--resume" in cmd
               else Path(cmd[cmd.index("--logs") + 1]) / cmd[cmd.index("--run-id") + 1])
    if run_dir.is_dir():  # the launcher's output, kept with the run for the reader of a failing test
        (run_dir / f"launcher-{int(started)}.out").write_text("".join(line for _, line in lines))
    if ran_past:
        pytest.fail(f"{cmd} ran past {timeout_s} s; its output is in {run_dir}")
    return {"rc": proc.returncode, "out": "".join(line for _, line in lines), "injected": injected, "lines": lines,
            "started": started, "fault_seen_at": faulted[0] if faulted else None, "ended": time.time()}


def left_of(run_dir: Path) -> list[int]:
    return faults.run_processes(f"TENSORBOARD_DIR={run_dir / 'tensorboard'}")


def scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    return {s.step: {k: v for k, v in s.values.items() if k.startswith(COMPARED)}
            for s in summary.read_steps(run_dir / "tensorboard")}


@pytest.fixture(scope="module")
def straight(megatron_run):
    """The run made straight through, which tests/recipes/test_smoke.py checks too."""
    run = megatron_run
    assert run["proc"].returncode == 0, run["proc"].stdout[-3000:] + run["proc"].stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def cut_save(fault_logs, smoke_work, straight):
    """Rank 2 stopped while the checkpoint of step 2 is written, then killed."""
    cmd = smoke_command("megatron", STEPS, smoke_work, fault_logs, *OVERRIDES, run_id="cut")
    ckpt = fault_logs / "cut" / "checkpoints"

    def stop_then_kill(pids):
        os.kill(pids[2], signal.SIGSTOP)
        time.sleep(2)  # the other ranks wait in the save's barrier; the tracker cannot name step 2
        seen = resume.tracked_step(ckpt)
        os.kill(pids[2], signal.SIGKILL)
        return {"pid": pids[2], "tracked_while_stopped": seen, "killed_at": time.time()}

    return run_with_fault(cmd, dashboard_of(cmd), lambda: (ckpt / "global_step_2").is_dir(), stop_then_kill)


def resume_command(run: dict) -> list[str]:
    found = RESUME.findall(run["out"])
    assert len(found) == 1, run["out"][-3000:]
    return shlex.split(found[0])


def resumed_to_the_end(run: dict) -> dict:
    """The command `run` printed, run again with no fault."""
    cmd = resume_command(run)
    return run_with_fault(cmd, dashboard_of(cmd), lambda: False, lambda pids: None)


@pytest.fixture(scope="module")
def finished(cut_save):
    """The cut run resumed with the printed command: from step 1, to its end."""
    return resumed_to_the_end(cut_save)


def test_a_rank_killed_during_a_save_leaves_the_last_complete_checkpoint(cut_save, fault_logs):
    out, injected = cut_save["out"], cut_save["injected"]
    assert injected and injected["tracked_while_stopped"] == 1, \
        f"the kill must land inside the save of step 2 ({injected})"
    assert cut_save["rc"] == 2, out[-3000:]
    seen = re.search(r"fault: rank 2 \(pid (\d+) on \S+\) died during save_checkpoint" + PEERS, out)
    assert seen and int(seen.group(1)) == injected["pid"], out[-3000:]
    assert "Last complete checkpoint: step 1 (" in out, out[-3000:]
    ckpt = fault_logs / "cut" / "checkpoints"
    assert resume.tracked_step(ckpt) == 1 and (ckpt / "global_step_2").is_dir(), "the cut save stays, untracked"
    assert "processes of the run left after Ray stopped: 0" in out, out[-3000:]
    assert left_of(fault_logs / "cut") == []


def test_the_resume_sets_the_cut_save_aside_and_equals_the_straight_run(finished, straight, fault_logs):
    out = finished["out"]
    ckpt = fault_logs / "cut" / "checkpoints"
    assert "resume: continues cut from step 1 (" in out
    assert f"note: global_step_2.partial: a save that did not complete, set aside for inspection ({ckpt}" in out
    assert (ckpt / "global_step_2.partial").is_dir()
    assert finished["rc"] == 0, out[-3000:]
    assert resume.tracked_step(ckpt) == 3 and left_of(fault_logs / "cut") == []
    assert_same_steps(fault_logs / "cut", straight["run_dir"])


def assert_same_steps(resumed: Path, straight: Path) -> None:
    got, want = scalars(resumed), scalars(straight)
    assert sorted(got) == sorted(want) == [1, 2, 3], "one TensorBoard run: steps 1-3, none repeated or skipped"
    differ = {(step, key): (got[step].get(key), value) for step in want for key, value in want[step].items()
              if got[step].get(key) != value}
    compared = sum(len(v) for v in want.values())
    print(f"resumed vs straight: {compared} metrics over {len(want)} steps, {len(differ)} differ")
    assert compared > 60 and not differ, json.dumps({f"{s}:{k}": v for (s, k), v in differ.items()}, indent=1)


def assert_seen_within_a_watch_period(run: dict) -> None:
    """The launcher asks Ray every 5 s: a dead rank is named within that (plus the state API's answer)."""
    seen = run["fault_seen_at"] - run["injected"]["killed_at"]
    ended = run["ended"] - run["injected"]["killed_at"]
    print(f"fault named {seen:.1f} s after the kill; launcher exited after {ended:.1f} s")
    assert seen < 15 and ended < 120


def test_a_fault_is_seen_within_a_watch_period_and_the_run_stops_soon_after(cut_save):
    assert_seen_within_a_watch_period(cut_save)


# --- long: a rank killed mid-step, a full disk, the head's launcher killed, a worker node lost ---------------------

@pytest.fixture(scope="module")
def killed_mid_step(fault_logs, smoke_work, straight):
    """Rank 1 killed once step 1 is logged, i.e. in step 2's rollout."""
    cmd = smoke_command("megatron", STEPS, smoke_work, fault_logs, *OVERRIDES, run_id="mid")
    log = fault_logs / "mid" / "trainer.log"

    def kill(pids):
        os.kill(pids[1], signal.SIGKILL)
        return {"pid": pids[1], "killed_at": time.time()}

    return run_with_fault(cmd, dashboard_of(cmd), lambda: log.is_file() and "step:1 -" in log.read_text(), kill)


@pytest.fixture(scope="module")
def mid_finished(killed_mid_step):
    return resumed_to_the_end(killed_mid_step)


@pytest.mark.long
def test_a_rank_killed_mid_step_is_named_with_its_phase(killed_mid_step, fault_logs):
    out = killed_mid_step["out"]
    assert killed_mid_step["rc"] == 2, out[-3000:]
    pid = killed_mid_step["injected"]["pid"]
    assert re.search(rf"fault: rank 1 \(pid {pid} on \S+\) died during generate_sequences(_cached)?" + PEERS, out)
    assert "Last complete checkpoint: step 1 (" in out and resume.tracked_step(fault_logs / "mid" / "checkpoints") == 1
    assert "processes of the run left after Ray stopped: 0" in out and left_of(fault_logs / "mid") == []
    assert_seen_within_a_watch_period(killed_mid_step)


@pytest.mark.long
def test_the_run_resumed_after_a_mid_step_kill_equals_the_straight_run(mid_finished, straight, fault_logs):
    assert mid_finished["rc"] == 0, mid_finished["out"][-3000:]
    assert "resume: continues mid from step 1 (" in mid_finished["out"]
    assert_same_steps(fault_logs / "mid", straight["run_dir"])


DISK_MB, BIGGER_MB = 40, 200  # one cpu-tiny checkpoint is 26 MB: the first fits, the second does not
HEAD_GONE_S = 60  # the bound for the run's processes to exit once the head's launcher is killed
TWO_NODES = ("launch.nodes=2", "launch.devices_per_node=2", "launch.ray.join_timeout_s=600")


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    where = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"a full disk is made with a tmpfs, which needs root: {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "--lazy", str(where)], check=False)


@pytest.fixture(scope="module")
def disk_full(fault_logs, smoke_work, small_disk, straight):
    cmd = smoke_command("megatron", STEPS, smoke_work, fault_logs, *OVERRIDES, f"recipe.checkpoints.dir={small_disk}",
                        "trainer.max_actor_ckpt_to_keep=1", run_id="disk")
    return run_with_fault(cmd, dashboard_of(cmd), lambda: False, lambda pids: None)


@pytest.fixture(scope="module")
def head_killed(fault_logs, small_disk, disk_full):
    """The disk made larger, the printed command run, and its launcher SIGKILLed once step 2 is logged."""
    subprocess.run(["mount", "-o", f"remount,size={BIGGER_MB}m", str(small_disk)], check=True)
    cmd = resume_command(disk_full)
    log = fault_logs / "disk" / "trainer.log"
    since = log.stat().st_size
    launcher: dict = {}

    def kill_the_launcher(pids):
        os.kill(launcher["pid"], signal.SIGKILL)
        return {"killed_at": time.time()}

    run = run_with_fault(cmd, dashboard_of(cmd), lambda: "step:2 -" in log.read_text()[since:], kill_the_launcher,
                         on_start=lambda proc: launcher.update(pid=proc.pid))
    deadline = time.monotonic() + HEAD_GONE_S
    while (left := left_of(fault_logs / "disk")) and time.monotonic() < deadline:
        time.sleep(0.5)
    run["left"], run["gone_after"] = left, time.time() - run["injected"]["killed_at"]
    faults.stop_processes(left)  # should the test fail, the next one must not find them
    # the run goes on for seconds without its launcher: it may finish step 3 and save it before its processes exit
    run["tracked"] = resume.tracked_step(small_disk / "disk")
    return run


@pytest.fixture(scope="module")
def disk_finished(disk_full, head_killed):
    return resumed_to_the_end(disk_full)  # what the user runs again: the launcher that was killed printed nothing


@pytest.mark.long
def test_a_full_disk_fails_the_run_with_the_error_and_leaves_the_last_checkpoint(disk_full, small_disk):
    out = disk_full["out"]
    assert disk_full["rc"] == 2, out[-3000:]
    assert "The checkpoint filesystem is full: " in out and "Last complete checkpoint: step 1 (" in out, out[-3000:]
    assert resume.tracked_step(small_disk / "disk") == 1, "the tracker never names the save the disk cut off"
    assert "processes of the run left after Ray stopped: 0" in out


@pytest.mark.long
def test_the_run_ends_by_itself_when_the_head_launcher_is_killed(head_killed, fault_logs):
    out = head_killed["out"]
    assert "resume: continues disk from step 1 (" in out and "set aside for inspection" in out
    assert head_killed["rc"] == -signal.SIGKILL
    print(f"head's launcher killed: the run's processes were gone after {head_killed['gone_after']:.1f} s")
    assert head_killed["left"] == [], f"still running {HEAD_GONE_S} s after the launcher was killed"


@pytest.mark.long
def test_the_run_resumed_after_the_disk_and_head_faults_equals_the_straight_run(disk_finished, head_killed, straight,
                                                                               fault_logs):
    out, tracked = disk_finished["out"], head_killed["tracked"]
    assert disk_finished["rc"] == 0, out[-3000:]
    assert tracked in (2, 3) and f"resume: continues disk from step {tracked} (" in out, out[-3000:]
    # resumed from the last step's checkpoint, the trainer must end without a step past the run's end
    assert ("Resumed at step 3 of 3: the run is complete" in out) == (tracked == 3), out[-3000:]
    assert_same_steps(fault_logs / "disk", straight["run_dir"])


def worker_node(cmd: list[str], log: Path) -> subprocess.Popen:
    """The worker node's `ray start`, as `python -m tools.launch` on a second node runs it (plan.worker_command),
    with ports of its own beside the head's on this one machine, started once the head answers."""
    from tests.gloo import free_port
    from tools.launch import cluster, config, plan

    port = int(next(a for a in cmd if a.startswith("launch.ray.port=")).split("=")[1])
    lay = config.load(ROOT / "recipes/deepseek_r1/configs/cpu-tiny.yaml", list(TWO_NODES)).layout
    extra = (f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cluster.wait_for_port("127.0.0.1", port, attempts=600, backoff_s=1, max_backoff_s=1, say=lambda _: None)
    return subprocess.Popen(plan.worker_command(lay, "127.0.0.1", port, ray_bin, extra), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": cluster.ray_auth_mode()})


def with_worker_node(cmd: list[str], log: Path, nodes: list) -> None:
    threading.Thread(target=lambda: nodes.append(worker_node(cmd, log)), daemon=True).start()


@pytest.fixture(scope="module")
def node_lost(fault_logs, smoke_work, straight):
    """Two nodes; the worker node's every process SIGKILLed once step 1 is logged (mid-step 2)."""
    cmd = smoke_command("megatron", STEPS, smoke_work, fault_logs, *OVERRIDES, *TWO_NODES, run_id="node")
    nodes: list[subprocess.Popen] = []
    with_worker_node(cmd, fault_logs / "worker-node.log", nodes)
    log = fault_logs / "node" / "trainer.log"

    def kill_the_node(pids):
        ip, ranks = ranks_off_the_head(dashboard_of(cmd))
        os.killpg(nodes[0].pid, signal.SIGKILL)  # `ray start`, the raylet and the daemons it started
        return {"killed_at": time.time(), "ip": ip, "ranks": ranks}

    try:
        return run_with_fault(cmd, dashboard_of(cmd), lambda: log.is_file() and "step:1 -" in log.read_text(),
                              kill_the_node)
    finally:
        for node in nodes:
            node.kill()


def ranks_off_the_head(dashboard: str) -> tuple[str, list[int]]:
    """The worker node's IP and the ranks whose worker actor lives there (verl places one pool per node)."""
    from ray.util.state import list_actors, list_nodes

    (other,) = list_nodes(address=dashboard, filters=[("is_head_node", "=", False)], raise_on_missing_output=False)
    alive = list_actors(address=dashboard, filters=[("state", "=", "ALIVE"), ("node_id", "=", other.node_id)],
                        detail=True, limit=1000, raise_on_missing_output=False)
    return other.node_ip, sorted(faults._rank(a) for a in alive if a.name and faults.WORKER.search(a.name))


@pytest.fixture(scope="module")
def node_finished(fault_logs, node_lost):
    cmd = resume_command(node_lost)
    nodes: list[subprocess.Popen] = []
    with_worker_node(cmd, fault_logs / "worker-node.log", nodes)
    try:
        return run_with_fault(cmd, dashboard_of(cmd), lambda: False, lambda pids: None)
    finally:
        for node in nodes:
            node.terminate()
            node.wait(60)


@pytest.mark.long
def test_a_lost_worker_node_is_named_with_its_ranks(node_lost, fault_logs):
    out, injected = node_lost["out"], node_lost["injected"]
    assert injected and len(injected["ranks"]) == 2, "the worker node holds two ranks"
    assert node_lost["rc"] == 2, out[-3000:]
    node = f"node {injected['ip']} left the cluster with rank(s) {', '.join(map(str, injected['ranks']))}"
    # its ranks are seen dead first (the job is stopped then); the verdict waits for Ray to declare the node dead
    assert f"fault: {node}" in out and f"error: {node}" in out, out[-3000:]
    assert "Last complete checkpoint: step 1 (" in out and " --master-addr 127.0.0.1 --resume " in out
    seen = node_lost["fault_seen_at"] - injected["killed_at"]
    named = next(t for t, line in node_lost["lines"] if line.startswith(f"fault: {node}")) - injected["killed_at"]
    print(f"lost node: its ranks seen dead {seen:.1f} s, the node named {named:.1f} s after its processes were killed")
    assert seen < 15 and named < 40, "a watch period; Ray's health check (period 3 s x 5 misses) plus the polls"
    assert "processes of the run left after Ray stopped: 0" in out and left_of(fault_logs / "node") == []


@pytest.mark.long
def test_the_run_resumed_after_a_lost_node_equals_the_straight_run(node_finished, straight, fault_logs):
    assert node_finished["rc"] == 0, node_finished["out"][-3000:]
    assert "resume: continues node from step 1 (" in node_finished["out"]
    assert_same_steps(fault_logs / "node", straight["run_dir"])
