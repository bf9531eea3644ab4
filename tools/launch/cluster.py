"""Ray on the nodes of a run: the `ray start` processes the launcher owns, the wait for every node, the job.

Only processes this module started are ever stopped: each `ray start --block` is a child in its own session;
SIGTERM makes it shut down the daemons it spawned, and a SIGKILL to its own process group follows if it hangs.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ClusterError(Exception):
    """The cluster did not come up or the job could not run; the message says what was missing."""


class SlowStart(ClusterError):
    """`ray start` gave up on its own node: its raylet did not register with the GCS within Ray's 30 s (hard-coded in
    ray/_private/node.py). A loaded machine can cause it, and then a new start can succeed."""


SLOW_START = "The current node timed out during startup"  # what `ray start` prints when it gives up


class RayProcess:
    """One `ray start --block` that this launcher started (head or worker)."""

    def __init__(self, command: tuple[str, ...] | list[str], log_path: Path, env: dict[str, str] | None = None):
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> RayProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_stop_with_parent)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM our child (it stops the Ray daemons it spawned), then SIGKILL its own group if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (even by SIGKILL), so its `ray start --block`
    shuts its daemons down instead of running on without an owner (Linux's PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


@dataclass(frozen=True)
class NodeInfo:
    address: str
    resources: dict[str, float]


def alive_nodes() -> list[NodeInfo]:
    """Alive nodes of the cluster this process is connected to (ray.nodes())."""
    import ray

    return [NodeInfo(n["NodeManagerAddress"], dict(n.get("Resources", {}))) for n in ray.nodes() if n.get("Alive")]


def join_status(nodes: list[NodeInfo], expected: int, resource: str | None, per_node: int,
                expected_hosts: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Whether `expected` nodes with `per_node` of `resource` have joined, and a sentence saying which have not."""
    ready = [n for n in nodes if resource is None or n.resources.get(resource, 0) >= per_node]
    short = [n for n in nodes if n not in ready]
    if len(ready) >= expected:
        return True, f"{len(ready)} of {expected} nodes joined"
    have = ", ".join(f"{n.address} ({resource} {n.resources.get(resource, 0):g})" if resource else n.address
                     for n in ready) or "none"
    msg = f"{len(ready)} of {expected} nodes joined with {resource or 'resources'} >= {per_node}: {have}"
    if short:
        msg += "; too few devices on " + ", ".join(f"{n.address} ({resource} {n.resources.get(resource, 0):g})"
                                                  for n in short)
    joined = {n.address for n in ready}
    missing_hosts = [h for h in expected_hosts if h not in joined]
    msg += f"; missing {expected - len(ready)} node(s)" + (f": {', '.join(missing_hosts)}" if missing_hosts else "")
    return False, msg


def ray_auth_mode(environ=os.environ, home: Path | None = None) -> str:
    """The one Ray auth mode of a run. With RAY_AUTH_MODE unset, Ray's `ray start` turns token auth on when
    ~/.ray/auth_token exists, while a client's ray.init stays disabled and is refused (InvalidAuthToken). The
    launcher therefore sets it for the daemons, the trainer job and itself: the user's RAY_AUTH_MODE when given,
    else token when this machine has a token (every node then needs it), else disabled."""
    if environ.get("RAY_AUTH_MODE"):
        return environ["RAY_AUTH_MODE"]
    token = (home or Path.home()) / ".ray" / "auth_token"
    return "token" if environ.get("RAY_AUTH_TOKEN") or token.is_file() else "disabled"


def wait_for_nodes(address: str, expected: int, resource: str | None, per_node: int, timeout_s: float,
                   poll_s: float = 1.0, expected_hosts: tuple[str, ...] = (),
                   say: Callable[[str], None] = print, head: RayProcess | None = None) -> str:
    """Connect to the cluster at `address` and wait until the nodes joined; ClusterError names what is missing.
    `head`, the head's `ray start` when this process started it: its exit ends the wait at once, with its log."""
    import ray

    deadline = time.monotonic() + timeout_s
    connected_here = not ray.is_initialized()
    if connected_here:
        connect(address, deadline, poll_s, say, head)
    try:
        last = ""
        while True:
            ok, msg = join_status(alive_nodes(), expected, resource, per_node, expected_hosts)
            if ok:
                say(msg)
                return msg
            if msg != last:
                say(f"waiting: {msg}")
                last = msg
            check_alive(head)
            if time.monotonic() >= deadline:
                raise ClusterError(f"timed out after {timeout_s:g} s: {msg}")
            time.sleep(poll_s)
    finally:
        if connected_here:
            ray.shutdown()


def connect(address: str, deadline: float, poll_s: float = 1.0, say: Callable[[str], None] = print,
            head: RayProcess | None = None) -> None:
    """ray.init to `address`, retried until `deadline` (time.monotonic()): the head's GCS port answers before its
    raylet has registered, and on a loaded machine the registration can take longer than ray.init waits."""
    import ray

    while True:
        try:
            ray.init(address=address, log_to_driver=False, namespace="tools.launch", logging_level="ERROR")
            return
        except ConnectionError as exc:
            check_alive(head)
            if time.monotonic() >= deadline:
                raise ClusterError(f"could not connect to the Ray cluster at {address}: {exc.__cause__ or exc}."
                                   f" Is the head's raylet running? Its log is in the head node's <host>.log"
                                   f" and Ray's session logs (raylet.out, gcs_server.out)") from exc
            say(f"waiting: Ray at {address} takes no client yet ({exc.__cause__ or exc})")
            time.sleep(poll_s)


def check_alive(head: RayProcess | None, lines: int = 20) -> None:
    """Raise, with the end of its log and of its daemons' logs, if the head's `ray start` has exited: SlowStart if
    Ray gave up on it."""
    if head is None or head.alive():
        return
    log = _tail(head.log_path, lines)
    error = SlowStart if any(SLOW_START in line for line in log) else ClusterError
    message = f"the head's `ray start` exited ({head.proc.returncode}); the end of {head.log_path}:\n" + _indent(log)
    logs = session_logs(head)
    for name in DAEMON_LOGS if logs else ():
        if (tail := _tail(logs / name, DAEMON_LOG_LINES)):  # whether the raylet was slow or dead, and why
            message += f"\nthe end of {logs / name}:\n" + _indent(tail)
    raise error(message)


DAEMON_LOGS = ("gcs_server.out", "raylet.out", "raylet.err")  # in a Ray session's logs folder; empty ones are left out
DAEMON_LOG_LINES = 10


def session_logs(process: RayProcess) -> Path | None:
    """The logs folder of the Ray session a head's `ray start` made. Ray names it session_<time>_<the pid of
    `ray start`>, under $RAY_TMPDIR, else $TMPDIR, else /tmp, then ray/ (ray._common.utils, Ray 2.x)."""
    env = {**os.environ, **(process.env or {})}
    root = Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp") / "ray"
    found = sorted(root.glob(f"session_*_{process.proc.pid}/logs")) if process.proc else []
    return found[-1] if found else None


def _tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


def _indent(lines: list[str]) -> str:
    return "\n".join(f"  {line}" for line in lines)


def port_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, attempts: int = 30, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                  sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print,
                  head: RayProcess | None = None) -> int:
    """Retry with exponential backoff until host:port answers; the number of attempts it took. `head`, the head's
    `ray start` when this process started it: its exit ends the wait at once, with its log."""
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        if port_open(host, port):
            return attempt
        check_alive(head)
        if attempt < attempts:
            say(f"head {host}:{port} not answering (attempt {attempt}/{attempts}); retrying in {delay:g} s")
            sleep(delay)
            delay = min(max_backoff_s, delay * 2)
    raise ClusterError(f"head {host}:{port} did not answer after {attempts} attempts: is the launcher running on"
                       f" the MASTER_ADDR node, and is port {port} open between the nodes?")


def watch_head(host: str, port: int, process: RayProcess | None = None, poll_s: float = 5.0, misses: int = 3,
               sleep: Callable[[float], None] = time.sleep) -> str:
    """Block while the head's Ray answers; return why the worker should leave (head gone, or our Ray exited)."""
    missed = 0
    while True:
        if process is not None and not process.alive():
            return f"our ray process exited ({process.proc.returncode})"
        missed = 0 if port_open(host, port, timeout_s=min(2.0, poll_s)) else missed + 1
        if missed >= misses:
            return f"head {host}:{port} stopped answering: the job has ended"
        sleep(poll_s)


def _submit(client, entrypoint: str, submission_id: str, env: dict[str, str], wait_s: float = 120.0) -> None:
    """Submit, retrying while the head's job agent is still starting (the dashboard answers before it does)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env})
            return
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise ClusterError(f"could not submit job {submission_id}: {exc}") from exc
            time.sleep(1.0)


def run_job(dashboard_url: str, entrypoint: str, submission_id: str, env: dict[str, str], log_path: Path,
            echo: Callable[[str], None] | None = print, timeout_s: float | None = None,
            watch: Callable[[], object | None] | None = None, watch_every_s: float = 5.0) -> str:
    """Submit `entrypoint` as a Ray job, stream its log to `log_path` (and echo), return its final status.
    `watch`, called every `watch_every_s` while the job runs, returns a fault or None: on a fault the job is stopped
    (its other ranks may otherwise wait in a collective until its timeout)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    _submit(client, entrypoint, submission_id, env)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    async def stream() -> None:
        with open(log_path, "a") as log:
            async for chunk in client.tail_job_logs(submission_id):
                log.write(chunk)
                log.flush()
                if echo:
                    echo(chunk.rstrip("\n"))

    async def watchdog() -> None:
        while watch is not None:
            await asyncio.sleep(watch_every_s)
            if await asyncio.to_thread(watch) is not None:
                if client.get_job_status(submission_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                    client.stop_job(submission_id)
                return

    async def both() -> None:
        guard = asyncio.create_task(watchdog())
        try:
            await stream()
        finally:
            guard.cancel()

    try:
        asyncio.run(asyncio.wait_for(both(), timeout_s))
    except TimeoutError:
        client.stop_job(submission_id)
        raise ClusterError(f"job {submission_id} ran past {timeout_s:g} s; stopped it") from None
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    status = client.get_job_status(submission_id)
    while status not in terminal:  # the log stream can end a moment before the status is final
        time.sleep(0.2)
        status = client.get_job_status(submission_id)
    return str(status.value if hasattr(status, "value") else status)
